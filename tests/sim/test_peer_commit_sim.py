"""``Config.peer_commit`` in the simulator: calls commit among their peers, some without reading
any master answer at all (``master_round_trips_0``, which fast commit's verdict never allows), a
peer killed at the awkward moments of a peer-agreed op leaves every checker satisfied, and the
checker of outcomes refuses a commit that a participant's readiness does not back."""

from __future__ import annotations

import types
from typing import Any

import pytest

from pccl.protocol import messages as m
from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.engine.trace import TraceEvent
from pccl_sim.tools.campaign import CampaignSpec
from pccl_sim.workloads.pccl.op_checkers import OutcomeFollowsVerdict
from pccl_sim.workloads.pccl.scenario import PcclScenario

SEQUENTIAL = ("compute", "all_reduce",
              {"name": "collectives", "kinds": ["broadcast", "reduce_scatter", "all_reduce"], "concurrent": 3,
               "in_flight": 1, "tag": 200})


def test_calls_commit_among_their_peers_some_without_any_master_answer() -> None:
    scenario = PcclScenario(peers=3, phases=SEQUENTIAL, fast_commit=True, peer_commit=True,
                            max_master_round_trips=1)
    trace = run(scenario, Schedule(seed=1, duration=2.0, quiet=3.0, scenario=scenario.to_json()))
    assert trace.ok, [f.message for f in trace.failures]
    calls = trace.stats["all_reduce_completed"] + trace.stats["collectives_completed"]
    trips = {k: v for k, v in trace.stats.items() if k.startswith("master_round_trips_")}
    assert calls > 50 and sum(trips.values()) == calls
    assert trips.get("master_round_trips_0", 0) > 0, trips  # the acks beat the master's Complete


@pytest.mark.parametrize(("part", "direction"), [
    ("CollectiveBegin", "send"),  # it began: the others' rings wait for it
    ("data:reduce-scatter", "send"),  # inside its ring
    ("CollectiveDone", "send"),  # ready: its acks go out next, its verdict is no master's
])
def test_a_peer_killed_in_a_peer_agreed_op_hangs_and_splits_nobody(part: str, direction: str) -> None:
    phase = {"name": "all_reduce", "n": 70_000}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=4, duration=8.0, quiet=None,
                        params=(("phases", ("compute", phase)), ("fast_commit", True), ("peer_commit", True)))
    scenario, schedule = spec.build(0)
    trigger = Trigger("message", host="peer1", direction=direction, message=part, nth=3)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, "kill", host="peer1", trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    after = trace.of_kind("triggered")[0].t
    assert {e.data["world_size"] for e in trace.of_kind("all_reduce") if e.t > after + 1} == {3}
    assert spec.command(0).endswith("--fast-commit --peer-commit")


class _Sim:
    def __init__(self) -> None:
        self.failures: list[tuple[str, str]] = []

    def fail(self, kind: str, message: str, checker: str) -> None:
        self.failures.append((kind, message))


def _outcome_of_a_commit(ready: list[str]) -> list[tuple[str, str]]:
    """Two hosts on a ring of two begin an op with peer_commit; the hosts in ``ready`` report it
    done; peer0's call returns a result without any final word."""
    checker = OutcomeFollowsVerdict()
    sim: Any = _Sim()
    checker.sim = sim
    ids = {"peer0": 10, "peer1": 11}
    ring = types.SimpleNamespace(ring=tuple(types.SimpleNamespace(peer_id=p) for p in ids.values()))
    seq = m.derived_seq(1, 5, 0)
    for host, pid in ids.items():
        checker._wire(host, "recv", "Welcome", "master", m.Welcome(pid, 7))
        checker._wire(host, "recv", "TopologyComplete", "master", ring)
        checker.on_event(sim, TraceEvent(0, 0.0, host, "all_reduce_call", {"tag": 5, "k": 0}))
        checker._wire(host, "send", "CollectiveBegin", "master", m.CollectiveBegin(5, seq, 1, 4, 10, 0, peer_commit=True))
    for host in ready:
        checker._wire(host, "send", "CollectiveDone", "master", m.CollectiveDone(5, seq))
    checker.on_event(sim, TraceEvent(1, 1.0, "peer0", "all_reduce", {"tag": 5, "k": 0}))
    return sim.failures


def test_the_outcome_checker_takes_a_commit_only_when_every_participant_reported_ready() -> None:
    assert _outcome_of_a_commit(["peer0", "peer1"]) == []
    failures = _outcome_of_a_commit(["peer0"])
    assert len(failures) == 1 and failures[0][0] == "safety" and "b never reported ready" in failures[0][1]
