"""The peer session: one peer's connection to the master and everything that hangs on it.

A session holds one framed connection to the master at a time.  A reader task receives every
master message and dispatches it: votes are answered through waiters (so ``are_peers_pending()``
can run while collectives use the same connection), ``ConnectToPeers`` starts (or restarts) the
ring set-up in the background (:mod:`pccl._peer.wiring`), collective messages are routed by tag
to the all-reduce and sync messages to the running sync (:meth:`PeerSession.open_route`,
:meth:`PeerSession.open_sync_route`), and a ``KickNotice`` fails every pending and later call.
A heartbeat task (:func:`run_heartbeat`) keeps the master informed and notices a silent one.

Losing the master (SPEC §3 "Master restart").  When the connection breaks or the master falls
silent, and ``Config.master_reconnect_timeout`` allows it, the session keeps its state and its
listeners and reconnects to the same address with jittered exponential backoff, registering
again with its old peer id (a restarted master gives it back).  Each successful registration
starts a new *master epoch*.  What was in flight belonged to the old epoch and ends: the routes
of collectives and of a sync close and their operations see :class:`~pccl._peer.host.MasterLost`
(the all-reduce turns it into ``CollectiveAborted``, the sync into ``SharedStateSyncFailed``; both
retryable), a pending-peers query is asked again, and an outstanding topology vote becomes the
wait for this peer's acceptance by the new master — which is what an ``update_topology()`` of a
peer that (re)joins means.  Calls made meanwhile wait in :meth:`PeerSession.ready`.  Once the
policy's deadline passes, the session fails with ``MasterUnreachable`` like a session that may
not reconnect at all.  A kick, a protocol error from the master or a refused token are final.

The session implements :class:`~pccl._peer.host.PeerHost`, the interface its services use, and
owns the phase rule (:mod:`pccl._peer.phase`) that every call consults before it starts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import trio

from ..config import Config
from ..errors import (
    AuthenticationFailed,
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    MasterUnreachable,
    PCCLError,
    PhaseMismatch,
    ProtocolError,
    TransportError,
)
from ..net.admission import Admission
from ..net.base import Listener, Network, Stream, format_address, parse_address
from ..net.framed import FramedConnection, accept_framed, open_framed
from ..protocol import messages as m
from .probes import ProbeService
from .host import CollectiveRoute, Counters, MasterLost
from .ring_connections import P2PLinks
from .phase import PhaseRule
from .wiring import RingWiring

__all__ = ["PeerSession", "run_heartbeat"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Scheduler turns the heartbeat task gives the reader before it calls a quiet master silent
#: (the reader needs two or three to take in a message waiting on the socket).
_READER_TURNS = 10

#: Collective messages the reader routes by tag.
_COLLECTIVE_REPLIES = (m.CollectiveCommence, m.CollectiveComplete, m.CollectiveAbort, m.CollectiveRejected)
#: Shared-state messages the reader routes to the running sync.
_SYNC_REPLIES = (m.SyncPlan, m.SyncComplete, m.SyncRejected)
#: Capacity of a collective route and of the sync route: the master sends a handful per op.
_ROUTE_CAPACITY = 16
_SYNC_ROUTE_CAPACITY = 8


class _Waiter(Generic[_T]):
    """One outstanding answer from the master."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self._value: _T | None = None
        self._error: PCCLError | None = None

    def set(self, value: _T) -> None:
        if not self._event.is_set():
            self._value = value
            self._event.set()

    def fail(self, error: PCCLError) -> None:
        if not self._event.is_set():
            self._error = error
            self._event.set()

    async def wait(self) -> _T:
        await self._event.wait()
        if self._error is not None:
            raise fresh_error(self._error)
        return self._value  # type: ignore[return-value]


def kicked_error(notice: m.KickNotice) -> Kicked:
    try:
        reason = KickReason(notice.reason)
    except ValueError:  # a newer master's reason code
        reason = KickReason.UNSPECIFIED
    return Kicked(reason, notice.detail)


def fresh_error(error: PCCLError) -> PCCLError:
    """A new instance of ``error`` to raise (raising one object from many places tangles tracebacks)."""
    if isinstance(error, Kicked):
        copy: PCCLError = Kicked(error.reason, error.detail)
    else:
        copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


