"""``Config.peer_commit`` in the simulator: calls commit among their peers, some without reading
any master answer at all (``master_round_trips_0``, which fast commit's verdict never allows), a
peer killed at the awkward moments of a peer-agreed op leaves every checker satisfied, and the
checker of outcomes refuses a commit that a participant's readiness does not back."""

from __future__ import annotations

import types
from typing import Any

import pytest

from pccl.protocol import messages as m
from pccl_sim.engine.runner import Checker, run
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


class _LateArming(Checker):
    """Witness: a peer read a begun op's arming ``Commence`` after it had voted a topology."""

    name = "late-arming"

    def __init__(self) -> None:
        self.voting: set[str] = set()
        self.seen: list[tuple[str, int]] = []

    def attach(self, sim: Any) -> None:
        sim.tap.watch(self._wire, names={"VoteTopology", "TopologyComplete", "CollectiveCommence"})

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if name == "VoteTopology" and direction == "send":
            self.voting.add(host)
        elif name == "TopologyComplete" and direction == "recv":
            self.voting.discard(host)
        elif name == "CollectiveCommence" and direction == "recv" and host in self.voting:
            self.seen.append((host, msg.seq))


def test_a_begun_ops_arming_commence_read_after_its_peer_commit_and_a_topology_vote_is_no_phase_violation() -> None:
    # No faults, 2 peers: peer1 begins last and commits at once; the master arms the op on both as
    # peer1's Begin comes in while peer0, committed on peer1's acks, reports Done and votes its
    # next step's topology.  The arming Commence reaches peer0 inside that vote: phase-rule took
    # it for a commencement (a safety failure at t=0.4999) though the Begin was the commencement.
    spec = CampaignSpec(scenario="pccl", profile="none", peers=2, duration=8.0, quiet=None,
                        params=(("phases", ("compute", {"name": "all_reduce", "n": 1000})), ("fast_commit", True),
                                ("peer_commit", True)))
    scenario, schedule = spec.build(0)
    witness = _LateArming()
    scenario.checkers = lambda real=scenario.checkers: [*real(), witness]  # type: ignore[method-assign]
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert witness.seen and all(seq >> 63 for _, seq in witness.seen), witness.seen  # begun ops' (derived seq)
    assert trace.stats["all_reduce_completed"] > 100 and trace.stats["all_reduce_aborted"] == 0
    again = run(*spec.build(0))
    assert again.ok and again.hash() == trace.hash()  # the seed replays the same run
    assert spec.command(0) == ("pccl-sim replay --seed 0 --profile none --peers 2 --duration 8 --phases "
                               "'[\"compute\",{\"name\":\"all_reduce\",\"n\":1000}]' --fast-commit --peer-commit")


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
