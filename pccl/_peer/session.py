"""The peer session: one peer's membership in a run, and the shell around its lifecycle machine.

What the session's standing with the master means — connecting, registered, accepted, lost and
reconnecting, rejoined, realigning, closing, failed — is :mod:`pccl.protocol.lifecycle`'s, and
the session only reports what happens to it.  The pieces it holds together:

* the master connection of the current epoch, its reader and heartbeat
  (:mod:`pccl._peer.master_link`, :mod:`pccl._peer.heartbeat`); the reader dispatches every
  master message through :attr:`PeerSession.dispatch`, a table by message type;
* getting a lost master back (:mod:`pccl._peer.reconnect`) when
  ``Config.master_reconnect_timeout`` allows; what was in flight belonged to the old epoch and
  ends retryably (the routes close, the operations see :class:`~pccl._peer.host.MasterLost`);
  an outstanding topology vote becomes the wait for acceptance by the new master;
* the votes (:mod:`pccl._peer.votes`), the routes of running operations
  (:mod:`pccl._peer.routes`), the ring wiring (:mod:`pccl._peer.wiring`) and the link probes;
* the phase rule (:mod:`pccl._peer.phase`) that every call consults before it starts.

The session implements :class:`~pccl._peer.host.PeerHost`, the interface its services use.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import trio

from ..config import Config
from ..errors import (
    InvalidArgument,
    InvalidUsage,
    MasterUnreachable,
    PCCLError,
    ProtocolError,
    TransportError,
)
from ..net.admission import Admission
from ..net.base import Listener, Network, Stream, format_address, parse_address
from ..net.framed import FramedConnection, accept_framed, establish_over, open_framed
from ..net.serving import HandshakeSlot
from ..protocol import messages as m
from ..protocol.lifecycle import Event, Lifecycle
from ..protocol.paths import Port, advertised_candidates, local_candidates, parse_advertise
from ..protocol.phases import TopologyVote
from .connector import AcceptHandler, Connector
from .host import CollectiveRoute, Counters, MasterLost
from .master_link import Dispatch, MasterLink, handshake, kicked_error
from .phase import PhaseRule
from .point import PointService
from .probes import ProbeService
from .reconnect import dial_first, reconnect
from .ring_connections import P2PLinks
from .routes import COLLECTIVE_REPLIES, SYNC_REPLIES, Flooded, Routes
from .votes import Votes, fresh_error
from .wiring import RingWiring

__all__ = ["PeerSession"]

log = logging.getLogger(__name__)


class PeerSession:
    """One peer's membership in a run, below the public :class:`~pccl.Communicator`.

    Driven by :func:`pccl.open_communicator`: :meth:`connect` (p2p listener and the master
    connection), :meth:`register` (``Register`` → ``Welcome``; the background tasks start),
    :meth:`wait_accepted`; at the end :meth:`begin_close`, :meth:`leave` and :meth:`stop`.
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
        #: The local address listeners bind to: ``Config.bind_host``, else every interface of
        #: the master's address family.
        self.bind_host = config.bind_host or ("::" if ":" in host else "0.0.0.0")
        self._lifecycle = Lifecycle()
        self._link: MasterLink | None = None
        self._wiring: RingWiring | None = None
        self._probes = ProbeService(self)
        self._points = PointService(self)
        self._connector = Connector(self)
        #: What this peer advertises (``Config.advertise``; open_communicator put
        #: ``$PCCL_ADVERTISE`` there when it applies).
        self._advertise = parse_advertise(config.advertise or "")
        self._observed_host = ""
        self._failure: PCCLError | None = None
        self._close_begun = False
        self._master_instance = 0
        self._shared_state_port = 0
        self._ready_changed = trio.Event()
        self.membership = m.Membership(0, 0, 0, 0)
        #: This group's ring (endpoints, in order) as of the last topology update.
        self.ring_endpoints: tuple[m.PeerEndpoint, ...] = ()
        self._phase = PhaseRule()
        self._routes = Routes(self._phase)
        self._votes = Votes(self)
        self._counters = Counters()
        self.on_query: Callable[[m.CollectiveQuery, int], None] | None = None
        self.on_register: Callable[[], tuple[m.UndecidedOp, ...]] | None = None
        self.on_rejoined: Callable[[], None] | None = None
        #: What the reader does with each message of the master, by type.
        self.dispatch: Dispatch = {
            m.Heartbeat: lambda link, msg: None,
            m.KickNotice: self._on_kick,
            m.ConnectToPeers: self._on_connect_to_peers,
            m.TopologyComplete: self._on_topology_complete,
            m.TopologyRejected: lambda link, msg: self._votes.topology_rejected(msg),  # type: ignore[arg-type]
            m.PeersPendingResult: lambda link, msg: self._votes.pending_answered(msg),  # type: ignore[arg-type]
            m.ProbeRequest: self._on_probe_request,
            m.DialRequest: lambda link, msg: self._connector.on_dial_request(msg, link.epoch),  # type: ignore[arg-type]
            m.RelayOffer: lambda link, msg: self._connector.on_relay_offer(msg, link.epoch),  # type: ignore[arg-type]
            m.PathUnavailable: lambda link, msg: self._connector.on_path_unavailable(msg),  # type: ignore[arg-type]
            **{kind: self._on_collective_reply for kind in COLLECTIVE_REPLIES},
            m.CollectiveQuery: self._on_collective_query,
            **{kind: self._on_sync_reply for kind in SYNC_REPLIES},
        }

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
    def network(self) -> Network:
        return self._network

    @property
    def counters(self) -> Counters:
        return self._counters

    @property
    def phase(self) -> PhaseRule:
        return self._phase

    @property
    def lifecycle(self) -> Lifecycle:
        """This peer's standing with the master (read it; the session drives it)."""
        return self._lifecycle

    @property
    def world_size(self) -> int:
        return self.membership.world_size

    @property
    def links(self) -> P2PLinks:
        assert self._wiring is not None, "the session is not connected"
        return self._wiring.links

    @property
    def master_epoch(self) -> int:
        return self._lifecycle.epoch

    @property
    def reconnecting(self) -> bool:
        return self._failure is None and self._lifecycle.reconnecting

    @property
    def master_instance(self) -> int:
        """The identity of the master this session is registered with (from its Welcome)."""
        return self._master_instance

    @property
    def observed_host(self) -> str:
        return self._observed_host

    @property
    def points(self) -> PointService:
        """Point-to-point ``send``/``recv`` and their connections (:mod:`pccl._peer.point`)."""
        return self._points

    @property
    def connector(self) -> Connector:
        """This peer's connections to the others and the paths they take."""
        return self._connector

    @property
    def master(self) -> FramedConnection | None:
        """The connection to the master (``None`` before :meth:`connect`)."""
        return self._link.connection if self._link is not None else None

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

    def is_current(self, link: MasterLink) -> bool:
        return link is self._link

    # --- PeerHost: failure and readiness -------------------------------------------------------

    def raise_if_failed(self, epoch: int | None = None) -> None:
        if self._failure is not None:
            raise fresh_error(self._failure)
        lifecycle = self._lifecycle  # (the reads below are plain attributes: this runs per message)
        if epoch is not None and (epoch != lifecycle.epoch or lifecycle.lost_at is not None):
            raise MasterLost(f"the connection to the master at {self.master_address} was lost")

    async def ready(self) -> None:
        await self.until_accepted()
        if not self._lifecycle.aligned:
            # Accepted again by a restarted master, but not at a step boundary: its group may be
            # anywhere in the loop.  Collectives and syncs fail (retryably) until this peer's
            # next update_topology, where the loops meet again.
            raise MasterLost(f"this peer rejoined the master at {self.master_address} after losing it; it "
                             "goes on from its next update_topology")

    async def until_accepted(self) -> None:
        """Wait until the current master has accepted this peer (``InvalidUsage`` once closing)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self.raise_if_failed()
            if self._lifecycle.closing:
                raise InvalidUsage("the communicator is closing")
            if self._lifecycle.accepted:
                return
            await self._ready_changed.wait()

    def fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None:
        if self._failure is not None:
            return
        closing = self._lifecycle.closing
        if closing and not isinstance(error, InvalidUsage):
            # aclose() has begun: its Leave makes the master hang up, which the reader or a
            # heartbeat may meet first.  That is the end this peer asked for, not a failure.
            error, cause = InvalidUsage("the communicator is closed"), None
        if cause is not None:
            error.__cause__ = cause
        self._failure = error
        self._lifecycle.handle(Event.FAIL)
        if not isinstance(error, InvalidUsage):
            log.warning("peer %x: %s", self._peer_id, error)
        self._votes.fail_all(error)
        self._routes.end_all()
        # Closing: the p2p connections end gracefully, so that the answers this peer sent
        # last (a receive's PointAck) reach their senders (PointService._linger).
        self._points.fail_all(error, graceful=closing)
        if self._link is not None:
            self._link.scope.cancel()
        self._notify_ready()

    def leave_lockstep(self, error: PCCLError) -> None:
        self.fail(error)
        if self._link is not None:
            self._link.connection.abort()

    def _notify_ready(self) -> None:
        self._ready_changed.set()
        self._ready_changed = trio.Event()

    # --- PeerHost: the master ------------------------------------------------------------------

    def _current_link(self, epoch: int | None) -> MasterLink:
        self.raise_if_failed(epoch)
        link = self._link
        if link is None or self._lifecycle.lost_at is not None:  # reconnecting
            raise MasterLost(f"the connection to the master at {self.master_address} was lost")
        return link

    async def send(self, msg: m.Message, *, epoch: int | None = None, schedule_point: bool = True) -> None:
        link = self._current_link(epoch)
        try:
            await link.write(msg, schedule_point=schedule_point)
        except TransportError as exc:
            self.master_send_failed(exc, link)

    async def send_shielded(self, msg: m.Message, *, epoch: int | None = None) -> None:
        link = self._current_link(epoch)
        try:
            whole = await link.write_shielded(msg, self._config.peer_timeout)
        except TransportError as exc:
            self.master_send_failed(exc, link)
        if not whole:
            self.connection_lost(link, MasterUnreachable(
                f"could not send {type(msg).__name__} to the master within {self._config.peer_timeout:g} s"))
            self.raise_if_failed(link.epoch)

    def master_send_failed(self, exc: TransportError, link: MasterLink | None = None) -> NoReturn:
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

    # --- PeerHost: routes ----------------------------------------------------------------------

    def open_route(self, tag: int) -> CollectiveRoute:
        self.raise_if_failed()
        return self._routes.open(tag)

    def close_route(self, tag: int) -> None:
        self._routes.close(tag)

    def abandon_route(self, tag: int) -> None:
        self._routes.abandon(tag)

    async def settled(self, tag: int | None = None) -> None:
        await self._routes.settled(tag)

    def open_sync_route(self) -> trio.MemoryReceiveChannel[m.Message]:
        self.raise_if_failed()
        return self._routes.open_sync()

    def close_sync_route(self) -> None:
        self._routes.close_sync()

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

    async def open_peer(self, target: m.PeerEndpoint, port: Port) -> FramedConnection:
        return await self._connector.open(target, port)

    async def establish_over(self, stream: Stream, *, role: m.HandshakeRole) -> FramedConnection:
        return await establish_over(stream, role=role, token=self._token, config=self._config,
                                    nonce_source=self._nonce_source)

    async def accept_peer(self, stream: Stream, slot: HandshakeSlot, listener: Port) -> None:
        await self._connector.accept(stream, slot, listener)

    def serve_port(self, port: Port, handler: AcceptHandler) -> None:
        self._connector.set_handler(port, handler)

    async def listen(self, base_port: int) -> Listener:
        return await self._network.listen(format_address(self.bind_host, base_port),
                                          port_range=self._config.port_search_range)

    async def serve_probe(self, conn: FramedConnection, hello: m.ProbeHello) -> None:
        await self._probes.serve(conn, hello)

    async def serve_point(self, conn: FramedConnection, hello: m.PointHello) -> None:
        await self._points.serve(conn, hello)

    # --- votes (pccl._peer.votes) --------------------------------------------------------------

    async def topology_vote(self, *, accept_new_peers: bool) -> None:
        await self._votes.topology(accept_new_peers=accept_new_peers)

    async def rewire(self) -> None:
        await self._votes.topology(accept_new_peers=False)

    async def optimize_vote(self) -> None:
        await self._votes.optimize()

    async def are_peers_pending(self) -> bool:
        return await self._votes.peers_pending()

    # --- lifecycle -----------------------------------------------------------------------------

    async def connect(self) -> None:
        """Bind the p2p listener and connect to the master, waiting up to
        ``Config.master_wait_timeout`` for one that is not up yet
        (:func:`~pccl._peer.reconnect.dial_first`).  ``MasterUnreachable`` if it cannot be
        reached; handshake errors (``AuthenticationFailed``, ``ProtocolError``) as they are.
        Cancellation ends the wait."""
        listener = await self.listen(self._config.p2p_base_port)
        self._wiring = RingWiring(self, listener)
        connection = await dial_first(self, self._rng)
        self._link = MasterLink(self, connection, self._lifecycle.epoch)
        self._check_bind_host(connection.local_address)

    def _check_bind_host(self, local_address: str) -> None:
        """Warn when the listeners are bound to an IP the master does not see this peer at."""
        bound = self._config.bind_host
        try:
            bound_ip = ipaddress.ip_address(bound) if bound is not None else None
            local_ip = ipaddress.ip_address(parse_address(local_address)[0])
        except (ValueError, InvalidArgument):
            return  # a host name, or a transport without IP addresses: nothing to compare
        if bound_ip is not None and not bound_ip.is_unspecified and bound_ip != local_ip and not self._config.advertise:
            log.warning("Config.bind_host is %s but this peer reaches the master at %s from %s: the others dial "
                        "the address the master sees first, where nothing of this peer listens, and then %s (they "
                        "reach it only where they can route to it); set Config.advertise if they should dial "
                        "another address", bound, self.master_address, local_ip, bound)

    async def register(self, *, shared_state_port: int) -> None:
        """Register with the master, wait for ``Welcome``, start the background tasks."""
        assert self._link is not None and self._wiring is not None, "connect() first"
        self._shared_state_port = shared_state_port
        self._votes.begin_topology(TopologyVote.ACCEPT)  # our first TopologyComplete is the acceptance
        await self.register_on(self._link.connection)
        log.info("registered with the master at %s as peer %x (group %d)", self.master_address, self._peer_id,
                 self.peer_group)
        self.spawn(self._wiring.serve)

    async def register_on(self, connection: FramedConnection) -> None:
        """``Register`` on a fresh master connection, ``Welcome`` back: a new epoch begins, with
        its reader and heartbeat.  ``MasterUnreachable`` if the master does not answer in
        ``Config.connect_timeout`` or the connection breaks; ``Kicked``, ``ProtocolError``."""
        assert self._wiring is not None
        undecided = self.on_register() if self.on_register is not None and self._peer_id else ()
        register = m.Register(self.peer_group, self._wiring.listener.port, self._shared_state_port,
                              previous_peer_id=self._peer_id, candidates=self._candidates(), undecided=undecided)
        welcome = await handshake(connection, register, timeout=self._config.connect_timeout,
                                  master_address=self.master_address)
        if self._config.peer_commit and not welcome.peer_commit:
            raise ProtocolError(f"Config.peer_commit is on, but the master at {self.master_address} does not resolve "
                                "ops whose peers commit among themselves (an older master): turn peer_commit off "
                                "or upgrade the master")
        self._lifecycle.handle(Event.WELCOMED)
        self._peer_id = welcome.peer_id
        self._master_instance = welcome.instance
        self._observed_host = welcome.observed_host
        self._connector.reset()
        self._wiring.reset(self._peer_id)
        link = self._link = MasterLink(self, connection, self._lifecycle.epoch)
        self.spawn(link.run, self.dispatch)

    def _candidates(self) -> tuple[m.Candidate, ...]:
        """What this peer registers besides the address the master observes: its advertised
        endpoints, then its interface addresses (:mod:`pccl.protocol.paths`)."""
        assert self._wiring is not None
        bound = {Port.P2P: self._wiring.listener.port, Port.SHARED_STATE: self._shared_state_port}
        bind = self.bind_host
        if bind not in ("0.0.0.0", "::"):
            hosts = [bind]
        else:
            hosts = self._network.local_addresses("ipv6" if bind == "::" else "ipv4")
        return advertised_candidates(self._advertise, bound) + local_candidates(hosts, bound)

    async def wait_accepted(self) -> None:
        """Wait until a topology round accepted this peer (the vote :meth:`register` set)."""
        await self._votes.wait_topology()
        self._lifecycle.handle(Event.REALIGNED)  # a restart while joining: the acceptance all the same
        log.info("accepted: world size %d, global world size %d", self.membership.world_size,
                 self.membership.global_world_size)

    def begin_close(self) -> bool:
        """Mark the session closing; ``False`` if its close already began (close once)."""
        if self._close_begun:
            return False
        self._close_begun = True
        self._lifecycle.handle(Event.CLOSE)
        return True

    async def leave(self) -> None:
        """Tell the master (best effort, bounded), fail every call as closed, close the master
        connection, the ring connections and the p2p listener.  Call under a shield."""
        link = self._link
        if link is not None and self._failure is None and not self._lifecycle.reconnecting:
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

    # --- losing the master and getting it back (pccl._peer.reconnect) ------------------------------

    def connection_lost(self, link: MasterLink, error: PCCLError) -> None:
        """``link`` broke or its master fell silent (``error`` says how).  Reconnect if the
        policy allows, else fail with ``error``.  Nothing happens for an older link."""
        lifecycle = self._lifecycle
        if link is not self._link or self._failure is not None or lifecycle.reconnecting:
            return
        if not lifecycle.holds_master or self._config.master_reconnect_timeout <= 0:
            self.fail(error)  # closing (then it is the close), not yet registered, or no reconnecting
            return
        lifecycle.handle(Event.MASTER_LOST, now=trio.current_time())
        log.warning("peer %x: %s; reconnecting for up to %g s (Config.master_reconnect_timeout)", self._peer_id,
                    error, self._config.master_reconnect_timeout)
        link.give_up()
        assert self._wiring is not None
        self._wiring.reset(self._peer_id)  # the old master's rounds are over
        self._connector.reset()
        lost = MasterLost(str(error))
        self._votes.master_gone(lost)
        self._routes.end_all()
        self._notify_ready()
        self.spawn(self._reconnect, error)

    async def _reconnect(self, why: PCCLError) -> None:
        lost_at = self._lifecycle.lost_at
        assert lost_at is not None
        await reconnect(self, why, lost_at, self._rng)

    def reader_cancelled(self, link: MasterLink) -> None:
        """The current link's reader was cancelled from outside: the communicator stops (its
        close, or a cancelled scope around it).  The master's answers cannot come any more, so
        the routes close — an op waiting for the master's final word on a success it reported
        ends at once (``MASTER_LOST``) instead of waiting out ``peer_timeout`` for a word no
        task would read."""
        if link is self._link:
            self._routes.end_all()

    def rejoined(self) -> None:
        """:func:`~pccl._peer.reconnect.reconnect` registered again: wait to be accepted."""
        if not self._votes.topology_outstanding:  # our first TopologyComplete is the acceptance
            self._votes.begin_topology(TopologyVote.ACCEPT)
        log.warning("peer %x: reconnected to the master at %s (epoch %d); waiting to be accepted",
                    self._peer_id, self.master_address, self._lifecycle.epoch)
        if self.on_rejoined is not None:
            self.on_rejoined()  # the ops in doubt ask the new master
        self._notify_ready()

    # --- the master's messages (the dispatch table) --------------------------------------------

    def _on_kick(self, link: MasterLink, msg: m.Message) -> None:
        assert isinstance(msg, m.KickNotice)
        self.fail(kicked_error(msg))

    def _on_connect_to_peers(self, link: MasterLink, msg: m.Message) -> None:
        assert isinstance(msg, m.ConnectToPeers) and self._wiring is not None
        try:
            self._wiring.start_round(msg, link.epoch)
        except ProtocolError as exc:
            self.fail(exc)

    def _on_topology_complete(self, link: MasterLink, msg: m.Message) -> None:
        assert isinstance(msg, m.TopologyComplete)
        self.membership = msg.membership
        self.ring_endpoints = msg.ring
        self._counters.topology_updates += 1
        newly = not self._lifecycle.accepted
        self._lifecycle.handle(Event.ACCEPTANCE)
        if newly:
            log.debug("peer %x: accepted by the master (epoch %d), world size %d", self._peer_id,
                      self._lifecycle.epoch, msg.membership.world_size)
            self._notify_ready()
        self._votes.topology_completed(msg)

    def _on_probe_request(self, link: MasterLink, msg: m.Message) -> None:
        assert isinstance(msg, m.ProbeRequest)
        if self._phase.topology_vote is not TopologyVote.OPTIMIZE:
            self.fail(ProtocolError(f"the master sent a probe request while this peer is in "
                                    f"{self._phase.describe()}"))
            return
        self.spawn(self._probe_and_report, msg, link.epoch)

    async def _probe_and_report(self, request: m.ProbeRequest, epoch: int) -> None:
        report = await self._probes.run(request)
        try:
            await self.send(report, epoch=epoch)
        except PCCLError:
            pass  # the communicator failed, or this probe's master is gone

    def _on_collective_reply(self, link: MasterLink, msg: m.Message) -> None:
        try:
            self._routes.deliver_collective(msg)  # type: ignore[arg-type]
        except Flooded as exc:
            self.fail(exc)

    def _on_collective_query(self, link: MasterLink, msg: m.Message) -> None:
        assert isinstance(msg, m.CollectiveQuery)
        if self.on_query is not None:
            self.on_query(msg, link.epoch)

    def _on_sync_reply(self, link: MasterLink, msg: m.Message) -> None:
        try:
            self._routes.deliver_sync(msg)
        except Flooded as exc:
            self.fail(exc)
