"""The checkers of one collective's guarantees (docs/protocol.rst, "One collective: the
guarantees as messages"): each stays quiet on a legal exchange and fails on a planted violation
of its rule; on a real run they all pass and the round trips per call are counted."""

from __future__ import annotations

from typing import Any

import pytest

from pccl.protocol import messages as m
from pccl_sim.engine.runner import Checker, run
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.engine.trace import Trace, TraceEvent
from pccl_sim.workloads.pccl.op_checkers import (AgreedParameters, MasterRoundTrips, NoHungCall, OneVerdict,
                                                  OutcomeFollowsVerdict, PhaseRule, op_checkers)
from pccl_sim.workloads.pccl.orphan_waits import OrphanWaits
from pccl_sim.workloads.pccl.scenario import PcclScenario
from pccl_sim.workloads.pccl.split_checker import NoSplit


class _Tap:
    def __init__(self) -> None:
        self.watchers: list[tuple[Any, frozenset[str] | None]] = []

    def watch(self, callback: Any, names: Any = None, *, decode: bool = True) -> None:
        self.watchers.append((callback, None if names is None else frozenset(names)))


class _Sim:
    """What the checkers use of a simulation: the wire (fed by hand), the trace, the time."""

    def __init__(self, *checkers: Checker) -> None:
        self.trace = Trace()
        self.tap = _Tap()
        self.now = 0.0
        self.checkers = checkers
        self.events = 0
        for checker in checkers:
            checker.attach(self)  # type: ignore[arg-type]

    def fail(self, kind: str, message: str, source: str = "runner") -> None:
        self.trace.fail(kind, source, message, t=self.now)

    def wire(self, host: str, direction: str, msg: m.Message) -> None:
        name = type(msg).__name__
        for callback, names in self.tap.watchers:
            if names is None or name in names:
                callback(host, direction, name, "master", msg)

    def event(self, source: str, kind: str, **data: Any) -> None:
        self.events += 1
        for checker in self.checkers:
            checker.on_event(self, TraceEvent(self.events, self.now, source, kind, data))  # type: ignore[arg-type]

    def failures(self) -> list[tuple[str, str, str]]:
        return [(f.kind, f.source, f.message) for f in self.trace.failures]


def _init(tag: int = 7, count: int = 4, kind: int = 0) -> m.CollectiveInit:
    return m.CollectiveInit(tag, count, 1, 0, kind=kind)


def _op(sim: _Sim, hosts: tuple[str, ...] = ("peer0", "peer1"), *, verdicts: tuple[str, ...] = ("Complete", "Complete"),
        inits: tuple[m.CollectiveInit, ...] | None = None, seq: int = 1) -> None:
    """A whole op on ``hosts``: calls, Inits, one Commence each, Dones, the final words given."""
    for i, host in enumerate(hosts):
        sim.wire(host, "recv", m.Welcome(i + 1, instance=5))
    for i, host in enumerate(hosts):
        init = inits[i] if inits else _init()
        sim.event(host, "collective_call", tag=init.tag, k=1)
        sim.wire(host, "send", init)
    for host in hosts:
        sim.wire(host, "recv", m.CollectiveCommence(7, seq, (1, 2)))
    for host, verdict in zip(hosts, verdicts):
        sim.wire(host, "send", m.CollectiveDone(7, seq, aborted=verdict != "Complete"))
    for host, verdict in zip(hosts, verdicts):
        sim.wire(host, "recv", m.CollectiveComplete(7, seq) if verdict == "Complete" else m.CollectiveAbort(7, seq))
        sim.event(host, "collective" if verdict == "Complete" else "collective_aborted", tag=7, k=1)


def test_a_legal_op_passes_every_checker_and_waits_for_two_answers() -> None:
    trips = MasterRoundTrips(limit=2)
    sim = _Sim(*op_checkers(30.0)[:-1], trips)
    _op(sim)
    _op(sim, verdicts=("Abort", "Abort"), seq=2)
    sim.now = 100.0
    sim.event("monitor", "probe")
    assert sim.failures() == []
    assert trips.histogram == {2: 2}  # only successful calls count: Commence + Complete each


