"""pccl.collectives.halving: recursive doubling and Rabenseifner's halving-doubling all-reduce,
N peers as trio tasks over in-memory partner links (:func:`pccl.testing.memory_mesh`).

Results must equal the numpy model of the algorithm's reduction tree
(:func:`pccl.collectives.reference.halving_reference`) bit for bit, and be bit-identical on
every peer, for every dtype and op, powers of two and not (the fold).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives import InputBackup, KernelRunner, RingLinks, ring_all_reduce
from pccl.collectives.reference import halving_reference, ring_reference
from pccl.errors import InvalidUsage, PCCLError, PeerDisconnected
from pccl.protocol.algorithms import (
    HALVING_MAX_BYTES,
    MIN_WORLD,
    AllReduceAlgorithm,
    choose_all_reduce,
    fold_partner,
    largest_frame,
    parse_algorithm,
    partner_positions,
    position_of,
    virtual_rank,
)
from pccl.protocol.codec import MAX_DATA_PAYLOAD
from pccl.types import Quantization, ReduceOp

from fp_mode import flush_denormals, needs_sse_modes

from pccl.testing import memory_mesh, memory_ring

RD, HD, RING = AllReduceAlgorithm.RECURSIVE_DOUBLING, AllReduceAlgorithm.HALVING_DOUBLING, AllReduceAlgorithm.RING
ALGORITHMS = [RD, HD]
ALL_DTYPES = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]
WORLDS = [2, 3, 4, 5, 6, 7, 8, 9, 16]


def make_inputs(world: int, n: int, dtype: Any, op: ReduceOp, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        hi = 4 if op is ReduceOp.PROD else min(int(info.max), 1000)
        lo = -hi if dt.kind == "i" else 0
        return [rng.integers(lo, hi, n, endpoint=True).astype(dt) for _ in range(world)]
    scale = 1.5 if op is ReduceOp.PROD else 100.0
    return [(rng.standard_normal(n) * scale).astype(dt) for _ in range(world)]


async def run_op(inputs: Sequence[np.ndarray], op: ReduceOp, algorithm: AllReduceAlgorithm | None, *,
                 in_place: bool = True, links: Sequence[RingLinks] | None = None, seq: int = 1,
                 quantization: Quantization | None = None) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    if links is None:
        links, _, _ = memory_mesh(world)
    outputs = [x.copy() for x in inputs]
    recvs = [None if in_place else np.full_like(x, 7) for x in inputs]
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        sizes[r] = await ring_all_reduce(outputs[r], recvs[r], op=op, links=links[r], rank=r, world=world, seq=seq,
                                         quantization=quantization, algorithm=algorithm)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    if not in_place:
        for r in range(world):
            assert np.array_equal(outputs[r].view(np.uint8), inputs[r].view(np.uint8)), "send was modified"
        return recvs, sizes  # type: ignore[return-value]
    return outputs, sizes


def assert_bit_identical(outputs: Sequence[np.ndarray]) -> None:
    for r, out in enumerate(outputs[1:], 1):
        assert out.view(np.uint8).tobytes() == outputs[0].view(np.uint8).tobytes(), f"peer {r} differs from peer 0"


# --- the fold and the partners ------------------------------------------------------------------


@pytest.mark.parametrize("world", [*range(1, 20), 64, 100, 256])
def test_virtual_ranks_are_the_ring_order_of_the_non_folding_peers(world: int) -> None:
    ranks = [virtual_rank(p, world) for p in range(world)]
    taking = [v for v in ranks if v is not None]
    size = 1 << (world.bit_length() - 1)
    assert taking == list(range(size))  # ascending with the ring position
    for p, v in enumerate(ranks):
        if v is not None:
            assert position_of(v, world) == p
        partner = fold_partner(p, world)
        if v is None:  # folds into the next position, which folds back
            assert partner == p + 1 and fold_partner(p + 1, world) == p
    for p in range(world):  # partner links are symmetric
        for q in partner_positions(p, world):
            assert p in partner_positions(q, world) and q != p


def test_partners_are_log2_of_the_world() -> None:
    assert partner_positions(0, 64) == (1, 2, 4, 8, 16, 32)
    assert partner_positions(5, 8) == (1, 4, 7)
    assert partner_positions(0, 5) == (1,)  # folds into position 1
    assert partner_positions(1, 5) == (0, 2, 3)


# --- correctness: the model, bit for bit ---------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("world", WORLDS)
async def test_every_op_and_dtype_matches_the_model_and_is_bit_identical(algorithm: AllReduceAlgorithm,
                                                                         world: int) -> None:
    links, _, _ = memory_mesh(world)  # one set of links for every op: seqs keep them apart
    seq = 0
    for d, dtype in enumerate(ALL_DTYPES):
        for i, op in enumerate(ReduceOp):
            # an odd size (uneven blocks), and fewer elements than peers (empty blocks)
            for n in (37, 3):
                seq += 1
                inputs = make_inputs(world, n, dtype, op, seed=world * 1000 + d * 10 + i)
                outputs, _ = await run_op(inputs, op, algorithm, in_place=seq % 2 == 0, links=links, seq=seq)
                assert_bit_identical(outputs)
                expected = halving_reference(inputs, op, algorithm)
                assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), (
                    np.dtype(dtype).name, op, n)


def test_the_model_is_the_sum() -> None:
    # the model itself against plain arithmetic (integers: exact)
    inputs = make_inputs(7, 100, np.int64, ReduceOp.SUM, seed=1)
    for algorithm in ALGORITHMS:
        assert np.array_equal(halving_reference(inputs, ReduceOp.SUM, algorithm), sum(inputs))
        assert np.array_equal(halving_reference(inputs, ReduceOp.AVG, algorithm), sum(inputs) // 7)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("world", [3, 4, 6])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_half_precision_accumulates_in_f32(algorithm: AllReduceAlgorithm, world: int, dtype: Any) -> None:
    # 1 + world * 2**-12: every 2**-12 is lost when rounded to 16 bits per combination
    inputs = [np.full(64, 2.0**-12, dtype) for _ in range(world)]
    inputs[0][:] = 1.0
    outputs, _ = await run_op(inputs, ReduceOp.SUM, algorithm)
    expected = np.float32(1.0) + np.float32(2.0**-12) * (world - 1)
    assert_bit_identical(outputs)
    assert np.array_equal(outputs[0], np.full(64, expected).astype(dtype))


_QUIET_NAN_BITS = {np.dtype(np.float32): (np.uint32, 0x7FC00000), np.dtype(np.float16): (np.uint16, 0x7E00),
                   np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7FC0)}


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("world", [4, 5])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_nan_payloads_end_bit_identical(algorithm: AllReduceAlgorithm, world: int, op: ReduceOp,
                                              dtype: Any) -> None:
    # Every peer computes its own NaNs (each at its own alignment): payloads are made canonical.
    bits, quiet = _QUIET_NAN_BITS[np.dtype(dtype)]
    inputs = [np.full(1001, quiet + r + 1, bits).view(dtype) for r in range(world)]
    for in_place in (True, False):
        outputs, _ = await run_op(inputs, op, algorithm, in_place=in_place)
        assert_bit_identical(outputs)
        assert np.all(outputs[0].view(bits) == quiet)


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("world", [4, 6, 9])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=lambda d: np.dtype(d).name)
async def test_signed_zeros_end_bit_identical(algorithm: AllReduceAlgorithm, world: int, op: ReduceOp,
                                              dtype: Any) -> None:
    # MIN/MAX of +0 and -0 keep one operand of an equal pair: both partners must keep the same.
    inputs = [np.full(100, -0.0 if r % 2 else 0.0, dtype) for r in range(world)]
    outputs, _ = await run_op(inputs, op, algorithm)
    assert_bit_identical(outputs)
    expected = halving_reference(inputs, op, algorithm)
    assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()


@needs_sse_modes
@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_results_are_ieee_whatever_the_callers_flush_to_zero_mode(algorithm: AllReduceAlgorithm,
                                                                       dtype: Any) -> None:
    world = 5
    inputs = [np.full(100, (r + 1) * 3e-39, np.float32).astype(dtype) for r in range(world)]
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        expected = halving_reference(inputs, op, algorithm)
        assert np.any(expected.astype(np.float32) != 0.0)
        with flush_denormals():
            outputs, _ = await run_op(inputs, op, algorithm)
        assert_bit_identical(outputs)
        assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()


@pytest.mark.parametrize("world", [4, 8, 5])
async def test_bytes_moved(world: int) -> None:
    n = 1024  # f32: 4 KiB
    inputs = make_inputs(world, n, np.float32, ReduceOp.SUM, seed=2)
    _, rd = await run_op(inputs, ReduceOp.SUM, RD)
    _, hd = await run_op(inputs, ReduceOp.SUM, HD)
    size = 1 << (world.bit_length() - 1)
    steps = size.bit_length() - 1
    for r in range(world):
        if virtual_rank(r, world) is None:  # folds its input in, takes the result back
            assert rd[r] == hd[r] == (n * 4, n * 4)
            continue
        fold = n * 4 if fold_partner(r, world) is not None else 0
        assert rd[r] == (steps * n * 4 + fold, steps * n * 4 + fold)
        # Rabenseifner: (P - 1)/P of the buffer each way in each phase (blocks of n/P here)
        assert hd[r] == (2 * (size - 1) * n // size * 4 + fold, 2 * (size - 1) * n // size * 4 + fold)


async def test_concurrent_ops_share_the_links() -> None:
    # Concurrent ops over the partner links need their order: recorded as commenced (as the
    # communicator does), whatever order the tasks start in, they take turns by seq.
    world = 6
    links, _, _ = memory_mesh(world)
    cases = [(RD, ReduceOp.SUM, np.float32), (HD, ReduceOp.MAX, np.int32), (RD, ReduceOp.AVG, np.float16),
             (HD, ReduceOp.SUM, np.float64)]
    results: dict[int, list[np.ndarray]] = {}
    for peer in links:
        for seq in range(1, 2 * len(cases) + 1):
            peer.registry.commenced(seq)

    async def one(seq: int, algorithm: AllReduceAlgorithm, op: ReduceOp, dtype: Any) -> None:
        inputs = make_inputs(world, 500, dtype, op, seed=seq)
        outputs, _ = await run_op(inputs, op, algorithm, links=links, seq=seq)
        assert_bit_identical(outputs)
        assert np.array_equal(outputs[0].view(np.uint8), halving_reference(inputs, op, algorithm).view(np.uint8))
        results[seq] = outputs

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for seq, case in reversed(list(enumerate(cases * 2, 1))):  # started highest seq first
                nursery.start_soon(one, seq, *case)
    assert len(results) == 2 * len(cases)


async def test_an_uncommenced_op_beside_another_on_the_partner_links_is_refused() -> None:
    # Ops nobody recorded as commenced have no order known to be the same on every peer: run
    # beside each other on the partner links they could each wait behind the other's frames
    # (4 of 30 random-order runs hung).  The second one is refused at once instead.
    world = 4
    links, _, _ = memory_mesh(world)
    first = np.ones(64, np.float32)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            # peer 0's op 1 holds the partner turn, waiting for partners that never come
            nursery.start_soon(lambda: ring_all_reduce(first, op=ReduceOp.SUM, links=links[0], rank=0, world=world,
                                                       seq=1, algorithm=RD))
            turns = links[0].partner_turns
            assert turns is not None
            while not turns.running:
                await trio.sleep(0)
            second = np.arange(64, dtype=np.float32)
            with pytest.raises(InvalidUsage, match="seq 2 .* not recorded as commenced"):
                await ring_all_reduce(second, op=ReduceOp.SUM, links=links[0], rank=0, world=world, seq=2,
                                      algorithm=RD)
            assert np.array_equal(second, np.arange(64, dtype=np.float32))  # untouched
            nursery.cancel_scope.cancel()
    assert turns.running == 0 and np.array_equal(first, np.ones(64, np.float32))  # restored on cancel


async def test_commenced_ops_take_turns_in_seq_order_whatever_order_each_peer_starts_them() -> None:
    # As the communicator does: every peer records the Commences in seq order; each peer then
    # reaches the data path of the ops in its own order, and the two algorithms (partners in
    # opposite orders) alternate.  Every op completes, one at a time on each peer's partner links.
    world, ops = 8, 6
    links, _, _ = memory_mesh(world)
    for peer in links:
        for seq in range(1, ops + 1):
            peer.registry.commenced(seq)
    inputs = {seq: make_inputs(world, 3000, np.float32, ReduceOp.SUM, seed=seq) for seq in range(1, ops + 1)}
    outputs = {seq: [x.copy() for x in xs] for seq, xs in inputs.items()}
    most = [0] * world

    async def one(r: int, seq: int) -> None:
        await ring_all_reduce(outputs[seq][r], op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=seq,
                              algorithm=RD if seq % 2 else HD)

    async def watch() -> None:
        while True:
            for r, peer in enumerate(links):
                assert peer.partner_turns is not None
                most[r] = max(most[r], peer.partner_turns.running)
            await trio.sleep(0)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as peers:
                for r in range(world):
                    order = list(range(1, ops + 1))
                    order = order[r % ops:] + order[: r % ops]  # each peer its own order
                    for seq in order:
                        peers.start_soon(one, r, seq)
            nursery.cancel_scope.cancel()
    assert most == [1] * world
    for seq in range(1, ops + 1):
        assert_bit_identical(outputs[seq])
        expected = halving_reference(inputs[seq], ReduceOp.SUM, RD if seq % 2 else HD)
        assert outputs[seq][0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes()


async def test_empty_buffer_moves_nothing() -> None:
    outputs, sizes = await run_op([np.zeros(0, np.float32)] * 5, ReduceOp.SUM, HD)
    assert sizes == [(0, 0)] * 5


# --- the choice ----------------------------------------------------------------------------------


def _choose(nbytes: int, world: int, **kw: Any) -> AllReduceAlgorithm:
    args: dict[str, Any] = dict(itemsize=4, acc_itemsize=4, quantized=False, segmented=False, partner_links=True,
                                exchange_max_bytes=256 * 1024)
    args.update(kw)
    return choose_all_reduce(nbytes, world, **args)


def test_the_choice_follows_the_documented_table() -> None:
    # docs/collectives.rst shows this table
    for world in range(2, MIN_WORLD):
        assert _choose(4096, world) is RING and _choose(1 << 20, world) is RING
    assert _choose(4096, 8) is RD and _choose(4096, 16) is RD and _choose(4096, 64) is RD
    assert _choose(256 << 10, 9) is RD and _choose(1 << 20, 9) is RING  # the fold moves the buffer twice more
    assert _choose(1 << 20, 8) is HD and _choose(1 << 20, 16) is HD and _choose(16 << 20, 64) is HD
    assert _choose(16 << 20, 8) is RING and _choose(16 << 20, 16) is RING
    assert _choose(HALVING_MAX_BYTES + 4, 256) is RING
    # f16/bf16 partials travel as f32: recursive doubling stops earlier
    assert _choose(128 << 10, 64) is RD and _choose(128 << 10, 64, itemsize=2, acc_itemsize=4) is HD


#: The worlds docs/collectives.rst's table has a row for.
DOCUMENTED = [8, 9, 12, 15, 16, 64, 256]
DOCS = Path(__file__).resolve().parents[2] / "docs" / "collectives.rst"


def _first_size_taking(world: int, algorithm: AllReduceAlgorithm, lo: int, hi: int) -> int:
    """The smallest float32 size in bytes in ``(lo, hi]`` the choice gives ``algorithm`` (it
    gives it at ``hi`` and not at ``lo``, and the choice changes once in between)."""
    while hi - lo > 4:
        mid = (lo + hi) // 8 * 4
        lo, hi = (lo, mid) if _choose(mid, world) is algorithm else (mid, hi)
    return hi


@pytest.mark.parametrize("world", DOCUMENTED)
def test_the_thresholds_are_the_documented_ones(world: int) -> None:
    # The choice moves once from recursive doubling to Rabenseifner, then once to the ring ...
    changes = []
    previous = None
    for kib in range(4, 70_000, 4):
        algorithm = _choose(kib * 1024, world)
        if algorithm is not previous:
            changes.append((kib, algorithm))
            previous = algorithm
    assert [a for _, a in changes] == [RD, HD, RING]
    # ... at the byte sizes docs/collectives.rst's table states (KiB to one decimal).
    halving = _first_size_taking(world, HD, (changes[1][0] - 4) * 1024, changes[1][0] * 1024)
    ring = _first_size_taking(world, RING, (changes[2][0] - 4) * 1024, changes[2][0] * 1024)
    assert _choose(halving - 4, world) is RD and _choose(ring - 4, world) is HD
    if ring - 4 == HALVING_MAX_BYTES:
        upper = "Rabenseifner up to 64 MiB"
    else:
        upper = f"Rabenseifner below {ring / 1024:.1f} KiB"
    row = f"* - {world}\n     - recursive doubling below {halving / 1024:.1f} KiB, {upper}, the ring above"
    assert row in DOCS.read_text(), row


def test_the_choice_never_takes_what_cannot_run() -> None:
    for forced in (None, RD, HD):
        assert _choose(4096, 64, quantized=True, forced=forced) is RING
        assert _choose(4096, 64, segmented=True, forced=forced) is RING
        assert _choose(4096, 64, partner_links=False, forced=forced) is RING
        assert _choose(0, 64, forced=forced) is RING
    assert _choose(4096, 2, forced=HD) is HD and _choose(64 << 20, 3, forced=RD) is RD
    assert _choose(4096, 64, forced=RING) is RING


def test_a_forced_algorithm_whose_frames_would_not_fit_the_wire_takes_the_ring() -> None:
    # halving.py sends each step's range as one data frame, whose payload is at most
    # MAX_DATA_PAYLOAD (just under 4 GiB): the choice gives such ops to the ring (a pure
    # function of the size, so every peer agrees; nothing is allocated here).
    gib = 1 << 30
    assert _choose(5 * gib, 8, forced=RD) is RING  # recursive doubling swaps the whole buffer
    assert _choose(4 * gib - 4096, 8, forced=RD) is RD
    assert _choose(5 * gib, 8, forced=HD) is HD  # its largest frame is half the buffer
    assert largest_frame(5 * gib, 8, HD, itemsize=4, acc_itemsize=4) == 5 * gib // 2
    assert _choose(9 * gib, 8, forced=HD) is RING
    assert _choose(5 * gib, 9, forced=HD) is RING  # the fold sends the whole buffer
    # f16/bf16 partials travel as f32: 2.5 GiB of f16 input is a 5 GiB frame
    assert _choose(5 * gib // 2, 8, forced=RD, itemsize=2, acc_itemsize=4) is RING
    assert _choose(3 * gib // 2, 8, forced=RD, itemsize=2, acc_itemsize=4) is RD
    for forced in (RD, HD):
        huge = _choose(64 * gib, 64, forced=forced)
        assert huge is RING
        assert largest_frame(64 * gib, 64, forced, itemsize=4, acc_itemsize=4) > MAX_DATA_PAYLOAD


def test_parse_algorithm() -> None:
    assert parse_algorithm("auto") is None and parse_algorithm(None) is None
    assert parse_algorithm("halving_doubling") is HD and parse_algorithm(RD) is RD
    with pytest.raises(ValueError, match="'auto' or one of"):
        parse_algorithm("tree")


async def test_without_partner_links_the_ring_runs() -> None:
    world = 4
    links, _ = memory_ring(world)
    inputs = make_inputs(world, 1000, np.float32, ReduceOp.SUM, seed=4)
    outputs, _ = await run_op(inputs, ReduceOp.SUM, HD, links=links)
    assert np.array_equal(outputs[0], ring_reference(inputs, ReduceOp.SUM))


async def test_quantized_ops_take_the_ring_even_when_forced() -> None:
    world = 4
    quant = Quantization(dtype=np.uint8)
    inputs = make_inputs(world, 5000, np.float32, ReduceOp.SUM, seed=5)
    ring, _ = await run_op(inputs, ReduceOp.SUM, None, links=memory_ring(world)[0], quantization=quant)
    forced, _ = await run_op(inputs, ReduceOp.SUM, HD, quantization=quant)
    assert_bit_identical(forced)
    assert np.array_equal(forced[0].view(np.uint8), ring[0].view(np.uint8))  # the same (ring) op ran


# --- aborts --------------------------------------------------------------------------------------


class _Cancelled:
    def __repr__(self) -> str:
        return "CANCELLED"


CANCELLED = _Cancelled()


async def run_with_master_abort(inputs: Sequence[np.ndarray], links: Sequence[RingLinks],
                                 algorithm: AllReduceAlgorithm,
                                 trigger: Callable[[list[trio.CancelScope]], Any]) -> list[Any]:
    """Run an in-place op on every peer; the first failure cancels every other peer's scope
    (what the master's Abort does).  Returns each peer's outcome."""
    world = len(inputs)
    scopes = [trio.CancelScope() for _ in range(world)]
    outcomes: list[Any] = [None] * world

    def abort_all() -> None:
        for s in scopes:
            s.cancel()

    async def peer(r: int) -> None:
        try:
            with scopes[r]:
                outcomes[r] = await ring_all_reduce(inputs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=world,
                                                    seq=1, algorithm=algorithm)
                return
        except BaseException as exc:  # noqa: BLE001 - the test inspects exactly what escaped
            outcomes[r] = exc
            abort_all()
            if not isinstance(exc, PCCLError):
                raise
        if scopes[r].cancelled_caught:
            outcomes[r] = CANCELLED
            abort_all()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
            nursery.start_soon(trigger, scopes)
    return outcomes


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize(("world", "breaker", "partner"), [(4, 0, 2), (5, 3, 4), (5, 0, 1), (8, 6, 7), (6, 1, 0)],
                         ids=["4-step2", "5-after-fold", "5-fold-in", "8-step1", "6-unfold"])
async def test_a_partner_link_dying_mid_op_aborts_everyone_and_restores_inputs(
        algorithm: AllReduceAlgorithm, world: int, breaker: int, partner: int) -> None:
    links, _, streams = memory_mesh(world)
    n = 40_000  # f64: 320 KB, so that the break lands inside a frame
    inputs = make_inputs(world, n, np.float64, ReduceOp.SUM, seed=world)
    originals = [x.copy() for x in inputs]
    stream = streams[breaker][partner]
    stream.break_after = n * 8 // 24  # inside its first frame to that partner (the smallest: n / 8 elements)

    async def no_trigger(scopes: list[trio.CancelScope]) -> None:
        await trio.sleep(0)

    outcomes = await run_with_master_abort(inputs, links, algorithm, no_trigger)
    assert stream.broke.is_set()
    assert isinstance(outcomes[breaker], PeerDisconnected), outcomes[breaker]
    for r in range(world):
        if isinstance(outcomes[r], tuple):
            # A peer whose own partners all got through finishes before the abort reaches it:
            # its result is whole; the master's abort then restores the input from the
            # caller's backup (the communicator keeps it until the master's final word).
            assert r not in (breaker, partner)
            expected = halving_reference(originals, ReduceOp.SUM, algorithm)
            assert np.array_equal(inputs[r].view(np.uint8), expected.view(np.uint8)), f"peer {r}: wrong result"
            continue
        assert outcomes[r] is CANCELLED or isinstance(outcomes[r], PCCLError), (r, outcomes[r])
        assert not isinstance(outcomes[r], BaseExceptionGroup)
        assert np.array_equal(inputs[r].view(np.uint8), originals[r].view(np.uint8)), f"peer {r} not restored"


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a.value)
@pytest.mark.parametrize("world", [4, 7])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
async def test_cancelling_one_peer_mid_op_restores_every_input(algorithm: AllReduceAlgorithm, world: int,
                                                               dtype: Any) -> None:
    links, _, streams = memory_mesh(world)
    inputs = make_inputs(world, 30_000, dtype, ReduceOp.SUM, seed=3)
    originals = [x.copy() for x in inputs]
    victim = world - 1
    # One partner of the victim never sends it anything (a stalled peer): the victim is still
    # in the op, having sent part of its data, when it is cancelled.
    last = partner_positions(victim, world)[0]
    streams[last][victim].stall_after = 0

    async def cancel_victim_when_busy(scopes: list[trio.CancelScope]) -> None:
        while sum(s.sent_bytes for s in streams[victim].values()) < 30_000 * np.dtype(dtype).itemsize // 4:
            await trio.sleep(0)
        scopes[victim].cancel()

    outcomes = await run_with_master_abort(inputs, links, algorithm, cancel_victim_when_busy)
    assert outcomes[victim] is CANCELLED
    for r in range(world):
        if isinstance(outcomes[r], tuple):  # finished before the abort reached it (see above)
            assert r not in (victim, last)
            expected = halving_reference(originals, ReduceOp.SUM, algorithm)
            assert np.array_equal(inputs[r].view(np.uint8), expected.view(np.uint8)), f"peer {r}: wrong result"
            continue
        assert outcomes[r] is CANCELLED or isinstance(outcomes[r], PCCLError), (r, outcomes[r])
        assert np.array_equal(inputs[r].view(np.uint8), originals[r].view(np.uint8)), f"peer {r} not restored"


async def test_saving_the_callers_buffer_runs_through_the_kernel_runner() -> None:
    # In place, the caller's buffer is saved whole before its first write (up to 64 MiB in
    # auto): work for the runner (a worker thread when large), as the ring's saves are, not a
    # copy on the Trio thread.
    class Recording(KernelRunner):
        def __init__(self) -> None:
            super().__init__(thread_threshold=0)  # every kernel to a worker thread
            self.ran: list[Callable[..., Any]] = []

        async def run(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
            self.ran.append(fn)
            return await super().run(nbytes, fn, *args)

    for algorithm, world in ((RD, 4), (HD, 4), (RD, 5)):
        links, _, _ = memory_mesh(world)
        inputs = make_inputs(world, 1000, np.float32, ReduceOp.SUM, seed=world)
        outputs = [x.copy() for x in inputs]
        runners = [Recording() for _ in range(world)]

        async def peer(r: int) -> None:
            await ring_all_reduce(outputs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=1,
                                  algorithm=algorithm, runner=runners[r])

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for r in range(world):
                    nursery.start_soon(peer, r)
        assert_bit_identical(outputs)
        for r, runner in enumerate(runners):
            saves = [fn for fn in runner.ran if isinstance(getattr(fn, "__self__", None), InputBackup)]
            assert [fn.__name__ for fn in saves] == ["save"], (algorithm.value, world, r, runner.ran)
