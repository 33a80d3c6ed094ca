"""The scatter + all-gather broadcast in the simulator: at 8 peers the production peer's automatic
choice sends a 240 KB broadcast through it (between the tree's and the chain's sizes); the
collectives checker (every completed broadcast holds the root's bytes on exactly its
participants, aborted calls left their input intact) holds when a peer is killed inside one,
and under the chaos profile, where faults land inside it at 8 peers."""

from __future__ import annotations

import collections

import pytest

from pccl.protocol.algorithms import BroadcastAlgorithm, choose_broadcast
from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec
from test_tree_broadcast_sim import chaos_broadcasts, ops_run

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
    with ops_run() as ops:
        trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    # The kill landed inside a scatter + all-gather: its survivors' ops raised.
    assert sum(c for (kind, world, end), c in ops.items()
               if kind == "ScatterAllGatherOp" and world == PEERS and end != "done") > 0, ops
    kinds = collections.Counter(e.kind for e in trace.events)
    assert kinds["collective_aborted"] > 0, kinds  # inside the transfer: the survivors' op aborted
    assert all(e.data["restored"] for e in trace.of_kind("collective_aborted"))
    after = trace.of_kind("triggered")[0].t
    done = [e for e in trace.of_kind("collective") if e.t > after + 1]
    assert done and {e.data["world_size"] for e in done} == {PEERS - 1}


def test_scatter_all_gather_broadcasts_under_chaos_pass_the_checker() -> None:
    _, ops = chaos_broadcasts(N)  # 240 KB: the scatter + all-gather at 8 peers, the chain at 9 or 7
    done = sum(c for (kind, world, end), c in ops.items()
               if kind == "ScatterAllGatherOp" and world >= 8 and end == "done")
    broken = sum(c for (kind, world, end), c in ops.items()
                 if kind == "ScatterAllGatherOp" and world >= 8 and end == "PeerDisconnected")
    assert done > 20 and broken > 0, ops  # it ran, and faults landed inside it
