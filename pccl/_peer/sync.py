"""The shared-state sync (``Communicator.sync_shared_state``): vote, fetch, verify, adopt.

A sync (:meth:`StateSyncService.sync`):

1. hash every tensor (xxh3-128 over its raw bytes, with a checkpoint every 64 MiB);
2. start serving this state on the peer's shared-state port (unless RECEIVE_ONLY) and vote
   ``SyncVote(revision, strategy, entries, lineage)``;
3. the master elects the popular state (:mod:`pccl.protocol.master.election`) and sends each peer that
   must fetch something a ``SyncPlan``: byte ranges of its dirty tensors, striped over the
   up-to-date peers;
4. the receiver opens a connection to every source of the plan at once (over the pair's path,
   :mod:`pccl._peer.connector`: direct, dialled back, or relayed; framed handshake with the run
   token), sends ``StateRequest`` and receives one data frame per ≤ 4 MiB chunk straight into its
   buffers; a source that fails (refused, reset, silent for ``Config.peer_timeout``) is reported
   and the master moves its pieces to other sources (next attempt); once every piece arrived the
   receiver re-hashes the tensors it got and reports — a mismatch fails its sync
   (``SharedStateSyncFailed``), it is never accepted silently;
5. ``SyncComplete(revision, lineage, reason)`` ends the sync on every participant: the revision
   and the group's lineage are written back into ``state.revision`` and ``state.lineage``, the
   reason goes into ``SyncInfo.reason``; sources stop serving.

The sync runs in a task of the communicator, so that a caller cancelled after its vote went out
does not strand its group: the sync completes without it, and the next call resumes it.

``SyncInfo.tx_bytes``/``rx_bytes`` count exactly the payload bytes this peer served / received
during the sync (partial pieces from a source that died included: they did move); the
communicator's counters (``statistics()``) keep the running totals.  The service reaches the
peer session only through :class:`~pccl._peer.host.PeerHost`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import numpy as np
import outcome
import trio

from .host import MasterLost, PeerHost
from ..errors import (
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    PCCLError,
    PhaseMismatch,
    ProtocolError,
    RevisionViolation,
    SharedStateSyncFailed,
    StreamClosed,
    TransportError,
)
from ..net.base import Listener, Stream
from ..net.framed import FramedConnection
from ..net.serving import PEER_LIMITS, HandshakeSlot, RefusalLog, admission_for, serve_listener
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.paths import Port
from ..shared_state import SharedState, hash_array_async, lineage_from_wire, lineage_to_wire, state_bytes, vote_entries
from ..types import SyncInfo, SyncReason, SyncStrategy

__all__ = ["StateSyncService", "CHUNK_SIZE"]

log = logging.getLogger(__name__)

#: Payload bytes per data frame: small enough that a slow link delivers one well within
#: ``Config.peer_timeout`` (the idle timeout of a fetch), large enough that headers are noise.
CHUNK_SIZE = 4 * 1024 * 1024


@dataclasses.dataclass(eq=False)
class _RunningSync:
    """One sync of this peer, run by a task of the communicator (see ``StateSyncService.sync``)."""

    state: SharedState
    strategy: SyncStrategy
    epoch: int
    voted: bool = False
    #: Its caller was cancelled after the vote: the sync goes on without anyone waiting.
    abandoned: bool = False
    scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    finished: trio.Event = dataclasses.field(default_factory=trio.Event)
    outcome: outcome.Outcome[SyncInfo] | None = None


class _Stopped(Exception):
    """Internal: a sync's caller was cancelled before its vote went out; the sync stopped."""


@dataclasses.dataclass(eq=False)
class _Serving:
    """What this peer serves while its sync runs."""

    arrays: dict[str, np.ndarray]  # flat uint8 views of the user's tensors
    tx_bytes: int = 0


