"""Ring all-reduce over the data lanes to the ring neighbours (SPEC §3, ARCHITECTURE §3).

:func:`ring_all_reduce` runs one operation — reduce-scatter, then all-gather, on the schedule of
:mod:`pccl.protocol.ring` — and returns the payload bytes it sent and received.  The communicator
calls it after the master's ``Commence(tag, seq, ring)``, inside the op's cancel scope.

Design
------
* **Pipelining.**  Every chunk is cut into sub-chunks (one data frame each).  Per lane three
  tasks run: a *receiver* that takes the lane's next frame straight into its destination, a
  *processor* that runs the kernel for it (reduce / dequantize) and marks it ready, and a
  *sender* that sends frame ``(step, k)`` as soon as ``(step - 1, k)`` is ready.  On TCP the
  bulk send and receive run in worker threads (:mod:`pccl.net.tcp`) and the C kernels release
  the GIL, so receiving, reducing and sending overlap sub-chunk by sub-chunk and across steps.
  Kernels run inline on the Trio thread up to a size and in a worker thread above it
  (:class:`KernelRunner`; the simulator passes ``threads=False``).
* **Threads on real TCP.**  When the lanes offer the blocking fast path (real TCP does, the
  simulator does not: :attr:`RingLinks.threaded`), the same per-lane loops run instead in one
  sender and one receiver *thread* per lane (:mod:`pccl.collectives.threaded`), with the same
  frames, kernels and buffers — about twice the throughput on a 2-core loopback box.  Small ops
  (≤ 256 KiB) on those lanes run instead as one sequential loop in the calling task
  (:mod:`pccl.collectives.inline`): for them the threads' hand-offs cost more than the transfer.
* **Small ops: the exchange.**  An unquantized op whose peers would each send at most 256 KiB
  this way (``(N - 1) × input``: 256 KiB of input at N = 2, 128 KiB at N = 3) runs on
  :class:`~pccl.protocol.ring.ExchangeSchedule`: every input travels around the ring in its own
  dtype (each peer sends its own, then forwards what it received) and every peer reduces all of
  them — N - 1 trips instead of the ring's 2 (N - 1); at N = 2 one trip for the same bytes.
  Every peer folds ``x[0] op x[1] op … op x[N-1]`` in ring order (f16/bf16 widened to f32,
  rounded once) and canonicalises NaN results, so all end bit-identical; in place, the input is
  sent from a copy (the result overwrites the slice being sent).  Every execution path runs it
  (it is just another schedule).  Measured at 16 KiB on the 2-core loopback box: N = 3
  1.91 → 1.55 ms per op, N = 4 2.91 → 2.53 ms; at N = 3 the ring catches up at 128 KiB.
* **Scratch memory** (the in-place backup, the f32 working array, staging) comes from a
  process-wide :class:`~pccl.collectives.buffers.ScratchArena` that keeps freed buffers: fresh
  pages cost more to fault in than the whole copy.
* **Zero copy.**  Frames are sent from memoryviews of the caller's arrays (or the f32 working
  array).  All-gather payloads are received straight into the output.  Reduce-scatter payloads
  must be combined with what is there, so they land in a small per-lane staging pool and are
  reduced from it.  The processor never waits for the sender, so a full pool only ever waits for
  a kernel: no cycle of waits can form around the ring.
* **f16/bf16** accumulate in f32: reduce-scatter frames carry f32 partial sums (a partial sum
  rounded to 16 bits per hop would gain nothing over 16-bit arithmetic); the owner of a chunk
  rounds the final sum once (RNE) into the output and the all-gather moves those 16-bit values.
* **AVG** is SUM, then the owner divides its chunk by the world size (floats: IEEE division;
  integers: floor division) before the all-gather, so every peer holds the same bytes.
* **MIN_MAX quantization.**  Reduce-scatter frames are quantized by their sender with fresh
  per-frame parameters and dequantize-reduced by the receiver into its full-precision
  accumulator (one fused kernel).  In the all-gather only the owner quantizes: it quantizes its
  final chunk once into the *gather store* (``count × qbytes`` plus 16 bytes per frame), applies
  the dequantized values to its own output, and sends the stored bytes; every other peer
  receives the bytes into its gather store, dequantizes them into its output and forwards them
  verbatim.  Everyone applies the same dequantization to the same bytes: bit-identical.
* **Frames** are stamped ``(op_seq=seq, stream=sub-chunk index, step, offset=byte offset in the
  caller's array)``; the receiver checks every field against its own schedule.  Frames of other
  operations are routed by seq (:mod:`pccl.collectives.links`); frames of an ended seq are
  discarded, so a late frame of an aborted op is never taken for a later op's.
* **Concurrency and striping.**  Several operations run at once over the same
  :class:`~pccl.collectives.links.RingLinks` (frames interleave whole; receivers demultiplex by
  seq).  With ``lanes > 1`` connections per neighbour, sub-chunk ``k`` of every step travels on
  lane ``k mod lanes``, so one operation is striped over all lanes.

Aborts
------
The operation is cancellable at any instant.  Cancellation, a broken lane or a protocol error
stops every task of the operation (kernels in worker threads are waited for, never abandoned)
and :func:`ring_all_reduce` raises exactly one exception: ``Cancelled`` when the caller's scope
was cancelled and nothing else went wrong, else the first real error (``PeerDisconnected``,
``StreamClosed``, ``ProtocolError``, ``InvalidArgument`` for NaN/Inf under quantization…); never
an ExceptionGroup.  For an in-place operation every slice is saved in an :class:`InputBackup`
right before its first overwrite — by the reduce-scatter kernel itself where that overwrite is a
reduction (``reduce_into_saving``: the copy rides along with the reduction's own pass over the
slice), by a copy otherwise (the chunk sent at step 0; f16/bf16 outputs).  Pass your own
``backup`` to be able to restore the input after this function has returned (an abort decided
by the master after this peer finished its ring), otherwise the input is restored here before
the exception propagates.  A lane torn mid-frame is
aborted by its connection, so later operations on it fail fast until the ring is re-wired.
"""

