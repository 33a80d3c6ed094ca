"""What an execution path needs of an operation: the protocol every collective's op implements.

The three execution paths (:mod:`pccl.collectives.trio_ring`, :mod:`pccl.collectives.inline`,
:mod:`pccl.collectives.threaded`) move frames; they know nothing of what a frame means.  An op
(:class:`~pccl.collectives.ring_op.RingOp` for the all-reduce,
:class:`~pccl.collectives.reduce_scatter.ReduceScatterOp`,
:class:`~pccl.collectives.chain_op.ChainOp` for the all-gather and the broadcast) tells them,
per frame of its schedule, where its payload comes from and goes to, what a received frame costs
to process, which slices of an in-place buffer to save ahead and how much scratch memory its
sends and receives need.

The paths rely on these rules of every schedule (:mod:`pccl.protocol.ring`): a step may move
no frame on a link; frame ``k`` received at step ``s`` is what frame ``k`` sent at step ``s + 1``
is made from; frame ``k`` of every step travels on lane ``k mod lanes``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ..protocol.codec import DataHeader
from ..protocol.ring import Frame, RingSchedule
from .backup import InputBackup
from .buffers import KernelRunner
from .links import RingLinks

__all__ = ["LaneOp"]


class LaneOp(Protocol):
    """One running operation on this peer, as the execution paths drive it.

    Thread safety: :meth:`destination`, :meth:`received` and :meth:`prepare_payload` run in any
    thread (the lane threads), each frame once; the rest on the Trio thread.
    """

    tx_bytes: int
    rx_bytes: int

    @property
    def links(self) -> RingLinks: ...
    @property
    def lanes(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def runner(self) -> KernelRunner: ...
    @property
    def schedule(self) -> RingSchedule: ...
    @property
    def backup(self) -> InputBackup | None: ...
    @property
    def itemsize(self) -> int:
        """Bytes per element of the buffer the frames' offsets are in."""
    @property
    def op_nbytes(self) -> int:
        """The op's size in bytes (which path runs it: :func:`~pccl.collectives.inline.suits_inline`)."""
    @property
    def stage_nbytes(self) -> int:
        """Size of the staging buffer a receiver needs (0: every frame lands where it belongs)."""
    @property
    def send_scratch_nbytes(self) -> int:
        """Size of one send scratch buffer (0: no frame is sent from scratch)."""
    @property
    def max_frame_nbytes(self) -> int:
        """Payload bytes of the op's largest frame."""

    def take(self, nbytes: int) -> np.ndarray:
        """Scratch memory held until the op ends (Trio thread)."""

    def release(self) -> None:
        """Give the op's scratch memory back, once nothing can touch it any more (Trio thread;
        :func:`~pccl.collectives.execute.execute` calls it once the op has stopped)."""

    def moves_nothing(self) -> bool: ...
    def frame_nbytes(self, frame: Frame) -> int: ...
    def header(self, frame: Frame) -> DataHeader: ...

    def sends_from_scratch(self, frame: Frame) -> bool:
        """Whether :meth:`prepare_payload` needs a scratch buffer for ``frame``."""

    def payload_cost(self, frame: Frame) -> int:
        """Bytes of kernel work :meth:`prepare_payload` does for ``frame`` (0: none)."""

    def prepare_payload(self, frame: Frame, scratch: np.ndarray | None) -> np.ndarray:
        """What to send for ``frame``; ``scratch`` when :meth:`sends_from_scratch`."""

    def save_before_receive(self, frame: Frame) -> tuple[int, int] | None:
        """The slice of the in-place buffer to save before ``frame`` is received into it, if
        any (the Trio path saves it through the kernel runner; :meth:`destination` otherwise)."""

    def destination(self, frame: Frame, stage: np.ndarray) -> memoryview:
        """Where ``frame``'s payload is received (saving what it overwrites first)."""

    def receive_cost(self, frame: Frame) -> int:
        """Bytes of kernel work :meth:`received` does for ``frame`` (0: none)."""

    def received(self, frame: Frame, stage: np.ndarray) -> None:
        """Process a frame received into :meth:`destination`."""

    def backup_ahead(self, lane: int) -> list[tuple[int, int]] | None:
        """Slices a lane's sender thread may save while it would otherwise wait, most urgent
        *last* (``None``: nothing is backed up)."""
