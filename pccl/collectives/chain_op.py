"""The state of one running forwarding collective on this peer: an all-gather or a broadcast.

Both move data that is never combined: every frame is either *originated* — made by this peer
from its own contribution, which is what a peer sends at step 0 (its slot of an all-gather, the
root's buffer in a broadcast) — or *forwarded*: received at step ``s`` straight into the output
and sent on verbatim at step ``s + 1``.  :class:`ChainOp` is that rule over any schedule with
that shape (:class:`~pccl.protocol.ring.AllGatherSchedule`,
:class:`~pccl.protocol.ring.BroadcastSchedule`) and implements what the execution paths ask of
an op (:class:`~pccl.collectives.lane_op.LaneOp`), so they run it unchanged.

* **Zero copy.**  Unquantized frames are received into the output slice they belong to and
  forwarded from it; an originated frame is sent from the caller's input and copied into this
  peer's own slot of the output (no copy when that slot *is* the input: an in-place broadcast
  root, an all-gather whose input is a view of its slot in the output).  f16/bf16 travel as
  they are.
* **MIN_MAX quantization** (float buffers): the originator quantizes each sub-chunk once, with
  its own parameters, into the op's *store* (the codes plus the ``(lo, scale)`` parameters of
  the frame or of each block, :mod:`~pccl.collectives.wire_quant`), writes the dequantized values
  into its own output slot and sends the stored bytes; every other peer receives the bytes
  into its store, dequantizes them into its output and forwards them unchanged.  Everyone
  applies one dequantization to the same bytes, so every peer's output is bit-identical,
  the originator's own slot included.  f16/bf16 dequantize into an f32 working array and round
  once.
* **In place** (a broadcast's buffer): every slice of the output is saved in the backup right
  before its first overwrite — before it is received into, before the dequantized values land
  in it (which includes a quantized root's own buffer).  The lane threads' senders save the
  slices ahead while they would otherwise wait.
"""

from __future__ import annotations

import numpy as np

from .. import kernels
from ..protocol.codec import DataHeader
from ..protocol.ring import Frame, RingSchedule
from ..types import DType, dtype_of
from .backup import InputBackup
from .buffers import SCRATCH, KernelRunner, ScratchArena
from .wire_quant import WireQuant
from .links import RingLinks
from .segments import Segments

__all__ = ["ChainOp"]

_HALF = (DType.FLOAT16, DType.BFLOAT16)


def _as_bytes(array: np.ndarray) -> np.ndarray:
    """A uint8 view (no copy): the buffer protocol refuses some dtypes (ml_dtypes' bfloat16)."""
    return array.view(np.uint8)


