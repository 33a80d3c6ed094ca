"""pccl.protocol.ring: chunk boundaries, the step schedule and its pipelining invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl.protocol.ring import (
    DEFAULT_SUBCHUNK_BYTES,
    EXCHANGE_MAX_BYTES,
    MIN_SUBCHUNK_BYTES,
    ExchangeSchedule,
    Phase,
    RingSchedule,
    chunk_bounds,
    shared_schedule,
    split_range,
    subchunk_elements,
    uses_exchange,
)


def test_chunk_bounds_follow_pccl_rule() -> None:
    # base = 10 // 4 = 2, the first 10 % 4 = 2 chunks get one more element.
    assert chunk_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert chunk_bounds(1, 3) == ((0, 1), (1, 1), (1, 1))
    assert chunk_bounds(0, 2) == ((0, 0), (0, 0))


@given(st.integers(0, 10_000), st.integers(1, 17))
def test_chunk_bounds_partition(count: int, world: int) -> None:
    bounds = chunk_bounds(count, world)
    assert len(bounds) == world
    assert bounds[0][0] == 0 and bounds[-1][1] == count
    sizes = [b - a for a, b in bounds]
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(world - 1))
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_split_range() -> None:
    assert split_range(5, 15, 4) == ((5, 9), (9, 13), (13, 15))
    assert split_range(3, 3, 4) == ()
    with pytest.raises(ValueError):
        split_range(0, 1, 0)


def test_subchunk_elements_is_clamped_and_deterministic() -> None:
    assert subchunk_elements(10, 2, 4) == MIN_SUBCHUNK_BYTES // 4
    assert subchunk_elements(1 << 30, 2, 4) == DEFAULT_SUBCHUNK_BYTES // 4
    # chunks of 1M elements -> 2 sub-chunks of 500k elements (2 MB, below the 4 MiB cap)
    assert subchunk_elements(2_000_000, 2, 4) == 500_000


def _simulate(count: int, world: int, sub: int) -> list[list[set[int]]]:
    """Run the schedule symbolically: which inputs each peer's copy of each element holds."""
    scheds = [RingSchedule(count, world, r, sub) for r in range(world)]
    # contributions[r][i] = set of ranks whose input is folded into peer r's element i
    contributions = [[{r} for _ in range(count)] for r in range(world)]
    for step in range(scheds[0].num_steps):
        outgoing = {}
        for r, s in enumerate(scheds):
            c = s.send_chunk(step)
            a, b = s.chunks[c]
            outgoing[(r + 1) % world] = (c, [set(x) for x in contributions[r][a:b]])
        for r, s in enumerate(scheds):
            c, data = outgoing[r]
            assert c == s.recv_chunk(step), "sender and receiver disagree on the chunk"
            a, _ = s.chunks[c]
            for j, contrib in enumerate(data):
                if s.phase(step) is Phase.REDUCE_SCATTER:
                    assert not (contributions[r][a + j] & contrib), "an input is counted twice"
                    contributions[r][a + j] |= contrib
                else:
                    contributions[r][a + j] = contrib
        if step == world - 2:  # end of reduce-scatter: each peer owns one complete chunk
            for r, s in enumerate(scheds):
                a, b = s.chunks[s.owned_chunk]
                assert all(contributions[r][i] == set(range(world)) for i in range(a, b))
    return contributions


@pytest.mark.parametrize("world", [2, 3, 4, 5, 7])
@pytest.mark.parametrize("count", [1, 3, 10, 33])
def test_schedule_reduces_every_input_exactly_once_everywhere(world: int, count: int) -> None:
    contributions = _simulate(count, world, sub=2)
    assert all(c == set(range(world)) for peer in contributions for c in peer)


@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_send_of_step_depends_on_receive_of_previous_step(world: int) -> None:
    s = RingSchedule(100, world, 1, 7)
    for step in range(1, s.num_steps):
        assert s.send_chunk(step) == s.recv_chunk(step - 1)
    assert s.send_chunk(world - 1) == s.owned_chunk


@pytest.mark.parametrize("lanes", [1, 2, 3])
def test_frames_match_between_neighbours_per_lane(lanes: int) -> None:
    world, count, sub = 4, 1001, 13
    scheds = [RingSchedule(count, world, r, sub) for r in range(world)]
    for r, lane in itertools.product(range(world), range(lanes)):
        sent = scheds[r].send_frames(lane, lanes)
        received = scheds[(r + 1) % world].recv_frames(lane, lanes)
        assert sent == received
        assert all(f.index % lanes == lane for f in sent)
        assert [(f.step, f.index) for f in sent] == sorted((f.step, f.index) for f in sent)
    all_frames = [f for lane in range(lanes) for f in scheds[0].send_frames(lane, lanes)]
    assert sum(f.count for f in all_frames) == scheds[0].sent_elements()


def test_sent_elements_match_pccl_accounting() -> None:
    # PCCL: tx = 2B - |c(r+1)| - |c(r+2)|.
    count, world = 10, 4
    for r in range(world):
        s = RingSchedule(count, world, r, 3)
        sizes = [b - a for a, b in s.chunks]
        assert s.sent_elements() == 2 * count - sizes[(r + 1) % world] - sizes[(r + 2) % world]
        assert s.received_elements() == 2 * count - sizes[(r + 1) % world] - sizes[r]


