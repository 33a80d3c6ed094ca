"""Buffers of one all-reduce: the argument check, the op's arrays, scratch memory, where kernels run.

The arithmetic is in the C kernels, called straight through :mod:`pccl.kernels` (the one place
that knows their signatures) by :mod:`pccl.collectives.ring_op`, which decides which kernel runs
on which slice; :class:`KernelRunner` decides where (a worker thread for large slices, inline
otherwise).  The quantized wire format is :mod:`pccl.collectives.wire_quant`'s.
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import trio

from ..arrays import as_array
from ..errors import InvalidArgument
from ..types import DType, Quantization, QuantKind, ReduceOp, dtype_of
from .segments import Segments
from .wire_quant import QUANT_META, WireQuant, pack_meta, unpack_meta

__all__ = [
    "ScratchArena",
    "SCRATCH",
    "check_op",
    "check_quantization",
    "quant_for",
    "ReduceArgs",
    "OpBuffers",
    "KernelRunner",
    "QUANT_META",
    "pack_meta",
    "unpack_meta",
]

_T = TypeVar("_T")

_HALF = (DType.FLOAT16, DType.BFLOAT16)


class ScratchArena:
    """Reusable scratch memory for all-reduces: backups, f32 working arrays, staging buffers.

    Fresh memory costs page faults on first touch — on this kind of machine writing 64 MiB of
    new pages takes 12-60 ms against ~2 ms for memory already mapped — and a training loop
    all-reduces buffers of the same sizes every step, so freed buffers are kept (up to
    ``retain_bytes`` in total; a buffer given to a full arena evicts the oldest kept ones, so that
    sizes no longer used make room for the current ones) and handed out again.  A buffer is taken whole by one user and
    given back when that user is done with it; :meth:`take` returns a uint8 array of at least the
    requested size (never more than twice as large).  Locked, so trio runs in several threads
    (the blocking facade, tests) may share it.
    """

    def __init__(self, retain_bytes: int = 1 << 30) -> None:
        self.retain_bytes = retain_bytes
        # Free buffers by size, oldest first, and the sizes present in order: a take finds the
        # smallest fitting buffer by bisection (a long-lived process, or a simulation of many
        # peers sharing this arena, keeps many of them).
        self._free: dict[int, list[tuple[int, np.ndarray]]] = {}  # (when given, buffer)
        self._sizes: list[int] = []
        self._retained = 0
        self._given = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        nbytes = max(nbytes, 1)
        with self._lock:
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= 2 * nbytes:
                size = self._sizes[i]
                return self._pop(size, i)
        return np.empty(nbytes, np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        size = buffer.size
        if size > self.retain_bytes:
            return
        with self._lock:
            while self._retained + size > self.retain_bytes:  # evict the oldest kept buffer
                oldest = min(self._sizes, key=lambda kept: self._free[kept][0][0])
                self._pop(oldest, bisect.bisect_left(self._sizes, oldest))
            same = self._free.get(size)
            if same is None:
                same = self._free[size] = []
                bisect.insort(self._sizes, size)
            same.append((self._given, buffer))
            self._given += 1
            self._retained += size

    def _pop(self, size: int, index: int) -> np.ndarray:
        """The oldest kept buffer of ``size`` (``self._sizes[index]``), no longer kept."""
        same = self._free[size]
        _, buffer = same.pop(0)
        if not same:
            del self._free[size]
            del self._sizes[index]
        self._retained -= size
        return buffer

    @property
    def retained_bytes(self) -> int:
        with self._lock:
            return self._retained


#: The arena every all-reduce uses unless given another.
SCRATCH = ScratchArena()


def check_op(op: Any) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; :class:`InvalidArgument` if it names none."""
    if type(op) is ReduceOp:
        return op
    try:
        return ReduceOp(op)
    except ValueError:
        raise InvalidArgument(f"op must be a ReduceOp, got {op!r}") from None


def check_quantization(quantization: Any) -> Quantization | None:
    """``quantization`` if it is a :class:`~pccl.types.Quantization` or ``None``, else
    :class:`InvalidArgument`."""
    if quantization is not None and not isinstance(quantization, Quantization):
        raise InvalidArgument(f"quantization must be a pccl.Quantization or None, got {quantization!r}")
    return quantization


