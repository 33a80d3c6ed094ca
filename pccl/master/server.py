"""The master: a thin Trio shell around :class:`pccl.protocol.master.machine.MasterState`.

One task per connection runs the framed handshake (magic, version, run token), then reads
messages and feeds them to the machine; a writer task per connection sends what the machine
says when the socket does not take it at once.  One timer task feeds ``Tick`` at the machine's
deadline, and one heartbeat task sends a ``Heartbeat`` to each connection that has been sent
nothing for most of ``Config.heartbeat_interval`` (a peer only needs to hear from the master
within every interval; a peer busy with votes hears those), so no connection costs a task
wake-up of its own for its heartbeats.
Everything the machine decides happens synchronously inside :meth:`_MasterServer.feed`, so no
locks are needed: Trio runs one task at a time.  The shell executes the machine's effects and
re-derives nothing: what the status page counts and lists (joins, acceptances, ops' and syncs'
ends, the bytes a sync planned) arrives as the machine's facts, and the peers' heartbeat
reports are the machine's to keep (``MasterState.reports``).

Bad input never takes the master down: a connection whose handshake fails is closed and logged;
a connection that sends an undecodable or oversized frame becomes a ``ProtocolViolation`` event,
which the machine turns into a kick of that peer only; a peer that stops reading (its outbox
fills up) is kicked too.  As a last line of defence, any other exception (a bug) escaping one
connection's tasks is logged with its traceback and closes that connection only.

Connections that proved nothing: the port faces the internet, so it is served by
:func:`pccl.net.serving.serve_listener` (see :mod:`pccl.net.admission` for the rule).  A
connection holds one of ``max_pending_handshakes`` (default :data:`MAX_PENDING_HANDSHAKES`)
slots from its handshake until the machine registers it (a ``Register`` it takes: the fact
``PeerJoined``; a relay's ``RelayRegister``: ``RelayJoined``) — without a run token the handshake proves nothing — and one source address
holds at most :data:`MASTER_LIMITS` ``.per_address`` of them; the others are accepted and
parked (a descriptor each, nothing more) until a slot frees, so idle or slow connections from
one address never delay a join from another.  The handshake's first
bytes are due within ``Config.first_bytes_timeout``, all of it within ``Config.connect_timeout``,
and the machine gives a connection ``Config.peer_timeout`` to register (heartbeats do not extend
it).  Refused connections are logged once each, rate-limited (:class:`pccl.net.serving.RefusalLog`).
Running out of descriptors anyway makes the listener back off and retry
(:meth:`pccl.net.tcp.TcpListener.accept`) rather than stop.  Kick details are clipped to
:data:`pccl.protocol.codec.MAX_DETAIL` characters.

The master's own relay (``relay=True``, ``pccl master --relay``): the master is relay 1 of the
run (:mod:`pccl.protocol.master.paths`) on its own port.  A connection whose first message is a
``RelayJoin`` goes to a :class:`pccl.relay.hub.RelayHub` instead of the machine (with the same
admission slot, released once the join is valid); every other connection is served as before.
The first message is then due within ``Config.connect_timeout`` of the handshake.  What the hub
forwarded reaches the machine's relay view whenever the status is read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import random
import signal
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from typing import Any

import trio

from ..config import DEFAULT_MASTER_PORT, Config
from .._groups import single_exception
from ..errors import (
    AuthenticationFailed,
    FrameTooLarge,
    InvalidArgument,
    KickReason,
    PCCLError,
    ProtocolError,
    TransportError,
)
from ..net.admission import AdmissionLimits
from ..net.base import Listener, Network, Stream, parse_address
from ..net.framed import FramedConnection, accept_framed
from ..net.serving import HandshakeSlot, RefusalLog, admission_for, serve_listener
from ..protocol.master import machine as ms
from ..protocol import status as st
from ..protocol.codec import MAX_DETAIL, clip_text
from ..protocol import messages as m
from ..relay.hub import RelayHub
from .connection import OUTBOX_LIMIT, Connection, OutboxItem
from .status_book import StatusBook

__all__ = ["Master", "MasterStatistics", "serve_master", "open_master", "run_master", "MAX_PENDING_HANDSHAKES",
           "MASTER_LIMITS"]

log = logging.getLogger(__name__)

#: Scheduler turns the timer gives the connections' readers before a deadline removes a peer.
_READER_TURNS = 10
#: Connections allowed between accept and ``Register`` at once; more are parked until a slot
#: frees.  Each handshake takes a few round trips, so 512 admit a burst of thousands of joining
#: peers within seconds while bounding what idle connections can hold.
MAX_PENDING_HANDSHAKES = 512
#: The master's admission limits (``pending`` is ``max_pending_handshakes``): a source address
#: gets an eighth of the slots — a whole cluster behind one NAT joins in a few rounds — and four
#: thousand connections may wait (all within a quarter of the descriptor limit, see
#: :func:`pccl.net.serving.descriptor_budget`).
MASTER_LIMITS = AdmissionLimits(pending=MAX_PENDING_HANDSHAKES, per_address=64, waiting=4096)


@dataclasses.dataclass(frozen=True)
class MasterStatistics:
    """A snapshot of the master's counters."""

    connections: int
    registered_peers: int
    accepted_peers: int
    kicks: int
    handshake_failures: int
    #: Connections closed because of an unexpected exception (a bug, logged with its traceback).
    #: Always 0 in a correct master: the simulator and tests should treat more as a failure.
    internal_errors: int = 0
    #: Connections between accept and ``Register`` (holding a handshake slot) right now.
    unproven_connections: int = 0
    #: Connections accepted and parked until a handshake slot frees, right now.
    waiting_connections: int = 0
    #: Connections refused so far (handshake failed, never registered, or dropped unserved).
    refused_connections: int = 0


