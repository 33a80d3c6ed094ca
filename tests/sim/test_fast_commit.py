"""``Config.fast_commit`` in the simulator: calls made one after the other wait for one master
round trip each (the verdict) instead of two, concurrent ones fall back to the vote or join a
begun op, and a peer killed at the awkward moments of a begun op (right after its Begin, inside
the ring before everyone began, right after its Done) leaves every checker of one collective's
guarantees satisfied and the survivors running."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from pccl.protocol import messages as m
from pccl_sim.engine.runner import Checker, Simulation, run
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.engine.trace import Trace
from pccl_sim.tools.campaign import CampaignSpec
from pccl_sim.tools.scenarios import scenario_from_json
from pccl_sim.workloads.pccl.scenario import PcclScenario

SCHEDULES = pathlib.Path(__file__).parent / "schedules"
SEQUENTIAL = ("compute", "all_reduce",
              {"name": "collectives", "kinds": ["broadcast", "reduce_scatter", "all_reduce"], "concurrent": 3,
               "in_flight": 1, "tag": 200})


def _trips(trace: Trace) -> dict[str, int]:
    return {k: v for k, v in trace.stats.items() if k.startswith("master_round_trips_")}


def test_calls_one_after_the_other_wait_for_one_master_round_trip() -> None:
    scenario = PcclScenario(peers=4, phases=SEQUENTIAL, fast_commit=True, max_master_round_trips=1)
    trace = run(scenario, Schedule(seed=1, duration=2.0, quiet=3.0, scenario=scenario.to_json()))
    assert trace.ok, [f.message for f in trace.failures]
    calls = trace.stats["all_reduce_completed"] + trace.stats["collectives_completed"]
    assert calls > 50 and _trips(trace) == {"master_round_trips_1": calls}


def test_concurrent_calls_vote_or_join_and_all_complete() -> None:
    phases: Any = ("compute", {"name": "collectives", "concurrent": 4})  # every kind, all at once
    scenario = PcclScenario(peers=3, phases=phases, fast_commit=True)
    trace = run(scenario, Schedule(seed=2, duration=2.0, quiet=3.0, scenario=scenario.to_json()))
    assert trace.ok, [f.message for f in trace.failures]
    trips = _trips(trace)
    assert set(trips) == {"master_round_trips_1", "master_round_trips_2"}  # the first begins, the rest vote
    assert sum(trips.values()) == trace.stats["collectives_completed"] and trace.stats["collectives_aborted"] == 0


@pytest.mark.parametrize(("part", "direction"), [
    ("CollectiveBegin", "send"),  # it began: the others' rings wait for it
    ("data:reduce-scatter", "send"),  # inside its ring
    ("CollectiveDone", "send"),  # its part done, the verdict not yet in
])
def test_a_peer_killed_in_a_begun_op_hangs_nobody(part: str, direction: str) -> None:
    phase = {"name": "all_reduce", "n": 70_000}  # a ring op (reduce-scatter + all-gather) at 4 peers
    spec = CampaignSpec(scenario="pccl", profile="none", peers=4, duration=8.0, quiet=None,
                        params=(("phases", ("compute", phase)), ("fast_commit", True)))
    scenario, schedule = spec.build(0)
    trigger = Trigger("message", host="peer1", direction=direction, message=part, nth=3)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, "kill", host="peer1", trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    after = trace.of_kind("triggered")[0].t
    worlds = {e.data["world_size"] for e in trace.of_kind("all_reduce") if e.t > after + 1}
    assert worlds == {3}  # the survivors went on, re-wired
    assert trace.stats["master_round_trips_1"] > trace.stats.get("master_round_trips_2", 0)


class _LateBegins(Checker):
    """Records the Begins the master read after ``after`` and the Commences the peers read (the
    moment the replay below must reach)."""

    name = "late-begins"

    def __init__(self, after: float) -> None:
        self.after = after
        self.late: list[tuple[int, int]] = []  # (tag, seq) of Begins the master read late
        self.read: list[tuple[str, int, int]] = []  # (message, tag, seq) a peer read
        self.sim: Simulation | None = None

    def attach(self, sim: Simulation) -> None:
        assert sim.tap is not None
        self.sim = sim
        sim.tap.watch(self._wire, names=("CollectiveBegin", "CollectiveCommence"))

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is None or direction != "recv" or self.sim is None:
            return
        if name == "CollectiveBegin" and host == "master" and self.sim.now > self.after:
            self.late.append((msg.tag, msg.seq))
        elif host.startswith("peer"):
            self.read.append((name, msg.tag, msg.seq))


def test_a_begin_held_up_while_a_finished_participant_dies_joins_its_op() -> None:
    """``fast_commit_late_begin_shrunk.json`` (seed 377 of the 8-peer chaos campaign, shrunk):
    peer0's link to the master is clogged as it sends its Begin of an all-reduce whose ring runs
    to the end on all 8 peers; peer7, finished, is killed; then the clog lifts.  The master used
    to refuse peer0's late Begin as STALE_RING (peer7's death made the group stale) yet complete
    the op, never armed, on the Dones: all-reduce-agreement failed ("seq ... completed without
    the Commence that arms it") and peer0 alone would have raised CollectiveAborted."""
    schedule = Schedule.load(SCHEDULES / "fast_commit_late_begin_shrunk.json")
    assert [e.kind for e in schedule.events] == ["clog", "kill"]
    scenario = scenario_from_json(schedule.scenario)
    late = _LateBegins(after=schedule.events[1].t)
    checkers = scenario.checkers
    scenario.checkers = lambda: [late, *checkers()]  # type: ignore[method-assign]
    trace = run(scenario, schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    assert late.late, "the replay no longer holds a Begin up past the kill"
    tag, seq = late.late[0]  # peer0's, held up: it armed its op on the 7 survivors
    assert late.read.count(("CollectiveCommence", tag, seq)) == 7


def test_a_begin_that_arrives_after_its_op_aborted_hears_the_abort() -> None:
    """Seed 37 of the 8-peer chaos campaign with sites and the optimize phase: peer1 is killed
    as it begins an all-reduce (tag 100) that three peers began before it and three begin at the
    same instant; the master aborts the op on the first three ("participant left before
    finishing") before the last three's Begins arrive.  It used to refuse those as STALE_RING:
    their calls re-wired and voted again, alone, while the first three returned
    CollectiveAborted and went on to update_topology — a phase mismatch crashed the run at
    t=9.98.  Now the late beginners hear the same abort: all six abort tag 100's first use."""
    spec = CampaignSpec(peers=8, duration=10, params=(
        ("phases", ("compute", "optimize", {"name": "all_reduce", "n": [33, 65537, 250000]}, "collectives")),
        ("fast_commit", True), ("sites", {"count": 2, "uplink": 125e6}),
    ))
    scenario, schedule = spec.build(37)
    trace = run(scenario, schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    first_use = [e for e in trace.events if e.kind == "collective_aborted" and e.data["tag"] == 100
                 and 9.0 <= e.t <= 9.1]
    assert len({e.source for e in first_use}) == 6, [(e.source, e.data["error"]) for e in first_use]
    assert len({e.data["error"].split("(seq ")[1].split(")")[0] for e in first_use}) == 1  # one op
    assert not [e for e in trace.events if "phase mismatch" in str(e.data.get("error", ""))]


@pytest.mark.parametrize("seed", [1, 2])
def test_a_begun_op_and_the_ops_voted_after_it_take_turns_alike_on_every_peer(seed: int) -> None:
    """The collectives phase starts its tags one by one (each after a checkpoint): whether the
    first still sees the next one starting differs per peer, so some peers begin it and the
    others vote for it (they join the begun op).  Its derived seq sorts after the master's
    seqs of the tags voted after it: ordered by seq, a voter gave the partner links to the next
    tag's broadcast first while a beginner ran the begun all-reduce, and each waited for the
    other's frames until the watchdog aborted both, on every step of a fault-free run."""
    phases: Any = ("compute", {"name": "collectives", "n": 1000})
    scenario = PcclScenario(peers=8, phases=phases, fast_commit=True)
    trace = run(scenario, Schedule(seed=seed, duration=3.0, quiet=3.0, scenario=scenario.to_json()))
    assert trace.ok, [f.message for f in trace.failures]
    assert trace.stats["collectives_aborted"] == 0
    assert trace.stats["collectives_completed"] > 100
    assert trace.stats["master_round_trips_2"] > 0  # the later tags voted (a mix, not one path)


class _StaleBegins(Checker):
    """The tags whose Begin the master refused STALE_RING, and those whose held votes it refused
    because a non-voter re-wires (the moment the replay below must reach)."""

    name = "stale-begins"

    def __init__(self) -> None:
        self.begun: dict[str, int] = {}  # peer -> the tag of its last Begin the master read
        self.refused_begins: set[int] = set()
        self.refused_votes: set[int] = set()

    def attach(self, sim: Simulation) -> None:
        assert sim.tap is not None
        sim.tap.watch(self._wire, names=("CollectiveBegin", "CollectiveRejected"))

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is None or host != "master":
            return
        if name == "CollectiveBegin" and direction == "recv":
            self.begun[peer] = msg.tag
        elif name == "CollectiveRejected" and direction == "send" and msg.code == m.RejectCode.STALE_RING:
            if "since round" in msg.detail and self.begun.get(peer) == msg.tag:
                self.refused_begins.add(msg.tag)
            elif "re-wires it" in msg.detail:
                self.refused_votes.add(msg.tag)


@pytest.mark.parametrize("peer_commit", [True, False])
def test_votes_of_a_tag_whose_begin_was_refused_stale_retry_with_it(peer_commit: bool) -> None:
    """``shuffled_stale_begin_shrunk.json`` (seed 117 of a 40-seed campaign: 8 peers in two
    sites, fast and peer commit, six collectives launched in each peer's own order; shrunk):
    peer6 is killed as it starts its collectives, which makes the group stale.  Each peer
    begins its first tag and votes the rest; the master refuses the Begins STALE_RING, and a
    refused call re-wires only once its peer's other calls (held votes) end.  The master held
    the others' votes of the refused tags, for which the refused peers could not vote: every
    member waited in votes of different tags, and the phase mismatch that ended them ended the
    voters' calls alone.  The refused calls re-wired and retried their tags alone while the
    others went on to ``update_topology()``: a second phase mismatch raised ``PhaseMismatch``
    there (crash at t = 5.75).  Now those votes are refused STALE_RING at once, and every
    caller of the tag retries it on the re-wired ring.  Fast commit's refusal is the cause: with
    ``peer_commit`` off the same schedule crashed alike (t = 5.80)."""
    schedule = Schedule.load(SCHEDULES / "shuffled_stale_begin_shrunk.json")
    assert [e.kind for e in schedule.events] == ["stall", "kill"]
    scenario = scenario_from_json({**schedule.scenario, "peer_commit": peer_commit})
    stale = _StaleBegins()
    checkers = scenario.checkers
    scenario.checkers = lambda: [stale, *checkers()]  # type: ignore[method-assign]
    trace = run(scenario, schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    assert stale.refused_begins & stale.refused_votes, "the replay no longer refuses a Begin of a tag others voted"
    assert not [e for e in trace.events if "phase mismatch" in str(e.data.get("error", ""))]
