"""The one interface between the peer session and the services that run on it.

The all-reduce (:mod:`pccl._peer.collective_service`) and the shared-state sync
(:mod:`pccl._peer.sync`) reach the session only through :class:`PeerHost`; they never import
:mod:`pccl.communicator` or the session, and never touch another class's private members (a
test checks both).  :class:`~pccl._peer.session.PeerSession` implements it; tests may substitute
their own.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import trio

from ..config import Config
from ..errors import PCCLError
from ..net.base import Listener, Network, Stream
from ..net.framed import FramedConnection
from ..net.serving import HandshakeSlot
from ..protocol import messages as m
from ..protocol.paths import Port
from .ring_connections import P2PLinks
from .phase import PhaseRule

__all__ = ["PeerHost", "Counters", "CollectiveRoute", "MasterLost", "RouteInbox"]


class MasterLost(PCCLError):
    """The master connection an operation belonged to is gone; the session reconnects to a
    restarted master.  Services turn it into their own retryable error (the all-reduce into
    ``CollectiveAborted``, the sync into ``SharedStateSyncFailed``); it never reaches a user."""


@dataclasses.dataclass
class Counters:
    """Running totals of one communicator (``Communicator.statistics()`` snapshots them)."""

    topology_updates: int = 0
    p2p_rounds: int = 0
    #: Ring lanes dialled afresh, and lanes kept from the previous round (same neighbour,
    #: connection at rest: only a ``P2PHello`` on it, no new connection).
    p2p_dials: int = 0
    p2p_lanes_kept: int = 0
    #: Halving-doubling partner links dialled (never kept: every round dials them afresh).
    p2p_partner_dials: int = 0
    collectives_completed: int = 0
    collectives_aborted: int = 0
    #: All-reduce attempts repeated after an abort or a stale ring.
    retries: int = 0
    #: Payload bytes of completed all-reduces.
    tx_bytes: int = 0
    rx_bytes: int = 0
    syncs_completed: int = 0
    #: Sync attempts beyond the first (a source failed mid-transfer and the master re-planned).
    sync_replans: int = 0
    #: Shared-state payload bytes served to / received from other peers (partial pieces from a
    #: source that died included: they did move).
    sync_tx_bytes: int = 0
    sync_rx_bytes: int = 0
    #: The last completed sync: the revision adopted and the bytes this peer served and
    #: received in it (None before the first); heartbeats report them to the master.
    last_sync_revision: int | None = None
    last_sync_tx_bytes: int = 0
    last_sync_rx_bytes: int = 0
    #: Paths this peer decided for its connections to others (:mod:`pccl._peer.connector`),
    #: by kind; a path decided again (its old one failed) counts again.
    paths_direct: int = 0
    paths_reversed: int = 0
    paths_relayed: int = 0
    #: Connections this peer dialled back for another, and relay rendezvous it answered.
    dial_backs: int = 0
    relay_joins: int = 0
    #: Payload bytes of completed point-to-point sends and receives (:mod:`pccl._peer.point`).
    p2p_tx_bytes: int = 0
    p2p_rx_bytes: int = 0
    #: Collectives committed among their peers (``Config.peer_commit``: a full known set, no
    #: master verdict waited for), and those this peer fell in doubt about once ready (it asked
    #: the master, or the master queried it) and waited for the master's verdict.
    peer_commits: int = 0
    peer_commit_doubts: int = 0


class RouteInbox:
    """The queue of one :class:`CollectiveRoute`: a memory channel's receive side for the one
    task at a time that waits on the route (the call, then a task it hands the tag to).

    A deque and the waiting task: opening a ``trio`` memory channel per collective call cost
    several microseconds (a tenth of the argument checks and the Init together).  As a
    channel's: :meth:`receive` is a checkpoint and waits for the next message, ``EndOfChannel``
    once the route is closed and drained; ``async for`` iterates until then.
    """

    __slots__ = ("_queue", "_capacity", "_closed", "_waiter")

    def __init__(self, capacity: int) -> None:
        self._queue: collections.deque[m.Message] = collections.deque()
        self._capacity = capacity
        self._closed = False
        self._waiter: trio.lowlevel.Task | None = None

    def put_nowait(self, msg: m.Message) -> None:
        """Queue ``msg`` (Trio thread); ``trio.WouldBlock`` if the inbox is full,
        ``trio.ClosedResourceError`` once closed."""
        if self._closed:
            raise trio.ClosedResourceError("the route is closed")
        if len(self._queue) >= self._capacity:
            raise trio.WouldBlock
        self._queue.append(msg)
        self._wake()

    def close(self) -> None:
        """No more messages: the waiter sees ``EndOfChannel`` once the queue is drained."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        task, self._waiter = self._waiter, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    def receive_nowait(self) -> m.Message:
        """The next message; ``trio.WouldBlock`` if none is queued, ``trio.EndOfChannel`` if
        none will come."""
        if self._queue:
            return self._queue.popleft()
        if self._closed:
            raise trio.EndOfChannel
        raise trio.WouldBlock

    async def receive(self) -> m.Message:
        """The next message, waiting for it (cancellable); ``trio.EndOfChannel`` once closed
        and drained.  One waiter at a time (``trio.BusyResourceError``)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._queue or self._closed:
            msg = self.receive_nowait()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return msg
        if self._waiter is not None:
            raise trio.BusyResourceError("another task is waiting on this route")
        self._waiter = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return self.receive_nowait()  # woken by a message (queued) or the close (EndOfChannel)

    def __aiter__(self) -> AsyncIterator[m.Message]:
        return self

    async def __anext__(self) -> m.Message:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None


class CollectiveRoute:
    """The master's messages for one in-flight collective tag.

    Messages queue on :attr:`inbox` (``EndOfChannel`` once the communicator fails).  While
    :attr:`intercept` is set, :meth:`deliver` hands each message to it synchronously instead (in
    the task reading the master connection), and ``intercept(None)`` tells it the communicator
    failed: a running op reacts to an abort without a task of its own listening.
    """

    __slots__ = ("inbox", "intercept", "on_commence")

    def __init__(self, capacity: int) -> None:
        self.inbox = RouteInbox(capacity)
        self.intercept: Callable[[m.Message | None], None] | None = None
        #: Told every Commence's seq as it arrives (synchronously, in the order the master sent
        #: them), before it is queued or intercepted.
        self.on_commence: Callable[[int], None] | None = None

    def deliver(self, msg: m.Message) -> None:
        """Queue (or intercept) ``msg``; ``trio.WouldBlock`` if the inbox is full."""
        if self.on_commence is not None and isinstance(msg, m.CollectiveCommence):
            self.on_commence(msg.seq)
        if self.intercept is not None:
            self.intercept(msg)
        else:
            self.inbox.put_nowait(msg)

    def close(self) -> None:
        self.inbox.close()
        if self.intercept is not None:
            self.intercept(None)


class PeerHost(Protocol):
    """What a service may ask of the peer session."""

    # --- who and what ----------------------------------------------------------------------------

    @property
    def peer_id(self) -> int:
        """This peer's id (0 until registered)."""

    @property
    def config(self) -> Config: ...

    @property
    def network(self) -> Network:
        """The transport this peer runs on (its :meth:`~pccl.net.base.Network.kernel_wait` paces
        the data path's kernels)."""

    @property
    def counters(self) -> Counters:
        """The communicator's running totals; services add to them."""

    @property
    def phase(self) -> PhaseRule:
        """The phase rule; the sync begins and ends its phase there (collectives do through
        :meth:`open_route`)."""

    @property
    def world_size(self) -> int:
        """Accepted peers in this peer's group."""

    @property
    def links(self) -> P2PLinks:
        """The current topology round's ring connections."""

    @property
    def ring_endpoints(self) -> tuple[m.PeerEndpoint, ...]:
        """This group's ring (endpoints, in order) as of the last topology update."""

    @property
    def master_epoch(self) -> int:
        """Registrations with a master so far; a new one begins after each reconnection.  An
        operation remembers its epoch: what it sends or awaits belongs to that master only."""

    @property
    def master_instance(self) -> int:
        """The identity of the current master (from its ``Welcome``)."""

    @property
    def reconnecting(self) -> bool:
        """The master was lost and the session tries to get it back (not failed, not yet
        registered again): what waits for a master's word may still get it, from the next."""

    @property
    def master_address(self) -> str:
        """The master's address as given to ``open_communicator`` (also the address of the
        master's own relay)."""

    @property
    def observed_host(self) -> str:
        """The host the master sees this peer's connection come from (its ``Welcome``)."""

    # --- failure ---------------------------------------------------------------------------------

    def raise_if_failed(self, epoch: int | None = None) -> None:
        """Raise (a fresh copy of) the error the communicator failed with, if it did; with
        ``epoch``, raise :class:`MasterLost` if that epoch's master connection is gone."""

    async def ready(self) -> None:
        """Return once this peer may start a collective or a sync: at once normally; while the
        session reconnects to a lost master, or waits to be accepted by the new one, wait
        (bounded by ``Config.master_reconnect_timeout``).  Raises the communicator's failure,
        and :class:`MasterLost` for a peer that rejoined a restarted master until its next
        topology update (its group's loop may stand anywhere until then)."""

    def fail(self, error: PCCLError) -> None:
        """Fail the communicator: every pending and later call raises ``error``."""

    def leave_lockstep(self, error: PCCLError) -> None:
        """This peer can no longer follow its group: fail with ``error`` and drop the master
        connection, so the master removes this peer at once."""

    # --- the master ------------------------------------------------------------------------------

    async def send(self, msg: m.Message, *, epoch: int | None = None, schedule_point: bool = True) -> None:
        """Send to the master (of ``epoch``, when given: else :class:`MasterLost`); a transport
        failure loses the master (reconnect, or ``MasterUnreachable``).  A cancellation point
        always; ``schedule_point=False`` skips the schedule point when the message went out at
        once, for a caller that awaits a checkpoint right after (its answer) or whose task ends."""

    async def send_shielded(self, msg: m.Message, *, epoch: int | None = None) -> None:
        """:meth:`send`, even if the caller is being cancelled, bounded by ``config.peer_timeout``
        (a control message cut mid-frame would break the connection)."""

    def open_route(self, tag: int) -> CollectiveRoute:
        """Begin collective ``tag`` (the phase rule decides: ``InvalidUsage`` otherwise) and
        route the master's messages for it to the returned route until :meth:`close_route`."""

    def close_route(self, tag: int) -> None: ...

    def abandon_route(self, tag: int) -> None:
        """Collective ``tag``'s caller is gone: a background task settles it with the master and
        then closes the route (:meth:`settled` waits for that)."""

    async def settled(self, tag: int | None = None) -> None:
        """Return once no abandoned collective (on ``tag``, when given) is in flight any more;
        a later call on that tag, a topology vote or a sync waits for this first."""

    def open_sync_route(self) -> trio.MemoryReceiveChannel[m.Message]:
        """Route the master's sync messages to the returned channel until
        :meth:`close_sync_route` (``EndOfChannel`` once the communicator fails)."""

    def close_sync_route(self) -> None: ...

    async def rewire(self) -> None:
        """Vote to re-wire this peer's group (after a failed collective); returns when the new
        ring is connected.  Errors as for ``update_topology``."""

    # --- tasks and connections -------------------------------------------------------------------

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Run ``fn(*args)`` in the communicator's nursery; ``False`` if it is shutting down."""

    #: Called with the master's ``CollectiveQuery`` and its connection's epoch (the collective
    #: service answers it, whether or not an op of its tag runs here: docs/protocol.rst,
    #: "Design: completion agreed among peers"); ``None``: queries are dropped.
    on_query: Callable[[m.CollectiveQuery, int], None] | None
    #: Called as this peer registers again after losing its master: the peer-agreed ops it is
    #: ready for and has no outcome of, for ``Register.undecided``; ``None``: none.
    on_register: Callable[[], tuple[m.UndecidedOp, ...]] | None
    #: Called once a registration after a lost master worked (``None``: nothing to do).
    on_rejoined: Callable[[], None] | None

    async def dial(self, address: str) -> FramedConnection:
        """Connect to ``address`` (another peer's listener, a relay) and run the authenticated
        handshake; services open peer connections with :meth:`open_peer` instead."""

    async def open_peer(self, target: m.PeerEndpoint, port: Port) -> FramedConnection:
        """An authenticated connection to ``target``'s listener for ``port`` on which this side
        speaks first, over whatever path works (:meth:`pccl._peer.connector.Connector.open`).
        ``PeerUnreachable`` when none does."""

    async def establish_over(self, stream: Stream, *, role: m.HandshakeRole) -> FramedConnection:
        """Run the authenticated handshake as ``role`` over a connected stream (a relay's splice)."""

    async def accept_peer(self, stream: Stream, slot: HandshakeSlot, listener: Port) -> None:
        """Serve one connection this peer's ``listener`` accepted: the knock, then the port's
        handler (:meth:`serve_port`), or the dial-back an :meth:`open_peer` waits for."""

    def serve_port(self, port: Port, handler: Callable[[FramedConnection, HandshakeSlot | None],
                                                           Awaitable[None]]) -> None:
        """Have ``handler`` serve the connections knocked for ``port`` (accepted by a listener,
        dialled back, or relayed): it reads the service's first message, releases ``slot`` (when
        not ``None``) once the connection proved itself, serves and closes it."""

    async def accept(self, stream: Stream) -> FramedConnection:
        """Run the authenticated handshake on a stream one of this peer's listeners accepted."""

    async def serve_probe(self, conn: FramedConnection, hello: m.ProbeHello) -> None:
        """Answer another peer's bandwidth probe stream on ``conn`` (the ring listener got
        ``hello`` first); closes ``conn``."""

    async def serve_point(self, conn: FramedConnection, hello: m.PointHello) -> None:
        """Serve another peer's point-to-point connection (its sends to this peer) on ``conn``
        (the ring listener got ``hello`` first) until it fails; closes ``conn``."""

    async def listen(self, base_port: int) -> Listener:
        """Bind a listener on the address the session binds to, from ``base_port`` upwards
        (``config.port_search_range`` ports)."""
