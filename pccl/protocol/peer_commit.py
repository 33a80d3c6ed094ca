"""Completion agreed among an op's participants, as a state machine (sans-IO).

The verified core of the design in :doc:`protocol` ("Design: completion agreed among peers"),
run per begun op by :mod:`pccl._peer.peer_commit_driver` when ``Config.peer_commit`` is on.
Otherwise the verdict of every collective is the master's (``Done`` -> ``Complete``/``Abort``,
:mod:`pccl.protocol.op_lifecycle`); here the participants decide it themselves in the steady
state, and the master only resolves an op that someone is in doubt about.  The model is h11's ``_state.py``: rules first, transitions as data.

Terms
=====

*participants*
    the op's ring (every peer of the group since the last topology round), identical everywhere.
*ready*
    a participant holds its full result and every digest its neighbours sent matched its own
    parameters.  Becoming ready is a participant's *vote to commit*; nothing takes it back.
*known*
    the set of participants this one knows to be ready: its own id once it is ready, and every id
    in a ``known`` set it received.  An id enters a known set only from that participant's own
    readiness (provenance), so a full known set proves that every participant was ready.
*in doubt*
    ready, frozen, and waiting for the master's verdict: it asked (it lost a link, or the master
    said a participant is dead) or it answered the master's query.

States
======

=============  ===================================================================================
``RUNNING``    the data path runs (or the op has not begun here yet): this participant is not ready
``READY``      it holds its full result and sent its known set on; it waits for the rest of the set
``IN_DOUBT``   ready and frozen: its answer is with the master, whose verdict alone ends the op here
``COMMITTED``  final outcome: the call returns the result
``ABORTED``    final outcome: the call raises (its in-place input restored)
=============  ===================================================================================

Events
======

================  =================================================================================
``RESULT_HELD``   the data path finished with the full result and every digest matched
``RING_FAILED``   the data path failed, a digest differed, or the call left before the result
``ALL_KNOWN``     the known set became every participant (derived by :func:`step` from a merge)
``NACK``          a participant said it will never be ready (it failed, or answered a query running)
``PEER_LOST``     a link to a participant broke, or the master said a participant is dead
``MASTER_LOST``   the master connection closed (a restart, or this peer was cut off)
``QUERY``         the master asks this participant's state for the op
``PEER_QUERY``    a participant in doubt asks this one's state (no master needed; nothing freezes)
``COMMIT``        the master's verdict (which an answer ``committed`` decides): commit
``ABORT``         the master's verdict, or a participant's answer ``aborted``: abort
``CANCEL``        the caller was cancelled
================  =================================================================================

Effects
=======

=================  ================================================================================
``SEND_KNOWN``     send the known set to this participant's next ack partners
``SEND_NACK``      tell the participants that this one will never be ready
``CANCEL_RING``    stop the data path
``RETURN_RESULT``  the call returns the result (if the caller is still there)
``RESTORE_INPUT``  restore an in-place input; the call raises ``CollectiveAborted`` (or the error)
``RETIRE``         tell the master, one-way, that the op committed here (nobody waits for it)
``ASK_MASTER``     ask the master (the one connected now, or the next) to resolve, with the answer
``ANSWER``         answer the query (the master's, or the asking participant's) with
                   :meth:`PeerCommit.answer`
``DETACH``         the call ends (cancelled, input restored); the op lives on in the background
=================  ================================================================================

Rules
=====

* A participant commits only with a full known set, or on the master's ``COMMIT``; the master
  says ``COMMIT`` only when some participant committed or its answers' known sets cover every
  participant (:func:`resolve`).  So nothing commits unless every participant was ready.
* A participant that never became ready never becomes ready once it failed, nacked or answered
  a query: a query freezes a running participant into ``ABORTED``.  A ``NACK`` therefore proves
  that nobody can commit, and any participant may abort on it without the master.
* Once a ready participant has asked or answered the master it is frozen: known sets it receives
  afterwards never commit it (the master may be deciding on the answer it gave).
* A participant in doubt may ask the others (``PEER_QUERY``) and abort on an answer ``aborted``;
  it never commits on one (:func:`learned_from_peer` says why).
* A ready participant never aborts on its own: a lost link, a lost master or a cancelled caller
  leave it ready (or in doubt); only a ``NACK`` or an ``ABORT`` (the master's, or learned from
  another participant's answer) end it aborted.
* A pair missing from :data:`TRANSITIONS` cannot happen if the rules hold (a ``NACK`` reaching a
  committed participant, say): :func:`step` raises :class:`PeerCommitError` rather than guess.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from typing import NamedTuple

from ..errors import InvalidArgument, ProtocolError
from . import transition_table

__all__ = ["Answer", "DECIDED", "Effect", "Event", "Phase", "PeerCommit", "PeerCommitError",
           "TRANSITIONS", "Verdict", "ack_partners", "ack_rounds", "learned_from_peer", "merge",
           "outcome_of", "render_table", "resolve", "step"]


class Phase(enum.Enum):
    RUNNING = "running"
    READY = "ready"
    IN_DOUBT = "in doubt"
    COMMITTED = "committed"
    ABORTED = "aborted"


class Event(enum.Enum):
    RESULT_HELD = "result held"
    RING_FAILED = "ring failed"
    ALL_KNOWN = "all known"
    NACK = "nack"
    PEER_LOST = "peer lost"
    MASTER_LOST = "master lost"
    QUERY = "query"
    PEER_QUERY = "peer query"
    COMMIT = "commit"
    ABORT = "abort"
    CANCEL = "cancel"


class Effect(enum.Enum):
    SEND_KNOWN = "send known"
    SEND_NACK = "send nack"
    CANCEL_RING = "cancel ring"
    RETURN_RESULT = "return result"
    RESTORE_INPUT = "restore input"
    RETIRE = "retire"
    ASK_MASTER = "ask master"
    ANSWER = "answer"
    DETACH = "detach"


class Verdict(enum.Enum):
    COMMIT = "commit"
    ABORT = "abort"


P, E, X = Phase, Event, Effect
_NONE: tuple[Effect, ...] = ()
_FAIL = (X.CANCEL_RING, X.SEND_NACK, X.RESTORE_INPUT)

#: (phase, event) -> (next phase, effects).  Filled in below for the events that change nothing.
TRANSITIONS: dict[tuple[Phase, Event], tuple[Phase, tuple[Effect, ...]]] = {
    (P.RUNNING, E.RESULT_HELD): (P.READY, (X.SEND_KNOWN,)),
    (P.RUNNING, E.RING_FAILED): (P.ABORTED, _FAIL),
    (P.RUNNING, E.NACK): (P.ABORTED, _FAIL),
    (P.RUNNING, E.PEER_LOST): (P.ABORTED, _FAIL),  # the ring cannot finish: never ready
    (P.RUNNING, E.MASTER_LOST): (P.RUNNING, _NONE),  # the steady state needs no master
    (P.RUNNING, E.QUERY): (P.ABORTED, (*_FAIL, X.ANSWER)),  # frozen running: never ready
    (P.RUNNING, E.PEER_QUERY): (P.ABORTED, (*_FAIL, X.ANSWER)),  # so the asker can abort
    (P.RUNNING, E.ABORT): (P.ABORTED, (X.CANCEL_RING, X.RESTORE_INPUT)),
    (P.RUNNING, E.CANCEL): (P.ABORTED, _FAIL),

    (P.READY, E.ALL_KNOWN): (P.COMMITTED, (X.RETURN_RESULT, X.RETIRE)),
    (P.READY, E.NACK): (P.ABORTED, (X.RESTORE_INPUT,)),
    (P.READY, E.PEER_LOST): (P.IN_DOUBT, (X.ASK_MASTER,)),
    (P.READY, E.MASTER_LOST): (P.READY, _NONE),
    (P.READY, E.QUERY): (P.IN_DOUBT, (X.ANSWER,)),
    (P.READY, E.PEER_QUERY): (P.READY, (X.ANSWER,)),  # "ready" decides nothing for the asker
    (P.READY, E.COMMIT): (P.COMMITTED, (X.RETURN_RESULT,)),
    (P.READY, E.ABORT): (P.ABORTED, (X.RESTORE_INPUT,)),
    (P.READY, E.CANCEL): (P.READY, (X.DETACH,)),

    (P.IN_DOUBT, E.ALL_KNOWN): (P.IN_DOUBT, _NONE),  # frozen: the master decides on its answer
    (P.IN_DOUBT, E.NACK): (P.ABORTED, (X.RESTORE_INPUT,)),
    (P.IN_DOUBT, E.PEER_LOST): (P.IN_DOUBT, _NONE),
    (P.IN_DOUBT, E.MASTER_LOST): (P.IN_DOUBT, (X.ASK_MASTER,)),  # ask the next master
    (P.IN_DOUBT, E.QUERY): (P.IN_DOUBT, (X.ANSWER,)),
    (P.IN_DOUBT, E.PEER_QUERY): (P.IN_DOUBT, (X.ANSWER,)),
    (P.IN_DOUBT, E.COMMIT): (P.COMMITTED, (X.RETURN_RESULT,)),
    (P.IN_DOUBT, E.ABORT): (P.ABORTED, (X.RESTORE_INPUT,)),
    (P.IN_DOUBT, E.CANCEL): (P.IN_DOUBT, (X.DETACH,)),
}
for _event in (E.ALL_KNOWN, E.PEER_LOST, E.MASTER_LOST, E.COMMIT, E.CANCEL):
    TRANSITIONS[(P.COMMITTED, _event)] = (P.COMMITTED, _NONE)
for _event in (E.NACK, E.PEER_LOST, E.MASTER_LOST, E.ABORT, E.CANCEL):
    TRANSITIONS[(P.ABORTED, _event)] = (P.ABORTED, _NONE)
for _phase in (P.COMMITTED, P.ABORTED):
    TRANSITIONS[(_phase, E.QUERY)] = (_phase, (X.ANSWER,))
    TRANSITIONS[(_phase, E.PEER_QUERY)] = (_phase, (X.ANSWER,))
# A result held after the abort (the ring finished as it was stopped) changes nothing; nor does
# a full known set reaching a participant the master aborted (a crashed participant collected
# every id and died before anyone live heard of one of them: it is no survivor).
for _event in (E.RESULT_HELD, E.RING_FAILED, E.ALL_KNOWN):
    TRANSITIONS[(P.ABORTED, _event)] = (P.ABORTED, _NONE)
del _event, _phase

#: Outcomes: a participant in one of these never changes phase again.
DECIDED = frozenset({P.COMMITTED, P.ABORTED})


class PeerCommitError(RuntimeError):
    """An event the rules say cannot happen (a pccl bug, or two outcomes for one op)."""


class Answer(NamedTuple):
    """A participant's state for an op, as the master's query (or its own ask) carries it."""

    phase: Phase
    known: frozenset[int]


def _check_participants(me: int, participants: Collection[int]) -> frozenset[int]:
    group = frozenset(participants)
    if not group or len(group) != len(participants):
        raise InvalidArgument(f"an op's participants must be distinct peer ids, got {sorted(participants)}")
    if me not in group:
        raise InvalidArgument(f"peer {me} is not a participant of an op over {sorted(group)}")
    return group


def step(phase: Phase, known: frozenset[int], me: int, participants: frozenset[int], event: Event,
         table: Mapping[tuple[Phase, Event], tuple[Phase, tuple[Effect, ...]]] = TRANSITIONS,
         ) -> tuple[Phase, frozenset[int], tuple[Effect, ...]]:
    """One transition: ``(phase, known)`` after ``event`` and the effects, in order (a known set
    that arrived is :func:`merge`'s).  ``table`` lets a test try another rule on the same model.
    """
    try:
        nxt, effects = table[(phase, event)]
    except KeyError:
        raise PeerCommitError(
            f"{event.value!r} cannot happen to a participant that is {phase.value}") from None
    if event is E.RESULT_HELD and phase is P.RUNNING:
        known = known | {me}
    if nxt is P.READY and known == participants:  # the last to be ready: commit at once
        nxt2, more = table[(P.READY, E.ALL_KNOWN)]
        return nxt2, known, effects + more
    return nxt, known, effects


def merge(phase: Phase, known: frozenset[int], me: int, participants: frozenset[int],
          received: frozenset[int],
          table: Mapping[tuple[Phase, Event], tuple[Phase, tuple[Effect, ...]]] = TRANSITIONS,
          ) -> tuple[Phase, frozenset[int], tuple[Effect, ...]]:
    """A known set arrived from another participant: merge it; forward what grew (a ready or
    committed participant relays, so that O(log N) rounds spread every id); commit on a full set
    through :data:`TRANSITIONS`' ``ALL_KNOWN`` row."""
    if not received <= participants:
        raise ProtocolError(f"a known set names {sorted(received - participants)}, "
                            f"not participants of the op over {sorted(participants)}")
    if me in received and me not in known:
        raise ProtocolError(f"a known set names peer {me} ready, which it never was ({phase.value})")
    grown = known | received
    if grown == known:
        return phase, known, _NONE
    effects: tuple[Effect, ...] = (X.SEND_KNOWN,) if phase in (P.READY, P.COMMITTED) else _NONE
    if grown == participants:
        nxt, _, more = step(phase, grown, me, participants, E.ALL_KNOWN, table=table)
        return nxt, grown, effects + more
    return phase, grown, effects


class PeerCommit:
    """One participant's side of one op (see the module docstring); the shell runs the effects."""

    __slots__ = ("me", "participants", "phase", "known")

    def __init__(self, me: int, participants: Collection[int]) -> None:
        self.participants = _check_participants(me, participants)
        self.me = me
        self.phase = P.RUNNING
        self.known: frozenset[int] = frozenset()

    def handle(self, event: Event) -> tuple[Effect, ...]:
        """Apply ``event``; return the effects to run.  :class:`PeerCommitError` (nothing
        changed) for an event the rules exclude."""
        if event is E.ALL_KNOWN:
            raise PeerCommitError("ALL_KNOWN is derived from received known sets: call receive_known")
        self.phase, self.known, effects = step(self.phase, self.known, self.me, self.participants, event)
        return effects

    def receive_known(self, received: Collection[int]) -> tuple[Effect, ...]:
        """A known set arrived (an ack).  :class:`pccl.ProtocolError` if it names a non-participant."""
        self.phase, self.known, effects = merge(self.phase, self.known, self.me, self.participants,
                                                frozenset(received))
        return effects

    def answer(self) -> Answer:
        return Answer(self.phase, self.known)

    @property
    def decided(self) -> bool:
        return self.phase in DECIDED

    def __repr__(self) -> str:
        return f"PeerCommit(me={self.me}, {self.phase.name}, known={sorted(self.known)})"


def outcome_of(answers: Mapping[int, Answer]) -> Verdict | None:
    """What some answers alone prove, without the master: an answer ``committed`` -> ``COMMIT``,
    an answer ``aborted`` -> ``ABORT``, else ``None``.  Sound for the master (rules 1-2): a
    committed one held every id, an aborted one either never was ready or heard an abort that
    was itself sound.  A participant asking the others takes less from them
    (:func:`learned_from_peer`).  Both at once is a split that already happened: :class:`PeerCommitError`.
    """
    committed = sorted(p for p, ans in answers.items() if ans.phase is P.COMMITTED)
    aborted = sorted(p for p, ans in answers.items() if ans.phase is P.ABORTED)
    if committed and aborted:
        raise PeerCommitError(f"op split: {committed} committed, {aborted} aborted")
    if committed:
        return Verdict.COMMIT
    if aborted:
        return Verdict.ABORT
    return None


def learned_from_peer(answer: Answer) -> Verdict | None:
    """What a participant in doubt may conclude from another participant's answer to its
    ``PEER_QUERY``, with or without a master: ``ABORT`` from an answer ``aborted``, nothing else.

    An aborted participant never was ready (so nobody can ever commit) or heard a sound abort.  A
    *committed* answer proves that every participant was ready, but it may come from a
    participant the master already declared dead and fenced (cut off from the master only, it
    still talks to its peers), while the master aborts the survivors on the ids it could see:
    adopting it would split the survivors (the model's walk shows it).  So peers can abort among
    themselves but not commit; the commit of an op in doubt is the master's.  An answer that
    reaches a participant which has decided meanwhile is stale: the shell drops it.
    """
    return Verdict.ABORT if answer.phase is P.ABORTED else None


def resolve(participants: Collection[int], answers: Mapping[int, Answer],
            dead: Collection[int] = (), ready: Collection[int] = ()) -> Verdict | None:
    """The master's rule for an op someone is in doubt about; ``None``: not decided yet.

    ``answers`` are the participants' answers to the query (each participant that answered is
    frozen); ``dead`` the participants the master declared dead (fenced: their outcome binds
    nobody); ``ready`` the participants the master knows were ready from a one-way report (fast
    commit's ``Done(ok)``, sent as its sender became ready: :mod:`pccl.protocol.master.peer_resolve`),
    which count as known in rule 4 (they are not frozen, so they do not count as answers).  In
    order:

    1. an answer ``COMMITTED`` -> ``COMMIT`` (it held every id: all were ready);
    2. an answer ``ABORTED`` (it failed, nacked, answered running, or heard ``ABORT``) -> ``ABORT``
       (some participant is never ready, or the verdict was already abort);
    3. a live participant has not answered -> ``None`` (wait for it, or for its death);
    4. the answers' known sets (and ``ready``) together cover every participant -> ``COMMIT``, else ``ABORT``: a
       dead participant whose readiness no live one heard of may have died running, and "a
       participant that dies mid-op aborts the op" (the fault model); nobody live can have
       committed without its id.

    Rules 1 and 2 together are a split that already happened: :class:`PeerCommitError`.  An
    answer from a non-participant, or naming one, is a :class:`pccl.ProtocolError`.
    """
    group = frozenset(participants)
    strangers = sorted(set(answers) - group) + sorted(set(dead) - group) + sorted(set(ready) - group)
    if strangers:
        raise ProtocolError(f"answers or deaths from {strangers}, not participants of {sorted(group)}")
    for peer, ans in answers.items():
        if not ans.known <= group:
            raise ProtocolError(f"peer {peer}'s answer names {sorted(ans.known - group)}, not participants")
    known_outcome = outcome_of(answers)
    if known_outcome is not None:
        return known_outcome
    if group - set(dead) - set(answers):
        return None
    union = frozenset(ready).union(*(ans.known for ans in answers.values()))
    return Verdict.COMMIT if union == group else Verdict.ABORT


def ack_rounds(n: int) -> int:
    """Rounds of :func:`ack_partners` after which every ready participant's id reached every
    other: ``ceil(log2 n)`` (0 for a single participant)."""
    if n < 1:
        raise InvalidArgument(f"an op has at least one participant, got {n}")
    return (n - 1).bit_length()


def ack_partners(position: int, n: int, rnd: int) -> tuple[int, int]:
    """The dissemination pattern (Hensgen, Finkel and Manber's barrier): in round ``rnd`` the
    participant at ring ``position`` sends its known set to position ``+ 2**rnd`` and hears from
    ``- 2**rnd`` (mod ``n``).  Returns ``(send_to, receive_from)`` positions."""
    if not 0 <= position < n:
        raise InvalidArgument(f"ring position {position} is not in 0..{n - 1}")
    if not 0 <= rnd < ack_rounds(n):
        raise InvalidArgument(f"ack round {rnd} is not in 0..{ack_rounds(n) - 1} for {n} participants")
    hop = 1 << rnd
    return (position + hop) % n, (position - hop) % n


def render_table(fmt: str = "rst") -> str:
    """:data:`TRANSITIONS` as an rst ``list-table`` (``fmt="rst"``) or a markdown table."""
    return transition_table.render(TRANSITIONS, Phase, Event, ("Phase", "Event", "Next phase", "Effects"), fmt)
