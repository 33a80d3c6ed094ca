"""Shared-state sync, the master's side: one sync per group, pure and synchronous (no I/O).

:class:`SyncState` is a sub-machine of :class:`pccl.protocol.master.machine.MasterState`: the
master checks the phase rules (a peer may not vote a sync while it has a topology vote standing,
takes part in a round or has a collective in flight; nor vote twice), then hands it the sync
messages of accepted peers and re-checks it with every other consensus after every event.  It
sees the peers only through :class:`SyncHost`; it never imports the master.  Who fetches what
from whom is decided by :mod:`pccl.protocol.master.election`.

Rules
=====

Votes.  Every accepted peer of the group sends ``SyncVote``; a malformed vote is a
PROTOCOL_ERROR kick.  A vote from a peer that the group's running sync already finished with
(rejected) counts for the group's next sync, which starts when this one ends.

Election.  At consensus (every accepted member voted; votes of peers that left are dropped) the
election kicks (revision violation, schema mismatch, SEND_ONLY that would receive) and rejects
(``SyncRejected``: strategy mix, no source) and fixes the adopted revision.  Who wins follows
the lineage rule of :mod:`pccl.protocol.master.election`: the machine remembers each group's last
completed sync (:class:`~pccl.protocol.master.election.History`: the group's lineage, its schema and
the peers that took part); those peers' state wins over anyone else's, a peer without the
group's lineage receives it whatever revision it offers, and they must offer exactly its
revision + 1.  A restarted master remembers nothing: the lineages the votes carry decide.  The
first sync of a run (nobody holds a lineage) mints the group's lineage id (``new_lineage_id``,
from the master's injected RNG).
Every receiver with something to fetch gets ``SyncPlan(sync_id, attempt 1)``; everybody else
just waits.

Telling.  The machine logs at INFO when a group adopts a revision other than its last + 1 (who
offered it, and what the group had), when a peer without the group's lineage offered a higher
revision than the group's (it receives), and — once per peer — when a peer that took part in the
last sync offers that sync's revision again (a loop that forgot ``state.revision += 1``, or a
step given up).

Withdrawal.  A vote that waits for the election can be withdrawn by the master
(:meth:`SyncState.withdraw`, a phase mismatch: the group's other members wait in calls that
need this peer elsewhere): the peer gets ``SyncRejected(PHASE_MISMATCH)``.

Reports.  A receiver answers ``SyncReport``: ok → done; failed sources → the next attempt moves
their pieces onto the remaining sources (``SyncRejected(NO_SOURCE)`` when none is left); a hash
mismatch → ``SyncRejected(HASH_MISMATCH)`` for that receiver only.  A report for an earlier sync
or attempt crossed a decision on the wire and is ignored; one for a sync or attempt never sent
is OUT_OF_PHASE.

End.  A receiver that leaves is dropped; a source that leaves is reported by its receivers.
Once no receiver is pending every remaining participant gets ``SyncComplete(sync_id,
revision, lineage, reason)``, and the sync becomes the group's history.  Sources serve until
then.  A sync that completes so is reported once (the fact ``SyncEnded``, right before those
messages, with the bytes every plan of it had receivers fetch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

from ...errors import KickReason
from . import election
from .. import messages as m
from ..codec import MAX_DETAIL, clip_text
from .events import PeerFault, SyncEnded

__all__ = ["SyncState", "SyncHost", "SyncRoundInfo", "PeerFault"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SyncHost:
    """What the sync machine needs from the master, as callables (peers named by id)."""

    #: the peer still has a connection (it was not removed)
    is_live: Callable[[int], bool]
    #: where a live peer serves its shared state
    endpoint: Callable[[int], m.PeerEndpoint]
    #: the accepted peers of a group
    members: Callable[[int], list[int]]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: remove a live peer with ``Kick(reason, detail)``
    kick: Callable[[int, KickReason, str], None]
    #: tell the shell that a sync ended (a fact, before its ``SyncComplete`` messages)
    report: Callable[[SyncEnded], None]


@dataclasses.dataclass(frozen=True)
class SyncRoundInfo:
    """Read-only view of one group's shared-state sync."""

    group: int
    voters: frozenset[int]
    sync_id: int | None
    revision: int
    participants: tuple[int, ...]
    sources: tuple[int, ...]
    receivers: frozenset[int]


