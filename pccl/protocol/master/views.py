"""The master's read-only views (split out of :mod:`.machine`, whose ``MasterState`` inherits
them): what the shell's status page, the simulator's checkers and the tests read of the master's
state.  Nothing here changes it, except ``relay_forwarded`` and ``record_link``, which take
figures measured elsewhere."""

from __future__ import annotations

from .. import messages as m
from .collectives import CollectiveOps, OpInfo
from .mismatch import PhaseMismatches
from .optimize import Optimizer
from .paths import Paths, PathView, RelayView
from .peers import PeerInfo, PeerStatus, ReportedBytes
from .roster import Roster
from .rounds import Rounds
from .sync import SyncRoundInfo, SyncState

__all__ = ["MasterViews"]


class MasterViews:
    """The read-only views of :class:`pccl.protocol.master.machine.MasterState` (a mixin: it
    reads the state the machine keeps)."""

    _roster: Roster
    _reported: ReportedBytes
    _paths: Paths
    _optimizer: Optimizer
    _rings: dict[int, tuple[int, ...]]
    _stale_groups: set[int]
    _rounds: Rounds
    _mismatches: PhaseMismatches
    _collectives: CollectiveOps
    _sync_state: SyncState

    def peers(self) -> list[PeerInfo]:
        return [
            PeerInfo(p.conn_id, p.peer_id, p.group, p.status, p.topology_vote, p.round_scope is not None,
                     p.pending_vote, p.host, p.p2p_port)
            for p in self._roster.by_conn.values()
        ]

    def last_heard(self) -> dict[int, float]:
        """conn_id → when the master last heard from that connection.  Heartbeats move it, so
        unlike the other views it is not covered by ``generation``."""
        return {p.conn_id: p.last_heard for p in self._roster.by_conn.values()}

    def reports(self) -> dict[int, m.Heartbeat]:
        """conn_id → the last heartbeat of each connection that sent one (what the status page
        shows of the peer), and below, the run's reported payload totals.  Not covered by
        ``generation``, like ``last_heard``."""
        return {p.conn_id: p.report for p in self._roster.by_conn.values() if p.report is not None}

    def reported_bytes(self) -> tuple[int, int]:
        """(tx, rx): the payload bytes every connection's heartbeats reported, summed."""
        return self._reported.tx, self._reported.rx

    def peer_id_of(self, conn_id: int) -> int | None:
        p = self._roster.by_conn.get(conn_id)
        return (p.peer_id if p is not None and p.status is not PeerStatus.CONNECTED and p.status is not PeerStatus.RELAY
                else None)

    def paths(self) -> list[PathView]:
        """The paths peers reported (:mod:`pccl.protocol.master.paths`), by initiator and target."""
        return self._paths.paths()

    def relays(self) -> list[RelayView]:
        """The relays that serve the run, by id."""
        return self._paths.relays()

    def candidates_of(self, peer_id: int) -> tuple[m.Candidate, ...]:
        """The candidates ``peer_id`` registered (hosts resolved), ``()`` for an unknown peer."""
        conn = self._roster.by_id.get(peer_id)
        return self._roster.by_conn[conn].candidates if conn is not None else ()

    def relay_forwarded(self, stats: m.RelayStats) -> None:
        """What the master's own relay (``own_relay``) forwarded so far (the shell reports it)."""
        self._paths.own_relay_stats(stats)

    def path_counters(self) -> dict[str, int]:
        """Path attempts by outcome since the start: ``dial_back``, ``relayed``, ``unavailable``."""
        return dict(self._paths.counters)

    def conn_of(self, peer_id: int) -> int | None:
        return self._roster.by_id.get(peer_id)

    def rings(self) -> dict[int, tuple[int, ...]]:
        return dict(self._rings)

    def measured_links(self) -> dict[tuple[int, int], float]:
        """Bandwidth (bytes/s) of every measured directed link, by ``(sender, receiver)``."""
        return {k: e.bandwidth for k, e in self._optimizer.links.snapshot().items()}

    def record_link(self, sender: int, receiver: int, bandwidth: float, rtt: float) -> None:
        """Take a link's figure as if a probe had measured it (links measured elsewhere, a
        benchmark's known truth); kept, like a probe's, while both ends stay."""
        self._optimizer.links.record(sender, receiver, bandwidth, rtt)

    def probing_groups(self) -> frozenset[int]:
        """Groups whose optimise vote waits for probe reports."""
        return self._optimizer.probing_groups()

    def stale_groups(self) -> frozenset[int]:
        return frozenset(self._stale_groups)

    def rounds_in_progress(self) -> dict[int, tuple[int, ...]]:
        """scope → participants of each running round."""
        return self._rounds.in_progress()

    def round_reports(self) -> dict[int, frozenset[int]]:
        """scope → the participants of each running round that have reported."""
        return self._rounds.reports()

    def probes(self) -> dict[int, tuple[dict[int, tuple[int, ...]], frozenset[int]]]:
        """group → (member → the peers it was asked to probe, the members that reported), for
        each optimise vote past consensus."""
        return self._optimizer.probes()

    def mismatches_in_grace(self) -> frozenset[int]:
        """Groups in a phase mismatch whose grace period runs (ended when it is over)."""
        return self._mismatches.in_grace()

    @property
    def mismatch_grace(self) -> float:
        """How long a phase mismatch lasts before the master ends it."""
        return self._mismatches.grace


    def ops(self) -> list[OpInfo]:
        return self._collectives.views()

    def syncs(self) -> list[SyncRoundInfo]:
        return self._sync_state.syncs()

    def revision_of(self, group: int) -> int | None:
        """The revision ``group`` adopted at its last sync (``None`` before its first)."""
        return self._sync_state.revision_of(group)

    def lineage_of(self, group: int) -> m.Lineage | None:
        """The lineage of ``group`` after its last completed sync (``None`` before its first)."""
        return self._sync_state.lineage_of(group)

    def membership_of(self, group: int) -> m.Membership:
        sizes = self._roster.world_sizes()
        return m.Membership(
            world_size=sizes.get(group, 0),
            global_world_size=sum(sizes.values()),
            num_peer_groups=len(sizes),
            largest_peer_group_size=max(sizes.values(), default=0),
        )