def test_invalid_parameters() -> None:
    with pytest.raises(ValueError):
        RingSchedule(10, 1, 0, 4)
    with pytest.raises(ValueError):
        RingSchedule(10, 3, 3, 4)
    with pytest.raises(ValueError):
        RingSchedule(10, 3, 0, 4).send_chunk(4)
    with pytest.raises(ValueError):
        RingSchedule(10, 3, 0, 4).send_frames(2, 2)


# --- the exchange (small ops: every input around the ring) --------------------------------------


@pytest.mark.parametrize("count", [0, 1, 3, 1000])
@pytest.mark.parametrize("lanes", [1, 2])
@pytest.mark.parametrize("world", [2, 3, 5])
def test_exchange_brings_every_input_to_every_peer_in_world_minus_one_steps(count: int, lanes: int,
                                                                            world: int) -> None:
    scheds = [ExchangeSchedule(count, world, r, 7) for r in range(world)]
    assert all(s.num_steps == world - 1 and s.phase(s.num_steps - 1) is Phase.REDUCE_SCATTER for s in scheds)
    pieces = [(a, min(a + 7, count)) for a in range(0, count, 7)]
    for r, lane in itertools.product(range(world), range(lanes)):
        sent = scheds[r].send_frames(lane, lanes)
        assert sent == scheds[(r + 1) % world].recv_frames(lane, lanes)  # what one sends, the next expects
        assert all(f.index % lanes == lane for f in sent)
    for r, s in enumerate(scheds):
        # Step 0 sends the own input; step k forwards what step k - 1 received (chunk = origin).
        assert s.send_chunk(0) == r
        assert [s.send_chunk(k) for k in range(1, world - 1)] == [s.recv_chunk(k - 1) for k in range(1, world - 1)]
        # Every other peer's input arrives exactly once, whole.
        assert sorted(s.recv_chunk(k) for k in range(world - 1)) == sorted(set(range(world)) - {r})
        for k in range(world - 1):
            frames = sorted((f for lane in range(lanes) for f in s.recv_frames(lane, lanes) if f.step == k),
                            key=lambda f: f.start)
            assert [(f.start, f.stop) for f in frames] == pieces
            assert {f.chunk for f in frames} <= {s.recv_chunk(k)}
        assert s.sent_elements() == s.received_elements() == (world - 1) * count
    # At two peers: the same bytes as the ring, half the trips.
    if world == 2:
        assert RingSchedule(count, 2, 0, 7).sent_elements() == count
    with pytest.raises(ValueError):
        scheds[0].send_chunk(world - 1)


def test_exchange_is_chosen_from_agreed_parameters_only() -> None:
    # At most EXCHANGE_MAX_BYTES sent per peer: (world - 1) * input bytes.
    assert uses_exchange(2, EXCHANGE_MAX_BYTES, quantized=False)
    assert not uses_exchange(2, EXCHANGE_MAX_BYTES + 1, quantized=False)
    assert uses_exchange(3, EXCHANGE_MAX_BYTES // 2, quantized=False)
    assert not uses_exchange(3, EXCHANGE_MAX_BYTES // 2 + 1, quantized=False)
    assert uses_exchange(5, EXCHANGE_MAX_BYTES // 4, quantized=False)
    assert not uses_exchange(5, EXCHANGE_MAX_BYTES // 4 + 4, quantized=False)
    assert not uses_exchange(2, 16, quantized=True)
    assert not uses_exchange(1, 16, quantized=False)


def test_ring_order_helpers() -> None:
    from pccl.protocol.ring import build_ring, ring_neighbours, ring_predecessor, ring_successor

    ring = build_ring([30, 10, 20])
    assert ring == (10, 20, 30)
    assert [ring_successor(ring, p) for p in ring] == [20, 30, 10]
    assert [ring_predecessor(ring, p) for p in ring] == [30, 10, 20]
    assert ring_neighbours(ring, 10) == (30, 20)
    assert ring_neighbours((10, 20), 10) == (20,)  # a ring of two: one neighbour, both directions
    assert ring_neighbours((10,), 10) == ()
    assert ring_successor((10,), 10) == ring_predecessor((10,), 10) == 10
    with pytest.raises(ValueError):
        ring_successor(ring, 99)


@given(st.integers(0, 40), st.integers(2, 6), st.integers(1, 9), st.integers(1, 3), st.booleans())
def test_moves_nothing_and_cached_frame_lists(count: int, world: int, sub: int, lanes: int, exchange: bool) -> None:
    kind = ExchangeSchedule if exchange else RingSchedule
    schedules = [kind(count, world, r, sub) for r in range(world)]
    for s in schedules:
        frames = [f for lane in range(lanes) for f in (*s.send_frames(lane, lanes), *s.recv_frames(lane, lanes))]
        assert s.moves_nothing == (not frames) == (count == 0)
        # Asked again, the same (cached) frames; a bad lane is still refused.
        assert all(s.send_frames(lane, lanes) is s.send_frames(lane, lanes) for lane in range(lanes))
        with pytest.raises(ValueError):
            s.recv_frames(lanes, lanes)
    shared = shared_schedule(exchange, count, world, 0, sub)
    assert type(shared) is kind and shared is shared_schedule(exchange, count, world, 0, sub)
    assert shared.send_frames(0, lanes) == schedules[0].send_frames(0, lanes)
