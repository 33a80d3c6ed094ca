"""Narrow hooks into a running communicator or master, each doing one thing or returning a
frozen snapshot — what a test needs to read a state or to plant a fault at an exact moment,
reached by name instead of through private attributes.

Each hook is a few lines over the runtime's parts, so a refactor of those parts re-points the
hook, not the tests.  No compatibility promise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any, Literal

import trio

from .._peer import sync as _sync_module
from .._peer import wiring as _wiring_module
from .._peer.host import RouteInbox
from .._peer.probes import ProbeService, probe_bound
from .._peer.session import PeerSession
from ..collectives.kinds import KindOps
from ..communicator import Communicator, internals_of
from ..errors import InvalidArgument, PCCLError, TransportError
from ..net.admission import AdmissionLimits
from ..net.framed import FramedConnection
from ..net.framed_threads import thread_channel
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.paths import Port as _Port
from ..protocol.phases import TopologyVote

__all__ = [
    "PhaseSnapshot", "phase_of", "failure_of", "force_rewire", "hold_call_before_route",
    "RingLanes", "ring_lanes", "send_on_lane", "receive_on_lane", "send_data_on_lane", "break_lane", "kept_bytes",
    "send_raw", "open_route", "close_route", "drop_master_link", "intercept_master_sends",
    "after_master_link_sends", "fail_master_send", "after_acks", "hold_lane_send_lock", "crash",
    "Port", "AdmissionCounts", "listener_address", "admission_counts", "peer_admission_limits",
    "points_under_way", "hold_point_answers", "hold_point_acks_sent", "probe", "probe_bound", "run_kind",
]

Port = Literal["ring", "sync"]


def _session(comm: Communicator) -> PeerSession:
    return internals_of(comm).session


# --- phase and failure -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PhaseSnapshot:
    """What a communicator is doing with the master right now (its phase rule's view)."""

    #: The topology vote it has standing, if any.
    topology_vote: TopologyVote | None
    #: Tags of its collectives in flight.
    collectives: frozenset[int]
    #: Tags it abandoned whose end the master has not confirmed yet.
    abandoned: frozenset[int]
    #: Whether a shared-state sync is in flight.
    syncing: bool


def phase_of(comm: Communicator) -> PhaseSnapshot:
    """A snapshot of ``comm``'s phase."""
    rule = _session(comm).phase
    return PhaseSnapshot(rule.topology_vote, rule.collectives, rule.abandoned, rule.syncing)


def failure_of(comm: Communicator) -> PCCLError | None:
    """The error that ended ``comm`` (kicked, master lost, closed), or None while it lives."""
    return _session(comm).failure


async def force_rewire(comm: Communicator) -> None:
    """Vote a re-wire of ``comm``'s group's ring, as a failed collective does (the ring stays
    the same, its connections are checked and re-dialled where needed); return when the group's
    round is done."""
    await _session(comm).rewire()


@contextlib.asynccontextmanager
async def hold_call_before_route(comm: Communicator, tag: int) -> AsyncIterator[trio.Event]:
    """For the block, the first collective call (or retry) of ``comm`` on ``tag`` that gets this
    far pauses at the end of its way to the tag — after it joined a standing re-wire of this
    peer, waited for the tag's cancelled call to be settled and chose its path — before it claims
    the tag; the event this yields is set once it paused there.  Leaving the block lets it go on
    (a re-wire of this peer begun meanwhile stands then: the call joins it).  One such block per
    communicator at a time (``InvalidArgument``)."""
    gate = internals_of(comm).all_reduce.gate
    if gate.before_route is not None:
        raise InvalidArgument("a collective call of this communicator is held already")
    reached, release = trio.Event(), trio.Event()

    async def before_route(call_tag: int) -> None:
        if call_tag == tag and not reached.is_set():
            reached.set()
            await release.wait()

    gate.before_route = before_route
    try:
        yield reached
    finally:
        release.set()
        gate.before_route = None


# --- ring lanes --------------------------------------------------------------------------------

_lane_ids: weakref.WeakKeyDictionary[FramedConnection, int] = weakref.WeakKeyDictionary()
_next_lane_id = itertools.count(1)


def _lane_id(conn: FramedConnection) -> int:
    if conn not in _lane_ids:
        _lane_ids[conn] = next(_next_lane_id)
    return _lane_ids[conn]


@dataclasses.dataclass(frozen=True)
class RingLanes:
    """``comm``'s ring connections in the current topology round (a snapshot)."""

    successor: int
    predecessor: int
    #: The lanes to the successor in lane order, each as a number that names that connection
    #: for the test's lifetime (equal numbers: the very same connection, kept across rounds).
    to_successor: tuple[int, ...]
    #: Lanes per peer this peer dialled, and per peer that dialled this one.
    outgoing: Mapping[int, int]
    incoming: Mapping[int, int]
    #: The round's connections (lanes and partner links) that this peer knows to be unusable: a
    #: frame cut mid-way here (a cancelled send or payload receive) or a failure closed them.
    torn: int = 0


def ring_lanes(comm: Communicator) -> RingLanes:
    """A snapshot of ``comm``'s ring lanes."""
    links = _session(comm).links
    return RingLanes(
        successor=links.successor, predecessor=links.predecessor,
        to_successor=tuple(_lane_id(c) for c in links.to_successor()),
        outgoing={peer: len(lanes) for peer, lanes in links.outgoing.items()},
        incoming={peer: len(lanes) for peer, lanes in links.incoming.items()},
        torn=sum(1 for c in links.connections() if c.broken or c.frames.closed))


def _outgoing_lane(comm: Communicator, lane: int) -> FramedConnection:
    lanes = _session(comm).links.to_successor()
    if not 0 <= lane < len(lanes):
        raise InvalidArgument(f"lane {lane}: this peer has {len(lanes)} lanes to its successor")
    return lanes[lane]


async def send_on_lane(comm: Communicator, lane: int, message: m.Message) -> None:
    """Send a raw control ``message`` on ``comm``'s lane ``lane`` to its successor."""
    await _outgoing_lane(comm, lane).send(message)


async def send_data_on_lane(comm: Communicator, lane: int, header: DataHeader, payload: Any) -> None:
    """Send a raw data frame on ``comm``'s lane ``lane`` to its successor (a stray frame no
    op reads, say)."""
    await _outgoing_lane(comm, lane).send_data(header, payload)


@contextlib.contextmanager
def hold_lane_send_lock(comm: Communicator, lane: int) -> Iterator[None]:
    """For the block, hold the thread-side send lock of ``comm``'s lane ``lane`` to its
    successor, as a worker thread does while it writes a frame there (real TCP lanes only;
    ``InvalidArgument`` otherwise): whatever keeps frames whole must wait for it."""
    channel = thread_channel(_outgoing_lane(comm, lane))
    if channel is None:
        raise InvalidArgument(f"lane {lane} has no thread-side channel (not real TCP)")
    if not channel.send_lock.acquire(timeout=10.0):
        raise InvalidArgument(f"lane {lane}'s send lock stayed busy for 10 s")
    try:
        yield
    finally:
        channel.send_lock.release()


async def receive_on_lane(comm: Communicator, lane: int) -> m.Message:
    """Receive the next control message on lane ``lane`` from ``comm``'s predecessor (waits
    until the predecessor's lanes are connected)."""
    lanes = await _session(comm).links.from_predecessor()
    return await lanes[lane].receive()


async def lanes_from_predecessor(comm: Communicator) -> int:
    """Wait until ``comm``'s predecessor's lanes of this round are connected; their number."""
    return len(await _session(comm).links.from_predecessor())


def break_lane(comm: Communicator, from_peer: int, lane: int) -> None:
    """Abort ``comm``'s end of lane ``lane`` that ``from_peer`` dialled (a dropped connection)."""
    _session(comm).links.incoming[from_peer][lane].abort()


def kept_bytes(comm: Communicator) -> int:
    """Payload bytes ``comm``'s current links keep in memory now, over every inbox, for ops
    that have not begun or ended here (frames read off a link for another op)."""
    return internals_of(comm).all_reduce.kept_bytes


# --- the master link ---------------------------------------------------------------------------


async def send_raw(comm: Communicator, message: m.Message) -> None:
    """Send ``message`` to the master on ``comm``'s connection, outside any call."""
    await _session(comm).send(message)


def open_route(comm: Communicator, tag: int) -> RouteInbox:
    """Claim collective tag ``tag`` on ``comm`` (as a collective call does) and return the
    inbox the master's replies for it arrive on (``await inbox.receive()``, as a memory
    channel's).  ``InvalidUsage`` if the tag is in flight."""
    return _session(comm).open_route(tag).inbox


def close_route(comm: Communicator, tag: int) -> None:
    """Release tag ``tag`` claimed with :func:`open_route`."""
    _session(comm).close_route(tag)


def drop_master_link(comm: Communicator) -> None:
    """Abort ``comm``'s connection to the master (as a crash of this peer looks to it)."""
    link = _session(comm).master
    if link is not None:
        link.abort()


@contextlib.contextmanager
def intercept_master_sends(comm: Communicator, before: Callable[[m.Message], Awaitable[None]]) -> Iterator[None]:
    """For the block, await ``before(message)`` before each shielded message ``comm`` sends to
    the master: a collective's ``Done`` and ``Withdraw`` (a sync's messages take the plain send
    and are not seen).  A planted fault: ``before`` may delay, or never return."""
    session = _session(comm)
    real = session.send_shielded

    async def send_shielded(msg: m.Message, **kw: Any) -> None:
        await before(msg)
        await real(msg, **kw)

    session.send_shielded = send_shielded  # type: ignore[method-assign]
    try:
        yield
    finally:
        session.send_shielded = real  # type: ignore[method-assign]


def after_master_link_sends(comm: Communicator, after: Callable[[m.Message], Awaitable[None]]) -> None:
    """From now on, await ``after(message)`` after each message sent through the awaited send of
    ``comm``'s current connection to the master: its ``Leave``, and any message that did not fit
    the connection's send buffer at once (the others, heartbeats among them, go out without
    waiting and are not seen).  A planted fault for the closing path."""
    link = _session(comm).master
    if link is None:
        raise InvalidArgument("this communicator has no connection to the master")
    real = link.send

    async def send(message: m.Message) -> None:
        await real(message)
        await after(message)

    link.send = send  # type: ignore[method-assign]


def fail_master_send(comm: Communicator, error: TransportError) -> None:
    """Report ``error`` as a failed send on ``comm``'s master connection (as a heartbeat's send
    that met a closed connection does); raises what the communicator makes of it."""
    _session(comm).master_send_failed(error)


def after_acks(comm: Communicator, after: Callable[[], Awaitable[None]]) -> None:
    """From now on, await ``after()`` right after each ack ``comm`` sends to its ring successor
    (``Config.peer_commit``): a planted fault at the moment its readiness left it."""
    commits = internals_of(comm).all_reduce.peer_commits
    real = commits.send_ack

    async def send_ack(*args: Any) -> None:
        await real(*args)
        await after()

    commits.send_ack = send_ack  # type: ignore[method-assign,assignment]


def crash(comm: Communicator) -> None:
    """Abort every connection of ``comm`` — to the master and to its ring peers — as a crash of
    its process looks to the others (the communicator then fails)."""
    session = _session(comm)
    for connection in session.links.connections():
        connection.abort()
    drop_master_link(comm)


# --- ports facing the network ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AdmissionCounts:
    """A port's unproven connections: holding a handshake slot, and parked for one."""

    pending: int
    waiting: int


def _port(comm: Communicator, port: Port) -> Any:
    if port == "ring":
        session = _session(comm)
        return session.p2p_listener, session.p2p_admission
    if port == "sync":
        sync = internals_of(comm).sync
        return sync.listener, sync.admission
    raise InvalidArgument(f"port must be 'ring' or 'sync', not {port!r}")


def listener_address(comm: Communicator, port: Port) -> str:
    """The ``host:port`` ``comm`` listens on for its ring lanes or for shared-state fetches."""
    listener, _ = _port(comm, port)
    if listener is None:
        raise InvalidArgument(f"this communicator has no {port} listener (yet)")
    return str(listener.address)


def admission_counts(comm: Communicator, port: Port) -> AdmissionCounts:
    """A snapshot of the unproven connections on ``comm``'s ring or sync port."""
    _, admission = _port(comm, port)
    if admission is None:
        return AdmissionCounts(0, 0)
    return AdmissionCounts(admission.pending, admission.waiting)


@contextlib.contextmanager
def peer_admission_limits(limits: AdmissionLimits) -> Iterator[None]:
    """For the block, communicators opened in it admit connections on their ring and sync ports
    within ``limits`` (instead of the defaults)."""
    saved = _wiring_module.PEER_LIMITS, _sync_module.PEER_LIMITS
    _wiring_module.PEER_LIMITS = _sync_module.PEER_LIMITS = limits
    try:
        yield
    finally:
        _wiring_module.PEER_LIMITS, _sync_module.PEER_LIMITS = saved


# --- point-to-point and probes -----------------------------------------------------------------


def points_under_way(comm: Communicator) -> int:
    """How many of ``comm``'s point-to-point messages are moving data right now."""
    return _session(comm).points.under_way()


@contextlib.contextmanager
def hold_point_answers(comm: Communicator) -> Iterator[trio.Event]:
    """For the block, each connection ``comm`` dials (from now on) for its point-to-point sends
    stops reading once it took a ``PointReady``, until the event this yields is set: what the
    receiver sends after it (the message's ``PointAck``, an EOF, a reset) waits unread in the
    kernel meanwhile, as behind a sender whose loop is slow to come round."""
    session = _session(comm)
    real = session.open_peer
    release = trio.Event()

    async def open_peer(target: m.PeerEndpoint, port: _Port) -> FramedConnection:
        conn = await real(target, port)
        if port == _Port.P2P:
            receive, took_ready = conn.receive_frame, False

            async def receive_frame() -> m.Message | DataHeader:
                nonlocal took_ready
                if took_ready:
                    await release.wait()
                frame = await receive()
                took_ready = took_ready or isinstance(frame, m.PointReady)
                return frame

            conn.receive_frame = receive_frame  # type: ignore[method-assign]
        return conn

    session.open_peer = open_peer  # type: ignore[method-assign]
    try:
        yield release
    finally:
        session.open_peer = real  # type: ignore[method-assign]


@contextlib.contextmanager
def hold_point_acks_sent(comm: Communicator) -> Iterator[trio.Event]:
    """For the block, each connection ``comm`` serves (from now on: the ones its senders dial)
    holds its writer right after a ``PointAck`` was handed to the transport, until the event this
    yields is set (shielded, as the transport's own schedule point after a write is): the
    sender may read the answer, return and close meanwhile, as when this side's loop is slow to
    come round after the write."""
    points = _session(comm).points
    real = points.serve
    release = trio.Event()

    async def serve(conn: FramedConnection, hello: m.PointHello) -> None:
        send = conn.send

        async def send_held(msg: m.Message) -> None:
            await send(msg)
            if isinstance(msg, m.PointAck):
                with trio.CancelScope(shield=True):
                    await release.wait()

        conn.send = send_held  # type: ignore[method-assign,assignment]
        await real(conn, hello)

    points.serve = serve  # type: ignore[method-assign]
    try:
        yield release
    finally:
        del points.serve


async def probe(comm: Communicator, request: m.ProbeRequest) -> m.ProbeReport:
    """Run the probes of ``request`` from ``comm`` as the master's ``ProbeRequest`` makes it
    (never raises for a failed probe; bounded by :func:`probe_bound` per target)."""
    return await ProbeService(_session(comm)).run(request)


# --- a kind that is not built in ------------------------------------------------------------------


async def run_kind(comm: Communicator, row: KindOps, *args: Any) -> Any:
    """Run one collective of the kind ``row`` describes on ``comm`` (``args``: the row's
    ``check`` arguments), as ``comm.all_reduce`` and its siblings run theirs: a kind written in
    a test (one row and one op module) before it has a method of its own."""
    return await internals_of(comm).all_reduce.call(row, *args)
