"""The ring links the collectives run on: built once per topology round, and the seqs that
ended, kept per master epoch."""

from __future__ import annotations

import trio

from ..collectives.links import RingLinks, SeqRegistry
from ..errors import PeerDisconnected
from ..net.framed import FramedConnection
from ..protocol.algorithms import link_partner_positions
from .ring_connections import P2PLinks

__all__ = ["RingLinkCache"]


class RingLinkCache:
    """The :class:`~pccl.collectives.links.RingLinks` of the current round (one ``Inbox`` per
    connection, shared by every op of the round) and the :attr:`registry` of seqs that ended on
    this peer (late frames of those are discarded).

    A new master numbers its ops from 1 again: :meth:`follow` starts a new registry (and drops
    the links, which hold the old one) when the master epoch changes, so that the seqs that ended
    under the old master do not make the new one's frames look late.
    """

    def __init__(self, epoch: int) -> None:
        self.registry = SeqRegistry()
        self._epoch = epoch
        self._lock = trio.Lock()
        self._round: P2PLinks | None = None
        self._links: RingLinks | None = None

    def follow(self, epoch: int) -> None:
        """The master epoch an op is about to start in (see the class docstring)."""
        if epoch != self._epoch:
            self._epoch = epoch
            if self._links is not None:
                self._links.drop_kept(f"a new master epoch ({epoch})")
            self.registry = SeqRegistry()
            self._round = None
            self._links = None

    @property
    def kept_bytes(self) -> int:
        """Payload bytes the current links keep in memory for ops not begun here (0 before any)."""
        return 0 if self._links is None else self._links.kept_bytes

    async def links(self, p2p: P2PLinks) -> RingLinks:
        """The ring links of ``p2p``'s round, built on first use in the round.

        Raises ``PeerDisconnected`` if the connection to the ring successor is missing; waits
        for the predecessor's connections (cancellable).
        """
        if self._round is p2p and self._links is not None:
            return self._links  # the common case: no schedule point (the ring has plenty)
        async with self._lock:
            if self._round is not p2p or self._links is None:
                outgoing = p2p.to_successor()
                if not outgoing:
                    raise PeerDisconnected(f"no connection to ring successor {p2p.successor:x} in round {p2p.round}")
                incoming = await p2p.from_predecessor()
                ring = p2p.ring
                partners: dict[int, FramedConnection] = {}
                positions = link_partner_positions(ring.index(p2p.me), len(ring), p2p.algorithm, p2p.sites)
                if positions:
                    by_id = await p2p.partner_links(tuple(ring[p] for p in positions))
                    partners = {p: by_id[ring[p]] for p in positions}
                if self._links is not None:
                    self._links.drop_kept(f"a new topology round ({p2p.round})")
                self._links = RingLinks(outgoing, incoming, registry=self.registry, partners=partners,
                                        algorithm=p2p.algorithm, sites=p2p.sites)
                self._round = p2p
            return self._links
