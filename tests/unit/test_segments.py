"""Segmented buffers: several arrays all-reduced in place as one op, frames cut at their bounds.

The schedule with breaks (every element in exactly one frame per chunk, no frame across a
break, neighbours agree frame by frame), :class:`Segments` slicing, a segmented op's results
against the numpy model for every dtype and op (Trio path on memory streams, lane threads on
real TCP), restore of every member when the op breaks mid-way, and the bucket rule: segmented
buckets take no scratch of the bucket's size for themselves.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.collectives import ring_all_reduce
from pccl.collectives.buckets import PACKED_BUCKET_BYTES, SEGMENTED_MIN_BYTES, plan_buckets
from pccl.collectives.backup import InputBackup
from pccl.collectives.buffers import OpBuffers, ReduceArgs, ScratchArena
from pccl.collectives.reference import ring_reference
from pccl.collectives.segments import Segments
from pccl.errors import InvalidArgument, PCCLError, PeerDisconnected
from pccl.protocol.ring import ExchangeSchedule, RingSchedule, split_at_breaks
from pccl.types import Quantization, ReduceOp

from test_allreduce_ring import ALL_DTYPES, assert_bit_identical, make_inputs, tcp_ring

from pccl.testing import memory_ring

# --- the schedule ------------------------------------------------------------------------------


def test_split_at_breaks() -> None:
    assert split_at_breaks(0, 10, 4, ()) == ((0, 4), (4, 8), (8, 10))
    assert split_at_breaks(0, 10, 4, (3,)) == ((0, 3), (3, 7), (7, 10))
    assert split_at_breaks(5, 12, 100, (2, 5, 6, 11, 12, 20)) == ((5, 6), (6, 11), (11, 12))
    assert split_at_breaks(5, 5, 4, (5,)) == ()


@settings(deadline=None)  # no wall-clock limit: the machine is shared
@given(
    st.integers(1, 3000),
    st.integers(2, 5),
    st.integers(1, 400),
    st.lists(st.integers(1, 2999), max_size=12),
    st.integers(1, 3),
)
def test_frames_cover_every_element_once_and_never_straddle_a_break(
    count: int, world: int, sub: int, raw_breaks: list[int], lanes: int
) -> None:
    breaks = sorted({b for b in raw_breaks if b < count})
    schedules = [RingSchedule(count, world, r, sub, breaks) for r in range(world)]
    for s in schedules:
        for c, (a, b) in enumerate(s.chunks):
            pieces = s.subchunks(c)
            # consecutive, covering the chunk exactly, none longer than a sub-chunk
            assert [p[0] for p in pieces[1:]] == [p[1] for p in pieces[:-1]]
            assert (pieces[0][0], pieces[-1][1]) == (a, b) if pieces else a == b
            assert all(0 < q - p <= sub for p, q in pieces)
            for p, q in pieces:
                assert not any(p < x < q for x in breaks), (p, q)
        sent = s.send_frames(0, 1)
        for step in range(s.num_steps):  # each step moves each element of its chunk once
            covered = np.zeros(count, np.int8)
            for f in sent:
                if f.step == step:
                    covered[f.start : f.stop] += 1
            a, b = s.chunks[s.send_chunk(step)]
            assert covered[a:b].tolist() == [1] * (b - a) and covered.sum() == b - a
    # every peer's sends on a lane are exactly what its successor expects there, in order
    for r in range(world):
        for lane in range(lanes):
            assert schedules[r].send_frames(lane, lanes) == schedules[(r + 1) % world].recv_frames(lane, lanes)
    # the sender of (step, k) waits for the received (step - 1, k): the same slice
    s = schedules[0]
    received = {(f.step, f.index): (f.start, f.stop) for f in s.recv_frames()}
    for f in s.send_frames():
        if f.step > 0:
            assert received[(f.step - 1, f.index)] == (f.start, f.stop)


def test_breaks_are_checked_and_the_exchange_cuts_at_them_too() -> None:
    with pytest.raises(ValueError):
        RingSchedule(10, 2, 0, 4, (0,))
    with pytest.raises(ValueError):
        RingSchedule(10, 2, 0, 4, (5, 5))
    with pytest.raises(ValueError):
        RingSchedule(10, 2, 0, 4, (10,))
    ex = ExchangeSchedule(10, 3, 1, 4, (3, 9))
    assert ex.subchunks(0) == ex.subchunks(2) == ((0, 3), (3, 7), (7, 9), (9, 10))
    assert RingSchedule(10, 2, 0, 100, (1, 2, 3)).max_subchunks == 4


# --- Segments ------------------------------------------------------------------------------------


def test_segments_slice_into_one_member_and_refuse_to_straddle() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    empty = np.zeros(0, np.float32)
    b = np.arange(4, dtype=np.float32) + 10
    seg = Segments([a, empty, b])
    assert (seg.size, seg.nbytes, seg.dtype, seg.itemsize) == (10, 40, np.float32, 4)
    assert seg.breaks == (6,) and seg.reshape(-1) is seg
    view = seg[2:5]
    assert np.shares_memory(view, a) and view.tolist() == [2, 3, 4]
    view[...] = -1  # a view of the caller's memory
    assert a.reshape(-1)[2:5].tolist() == [-1, -1, -1]
    assert seg[6:10].tolist() == [10, 11, 12, 13] and np.shares_memory(seg[6:10], b)
    assert seg[6:6].size == 0 and seg[10:10].size == 0 and seg[0:0].size == 0
    with pytest.raises(ValueError, match="straddles"):
        seg[5:7]
    with pytest.raises(TypeError):
        seg[0:10:2]
    raw = seg.view(np.uint8)
    assert raw.nbytes == 40 and raw.breaks == (24,) and np.shares_memory(raw[24:28], b)
    with pytest.raises(ValueError):
        Segments([a, np.zeros(3, np.float64)])
    with pytest.raises(ValueError):
        Segments([np.arange(8, dtype=np.float32)[::2]])


def test_layout_digest_tells_different_cuts_apart() -> None:
    f = np.zeros(10, np.float32)
    assert Segments([f[:4], f[4:]]).layout == Segments([np.ones(4, np.float32), np.ones(6, np.float32)]).layout
    assert Segments([f[:4], f[4:]]).layout != Segments([f[:5], f[5:]]).layout
    assert Segments([f[:4], f[4:]]).layout != 0


def test_segments_are_reduced_in_place_only() -> None:
    seg = Segments([np.zeros(4, np.float32), np.zeros(4, np.float32)])
    with pytest.raises(InvalidArgument, match="in place"):
        ReduceArgs.check(seg, np.zeros(8, np.float32), ReduceOp.SUM, None)
    bufs = OpBuffers.for_args(ReduceArgs.check(seg, None, ReduceOp.SUM, None))
    assert bufs.in_place and bufs.src is seg and bufs.acc is seg


def test_backup_of_segments_saves_and_restores_each_member() -> None:
    members = [np.arange(5, dtype=np.int32), np.arange(7, dtype=np.int32) + 100]
    originals = [m.copy() for m in members]
    seg = Segments(members)
    backup = InputBackup(seg, arena=ScratchArena())
    backup.save(1, 5)
    backup.overwrite(5, 9, lambda saved: (np.copyto(saved, seg[5:9]), seg[5:9].fill(0)),
                     lambda: pytest.fail("first write"))
    seg[1:5].fill(-3)
    backup.restore()
    for m, o in zip(members, originals):
        np.testing.assert_array_equal(m, o)
    backup.release()


# --- segmented ops -------------------------------------------------------------------------------

#: Member sizes of one segmented buffer: tiny ones, empty ones, ones larger than a frame.
SIZES = [1, 700, 0, 3, 40_000, 5, 1, 12_001]


def _members(inputs: list[np.ndarray]) -> list[list[np.ndarray]]:
    """Each peer's flat input cut into members of SIZES (copies: the peer's own arrays)."""
    cuts = np.cumsum(SIZES)[:-1]
    return [[part.copy() for part in np.split(x, cuts)] for x in inputs]


async def _run_segmented(members: list[list[np.ndarray]], op: ReduceOp, *, links: Any = None,
                         quantization: Quantization | None = None, seq: int = 1,
                         max_subchunk_bytes: int = 16 * 1024) -> list[tuple[int, int]]:
    world = len(members)
    if links is None:
        links, _ = memory_ring(world)
    sizes: list[tuple[int, int]] = [(0, 0)] * world

    async def peer(r: int) -> None:
        sizes[r] = await ring_all_reduce(Segments(members[r]), op=op, links=links[r], rank=r, world=world,
                                         seq=seq, quantization=quantization, max_subchunk_bytes=max_subchunk_bytes)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    return sizes


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
async def test_segmented_op_matches_the_ring_model_for_every_dtype_and_op(world: int, dtype: Any) -> None:
    n = sum(SIZES)
    for i, op in enumerate(ReduceOp):
        inputs = make_inputs(world, n, dtype, op, seed=world * 100 + i)
        members = _members(inputs)
        sizes = await _run_segmented(members, op)
        outputs = [np.concatenate(ms) for ms in members]
        assert_bit_identical(outputs)
        # frames do not change the arithmetic: the ring's result over the concatenation
        expected = ring_reference(inputs, op, exchange_max_bytes=0)
        assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), op
        assert all(tx > 0 and rx > 0 for tx, rx in sizes)


@pytest.mark.parametrize("world", [2, 3])
async def test_segmented_quantized_op_is_close_and_bit_identical(world: int) -> None:
    n = sum(SIZES)
    inputs = make_inputs(world, n, np.float32, ReduceOp.SUM, seed=7)
    members = _members(inputs)
    await _run_segmented(members, ReduceOp.SUM, quantization=Quantization(dtype=np.uint8))
    outputs = [np.concatenate(ms) for ms in members]
    assert_bit_identical(outputs)
    exact = np.sum(inputs, axis=0)
    assert np.max(np.abs(outputs[0] - exact)) < 0.05 * np.max(np.abs(exact)) * world


@pytest.mark.parametrize("world", [2, 3])
async def test_segmented_op_over_tcp_lane_threads(world: int) -> None:
    links = await tcp_ring(world, lanes=2)
    try:
        for seq, (dtype, op) in enumerate([(np.float32, ReduceOp.SUM), (ml_dtypes.bfloat16, ReduceOp.AVG),
                                           (np.int64, ReduceOp.MAX)], 1):
            inputs = make_inputs(world, sum(SIZES), dtype, op, seed=seq)
            members = _members(inputs)
            await _run_segmented(members, op, links=links, seq=seq)
            outputs = [np.concatenate(ms) for ms in members]
            assert_bit_identical(outputs)
            expected = ring_reference(inputs, op, exchange_max_bytes=0)
            assert outputs[0].view(np.uint8).tobytes() == expected.view(np.uint8).tobytes(), (dtype, op)
    finally:
        for link in links:
            await link.aclose()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
async def test_a_segmented_op_broken_mid_way_restores_every_member(world: int, dtype: Any) -> None:
    links, raw = memory_ring(world)
    inputs = make_inputs(world, sum(SIZES), dtype, ReduceOp.SUM, seed=world)
    members = _members(inputs)
    originals = [[m.copy() for m in ms] for ms in members]
    raw[world - 1][0].break_after = 60_000  # the last peer's link to peer 0 dies mid-op
    outcomes: list[BaseException | None] = [None] * world

    async def peer(r: int, cancel_all: trio.CancelScope) -> None:
        try:
            await ring_all_reduce(Segments(members[r]), op=ReduceOp.SUM, links=links[r], rank=r, world=world,
                                  seq=1, max_subchunk_bytes=16 * 1024)
        except PCCLError as exc:
            outcomes[r] = exc
            cancel_all.cancel()  # what the master's abort does to the others

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r, nursery.cancel_scope)
    assert raw[world - 1][0].broke.is_set()
    assert isinstance(outcomes[world - 1], PeerDisconnected), outcomes
    for r in range(world):
        for m, o in zip(members[r], originals[r]):
            assert m.view(np.uint8).tobytes() == o.view(np.uint8).tobytes(), f"peer {r} not restored"


# --- the bucket rule -----------------------------------------------------------------------------


class _CountingArena(ScratchArena):
    def __init__(self) -> None:
        super().__init__()
        self.taken: list[int] = []

    def take(self, nbytes: int) -> np.ndarray:
        self.taken.append(nbytes)
        return super().take(nbytes)


def test_large_buckets_are_segmented_over_the_members_without_scratch() -> None:
    arena = _CountingArena()
    big = [np.ones(SEGMENTED_MIN_BYTES // 4, np.float32), np.ones(SEGMENTED_MIN_BYTES // 4 + 1, np.float32)]
    small = [np.ones(10, np.float32), np.ones(20, np.float32)]
    (seg_bucket,) = plan_buckets(big, 1 << 30)
    (packed_bucket,) = plan_buckets(small, 1 << 30)
    assert seg_bucket.segmented and not seg_bucket.packed
    assert packed_bucket.packed and not packed_bucket.segmented
    send, recv = seg_bucket.buffers(arena)
    assert isinstance(send, Segments) and recv is None and arena.taken == []
    assert all(np.shares_memory(m, big[i]) for i, m in enumerate(send.members))
    seg_bucket.unpack(recv)
    seg_bucket.release(arena)
    packed_bucket.buffers(arena)
    assert len(arena.taken) == 2  # the rule has teeth: packing takes two bucket-sized buffers


def test_small_arrays_are_packed_apart_from_the_large_ones_which_share_segmented_buckets() -> None:
    n = SEGMENTED_MIN_BYTES // 4
    big = [np.ones(n, np.float32) for _ in range(3)]
    bias = [np.ones(7, np.float32) for _ in range(3)]
    arrays = [big[0], bias[0], big[1], bias[1], bias[2], big[2], np.ones(n, np.int64)]
    buckets = plan_buckets(arrays, 1 << 30)
    assert [b.indices for b in buckets] == [[0, 2, 5], [1, 3, 4], [6]]
    assert [(b.segmented, b.packed) for b in buckets] == [(True, False), (False, True), (False, False)]
    # a cap of two large arrays per bucket: the third starts a segmented bucket of its own
    buckets = plan_buckets(arrays, 2 * n * 4 + 100)
    assert [b.indices for b in buckets] == [[0, 2], [1, 3, 4], [5], [6]]
    assert not buckets[2].segmented and not buckets[2].packed  # alone: plain in place


def test_packed_buckets_stay_small_whatever_the_bucket_size() -> None:
    small = [np.ones(SEGMENTED_MIN_BYTES // 4 - 1, np.float32) for _ in range(60)]  # ~60 MiB in all
    buckets = plan_buckets(small, 1 << 30)
    assert all(b.packed for b in buckets) and len(buckets) == 3
    assert all(b.nbytes <= PACKED_BUCKET_BYTES for b in buckets)
    assert sum(len(b.members) for b in buckets) == 60
