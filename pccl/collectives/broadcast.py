"""Broadcast along the ring: a pipelined chain from the root, on the all-reduce's lanes.

:func:`broadcast_checked` sends the root's buffer to every participant and returns the payload
bytes this peer sent and received.  Where the ring has partner links and the buffer is small for
the group, :func:`broadcast_op` makes a :class:`~pccl.collectives.tree_broadcast.TreeBroadcastOp`
instead (``log2 N`` hops), and for mid-size and large buffers in large groups a
:class:`~pccl.collectives.scatter_broadcast.ScatterAllGatherOp` (``2 log2 N`` hops, about twice
the buffer per peer); :func:`~pccl.protocol.algorithms.choose_broadcast`, a pure function of
agreed parameters, picks per op.  What follows is the chain.

Design
------
The plan is :class:`~pccl.protocol.ring.BroadcastSchedule`: the buffer is cut into sub-chunks;
the peer at distance ``d = (rank - root) mod n`` receives every sub-chunk at step ``d - 1``
and sends it on at step ``d`` (the last peer sends nothing), so sub-chunk ``k`` leaves a peer
as soon as it is in and the chain's hops overlap.  The op is a
:class:`~pccl.collectives.chain_op.ChainOp`, run by the all-reduce's execution paths
(:func:`~pccl.collectives.execute.execute`) with its frame headers, striping and abort
rules.  Sub-chunks are sized by :func:`~pccl.protocol.ring.subchunk_elements` for the ring
(``count / 2n`` elements, between 64 KiB and ``max_subchunk_bytes``): a 64 MiB op at two peers
moves 16 frames of 4 MiB, so the chain is full after one frame.

* **Buffers.**  In place (``ReduceArgs.check(x, None, ReduceOp.SUM, quantization)``) every
  receiver's ``x`` is overwritten, sub-chunk by sub-chunk, straight from the wire (zero copy),
  each slice saved in the backup right before; out of place (``dst`` a staged array) ``dst``
  ends holding the result on every peer, the root included (it copies its input there), and
  ``src`` is never written.
* **MIN_MAX quantization** (float buffers): the root quantizes each sub-chunk once, writes the
  dequantized values into its own buffer (so the root and every receiver end bit-identical; in
  place the root's ``x`` is saved first) and sends the bytes; receivers dequantize them and
  forward them verbatim.
* **Aborts.**  Pass a ``backup`` (an :class:`~pccl.collectives.backup.InputGuard`'s) to restore
  the input after this function returned; without one the call keeps its own and restores the
  input before the exception propagates.
"""

from __future__ import annotations

import functools

from ..errors import InvalidArgument
from ..protocol.algorithms import AllReduceAlgorithm, BroadcastAlgorithm, choose_broadcast, partner_positions
from ..protocol.ring import DEFAULT_SUBCHUNK_BYTES, BroadcastSchedule, subchunk_elements
from .backup import InputBackup
from .buffers import KernelRunner, ReduceArgs
from .chain_op import ChainOp
from .execute import Place, execute
from .links import RingLinks
from .scatter_broadcast import ScatterAllGatherOp
from .segments import Segments
from .tree_broadcast import TreeBroadcastOp

__all__ = ["broadcast_checked", "broadcast_op", "broadcast_algorithm_for"]


