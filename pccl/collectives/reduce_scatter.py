"""Ring reduce-scatter: the first half of the all-reduce's ring, on the same lanes and frames.

:func:`reduce_scatter_checked` runs one operation on arguments checked by
:meth:`ReduceArgs.check <pccl.collectives.buffers.ReduceArgs.check>` and returns the payload
bytes it sent and received.

Ownership
---------
The participant at ring position ``i`` of ``n`` owns the slice
``shard_bounds(count, n, i) = chunk_bounds(count, n)[i]`` of the buffer (the first
``count % n`` slices are one element longer).  After success ``dst[start:stop]`` holds the
reduction over every participant of that slice; the rest of ``dst`` is unspecified (partial
sums, or the input).  The plan is :class:`~pccl.protocol.ring.ReduceScatterSchedule`: at step
``s`` position ``r`` sends chunk ``(r - s - 1) mod n`` and receives chunk ``(r - s - 2) mod n``,
so after ``n - 1`` steps it holds chunk ``r``, folded from position ``r + 1`` around the ring and
ending with its own contribution (``acc = x[r+1]; acc = x[r+2] op acc; …; acc = x[r] op acc``).

Design
------
Everything is the all-reduce's reduce-scatter phase (:mod:`pccl.collectives.allreduce`,
:class:`~pccl.collectives.ring_op.RingOp`, of which :class:`ReduceScatterOp` is a variant with
the shifted schedule): the same sub-chunk pipelining, staging pool, execution paths, frame
headers and abort rules; f16/bf16 accumulate in an f32 working array; MIN_MAX quantized frames
are quantized by their sender with fresh per-frame parameters and dequantize-reduced by the
receiver.  There is no all-gather and no exchange: the owner finalises its slice (AVG divides
by the world size, f16/bf16 round once) as soon as the last frame of each of its sub-chunks is
reduced.  In place, every overwritten slice is first saved in the backup — by the fused saving
kernels where the overwrite is a reduction, by a copy before an f16/bf16 slice is rounded into
place; the chunk a peer sends at step 0 is never overwritten.  Out of place (``dst`` separate,
such as a staged scratch array) ``src`` is never written.
"""

from __future__ import annotations

from ..protocol.ring import DEFAULT_SUBCHUNK_BYTES, Frame, ReduceScatterSchedule, RingSchedule, chunk_bounds
from .. import kernels
from ..types import ReduceOp
from .backup import InputBackup
from .buffers import KernelRunner, OpBuffers, ReduceArgs
from .execute import Place, execute
from .links import RingLinks
from .ring_op import RingOp

import numpy as np

__all__ = ["ReduceScatterOp", "reduce_scatter_checked", "reduce_scatter_op", "shard_bounds"]


def shard_bounds(count: int, world: int, rank: int) -> tuple[int, int]:
    """The ``(start, stop)`` element range ring position ``rank`` owns in a reduce-scatter of
    ``count`` elements over ``world`` participants: :func:`~pccl.protocol.ring.chunk_bounds`'s
    ``rank``-th chunk."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside a ring of {world}")
    return chunk_bounds(count, world)[rank]


class ReduceScatterOp(RingOp):
    """The state of one running reduce-scatter on this peer: the all-reduce's reduce-scatter
    phase on :class:`~pccl.protocol.ring.ReduceScatterSchedule`, the owner finalising its slice
    when its last frame is in."""

    def _plan(self, count: int, rank: int, sub: int, breaks: tuple[int, ...],
              exchange_max_bytes: int) -> tuple[bool, RingSchedule]:
        return False, ReduceScatterSchedule(count, self.world, rank, sub, breaks)

    def _make_gather_store(self) -> tuple[np.ndarray | None, dict[tuple[int, int], int]]:
        return None, {}  # nothing is gathered

    def received(self, frame: Frame, stage: np.ndarray) -> None:
        self._reduce_frame(frame, stage[: self.frame_nbytes(frame)])
        if frame.step == self.schedule.num_steps - 1:
            self._finish_owned(frame)

    def receive_cost(self, frame: Frame) -> int:
        return self.frame_nbytes(frame) * (3 if frame.step == self.schedule.num_steps - 1 else 2)

    def _finish_owned(self, frame: Frame) -> None:
        """The owner's last word on a sub-chunk of its slice: AVG division, rounding."""
        bufs = self.bufs
        a, b = frame.start, frame.stop
        acc = bufs.acc[a:b]
        if bufs.op is ReduceOp.AVG:
            kernels.avg_finalize(acc, self.world)
        if bufs.half:
            self._save(a, b)
            kernels.narrow(bufs.dst[a:b], acc)

    def backup_ahead(self, lane: int) -> list[tuple[int, int]] | None:
        """Reductions save their slices themselves (fused); f16/bf16 overwrite only the owned
        slice, when it is rounded into place: that is what a lane's sender may save ahead."""
        if self.backup is None:
            return None
        if self.fused_backup:
            return []
        last = self.schedule.num_steps - 1
        work = [(f.start, f.stop) for f in self.schedule.recv_frames(lane, self.lanes) if f.step == last]
        work.reverse()
        return work


async def reduce_scatter_checked(
    args: ReduceArgs,
    *,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    backup: InputBackup | None = None,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
) -> tuple[int, int]:
    """Reduce-scatter ``args`` (checked by :meth:`ReduceArgs.check
    <pccl.collectives.buffers.ReduceArgs.check>`) over the ring: afterwards ``args.dst`` holds,
    in :func:`shard_bounds` ``(count, world, rank)``, the reduction of that slice over every
    participant (see the module docstring for the rest of ``dst``).

    ``rank``/``world``/``links``/``seq`` as for :func:`~pccl.collectives.allreduce.reduce_checked`;
    every peer must pass the same count, dtype, op, quantization, ``max_subchunk_bytes`` and
    number of lanes.  In place, pass a ``backup`` (an :class:`~pccl.collectives.backup.InputGuard`'s)
    to restore the input after this function has returned; without one the call restores it
    itself before an exception propagates.  Returns ``(tx_bytes, rx_bytes)`` (payload bytes,
    quantization metadata included).  Errors as the all-reduce's; the seq is retired on exit,
    whatever the outcome.
    """
    op = await execute(lambda place: reduce_scatter_op(args, place, max_subchunk_bytes=max_subchunk_bytes),
                       links=links, rank=rank, world=world, seq=seq, keep=args, backup=backup, runner=runner)
    return op.tx_bytes, op.rx_bytes


def reduce_scatter_op(args: ReduceArgs, place: Place, *,
                      max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES) -> ReduceScatterOp:
    """The reduce-scatter of ``args`` at ``place``, ready to run (its scratch memory taken)."""
    bufs = OpBuffers.for_args(args)
    try:
        return ReduceScatterOp(bufs, links=place.links, rank=place.rank, world=place.world, seq=place.seq,
                               backup=place.backup, runner=place.runner, max_subchunk_bytes=max_subchunk_bytes,
                               exchange_max_bytes=0)
    except BaseException:
        bufs.release()
        raise