def test_one_verdict_fails_on_a_split_a_second_word_and_an_early_complete() -> None:
    sim = _Sim(OneVerdict())
    _op(sim, verdicts=("Complete", "Abort"))
    assert sim.failures() == [("safety", "one-verdict", "tag 7 seq 1 split: peer0 read Complete, peer1 read Abort")]

    sim = _Sim(OneVerdict())
    _op(sim)
    sim.wire("peer0", "recv", m.CollectiveAbort(7, 1))
    assert [f[2] for f in sim.failures()] == ["peer0 read a second final word for tag 7 seq 1: Complete, then Abort"]

    sim = _Sim(OneVerdict())
    sim.wire("peer0", "recv", m.Welcome(1, instance=5))
    sim.wire("peer0", "recv", m.CollectiveAbort(7, 3))
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 4, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveComplete(7, 4))
    assert [f[2] for f in sim.failures()] == ["peer0 read Abort for tag 7 seq 3, an op it was never commenced on"]
    sim = _Sim(OneVerdict())
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 4, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveComplete(7, 4))
    assert [f[2] for f in sim.failures()] == ["peer0 read Complete for tag 7 seq 4 before it reported its own success"]


def test_one_verdict_keeps_the_ops_of_master_instances_apart() -> None:
    sim = _Sim(OneVerdict())
    _op(sim)
    for host in ("peer0", "peer1"):  # a restarted master numbers ops from 1 again
        sim.wire(host, "send", m.Register(0, 5000, 0, 0))
        sim.wire(host, "recv", m.Welcome(3, instance=6))
        sim.wire(host, "recv", m.CollectiveCommence(7, 1, (1, 2)))
        sim.wire(host, "send", m.CollectiveDone(7, 1, aborted=True))
        sim.wire(host, "recv", m.CollectiveAbort(7, 1))
    assert sim.failures() == []


def test_agreed_parameters_fails_when_disagreeing_votes_commence() -> None:
    sim = _Sim(AgreedParameters())
    _op(sim, inits=(_init(count=4), _init(count=5)))
    assert sim.failures() == [("safety", "agreed-parameters", "tag 7 seq 1 commenced on votes that disagree: "
                               "peer0 voted all_reduce count=4 dtype=int8 op=sum quant=none/- layout=0, "
                               "peer1 voted all_reduce count=5 dtype=int8 op=sum quant=none/- layout=0")]
    sim = _Sim(AgreedParameters())
    _op(sim, inits=(_init(kind=m.CollectiveKind.ALL_GATHER), _init(kind=m.CollectiveKind.BROADCAST)))
    assert "disagree" in sim.failures()[0][2]
    sim = _Sim(AgreedParameters())  # all-gather contributions may differ in length: agreed
    _op(sim, inits=(_init(count=4, kind=m.CollectiveKind.ALL_GATHER), _init(count=0, kind=m.CollectiveKind.ALL_GATHER)))
    assert sim.failures() == []
    sim = _Sim(AgreedParameters())
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 1, (1, 2)))
    assert sim.failures()[0][2] == "peer0 was commenced on tag 7 seq 1 without having voted it"


def test_phase_rule_fails_on_a_commence_inside_a_topology_vote_and_a_round_over_a_running_op() -> None:
    sim = _Sim(PhaseRule())
    sim.wire("peer0", "send", m.VoteTopology(True))
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 1, (1, 2)))
    assert sim.failures()[0][1:] == ("phase-rule", "peer0 was commenced on tag 7 seq 1 while its topology vote or "
                                                   "round was outstanding")
    sim = _Sim(PhaseRule())
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 1, (1, 2)))
    sim.wire("peer0", "recv", m.ConnectToPeers(3, (1, 2), ()))
    assert sim.failures()[0][2] == ("peer0 was drawn into a topology round (ConnectToPeers) while its collectives "
                                    "ran: tag 7 seq 1")
    sim = _Sim(PhaseRule())
    sim.wire("peer0", "send", m.SyncVote(1, 0, ()))
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 1, (1, 2)))
    assert "shared-state sync" in sim.failures()[0][2]
    # Legal: a vote after the op's final word, a commence after the round's end or a sync's.
    sim = _Sim(PhaseRule())
    _op(sim)
    sim.wire("peer0", "send", m.VoteTopology(True))
    sim.wire("peer0", "recv", m.ConnectToPeers(3, (1, 2), ()))
    sim.wire("peer0", "recv", m.TopologyRejected("phase mismatch"))
    sim.wire("peer0", "send", m.SyncVote(1, 0, ()))
    sim.wire("peer0", "recv", m.SyncRejected(4))
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 2, (1, 2)))
    assert sim.failures() == []


