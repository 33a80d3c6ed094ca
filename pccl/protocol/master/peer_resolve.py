"""The master's side of completion agreed among peers: resolving one op (sans-IO).

With completion agreed among peers (docs/protocol.rst, "Design: completion agreed among peers";
the participant's machine is :mod:`pccl.protocol.peer_commit`) the participants of a fast-path
op commit on a full known set without the master's verdict.  The master then may no longer
abort an op the moment a participant dies before its ``Done``, as fast commit's master does
today (:mod:`.collectives`): the dead participant may have acked its readiness to the others,
and one of them may have committed already.  :class:`Resolution` is what the master does
instead, for one op: it folds in the one-way ``Done`` reports fast commit already sends, asks
the live participants for their state when it must (a death before ``Done``, a participant in
doubt, a stuck phase vote) and decides with :func:`pccl.protocol.peer_commit.resolve`.

:mod:`.collectives` runs one per op begun with ``CollectiveBegin.peer_commit`` (the messages
are ``CollectiveQuery``, ``CollectiveAnswer``, ``CollectiveAsk``);
``tests/property/peer_commit_world.py`` runs it as the master of the model's every interleaving,
with the one-way ``Done`` reports.

Rules
=====

*Inputs*, per op (its participants fixed when it opens):

``done(peer, ok=True)``
    fast commit's ``Done(ok)``: sent one-way when the peer becomes ready, before its acks.  The
    peer is ready; it is *not* frozen (it may still commit on a full known set).
``done(peer, ok=False)``
    ``Done(aborted)``: the peer never was ready and never will be (it nacks): nobody can
    commit, so the verdict is abort at once.
``ask(peer, answer)``
    a ready participant in doubt asks, with its answer (it is frozen).
``answer(peer, answer)``
    a participant's answer to the master's query (it is frozen; a running one became aborted).
``death(peer)``
    the master declared ``peer`` dead (heartbeat timeout, a kick): it is fenced.
``query_all()``
    the phase-mismatch machine asks the op's state (a member waits elsewhere).

*Decision*, in order, once there is none yet:

1. every participant reported ``Done(ok)`` -> commit (all were ready; nobody can have aborted:
   a ready participant aborts only on a nack or the master's abort, and a nack is a
   ``Done(aborted)``, which never follows ``Done(ok)``) — today's ``Complete`` rule.  (With the
   digest in the acks a ``Done(ok)`` does not prove equal parameters; the host's Begin checks
   do: a participant's Begin precedes its Done on one connection, so a disagreement aborts the
   op, as today, before the last ``Done(ok)``.  Such an abort needs no query: differing digests
   never merge, so no participant can hold a full set);
2. a ``Done(aborted)`` -> abort (a nack: nobody can commit);
3. while querying: :func:`~pccl.protocol.peer_commit.resolve` over the answers and the dead,
   with the ``Done(ok)`` ids counted as known (each proves its sender was ready).

*Querying* starts with the first ``ask``, a ``death`` of a participant that had not reported
``Done`` (it may have acked: the others must be asked what they know), or ``query_all``; it
queries every live participant that has not answered yet, once.  A participant that reported
``Done(ok)`` and then died needs no query: its readiness is known, and the live ones report
their own ``Done`` (or ask) in any case.

*Verdict*: sent once to every live participant that has not been told (a participant that
answered or asked waits for it; a ready one takes a ``COMMIT`` as its full set; the dead are
fenced and named with it).  A later ``ask`` or ``answer`` hears the same verdict again, and so
does nobody else.

*Bad input* is a :class:`pccl.ProtocolError` and changes nothing (the master kicks its sender,
PROTOCOL_ERROR; the op goes on with that participant's death): an input from a
non-participant, an answer naming one, a second ``Done``, an answer from a participant that was
never queried (it is not frozen: nothing it says may decide), and an ask in any phase but
``IN_DOUBT`` (a participant asks only in doubt).  So every answer the rule sees was asked for,
and the first ``committed`` or ``aborted`` one decides at once: :func:`resolve` never meets both
(a split, :class:`~pccl.protocol.peer_commit.PeerCommitError`).  Should it still (a pccl bug),
the master logs it and aborts the op rather than fail (:mod:`.collectives`).  (A ``Done(ok)`` may come with, or in the
model after, an answer ``aborted`` of its sender: it was ready, then heard a nack.)
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ...errors import ProtocolError
from .. import messages as m
from ..peer_commit import Answer, Phase, Verdict, resolve

__all__ = ["PHASES", "Resolution", "Send", "Word", "why_aborted"]

#: The rule of step 3 (``resolve``; a test may try another).
Rule = Callable[..., "Verdict | None"]


class Word(enum.Enum):
    QUERY = "query"
    VERDICT = "verdict"


class Send(NamedTuple):
    """A message the master sends: a query, or the verdict (with the fenced participants)."""

    word: Word
    to: frozenset[int]
    verdict: Verdict | None = None
    fenced: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Resolution:
    """One op at the master (see the module docstring).  Immutable: every input returns the next
    resolution and the messages to send, so a model can keep it in a hashable world."""

    participants: frozenset[int]
    ready: frozenset[int] = frozenset()  # reported Done(ok)
    nacked: frozenset[int] = frozenset()  # reported Done(aborted)
    answers: frozenset[tuple[int, Answer]] = frozenset()
    dead: frozenset[int] = frozenset()
    querying: bool = False
    queried: frozenset[int] = frozenset()
    verdict: Verdict | None = None
    told: frozenset[int] = frozenset()
    rule: Rule = field(default=resolve, compare=False)

    @classmethod
    def open(cls, participants: Collection[int], rule: Rule = resolve) -> Resolution:
        group = frozenset(participants)
        if not group or len(group) != len(participants):
            raise ProtocolError(f"an op's participants must be distinct peer ids, got {sorted(participants)}")
        return cls(group, rule=rule)

    @property
    def answer_map(self) -> dict[int, Answer]:
        return dict(self.answers)

    # --- inputs ---------------------------------------------------------------------------

    def done(self, peer: int, ok: bool) -> tuple[Resolution, tuple[Send, ...]]:
        _check(self, peer)
        if peer in self.ready or peer in self.nacked:
            raise ProtocolError(f"a second Done from peer {peer}")
        nxt = replace(self, ready=self.ready | {peer}) if ok else replace(self, nacked=self.nacked | {peer})
        return _decide(nxt)

    def ask(self, peer: int, answer: Answer) -> tuple[Resolution, tuple[Send, ...]]:
        return _answered(self, peer, answer, asked=True)

    def answer(self, peer: int, answer: Answer) -> tuple[Resolution, tuple[Send, ...]]:
        return _answered(self, peer, answer, asked=False)

    def death(self, peer: int) -> tuple[Resolution, tuple[Send, ...]]:
        _check(self, peer)
        nxt = replace(self, dead=self.dead | {peer})
        if nxt.verdict is None and peer not in self.ready and peer not in self.nacked:
            return _query(nxt)  # it may have acked before it died: ask the others what they know
        return _decide(nxt)

    def query_all(self) -> tuple[Resolution, tuple[Send, ...]]:
        if self.verdict is not None:
            return self, ()
        return _query(self)


# --- the rules ----------------------------------------------------------------------------

def _check(res: Resolution, peer: int) -> None:
    if peer not in res.participants:
        raise ProtocolError(f"peer {peer} is not a participant of the op over {sorted(res.participants)}")


def _answered(res: Resolution, peer: int, answer: Answer, asked: bool) -> tuple[Resolution, tuple[Send, ...]]:
    """An ask or an answer: its sender is frozen and waits for the verdict."""
    _check(res, peer)
    if not answer.known <= res.participants:
        raise ProtocolError(f"peer {peer}'s answer names {sorted(answer.known - res.participants)}, "
                            "not participants")
    if asked and answer.phase is not Phase.IN_DOUBT:
        raise ProtocolError(f"peer {peer} asks as {answer.phase.value}: a participant asks only in doubt")
    if not asked and peer not in res.queried:
        raise ProtocolError(f"peer {peer} answers a query it was never sent")
    if res.verdict is not None:  # it waits for the verdict: tell it (again)
        return (replace(res, told=res.told | {peer}),
                (Send(Word.VERDICT, frozenset({peer}), res.verdict, res.dead),))
    answers = res.answer_map
    answers[peer] = answer
    nxt = replace(res, answers=frozenset(answers.items()))
    if asked or res.querying:
        return _query(nxt)
    return _decide(nxt)


def _query(res: Resolution) -> tuple[Resolution, tuple[Send, ...]]:
    """Query every live participant not answered or queried yet, then decide."""
    answered = frozenset(res.answer_map)
    ask = res.participants - res.dead - answered - res.queried
    nxt = replace(res, querying=True, queried=res.queried | ask)
    later, sends = _decide(nxt)
    if ask and later.verdict is None:
        return later, (Send(Word.QUERY, ask), *sends)
    return later, sends


def _decide(res: Resolution) -> tuple[Resolution, tuple[Send, ...]]:
    """The module docstring's decision, and the verdict to every live participant not told."""
    if res.verdict is not None:
        return res, ()
    verdict: Verdict | None
    if res.ready == res.participants:
        verdict = Verdict.COMMIT
    elif res.nacked:
        verdict = Verdict.ABORT
    elif res.querying:
        verdict = res.rule(res.participants, res.answer_map, res.dead, ready=res.ready)
    else:
        verdict = None
    if verdict is None:
        return res, ()
    tell = res.participants - res.dead - res.told
    return (replace(res, verdict=verdict, told=res.told | tell),
            (Send(Word.VERDICT, tell, verdict, res.dead),) if tell else ())


#: An answer's phase on the wire and in :mod:`pccl.protocol.peer_commit`.
PHASES = {m.CommitPhase.RUNNING: Phase.RUNNING, m.CommitPhase.READY: Phase.READY,
          m.CommitPhase.IN_DOUBT: Phase.IN_DOUBT, m.CommitPhase.COMMITTED: Phase.COMMITTED,
          m.CommitPhase.ABORTED: Phase.ABORTED}


def why_aborted(res: Resolution) -> str:
    """The detail of a resolution's abort, as the callers' ``CollectiveAborted`` will say it."""
    aborted = sorted(pid for pid, ans in res.answers if ans.phase is Phase.ABORTED)
    if aborted:
        return f"peer {aborted[0]:x} had aborted"
    unknown = sorted(pid for pid in res.dead if pid not in res.ready)
    if unknown:
        return f"participant {unknown[0]:x} left before finishing"
    running = sorted(pid for pid, ans in res.answers if ans.phase is Phase.RUNNING)
    return f"participant {running[0]:x} was not ready" if running else "a participant failed"
