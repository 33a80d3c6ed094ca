"""The master machine's interface types: the events the shell feeds it and the effects it returns.

:class:`~pccl.protocol.master.machine.MasterState` (whose module re-exports these) is driven as
``handle(event, now) -> list[Effect]``; the Trio shell (:mod:`pccl.master.server`), the simulator and
the property tests build these events and execute these effects.

Facts are the effects that move nothing on the wire: what the machine decided that the shell
records (the status page's counters and recent events), so that the shell never re-derives it
from the messages it sends.  Each comes right before the ``Send`` it goes with (a join before
the ``Welcome``, an acceptance before the ``TopologyComplete``, an op's or a sync's end before
its final messages), and only when there is one: an op or sync that ends with nobody left to
tell is not reported.
"""

from __future__ import annotations

import dataclasses

from ...errors import KickReason
from .. import messages as m

__all__ = ["PeerFault", "PeerConnected", "MessageReceived", "PeerDisconnected", "ProtocolViolation", "Tick", "Event", "Send",
           "Kick", "Close", "SetTimer", "PeerJoined", "PeerAccepted", "RelayJoined", "OpEnded", "SyncEnded", "Fact",
           "Effect"]


# --- events (shell → machine) ------------------------------------------------------------------


class PeerFault(Exception):
    """A mistake of the peer whose message is being handled (here or in the master's handlers):
    the master kicks that peer, and only it."""

    def __init__(self, reason: KickReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclasses.dataclass(frozen=True)
class PeerConnected:
    """A connection finished the framed handshake; ``observed_host`` is its source address."""

    conn_id: int
    observed_host: str


@dataclasses.dataclass(frozen=True)
class MessageReceived:
    conn_id: int
    msg: m.Message

    def __init__(self, conn_id: int, msg: m.Message) -> None:
        # One per message received: the generated frozen __init__ (a call of
        # ``object.__setattr__`` per field) costs about twice these two stores.
        d = self.__dict__
        d["conn_id"], d["msg"] = conn_id, msg


@dataclasses.dataclass(frozen=True)
class PeerDisconnected:
    """The connection closed or broke (EOF, reset, send failure)."""

    conn_id: int


@dataclasses.dataclass(frozen=True)
class ProtocolViolation:
    """The shell could not decode what the connection sent (garbage, oversized frame…)."""

    conn_id: int
    reason: KickReason
    detail: str


@dataclasses.dataclass(frozen=True)
class Tick:
    """A timer set by ``SetTimer`` fired (the deadline check runs on every event anyway)."""


Event = PeerConnected | MessageReceived | PeerDisconnected | ProtocolViolation | Tick


# --- effects (machine → shell) -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Send:
    conn_id: int
    msg: m.Message

    def __init__(self, conn_id: int, msg: m.Message) -> None:
        # One per message sent: the generated frozen __init__ (a call of
        # ``object.__setattr__`` per field) costs about twice these two stores.
        d = self.__dict__
        d["conn_id"], d["msg"] = conn_id, msg


@dataclasses.dataclass(frozen=True)
class Kick:
    """Send ``KickNotice(reason, detail)`` if possible, then close.  The peer is already gone."""

    conn_id: int
    reason: KickReason
    detail: str


@dataclasses.dataclass(frozen=True)
class Close:
    """Close the connection without a notice (the peer left on purpose)."""

    conn_id: int


@dataclasses.dataclass(frozen=True)
class SetTimer:
    """Feed a ``Tick`` at time ``at`` (``None``: no deadline pending).  Replaces earlier timers."""

    at: float | None


# --- facts (machine → shell, to record; see the module docstring) ------------------------------


@dataclasses.dataclass(frozen=True)
class PeerJoined:
    """Connection ``conn_id`` registered: it is peer ``peer_id`` of ``group`` (``rejoined``: it
    registered again after a master restart and keeps the id it had)."""

    conn_id: int
    peer_id: int
    group: int
    rejoined: bool


@dataclasses.dataclass(frozen=True)
class PeerAccepted:
    """The peer on ``conn_id`` was accepted by a topology round; its group now has ``world_size``
    members."""

    conn_id: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class RelayJoined:
    """Connection ``conn_id`` registered as relay ``relay_id``, reached at ``address``: it proved
    itself like a registered peer (the shell gives back its admission slot)."""

    conn_id: int
    relay_id: int
    address: str


@dataclasses.dataclass(frozen=True)
class OpEnded:
    """Collective op ``seq`` (``tag`` of ``group``) completed, or ``aborted``; ``peer_id`` is the
    first participant told (the one its status event names)."""

    group: int
    tag: int
    seq: int
    aborted: bool
    peer_id: int


@dataclasses.dataclass(frozen=True)
class SyncEnded:
    """Shared-state sync ``sync_id`` of ``group`` completed at ``revision``; ``planned_bytes``
    is what its plans had the receivers fetch (a re-plan counts its pieces again)."""

    group: int
    sync_id: int
    revision: int
    planned_bytes: int


Fact = PeerJoined | PeerAccepted | RelayJoined | OpEnded | SyncEnded
Effect = Send | Kick | Close | SetTimer | Fact
