"""The peer session: one peer's connection to the master and everything that hangs on it.

A session holds one framed connection to the master.  A single reader task receives every
master message and dispatches it: votes are answered through waiters (so ``are_peers_pending()``
can run while collectives use the same connection), ``ConnectToPeers`` starts (or restarts) the
ring set-up in the background (:mod:`pccl._peer.wiring`), collective messages are routed by tag
to the all-reduce and sync messages to the running sync (:meth:`PeerSession.open_route`,
:meth:`PeerSession.open_sync_route`), a ``KickNotice`` or a lost connection fails every pending
and later call.  A heartbeat task (:func:`run_heartbeat`) keeps the master informed and declares
the master unreachable when it has been silent for ``config.peer_timeout``.

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
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    MasterUnreachable,
    PCCLError,
    ProtocolError,
    TransportError,
)
from ..net.base import Listener, Network, Stream, format_address, parse_address
from ..net.framed import FramedConnection, accept_framed, open_framed
from ..protocol import messages as m
from .host import CollectiveRoute, Counters
from .links import P2PLinks
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
        self._nursery = nursery
        host, _ = parse_address(master_address)
        #: The local address listeners bind to (the master's address family).
        self.bind_host = "::" if ":" in host else "0.0.0.0"
        self._master: FramedConnection | None = None
        self._wiring: RingWiring | None = None
        self._failure: PCCLError | None = None
        self._closing = False
        self._last_heard = trio.current_time()
        self.membership = m.Membership(0, 0, 0, 0)
        #: This group's ring (endpoints, in order) as of the last topology update.
        self.ring_endpoints: tuple[m.PeerEndpoint, ...] = ()
        self._topology_waiter: _Waiter[m.TopologyComplete] | None = None
        self._pending_waiter: _Waiter[bool] | None = None
        self._routes: dict[int, CollectiveRoute] = {}
        self._sync_route: trio.MemorySendChannel[m.Message] | None = None
        self._phase = PhaseRule()
        self._counters = Counters()

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
    def master(self) -> FramedConnection | None:
        """The connection to the master (``None`` before :meth:`connect`)."""
        return self._master

    @property
    def p2p_listener(self) -> Listener | None:
        return self._wiring.listener if self._wiring is not None else None

    @property
    def failure(self) -> PCCLError | None:
        """The error this session failed with (``None`` while it is usable)."""
        return self._failure

    @property
    def last_heard(self) -> float:
        """When the master was last heard from (``trio.current_time()``)."""
        return self._last_heard

    # --- PeerHost: failure ---------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        if self._failure is not None:
            raise fresh_error(self._failure)

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
        if not isinstance(error, InvalidUsage):
            log.warning("peer %x: %s", self._peer_id, error)
        self._clear_topology_waiter(error)
        waiter, self._pending_waiter = self._pending_waiter, None
        if waiter is not None:
            waiter.fail(error)
        for route in self._routes.values():
            route.close()
        if self._sync_route is not None:
            self._sync_route.close()
            self._sync_route = None  # later sync messages are dropped, not sent into a closed channel

    def leave_lockstep(self, error: PCCLError) -> None:
        self.fail(error)
        if self._master is not None:
            self._master.abort()

    # --- PeerHost: the master ------------------------------------------------------------------

    async def send(self, msg: m.Message) -> None:
        self.raise_if_failed()
        assert self._master is not None
        try:
            # Cancellation before anything is written sends nothing; once the message went out
            # (send_nowait), flush() finishes it and never raises Cancelled for a whole frame.
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._master.send_nowait(msg):
                await self._master.flush()
            else:
                await self._master.send(msg)
        except TransportError as exc:
            self.master_send_failed(exc)

    async def send_shielded(self, msg: m.Message) -> None:
        master = self._master
        sent = self._failure is None and master is not None and master.send_nowait(msg)
        if sent and not master.needs_flush:  # type: ignore[union-attr]
            return  # written at once: nothing to shield (the common case, and a latency-bound one)
        with trio.CancelScope(shield=True) as scope:
            scope.deadline = trio.current_time() + self._config.peer_timeout
            if not sent:
                await self.send(msg)
            else:
                assert master is not None
                try:
                    await master.flush()
                except TransportError as exc:
                    self.master_send_failed(exc)
        if scope.cancelled_caught:
            self.fail(MasterUnreachable(f"could not send {type(msg).__name__} to the master within "
                                        f"{self._config.peer_timeout:g} s"))
            self.raise_if_failed()

    def master_send_failed(self, exc: TransportError) -> NoReturn:
        """A send to the master failed: the master is lost (or this peer is closing)."""
        self.fail(MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}"), cause=exc)
        self.raise_if_failed()
        raise AssertionError("unreachable: the session has failed")  # pragma: no cover

    def open_route(self, tag: int) -> CollectiveRoute:
        self.raise_if_failed()
        self._phase.begin_collective(tag)
        route = self._routes[tag] = CollectiveRoute(_ROUTE_CAPACITY)
        return route

    def close_route(self, tag: int) -> None:
        route = self._routes.pop(tag, None)
        if route is not None:
            route.close()
            self._phase.end_collective(tag)

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

    # --- votes ---------------------------------------------------------------------------------

    async def topology_vote(self, *, accept_new_peers: bool) -> None:
        """Vote to accept pending peers (``True``: ``update_topology``) or to re-wire this
        group (``False``); return when the round completed.  A cancelled vote stands: the next
        call of the same kind waits for it (:mod:`pccl._peer.phase`)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.raise_if_failed()
        kind = "accept" if accept_new_peers else "rewire"
        if self._phase.join_topology(kind):
            waiter = self._topology_waiter
            assert waiter is not None
        else:
            waiter = self._new_topology_waiter(kind)
            try:
                await self.send(m.VoteTopology(accept_new_peers))
            except BaseException:
                # Not sent (cancelled while waiting to send, or the connection failed): no vote stands.
                if self._topology_waiter is waiter:
                    self._clear_topology_waiter(None)
                raise
        await waiter.wait()

    async def rewire(self) -> None:
        await self.topology_vote(accept_new_peers=False)

    async def are_peers_pending(self) -> bool:
        """Whether a registered peer waits to be accepted, answered once every accepted peer
        asked.  Legal in every phase; a cancelled query stands (the next call waits for it)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.raise_if_failed()
        waiter = self._pending_waiter
        if waiter is None:
            waiter = self._pending_waiter = _Waiter()
            try:
                await self.send(m.VotePeersPending())
            except BaseException:
                if self._pending_waiter is waiter:
                    self._pending_waiter = None
                raise
        return await waiter.wait()

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
            self._master = await self.dial(self.master_address)
        except TransportError as exc:
            raise MasterUnreachable(f"cannot reach the master at {self.master_address}: {exc}") from exc
        self._last_heard = trio.current_time()

    async def register(self, *, shared_state_port: int) -> None:
        """Register with the master, wait for ``Welcome``, start the background tasks."""
        master, wiring = self._master, self._wiring
        assert master is not None and wiring is not None, "connect() first"
        self._new_topology_waiter("accept")  # our first TopologyComplete is the acceptance
        await self.send(m.Register(self.peer_group, wiring.listener.port, shared_state_port))
        try:
            with trio.fail_after(self._config.connect_timeout):
                while True:
                    msg = await master.receive()
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
        self._peer_id = msg.peer_id
        wiring.reset(self._peer_id)
        log.info("registered with the master at %s as peer %x (group %d)", self.master_address, self._peer_id,
                 self.peer_group)
        self.spawn(self._read_master)
        self.spawn(run_heartbeat, self)
        self.spawn(wiring.serve)

    async def wait_accepted(self) -> None:
        """Wait until a topology round accepted this peer (the waiter :meth:`register` set)."""
        waiter = self._topology_waiter
        assert waiter is not None
        await waiter.wait()
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
        if self._master is not None and self._failure is None:
            with trio.move_on_after(min(1.0, self._config.connect_timeout)):
                try:
                    await self._master.send(m.Leave())
                except PCCLError:
                    pass
        self.fail(InvalidUsage("the communicator is closed"))
        if self._master is not None:
            await self._master.aclose()
        if self._wiring is not None:
            self._wiring.close()
            await self._wiring.listener.aclose()

    def stop(self) -> None:
        """Stop the background tasks (cancels the communicator's nursery)."""
        self._nursery.cancel_scope.cancel()

    # --- the reader ----------------------------------------------------------------------------

    async def _read_master(self) -> None:
        assert self._master is not None
        try:
            while True:
                msg = await self._master.receive()
                self._last_heard = trio.current_time()
                self._dispatch(msg)
        except ProtocolError as exc:
            self.fail(ProtocolError(f"the master at {self.master_address} sent garbage: {exc}"), cause=exc)
        except TransportError as exc:
            self.fail(MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}"),
                      cause=exc)

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.Heartbeat):
            return
        if isinstance(msg, m.KickNotice):
            self.fail(kicked_error(msg))
        elif isinstance(msg, m.ConnectToPeers):
            assert self._wiring is not None
            try:
                self._wiring.start_round(msg)
            except ProtocolError as exc:
                self.fail(exc)
        elif isinstance(msg, m.TopologyComplete):
            self.membership = msg.membership
            self.ring_endpoints = msg.ring
            self._counters.topology_updates += 1
            waiter = self._topology_waiter
            self._clear_topology_waiter(None)
            if waiter is not None:
                waiter.set(msg)
        elif isinstance(msg, m.PeersPendingResult):
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
    """What :func:`run_heartbeat` needs (the session; tests substitute a stand-in)."""

    master_address: str

    @property
    def peer_id(self) -> int: ...

    @property
    def config(self) -> Config: ...

    @property
    def last_heard(self) -> float: ...

    @property
    def failure(self) -> PCCLError | None: ...

    def fail(self, error: PCCLError) -> None: ...

    async def send(self, msg: m.Message) -> None: ...


async def run_heartbeat(subject: HeartbeatSubject) -> None:
    """Send a heartbeat every ``config.heartbeat_interval``; fail the session with
    ``MasterUnreachable`` once the master has been silent for ``config.peer_timeout``.  Returns
    when the session has failed."""
    cfg = subject.config
    while subject.failure is None:
        due = trio.current_time() + cfg.heartbeat_interval
        await trio.sleep_until(due)
        late = trio.current_time() - due
        if late >= cfg.peer_timeout / 2:
            log.warning("peer %x: no heartbeat could go to the master for %.3g s: the event loop was blocked "
                        "(the master removes peers silent for Config.peer_timeout = %g s); run long "
                        "computations off the Trio thread", subject.peer_id, late + cfg.heartbeat_interval,
                        cfg.peer_timeout)
        if trio.current_time() - subject.last_heard > cfg.peer_timeout:
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
        try:
            await subject.send(m.Heartbeat())
        except PCCLError:
            return