def quant_for(dtype: DType, quantization: Quantization | None) -> WireQuant | None:
    """How a buffer of ``dtype`` travels under ``quantization`` (``None``: unquantized);
    :class:`InvalidArgument` for min-max quantization of a non-float buffer."""
    if quantization is None or QuantKind(quantization.kind) is QuantKind.NONE:
        return None
    if not dtype.is_float:
        raise InvalidArgument(f"MIN_MAX quantization needs a floating-point buffer, got {dtype.name.lower()}")
    return WireQuant.of(dtype, quantization)


@dataclasses.dataclass(frozen=True)
class ReduceArgs:
    """One all-reduce's arguments, checked: its buffers, flattened, and what to do with them.

    ``src`` is the caller's input and ``dst`` the output (the same array in place); in place
    over several arrays both are one :class:`Segments`.  :meth:`check` is the only check of an
    all-reduce's arguments: the communicator makes it before its vote (a bad buffer never
    reaches the master) and hands the result on, and the data path runs on it as it is.
    """

    src: np.ndarray | Segments
    dst: np.ndarray | Segments
    op: ReduceOp
    dtype: DType
    in_place: bool
    #: How min-max quantized frames travel; ``None`` when unquantized.
    quant: WireQuant | None

    @classmethod
    def check(cls, send: Any, recv: Any, op: Any, quantization: Any) -> ReduceArgs:
        """Check ``send`` and ``recv`` (``None`` or ``send`` itself: in place) — numpy arrays
        or CPU torch tensors, viewed without a copy by :func:`pccl.arrays.as_array`, or one
        :class:`Segments` (in place only) — ``op`` and ``quantization`` (a
        :class:`~pccl.types.Quantization` or ``None``).  :class:`InvalidArgument` says what is
        wrong.  NaN or Inf in a quantized input is found by the quantization kernel, during the
        op (``InvalidArgument`` from the ring)."""
        op = check_op(op)
        quantization = check_quantization(quantization)
        same = recv is None or recv is send
        if isinstance(send, Segments):
            if not same:
                raise InvalidArgument("a segmented buffer is reduced in place only")
            return cls._make(send, send, op, True, quantization)
        send = as_array(send, name="send", writable=False)
        recv = send if same else as_array(recv, name="recv", writable=False)
        if recv.dtype != send.dtype or recv.size != send.size:
            raise InvalidArgument(
                f"recv ({recv.dtype}, {recv.size} elements) must match send ({send.dtype}, {send.size} elements)"
            )
        if not recv.flags.writeable:
            raise InvalidArgument("recv (or the in-place buffer) is read-only")
        src = send.reshape(-1)
        dst = src if same else recv.reshape(-1)
        in_place = same or np.shares_memory(src, dst)
        # (``__array_interface__`` builds a dict: asked only of two arrays that do overlap.)
        if in_place and not same and not (
            src.__array_interface__["data"][0] == dst.__array_interface__["data"][0]
        ):
            raise InvalidArgument("send and recv overlap partially; pass the same array (in place) or disjoint ones")
        return cls._make(src, dst, op, in_place, quantization)

    @classmethod
    def _make(cls, src: np.ndarray | Segments, dst: np.ndarray | Segments, op: ReduceOp, in_place: bool,
              quantization: Quantization | None) -> ReduceArgs:
        dtype = dtype_of(src.dtype)
        return cls(src, dst, op, dtype, in_place, quant_for(dtype, quantization))

    def into(self, output: np.ndarray) -> ReduceArgs:
        """The same op reducing into ``output`` instead: a flat array of ``src``'s dtype and size
        that shares no memory with it (an in-place op's result staged in scratch memory)."""
        # Built directly (every staged op makes one): dataclasses.replace costs several times more.
        return ReduceArgs(self.src, output, self.op, self.dtype, False, self.quant)


