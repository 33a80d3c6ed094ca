"""pccl.collectives.scatter_broadcast: the scatter + all-gather broadcast over the partner links,
N peers as trio tasks over in-memory links (:func:`pccl.testing.memory_mesh`), and its place in
the choice (:func:`pccl.protocol.algorithms.choose_broadcast`).

Every peer must end holding the root's bytes exactly, from any root, folded or not, whatever
the count (blocks of one element, empty blocks, several frames per move); a peer receives the
buffer once; a partner link breaking mid-op (in the scatter, the all-gather, the fold in or out)
aborts the op and every input is restored.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives import broadcast_checked
from pccl.collectives.buffers import ReduceArgs
from pccl.errors import InvalidArgument, PCCLError, PeerDisconnected
from pccl.protocol.algorithms import (
    MIN_WORLD,
    TREE_SEGMENT_BYTES,
    BroadcastAlgorithm,
    broadcast_costs,
    choose_broadcast,
)
from pccl.protocol.scatter_gather import scatter_all_gather_plan
from pccl.testing import force_broadcast_algorithm, memory_mesh, memory_ring
from pccl.types import ReduceOp
from test_tree_broadcast import broadcast, inputs_for

SAG, TREE, CHAIN = BroadcastAlgorithm.SCATTER_ALL_GATHER, BroadcastAlgorithm.TREE, BroadcastAlgorithm.CHAIN


def _bits(x: np.ndarray) -> bytes:
    return x.view(np.uint8).tobytes()


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6, 7, 8, 9, 12, 16])
@pytest.mark.parametrize("n", [1, 3, 1000])
async def test_every_peer_ends_with_the_roots_bytes_from_any_root(world: int, n: int) -> None:
    inputs = inputs_for(world, n + world, np.float32, seed=world)
    for root in range(world) if world <= 9 else (0, 1, 5, 8, world - 1):
        links, _, _ = memory_mesh(world)
        outs, sizes = await broadcast(inputs, root, links, algorithm=SAG)
        for r in range(world):
            assert _bits(outs[r]) == _bits(inputs[root]), (world, root, r)
        nbytes = inputs[root].nbytes
        assert all(rx == (0 if r == root else nbytes) for r, (_, rx) in enumerate(sizes)), sizes  # once each
        assert sum(tx for tx, _ in sizes) == (world - 1) * nbytes


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.float16, ml_dtypes.bfloat16, np.float64])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out-of-place"])
async def test_dtypes_and_out_of_place_are_bit_identical(dtype: Any, in_place: bool) -> None:
    world = 11
    inputs = [np.frombuffer(np.random.default_rng(r).bytes(8 * 777), dtype=dtype).copy() for r in range(world)]
    for root in (0, 4):  # folded, and not
        links, _, _ = memory_mesh(world)
        outs, _ = await broadcast(inputs, root, links, algorithm=SAG, in_place=in_place)
        assert all(_bits(o) == _bits(inputs[root]) for o in outs)  # NaN payloads and signed zeros too


async def test_large_buffers_travel_in_frames_and_match_the_chain() -> None:
    world = 6
    n = (5 * TREE_SEGMENT_BYTES + 12345) // 4  # the first scatter move is two frames, the fold's six
    inputs = inputs_for(world, n, np.float32, seed=7)
    links, _, _ = memory_mesh(world)
    sag, _ = await broadcast(inputs, 2, links, algorithm=SAG)
    links, _, _ = memory_mesh(world)
    chain, _ = await broadcast(inputs, 2, links, algorithm=CHAIN)
    assert all(_bits(s) == _bits(c) == _bits(inputs[2]) for s, c in zip(sag, chain))


async def test_without_partner_links_the_chain_runs_even_when_forced() -> None:
    links, _ = memory_ring(5)
    inputs = inputs_for(5, 100, np.float32)
    outs, sizes = await broadcast(inputs, 2, links, algorithm=SAG)
    assert all(_bits(o) == _bits(inputs[2]) for o in outs)
    assert sizes[1] == (0, 400), "the chain: the root's predecessor forwards nothing"


def test_the_choice_takes_it_for_mid_size_and_large_buffers_in_large_groups() -> None:
    auto = dict(quantized=False, segmented=False, partner_links=True)
    assert choose_broadcast(16 << 20, 64, **auto) is SAG
    assert choose_broadcast(16 << 20, 256, **auto) is SAG
    assert choose_broadcast(4096, 256, **auto) is TREE
    assert choose_broadcast(1 << 30, 256, **auto) is CHAIN  # the chain moves the buffer once, not twice
    assert choose_broadcast(16 << 20, MIN_WORLD - 1, **auto) is CHAIN
    assert choose_broadcast(16 << 20, 5, **auto, forced=SAG) is SAG
    for kw in ({"quantized": True}, {"segmented": True}, {"partner_links": False}):
        assert choose_broadcast(16 << 20, 64, **{**auto, **kw}, forced=SAG) is CHAIN  # type: ignore[arg-type]
    for world in (8, 9, 16, 64, 100, 256):
        for shift in range(2, 32):
            costs = broadcast_costs(1 << shift, world)
            assert choose_broadcast(1 << shift, world, **auto) is min(costs, key=lambda a: (costs[a], list(costs).index(a)))


@pytest.mark.parametrize(("world", "root", "breaker", "partner", "where"),
                         [(8, 0, 0, 4, "scatter"), (8, 3, 0, 4, "all-gather"), (5, 0, 0, 1, "fold-in"),
                          (6, 2, 1, 0, "fold-out")],
                         ids=["8-root-scatter", "8-all-gather", "5-fold-in", "6-fold-out"])
async def test_a_partner_link_dying_mid_broadcast_aborts_and_restores_inputs(world: int, root: int, breaker: int,
                                                                            partner: int, where: str) -> None:
    moves = [m for m in scatter_all_gather_plan(breaker, world, root) if m.send and m.partner == partner]
    assert sum(m.stop - m.first for m in moves) >= 4, f"the test breaks an edge carrying half the buffer ({where})"
    links, _, streams = memory_mesh(world)
    n = TREE_SEGMENT_BYTES  # f64: 8 segments, one block of 8 per segment; the break lands inside the second
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
                                                      algorithm=SAG)
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
    assert not isinstance(outcomes[partner], tuple), "the partner was cut off mid-move"
    for r in range(world):
        if isinstance(outcomes[r], tuple):  # done before the abort reached it: the caller's backup restores it
            assert _bits(inputs[r]) == _bits(originals[root])
            continue
        assert _bits(inputs[r]) == _bits(originals[r]), f"peer {r} not restored ({outcomes[r]!r})"


def test_forcing_an_unknown_broadcast_algorithm_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="broadcast algorithm must be one of"):
        force_broadcast_algorithm("scatter")
    with force_broadcast_algorithm("scatter_all_gather") as planted:
        assert not planted.removed
