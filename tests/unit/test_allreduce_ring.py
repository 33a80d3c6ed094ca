"""pccl.collectives: the ring all-reduce over framed lanes, N peers as trio tasks in one process.

Peers are connected by in-memory streams (:func:`pccl.testing.memory_ring`) or by real TCP on
loopback.  Results are compared with a numpy model of
the ring's reduction order, so unquantized results must match *bit for bit*.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

from pccl.collectives import InputBackup, KernelRunner, RingLinks, ring_all_reduce
from pccl.collectives.buffers import ScratchArena
from pccl.collectives.reference import ring_reference
from pccl.config import Config
from pccl.errors import (
    InvalidArgument,
    PCCLError,
    PeerDisconnected,
    ProtocolError,
    StreamClosed,
)
from pccl.net.framed import FramedConnection
from pccl.protocol.codec import DataHeader
from pccl.protocol.ring import EXCHANGE_MAX_BYTES, uses_exchange
from pccl.types import Quantization, ReduceOp

from fp_mode import flush_denormals, needs_sse_modes

from pccl.testing import memory_ring

CONFIG = Config()
ALL_DTYPES = [
    np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64,
    np.float16, ml_dtypes.bfloat16, np.float32, np.float64,
]
FLOAT_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


# The numpy model of the ring's reduction order is pccl.collectives.reference.ring_reference.


def make_inputs(world: int, n: int, dtype: Any, op: ReduceOp, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        hi = 4 if op is ReduceOp.PROD else min(int(info.max), 1000)
        lo = -hi if dt.kind == "i" else 0
        return [rng.integers(lo, hi, n, endpoint=True).astype(dt) for _ in range(world)]
    scale = 2.0 if op is ReduceOp.PROD else 100.0
    return [(rng.standard_normal(n) * scale).astype(dt) for _ in range(world)]


async def run_ring(
    inputs: Sequence[np.ndarray],
    op: ReduceOp,
    *,
    quantization: Quantization | None = None,
    in_place: bool = True,
    lanes: int = 1,
    links: Sequence[RingLinks] | None = None,
    seq: int = 1,
    max_subchunk_bytes: int | None = None,
    exchange_max_bytes: int | None = None,
) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    world = len(inputs)
    if links is None:
        links, _ = memory_ring(world, lanes)
    outputs = [x.copy() for x in inputs]
    recvs = [None if in_place else np.full_like(x, 7) for x in inputs]
    sizes: list[tuple[int, int]] = [(0, 0)] * world
    kwargs: dict[str, int] = {} if max_subchunk_bytes is None else {"max_subchunk_bytes": max_subchunk_bytes}
    if exchange_max_bytes is not None:
        kwargs["exchange_max_bytes"] = exchange_max_bytes

    async def peer(r: int) -> None:
        sizes[r] = await ring_all_reduce(
            outputs[r], recvs[r], op=op, links=links[r], rank=r, world=world, seq=seq,
            quantization=quantization, **kwargs,
        )

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    if not in_place:
        for r in range(world):
            assert np.array_equal(outputs[r].view(np.uint8), inputs[r].view(np.uint8)), "send was modified"
        outputs = recvs  # type: ignore[assignment]
    return outputs, sizes


def assert_bit_identical(outputs: Sequence[np.ndarray]) -> None:
    for r, out in enumerate(outputs[1:], 1):
        assert out.view(np.uint8).tobytes() == outputs[0].view(np.uint8).tobytes(), f"peer {r} differs from peer 0"


def expected_sizes(n: int, world: int, itemsize: int, rs_itemsize: int,
                   exchange_max_bytes: int = EXCHANGE_MAX_BYTES) -> list[tuple[int, int]]:
    if uses_exchange(world, n * itemsize, quantized=False, max_bytes=exchange_max_bytes):
        # every other peer's input once, in its own dtype
        return [((world - 1) * n * itemsize, (world - 1) * n * itemsize)] * world
    base, extra = divmod(n, world)
    chunk = [base + (1 if c < extra else 0) for c in range(world)]
    result = []
    for r in range(world):
        # reduce-scatter sends all chunks but r+1, all-gather all but r+2 (PCCL's formula);
        # receives: all but r in reduce-scatter, all but r+1 in all-gather.
        tx = (n - chunk[(r + 1) % world]) * rs_itemsize + (n - chunk[(r + 2) % world]) * itemsize
        rx = (n - chunk[r]) * rs_itemsize + (n - chunk[(r + 1) % world]) * itemsize
        result.append((tx, rx))
    return result


# --- correctness ------------------------------------------------------------------------------


#: ``exchange_max_bytes`` of each plan: these sizes are all exchanges by default; 0 forces the ring.
PLANS = {"exchange": EXCHANGE_MAX_BYTES, "ring": 0}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 3, 1025])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
async def test_every_op_and_dtype_matches_the_ring_model(plan: str, world: int, n: int, dtype: Any) -> None:
    limit = PLANS[plan]
    item = np.dtype(dtype).itemsize
    assert uses_exchange(world, n * item, quantized=False, max_bytes=limit) == (plan == "exchange")
    for i, op in enumerate(ReduceOp):
        inputs = make_inputs(world, n, dtype, op, seed=world * 1000 + n + i)
        outputs, sizes = await run_ring(inputs, op, in_place=(i % 2 == 0), exchange_max_bytes=limit)
        assert_bit_identical(outputs)
        expected = ring_reference(inputs, op, exchange_max_bytes=limit)
        assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), op
        rs_item = 4 if item == 2 and np.dtype(dtype).kind not in "iu" else item
        assert sizes == expected_sizes(n, world, item, rs_item, limit)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int64], ids=lambda d: np.dtype(d).name)
async def test_large_buffers_striped_over_lanes(world: int, dtype: Any) -> None:
    n = 200_003
    lanes = 2 if world != 3 else 3
    for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
        inputs = make_inputs(world, n, dtype, op, seed=world + int(op))
        outputs, sizes = await run_ring(inputs, op, lanes=lanes, in_place=op is not ReduceOp.MAX)
        assert_bit_identical(outputs)
        assert np.array_equal(outputs[0].view(np.uint8), ring_reference(inputs, op).view(np.uint8))
        item = np.dtype(dtype).itemsize
        assert sizes == expected_sizes(n, world, item, 4 if item == 2 else item)  # every lane counted


def test_f16_accumulates_in_f32() -> None:
    # 2048 + 1 + 1 in f16 arithmetic stays 2048 (1 is below half an ulp at 2048);
    # accumulated in f32 and rounded once it is 2050.
    inputs = [np.array([2048.0], np.float16), np.array([1.0], np.float16), np.array([1.0], np.float16)]
    outputs, _ = trio.run(run_ring, inputs, ReduceOp.SUM)
    assert [float(o[0]) for o in outputs] == [2050.0] * 3


# --- the exchange (small ops: every input around the ring, N - 1 steps instead of 2 (N - 1)) -----


_QUIET_NAN_BITS = {np.dtype(np.float32): (np.uint32, 0x7FC00000), np.dtype(np.float16): (np.uint16, 0x7E00),
                   np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7FC0)}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_nan_payloads_end_bit_identical(plan: str, world: int, op: ReduceOp, dtype: Any) -> None:
    # Which NaN payload an operation keeps depends on the instruction (and so on alignment, vector
    # body or scalar tail): peers that computed the same element apart could disagree.  The
    # exchange canonicalises NaN results; the ring distributes its owners' bytes.
    bits, quiet = _QUIET_NAN_BITS[np.dtype(dtype)]
    inputs = [np.full(1000, quiet + r + 1, bits).view(dtype) for r in range(world)]
    for in_place in (True, False):
        outputs, _ = await run_ring(inputs, op, in_place=in_place, exchange_max_bytes=PLANS[plan])
        assert_bit_identical(outputs)
        assert np.all(np.isnan(outputs[0].astype(np.float32)))
        if plan == "exchange":  # the exchange's NaN results are canonical, as its model says
            assert np.array_equal(outputs[0].view(bits), ring_reference(inputs, op).view(bits))


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [np.float64, np.float16], ids=lambda d: np.dtype(d).name)
async def test_signed_zeros_end_bit_identical(plan: str, world: int, op: ReduceOp, dtype: Any) -> None:
    # MIN/MAX of +0 and -0 return one operand of an equal pair: the peers must agree which.
    inputs = [np.full(1000, -0.0 if r % 2 else 0.0, dtype) for r in range(world)]
    limit = PLANS[plan]
    for in_place in (True, False):
        outputs, _ = await run_ring(inputs, op, in_place=in_place, exchange_max_bytes=limit)
        assert_bit_identical(outputs)
        expected = ring_reference(inputs, op, exchange_max_bytes=limit)
        assert np.array_equal(outputs[0].view(np.uint8), expected.view(np.uint8))


@needs_sse_modes
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_results_are_ieee_whatever_the_callers_flush_to_zero_mode(plan: str, world: int, dtype: Any) -> None:
    # User code may turn flush-to-zero on in the thread that calls all_reduce; where peers compute
    # the same elements themselves (the exchange) a flushed subnormal would make them differ.
    # The ring distributes each chunk's owner's bytes, so it would stay bit-identical even so, but
    # every plan, in place or not, must give the IEEE result (the out-of-place ring's first
    # reduction of a slice once added with numpy, in the caller's mode: flushed).
    inputs = [np.full(1000, (r + 1) * 3e-39, np.float32).astype(dtype) for r in range(world)]
    limit = PLANS[plan]
    for op in (ReduceOp.SUM, ReduceOp.AVG):
        expected = ring_reference(inputs, op, exchange_max_bytes=limit)
        assert np.any(expected.astype(np.float32) != 0.0)
        for in_place in (True, False):
            with flush_denormals():
                outputs, _ = await run_ring(inputs, op, in_place=in_place, exchange_max_bytes=limit)
            assert_bit_identical(outputs)
            assert np.array_equal(outputs[0].view(np.uint8), expected.view(np.uint8)), (op, in_place)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
async def test_exchange_moves_one_frame_per_step_on_each_link(world: int, dtype: Any) -> None:
    links, raw = memory_ring(world)
    inputs = make_inputs(world, 1000, dtype, ReduceOp.SUM, seed=3)
    nbytes = 1000 * np.dtype(dtype).itemsize  # f16/bf16 travel as they are, not as f32
    outputs, sizes = await run_ring(inputs, ReduceOp.SUM, links=links)
    assert sizes == [((world - 1) * nbytes, (world - 1) * nbytes)] * world
    frame_overhead = links[0].to_next[0].statistics().bytes_sent // (world - 1) - nbytes
    assert [raw[r][0].sent_bytes for r in range(world)] == [(world - 1) * (nbytes + frame_overhead)] * world
    assert [links[r].to_next[0].statistics().frames_sent for r in range(world)] == [world - 1] * world
    # Folded in ring order in f32, rounded once.
    expected = inputs[0].astype(np.float32)
    for x in inputs[1:]:
        expected = expected + x.astype(np.float32)
    assert_bit_identical(outputs)
    assert np.array_equal(outputs[0].view(np.uint8), expected.astype(dtype).view(np.uint8))


@pytest.mark.parametrize("world", [2, 3])
async def test_exchange_in_place_sends_the_input_not_the_result(world: int) -> None:
    # In place, each slice's result overwrites the very memory being sent; a send still under
    # way (here: held until this peer has applied the others' inputs) must send the input.
    links, _ = memory_ring(world)
    inputs = make_inputs(world, 1000, np.float32, ReduceOp.SUM, seed=4)
    bufs = [x.copy() for x in inputs]
    # Hold peer 0's first send (its own input) until its buffer holds the result: it gets
    # every other input without that frame (at N = 3 the last one comes from peer 2, which
    # forwards peer 1's), so the result is written while the send is still under way.
    connection = links[0].to_next[0]
    send_data = connection.send_data
    held = [True]
    released_by_the_result: list[bool] = []

    async def held_send_data(header: DataHeader, payload: Any) -> None:
        if held[0]:
            held[0] = False
            with trio.move_on_after(2):
                while np.array_equal(bufs[0], inputs[0]):
                    await trio.sleep(0.001)
            released_by_the_result.append(not np.array_equal(bufs[0], inputs[0]))
        await send_data(header, payload)

    connection.send_data = held_send_data  # type: ignore[method-assign]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(lambda r=r: ring_all_reduce(bufs[r], op=ReduceOp.SUM, links=links[r], rank=r,
                                                               world=world, seq=1))
    assert released_by_the_result == [True]  # the result was written while the input was unsent
    assert np.array_equal(bufs[0].view(np.uint8), ring_reference(inputs, ReduceOp.SUM).view(np.uint8))
    assert_bit_identical(bufs)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("quant", [Quantization(dtype=np.uint8), Quantization(dtype=np.uint16),
                                   Quantization(dtype="uint4"), Quantization(dtype="uint4", block=128),
                                   Quantization(dtype=np.uint16, block=99)], ids=["u8", "u16", "u4", "u4b128", "u16b99"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
async def test_quantized_results_are_close_and_bit_identical(world: int, quant: Quantization, dtype: Any) -> None:
    levels = 2**quant.bits - 1
    for n, op in ((1, ReduceOp.SUM), (3, ReduceOp.MAX), (1025, ReduceOp.AVG), (40_000, ReduceOp.SUM)):
        inputs = make_inputs(world, n, dtype, op, seed=n + world)
        outputs, sizes = await run_ring(inputs, op, quantization=quant, in_place=n != 3, max_subchunk_bytes=4096)
        assert_bit_identical(outputs)
        exact = ring_reference([x.astype(np.float64) for x in inputs], op)
        spread = max(float(np.ptp(np.sum([x.astype(np.float64) for x in inputs], axis=0))), 1.0)
        # every hop adds at most half a quantization step of its partial result's range
        tolerance = world * spread / levels + (0.02 * np.abs(exact) if np.dtype(dtype).itemsize == 2 else 0)
        assert np.all(np.abs(outputs[0].astype(np.float64) - exact) <= tolerance)
        assert sizes[0][0] > 0 and sizes[0][0] < n * np.dtype(dtype).itemsize * 2 + 64


async def test_quantization_owner_ends_with_dequantized_values() -> None:
    # With one element per chunk the all-gather payload is a constant chunk (exact), so use
    # chunks with spread: the owner's own slice must equal what the others decoded — checked by
    # bit identity — and differ from the unquantized sum somewhere.
    inputs = make_inputs(3, 3000, np.float32, ReduceOp.SUM, seed=5)
    outputs, _ = await run_ring(inputs, ReduceOp.SUM, quantization=Quantization(dtype=np.uint8))
    assert_bit_identical(outputs)
    assert not np.array_equal(outputs[0], ring_reference(inputs, ReduceOp.SUM))


async def test_quantization_rejects_nonfinite_and_integers() -> None:
    links, _ = memory_ring(2)
    bad = np.array([1.0, np.nan, 2.0], np.float32)
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        with trio.fail_after(5):
            await ring_all_reduce(bad, op=ReduceOp.SUM, links=links[0], rank=0, world=2, seq=1,
                                  quantization=Quantization(dtype=np.uint8))
    assert not np.isnan(bad[0]) and np.isnan(bad[1])  # restored / untouched
    with pytest.raises(InvalidArgument, match="floating-point"):
        await ring_all_reduce(np.arange(4, dtype=np.int32), op=ReduceOp.SUM, links=links[0], rank=0,
                              world=2, seq=2, quantization=Quantization(dtype=np.uint8))


async def test_argument_checks() -> None:
    links, _ = memory_ring(2)
    a = np.zeros(8, np.float32)
    with pytest.raises(InvalidArgument, match="overlap partially"):
        await ring_all_reduce(a[:6], a[2:], op=ReduceOp.SUM, links=links[0], rank=0, world=2, seq=1)
    with pytest.raises(InvalidArgument, match="must match"):
        await ring_all_reduce(a, np.zeros(8, np.float64), op=ReduceOp.SUM, links=links[0], rank=0, world=2, seq=1)
    with pytest.raises(InvalidArgument, match="ring needs"):
        await ring_all_reduce(a, op=ReduceOp.SUM, links=links[0], rank=2, world=2, seq=1)


async def test_empty_buffer_moves_nothing() -> None:
    outputs, sizes = await run_ring([np.zeros(0, np.float32)] * 3, ReduceOp.SUM)
    assert sizes == [(0, 0)] * 3 and all(o.size == 0 for o in outputs)


# --- concurrency ------------------------------------------------------------------------------


@pytest.mark.parametrize("ops_in_flight", [2, 8])
async def test_concurrent_ops_share_the_links(ops_in_flight: int) -> None:
    world, lanes = 3, 2
    links, _ = memory_ring(world, lanes)
    rng = random.Random(ops_in_flight)
    cases = []
    for t in range(ops_in_flight):
        op = list(ReduceOp)[t % 5]
        dtype = [np.float32, np.int32, np.float16, np.float64][t % 4]
        quant = Quantization(dtype=np.uint8) if t % 3 == 2 and np.dtype(dtype).kind == "f" else None
        inputs = make_inputs(world, 5000 + 37 * t, dtype, op, seed=t)
        cases.append((100 + t, op, quant, inputs, [x.copy() for x in inputs]))

    async def peer(r: int) -> None:
        order = list(range(ops_in_flight))
        rng.shuffle(order)  # every peer starts the ops in a different order
        async with trio.open_nursery() as nursery:
            for t in order:
                seq, op, quant, _, bufs = cases[t]
                nursery.start_soon(
                    lambda seq=seq, op=op, quant=quant, buf=bufs[r]: ring_all_reduce(
                        buf, op=op, links=links[r], rank=r, world=world, seq=seq, quantization=quant,
                        max_subchunk_bytes=2048,
                    )
                )
                await trio.sleep(0)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    for seq, op, quant, inputs, bufs in cases:
        assert_bit_identical(bufs)
        if quant is None:
            assert np.array_equal(bufs[0].view(np.uint8), ring_reference(inputs, op).view(np.uint8)), seq


# --- aborts -----------------------------------------------------------------------------------


class _CancelledMarker(Exception):
    """Recorded for a peer whose scope caught the Cancelled (the op raised Cancelled)."""


CANCELLED = _CancelledMarker("the op raised Cancelled")


async def _run_with_master_abort(
    inputs: Sequence[np.ndarray],
    links: Sequence[RingLinks],
    *,
    trigger: Callable[[list[trio.CancelScope]], Any],
    seq: int = 1,
    quantization: Quantization | None = None,
) -> list[BaseException | tuple[int, int]]:
    """Run an in-place op on every peer; the first failure cancels every other peer's scope
    (what the master's Abort does).  Returns each peer's outcome."""
    world = len(inputs)
    scopes = [trio.CancelScope() for _ in range(world)]
    outcomes: list[BaseException | tuple[int, int]] = [(-1, -1)] * world

    def abort_all() -> None:
        for s in scopes:
            s.cancel()

    async def peer(r: int) -> None:
        try:
            with scopes[r]:
                outcomes[r] = await ring_all_reduce(
                    inputs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=seq,
                    quantization=quantization, max_subchunk_bytes=4096,
                )
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


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("quantized", [None, "u8", "u4b128"])
async def test_broken_stream_mid_op_aborts_everyone_and_restores_inputs(world: int, quantized: str | None) -> None:
    links, raw = memory_ring(world)
    inputs = make_inputs(world, 60_000, np.float32, ReduceOp.SUM, seed=world)
    originals = [x.copy() for x in inputs]
    # last peer -> peer 0 dies mid-op (a third of what it sends, at each wire size)
    raw[world - 1][0].break_after = {None: 100_000, "u8": 20_000, "u4b128": 10_000}[quantized]
    quant = {None: None, "u8": Quantization(dtype=np.uint8), "u4b128": Quantization(dtype="uint4", block=128)}

    async def no_trigger(scopes: list[trio.CancelScope]) -> None:
        await trio.sleep(0)

    outcomes = await _run_with_master_abort(inputs, links, trigger=no_trigger, quantization=quant[quantized])
    assert raw[world - 1][0].broke.is_set()
    for r in range(world):
        assert isinstance(outcomes[r], BaseException) and not isinstance(outcomes[r], BaseExceptionGroup), outcomes[r]
        assert np.array_equal(inputs[r], originals[r]), f"peer {r} buffer not restored"
    # The peer whose stream broke saw it; the others saw it too or were aborted ("master").
    assert isinstance(outcomes[world - 1], PeerDisconnected)
    assert all(o is CANCELLED or isinstance(o, PCCLError) for o in outcomes)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("progress", [0.3, 0.8])
@pytest.mark.parametrize("size", ["small", "large"])
async def test_cancelling_one_peer_mid_op_restores_every_input(world: int, dtype: Any, progress: float,
                                                               size: str) -> None:
    # small: the exchange, in 2-6 frames per peer (1-2 per step), so that the trigger lands mid-op
    n = {"small": 64_000 // (world - 1), "large": 200_000}[size]
    assert uses_exchange(world, n * np.dtype(dtype).itemsize, quantized=False) == (size == "small")
    links, raw = memory_ring(world)
    inputs = make_inputs(world, n, dtype, ReduceOp.SUM, seed=3)
    originals = [x.copy() for x in inputs]
    # cancel peer 1 in reduce-scatter (0.3) or in all-gather (0.8, where f16 outputs are written)
    item = np.dtype(dtype).itemsize
    sizes = expected_sizes(n, world, item, 4 if item == 2 else item)
    total_tx = sizes[1][0]
    # Peer 1 must still be in the op when cancelled: peer 0's last frame to it never arrives
    # (its send stalls like a full window).  Otherwise, late in a small op, peer 1 could finish
    # within the turns it runs before the trigger sees its progress.
    raw[0][0].stall_after = sizes[0][0]

    async def cancel_peer_1_when_busy(scopes: list[trio.CancelScope]) -> None:
        while raw[1][0].sent_bytes < progress * total_tx:
            await trio.sleep(0)
        scopes[1].cancel()

    outcomes = await _run_with_master_abort(inputs, links, trigger=cancel_peer_1_when_busy)
    assert outcomes[1] is CANCELLED
    for r in range(world):
        if isinstance(outcomes[r], tuple):
            # In the exchange a peer that already holds every input finishes while peer 1 still
            # sends to another (late in the op, N > 2).  Its result is whole; the master's abort
            # then restores it from the caller's backup (test_backup_restores_after_...).
            assert size == "small" and world > 2 and progress > 0.5, (r, outcomes[r])
            reference = ring_reference(originals, ReduceOp.SUM)
            assert np.array_equal(inputs[r].view(np.uint8), reference.view(np.uint8)), f"peer {r}: wrong result"
            continue
        assert outcomes[r] is CANCELLED or isinstance(outcomes[r], PCCLError), outcomes[r]
        assert np.array_equal(inputs[r].view(np.uint8), originals[r].view(np.uint8)), f"peer {r} not restored"


async def test_stalled_peer_is_aborted_around_by_the_callers_deadline() -> None:
    # Peer 1 freezes mid-send; nobody's transfer can finish.  The master's timeout (here: the
    # trigger) aborts every peer; each raises one error and gets its input back.
    world = 3
    links, raw = memory_ring(world)
    inputs = make_inputs(world, 50_000, np.float64, ReduceOp.MIN, seed=8)
    originals = [x.copy() for x in inputs]
    raw[1][0].stall_after = 150_000

    async def master_timeout(scopes: list[trio.CancelScope]) -> None:
        await raw[1][0].broke.wait()
        await trio.sleep(0.05)
        for scope in scopes:
            scope.cancel()

    outcomes = await _run_with_master_abort(inputs, links, trigger=master_timeout)
    assert outcomes == [CANCELLED] * world
    for r in range(world):
        assert np.array_equal(inputs[r], originals[r])
    # the frozen lane was torn by the cancelled send; the others are intact
    with pytest.raises(StreamClosed):
        await links[1].to_next[0].send_data(DataHeader(op_seq=9, stream=0, step=0, offset=0, nbytes=1), b"x")


@pytest.mark.parametrize(("world", "dtype", "plan"),
                         [(3, np.float64, "ring"), (2, np.float64, "exchange"), (2, np.float16, "exchange"),
                          (2, ml_dtypes.bfloat16, "exchange"), (3, np.float64, "exchange"), (4, np.float16, "exchange")],
                         ids=["ring", "exchange", "exchange-f16", "exchange-bf16", "exchange-3", "exchange-4-f16"])
async def test_backup_restores_after_a_completed_ring(world: int, dtype: Any, plan: str) -> None:
    # The master may abort after this peer finished its ring: the caller's backup still holds
    # the input, and holds no more than one copy of it.
    links, _ = memory_ring(world)
    inputs = make_inputs(world, 10_000, dtype, ReduceOp.PROD, seed=9)
    bufs = [x.copy() for x in inputs]
    backups = [InputBackup(b) for b in bufs]

    async def peer(r: int) -> None:
        await ring_all_reduce(bufs[r], op=ReduceOp.PROD, links=links[r], rank=r, world=world, seq=4,
                              backup=backups[r], max_subchunk_bytes=4096, exchange_max_bytes=PLANS[plan])

    async with trio.open_nursery() as nursery:
        for r in range(world):
            nursery.start_soon(peer, r)
    expected = ring_reference(inputs, ReduceOp.PROD, exchange_max_bytes=PLANS[plan])
    assert_bit_identical(bufs)
    assert np.array_equal(bufs[0].view(np.uint8), expected.view(np.uint8))
    for r in range(world):
        assert backups[r].saved_elements == inputs[r].size
        backups[r].restore()
        assert np.array_equal(bufs[r].view(np.uint8), inputs[r].view(np.uint8))


def test_scratch_arena_reuses_buffers_of_similar_size() -> None:
    arena = ScratchArena(retain_bytes=1 << 20)
    a = arena.take(1000)
    arena.give(a)
    assert arena.take(900) is a  # reused: its pages are already mapped
    assert arena.take(100) is not a  # never more than twice the request
    arena.give(a)
    arena.give(np.empty(2 << 20, np.uint8))  # over the retention cap: dropped
    assert arena.retained_bytes == a.size
    backup = InputBackup(np.arange(10, dtype=np.float64), arena=arena)
    backup.release()
    assert arena.retained_bytes >= 80


async def test_out_of_place_op_needs_no_backup_and_leaves_send_alone() -> None:
    links, raw = memory_ring(2)
    inputs = make_inputs(2, 50_000, np.float32, ReduceOp.SUM, seed=1)
    recvs = [np.zeros_like(x) for x in inputs]
    originals = [x.copy() for x in inputs]
    raw[1][0].break_after = 30_000
    failures: list[BaseException] = []
    scopes = [trio.CancelScope(), trio.CancelScope()]

    async def peer(r: int) -> None:
        with scopes[r]:
            try:
                await ring_all_reduce(inputs[r], recvs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=2,
                                      seq=1, max_subchunk_bytes=4096)
            except PCCLError as exc:
                failures.append(exc)
                for scope in scopes:  # the master aborts the op everywhere
                    scope.cancel()

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer, 0)
            nursery.start_soon(peer, 1)
    assert failures and all(np.array_equal(x, o) for x, o in zip(inputs, originals))


async def test_late_frames_of_an_aborted_op_are_discarded_by_the_next() -> None:
    links, _ = memory_ring(2)
    stale = np.full(20_000, 1000.0, np.float32)
    # Peer 0 starts op 7 and sends its first frames; peer 1 never runs op 7 (the master aborted
    # it before it started here) and retires the seq.  Peer 0 is aborted while waiting.
    links[1].retire(7)
    with trio.move_on_after(0.2) as scope:
        await ring_all_reduce(stale, op=ReduceOp.SUM, links=links[0], rank=0, world=2, seq=7,
                              max_subchunk_bytes=4096)
    assert scope.cancelled_caught and np.all(stale == 1000.0)
    assert links[0].to_next[0].statistics().data_bytes_sent > 0  # op 7's frames are in flight
    inputs = make_inputs(2, 20_000, np.float32, ReduceOp.SUM, seed=11)
    outputs, _ = await run_ring(inputs, ReduceOp.SUM, links=links, seq=8)
    assert np.array_equal(outputs[1], ring_reference(inputs, ReduceOp.SUM))


async def test_frame_of_the_right_seq_but_wrong_position_is_a_protocol_error() -> None:
    links, _ = memory_ring(2)
    bogus = np.zeros(16, np.uint8)
    await links[0].to_next[0].send_data(DataHeader(op_seq=3, stream=0, step=1, offset=0, nbytes=16), bogus)
    with pytest.raises(ProtocolError, match="expected stream=0 step=0"):
        with trio.fail_after(5):
            await ring_all_reduce(np.ones(8, np.float32), op=ReduceOp.SUM, links=links[1], rank=1, world=2, seq=3)


async def test_header_of_an_op_not_yet_started_here_waits_for_its_owner() -> None:
    # Ops 5 and 6 are both commenced (in flight on every peer).  Peer 1 starts 6 first, peer 0
    # starts 5 first and 6 only later: peer 0's op 5 must leave op 6's frames for op 6.
    links, _ = memory_ring(2)
    a5 = make_inputs(2, 3000, np.int32, ReduceOp.SUM, seed=5)
    a6 = make_inputs(2, 3000, np.int32, ReduceOp.MAX, seed=6)
    b5, b6 = [x.copy() for x in a5], [x.copy() for x in a6]

    async def peer(r: int, first: tuple[int, np.ndarray, ReduceOp], second: tuple[int, np.ndarray, ReduceOp]) -> None:
        async with trio.open_nursery() as nursery:
            for i, (seq, buf, op) in enumerate((first, second)):
                if i:
                    await trio.sleep(0.01)
                nursery.start_soon(
                    lambda seq=seq, buf=buf, op=op: ring_all_reduce(buf, op=op, links=links[r], rank=r, world=2, seq=seq)
                )

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer, 0, (5, b5[0], ReduceOp.SUM), (6, b6[0], ReduceOp.MAX))
            nursery.start_soon(peer, 1, (6, b6[1], ReduceOp.MAX), (5, b5[1], ReduceOp.SUM))
    assert np.array_equal(b5[1], ring_reference(a5, ReduceOp.SUM))
    assert np.array_equal(b6[0], ring_reference(a6, ReduceOp.MAX))


def test_kernel_runner_without_threads_is_used_inline() -> None:
    # The simulator runs kernels inline; the op must still complete (and start no thread).
    async def main() -> None:
        world = 2
        links, _ = memory_ring(world)
        inputs = make_inputs(world, 100_000, np.float32, ReduceOp.SUM, seed=2)
        bufs = [x.copy() for x in inputs]
        runner = KernelRunner(threads=False)

        async def peer(r: int) -> None:
            await ring_all_reduce(bufs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=1, runner=runner)

        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
        assert np.array_equal(bufs[0], ring_reference(inputs, ReduceOp.SUM))

    before = threading.active_count()
    trio.run(main)
    assert threading.active_count() == before


# --- real TCP ---------------------------------------------------------------------------------


async def tcp_ring(world: int, lanes: int) -> list[RingLinks]:
    from pccl.net.framed import accept_framed, open_framed
    from pccl.net.tcp import TcpNetwork

    network = TcpNetwork(CONFIG)
    listeners = [await network.listen("127.0.0.1:0") for _ in range(world)]
    out: list[list[FramedConnection]] = [[] for _ in range(world)]
    inc: list[list[FramedConnection]] = [[] for _ in range(world)]

    async def accept(r: int) -> None:
        for _ in range(lanes):
            inc[r].append(await accept_framed(await listeners[r].accept(), config=CONFIG))

    async with trio.open_nursery() as nursery:
        for r in range(world):
            nursery.start_soon(accept, r)
        for r in range(world):
            for _ in range(lanes):
                out[r].append(await open_framed(network, listeners[(r + 1) % world].address, config=CONFIG))
    for listener in listeners:
        await listener.aclose()
    return [RingLinks(out[r], inc[r]) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_over_tcp_loopback(world: int) -> None:
    links = await tcp_ring(world, lanes=2)
    try:
        for seq, (dtype, op, quant) in enumerate(
            [
                (np.float32, ReduceOp.SUM, None),
                (ml_dtypes.bfloat16, ReduceOp.AVG, None),
                (np.int64, ReduceOp.PROD, None),
                (np.float32, ReduceOp.SUM, Quantization(dtype=np.uint8)),
                (ml_dtypes.bfloat16, ReduceOp.AVG, Quantization(dtype="uint4", block=128)),
            ]
        ):
            inputs = make_inputs(world, 200_000, dtype, op, seed=seq)
            with trio.fail_after(20):
                outputs, sizes = await run_ring(inputs, op, links=links, seq=seq, quantization=quant)
            assert_bit_identical(outputs)
            if quant is None:
                assert np.array_equal(outputs[0].view(np.uint8), ring_reference(inputs, op).view(np.uint8))
            stats_tx = sum(c.statistics().data_bytes_sent for c in links[0].to_next)
            assert stats_tx >= sizes[0][0]
    finally:
        for link in links:
            await link.aclose()


@pytest.mark.parametrize("path", ["inline", "threads"])
@pytest.mark.parametrize("world", [2, 3, 4])
async def test_exchange_over_tcp_loopback(world: int, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # On real TCP the exchange runs inline (its frames are small); the lane threads run it too
    # when forced.  Sizes: one frame per step, and the largest exchange (several frames per step,
    # striped over both lanes); in place and out of place.
    import pccl.collectives.execute as execute_module

    ran: list[str] = []
    real_suits = execute_module.suits_inline

    def chosen(op: Any) -> bool:
        inline = real_suits(op) and path == "inline"
        ran.append("inline" if inline else "threads")
        return inline

    monkeypatch.setattr(execute_module, "suits_inline", chosen)
    links = await tcp_ring(world, lanes=2)
    try:
        seq = 0
        for dtype, op in ((np.float32, ReduceOp.SUM), (ml_dtypes.bfloat16, ReduceOp.AVG), (np.int64, ReduceOp.MIN)):
            item = np.dtype(dtype).itemsize
            for n in (1000, EXCHANGE_MAX_BYTES // (world - 1) // item):
                assert uses_exchange(world, n * item, quantized=False)
                for in_place in (True, False):
                    seq += 1
                    inputs = make_inputs(world, n, dtype, op, seed=seq)
                    with trio.fail_after(20):
                        outputs, sizes = await run_ring(inputs, op, links=links, seq=seq, in_place=in_place)
                    assert_bit_identical(outputs)
                    expected = ring_reference(inputs, op)
                    assert np.array_equal(outputs[0].view(np.uint8), expected.view(np.uint8)), (dtype, n, in_place)
                    assert sizes == [((world - 1) * n * item,) * 2] * world
        assert set(ran) == {path}
    finally:
        for link in links:
            await link.aclose()


async def test_tcp_peer_vanishing_mid_op() -> None:
    world = 3
    links = await tcp_ring(world, lanes=1)
    # 16 MiB a peer: the watcher below polls, and on a loaded host a 1.6 MB op had finished
    # before it ran again (seen beside a second default run: every outcome a result).
    inputs = make_inputs(world, 4_000_000, np.float32, ReduceOp.SUM, seed=1)
    originals = [x.copy() for x in inputs]

    async def kill_peer_2(scopes: list[trio.CancelScope]) -> None:
        while links[2].to_next[0].statistics().data_bytes_sent < 200_000:
            await trio.sleep(0.001)
        links[2].abort()  # its connections reset, like a SIGKILL

    try:
        outcomes = await _run_with_master_abort(inputs, links, trigger=kill_peer_2)
    finally:
        for link in links:
            await link.aclose()
    for r in range(world):
        assert outcomes[r] is CANCELLED or isinstance(outcomes[r], PCCLError), outcomes[r]
        assert np.array_equal(inputs[r], originals[r])
    assert any(isinstance(o, PeerDisconnected | StreamClosed) for o in outcomes)

