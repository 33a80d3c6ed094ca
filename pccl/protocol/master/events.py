"""The master machine's interface types: the events the shell feeds it and the effects it returns.

:class:`~pccl.protocol.master.machine.MasterState` (whose module re-exports these) is driven as
``handle(event, now) -> list[Effect]``; the Trio shell (:mod:`pccl.master.server`), the simulator and
the property tests build these events and execute these effects.
"""

from __future__ import annotations

import dataclasses

from ...errors import KickReason
from .. import messages as m

__all__ = ["PeerFault", "PeerConnected", "MessageReceived", "PeerDisconnected", "ProtocolViolation", "Tick", "Event", "Send",
           "Kick", "Close", "SetTimer", "Effect"]


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


Effect = Send | Kick | Close | SetTimer
