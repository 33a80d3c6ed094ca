"""Invariants of the pccl workload, checked after every trace event.

Each checker is an independent :class:`pccl_sim.engine.runner.Checker`; a scenario lists the ones it
needs (:func:`membership_checkers` for membership, plus whatever the step's phases add — see
:mod:`pccl_sim.workloads.pccl.phases`).  Failure kinds (VOPR's classification,
:data:`pccl_sim.engine.trace.FAILURE_KINDS`):

* **safety** — :class:`MembershipAgreement`: every peer that completed the same topology round
  got the same attributes (``world_size`` within a ring, ``global_world_size`` /
  ``num_peer_groups`` / ``largest_peer_group_size`` across the round), consistent with its ring,
  and what the peer reports through the public attributes is exactly what the master sent.  The
  round id is read off the wire (``TopologyComplete.round``), never from pccl internals, and a
  round belongs to the master process that ran it (``Welcome.instance`` of the connection it came
  on): a restarted master numbers its rounds afresh, and a peer that was stalled across the
  restart may still read the old master's last rounds out of its socket afterwards.
* **safety** — :class:`NoStuckVote`: the master never sits in a state where a vote (topology
  accept, group re-wire, peers-pending, collective init/done) has every live voter's ballot or a
  topology round has no live participant left, yet nothing happens — "a peer stuck in a vote
  whose other voters are gone".  Read from the master's read-only views (``Master.state``) at
  every event, including the monitor's periodic probes (a stuck cluster is silent).
* **safety** — :class:`NoProtocolKicks`: the real peers never get kicked for protocol
  violations (``PROTOCOL_ERROR``, ``OUT_OF_PHASE``, ``FRAME_TOO_LARGE``): they speak the
  protocol, so such a kick is a bug on one side.
* **liveness** — :class:`FullMembershipLiveness`: after the last fault (the quiet window: the
  network healed, the master restarted if needed) a *full-membership step* must follow within
  ``bound`` seconds: every live peer accepted and completing a step (begun after the faults
  stopped) with ``world_size`` equal to the number of live peers of its group (a peer alone in
  its group: waiting alone).  The bound is longer than the protocol's timeouts
  (:attr:`pccl_sim.workloads.pccl.scenario.PcclScenario.liveness_bound`) but one: a restarted
  master waits ``master_reconnect_timeout`` (60 s) from the first report of a peer-agreed op for
  its absent participants, and the peers that reported it wait with it; the bound then counts
  from the end of that wait (:mod:`pccl_sim.workloads.pccl.orphan_waits`).
* crash / zombie / determinism come from the runner and the CLI.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from pccl.protocol.master import machine as ms

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent
from .orphan_waits import OrphanWaits

__all__ = [
    "MembershipAgreement",
    "NoStuckVote",
    "NoProtocolKicks",
    "FullMembershipLiveness",
    "MembershipScenario",
    "membership_checkers",
    "stuck_votes",
]

_ATTRIBUTES = ("world_size", "global_world_size", "num_peer_groups", "largest_peer_group_size")


class MembershipScenario(Protocol):
    """What the membership checkers read of the scenario they watch (a
    :class:`~pccl_sim.workloads.pccl.scenario.PcclScenario`)."""

    #: Seconds after the faults stop within which a full-membership step must happen.
    liveness_bound: float
    #: Seconds to keep watching after that step before ending the run (``None``: never end early).
    hold: float | None

    def group_of(self, host: str) -> int: ...

    def master_state(self, sim: Simulation) -> ms.MasterState | None: ...

    def masters(self) -> Iterable[Any]: ...


class MembershipAgreement(Checker):
    """Attributes agree among the peers of one topology round (module docstring)."""

    name = "membership-agreement"

    def __init__(self) -> None:
        # Keyed by (master instance, round): rounds of different master processes are different.
        self.round_globals: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.round_rings: dict[tuple[int, int], dict[int, tuple[int, ...]]] = {}  # -> peer id -> its ring
        self.peer_ids: dict[str, int] = {}  # host -> id from the Welcome it read
        self.instances: dict[str, int] = {}  # host -> master instance from that Welcome
        self.last_received: dict[str, dict[str, int]] = {}  # host -> attributes of its last TopologyComplete
        self.failed = False

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError("MembershipAgreement needs the wire (Scenario.sniff)")
        sim.tap.watch(lambda *args: self._wire(sim, *args), names=("Welcome", "TopologyComplete"))

    def _fail(self, sim: Simulation, message: str) -> None:
        if not self.failed:  # the first disagreement is the story; the rest is its echo
            self.failed = True
            sim.fail("safety", message, self.name)

    def _wire(self, sim: Simulation, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if direction != "recv" or msg is None:
            return
        if name == "Welcome":
            self.peer_ids[host] = msg.peer_id
            self.instances[host] = msg.instance
            return
        ring = tuple(e.peer_id for e in msg.ring)
        got = {k: getattr(msg.membership, k) for k in _ATTRIBUTES}
        self.last_received[host] = got
        me = self.peer_ids.get(host)
        if me is not None and me not in ring:
            self._fail(sim, f"{host} (peer {me:x}) got TopologyComplete round {msg.round} with a ring without it")
        if got["world_size"] != len(ring):
            self._fail(sim, f"{host}: round {msg.round} says world_size {got['world_size']} for a ring of {len(ring)}")
        if not (got["world_size"] <= got["largest_peer_group_size"] <= got["global_world_size"]
                and got["num_peer_groups"] >= 1
                and got["global_world_size"] <= got["num_peer_groups"] * got["largest_peer_group_size"]):
            self._fail(sim, f"{host}: inconsistent attributes {got} in round {msg.round}")
        glob = (got["global_world_size"], got["num_peer_groups"], got["largest_peer_group_size"])
        key = (self.instances.get(host, 0), msg.round)
        first = self.round_globals.setdefault(key, glob)
        if first != glob:
            self._fail(sim, f"{host}: round {msg.round} attributes {glob} differ from another peer's {first} "
                            "(global_world_size, num_peer_groups, largest_peer_group_size)")
        rings = self.round_rings.setdefault(key, {})
        for pid in ring:
            other = rings.setdefault(pid, ring)
            if other != ring:
                self._fail(sim, f"{host}: round {msg.round} puts peer {pid:x} in two rings {list(other)} and {list(ring)}")
                break

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "start":
            self.peer_ids.pop(event.source, None)
            self.instances.pop(event.source, None)
            self.last_received.pop(event.source, None)
            if event.data.get("role") == "master":
                # A new master numbers its rounds afresh; the old one's rounds are done (a late
                # reader of one of them checks it against whoever read it late too).
                self.round_globals.clear()
                self.round_rings.clear()
        elif event.kind in ("accepted", "topology"):
            seen = self.last_received.get(event.source)
            reported = {k: event.data.get(k) for k in _ATTRIBUTES}
            if seen != reported:
                self._fail(sim, f"{event.source} reports attributes {reported} after its {event.kind}, but the "
                                f"master's last TopologyComplete to it said {seen}")


def stuck_votes(state: ms.MasterState) -> list[str]:
    """Consensus predicates that hold in ``state`` although the machine did not act on them
    (empty for a machine that re-checks after every event).  Read-only views only.

    One pass over the peers (it runs after most changes of the master's state, and was a tenth
    of a fault-free simulated run when it filtered the peer list once per predicate)."""
    accept, rewire = ms.TopologyVote.ACCEPT, ms.TopologyVote.REWIRE
    accepted_status, connected, relay = ms.PeerStatus.ACCEPTED, ms.PeerStatus.CONNECTED, ms.PeerStatus.RELAY
    live: set[int] = set()
    accepted = registered = 0
    all_accept = all_pending = True
    rewiring: dict[int, bool] = {}  # group -> every accepted member votes re-wire
    members_of: dict[int, set[int]] = {}  # group -> accepted peer ids
    for p in state.peers():
        if p.status is connected or p.status is relay:  # a relay's registration is no voter
            continue
        live.add(p.peer_id)
        if p.status is not accepted_status:
            registered += 1
            continue
        accepted += 1
        vote = p.topology_vote
        all_accept = all_accept and vote is accept
        all_pending = all_pending and p.pending_vote
        rewiring[p.group] = rewiring.get(p.group, True) and vote is rewire
        members_of.setdefault(p.group, set()).add(p.peer_id)
    rounds = state.rounds_in_progress()
    out: list[str] = []
    for scope, participants in sorted(rounds.items()):
        if live.isdisjoint(participants):
            out.append(f"topology round (scope {scope}) whose participants are all gone")
    if not rounds and (accepted or registered) and all_accept:
        out.append(f"accept vote: all {accepted} accepted peers voted ({registered} registered waiting), no round started")
    if ms.GLOBAL_SCOPE not in rounds:
        for group in sorted(group for group, all_rewire in rewiring.items() if all_rewire and group not in rounds):
            out.append(f"re-wire vote of group {group}: all {len(members_of[group])} members voted, no round started")
    if accepted and all_pending:
        out.append(f"peers-pending vote: all {accepted} accepted peers asked, no answer")
    for op in state.ops():
        if op.seq is None:
            voters = members_of.get(op.group)
            if voters and voters <= op.voters:
                out.append(f"collective tag {op.tag} of group {op.group}: every member voted, not decided")
        else:
            alive = [pid for pid in op.participants if pid in live]
            gone = [pid for pid in op.participants if pid not in live and pid not in op.done]
            if op.resolving:  # a peer-agreed op the master queries: decided once every live one answered
                if op.answered.issuperset(alive):
                    out.append(f"collective tag {op.tag} seq {op.seq}: every live participant answered, not concluded")
            elif gone or all(pid in op.done for pid in alive):
                out.append(f"collective tag {op.tag} seq {op.seq}: finished or lost a participant, not concluded")
    return out


class NoStuckVote(Checker):
    """The master's state never holds a completed-but-unacted vote for longer than ``grace``
    (module docstring).  ``master_state(sim)`` returns the live master's machine or ``None``."""

    name = "no-stuck-vote"

    def __init__(self, master_state: Callable[[Simulation], ms.MasterState | None], grace: float = 0.0) -> None:
        self.master_state = master_state
        self.grace = grace
        self.since: float | None = None
        self.failed = False
        self._seen: tuple[ms.MasterState, int] | None = None  # the machine and generation last checked
        self._stuck: list[str] = []

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if self.failed:
            return
        state = self.master_state(sim)
        if state is None:
            stuck: list[str] = []
        else:
            if self._seen is None or self._seen[0] is not state or self._seen[1] != state.generation:
                seen = (state, state.generation)  # heartbeats change nothing the predicates read
                self._seen, self._stuck = seen, stuck_votes(state)
            stuck = self._stuck
        if not stuck:
            self.since = None
            return
        if self.since is None:
            self.since = event.t
        if event.t - self.since >= self.grace:
            self.failed = True
            sim.fail("safety", f"master stuck since t={self.since:.3f}: {'; '.join(stuck)}", self.name)


