"""Blockwise and 4-bit min-max quantization: typed wrappers over the C kernels, and numpy oracles.

The kernels (``native/quant.c``, "blockwise and 4-bit quantization") cut an array into blocks of
``block`` elements (the last one may be shorter) and quantize each exactly as
:func:`pccl.kernels.quantize` quantizes a whole chunk: ``lo`` its minimum, ``scale = (max - min) /
QMAX`` (QMAX = 15, 255 or 65535 for 4, 8 or 16 bits), codes ``rint((x - lo) * (QMAX / range))``
in the accumulator type (float32 for float16/bfloat16/float32 sources, float64 for float64),
constant blocks exact (scale 0).  Each block's ``lo`` and ``scale`` are written to arrays of the
accumulator type, one element per block.  4-bit codes are packed two per byte: element ``2j`` in
the low nibble of byte ``j``, element ``2j + 1`` in the high nibble; an odd count leaves the last
high nibble 0.  Dequantization of element ``i`` of block ``b`` is ``lo[b] + q_i * scale[b]``
(two roundings, no fused multiply-add), so every peer decodes the same bytes to the same bits.

Wrappers check their arguments like :mod:`pccl.kernels` (``InvalidArgument`` naming the
argument; NaN/Inf in a quantized input or a range that overflows the accumulator type is
``InvalidArgument`` too), release the GIL (cffi) and never await.  The ``*_oracle`` functions
implement the same definitions in plain numpy; the property tests check the kernels against them
bit for bit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernels import ffi, lib
from .errors import InvalidArgument
from .kernels import accumulator_dtype, argument_error, checked_array, minmax_oracle
from .types import DType, ReduceOp, dtype_of

__all__ = [
    "QMAX",
    "code_nbytes",
    "num_blocks",
    "quantize_blocks",
    "dequantize_blocks",
    "dequantize_reduce_blocks",
    "dequantize_reduce_blocks_saving",
    "minmax_blocks",
    "quantize_blocks_oracle",
    "dequantize_blocks_oracle",
    "minmax_blocks_oracle",
    "pack4",
    "unpack4",
]


#: The largest code of each width.
QMAX = {4: 15, 8: 255, 16: 65535}
_SOURCES = (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
_HALF = (DType.FLOAT16, DType.BFLOAT16)
_CODE_DTYPE: dict[int, np.dtype[Any]] = {4: np.dtype(np.uint8), 8: np.dtype(np.uint8), 16: np.dtype(np.uint16)}
_CHAR_ARRAY = ffi.typeof("char[]")


def code_nbytes(count: int, bits: int) -> int:
    """Bytes the codes of ``count`` elements take at ``bits`` per element."""
    return (count + 1) // 2 if bits == 4 else count * bits // 8


def num_blocks(count: int, block: int) -> int:
    """How many blocks ``count`` elements make (the last may be shorter); 0 for no elements."""
    return -(-count // block)


def _source_dtype(x: np.ndarray, declared: DType | None) -> DType:
    if declared is not None:
        declared = DType(declared)
        if declared in _HALF and x.dtype == np.uint16:
            return declared
    try:
        dt = dtype_of(x.dtype)
    except InvalidArgument:
        dt = None
    if dt not in _SOURCES or (declared is not None and dt is not declared):
        raise argument_error(f"x must be a float16/bfloat16/float32/float64 array, got dtype {x.dtype}")
    assert dt is not None
    return dt


def _check_bits(bits: int) -> None:
    if bits not in QMAX:
        raise argument_error(f"bits must be 4, 8 or 16, got {bits!r}")


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise argument_error(f"block must be a positive integer, got {block!r}")


def _codes(name: str, q: np.ndarray, count: int, bits: int, *, writable: bool) -> np.ndarray:
    q = checked_array(name, q, writable=writable)
    if q.dtype != _CODE_DTYPE[bits]:
        raise argument_error(f"{bits}-bit codes are stored as {_CODE_DTYPE[bits]}, {name} has dtype {q.dtype}")
    want = code_nbytes(count, bits) // q.itemsize
    if q.size != want:
        raise argument_error(f"{name} must hold {want} {q.dtype} for {count} elements at {bits} bits, got {q.size}")
    return q


def _params(name: str, a: np.ndarray, acc: DType, nb: int, *, writable: bool) -> np.ndarray:
    a = checked_array(name, a, writable=writable)
    if a.dtype != acc.numpy_dtype():
        raise argument_error(f"{name} must be a {acc.name.lower()} array (the accumulator type), got dtype {a.dtype}")
    if a.size != nb:
        raise argument_error(f"{name} must hold one value per block ({nb}), got {a.size}")
    return a


def _apart(*named: tuple[str, np.ndarray]) -> None:
    for i, (na, a) in enumerate(named):
        for nb_, b in named[i + 1 :]:
            if np.shares_memory(a, b):
                raise argument_error(f"{na} and {nb_} overlap in memory; the kernel needs separate buffers")


def _aligned(a: np.ndarray) -> np.ndarray:
    return a if a.flags.aligned else a.copy()


def _ptr(a: np.ndarray) -> Any:
    return ffi.from_buffer(_CHAR_ARRAY, a, require_writable=a.flags.writeable)


def _check(rc: int, what: str, acc: DType) -> None:
    if rc == lib.PCCL_OK:
        return
    if rc == lib.PCCL_ENONFINITE:
        raise argument_error(f"{what}: the input contains NaN or Inf; min-max quantization needs finite values")
    if rc == lib.PCCL_ERANGE:
        raise argument_error(f"{what}: max - min of a block overflows {acc.name.lower()}")
    raise argument_error(f"{what}: the native kernel rejected its arguments (status {rc})")


def _write_back(outputs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for original, used in outputs:
        if used is not original:
            original[...] = used


def quantize_blocks(x: np.ndarray, q: np.ndarray, lo: np.ndarray, scale: np.ndarray, *, bits: int,
                    block: int, dtype: DType | None = None) -> None:
    """Quantize ``x`` (float16/bfloat16/float32/float64; ``dtype`` declares raw uint16 bits of a
    16-bit float) block by block into ``q`` (:func:`code_nbytes` bytes of uint8 codes for 4 and
    8 bits, uint16 for 16), writing each block's ``lo`` and ``scale`` (accumulator-type arrays
    of :func:`num_blocks` elements).  Raises InvalidArgument (NaN/Inf in ``x``, a range that
    overflows the accumulator; the outputs are then unspecified)."""
    _check_bits(bits)
    _check_block(block)
    x = checked_array("x", x)
    dt = _source_dtype(x, dtype)
    acc = accumulator_dtype(dt)
    n = x.size
    nb = num_blocks(n, block)
    q = _codes("q", q, n, bits, writable=True)
    lo = _params("lo", lo, acc, nb, writable=True)
    scale = _params("scale", scale, acc, nb, writable=True)
    _apart(("x", x), ("q", q), ("lo", lo), ("scale", scale))
    if n == 0:
        return
    xa, qa, la, sa = _aligned(x), _aligned(q), _aligned(lo), _aligned(scale)
    _check(lib.pccl_quantize_blocks(dt, _ptr(xa), n, bits, _ptr(qa), block, _ptr(la), _ptr(sa)),
           "quantize_blocks", acc)
    _write_back([(q, qa), (lo, la), (scale, sa)])


def _dequant_args(q: np.ndarray, lo: np.ndarray, scale: np.ndarray, out_name: str, out: np.ndarray, bits: int,
                  block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, DType]:
    _check_bits(bits)
    _check_block(block)
    out = checked_array(out_name, out, writable=True)
    if out.dtype not in (np.float32, np.float64):
        raise argument_error(f"{out_name} must be a float32 or float64 accumulator, not {out.dtype}")
    acc = dtype_of(out.dtype)
    nb = num_blocks(out.size, block)
    q = _codes("q", q, out.size, bits, writable=False)
    lo = _params("lo", lo, acc, nb, writable=False)
    scale = _params("scale", scale, acc, nb, writable=False)
    _apart((out_name, out), ("q", q))
    _apart((out_name, out), ("lo", lo))
    _apart((out_name, out), ("scale", scale))
    return q, lo, scale, out, acc


def dequantize_blocks(q: np.ndarray, lo: np.ndarray, scale: np.ndarray, out: np.ndarray, *, bits: int,
                      block: int) -> None:
    """``out[i] = lo[b] + q_i * scale[b]`` (``b = i // block``) in out's type (float32 or
    float64, the accumulator type ``lo`` and ``scale`` are in)."""
    q, lo, scale, out, acc = _dequant_args(q, lo, scale, "out", out, bits, block)
    if out.size == 0:
        return
    oa, qa, la, sa = _aligned(out), _aligned(q), _aligned(lo), _aligned(scale)
    _check(lib.pccl_dequantize_blocks(bits, _ptr(qa), out.size, acc, _ptr(oa), block, _ptr(la), _ptr(sa)),
           "dequantize_blocks", acc)
    _write_back([(out, oa)])


def dequantize_reduce_blocks(acc: np.ndarray, q: np.ndarray, lo: np.ndarray, scale: np.ndarray,
                             op: ReduceOp | int = ReduceOp.SUM, *, bits: int, block: int) -> None:
    """``acc op= dequantize_blocks(q, lo, scale)`` in one pass (bit for bit the same as the two
    steps); ``acc`` is float32 or float64."""
    op = ReduceOp(op)
    q, lo, scale, acc, adt = _dequant_args(q, lo, scale, "acc", acc, bits, block)
    if acc.size == 0:
        return
    aa, qa, la, sa = _aligned(acc), _aligned(q), _aligned(lo), _aligned(scale)
    _check(lib.pccl_dequantize_reduce_blocks(op, bits, _ptr(qa), acc.size, adt, _ptr(aa), block, _ptr(la),
                                             _ptr(sa)), "dequantize_reduce_blocks", adt)
    _write_back([(acc, aa)])


def dequantize_reduce_blocks_saving(acc: np.ndarray, q: np.ndarray, lo: np.ndarray, scale: np.ndarray,
                                    backup: np.ndarray, op: ReduceOp | int = ReduceOp.SUM, *, bits: int,
                                    block: int) -> None:
    """:func:`dequantize_reduce_blocks` that first saves acc's previous values into ``backup``
    (acc's dtype and size, overlapping none of the other arrays), in one pass."""
    op = ReduceOp(op)
    q, lo, scale, acc, adt = _dequant_args(q, lo, scale, "acc", acc, bits, block)
    backup = checked_array("backup", backup, writable=True)
    if backup.dtype != acc.dtype or backup.size != acc.size:
        raise argument_error(f"backup ({backup.dtype}, {backup.size}) must match acc ({acc.dtype}, {acc.size})")
    _apart(("backup", backup), ("acc", acc), ("q", q), ("lo", lo), ("scale", scale))
    if acc.size == 0:
        return
    aa, ba, qa, la, sa = _aligned(acc), _aligned(backup), _aligned(q), _aligned(lo), _aligned(scale)
    _check(lib.pccl_dequantize_reduce_blocks_save(op, bits, _ptr(qa), acc.size, adt, _ptr(aa), _ptr(ba), block,
                                                  _ptr(la), _ptr(sa)), "dequantize_reduce_blocks_saving", adt)
    _write_back([(acc, aa), (backup, ba)])


def minmax_blocks(x: np.ndarray, lo: np.ndarray, hi: np.ndarray, *, block: int, dtype: DType | None = None) -> None:
    """Each block's minimum and maximum (accumulator-type arrays, -0 reported as +0), in one
    pass.  Raises InvalidArgument on NaN/Inf in ``x``."""
    _check_block(block)
    x = checked_array("x", x)
    dt = _source_dtype(x, dtype)
    acc = accumulator_dtype(dt)
    nb = num_blocks(x.size, block)
    lo = _params("lo", lo, acc, nb, writable=True)
    hi = _params("hi", hi, acc, nb, writable=True)
    _apart(("x", x), ("lo", lo), ("hi", hi))
    if x.size == 0:
        return
    xa, la, ha = _aligned(x), _aligned(lo), _aligned(hi)
    _check(lib.pccl_minmax_blocks(dt, _ptr(xa), x.size, block, _ptr(la), _ptr(ha)), "minmax_blocks", acc)
    _write_back([(lo, la), (hi, ha)])


# --- numpy oracles (the same definitions in plain numpy; used by the tests) ----------------------


def pack4(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (uint8 values 0..15), two per byte, the even element in the low nibble."""
    c = codes.astype(np.uint8).reshape(-1)
    if c.size % 2:
        c = np.concatenate([c, np.zeros(1, np.uint8)])
    return (c[0::2] | (c[1::2] << np.uint8(4))).astype(np.uint8)


def unpack4(q: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` 4-bit codes packed in ``q``."""
    out = np.empty(q.size * 2, np.uint8)
    out[0::2] = q & np.uint8(15)
    out[1::2] = q >> np.uint8(4)
    return out[:count]


def _values(x: np.ndarray, dt: DType) -> np.ndarray:
    flat = x.reshape(-1)
    if dt in _HALF:
        bits = flat.view(np.uint16)
        if dt is DType.FLOAT16:
            return bits.view(np.float16).astype(np.float32)
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return flat


def minmax_blocks_oracle(x: np.ndarray, block: int, dtype: DType | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each block's (min, max) in the accumulator type."""
    dt = DType(dtype) if dtype is not None else dtype_of(x.dtype)
    v = _values(x, dt)
    acc = accumulator_dtype(dt).numpy_dtype()
    nb = num_blocks(v.size, block)
    lo, hi = np.empty(nb, acc), np.empty(nb, acc)
    for b in range(nb):
        lo[b], hi[b] = minmax_oracle(v[b * block : (b + 1) * block])
    return lo, hi


def quantize_blocks_oracle(x: np.ndarray, bits: int, block: int,
                           dtype: DType | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(q, lo, scale)`` as :func:`quantize_blocks` writes them."""
    dt = DType(dtype) if dtype is not None else dtype_of(x.dtype)
    v = _values(x, dt)
    acc = accumulator_dtype(dt).numpy_dtype().type
    qmax = acc(QMAX[bits])
    lo, hi = minmax_blocks_oracle(x, block, dt)
    codes = np.empty(v.size, _CODE_DTYPE[bits])
    scale = np.empty_like(lo)
    with np.errstate(all="ignore"):
        for b in range(lo.size):
            vb = v[b * block : (b + 1) * block]
            rng = hi[b] - lo[b]
            if not np.isfinite(rng):
                raise InvalidArgument("quantize_blocks: max - min of a block overflows the accumulator type")
            s = rng / qmax
            inv = qmax / rng if rng > 0 else acc(0)
            if rng > 0 and np.isfinite(inv):
                val = (vb - lo[b]) * inv
            elif rng > 0 and s > 0:
                val = (vb - lo[b]) / s
            else:
                s = acc(0)
                val = np.zeros_like(vb)
            scale[b] = s
            codes[b * block : (b + 1) * block] = np.rint(np.clip(val, acc(0), qmax))
    q = pack4(codes) if bits == 4 else codes
    return q, lo, scale


def dequantize_blocks_oracle(q: np.ndarray, lo: np.ndarray, scale: np.ndarray, count: int, bits: int,
                             block: int) -> np.ndarray:
    """``lo[b] + q_i * scale[b]`` in the accumulator type of ``lo``."""
    codes = unpack4(q, count) if bits == 4 else q.reshape(-1)[:count]
    idx = np.arange(count) // block
    acc = lo.dtype.type
    return lo[idx] + codes.astype(acc) * scale[idx]
