"""The peer side: :func:`open_communicator` and :class:`Communicator`.

A communicator holds one framed connection to the master.  A single reader task receives every
master message and dispatches it: votes are answered through waiters (so ``are_peers_pending()``
can run while collectives use the same connection), ``ConnectToPeers`` starts (or restarts) the
p2p establishment in the background, collective messages are routed by tag to the all-reduce
(``_collective_inbox``), a ``KickNotice`` or a lost connection fails every pending and later call.
A heartbeat task keeps the master informed and declares the master unreachable when it has been
silent for ``config.peer_timeout``.

P2P links: every peer listens on a p2p port (bump-allocated from ``config.p2p_base_port``) and,
in each topology round, dials its ring successor (framed handshake with the run token, then
``P2PHello``/``P2PHelloAck``).  The current round's connections live in :class:`P2PLinks`:
``outgoing[successor]`` was dialled by this peer, ``incoming[predecessor]`` was accepted.  The
ring all-reduce sends on the former and receives on the latter.  A new round closes the old
round's connections.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Generic, NoReturn, TypeVar

import numpy as np
import trio

from .config import Config
from ._groups import single_exception
from .errors import (
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    MasterUnreachable,
    PCCLError,
    PeerDisconnected,
    ProtocolError,
    StreamClosed,
    TransportError,
)
from .net.base import Listener, Network, Stream, format_address, parse_address
from .net.framed import FramedConnection, accept_framed, open_framed
from .net.serving import HandshakeSlot, serve_listener
from .protocol import messages as m
from .shared_state import SharedState, SharedStateService
from .types import SyncInfo, SyncStrategy
from .collectives.operation import MANY_FIRST_TAG, AllReduceService
from .types import Quantization, ReduceInfo, ReduceOp

__all__ = ["Communicator", "CommunicatorStatistics", "P2PLinks", "open_communicator"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Scheduler turns the heartbeat task gives the reader before it calls a quiet master silent
#: (the reader needs two or three to take in a message waiting on the socket).
_READER_TURNS = 10

#: Collective messages the reader routes by tag.
_COLLECTIVE_REPLIES = (m.CollectiveCommence, m.CollectiveComplete, m.CollectiveAbort, m.CollectiveRejected)


@dataclasses.dataclass(frozen=True)
class CommunicatorStatistics:
    """A snapshot of one communicator (``Communicator.statistics()``)."""

    peer_id: int
    peer_group: int
    world_size: int
    global_world_size: int
    num_peer_groups: int
    largest_peer_group_size: int
    #: This group's ring (peer ids in order) as of the last topology update.
    ring: tuple[int, ...]
    topology_updates: int
    p2p_rounds: int
    p2p_connections: int
    #: Counters maintained by the collectives (all-reduce issue).
    collectives_completed: int
    collectives_aborted: int
    retries: int
    tx_bytes: int
    rx_bytes: int


class _Waiter(Generic[_T]):
    """One outstanding answer from the master."""

    def __init__(self, kind: str = "") -> None:
        self.kind = kind
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
            raise _fresh(self._error)
        return self._value  # type: ignore[return-value]


class CollectiveRoute:
    """The master's messages for one in-flight collective tag (see ``Communicator._collective_inbox``).

    Messages queue on :attr:`inbox` (``EndOfChannel`` once the communicator fails).  While
    :attr:`intercept` is set, :meth:`deliver` hands each message to it synchronously instead (in
    the task reading the master connection), and ``intercept(None)`` tells it the communicator
    failed: a running op reacts to an abort without a task of its own listening.
    """

    __slots__ = ("_send", "inbox", "intercept")

    def __init__(self, capacity: int) -> None:
        self._send, self.inbox = trio.open_memory_channel[m.Message](capacity)
        self.intercept: Callable[[m.Message | None], None] | None = None

    def deliver(self, msg: m.Message) -> None:
        """Queue (or intercept) ``msg``; ``trio.WouldBlock`` if the inbox is full."""
        if self.intercept is not None:
            self.intercept(msg)
        else:
            self._send.send_nowait(msg)

    def close(self) -> None:
        self._send.close()
        if self.intercept is not None:
            self.intercept(None)


def _leaf_error(exc: BaseException) -> PCCLError | None:
    """The pccl error inside ``exc`` (possibly an ExceptionGroup of dial tasks), or None if it
    holds something else (a cancellation or a bug, which must propagate)."""
    if isinstance(exc, PCCLError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        errors = [_leaf_error(e) for e in exc.exceptions]
        if errors and all(e is not None for e in errors):
            return errors[0]
    return None


def _kicked(notice: m.KickNotice) -> Kicked:
    try:
        reason = KickReason(notice.reason)
    except ValueError:  # a newer master's reason code
        reason = KickReason.UNSPECIFIED
    return Kicked(reason, notice.detail)


def _fresh(error: PCCLError) -> PCCLError:
    """A new instance of ``error`` to raise (raising one object from many places tangles tracebacks)."""
    if isinstance(error, Kicked):
        copy: PCCLError = Kicked(error.reason, error.detail)
    else:
        copy = type(error)(*error.args)
    copy.__cause__ = error.__cause__
    return copy


class P2PLinks:
    """The ring connections of one topology round (what the all-reduce runs on).

    ``ring`` is this peer's group ring for the round.  ``outgoing[successor]`` holds the
    ``lanes`` connections this peer dialled (lane ``j`` at index ``j``); ``incoming[predecessor]``
    maps lane index to the connections the predecessor dialled to this peer.  With two peers the
    successor is also the predecessor: the two directions use different connections.  Nobody
    reads these connections between collectives; the all-reduce owns them while it runs.
    """

    def __init__(self, round_id: int, ring: tuple[int, ...], me: int, lanes: int) -> None:
        self.round = round_id
        self.ring = ring
        self.me = me
        self.lanes = lanes
        self.outgoing: dict[int, tuple[FramedConnection, ...]] = {}
        self.incoming: dict[int, dict[int, FramedConnection]] = {}
        self.closed = False
        self._changed = trio.Event()

    @property
    def successor(self) -> int:
        i = self.ring.index(self.me)
        return self.ring[(i + 1) % len(self.ring)]

    @property
    def predecessor(self) -> int:
        i = self.ring.index(self.me)
        return self.ring[(i - 1) % len(self.ring)]

    def connections(self) -> list[FramedConnection]:
        out = [c for lanes in self.outgoing.values() for c in lanes]
        return out + [c for lanes in self.incoming.values() for c in lanes.values()]

    def to_successor(self) -> tuple[FramedConnection, ...]:
        """The lanes to the successor (empty when alone or not connected)."""
        return self.outgoing.get(self.successor, ())

    async def from_predecessor(self) -> tuple[FramedConnection, ...]:
        """The predecessor's lanes to this peer, in lane order (see :meth:`incoming_from`)."""
        return await self.incoming_from(self.predecessor)

    async def incoming_from(self, peer_id: int) -> tuple[FramedConnection, ...]:
        """The ``lanes`` connections ``peer_id`` dialled to this peer in this round, waiting for
        handshakes still running.  ``PeerDisconnected`` once the round's links are closed.
        Cancellation (the collective's abort or timeout) just stops waiting."""
        while len(self.incoming.get(peer_id, ())) < self.lanes:
            if self.closed:
                raise PeerDisconnected(f"the ring connections of round {self.round} are closed")
            await self._changed.wait()
        lanes = self.incoming[peer_id]
        return tuple(lanes[j] for j in range(self.lanes))

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def close(self) -> None:
        for conn in self.connections():
            conn.abort()
        self.outgoing.clear()
        self.incoming.clear()
        self.closed = True
        self._notify()