@dataclasses.dataclass(eq=False)
class _Receiver:
    plan: election.ReceiverPlan
    attempt: int = 1
    excluded: set[int] = dataclasses.field(default_factory=set)  # sources that failed it


@dataclasses.dataclass(eq=False)
class _Sync:
    group: int
    votes: dict[int, m.SyncVote] = dataclasses.field(default_factory=dict)
    sync_id: int | None = None  # set once elected
    revision: int = 0
    #: The group's lineage, schema and every participant's reason once elected.
    lineage: m.Lineage | None = None
    schema: election.Structure = ()
    reasons: dict[int, m.SyncReason] = dataclasses.field(default_factory=dict)
    participants: tuple[int, ...] = ()
    sources: tuple[int, ...] = ()
    receivers: dict[int, _Receiver] = dataclasses.field(default_factory=dict)  # still fetching
    #: Bytes of every plan sent for this sync so far (re-plans count their pieces again).
    planned_bytes: int = 0
    #: Votes for the group's *next* sync from peers this one already finished with (rejected).
    next_votes: dict[int, m.SyncVote] = dataclasses.field(default_factory=dict)


class SyncState:
    """The syncs of every group.  See the module docstring for the rules."""

    def __init__(self, host: SyncHost, *, new_lineage_id: Callable[[], bytes],
                 min_stripe: int = election.DEFAULT_MIN_STRIPE) -> None:
        self._host = host
        #: Draws a fresh lineage id (``LINEAGE_ID_SIZE`` bytes) from the master's injected RNG.
        self._new_lineage_id = new_lineage_id
        self._min_stripe = min_stripe
        self._syncs: dict[int, _Sync] = {}  # group -> sync in progress
        #: group -> its last completed sync (the lineage rule's memory; see pccl.protocol.master.election).
        self._history: dict[int, election.History] = {}
        #: Peers already told that they offered the group's last revision again (logged once each).
        self._told_unchanged: set[int] = set()
        self._next_sync = 1

    # --- read-only views ------------------------------------------------------------------------

    def syncs(self) -> list[SyncRoundInfo]:
        return [SyncRoundInfo(s.group, frozenset(s.votes if s.sync_id is None else s.next_votes), s.sync_id,
                              s.revision, s.participants, s.sources, frozenset(s.receivers))
                for s in self._syncs.values()]

    def revision_of(self, group: int) -> int | None:
        """The revision ``group`` adopted at its last completed sync (``None`` before its first)."""
        history = self._history.get(group)
        return None if history is None else history.revision

    def lineage_of(self, group: int) -> m.Lineage | None:
        """The lineage of ``group`` after its last completed sync (``None`` before its first)."""
        history = self._history.get(group)
        return None if history is None else history.lineage

    def forget(self, group: int) -> None:
        """Forget ``group``'s last completed sync, as a restarted master knows nothing of it (the
        simulator's planted masters use it)."""
        self._history.pop(group, None)

    def in_sync(self, group: int, peer_id: int) -> bool:
        """The peer voted for its group's sync, takes part in it, or its next vote is queued."""
        sync = self._syncs.get(group)
        if sync is None:
            return False
        if peer_id in sync.next_votes:
            return True
        return peer_id in (sync.votes if sync.sync_id is None else sync.participants)

    def waiting_voters(self, group: int) -> frozenset[int]:
        """The peers of ``group`` whose vote waits for the others' (no election yet)."""
        sync = self._syncs.get(group)
        if sync is None or sync.sync_id is not None:
            return frozenset()
        return frozenset(sync.votes)

    def withdraw(self, group: int, peer_id: int, code: m.SyncRejectCode, detail: str) -> None:
        """Drop a waiting vote of ``peer_id`` (see :meth:`waiting_voters`) and tell it why."""
        sync = self._syncs[group]
        assert sync.sync_id is None, "only a vote that waits for the election is withdrawn"
        del sync.votes[peer_id]
        if not sync.votes:
            del self._syncs[group]
        self._host.send(peer_id, m.SyncRejected(code, detail))

    # --- messages (from accepted peers, phase rules already checked) ----------------------------

    def on_vote(self, group: int, peer_id: int, msg: m.SyncVote) -> None:
        problem = election.validate_vote(msg)
        if problem is not None:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"malformed sync vote: {problem}")
        sync = self._syncs.get(group)
        if sync is None:
            sync = self._syncs[group] = _Sync(group)
        if sync.sync_id is not None:
            # The group's previous sync still transfers and this peer is already out of it
            # (rejected): its vote counts for the next sync, which starts when this one ends.
            sync.next_votes[peer_id] = msg
        else:
            sync.votes[peer_id] = msg

    def on_report(self, group: int, peer_id: int, msg: m.SyncReport) -> None:
        sync = self._syncs.get(group)
        receiver = sync.receivers.get(peer_id) if sync is not None else None
        if sync is None or sync.sync_id != msg.sync_id or receiver is None:
            if msg.sync_id < self._next_sync:
                log.debug("ignoring late sync report of peer %x for sync %d", peer_id, msg.sync_id)
                return
            raise PeerFault(KickReason.OUT_OF_PHASE, f"sync report for sync {msg.sync_id}, which it was not sent")
        if msg.attempt != receiver.attempt:
            if msg.attempt < receiver.attempt:
                return
            raise PeerFault(KickReason.OUT_OF_PHASE, f"sync report for attempt {msg.attempt}, never planned")
        if msg.ok:
            del sync.receivers[peer_id]
            return
        if not msg.failed_sources:
            detail = clip_text(msg.detail, MAX_DETAIL)  # the peer's own text
            log.warning("peer %x received shared state that does not match the elected hashes: %s",
                        peer_id, detail)
            self._reject_receiver(sync, peer_id, m.SyncRejectCode.HASH_MISMATCH,
                                  f"the received bytes do not match the elected hashes: {detail}")
            return
        self._replan(sync, peer_id, receiver, msg.failed_sources)

    def _replan(self, sync: _Sync, pid: int, receiver: _Receiver, failed: Sequence[int]) -> None:
        planned = set(receiver.plan.sources)
        receiver.excluded |= {s for s in failed if s in planned}
        available = [s for s in sync.sources if self._host.is_live(s) and s not in receiver.excluded]
        plan = election.replan(sync.votes, receiver.plan, sorted(receiver.excluded), available,
                               min_stripe=self._min_stripe)
        if plan is None:
            self._reject_receiver(sync, pid, m.SyncRejectCode.NO_SOURCE,
                                  f"every source failed ({len(receiver.excluded)} tried)")
            return
        receiver.plan = plan
        receiver.attempt += 1
        log.info("sync %s: re-planning peer %x (attempt %d) after sources %s failed", sync.sync_id, pid,
                 receiver.attempt, ", ".join(f"{s:x}" for s in failed))
        self._host.send(pid, self._sync_plan(sync, receiver))

    def _reject_receiver(self, sync: _Sync, pid: int, code: m.SyncRejectCode, detail: str) -> None:
        del sync.receivers[pid]
        sync.participants = tuple(p for p in sync.participants if p != pid)
        self._host.send(pid, m.SyncRejected(code, detail))

    def _sync_plan(self, sync: _Sync, receiver: _Receiver) -> m.SyncPlan:
        plan = receiver.plan
        fetches = []
        for src in plan.sources:
            pieces = tuple(m.StatePiece(p.key, p.offset, p.nbytes) for p in plan.pieces if p.source == src)
            fetches.append(m.SourceFetch(self._host.endpoint(src), pieces))
        expected = tuple(m.ExpectedHash(k, plan.expected[k]) for k in sorted(plan.expected))
        assert sync.sync_id is not None
        sync.planned_bytes += sum(piece.nbytes for fetch in fetches for piece in fetch.pieces)
        return m.SyncPlan(sync.sync_id, receiver.attempt, sync.revision, expected, tuple(fetches))

    # --- consensus (re-evaluated by the master after every event) -------------------------------

    def settle(self) -> bool:
        """Re-check every group's sync once; whether anything happened."""
        progressed = False
        for group in sorted(self._syncs):
            progressed |= self._check_sync(group)
        return progressed

    def _check_sync(self, group: int) -> bool:
        sync = self._syncs[group]
        if sync.sync_id is None:
            for pid in [p for p in sync.votes if not self._host.is_live(p)]:
                del sync.votes[pid]
            if not sync.votes:
                del self._syncs[group]
                return True
            if not all(pid in sync.votes for pid in self._host.members(group)):
                return False
            self._elect(sync)
            return True
        for pid in [p for p in sync.receivers if not self._host.is_live(p)]:
            del sync.receivers[pid]
        live = [p for p in sync.participants if self._host.is_live(p)]
        if sync.receivers and live:
            # A receiver whose plan names only dead sources and that has not noticed yet will
            # report; nothing to do here (its fetch fails on the dead connection or times out).
            return False
        del self._syncs[group]
        queued = {pid: v for pid, v in sync.next_votes.items() if self._host.is_live(pid)}
        if queued:
            self._syncs[group] = _Sync(group, votes=queued)
        if sync.lineage is None:  # every voter was rejected: nothing was elected
            return True
        if live:
            assert sync.sync_id is not None  # elected: it has a lineage
            self._history[group] = election.History(sync.lineage, sync.schema, frozenset(live))
            self._host.report(SyncEnded(group, sync.sync_id, sync.revision, sync.planned_bytes))
        for pid in live:
            reason = sync.reasons.get(pid, m.SyncReason.UP_TO_DATE)
            self._host.send(pid, m.SyncComplete(sync.sync_id, sync.revision, sync.lineage, int(reason)))
        log.debug("sync %d of group %d complete at revision %d", sync.sync_id, group, sync.revision)
        return True

    def _elect(self, sync: _Sync) -> None:
        history = self._history.get(sync.group)
        outcome = election.elect(sync.votes, history, min_stripe=self._min_stripe)
        for pid, (code, detail) in sorted(outcome.rejects.items()):
            self._host.send(pid, m.SyncRejected(code, clip_text(detail, MAX_DETAIL)))  # quotes keys
        for pid, (reason, detail) in sorted(outcome.kicks.items()):
            self._host.kick(pid, reason, detail)
        sync.sync_id = self._next_sync
        self._next_sync += 1
        sync.participants = outcome.participants
        sync.sources = outcome.sources
        if outcome.revision is not None:
            sync.revision = outcome.revision
            lineage_id = outcome.lineage_id
            if lineage_id is None:
                lineage_id = self._new_lineage_id()
            sync.lineage = m.Lineage(lineage_id, outcome.revision, election.content_digest(outcome.popular))
            sync.schema = election.structure_of(outcome.popular)
            sync.reasons = dict(outcome.reasons)
            self._tell(sync, history, outcome)
        for pid in sorted(outcome.plans):
            receiver = _Receiver(outcome.plans[pid])
            sync.receivers[pid] = receiver
            self._host.send(pid, self._sync_plan(sync, receiver))
        log.debug("sync %d of group %d elected: revision %s, %d sources, %d receivers, %d kicked, %d rejected",
                  sync.sync_id, sync.group, outcome.revision, len(outcome.sources), len(outcome.plans),
                  len(outcome.kicks), len(outcome.rejects))

    def _tell(self, sync: _Sync, history: election.History | None, outcome: election.Election) -> None:
        """The INFO lines of the module's "Telling" rule."""
        assert outcome.revision is not None and outcome.winner is not None and sync.lineage is not None
        group, revision, lineage = sync.group, outcome.revision, sync.lineage
        if history is not None:
            for pid in outcome.participants:
                if (pid in history.continuing and sync.votes[pid].revision == history.revision
                        and pid not in self._told_unchanged):
                    self._told_unchanged.add(pid)
                    log.info("peer %x offered revision %d, the revision of group %d's last sync, again: did its "
                             "loop forget `state.revision += 1`? (said once per peer)", pid, history.revision, group)
        if history is None or revision != history.revision + 1:
            vote = sync.votes[outcome.winner]
            offered = (f"offered by peer {outcome.winner:x}, which held "
                       + ("no lineage" if vote.lineage is None else f"lineage {_short(vote.lineage)}"))
            if history is None:
                had = "no earlier sync of this group is known (the run's first sync, or the master restarted)"
            else:
                had = f"the group was at revision {history.revision} of lineage {_short(history.lineage)}"
            became = ("a new lineage " if outcome.lineage_id is None else "lineage ") + lineage.id.hex()[:12]
            log.info("group %d adopts revision %d (%s) %s; %s", group, revision, became, offered, had)
        for pid in outcome.participants:
            if (outcome.reasons.get(pid) is m.SyncReason.NEWCOMER and sync.votes[pid].revision > revision):
                log.info("peer %x offered revision %d but holds none of group %d's lineage: it receives the group's "
                         "state at revision %d", pid, sync.votes[pid].revision, group, revision)


def _short(lineage: m.Lineage) -> str:
    return f"{lineage.id.hex()[:12]} at revision {lineage.revision}"
