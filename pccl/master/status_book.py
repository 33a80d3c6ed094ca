"""What the master's status page shows beside the machine's own views: the recent events, the
run's counters and each group's last syncs (cheap bookkeeping in the Trio shell,
:mod:`pccl.master.server`, from the facts the machine reports and the ends of connections).

Peers are named as the shell knows their connection (peer id and group once it registered); a
connection that never registered is no peer of the run and leaves no event here (its refusal is
logged, rate-limited, by the admission code).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from ..protocol import status as st
from ..protocol.codec import MAX_DETAIL, clip_text
from ..protocol.master import machine as ms

__all__ = ["StatusBook", "STATUS_EVENTS"]

#: Lines kept in the status page's recent-events list.
STATUS_EVENTS = 200


class StatusBook:
    """The status page's events and counters; ``clock`` is the master's (the events' times)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.events: collections.deque[st.StatusEvent] = collections.deque(maxlen=STATUS_EVENTS)
        self.ops_completed = 0
        self.ops_aborted = 0
        self.syncs_completed = 0
        self.joins = 0
        self.removals: collections.Counter[str] = collections.Counter()
        #: group -> (last sync, last sync that moved bytes)
        self.last_syncs: dict[int, tuple[st.SyncRecord | None, st.SyncRecord | None]] = {}

    def event(self, kind: str, peer_id: int | None, group: int | None, detail: str) -> None:
        self.events.appendleft(st.StatusEvent(self.clock(), kind, peer_id, group, detail))

    def op_ended(self, fact: ms.OpEnded) -> None:
        if fact.aborted:
            self.ops_aborted += 1
            self.event("abort", fact.peer_id, fact.group, f"collective tag {fact.tag} seq {fact.seq} aborted")
        else:
            self.ops_completed += 1

    def sync_ended(self, fact: ms.SyncEnded) -> None:
        self.syncs_completed += 1
        record = st.SyncRecord(fact.revision, fact.planned_bytes, self.clock())
        previous_transfer = self.last_syncs.get(fact.group, (None, None))[1]
        self.last_syncs[fact.group] = (record, record if record.nbytes else previous_transfer)

    def joined(self, peer_id: int, group: int, address: str, rejoined: bool) -> None:
        self.joins += 1
        if rejoined:
            self.event("rejoin", peer_id, group, f"registered again from {address} after a master restart, "
                                                 "keeping its id")
        else:
            self.event("join", peer_id, group, f"registered from {address}")

    def accepted(self, peer_id: int | None, group: int, world_size: int) -> None:
        self.event("accept", peer_id, group, f"accepted; world size {world_size}")

    def removed(self, peer_id: int, group: int, kind: str, reason: str, detail: str) -> None:
        """A registered peer's connection ended: ``kind`` "kick", "left" or "lost"."""
        self.removals[reason] += 1
        self.event(kind, peer_id, group, f"{reason}: {clip_text(detail, MAX_DETAIL)}" if kind == "kick" else detail)

    def counters(self, tx_bytes: int, rx_bytes: int) -> st.RunCounters:
        """The running totals, with the payload bytes the peers' heartbeats reported."""
        return st.RunCounters(self.ops_completed, self.ops_aborted, self.syncs_completed, self.joins,
                              dict(self.removals), tx_bytes, rx_bytes)
