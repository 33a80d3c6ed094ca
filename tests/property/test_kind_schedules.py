"""pccl.protocol.ring: the reduce-scatter, all-gather and broadcast plans, simulated whole.

For any size, ring and lane count: what each peer sends on a lane is exactly what its successor
expects on that lane (step, sub-chunk, bounds: the receiver checks the header against them);
frame ``k`` received at step ``s`` is what frame ``k`` sent at ``s + 1`` is made from; and the
data flow ends as each collective promises (every owner has every contribution of its slice;
every peer has every other contribution once; every non-root has every sub-chunk once).
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pccl.protocol.ring import (
    AllGatherSchedule,
    BroadcastSchedule,
    ReduceScatterSchedule,
    RingSchedule,
    chunk_bounds,
    gather_bounds,
)

worlds = st.integers(2, 6)
sizes = st.integers(0, 300)
subs = st.integers(1, 40)
lane_counts = st.integers(1, 3)


def _links_agree(plans: list[RingSchedule], lanes: int) -> None:
    world = len(plans)
    for r, plan in enumerate(plans):
        successor = plans[(r + 1) % world]
        for lane in range(lanes):
            sent = [(f.step, f.index, f.start, f.stop) for f in plan.send_frames(lane, lanes)]
            expected = [(f.step, f.index, f.start, f.stop) for f in successor.recv_frames(lane, lanes)]
            assert sent == expected
            assert all(f.index % lanes == lane for f in plan.send_frames(lane, lanes))
        sends = plan.step_frames(False)
        for step, received in enumerate(plan.step_frames(True)[:-1]):
            following = sends[step + 1]
            # a frame sent after step 0 is made from one received (the paths send it then)
            assert bool(following) <= bool(received)
            if received and following:
                assert [(f.start, f.stop) for f in following] == [(f.start, f.stop) for f in received]
        assert len(plan.step_frames(True)) == len(sends) == plan.num_steps == world - 1


@given(worlds, sizes, subs, lane_counts)
def test_reduce_scatter_owners_hold_everything(world: int, count: int, sub: int, lanes: int) -> None:
    plans: list[RingSchedule] = [ReduceScatterSchedule(count, world, r, sub) for r in range(world)]
    _links_agree(plans, lanes)
    # held[r][c]: whose contributions peer r's accumulator of chunk c contains
    held = [[{r} for _ in range(world)] for r in range(world)]
    for step in range(world - 1):
        moved = [(plans[r].send_chunk(step), set(held[r][plans[r].send_chunk(step)])) for r in range(world)]
        for r in range(world):
            chunk, contributions = moved[(r - 1) % world]
            assert chunk == plans[r].recv_chunk(step)
            assert not contributions & held[r][chunk]  # nothing is counted twice
            held[r][chunk] |= contributions
    for r in range(world):
        assert plans[r].owned_chunk == r and held[r][r] == set(range(world))
    assert [plan.chunks[r] for r, plan in enumerate(plans)] == list(chunk_bounds(count, world))


@given(worlds, st.data(), subs, lane_counts)
def test_all_gather_delivers_every_contribution_once(world: int, data: st.DataObject, sub: int, lanes: int) -> None:
    counts = data.draw(st.lists(st.integers(0, 60), min_size=world, max_size=world))
    plans: list[RingSchedule] = [
        AllGatherSchedule(sum(counts), world, r, sub, counts=counts) for r in range(world)
    ]
    _links_agree(plans, lanes)
    for r, plan in enumerate(plans):
        assert plan.chunks == gather_bounds(counts)
        received = [c for s in range(world - 1) for c in plan.step_chunks(s, True)]
        assert sorted(received) == sorted(set(range(world)) - {r})
        assert plan.send_chunk(0) == r
        assert plan.received_elements() == sum(counts) - counts[r]


@given(worlds, sizes, subs, lane_counts, st.data())
def test_broadcast_chain_reaches_everyone(world: int, count: int, sub: int, lanes: int, data: st.DataObject) -> None:
    root = data.draw(st.integers(0, world - 1))
    plans: list[RingSchedule] = [BroadcastSchedule(count, world, r, sub, root=root) for r in range(world)]
    _links_agree(plans, lanes)
    pieces = plans[0].subchunks(0)
    for r, plan in enumerate(plans):
        d = (r - root) % world
        got = [(f.step, f.start, f.stop) for f in plan.recv_frames()]
        sent = [(f.step, f.start, f.stop) for f in plan.send_frames()]
        assert got == ([] if d == 0 else [(d - 1, a, b) for a, b in pieces])
        assert sent == ([] if d == world - 1 else [(d, a, b) for a, b in pieces])
