"""The membership checkers catch what they claim to catch, and stay quiet on the real code."""

from __future__ import annotations

import pathlib
import random

from pccl.protocol.master import machine as ms
from pccl.protocol import messages as m
from pccl_sim.engine.runner import run
from pccl_sim.engine.trace import Trace, TraceEvent
from pccl_sim.engine.schedule import FaultEvent, Schedule
from pccl_sim.observe.coverage import coverage_table, fault_victims
from pccl_sim.tools.scenarios import scenario_from_json
from pccl_sim.workloads.pccl.checkers import NoProtocolKicks, stuck_votes
from pccl_sim.workloads.pccl.mutants import MASTER_VARIANTS, NoRecheckOnDisconnect, register_master_variant
from pccl_sim.workloads.pccl.scenario import MEMBERSHIP_MESSAGES, PcclScenario


def _feed(machine: ms.MasterState, event: ms.Event) -> None:
    """Hand ``event`` to the machine; peers answer every ConnectToPeers with a good report."""
    queue = [event]
    while queue:
        for effect in machine.handle(queue.pop(0), 0.0):
            if isinstance(effect, ms.Send) and isinstance(effect.msg, m.ConnectToPeers):
                queue.append(ms.MessageReceived(effect.conn_id, m.P2PReport(effect.msg.round, True, ())))


def _three_voters(machine: ms.MasterState) -> None:
    """Accept three peers, then let two of them vote to accept: the third blocks the vote."""
    for conn in (1, 2, 3):
        _feed(machine, ms.PeerConnected(conn, f"h{conn}"))
        _feed(machine, ms.MessageReceived(conn, m.Register(0, 5000 + conn, 0, 0)))
    _feed(machine, ms.MessageReceived(1, m.VoteTopology(True)))  # the first peer admits the others
    assert [p.status for p in machine.peers()] == [ms.PeerStatus.ACCEPTED] * 3
    for conn in (1, 2):
        _feed(machine, ms.MessageReceived(conn, m.VoteTopology(True)))


def test_stuck_votes_sees_the_missing_recheck_and_not_the_real_machine() -> None:
    real = ms.MasterState(rng=random.Random(1), peer_timeout=2.0)
    broken = NoRecheckOnDisconnect(rng=random.Random(1), peer_timeout=2.0)
    for machine in (real, broken):
        _three_voters(machine)
        assert stuck_votes(machine) == []  # peer 3 has not voted: waiting is right
        _feed(machine, ms.PeerDisconnected(3))
    assert stuck_votes(real) == []
    assert stuck_votes(broken) == ["accept vote: all 2 accepted peers voted (0 registered waiting), no round started"]


class _LyingMaster(ms.MasterState):
    """Tells the first peer it accepts a world one larger than it is."""

    def _topology_complete(self, round_id: int, group: int) -> m.TopologyComplete:
        msg = super()._topology_complete(round_id, group)
        self.__dict__.setdefault("_told", 0)
        self._told += 1
        if self._told != 1:
            return msg
        ms_ = msg.membership
        return m.TopologyComplete(msg.round, msg.ring, m.Membership(ms_.world_size + 1, ms_.global_world_size + 1,
                                                                    ms_.num_peer_groups, ms_.largest_peer_group_size + 1))


def test_disagreeing_attributes_are_a_safety_failure() -> None:
    register_master_variant("test-lying", _LyingMaster)
    try:
        scenario = PcclScenario(peers=3, master="test-lying")
        trace = run(scenario, Schedule(seed=2, duration=3.0, quiet=scenario.liveness_bound + 1, scenario=scenario.to_json()))
    finally:
        del MASTER_VARIANTS["test-lying"]
    assert trace.failure_kinds[0] == "safety"
    assert trace.failures[0].source == "membership-agreement"
    assert "says world_size" in trace.failures[0].message or "differ" in trace.failures[0].message


class _FakeSim:
    def __init__(self) -> None:
        self.trace = Trace()

    def fail(self, kind: str, message: str, source: str = "runner") -> None:
        self.trace.fail(kind, source, message, t=0.0)


def test_protocol_kicks_are_safety_failures_timeouts_are_not() -> None:
    checker, sim = NoProtocolKicks(), _FakeSim()
    checker.on_event(sim, TraceEvent(0, 1.0, "peer1", "left", {"error": "Kicked", "reason": "TIMEOUT"}))  # type: ignore[arg-type]
    assert sim.trace.ok
    checker.on_event(sim, TraceEvent(1, 2.0, "peer1", "left", {"error": "Kicked", "reason": "OUT_OF_PHASE"}))  # type: ignore[arg-type]
    assert sim.trace.failure_kinds == ("safety",) and "OUT_OF_PHASE" in sim.trace.failures[0].message


def test_coverage_table_lists_every_membership_phase_even_unhit_ones() -> None:
    cells = [["VoteTopology", "VoteTopology", "kill"], ["P2PHello", "ConnectToPeers", "stall"],
             ["VoteTopology", "VoteTopology", "kill"]]
    table = coverage_table(cells, phases=MEMBERSHIP_MESSAGES)
    victim_rows = {line.split("|")[0].strip(): line for line in table.splitlines()[:12] if "|" in line}
    assert set(MEMBERSHIP_MESSAGES) <= set(victim_rows)
    assert victim_rows["VoteTopology"].split("|")[-1].strip() == "2"
    assert victim_rows["Register"].split("|")[-1].strip() == "0"
    assert "2 distinct (victim phase, master phase, fault kind) cells, 3 faults" in table
    assert fault_victims(FaultEvent(1.0, "partition", side=("peer1", "peer2")).to_json()) == ["peer1", "peer2"]
    assert fault_victims(FaultEvent(1.0, "master_restart").to_json()) == ["master"]


