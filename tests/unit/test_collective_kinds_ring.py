"""The data path of reduce-scatter, all-gather (any sizes) and broadcast, N peers in one process.

Each kind runs over in-memory streams (the Trio path) and over real loopback TCP (inline for
small ops, lane threads for large ones, two lanes striped), against a numpy reference: bit for
bit unquantized (the reduce-scatter's fold order is the all-reduce's reference with the ring
rotated by one), within the min-max error bound and bit-identical across peers quantized.
Aborts (a torn stream, a cancel mid-op) restore every in-place input exactly.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives import (
    GatherArgs,
    InputGuard,
    ReduceArgs,
    RingLinks,
    all_gather_checked,
    broadcast_checked,
    reduce_scatter_checked,
    shard_bounds,
)
from pccl.collectives.reference import ring_reference
from pccl.errors import InvalidArgument, PCCLError, PeerDisconnected
from pccl.protocol.ring import gather_bounds
from pccl.types import Quantization, ReduceOp

from test_allreduce_ring import make_inputs, tcp_ring

from pccl.testing import memory_ring

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32, np.int64, np.uint8]
FLOATS = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
#: 8 and 16 bits with one (min, max) per frame; 4 bits with blocks of an odd size (blocks that
#: straddle bytes, frames that end mid-byte); 8 bits in blocks.
QUANTS = [Quantization(dtype=np.uint8), Quantization(dtype=np.uint16), Quantization(dtype="uint4", block=77),
          Quantization(dtype=np.uint8, block=128)]
QUANT_IDS = ["u8", "u16", "u4b77", "u8b128"]
SUB = 4096  # small frames: several per chunk even for small buffers


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def rs_reference(inputs: Sequence[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Chunk c is folded from position c + 1 around the ring: the all-reduce's reference on the
    ring rotated by one."""
    world = len(inputs)
    return ring_reference([inputs[(j + 1) % world] for j in range(world)], op, exchange_max_bytes=0)


async def run_peers(world: int, body: Callable[[int], Any]) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(body, r)


async def reduce_scatter(inputs: Sequence[np.ndarray], op: ReduceOp, links: Sequence[RingLinks], *,
                         quant: Quantization | None = None, in_place: bool = True, seq: int = 1,
                         sub: int = SUB) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    xs = [x.copy() for x in inputs]
    dsts = [x if in_place else np.full_like(x, 7) for x in xs]
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        args = ReduceArgs.check(xs[r], None if in_place else dsts[r], op, quant)
        sizes[r] = await reduce_scatter_checked(args, links=links[r], rank=r, world=world, seq=seq,
                                                max_subchunk_bytes=sub)

    await run_peers(world, peer)
    if not in_place:
        assert all(np.array_equal(_bits(x), _bits(i)) for x, i in zip(xs, inputs)), "src was written"
    return dsts, sizes


async def all_gather(inputs: Sequence[np.ndarray], links: Sequence[RingLinks], *, quant: Quantization | None = None,
                     seq: int = 1, sub: int = SUB) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    counts = [x.size for x in inputs]
    xs = [x.copy() for x in inputs]
    outs = [np.full(sum(counts), 3, inputs[0].dtype) for _ in range(world)]
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        sizes[r] = await all_gather_checked(GatherArgs.check(xs[r], quant), outs[r], counts=counts, links=links[r],
                                            rank=r, world=world, seq=seq, max_subchunk_bytes=sub)

    await run_peers(world, peer)
    assert all(np.array_equal(_bits(x), _bits(i)) for x, i in zip(xs, inputs)), "x was written"
    return outs, sizes


async def broadcast(inputs: Sequence[np.ndarray], root: int, links: Sequence[RingLinks], *,
                    quant: Quantization | None = None, in_place: bool = True, seq: int = 1,
                    sub: int = SUB) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    xs = [x.copy() for x in inputs]
    dsts = [x if in_place else np.full_like(x, 7) for x in xs]
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        args = ReduceArgs.check(xs[r], None if in_place else dsts[r], ReduceOp.SUM, quant)
        sizes[r] = await broadcast_checked(args, root=root, links=links[r], rank=r, world=world, seq=seq,
                                           max_subchunk_bytes=sub)

    await run_peers(world, peer)
    if not in_place:
        assert all(np.array_equal(_bits(x), _bits(i)) for x, i in zip(xs, inputs)), "src was written"
    return dsts, sizes


