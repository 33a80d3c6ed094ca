"""The halving-doubling all-reduce in the simulator: from 8 peers up the production peer picks
recursive doubling for small ops (and Rabenseifner for mid-size ones), over the partner links
its topology rounds wire; the workload's checkers (results equal the model of the algorithm that
ran, bit-identical on every peer, aborted ops restored) hold when a peer is killed inside it."""

from __future__ import annotations

import collections

import pytest

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec


@pytest.mark.parametrize(("peers", "n", "part"), [(8, 1000, "data:exchange"), (9, 1000, "data:exchange"),
                                                  (8, 200_000, "data:reduce-scatter")],
                         ids=["8-doubling", "9-fold", "8-halving"])
def test_a_peer_killed_inside_a_halving_doubling_op(peers: int, n: int, part: str) -> None:
    # 1000 f32 (4 KB): recursive doubling; 200,000 (800 KB) at 8 peers: Rabenseifner.  The kill
    # fires right after peer1 sent its 2nd data frame of an op.  The tap names frames after the
    # ring's plans (pccl_sim.workloads.pccl.frames): a small op's as the exchange's, a larger
    # one's by step (all of Rabenseifner's steps are below N - 1: "reduce-scatter").
    phase = {"name": "all_reduce", "n": n}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=peers, duration=6.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    scenario, schedule = spec.build(0)
    trigger = Trigger("message", host="peer1", direction="send", message=part, nth=2)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, "kill", host="peer1", trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    kinds = collections.Counter(e.kind for e in trace.events)
    assert kinds["all_reduce_aborted"] > 0  # inside the transfer: the survivors' op aborted
    after = trace.of_kind("triggered")[0].t
    if peers == 8:  # the bytes say which algorithm ran before the kill: 3 doubling steps, or 2 x 7/8
        sent = {e.data["tx"] for e in trace.of_kind("all_reduce") if e.t < after}
        assert sent == {3 * 4 * n if n == 1000 else 2 * 7 * 4 * n // 8}, sent
    reduced = [e for e in trace.of_kind("all_reduce") if e.t > after + 1]
    assert reduced and {e.data["world_size"] for e in reduced} == {peers - 1}