class _Views:
    """The read-only views ``stuck_votes`` reads, as given."""

    def __init__(self, peers: list[ms.PeerInfo], rounds: dict[int, tuple[int, ...]] | None = None,
                 ops: list[ms.OpInfo] | None = None) -> None:
        self._peers, self._rounds, self._ops = peers, rounds or {}, ops or []

    def peers(self) -> list[ms.PeerInfo]:
        return self._peers

    def rounds_in_progress(self) -> dict[int, tuple[int, ...]]:
        return self._rounds

    def ops(self) -> list[ms.OpInfo]:
        return self._ops


def _peer(pid: int, group: int = 0, status: ms.PeerStatus = ms.PeerStatus.ACCEPTED,
          vote: ms.TopologyVote | None = None, pending: bool = False) -> ms.PeerInfo:
    return ms.PeerInfo(pid, pid, group, status, vote, False, pending)


_A, _R = ms.TopologyVote.ACCEPT, ms.TopologyVote.REWIRE


def test_stuck_votes_names_every_kind_of_stuck_vote_and_only_those() -> None:
    reg = _peer(9, status=ms.PeerStatus.REGISTERED)
    conn = _peer(8, status=ms.PeerStatus.CONNECTED)
    cases: list[tuple[_Views, list[str]]] = [
        (_Views([_peer(1, vote=_A), _peer(2)]), []),
        (_Views([_peer(1, vote=_A), _peer(2, vote=_A), reg, conn]),
         ["accept vote: all 2 accepted peers voted (1 registered waiting), no round started"]),
        (_Views([_peer(1, vote=_A), _peer(2, vote=_A)], rounds={0: (1, 2)}), []),
        (_Views([reg]), ["accept vote: all 0 accepted peers voted (1 registered waiting), no round started"]),
        (_Views([_peer(1, vote=_R), _peer(2, vote=_R), _peer(3, group=1, vote=_R), _peer(4, group=1)]),
         ["re-wire vote of group 0: all 2 members voted, no round started"]),
        (_Views([_peer(1, vote=_R), _peer(2, vote=_R)], rounds={ms.GLOBAL_SCOPE: (1, 2)}), []),
        (_Views([_peer(1, vote=_R), _peer(2, group=1, vote=_R)], rounds={1: (2,)}),
         ["re-wire vote of group 0: all 1 members voted, no round started"]),
        (_Views([_peer(1), conn], rounds={0: (5, 8)}),
         ["topology round (scope 0) whose participants are all gone"]),
        (_Views([_peer(1, pending=True), _peer(2, pending=True)]),
         ["peers-pending vote: all 2 accepted peers asked, no answer"]),
        (_Views([_peer(1, pending=True), _peer(2)]), []),
        (_Views([_peer(1), _peer(2), _peer(3, group=1)], ops=[ms.OpInfo(0, 7, frozenset({1, 2}), None, (), frozenset())]),
         ["collective tag 7 of group 0: every member voted, not decided"]),
        (_Views([_peer(1), _peer(2)], ops=[ms.OpInfo(0, 7, frozenset({1}), None, (), frozenset())]), []),
        (_Views([_peer(1), _peer(2)], ops=[ms.OpInfo(0, 7, frozenset({1, 2}), 4, (1, 2, 3), frozenset({1}))]),
         ["collective tag 7 seq 4: finished or lost a participant, not concluded"]),
        (_Views([_peer(1), _peer(2)], ops=[ms.OpInfo(0, 7, frozenset({1, 2}), 4, (1, 2), frozenset({1, 2}))]),
         ["collective tag 7 seq 4: finished or lost a participant, not concluded"]),
        (_Views([_peer(1), _peer(2)], ops=[ms.OpInfo(0, 7, frozenset({1, 2}), 4, (1, 2, 3), frozenset({1, 3}))]), []),
    ]
    for views, expected in cases:
        assert stuck_votes(views) == expected, views.__dict__  # type: ignore[arg-type]


def test_a_round_read_late_from_a_dead_master_is_not_confused_with_the_new_masters() -> None:
    """``stale_round_after_master_restart_shrunk.json`` (seed 992 of the ``phases`` profile,
    shrunk to 10 faults): peer7 registers with the third master and is stalled (t = 17.527-20.0)
    while that master's round 3 admits it; the master dies and a fourth one starts (t = 19.562)
    and runs rounds 1 and 2; peer7 wakes and reads the dead master's round 3 out of its socket
    (reports ``accepted``), then the new master's round 3 reaches the others with another ring.
    Both are real and correct (peer7 finds its master gone and joins the new one as a new peer),
    but a checker that keyed rounds by number alone failed this run with "round 3 puts peer
    14e2b292cdc10d71 in two rings".  Rounds belong to the master instance that ran them."""
    schedule = Schedule.load(pathlib.Path(__file__).parent / "schedules"
                             / "stale_round_after_master_restart_shrunk.json")
    trace = run(scenario_from_json(schedule.scenario), schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    # The race happened: peer7's first acceptance came after the fourth master had started,
    # from the third one's round, and it was then accepted again under a new id.
    last_master = max(e.t for e in trace.of_kind("start") if e.source == "master" and e.t < 20.0)
    accepted = [e for e in trace.of_kind("accepted") if e.source == "peer7"]
    assert len(accepted) >= 2 and accepted[0].t > last_master
    assert accepted[0].data["peer_id"] != accepted[1].data["peer_id"]
