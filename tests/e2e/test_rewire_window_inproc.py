"""A collective call and a re-wire of the same peer begun while the call is on its way to its tag
(peers as Trio tasks in this process, real TCP).

A call first joins a re-wire of its peer that stands (the all-reduce's internal vote, which the
phase rule says refuses collectives), then waits for a cancelled call on its tag to be settled
and, on the fast path, checks whether it is alone; only then does it claim its tag.  A re-wire
that another call of the same peer began during those awaits (a call on another tag that met a
stale ring) made the legal call fail with ``InvalidUsage: cannot start a collective while a
topology vote (rewire) is outstanding`` — the full test run hit it under load.  The call is
held at that spot here (:func:`pccl.testing.hold_call_before_route`) while its peer starts the
re-wire, so the race is met every time: as ``all_reduce`` and as ``all_reduce_many`` (what
``pccl.torch``'s DDP calls per bucket) take it, on the fast path and the voted one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
import pccl.testing
from pccl import Config
from pccl.protocol.phases import TopologyVote
from pccl.testing import open_test_cluster

TOKEN = "rewire-window"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0)
SOON = 30.0
#: Upper bound for the whole scenario once the cluster stands (a hang check, not a speed check).
BOUND = 30.0
TAG = 7


@pytest.mark.parametrize("many", [False, True], ids=["all_reduce", "all_reduce_many"])
@pytest.mark.parametrize("fast_commit", [False, True], ids=["voted", "fast"])
async def test_a_rewire_begun_while_a_call_is_on_its_way_to_its_tag_is_joined_not_refused(
        fast_commit: bool, many: bool) -> None:
    config = dataclasses.replace(CFG, fast_commit=fast_commit)
    async with open_test_cluster(3, token=TOKEN, config=config, soon=SOON) as (master, comms, _):
        x, *others = comms
        inputs = [np.arange(1000, dtype=np.float32) * (i + 1) for i in range(3)]
        arrays = [a.copy() for a in inputs]
        infos: dict[int, pccl.ReduceInfo] = {}
        before = [c.statistics() for c in comms]

        async def reduce(i: int) -> None:
            if many:
                infos[i] = await comms[i].all_reduce_many([arrays[i]], first_tag=TAG)  # one bucket: tag TAG
            else:
                infos[i] = await comms[i].all_reduce(arrays[i], tag=TAG)

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as calls:
                async with pccl.testing.hold_call_before_route(x, TAG) as reached:
                    calls.start_soon(reduce, 0)
                    await reached.wait()
                    # Meanwhile another call of x (on another tag) met a stale ring: x re-wires.
                    calls.start_soon(pccl.testing.force_rewire, x)
                    while pccl.testing.phase_of(x).topology_vote is not TopologyVote.REWIRE:
                        await trio.lowlevel.checkpoint()
                # The call goes on while x's re-wire stands (the others have not voted yet): it was
                # refused here; now it joins the re-wire and waits for its round.
                await trio.testing.wait_all_tasks_blocked()
                assert not infos and pccl.testing.phase_of(x).topology_vote is TopologyVote.REWIRE
                assert pccl.testing.phase_of(x).collectives == frozenset()
                async with trio.open_nursery() as voters:  # the others' internal votes: the round completes
                    for comm in others:
                        voters.start_soon(pccl.testing.force_rewire, comm)
                for i in (1, 2):
                    calls.start_soon(reduce, i)
        want = sum(inputs)
        assert all(np.array_equal(a, want) for a in arrays)
        assert sorted(infos) == [0, 1, 2] and all(info.world_size == 3 for info in infos.values()), infos
        after = [c.statistics() for c in comms]
        assert [a.p2p_rounds - b.p2p_rounds for a, b in zip(after, before)] == [1, 1, 1]  # the one re-wire
        assert after[0].retries == before[0].retries  # x's call joined it: never refused, never retried
        assert master.statistics().kicks == 0
        assert pccl.testing.master_snapshot(master).ops == ()


async def test_a_call_on_its_way_joins_the_rewire_another_call_of_its_peer_starts_after_a_stale_ring() -> None:
    # The race as the stress pattern met it, with no forced vote: a member left, and while x's
    # call on tag T is on its way to its tag, x's call on tag U meets the stale ring and re-wires
    # the group (the held call holds no tag yet, so that re-wire does not wait for it).  On the
    # fast path: x's Begin on U is refused STALE_RING at once, so x re-wires alone first (a
    # voted U is refused only once the others voted it too, and they re-wire with x).
    config = dataclasses.replace(CFG, fast_commit=True)
    other_tag = TAG + 1
    async with open_test_cluster(4, token=TOKEN, config=config, soon=SOON) as (master, comms, _):
        await comms[3].aclose()  # the ring is stale for the other three from now on
        x, y, z = comms[:3]
        with trio.fail_after(BOUND):
            while master.statistics().accepted_peers != 3:
                await trio.sleep(0.01)
            arrays = {(i, tag): np.full(100, float(i + 1) * (1 + tag), np.float32)
                      for i in range(3) for tag in (TAG, other_tag)}
            infos: dict[tuple[int, int], pccl.ReduceInfo] = {}
            before = [c.statistics() for c in (x, y, z)]

            async def reduce(i: int, tag: int) -> None:
                infos[i, tag] = await comms[i].all_reduce(arrays[i, tag], tag=tag)

            async with trio.open_nursery() as calls:
                async with pccl.testing.hold_call_before_route(x, TAG) as reached:
                    calls.start_soon(reduce, 0, TAG)
                    await reached.wait()
                    calls.start_soon(reduce, 0, other_tag)  # refused STALE_RING: x re-wires
                    while pccl.testing.phase_of(x).topology_vote is not TopologyVote.REWIRE:
                        await trio.sleep(0.001)
                await trio.testing.wait_all_tasks_blocked()
                assert not infos and pccl.testing.phase_of(x).topology_vote is TopologyVote.REWIRE
                for i in (1, 2):  # they meet the stale ring too, and their re-wires complete the round
                    calls.start_soon(reduce, i, other_tag)
                    calls.start_soon(reduce, i, TAG)
        for tag in (TAG, other_tag):
            want = np.full(100, 6.0 * (1 + tag), np.float32)
            assert all(np.array_equal(arrays[i, tag], want) for i in range(3)), tag
            assert all(infos[i, tag].world_size == 3 for i in range(3)), infos
        after = [c.statistics() for c in (x, y, z)]
        assert [a.p2p_rounds - b.p2p_rounds for a, b in zip(after, before)] == [1, 1, 1]  # the one re-wire
        assert after[0].retries == before[0].retries + 1  # x's call on U met the stale ring; the one on T joined
        assert master.statistics().kicks == 0
