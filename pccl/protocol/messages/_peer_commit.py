"""Messages of completion agreed among peers (tags 58–60, in the collectives range): a ready
participant in doubt asks the master, the master queries the op's participants, they answer.

Import them from :mod:`pccl.protocol.messages`, which re-exports everything.  The design is
docs/protocol.rst, "Design: completion agreed among peers"; the master's side is
:mod:`pccl.protocol.master.peer_resolve`, run per op by :mod:`pccl.protocol.master.collectives`
for ops begun with ``CollectiveBegin.peer_commit``.  The verdict is the existing
``CollectiveComplete`` / ``CollectiveAbort``.
"""

from __future__ import annotations

import enum

import msgspec

from ._base import U32, U64, Message


class CommitPhase(enum.IntEnum):
    """A participant's phase of an op as it answers (:class:`pccl.protocol.peer_commit.Phase`)."""

    RUNNING = 0
    READY = 1
    IN_DOUBT = 2
    COMMITTED = 3
    ABORTED = 4


class CollectiveAsk(Message, tag=58):
    """Participant → master: this ready participant of op ``seq`` is in doubt (it lost a link,
    or heard that a participant died) and waits for the verdict; ``phase`` and ``known`` (the
    peer ids it knows to be ready) are its answer, frozen from now on."""

    tag: U64
    seq: U64
    phase: U32
    known: tuple[U64, ...] = ()
    #: The ``Welcome.instance`` of the master the op began under, when that is a master before
    #: a restart (0: this master's op): it knows the op from the participants' reports
    #: (``Register.undecided``).
    instance: U64 = 0


class CollectiveQuery(Message, tag=59):
    """Master → participant: answer ``CollectiveAnswer`` with your state of op ``seq`` (a
    participant died before its ``Done``, or another is in doubt).  A participant that is not
    ready yet (running, or not begun) is frozen by the query into aborted and answers
    ``ABORTED``: it will never be ready (it aborts the op; if it had not begun it, its Begin of
    it hears the abort)."""

    tag: U64
    seq: U64
    #: As in ``CollectiveAsk``: the op of a master before a restart (0: this master's).
    instance: U64 = 0


class CollectiveAnswer(Message, tag=60):
    """Participant → master: its answer to ``CollectiveQuery``, frozen from now on: a ready one
    (``READY``, ``IN_DOUBT``) waits for the verdict; ``COMMITTED`` and ``ABORTED`` are final.
    (``RUNNING`` is no answer a query gets: the query freezes a running participant into
    ``ABORTED``.)"""

    tag: U64
    seq: U64
    phase: U32
    known: tuple[U64, ...] = ()
    #: As in ``CollectiveQuery`` (the query's own instance, echoed).
    instance: U64 = 0


class UndecidedOp(msgspec.Struct, frozen=True, array_like=True):
    """A peer-agreed op this peer is ready for and has no outcome of, as it reports it when it
    registers with a restarted master (``Register.undecided``): the op's master (``instance``,
    that master's ``Welcome.instance``), ``tag``, ``seq``, its ``participants`` (peer ids, the
    ring), and this participant's ``phase`` (``READY`` or ``IN_DOUBT``: then the report is its
    ask) with its known set (peer ids)."""

    instance: U64
    tag: U64
    seq: U64
    participants: tuple[U64, ...]
    phase: U32
    known: tuple[U64, ...] = ()


PEER_COMMIT_MESSAGES: tuple[type[Message], ...] = (CollectiveAsk, CollectiveQuery, CollectiveAnswer)