from __future__ import annotations

import logging

import numpy as np
import trio

from .._groups import single_exception
from ..errors import InvalidArgument
from ..protocol.codec import DataHeader
from ..protocol.ring import (
    DEFAULT_SUBCHUNK_BYTES,
    EXCHANGE_MAX_BYTES,
    ExchangeSchedule,
    Frame,
    Phase,
    RingSchedule,
    subchunk_elements,
    uses_exchange,
)
from ..types import Quantization, ReduceOp
from . import buffers as bf
from .buffers import InputBackup, KernelRunner, OpBuffers, StagingPool
from .links import RingLinks
from .inline import InlineRing, suits_inline
from .threaded import LaneThreads

__all__ = ["ring_all_reduce", "InputBackup", "KernelRunner"]

logger = logging.getLogger(__name__)

#: Staging buffers per lane for reduce-scatter payloads: one being received, one being reduced,
#: one spare to absorb scheduling jitter (measured: depth 2 stalls the receiver noticeably).
_STAGING_DEPTH = 3
#: Quantized send buffers per lane (one being filled while the previous one is on the wire).
_SEND_DEPTH = 2


async def ring_all_reduce(
    send: np.ndarray,
    recv: np.ndarray | None = None,
    *,
    op: ReduceOp,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    quantization: Quantization | None = None,
    backup: InputBackup | None = None,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
    exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
) -> tuple[int, int]:
    """All-reduce ``send`` into ``recv`` (``None`` or ``send`` itself: in place) over the ring.

    ``rank``/``world``: this peer's position in the ring and the ring size (≥ 2); ``links`` the
    lanes to the successor ``ring[(rank+1) % world]`` and from the predecessor; ``seq`` the
    master's sequence number of this op (unique per group, the same on every peer).  Every peer
    must pass the same ``count``, dtype, ``op``, ``quantization``, ``max_subchunk_bytes``,
    ``exchange_max_bytes`` (which small ops run as an exchange,
    :func:`~pccl.protocol.ring.uses_exchange`; 0: none) and number of lanes (the master checks
    the first four; the others are configuration).

    Returns ``(tx_bytes, rx_bytes)``: payload bytes sent and received (quantization metadata
    included, frame headers not).  Errors: see the module docstring; ``InvalidArgument`` for
    bad arguments before anything is sent.  The seq is retired on exit, whatever the outcome.
    """
    try:
        return await _run_op(
            send, send if recv is None else recv, op=op, links=links, rank=rank, world=world, seq=seq,
            quantization=quantization, backup=backup, runner=runner, max_subchunk_bytes=max_subchunk_bytes,
            exchange_max_bytes=exchange_max_bytes,
        )
    finally:
        links.retire(seq)


