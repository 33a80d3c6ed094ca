"""The scatter + all-gather broadcast in the simulator: at 8 peers the production peer's automatic
choice sends a 240 KB broadcast through it (between the tree's and the chain's sizes); the
collectives checker (every completed broadcast holds the root's bytes on exactly its
participants, aborted calls left their input intact) holds when a peer is killed inside one,
and under the chaos profile."""

from __future__ import annotations

import collections

import pytest

from pccl.protocol.algorithms import BroadcastAlgorithm, choose_broadcast
from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec

PEERS = 8
N = 60_000  # f32, 240 KB: the scatter + all-gather at 8 peers (the chain at the 7 survivors)


def test_the_buffer_takes_the_scatter_all_gather() -> None:
    auto = dict(quantized=False, segmented=False, partner_links=True)
    assert choose_broadcast(4 * N, PEERS, **auto) is BroadcastAlgorithm.SCATTER_ALL_GATHER
    assert choose_broadcast(4 * N, PEERS - 1, **auto) is BroadcastAlgorithm.CHAIN


@pytest.mark.parametrize(("direction", "host", "nth"), [("recv", "peer3", 2), ("send", "peer4", 2)],
                         ids=["receiver", "sender"])
def test_a_peer_killed_inside_a_scatter_all_gather_broadcast(direction: str, host: str, nth: int) -> None:
    phase = {"name": "collectives", "kinds": ["broadcast"], "concurrent": 2, "in_flight": 2, "n": N}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=PEERS, duration=6.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    scenario, schedule = spec.build(0)
    # The kill fires as the host moves its 2nd broadcast data frame: a receiver as it arrives
    # (its scatter part is in, the all-gather under way), a sender as it leaves.
    trigger = Trigger("message", host=host, direction=direction, message="data:broadcast", nth=nth)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, "kill", host=host, trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    kinds = collections.Counter(e.kind for e in trace.events)
    assert kinds["collective_aborted"] > 0, kinds  # inside the transfer: the survivors' op aborted
    assert all(e.data["restored"] for e in trace.of_kind("collective_aborted"))
    after = trace.of_kind("triggered")[0].t
    done = [e for e in trace.of_kind("collective") if e.t > after + 1]
    assert done and {e.data["world_size"] for e in done} == {PEERS - 1}


def test_scatter_all_gather_broadcasts_under_chaos_pass_the_checker() -> None:
    # Concurrent 240 KB broadcasts and all-reduces (sharing the partner links, one op at a time in
    # commence order) under the chaos profile's faults.
    phase = {"name": "collectives", "kinds": ["broadcast", "all_reduce"], "concurrent": 4, "in_flight": 3, "n": N}
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=PEERS, duration=8.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    trace = run(*spec.build(3))
    assert trace.ok, [f.message for f in trace.failures]
    counts = collections.Counter(e.data["op"] for e in trace.of_kind("collective"))
    assert counts["broadcast"] > 10 and counts["all_reduce"] > 10, counts
    assert all(e.data["restored"] for e in trace.of_kind("collective_aborted"))