def quant_bound(values: np.ndarray, quant: Quantization, hops: int) -> float:
    """Min-max error bound: half a step of the global range per quantization, ``hops`` times,
    plus 16-bit rounding."""
    levels = float(2**quant.bits - 1)
    v = values.astype(np.float64)
    spread = float(v.max() - v.min()) if v.size else 0.0
    return hops * spread / levels + 2 ** -7 * float(np.abs(v).max(initial=0.0)) + 1e-12


# --- reduce-scatter ------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_reduce_scatter_matches_the_reference(world: int, dtype: Any) -> None:
    seq = 0
    for op in ReduceOp:
        for n in (0, world - 1, 5000):  # empty, tiny (count < world), several frames per chunk
            for in_place in (True, False):
                seq += 1
                inputs = make_inputs(world, n, dtype, op, seed=seq)
                links, _ = memory_ring(world)
                outs, sizes = await reduce_scatter(inputs, op, links, in_place=in_place, seq=seq)
                expected = rs_reference(inputs, op)
                covered = np.zeros(n, int)
                for r in range(world):
                    a, b = shard_bounds(n, world, r)
                    covered[a:b] += 1
                    assert np.array_equal(_bits(outs[r][a:b]), _bits(expected[a:b])), (op, n, in_place, r)
                assert (covered == 1).all()  # the owned slices cover every element exactly once
                assert sum(tx for tx, _ in sizes) == sum(rx for _, rx in sizes)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
async def test_reduce_scatter_quantized_within_the_bound(world: int, quant: Quantization, dtype: Any) -> None:
    for seq, op in enumerate((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX), 1):
        inputs = make_inputs(world, 6000, dtype, op, seed=seq)
        links, _ = memory_ring(world)
        outs, _ = await reduce_scatter(inputs, op, links, quant=quant, seq=seq)
        exact = rs_reference([x.astype(np.float64) for x in inputs], op)
        partial_range = sum(np.abs(x.astype(np.float64)) for x in inputs)
        for r in range(world):
            a, b = shard_bounds(6000, world, r)
            bound = quant_bound(np.concatenate([partial_range, -partial_range]), quant, world - 1)
            err = np.abs(outs[r][a:b].astype(np.float64) - exact[a:b]).max()
            assert err <= bound, (op, r, err, bound)


# --- all-gather ----------------------------------------------------------------------------------


def gather_counts(world: int) -> list[list[int]]:
    return [[0] * world, [1] * world, [2000] * world, [3000, 0, 17, 1][:world], [0, 4001, 5, 9000][:world]]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_all_gather_layout_of_any_sizes(world: int, dtype: Any) -> None:
    for seq, counts in enumerate(gather_counts(world), 1):
        inputs = [make_inputs(1, c, dtype, ReduceOp.SUM, seed=seq * 10 + p)[0] for p, c in enumerate(counts)]
        links, _ = memory_ring(world)
        outs, sizes = await all_gather(inputs, links, seq=seq)
        expected = np.concatenate(inputs)
        for r in range(world):
            assert np.array_equal(_bits(outs[r]), _bits(expected)), (counts, r)
            for p, (a, b) in enumerate(gather_bounds(counts)):
                assert np.array_equal(_bits(outs[r][a:b]), _bits(inputs[p]))
        item = np.dtype(dtype).itemsize
        assert [rx for _, rx in sizes] == [(sum(counts) - counts[r]) * item for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
async def test_all_gather_quantized_is_bit_identical_everywhere(world: int, quant: Quantization, dtype: Any) -> None:
    counts = [5000, 0, 3, 7000][:world]
    inputs = [make_inputs(1, c, dtype, ReduceOp.SUM, seed=p)[0] for p, c in enumerate(counts)]
    links, _ = memory_ring(world)
    outs, _ = await all_gather(inputs, links, quant=quant)
    for r in range(world):
        assert np.array_equal(_bits(outs[r]), _bits(outs[0]))  # the source's own slot included
    for p, (a, b) in enumerate(gather_bounds(counts)):
        if b > a:
            err = np.abs(outs[0][a:b].astype(np.float64) - inputs[p].astype(np.float64)).max()
            assert err <= quant_bound(inputs[p], quant, 1)


async def test_all_gather_argument_checks() -> None:
    links, _ = memory_ring(2)
    x = np.ones(4, np.float32)
    with pytest.raises(InvalidArgument):
        GatherArgs.check(np.ones(4, np.int32), Quantization(dtype=np.uint8))
    with pytest.raises(InvalidArgument):
        GatherArgs.check(x, "min-max")
    bad: list[tuple[list[int], np.ndarray]] = [
        ([3, 4], np.zeros(7, np.float32)),  # counts[rank] != src.size
        ([4, 4], np.zeros(7, np.float32)),  # out too small
        ([4, 4], np.zeros(8, np.float64)),  # wrong dtype
        ([4], np.zeros(4, np.float32)),  # one count per position
    ]
    for seq, (counts, out) in enumerate(bad, 1):
        with pytest.raises(InvalidArgument):
            await all_gather_checked(GatherArgs.check(x, None), out, counts=counts, links=links[0], rank=0, world=2,
                                     seq=seq)
    # the input may be its own slot of the output: nothing to copy
    out = np.zeros(8, np.float32)
    outs = [out, np.zeros(8, np.float32)]
    mine = [out[0:4], np.arange(4, dtype=np.float32)]
    mine[0][:] = 1

    async def peer(r: int) -> None:
        await all_gather_checked(GatherArgs.check(mine[r], None), outs[r], counts=[4, 4], links=links[r], rank=r,
                                 world=2, seq=10)

    await run_peers(2, peer)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], [1, 1, 1, 1, 0, 1, 2, 3])


