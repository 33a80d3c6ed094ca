"""pccl.collectives.hierarchical: the all-reduce across sites (reduce-scatter in each site, the
shards across sites, all-gather in each site), N peers as trio tasks over in-memory partner
links (:func:`pccl.testing.memory_mesh` with ``sites``).

Results must equal the numpy model of its reduction order
(:func:`pccl.collectives.reference.hierarchical_reference`) bit for bit, and be bit-identical
on every peer, for every dtype and op and several site shapes; the choice is a pure function
of the sites; a partner link dying mid-op aborts everyone with their inputs restored.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives.reference import all_reduce_reference, halving_reference, hierarchical_reference, ring_reference
from pccl.errors import PCCLError, PeerDisconnected
from pccl.protocol.algorithms import (
    AllReduceAlgorithm,
    choose_all_reduce,
    link_partner_positions,
    partner_positions,
    site_partners,
)
from pccl.testing import memory_mesh
from pccl.types import Quantization, ReduceOp

from test_halving_doubling import (
    ALL_DTYPES,
    CANCELLED,
    run_with_master_abort,
    assert_bit_identical,
    make_inputs,
    run_op,
)

HIER, RING, HD = AllReduceAlgorithm.HIERARCHICAL, AllReduceAlgorithm.RING, AllReduceAlgorithm.HALVING_DOUBLING
#: Site shapes, as ConnectToPeers.sites (a site per ring position, numbered along the ring):
#: 2x2, 2x3, 3x2, sites scattered along the ring, 3x4, 4x2 interleaved; uneven: 2+3, 4+2+3
#: (scattered), 3+3+2.
SHAPES = [(0, 0, 1, 1), (0, 0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 2), (0, 1, 1, 0, 2, 2),
          (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2), (0, 1, 2, 3, 0, 1, 2, 3),
          (0, 0, 1, 1, 1), (0, 0, 1, 1, 2, 0, 2, 2, 0), (0, 0, 0, 1, 1, 1, 2, 2)]


def _choose(nbytes: int, sites: tuple[int, ...], *, forced: AllReduceAlgorithm | None = None, quantized: bool = False,
            site_links: bool = True, partner_links: bool = True) -> AllReduceAlgorithm:
    return choose_all_reduce(nbytes, len(sites) or 8, itemsize=4, acc_itemsize=4, quantized=quantized,
                             segmented=False, partner_links=partner_links, exchange_max_bytes=64 << 10,
                             forced=forced, sites=sites, site_links=site_links)


@pytest.mark.parametrize("sites", SHAPES, ids=lambda s: "".join(map(str, s)))
async def test_every_op_and_dtype_matches_the_model_and_is_bit_identical(sites: tuple[int, ...]) -> None:
    world = len(sites)
    links, _, _ = memory_mesh(world, sites=sites)
    seq = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for i, op in enumerate(ReduceOp):
            # uneven shards and pieces, and fewer elements than peers (empty shards)
            for n in (37, 3):
                seq += 1
                inputs = make_inputs(world, n, dtype, op, seed=world * 1000 + d * 10 + i)
                outputs, _ = await run_op(inputs, op, None, in_place=seq % 2 == 0, links=links, seq=seq)
                assert_bit_identical(outputs)
                expected = hierarchical_reference(inputs, op, sites)
                assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), (
                    np.dtype(dtype).name, op, n)
                assert np.array_equal(all_reduce_reference(inputs, op, sites=sites).view(np.uint8),
                                      expected.view(np.uint8))


def test_the_model_folds_each_site_then_the_sites() -> None:
    inputs = make_inputs(6, 100, np.int64, ReduceOp.SUM, seed=1)
    assert np.array_equal(hierarchical_reference(inputs, ReduceOp.SUM, (0, 1, 1, 0, 2, 2)), sum(inputs))
    assert np.array_equal(hierarchical_reference(inputs, ReduceOp.AVG, (0, 1, 1, 0, 2, 2)), sum(inputs) // 6)
    # Floats: the order is pinned, ((x0 + x3) + (x1 + x2)) + (x4 + x5) here, not the ring's.
    x = [np.array([v], np.float32) for v in (1e8, 1.0, -1e8, 1.0, 1.0, 1.0)]
    got = hierarchical_reference(x, ReduceOp.SUM, (0, 1, 1, 0, 2, 2))
    f = np.float32
    assert got[0] == ((f(1e8) + f(1.0)) + (f(1.0) + f(-1e8))) + (f(1.0) + f(1.0))
    with pytest.raises(ValueError, match="do not suit"):
        hierarchical_reference(x, ReduceOp.SUM, (0, 0, 0, 1, 1, 2))


@pytest.mark.parametrize("world", [4, 6])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_half_precision_accumulates_in_f32(world: int, dtype: Any) -> None:
    sites = tuple(k // 2 for k in range(world))
    inputs = [np.full(64, 2.0**-12, dtype) for _ in range(world)]
    inputs[0][:] = 1.0
    outputs, _ = await run_op(inputs, ReduceOp.SUM, None, links=memory_mesh(world, sites=sites)[0])
    assert_bit_identical(outputs)
    assert np.array_equal(outputs[0], np.full(64, np.float32(1.0) + np.float32(2.0**-12) * (world - 1)).astype(dtype))


@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
async def test_signed_zeros_and_nans_end_bit_identical(op: ReduceOp) -> None:
    sites = (0, 0, 1, 1, 2, 2)
    links = memory_mesh(6, sites=sites)[0]
    inputs = [np.full(100, -0.0 if r % 2 else 0.0, np.float64) for r in range(6)]
    outputs, _ = await run_op(inputs, op, None, links=links, seq=1)
    assert_bit_identical(outputs)
    assert outputs[0].tobytes() == hierarchical_reference(inputs, op, sites).tobytes()
    nans = [np.full(101, 0x7FC00000 + r + 1, np.uint32).view(np.float32) for r in range(6)]
    outputs, _ = await run_op(nans, ReduceOp.SUM, None, links=links, seq=2)
    assert_bit_identical(outputs)
    assert np.all(outputs[0].view(np.uint32) == 0x7FC00000)


@pytest.mark.parametrize("sites", [(0, 0, 1, 1), (0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2)], ids=["2x2", "3x4"])
async def test_bytes_moved_are_the_schedules(sites: tuple[int, ...]) -> None:
    world, count = len(sites), max(sites) + 1
    per = world // count
    n = 12 * 1024  # f32, divisible by every shard and piece count here
    inputs = make_inputs(world, n, np.float32, ReduceOp.SUM, seed=2)
    _, sizes = await run_op(inputs, ReduceOp.SUM, None, links=memory_mesh(world, sites=sites)[0])
    # in the site: (L - 1) / L of the buffer each way, twice; across: (S - 1) / S of a shard, twice
    inside = 2 * (per - 1) * (n // per) * 4
    across = 2 * (count - 1) * (n // per // count) * 4
    assert sizes == [(inside + across, inside + across)] * world


async def test_uneven_sites_shard_by_the_largest_and_every_peer_owns_a_run() -> None:
    # Sites of 2 and 3: three shards (s = 4096 f32); in the site of 2, rank 0 owns shards 0-1
    # and rank 1 shard 2; in the site of 3 each rank owns one.  Every peer takes part in the
    # steps across sites (a peer that only waited there would see no byte move on its own
    # connections for as long as they last, and its transfer watchdog would end the op).
    sites = (0, 0, 1, 1, 1)
    n = 12 * 1024
    inputs = make_inputs(5, n, np.float32, ReduceOp.SUM, seed=3)
    _, sizes = await run_op(inputs, ReduceOp.SUM, None, links=memory_mesh(5, sites=sites)[0])
    s = n // 3 * 4
    half = s // 2                   # a segment's piece: each shard is one segment here, cut in 2
    # rank 0 of the site of 2: step 1 sends shard 2, takes 2 shards; two segments across; step 4
    two_shards = s + 2 * half + 2 * half + 2 * s
    one_shard = 2 * s + half + half + s   # its site mate: sends shards 0-1 and gets them back
    site_of_3 = 2 * s + half + half + 2 * s
    assert sizes == [(two_shards, two_shards), (one_shard, one_shard)] + [(site_of_3, site_of_3)] * 3


def test_site_partners_are_symmetric_and_the_wiring_takes_them() -> None:
    for sites in SHAPES:
        world = len(sites)
        for p in range(world):
            for q in site_partners(p, sites):
                assert q != p and p in site_partners(q, sites)
            assert set(site_partners(p, sites)) <= set(link_partner_positions(p, world, None, sites))
            assert link_partner_positions(p, world, RING, sites) == ()
            assert link_partner_positions(p, world, HIER, sites) == site_partners(p, sites)
    assert site_partners(0, (0, 1, 1, 0, 2, 2)) == (1, 3, 4)        # its site's peer, rank 0 of the others
    # sites of 3 and 2, three shards: rank 2 of the site of 3 owns shard 2, as rank 1 of the
    # site of 2 does; rank 0 of the site of 2 owns shards 0-1, as ranks 0 and 1 of the other
    assert site_partners(2, (0, 0, 0, 1, 1)) == (0, 1, 4)
    assert site_partners(3, (0, 0, 0, 1, 1)) == (0, 1, 4)
    assert site_partners(0, (0, 0, 0, 1, 2)) == ()                   # peers alone in their sites: none
    assert link_partner_positions(0, 8, None, ()) == partner_positions(0, 8)


def test_the_choice_is_a_pure_function_of_the_sites() -> None:
    even = (0, 0, 1, 1, 2, 2, 3, 3)
    for nbytes in (4, 4096, 1 << 20, 256 << 20):
        assert _choose(nbytes, even) is HIER
        assert _choose(nbytes, even, forced=HIER) is HIER
        assert _choose(nbytes, even, forced=HD) is HD                 # another forced algorithm wins
        assert _choose(nbytes, even, quantized=True) is RING
        assert _choose(nbytes, even, site_links=False) is not HIER     # links missing
    assert _choose(4096, (0, 0, 0, 1, 1, 2, 2, 2)) is HIER           # sizes may differ
    lone = (0, 0, 0, 1, 1, 1, 1, 2)                                   # a peer alone in its site
    flat = _choose(4096, ())                                          # 8 peers, no sites
    assert flat is not HIER
    assert _choose(4096, lone) is flat                                # the flat choice, as without sites
    assert _choose(4096, lone, forced=HIER) is RING                  # forced without such sites: the ring
    assert _choose(4096, (), forced=HIER) is RING
    assert _choose(4096, (0, 0, 0, 0, 0, 0, 0, 0)) is flat            # one site
    assert _choose(0, even) is RING                                   # empty


async def test_a_peer_alone_in_its_site_makes_the_flat_algorithm_run() -> None:
    sites = (0, 0, 0, 1, 1, 1, 2)
    inputs = make_inputs(7, 1000, np.float32, ReduceOp.SUM, seed=4)
    outputs, _ = await run_op(inputs, ReduceOp.SUM, None, links=memory_mesh(7, sites=sites)[0])
    assert_bit_identical(outputs)
    assert np.array_equal(outputs[0], ring_reference(inputs, ReduceOp.SUM))


async def test_quantized_ops_take_the_ring_even_with_sites() -> None:
    sites = (0, 0, 1, 1)
    quant = Quantization(dtype=np.uint8)
    inputs = make_inputs(4, 5000, np.float32, ReduceOp.SUM, seed=5)
    links = memory_mesh(4, sites=sites)[0]
    outputs, _ = await run_op(inputs, ReduceOp.SUM, None, links=links, quantization=quant)
    assert_bit_identical(outputs)


@pytest.mark.parametrize(("sites", "breaker", "partner"),
                         [((0, 0, 1, 1), 0, 2), ((0, 0, 1, 1, 2, 2), 3, 2), ((0, 0, 0, 1, 1, 1), 4, 1),
                          ((0, 0, 1, 1, 1), 4, 2)],
                         ids=["across-2x2", "in-site-3x2", "across-2x3", "uneven-2+3"])
async def test_a_partner_link_dying_mid_op_aborts_everyone_and_restores_inputs(
        sites: tuple[int, ...], breaker: int, partner: int) -> None:
    world = len(sites)
    assert partner in site_partners(breaker, sites)
    links, _, streams = memory_mesh(world, sites=sites)
    n = 60_000  # f64: 480 KB, so that the break lands inside a frame
    inputs = make_inputs(world, n, np.float64, ReduceOp.SUM, seed=world)
    originals = [x.copy() for x in inputs]
    stream = streams[breaker][partner]
    stream.break_after = n * 8 // 40  # inside its first frame to that partner

    async def no_trigger(scopes: list[trio.CancelScope]) -> None:
        await trio.sleep(0)

    outcomes = await run_with_master_abort(inputs, links, None, no_trigger)  # type: ignore[arg-type]
    assert stream.broke.is_set()
    assert isinstance(outcomes[breaker], PeerDisconnected), outcomes[breaker]
    expected = hierarchical_reference(originals, ReduceOp.SUM, sites)
    for r in range(world):
        if isinstance(outcomes[r], tuple):  # finished before the abort reached it: its result is whole
            assert np.array_equal(inputs[r].view(np.uint8), expected.view(np.uint8)), f"peer {r}: wrong result"
            continue
        assert outcomes[r] is CANCELLED or isinstance(outcomes[r], PCCLError), (r, outcomes[r])
        assert not isinstance(outcomes[r], BaseExceptionGroup)
        assert np.array_equal(inputs[r].view(np.uint8), originals[r].view(np.uint8)), f"peer {r} not restored"
    # The retry on the same (whole) data gives the model's bits.
    outputs, _ = await run_op(originals, ReduceOp.SUM, None, links=memory_mesh(world, sites=sites)[0], seq=2)
    assert_bit_identical(outputs)
    assert outputs[0].tobytes() == expected.tobytes()


def test_halving_model_is_not_the_hierarchical_one() -> None:
    # The two schedules pin different orders: a test passing with one model would not with the other.
    x = [np.array([v], np.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    assert hierarchical_reference(x, ReduceOp.SUM, (0, 1, 1, 0))[0] != halving_reference(x, ReduceOp.SUM, HD)[0]
