"""The state and arithmetic of one running ring all-reduce on this peer.

:class:`RingOp` holds one operation's schedule, buffers, frame layout and kernels: what every
execution path shares, so the bytes on the wire and the results are identical whichever runs
(:mod:`pccl.collectives.allreduce` picks the path and describes the design).  The paths drive
its methods: :mod:`pccl.collectives.trio_ring` from one Trio task, :mod:`pccl.collectives.inline`
from one task over the thread-side lanes, :mod:`pccl.collectives.threaded` from threads.
"""

from __future__ import annotations

import numpy as np

from ..protocol.codec import DataHeader
from ..protocol.ring import (
    EXCHANGE_MAX_BYTES,
    Frame,
    Phase,
    RingSchedule,
    shared_schedule,
    subchunk_elements,
    uses_exchange,
)
from .. import kernels
from ..types import ReduceOp
from .backup import InputBackup
from .buffers import KernelRunner, OpBuffers
from .links import RingLinks
from .segments import Segments

__all__ = ["RingOp"]


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A uint8 view (no copy): the buffer protocol refuses some dtypes (ml_dtypes' bfloat16)."""
    return array.view(np.uint8)


class RingOp:
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
        self.itemsize = bufs.itemsize
        count = bufs.src.size
        sub = subchunk_elements(count, world, bufs.itemsize, max_bytes=max_subchunk_bytes)
        #: A segmented buffer's frames are also cut where one of its arrays ends.
        breaks = bufs.src.breaks if isinstance(bufs.src, Segments) else ()
        self.exchange, self.schedule = self._plan(count, rank, sub, tuple(breaks), exchange_max_bytes)
        #: In place, an exchange overwrites each slice with its result while the send of that same
        #: slice may still be under way (a worker thread, the Trio sender): it sends from a copy.
        self.exchange_send: np.ndarray | None = None
        #: Exchange: the other peers' inputs, row ``s`` the one received at step ``s`` (from ring
        #: position ``rank - s - 1``), forwarded from there at step ``s + 1``.
        self.exchange_inputs: np.ndarray | None = None
        if self.exchange and count:
            assert isinstance(bufs.src, np.ndarray)  # never segmented (above)
            if bufs.in_place:
                self.exchange_send = bufs.take(bufs.src.nbytes).view(bufs.src.dtype)
                np.copyto(self.exchange_send, bufs.src)
            self.exchange_inputs = (
                bufs.take((world - 1) * bufs.src.nbytes).view(bufs.src.dtype).reshape(world - 1, count)
            )
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.gather_store, self.gather_offsets = self._make_gather_store()
        #: In place without a working array, a reduce-scatter reduction is the first overwrite of
        #: its slice of the caller's buffer, and saves the slice in the same pass
        #: (:meth:`InputBackup.overwrite`); the other slices are saved by plain copies.
        self.fused_backup = backup is not None and bufs.in_place and not bufs.half

    def _plan(self, count: int, rank: int, sub: int, breaks: tuple[int, ...],
              exchange_max_bytes: int) -> tuple[bool, RingSchedule]:
        """Whether the op runs as an exchange, and its schedule.

        A small unquantized op: the inputs travel around the ring and every peer reduces them
        all.  Decided from agreed parameters only (world, count, dtype, quantization,
        segmentation), so every peer agrees.  Never over segments: the exchange sends an
        in-place input from a flat copy, which a segmented buffer exists to avoid.
        """
        bufs = self.bufs
        exchange = not isinstance(bufs.src, Segments) and uses_exchange(
            self.world, bufs.src.nbytes, quantized=bufs.quantized, max_bytes=exchange_max_bytes)
        return exchange, shared_schedule(exchange, count, self.world, rank, sub, breaks)

    # --- what the execution paths ask (pccl.collectives.lane_op.LaneOp) ------------------------

    def take(self, nbytes: int) -> np.ndarray:
        return self.bufs.take(nbytes)

    def release(self) -> None:
        self.bufs.release()

    @property
    def op_nbytes(self) -> int:
        return self.bufs.src.nbytes

    @property
    def stage_nbytes(self) -> int:
        if self.exchange:
            return 0  # every input lands in exchange_inputs (destination): nothing is staged
        return self.max_reduce_scatter_nbytes

    @property
    def send_scratch_nbytes(self) -> int:
        return self.max_reduce_scatter_nbytes if self.bufs.quantized else 0

    @property
    def max_frame_nbytes(self) -> int:
        largest = min(self.schedule.subchunk_elements, self.schedule.chunk_size(0))
        return max(self.max_reduce_scatter_nbytes, self.bufs.all_gather_nbytes(largest))

    def sends_from_scratch(self, frame: Frame) -> bool:
        """Quantized reduce-scatter frames are quantized into scratch."""
        return self.bufs.quantized and frame.step < self.world - 1

    def receive_cost(self, frame: Frame) -> int:
        nbytes = self.frame_nbytes(frame)
        if self.exchange:
            return nbytes * self.world if frame.step == self.schedule.num_steps - 1 else 0
        if self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
            return nbytes * 2
        if self.bufs.quantized:
            return nbytes * 4
        return 0  # received in place

    def save_before_receive(self, frame: Frame) -> tuple[int, int] | None:
        """An unquantized all-gather frame lands in the caller's array: saved first, in place."""
        if self.exchange or self.backup is None or self.bufs.quantized:
            return None
        if self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER or self.backup.is_saved(frame.start):
            return None
        return frame.start, frame.stop

    def backup_ahead(self, lane: int) -> list[tuple[int, int]] | None:
        """In place, every slice must be backed up before its first overwrite; most of those
        copies would fall on the receiver (the busier thread), so a lane's sender saves them
        ahead, in the order the receiver will need them.  Slices whose first overwrite is a
        reduce-scatter reduction are left out when that reduction saves them itself
        (:attr:`fused_backup`): copying them here would be the extra pass the fused kernel
        avoids.  What remains is the chunk sent at step 0, first overwritten by the all-gather
        receive."""
        if self.backup is None:
            return None
        schedule = self.schedule
        work: list[tuple[int, int]] = []
        if not self.fused_backup:
            work = [(f.start, f.stop) for f in schedule.recv_frames(lane, self.lanes)]
        work += [(f.start, f.stop) for f in schedule.send_frames(lane, self.lanes) if f.step == 0]
        work.reverse()  # pop() takes the most urgent first
        return work

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

    def moves_nothing(self) -> bool:
        """Whether no frame moves at all (an empty buffer)."""
        return self.schedule.moves_nothing

    def destination(self, frame: Frame, stage: np.ndarray) -> memoryview:
        """Where frame ``frame``'s payload is received, for the lane threads and the inline path
        (any thread): ``stage`` in the reduce-scatter, the gather store when quantized, else the
        output slice itself (saved first, in place).  :meth:`received` processes it then."""
        bufs = self.bufs
        if self.exchange:
            return _as_bytes(self._exchange_slot(frame.step, frame)).data
        if self.schedule.phase(frame.step) is Phase.REDUCE_SCATTER:
            return stage[: self.frame_nbytes(frame)].data
        if bufs.quantized:
            return self._gather_segment(frame).data
        if self.backup is not None and not self.backup.is_saved(frame.start):
            self.backup.save(frame.start, frame.stop)
        return _as_bytes(bufs.dst[frame.start : frame.stop]).data

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
            kernels.widen(acc, operands[0])
        elif not (bufs.in_place and self.schedule.rank == 0):
            np.copyto(acc, operands[0])
        for operand in operands[1:]:
            kernels.reduce_into(acc, operand, bufs.op)
        if bufs.op is ReduceOp.AVG:
            kernels.avg_finalize(acc, self.world)
        if acc.dtype.kind == "f" and acc.size and np.isnan(np.minimum.reduce(acc, axis=None)):
            # (the minimum is NaN iff an element is: one pass, no mask, and no Python-level call)
            acc[np.isnan(acc)] = np.nan
        if bufs.half:
            kernels.narrow(out, acc)

    def _reduce_partial(self, frame: Frame, payload: np.ndarray) -> None:
        bufs = self.bufs
        a, b = frame.start, frame.stop
        acc = bufs.acc[a:b]
        # First touch of this slice: bring in this peer's own contribution.
        if bufs.half:
            kernels.widen(acc, bufs.src[a:b])
        elif not bufs.in_place:
            if not bufs.quantized:
                # One pass instead of copy + accumulate (NaN payloads aside, the same bits; the
                # owner's bytes are what every peer ends with either way).
                kernels.reduce_to(acc, bufs.src[a:b], payload.view(acc.dtype), bufs.op)
                return
            np.copyto(acc, bufs.src[a:b])
        if bufs.quant is not None:
            quant = bufs.quant
            if self.fused_backup:
                assert self.backup is not None
                self.backup.overwrite(
                    a, b,
                    lambda saved: quant.dequantize_reduce_saving(acc, payload, saved, bufs.op),
                    lambda: quant.dequantize_reduce(acc, payload, bufs.op),
                )
            else:
                quant.dequantize_reduce(acc, payload, bufs.op)
        else:
            wire = payload.view(acc.dtype)
            if self.fused_backup:
                # In place, this reduction is the slice's first overwrite: the kernel saves the
                # input as it reads it, so the backup costs no pass over memory of its own.
                assert self.backup is not None
                self.backup.overwrite(
                    a, b,
                    lambda saved: kernels.reduce_into_saving(acc, wire, saved, bufs.op),
                    lambda: kernels.reduce_into(acc, wire, bufs.op),
                )
            else:
                kernels.reduce_into(acc, wire, bufs.op)

    def _apply_gathered(self, frame: Frame) -> None:
        """All-gather, quantized: dequantize the received bytes into the output (worker thread)."""
        self._dequantize_own(frame, self._gather_segment(frame))

    def _dequantize_own(self, frame: Frame, segment: np.ndarray) -> None:
        bufs = self.bufs
        a, b = frame.start, frame.stop
        assert bufs.quant is not None
        self._save(a, b)
        if bufs.half:
            bufs.quant.dequantize(segment, bufs.acc[a:b])
            kernels.narrow(bufs.dst[a:b], bufs.acc[a:b])
        else:
            bufs.quant.dequantize(segment, bufs.dst[a:b])

    def payload_cost(self, frame: Frame) -> int:
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
                    kernels.widen(payload, bufs.src[frame.start : frame.stop])
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
        assert bufs.quant is not None
        bufs.quant.quantize(source, out)

    def _finalize_owned(self, frame: Frame) -> np.ndarray:
        """The owner's last word on its chunk: AVG division, rounding, quantization (worker thread).

        Returns the payload of the first all-gather frame; this peer's output slice then holds
        exactly what every other peer will derive from that payload.
        """
        bufs = self.bufs
        a, b = frame.start, frame.stop
        acc = bufs.acc[a:b]
        if bufs.op is ReduceOp.AVG:
            kernels.avg_finalize(acc, self.world)
        if bufs.quant is not None:
            segment = self._gather_segment(frame)
            bufs.quant.quantize(acc, segment)
            self._dequantize_own(frame, segment)
            return segment
        if bufs.half:
            self._save(a, b)
            kernels.narrow(bufs.dst[a:b], acc)
        return bufs.dst[a:b]
