"""The ring connections of one topology round (what the all-reduce runs on)."""

from __future__ import annotations

import trio

from ..errors import PeerDisconnected
from ..net.framed import FramedConnection
from ..protocol.algorithms import AllReduceAlgorithm
from ..protocol.ring import ring_predecessor, ring_successor

__all__ = ["P2PLinks"]


class P2PLinks:
    """The ring connections of one topology round.

    ``ring`` is this peer's group ring for the round.  ``outgoing[successor]`` holds the
    ``lanes`` connections this peer dialled (lane ``j`` at index ``j``); ``incoming[predecessor]``
    maps lane index to the connections the predecessor dialled to this peer.  With two peers the
    successor is also the predecessor: the two directions use different connections.  Nobody
    reads these connections between collectives; the all-reduce owns them while it runs.
    """

    def __init__(self, round_id: int, ring: tuple[int, ...], me: int, lanes: int, *,
                 algorithm: AllReduceAlgorithm | None = None, sites: tuple[int, ...] = ()) -> None:
        self.round = round_id
        #: The site of each ring position as the master measured it (``ConnectToPeers.sites``;
        #: ``()``: unknown).
        self.sites = sites
        #: The all-reduce algorithm ``Config.all_reduce_algorithm`` forces (``None``: auto): with
        #: the sites, which partner links the round has
        #: (:func:`~pccl.protocol.algorithms.link_partner_positions`).
        self.algorithm = algorithm
        self.ring = ring
        self.me = me
        self.lanes = lanes
        self.outgoing: dict[int, tuple[FramedConnection, ...]] = {}
        self.incoming: dict[int, dict[int, FramedConnection]] = {}
        #: The round's partner links (halving-doubling), by the partner's peer id: dialled by
        #: the lower ring position of each pair, carrying data both ways.
        self.partners: dict[int, FramedConnection] = {}
        self.closed = False
        self._changed = trio.Event()

    @property
    def successor(self) -> int:
        return ring_successor(self.ring, self.me)

    @property
    def predecessor(self) -> int:
        return ring_predecessor(self.ring, self.me)

    def connections(self) -> list[FramedConnection]:
        out = [c for lanes in self.outgoing.values() for c in lanes]
        return out + [c for lanes in self.incoming.values() for c in lanes.values()] + list(self.partners.values())

    @property
    def torn(self) -> bool:
        """Whether a connection of the round is unusable on this side: a frame cut mid-way here
        (a cancelled send or payload receive aborts its connection), or one that failed.  No op
        may begin on such a round: its ring needs a re-wire (the master is told:
        ``CollectiveWithdraw.torn``).  The other end of a cut learns of it only when it reads."""
        return any(conn.broken or conn.frames.closed for conn in self.connections())

    def bytes_moved(self) -> int:
        """Bytes sent and received so far on this round's connections (the all-reduce's
        watchdog compares it over time)."""
        total = 0
        for conn in self.connections():
            counters = conn.frames.counters  # live counters: no statistics() snapshot per look
            total += counters["bytes_sent"] + counters["bytes_received"]
        return total

    def to_successor(self) -> tuple[FramedConnection, ...]:
        """The lanes to the successor (empty when alone or not connected)."""
        return self.outgoing.get(self.successor, ())

    def take_outgoing(self, peer_id: int, lanes: int) -> list[FramedConnection | None]:
        """The lanes to ``peer_id`` that may carry on into a round with ``lanes`` lanes (its
        successor too): lane ``j`` at index ``j`` if it is at rest, else ``None``.  The
        connections taken leave these links (:meth:`close` no longer aborts them); the caller
        owns them.  Empty when this round had no lanes to ``peer_id`` or another lane count."""
        current = self.outgoing.get(peer_id, ())
        if self.lanes != lanes or len(current) != lanes or self.closed:
            return []
        del self.outgoing[peer_id]
        kept: list[FramedConnection | None] = []
        for conn in current:
            if conn.at_rest:
                kept.append(conn)
            else:
                conn.abort()
                kept.append(None)
        return kept

    def take_incoming(self, peer_id: int, lanes: int) -> dict[int, FramedConnection]:
        """The lanes from ``peer_id`` at rest, by lane, for a round with ``lanes`` lanes and the
        same predecessor (see :meth:`take_outgoing`); lanes it never connected stay missing."""
        current = self.incoming.get(peer_id, {})
        if self.lanes != lanes or not current or self.closed:
            return {}
        del self.incoming[peer_id]
        kept: dict[int, FramedConnection] = {}
        for lane, conn in current.items():
            if conn.at_rest:
                kept[lane] = conn
            else:
                conn.abort()
        return kept

    def add_outgoing(self, peer_id: int, lanes: tuple[FramedConnection, ...]) -> None:
        """The lanes this peer dialled to ``peer_id`` are connected."""
        self.outgoing[peer_id] = lanes
        self._notify()

    def add_incoming(self, peer_id: int, lane: int, conn: FramedConnection) -> None:
        """``peer_id`` dialled lane ``lane`` to this peer (replacing an earlier dial of it)."""
        lanes = self.incoming.setdefault(peer_id, {})
        old = lanes.pop(lane, None)
        if old is not None:
            old.abort()
        lanes[lane] = conn
        self._notify()

    def add_partner(self, peer_id: int, conn: FramedConnection) -> None:
        """The partner link with ``peer_id`` (replacing an earlier one)."""
        old = self.partners.pop(peer_id, None)
        if old is not None and old is not conn:
            old.abort()
        self.partners[peer_id] = conn
        self._notify()

    def remove_partner(self, peer_id: int, conn: FramedConnection) -> None:
        """Forget the partner link with ``peer_id`` if it is still ``conn``."""
        if self.partners.get(peer_id) is conn:
            del self.partners[peer_id]

    async def partner_links(self, peer_ids: tuple[int, ...]) -> dict[int, FramedConnection]:
        """The partner links with ``peer_ids``, waiting for handshakes still running (as
        :meth:`incoming_from`)."""
        while not all(p in self.partners for p in peer_ids):
            if self.closed:
                raise PeerDisconnected(f"the ring connections of round {self.round} are closed")
            await self._changed.wait()
        return {p: self.partners[p] for p in peer_ids}

    def remove_incoming(self, peer_id: int, lane: int, conn: FramedConnection) -> None:
        """Forget lane ``lane`` from ``peer_id`` if it is still ``conn``."""
        lanes = self.incoming.get(peer_id, {})
        if lanes.get(lane) is conn:
            del lanes[lane]

    async def from_predecessor(self) -> tuple[FramedConnection, ...]:
        """The predecessor's lanes to this peer, in lane order (see :meth:`incoming_from`)."""
        return await self.incoming_from(self.predecessor)

    async def incoming_from(self, peer_id: int) -> tuple[FramedConnection, ...]:
        """The ``lanes`` connections ``peer_id`` dialled to this peer in this round, waiting for
        handshakes still running.  ``PeerDisconnected`` once the round's links are closed.
        Cancellation (the collective's abort or timeout) just stops waiting."""
        while len(self.incoming.get(peer_id, ())) < self.lanes:
            if self.closed:
                raise PeerDisconnected(f"the ring connections of round {self.round} are closed")
            await self._changed.wait()
        lanes = self.incoming[peer_id]
        return tuple(lanes[j] for j in range(self.lanes))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def close(self) -> None:
        for conn in self.connections():
            conn.abort()
        self.outgoing.clear()
        self.incoming.clear()
        self.partners.clear()
        self.closed = True
        self._notify()