class Communicator:
    """A peer's membership in a run.  Obtain one from :func:`open_communicator`.

    Every async method is a Trio checkpoint.  When the master kicks this peer every pending and
    later call raises :class:`~pccl.errors.Kicked`; when the master is lost (closed connection,
    or silent for ``config.peer_timeout``) they raise :class:`~pccl.errors.MasterUnreachable`.
    """

    def __init__(self, master_address: str, *, peer_group: int, token: str | bytes | None, config: Config,
                 network: Network, rng: random.Random | None, nursery: trio.Nursery) -> None:
        if not isinstance(peer_group, int) or not 0 <= peer_group < 2**32:
            raise InvalidArgument(f"peer_group must be an integer in [0, 2**32), got {peer_group!r}")
        self.master_address = master_address
        self.peer_group = peer_group
        self.peer_id = 0
        self._token = token
        self._config = config
        self._network = network
        self._nonce_source = rng
        self._nursery = nursery
        self._master: FramedConnection | None = None
        self._listener: Listener | None = None
        self._failure: PCCLError | None = None
        self._closed = False
        self._last_heard = trio.current_time()
        self._membership = m.Membership(0, 0, 0, 0)
        self._ring: tuple[m.PeerEndpoint, ...] = ()
        self._topology_waiter: _Waiter[m.TopologyComplete] | None = None
        self._pending_waiter: _Waiter[bool] | None = None
        self._links = P2PLinks(0, (0,), 0, config.p2p_lanes)
        self._round_scope: trio.CancelScope | None = None
        self._round_changed = trio.Event()
        self._routes: dict[int, CollectiveRoute] = {}
        self._shared = SharedStateService(self)
        self._stats = dict.fromkeys(("topology_updates", "p2p_rounds", "collectives_completed",
                                     "collectives_aborted", "retries", "tx_bytes", "rx_bytes"), 0)
        self._all_reduce = AllReduceService(self)

    # --- attributes (accepted peers only; identical on every peer after each change) -----------

    @property
    def world_size(self) -> int:
        """Accepted peers in this peer's group."""
        return self._membership.world_size

    @property
    def global_world_size(self) -> int:
        """Accepted peers in all groups (pending peers are not counted)."""
        return self._membership.global_world_size

    @property
    def num_peer_groups(self) -> int:
        return self._membership.num_peer_groups

    @property
    def largest_peer_group_size(self) -> int:
        return self._membership.largest_peer_group_size

    @property
    def ring(self) -> tuple[int, ...]:
        """This group's ring (peer ids, in order) as of the last topology update."""
        return tuple(e.peer_id for e in self._ring)

    @property
    def ring_endpoints(self) -> tuple[m.PeerEndpoint, ...]:
        return self._ring

    @property
    def p2p(self) -> P2PLinks:
        """The current round's ring connections (for the collectives)."""
        return self._links

    def statistics(self) -> CommunicatorStatistics:
        return CommunicatorStatistics(
            peer_id=self.peer_id, peer_group=self.peer_group, world_size=self.world_size,
            global_world_size=self.global_world_size, num_peer_groups=self.num_peer_groups,
            largest_peer_group_size=self.largest_peer_group_size, ring=self.ring,
            p2p_connections=len(self._links.connections()), **self._stats)

    # --- public calls ---------------------------------------------------------------------------

    async def update_topology(self) -> None:
        """Vote to accept pending peers and re-wire the ring; return when every accepted peer of
        every group voted and the new ring is connected (p2p failures are retried internally).

        ``InvalidUsage`` while a collective of this peer is in flight.  Cancellation leaves the
        vote standing: the next call waits for the same vote instead of voting again.
        Raises ``Kicked``, ``MasterUnreachable``.
        """
        await self._topology_vote(accept_new_peers=True)

    async def are_peers_pending(self) -> bool:
        """Whether a registered peer waits to be accepted; answered once every accepted peer
        asked.  Legal while collectives run.  Cancellation leaves the vote standing (the next
        call waits for its answer).  Raises ``Kicked``, ``MasterUnreachable``."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        waiter = self._pending_waiter
        if waiter is None:
            waiter = self._pending_waiter = _Waiter()
            await self._send_vote(m.VotePeersPending(), waiter, "_pending_waiter")
        return await waiter.wait()

    async def aclose(self) -> None:
        """Leave the run: tell the master (best effort, bounded), close every connection and stop
        the background tasks.  Idempotent; closes even when cancelled."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            if self._master is not None and self._failure is None:
                with trio.move_on_after(min(1.0, self._config.connect_timeout)):
                    try:
                        await self._master.send(m.Leave())
                    except PCCLError:
                        pass
            self._fail(InvalidUsage("the communicator is closed"))
            if self._master is not None:
                await self._master.aclose()
            self._links.close()
            if self._listener is not None:
                await self._listener.aclose()
            await self._shared.aclose()
        self._nursery.cancel_scope.cancel()

    # --- all-reduce (the machinery is pccl.collectives.operation) --------------------------------

    async def all_reduce(self, send: np.ndarray, recv: np.ndarray | None = None, *, op: ReduceOp = ReduceOp.SUM,
                         tag: int = 0, quantization: Quantization | None = None) -> ReduceInfo:
        """Ring all-reduce of ``send`` into ``recv`` (``None``: in place) over the group's accepted
        peers; returns ``ReduceInfo(world_size, tx_bytes, rx_bytes)`` — the peers it ran over and
        the payload bytes this peer moved.

        Every peer of the group must call it with the same ``tag``, element count, dtype, ``op``
        and ``quantization`` (else ``InvalidUsage`` on every peer).  f16/bf16 accumulate in f32;
        AVG divides by the number of participants; MIN_MAX quantization leaves every peer with
        bit-identical results.  Several calls with distinct tags may run at once.

        Raises ``InvalidArgument`` (bad buffer: unsupported dtype, size/dtype mismatch between
        ``send`` and ``recv``, non-contiguous, read-only output, NaN/Inf under quantization),
        ``InvalidUsage`` (``tag`` already in flight here, or the peers' parameters disagree),
        ``TooFewPeers`` (alone in the group; the buffers are untouched), ``CollectiveAborted`` (a
        participant failed: an in-place buffer holds its input again; retry — a stale ring is
        re-wired automatically by the next call), ``Kicked``, ``MasterUnreachable``.
        Cancellation restores an in-place buffer and makes the other participants abort.
        """
        return await self._all_reduce.all_reduce(send, recv, op=op, tag=tag, quantization=quantization)

    async def all_reduce_many(self, arrays: Sequence[np.ndarray], *, op: ReduceOp = ReduceOp.SUM,
                              quantization: Quantization | None = None, max_in_flight: int = 4,
                              first_tag: int = MANY_FIRST_TAG) -> ReduceInfo:
        """All-reduce each array of ``arrays`` in place, up to ``max_in_flight`` at once (array
        ``i`` uses tag ``first_tag + i``).  Ops that abort are retried on the survivors — after
        every running op has settled — until all succeeded.  Returns the smallest world size
        any array was reduced over and the summed payload bytes of the successful ops.

        Raises ``TooFewPeers`` once alone (arrays reduced before keep their results, the others
        their inputs), and the errors of :meth:`all_reduce` other than ``CollectiveAborted``;
        no op is left running when it raises.  Cancellation cancels every running op.
        """
        return await self._all_reduce.all_reduce_many(arrays, op=op, quantization=quantization,
                                                      max_in_flight=max_in_flight, first_tag=first_tag)

    # --- shared state (logic in pccl/shared_state.py) -----------------------------------------------

    async def sync_shared_state(self, state: SharedState,
                                strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> SyncInfo:
        """Make ``state`` bit-identical to the group's popular state and adopt its revision
        (written back into ``state.revision``).  Returns once every peer of the group is done.

        Raises ``InvalidArgument``/``InvalidUsage`` (bad state or strategy, collective or another
        sync in flight, ENFORCE_POPULAR mixed with another strategy), ``RevisionViolation`` (the
        revision did not advance by exactly one; this peer is kicked), ``Kicked`` (key set, dtype
        or size differs from the popular state; SEND_ONLY without the popular state),
        ``SharedStateSyncFailed`` (no source could deliver, hash mismatch), ``MasterUnreachable``.
        Cancellation after the vote went out leaves the run (the communicator fails).
        """
        self._refuse_during_topology_vote("synchronise the shared state")
        return await self._shared.sync(state, strategy)

    def _refuse_during_topology_vote(self, what: str) -> None:
        # A cancelled update_topology() leaves its vote standing at the master, which refuses
        # (kicks, OUT_OF_PHASE) any collective or sync vote until that round completes.  Fail
        # locally with a clear message instead of getting the peer kicked.
        waiter = self._topology_waiter
        if waiter is not None:
            raise InvalidUsage(f"cannot {what} while a topology vote ({waiter.kind}) is outstanding; "
                               "call update_topology() again to finish it")

    async def steps(self, state: SharedState, *,
                    strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> AsyncIterator[SyncInfo]:
        """The recommended training loop, as an async iterator yielding each step's ``SyncInfo``.

        Each step: ``update_topology()`` (skipped on the first step — a newcomer's
        ``open_communicator`` returned exactly when the others' update returned, so it already
        stands at this line), then while this peer is alone in its group, wait for a newcomer
        (``are_peers_pending()`` every ``config.heartbeat_interval``, accepting it when one
        waits), then ``sync_shared_state(state, strategy)``.  The caller all-reduces, updates the
        state and increments ``state.revision`` in the loop body.  Errors as for the calls it
        makes; cancellation as for them.  Close it (``aclose``) or break out of the loop.
        """
        first = True
        while True:
            if not first:
                await self.update_topology()
            first = False
            while self.world_size < 2:
                if await self.are_peers_pending():
                    await self.update_topology()
                else:
                    await trio.sleep(self._config.heartbeat_interval)
            yield await self.sync_shared_state(state, strategy)

    def _leave_lockstep(self, error: PCCLError) -> None:
        """This peer can no longer follow its group (a sync was abandoned midway): fail every
        call with ``error`` and drop the master connection so the master removes it at once."""
        self._fail(error)
        if self._master is not None:
            self._master.abort()

    # --- internals the collectives use -----------------------------------------------------------

    async def _rewire(self) -> None:
        """Vote to re-wire this peer's group only (after a failed collective); no peer is accepted.
        Returns when the group's new ring is connected.  Errors as for :meth:`update_topology`."""
        await self._topology_vote(accept_new_peers=False)

    def _collective_inbox(self, tag: int) -> trio.MemoryReceiveChannel[m.Message]:
        """Route the master's messages for collective ``tag`` to the returned channel until
        :meth:`_release_collective`.  ``InvalidUsage`` if the tag is in flight.  The channel ends
        (``EndOfChannel``) when the communicator fails; then call ``_raise_if_unusable``."""
        return self._collective_route(tag).inbox

    def _collective_route(self, tag: int) -> CollectiveRoute:
        """As :meth:`_collective_inbox`, but the route itself (whose messages can also be
        intercepted synchronously: see :class:`CollectiveRoute`)."""
        self._raise_if_unusable()
        if tag in self._routes:
            raise InvalidUsage(f"collective tag {tag} is already in flight")
        if self._shared.busy:
            raise InvalidUsage("cannot start a collective while a shared-state sync is running")
        self._refuse_during_topology_vote("start a collective")
        route = CollectiveRoute(16)
        self._routes[tag] = route
        return route

    def _release_collective(self, tag: int) -> None:
        route = self._routes.pop(tag, None)
        if route is not None:
            route.close()

    async def _send_master(self, msg: m.Message) -> None:
        """Send to the master; a transport failure fails the communicator (``MasterUnreachable``)."""
        self._raise_if_unusable()
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
            self._master_send_failed(exc)

    async def _flush_master(self) -> None:
        """Finish a frame ``send_nowait`` began; errors as for :meth:`_send_master`."""
        assert self._master is not None
        try:
            await self._master.flush()
        except TransportError as exc:
            self._master_send_failed(exc)

    def _master_send_failed(self, exc: TransportError) -> NoReturn:
        self._fail(MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}"), cause=exc)
        self._raise_if_unusable()
        raise AssertionError("unreachable: the communicator has failed")  # pragma: no cover

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise _fresh(self._failure)

    # --- startup --------------------------------------------------------------------------------

    async def _start(self) -> None:
        cfg = self._config
        host, _ = parse_address(self.master_address)
        bind = "[::]" if ":" in host else "0.0.0.0"
        self._listener = await self._network.listen(format_address(bind.strip("[]"), cfg.p2p_base_port),
                                                    port_range=cfg.port_search_range)
        try:
            self._master = await open_framed(self._network, self.master_address, token=self._token, config=cfg,
                                             nonce_source=self._nonce_source)
        except TransportError as exc:
            raise MasterUnreachable(f"cannot reach the master at {self.master_address}: {exc}") from exc
        self._last_heard = trio.current_time()
        waiter: _Waiter[m.TopologyComplete] = _Waiter("accept")
        self._topology_waiter = waiter  # our first TopologyComplete is the acceptance
        state_port = await self._shared.listen(bind.strip("[]"))
        await self._send_master(m.Register(self.peer_group, self._listener.port, state_port, 0))
        try:
            with trio.fail_after(cfg.connect_timeout):
                while True:
                    msg = await self._master.receive()
                    if isinstance(msg, m.Welcome):
                        break
                    if isinstance(msg, m.KickNotice):
                        raise _kicked(msg)
                    if not isinstance(msg, m.Heartbeat):
                        raise ProtocolError(f"the master sent {type(msg).__name__} before Welcome")
        except trio.TooSlowError:
            raise MasterUnreachable(f"the master at {self.master_address} did not answer the registration") from None
        except TransportError as exc:
            raise MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}") from exc
        self.peer_id = msg.peer_id
        self._links = P2PLinks(0, (self.peer_id,), self.peer_id, cfg.p2p_lanes)
        log.info("registered with the master at %s as peer %x (group %d)", self.master_address, self.peer_id,
                 self.peer_group)
        self._nursery.start_soon(self._read_master)
        self._nursery.start_soon(self._heartbeat)
        self._nursery.start_soon(self._serve_p2p, self._listener)
        self._nursery.start_soon(self._shared.serve)
        await waiter.wait()
        log.info("accepted: world size %d, global world size %d", self.world_size, self.global_world_size)

    # --- votes ----------------------------------------------------------------------------------

    async def _topology_vote(self, *, accept_new_peers: bool) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._raise_if_unusable()
        kind = "accept" if accept_new_peers else "rewire"
        if self._routes:
            raise InvalidUsage(f"cannot update the topology while collective tags {sorted(self._routes)} are in flight")
        if self._shared.busy:
            raise InvalidUsage("cannot update the topology while a shared-state sync is running")
        waiter = self._topology_waiter
        if waiter is None:
            waiter = self._topology_waiter = _Waiter(kind)
            await self._send_vote(m.VoteTopology(accept_new_peers), waiter, "_topology_waiter")
        elif waiter.kind != kind:
            raise InvalidUsage(f"a topology vote of another kind ({waiter.kind}) is still outstanding")
        await waiter.wait()

    async def _send_vote(self, msg: m.Message, waiter: _Waiter, slot: str) -> None:
        try:
            await self._send_master(msg)
        except BaseException:
            # Not sent (cancelled while waiting to send, or the connection failed): no vote stands.
            if getattr(self, slot) is waiter:
                setattr(self, slot, None)
            raise

    # --- background tasks -----------------------------------------------------------------------

    def _fail(self, error: PCCLError, *, cause: BaseException | None = None) -> None:
        if self._failure is not None:
            return
        if self._closed and not isinstance(error, InvalidUsage):
            # aclose() has begun: its Leave makes the master hang up, which the reader or a
            # heartbeat may meet first.  That is the end this peer asked for, not a failure.
            error, cause = InvalidUsage("the communicator is closed"), None
        if cause is not None:
            error.__cause__ = cause
        self._failure = error
        if not isinstance(error, InvalidUsage):
            log.warning("peer %x: %s", self.peer_id, error)
        for slot in ("_topology_waiter", "_pending_waiter"):
            waiter = getattr(self, slot)
            if waiter is not None:
                waiter.fail(error)
                setattr(self, slot, None)
        for route in self._routes.values():
            route.close()
        self._shared.fail()

    async def _read_master(self) -> None:
        assert self._master is not None
        try:
            while True:
                msg = await self._master.receive()
                self._last_heard = trio.current_time()
                self._dispatch(msg)
        except ProtocolError as exc:
            self._fail(ProtocolError(f"the master at {self.master_address} sent garbage: {exc}"), cause=exc)
        except TransportError as exc:
            self._fail(MasterUnreachable(f"lost the connection to the master at {self.master_address}: {exc}"),
                       cause=exc)

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.Heartbeat):
            return
        if isinstance(msg, m.KickNotice):
            self._fail(_kicked(msg))
        elif isinstance(msg, m.ConnectToPeers):
            self._start_round(msg)
        elif isinstance(msg, m.TopologyComplete):
            self._membership = msg.membership
            self._ring = msg.ring
            self._stats["topology_updates"] += 1
            waiter, self._topology_waiter = self._topology_waiter, None
            if waiter is not None:
                waiter.set(msg)
        elif isinstance(msg, m.PeersPendingResult):
            waiter, self._pending_waiter = self._pending_waiter, None
            if waiter is not None:
                waiter.set(msg.pending)
        elif isinstance(msg, _COLLECTIVE_REPLIES):
            route = self._routes.get(msg.tag)
            if route is None:
                log.debug("dropping %s for tag %d: no collective waits for it", type(msg).__name__, msg.tag)
                return
            try:
                route.deliver(msg)
            except trio.WouldBlock:
                self._fail(ProtocolError(f"the master flooded collective tag {msg.tag}"))
        elif self._shared.deliver(msg):
            pass
        else:
            self._fail(ProtocolError(f"the master sent an unexpected {type(msg).__name__}"))

    async def _heartbeat(self) -> None:
        cfg = self._config
        while self._failure is None:
            due = trio.current_time() + cfg.heartbeat_interval
            await trio.sleep_until(due)
            late = trio.current_time() - due
            if late >= cfg.peer_timeout / 2:
                log.warning("peer %x: no heartbeat could go to the master for %.3g s: the event loop was blocked "
                            "(the master removes peers silent for Config.peer_timeout = %g s); run long "
                            "computations off the Trio thread", self.peer_id, late + cfg.heartbeat_interval,
                            cfg.peer_timeout)
            if trio.current_time() - self._last_heard > cfg.peer_timeout:
                # Before calling the master silent, let the reader take in what may be waiting
                # unread: after user code blocked the event loop, the master's heartbeats (or its
                # kick) are there.  Counted in scheduler turns, not time, since the loop may block
                # again meanwhile; a hung master is still caught within a few turns.
                for _ in range(_READER_TURNS):
                    await trio.lowlevel.checkpoint()
                    if self._failure is not None:
                        return
                    if trio.current_time() - self._last_heard <= cfg.peer_timeout:
                        break
                else:
                    silent = trio.current_time() - self._last_heard
                    self._fail(MasterUnreachable(f"the master at {self.master_address} has been silent for {silent:.3g} s"))
                    return
            try:
                await self._send_master(m.Heartbeat())
            except PCCLError:
                return

    # --- p2p ------------------------------------------------------------------------------------

    def _start_round(self, msg: m.ConnectToPeers) -> None:
        if msg.round <= self._links.round or self.peer_id not in msg.ring:
            self._fail(ProtocolError(f"the master sent a bad ConnectToPeers (round {msg.round})"))
            return
        if self._round_scope is not None:
            self._round_scope.cancel()
        self._links.close()
        self._links = P2PLinks(msg.round, tuple(msg.ring), self.peer_id, self._config.p2p_lanes)
        self._stats["p2p_rounds"] += 1
        self._round_changed.set()
        self._round_changed = trio.Event()
        self._round_scope = trio.CancelScope()
        endpoints = {e.peer_id: e for e in msg.neighbours}
        self._nursery.start_soon(self._establish, self._links, self._round_scope, endpoints)

    async def _establish(self, links: P2PLinks, scope: trio.CancelScope, endpoints: dict[int, m.PeerEndpoint]) -> None:
        with scope:
            ok, unreachable = True, ()
            succ = links.successor
            if succ != self.peer_id:
                dialled: list[FramedConnection | None] = [None] * links.lanes
                try:
                    endpoint = endpoints.get(succ)
                    if endpoint is None:
                        raise ProtocolError(f"the master sent no endpoint for ring successor {succ:x}")
                    async with trio.open_nursery() as nursery:
                        for lane in range(links.lanes):
                            nursery.start_soon(self._dial_lane, endpoint, links, lane, dialled)
                except BaseException as exc:
                    for conn in dialled:
                        if conn is not None:
                            conn.abort()
                    error = _leaf_error(exc)
                    if error is None:
                        raise
                    log.info("peer %x: cannot connect to ring successor %x in round %d: %s",
                             self.peer_id, succ, links.round, error)
                    ok, unreachable = False, (succ,)
                else:
                    if links is not self._links:
                        for conn in dialled:
                            conn.abort()  # type: ignore[union-attr]
                        return
                    links.outgoing[succ] = tuple(dialled)  # type: ignore[arg-type]
                    links._notify()
            try:
                await self._send_master(m.P2PReport(links.round, ok, unreachable))
            except PCCLError:
                pass  # the communicator failed; every caller sees that

    async def _dial_lane(self, endpoint: m.PeerEndpoint, links: P2PLinks, lane: int,
                         dialled: list[FramedConnection | None]) -> None:
        address = format_address(endpoint.host, endpoint.p2p_port)
        conn = await open_framed(self._network, address, token=self._token, config=self._config,
                                 nonce_source=self._nonce_source)
        dialled[lane] = conn
        try:
            with trio.fail_after(self._config.connect_timeout):
                await conn.send(m.P2PHello(self.peer_id, links.round, lane, links.lanes))
                ack = await conn.receive()
        except trio.TooSlowError:
            raise ProtocolError(f"{address} did not acknowledge the p2p hello") from None
        if not isinstance(ack, m.P2PHelloAck) or ack.peer_id != endpoint.peer_id or ack.round != links.round:
            raise ProtocolError(f"{address} answered the p2p hello with {ack!r}")

    async def _serve_p2p(self, listener: Listener) -> None:
        def failed(exc: TransportError) -> None:
            # StreamClosed: closed by aclose.  Anything else is permanent (running out of
            # descriptors is waited out inside accept): say so, the master will see this peer as
            # unreachable by its ring predecessor.
            if not isinstance(exc, StreamClosed):
                log.error("peer %x: p2p listener failed, accepting no more ring connections: %s", self.peer_id, exc)

        await serve_listener(listener, self._accept_p2p, on_error=failed)

    async def _accept_p2p(self, stream: Stream, slot: HandshakeSlot) -> None:
        remote = stream.remote_address
        conn: FramedConnection | None = None
        try:
            conn = await accept_framed(stream, token=self._token, config=self._config, nonce_source=self._nonce_source)
            slot.release()  # authenticated: no longer an anonymous connection
            with trio.fail_after(self._config.connect_timeout):
                hello = await conn.receive()
                if not isinstance(hello, m.P2PHello):
                    raise ProtocolError(f"expected P2PHello, got {type(hello).__name__}")
                while self._links.round < hello.round:  # the dialler may be ahead of us
                    await self._round_changed.wait()
            links = self._links
            if hello.round != links.round or hello.peer_id != links.predecessor or hello.peer_id == self.peer_id:
                raise ProtocolError(f"unexpected p2p hello from peer {hello.peer_id:x} for round {hello.round} "
                                    f"(current round {links.round})")
            if hello.lanes != links.lanes or not 0 <= hello.lane < links.lanes:
                raise ProtocolError(f"peer {hello.peer_id:x} dials lane {hello.lane} of {hello.lanes}, this peer "
                                    f"uses {links.lanes} lanes (Config.p2p_lanes must match)")
            # Register before acknowledging: once the dialler has its ack it reports success, and
            # the round may complete at once; the connection must be in place by then.
            lanes = links.incoming.setdefault(hello.peer_id, {})
            old = lanes.pop(hello.lane, None)
            if old is not None:
                old.abort()
            lanes[hello.lane] = conn
            links._notify()
            try:
                await conn.send(m.P2PHelloAck(self.peer_id, hello.round))
            except BaseException:
                if lanes.get(hello.lane) is conn:
                    del lanes[hello.lane]
                raise
        except (PCCLError, trio.TooSlowError) as exc:
            log.info("peer %x: refused p2p connection from %s: %s", self.peer_id, remote, exc)
            if conn is not None:
                conn.abort()
        except BaseException:
            if conn is not None:  # cancelled while pending: close now, not when the GC gets to it
                conn.abort()
            raise


