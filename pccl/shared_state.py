"""Shared state: the tensors every peer of a group holds bit for bit, and their synchronisation.

:class:`SharedState` maps names to arrays (numpy arrays, or CPU torch tensors through their
zero-copy numpy view) *by reference*: pccl reads them to hash and to serve, and writes received
bytes straight into them.  Nothing is copied.

A sync (:meth:`SharedStateService.sync`, behind ``Communicator.sync_shared_state``):

1. hash every tensor (xxh3-128 over its raw bytes, with a checkpoint every 64 MiB);
2. start serving this state on the peer's shared-state port (unless RECEIVE_ONLY) and vote
   ``SyncVote(revision, strategy, entries)``;
3. the master elects the popular state (:mod:`pccl.protocol.election`) and sends each peer that
   must fetch something a ``SyncPlan``: byte ranges of its dirty tensors, striped over the
   up-to-date peers;
4. the receiver dials every source of the plan at once (framed handshake with the run token),
   sends ``StateRequest`` and receives one data frame per ≤ 4 MiB chunk straight into its
   buffers; a source that fails (refused, reset, silent for ``Config.peer_timeout``) is reported
   and the master moves its pieces to other sources (next attempt); once every piece arrived the
   receiver re-hashes the tensors it got and reports — a mismatch fails its sync
   (``SharedStateSyncFailed``), it is never accepted silently;
5. ``SyncComplete(revision)`` ends the sync on every participant: the revision is written back
   into ``state.revision``; sources stop serving.

``SyncInfo.tx_bytes``/``rx_bytes`` count exactly the payload bytes this peer served / received
during the sync (partial pieces from a source that died included: they did move).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import trio
import xxhash

from .errors import (
    InvalidArgument,
    InvalidUsage,
    Kicked,
    KickReason,
    PCCLError,
    ProtocolError,
    RevisionViolation,
    SharedStateSyncFailed,
    StreamClosed,
    TransportError,
)
from .net.base import Listener, Stream, format_address
from .net.framed import FramedConnection, accept_framed, open_framed
from .net.serving import HandshakeSlot, serve_listener
from .protocol import messages as m
from .protocol.codec import DataHeader
from .types import DType, SyncInfo, SyncStrategy, dtype_of

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["Tensor", "SharedState", "SharedStateService", "hash_array", "CHUNK_SIZE"]

log = logging.getLogger(__name__)

#: Payload bytes per data frame: small enough that a slow link delivers one well within
#: ``Config.peer_timeout`` (the idle timeout of a fetch), large enough that headers are noise.
CHUNK_SIZE = 4 * 1024 * 1024
#: Bytes hashed between two checkpoints.
_HASH_STEP = 64 * 1024 * 1024

_SYNC_REPLIES = (m.SyncPlan, m.SyncComplete, m.SyncRejected)


# --- tensors -----------------------------------------------------------------------------------


def _as_array(obj: object) -> np.ndarray:
    """``obj`` as a numpy array sharing its memory: a numpy array itself, or a CPU torch
    tensor's numpy view (bfloat16 through an int16 view re-typed as ``ml_dtypes.bfloat16``)."""
    if isinstance(obj, np.ndarray):
        return obj
    if type(obj).__module__.split(".")[0] == "torch":
        tensor: Any = obj
        if tensor.device.type != "cpu":
            raise InvalidArgument(f"only CPU torch tensors can be shared state, got one on {tensor.device}")
        import torch  # present, since obj is a torch tensor

        tensor = tensor.detach()
        if tensor.dtype == torch.bfloat16:
            return tensor.view(torch.int16).numpy().view(DType.BFLOAT16.numpy_dtype())
        return tensor.numpy()
    raise InvalidArgument(f"shared state entries must be numpy arrays or CPU torch tensors, got {type(obj).__name__}")


