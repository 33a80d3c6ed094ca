"""The master's roster: every connection's record, by connection and by peer id, the accepted
members, and when each connection was last heard (sans-IO; the consensus machine,
:mod:`pccl.protocol.master.machine`, owns one).

Records.  One :class:`~pccl.protocol.master.peers.PeerRecord` per connection (``by_conn``);
a registered peer's id maps to its connection (``by_id``).  Ids are never reused
(``issued_ids``), so that "gone" stays unambiguous.

Members.  Every vote reads the accepted peers (all, and by group); rebuilding them per message
made each vote cost O(peers) several times over, so they are remembered until the machine says
the membership :meth:`~Roster.changed` (a peer came, went, registered or was accepted).

Liveness.  ``(last_heard, conn_id)`` of every time a connection was heard, a min-heap whose
entries are dropped once that connection has been heard since or is gone: its first valid entry
is the connection heard least recently (the machine's next deadline), found without a scan of
every peer.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable

from .peers import PeerRecord, PeerStatus

__all__ = ["Roster"]

_A = PeerStatus.ACCEPTED


class Roster:
    """The connections the master knows, and the indexes over them (see the module docstring)."""

    def __init__(self) -> None:
        self.by_conn: dict[int, PeerRecord] = {}
        self.by_id: dict[int, int] = {}  # peer_id -> conn_id
        self.issued_ids: set[int] = set()  # never reuse an id, so "gone" is unambiguous
        self._version = 0
        self._seen = -1
        self._accepted_all: list[PeerRecord] = []
        self._accepted_by_group: dict[int, list[PeerRecord]] = {}
        self._accepted_ids_by_group: dict[int, list[int]] = {}
        self._heard: list[tuple[float, int]] = []

    def connect(self, conn_id: int, observed_host: str, now: float) -> None:
        self.by_conn[conn_id] = PeerRecord(conn_id, observed_host, now)
        heapq.heappush(self._heard, (now, conn_id))
        self._version += 1

    def heard(self, peer: PeerRecord, now: float) -> None:
        """``peer`` was heard at ``now``: its deadline moves."""
        if peer.last_heard != now:
            peer.last_heard = now
            heapq.heappush(self._heard, (now, peer.conn_id))

    def remove(self, conn_id: int) -> PeerRecord:
        """Forget the connection's record (its peer id, if any, stays in ``by_id`` for the caller
        to drop)."""
        peer = self.by_conn.pop(conn_id)
        self._version += 1
        return peer

    def changed(self) -> None:
        """A peer registered or was accepted: the member index is rebuilt when next read."""
        self._version += 1

    def issue_id(self, previous: int, draw: Callable[[], int]) -> int:
        """A fresh peer id: ``previous`` (a peer registering again after a master restart keeps
        its id) unless it is 0, out of range or issued already, else ``draw()`` until one is new."""
        peer_id = previous if previous < 2**63 else 0
        while peer_id == 0 or peer_id in self.issued_ids:
            peer_id = draw()
        self.issued_ids.add(peer_id)
        return peer_id

    def least_recently_heard(self) -> float | None:
        """When the connection heard least recently was last heard (``None``: no connections)."""
        if not self.by_conn:
            return None
        heard = self._heard
        while True:  # drop the entries of peers heard since, or gone (every peer has one valid)
            at, conn_id = heard[0]
            peer = self.by_conn.get(conn_id)
            if peer is not None and peer.last_heard == at:
                return at
            heapq.heappop(heard)

    def peer(self, peer_id: int) -> PeerRecord:
        return self.by_conn[self.by_id[peer_id]]

    def accepted(self, group: int | None = None) -> list[PeerRecord]:
        """The accepted peers (of ``group``), in arrival order.  Shared: do not modify."""
        if self._seen != self._version:
            self._index_members()
        if group is None:
            return self._accepted_all
        return self._accepted_by_group.get(group, [])

    def accepted_groups(self) -> set[int]:
        if self._seen != self._version:
            self._index_members()
        return set(self._accepted_by_group)

    def member_ids(self, group: int) -> list[int]:
        """The accepted peers of ``group`` by id, in arrival order.  Shared: do not modify."""
        if self._seen != self._version:
            self._index_members()
        return self._accepted_ids_by_group.get(group, [])

    def world_sizes(self) -> Counter[int]:
        """group -> number of accepted peers (a scan of every connection)."""
        return Counter(p.group for p in self.by_conn.values() if p.status is _A)

    def _index_members(self) -> None:
        self._accepted_all = [p for p in self.by_conn.values() if p.status is _A]
        by_group: dict[int, list[PeerRecord]] = {}
        for p in self._accepted_all:
            by_group.setdefault(p.group, []).append(p)
        self._accepted_by_group = by_group
        self._accepted_ids_by_group = {g: [p.peer_id for p in ps] for g, ps in by_group.items()}
        self._seen = self._version