class Master:
    """A running master (from :func:`open_master` or ``nursery.start(serve_master, ...)``).

    ``address`` is the bound ``host:port`` (the real port when 0 was asked for).
    """

    def __init__(self, server: _MasterServer) -> None:
        self._server = server
        _SERVERS[self] = server

    @property
    def address(self) -> str:
        return self._server.listener.address

    def statistics(self) -> MasterStatistics:
        return self._server.statistics()

    def status(self) -> dict[str, Any]:
        """The run's status as ``/status.json`` serves it (schema in :mod:`pccl.protocol.status`)."""
        return self._server.status()

    @property
    def status_address(self) -> str | None:
        """The ``host:port`` the status endpoint is bound to (None when it is off)."""
        return self._server.status_address

    async def aclose(self) -> None:
        """Stop serving: close the listener and every connection.  Idempotent."""
        self._server.stop()
        await trio.lowlevel.checkpoint()


#: Master -> the server under it (read by :func:`server_of`; the master keeps no public handle
#: on it).
_SERVERS: weakref.WeakKeyDictionary[Master, _MasterServer] = weakref.WeakKeyDictionary()


def server_of(master: Master) -> _MasterServer:
    """The server under ``master``, for pccl's own test hooks (:mod:`pccl.testing`): no
    compatibility promise, not part of the public face."""
    return _SERVERS[master]


