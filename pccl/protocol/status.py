"""The run's status as one plain dict: what ``/status.json`` serves and the page renders.

Pure (sans-IO, like the rest of :mod:`pccl.protocol`): :func:`snapshot` reads the master's
machine through its read-only views plus what the Trio shell records beside it (the peers'
reports from their heartbeats, the recent events, running counters) and returns JSON-ready
data.  It never changes the machine, so the status server can call it whenever a request
comes, without waiting for anything the master's loop holds.

Schema 1 (``"schema": 1``; a field's meaning never changes within a schema number, fields may
be added).  Peer ids are 16-digit hex strings (JSON numbers lose precision above 2**53);
durations are seconds; ages count back from the moment of the snapshot.

* ``master``: ``address``, ``instance`` (hex), ``uptime_s``, ``token_required``, ``tls``.
* ``groups``: one per peer group with an accepted or pending member, in group order:
  ``group``, ``world_size``, ``ring`` (peer ids in ring order; empty before the first round),
  ``ring_stale`` (a member left or an op aborted since it was built), ``revision`` (adopted at
  the group's last sync, or null), ``lineage`` (hex id of the group's lineage, or null),
  ``last_sync`` (``revision``, ``bytes``: the bytes the master
  planned for its receivers to fetch, ``age_s``) or null, ``last_transfer`` (the same for the
  last sync that moved any bytes: in a steady run most syncs move none) or null, ``sync_running``,
  ``edges`` (ring edges ``from`` → ``to`` with ``bandwidth_bps``: the link's figure from
  ``optimize_topology``'s probes, null until measured or when its probe failed),
  ``collectives`` (``tag``, ``seq`` or null, ``state`` "voting"/"running", ``voters``,
  ``participants``, ``done``), ``peers`` (accepted, ring order) and ``pending`` (registered).
* each peer: ``peer_id``, ``short_id`` (first 6 hex digits), ``address`` (observed host and
  advertised p2p port), ``state`` ("accepted"/"registered"), ``activity`` (what the master knows
  it waits in: "idle", "topology vote", "topology round", "collective", "sync", "pending query"),
  ``ring_position`` (0-based, or null), ``heartbeat_age_s``, ``revision`` (from its last sync,
  null before one), ``last_sync`` (``revision``, ``tx_bytes``, ``rx_bytes``) or null,
  ``tx_bytes``/``rx_bytes`` (its running payload totals), as last reported by its heartbeat;
  ``observed_host`` (the source address the master sees), ``advertised`` (its advertised
  endpoints as ``"kind=host:port"``), ``local`` (its interface candidates, ``host`` strings),
  ``reachable`` (true once some peer's connections to it go direct, false while every reported
  path to it is dialled back or relayed, null before any is reported) and ``paths`` (the paths
  of its own connections to others: ``to`` (peer id), ``port`` ("p2p", "shared_state",
  "benchmark"), ``path`` ("direct", "reversed", "relayed"), ``via``), in ``to`` order.
* ``relays``: ``relay_id``, ``address`` (empty: the master's own, ``pccl master --relay``),
  ``own``, ``pairs_assigned`` (rendezvous the master sent there), ``pairs`` (spliced now),
  ``waiting`` (joins without their partner yet), ``forwarded_bytes``, as last reported.
* ``paths``: counts of reported paths by ``direct``/``reversed``/``relayed``.
* ``connections``: ``total``, ``unregistered`` (handshake done, no ``Register`` yet), ``relays``.
* ``votes_in_progress``: counts of peers with a ``topology`` vote standing, ``collective``
  ops voting or running, groups in a ``sync``, peers in a ``pending_query``; ``rounds``: topology
  rounds running.
* ``counters``: running totals since the master started: ``ops_completed``, ``ops_aborted``,
  ``syncs_completed``, ``joins``, ``removals`` (by reason: a ``KickReason`` name,
  ``CONNECTION_LOST`` or ``LEFT``), ``reported_tx_bytes``/``reported_rx_bytes`` (payload bytes the
  peers reported, summed over every connection).
* ``events``: newest first, at most the shell's bound: ``age_s``, ``kind`` ("join", "rejoin",
  "accept", "kick", "lost", "left", "abort"), ``peer_id`` (or null), ``group`` (or null),
  ``detail``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .master import machine as ms
from . import messages as m
from .paths import CandidateOrigin, describe_port, format_host_port

__all__ = ["SCHEMA", "PeerReport", "StatusEvent", "RunCounters", "snapshot", "short_id", "peer_hex"]

SCHEMA = 1


@dataclasses.dataclass(frozen=True)
class PeerReport:
    """What a peer's last heartbeat reported (see ``messages.Heartbeat``)."""

    synced: bool
    revision: int
    sync_tx_bytes: int
    sync_rx_bytes: int
    tx_bytes: int
    rx_bytes: int

    @classmethod
    def of(cls, heartbeat: m.Heartbeat) -> PeerReport:
        return cls(heartbeat.synced, heartbeat.revision, heartbeat.sync_tx_bytes, heartbeat.sync_rx_bytes,
                   heartbeat.tx_bytes, heartbeat.rx_bytes)