class NoProtocolKicks(Checker):
    """Real peers speak the protocol: a kick for a protocol violation is a bug."""

    name = "no-protocol-kicks"
    BAD_REASONS = frozenset({"PROTOCOL_ERROR", "OUT_OF_PHASE", "FRAME_TOO_LARGE", "UNSPECIFIED"})

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind in ("left", "join_failed") and event.data.get("reason") in self.BAD_REASONS:
            sim.fail("safety", f"{event.source} was kicked for {event.data['reason']}", self.name)


class NoMasterInternalErrors(Checker):
    """A bug in the master's own code reached through one connection is contained by
    :mod:`pccl.master.server` (that connection is closed, ``internal_errors`` counted) so a real
    deployment keeps serving — which would hide it here.  Count it as a crash."""

    name = "no-master-internal-errors"

    def __init__(self, masters: Callable[[], Iterable[Any]]) -> None:
        self.masters = masters

    def at_end(self, sim: Simulation) -> None:
        total = sum(master.statistics().internal_errors for master in self.masters())
        if total:
            sim.fail("crash", f"the master contained {total} internal error(s) in its connection "
                     "handlers (its log has the tracebacks)", self.name)


class FullMembershipLiveness(Checker):
    """A full-membership step within ``bound`` s of the quiet window's start (module docstring).

    ``group_of(host)`` gives a peer host's group.  With ``hold`` set, the run ends ``hold``
    seconds after the full-membership step (the other checkers keep watching meanwhile): a
    campaign spends its time on faults, not on steady state.  The verdict is given in ``at_end``,
    so the run's quiet window should be longer than ``bound``
    (:func:`pccl_sim.workloads.pccl.scenario.pccl_schedule` makes it 1.2 × bound); a window too short
    to converge in fails rather than passing vacuously.
    """

    name = "full-membership"

    def __init__(self, bound: float, group_of: Callable[[str], int], *, hold: float | None = None,
                 waits: OrphanWaits | None = None) -> None:
        self.bound = bound
        self.group_of = group_of
        self.hold = hold
        self.waits = waits
        self.finished = False
        self.steps: dict[str, tuple[int, float]] = {}  # host -> (world_size, start) of its last completed step
        self.alone: dict[str, float] = {}  # host -> t of its last "alone"
        self.converged_at: float | None = None

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        source, kind = event.source, event.kind
        if kind in ("start", "left", "join_failed"):
            self.steps.pop(source, None)
            self.alone.pop(source, None)
        elif kind == "step":
            self.steps[source] = (event.data["world_size"], event.data.get("began", event.t))
        elif kind == "alone":
            self.alone[source] = event.t
        else:
            if kind != "quiet":
                return
        if sim.in_quiet and self.converged_at is None and self._full(sim):
            self.converged_at = event.t
        elif self.converged_at is not None and self.hold is not None and not self.finished:
            if event.t >= self.converged_at + self.hold:
                # Recovered and stayed up for ``hold`` (longer than any protocol timeout): the
                # rest of the quiet window would only repeat steady-state steps.
                self.finished = True
                sim.finish()

    def _full(self, sim: Simulation) -> bool:
        live = sim.alive("peer")
        sizes: dict[int, int] = {}
        for host in live:
            g = self.group_of(host)
            sizes[g] = sizes.get(g, 0) + 1
        for host in live:
            n = sizes[self.group_of(host)]
            if n == 1:
                if self.alone.get(host, -1.0) < sim.quiet_at:
                    return False
            else:
                ws, t = self.steps.get(host, (0, -1.0))
                if t < sim.quiet_at or ws != n:
                    return False
        return True

    def at_end(self, sim: Simulation) -> None:
        horizon = sim.schedule.horizon
        # Statistics (not hashed): how long recovery took, for tuning bounds and for reports.
        sim.trace.stats["converged_after"] = None if self.converged_at is None else self.converged_at - sim.quiet_at
        if self.converged_at is None:
            live = sim.alive("peer")
            detail = ", ".join(
                f"{h}: last completed step began at t={self.steps[h][1]:.2f} with world_size {self.steps[h][0]}"
                if h in self.steps
                else f"{h}: no step"
                for h in live
            )
            sim.fail(
                "liveness",
                f"no full-membership step in the {horizon - sim.quiet_at:.1f} s after the faults stopped "
                f"({len(live)} live peers; {detail})",
                self.name,
            )
        else:
            start, since = sim.quiet_at, "the faults stopped"
            waited = float("-inf") if self.waits is None else self.waits.waited_until()
            if waited > start:
                start, since = waited, f"a restarted master's wait for a reported op ended (t={waited:.2f})"
            if self.converged_at - start > self.bound:
                sim.fail(
                    "liveness",
                    f"full membership only {self.converged_at - start:.2f} s after {since} (bound {self.bound:.1f} s)",
                    self.name,
                )


def membership_checkers(scenario: MembershipScenario, waits: OrphanWaits | None = None) -> list[Checker]:
    """The membership invariants, for one run of ``scenario`` (``waits``: a restarted master's
    documented waits for reported ops, which the liveness bound does not count)."""
    return [
        MembershipAgreement(),
        NoStuckVote(scenario.master_state, grace=0.0),
        NoProtocolKicks(),
        NoMasterInternalErrors(scenario.masters),
        FullMembershipLiveness(scenario.liveness_bound, scenario.group_of, hold=scenario.hold, waits=waits),
    ]