class _MasterServer:
    def __init__(self, listener: Listener, *, token: str | bytes | None, config: Config,
                 rng: random.Random | None, max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
                 status: str | None = None, relay: bool = False) -> None:
        self.listener = listener
        self.status_request = status
        limits = dataclasses.replace(MASTER_LIMITS, pending=max_pending_handshakes,
                                     per_address=min(MASTER_LIMITS.per_address, max_pending_handshakes))
        self.admission = admission_for(limits, wait_timeout=config.connect_timeout)
        self.refusals = RefusalLog("master", logger=log)
        self.token = token
        self.config = config
        self.nonce_source = rng  # None: cryptographic nonces (secrets); a seeded RNG in the simulator
        self.state = ms.MasterState(rng=rng if rng is not None else random.Random(), peer_timeout=config.peer_timeout,
                                    own_relay=relay, reconnect_timeout=config.master_reconnect_timeout)
        #: The master's own relay (``relay=True``), else None.
        self.hub = RelayHub(config) if relay else None
        self.conns: dict[int, Connection] = {}
        self.next_conn_id = 1
        self.timer_at: float | None = None
        self.timer_changed = trio.Event()
        self.events: collections.deque[ms.Event] = collections.deque()
        self.feeding = False
        self.fed_at = 0.0  # Trio's time when the current feed began
        self.kicks = 0
        self.handshake_failures = 0
        self.internal_errors = 0
        self.scope = trio.CancelScope()
        #: Trio's time, read from the run's clock itself (``trio.current_time()`` is this call
        #: behind two more; the master reads it for every message).
        self.trio_time = trio.lowlevel.current_clock().current_time
        self.started_at = self.loop_seen = trio.current_time()
        self.lost = 0.0  # the time this loop was seen not to run (see clock)
        self.status_address: str | None = None
        #: What the status page shows beside the machine's views (events, counters, last syncs).
        self.book = StatusBook(self.clock)

    # --- the machine ------------------------------------------------------------------------------

    def feed(self, event: ms.Event) -> None:
        """Hand ``event`` to the machine and execute its effects (synchronously)."""
        if self.feeding or self.events:  # after the events queued before it (follow-ups, or a
            self.events.append(event)   # heartbeat's full outbox), in order
            if self.feeding:  # an effect produced a follow-up event: the outer loop handles it
                return
            event = self.events.popleft()
        self.feeding = True
        self.fed_at = now = self.trio_time()  # (read once: the sends note it too)
        try:
            while True:  # (a message usually comes alone: no trip through the queue)
                for effect in self.state.handle(event, self.clock(now)):
                    self._execute(effect)
                if not self.events:
                    break
                event = self.events.popleft()
        finally:
            self.feeding = False

    def clock(self, now: float | None = None) -> float:
        """The machine's time: Trio's, less the time this loop was seen not to run.  The
        heartbeat task runs every quarter interval; a longer gap between two readings means the
        loop was blocked or starved of CPU (a busy host), and the peers' messages waited unread
        meanwhile: that time is not their silence, so no deadline counts it.  ``now``: Trio's
        time, if the caller just read it."""
        if now is None:
            now = trio.current_time()
        stalled = now - self.loop_seen - self.config.heartbeat_interval
        if stalled > 0:
            self.lost += stalled
        self.loop_seen = now
        return now - self.lost

    def _execute(self, effect: ms.Effect) -> None:
        if isinstance(effect, ms.Send):
            conn = self.conns.get(effect.conn_id)
            if conn is not None and not conn.closing:
                self._enqueue(conn, effect.msg)
        elif isinstance(effect, ms.SetTimer):
            # Most messages move the earliest deadline *later* (the sender was just heard): the
            # timer task then wakes at the old deadline and goes back to sleep, which spares a
            # wake-up and a cancel scope per message.  An earlier deadline wakes it now.
            earlier = effect.at is not None and (self.timer_at is None or effect.at < self.timer_at)
            self.timer_at = effect.at
            if earlier:
                self.timer_changed.set()
        elif isinstance(effect, (ms.Kick, ms.Close)):
            conn = self.conns.get(effect.conn_id)
            if conn is None or conn.closing:
                return
            if isinstance(effect, ms.Close):
                self._note_removed(conn, "left", "LEFT", "left the run")
                conn.close(None)
                return
            self.kicks += 1
            self._note_removed(conn, "kick", effect.reason.name, effect.detail)
            detail = clip_text(effect.detail, MAX_DETAIL)  # may quote peer input: keep it sendable
            if not conn.slot.released:  # never registered: one refusal among many, rate-limited
                conn.slot.refuse(f"connection {conn.conn_id}: {effect.reason.name}: {detail}")
            else:
                log.warning("kicking %s (connection %d): %s: %s", conn.framed.remote_address, conn.conn_id,
                            effect.reason.name, detail)
            conn.close(m.KickNotice(int(effect.reason), detail))
        else:
            self._record(effect)

    # --- what the status page shows (cheap bookkeeping beside the machine) --------------------

    def _record(self, fact: ms.Fact) -> None:
        """Record what the machine reports (the status page's counters, events and syncs)."""
        if isinstance(fact, ms.OpEnded):
            self.book.op_ended(fact)
            return
        if isinstance(fact, ms.SyncEnded):
            self.book.sync_ended(fact)
            return
        conn = self.conns.get(fact.conn_id)
        if conn is None or conn.closing:
            return
        if isinstance(fact, ms.RelayJoined):
            conn.slot.release()  # a relay proved itself as a peer does; it is no run member
            return
        if isinstance(fact, ms.PeerJoined):
            conn.slot.release()  # the peer made itself known: no longer an anonymous connection
            conn.peer_id, conn.group = fact.peer_id, fact.group
            self.book.joined(fact.peer_id, fact.group, conn.framed.remote_address, fact.rejoined)
        else:
            self.book.accepted(conn.peer_id, conn.group, fact.world_size)

    def _note_removed(self, conn: Connection, kind: str, reason: str, detail: str) -> None:
        if conn.peer_id is None or conn.removed:
            return  # never registered: not a peer of the run (refusals are logged, rate-limited)
        conn.removed = True
        self.book.removed(conn.peer_id, conn.group, kind, reason, detail)

    def status(self) -> dict[str, Any]:
        if self.hub is not None:
            self.state.relay_forwarded(self.hub.stats())
        counters = self.book.counters(*self.state.reported_bytes())
        reports = {cid: st.PeerReport.of(heartbeat) for cid, heartbeat in self.state.reports().items()}
        return st.snapshot(self.state, now=self.clock(), started_at=self.started_at,
                           address=self.listener.address, reports=reports, events=list(self.book.events),
                           counters=counters, syncs=self.book.last_syncs, token_required=self.token is not None,
                           tls=self.config.tls_server_context is not None)

    def _enqueue(self, conn: Connection, msg: m.Message) -> None:
        if not conn.enqueue(msg, self.fed_at if self.feeding else None):
            self.events.append(ms.ProtocolViolation(conn.conn_id, KickReason.TIMEOUT,
                                                    f"not reading: {OUTBOX_LIMIT} messages queued"))

    def statistics(self) -> MasterStatistics:
        peers = self.state.peers()
        return MasterStatistics(
            connections=len(self.conns),
            registered_peers=sum(p.status is ms.PeerStatus.REGISTERED for p in peers),
            accepted_peers=sum(p.status is ms.PeerStatus.ACCEPTED for p in peers),
            kicks=self.kicks,
            handshake_failures=self.handshake_failures,
            internal_errors=self.internal_errors,
            unproven_connections=self.admission.pending,
            waiting_connections=self.admission.waiting,
            refused_connections=self.refusals.total,
        )

    def stop(self) -> None:
        self.scope.cancel()

    # --- tasks ------------------------------------------------------------------------------------

    async def run(self, task_status: trio.TaskStatus[Master]) -> None:
        with self.scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._timer)
                    nursery.start_soon(self._heartbeats)
                    if self.status_request is not None:
                        from .status_endpoint import StatusApp, serve_status

                        app = StatusApp(self.status, token=self.token)
                        self.status_address = await nursery.start(serve_status, self.status_request, app)
                    task_status.started(Master(self))
                    log.info("master listening on %s", self.listener.address)
                    await serve_listener(self.listener, self._connection_task, on_error=self._listener_failed,
                                         admission=self.admission, refusals=self.refusals)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None
            finally:
                with trio.CancelScope(shield=True):
                    await self.listener.aclose()

    @staticmethod
    def _listener_failed(exc: TransportError) -> None:
        log.error("master listener failed: %s", exc)
        raise exc

    async def _timer(self) -> None:
        while True:
            self.timer_changed = trio.Event()
            at = self.timer_at
            if at is None:
                await self.timer_changed.wait()
                continue
            with trio.move_on_at(at + self.lost):  # the machine's time is behind (see clock)
                await self.timer_changed.wait()
                continue
            if self.timer_at is None or self.timer_at > at or self.clock() < at:
                continue  # the deadline moved later meanwhile (see _execute), or the loop lost time
            # Before the deadline acts, the readers get a few scheduler turns to take in what
            # waits unread (the peers' messages, after a stall shorter than clock() notices).
            # Turns, not time, since the loop may stall again: a silent peer still goes.
            for _ in range(_READER_TURNS):
                await trio.lowlevel.checkpoint()
                if self.timer_at is None or self.timer_at > at:
                    break
            else:
                self.feed(ms.Tick())
            # A Tick at the deadline always removes someone or moves the deadline; if the clock
            # granularity left it unchanged, wait for a change instead of spinning.
            if self.timer_at == at:
                await trio.sleep(max(self.config.heartbeat_interval / 10, 0.001))

    async def _heartbeats(self) -> None:
        """What tells the peers the master is alive (they give up on it after
        ``Config.peer_timeout`` of silence; any message will do).  Every quarter interval, a
        ``Heartbeat`` to each connection sent nothing for three quarters of one: every peer hears
        from the master within each ``Config.heartbeat_interval`` (as long as the loop runs), and
        one busy with votes gets none.  A connection with messages still queued is skipped: they
        reach the peer before a heartbeat queued behind them could."""
        tick = self.config.heartbeat_interval / 4
        due = trio.current_time()
        while True:
            due += tick
            await trio.sleep_until(due)
            now = trio.current_time()
            self.clock()  # this loop runs: see clock
            due = max(due, now - tick)  # after a blocked loop: no burst of ticks to catch up
            quiet_since = now - 3 * tick
            for conn in list(self.conns.values()):
                if conn.last_sent <= quiet_since and not conn.closing and not conn.queued:
                    self._enqueue(conn, m.Heartbeat())

    async def _connection_task(self, stream: Stream, slot: HandshakeSlot) -> None:
        """Serve one connection; an unexpected exception (a bug) closes it, never the master.

        ``trio.Cancelled``, ``KeyboardInterrupt`` and other ``BaseException``s propagate (also out
        of an exception group, whose ``Exception`` leaves are logged and dropped).
        """
        try:
            framed = await self._handshake(stream, slot)
            if framed is None:
                return
            first = None
            if self.hub is not None:
                first = await self._first_message(framed, slot)
                if first is None:
                    return
                if isinstance(first, m.RelayJoin):
                    await self.hub.serve(framed, first, slot)
                    return
            await self._serve_connection(framed, slot, first)
        except* Exception as group:
            self.internal_errors += 1
            log.error("connection from %s failed unexpectedly; closed it", stream.remote_address,
                      exc_info=group.exceptions[0] if len(group.exceptions) == 1 else group)
            stream.abort()

    async def _handshake(self, stream: Stream, slot: HandshakeSlot) -> FramedConnection | None:
        """The authenticated connection, or None (logged; the stream is closed) if it failed."""
        try:
            return await accept_framed(stream, token=self.token, config=self.config, nonce_source=self.nonce_source)
        except AuthenticationFailed as exc:
            self.handshake_failures += 1
            slot.refuse(exc, level=logging.WARNING)
        except PCCLError as exc:
            self.handshake_failures += 1
            slot.refuse(f"handshake failed: {exc}")
        return None

    async def _first_message(self, framed: FramedConnection, slot: HandshakeSlot) -> m.Message | None:
        """With a relay: the connection's first message, read before the machine hears of it (a
        relay join never reaches the machine), or None (refused, logged; the connection closed)."""
        try:
            with trio.fail_after(self.config.connect_timeout):
                return await framed.receive()
        except trio.TooSlowError:
            slot.refuse(f"no first message within {self.config.connect_timeout:g} s (Config.connect_timeout)")
        except PCCLError as exc:
            slot.refuse(f"first message: {exc}")
        framed.abort()
        return None

    async def _serve_connection(self, framed: FramedConnection, slot: HandshakeSlot,
                                first: m.Message | None = None) -> None:
        conn_id = self.next_conn_id
        self.next_conn_id += 1
        send, receive = trio.open_memory_channel[OutboxItem](OUTBOX_LIMIT)
        conn = Connection(conn_id, framed, send, trio.CancelScope(), slot, last_sent=trio.current_time())
        self.conns[conn_id] = conn
        try:
            with conn.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(conn.write, receive)
                    self.feed(ms.PeerConnected(conn_id, parse_address(framed.remote_address)[0]))
                    if first is not None:
                        self.feed(ms.MessageReceived(conn_id, first))
                    await self._reader(conn)
        finally:
            # Forget the connection first so that no effect of its own removal is sent to it.
            del self.conns[conn_id]
            self._note_removed(conn, "lost", "CONNECTION_LOST", "connection lost (closed or reset without a Leave)")
            self.feed(ms.PeerDisconnected(conn_id))  # ignored if the machine already removed it
            conn.framed.abort()

    async def _reader(self, conn: Connection) -> None:
        while not conn.closing:
            try:
                msg = await conn.framed.receive()
            except ProtocolError as exc:
                reason = KickReason.FRAME_TOO_LARGE if isinstance(exc, FrameTooLarge) else KickReason.PROTOCOL_ERROR
                self.feed(ms.ProtocolViolation(conn.conn_id, reason, str(exc)))
                break
            except TransportError as exc:
                if conn.slot.released:
                    log.info("connection %d (%s) lost: %s", conn.conn_id, conn.framed.remote_address, exc)
                else:
                    conn.slot.refuse(f"connection {conn.conn_id} lost before it registered: {exc}")
                conn.scope.cancel()
                return
            self.feed(ms.MessageReceived(conn.conn_id, msg))
        # Kicked or leaving: the writer delivers the notice and closes; stop reading meanwhile.
        await trio.sleep_forever()