@dataclasses.dataclass(frozen=True)
class StatusEvent:
    """One line of the recent-events list; ``at`` is on the master's clock."""

    at: float
    kind: str
    peer_id: int | None
    group: int | None
    detail: str


@dataclasses.dataclass(frozen=True)
class SyncRecord:
    """A group's completed sync as the master saw it: the revision adopted, the bytes its plans
    had the receivers fetch (a re-plan after a failed source counts the moved pieces again),
    and when it completed (the master's clock)."""

    revision: int
    nbytes: int
    at: float


@dataclasses.dataclass(frozen=True)
class RunCounters:
    ops_completed: int = 0
    ops_aborted: int = 0
    syncs_completed: int = 0
    joins: int = 0
    removals: Mapping[str, int] = dataclasses.field(default_factory=dict)
    reported_tx_bytes: int = 0
    reported_rx_bytes: int = 0


def peer_hex(peer_id: int) -> str:
    return f"{peer_id:016x}"


def short_id(peer_id: int) -> str:
    return peer_hex(peer_id)[:6]


def _activity(peer: ms.PeerInfo, in_op: bool, syncing: bool) -> str:
    if peer.in_round:
        return "topology round"
    if peer.topology_vote is not None:
        return "topology vote"
    if syncing:
        return "sync"
    if in_op:
        return "collective"
    if peer.pending_vote:
        return "pending query"
    return "idle"


def _lineage_hex(lineage: m.Lineage | None) -> str | None:
    return None if lineage is None else lineage.id.hex()


def _bits(bandwidth: float | None) -> float | None:
    """A measured link's bits/s; None when never measured or when its probe failed (0)."""
    return bandwidth * 8 if bandwidth else None