class _Link:
    """One connection to the master (one epoch): what :func:`run_heartbeat` watches."""

    def __init__(self, session: PeerSession, connection: FramedConnection, epoch: int) -> None:
        self._session = session
        self.connection = connection
        self.epoch = epoch
        self.master_address = session.master_address
        self.last_heard = trio.current_time()
        #: When the last message to the master went out on this connection (heartbeats too).
        self.last_sent = self.last_heard
        self.scope = trio.CancelScope()

    @property
    def peer_id(self) -> int:
        return self._session.peer_id

    @property
    def config(self) -> Config:
        return self._session.config

    @property
    def failure(self) -> PCCLError | None:
        return self._session.failure

    def fail(self, error: PCCLError) -> None:
        self._session.connection_lost(self, error)

    async def send(self, msg: m.Message) -> None:
        await self._session.send(msg, epoch=self.epoch)

    def heartbeat(self) -> m.Heartbeat:
        return self._session.heartbeat()


class PeerSession:
    """One peer's membership in a run, below the public :class:`~pccl.Communicator`.

    Lifecycle (driven by :func:`pccl.open_communicator`): :meth:`connect` (p2p listener and the
    master connection), :meth:`register` (``Register`` → ``Welcome``; the background tasks
    start), :meth:`wait_accepted`; at the end :meth:`begin_close`, :meth:`leave` and
    :meth:`stop`.
    """

    def __init__(self, master_address: str, *, peer_group: int, token: str | bytes | None, config: Config,
                 network: Network, rng: random.Random | None, nursery: trio.Nursery) -> None:
        if not isinstance(peer_group, int) or not 0 <= peer_group < 2**32:
            raise InvalidArgument(f"peer_group must be an integer in [0, 2**32), got {peer_group!r}")
        self.master_address = master_address
        self.peer_group = peer_group
        self._peer_id = 0
        self._token = token
        self._config = config
        self._network = network
        self._nonce_source = rng
        #: Backoff jitter; the simulator's seeded RNG when given, so its runs stay deterministic.
        self._rng = rng if rng is not None else random.Random()
        self._nursery = nursery
        host, _ = parse_address(master_address)
        #: The local address listeners bind to (the master's address family).
        self.bind_host = "::" if ":" in host else "0.0.0.0"
        self._link: _Link | None = None
        self._wiring: RingWiring | None = None
        self._probes = ProbeService(self)
        self._failure: PCCLError | None = None
        self._closing = False
        #: Registrations so far (a new master connection each): operations remember theirs.
        self._epoch = 0
        self._master_instance = 0
        self._accepted = False  # by the master of the current epoch
        #: Whether this peer stands at the same place of the loop as its group: true once an
        #: update_topology completed (or open_communicator's acceptance) with the current master.
        #: A peer that rejoined a restarted master is not, until its next update_topology.
        self._aligned = False
        #: Accepted again after a reconnection while no update_topology waited for it: the next
        #: update_topology returns at once (the acceptance was this peer's topology update).
        self._rejoined = False
        self._lost_at: float | None = None  # while reconnecting: when the master was lost
        self._shared_state_port = 0
        self._ready_changed = trio.Event()
        self.membership = m.Membership(0, 0, 0, 0)
        #: This group's ring (endpoints, in order) as of the last topology update.
        self.ring_endpoints: tuple[m.PeerEndpoint, ...] = ()
        self._topology_waiter: _Waiter[m.TopologyComplete] | None = None
        self._pending_waiter: _Waiter[bool] | None = None
        self._routes: dict[int, CollectiveRoute] = {}
        self._abandoned_settled = trio.Event()  # set (and replaced) when an abandoned route closes
        self._sync_route: trio.MemorySendChannel[m.Message] | None = None
        self._phase = PhaseRule()
        self._counters = Counters()

    def heartbeat(self) -> m.Heartbeat:
        """A heartbeat that reports what the master's status page shows (no extra message)."""
        c = self._counters
        tx, rx = c.tx_bytes + c.sync_tx_bytes, c.rx_bytes + c.sync_rx_bytes
        if c.last_sync_revision is None:
            return m.Heartbeat(tx_bytes=tx, rx_bytes=rx)
        return m.Heartbeat(True, c.last_sync_revision, c.last_sync_tx_bytes, c.last_sync_rx_bytes, tx, rx)

    # --- PeerHost: who and what ----------------------------------------------------------------

    @property
    def peer_id(self) -> int:
        return self._peer_id

    @property
    def config(self) -> Config:
        return self._config

    @property
    def counters(self) -> Counters:
        return self._counters

    @property
    def phase(self) -> PhaseRule:
        return self._phase

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def links(self) -> P2PLinks:
        assert self._wiring is not None, "the session is not connected"
        return self._wiring.links

    @property
    def master_epoch(self) -> int:
        return self._epoch

    @property
    def master(self) -> FramedConnection | None:
        """The connection to the master (``None`` before :meth:`connect` and while reconnecting)."""
        return self._link.connection if self._link is not None else None

    @property
    def closing(self) -> bool:
        """Whether this session's close has begun (``aclose`` sets it: its ``Leave`` is out)."""
        return self._closing

    @closing.setter
    def closing(self, value: bool) -> None:
        self._closing = value

    @property
    def p2p_admission(self) -> Admission | None:
        """The admission rule of the p2p port (``None`` before the first ring set-up)."""
        return None if self._wiring is None else self._wiring.admission

    @property
    def p2p_listener(self) -> Listener | None:
        return self._wiring.listener if self._wiring is not None else None

    @property
    def failure(self) -> PCCLError | None:
        """The error this session failed with (``None`` while it is usable)."""
        return self._failure

    @property
    def reconnecting(self) -> bool:
        """Whether the master was lost and the session is trying to get it back."""
        return self._lost_at is not None

    @property
    def last_heard(self) -> float:
        """When the current master was last heard from (``trio.current_time()``)."""
        return self._link.last_heard if self._link is not None else trio.current_time()

    # --- PeerHost: failure ---------------------------------------------------------------------

    def raise_if_failed(self, epoch: int | None = None) -> None:
        if self._failure is not None:
            raise fresh_error(self._failure)
        if epoch is not None and (epoch != self._epoch or self._lost_at is not None):
            raise MasterLost(f"the connection to the master at {self.master_address} was lost")

    async def ready(self) -> None:
        await self._until_accepted()
        if not self._aligned:
            # Accepted again by a restarted master, but not at a step boundary: its group may be
            # anywhere in the loop.  Collectives and syncs fail (retryably) until this peer's
            # next update_topology, where the loops meet again.
            raise MasterLost(f"this peer rejoined the master at {self.master_address} after losing it; it "
                             "goes on from its next update_topology")

    async def _until_accepted(self) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self.raise_if_failed()
            if self._accepted:
                return
            await self._ready_changed.wait()

    def fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None:
        if self._failure is not None:
            return
        if self._closing and not isinstance(error, InvalidUsage):
            # aclose() has begun: its Leave makes the master hang up, which the reader or a
            # heartbeat may meet first.  That is the end this peer asked for, not a failure.
            error, cause = InvalidUsage("the communicator is closed"), None
        if cause is not None:
            error.__cause__ = cause
        self._failure = error
        self._lost_at = None
        if not isinstance(error, InvalidUsage):
            log.warning("peer %x: %s", self._peer_id, error)
        self._clear_topology_waiter(error)
        self._end_in_flight(error)
        if self._link is not None:
            self._link.scope.cancel()
        self._notify_ready()

    def leave_lockstep(self, error: PCCLError) -> None:
        self.fail(error)
        if self._link is not None:
            self._link.connection.abort()

    def _end_in_flight(self, error: PCCLError) -> None:
        """The master's answers to what is outstanding will not come: end the waits."""
        waiter, self._pending_waiter = self._pending_waiter, None
        if waiter is not None:
            waiter.fail(error)
        for route in self._routes.values():
            route.close()
        if self._sync_route is not None:
            self._sync_route.close()
            self._sync_route = None  # later sync messages are dropped, not sent into a closed channel

    def _notify_ready(self) -> None:
        self._ready_changed.set()
        self._ready_changed = trio.Event()

    # --- PeerHost: the master ------------------------------------------------------------------

    def _current_link(self, epoch: int | None) -> _Link:
        self.raise_if_failed(epoch)
        link = self._link
        if link is None or self._lost_at is not None:
            raise MasterLost(f"the connection to the master at {self.master_address} was lost")
        return link

    async def send(self, msg: m.Message, *, epoch: int | None = None, schedule_point: bool = True) -> None:
        link = self._current_link(epoch)
        try:
            # Cancellation before anything is written sends nothing; once the message went out
            # (send_nowait), flush() finishes it and never raises Cancelled for a whole frame.
            # Without a schedule point, a vote waits for its answer in its second scheduler
            # turn, not its third (in the simulator's fault-free default run, a third of the
            # training loop's turns were this yield).
            await trio.lowlevel.checkpoint_if_cancelled()
            if link.connection.send_nowait(msg):
                link.last_sent = trio.current_time()
                if schedule_point or link.connection.needs_flush:
                    await link.connection.flush()
            else:
                await link.connection.send(msg)
                link.last_sent = trio.current_time()
        except TransportError as exc:
            self.master_send_failed(exc, link)

    async def send_shielded(self, msg: m.Message, *, epoch: int | None = None) -> None:
        link = self._current_link(epoch)
        sent = link.connection.send_nowait(msg)
        if sent:
            link.last_sent = trio.current_time()
            if not link.connection.needs_flush:
                return  # written at once: nothing to shield (the common case, and a latency-bound one)
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self._config.peer_timeout
            try:
                if sent:
                    await link.connection.flush()
                else:
                    await link.connection.send(msg)
                    link.last_sent = trio.current_time()
            except TransportError as exc:
                self.master_send_failed(exc, link)
        if scope.cancelled_caught:
            self.connection_lost(link, MasterUnreachable(
                f"could not send {type(msg).__name__} to the master within {self._config.peer_timeout:g} s"))
            self.raise_if_failed(link.epoch)

    def master_send_failed(self, exc: TransportError, link: _Link | None = None) -> NoReturn:
        """A send to the master failed: the master is lost (or this peer is closing)."""
        link = link if link is not None else self._link
        error = MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}")
        error.__cause__ = exc
        if link is None:
            self.fail(error)
        else:
            self.connection_lost(link, error)
        self.raise_if_failed(link.epoch if link is not None else None)
        raise AssertionError("unreachable: the session has failed or lost its master")  # pragma: no cover

    def open_route(self, tag: int) -> CollectiveRoute:
        self.raise_if_failed()
        self._phase.begin_collective(tag)
        route = self._routes[tag] = CollectiveRoute(_ROUTE_CAPACITY)
        return route

    def close_route(self, tag: int) -> None:
        route = self._routes.pop(tag, None)
        if route is not None:
            route.close()
            if tag in self._phase.abandoned:
                self._abandoned_settled.set()
                self._abandoned_settled = trio.Event()
            self._phase.end_collective(tag)

    def abandon_route(self, tag: int) -> None:
        self._phase.abandon_collective(tag)

    async def settled(self, tag: int | None = None) -> None:
        while (tag in self._phase.abandoned) if tag is not None else self._phase.abandoned:
            await self._abandoned_settled.wait()

    def open_sync_route(self) -> trio.MemoryReceiveChannel[m.Message]:
        self.raise_if_failed()
        assert self._sync_route is None, "one sync at a time (the phase rule)"
        self._sync_route, receive = trio.open_memory_channel[m.Message](_SYNC_ROUTE_CAPACITY)
        return receive

    def close_sync_route(self) -> None:
        if self._sync_route is not None:
            self._sync_route.close()
            self._sync_route = None

    # --- PeerHost: tasks and connections -------------------------------------------------------

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        try:
            self._nursery.start_soon(fn, *args)
        except RuntimeError:  # the nursery is closing: the communicator is shutting down
            return False
        return True

    async def dial(self, address: str) -> FramedConnection:
        return await open_framed(self._network, address, token=self._token, config=self._config,
                                 nonce_source=self._nonce_source)

    async def accept(self, stream: Stream) -> FramedConnection:
        return await accept_framed(stream, token=self._token, config=self._config, nonce_source=self._nonce_source)

    async def listen(self, base_port: int) -> Listener:
        return await self._network.listen(format_address(self.bind_host, base_port),
                                          port_range=self._config.port_search_range)

    @property
    def master_instance(self) -> int:
        """The identity of the master this session is registered with (from its Welcome)."""
        return self._master_instance

    # --- votes ---------------------------------------------------------------------------------

    async def optimize_vote(self) -> None:
        """Vote to optimise this group's ring: probe the links the master names, report, and
        return once the solved ring is installed (its round completed).  A cancelled vote stands
        (the next call waits for it).  A master lost meanwhile: the call returns once the
        restarted master accepted this peer, with that master's ring, and until this peer's next
        ``update_topology`` (where the group's loops realign) it returns without measuring."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._accepted or self._rejoined:
            # Rejoined a restarted master: the group's loops realign at the next update_topology
            # (until then collectives abort at once, see ready()); an optimisation now would
            # wait for peers that are elsewhere in their step.  Nothing to measure yet.
            await self._until_accepted()
            log.info("peer %x: optimize_topology skipped: rejoined a restarted master, realigning at the "
                     "next update_topology", self._peer_id)
            return
        await self.settled()
        self.raise_if_failed()
        epoch = self._epoch
        if self._phase.join_topology("optimize"):
            waiter = self._topology_waiter
            assert waiter is not None
        else:
            waiter = self._new_topology_waiter("optimize")
            log.debug("peer %x: optimise vote", self._peer_id)
            try:
                await self.send(m.VoteOptimize(), epoch=epoch, schedule_point=False)
            except BaseException:
                if self._topology_waiter is waiter:
                    self._clear_topology_waiter(None)
                raise
        await waiter.wait()
        if self._epoch != epoch:
            # The master was lost meanwhile, and this was the acceptance by the next one: this
            # peer stays "rejoined" (see above) until its next update_topology.
            log.info("peer %x: optimize_topology ended by the loss of the master", self._peer_id)

    async def _probe_and_report(self, request: m.ProbeRequest, epoch: int) -> None:
        report = await self._probes.run(request)
        try:
            await self.send(report, epoch=epoch)
        except PCCLError:
            pass  # the communicator failed, or this probe's master is gone

    async def serve_probe(self, conn: FramedConnection, hello: m.ProbeHello) -> None:
        await self._probes.serve(conn, hello)

    async def topology_vote(self, *, accept_new_peers: bool) -> None:
        """Vote to accept pending peers (``True``: ``update_topology``) or to re-wire this
        group (``False``); return when the round completed.  A cancelled vote stands: the next
        call of the same kind waits for it (:mod:`pccl._peer.phase`).  A vote outstanding when
        the master is lost becomes the wait for this peer's acceptance by the master it
        reconnects to (a re-joining peer's topology update)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if not self._accepted or self._rejoined:
            # Reconnecting, or registered again and not yet accepted (or accepted meanwhile):
            # being accepted by the master is this peer's topology update — it returns when the
            # accepting peers' update_topology does, as a newcomer's open_communicator does,
            # and the loops meet again.  Not so for a re-wire inside an all-reduce: that call
            # belonged to the old master and ends (the all-reduce aborts).
            await self._until_accepted()
            if not accept_new_peers:
                raise MasterLost(f"the master at {self.master_address} was lost during a re-wire")
            self._rejoined = False
            self._aligned = True
            return
        await self.settled()  # a cancelled all-reduce's Init must not stand at the master
        self.raise_if_failed()
        kind = "accept" if accept_new_peers else "rewire"
        epoch = self._epoch
        if self._phase.join_topology(kind):
            waiter = self._topology_waiter
            assert waiter is not None
        else:
            waiter = self._new_topology_waiter(kind)
            log.debug("peer %x: topology vote (%s)", self._peer_id, kind)
            try:
                await self.send(m.VoteTopology(accept_new_peers), epoch=self._epoch, schedule_point=False)
            except MasterLost:
                pass  # the vote stands as the wait for acceptance by the next master
            except BaseException:
                # Not sent (cancelled while waiting to send, or the session failed): no vote stands.
                if self._topology_waiter is waiter:
                    self._clear_topology_waiter(None)
                raise
        await waiter.wait()
        if self._epoch != epoch:  # the master was lost meanwhile: this was the acceptance by the next
            if not accept_new_peers:
                raise MasterLost(f"the master at {self.master_address} was lost during a re-wire")
            self._rejoined = False
            self._aligned = True

    async def rewire(self) -> None:
        await self.topology_vote(accept_new_peers=False)

    async def are_peers_pending(self) -> bool:
        """Whether a registered peer waits to be accepted, answered once every accepted peer
        asked.  Legal in every phase; a cancelled query stands (the next call waits for it).

        When the master was lost (before or during the query): once the restarted master
        accepted this peer, ``True`` until its next ``update_topology`` — the group is being
        rebuilt, and ``update_topology`` is where this peer meets the others again.  Asking the
        new master instead would wait for peers that the restart put back in their step (a
        sync, an all-reduce) while they wait for this one.  While reconnecting it waits, bounded
        by ``Config.master_reconnect_timeout`` (then ``MasterUnreachable``)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.raise_if_failed()
        if self._lost_at is None and not self._rejoined:
            waiter = self._pending_waiter
            if waiter is None:
                waiter = self._pending_waiter = _Waiter()
                try:
                    await self.send(m.VotePeersPending(), epoch=self._epoch, schedule_point=False)
                except MasterLost:  # not sent: no vote stands at any master
                    if self._pending_waiter is waiter:
                        self._pending_waiter = None
                    waiter = None
                except BaseException:
                    if self._pending_waiter is waiter:
                        self._pending_waiter = None
                    raise
            if waiter is not None:
                try:
                    return await waiter.wait()
                except MasterLost:
                    pass
        await self._until_accepted()
        return True

    def _new_topology_waiter(self, kind: str) -> _Waiter[m.TopologyComplete]:
        self._phase.begin_topology(kind)
        waiter = self._topology_waiter = _Waiter()
        return waiter

    def _clear_topology_waiter(self, error: PCCLError | None) -> None:
        waiter, self._topology_waiter = self._topology_waiter, None
        if waiter is not None:
            self._phase.end_topology()
            if error is not None:
                waiter.fail(error)

    # --- lifecycle -----------------------------------------------------------------------------

    async def connect(self) -> None:
        """Bind the p2p listener and connect to the master.  ``MasterUnreachable`` if it cannot
        be reached; handshake errors (``AuthenticationFailed``, ``ProtocolError``) as they are."""
        listener = await self.listen(self._config.p2p_base_port)
        self._wiring = RingWiring(self, listener)
        try:
            connection = await self.dial(self.master_address)
        except TransportError as exc:
            raise MasterUnreachable(f"cannot reach the master at {self.master_address}: {exc}") from exc
        self._link = _Link(self, connection, self._epoch)

    async def register(self, *, shared_state_port: int) -> None:
        """Register with the master, wait for ``Welcome``, start the background tasks."""
        assert self._link is not None and self._wiring is not None, "connect() first"
        self._shared_state_port = shared_state_port
        self._new_topology_waiter("accept")  # our first TopologyComplete is the acceptance
        await self._register_on(self._link.connection)
        log.info("registered with the master at %s as peer %x (group %d)", self.master_address, self._peer_id,
                 self.peer_group)
        self.spawn(self._wiring.serve)

    async def _register_on(self, connection: FramedConnection) -> None:
        """``Register`` on a fresh master connection, ``Welcome`` back: a new epoch begins, with
        its reader and heartbeat.  Errors as for :meth:`register`."""
        assert self._wiring is not None
        try:
            await connection.send(m.Register(self.peer_group, self._wiring.listener.port, self._shared_state_port,
                                             previous_peer_id=self._peer_id))
            with trio.fail_after(self._config.connect_timeout):
                while True:
                    msg = await connection.receive()
                    if isinstance(msg, m.Welcome):
                        break
                    if isinstance(msg, m.KickNotice):
                        raise kicked_error(msg)
                    if not isinstance(msg, m.Heartbeat):
                        raise ProtocolError(f"the master sent {type(msg).__name__} before Welcome")
        except trio.TooSlowError:
            raise MasterUnreachable(f"the master at {self.master_address} did not answer the registration") from None
        except TransportError as exc:
            raise MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}") from exc
        self._epoch += 1
        self._peer_id = msg.peer_id
        self._master_instance = msg.instance
        self._wiring.reset(self._peer_id)
        link = self._link = _Link(self, connection, self._epoch)
        self.spawn(self._run_link, link)

    async def wait_accepted(self) -> None:
        """Wait until a topology round accepted this peer (the waiter :meth:`register` set)."""
        waiter = self._topology_waiter
        assert waiter is not None
        await waiter.wait()
        self._rejoined = False  # a restart while joining: this is the acceptance all the same
        self._aligned = True
        log.info("accepted: world size %d, global world size %d", self.membership.world_size,
                 self.membership.global_world_size)

    def begin_close(self) -> bool:
        """Mark the session closing; ``False`` if it already was (close once)."""
        if self._closing:
            return False
        self._closing = True
        return True

    async def leave(self) -> None:
        """Tell the master (best effort, bounded), fail every call as closed, close the master
        connection, the ring connections and the p2p listener.  Call under a shield."""
        link = self._link
        if link is not None and self._failure is None and self._lost_at is None:
            with trio.move_on_after(min(1.0, self._config.connect_timeout)):
                try:
                    await link.connection.send(m.Leave())
                except PCCLError:
                    pass
        self.fail(InvalidUsage("the communicator is closed"))
        if link is not None:
            await link.connection.aclose()
        if self._wiring is not None:
            self._wiring.close()
            await self._wiring.listener.aclose()

    def stop(self) -> None:
        """Stop the background tasks (cancels the communicator's nursery)."""
        self._nursery.cancel_scope.cancel()

    # --- losing the master and getting it back ---------------------------------------------------

    def connection_lost(self, link: _Link, error: PCCLError) -> None:
        """``link`` broke or its master fell silent (``error`` says how).  Reconnect if the
        policy allows, else fail with ``error``.  Nothing happens for an older link."""
        if link is not self._link or self._failure is not None or self._lost_at is not None:
            return
        if self._closing or self._config.master_reconnect_timeout <= 0:
            self.fail(error)
            return
        self._lost_at = trio.current_time()
        self._accepted = self._aligned = False
        log.warning("peer %x: %s; reconnecting for up to %g s (Config.master_reconnect_timeout)", self._peer_id,
                    error, self._config.master_reconnect_timeout)
        link.scope.cancel()
        link.connection.abort()
        assert self._wiring is not None
        self._wiring.reset(self._peer_id)  # the old master's rounds are over
        self._end_in_flight(MasterLost(str(error)))
        self._notify_ready()
        self.spawn(self._reconnect, error)

    async def _reconnect(self, why: PCCLError) -> None:
        """Dial and register until it works or the policy's deadline passes."""
        assert self._lost_at is not None
        deadline = self._lost_at + self._config.master_reconnect_timeout
        first, longest = self._config.master_reconnect_backoff
        attempt = 0
        last_error: BaseException = why
        while self._failure is None:
            now = trio.current_time()
            if now >= deadline:
                error = MasterUnreachable(f"lost the master at {self.master_address} ({why}) and could not "
                                          f"reconnect within {self._config.master_reconnect_timeout:g} s: {last_error}")
                self.fail(error, cause=last_error)
                return
            delay = min(longest, first * 2**attempt) * self._rng.uniform(0.5, 1.5)
            attempt += 1
            connection: FramedConnection | None = None
            with trio.move_on_at(deadline):
                try:
                    connection = await self.dial(self.master_address)
                    await self._register_on(connection)
                except (Kicked, AuthenticationFailed, ProtocolError) as exc:
                    if connection is not None:
                        connection.abort()
                    failure: PCCLError = exc
                    if isinstance(exc, ProtocolError) and not isinstance(exc, MasterUnreachable):
                        failure = MasterUnreachable(f"the master at {self.master_address} answered the "
                                                    f"reconnection with a protocol error: {exc}")
                    self.fail(failure)
                    return
                except (TransportError, MasterUnreachable) as exc:
                    if connection is not None:
                        connection.abort()
                    last_error = exc
                    log.debug("peer %x: reconnection attempt %d failed: %s", self._peer_id, attempt, exc)
                else:
                    self._lost_at = None
                    self._rejoined = True
                    if self._topology_waiter is None:  # our first TopologyComplete is the acceptance
                        self._new_topology_waiter("accept")
                    log.warning("peer %x: reconnected to the master at %s (epoch %d); waiting to be accepted",
                                self._peer_id, self.master_address, self._epoch)
                    self._notify_ready()
                    return
                await trio.sleep(min(delay, max(0.0, deadline - trio.current_time())))

    # --- one master connection: reader and heartbeat ------------------------------------------------

    async def _run_link(self, link: _Link) -> None:
        with link.scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_master, link)
                nursery.start_soon(run_heartbeat, link)

    async def _read_master(self, link: _Link) -> None:
        try:
            while True:
                msg = await link.connection.receive()
                link.last_heard = trio.current_time()
                self._dispatch(link, msg)
        except ProtocolError as exc:
            if link is self._link:
                self.fail(ProtocolError(f"the master at {self.master_address} sent garbage: {exc}"), cause=exc)
        except TransportError as exc:
            error = MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}")
            error.__cause__ = exc
            self.connection_lost(link, error)

    def _dispatch(self, link: _Link, msg: m.Message) -> None:
        if isinstance(msg, m.Heartbeat):
            return
        if isinstance(msg, m.KickNotice):
            self.fail(kicked_error(msg))
        elif isinstance(msg, m.ConnectToPeers):
            assert self._wiring is not None
            try:
                self._wiring.start_round(msg, link.epoch)
            except ProtocolError as exc:
                self.fail(exc)
        elif isinstance(msg, m.TopologyComplete):
            self.membership = msg.membership
            self.ring_endpoints = msg.ring
            self._counters.topology_updates += 1
            waiter = self._topology_waiter
            self._clear_topology_waiter(None)
            if not self._accepted:
                self._accepted = True
                log.debug("peer %x: accepted by the master (epoch %d), world size %d", self._peer_id, self._epoch,
                          msg.membership.world_size)
                self._notify_ready()
            if waiter is not None:
                waiter.set(msg)
        elif isinstance(msg, m.TopologyRejected):
            if self._topology_waiter is None:
                log.debug("dropping TopologyRejected: no topology vote stands")
                return
            log.warning("peer %x: the master ended this peer's topology vote: %s", self._peer_id, msg.detail)
            self._clear_topology_waiter(PhaseMismatch(msg.detail or "phase mismatch"))
        elif isinstance(msg, m.ProbeRequest):
            if self._phase.topology_vote != "optimize":
                self.fail(ProtocolError(f"the master sent a probe request while this peer is in "
                                        f"{self._phase.describe()}"))
                return
            self.spawn(self._probe_and_report, msg, link.epoch)
        elif isinstance(msg, m.PeersPendingResult):
            log.debug("peer %x: peers pending: %s", self._peer_id, msg.pending)
            pending_waiter, self._pending_waiter = self._pending_waiter, None
            if pending_waiter is not None:
                pending_waiter.set(msg.pending)
        elif isinstance(msg, _COLLECTIVE_REPLIES):
            route = self._routes.get(msg.tag)
            if route is None:
                log.debug("dropping %s for tag %d: no collective waits for it", type(msg).__name__, msg.tag)
                return
            try:
                route.deliver(msg)
            except trio.WouldBlock:
                self.fail(ProtocolError(f"the master flooded collective tag {msg.tag}"))
        elif isinstance(msg, _SYNC_REPLIES):
            if self._sync_route is None:
                log.debug("dropping %s: no sync is running", type(msg).__name__)
                return
            try:
                self._sync_route.send_nowait(msg)
            except trio.WouldBlock:
                self.fail(ProtocolError("the master flooded the shared-state sync with messages"))
        else:
            self.fail(ProtocolError(f"the master sent an unexpected {type(msg).__name__}"))


