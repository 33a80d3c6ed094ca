"""Typed numpy-facing wrappers over the C kernels of ``pccl._kernels``, and numpy oracles.

Every wrapper validates its arguments and raises :class:`~pccl.errors.InvalidArgument` with a
message naming the argument: unsupported or mismatched dtype, a non-C-contiguous array,
different element counts, a read-only destination, or a destination that overlaps an input.
Arrays of any shape are accepted as long as they are C-contiguous; kernels work on the flat
element sequence.  Misaligned views (e.g. ``np.frombuffer(buf, offset=1)``) are accepted: they
go through an aligned temporary copy, because the C code may assume natural alignment.
``n == 0`` is fine everywhere.

The GIL: cffi's API mode wraps every C call in ``Py_BEGIN_ALLOW_THREADS`` /
``Py_END_ALLOW_THREADS`` (documented by cffi since 0.3, "C function calls are done with the GIL
released"; visible in the generated ``_kernels.c``), so a kernel running in a worker thread
never blocks the Trio thread, whatever the buffer size.  Pointers come from ``ffi.from_buffer``:
no copies.  Nothing here awaits, so cancellation cannot interrupt a kernel half-way; callers
that run kernels in threads decide what cancellation means for the buffer.

Semantics (integer wrapping, NaN rules of MIN/MAX, floor division of integer AVG, rounding of
float16/bfloat16 narrowing, the quantization formulas) are specified in ``native/reduce.c`` and
``native/quant.c``.  The ``*_oracle`` functions at the end implement the same definitions in
plain numpy; the property tests check the kernels against them bit for bit.  Blockwise and
4-bit quantization have their wrappers and oracles in :mod:`pccl.blockquant`.

bfloat16 arrays are numpy arrays of ``ml_dtypes.bfloat16`` (recognised by name, so checking an
argument does not import ml_dtypes); where a function takes an explicit ``dtype=DType.BFLOAT16`` (or FLOAT16) a raw
``uint16`` array holding the bit patterns is accepted too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from ._kernels import ffi, lib
from .errors import InvalidArgument
from .types import DType, ReduceOp, dtype_of

__all__ = [
    "QuantParams",
    "accumulator_dtype",
    "argument_error",
    "checked_array",
    "reduce_into",
    "reduce_to",
    "reduce_into_saving",
    "save_copy",
    "avg_finalize",
    "widen",
    "narrow",
    "minmax",
    "quantize",
    "dequantize",
    "dequantize_reduce",
    "dequantize_reduce_saving",
    "reduce_oracle",
    "avg_oracle",
    "widen_oracle",
    "narrow_oracle",
    "minmax_oracle",
    "quantize_oracle",
    "dequantize_oracle",
    "dequantize_reduce_oracle",
]

_log = logging.getLogger(__name__)

_HALF = (DType.FLOAT16, DType.BFLOAT16)
_QUANT_SOURCES = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
_QUANT_TARGETS = {DType.UINT8: 255, DType.UINT16: 65535}
_ACCUMULATORS = (DType.FLOAT32, DType.FLOAT64)

# The native module must be the one built from this source tree (an editable install whose
# extension was not rebuilt after a change of native/ would otherwise misbehave silently).
_ABI_VERSION = 6  # 4: float kernels reset the caller's FTZ/DAZ/rounding mode; 5: pccl_reduce_to; 6: blockwise/4-bit
if lib.pccl_kernels_abi_version() != _ABI_VERSION:  # pragma: no cover - stale build only
    raise ImportError(
        f"pccl._kernels has ABI {lib.pccl_kernels_abi_version()}, expected {_ABI_VERSION}: "
        "rebuild it (pip install -e .)"
    )
if (lib.PCCL_F32, lib.PCCL_BF16, lib.PCCL_U64, lib.PCCL_MAX) != (
    DType.FLOAT32, DType.BFLOAT16, DType.UINT64, ReduceOp.MAX
):  # pragma: no cover - kernels.h and pccl/types.py disagree
    raise ImportError("pccl._kernels dtype/op codes disagree with pccl.types")


@dataclasses.dataclass(frozen=True)
class QuantParams:
    """What a quantized chunk needs besides its integers: ``x' = lo + q * scale``.

    Both values are exact images of accumulator-type numbers (float32 for float32/float16/
    bfloat16 chunks, float64 for float64 chunks), so sending them as float64 loses nothing.
    """

    lo: float
    scale: float


def accumulator_dtype(dtype: DType) -> DType:
    """The type reductions and (de)quantization of ``dtype`` compute in: FLOAT64 stays FLOAT64,
    every other float type accumulates in FLOAT32; integers reduce in their own type."""
    dtype = DType(dtype)
    if dtype is DType.FLOAT64 or not dtype.is_float:
        return dtype
    return DType.FLOAT32


# --- argument checking ------------------------------------------------------------------------


def argument_error(message: str) -> InvalidArgument:
    """The error for a bad kernel argument (logged at debug level): :mod:`pccl.blockquant`'s too."""
    _log.debug("kernel argument rejected: %s", message)
    return InvalidArgument(message)