def snapshot(
    state: ms.MasterState,
    *,
    now: float,
    started_at: float,
    address: str,
    reports: Mapping[int, PeerReport],
    events: Iterable[StatusEvent],
    counters: RunCounters,
    syncs: Mapping[int, tuple[SyncRecord | None, SyncRecord | None]] | None = None,
    token_required: bool = False,
    tls: bool = False,
) -> dict[str, Any]:
    """The status of the run held by ``state`` at time ``now`` (see the module docstring).

    ``reports`` maps connection ids to the peer's last report; ``events`` are newest first;
    ``syncs`` maps groups to their (last sync, last sync that moved bytes).
    """
    peers = state.peers()
    last_heard = state.last_heard()
    ops = state.ops()
    running_syncs = {s.group: s for s in state.syncs()}
    rings = state.rings()
    links = state.measured_links()  # bytes/s by (sender, receiver), from optimize_topology's probes
    stale = state.stale_groups()
    in_ops = {pid for op in ops for pid in (op.voters | set(op.participants))}
    paths = state.paths()
    paths_from: dict[int, list[dict[str, Any]]] = {}
    reached: dict[int, bool] = {}
    for path in paths:
        paths_from.setdefault(path.initiator, []).append(
            {"to": peer_hex(path.target), "port": describe_port(path.port), "path": path.kind.name.lower(),
             "via": path.via})
        reached[path.target] = reached.get(path.target, False) or path.kind.name == "DIRECT"
    syncing = {pid for s in running_syncs.values() for pid in (s.voters | set(s.participants))}

    def peer_record(p: ms.PeerInfo) -> dict[str, Any]:
        report = reports.get(p.conn_id)
        ring = rings.get(p.group, ())
        candidates = state.candidates_of(p.peer_id)
        last_sync = None
        if report is not None and report.synced:
            last_sync = {"revision": report.revision, "tx_bytes": report.sync_tx_bytes,
                         "rx_bytes": report.sync_rx_bytes}
        return {
            "peer_id": peer_hex(p.peer_id),
            "short_id": short_id(p.peer_id),
            "address": f"[{p.host}]:{p.p2p_port}" if ":" in p.host else f"{p.host}:{p.p2p_port}",
            "state": p.status.value,
            "activity": _activity(p, p.peer_id in in_ops, p.peer_id in syncing),
            "ring_position": ring.index(p.peer_id) if p.status is ms.PeerStatus.ACCEPTED and p.peer_id in ring
            else None,
            "heartbeat_age_s": round(max(0.0, now - last_heard.get(p.conn_id, now)), 3),
            "revision": last_sync["revision"] if last_sync is not None else None,
            "last_sync": last_sync,
            "tx_bytes": report.tx_bytes if report is not None else 0,
            "rx_bytes": report.rx_bytes if report is not None else 0,
            "observed_host": p.host,
            "advertised": [f"{describe_port(c.kind)}={format_host_port(c.host, c.port)}" for c in candidates
                           if c.origin == CandidateOrigin.ADVERTISED],
            "local": sorted({c.host for c in candidates if c.origin == CandidateOrigin.LOCAL}),
            "reachable": reached.get(p.peer_id),
            "paths": sorted(paths_from.get(p.peer_id, []), key=lambda x: (x["to"], x["port"])),
        }

    registered = [p for p in peers if p.status in (ms.PeerStatus.REGISTERED, ms.PeerStatus.ACCEPTED)]
    groups_out = []
    for group in sorted({p.group for p in registered}):
        members = [p for p in registered if p.group == group]
        accepted = [p for p in members if p.status is ms.PeerStatus.ACCEPTED]
        ring = rings.get(group, ())
        position = {pid: i for i, pid in enumerate(ring)}
        accepted.sort(key=lambda p: (position.get(p.peer_id, len(ring)), p.peer_id))
        pending = sorted((p for p in members if p.status is ms.PeerStatus.REGISTERED), key=lambda p: p.peer_id)
        records = [peer_record(p) for p in accepted]
        last_sync, last_transfer = (
            None if record is None else {"revision": record.revision, "bytes": record.nbytes,
                                         "age_s": round(max(0.0, now - record.at), 3)}
            for record in (syncs or {}).get(group, (None, None)))
        edges = [{"from": peer_hex(a), "to": peer_hex(b), "bandwidth_bps": _bits(links.get((a, b)))}
                 for a, b in zip(ring, ring[1:] + ring[:1])] if len(ring) > 1 else []
        collectives = [
            {"tag": op.tag, "seq": op.seq, "state": "voting" if op.seq is None else "running",
             "voters": len(op.voters), "participants": len(op.participants), "done": len(op.done)}
            for op in sorted((o for o in ops if o.group == group), key=lambda o: o.tag)
        ]
        groups_out.append({
            "group": group,
            "world_size": len(accepted),
            "ring": [peer_hex(pid) for pid in ring],
            "ring_stale": group in stale,
            "revision": state.revision_of(group),
            "lineage": _lineage_hex(state.lineage_of(group)),
            "last_sync": last_sync,
            "last_transfer": last_transfer,
            "sync_running": group in running_syncs,
            "edges": edges,
            "collectives": collectives,
            "peers": records,
            "pending": [peer_record(p) for p in pending],
        })

    return {
        "schema": SCHEMA,
        "master": {"address": address, "instance": f"{state.instance:016x}",
                   "uptime_s": round(max(0.0, now - started_at), 3),
                   "token_required": token_required, "tls": tls},
        "groups": groups_out,
        "connections": {"total": len(peers),
                        "unregistered": sum(p.status is ms.PeerStatus.CONNECTED for p in peers),
                        "relays": sum(p.status is ms.PeerStatus.RELAY for p in peers)},
        "relays": [{"relay_id": r.relay_id, "address": r.address, "own": r.own, "pairs_assigned": r.pairs_assigned,
                    "pairs": r.pairs, "waiting": r.waiting, "forwarded_bytes": r.forwarded_bytes}
                   for r in state.relays()],
        "paths": {kind: sum(p.kind.name.lower() == kind for p in paths) for kind in ("direct", "reversed", "relayed")},
        "votes_in_progress": {
            "topology": sum(p.topology_vote is not None for p in peers),
            "collective": len(ops),
            "sync": len(running_syncs),
            "pending_query": sum(p.pending_vote for p in peers),
            "rounds": len(state.rounds_in_progress()),
        },
        "counters": {
            "ops_completed": counters.ops_completed,
            "ops_aborted": counters.ops_aborted,
            "syncs_completed": counters.syncs_completed,
            "joins": counters.joins,
            "removals": dict(sorted(counters.removals.items())),
            "reported_tx_bytes": counters.reported_tx_bytes,
            "reported_rx_bytes": counters.reported_rx_bytes,
        },
        "events": [
            {"age_s": round(max(0.0, now - e.at), 3), "kind": e.kind,
             "peer_id": peer_hex(e.peer_id) if e.peer_id is not None else None,
             "group": e.group, "detail": e.detail}
            for e in events
        ],
    }
