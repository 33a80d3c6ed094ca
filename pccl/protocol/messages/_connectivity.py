"""Connectivity messages (tags 130–159): knocks, connection reversal, relays.

Import them from :mod:`pccl.protocol.messages`, which re-exports everything.
"""

from __future__ import annotations

from ._base import U16, U32, U64, Message, PeerEndpoint


# --- 130–159: connectivity (rules in pccl/protocol/paths.py; master side in
# pccl/protocol/master/paths.py, peer side in pccl/_peer/connector.py, relays in pccl/relay/) ----
#
# Every peer-to-peer connection begins, after the framed handshake, with Knock → KnockAck: the
# dialler names whom it wants (diallers race several candidates, and the first connection that
# reaches the right peer wins).  A peer that cannot dial another asks the master
# (PathRequest); the master asks the target to dial back (DialRequest), which it does on the
# requester's p2p port with ReverseHello → KnockAck; a target that cannot either says so
# (DialFailed) and the master offers both a relay (RelayOffer).  Both dial the relay, present
# RelayJoin and, once the relay answered RelayReady to both, talk through it as over a direct
# connection (a fresh framed handshake end to end, then Knock).  PathReport tells the master
# which path a pair took (status page, metrics).  Relays register with the master
# (RelayRegister → RelayWelcome) and report RelayStats as their heartbeat.


class Knock(Message, tag=130):
    """Dialler → acceptor, first message on every peer-to-peer connection (direct or relayed):
    peer ``origin`` wants peer ``target`` of master ``instance``, for a connection of ``port``
    (a ``paths.Port``)."""

    origin: U64
    target: U64
    instance: U64
    port: U32


class KnockAck(Message, tag=131):
    """Acceptor → dialler (and requester → target after a ReverseHello): who answered;
    ``accepted`` false (with ``detail``) when the knock was not for it, and it closes."""

    peer_id: U64
    accepted: bool = True
    detail: str = ""


class PathRequest(Message, tag=132):
    """Peer → master: this peer cannot dial ``target``'s ``port``; have it dial back, or with
    ``relay_only`` go straight to a relay (avoiding the relays in ``avoid``).  ``request`` is the
    requester's own id for the attempt (later messages about it carry it)."""

    request: U64
    target: U64
    port: U32
    relay_only: bool = False
    avoid: tuple[U64, ...] = ()
    #: What the requester's own dials met (each candidate and its failure), for the target's log.
    detail: str = ""


class DialRequest(Message, tag=133):
    """Master → target: dial ``requester`` (its p2p port candidates) for attempt ``request``
    and present ``ReverseHello``; the connection is then ``requester``'s, for ``port``."""

    request: U64
    requester: PeerEndpoint
    port: U32
    #: Why the requester could not dial this peer (the candidates it tried and what each met).
    detail: str = ""


class ReverseHello(Message, tag=134):
    """Dialled-back connection, first message after the framed handshake: peer ``origin`` (the
    one asked to dial) answers attempt ``request`` of peer ``target`` (the requester) under
    master ``instance``; the requester answers KnockAck."""

    request: U64
    origin: U64
    target: U64
    instance: U64


class DialFailed(Message, tag=135):
    """Target → master: dialling ``requester`` back for attempt ``request`` failed (``detail``)."""

    request: U64
    requester: U64
    detail: str = ""


class RelayOffer(Message, tag=136):
    """Master → both ends of attempt ``request``: meet ``partner`` at relay ``relay`` (its
    ``address``; empty: the master's own address, ``pccl master --relay``), presenting ``key``.
    ``initiator``: this side asked (it opens the connection for ``port``); else it answers."""

    request: U64
    relay: U64
    address: str
    key: bytes
    partner: U64
    port: U32
    initiator: bool


class PathUnavailable(Message, tag=137):
    """Master → requester: attempt ``request`` has no path (``detail`` says what failed)."""

    request: U64
    detail: str = ""


class PathReport(Message, tag=138):
    """Peer → master: this peer's connections of ``port`` to ``target`` now take a path of
    ``kind`` (a ``paths.PathKind``) through ``via`` (the address dialled, or the relay);
    ``request``: the attempt it ends (0: none, a direct dial)."""

    target: U64
    port: U32
    kind: U32
    via: str = ""
    request: U64 = 0


class RelayRegister(Message, tag=140):
    """Relay → master, first message: this connection is a relay reachable at ``host:port``
    (``host`` empty: the address the master sees the connection come from)."""

    host: str
    port: U16


class RelayWelcome(Message, tag=141):
    """Master → relay: registered as relay ``relay_id`` of master ``instance``."""

    relay_id: U64
    instance: U64 = 0


class RelayStats(Message, tag=142):
    """Relay → master, every heartbeat interval (it is the relay's heartbeat): pairs spliced
    now, joins waiting for their partner, and payload bytes forwarded since the relay started."""

    pairs: U32 = 0
    waiting: U32 = 0
    forwarded_bytes: U64 = 0


class RelayJoin(Message, tag=143):
    """Peer → relay, first message after the framed handshake: splice this connection with
    ``partner``'s, which presents the same ``key``.  The peer sends nothing more until
    RelayReady."""

    key: bytes
    peer_id: U64
    partner: U64


class RelayReady(Message, tag=144):
    """Relay → both joiners: the partner is here; from the next byte on, the connection carries
    the partner's bytes."""


class RelayRefused(Message, tag=145):
    """Relay → joiner: not spliced (``reason``: no partner in time, a bad join, the relay is full)."""

    reason: str = ""


CONNECTIVITY_MESSAGES: tuple[type[Message], ...] = (
    Knock, KnockAck, PathRequest, DialRequest, ReverseHello, DialFailed, RelayOffer, PathUnavailable,
    PathReport, RelayRegister, RelayWelcome, RelayStats, RelayJoin, RelayReady, RelayRefused,
)
