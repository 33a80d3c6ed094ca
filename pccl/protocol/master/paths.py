"""The master's connectivity sub-machine: dial-backs, relay offers, relays, and the paths
peers report (sans-IO).  What a candidate and a path are: :mod:`pccl.protocol.paths`.

Rules
=====

Attempts.  A peer (registered or accepted) that cannot dial another sends
``PathRequest(request, target, port)``; ``request`` is its own number for the attempt, and
the attempt is named by (requester, request) from then on.  The master answers every attempt
with exactly one outcome, unless the requester itself ends it first (a ``PathReport`` naming
it, or a newer request once :data:`MAX_ATTEMPTS` are open):

* a target that is not a live peer (or the requester itself): ``PathUnavailable`` at once;
* otherwise the target gets ``DialRequest(request, requester's endpoint, port)``: it dials the
  requester back.  It succeeds silently (the requester reports the path), or answers
  ``DialFailed``, and then the attempt moves to a relay;
* ``relay_only`` (the requester gave up waiting for the dial-back, or knows it will not come)
  moves an open attempt, or a new one, to a relay at once; for an attempt at a relay that its
  ``avoid`` list now names (the requester could not meet its partner there), to another relay;
* moving to a relay: the live relay that is not in the attempt's ``avoid`` list with the
  fewest pairs assigned (then the lowest id) is chosen, a fresh random key drawn, and both
  ends get ``RelayOffer`` (the requester as ``initiator``); no relay left:
  ``PathUnavailable`` saying what failed.  A ``DialFailed`` for an attempt already at a relay,
  closed or unknown is ignored (it crossed the requester's own ``relay_only``).
* the target leaving ends its attempts with ``PathUnavailable``; the requester leaving drops
  its attempts.

Relays.  A connection whose first message is ``RelayRegister(host, port)`` is a relay: it gets
``RelayWelcome(relay_id)``, must send something (its ``RelayStats``) every ``peer_timeout``
like a peer, and is dropped with its connection.  ``host`` empty means the address the master
observes.  The master's own relay (``pccl master --relay``) is relay 1 from the start, at the
empty address (peers dial the master's address for it).  Relay ids start at 1 and are never
reused.  Pairs assigned to a relay count against it until the relay goes.

Paths.  ``PathReport(target, port, kind, via)`` from a peer records the path of its
connections of ``port`` to ``target`` (replacing an earlier one) and is logged when it
changes; a path is forgotten with either end, and a relayed one with its relay (every
connection through it ended; the pair reports its next path when it needs one).  The views (:meth:`Paths.paths`,
:meth:`Paths.relays`) feed the status page and ``/metrics``.  A report with a kind outside
:class:`~pccl.protocol.paths.PathKind` or a port outside :class:`~pccl.protocol.paths.Port`
is the reporter's PROTOCOL_ERROR.

The machine sees the master only through :class:`PathsHost`.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import logging
from collections.abc import Callable

from ...errors import KickReason
from .. import messages as m
from ..codec import MAX_DETAIL, clip_text
from ..paths import PathKind, Port, describe_port, relay_of_via
from .events import PeerFault

__all__ = ["Paths", "PathsHost", "PathView", "RelayView", "MAX_ATTEMPTS", "OWN_RELAY_ID", "RELAY_KEY_SIZE"]

log = logging.getLogger("pccl.protocol.master.machine")

#: Open attempts kept per requester; a newer one drops the oldest (bounded memory).
MAX_ATTEMPTS = 256
#: The relay id of the master's own relay (``pccl master --relay``).
OWN_RELAY_ID = 1
#: Bytes of a relay rendezvous key.
RELAY_KEY_SIZE = 16


class _Stage(enum.Enum):
    REVERSING = "reversing"
    RELAYING = "relaying"


@dataclasses.dataclass
class _Attempt:
    target: int
    port: Port
    stage: _Stage
    avoid: frozenset[int]
    relay: int | None = None
    detail: str = ""


@dataclasses.dataclass
class _Relay:
    relay_id: int
    conn_id: int | None  # None: the master's own relay
    address: str
    pairs: int = 0
    stats: m.RelayStats = dataclasses.field(default_factory=m.RelayStats)


@dataclasses.dataclass(frozen=True)
class PathView:
    """One reported path: ``initiator``'s connections of ``port`` to ``target``."""

    initiator: int
    target: int
    port: Port
    kind: PathKind
    via: str
    since: float