async def _run_op(
    send: np.ndarray,
    recv: np.ndarray,
    *,
    op: ReduceOp,
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    quantization: Quantization | None,
    backup: InputBackup | None,
    runner: KernelRunner | None,
    max_subchunk_bytes: int,
    exchange_max_bytes: int,
) -> tuple[int, int]:
    if world < 2 or not 0 <= rank < world:
        raise InvalidArgument(f"rank {rank} / world {world}: a ring needs 2+ peers and 0 <= rank < world")
    bufs = OpBuffers.check(send, recv, op, quantization)
    own_backup = backup is None and bufs.in_place
    if own_backup:
        backup = InputBackup(bufs.dst)
    try:
        ring_op = _RingOp(
            bufs,
            links=links,
            rank=rank,
            world=world,
            seq=seq,
            backup=backup if bufs.in_place else None,
            runner=runner or KernelRunner(),
            max_subchunk_bytes=max_subchunk_bytes,
            exchange_max_bytes=exchange_max_bytes,
        )
        await ring_op.run()
    except BaseException:
        if own_backup:
            assert backup is not None
            backup.restore()
        raise
    finally:
        # Every task of the op has stopped (kernels and socket workers are waited for), so
        # nothing touches the scratch memory any more.
        bufs.release()
        if own_backup:
            assert backup is not None
            backup.release()
    return ring_op.tx_bytes, ring_op.rx_bytes


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A uint8 view (no copy): the buffer protocol refuses some dtypes (ml_dtypes' bfloat16)."""
    return array.view(np.uint8)


class _RingOp:
    """The state of one running all-reduce on this peer."""

    def __init__(
        self,
        bufs: OpBuffers,
        *,
        links: RingLinks,
        rank: int,
        world: int,
        seq: int,
        backup: InputBackup | None,
        runner: KernelRunner,
        max_subchunk_bytes: int,
        exchange_max_bytes: int = EXCHANGE_MAX_BYTES,
    ) -> None:
        self.bufs = bufs
        self.links = links
        self.world = world
        self.seq = seq
        self.backup = backup
        self.runner = runner
        self.lanes = links.lanes
        count = bufs.src.size
        sub = subchunk_elements(count, world, bufs.itemsize, max_bytes=max_subchunk_bytes)
        #: A small unquantized op: the inputs travel around the ring and every peer reduces
        #: them all.  Decided from agreed parameters only (world, count, dtype, quantization),
        #: so every peer agrees.
        self.exchange = uses_exchange(world, bufs.src.nbytes, quantized=bufs.quantized, max_bytes=exchange_max_bytes)
        self.schedule = (
            ExchangeSchedule(count, world, rank, sub) if self.exchange else RingSchedule(count, world, rank, sub)
        )
        #: In place, an exchange overwrites each slice with its result while the send of that same
        #: slice may still be under way (a worker thread, the Trio sender): it sends from a copy.
        self.exchange_send: np.ndarray | None = None
        #: Exchange: the other peers' inputs, row ``s`` the one received at step ``s`` (from ring
        #: position ``rank - s - 1``), forwarded from there at step ``s + 1``.
        self.exchange_inputs: np.ndarray | None = None
        if self.exchange and count:
            if bufs.in_place:
                self.exchange_send = bufs.take(bufs.src.nbytes).view(bufs.src.dtype)
                np.copyto(self.exchange_send, bufs.src)
            self.exchange_inputs = (
                bufs.take((world - 1) * bufs.src.nbytes).view(bufs.src.dtype).reshape(world - 1, count)
            )
        self.tx_bytes = 0
        self.rx_bytes = 0
        # ready[(step, k)]: the frame received at (step, k) is processed; the sender of
        # (step + 1, k) waits for it.
        # (made by run() for the Trio path only; the other paths keep their own bookkeeping)
        self.ready: dict[tuple[int, int], trio.Event] = {}
        self.gather_store, self.gather_offsets = self._make_gather_store()
        #: In place without a working array, a reduce-scatter reduction is the first overwrite of
        #: its slice of the caller's buffer, and saves the slice in the same pass
        #: (:meth:`InputBackup.overwrite`); the other slices are saved by plain copies.
        self.fused_backup = backup is not None and bufs.in_place and not bufs.half

    # --- layout ------------------------------------------------------------------------------

    def _make_gather_store(self) -> tuple[np.ndarray | None, dict[tuple[int, int], int]]:
        """Quantized all-gather bytes of every sub-chunk, each ``meta | q`` contiguous."""
        if not self.bufs.quantized:
            return None, {}
        offsets: dict[tuple[int, int], int] = {}
        pos = 0
        for c in range(self.world):
            for k, (a, b) in enumerate(self.schedule.subchunks(c)):
                offsets[(c, k)] = pos
                pos += self.bufs.all_gather_nbytes(b - a)
        return self.bufs.take(max(pos, 1)), offsets

    def _gather_segment(self, frame: Frame) -> np.ndarray:
        assert self.gather_store is not None
        at = self.gather_offsets[(frame.chunk, frame.index)]
        return self.gather_store[at : at + self.bufs.all_gather_nbytes(frame.count)]

    def frame_nbytes(self, frame: Frame) -> int:
        if self.exchange:
            return frame.count * self.bufs.itemsize  # the input as it is (f16/bf16 not widened)
        if self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
            return self.bufs.reduce_scatter_nbytes(frame.count)
        return self.bufs.all_gather_nbytes(frame.count)

    def header(self, frame: Frame) -> DataHeader:
        return DataHeader(
            op_seq=self.seq,
            stream=frame.index,
            step=frame.step,
            offset=frame.start * self.bufs.itemsize,
            nbytes=self.frame_nbytes(frame),
        )

    @property
    def max_reduce_scatter_nbytes(self) -> int:
        """Payload bytes of the largest reduce-scatter frame (staging buffer size)."""
        largest_frame = min(self.schedule.subchunk_elements, self.schedule.chunk_size(0))
        if self.exchange:
            return largest_frame * self.bufs.itemsize  # the input as it is (see frame_nbytes)
        return self.bufs.reduce_scatter_nbytes(largest_frame)

    def _save(self, a: int, b: int) -> None:
        if self.backup is not None:
            self.backup.save(a, b)

    # --- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the op on the path its links offer; connections it left broken (a torn frame, a
        bad header) are aborted when it ends, whichever path ran."""
        try:
            await self._run()
        finally:
            self.links.abort_broken()

    async def _run(self) -> None:
        if not any(self.schedule.send_frames(lane, self.lanes) for lane in range(self.lanes)) and not any(
            self.schedule.recv_frames(lane, self.lanes) for lane in range(self.lanes)
        ):
            await trio.lowlevel.checkpoint()  # nothing to move (an empty buffer)
            return
        if self.links.threaded:
            if suits_inline(self):
                await InlineRing(self).run()
            else:
                await LaneThreads(self).run()
            return
        max_rs = self.max_reduce_scatter_nbytes
        for step in range(self.schedule.num_steps):
            for k in range(len(self.schedule.subchunks(self.schedule.recv_chunk(step)))):
                self.ready[(step, k)] = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                for lane in range(self.lanes):
                    to_processor, from_receiver = trio.open_memory_channel[tuple[Frame, np.ndarray | None]](
                        _STAGING_DEPTH
                    )
                    staging = StagingPool(_STAGING_DEPTH, max_rs, self.bufs)
                    nursery.start_soon(self._receiver, lane, staging, to_processor)
                    nursery.start_soon(self._processor, staging, from_receiver)
                    nursery.start_soon(self._sender, lane)
        except BaseExceptionGroup as group:
            raise single_exception(group) from None

    async def _receiver(
        self, lane: int, staging: StagingPool, to_processor: trio.MemorySendChannel[tuple[Frame, np.ndarray | None]]
    ) -> None:
        inbox = self.links.inboxes[lane]
        bufs = self.bufs
        async with to_processor:
            for frame in self.schedule.recv_frames(lane, self.lanes):
                nbytes = self.frame_nbytes(frame)
                stage: np.ndarray | None = None
                process = bufs.quantized
                if self.exchange:
                    destination = memoryview(_as_bytes(self._exchange_slot(frame.step, frame)))
                    process = frame.step == self.schedule.num_steps - 1  # the last input: reduce
                elif self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
                    stage = await staging.get()
                    destination = memoryview(stage)[:nbytes]
                elif bufs.quantized:
                    destination = memoryview(self._gather_segment(frame))
                else:
                    if self.backup is not None and not self.backup.is_saved(frame.start):
                        await self.runner.run(nbytes, self.backup.save, frame.start, frame.stop)
                    destination = memoryview(_as_bytes(bufs.dst[frame.start : frame.stop]))
                # Not `self.rx_bytes += await ...`: that reads the total before the await, and
                # the receivers of the other lanes add to it meanwhile.
                received = await inbox.receive_into(
                    seq=self.seq,
                    stream=frame.index,
                    step=frame.step,
                    offset=frame.start * bufs.itemsize,
                    destination=destination,
                )
                self.rx_bytes += received
                if stage is None and not process:
                    self.ready[(frame.step, frame.index)].set()  # received in place: nothing to do
                else:
                    await to_processor.send((frame, stage))

    async def _processor(
        self, staging: StagingPool, from_receiver: trio.MemoryReceiveChannel[tuple[Frame, np.ndarray | None]]
    ) -> None:
        async with from_receiver:
            async for frame, stage in from_receiver:
                nbytes = self.frame_nbytes(frame)
                if stage is not None:
                    await self.runner.run(nbytes * 2, self._reduce_frame, frame, stage[:nbytes])
                    staging.put(stage)
                elif self.exchange:
                    await self.runner.run(nbytes * self.world, self._reduce_exchanged, frame)
                else:
                    await self.runner.run(nbytes * 4, self._apply_gathered, frame)
                self.ready[(frame.step, frame.index)].set()

    def destination(self, frame: Frame, stage: np.ndarray) -> memoryview:
        """Where frame ``frame``'s payload is received, for the lane threads and the inline path
        (any thread): ``stage`` in the reduce-scatter, the gather store when quantized, else the
        output slice itself (saved first, in place).  :meth:`received` processes it then."""
        bufs = self.bufs
        if self.exchange:
            return memoryview(_as_bytes(self._exchange_slot(frame.step, frame)))
        if self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
            return memoryview(stage[: self.frame_nbytes(frame)])
        if bufs.quantized:
            return memoryview(self._gather_segment(frame))
        if self.backup is not None and not self.backup.is_saved(frame.start):
            self.backup.save(frame.start, frame.stop)
        return memoryview(_as_bytes(bufs.dst[frame.start : frame.stop]))

    def received(self, frame: Frame, stage: np.ndarray) -> None:
        """Process a frame received into :meth:`destination` (any thread)."""
        if self.exchange:
            if frame.step == self.schedule.num_steps - 1:
                self._reduce_exchanged(frame)  # the last input of this slice is in
        elif self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
            self._reduce_frame(frame, stage[: self.frame_nbytes(frame)])
        elif self.bufs.quantized:
            self._apply_gathered(frame)

    def _reduce_frame(self, frame: Frame, payload: np.ndarray) -> None:
        """Reduce-scatter: fold a received partial result into the accumulator (worker thread)."""
        self._reduce_partial(frame, payload)

    def _exchange_slot(self, step: int, frame: Frame) -> np.ndarray:
        """Exchange: where the input received at ``step`` keeps ``frame``'s slice."""
        assert self.exchange_inputs is not None
        return self.exchange_inputs[step, frame.start : frame.stop]

    def _exchange_operand(self, position: int, frame: Frame) -> np.ndarray:
        """Exchange: ``frame``'s slice of the input of ring position ``position``."""
        if position == self.schedule.rank:
            own = self.exchange_send if self.exchange_send is not None else self.bufs.src
            return own[frame.start : frame.stop]
        return self._exchange_slot((self.schedule.rank - position - 1) % self.world, frame)

    def _reduce_exchanged(self, frame: Frame) -> None:
        """Exchange: every input's slice ``frame`` is in; compute its final result (any thread).

        Every peer computes ``x[0] op x[1] op … op x[N-1]`` (``x[p]`` the input of ring
        position ``p``), folded left in that order: the operand order decides MIN/MAX of +0 and
        -0, and float sums depend on it.  Which operand's payload a NaN sum or product keeps
        depends on the instruction the compiler picked for that element (vector body or scalar
        tail, so on alignment), so NaN results are made the canonical quiet NaN.  The kernels
        compute in IEEE's default mode whatever the calling thread's, so every peer ends
        bit-identical.  f16/bf16 inputs are widened to f32, reduced there and rounded once.
        """
        bufs = self.bufs
        a, b = frame.start, frame.stop
        out = bufs.dst[a:b]
        acc = bufs.acc[a:b] if bufs.half else out
        operands = [self._exchange_operand(p, frame) for p in range(self.world)]
        # In place, ``out`` is the caller's input: save it before the first write (the peer at
        # position 0 folds straight onto its own input, which ``out`` already holds).
        self._save(a, b)
        if bufs.half:
            bf.widen(acc, operands[0])
        elif not (bufs.in_place and self.schedule.rank == 0):
            np.copyto(acc, operands[0])
        for operand in operands[1:]:
            bf.reduce_into(bufs.op, acc, operand)
        if bufs.op is ReduceOp.AVG:
            bf.avg_finalize(acc, self.world)
        if acc.dtype.kind == "f":
            nan = np.isnan(acc)
            if nan.any():
                acc[nan] = np.nan
        if bufs.half:
            bf.narrow(out, acc)

    def _reduce_partial(self, frame: Frame, payload: np.ndarray) -> None:
        bufs = self.bufs
        a, b = frame.start, frame.stop
        acc = bufs.acc[a:b]
        # First touch of this slice: bring in this peer's own contribution.
        if bufs.half:
            bf.widen(acc, bufs.src[a:b])
        elif not bufs.in_place:
            if not bufs.quantized:
                # One pass instead of copy + accumulate (NaN payloads aside, the same bits; the
                # owner's bytes are what every peer ends with either way).
                bf.reduce_to(bufs.op, acc, bufs.src[a:b], payload.view(acc.dtype))
                return
            np.copyto(acc, bufs.src[a:b])
        if bufs.quantized:
            lo, scale = bf.unpack_meta(memoryview(payload)[: bf.QUANT_META.size])
            q = payload[bf.QUANT_META.size :].view(bufs.quant_dtype.numpy_dtype())  # type: ignore[union-attr]
            if self.fused_backup:
                assert self.backup is not None
                self.backup.overwrite(
                    a, b,
                    lambda saved: bf.dequantize_reduce_saving(bufs.op, q, acc, lo, scale, saved),
                    lambda: bf.dequantize_reduce(bufs.op, q, acc, lo, scale),
                )
            else:
                bf.dequantize_reduce(bufs.op, q, acc, lo, scale)
        else:
            wire = payload.view(acc.dtype)
            if self.fused_backup:
                # In place, this reduction is the slice's first overwrite: the kernel saves the
                # input as it reads it, so the backup costs no pass over memory of its own.
                assert self.backup is not None
                self.backup.overwrite(
                    a, b,
                    lambda saved: bf.reduce_into_saving(bufs.op, acc, wire, saved),
                    lambda: bf.reduce_into(bufs.op, acc, wire),
                )
            else:
                bf.reduce_into(bufs.op, acc, wire)

    def _apply_gathered(self, frame: Frame) -> None:
        """All-gather, quantized: dequantize the received bytes into the output (worker thread)."""
        self._dequantize_own(frame, self._gather_segment(frame))

    def _dequantize_own(self, frame: Frame, segment: np.ndarray) -> None:
        bufs = self.bufs
        a, b = frame.start, frame.stop
        lo, scale = bf.unpack_meta(memoryview(segment)[: bf.QUANT_META.size])
        q = segment[bf.QUANT_META.size :].view(bufs.quant_dtype.numpy_dtype())  # type: ignore[union-attr]
        self._save(a, b)
        if bufs.half:
            bf.dequantize(q, bufs.acc[a:b], lo, scale)
            bf.narrow(bufs.dst[a:b], bufs.acc[a:b])
        else:
            bf.dequantize(q, bufs.dst[a:b], lo, scale)

    async def _sender(self, lane: int) -> None:
        connection = self.links.to_next[lane]
        bufs = self.bufs
        owner_step = self.world - 1
        largest_frame = min(self.schedule.subchunk_elements, self.schedule.chunk_size(0))
        send_pool = (
            StagingPool(_SEND_DEPTH, bufs.reduce_scatter_nbytes(largest_frame), bufs)
            if bufs.quantized
            else None
        )
        for frame in self.schedule.send_frames(lane, self.lanes):
            if frame.step > 0:
                await self.ready[(frame.step - 1, frame.index)].wait()
            nbytes = self.frame_nbytes(frame)
            pooled: np.ndarray | None = None
            if bufs.quantized and frame.step < owner_step:
                assert send_pool is not None
                pooled = await send_pool.get()
            cost = self._payload_cost(frame)
            if cost:
                payload = await self.runner.run(cost, self.prepare_payload, frame, pooled)
            else:
                payload = self.prepare_payload(frame, pooled)
            await connection.send_data(self.header(frame), _as_bytes(payload))
            self.tx_bytes += nbytes
            if pooled is not None:
                assert send_pool is not None
                send_pool.put(pooled)

    def _payload_cost(self, frame: Frame) -> int:
        """Bytes of kernel work :meth:`prepare_payload` does for ``frame`` (0: none)."""
        nbytes = self.frame_nbytes(frame)
        owner_step = self.world - 1
        if self.exchange:
            return 0
        if frame.step < owner_step:
            if self.bufs.quantized:
                return nbytes * 2
            return nbytes if frame.step == 0 and self.bufs.half and not self.exchange else 0
        return nbytes * 4 if frame.step == owner_step else 0

    def prepare_payload(self, frame: Frame, scratch: np.ndarray | None) -> np.ndarray:
        """What to send for ``frame`` (kernels included; any thread).  ``scratch`` (quantized
        reduce-scatter only) receives the quantized bytes."""
        bufs = self.bufs
        owner_step = self.world - 1
        if self.exchange:  # its own input at step 0, then the one it received last
            if frame.step == 0:
                return self._own_contribution(frame)
            return self._exchange_slot(frame.step - 1, frame)
        if frame.step < owner_step:
            if bufs.quantized:
                assert scratch is not None
                payload = scratch[: self.frame_nbytes(frame)]
                self._quantize_partial(frame, payload)
                return payload
            if frame.step == 0:
                payload = self._own_contribution(frame)
                if bufs.half and not self.exchange:
                    bf.widen(payload, bufs.src[frame.start : frame.stop])
                return payload
            return bufs.acc[frame.start : frame.stop]
        if frame.step == owner_step:
            return self._finalize_owned(frame)
        if bufs.quantized:
            return self._gather_segment(frame)
        return bufs.dst[frame.start : frame.stop]

    def _own_contribution(self, frame: Frame) -> np.ndarray:
        """What step 0 sends unquantized: the input slice (the ring's f32 working slice for
        f16/bf16, to be filled by widening; the exchange sends 16-bit inputs as they are)."""
        if self.exchange_send is not None:
            return self.exchange_send[frame.start : frame.stop]
        if self.bufs.half and not self.exchange:
            return self.bufs.acc[frame.start : frame.stop]
        return self.bufs.src[frame.start : frame.stop]

    def _quantize_partial(self, frame: Frame, out: np.ndarray) -> None:
        """Reduce-scatter, quantized: quantize the slice's current partial result into ``out``."""
        bufs = self.bufs
        a, b = frame.start, frame.stop
        source = bufs.src[a:b] if frame.step == 0 else bufs.acc[a:b]
        q = out[bf.QUANT_META.size :].view(bufs.quant_dtype.numpy_dtype())  # type: ignore[union-attr]
        lo, scale = bf.quantize(source, q)
        bf.pack_meta(memoryview(out)[: bf.QUANT_META.size], lo, scale)

    def _finalize_owned(self, frame: Frame) -> np.ndarray:
        """The owner's last word on its chunk: AVG division, rounding, quantization (worker thread).

        Returns the payload of the first all-gather frame; this peer's output slice then holds
        exactly what every other peer will derive from that payload.
        """
        bufs = self.bufs
        a, b = frame.start, frame.stop
        acc = bufs.acc[a:b]
        if bufs.op is ReduceOp.AVG:
            bf.avg_finalize(acc, self.world)
        if bufs.quantized:
            segment = self._gather_segment(frame)
            q = segment[bf.QUANT_META.size :].view(bufs.quant_dtype.numpy_dtype())  # type: ignore[union-attr]
            lo, scale = bf.quantize(acc, q)
            bf.pack_meta(memoryview(segment)[: bf.QUANT_META.size], lo, scale)
            self._dequantize_own(frame, segment)
            return segment
        if bufs.half:
            self._save(a, b)
            bf.narrow(bufs.dst[a:b], acc)
        return bufs.dst[a:b]