def test_phase_rule_takes_a_begun_ops_late_arming_commence_for_none_and_still_fails_on_real_commences() -> None:
    # Peer commit: peer0 began the op, committed it on its acks (its call returned), reported
    # Done and voted a topology before the master's arming Commence (sent as the last Begin came
    # in) reached it.  That Commence arms a watchdog; the Begin was the commencement.
    def committed_and_voting() -> _Sim:
        sim = _Sim(PhaseRule())
        sim.event("peer0", "all_reduce_call", tag=0, k=1)
        sim.wire("peer0", "send", m.CollectiveBegin(0, 1 << 63 | 5, 2, 4, 1, 0, peer_commit=True))
        sim.event("peer0", "all_reduce", tag=0, k=1)
        sim.wire("peer0", "send", m.CollectiveDone(0, 1 << 63 | 5, aborted=False))
        sim.wire("peer0", "send", m.VoteTopology(True))
        return sim
    sim = committed_and_voting()
    sim.wire("peer0", "recv", m.CollectiveCommence(0, 1 << 63 | 5, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveComplete(0, 1 << 63 | 5))
    assert sim.failures() == []
    # Planted: the master commences another op of the tag (a vote's) in that topology vote.
    sim = committed_and_voting()
    sim.wire("peer0", "recv", m.CollectiveCommence(0, 1 << 63 | 5, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveCommence(0, 6, (1, 2)))
    assert sim.failures()[0][2] == ("peer0 was commenced on tag 0 seq 6 while its topology vote or round was "
                                    "outstanding")
    # Planted: a second Commence of the begun op is no arming one any more.
    sim = committed_and_voting()
    sim.wire("peer0", "recv", m.CollectiveCommence(0, 1 << 63 | 5, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveCommence(0, 1 << 63 | 5, (1, 2)))
    assert "while its topology vote or round was outstanding" in sim.failures()[0][2]
    # Planted: a Begin inside the vote is still a commencement in it.
    sim = committed_and_voting()
    sim.wire("peer0", "send", m.CollectiveBegin(1, 1 << 63 | 6, 2, 4, 1, 0, peer_commit=True))
    assert sim.failures()[0][2] == ("peer0 began tag 1 seq 9223372036854775814 while its topology vote or round "
                                    "was outstanding")


def test_outcome_follows_verdict_fails_when_a_call_ends_against_its_final_word() -> None:
    sim = _Sim(OutcomeFollowsVerdict())
    sim.event("peer0", "all_reduce_call", tag=7, k=3)
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 1, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveAbort(7, 1))
    sim.event("peer0", "all_reduce", tag=7, k=3)
    assert sim.failures() == [("safety", "outcome-follows-verdict",
                               "peer0: call #3 on tag 7 (seq 1) returned a result after reading Abort for its op")]
    sim = _Sim(OutcomeFollowsVerdict())
    _op(sim, verdicts=("Complete", "Complete"))
    sim.event("peer0", "collective_call", tag=7, k=2)
    sim.wire("peer0", "recv", m.CollectiveCommence(7, 2, (1, 2)))
    sim.wire("peer0", "recv", m.CollectiveComplete(7, 2))
    sim.event("peer0", "collective_aborted", tag=7, k=2, error="boom")
    assert sim.failures()[0][2] == "peer0: call #2 on tag 7 (seq 2) read Complete for its op but ended aborted: boom"
    sim = _Sim(OutcomeFollowsVerdict())
    sim.event("peer0", "collective_call", tag=7, k=1)
    sim.event("peer0", "collective", tag=7, k=1)
    assert "returned a result after reading no final word" in sim.failures()[0][2]


def test_no_hung_call_fails_a_call_that_outlives_the_bound_unless_the_master_restarted() -> None:
    sim = _Sim(NoHungCall(10.0))
    sim.event("peer0", "collective_call", tag=7, k=1)
    sim.event("peer1", "collective_call", tag=7, k=1)
    sim.now = 8.0
    sim.event("master", "start")  # the calls wait for the new master: their clocks start again
    sim.event("net", "kill", host="peer1")  # a killed host's call hangs nobody
    sim.now = 17.0
    sim.event("monitor", "probe")
    assert sim.failures() == []
    sim.now = 18.5
    sim.event("monitor", "probe")
    assert sim.failures() == [("liveness", "no-hung-call", "peer0: call #1 on tag 7 still runs 10.5 s after it began "
                                                         "(bound 10.0 s; without a Commence)")]


def test_no_hung_call_ignores_a_call_a_corpse_begins_at_its_death_instant() -> None:
    # seed 2474 (8 peers, --peer-commit): peer2 is killed as it sends a CollectiveInit; before its
    # next checkpoint its dead code starts the call on tag 103 -- a call of no live process.
    sim = _Sim(NoHungCall(10.0))
    sim.event("peer2", "collective_call", tag=102, k=1)
    sim.event("net", "kill", host="peer2")
    sim.event("peer2", "collective_call", tag=103, k=1)
    sim.now = 11.0
    sim.event("monitor", "probe")
    assert sim.failures() == []
    sim.event("peer2", "start")  # a new life: its calls count again
    sim.event("peer2", "collective_call", tag=103, k=1)
    sim.now = 21.5
    sim.event("monitor", "probe")
    assert sim.failures() == [("liveness", "no-hung-call", "peer2: call #1 on tag 103 still runs 10.5 s after it "
                                                         "began (bound 10.0 s; without a Commence)")]


def test_round_trips_limit_fails_a_call_that_waited_for_more() -> None:
    sim = _Sim(MasterRoundTrips(limit=1))
    _op(sim)
    assert sim.failures()[0][:2] == ("liveness", "master-round-trips")
    assert "waited for 2 master round trips (at most 1)" in sim.failures()[0][2]


_PHASES = ("compute", {"name": "all_reduce", "concurrent": 2}, {"name": "collectives", "concurrent": 4})


def _run(**params: Any) -> Trace:
    scenario = PcclScenario(peers=3, phases=_PHASES, **params)
    return run(scenario, Schedule(seed=3, duration=2.0, quiet=3.0, scenario=scenario.to_json()))


def test_a_fault_free_run_passes_and_every_successful_call_took_two_round_trips() -> None:
    trace = _run()
    assert trace.ok, trace.failures
    calls = trace.stats["all_reduce_completed"] + trace.stats["collectives_completed"]
    assert calls > 50
    assert {k: v for k, v in trace.stats.items() if k.startswith("master_round_trips_")} == {"master_round_trips_2": calls}


@pytest.mark.parametrize(("params", "sources"), [
    ({"max_master_round_trips": 1}, ["master-round-trips"]),  # today's protocol: Commence and Complete
    # a master that decides per participant: its words split, and so do the calls' outcomes
    ({"master": "split-verdict"}, ["one-verdict", "no-split"]),
])
def test_a_real_run_fails_on_the_claim_it_breaks(params: dict[str, Any], sources: list[str]) -> None:
    trace = _run(**params)
    assert [f.source for f in trace.failures] == sources, trace.failures


@pytest.mark.parametrize("peer_commit", [False, True])
def test_a_peer_killed_as_it_sends_a_collective_init_leaves_no_hung_call(peer_commit: bool) -> None:
    # The kill lands inside peer1's send; its concurrent calls' tasks run on to their next
    # checkpoint and record their start after the kill (seed 2474 of the 8-peer peer-commit
    # campaign).  The bound is below the run's length, so such a phantom would outlive it.
    scenario = PcclScenario(peers=4, phases=("compute", "collectives"), fast_commit=True, peer_commit=peer_commit,
                            liveness_bound=8.0)
    trigger = Trigger("message", host="peer1", direction="send", message="CollectiveInit", nth=2)
    trace = run(scenario, Schedule(seed=0, duration=4.0, quiet=9.6, scenario=scenario.to_json(),
                                   events=[FaultEvent(1.0, "kill", host="peer1", trigger=trigger)]))
    assert trace.ok, [f.message for f in trace.failures]
    kill = next(e for e in trace.events if e.kind == "kill" and e.data.get("host") == "peer1")
    assert [e for e in trace.events if e.source == "peer1" and e.seq > kill.seq and e.kind == "collective_call"]
    assert trace.events[-1].t - kill.t > scenario.liveness_bound


# --- no-split: a result on one peer, a raise on another -------------------------------------------


def _peer_agreed(sim: _Sim, seq: int = 9, *, done: bool = False) -> None:
    """peer0 and peer1 (ids 1, 2) begin op ``seq`` with peer commit (and report ready, if
    ``done``); peer0 commits on its set."""
    for i, host in enumerate(("peer0", "peer1")):
        sim.wire(host, "recv", m.Welcome(i + 1, instance=5))
        sim.wire(host, "recv", m.TopologyComplete(1, (m.PeerEndpoint(1, "a", 1, 2), m.PeerEndpoint(2, "b", 1, 2)),
                                                  m.Membership(2, 2, 1, 2)))
        sim.event(host, "all_reduce_call", tag=7, k=1)
        sim.wire(host, "send", m.CollectiveBegin(7, seq, 3, 4, 1, 0, peer_commit=True))
    if done:
        for host in ("peer0", "peer1"):
            sim.wire(host, "send", m.CollectiveDone(7, seq, aborted=False))
    sim.event("peer0", "all_reduce", tag=7, k=1)  # committed among its peers: no final word


def test_no_split_fires_on_a_result_and_a_raise_the_masters_words_do_not_drive() -> None:
    # The master aborts peer1 while peer0, which returned the result, is still its participant:
    # it hears the Abort too, so it is a survivor (rule 12).
    sim = _Sim(NoSplit())
    _peer_agreed(sim)
    sim.wire("peer1", "recv", m.CollectiveAbort(7, 9))
    sim.event("peer1", "all_reduce_aborted", tag=7, k=1, error="aborted")
    assert sim.failures() == []  # peer0 may still be one the master declared dead
    sim.wire("peer0", "recv", m.CollectiveAbort(7, 9))
    assert sim.failures() == [("safety", "no-split", "seq 9 split: peer0 (call #1 on tag 7) returned its result, "
                               "peer1 (call #1 on tag 7) raised (read Abort); peer0 is a survivor (it read Abort)")]
    # peer1 raises without any word from the master and keeps its master connection, after both
    # reported ready: a split that only no-split sees (peer0's commit on a full set is valid,
    # and nobody read a final word).
    sim = _Sim(*op_checkers(100.0), NoSplit())
    _peer_agreed(sim, done=True)
    sim.event("peer1", "all_reduce_aborted", tag=7, k=1, error="aborted")
    for checker in sim.checkers:
        checker.at_end(sim)  # type: ignore[arg-type]
    assert sim.failures() == [("safety", "no-split", "seq 9 split: peer0 (call #1 on tag 7) returned its result, "
                               "peer1 (call #1 on tag 7) raised (no final word read); peer1 neither read a final "
                               "word for it nor left it by the end of the run")]


def test_no_split_allows_the_documented_paths_where_a_participant_left_the_op() -> None:
    # (a): the master declared the committer dead (it registers again without the op) and
    # aborts the survivor.
    sim = _Sim(NoSplit())
    _peer_agreed(sim)
    sim.wire("peer1", "recv", m.CollectiveAbort(7, 9))
    sim.event("peer1", "all_reduce_aborted", tag=7, k=1, error="aborted")
    sim.wire("peer0", "send", m.Register(0, 1, 2, previous_peer_id=1))
    sim.checkers[0].at_end(sim)  # type: ignore[arg-type]
    # Rule 2: peer1 lost its master before the verdict (it raised, then registered again without
    # the op), or died.
    for leaves in ("register", "kill"):
        sim2 = _Sim(NoSplit())
        _peer_agreed(sim2)
        sim2.event("peer1", "all_reduce_aborted", tag=7, k=1, error="the master was lost")
        if leaves == "register":
            sim2.wire("peer1", "send", m.Register(0, 1, 2, previous_peer_id=2))
        else:
            sim2.event("net", "kill", host="peer1")
        sim2.checkers[0].at_end(sim2)  # type: ignore[arg-type]
        assert sim2.failures() == [], leaves
    # ... but one that carries the op into its registration is still in it: the new master's
    # Abort then makes it a survivor of a split.
    sim3 = _Sim(NoSplit())
    _peer_agreed(sim3)
    sim3.event("master", "start")  # the master restarted: the next one hears the report
    sim3.wire("peer1", "send", m.Register(0, 1, 2, previous_peer_id=2,
                                          undecided=(m.UndecidedOp(5, 7, 9, (1, 2), 0),)))
    sim3.wire("peer1", "recv", m.Welcome(2, instance=6))
    sim3.wire("peer1", "recv", m.CollectiveAbort(7, 9))  # the new master's verdict on the old op
    sim3.event("peer1", "all_reduce_aborted", tag=7, k=1, error="aborted")
    sim3.wire("peer0", "recv", m.CollectiveAbort(7, 9))
    assert [f[1] for f in sim3.failures()] == ["no-split"]
    assert sim.failures() == []
    # Carried to the master that began it (no restart: the peer's connection broke), the op is
    # left all the same: that master ignores the report and welcomes the peer under a new id,
    # whose call raises with no word (campaign seed 543, 2 peers, peer commit).
    sim5 = _Sim(NoSplit())
    _peer_agreed(sim5, done=True)
    sim5.wire("peer1", "send", m.Register(0, 1, 2, previous_peer_id=2,
                                          undecided=(m.UndecidedOp(5, 7, 9, (1, 2), 1),)))
    sim5.wire("peer1", "recv", m.Welcome(3, instance=5))
    sim5.event("peer1", "all_reduce_aborted", tag=7, k=1, error="the master was lost")
    sim5.checkers[0].at_end(sim5)  # type: ignore[arg-type]
    assert sim5.failures() == []
    # A legal op (both read Complete) and a legal abort (both read Abort) are no split.
    for verdicts in (("Complete", "Complete"), ("Abort", "Abort")):
        sim4 = _Sim(NoSplit())
        _op(sim4, verdicts=verdicts)
        sim4.checkers[0].at_end(sim4)  # type: ignore[arg-type]
        assert sim4.failures() == [], verdicts


def test_no_hung_call_waits_out_a_restarted_masters_documented_wait_for_a_reported_op() -> None:
    # A restarted master waits master_reconnect_timeout (here 60 s) from an op's first report for
    # its participants that have not registered (seed 16, 2 peers, peer commit: the other
    # participant died across the restart): the reporter's call waits that long by design, and
    # only the bound after it is a hang.
    waits = OrphanWaits(60.0)
    sim = _Sim(waits, NoHungCall(10.0, waits))
    sim.wire("peer0", "recv", m.Welcome(1, instance=5))
    sim.event("peer0", "all_reduce_call", tag=7, k=1)
    sim.wire("peer0", "send", m.CollectiveBegin(7, 9, 3, 4, 1, 0, peer_commit=True))
    sim.now = 1.0
    sim.event("master", "start")
    sim.now = 2.0
    sim.wire("peer0", "send", m.Register(0, 1, 2, previous_peer_id=1, undecided=(m.UndecidedOp(5, 7, 9, (1, 2), 0),)))
    assert waits.waited_until() == 62.0  # running: it ends at its deadline
    sim.now = 70.0
    sim.event("monitor", "probe")
    assert sim.failures() == []
    sim.now = 72.5
    sim.event("monitor", "probe")
    assert sim.failures() == [("liveness", "no-hung-call", "peer0: call #1 on tag 7 still runs 10.5 s after a "
                                                         "restarted master's wait for a reported op ended (bound "
                                                         "10.0 s; in seq 9, final word None)")]
    # The wait ended for the cluster when the reporter read the verdict (before its deadline).
    sim.wire("peer0", "recv", m.Welcome(1, instance=6))
    sim.now = 73.0
    sim.wire("peer0", "recv", m.CollectiveAbort(7, 9))
    assert waits.waited_until() == 62.0
    # A call that begins after the wait ended has no allowance.
    sim2 = _Sim(waits, NoHungCall(10.0, waits))
    sim2.now = 73.0
    sim2.event("peer1", "all_reduce_call", tag=8, k=1)
    sim2.now = 83.5
    sim2.event("monitor", "probe")
    assert [f[1] for f in sim2.failures()] == ["no-hung-call"]


def test_no_hung_call_allows_no_wait_for_an_op_reported_to_the_master_that_began_it() -> None:
    # peer0's master connection breaks (the master does not restart) while it is ready for a
    # peer-agreed op: it registers again with the op in Register.undecided, but that master
    # (same instance) ignores the report and waits for nobody (it had declared peer0 dead in its
    # ops).  No documented wait runs: a call that hangs meanwhile fails after the bound alone.
    waits = OrphanWaits(60.0)
    sim = _Sim(waits, NoHungCall(10.0, waits))
    sim.wire("peer0", "recv", m.Welcome(1, instance=5))
    sim.wire("peer1", "recv", m.Welcome(2, instance=5))
    sim.event("peer1", "all_reduce_call", tag=8, k=1)
    sim.now = 2.0
    sim.wire("peer0", "send", m.Register(0, 1, 2, previous_peer_id=1, undecided=(m.UndecidedOp(5, 7, 9, (1, 2), 0),)))
    sim.wire("peer0", "recv", m.Welcome(3, instance=5))
    assert waits.waited_until() == float("-inf")
    sim.now = 10.5
    sim.event("monitor", "probe")
    assert [f[1] for f in sim.failures()] == ["no-hung-call"]