async def broadcast_checked(
    args: ReduceArgs,
    *,
    root: int,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    backup: InputBackup | None = None,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
    algorithm: BroadcastAlgorithm | None = None,
) -> tuple[int, int]:
    """Broadcast the buffer of ring position ``root`` into ``args.dst`` on every peer.

    ``args`` is :meth:`ReduceArgs.check(x, None or dst, ReduceOp.SUM, quantization)
    <pccl.collectives.buffers.ReduceArgs.check>` (the op is not used); every peer must pass the
    same ``root``, count, dtype, quantization, ``max_subchunk_bytes``, ``algorithm`` (``None``:
    chosen per op by :func:`broadcast_algorithm_for`; else forced where it can run) and number
    of lanes.
    ``rank``/``world``/``links``/``seq`` as for :func:`~pccl.collectives.allreduce.reduce_checked`.
    Returns ``(tx_bytes, rx_bytes)`` (payload bytes, quantization headers included).
    ``InvalidArgument`` for a bad ``root``/``rank``/``world`` before anything is sent; other
    errors as the all-reduce's.  The seq is retired on exit, whatever the outcome.
    """
    op = await execute(lambda place: broadcast_op(args, place, root=root, max_subchunk_bytes=max_subchunk_bytes,
                                                  algorithm=algorithm),
                       links=links, rank=rank, world=world, seq=seq, keep=args, backup=backup, runner=runner)
    return op.tx_bytes, op.rx_bytes


def broadcast_algorithm_for(args: ReduceArgs, place: Place,
                            forced: BroadcastAlgorithm | None = None) -> BroadcastAlgorithm:
    """The algorithm the broadcast of ``args`` runs at ``place``
    (:func:`~pccl.protocol.algorithms.choose_broadcast`; the same on every peer: the partner
    links are wired on every peer of a round or on none).  A round forced to the hierarchical
    all-reduce wires site partners only, some of which may happen to be a peer's
    halving-doubling partners: neither the tree nor the scatter + all-gather runs there."""
    return choose_broadcast(int(args.src.nbytes), place.world, quantized=args.quant is not None,
                            segmented=isinstance(args.src, Segments),
                            partner_links=place.links.algorithm is not AllReduceAlgorithm.HIERARCHICAL
                            and place.links.has_partners(partner_positions(place.rank, place.world)),
                            forced=forced)


@functools.lru_cache(maxsize=64)
def shared_broadcast_schedule(count: int, world: int, rank: int, subchunk_elements: int, breaks: tuple[int, ...],
                              root: int) -> BroadcastSchedule:
    """The (immutable) chain schedule of a broadcast with these parameters, shared by every op
    that has them, as the all-reduce's are (:func:`~pccl.protocol.ring.shared_schedule`): a loop
    broadcasts the same buffers every step, and building a schedule and its frame lists per op
    costs more than a small op's own work."""
    return BroadcastSchedule(count, world, rank, subchunk_elements, breaks, root=root)


def broadcast_op(args: ReduceArgs, place: Place, *, root: int, max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
                 algorithm: BroadcastAlgorithm | None = None) -> ChainOp | TreeBroadcastOp | ScatterAllGatherOp:
    """The broadcast from ring position ``root`` of ``args`` at ``place``, ready to run, by the
    algorithm :func:`broadcast_algorithm_for` picks (``algorithm`` forces one where it can run)
    (``InvalidArgument`` for a ``root`` outside the ring)."""
    if not 0 <= root < place.world:
        raise InvalidArgument(f"root {root} / world {place.world}: the root must be a ring position, "
                              f"0 <= root < world")
    chosen = broadcast_algorithm_for(args, place, algorithm)
    if chosen is not BroadcastAlgorithm.CHAIN:
        kind = TreeBroadcastOp if chosen is BroadcastAlgorithm.TREE else ScatterAllGatherOp
        return kind(args, root=root, links=place.links, rank=place.rank, world=place.world,
                    seq=place.seq, backup=place.backup, runner=place.runner)
    count = args.src.size
    sub = subchunk_elements(count, place.world, args.dtype.itemsize, max_bytes=max_subchunk_bytes)
    breaks = tuple(args.src.breaks) if isinstance(args.src, Segments) else ()
    schedule = shared_broadcast_schedule(count, place.world, place.rank, sub, breaks, root)
    return ChainOp(schedule, src=args.src, out=args.dst, base=0, quant=args.quant, links=place.links,
                   world=place.world, seq=place.seq, backup=place.backup, runner=place.runner)
