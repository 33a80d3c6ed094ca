"""The scatter + all-gather broadcast's schedule: who sends which blocks to whom, at which step.

A broadcast of a large buffer to many peers (:data:`~pccl.protocol.algorithms.BroadcastAlgorithm.SCATTER_ALL_GATHER`)
splits the buffer into ``P`` blocks (``P`` the largest power of two ``<= N``; block ``b`` is the
elements :func:`~pccl.collectives.halving.block_bounds` gives, the first ``count % P`` blocks one
element longer) and moves them over the halving-doubling partner links
(:func:`~pccl.protocol.algorithms.partner_positions`) in two phases of ``log2 P`` steps each:

* **scatter** (recursive halving from the root): the root's virtual rank ``t`` holds every
  block; at step ``s = 1 .. log2 P`` (distance ``d = P >> s``) every peer whose ``rel = v XOR
  t`` is a multiple of ``2d`` holds the ``2d`` blocks of its aligned run and sends the half
  that holds virtual rank ``v XOR d`` to that peer.  After it, virtual rank ``v`` holds block
  ``v`` (and the root everything); the root has sent ``(P - 1) / P`` of the buffer.
* **all-gather** (recursive doubling, as the halving-doubling all-reduce's second half): at step
  ``log2 P + k`` (distance ``d = 2^(k-1)``) partners ``v`` and ``v XOR d`` swap the aligned runs
  of ``d`` blocks they hold.  A peer never receives blocks it holds already: the half of a pair
  whose ``rel`` is a multiple of ``2d`` sent that run to the other in the scatter, so only the
  other direction moves (the root receives nothing at all).

Every peer but the root receives each block exactly once (the whole buffer, in runs of ``P/2``
blocks and less); the root sends ``(P - 1) / P`` of the buffer in each phase, no peer more than
that: ``2 log2 P`` hops and about twice the buffer through the busiest uplink, where the chain
pays ``N - 1`` hops and the binomial tree's root sends the whole buffer ``log2 P`` times.

Non-powers of two: the fold of :mod:`pccl.protocol.algorithms`.  A root that folds sends the
whole buffer to its fold partner first (step 0), which then acts as the root; at the last step
(``2 log2 P + 1``) every peer with a folded partner sends it the whole buffer (except to the
root).  Pure functions of the ring position, the world and the root: every peer computes the
same plan, so each edge's frames come in the order they are sent.
"""

from __future__ import annotations

import dataclasses
import functools

from .algorithms import fold_partner, position_of, power_of_two_below, virtual_rank

__all__ = ["BlockMove", "scatter_all_gather_plan", "fold_out_step"]


@dataclasses.dataclass(frozen=True)
class BlockMove:
    """One transfer of this peer's plan: blocks ``[first, stop)`` of the ``P`` to or from
    ``partner`` (a ring position) at ``step``; ``(0, P)`` is the whole buffer."""

    step: int
    partner: int
    #: True: this peer sends the blocks; False: it receives them.
    send: bool
    first: int
    stop: int


def fold_out_step(world: int) -> int:
    """The step at which fold partners hand the whole buffer to their folded peers."""
    return 2 * (power_of_two_below(world).bit_length() - 1) + 1


def _run(v: int, distance: int) -> tuple[int, int]:
    """The aligned run of ``distance`` blocks that holds block ``v``."""
    first = v & ~(distance - 1)
    return first, first + distance


@functools.lru_cache(maxsize=256)
def scatter_all_gather_plan(position: int, world: int, root: int) -> tuple[BlockMove, ...]:
    """Ring position ``position``'s moves in the scatter + all-gather broadcast from ring position
    ``root`` on ``world >= 2`` peers, in step order (a step's moves run together: at most one
    send and one receive, with one partner).  See the module docstring.  ``ValueError`` for
    positions outside the ring."""
    if world < 2 or not 0 <= position < world or not 0 <= root < world:
        raise ValueError(f"position {position} / root {root} / world {world}: not a ring of 2+ peers")
    size = power_of_two_below(world)
    steps = size.bit_length() - 1
    last = fold_out_step(world)
    whole = (0, size)
    root_v = virtual_rank(root, world)
    root_fold = fold_partner(root, world)
    moves: list[BlockMove] = []
    v = virtual_rank(position, world)
    if v is None:  # a folded peer: the root sends first, any other receives last
        partner = fold_partner(position, world)
        assert partner is not None
        if position == root:
            return (BlockMove(0, partner, True, *whole),)
        return (BlockMove(last, partner, False, *whole),)
    if root_v is None:  # the root folds: its partner takes the buffer first and acts as the root
        assert root_fold is not None
        root_v = virtual_rank(root_fold, world)
        if position == root_fold:
            moves.append(BlockMove(0, root, False, *whole))
    assert root_v is not None
    rel = v ^ root_v
    for s in range(1, steps + 1):  # the scatter
        d = size >> s
        partner = position_of(v ^ d, world)
        if rel % (2 * d) == 0:
            moves.append(BlockMove(s, partner, True, *_run(v ^ d, d)))
        elif rel % (2 * d) == d:
            moves.append(BlockMove(s, partner, False, *_run(v, d)))
    for k in range(steps):  # the all-gather
        d = 1 << k
        partner = position_of(v ^ d, world)
        if (rel ^ d) % (2 * d):  # the partner lacks this peer's run
            moves.append(BlockMove(steps + 1 + k, partner, True, *_run(v, d)))
        if rel % (2 * d):  # this peer lacks the partner's run
            moves.append(BlockMove(steps + 1 + k, partner, False, *_run(v ^ d, d)))
    fold = fold_partner(position, world)
    if fold is not None and fold != root:
        moves.append(BlockMove(last, fold, True, *whole))
    return tuple(moves)