class StateSyncService:
    """A communicator's shared-state side: its listener and server, and the sync procedure."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host
        self.listener: Listener | None = None
        self._serving: _Serving | None = None
        self._running: _RunningSync | None = None
        #: Who gets a handshake slot on the shared-state port (its counters are read by tests).
        self.admission = admission_for(PEER_LIMITS, wait_timeout=host.config.connect_timeout)
        host.serve_port(Port.SHARED_STATE, self._serve_request)

    # --- lifecycle -----------------------------------------------------------------------------

    async def listen(self) -> int:
        """Bind the shared-state port (bump allocation from ``Config.shared_state_base_port``)."""
        self.listener = await self._host.listen(self._host.config.shared_state_base_port)
        return self.listener.port

    async def serve(self) -> None:
        """Accept state requests until the listener closes (run in the communicator's nursery)."""
        assert self.listener is not None

        def failed(exc: TransportError) -> None:
            if not isinstance(exc, StreamClosed):  # permanent (running out of descriptors is waited out)
                log.error("peer %x: shared-state listener failed, serving no more state requests: %s",
                          self._host.peer_id, exc)

        await serve_listener(self.listener, self._accept, on_error=failed, admission=self.admission,
                             refusals=RefusalLog(f"peer {self._host.peer_id:x} shared-state port", logger=log))

    async def aclose(self) -> None:
        self._serving = None
        if self.listener is not None:
            await self.listener.aclose()

    # --- the sync -----------------------------------------------------------------------------

    async def sync(self, state: SharedState, strategy: SyncStrategy) -> SyncInfo:
        """Run one sync (see the module docstring).  Errors: ``InvalidArgument``/``InvalidUsage``
        (bad state, strategy mix, collective or topology vote outstanding, concurrent sync),
        ``RevisionViolation`` (this peer's revision jumped; it is kicked), ``Kicked``,
        ``SharedStateSyncFailed``, ``MasterUnreachable``, ``PhaseMismatch`` (the group's other
        members wait in other calls: the master withdrew this vote).

        The sync runs in a task of the communicator.  Cancelled before its vote went out, it
        stops and nothing stands.  Cancelled after, it goes on in the background (this peer's
        group waits for it: the vote cannot be taken back), and the next call with the same
        state resumes it and returns (or raises) its outcome; meanwhile collectives and other
        syncs are refused as while any sync runs."""
        host = self._host
        await trio.lowlevel.checkpoint_if_cancelled()
        if not isinstance(state, SharedState):
            raise InvalidArgument(f"sync_shared_state needs a pccl.SharedState, got {type(state).__name__}")
        try:
            strategy = SyncStrategy(strategy)
        except ValueError:
            raise InvalidArgument(f"unknown sync strategy {strategy!r}") from None
        running = self._running
        if running is not None and running.scope.cancel_called and not running.voted:
            await running.finished.wait()  # stopped before its vote by a cancelled call: gone soon
            running = self._running
        if running is not None:
            if running.state is not state or running.strategy is not strategy:
                raise InvalidUsage("a cancelled sync_shared_state still completes in the background; call it again "
                                   "with the same state and strategy to resume it")
            log.debug("peer %x: resuming a cancelled sync", host.peer_id)
            return await self._outcome_of(running)
        try:
            await host.ready()
        except MasterLost as exc:
            raise SharedStateSyncFailed(f"shared-state sync failed: {exc}") from exc
        await host.settled()  # a cancelled all-reduce's Init must not stand at the master
        host.phase.begin_sync()
        running = self._running = _RunningSync(state, strategy, host.master_epoch)
        if not host.spawn(self._run, running):
            self._running = None
            host.phase.end_sync()
            host.raise_if_failed()
            raise InvalidUsage("the communicator is closing")
        return await self._outcome_of(running)

    async def _outcome_of(self, running: _RunningSync) -> SyncInfo:
        try:
            await running.finished.wait()
        except trio.Cancelled:
            if not running.voted:
                running.scope.cancel()  # nothing stands at the master yet: stop it
            else:
                running.abandoned = True
            raise
        result, running.outcome = running.outcome, None  # reported to one caller
        if result is None:
            self._host.raise_if_failed()  # the communicator closed under it
            raise InvalidUsage("this shared-state sync was already reported to another call")
        return result.unwrap()  # type: ignore[no-any-return]

    async def _run(self, running: _RunningSync) -> None:
        """The sync itself, in the communicator's nursery (see :meth:`sync`)."""
        result: outcome.Outcome[SyncInfo] | None = None
        try:
            result = await outcome.acapture(self._sync_once, running)
        finally:
            self._running = None
            self._host.phase.end_sync()
            error = result.error if isinstance(result, outcome.Error) else None
            if result is not None and not isinstance(error, (_Stopped, trio.Cancelled)):
                running.outcome = result  # else: stopped before its vote, or the communicator closes
            running.finished.set()
        if isinstance(error, trio.Cancelled):
            raise error
        if error is not None and running.abandoned and not isinstance(error, _Stopped):
            log.info("peer %x: a cancelled shared-state sync ended in the background: %s", self._host.peer_id, error)

    async def _sync_once(self, running: _RunningSync) -> SyncInfo:
        host = self._host
        state, strategy, epoch = running.state, running.strategy, running.epoch
        receive: trio.MemoryReceiveChannel[m.Message] | None = None
        rx = 0
        received = False
        try:
            with running.scope:  # cancellable by its caller until the vote is out
                entries = await vote_entries(state)
                receive = host.open_sync_route()
                arrays = {key: state_bytes(t.array) for key, t in state.tensors().items()}
                serving = _Serving(arrays)
                if strategy is not SyncStrategy.RECEIVE_ONLY:
                    self._serving = serving  # before voting: receivers may dial as soon as the vote completes
                vote = m.SyncVote(state.revision, int(strategy), entries, lineage_to_wire(state.lineage))
                await host.send(vote, epoch=epoch, schedule_point=False)
                running.voted = True
            if not running.voted or receive is None:
                raise _Stopped()
            while True:
                try:
                    msg = await receive.receive()
                except trio.EndOfChannel:
                    host.raise_if_failed(epoch)
                    raise SharedStateSyncFailed("the shared-state sync ended without an answer") from None
                if isinstance(msg, m.SyncPlan):
                    if msg.attempt > 1:
                        host.counters.sync_replans += 1
                    rx += await self._run_plan(msg, arrays, epoch)
                    received = True
                elif isinstance(msg, m.SyncComplete):
                    reason = _reason(msg.reason)
                    state.revision = msg.revision
                    state.lineage = lineage_from_wire(msg.lineage)
                    host.counters.syncs_completed += 1
                    host.counters.last_sync_revision = msg.revision
                    host.counters.last_sync_tx_bytes, host.counters.last_sync_rx_bytes = serving.tx_bytes, rx
                    log.debug("peer %x: sync %d complete at revision %d (%s; tx %d, rx %d)", host.peer_id,
                              msg.sync_id, msg.revision, reason.name, serving.tx_bytes, rx)
                    return SyncInfo(msg.revision, serving.tx_bytes, rx, received, reason)
                else:
                    assert isinstance(msg, m.SyncRejected)
                    if msg.code == m.SyncRejectCode.STRATEGY_MIX:
                        raise InvalidUsage(f"shared-state sync refused: {msg.detail}")
                    if msg.code == m.SyncRejectCode.PHASE_MISMATCH:
                        log.warning("peer %x: the master ended this peer's shared-state sync: %s", host.peer_id,
                                    msg.detail)
                        raise PhaseMismatch(msg.detail or "phase mismatch")
                    raise SharedStateSyncFailed(f"shared-state sync failed: {msg.detail}")
        except MasterLost as exc:
            raise SharedStateSyncFailed(f"shared-state sync failed: {exc}; the communicator reconnects, "
                                        "call sync_shared_state again") from exc
        except Kicked as exc:
            if exc.reason is KickReason.REVISION_VIOLATION:
                raise RevisionViolation(exc.detail or "revision violation") from exc
            raise
        finally:
            if receive is not None:
                host.close_sync_route()
            self._serving = None

    # --- receiving ------------------------------------------------------------------------------

    async def _run_plan(self, plan: m.SyncPlan, arrays: dict[str, np.ndarray], epoch: int) -> int:
        """Fetch one attempt's pieces, report, and return the payload bytes received."""
        host = self._host
        for fetch in plan.fetches:
            for piece in fetch.pieces:
                view = arrays.get(piece.key)
                if view is None or piece.offset + piece.nbytes > view.nbytes:
                    raise ProtocolError(f"the master planned bytes {piece.offset}+{piece.nbytes} of {piece.key!r}, "
                                        "which this peer's state does not have")
        for expected in plan.expected:
            if expected.key not in arrays:
                raise ProtocolError(f"the master expects a hash for unknown key {expected.key!r}")
        received = [0]
        failed: list[int] = []
        async with trio.open_nursery() as nursery:
            for fetch in plan.fetches:
                nursery.start_soon(self._fetch_from, plan.sync_id, fetch, arrays, received, failed)
        if failed:
            report = m.SyncReport(plan.sync_id, plan.attempt, False, tuple(sorted(failed)))
        else:
            mismatched = []
            for expected in plan.expected:
                digest = await hash_array_async(arrays[expected.key])
                if digest != expected.hash:
                    mismatched.append(expected.key)
            detail = f"hash mismatch in {', '.join(repr(k) for k in mismatched)}" if mismatched else ""
            if mismatched:
                log.warning("peer %x: sync %d: %s", host.peer_id, plan.sync_id, detail)
            report = m.SyncReport(plan.sync_id, plan.attempt, not mismatched, (), detail)
        await host.send(report, epoch=epoch)
        return received[0]

    async def _fetch_from(self, sync_id: int, fetch: m.SourceFetch, arrays: dict[str, np.ndarray],
                          received: list[int], failed: list[int]) -> None:
        host = self._host
        source = fetch.source
        conn: FramedConnection | None = None
        try:
            conn = await host.open_peer(source, Port.SHARED_STATE)
            await conn.send(m.StateRequest(sync_id, host.peer_id, fetch.pieces))
            for index, piece in enumerate(fetch.pieces):
                view = arrays[piece.key].data
                for step, (offset, nbytes) in enumerate(_chunks(piece)):
                    with trio.fail_after(host.config.peer_timeout):
                        frame = await conn.receive_frame()
                        if isinstance(frame, m.StateRefused):
                            raise ProtocolError(f"refused: {frame.reason}")
                        if not isinstance(frame, DataHeader):
                            raise ProtocolError(f"sent {type(frame).__name__} instead of state data")
                        frame.check(op_seq=sync_id, stream=index, step=step, nbytes=nbytes)
                        if frame.offset != offset:
                            raise ProtocolError(f"sent offset {frame.offset} of {piece.key!r}, expected {offset}")
                        before = conn.statistics().data_bytes_received
                        try:
                            await conn.receive_data_into(view[offset : offset + nbytes])
                        finally:
                            got = conn.statistics().data_bytes_received - before
                            received[0] += got
                            host.counters.sync_rx_bytes += got
        except (PCCLError, trio.TooSlowError) as exc:
            reason = "silent too long" if isinstance(exc, trio.TooSlowError) else str(exc)
            log.info("peer %x: fetching shared state from peer %x failed: %s", host.peer_id, source.peer_id, reason)
            failed.append(source.peer_id)
        finally:
            if conn is not None:
                await conn.aclose()

    # --- serving --------------------------------------------------------------------------------

    async def _accept(self, stream: Stream, slot: HandshakeSlot) -> None:
        await self._host.accept_peer(stream, slot, Port.SHARED_STATE)

    async def _serve_request(self, conn: FramedConnection, slot: HandshakeSlot | None) -> None:
        """Serve one connection knocked for this peer's shared-state port (accepted, dialled
        back, or relayed).  An accepted one keeps its slot (pccl.net.serving) until its request
        arrived: without a run token the handshake alone proves little."""
        host = self._host
        remote = conn.remote_address
        try:
            with trio.fail_after(host.config.connect_timeout):
                request = await conn.receive()
            if not isinstance(request, m.StateRequest):
                raise ProtocolError(f"expected StateRequest, got {type(request).__name__}")
            if slot is not None:
                slot.release()
            serving = self._serving
            problem = check_request(serving, request)
            if problem is not None:
                log.info("peer %x: refusing state request of peer %x: %s", host.peer_id, request.requester, problem)
                await conn.send(m.StateRefused(problem))
                return
            assert serving is not None
            for index, piece in enumerate(request.pieces):
                view = serving.arrays[piece.key].data
                for step, (offset, nbytes) in enumerate(_chunks(piece)):
                    if self._serving is not serving:
                        raise SharedStateSyncFailed("the sync ended while serving")
                    await conn.send_data(DataHeader(request.sync_id, index, step, offset, nbytes),
                                         view[offset : offset + nbytes])
                    serving.tx_bytes += nbytes
                    host.counters.sync_tx_bytes += nbytes
        except (PCCLError, trio.TooSlowError) as exc:
            reason = "silent too long" if isinstance(exc, trio.TooSlowError) else exc
            if slot is None or slot.released:
                log.info("peer %x: state request from %s failed: %s", host.peer_id, remote, reason)
            else:
                slot.refuse(reason)
        finally:
            await conn.aclose()


def _reason(code: int) -> SyncReason:
    try:
        return SyncReason(code)
    except ValueError:
        raise ProtocolError(f"the master sent an unknown sync reason {code}") from None


def _chunks(piece: m.StatePiece) -> Iterator[tuple[int, int]]:
    """(offset, nbytes) of the data frames carrying ``piece``; both sides cut alike."""
    end = piece.offset + piece.nbytes
    for start in range(piece.offset, end, CHUNK_SIZE):
        yield start, min(CHUNK_SIZE, end - start)


def check_request(serving: _Serving | None, request: m.StateRequest) -> str | None:
    if serving is None:
        return "this peer is not serving shared state (no sync running, or RECEIVE_ONLY)"
    for piece in request.pieces:
        view = serving.arrays.get(piece.key)
        if view is None:
            return f"unknown key {piece.key!r}"
        if piece.offset + piece.nbytes > view.nbytes:
            return f"bytes {piece.offset}+{piece.nbytes} are beyond {piece.key!r} ({view.nbytes} bytes)"
    return None
