"""A relay process: joins peer pairs that cannot connect either way (``pccl relay``).

It listens on its own port for peers sent to it by the master's ``RelayOffer`` (each presents
``RelayJoin`` after the framed handshake with the run token, TLS where the run uses it; the
splice is :mod:`pccl.relay.hub`'s), and keeps one connection to the master: ``RelayRegister``
(where peers reach it) answered by ``RelayWelcome`` (its relay id), then a ``RelayStats`` every
``Config.heartbeat_interval`` as its heartbeat.  When that connection is lost (the master
restarted, a network fault), the relay keeps splicing the pairs it has and registers again, with
backoff (``Config.master_reconnect_backoff``), for as long as it runs: a master that comes back
gets it back.

Its port faces the internet like the master's, and is served the same way
(:func:`pccl.net.serving.serve_listener`): a connection holds a handshake slot until it presents
a valid join (one source address at most :data:`RELAY_LIMITS` ``.per_address`` of them, the
others parked), its first bytes are due within ``Config.first_bytes_timeout``, the handshake and
the join within ``Config.connect_timeout``, and frames before the splice are at most
:data:`MAX_JOIN_FRAME` bytes (a frame that announces more is refused before anything is read or
allocated).  So idle or half-sent connections cost a descriptor each for a few seconds, and
memory is bounded by the rendezvous' limits and :data:`~pccl.relay.hub.SPLICE_BUFFER` per pair.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import random
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from .._groups import single_exception
from ..config import Config
from ..errors import AuthenticationFailed, InvalidArgument, KickReason, PCCLError, TransportError
from ..net.admission import AdmissionLimits
from ..net.base import Network, Stream, format_address, parse_address
from ..net.framed import accept_framed, open_framed
from ..net.serving import HandshakeSlot, RefusalLog, admission_for, serve_listener
from ..protocol import messages as m
from ..protocol.relay import RELAY_JOIN_LIMITS, JoinLimits
from .hub import RelayHub

__all__ = ["Relay", "RelayStatistics", "serve_relay", "open_relay", "run_relay", "DEFAULT_RELAY_PORT",
           "RELAY_LIMITS", "MAX_JOIN_FRAME"]

log = logging.getLogger(__name__)

#: The port ``pccl relay`` listens on by default (the master's is 48148).
DEFAULT_RELAY_PORT = 48147
#: Largest frame a relay reads before a splice (a join is a few dozen bytes).
MAX_JOIN_FRAME = 4096
#: A relay's admission limits: a whole NAT of peers joins at once from one address (each
#: relayed connection is a join), and thousands may wait parked.
RELAY_LIMITS = AdmissionLimits(pending=512, per_address=64, waiting=4096)


@dataclasses.dataclass(frozen=True)
class RelayStatistics:
    """A snapshot of what a relay did (:meth:`Relay.statistics`)."""

    #: The id the master gave this relay; None while it is not registered.
    relay_id: int | None
    #: Pairs spliced now, and joins waiting for their partner.
    pairs: int
    waiting: int
    #: Pairs spliced since the start, joins refused, payload bytes forwarded.
    pairs_total: int
    refused: int
    forwarded_bytes: int
    #: Times the relay registered with a master (1 + re-registrations after losing it).
    registrations: int


class Relay:
    """A running relay (from :func:`serve_relay` via ``nursery.start``, or :func:`open_relay`)."""

    def __init__(self, server: _RelayServer) -> None:
        self._server = server

    @property
    def address(self) -> str:
        """``HOST:PORT`` the relay listens on (the bound port when 0 was asked for)."""
        return self._server.listener.address

    @property
    def relay_id(self) -> int | None:
        """The id of the current registration with the master (None while unregistered)."""
        return self._server.relay_id

    def statistics(self) -> RelayStatistics:
        return self._server.statistics()

    async def wait_registered(self) -> int:
        """Wait until the relay is registered with a master; its relay id."""
        while self._server.relay_id is None:
            await self._server.registered_changed.wait()
        return self._server.relay_id


class _RelayServer:
    def __init__(self, network: Network, listener, *, master: str, advertise: tuple[str, int],
                 token: str | bytes | None, config: Config, limits: JoinLimits, rng: random.Random | None) -> None:
        self.network = network
        #: Backoff jitter; with it, handshake nonces too (None: unseeded jitter, cryptographic
        #: nonces).  A seeded one makes a simulated relay replay bit for bit.
        self.rng = rng
        self.listener = listener
        self.master = master
        self.advertise = advertise
        self.token = token
        self.config = config
        self.join_config = dataclasses.replace(config, max_frame_size=MAX_JOIN_FRAME)
        self.hub = RelayHub(config, limits=limits)
        self.admission = admission_for(RELAY_LIMITS, wait_timeout=config.connect_timeout)
        self.refusals = RefusalLog("relay", logger=log)
        self.relay_id: int | None = None
        self.registrations = 0
        self.registered_changed = trio.Event()

    def statistics(self) -> RelayStatistics:
        c = self.hub.counters
        return RelayStatistics(self.relay_id, self.hub.pairs, self.hub.waiting, c.pairs_total, c.refused,
                               c.forwarded_bytes, self.registrations)

    def _set_registered(self, relay_id: int | None) -> None:
        self.relay_id = relay_id
        self.registered_changed.set()
        self.registered_changed = trio.Event()

    async def run(self, task_status: trio.TaskStatus[Relay]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._master_link)
                task_status.started(Relay(self))
                log.info("relay listening on %s (peers are told %s), serving master %s", self.listener.address,
                         format_address(*self.advertise) if self.advertise[0] else f"*:{self.advertise[1]}",
                         self.master)
                await serve_listener(self.listener, self._connection, on_error=self._listener_failed,
                                     admission=self.admission, refusals=self.refusals)
        except BaseExceptionGroup as group:
            raise single_exception(group) from None
        finally:
            with trio.CancelScope(shield=True):
                await self.listener.aclose()

    @staticmethod
    def _listener_failed(exc: TransportError) -> None:
        log.error("relay listener failed: %s", exc)
        raise exc

    # --- peers ------------------------------------------------------------------------------------

    async def _connection(self, stream: Stream, slot: HandshakeSlot) -> None:
        deadline = trio.current_time() + self.config.connect_timeout
        try:
            conn = await accept_framed(stream, token=self.token, config=self.join_config, nonce_source=self.rng)
        except AuthenticationFailed as exc:
            slot.refuse(exc, level=logging.WARNING)
            return
        except PCCLError as exc:
            slot.refuse(f"handshake failed: {exc}")
            return
        try:
            with trio.fail_at(deadline):
                first = await conn.receive()
        except trio.TooSlowError:
            slot.refuse(f"no join within {self.config.connect_timeout:g} s (Config.connect_timeout)")
            conn.abort()
            return
        except PCCLError as exc:
            slot.refuse(f"no join: {exc}")
            conn.abort()
            return
        if not isinstance(first, m.RelayJoin):
            slot.refuse(f"the first message was {type(first).__name__}, not RelayJoin (this is a relay)")
            conn.abort()
            return
        await self.hub.serve(conn, first, slot)

    # --- the master -------------------------------------------------------------------------------

    async def _master_link(self) -> None:
        """Register with the master and heartbeat it; again after every loss, with backoff."""
        rng = self.rng if self.rng is not None else random.Random()
        low, high = self.config.master_reconnect_backoff
        delay = low
        failures = 0
        while True:
            try:
                await self._registered_session()
                delay = low
                failures = 0
            except (PCCLError, _MasterGone) as exc:
                failures += 1
                # The first failure of a streak is a warning; the rest of it is repeated quietly.
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "relay: master %s: %s; registering again (backoff up to %g s)", self.master, exc, high)
            finally:
                if self.relay_id is not None:
                    self._set_registered(None)
            await trio.sleep(delay * (0.5 + rng.random()))
            delay = min(high, delay * 2)

    async def _registered_session(self) -> None:
        config = self.config
        conn = await open_framed(self.network, self.master, token=self.token, config=config, nonce_source=self.rng)
        try:
            with trio.fail_after(config.connect_timeout):
                await conn.send(m.RelayRegister(*self.advertise))
                answer = await conn.receive()
                while isinstance(answer, m.Heartbeat):
                    answer = await conn.receive()
            if isinstance(answer, m.KickNotice):
                raise _MasterGone(f"refused the registration: {_kick_text(answer)}")
            if not isinstance(answer, m.RelayWelcome):
                raise _MasterGone(f"answered RelayRegister with {type(answer).__name__} "
                                  "(a master of another protocol version?)")
            self.registrations += 1
            self._set_registered(answer.relay_id)
            log.info("relay registered with master %s (instance %x) as relay %d", self.master, answer.instance,
                     answer.relay_id)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._heartbeats, conn)
                    await self._listen_to_master(conn)
            except BaseExceptionGroup as group:
                # The master went silent or reset the connection: one error for _master_link's
                # retry (a group would escape it and end the relay).
                raise single_exception(group) from None
        except trio.TooSlowError:
            raise _MasterGone(f"no RelayWelcome within {config.connect_timeout:g} s") from None
        finally:
            conn.abort()

    async def _heartbeats(self, conn) -> None:
        while True:
            await conn.send(self.hub.stats())
            await trio.sleep(self.config.heartbeat_interval)

    async def _listen_to_master(self, conn) -> None:
        while True:
            with trio.move_on_after(self.config.peer_timeout) as silence:
                msg = await conn.receive()
            if silence.cancelled_caught:
                raise _MasterGone(f"silent for {self.config.peer_timeout:g} s (Config.peer_timeout)")
            if isinstance(msg, m.KickNotice):
                raise _MasterGone(f"closed the registration: {_kick_text(msg)}")
            # Heartbeats and anything newer are only signs of life.


class _MasterGone(Exception):
    pass


def _kick_text(notice: m.KickNotice) -> str:
    try:
        reason = KickReason(notice.reason).name
    except ValueError:
        reason = str(notice.reason)
    return f"{reason}: {notice.detail}" if notice.detail else reason


def _is_bare_host(text: str) -> bool:
    if ":" not in text:
        return True
    try:
        return isinstance(ipaddress.ip_address(text.strip("[]")), ipaddress.IPv6Address)
    except ValueError:
        return False


def _advertised(listen_host: str, port: int, advertise: str | None) -> tuple[str, int]:
    """What the relay registers: ``advertise`` (``HOST:PORT``, ``HOST`` or ``:PORT``), else
    the listening host unless it is a wildcard (then "": the host the master sees)."""
    host, chosen = "", port
    try:
        wildcard = ipaddress.ip_address(listen_host).is_unspecified
    except ValueError:
        wildcard = listen_host == ""
    if not wildcard:
        host = listen_host
    if advertise:
        if advertise.startswith(":") and advertise[1:].isdigit():
            chosen = int(advertise[1:])
        elif _is_bare_host(advertise):
            host = advertise.strip("[]")
        else:
            host, chosen = parse_address(advertise)
    if not 0 < chosen < 65536:
        raise InvalidArgument(f"relay advertise port must be 1-65535, got {chosen}")
    return host, chosen


async def serve_relay(
    master: str,
    listen: str = f"0.0.0.0:{DEFAULT_RELAY_PORT}",
    *,
    advertise: str | None = None,
    token: str | bytes | None = None,
    config: Config | None = None,
    network: Network | None = None,
    limits: JoinLimits = RELAY_JOIN_LIMITS,
    rng: random.Random | None = None,
    task_status: trio.TaskStatus[Relay] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as a relay of the run whose master is at ``master`` (``HOST:PORT``), listening on
    ``listen``, until cancelled (use with ``nursery.start``, which returns the :class:`Relay`).

    ``advertise``: where peers reach the relay, when that is not the listening address
    (``HOST:PORT``, a bare ``HOST``, or ``:PORT``); by default the listening host, or the host
    the master sees the relay's connection come from when it listens on a wildcard address.
    ``token``: the run token (the master's and every peer's).  ``config``: timeouts, TLS
    (``Config.with_tls``: the relay's certificate must name the address peers dial) and the
    master reconnect backoff.  ``network`` defaults to real TCP; ``rng`` (default: unseeded)
    draws the reconnect backoff's jitter and, when given, handshake nonces (as
    :func:`pccl.serve_master`'s: a simulated relay passes its host's seeded one).  Raises ``AddressInUse`` or
    ``TransportError`` if it cannot listen; a master it cannot reach is retried (logged) for as
    long as the relay runs.  Cancellation closes the listener and every splice.
    """
    config = config or Config()
    if network is None:
        from ..net.tcp import TcpNetwork

        network = TcpNetwork(config)
    parse_address(master)
    listener = await network.listen(listen)
    try:
        listen_host = parse_address(listen)[0]
        bound = parse_address(listener.address)[1]
        chosen = _advertised(listen_host, bound, advertise)
    except BaseException:
        await listener.aclose()
        raise
    server = _RelayServer(network, listener, master=master, advertise=chosen, token=token, config=config,
                          limits=limits, rng=rng)
    await server.run(task_status)


@asynccontextmanager
async def open_relay(master: str, listen: str = "127.0.0.1:0", **kwargs) -> AsyncIterator[Relay]:
    """Run a relay for the duration of the ``async with`` block (arguments as for
    :func:`serve_relay`); yields the :class:`Relay`."""
    try:
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(lambda task_status: serve_relay(master, listen, task_status=task_status,
                                                                        **kwargs))
            try:
                yield relay
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise single_exception(group) from None


def run_relay(master: str, listen: str = f"0.0.0.0:{DEFAULT_RELAY_PORT}", *, advertise: str | None = None,
              token: str | bytes | None = None, config: Config | None = None) -> None:
    """Serve a relay until SIGINT or SIGTERM, blocking (``pccl relay`` runs this; arguments as
    for :func:`serve_relay`).  Call it from the main thread, outside Trio."""

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: serve_relay(
                    master, listen, advertise=advertise, token=token, config=config, task_status=task_status))
                if token is None:
                    log.warning("no run token: any host can use this relay (use --token or $PCCL_TOKEN)")
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    except BaseExceptionGroup as group:
        raise single_exception(group) from None