# --- broadcast -----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
async def test_broadcast_from_every_root(world: int, dtype: Any) -> None:
    seq = 0
    for root in range(world):
        for n in (0, 1, 20_000):
            for in_place in (True, False):
                seq += 1
                inputs = make_inputs(world, n, dtype, ReduceOp.SUM, seed=seq)
                links, _ = memory_ring(world)
                outs, sizes = await broadcast(inputs, root, links, in_place=in_place, seq=seq)
                for r in range(world):
                    assert np.array_equal(_bits(outs[r]), _bits(inputs[root])), (root, n, in_place, r)
                nbytes = inputs[0].nbytes
                last = (root - 1) % world
                assert sizes[root] == (nbytes, 0) and sizes[last][0] == 0
                assert all(rx == nbytes for r, (_, rx) in enumerate(sizes) if r != root)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("quant", QUANTS, ids=QUANT_IDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: np.dtype(d).name)
async def test_broadcast_quantized_is_bit_identical_root_included(world: int, quant: Quantization, dtype: Any) -> None:
    for root in range(world):
        for in_place in (True, False):
            inputs = make_inputs(world, 9000, dtype, ReduceOp.SUM, seed=root)
            links, _ = memory_ring(world)
            outs, _ = await broadcast(inputs, root, links, quant=quant, in_place=in_place)
            for r in range(world):
                assert np.array_equal(_bits(outs[r]), _bits(outs[root]))
            err = np.abs(outs[root].astype(np.float64) - inputs[root].astype(np.float64)).max()
            assert err <= quant_bound(inputs[root], quant, 1)


# --- real TCP: inline (small), lane threads (large), two lanes ----------------------------------


