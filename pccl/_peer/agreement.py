"""One begun op's side of completion agreed among peers (``Config.peer_commit``): the
participant's machine over ring positions and the count of its acks.  The driver that runs it
is :mod:`pccl._peer.peer_commit_driver`; the op keeps it (``OpAttempt.agreement``)."""

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
    #: worked out once per op, not per ack sent, read and retired).
    seq: int = 0
    sent: int = 0  # acks sent (the next one's step)
    #: The positions the last ack sent named: a growth by the successor's own id alone (which
    #: comes last round the ring) tells it nothing, and is not sent.
    told: frozenset[int] = frozenset()
    received: int = 0  # acks read from the predecessor
    #: The ack read in progress (its deadline: ``peer_timeout``): cancelled by the master's word
    #: (``stop``, which also sets ``stopped``: a read it ends is no silence).
    scope: trio.CancelScope | None = None
    stopped: bool = False
    master_lost: bool = False

    @classmethod
    def of(cls, ring: tuple[int, ...], me: int, round_id: int, seq: int, init: m.CollectiveInit) -> Agreement:
        position = ring.index(me)
        return cls(ring, position, op_digest(round_id, seq, init), PeerCommit(position, range(len(ring))),
                   ack_seq(seq))

    def news(self) -> bool:
        """Whether the known set holds an id the successor has not been told, besides its own."""
        successor = (self.position + 1) % len(self.ring)
        return bool(self.machine.known - self.told - {successor})

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