def _same_memory(a: np.ndarray | Segments, b: np.ndarray | Segments) -> bool:
    if a is b:
        return True
    if isinstance(a, Segments) or isinstance(b, Segments):
        return False
    return bool(a.size == b.size and a.size and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


class ChainOp:
    """One all-gather or broadcast on this peer (see the module docstring).

    ``out`` is the flat output every frame's offsets are in; ``src`` this peer's contribution,
    which belongs at ``out[base : base + src.size]`` (a broadcast: the whole buffer at 0; only
    read where this peer originates frames).  ``backup`` saves ``out``'s slices before their
    first overwrite (an in-place broadcast), ``None`` when ``out`` is not the caller's input.
    """

    def __init__(
        self,
        schedule: RingSchedule,
        *,
        src: np.ndarray | Segments,
        out: np.ndarray | Segments,
        base: int,
        quant: WireQuant | None,
        links: RingLinks,
        world: int,
        seq: int,
        backup: InputBackup | None,
        runner: KernelRunner,
        arena: ScratchArena = SCRATCH,
    ) -> None:
        self.schedule = schedule
        self.src = src
        self.out = out
        self.base = base
        self.quant = quant
        self.links = links
        self.lanes = links.lanes
        self.world = world
        self.seq = seq
        self.backup = backup
        self.runner = runner
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.dtype = dtype_of(out.dtype)
        self.itemsize = self.dtype.itemsize
        self.half = self.dtype in _HALF
        self._arena = arena
        self._scratch: list[np.ndarray] = []
        #: Originated frames are copied into this peer's own slot unless it is the input itself.
        self.copy_own = src.size > 0 and src is not out and not _same_memory(src, out[base : base + src.size])
        self._store: np.ndarray | None = None
        self._store_at: dict[tuple[int, int], int] = {}
        self._work: np.ndarray | None = None
        largest = 0
        pos = 0
        for c in range(len(schedule.chunks)):
            for k, (a, b) in enumerate(schedule.subchunks(c)):
                largest = max(largest, b - a)
                self._store_at[(c, k)] = pos
                pos += self._wire_nbytes(b - a)
        self._largest = largest
        if quant is not None and not schedule.moves_nothing:
            self._store = self.take(pos)
            if self.half:
                self._work = self.take(out.size * 4).view(np.float32)

    # --- buffers -------------------------------------------------------------------------------

    def take(self, nbytes: int) -> np.ndarray:
        buf = self._arena.take(nbytes)
        self._scratch.append(buf)
        return buf[:nbytes]

    def release(self) -> None:
        """Give the scratch memory back (only once nothing can touch it any more)."""
        for buf in self._scratch:
            self._arena.give(buf)
        self._scratch.clear()

    def _wire_nbytes(self, count: int) -> int:
        return self.quant.nbytes(count) if self.quant is not None else count * self.itemsize

    def _segment(self, frame: Frame) -> np.ndarray:
        assert self._store is not None
        at = self._store_at[(frame.chunk, frame.index)]
        return self._store[at : at + self._wire_nbytes(frame.count)]

    def _save(self, a: int, b: int) -> None:
        if self.backup is not None:
            self.backup.save(a, b)

    # --- what the execution paths ask (LaneOp) -------------------------------------------------

    @property
    def op_nbytes(self) -> int:
        return self.out.nbytes

    @property
    def stage_nbytes(self) -> int:
        return 0  # every frame lands where it belongs

    @property
    def send_scratch_nbytes(self) -> int:
        return 0

    @property
    def max_frame_nbytes(self) -> int:
        return self._wire_nbytes(self._largest)

    def moves_nothing(self) -> bool:
        return self.schedule.moves_nothing

    def frame_nbytes(self, frame: Frame) -> int:
        return self._wire_nbytes(frame.count)

    def header(self, frame: Frame) -> DataHeader:
        return DataHeader(op_seq=self.seq, stream=frame.index, step=frame.step,
                          offset=frame.start * self.itemsize, nbytes=self._wire_nbytes(frame.count))

    def sends_from_scratch(self, frame: Frame) -> bool:
        return False

    def payload_cost(self, frame: Frame) -> int:
        if frame.step != 0:
            return 0  # forwarded as received
        if self.quant is not None:
            return frame.count * self.itemsize * 3
        return frame.count * self.itemsize if self.copy_own else 0

    def prepare_payload(self, frame: Frame, scratch: np.ndarray | None) -> np.ndarray:
        a, b = frame.start, frame.stop
        if frame.step != 0:  # forward what was received at the step before
            return self._segment(frame) if self.quant is not None else self.out[a:b]
        source = self.src[a - self.base : b - self.base]
        if self.quant is not None:
            segment = self._segment(frame)
            self.quant.quantize(source, segment)
            self._apply(frame, segment)  # what every other peer will make of these bytes
            return segment
        if self.copy_own:
            self._save(a, b)
            np.copyto(self.out[a:b], source)
        return source

    def save_before_receive(self, frame: Frame) -> tuple[int, int] | None:
        if self.backup is None or self.quant is not None or self.backup.is_saved(frame.start):
            return None
        return frame.start, frame.stop

    def destination(self, frame: Frame, stage: np.ndarray) -> memoryview:
        if self.quant is not None:
            return self._segment(frame).data
        if self.backup is not None and not self.backup.is_saved(frame.start):
            self.backup.save(frame.start, frame.stop)
        return _as_bytes(self.out[frame.start : frame.stop]).data

    def receive_cost(self, frame: Frame) -> int:
        return self.frame_nbytes(frame) * 4 if self.quant is not None else 0

    def received(self, frame: Frame, stage: np.ndarray) -> None:
        if self.quant is not None:
            self._apply(frame, self._segment(frame))

    def _apply(self, frame: Frame, segment: np.ndarray) -> None:
        """Dequantize a stored frame into the output (saved first, in place)."""
        assert self.quant is not None
        a, b = frame.start, frame.stop
        self._save(a, b)
        if self._work is not None:
            self.quant.dequantize(segment, self._work[a:b])
            kernels.narrow(self.out[a:b], self._work[a:b])
        else:
            self.quant.dequantize(segment, self.out[a:b])

    def backup_ahead(self, lane: int) -> list[tuple[int, int]] | None:
        """Every slice received on ``lane`` (and, quantized, every slice this peer originates:
        its own dequantized values overwrite them) in the order they will be needed."""
        if self.backup is None:
            return None
        schedule = self.schedule
        work = [(f.start, f.stop) for f in schedule.recv_frames(lane, self.lanes)]
        if self.quant is not None:
            work += [(f.start, f.stop) for f in schedule.send_frames(lane, self.lanes) if f.step == 0]
        work.reverse()  # pop() takes the most urgent first
        return work