@pytest.mark.parametrize("world", [2, 3])
async def test_every_kind_over_tcp_on_both_paths(world: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import pccl.collectives.execute as execute_module

    ran: list[str] = []
    real = execute_module.suits_inline

    def recorded(op: Any) -> bool:
        inline = real(op)
        ran.append("inline" if inline else "threads")
        return inline

    monkeypatch.setattr(execute_module, "suits_inline", recorded)
    links = await tcp_ring(world, lanes=2)
    seq = 0
    try:
        for n, path in ((3000, "inline"), (300_000, "threads")):  # 12 KB / 1.2 MB of float32
            for quant in (None, Quantization(dtype=np.uint8), Quantization(dtype="uint4", block=128)):
                ran.clear()
                seq += 1
                inputs = make_inputs(world, n, np.float32, ReduceOp.SUM, seed=seq)
                outs, _ = await reduce_scatter(inputs, ReduceOp.AVG, links, quant=quant, seq=seq, sub=1 << 20)
                expected = rs_reference(inputs, ReduceOp.AVG)
                for r in range(world):
                    a, b = shard_bounds(n, world, r)
                    if quant is None:
                        assert np.array_equal(outs[r][a:b], expected[a:b])
                    else:
                        spread = sum(np.abs(x) for x in inputs)
                        bound = quant_bound(np.concatenate([spread, -spread]), quant, world - 1)
                        assert np.abs(outs[r][a:b] - expected[a:b]).max() <= bound
                seq += 1
                counts = [n, n // 3 + 1, 0][:world]
                parts = [make_inputs(1, c, np.float32, ReduceOp.SUM, seed=p)[0] for p, c in enumerate(counts)]
                gathered, _ = await all_gather(parts, links, quant=quant, seq=seq, sub=1 << 20)
                assert all(np.array_equal(g, gathered[0]) for g in gathered)
                if quant is None:
                    assert np.array_equal(gathered[0], np.concatenate(parts))
                for root in range(world):
                    seq += 1
                    got, _ = await broadcast(inputs, root, links, quant=quant, seq=seq, sub=1 << 20)
                    assert all(np.array_equal(g, got[root]) for g in got)
                    if quant is None:
                        assert np.array_equal(got[root], inputs[root])
                assert set(ran) == {path}, (n, ran)
    finally:
        for link in links:
            await link.aclose()


# --- aborts --------------------------------------------------------------------------------------


async def _run_aborting(kind: str, inputs: Sequence[np.ndarray], links: Sequence[RingLinks], *, root: int = 0,
                        quant: Quantization | None = None, trigger: Callable[[list[trio.CancelScope]], Any],
                        sub: int = SUB, guarded: bool = False, held: int | None = None) -> list[Any]:
    """Run an in-place op on every peer; the first failure cancels every other peer (the
    master's Abort).  Returns each peer's outcome (an exception, "cancelled" or the sizes).
    ``guarded``: every peer passes the backup of an InputGuard, as the communicator does, and
    the abort restores every input from it afterwards, a peer that had finished included.
    ``held``: that peer never starts the op (it waits, in its scope, to be cancelled), so the
    peers that need its data cannot finish before the trigger cancels."""
    world = len(inputs)
    guards = [InputGuard(ReduceArgs.check(x, None, ReduceOp.SUM, quant)) for x in inputs] if guarded else None
    scopes = [trio.CancelScope() for _ in range(world)]
    outcomes: list[Any] = [None] * world

    async def peer(r: int) -> None:
        try:
            with scopes[r]:
                if r == held:
                    await trio.sleep_forever()
                args = ReduceArgs.check(inputs[r], None, ReduceOp.SUM, quant)
                common: dict[str, Any] = dict(links=links[r], rank=r, world=world, seq=1, max_subchunk_bytes=sub,
                                              backup=guards[r].backup if guards else None)
                if kind == "reduce-scatter":
                    outcomes[r] = await reduce_scatter_checked(args, **common)
                else:
                    outcomes[r] = await broadcast_checked(args, root=root, **common)
                return
        except PCCLError as exc:
            outcomes[r] = exc
            for s in scopes:
                s.cancel()
        if scopes[r].cancelled_caught:
            outcomes[r] = "cancelled"
            for s in scopes:
                s.cancel()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
            nursery.start_soon(trigger, scopes)
    for guard in guards or ():
        guard.restore()  # the master's abort reaches every peer, finished or not
        guard.drop()
    return outcomes


async def _no_trigger(scopes: list[trio.CancelScope]) -> None:
    await trio.sleep(0)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("case", ["rs", "rs-f16", "rs-u8", "bcast", "bcast-u8"])
async def test_a_torn_stream_restores_every_input(world: int, case: str) -> None:
    kind = "reduce-scatter" if case.startswith("rs") else "broadcast"
    dtype = np.float16 if case == "rs-f16" else np.float32
    quant = Quantization(dtype=np.uint8) if case.endswith("u8") else None
    links, raw = memory_ring(world)
    inputs = make_inputs(world, 60_000, dtype, ReduceOp.SUM, seed=world)
    originals = [x.copy() for x in inputs]
    # RS: the last peer -> peer 0 dies mid-op; broadcast: the root (0) -> peer 1, after a few frames
    torn = raw[world - 1][0] if kind == "reduce-scatter" else raw[0][0]
    torn.break_after = 30_000
    outcomes = await _run_aborting(kind, inputs, links, quant=quant, trigger=_no_trigger)
    assert torn.broke.is_set()
    assert any(isinstance(o, PeerDisconnected) for o in outcomes)
    for r in range(world):
        assert outcomes[r] == "cancelled" or isinstance(outcomes[r], PCCLError), (r, outcomes[r])
        assert np.array_equal(_bits(inputs[r]), _bits(originals[r])), f"peer {r} not restored"


@pytest.mark.parametrize("case", ["rs", "rs-u8", "bcast", "bcast-u8"])
def test_cancel_mid_op_on_lane_threads_restores_the_input(case: str) -> None:
    kind = "reduce-scatter" if case.startswith("rs") else "broadcast"
    quant = Quantization(dtype=np.uint8) if case.endswith("u8") else None
    world = 3

    async def main() -> None:
        links = await tcp_ring(world, lanes=2)
        try:
            inputs = make_inputs(world, 1 << 20, np.float32, ReduceOp.SUM, seed=5)  # 4 MiB each
            originals = [x.copy() for x in inputs]
            threshold = (1 << 20) // (4 if quant is not None else 1)

            async def cancel_when_busy(scopes: list[trio.CancelScope]) -> None:
                # Once data moves from peer 0 to peer 1, cancel the held peer 2; the others
                # follow (the master's abort) while their lane threads are mid-op: a
                # reduce-scatter's peers 0 and 1 cannot finish without peer 2's data.
                while sum(c.statistics().data_bytes_sent for c in links[0].to_next) < threshold:
                    await trio.sleep(0.001)
                scopes[2].cancel()

            outcomes = await _run_aborting(kind, inputs, links, quant=quant, trigger=cancel_when_busy,
                                           sub=256 * 1024, guarded=True, held=2)
            assert outcomes[2] == "cancelled"
            if kind == "reduce-scatter":
                # Peers 0 and 1 cannot finish without peer 2's data.  Each ends cancelled, or
                # with the disconnect of a neighbour whose abort closed its connections first
                # (a lane thread sees the closed socket before its own cancellation lands).
                for r in (0, 1):
                    assert outcomes[r] == "cancelled" or isinstance(outcomes[r], PeerDisconnected), outcomes
            for r in range(world):
                # A peer may have finished before the abort reached it (the root of a broadcast,
                # or a reduce-scatter peer whose last chunk arrived before peer 1 was cancelled);
                # the master's abort restores its input all the same.
                if not isinstance(outcomes[r], tuple):
                    assert outcomes[r] == "cancelled" or isinstance(outcomes[r], PCCLError), (r, outcomes[r])
                assert np.array_equal(inputs[r], originals[r]), f"peer {r} not restored"
        finally:
            for link in links:
                await link.aclose()

    trio.run(main)
    assert not [t for t in threading.enumerate() if t.name == "pccl-ring-lane"]


async def test_bad_positions_are_invalid_before_anything_moves_and_retire_the_seq() -> None:
    links, _ = memory_ring(2)
    args = ReduceArgs.check(np.ones(8, np.float32), None, ReduceOp.SUM, None)
    calls: list[Callable[[int], Any]] = [
        lambda seq: reduce_scatter_checked(args, links=links[0], rank=2, world=2, seq=seq),
        lambda seq: reduce_scatter_checked(args, links=links[0], rank=0, world=1, seq=seq),
        lambda seq: broadcast_checked(args, root=2, links=links[0], rank=0, world=2, seq=seq),
        lambda seq: broadcast_checked(args, root=0, links=links[0], rank=-1, world=2, seq=seq),
        lambda seq: all_gather_checked(GatherArgs.check(np.ones(8, np.float32), None), np.zeros(16, np.float32),
                                       counts=[8, 8], links=links[0], rank=0, world=1, seq=seq),
    ]
    for seq, call in enumerate(calls, 1):
        with pytest.raises(InvalidArgument):
            await call(seq)
        assert links[0].registry.is_retired(seq)
    assert np.array_equal(args.dst, np.ones(8, np.float32))
    with pytest.raises(InvalidArgument):
        ReduceArgs.check(np.ones(8, np.int32), None, ReduceOp.SUM, Quantization(dtype=np.uint8))


def test_shard_bounds_are_the_chunks() -> None:
    assert [shard_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [shard_bounds(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    with pytest.raises(ValueError):
        shard_bounds(10, 4, 4)


async def test_half_dtypes_on_lane_threads() -> None:
    world = 2
    links = await tcp_ring(world, lanes=2)
    try:
        seq = 0
        for dtype, quant in ((np.float16, None), (ml_dtypes.bfloat16, Quantization(dtype=np.uint16))):
            inputs = make_inputs(world, 300_000, dtype, ReduceOp.SUM, seed=seq)  # 600 KB: lane threads
            seq += 1
            outs, _ = await reduce_scatter(inputs, ReduceOp.AVG, links, quant=quant, seq=seq, sub=1 << 18)
            if quant is None:
                expected = rs_reference(inputs, ReduceOp.AVG)
                for r in range(world):
                    a, b = shard_bounds(300_000, world, r)
                    assert np.array_equal(_bits(outs[r][a:b]), _bits(expected[a:b]))
            seq += 1
            gathered, _ = await all_gather(inputs, links, quant=quant, seq=seq, sub=1 << 18)
            assert all(np.array_equal(_bits(g), _bits(gathered[0])) for g in gathered)
            seq += 1
            got, _ = await broadcast(inputs, 1, links, quant=quant, seq=seq, sub=1 << 18)
            assert all(np.array_equal(_bits(g), _bits(got[1])) for g in got)
            if quant is None:
                assert np.array_equal(_bits(gathered[0]), _bits(np.concatenate(inputs)))
                assert np.array_equal(_bits(got[0]), _bits(inputs[1]))
    finally:
        for link in links:
            await link.aclose()


@pytest.mark.parametrize("kind", ["reduce-scatter", "broadcast"])
async def test_a_tcp_peer_vanishing_mid_op_restores_every_input(kind: str) -> None:
    world = 3
    links = await tcp_ring(world, lanes=1)
    # 8 MB each, and peer 2 never reads: peers 0 and 1 cannot finish, whatever the schedule,
    # because two hops of same-host socket buffers (~1 MiB each) hold far less.  (With 1.6 MB
    # and peer 2 reading, a broadcast could finish before the trigger first ran.)
    inputs = make_inputs(world, 2_000_000, np.float32, ReduceOp.SUM, seed=1)
    originals = [x.copy() for x in inputs]

    async def kill_peer_1(scopes: list[trio.CancelScope]) -> None:
        while links[0].to_next[0].statistics().data_bytes_sent < 200_000:
            await trio.sleep(0.001)
        links[1].abort()  # its connections reset, like a SIGKILL

    try:
        outcomes = await _run_aborting(kind, inputs, links, trigger=kill_peer_1, sub=64 * 1024, guarded=True, held=2)
    finally:
        for link in links:
            await link.aclose()
    # No peer can have finished; the first to notice the vanished peer ends with a pccl error
    # (which one depends on the schedule), the others with it or cancelled by it.
    assert any(isinstance(o, PCCLError) for o in outcomes), outcomes
    assert all(o == "cancelled" or isinstance(o, PCCLError) for o in outcomes), outcomes
    for r in range(world):
        assert np.array_equal(inputs[r], originals[r]), f"peer {r} not restored"


@pytest.mark.parametrize("world", [2, 3])
async def test_striped_over_two_memory_lanes(world: int) -> None:
    inputs = make_inputs(world, 50_000, np.float64, ReduceOp.MIN, seed=world)
    outs, _ = await reduce_scatter(inputs, ReduceOp.MIN, memory_ring(world, lanes=2)[0])
    expected = rs_reference(inputs, ReduceOp.MIN)
    for r in range(world):
        a, b = shard_bounds(50_000, world, r)
        assert np.array_equal(outs[r][a:b], expected[a:b])
    parts = [x[: 1000 * (p + 1)] for p, x in enumerate(inputs)]
    gathered, _ = await all_gather(parts, memory_ring(world, lanes=2)[0])
    assert all(np.array_equal(g, np.concatenate(parts)) for g in gathered)
    got, _ = await broadcast(inputs, world - 1, memory_ring(world, lanes=2)[0], quant=QUANTS[0])
    assert all(np.array_equal(_bits(g), _bits(got[world - 1])) for g in got)