class HeartbeatSubject(Protocol):
    """What :func:`run_heartbeat` needs (one master connection; tests substitute a stand-in)."""

    master_address: str

    @property
    def peer_id(self) -> int: ...

    @property
    def config(self) -> Config: ...

    @property
    def last_heard(self) -> float: ...

    @property
    def last_sent(self) -> float: ...

    @property
    def failure(self) -> PCCLError | None: ...

    def fail(self, error: PCCLError) -> None: ...

    async def send(self, msg: m.Message) -> None: ...

    def heartbeat(self) -> m.Heartbeat: ...


async def run_heartbeat(subject: HeartbeatSubject) -> None:
    """Keep the master hearing from this peer at least every ``config.heartbeat_interval``, and
    report ``MasterUnreachable`` (via ``subject.fail``) once the master has been silent for
    ``config.peer_timeout``.  Returns when the subject has failed or a send fails.

    A heartbeat goes out when the interval passed since the last message to the master, or, at
    the interval's cadence, when its report (what the status page shows) changed since the last
    heartbeat.  A peer busy voting every step sends none on top of its votes: any message
    refreshes the master's deadline for it (heartbeats were about 40% of what the master read in
    the simulator's default run)."""
    cfg = subject.config
    interval = cfg.heartbeat_interval
    reported: m.Heartbeat | None = None
    due = trio.current_time() + interval
    while subject.failure is None:
        await trio.sleep_until(due)
        now = trio.current_time()
        late = now - due
        if late >= cfg.peer_timeout / 2:
            log.warning("peer %x: no heartbeat could go to the master for %.3g s: the event loop was blocked "
                        "(the master removes peers silent for Config.peer_timeout = %g s); run long "
                        "computations off the Trio thread", subject.peer_id, late + interval,
                        cfg.peer_timeout)
        if now - subject.last_heard > cfg.peer_timeout:
            # Before calling the master silent, let the reader take in what may be waiting
            # unread: after user code blocked the event loop, the master's heartbeats (or its
            # kick) are there.  Counted in scheduler turns, not time, since the loop may block
            # again meanwhile; a hung master is still caught within a few turns.
            for _ in range(_READER_TURNS):
                await trio.lowlevel.checkpoint()
                if subject.failure is not None:
                    return
                if trio.current_time() - subject.last_heard <= cfg.peer_timeout:
                    break
            else:
                silent = trio.current_time() - subject.last_heard
                subject.fail(MasterUnreachable(f"the master at {subject.master_address} has been silent for {silent:.3g} s"))
                return
        heartbeat = subject.heartbeat()
        now = trio.current_time()
        if heartbeat == reported and subject.last_sent + interval > now:
            due = subject.last_sent + interval  # the master heard from this peer meanwhile
            continue
        try:
            await subject.send(heartbeat)
        except PCCLError:
            return
        reported = heartbeat
        # From when the send returned: a send held up (a stalled network, say) is not a late
        # wake-up, and whatever arrived meanwhile (a kick notice) gets an interval to be read.
        due = trio.current_time() + interval