def checked_array(name: str, a: Any, *, writable: bool = False) -> np.ndarray:
    """``a`` if it is a C-contiguous numpy array (writable when asked), else :class:`InvalidArgument`."""
    if not isinstance(a, np.ndarray):
        raise argument_error(f"{name} must be a numpy array, not {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise argument_error(f"{name} must be C-contiguous (got strides {a.strides} for shape {a.shape})")
    if writable and not a.flags.writeable:
        raise argument_error(f"{name} is read-only but the kernel writes into it")
    return a


_DTYPE_CACHE: dict[np.dtype, DType] = {}


def _dtype(name: str, a: np.ndarray, declared: DType | int | None = None) -> DType:
    """The element type of ``a``; with ``declared``, also accept raw uint16 bits for f16/bf16."""
    if declared is None:
        found = _DTYPE_CACHE.get(a.dtype)
        if found is None:
            found = _DTYPE_CACHE[a.dtype] = dtype_of(a.dtype)  # raises for unsupported dtypes
        return found
    declared = DType(declared)
    try:
        actual: DType | None = dtype_of(a.dtype)
    except InvalidArgument:
        actual = None
    if actual is declared or (declared in _HALF and actual is DType.UINT16):
        return declared
    raise argument_error(f"{name} has dtype {a.dtype}, which cannot hold {declared.name.lower()}")


def _same_size(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray) -> None:
    if a.size != b.size:
        raise argument_error(f"{name_a} has {a.size} elements but {name_b} has {b.size}")


def _no_overlap(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray) -> None:
    # Exact test (not just bounds); cheap for contiguous arrays.
    if np.shares_memory(a, b):
        raise argument_error(f"{name_a} and {name_b} overlap in memory; the kernel needs separate buffers")


_CHAR_ARRAY = ffi.typeof("char[]")
_FLOAT_ARRAY = ffi.typeof("float[]")


def _ptr(a: np.ndarray, ctype: Any = _CHAR_ARRAY) -> Any:
    """A zero-copy cffi pointer to the array's memory (it keeps ``a`` alive)."""
    return ffi.from_buffer(ctype, a, require_writable=a.flags.writeable)


def _aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself if naturally aligned, else an aligned copy (the C code may assume alignment)."""
    return a if a.flags.aligned else a.copy()


def _check(rc: int, what: str, acc: DType | None = None) -> None:
    if rc == lib.PCCL_OK:
        return
    if rc == lib.PCCL_ENONFINITE:
        raise argument_error(f"{what}: the input contains NaN or Inf; min-max quantization needs finite values")
    if rc == lib.PCCL_ERANGE:
        acc_name = acc.name.lower() if acc is not None else "the accumulator type"
        raise argument_error(f"{what}: max - min of the input overflows {acc_name}")
    # The wrappers validate everything the C code checks, so this is a wrapper bug.
    raise argument_error(f"{what}: the native kernel rejected its arguments (status {rc})")


def _op(op: ReduceOp | int) -> ReduceOp:
    if type(op) is ReduceOp:
        return op
    try:
        return ReduceOp(op)
    except ValueError as exc:
        raise argument_error(f"unknown reduce op {op!r}") from exc


# --- wrappers -----------------------------------------------------------------------------------


def reduce_into(dst: np.ndarray, src: np.ndarray, op: ReduceOp | int = ReduceOp.SUM,
                *, src_dtype: DType | None = None) -> None:
    """``dst op= src`` element-wise, in place.

    ``dst`` and ``src`` share a dtype (float32, float64, any integer type), or ``src`` is
    float16/bfloat16 and ``dst`` float32 (``src_dtype`` declares raw uint16 bits).  Integers
    wrap like numpy; float SUM/PROD are one IEEE operation per element (float32 SUM equals
    ``np.add(dst, src, out=dst)`` bit for bit); MIN/MAX behave like ``np.minimum`` /
    ``np.maximum``: NaN in either operand gives NaN, and on ties (+0 vs -0) src wins.  AVG
    accumulates like SUM; finish with :func:`avg_finalize`.  Raises InvalidArgument.
    """
    if src_dtype is None and type(dst) is np.ndarray and type(src) is np.ndarray and type(op) is ReduceOp:
        # The data path's call (a small op makes one or two per frame, where these checks cost
        # several times the kernel): two aligned C-contiguous arrays of one supported dtype,
        # not empty, not overlapping (for contiguous arrays the bounds test is exact), checked
        # in one go; anything else takes the checks below, which name what is wrong.
        dt = _DTYPE_CACHE.get(dst.dtype)
        fd, fs = dst.flags, src.flags
        if (dt is not None and dt not in _HALF and src.dtype == dst.dtype and dst.size == src.size and dst.size
                and fd.c_contiguous and fd.writeable and fd.aligned and fs.c_contiguous and fs.aligned
                and not np.may_share_memory(dst, src)):
            _check(lib.pccl_reduce(op, dt, ffi.from_buffer(_CHAR_ARRAY, dst, True), ffi.from_buffer(_CHAR_ARRAY, src),
                                   dst.size), "reduce")
            return
    op = _op(op)
    dst = checked_array("dst", dst, writable=True)
    src = checked_array("src", src)
    dt_dst = _dtype("dst", dst)
    dt_src = _dtype("src", src, src_dtype)
    _same_size("dst", dst, "src", src)
    _no_overlap("dst", dst, "src", src)
    if dt_src in _HALF:
        if dt_dst is not DType.FLOAT32:
            raise argument_error(f"{dt_src.name.lower()} src must be accumulated into a float32 dst, not {dst.dtype}")
    elif dt_src is not dt_dst:
        raise argument_error(f"dst has dtype {dst.dtype} but src has {src.dtype}; they must match")
    if dst.size == 0:
        return
    d, s = _aligned(dst), _aligned(src)
    if dt_src in _HALF:
        rc = lib.pccl_reduce_widen(op, dt_src, _ptr(d, _FLOAT_ARRAY), _ptr(s), d.size)
    else:
        rc = lib.pccl_reduce(op, dt_dst, _ptr(d), _ptr(s), d.size)
    _check(rc, "reduce")
    if d is not dst:
        dst[...] = d


def reduce_to(dst: np.ndarray, a: np.ndarray, b: np.ndarray, op: ReduceOp | int = ReduceOp.SUM) -> None:
    """``dst = a op b`` element-wise, in one pass: ``dst[:] = a`` followed by :func:`reduce_into`
    ``(dst, b, op)`` (bit for bit but for which NaN payload a float SUM/PROD of two NaNs keeps),
    for ``a``, ``b`` and ``dst`` of one dtype (float32, float64, any integer type; not
    float16/bfloat16).  ``a`` and ``b`` may be one array; ``dst`` overlaps neither.  Float
    arithmetic is IEEE's whatever the calling thread's floating-point mode (unlike ``np.add`` in
    a thread with flush-to-zero on).  Raises InvalidArgument.
    """
    op = _op(op)
    dst = checked_array("dst", dst, writable=True)
    a = checked_array("a", a)
    b = checked_array("b", b)
    dt = _dtype("dst", dst)
    for name, x in (("a", a), ("b", b)):
        if _dtype(name, x) is not dt:
            raise argument_error(f"dst has dtype {dst.dtype} but {name} has {x.dtype}; they must match")
        _same_size("dst", dst, name, x)
        _no_overlap("dst", dst, name, x)
    if dt in _HALF:
        raise argument_error(f"reduce_to does not take {dt.name.lower()}: widen to float32 first")
    if dst.size == 0:
        return
    d, x, y = _aligned(dst), _aligned(a), _aligned(b)
    _check(lib.pccl_reduce_to(op, dt, _ptr(d), _ptr(x), _ptr(y), d.size), "reduce_to")
    if d is not dst:
        dst[...] = d


def _backup_for(backup: Any, name: str, dst: np.ndarray, dt: DType, *inputs: tuple[str, np.ndarray]) -> np.ndarray:
    """Check the ``backup`` array of a saving kernel: writable, ``name``'s dtype and size, and
    apart from every other array of the call."""
    backup = checked_array("backup", backup, writable=True)
    if _dtype("backup", backup) is not dt:
        raise argument_error(f"backup has dtype {backup.dtype} but {name} has {dst.dtype}; they must match")
    _same_size("backup", backup, name, dst)
    _no_overlap("backup", backup, name, dst)
    for other_name, other in inputs:
        _no_overlap("backup", backup, other_name, other)
    return backup


def reduce_into_saving(dst: np.ndarray, src: np.ndarray, backup: np.ndarray,
                       op: ReduceOp | int = ReduceOp.SUM) -> None:
    """``backup[:] = dst; dst op= src`` in one pass over memory.

    The in-place all-reduce's save-before-overwrite fused into its reduction: the result in
    ``dst`` is bit-identical to :func:`reduce_into` and ``backup`` receives dst's previous bytes
    exactly (NaN payloads included).  ``dst``, ``src`` and ``backup`` share one dtype (float32,
    float64 or an integer type; float16/bfloat16 accumulate in float32 and have no saving
    variant) and element count, and must not overlap.  Raises InvalidArgument.
    """
    op = _op(op)
    dst = checked_array("dst", dst, writable=True)
    src = checked_array("src", src)
    dt_dst = _dtype("dst", dst)
    dt_src = _dtype("src", src)
    if dt_src is not dt_dst:
        raise argument_error(f"dst has dtype {dst.dtype} but src has {src.dtype}; they must match")
    if dt_dst in _HALF:
        raise argument_error(f"reduce_into_saving works on float32/float64/integer arrays, not {dst.dtype}")
    _same_size("dst", dst, "src", src)
    _no_overlap("dst", dst, "src", src)
    backup = _backup_for(backup, "dst", dst, dt_dst, ("src", src))
    if dst.size == 0:
        return
    d, s, b = _aligned(dst), _aligned(src), _aligned(backup)
    _check(lib.pccl_reduce_save(op, dt_dst, _ptr(d), _ptr(s), _ptr(b), d.size), "reduce_into_saving")
    if d is not dst:
        dst[...] = d
    if b is not backup:
        backup[...] = b


def save_copy(backup: np.ndarray, src: np.ndarray) -> None:
    """``backup[:] = src`` (same dtype and size, no overlap) with streaming stores: for a copy that
    is written once and read back only on abort (the in-place all-reduce's backup), so it
    neither evicts useful cache lines nor reads the destination's lines first.  Any alignment
    (it copies bytes).  Raises InvalidArgument."""
    src = checked_array("src", src)
    dt = _dtype("src", src)
    backup = _backup_for(backup, "src", src, dt)
    if src.size == 0:
        return
    _check(lib.pccl_save_copy(_ptr(backup), _ptr(src), src.nbytes), "save_copy")


def avg_finalize(dst: np.ndarray, count: int) -> None:
    """``dst /= count`` in place: IEEE division for floats, FLOOR division for integers
    (numpy's ``//``: -7 // 2 == -4).  float16/bfloat16 results are finalised in their float32
    accumulator before :func:`narrow`.  ``count`` must be in [1, 2**63)."""
    dst = checked_array("dst", dst, writable=True)
    dt = _dtype("dst", dst)
    if dt in _HALF:
        raise argument_error(f"AVG of {dt.name.lower()} is finalised in the float32 accumulator")
    if not isinstance(count, (int, np.integer)) or isinstance(count, bool) or not 1 <= count < 2**63:
        raise argument_error(f"AVG count must be an integer in [1, 2**63), got {count!r}")
    if dst.size == 0:
        return
    d = _aligned(dst)
    _check(lib.pccl_avg_finalize(dt, _ptr(d), d.size, int(count)), "avg_finalize")
    if d is not dst:
        dst[...] = d


def widen(dst: np.ndarray, src: np.ndarray, *, src_dtype: DType | None = None) -> None:
    """``dst[:] = src`` converting float16/bfloat16 to float32 (exact)."""
    dst = checked_array("dst", dst, writable=True)
    src = checked_array("src", src)
    if _dtype("dst", dst) is not DType.FLOAT32:
        raise argument_error(f"widen writes float32, dst has dtype {dst.dtype}")
    dt_src = _dtype("src", src, src_dtype)
    if dt_src not in _HALF:
        raise argument_error(f"widen reads float16 or bfloat16, src has dtype {src.dtype}")
    _same_size("dst", dst, "src", src)
    _no_overlap("dst", dst, "src", src)
    if dst.size == 0:
        return
    d, s = _aligned(dst), _aligned(src)
    _check(lib.pccl_widen(dt_src, _ptr(d, _FLOAT_ARRAY), _ptr(s), d.size), "widen")
    if d is not dst:
        dst[...] = d


def narrow(dst: np.ndarray, src: np.ndarray, *, dst_dtype: DType | None = None) -> None:
    """``dst[:] = src`` rounding float32 to float16/bfloat16, round-to-nearest-even (overflow
    gives Inf, NaN stays NaN).  ``dst_dtype`` declares a raw uint16 destination."""
    dst = checked_array("dst", dst, writable=True)
    src = checked_array("src", src)
    dt_dst = _dtype("dst", dst, dst_dtype)
    if dt_dst not in _HALF:
        raise argument_error(f"narrow writes float16 or bfloat16, dst has dtype {dst.dtype}")
    if _dtype("src", src) is not DType.FLOAT32:
        raise argument_error(f"narrow reads float32, src has dtype {src.dtype}")
    _same_size("dst", dst, "src", src)
    _no_overlap("dst", dst, "src", src)
    if dst.size == 0:
        return
    d, s = _aligned(dst), _aligned(src)
    _check(lib.pccl_narrow(dt_dst, _ptr(d), _ptr(s, _FLOAT_ARRAY), d.size), "narrow")
    if d is not dst:
        dst[...] = d


def minmax(x: np.ndarray, *, dtype: DType | None = None) -> tuple[float, float]:
    """``(min(x), max(x))`` of a float16/bfloat16/float32/float64 array in one pass; a -0
    extreme is reported as +0; an empty array gives ``(0.0, 0.0)``.  Raises InvalidArgument
    if ``x`` contains NaN or Inf."""
    x = checked_array("x", x)
    dt = _dtype("x", x, dtype)
    if dt not in _QUANT_SOURCES:
        raise argument_error(f"minmax scans float arrays, x has dtype {x.dtype}")
    if x.size == 0:
        return 0.0, 0.0
    lo = ffi.new("double *")
    hi = ffi.new("double *")
    xa = _aligned(x)
    _check(lib.pccl_minmax(dt, _ptr(xa), xa.size, lo, hi), "minmax")
    return lo[0], hi[0]


def quantize(x: np.ndarray, q: np.ndarray, *, dtype: DType | None = None) -> QuantParams:
    """Min-max quantize ``x`` (float16/bfloat16/float32/float64) into ``q`` (uint8/uint16).

    Returns the :class:`QuantParams` that :func:`dequantize` needs.  Rounds to nearest (ties to
    even); a constant chunk gets scale 0 and dequantizes exactly.  Raises InvalidArgument on
    NaN/Inf in ``x`` or when max - min overflows the accumulator type; ``q`` is then unspecified.
    """
    x = checked_array("x", x)
    q = checked_array("q", q, writable=True)
    dt = _dtype("x", x, dtype)
    if dt not in _QUANT_SOURCES:
        raise argument_error(f"quantize reads float arrays, x has dtype {x.dtype}")
    qdt = _dtype("q", q)
    if qdt not in _QUANT_TARGETS:
        raise argument_error(f"quantize writes uint8 or uint16, q has dtype {q.dtype}")
    _same_size("x", x, "q", q)
    _no_overlap("x", x, "q", q)
    if x.size == 0:
        return QuantParams(0.0, 0.0)
    xa, qa = _aligned(x), _aligned(q)
    lo = ffi.new("double *")
    scale = ffi.new("double *")
    _check(lib.pccl_quantize(dt, _ptr(xa), xa.size, qdt, _ptr(qa), lo, scale), "quantize",
           accumulator_dtype(dt))
    if qa is not q:
        q[...] = qa
    return QuantParams(lo[0], scale[0])


def _quant_pair(q: np.ndarray, out_name: str, out: np.ndarray) -> tuple[DType, DType]:
    qdt = _dtype("q", q)
    if qdt not in _QUANT_TARGETS:
        raise argument_error(f"quantized input must be uint8 or uint16, q has dtype {q.dtype}")
    odt = _dtype(out_name, out)
    if odt not in _ACCUMULATORS:
        raise argument_error(f"{out_name} must be a float32 or float64 accumulator, not {out.dtype}")
    _same_size(out_name, out, "q", q)
    _no_overlap(out_name, out, "q", q)
    return qdt, odt


def dequantize(q: np.ndarray, params: QuantParams, out: np.ndarray) -> None:
    """``out[:] = lo + q * scale`` computed in out's type (float32 or float64)."""
    q = checked_array("q", q)
    out = checked_array("out", out, writable=True)
    qdt, odt = _quant_pair(q, "out", out)
    if out.size == 0:
        return
    qa, oa = _aligned(q), _aligned(out)
    _check(lib.pccl_dequantize(qdt, _ptr(qa), qa.size, odt, _ptr(oa), params.lo, params.scale),
           "dequantize")
    if oa is not out:
        out[...] = oa


def dequantize_reduce(acc: np.ndarray, q: np.ndarray, params: QuantParams,
                      op: ReduceOp | int = ReduceOp.SUM) -> None:
    """``acc op= (lo + q * scale)`` in one pass, bit-identical to :func:`dequantize` into a
    temporary followed by :func:`reduce_into`.  ``acc`` is float32 or float64."""
    op = _op(op)
    acc = checked_array("acc", acc, writable=True)
    q = checked_array("q", q)
    qdt, adt = _quant_pair(q, "acc", acc)
    if acc.size == 0:
        return
    aa, qa = _aligned(acc), _aligned(q)
    _check(lib.pccl_dequantize_reduce(op, qdt, _ptr(qa), qa.size, adt, _ptr(aa),
                                      params.lo, params.scale), "dequantize_reduce")
    if aa is not acc:
        acc[...] = aa


def dequantize_reduce_saving(acc: np.ndarray, q: np.ndarray, params: QuantParams, backup: np.ndarray,
                             op: ReduceOp | int = ReduceOp.SUM) -> None:
    """``backup[:] = acc; acc op= (lo + q * scale)`` in one pass: :func:`dequantize_reduce`
    (bit-identical result) that first saves acc's previous values into ``backup`` (acc's dtype
    and size, overlapping neither ``acc`` nor ``q``)."""
    op = _op(op)
    acc = checked_array("acc", acc, writable=True)
    q = checked_array("q", q)
    qdt, adt = _quant_pair(q, "acc", acc)
    backup = _backup_for(backup, "acc", acc, adt, ("q", q))
    if acc.size == 0:
        return
    aa, qa, ba = _aligned(acc), _aligned(q), _aligned(backup)
    _check(lib.pccl_dequantize_reduce_save(op, qdt, _ptr(qa), qa.size, adt, _ptr(aa), _ptr(ba),
                                           params.lo, params.scale), "dequantize_reduce_saving")
    if aa is not acc:
        acc[...] = aa
    if ba is not backup:
        backup[...] = ba


# --- numpy oracles (plain numpy, same definitions; used by the tests) ---------------------------


def _as_f32(x: np.ndarray, dt: DType) -> np.ndarray:
    """float16/bfloat16 (or their uint16 bit patterns) to float32, exactly."""
    bits = x.reshape(-1).view(np.uint16)
    if dt is DType.FLOAT16:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def widen_oracle(src: np.ndarray, src_dtype: DType | None = None) -> np.ndarray:
    dt = DType(src_dtype) if src_dtype is not None else dtype_of(src.dtype)
    return _as_f32(src, dt).reshape(src.shape)


def narrow_oracle(src: np.ndarray, dst_dtype: DType) -> np.ndarray:
    """float32 -> uint16 bit patterns of float16 (numpy's cast) or bfloat16 (ml_dtypes' cast)."""
    if DType(dst_dtype) is DType.FLOAT16:
        return src.astype(np.float16).view(np.uint16)
    return src.astype(DType.BFLOAT16.numpy_dtype()).view(np.uint16)


_NUMPY_OPS = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
              ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def reduce_oracle(dst: np.ndarray, src: np.ndarray, op: ReduceOp | int,
                  src_dtype: DType | None = None) -> np.ndarray:
    dt_src = DType(src_dtype) if src_dtype is not None else dtype_of(src.dtype)
    s = widen_oracle(src, dt_src) if dt_src in _HALF else src
    with np.errstate(all="ignore"):
        return _NUMPY_OPS[ReduceOp(op)](dst, s.reshape(dst.shape))


def avg_oracle(dst: np.ndarray, count: int) -> np.ndarray:
    if dst.dtype.kind == "f":
        return dst / dst.dtype.type(count)
    wide = np.int64 if dst.dtype.kind == "i" else np.uint64
    return np.floor_divide(dst.astype(wide), wide(count)).astype(dst.dtype)


def _float_view(x: np.ndarray, dt: DType) -> np.ndarray:
    return _as_f32(x, dt) if dt in _HALF else x.reshape(-1)


def minmax_oracle(x: np.ndarray, dtype: DType | None = None) -> tuple[float, float]:
    dt = DType(dtype) if dtype is not None else dtype_of(x.dtype)
    v = _float_view(x, dt)
    if v.size == 0:
        return 0.0, 0.0
    if not np.all(np.isfinite(v)):
        raise InvalidArgument("minmax: the input contains NaN or Inf")
    zero = v.dtype.type(0)
    return float(v.min() + zero), float(v.max() + zero)


def quantize_oracle(x: np.ndarray, qdtype: Any, dtype: DType | None = None) -> tuple[np.ndarray, QuantParams]:
    dt = DType(dtype) if dtype is not None else dtype_of(x.dtype)
    qnp = np.dtype(qdtype)
    qmax_i = _QUANT_TARGETS[dtype_of(qnp)]
    v = _float_view(x, dt)
    acc = np.float64 if dt is DType.FLOAT64 else np.float32
    lo_f, hi_f = minmax_oracle(x, dt)
    lo, hi, qmax = acc(lo_f), acc(hi_f), acc(qmax_i)
    with np.errstate(all="ignore"):
        rng = hi - lo
        if not np.isfinite(rng):
            raise InvalidArgument("quantize: max - min overflows the accumulator type")
        scale = rng / qmax
        inv = qmax / rng if rng > 0 else acc(0)
        if rng > 0 and np.isfinite(inv):
            val = (v - lo) * inv
        elif rng > 0 and scale > 0:
            val = (v - lo) / scale
        else:
            scale = acc(0)
            val = np.zeros_like(v)
    q = np.rint(np.clip(val, acc(0), qmax)).astype(qnp)
    return q.reshape(x.shape), QuantParams(float(lo), float(scale))


def dequantize_oracle(q: np.ndarray, params: QuantParams, acc_dtype: Any) -> np.ndarray:
    acc = np.dtype(acc_dtype).type
    return acc(params.lo) + q.astype(acc) * acc(params.scale)


def dequantize_reduce_oracle(acc: np.ndarray, q: np.ndarray, params: QuantParams,
                             op: ReduceOp | int) -> np.ndarray:
    return reduce_oracle(acc, dequantize_oracle(q, params, acc.dtype).reshape(acc.shape), op)
