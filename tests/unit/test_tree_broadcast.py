"""pccl.collectives.tree_broadcast: the pipelined binomial-tree broadcast over the partner links,
N peers as trio tasks over in-memory links (:func:`pccl.testing.memory_mesh`), and its choice
(:func:`pccl.protocol.algorithms.choose_broadcast`).

Every peer must end holding the root's bytes exactly, whichever algorithm ran, from any root;
the tree uses partner links only, in ``log2 P`` levels (plus the fold); an abort restores every
input.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives import RingLinks, broadcast_checked
from pccl.collectives.broadcast import broadcast_algorithm_for
from pccl.collectives.buffers import ReduceArgs
from pccl.collectives.execute import Place
from pccl.errors import PCCLError, PeerDisconnected
from pccl.protocol.algorithms import (
    MIN_WORLD,
    AllReduceAlgorithm,
    TREE_SEGMENT_BYTES,
    BroadcastAlgorithm,
    broadcast_costs,
    broadcast_tree,
    choose_broadcast,
    link_partner_positions,
    partner_positions,
    power_of_two_below,
)
from pccl.types import Quantization, ReduceOp

from pccl.testing import memory_mesh, memory_ring

TREE, CHAIN = BroadcastAlgorithm.TREE, BroadcastAlgorithm.CHAIN
SCATTER_ALL_GATHER = BroadcastAlgorithm.SCATTER_ALL_GATHER
WORLDS = [2, 3, 4, 5, 6, 7, 8, 9, 16]


def _bits(x: np.ndarray) -> bytes:
    return x.view(np.uint8).tobytes()


async def broadcast(inputs: Sequence[np.ndarray], root: int, links: Sequence[RingLinks], *,
                    algorithm: BroadcastAlgorithm | None = TREE, in_place: bool = True,
                    quant: Quantization | None = None) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    xs = [x.copy() for x in inputs]
    dsts = [x if in_place else np.full_like(x, 7) for x in xs]
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        args = ReduceArgs.check(xs[r], None if in_place else dsts[r], ReduceOp.SUM, quant)
        sizes[r] = await broadcast_checked(args, root=root, links=links[r], rank=r, world=world, seq=1,
                                           algorithm=algorithm)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    if not in_place:
        assert all(_bits(x) == _bits(i) for x, i in zip(xs, inputs)), "src was written"
    return dsts, sizes


def inputs_for(world: int, n: int, dtype: Any, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(world)]


# --- the tree ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [*range(2, 20), 64, 100, 256])
def test_the_tree_reaches_everyone_once_over_partner_links_in_log_steps(world: int) -> None:
    size = power_of_two_below(world)
    depth_bound = (size.bit_length() - 1) + (2 if size != world else 0)
    for root in range(world):
        plans = [broadcast_tree(p, world, root) for p in range(world)]
        assert plans[root][0] is None
        for p, (parent, children) in enumerate(plans):
            if p != root:
                assert parent is not None
                q, step = parent
                assert (p, step) in plans[q][1], (world, root, p)  # the parent sends it exactly there
                assert q in partner_positions(p, world)
            steps = [s for _, s in children]
            assert steps == sorted(set(steps)), "one child per step, in step order"
            if parent is not None:
                assert all(s > parent[1] for s in steps), "a peer forwards only what it received"
        # Every peer hears from the root through a chain of parents no longer than the depth.
        for p in range(world):
            hops, at = 0, p
            while plans[at][0] is not None:
                at = plans[at][0][0]  # type: ignore[index]
                hops += 1
                assert hops <= depth_bound
            assert at == root


def test_the_tree_is_binomial_at_powers_of_two() -> None:
    # Root 0 at 8 peers: distance 4, then 2, then 1.
    assert broadcast_tree(0, 8, 0) == (None, ((4, 1), (2, 2), (1, 3)))
    assert broadcast_tree(4, 8, 0) == ((0, 1), ((6, 2), (5, 3)))
    assert broadcast_tree(7, 8, 0) == ((6, 3), ())
    # A folded root (position 0 of 5 folds into 1) hands the buffer to its partner at step 0;
    # the fold's other peers get it last (step log2 P + 1).
    assert broadcast_tree(0, 5, 0) == (None, ((1, 0),))
    assert broadcast_tree(1, 5, 0) == ((0, 0), ((3, 1), (2, 2)))
    with pytest.raises(ValueError):
        broadcast_tree(5, 5, 0)


# --- correctness ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLDS)
async def test_every_peer_ends_with_the_roots_bytes_from_any_root(world: int) -> None:
    inputs = inputs_for(world, 1000 + world, np.float32, seed=world)
    for root in range(world) if world <= 9 else (0, 1, 5, 8, 15):  # every root, folded or not
        links, _, _ = memory_mesh(world)
        outs, sizes = await broadcast(inputs, root, links)
        for r in range(world):
            assert _bits(outs[r]) == _bits(inputs[root]), (world, root, r)
        nbytes = inputs[root].nbytes
        assert sum(tx for tx, _ in sizes) == (world - 1) * nbytes  # every peer but the root once
        assert all(rx == (0 if r == root else nbytes) for r, (_, rx) in enumerate(sizes))


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
async def test_dtypes_and_out_of_place_are_bit_identical(dtype: Any, in_place: bool) -> None:
    world = 9
    inputs = [np.frombuffer(np.random.default_rng(r).bytes(8 * 777), dtype=dtype).copy() for r in range(world)]
    links, _, _ = memory_mesh(world)
    outs, _ = await broadcast(inputs, 4, links, in_place=in_place)
    assert all(_bits(o) == _bits(inputs[4]) for o in outs)  # NaN payloads and signed zeros too


async def test_large_buffers_travel_in_segments_and_match_the_chain() -> None:
    world = 6
    n = (2 * TREE_SEGMENT_BYTES + 12345) // 4  # three segments, the last one short
    inputs = inputs_for(world, n, np.float32, seed=7)
    links, _, _ = memory_mesh(world)
    tree, _ = await broadcast(inputs, 3, links, algorithm=TREE)
    links, _, _ = memory_mesh(world)
    chain, _ = await broadcast(inputs, 3, links, algorithm=CHAIN)
    assert all(_bits(t) == _bits(c) == _bits(inputs[3]) for t, c in zip(tree, chain))


async def test_without_partner_links_the_chain_runs_even_when_forced() -> None:
    links, _ = memory_ring(5)
    inputs = inputs_for(5, 100, np.float32)
    outs, _ = await broadcast(inputs, 2, links, algorithm=TREE)
    assert all(_bits(o) == _bits(inputs[2]) for o in outs)


async def test_empty_buffer_moves_nothing() -> None:
    links, _, _ = memory_mesh(4)
    outs, sizes = await broadcast([np.empty(0, np.float32) for _ in range(4)], 1, links)
    assert sizes == [(0, 0)] * 4


# --- the choice ----------------------------------------------------------------------------------


def test_the_choice() -> None:
    auto = dict(quantized=False, segmented=False, partner_links=True)
    # Small buffers in large groups take the tree, large ones the chain; small groups the chain.
    assert choose_broadcast(4096, 64, **auto) is TREE
    assert choose_broadcast(4096, 256, **auto) is TREE
    assert choose_broadcast(64 << 20, 64, **auto) is CHAIN
    assert choose_broadcast(4096, MIN_WORLD - 1, **auto) is CHAIN
    assert choose_broadcast(4096, MIN_WORLD, **auto) is TREE
    # What cannot run the tree never gets it, forced or not.
    for kw in ({"quantized": True}, {"segmented": True}, {"partner_links": False}):
        assert choose_broadcast(4096, 64, **{**auto, **kw}, forced=TREE) is CHAIN  # type: ignore[arg-type]
    assert choose_broadcast(0, 64, **auto, forced=TREE) is CHAIN
    assert choose_broadcast(64 << 20, 3, **auto, forced=TREE) is TREE
    # The choice is the cheapest of the documented costs (ties in the enum's order), and as the
    # buffer grows it goes from the tree to the scatter + all-gather (at some worlds) to the chain.
    for world in (8, 9, 16, 64, 256):
        picks = []
        for shift in range(2, 34):
            nbytes = 1 << shift
            costs = broadcast_costs(nbytes, world)
            pick = choose_broadcast(nbytes, world, **auto)
            assert pick is min(costs, key=lambda a: (costs[a], list(costs).index(a)))
            picks.append(pick)
        runs = [a for i, a in enumerate(picks) if i == 0 or a is not picks[i - 1]]
        assert runs in ([TREE, CHAIN], [TREE, SCATTER_ALL_GATHER, CHAIN]), (world, runs)


async def test_quantized_broadcast_takes_the_chain_even_when_forced() -> None:
    world = 8
    links, _, _ = memory_mesh(world)
    inputs = inputs_for(world, 4096, np.float32)
    outs, _ = await broadcast(inputs, 5, links, quant=Quantization(dtype=np.uint8))
    assert all(_bits(o) == _bits(outs[0]) for o in outs)  # the chain's quantized bytes, alike everywhere
    assert not np.array_equal(outs[0], inputs[5])  # quantized: the chain ran, not the exact tree


# --- aborts --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("world", "root", "breaker", "partner"),
                         [(8, 0, 0, 4), (8, 3, 1, 0), (5, 0, 0, 1), (6, 2, 1, 0)],
                         ids=["8-root-link", "8-inner", "5-fold-in", "6-fold-out"])
async def test_a_partner_link_dying_mid_broadcast_aborts_and_restores_inputs(world: int, root: int, breaker: int,
                                                                            partner: int) -> None:
    assert partner in [c for c, _ in broadcast_tree(breaker, world, root)[1]], "the test breaks a tree edge"
    links, _, streams = memory_mesh(world)
    n = 3 * TREE_SEGMENT_BYTES // 8  # f64: three segments; the break lands inside the second
    inputs = inputs_for(world, n, np.float64, seed=world)
    originals = [x.copy() for x in inputs]
    stream = streams[breaker][partner]
    stream.break_after = TREE_SEGMENT_BYTES + TREE_SEGMENT_BYTES // 2
    scopes = [trio.CancelScope() for _ in range(world)]
    outcomes: list[Any] = [None] * world

    async def peer(r: int) -> None:
        try:
            with scopes[r]:
                args = ReduceArgs.check(inputs[r], None, ReduceOp.SUM, None)
                outcomes[r] = await broadcast_checked(args, root=root, links=links[r], rank=r, world=world, seq=1,
                                                      algorithm=TREE)
                return
        except PCCLError as exc:
            outcomes[r] = exc
        for s in scopes:  # what the master's Abort does
            s.cancel()
        if outcomes[r] is None:
            outcomes[r] = "cancelled"

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    assert stream.broke.is_set()
    assert isinstance(outcomes[breaker], PeerDisconnected), outcomes[breaker]
    for r in range(world):
        if isinstance(outcomes[r], tuple):  # done before the abort reached it: the caller's backup restores it
            assert _bits(inputs[r]) == _bits(originals[root])
            continue
        assert _bits(inputs[r]) == _bits(originals[r]), f"peer {r} not restored ({outcomes[r]!r})"


#: The worlds docs/collectives.rst's broadcast table has a row for.
DOCUMENTED = [8, 9, 16, 64, 256]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "collectives.rst"


def smallest_size_not(world: int, algorithms: tuple[BroadcastAlgorithm, ...]) -> int:
    """The smallest buffer (bytes) the automatic choice does not give one of ``algorithms``
    (which it gives every smaller buffer)."""
    lo, hi = 1, 1 << 34
    while hi - lo > 1:
        mid = (lo + hi) // 2
        taken = choose_broadcast(mid, world, quantized=False, segmented=False, partner_links=True) in algorithms
        lo, hi = (mid, hi) if taken else (lo, mid)
    return hi


@pytest.mark.parametrize("world", DOCUMENTED)
def test_the_thresholds_are_the_documented_ones(world: int) -> None:
    tree_below = smallest_size_not(world, (TREE,))
    chain_from = smallest_size_not(world, (TREE, SCATTER_ALL_GATHER))
    if chain_from == tree_below:
        row = f"* - {world}\n     - the tree below {tree_below / 1024:.1f} KiB, the chain above"
    else:
        row = (f"* - {world}\n     - the tree below {tree_below / 1024:.1f} KiB, scatter + all-gather "
               f"below {chain_from / 1024:.1f} KiB, the chain above")
    assert row in DOCS.read_text(), row
    for world_below in range(2, MIN_WORLD):
        assert choose_broadcast(4, world_below, quantized=False, segmented=False, partner_links=True) is CHAIN


@pytest.mark.parametrize("sites", [(0, 0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 0, 1, 0, 1, 0, 1, 0), (0, 0, 0, 1, 1, 1, 2, 2, 2)])
def test_a_forced_hierarchical_round_chooses_one_broadcast_algorithm_on_every_peer(sites: tuple[int, ...]) -> None:
    """With ``Config.all_reduce_algorithm="hierarchical"`` a round wires the site partners only
    (:func:`link_partner_positions`); at 9 peers position 0's one halving-doubling partner (its
    fold partner) is a site mate, the others' are not.  The broadcast's choice must not follow
    which halving partners happen to be linked at this peer: every peer takes the chain."""
    world = len(sites)
    mesh, _, _ = memory_mesh(world, sites=sites)
    chosen = []
    for r in range(world):
        wired = set(link_partner_positions(r, world, AllReduceAlgorithm.HIERARCHICAL, sites))
        links = RingLinks(mesh[r].to_next, [inbox.connection for inbox in mesh[r].inboxes],
                          partners={p: inbox.connection for p, inbox in mesh[r].partners.items() if p in wired},
                          algorithm=AllReduceAlgorithm.HIERARCHICAL, sites=sites)
        place = Place(links, r, world, 1, runner=None, backup=None)  # type: ignore[arg-type]
        args = ReduceArgs.check(np.zeros(16, np.float32), None, ReduceOp.SUM, None)
        chosen.append(broadcast_algorithm_for(args, place))
    assert any(set(partner_positions(r, world)) <= set(link_partner_positions(
        r, world, AllReduceAlgorithm.HIERARCHICAL, sites)) for r in range(world))  # the trap is there
    assert chosen == [CHAIN] * world, chosen