@asynccontextmanager
async def open_communicator(
    master_address: str,
    *,
    peer_group: int = 0,
    token: str | bytes | None = None,
    config: Config | None = None,
    network: Network | None = None,
    rng: random.Random | None = None,
) -> AsyncIterator[Communicator]:
    """Connect to the master, register in ``peer_group`` and wait until accepted.

    The first peer is accepted at once; later ones when the accepted peers next call
    ``update_topology()`` — this returns at the same moment theirs does.  ``network`` defaults
    to real TCP; ``rng`` (when given) draws the handshake nonces (the simulator seeds it).
    Raises ``MasterUnreachable`` (cannot connect, or lost while waiting), ``AuthenticationFailed``
    (wrong or missing run token), ``Kicked``, ``ProtocolError``.  Cancellation while waiting
    leaves the run.  Leaving the block closes the communicator (``aclose``).
    """
    config = config or Config()
    if network is None:
        from .net.tcp import TcpNetwork

        network = TcpNetwork(config)
    try:
        async with trio.open_nursery() as nursery:
            comm = Communicator(master_address, peer_group=peer_group, token=token, config=config,
                                network=network, rng=rng, nursery=nursery)
            try:
                await comm._start()
                yield comm
            finally:
                await comm.aclose()
    except BaseExceptionGroup as group:
        raise single_exception(group) from None

