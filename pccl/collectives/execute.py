"""Running one op of any kind of collective: what every kind does alike, written once.

Each kind's module (:mod:`.allreduce`, :mod:`.reduce_scatter`, :mod:`.all_gather`,
:mod:`.broadcast`) says only how to make its op (a :class:`~pccl.collectives.lane_op.LaneOp`)
from its checked arguments and this peer's :class:`Place` on the ring.  :func:`execute` does the
rest, the same for all of them:

* **the ring check**: ``world >= 2`` and ``0 <= rank < world``, else ``InvalidArgument`` before
  anything is sent;
* **the input to keep**: given the buffer the op may overwrite (``keep``) and no ``backup`` of the
  caller's, the call keeps the input itself (an :class:`~pccl.collectives.backup.InputGuard`)
  and restores it before an exception propagates; an in-place op saves each slice into the
  backup (the caller's or its own) right before its first overwrite;
* **the kernel runner**: the caller's, or a default :class:`~pccl.collectives.buffers.KernelRunner`;
* **the run** on the path the links offer (:func:`execute_op`);
* **the release** of the op's scratch memory once every task and thread of the op has stopped,
  whatever the outcome;
* **the retire** of the seq on every way out, so frames of the op still in flight are discarded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import trio

from ..errors import InvalidArgument
from .backup import InputBackup, InputGuard
from .buffers import KernelRunner, ReduceArgs
from .halving import HalvingDoublingOp
from .inline import InlineRing, suits_inline
from .lane_op import LaneOp
from .links import RingLinks
from .scatter_broadcast import ScatterAllGatherOp
from .threaded import LaneThreads
from .tree_broadcast import TreeBroadcastOp
from .trio_ring import TrioRing

__all__ = ["AnyOp", "Place", "check_ring", "execute", "execute_op"]

#: An op :func:`execute` runs (any kind's): one the three ring paths drive (:class:`LaneOp`),
#: or one that runs itself over partner links (:class:`HalvingDoublingOp`, :class:`TreeBroadcastOp`,
#: :class:`ScatterAllGatherOp`).
AnyOp = LaneOp | HalvingDoublingOp | TreeBroadcastOp | ScatterAllGatherOp
#: The op :func:`execute` makes and runs.
OpT = TypeVar("OpT", bound=AnyOp)


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one op runs on this peer: what every kind's op is made with."""

    links: RingLinks
    #: this peer's ring position and the ring's size (checked: ``0 <= rank < world``, ``world >= 2``)
    rank: int
    world: int
    #: the master's sequence number of the op (the same on every peer)
    seq: int
    runner: KernelRunner
    #: where an in-place op saves each slice of the caller's input before overwriting it
    #: (``None``: out of place, or the input is kept elsewhere)
    backup: InputBackup | None


def check_ring(rank: int, world: int) -> None:
    """``InvalidArgument`` unless ``rank`` is a position in a ring of ``world`` (2 or more) peers."""
    if world < 2 or not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} / world {world}: a ring needs 2+ peers and 0 <= rank < world")


async def execute(make_op: Callable[[Place], OpT], *, links: RingLinks, rank: int, world: int, seq: int,
                  keep: ReduceArgs | None = None, backup: InputBackup | None = None,
                  runner: KernelRunner | None = None) -> OpT:
    """Make an op with ``make_op(place)`` and run it, as the module docstring says; returns the
    op (its byte counts).  ``keep``: the buffer the op may overwrite (``None``: it writes none
    of the caller's); ``backup``: where the caller keeps that buffer itself (``None``: this call
    keeps it).  ``make_op`` may raise ``InvalidArgument`` (a kind's own checks) or
    ``ProtocolError``: nothing has been sent then."""
    try:
        check_ring(rank, world)
        guard = InputGuard(keep) if keep is not None and backup is None else None
        kept = guard.backup if guard is not None else backup
        place = Place(links, rank, world, seq, runner or KernelRunner(),
                      kept if keep is not None and keep.in_place else None)
        op: OpT | None = None
        try:
            op = make_op(place)
            await execute_op(op)
            return op
        except BaseException:
            if guard is not None:
                guard.restore()
            raise
        finally:
            # Every task of the op has stopped (kernels and socket workers are waited for), so
            # nothing touches the scratch memory any more.
            if op is not None:
                op.release()
            if guard is not None:
                guard.drop()
    finally:
        links.retire(seq)


async def execute_op(op: AnyOp) -> None:
    """Run ``op`` (any collective's) on the path its links offer; connections it left broken (a
    torn frame, a bad header) are aborted when it ends, whichever path ran.

    An op for the lane threads first waits for its turn (:class:`~pccl.collectives.turns.ThreadTurns`:
    a few at a time per set of links, in commence order); cancellable while it waits.  Every
    other op leaves the commence order at once."""
    links = op.links
    try:
        if isinstance(op, (HalvingDoublingOp, TreeBroadcastOp, ScatterAllGatherOp)):
            if op.moves_nothing():
                links.registry.started(op.seq)
                await trio.lowlevel.checkpoint()
            else:
                await op.run()
        elif op.moves_nothing():
            links.registry.started(op.seq)
            await trio.lowlevel.checkpoint()
        elif not links.threaded:
            links.registry.started(op.seq)
            await TrioRing(op).run()
        elif suits_inline(op):
            links.registry.started(op.seq)
            await InlineRing(op).run()
        else:
            turns = links.turns
            assert turns is not None
            if not await turns.take(op.seq):
                await LaneThreads(op).run()
            else:
                try:
                    await LaneThreads(op).run()
                finally:
                    turns.give_back()
    finally:
        links.abort_broken()