@dataclasses.dataclass(frozen=True)
class RelayView:
    relay_id: int
    address: str  # "" for the master's own relay
    own: bool
    pairs_assigned: int
    pairs: int
    waiting: int
    forwarded_bytes: int


@dataclasses.dataclass(frozen=True)
class PathsHost:
    """What the paths machine needs from the master, as callables (peers named by id)."""

    #: the peer is registered or accepted and still connected
    is_live: Callable[[int], bool]
    #: where a live peer listens
    endpoint: Callable[[int], m.PeerEndpoint]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: ``n`` fresh random bytes (the injected RNG)
    random_bytes: Callable[[int], bytes]


class Paths:
    """Attempts, relays and reported paths (see the module docstring)."""

    def __init__(self, host: PathsHost, *, own_relay: bool = False) -> None:
        self._host = host
        self._attempts: dict[int, collections.OrderedDict[int, _Attempt]] = {}  # requester -> request -> attempt
        self._relays: dict[int, _Relay] = {}
        self._relay_of_conn: dict[int, int] = {}
        self._next_relay = OWN_RELAY_ID
        if own_relay:
            self._relays[OWN_RELAY_ID] = _Relay(OWN_RELAY_ID, None, "")
        self._next_relay = OWN_RELAY_ID + 1
        self._paths: dict[tuple[int, int, Port], PathView] = {}
        #: Counts of attempts by outcome since the master started (``/metrics``).
        self.counters: collections.Counter[str] = collections.Counter()

    # --- attempts ------------------------------------------------------------------------------

    def on_request(self, requester: int, msg: m.PathRequest) -> None:
        port = _port(msg.port)
        target = msg.target
        if target == requester or not self._host.is_live(target):
            self.counters["unavailable"] += 1
            why = "itself" if target == requester else f"peer {target:x}, which is not in the run"
            self._host.send(requester, m.PathUnavailable(msg.request, f"it asked for a path to {why}"))
            return
        attempts = self._attempts.setdefault(requester, collections.OrderedDict())
        attempt = attempts.get(msg.request)
        if attempt is not None and (attempt.target != target or attempt.port != port):
            raise PeerFault(KickReason.PROTOCOL_ERROR,
                            f"path request {msg.request} names another target or port than before")
        if attempt is None:
            while len(attempts) >= MAX_ATTEMPTS:
                attempts.popitem(last=False)
            attempt = attempts[msg.request] = _Attempt(target, port, _Stage.REVERSING, frozenset(msg.avoid),
                                                       detail=clip_text(msg.detail, MAX_DETAIL))
            if not msg.relay_only:
                self.counters["dial_back"] += 1
                self._host.send(target, m.DialRequest(msg.request, self._host.endpoint(requester), int(port),
                                                      attempt.detail))
                return
        else:
            attempt.avoid |= frozenset(msg.avoid)
        if msg.relay_only and (attempt.stage is _Stage.REVERSING or attempt.relay in attempt.avoid):
            why = ("the dial-back did not come in time" if attempt.stage is _Stage.REVERSING
                   else f"relay {attempt.relay} failed")
            self._to_relay(requester, msg.request, attempt, why)

    def on_dial_failed(self, target: int, msg: m.DialFailed) -> None:
        attempts = self._attempts.get(msg.requester)
        attempt = attempts.get(msg.request) if attempts is not None else None
        if attempt is None or attempt.target != target or attempt.stage is not _Stage.REVERSING:
            log.debug("ignoring DialFailed of peer %x for attempt %d of %x", target, msg.request, msg.requester)
            return
        detail = clip_text(msg.detail, MAX_DETAIL)
        self._to_relay(msg.requester, msg.request, attempt, f"peer {target:x} could not dial back: {detail}")

    def _to_relay(self, requester: int, request: int, attempt: _Attempt, why: str) -> None:
        relay = self._choose_relay(attempt.avoid)
        if relay is None:
            self.counters["unavailable"] += 1
            self._attempts[requester].pop(request, None)
            detail = (f"{why}; no relay serves this run" if not attempt.avoid
                      else f"{why}; no other relay serves this run")
            detail += " (start `pccl relay --master ...` or `pccl master --relay`)"
            self._host.send(requester, m.PathUnavailable(request, clip_text(detail, MAX_DETAIL)))
            return
        previous = self._relays.get(attempt.relay) if attempt.relay is not None else None
        if previous is not None:
            previous.pairs -= 1
        attempt.stage, attempt.relay = _Stage.RELAYING, relay.relay_id
        relay.pairs += 1
        self.counters["relayed"] += 1
        key = self._host.random_bytes(RELAY_KEY_SIZE)
        port = int(attempt.port)
        self._host.send(requester, m.RelayOffer(request, relay.relay_id, relay.address, key, attempt.target, port,
                                                True))
        self._host.send(attempt.target, m.RelayOffer(request, relay.relay_id, relay.address, key, requester, port,
                                                     False))
        log.debug("attempt %d of peer %x to %x (%s): relay %d", request, requester, attempt.target,
                  describe_port(port), relay.relay_id)

    def _choose_relay(self, avoid: frozenset[int]) -> _Relay | None:
        choices = [r for r in self._relays.values() if r.relay_id not in avoid]
        return min(choices, key=lambda r: (r.pairs, r.relay_id), default=None)

    # --- reported paths ------------------------------------------------------------------------

    def on_report(self, initiator: int, msg: m.PathReport, now: float) -> None:
        port = _port(msg.port)
        try:
            kind = PathKind(msg.kind)
        except ValueError:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"path report of unknown kind {msg.kind}") from None
        attempts = self._attempts.get(initiator)
        if msg.request and attempts is not None:
            attempts.pop(msg.request, None)
        if not self._host.is_live(msg.target) or msg.target == initiator:
            return  # the target left meanwhile
        via = clip_text(msg.via, 200)
        key = (initiator, msg.target, port)
        before = self._paths.get(key)
        if before is not None and before.kind is kind and before.via == via:
            return
        self._paths[key] = PathView(initiator, msg.target, port, kind, via, now)
        log.info("path %x -> %x (%s): %s%s", initiator, msg.target, describe_port(port), kind.name.lower(),
                 f" via {via}" if via else "")

    # --- peers and relays coming and going -----------------------------------------------------

    def peer_removed(self, peer_id: int) -> None:
        self._attempts.pop(peer_id, None)
        for requester, attempts in self._attempts.items():
            for request, attempt in list(attempts.items()):
                if attempt.target == peer_id:
                    del attempts[request]
                    self.counters["unavailable"] += 1
                    self._host.send(requester, m.PathUnavailable(request, f"peer {peer_id:x} left the run"))
        for key in [k for k in self._paths if peer_id in (k[0], k[1])]:
            del self._paths[key]

    def add_relay(self, conn_id: int, address: str) -> int:
        relay_id = self._next_relay
        self._next_relay += 1
        self._relays[relay_id] = _Relay(relay_id, conn_id, address)
        self._relay_of_conn[conn_id] = relay_id
        log.info("relay %d registered at %s", relay_id, address)
        return relay_id

    def relay_stats(self, conn_id: int, stats: m.RelayStats) -> None:
        relay_id = self._relay_of_conn.get(conn_id)
        if relay_id is not None:
            self._relays[relay_id].stats = stats

    def own_relay_stats(self, stats: m.RelayStats) -> None:
        """What the master's own relay forwarded (the shell reads its counters)."""
        relay = self._relays.get(OWN_RELAY_ID)
        if relay is not None and relay.conn_id is None:
            relay.stats = stats

    def relay_removed(self, conn_id: int) -> None:
        relay_id = self._relay_of_conn.pop(conn_id, None)
        if relay_id is None:
            return
        relay = self._relays.pop(relay_id)
        log.info("relay %d at %s is gone (it forwarded %d bytes)", relay_id, relay.address,
                 relay.stats.forwarded_bytes)
        for attempts in self._attempts.values():
            for attempt in attempts.values():
                if attempt.relay == relay_id:
                    attempt.avoid |= {relay_id}
        for key, path in list(self._paths.items()):
            if path.kind is PathKind.RELAYED and relay_of_via(path.via) == relay_id:
                del self._paths[key]

    # --- views ---------------------------------------------------------------------------------

    def paths(self) -> list[PathView]:
        return sorted(self._paths.values(), key=lambda p: (p.initiator, p.target, p.port))

    def relays(self) -> list[RelayView]:
        return [RelayView(r.relay_id, r.address, r.conn_id is None, r.pairs, r.stats.pairs, r.stats.waiting,
                          r.stats.forwarded_bytes) for r in sorted(self._relays.values(), key=lambda r: r.relay_id)]

    def open_attempts(self) -> int:
        return sum(len(a) for a in self._attempts.values())


def _port(value: int) -> Port:
    try:
        return Port(value)
    except ValueError:
        raise PeerFault(KickReason.PROTOCOL_ERROR, f"unknown port kind {value}") from None
