"""The master's topology rounds: connect, report, retry, kick the unreachable (sans-IO).

Rules
=====

Rounds.  A round has a scope (:data:`~pccl.protocol.master.peers.GLOBAL_SCOPE` for the global
round that accepts newcomers, a group number for a group's re-wire or optimisation) and an id.
Every participant gets ``ConnectToPeers(round, ring, neighbours, figures)`` — its group's ring
in the order the optimiser keeps, and the ring's measured link figures — and answers
``P2PReport(round, ok, unreachable)``: a report for an older round is ignored, one for a round
it was not sent, or a second one, is OUT_OF_PHASE.  When every *live* participant has
reported: all ok and nobody dropped out → the round completes (the master accepts the
participants, installs the rings and sends ``TopologyComplete``); otherwise a fresh round (new
id) starts with the survivors — automatic retry, no re-vote.  After ``max_attempts`` failed
attempts the peers reported unreachable most often (or, when the failures name nobody, the
reporters) are kicked (``P2P_UNREACHABLE``) and the retry goes on without them.  A round whose
participants are all gone ends.

The machine sees the master only through :class:`RoundsHost` (peers named by id).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable

from ...errors import KickReason
from .. import messages as m
from ..ring import ring_contacts
from .events import PeerFault
from .peers import RoundRecord

__all__ = ["Rounds", "RoundsHost"]

log = logging.getLogger("pccl.protocol.master.machine")


@dataclasses.dataclass(frozen=True)
class RoundsHost:
    """What the rounds machine needs from the master, as callables (peers named by id)."""

    #: a live peer's group
    group_of: Callable[[int], int]
    #: the peer still has a connection (it was not removed)
    is_live: Callable[[int], bool]
    #: where a live peer listens
    endpoint: Callable[[int], m.PeerEndpoint]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: remove a live peer with ``Kick(reason, detail)``
    kick: Callable[[int, KickReason, str], None]
    #: a group's members in ring order (the optimiser's kept order, newcomers after)
    ring_order: Callable[[int, list[int]], tuple[int, ...]]
    #: the measured figures of a ring's links
    ring_links: Callable[[tuple[int, ...]], tuple[m.LinkFigure, ...]]
    #: the site index of each ring position (:func:`pccl.protocol.sites.ring_sites`), ``()`` if unknown
    ring_sites: Callable[[tuple[int, ...]], tuple[int, ...]]
    #: a peer takes part in the round of this scope from now on (``None``: in none any more)
    enter: Callable[[int, int | None], None]
    #: every live participant reported success: complete the round with them
    complete: Callable[[RoundRecord, list[int]], None]


class Rounds:
    """The running topology rounds, by scope (see the module docstring)."""

    def __init__(self, host: RoundsHost, *, max_attempts: int) -> None:
        self._host = host
        self._max_attempts = max_attempts
        self._rounds: dict[int, RoundRecord] = {}  # by scope
        self._next_round = 1

    def take_id(self) -> int:
        """A fresh round id (also for a topology vote that completes without a round)."""
        rid = self._next_round
        self._next_round += 1
        return rid

    def start(self, scope: int, participants: list[int], previous: RoundRecord | None = None) -> None:
        """Start a round of ``scope`` (an attempt after ``previous``, whose failures it counts)."""
        rnd = RoundRecord(scope, self.take_id(), tuple(sorted(participants)))
        if previous is not None:
            rnd.failed_attempts, rnd.blame, rnd.details = previous.failed_attempts, previous.blame, previous.details
        self._rounds[scope] = rnd
        by_group: dict[int, list[int]] = {}
        for pid in rnd.participants:
            by_group.setdefault(self._host.group_of(pid), []).append(pid)
        for group, ids in by_group.items():
            ring = self._host.ring_order(group, ids)
            figures = self._host.ring_links(ring)
            sites = self._host.ring_sites(ring)
            for pid in ring:
                self._host.enter(pid, scope)
                ends = tuple(self._host.endpoint(n) for n in ring_contacts(ring, pid, sites))
                self._host.send(pid, m.ConnectToPeers(rnd.round_id, ring, ends, figures, sites))
        log.debug("round %d (scope %d) started with %d peers", rnd.round_id, scope, len(rnd.participants))

    def on_report(self, peer_id: int, scope: int | None, msg: m.P2PReport) -> None:
        """``peer_id`` (in the round of ``scope``, if any) reports."""
        rnd = self._rounds.get(scope) if scope is not None else None
        current = rnd.round_id if rnd is not None else self._next_round
        if msg.round < current:
            log.debug("ignoring stale p2p report of peer %x for round %d", peer_id, msg.round)
            return
        if rnd is None or msg.round != rnd.round_id:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"p2p report for round {msg.round}, which it was not sent")
        if peer_id in rnd.reports:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"second p2p report for round {msg.round}")
        rnd.reports[peer_id] = msg

    def dropped(self, scope: int) -> None:
        """A participant of the round of ``scope`` left during this attempt."""
        rnd = self._rounds.get(scope)
        if rnd is not None:
            rnd.dropped = True

    def settle(self) -> bool:
        """Check every round once; whether anything changed."""
        progressed = False
        for scope in list(self._rounds):
            progressed |= self._check(scope)
        return progressed

    def _check(self, scope: int) -> bool:
        rnd = self._rounds[scope]
        live = [pid for pid in rnd.participants if self._host.is_live(pid)]
        if not live:
            del self._rounds[scope]
            return True
        if not all(pid in rnd.reports for pid in live):
            return False
        failed = [rnd.reports[pid] for pid in live if not rnd.reports[pid].ok]
        if not failed and not rnd.dropped:
            del self._rounds[scope]
            self._host.complete(rnd, live)
            return True
        if failed:
            rnd.failed_attempts += 1
            for report in failed:
                blamed = [u for u in set(report.unreachable) if self._host.is_live(u) and u in live]
                rnd.blame.update(blamed)
                if report.detail:
                    for u in blamed:
                        rnd.details[u] = report.detail
            if rnd.failed_attempts >= self._max_attempts:
                self._kick_unreachable(rnd, live)
                live = [pid for pid in live if self._host.is_live(pid)]
        del self._rounds[scope]
        for pid in live:
            self._host.enter(pid, None)
        if live:
            self.start(scope, live, rnd)
        return True

    def _kick_unreachable(self, rnd: RoundRecord, live: list[int]) -> None:
        if rnd.blame:
            worst = max(rnd.blame.values())
            culprits = [pid for pid, n in rnd.blame.items() if n == worst]
            detail = f"unreachable from its ring neighbours in {rnd.failed_attempts} attempts"
        else:  # failures that name nobody: the reporters themselves cannot connect
            culprits = [pid for pid in live if not rnd.reports[pid].ok]
            detail = f"could not connect to its ring neighbours in {rnd.failed_attempts} attempts"
        for pid in sorted(culprits):
            if self._host.is_live(pid):
                why = rnd.details.get(pid)
                self._host.kick(pid, KickReason.P2P_UNREACHABLE, f"{detail}: {why}" if why else detail)
        rnd.failed_attempts = 0
        rnd.blame = Counter()
        rnd.details = {}

    # --- views --------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return bool(self._rounds)

    def __contains__(self, scope: object) -> bool:
        return scope in self._rounds

    def in_progress(self) -> dict[int, tuple[int, ...]]:
        """scope → participants of each running round."""
        return {s: r.participants for s, r in self._rounds.items()}

    def reports(self) -> dict[int, frozenset[int]]:
        """scope → the participants of each running round that have reported."""
        return {s: frozenset(r.reports) for s, r in self._rounds.items()}
