"""The master's optimise sub-machine: probe the links, solve the ring, keep its order (sans-IO).

Rules
=====

Optimise.  ``VoteOptimize`` is a group vote whose vote stands as a topology vote does (the same
phase rules; the master's membership keeps the vote).  When every accepted member of the group
has cast it and no round touches the group, each member gets a ``ProbeRequest`` with the members
it has no measurement to (:class:`~pccl.protocol.master.link_store.LinkStore`: kept while both ends
stay) and answers one ``ProbeReport`` naming exactly those targets (PROTOCOL_ERROR otherwise; a
second report, or one for a probe it was not asked for, is OUT_OF_PHASE; a report of an older
probe is ignored).  With every live member's report in, the master solves the ring
(:mod:`pccl.protocol.topology`), keeps that order for the group, and installs it with a group
round, which ends the votes.  Every round's ``ConnectToPeers`` carries the sites the measured links
show among the ring's members (:mod:`pccl.protocol.sites`; none while a pair is unmeasured).  Rings of later rounds keep the optimised order for the members
that stay; newcomers follow in id order (:meth:`Optimizer.ring_order`).

The machine sees the master only through :class:`OptimizeHost` (peers named by peer id).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

from ...errors import KickReason
from .. import messages as m
from .link_store import LinkStore
from ..ring import build_ring
from ..sites import find_sites, ring_sites
from .events import PeerFault

__all__ = ["Optimizer", "OptimizeHost"]

log = logging.getLogger("pccl.protocol.master.machine")


@dataclasses.dataclass(frozen=True)
class OptimizeHost:
    """What the optimise machine needs from the master, as callables (peers named by id)."""

    #: a group's members if every one has an optimise vote standing and no round touches the group, else ``None``
    voting_members: Callable[[int], list[int] | None]
    #: the accepted peers of a group, in arrival order
    members: Callable[[int], list[int]]
    #: a group's installed ring (``None`` before its first round)
    ring: Callable[[int], tuple[int, ...] | None]
    #: the peer still has a connection
    is_live: Callable[[int], bool]
    #: where a live peer listens
    endpoint: Callable[[int], m.PeerEndpoint]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: start the group round that installs the optimised ring (it ends the votes)
    install: Callable[[int, list[int]], None]


@dataclasses.dataclass
class _Probe:
    """An optimise vote of one group past consensus: who was asked to probe whom."""

    probe_id: int
    targets: dict[int, tuple[int, ...]]  # member -> the peers it was asked to probe
    reports: set[int] = dataclasses.field(default_factory=set)


class Optimizer:
    """Every group's optimisation (see the module docstring) and the link measurements."""

    def __init__(self, host: OptimizeHost) -> None:
        self._host = host
        self.links = LinkStore()
        self._probes: dict[int, _Probe] = {}  # by group
        self._orders: dict[int, tuple[int, ...]] = {}  # group -> ring order its optimisation chose
        self._next_probe = 1

    def on_report(self, group: int, peer_id: int, msg: m.ProbeReport) -> None:
        probe = self._probes.get(group)
        if probe is None or msg.probe != probe.probe_id or peer_id not in probe.targets:
            if msg.probe < self._next_probe:
                log.debug("ignoring stale probe report %d of peer %x", msg.probe, peer_id)
                return
            raise PeerFault(KickReason.OUT_OF_PHASE, f"probe report {msg.probe}, which it was not asked for")
        if peer_id in probe.reports:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"second report for probe {msg.probe}")
        asked = probe.targets[peer_id]
        if sorted(r.peer_id for r in msg.results) != sorted(asked):
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"probe report {msg.probe} does not answer the targets asked")
        probe.reports.add(peer_id)
        for result in msg.results:
            if self._host.is_live(result.peer_id):
                self.links.record(peer_id, result.peer_id, result.bandwidth, result.rtt)

    def check(self, group: int) -> bool:
        """Start ``group``'s probes once every member votes, install the solved ring once every
        live member reported; whether anything changed."""
        probe = self._probes.get(group)
        if probe is None:
            members = self._host.voting_members(group)
            if not members:
                return False
            plan = self.links.probe_plan(members)
            probe = self._probes[group] = _Probe(self._next_probe, plan)
            self._next_probe += 1
            for pid in members:
                targets = tuple(self._host.endpoint(t) for t in plan[pid])
                self._host.send(pid, m.ProbeRequest(probe.probe_id, targets))
            log.debug("group %d: probe %d: %d links to measure", group, probe.probe_id,
                      sum(len(t) for t in plan.values()))
            return True
        if not all(pid in probe.reports for pid in probe.targets if self._host.is_live(pid)):
            return False
        del self._probes[group]
        ids = list(self._host.members(group))
        if not ids:
            return True
        solution = self.links.solve(ids, self._host.ring(group))
        self._orders[group] = solution.order
        log.info("group %d: ring optimised (%s): bottleneck %.3g MB/s over %d peers", group,
                 "exact" if solution.exact else "heuristic", solution.bottleneck / 1e6, len(ids))
        self._host.install(group, ids)
        return True

    def ring_order(self, group: int, ids: Iterable[int]) -> tuple[int, ...]:
        """``ids`` in the order the group's last optimisation chose, newcomers after in id order."""
        order = self._orders.get(group, ())
        members = set(ids)
        kept = [pid for pid in order if pid in members]
        return tuple(kept) + build_ring(members.difference(kept))

    def ring_links(self, ring: tuple[int, ...]) -> tuple[m.LinkFigure, ...]:
        """The measured figures of ``ring``'s edges, in ring order (empty: none measured)."""
        if len(ring) < 2:
            return ()
        edges = [self.links.measured(a, ring[(i + 1) % len(ring)]) for i, a in enumerate(ring)]
        if all(e is None for e in edges):
            return ()
        return tuple(m.LinkFigure(e.bandwidth, e.rtt) if e is not None else m.LinkFigure(0.0, 0.0) for e in edges)

    def ring_sites(self, ring: tuple[int, ...]) -> tuple[int, ...]:
        """The site of each of ``ring``'s positions from the measured links
        (:mod:`pccl.protocol.sites`), ``()`` while any pair is unmeasured or no gap shows."""
        return ring_sites(ring, find_sites(ring, self.links.edges(ring)))

    # --- views --------------------------------------------------------------------------------

    def probing_groups(self) -> frozenset[int]:
        return frozenset(self._probes)

    def probes(self) -> dict[int, tuple[dict[int, tuple[int, ...]], frozenset[int]]]:
        return {g: (dict(pr.targets), frozenset(pr.reports)) for g, pr in self._probes.items()}
