"""One begun op's side of completion agreed among peers (``Config.peer_commit``): the
participant's machine over ring positions and its acks' counts per link.  The driver that runs
it is :mod:`pccl._peer.peer_commit_driver`; the op keeps it (``OpAttempt.agreement``)."""

from __future__ import annotations

import dataclasses

import trio

from .host import Counters
from ..protocol import messages as m
from ..protocol.peer_ack import ack_seq, op_digest
from ..protocol.peer_commit import Effect as X
from ..protocol.peer_commit import Event as E
from ..protocol.peer_commit import Phase, PeerCommit

__all__ = ["Agreement"]


@dataclasses.dataclass(eq=False)
class Agreement:
    """One begun op's side of the agreement: its machine over ring positions, and its acks."""

    ring: tuple[int, ...]
    position: int
    digest: bytes
    machine: PeerCommit
    #: The data-frame seq of the op's acks (:func:`~pccl.protocol.peer_ack.ack_seq`, a hash:
    #: worked out once per op, not per ack sent, read and retired, on any link).
    seq: int = 0
    #: Per ack target (ring position): acks sent to it (the next one's step).
    sent: dict[int, int] = dataclasses.field(default_factory=dict)
    #: Per ack target: the positions it knows to be ready, as far as this participant can tell
    #: (what it was sent, and what its own acks named): a growth it knows already is not sent.
    told: dict[int, frozenset[int]] = dataclasses.field(default_factory=dict)
    #: Per ack source (ring position): acks read from it (the next one's step).
    received: dict[int, int] = dataclasses.field(default_factory=dict)
    #: The wait for the next ack from any link (its deadline: ``peer_timeout``): cancelled by the
    #: master's word (``stop``, which also sets ``stopped``: a wait it ends is no silence).
    scope: trio.CancelScope | None = None
    stopped: bool = False
    #: The master was lost while this op waited (ready, or in doubt: then the next master
    #: hears of it, :meth:`pccl._peer.peer_commit_driver.PeerCommits.undecided`), and the phase
    #: that report gave.
    master_lost: bool = False
    reported: Phase | None = None
    #: Committed on a full set, the call's result not yet returned (the driver does that once
    #: its ack readers stopped, with no checkpoint before the call returns).
    result_due: bool = False

    @classmethod
    def of(cls, ring: tuple[int, ...], me: int, round_id: int, seq: int, init: m.CollectiveInit) -> Agreement:
        position = ring.index(me)
        return cls(ring, position, op_digest(round_id, seq, init), PeerCommit(position, range(len(ring))),
                   ack_seq(seq))

    def news(self, target: int) -> bool:
        """Whether the known set holds an id that ``target`` (a ring position) is not known to
        know: neither told it, nor named it in an ack, nor its own."""
        return bool(self.machine.known - self.told.get(target, frozenset()) - {target})

    def tell(self, target: int, known: frozenset[int]) -> None:
        """``target`` knows ``known`` now (it was sent them, or its ack named them)."""
        self.told[target] = self.told.get(target, frozenset()) | known

    def ids(self, positions: frozenset[int]) -> tuple[int, ...]:
        return tuple(sorted(self.ring[p] for p in positions))

    def doubt(self, event: E, counters: Counters) -> tuple[X, ...]:
        """Feed ``event`` (``PEER_LOST``, ``QUERY``); a ready participant falls in doubt (counted)."""
        was_ready = self.machine.phase is Phase.READY
        effects = self.machine.handle(event)
        if was_ready and self.machine.phase is Phase.IN_DOUBT:
            counters.peer_commit_doubts += 1
        return effects

    def stop(self) -> None:
        self.stopped = True
        if self.scope is not None:
            self.scope.cancel()
