"""The master's consensus machine: pure, synchronous, no I/O (h11 style).

``MasterState.handle(event, now) -> list[Effect]`` is the whole interface (the event and effect
types are in :mod:`pccl.protocol.master.events`, re-exported here; among the effects are the
facts — joins, acceptances, ops' and syncs' ends — that the shell records for the status
page).  The Trio shell (:mod:`pccl.master.server`) turns connections into events and executes
the effects; the simulator and the property tests drive the same object directly.  Time
(``now``) and randomness (``rng``) are inputs.  Nothing a peer sends can make ``handle`` raise: bad input becomes a ``Kick`` of that
peer only.  (Shell bugs — an unknown event type, a duplicate ``PeerConnected`` — do raise.)

Rules
=====

Peers.  CONNECTED, then REGISTERED (a peer id from the injected RNG), then ACCEPTED by a
topology round (:mod:`pccl.protocol.master.peers`).

Topology votes.  ``VoteTopology(accept_new_peers=True)`` is a global vote that accepts the
registered peers (a global round), ``accept_new_peers=False`` a re-wire of the voter's group (a
group round); a vote stands until its round ends.  ``VotePeersPending`` asks whether anybody
waits to be accepted.  Their consensus and its rules live in :mod:`pccl.protocol.master.votes`.

Rounds.  A topology vote's consensus starts a round: every participant connects to its ring
neighbours and reports; all ok → the participants are accepted, the rings installed,
``TopologyComplete`` sent; otherwise the round is retried with the survivors, and after
``max_p2p_attempts`` failed attempts the most-blamed peers are kicked (``P2P_UNREACHABLE``).
The sub-machine and its rules live in :mod:`pccl.protocol.master.rounds`.  A peer that
registers during a round waits for the next one.

Rings.  A group's ring is its accepted members ordered by peer id (:mod:`pccl.protocol.ring`),
or in the order its last optimisation installed (see Optimise).
A group's ring is *stale* once an accepted member is removed or one of its collectives aborts;
collectives of a stale group are rejected with ``STALE_RING`` until a round re-wires it.

Collectives (per group, per tag).  Every accepted peer of the group votes ``CollectiveInit``;
at consensus the op is rejected (parameter mismatch, too few peers, stale ring) or commenced
on the group's ring, and completes or aborts once its participants report.  The sub-machine,
its rules and its table of collective kinds (what must agree, in which order the op runs) live
in :mod:`pccl.protocol.master.collectives`; it sees the master only through ``OpsHost``.  An
abort makes the group's ring stale (see Rings).

Shared-state sync (per group).  Every accepted peer of the group sends ``SyncVote``; at
consensus the election (:mod:`pccl.protocol.master.election`) fixes the group's revision and
plans who fetches what from whom; receivers report until each is done or rejected, then every remaining
participant gets ``SyncComplete``.  A peer may not sync while it has a topology vote standing,
takes part in a round or has a collective in flight, and may not vote topology or start a
collective while its sync runs (OUT_OF_PHASE).  The sub-machine and its rules live in
:mod:`pccl.protocol.master.sync`; it sees the master only through ``SyncHost``.

Phase mismatch.  When every accepted member of a group waits for the others and not all in
the same kind of call — or all in collectives that have not commenced, none of whose tags every
member voted (different tags) — none of their votes can ever complete: once that has lasted
``mismatch_grace`` (a quarter of ``peer_timeout`` by default) unchanged, the master withdraws
every one of them, naming who waits where (and on which tags).  The sub-machine and its rules
live in :mod:`pccl.protocol.master.mismatch` (behind ``MismatchHost``).

Optimise.  ``VoteOptimize`` is a group vote whose vote stands as a topology vote does (the same
phase rules); when every member votes, the group's links are probed, the ring solved and
installed with a group round.  The sub-machine and its rules live in
:mod:`pccl.protocol.master.optimize` (behind ``OptimizeHost``).  An optimise vote is its own
kind for phase mismatches (it never meets an accept or re-wire vote).

Liveness.  Any message refreshes a connection's deadline ``last_heard + peer_timeout``; at that
deadline (checked on every event, ``Tick`` included) the peer is kicked with ``TIMEOUT``.  A
CONNECTED connection has ``peer_timeout`` from connecting to register: only ``Register``
refreshes its deadline, so a connection that merely heartbeats (it proved nothing) cannot hold a
descriptor of the master for ever.
``SetTimer(at)`` tells the shell the earliest deadline whenever it changes.

Re-checks.  Every consensus above is a predicate over the current state, and *all* of them are
re-evaluated (to a fixed point) after every event — so a disconnect, kick or timeout in any phase
lets every vote it was blocking complete (PCCL forgets some of these re-checks, reference §3.5).
One exception keeps the per-op cost flat: a ``CollectiveInit``, ``CollectiveWithdraw``,
successful ``CollectiveDone`` or ``CollectiveBegin`` that aborted nothing (an abort makes the
group stale, which other votes read; a vote can abort a begun op; so does a withdrawal that says
the ring is torn, which is re-checked in full), handled without a fault (and no timeout on the same event), changes
only its own op, and nothing else waits for ops (topology votes and syncs *refuse* a peer with an op in
flight instead of waiting for it), so only that op is re-checked.  A ``Heartbeat`` handled
without a fault changes nothing any consensus reads (only ``last_heard``, which the timer
covers: an event at or past the deadline always re-checks everything), so it re-checks nothing.
The phase-mismatch check of the own op's group goes with the op's re-check, except after a
successful ``CollectiveDone`` that leaves its op open: it changed only the op's reports, which
no member's wait reads, so the group's last check stands (a grace period that ends meanwhile is
a deadline, met by the full re-check).
The property tests check after every event that a full re-check would find nothing more to do.

Out of phase.  One table, ``PHASES`` (:mod:`pccl.protocol.master.peers`), holds the phase
rules: for each message type, which peer statuses may send it and, for a vote, which of the
sender's activities make it ``Kick(OUT_OF_PHASE)``, with the kick's detail.  Which activities
refuse which vote is the phase table of :mod:`pccl.protocol.phases`, the one the peer consults
before it sends.  It is checked once, before any handler runs.  A message type peers never send
→ ``Kick(PROTOCOL_ERROR)``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from ...errors import KickReason
from . import election
from .. import messages as m
from .. import phases as ph
from ..codec import MAX_DETAIL, clip_text
from .events import (Close, Effect, Event, Fact, Kick, MessageReceived, OpEnded, PeerAccepted, PeerConnected,
                     PeerDisconnected, PeerFault, PeerJoined, ProtocolViolation, RelayJoined, Send, SetTimer, SyncEnded,
                     Tick)
from .collectives import CollectiveOps, OpInfo, OpsHost
from .op_records import call_name
from .mismatch import MismatchHost, PhaseMismatches
from .optimize import OptimizeHost, Optimizer
from .orphans import OrphanOps, OrphansHost
from .paths import Paths, PathsHost
from .rounds import Rounds, RoundsHost
from .votes import TopologyVotes, VotesHost
from .roster import Roster
from .peers import GLOBAL_SCOPE, PHASES, PeerInfo, PeerRecord, PeerStatus, ReportedBytes, RoundRecord, TopologyVote
from ..paths import CandidateOrigin, Port, format_host_port, resolve_candidates
from .sync import SyncHost, SyncRoundInfo, SyncState
from .views import MasterViews

_C, _R, _A, _RELAY = PeerStatus.CONNECTED, PeerStatus.REGISTERED, PeerStatus.ACCEPTED, PeerStatus.RELAY
#: The messages whose handling (without a fault or an abort) changes only their own op (see
#: "Re-checks"), besides a ``CollectiveDone`` that reports no failure.
_OWN_OP_ONLY = frozenset({m.CollectiveInit, m.CollectiveWithdraw, m.CollectiveBegin})
#: The call a standing topology vote waits in, and its name as the caller knows it (``_waits_in``).
_VOTE_CALLS: dict[TopologyVote, tuple[ph.Call, Callable[[], str]]] = {
    TopologyVote.ACCEPT: (ph.Call.TOPOLOGY_VOTE, "update_topology()".__str__),
    TopologyVote.REWIRE: (ph.Call.TOPOLOGY_VOTE, "a re-wire after a failed all_reduce".__str__),
    TopologyVote.OPTIMIZE: (ph.Call.OPTIMIZE_VOTE, "optimize_topology()".__str__),
}
#: Candidates a peer may register (a host with a handful of interfaces has a few per port).
MAX_CANDIDATES = 64

__all__ = ["MasterState", "RandomSource", "PeerStatus", "TopologyVote", "GLOBAL_SCOPE", "PeerInfo", "OpInfo",
           "SyncRoundInfo", "PeerConnected", "MessageReceived", "PeerDisconnected", "ProtocolViolation", "Tick",
           "Event", "Send", "Kick", "Close", "SetTimer", "PeerJoined", "PeerAccepted", "RelayJoined", "OpEnded",
           "SyncEnded", "Fact", "Effect"]

log = logging.getLogger(__name__)


class RandomSource(Protocol):
    """What the machine needs from the injected ``random.Random``."""

    def getrandbits(self, k: int, /) -> int: ...


class MasterState(MasterViews):
    """The consensus machine.  See the module docstring for the rules.

    ``rng`` supplies peer ids; ``peer_timeout`` is ``Config.peer_timeout``; ``mismatch_grace``
    how long a phase mismatch must last before the master ends it (default ``peer_timeout / 4``).
    """

    def __init__(self, *, rng: RandomSource, peer_timeout: float, max_p2p_attempts: int = 3,
                 min_stripe: int = election.DEFAULT_MIN_STRIPE, mismatch_grace: float | None = None,
                 own_relay: bool = False, reconnect_timeout: float = 60.0) -> None:
        if peer_timeout <= 0 or max_p2p_attempts < 1:
            raise ValueError("peer_timeout must be positive and max_p2p_attempts at least 1")
        grace = peer_timeout / 4 if mismatch_grace is None else mismatch_grace
        if not 0 < grace < peer_timeout:
            raise ValueError("mismatch_grace must be positive and shorter than peer_timeout")
        self._now = 0.0
        #: Bumped by every event that may have changed more than a liveness deadline (read-only
        #: views of an unchanged generation are unchanged: checkers cache on it).
        self.generation = 0
        self._rng = rng
        #: This master's identity, sent in Welcome: peers tell ring connections of one master's
        #: rounds from another's (round ids start at 1 again after a restart).
        self.instance = rng.getrandbits(63) or 1
        self._peer_timeout = peer_timeout
        #: The connections' records, by conn_id and peer id, the accepted members and liveness.
        self._roster = Roster()
        # Hints that spare the consensus checks an O(peers) scan per vote (each is re-verified
        # before it is trusted, so a stale one only costs the scan): a peer that did not vote
        # in the accept vote when last checked; per group, a member that did not wait for the
        # others (no phase mismatch); whether any peer asked VotePeersPending since the last
        # check found none asking.
        self._rings: dict[int, tuple[int, ...]] = {}  # group -> established ring
        self._ring_rounds: dict[int, int] = {}  # group -> the round that installed its ring
        self._stale_groups: set[int] = set()
        host = SyncHost(
            is_live=lambda pid: pid in self._roster.by_id,
            endpoint=lambda pid: self._roster.peer(pid).endpoint(),
            members=lambda group: [p.peer_id for p in self._roster.accepted(group)],
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            kick=lambda pid, reason, detail: self._remove(self._roster.by_id[pid], reason, detail),
            report=self._report,
        )
        self._sync_state = SyncState(host, new_lineage_id=self._new_lineage_id, min_stripe=min_stripe)
        self._rounds = Rounds(RoundsHost(
            group_of=lambda pid: self._roster.peer(pid).group,
            is_live=lambda pid: pid in self._roster.by_id,
            endpoint=lambda pid: self._roster.peer(pid).endpoint(),
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            kick=lambda pid, reason, detail: self._remove(self._roster.by_id[pid], reason, detail),
            ring_order=lambda group, ids: self._optimizer.ring_order(group, ids),
            ring_links=lambda ring: self._optimizer.ring_links(ring),
            ring_sites=lambda ring: self._optimizer.ring_sites(ring),
            enter=self._enter_round,
            complete=self._complete_round,
        ), max_attempts=max_p2p_attempts)
        self._votes = TopologyVotes(VotesHost(
            accepted=self._roster.accepted,
            registered=lambda: [p for p in self._roster.by_conn.values() if p.status is _R],
            is_current=lambda p: self._roster.by_conn.get(p.conn_id) is p,
            stale_groups=lambda: self._stale_groups,
            topology_complete=self._topology_complete,
            send=self._send,
        ), self._rounds)
        self._optimizer = Optimizer(OptimizeHost(
            voting_members=self._votes.optimize_voters,
            members=self._roster.member_ids,
            ring=lambda group: self._rings.get(group),
            is_live=lambda pid: pid in self._roster.by_id,
            endpoint=lambda pid: self._roster.peer(pid).endpoint(),
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            install=lambda group, ids: self._rounds.start(group, ids),
        ))
        self._mismatches = PhaseMismatches(MismatchHost(
            members=self._roster.member_ids,
            waiting_calls=self._waiting_calls,
            full_vote=self._collectives_full_vote,
            end_waiting=self._end_waiting,
        ), grace=grace)
        self._collectives = CollectiveOps(OpsHost(
            members=self._roster.member_ids,
            ring=lambda group: self._rings.get(group),
            is_stale=lambda group: group in self._stale_groups,
            mark_stale=lambda group: self._stale_groups.add(group),
            is_live=lambda pid: pid in self._roster.by_id,
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            report=self._report,
            in_topology_vote=lambda pid: self._roster.peer(pid).topology_vote is not None,
            round_of=self._ring_rounds.get,
        ))
        # The peer-agreed ops of the master before a restart, as the peers report them
        # (docs/protocol.rst, "A master restart while peers are in doubt").
        self._orphans = OrphanOps(OrphansHost(
            is_live=lambda pid: pid in self._roster.by_id,
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            report=self._report,
        ), reconnect_timeout)
        self._paths = Paths(PathsHost(
            is_live=lambda pid: pid in self._roster.by_id,
            endpoint=lambda pid: self._roster.peer(pid).endpoint(),
            send=lambda pid, msg: self._send(self._roster.peer(pid), msg),
            random_bytes=lambda n: self._rng.getrandbits(8 * n).to_bytes(n, "little"),
        ), own_relay=own_relay)
        self._reported = ReportedBytes()
        self._timer_at: float | None = None
        self._out: list[Effect] = []
        self._logged_sizes: dict[int, int] = {}  # group -> world size last logged
        #: What each message type does once ``_dispatch`` let it through (same keys as ``PHASES``).
        self._handlers: dict[type[m.Message], Callable[[PeerRecord, Any], None]] = {
            m.Register: self._on_register,
            m.Heartbeat: self._reported.take,  # (last_heard was refreshed by handle())
            m.Leave: self._on_leave,
            m.P2PReport: lambda p, msg: self._rounds.on_report(p.peer_id, p.round_scope, msg),
            m.VoteTopology: self._on_vote_topology,
            m.VoteOptimize: self._on_vote_optimize,
            m.ProbeReport: lambda p, msg: self._optimizer.on_report(p.group, p.peer_id, msg),
            m.VotePeersPending: lambda p, msg: self._votes.asked_pending(p),
            m.CollectiveInit: lambda p, msg: self._collectives.on_init(p.group, p.peer_id, msg),
            m.CollectiveDone: lambda p, msg: self._collectives.on_done(p.group, p.peer_id, msg),
            m.CollectiveWithdraw: lambda p, msg: self._collectives.on_withdraw(p.group, p.peer_id, msg),
            m.CollectiveBegin: lambda p, msg: self._collectives.on_begin(p.group, p.peer_id, msg),
            m.CollectiveAsk: lambda p, msg: self._on_ask(p, msg, asked=True),
            m.CollectiveAnswer: lambda p, msg: self._on_ask(p, msg, asked=False),
            m.SyncVote: lambda p, msg: self._sync_state.on_vote(p.group, p.peer_id, msg),
            m.SyncReport: lambda p, msg: self._sync_state.on_report(p.group, p.peer_id, msg),
            m.PathRequest: lambda p, msg: self._paths.on_request(p.peer_id, msg),
            m.DialFailed: lambda p, msg: self._paths.on_dial_failed(p.peer_id, msg),
            m.PathReport: lambda p, msg: self._paths.on_report(p.peer_id, msg, self._now),
            m.RelayRegister: self._on_relay_register,
            m.RelayStats: lambda p, msg: self._paths.relay_stats(p.conn_id, msg),
        }
        assert self._handlers.keys() == PHASES.keys()

    # --- the interface ------------------------------------------------------------------------

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Apply one event at time ``now``; return the effects to execute, in order."""
        self._out = []
        self._now = now
        only_op: tuple[int, int] | None = None  # see "Re-checks" in the module docstring
        recheck = True
        msg: m.Message | None = None
        if isinstance(event, MessageReceived):  # (the common event first)
            msg = event.msg
            peer = self._roster.by_conn.get(event.conn_id)
            if peer is not None:  # messages still queued from a removed peer are dropped
                if peer.status is not _C or isinstance(event.msg, m.Register):
                    self._roster.heard(peer, now)
                aborts = self._collectives.aborts
                try:
                    self._dispatch(peer, event.msg)
                except PeerFault as fault:
                    self._remove(peer.conn_id, fault.reason, fault.detail)
                else:
                    only_op = self._own_op_only(peer, event.msg, aborts)
                    recheck = type(event.msg) is not m.Heartbeat
        elif isinstance(event, PeerConnected):
            if event.conn_id in self._roster.by_conn:
                raise ValueError(f"shell bug: connection {event.conn_id} connected twice")
            self._roster.connect(event.conn_id, event.observed_host, now)
        elif isinstance(event, PeerDisconnected):
            if event.conn_id in self._roster.by_conn:
                self._remove(event.conn_id, None, "disconnected")
        elif isinstance(event, ProtocolViolation):
            if event.conn_id in self._roster.by_conn:
                self._remove(event.conn_id, KickReason(event.reason), event.detail)
        elif not isinstance(event, Tick):
            raise TypeError(f"shell bug: unknown event {event!r}")
        # The deadline computed after the previous event bounds every peer's expiry from below
        # (last_heard only grows; new peers are heard now), so the O(peers) scan is needed only
        # once it is reached.
        if self._timer_at is not None and now >= self._timer_at:
            self._expire(now)
            only_op = None
            recheck = True
            self.generation += 1
        elif not isinstance(event, Tick) and not (
                isinstance(event, MessageReceived) and isinstance(event.msg, m.Heartbeat)):
            self.generation += 1
        if only_op is not None:
            while self._collectives.check(only_op):
                pass
            if isinstance(msg, m.CollectiveDone) and self._collectives.is_open(only_op, msg.seq):
                pass  # it changed no member's wait: the group's mismatch check stands (see "Re-checks")
            elif self._mismatches.check(only_op[0], self._now):
                self._settle()
        elif recheck:
            self._settle()
        if self._out:
            self.generation += 1  # (a heartbeat never acts; this guards the rule above)
        deadline = self.next_deadline
        if deadline != self._timer_at:
            self._timer_at = deadline
            self._out.append(SetTimer(deadline))
        out, self._out = self._out, []
        return out

    @property
    def next_deadline(self) -> float | None:
        at = self._roster.least_recently_heard()
        if at is None:
            return None
        deadline = at + self._peer_timeout
        for other in (self._mismatches.deadline(), self._orphans.deadline() if self._orphans else None):
            if other is not None:
                deadline = min(deadline, other)
        return deadline

    def recheck(self) -> list[Effect]:
        """Re-check every vote, round, op, sync and phase mismatch now, as an event at a
        deadline does, and return the effects that produced.  ``handle`` re-checks only what
        an event can have changed; the property tests call this after every event to show that
        nothing was left undone (the answer must be no effects and no change)."""
        self._settle()
        out, self._out = self._out, []
        return out

    def _new_lineage_id(self) -> bytes:
        return self._rng.getrandbits(8 * election.LINEAGE_ID_SIZE).to_bytes(election.LINEAGE_ID_SIZE, "little")

    # --- dispatch -------------------------------------------------------------------------------

    def _dispatch(self, peer: PeerRecord, msg: m.Message) -> None:
        phase = PHASES.get(type(msg))
        if phase is None:
            raise PeerFault(KickReason.PROTOCOL_ERROR,
                            f"{type(msg).__name__} is not a message peers send to the master")
        if peer.status not in phase.senders:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"{type(msg).__name__} while {peer.status.value}")
        for activity, detail in phase.refused_while:
            busy = self._busy_with(peer, activity)
            if busy:
                raise PeerFault(KickReason.OUT_OF_PHASE, detail.format(msg=msg, op=busy))
        self._handlers[type(msg)](peer, msg)

    def _busy_with(self, peer: PeerRecord, activity: ph.Activity) -> object:
        """Whether ``peer`` is in the middle of ``activity`` (for COLLECTIVE: its first op, or None)."""
        if activity is ph.Activity.TOPOLOGY:
            return peer.topology_vote is not None or peer.round_scope is not None
        if activity is ph.Activity.COLLECTIVE:
            ops = self._ops_of(peer)
            return ops[0] if ops else None
        if activity is ph.Activity.SYNC:
            return self._sync_state.in_sync(peer.group, peer.peer_id)
        return peer.pending_vote

    def _on_leave(self, peer: PeerRecord, msg: m.Leave) -> None:
        self._remove(peer.conn_id, None, "left the run")  # logs it, once
        self._out.append(Close(peer.conn_id))

    def _on_register(self, peer: PeerRecord, msg: m.Register) -> None:
        if msg.p2p_port == 0:
            raise PeerFault(KickReason.PROTOCOL_ERROR, "registration without a p2p port")
        if len(msg.candidates) > MAX_CANDIDATES:
            raise PeerFault(KickReason.PROTOCOL_ERROR,
                            f"registration with {len(msg.candidates)} candidates (at most {MAX_CANDIDATES})")
        for c in msg.candidates:
            if c.kind not in Port.__members__.values() or c.origin not in (CandidateOrigin.ADVERTISED,
                                                                           CandidateOrigin.LOCAL) or c.port == 0:
                raise PeerFault(KickReason.PROTOCOL_ERROR, f"registration with a bad candidate {c!r}")
        # A peer registering again after this master restarted keeps its id, unless this master
        # issued that id already (never reused, so that "gone" stays unambiguous).
        peer_id = self._roster.issue_id(msg.previous_peer_id, lambda: self._rng.getrandbits(63))
        peer.peer_id, peer.group, peer.status = peer_id, msg.peer_group, _R
        self._roster.changed()
        peer.p2p_port, peer.shared_state_port = msg.p2p_port, msg.shared_state_port
        peer.candidates = resolve_candidates(msg.candidates, peer.host)
        self._roster.by_id[peer_id] = peer.conn_id
        self._out.append(PeerJoined(peer.conn_id, peer_id, msg.peer_group, peer_id == msg.previous_peer_id))
        self._send(peer, m.Welcome(peer_id, self.instance, peer.host, peer_commit=True))
        again = " again, keeping its id" if peer_id == msg.previous_peer_id else ""
        log.info("peer %x joined group %d from %s%s; waiting to be accepted", peer_id, msg.peer_group, peer.host,
                 again)
        # (Reports of this master's own ops come from a peer that lost its connection to it: it
        # was declared dead in them, and ends them so.)
        undecided = tuple(u for u in msg.undecided if u.instance != self.instance)
        if undecided or self._orphans:
            self._orphans.registered(peer.group, peer_id, undecided, self._now)

    def _on_ask(self, peer: PeerRecord, msg: m.CollectiveAsk | m.CollectiveAnswer, *, asked: bool) -> None:
        """An ask or answer: of an op of the master before a restart (``msg.instance``), or of
        this master's (only an accepted peer takes part in one)."""
        if msg.instance and msg.instance != self.instance:
            self._orphans.answered(peer.group, peer.peer_id, msg, asked=asked)
        elif peer.status is not _A:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"{type(msg).__name__} while {peer.status.value}")
        elif asked:
            assert isinstance(msg, m.CollectiveAsk)
            self._collectives.on_ask(peer.group, peer.peer_id, msg)
        else:
            assert isinstance(msg, m.CollectiveAnswer)
            self._collectives.on_answer(peer.group, peer.peer_id, msg)

    def _on_relay_register(self, peer: PeerRecord, msg: m.RelayRegister) -> None:
        if msg.port == 0:
            raise PeerFault(KickReason.PROTOCOL_ERROR, "relay registration without a port")
        peer.status = _RELAY
        self._roster.changed()
        address = format_host_port(msg.host or peer.host, msg.port)
        relay_id = self._paths.add_relay(peer.conn_id, address)
        self._out.append(RelayJoined(peer.conn_id, relay_id, address))
        self._send(peer, m.RelayWelcome(relay_id, self.instance))

    def _on_vote_topology(self, peer: PeerRecord, msg: m.VoteTopology) -> None:
        peer.topology_vote = TopologyVote.ACCEPT if msg.accept_new_peers else TopologyVote.REWIRE

    def _on_vote_optimize(self, peer: PeerRecord, msg: m.VoteOptimize) -> None:
        peer.topology_vote = TopologyVote.OPTIMIZE

    # --- removal and timeouts -------------------------------------------------------------------

    def _remove(self, conn_id: int, reason: KickReason | None, detail: str) -> None:
        """Forget a connection; every vote it blocked is re-checked by ``_settle``."""
        peer = self._roster.remove(conn_id)
        if reason is not None:
            detail = clip_text(detail, MAX_DETAIL)  # may quote peer input (keys, frames): keep it small
            # DEBUG: the shell logs the kick (once, and rate-limited for unregistered connections).
            log.debug("kicking connection %d (peer %x): %s: %s", conn_id, peer.peer_id, reason.name, detail)
            self._out.append(Kick(conn_id, reason, detail))
        if peer.status is _C:
            return
        if peer.status is _RELAY:
            self._paths.relay_removed(conn_id)
            return
        if reason is None:  # a kick is logged once, by the shell that delivers it
            log.info("peer %x (group %d, connection %d) %s", peer.peer_id, peer.group, conn_id, detail)
        del self._roster.by_id[peer.peer_id]
        self._optimizer.links.forget(peer.peer_id)
        self._paths.peer_removed(peer.peer_id)
        if peer.round_scope is not None:
            self._rounds.dropped(peer.round_scope)
        if peer.status is _A:
            self._stale_groups.add(peer.group)
        self._collectives.forget(peer.group, peer.peer_id)

    def _expire(self, now: float) -> None:
        for peer in list(self._roster.by_conn.values()):
            if now >= peer.last_heard + self._peer_timeout and peer.conn_id in self._roster.by_conn:
                detail = (f"did not register within {now - peer.last_heard:.3g} s of connecting"
                          if peer.status is _C else f"silent for {now - peer.last_heard:.3g} s")
                self._remove(peer.conn_id, KickReason.TIMEOUT, detail)

    # --- consensus (re-evaluated after every event) ---------------------------------------------

    def _own_op_only(self, peer: PeerRecord, msg: m.Message, aborts: int) -> tuple[int, int] | None:
        """The op whose re-check is all that ``msg`` (just handled without a fault) needs, or
        ``None`` for a full re-check (see "Re-checks" in the module docstring); ``aborts`` is
        the collectives' abort count before it was handled."""
        if self._collectives.aborts != aborts or (isinstance(msg, m.CollectiveWithdraw) and msg.torn):
            return None  # an abort (or a torn ring) made the group stale: every vote of it is re-checked
        kind = type(msg)
        if kind in _OWN_OP_ONLY or (isinstance(msg, m.CollectiveDone) and not msg.aborted):
            return (peer.group, msg.tag)  # type: ignore[attr-defined]
        return None

    def _settle(self) -> None:
        progressed = True
        while progressed:
            progressed = False
            progressed |= self._rounds.settle()
            progressed |= self._votes.check_accept()
            for group in sorted(self._roster.accepted_groups() | self._optimizer.probing_groups()):
                progressed |= self._votes.check_rewire(group)
                progressed |= self._optimizer.check(group)
            progressed |= self._votes.check_pending()
            progressed |= self._collectives.settle()
            progressed |= self._sync_state.settle()
            if self._orphans:
                progressed |= self._orphans.check(self._now)
            if not progressed:
                groups = self._roster.accepted_groups()
                self._mismatches.keep_only(groups)
                for group in sorted(groups):
                    progressed |= self._mismatches.check(group, self._now)

    def _enter_round(self, peer_id: int, scope: int | None) -> None:
        """The peer takes part in the round of ``scope`` from now on (its topology vote ends
        there), or in none."""
        p = self._roster.peer(peer_id)
        if scope is not None:
            p.topology_vote = None
        p.round_scope = scope

    def _complete_round(self, rnd: RoundRecord, live: list[int]) -> None:
        """Every live participant of ``rnd`` reported success: they are accepted, the rings of
        their groups are installed, and each gets ``TopologyComplete``."""
        newcomers: set[int] = set()
        for pid in live:
            p = self._roster.peer(pid)
            if p.status is _R:
                log.info("peer %x accepted into group %d", pid, p.group)
                newcomers.add(pid)
            p.status, p.round_scope = _A, None
        self._roster.changed()
        groups = {self._roster.peer(pid).group for pid in live}
        for g in groups:
            self._rings[g] = self._optimizer.ring_order(g, [p.peer_id for p in self._roster.accepted(g)])
            self._ring_rounds[g] = rnd.round_id
            self._stale_groups.discard(g)
        if rnd.scope == GLOBAL_SCOPE:  # forget groups that have no members any more
            alive = {p.group for p in self._roster.accepted()}
            for g in list(self._rings):
                if g not in alive:
                    del self._rings[g]
            self._stale_groups &= alive
        completes: dict[int, m.TopologyComplete] = {}  # one per group: they are the same
        for pid in live:
            p = self._roster.peer(pid)
            if p.group not in completes:
                completes[p.group] = self._topology_complete(rnd.round_id, p.group)
            if pid in newcomers:
                self._out.append(PeerAccepted(p.conn_id, completes[p.group].membership.world_size))
            self._send(p, completes[p.group])
        log.debug("round %d complete: %d peers", rnd.round_id, len(live))
        self._log_world_sizes()

    def _log_world_sizes(self) -> None:
        """Log each group's world size when a completed round changed it (what its peers see)."""
        sizes = self._roster.world_sizes()
        for group in sorted(set(sizes) | set(self._logged_sizes)):
            if sizes.get(group, 0) != self._logged_sizes.get(group, 0):
                log.info("group %d: world size %d (was %d)", group, sizes.get(group, 0),
                         self._logged_sizes.get(group, 0))
        self._logged_sizes = dict(sizes)

    def _topology_complete(self, round_id: int, group: int) -> m.TopologyComplete:
        ring = tuple(self._roster.peer(pid).endpoint() for pid in self._rings[group])
        return m.TopologyComplete(round_id, ring, self.membership_of(group))

    def _waits_in(self, sync_waiting: frozenset[int], peer_id: int) -> tuple[ph.Call, Callable[[], str]] | None:
        """The call peer ``peer_id`` waits in for the others of its group, and what gives its
        name as the caller knows it (formatted only for a mismatch: a collective's name lists
        its tags); ``None`` when it is not known to wait for them (idle as far as the master
        knows, in a round, or with a collective running: each can still go on)."""
        peer = self._roster.by_conn[self._roster.by_id[peer_id]]
        if peer.round_scope is not None:
            return None
        if peer.topology_vote is not None:
            return _VOTE_CALLS[peer.topology_vote]
        if peer.peer_id in sync_waiting:
            return ph.Call.SYNC, "sync_shared_state()".__str__
        ops = self._collectives.waiting_ops(peer.group, peer.peer_id)
        return None if ops is None else (ph.Call.COLLECTIVE, functools.partial(call_name, ops))

    def _collectives_full_vote(self, group: int) -> bool:
        return self._collectives.full_vote(group)

    def _waiting_calls(self, group: int) -> Callable[[int], tuple[ph.Call, Callable[[], str]] | None]:
        # (asked after every collective message: a partial, not a lambda calling a method)
        return functools.partial(self._waits_in, self._sync_state.waiting_voters(group))

    def _end_waiting(self, group: int, detail: str) -> None:
        """Withdraw every waiting vote of ``group`` (a phase mismatch, ``detail`` says where):
        topology voters get ``TopologyRejected``, sync voters ``SyncRejected(PHASE_MISMATCH)``,
        collective voters ``CollectiveRejected(PHASE_MISMATCH)`` for each tag."""
        sync_waiting = self._sync_state.waiting_voters(group)
        for p in self._roster.accepted(group):
            if p.topology_vote is not None:
                p.topology_vote = None
                self._send(p, m.TopologyRejected(detail))
            elif p.peer_id in sync_waiting:
                self._sync_state.withdraw(group, p.peer_id, m.SyncRejectCode.PHASE_MISMATCH, detail)
            else:
                self._collectives.withdraw_all(group, p.peer_id, m.RejectCode.PHASE_MISMATCH, detail)

    # --- small helpers --------------------------------------------------------------------------

    def _ops_of(self, peer: PeerRecord) -> list[Any]:
        return self._collectives.of_peer(peer.group, peer.peer_id)

    def _send(self, peer: PeerRecord, msg: m.Message) -> None:
        self._out.append(Send(peer.conn_id, msg))

    def _report(self, fact: Fact) -> None:
        self._out.append(fact)