@dataclasses.dataclass
class OpBuffers:
    """The arrays of one running all-reduce, with the dtypes on the wire in each phase.

    ``src``, ``dst``, ``op``, ``in_place``… are those of its :class:`ReduceArgs`.  ``acc`` is
    where reduce-scatter accumulates: ``dst`` itself, except for f16/bf16, which accumulate in an
    f32 working array (so the partial sums travel as f32 and only the final result is rounded,
    once, by the chunk's owner).  In place over several arrays (:class:`Segments`) ``src`` and
    ``dst`` are the segmented buffer: the data path only ever takes a frame's slice of them.
    """

    src: np.ndarray | Segments
    dst: np.ndarray | Segments
    acc: np.ndarray | Segments
    dtype: DType
    acc_dtype: DType
    op: ReduceOp
    in_place: bool
    quant: WireQuant | None
    #: Arena buffers this op holds (returned by :meth:`release`).
    scratch: list[np.ndarray] = dataclasses.field(default_factory=list)
    arena: ScratchArena = SCRATCH

    @classmethod
    def for_args(cls, args: ReduceArgs, arena: ScratchArena = SCRATCH) -> OpBuffers:
        """The buffers of an op on ``args`` (checked already); f16/bf16 take their f32 working
        array from ``arena`` now."""
        half = args.dtype in _HALF
        acc_dtype = DType.FLOAT32 if half else args.dtype
        # f16/bf16 accumulate in an f32 working array, filled one sub-chunk at a time.
        scratch = [arena.take(args.src.size * 4)] if half else []
        acc = scratch[0][: args.src.size * 4].view(np.float32) if half else args.dst
        return cls(args.src, args.dst, acc, args.dtype, acc_dtype, args.op, args.in_place, args.quant,
                   scratch, arena)

    def take(self, nbytes: int) -> np.ndarray:
        """A scratch uint8 array of exactly ``nbytes`` held until :meth:`release`."""
        buf = self.arena.take(nbytes)
        self.scratch.append(buf)
        return buf[:nbytes]

    def release(self) -> None:
        """Give every scratch buffer back (only once nothing can touch them any more)."""
        for buf in self.scratch:
            self.arena.give(buf)
        self.scratch.clear()

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def half(self) -> bool:
        return self.dtype in _HALF

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    def reduce_scatter_nbytes(self, count: int) -> int:
        """Payload bytes of a reduce-scatter frame of ``count`` elements."""
        if self.quant is not None:
            return self.quant.nbytes(count)
        return count * self.acc_dtype.itemsize

    def all_gather_nbytes(self, count: int) -> int:
        if self.quant is not None:
            return self.quant.nbytes(count)
        return count * self.dtype.itemsize


#: Kernel work (in bytes touched) from which a worker thread is used.  A thread hand-off costs
#: tens of microseconds idle and much more on a loaded machine, while a kernel over a default
#: 4 MiB frame takes a fraction of a millisecond and releases the GIL anyway (cffi), so the
#: send/receive worker threads keep running; only larger frames are worth a thread.
DEFAULT_THREAD_THRESHOLD = 16 * 1024 * 1024


class KernelRunner:
    """Runs kernel work on slices: in a worker thread when large, else inline on the Trio thread.

    ``threads=False`` runs everything inline: the simulator's runs must not start real threads.
    A kernel in a worker thread is not abandoned on cancellation — the task waits the
    milliseconds it takes — so no kernel ever writes into a buffer after the op has returned.

    ``kernel_wait`` (the network's :meth:`~pccl.net.base.Network.kernel_wait`): where the clock
    is not the CPU's (the simulator's virtual clock, in which inline work takes no time), the
    wait kernel work on ``nbytes`` takes there.  Every piece of work then runs inline and the
    task awaits ``kernel_wait(nbytes)`` afterwards, shielded from cancellation as the wait for a
    worker thread is; a cancellation is raised once it returned.  ``None`` (production): no wait.
    """

    def __init__(self, *, threads: bool = True, thread_threshold: int = DEFAULT_THREAD_THRESHOLD,
                 kernel_wait: Callable[[int], Awaitable[None]] | None = None) -> None:
        self.threads = threads
        self.thread_threshold = thread_threshold
        self.kernel_wait = kernel_wait

    def inline(self, nbytes: int) -> bool:
        """Whether :meth:`run` runs kernel work of ``nbytes`` on the Trio thread with no wait (a
        caller that needs no schedule point after it may then call the kernel itself)."""
        return self.kernel_wait is None and (not self.threads or nbytes < self.thread_threshold)

    async def run(self, nbytes: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, a kernel over ``nbytes``.  Cancellation waits for the kernel (see the
        class docstring) and then raises ``Cancelled``; the kernel's errors escape."""
        if self.kernel_wait is not None:
            result = fn(*args)
            with trio.CancelScope(shield=True):
                await self.kernel_wait(nbytes)
            await trio.lowlevel.checkpoint()
            return result
        if not self.inline(nbytes):
            return await trio.to_thread.run_sync(fn, *args)
        result = fn(*args)
        await trio.lowlevel.checkpoint()
        return result