def _byte_view(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (no copy; the array is C-contiguous)."""
    return array.reshape(-1).view(np.uint8)


def hash_array(array: np.ndarray) -> bytes:
    """xxh3-128 digest (16 bytes) of a C-contiguous array's raw bytes, without copying."""
    return xxhash.xxh3_128(memoryview(_byte_view(array))).digest()


async def _hash_async(array: np.ndarray) -> bytes:
    """:func:`hash_array` with a checkpoint every 64 MiB (same digest: xxh3 streams)."""
    view = memoryview(_byte_view(array))
    if view.nbytes <= _HASH_STEP:
        await trio.lowlevel.checkpoint()
        return xxhash.xxh3_128(view).digest()
    state = xxhash.xxh3_128()
    for start in range(0, view.nbytes, _HASH_STEP):
        state.update(view[start : start + _HASH_STEP])
        await trio.lowlevel.checkpoint()
    return state.digest()


class Tensor:
    """One shared-state entry: an array referenced without a copy.

    ``allow_content_inequality=True`` means peers may legitimately differ in this tensor (e.g.
    a per-peer RNG state): it is never compared among up-to-date peers, but an outdated peer (a
    joiner) receives it from one up-to-date peer.  ``InvalidArgument`` unless the array is
    C-contiguous, writable and of a supported dtype (SPEC §2).
    """

    __slots__ = ("array", "allow_content_inequality", "dtype")

    def __init__(self, array: object, allow_content_inequality: bool = False) -> None:
        arr = _as_array(array)
        self.dtype = dtype_of(arr.dtype)
        if not arr.flags.c_contiguous:
            raise InvalidArgument("shared state arrays must be C-contiguous (use np.ascontiguousarray and keep it)")
        if not arr.flags.writeable:
            raise InvalidArgument("shared state arrays must be writable: received state is written into them")
        self.array = arr
        self.allow_content_inequality = bool(allow_content_inequality)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def __repr__(self) -> str:
        flag = ", allow_content_inequality=True" if self.allow_content_inequality else ""
        return f"Tensor({self.dtype.name.lower()}{list(self.array.shape)}{flag})"


class SharedState:
    """Named tensors plus a revision (``SharedState({"w": w, "m": m}, revision=0)``).

    Values are arrays (wrapped as ``Tensor(array)``) or :class:`Tensor` instances.  Keys are
    non-empty strings; their order does not matter (entries are compared by name).  The
    revision must increase by exactly one between syncs; ``sync_shared_state`` writes the
    group's revision back into it.  ``state[key]`` returns the array.
    """

    def __init__(self, mapping: Mapping[str, object], revision: int = 0) -> None:
        if not isinstance(mapping, Mapping):
            raise InvalidArgument(f"SharedState needs a mapping of names to arrays, got {type(mapping).__name__}")
        tensors: dict[str, Tensor] = {}
        for key, value in mapping.items():
            if not isinstance(key, str) or not key:
                raise InvalidArgument(f"shared state keys must be non-empty strings, got {key!r}")
            tensors[key] = value if isinstance(value, Tensor) else Tensor(value)
        self._tensors = dict(sorted(tensors.items()))
        self._revision = 0
        self.revision = revision

    @property
    def revision(self) -> int:
        return self._revision

    @revision.setter
    def revision(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise InvalidArgument(f"revision must be an integer in [0, 2**64), got {value!r}")
        self._revision = int(value)

    def tensors(self) -> Mapping[str, Tensor]:
        """The entries by name (sorted)."""
        return dict(self._tensors)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._tensors[key].array

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def hashes(self) -> dict[str, bytes]:
        """xxh3-128 digest of every tensor (what a sync compares)."""
        return {key: hash_array(t.array) for key, t in self._tensors.items()}

    async def _entries(self) -> tuple[m.SharedStateEntry, ...]:
        entries = []
        for key, t in self._tensors.items():
            digest = await _hash_async(t.array)
            entries.append(m.SharedStateEntry(key, int(t.dtype), t.nbytes, digest, t.allow_content_inequality))
        return tuple(entries)

    def __repr__(self) -> str:
        return f"SharedState({list(self._tensors.values())!r}, revision={self._revision})"


# --- the service (one per communicator) -------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Serving:
    """What this peer serves while its sync runs."""

    arrays: dict[str, np.ndarray]  # flat uint8 views of the user's tensors
    tx_bytes: int = 0


class SharedStateService:
    """A communicator's shared-state side: its listener and server, the route of the master's
    sync messages, and the sync procedure itself.  Owned by :class:`~pccl.communicator.Communicator`."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self.listener: Listener | None = None
        self._serving: _Serving | None = None
        self._route: trio.MemorySendChannel[m.Message] | None = None
        self.busy = False
        #: Running totals over the communicator's life (statistics, tests, the simulator).
        self.bytes_received = 0
        self.bytes_sent = 0
        self.syncs_completed = 0
        #: Attempts beyond the first (a source failed mid-transfer and the master re-planned).
        self.replans = 0

    # --- lifecycle (called by the communicator) -------------------------------------------------

    async def listen(self, bind_host: str) -> int:
        """Bind the shared-state port (bump allocation from ``Config.shared_state_base_port``)."""
        cfg = self._comm._config
        self.listener = await self._comm._network.listen(format_address(bind_host, cfg.shared_state_base_port),
                                                         port_range=cfg.port_search_range)
        return self.listener.port

    async def serve(self) -> None:
        """Accept state requests until the listener closes (run in the communicator's nursery)."""
        assert self.listener is not None

        def failed(exc: TransportError) -> None:
            if not isinstance(exc, StreamClosed):  # permanent (running out of descriptors is waited out)
                log.error("peer %x: shared-state listener failed, serving no more state requests: %s",
                          self._comm.peer_id, exc)

        await serve_listener(self.listener, self._serve_connection, on_error=failed)

    def deliver(self, msg: m.Message) -> bool:
        """Route a master message to the running sync; False if it is not a sync message."""
        if not isinstance(msg, _SYNC_REPLIES):
            return False
        if self._route is None:
            log.debug("dropping %s: no sync is running", type(msg).__name__)
            return True
        try:
            self._route.send_nowait(msg)
        except trio.WouldBlock:
            self._comm._fail(ProtocolError("the master flooded the shared-state sync with messages"))
        return True

    def fail(self) -> None:
        """The communicator failed: end the running sync's wait (it then raises the failure)."""
        if self._route is not None:
            self._route.close()
            self._route = None  # later sync messages are dropped, not sent into a closed channel

    async def aclose(self) -> None:
        self._serving = None
        if self.listener is not None:
            await self.listener.aclose()

    # --- the sync -----------------------------------------------------------------------------

    async def sync(self, state: SharedState, strategy: SyncStrategy) -> SyncInfo:
        """Run one sync (see the module docstring).  Errors: ``InvalidArgument``/``InvalidUsage``
        (bad state, strategy mix, collective in flight, concurrent sync), ``RevisionViolation``
        (this peer's revision jumped; it is kicked), ``Kicked``, ``SharedStateSyncFailed``,
        ``MasterUnreachable``.  Cancellation after the vote was sent leaves the lockstep: the
        communicator drops its master connection and fails with ``SharedStateSyncFailed``."""
        comm = self._comm
        await trio.lowlevel.checkpoint_if_cancelled()
        comm._raise_if_unusable()
        if not isinstance(state, SharedState):
            raise InvalidArgument(f"sync_shared_state needs a pccl.SharedState, got {type(state).__name__}")
        try:
            strategy = SyncStrategy(strategy)
        except ValueError:
            raise InvalidArgument(f"unknown sync strategy {strategy!r}") from None
        if self.busy:
            raise InvalidUsage("a shared-state sync is already running on this communicator")
        if comm._routes:
            raise InvalidUsage(f"cannot sync shared state while collective tags {sorted(comm._routes)} are in flight")
        self.busy = True
        try:
            entries = await state._entries()
            return await self._vote_and_transfer(state, strategy, entries)
        finally:
            self.busy = False

    async def _vote_and_transfer(self, state: SharedState, strategy: SyncStrategy,
                                 entries: tuple[m.SharedStateEntry, ...]) -> SyncInfo:
        comm = self._comm
        send, receive = trio.open_memory_channel[m.Message](8)
        self._route = send
        arrays = {key: _byte_view(t.array) for key, t in state.tensors().items()}
        serving = _Serving(arrays)
        if strategy is not SyncStrategy.RECEIVE_ONLY:
            self._serving = serving  # before voting: receivers may dial as soon as the vote completes
        rx = 0
        voted = False
        try:
            await comm._send_master(m.SyncVote(state.revision, int(strategy), entries))
            voted = True
            while True:
                try:
                    msg = await receive.receive()
                except trio.EndOfChannel:
                    comm._raise_if_unusable()
                    raise SharedStateSyncFailed("the shared-state sync ended without an answer") from None
                if isinstance(msg, m.SyncPlan):
                    if msg.attempt > 1:
                        self.replans += 1
                    rx += await self._run_plan(msg, arrays)
                elif isinstance(msg, m.SyncComplete):
                    state.revision = msg.revision
                    self.syncs_completed += 1
                    log.debug("peer %x: sync %d complete at revision %d (tx %d, rx %d)", comm.peer_id, msg.sync_id,
                              msg.revision, serving.tx_bytes, rx)
                    return SyncInfo(msg.revision, serving.tx_bytes, rx)
                else:
                    assert isinstance(msg, m.SyncRejected)
                    if msg.code == m.SyncRejectCode.STRATEGY_MIX:
                        raise InvalidUsage(f"shared-state sync refused: {msg.detail}")
                    raise SharedStateSyncFailed(f"shared-state sync failed: {msg.detail}")
        except Kicked as exc:
            if exc.reason is KickReason.REVISION_VIOLATION:
                raise RevisionViolation(exc.detail or "revision violation") from exc
            raise
        except trio.Cancelled:
            if voted:
                comm._leave_lockstep(SharedStateSyncFailed("sync_shared_state was cancelled mid-sync; this peer "
                                                           "left the run"))
            raise
        finally:
            self._route = None
            self._serving = None
            send.close()

    # --- receiving ------------------------------------------------------------------------------

    async def _run_plan(self, plan: m.SyncPlan, arrays: dict[str, np.ndarray]) -> int:
        """Fetch one attempt's pieces, report, and return the payload bytes received."""
        comm = self._comm
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
                digest = await _hash_async(arrays[expected.key])
                if digest != expected.hash:
                    mismatched.append(expected.key)
            detail = f"hash mismatch in {', '.join(repr(k) for k in mismatched)}" if mismatched else ""
            if mismatched:
                log.warning("peer %x: sync %d: %s", comm.peer_id, plan.sync_id, detail)
            report = m.SyncReport(plan.sync_id, plan.attempt, not mismatched, (), detail)
        await comm._send_master(report)
        return received[0]

    async def _fetch_from(self, sync_id: int, fetch: m.SourceFetch, arrays: dict[str, np.ndarray],
                          received: list[int], failed: list[int]) -> None:
        comm = self._comm
        cfg = comm._config
        source = fetch.source
        address = format_address(source.host, source.shared_state_port)
        conn: FramedConnection | None = None
        try:
            conn = await open_framed(comm._network, address, token=comm._token, config=cfg,
                                     nonce_source=comm._nonce_source)
            await conn.send(m.StateRequest(sync_id, comm.peer_id, fetch.pieces))
            for index, piece in enumerate(fetch.pieces):
                view = memoryview(arrays[piece.key])
                for step, (offset, nbytes) in enumerate(_chunks(piece)):
                    with trio.fail_after(cfg.peer_timeout):
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
                            self.bytes_received += got
        except (PCCLError, trio.TooSlowError) as exc:
            reason = "silent too long" if isinstance(exc, trio.TooSlowError) else str(exc)
            log.info("peer %x: fetching shared state from peer %x at %s failed: %s", comm.peer_id,
                     source.peer_id, address, reason)
            failed.append(source.peer_id)
        finally:
            if conn is not None:
                await conn.aclose()

    # --- serving --------------------------------------------------------------------------------

    async def _serve_connection(self, stream: Stream, slot: HandshakeSlot) -> None:
        comm = self._comm
        remote = stream.remote_address
        conn: FramedConnection | None = None
        try:
            conn = await accept_framed(stream, token=comm._token, config=comm._config,
                                       nonce_source=comm._nonce_source)
            slot.release()  # authenticated: no longer an anonymous connection
            with trio.fail_after(comm._config.connect_timeout):
                request = await conn.receive()
            if not isinstance(request, m.StateRequest):
                raise ProtocolError(f"expected StateRequest, got {type(request).__name__}")
            serving = self._serving
            problem = _check_request(serving, request)
            if problem is not None:
                log.info("peer %x: refusing state request of peer %x: %s", comm.peer_id, request.requester, problem)
                await conn.send(m.StateRefused(problem))
                return
            assert serving is not None
            for index, piece in enumerate(request.pieces):
                view = serving.arrays[piece.key]
                for step, (offset, nbytes) in enumerate(_chunks(piece)):
                    if self._serving is not serving:
                        raise SharedStateSyncFailed("the sync ended while serving")
                    await conn.send_data(DataHeader(request.sync_id, index, step, offset, nbytes),
                                         view[offset : offset + nbytes])
                    serving.tx_bytes += nbytes
                    self.bytes_sent += nbytes
        except (PCCLError, trio.TooSlowError) as exc:
            log.info("peer %x: state request from %s failed: %s", comm.peer_id, remote, exc)
        finally:
            if conn is not None:
                await conn.aclose()
            else:
                await stream.aclose()


def _chunks(piece: m.StatePiece) -> Iterator[tuple[int, int]]:
    """(offset, nbytes) of the data frames carrying ``piece``; both sides cut alike."""
    end = piece.offset + piece.nbytes
    for start in range(piece.offset, end, CHUNK_SIZE):
        yield start, min(CHUNK_SIZE, end - start)


def _check_request(serving: _Serving | None, request: m.StateRequest) -> str | None:
    if serving is None:
        return "this peer is not serving shared state (no sync running, or RECEIVE_ONLY)"
    for piece in request.pieces:
        view = serving.arrays.get(piece.key)
        if view is None:
            return f"unknown key {piece.key!r}"
        if piece.offset + piece.nbytes > view.nbytes:
            return f"bytes {piece.offset}+{piece.nbytes} are beyond {piece.key!r} ({view.nbytes} bytes)"
    return None
