"""A restarted master's side of the peer-agreed ops of the master before it (sans-IO).

docs/protocol.rst, "Design: completion agreed among peers", *A master restart while peers are
in doubt*.  The op's state lives on its participants: a ready one that lost its master keeps the
op (frozen if it was in doubt) and reports it when it registers again (``Register.undecided``:
the old master's instance, the tag, the seq, the participants, its phase and known set).  The
restarted master knows no such op, so it resolves it from those reports with the same rules as
its own ops (:class:`~.peer_resolve.Resolution`, :func:`pccl.protocol.peer_commit.resolve`):

* a report ``IN_DOUBT`` is that participant's ask: the master queries every other participant
  (``CollectiveQuery`` naming the old master's ``instance``) — at once if it has registered,
  else as it registers;
* a report ``READY`` is its ``Done(ok)``: it proves its sender was ready, and its sender is not
  frozen (it may still commit on its acks), so it does not count as an answer;
* a participant answers from what it remembers of the op (``COMMITTED`` or ``ABORTED``: it
  acted on a verdict or committed on its set; one that never began it, or knows nothing of
  it, answers ``ABORTED`` and is frozen out of it);
* a participant that has not registered within ``master_reconnect_timeout`` of the first report
  — every live peer has registered by then, or given up — or that registered and left again,
  is dead: its outcome binds nobody (:func:`~pccl.protocol.peer_commit.resolve`'s ``dead``).

The verdict, ``CollectiveComplete`` or ``CollectiveAbort`` with the old seq, goes only to the
participants that reported or answered the op undecided (they hold its tag, so no later op on
it can take the verdict for its own); a later ask or report of it hears it again.

Not here: fences (a participant declared dead that registers later is not kicked; its answers
and reports are ignored, logged) — see the docs' *Not done*.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable

from ...errors import KickReason, ProtocolError
from .. import messages as m
from ..peer_commit import Answer, Phase, PeerCommitError, Verdict
from .events import OpEnded, PeerFault
from .peer_resolve import PHASES, Resolution, Send, Word, why_aborted

__all__ = ["OrphanOps", "OrphansHost"]

log = logging.getLogger("pccl.protocol.master.machine")

#: Ended ops remembered for a late ask or report.
_MEMORY = 4096
#: (group, the old master's instance, seq)
Key = tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class OrphansHost:
    """What the orphaned ops need from the master (peers named by id)."""

    #: the peer is registered with this master (or accepted)
    is_live: Callable[[int], bool]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: tell the shell that an op ended (a fact, before its final messages)
    report: Callable[[OpEnded], None]


@dataclasses.dataclass(eq=False)
class _Orphan:
    tag: int
    participants: tuple[int, ...]
    res: Resolution
    deadline: float
    #: Participants that registered with this master since the op's first report (a later
    #: absence is a departure: dead at once).
    seen: set[int] = dataclasses.field(default_factory=set)
    #: Participants that reported or answered it undecided: they wait for the verdict.
    waiting: set[int] = dataclasses.field(default_factory=set)
    #: Participants the query went to (the others get it as they register).
    asked: set[int] = dataclasses.field(default_factory=set)
    #: The deadline passed: whoever had not registered then is dead.
    expired: bool = False


class OrphanOps:
    """The peer-agreed ops of earlier masters that peers reported (see the module docstring)."""

    def __init__(self, host: OrphansHost, reconnect_timeout: float) -> None:
        self._host = host
        self._timeout = reconnect_timeout
        self._ops: dict[Key, _Orphan] = {}
        #: Ended ops: the verdict, and who was told it (each participant hears it once).
        self._ended: collections.OrderedDict[Key, tuple[m.CollectiveComplete | m.CollectiveAbort, set[int]]] = \
            collections.OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._ops)

    # --- inputs -------------------------------------------------------------------------------

    def registered(self, group: int, peer_id: int, undecided: tuple[m.UndecidedOp, ...], now: float) -> None:
        """``peer_id`` registered with its reports: each is its ask (in doubt) or its ``Done(ok)``
        (ready); every open op of its group that queried it before it registered queries it now."""
        for report in undecided:
            key = (group, report.instance, report.seq)
            answer = self._answer_of(peer_id, report.tag, report.phase, report.known)
            if answer.phase not in (Phase.READY, Phase.IN_DOUBT):
                raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {report.tag}: an undecided op "
                                                           f"reported {answer.phase.value}")
            if key in self._ended:
                self._retell(key, peer_id)
                continue
            orphan = self._ops.get(key) or self._open(key, report, now)
            if tuple(report.participants) != orphan.participants or report.tag != orphan.tag:
                raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {report.tag} seq {report.seq}: "
                                "reported with other participants than before")
            if peer_id not in orphan.participants:
                raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {report.tag}: a report from a "
                                                           "non-participant")
            orphan.seen.add(peer_id)
            if peer_id in orphan.res.dead:
                log.warning("peer %x reports collective tag %d seq %d after it was declared dead: ignored",
                            peer_id, report.tag, report.seq)
                continue
            orphan.waiting.add(peer_id)
            if answer.phase is Phase.IN_DOUBT:
                self._fold(key, lambda res: res.ask(peer_id, answer))
            elif peer_id not in orphan.res.ready:
                self._fold(key, lambda res: res.done(peer_id, True))
        for key, orphan in list(self._ops.items()):
            if key[0] != group or peer_id not in orphan.participants:
                continue
            orphan.seen.add(peer_id)
            res = orphan.res
            if (peer_id in res.queried and peer_id not in res.answer_map and peer_id not in orphan.asked
                    and res.verdict is None):
                orphan.asked.add(peer_id)
                self._host.send(peer_id, m.CollectiveQuery(orphan.tag, key[2], key[1]))

    def answered(self, group: int, peer_id: int, msg: m.CollectiveAsk | m.CollectiveAnswer, *, asked: bool) -> None:
        """An ask or answer naming an earlier master's op (``msg.instance``)."""
        key = (group, msg.instance, msg.seq)
        answer = self._answer_of(peer_id, msg.tag, msg.phase, msg.known)
        orphan = self._ops.get(key)
        if orphan is None:
            if key in self._ended:
                if answer.phase in (Phase.READY, Phase.IN_DOUBT):
                    self._retell(key, peer_id)  # it waits for the verdict
            else:
                log.warning("peer %x %s collective tag %d seq %d of master %x, which nobody reported", peer_id,
                            "asks about" if asked else "answers on", msg.tag, msg.seq, msg.instance)
            return
        if peer_id in orphan.res.dead:
            log.warning("peer %x %s collective tag %d seq %d after it was declared dead: ignored", peer_id,
                        "asks about" if asked else "answers on", msg.tag, msg.seq)
            return
        if answer.phase in (Phase.READY, Phase.IN_DOUBT):
            orphan.waiting.add(peer_id)
        self._fold(key, lambda res: res.ask(peer_id, answer) if asked else res.answer(peer_id, answer))

    def check(self, now: float) -> bool:
        """Declare dead the participants that left, or did not register in time; whether
        anything changed."""
        changed = False
        for key, orphan in list(self._ops.items()):
            orphan.expired = orphan.expired or now >= orphan.deadline
            for pid in orphan.participants:
                if key not in self._ops:
                    break  # decided
                if pid in orphan.res.dead or self._host.is_live(pid):
                    continue
                if pid in orphan.seen or orphan.expired:
                    log.info("collective tag %d seq %d of master %x: participant %x %s: dead", orphan.tag, key[2],
                             key[1], pid, "left" if pid in orphan.seen else
                             f"did not register within {self._timeout:g} s (master_reconnect_timeout)")
                    changed = True
                    self._fold(key, lambda res: res.death(pid))
        return changed

    def deadline(self) -> float | None:
        """When :meth:`check` must run next (a participant may be declared dead then)."""
        return min((o.deadline for o in self._ops.values() if not o.expired), default=None)

    # --- the rules ----------------------------------------------------------------------------

    @staticmethod
    def _answer_of(peer_id: int, tag: int, phase: int, known: tuple[int, ...]) -> Answer:
        try:
            return Answer(PHASES[m.CommitPhase(phase)], frozenset(known))
        except ValueError:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {tag}: no phase {phase}") from None

    def _open(self, key: Key, report: m.UndecidedOp, now: float) -> _Orphan:
        try:
            res = Resolution.open(report.participants)
        except ProtocolError as exc:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {report.tag}: {exc}") from None
        orphan = self._ops[key] = _Orphan(report.tag, tuple(report.participants), res, now + self._timeout)
        orphan.seen.update(pid for pid in orphan.participants if self._host.is_live(pid))
        log.info("resolving collective tag %d seq %d of master %x (before a restart) over %d participants",
                 report.tag, report.seq, report.instance, len(orphan.participants))
        return orphan

    def _fold(self, key: Key, step: Callable[[Resolution], tuple[Resolution, tuple[Send, ...]]]) -> None:
        orphan = self._ops[key]
        try:
            res, sends = step(orphan.res)
        except PeerCommitError as exc:  # a pccl bug: abort rather than fail the master
            log.error("collective tag %d seq %d of master %x: %s: aborting it", orphan.tag, key[2], key[1], exc)
            self._end(key, m.CollectiveAbort(orphan.tag, key[2], f"the participants' answers disagree ({exc})"))
            return
        except ProtocolError as exc:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {orphan.tag}: {exc}") from None
        orphan.res = res
        for send in sends:
            if send.word is Word.QUERY:
                query = m.CollectiveQuery(orphan.tag, key[2], key[1])
                for pid in sorted(send.to):
                    if self._host.is_live(pid):  # the others as they register
                        orphan.asked.add(pid)
                        self._host.send(pid, query)
        if res.verdict is Verdict.COMMIT:
            self._end(key, m.CollectiveComplete(orphan.tag, key[2]))
        elif res.verdict is Verdict.ABORT:
            self._end(key, m.CollectiveAbort(orphan.tag, key[2], why_aborted(res)))

    def _retell(self, key: Key, peer_id: int) -> None:
        """``peer_id`` waits for an ended op's verdict: it hears it, once."""
        verdict, told = self._ended[key]
        if peer_id not in told:
            told.add(peer_id)
            self._host.send(peer_id, verdict)

    def _end(self, key: Key, verdict: m.CollectiveComplete | m.CollectiveAbort) -> None:
        orphan = self._ops.pop(key)
        aborted = isinstance(verdict, m.CollectiveAbort)
        log.info("collective tag %d seq %d of master %x: %s", orphan.tag, key[2], key[1],
                 f"aborted ({verdict.detail})" if isinstance(verdict, m.CollectiveAbort) else "committed")
        tell = [pid for pid in sorted(orphan.waiting - orphan.res.dead) if self._host.is_live(pid)]
        self._ended[key] = (verdict, set(tell))
        while len(self._ended) > _MEMORY:
            self._ended.popitem(last=False)
        if tell:
            self._host.report(OpEnded(key[0], orphan.tag, key[2], aborted, tell[0]))
        for pid in tell:
            self._host.send(pid, verdict)
