"""Getting a lost master back: dial and register again, with jittered exponential backoff, until
it works or ``Config.master_reconnect_timeout`` runs out; and waiting for a master that is not
up yet when a peer starts (:func:`dial_first`, bounded by ``Config.master_wait_timeout``).

The policy (what the rest of the session does meanwhile is :mod:`pccl.protocol.lifecycle`'s
``RECONNECTING`` state):

* attempt ``k`` (from 0) is followed, if it fails, by a pause of
  ``min(longest, first * 2**k) * uniform(0.5, 1.5)`` (``Config.master_reconnect_backoff`` is
  ``(first, longest)``; the jitter keeps a restarted master from meeting every peer at once);
* a broken connection, a refused dial or a registration that timed out is tried again;
* a kick, a refused token or a protocol error from the master is final (the restarted master
  does not want this peer, or is not a pccl master);
* the deadline is ``lost_at + master_reconnect_timeout``: past it the session fails with
  ``MasterUnreachable`` naming the last error.
"""

from __future__ import annotations

import logging
import random
from typing import Protocol

import trio

from ..config import Config
from ..errors import (
    AuthenticationFailed,
    ConnectionRefused,
    ConnectTimeout,
    Kicked,
    MasterUnreachable,
    PCCLError,
    ProtocolError,
    TransportError,
)
from ..net.framed import FramedConnection
from .heartbeat import PeerFacts

__all__ = ["DialSubject", "ReconnectSubject", "backoff_delay", "dial_first", "reconnect"]

log = logging.getLogger(__name__)


class DialSubject(PeerFacts, Protocol):
    """What :func:`dial_first` needs from the session."""

    async def dial(self, address: str) -> FramedConnection: ...


class ReconnectSubject(DialSubject, Protocol):
    """What :func:`reconnect` needs from the session."""

    def fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None: ...

    async def register_on(self, connection: FramedConnection) -> None:
        """``Register`` → ``Welcome`` on a fresh connection (a new epoch begins)."""

    def rejoined(self) -> None:
        """The registration worked: the master is back."""


def backoff_delay(config: Config, attempt: int, rng: random.Random) -> float:
    """The pause after failed attempt ``attempt`` (from 0)."""
    first, longest = config.master_reconnect_backoff
    return min(longest, first * 2**attempt) * rng.uniform(0.5, 1.5)


async def dial_first(subject: DialSubject, rng: random.Random) -> FramedConnection:
    """The first connection to the master.  While nobody answers at its address (refused,
    unreachable, not resolvable, no answer within ``Config.connect_timeout``) dial again after
    :func:`backoff_delay` pauses (jitter drawn from ``rng`` alone), up to
    ``Config.master_wait_timeout``; the first such failure is logged at INFO, once.

    Raises ``MasterUnreachable`` when the wait runs out (at once with a timeout of 0), or when
    the connection or its handshake breaks in another way (a TLS failure, say);
    ``AuthenticationFailed`` and ``ProtocolError`` as they come (something answered and refused:
    waiting would not help).  Cancellation ends the wait (no connection is left open)."""
    config = subject.config
    address = subject.master_address
    deadline = trio.current_time() + config.master_wait_timeout
    attempt = 0
    while True:
        try:
            return await subject.dial(address)
        except (ConnectionRefused, ConnectTimeout) as exc:
            now = trio.current_time()
            if now >= deadline:
                waited = f" (waited {config.master_wait_timeout:g} s, Config.master_wait_timeout)" if attempt else ""
                raise MasterUnreachable(f"cannot reach the master at {address}{waited}: {exc}") from exc
            if attempt == 0:
                log.info("waiting for the master at %s (up to %g s, Config.master_wait_timeout): %s", address,
                         config.master_wait_timeout, exc)
            else:
                log.debug("dialling the master at %s, attempt %d failed: %s", address, attempt + 1, exc)
            await trio.sleep(min(backoff_delay(config, attempt, rng), deadline - now))
            attempt += 1
        except TransportError as exc:
            raise MasterUnreachable(f"cannot reach the master at {address}: {exc}") from exc


async def reconnect(subject: ReconnectSubject, why: PCCLError, lost_at: float, rng: random.Random) -> None:
    """Dial and register until it works (``subject.rejoined()``), the session fails meanwhile,
    or the deadline passes (``subject.fail(MasterUnreachable)``)."""
    config = subject.config
    deadline = lost_at + config.master_reconnect_timeout
    attempt = 0
    last_error: BaseException = why
    while subject.failure is None:
        if trio.current_time() >= deadline:
            error = MasterUnreachable(f"lost the master at {subject.master_address} ({why}) and could not "
                                      f"reconnect within {config.master_reconnect_timeout:g} s: {last_error}")
            subject.fail(error, cause=last_error)
            return
        delay = backoff_delay(config, attempt, rng)
        attempt += 1
        connection: FramedConnection | None = None
        with trio.move_on_at(deadline):
            try:
                connection = await subject.dial(subject.master_address)
                await subject.register_on(connection)
            except (Kicked, AuthenticationFailed, ProtocolError) as exc:
                if connection is not None:
                    connection.abort()
                failure: PCCLError = exc
                if isinstance(exc, ProtocolError) and not isinstance(exc, MasterUnreachable):
                    failure = MasterUnreachable(f"the master at {subject.master_address} answered the "
                                                f"reconnection with a protocol error: {exc}")
                subject.fail(failure)
                return
            except (TransportError, MasterUnreachable) as exc:
                if connection is not None:
                    connection.abort()
                last_error = exc
                log.debug("peer %x: reconnection attempt %d failed: %s", subject.peer_id, attempt, exc)
            else:
                subject.rejoined()
                return
            await trio.sleep(min(delay, max(0.0, deadline - trio.current_time())))