async def serve_master(
    address: str = f"0.0.0.0:{DEFAULT_MASTER_PORT}",
    *,
    token: str | bytes | None = None,
    config: Config | None = None,
    network: Network | None = None,
    rng: random.Random | None = None,
    max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    status: str | None = None,
    relay: bool = False,
    task_status: trio.TaskStatus[Master] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as the master on ``address`` until cancelled (use with ``nursery.start``, which
    returns the :class:`Master`).

    ``token``: the run token every peer must prove (None: no authentication).  ``network``
    defaults to real TCP; ``rng`` (default: unseeded) draws peer ids and, when given, handshake
    nonces.  ``max_pending_handshakes`` caps connections in the handshake at once (see the module
    docstring; ``InvalidArgument`` below 1).  ``status``: ``HOST:PORT`` (or ``PORT``, on loopback)
    to serve the status page, ``/status.json`` and ``/metrics`` on (:mod:`pccl.master.status_endpoint`;
    they require ``token`` when there is one); None (the default) serves none.  ``relay``: the
    master also relays (it is relay 1 of the run, on its own port: peer pairs that cannot
    connect either way meet here; see :mod:`pccl.relay`).  Raises
    ``AddressInUse``/``TransportError`` if it cannot listen.  Cancellation closes the listener and
    every connection.
    """
    config = config or Config()
    if max_pending_handshakes < 1:
        raise InvalidArgument(f"max_pending_handshakes must be at least 1, got {max_pending_handshakes}")
    if network is None:
        from ..net.tcp import TcpNetwork

        network = TcpNetwork(config)
    listener = await network.listen(address)
    server = _MasterServer(listener, token=token, config=config, rng=rng,
                           max_pending_handshakes=max_pending_handshakes, status=status, relay=relay)
    await server.run(task_status)


@asynccontextmanager
async def open_master(
    address: str = f"0.0.0.0:{DEFAULT_MASTER_PORT}",
    *,
    token: str | bytes | None = None,
    config: Config | None = None,
    network: Network | None = None,
    rng: random.Random | None = None,
    max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
    status: str | None = None,
    relay: bool = False,
) -> AsyncIterator[Master]:
    """Run a master for the duration of the ``async with`` block; yields the :class:`Master`.

    Errors as for :func:`serve_master`; leaving the block stops the master.
    """
    try:
        async with trio.open_nursery() as nursery:
            master = await nursery.start(
                lambda task_status: serve_master(address, token=token, config=config, network=network, rng=rng,
                                                 max_pending_handshakes=max_pending_handshakes,
                                                 status=status, relay=relay, task_status=task_status))
            try:
                yield master
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        raise single_exception(group) from None


def run_master(address: str = f"0.0.0.0:{DEFAULT_MASTER_PORT}", *, token: str | bytes | None = None,
               config: Config | None = None, status: str | None = None, relay: bool = False) -> None:
    """Serve a master on ``address`` until SIGINT or SIGTERM, blocking (``pccl master`` runs
    this; arguments as for :func:`serve_master`).  Call it from the main thread, outside Trio.
    Errors as for :func:`serve_master`, never an ExceptionGroup."""
    config = config or Config()

    async def run() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(lambda task_status: serve_master(
                    address, token=token, config=config, status=status, relay=relay, task_status=task_status))
                if config.tls_server_context is not None:
                    log.info("TLS on: peers need a certificate of their own and the CA (Config.with_tls, $PCCL_TLS_*)")
                if token is None:
                    log.warning("no run token: any host can join this run (use --token or $PCCL_TOKEN)")
                async for signum in signals:
                    log.info("received %s, shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(run)
    except BaseExceptionGroup as group:
        raise single_exception(group) from None
