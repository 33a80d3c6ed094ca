"""Property tests of the native kernels against plain numpy.

Bit-exact wherever the operation is exact (all integer ops, MIN/MAX, one IEEE op per element,
the f16 conversions, the quantization formulas of native/quant.c).  NaN results are compared
as a class (a NaN where numpy has a NaN), since NaN payloads are not part of the contract.
float16 narrowing is checked against numpy's own astype; bfloat16 against an independent
integer implementation of round-to-nearest-even written here, and against ml_dtypes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pccl
from pccl import kernels as K
from pccl.types import DType, ReduceOp

FAST = settings(max_examples=40, deadline=None)

INT_TYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
SAME_TYPE = INT_TYPES + [np.float32, np.float64]
OPS = list(ReduceOp)
SIZES = st.integers(min_value=0, max_value=70)

# (sign+exponent+mantissa mask, exponent mask) per storage type, to find NaNs from bits alone
_NAN_MASKS = {DType.FLOAT16: (0x7FFF, 0x7C00), DType.BFLOAT16: (0x7FFF, 0x7F80),
              DType.FLOAT32: (0x7FFFFFFF, 0x7F800000), DType.FLOAT64: (0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(_UINT_OF_SIZE[a.dtype.itemsize])


def assert_same(actual: np.ndarray, expected: np.ndarray, dtype: DType | None = None) -> None:
    """Bit-identical, except that any NaN matches any NaN (payloads are not specified)."""
    assert actual.shape == expected.shape
    assert actual.dtype.itemsize == expected.dtype.itemsize
    a, e = bits(actual), bits(expected)
    dt = dtype if dtype is not None else pccl.types.dtype_of(actual.dtype)
    if dt in _NAN_MASKS:
        mag, exp = (a.dtype.type(m) for m in _NAN_MASKS[dt])
        nan_a, nan_e = (a & mag) > exp, (e & mag) > exp
        np.testing.assert_array_equal(nan_a, nan_e)
        a, e = a[~nan_a], e[~nan_e]
    np.testing.assert_array_equal(a, e)


def unaligned_copy(a: np.ndarray) -> np.ndarray:
    """A writable copy of ``a`` at an odd address (misaligned for every itemsize > 1)."""
    view = np.frombuffer(bytearray(a.nbytes + 1), dtype=a.dtype, count=a.size, offset=1)
    view[...] = a.reshape(-1)
    return view.reshape(a.shape)


def place(a: np.ndarray, unaligned: bool) -> np.ndarray:
    return unaligned_copy(a) if unaligned else a.copy()


def arrays(dtype: type, n: int, **kw: object) -> st.SearchStrategy[np.ndarray]:
    return hnp.arrays(np.dtype(dtype), n, elements=hnp.from_dtype(np.dtype(dtype), **kw))


@st.composite
def pair(draw: st.DrawFn, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """Two arrays of one length: either anything the dtype holds, or values from a tiny pool
    so that ties (+0 against -0), NaN against NaN and extremes meet element by element."""
    n = draw(SIZES)
    npd = np.dtype(dtype)
    if draw(st.booleans()):
        return draw(arrays(dtype, n)), draw(arrays(dtype, n))
    if npd.kind == "f":
        pool = [0.0, -0.0, np.nan, np.inf, -np.inf, 1.0, -1.0, float(np.finfo(npd).max)]
    else:
        info = np.iinfo(npd)
        pool = [0, 1, info.max, info.min, info.max // 2 + 1, max(info.min, -1)]
    elements = st.sampled_from([npd.type(v) for v in pool])
    return (draw(hnp.arrays(npd, n, elements=elements)), draw(hnp.arrays(npd, n, elements=elements)))


# f32 bit patterns with round-to-nearest ties for f16 (13 dropped bits) and bf16 (16 dropped
# bits) over-represented, plus every exponent (subnormals, overflow, Inf, NaN) from raw bits.
F32_BITS = st.one_of(
    st.integers(0, 2**32 - 1),
    st.builds(lambda hi, lo: (hi << 13) | lo, st.integers(0, 2**19 - 1), st.sampled_from([0x1000, 0xFFF, 0x1001, 0])),
    st.builds(lambda hi, lo: (hi << 16) | lo, st.integers(0, 2**16 - 1), st.sampled_from([0x8000, 0x7FFF, 0x8001, 0])),
    # NaNs whose payload lies only in the bits a narrowing drops, Inf, extremes, ties at the top
    st.sampled_from([0x7F800001, 0xFF800001, 0x7F801000, 0x7FC00000, 0x7F800000, 0xFF800000,
                     0x7F7FFFFF, 0x477FF000, 0x477FEFFF, 0x7F7F8000, 0x33000000, 0x80000000]),
    st.builds(lambda f: int(np.float32(f).view(np.uint32)),
              st.floats(-70000, 70000, width=32) | st.floats(-(2.0**-13), 2.0**-13, width=32)),
)


@st.composite
def f32_from_bits(draw: st.DrawFn) -> np.ndarray:
    n = draw(SIZES)
    return draw(hnp.arrays(np.uint32, n, elements=F32_BITS)).view(np.float32)


HALF_BITS = hnp.arrays(np.uint16, SIZES, elements=st.integers(0, 2**16 - 1))


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even, by integer arithmetic on the bits."""
    u = x.view(np.uint32).astype(np.uint64)
    lsb = (u >> np.uint64(16)) & np.uint64(1)
    rounded = ((u + np.uint64(0x7FFF) + lsb) >> np.uint64(16)).astype(np.uint16)
    is_nan = (u & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000)
    quiet = ((u >> np.uint64(16)) | np.uint64(0x40)).astype(np.uint16)
    return np.where(is_nan, quiet, rounded)


# --- reductions -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", SAME_TYPE, ids=lambda d: np.dtype(d).name)
@FAST
@given(data=st.data(), op=st.sampled_from(OPS), unaligned=st.tuples(st.booleans(), st.booleans()))
def test_reduce_matches_numpy_bit_for_bit(dtype: type, data: st.DataObject, op: ReduceOp,
                                          unaligned: tuple[bool, bool]) -> None:
    # float32 SUM is numpy's float32 add, integers wrap like numpy, MIN/MAX propagate NaN and
    # pick numpy's operand on ties (+0 vs -0).
    a, b = data.draw(pair(dtype))
    dst, src = place(a, unaligned[0]), place(b, unaligned[1])
    K.reduce_into(dst, src, op)
    assert_same(dst, K.reduce_oracle(a, b, op))
    np.testing.assert_array_equal(src, b)  # src untouched


@pytest.mark.parametrize("dtype", SAME_TYPE, ids=lambda d: np.dtype(d).name)
@FAST
@given(data=st.data(), op=st.sampled_from(OPS),
       unaligned=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_reduce_to_equals_copy_then_reduce(dtype: type, data: st.DataObject, op: ReduceOp,
                                           unaligned: tuple[bool, bool, bool]) -> None:
    # The out-of-place all-reduce's first reduction of a slice: dst = a op b in one pass, the
    # result of dst[:] = a; reduce_into(dst, b) (the operand order decides MIN/MAX ties; which
    # payload a SUM/PROD of two NaNs keeps is not specified).
    a, b = data.draw(pair(dtype))
    x, y = place(a, unaligned[0]), place(b, unaligned[1])
    dst = place(np.full_like(a, 7), unaligned[2])
    K.reduce_to(dst, x, y, op)
    assert_same(dst, K.reduce_oracle(a, b, op))
    two_pass = a.copy()
    K.reduce_into(two_pass, b.copy(), op)
    assert_same(dst, two_pass)
    np.testing.assert_array_equal(bits(x), bits(a))  # inputs untouched
    np.testing.assert_array_equal(bits(y), bits(b))


@pytest.mark.parametrize("dtype", SAME_TYPE, ids=lambda d: np.dtype(d).name)
@FAST
@given(data=st.data(), op=st.sampled_from(OPS),
       unaligned=st.tuples(st.booleans(), st.booleans(), st.booleans()))
def test_reduce_saving_matches_numpy_and_keeps_the_old_bits(dtype: type, data: st.DataObject, op: ReduceOp,
                                                           unaligned: tuple[bool, bool, bool]) -> None:
    # The in-place all-reduce's fused save + reduce: dst gets exactly reduce_into's result and
    # backup exactly dst's previous bytes (NaN payloads included: restore must be lossless).
    a, b = data.draw(pair(dtype))
    dst, src = place(a, unaligned[0]), place(b, unaligned[1])
    backup = place(np.full_like(a, 7), unaligned[2])
    K.reduce_into_saving(dst, src, backup, op)
    assert_same(dst, K.reduce_oracle(a, b, op))
    plain = a.copy()
    K.reduce_into(plain, b.copy(), op)
    np.testing.assert_array_equal(bits(dst), bits(plain))
    np.testing.assert_array_equal(bits(backup), bits(a))
    np.testing.assert_array_equal(bits(src), bits(b))  # src untouched


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int64, np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("n", [8191, 8192, 8193, 20011])
def test_saving_kernels_across_block_boundaries(dtype: type, n: int) -> None:
    # The saving kernels work in 8 KiB blocks with streaming stores after a scalar head that
    # aligns the backup: long arrays, at odd backup offsets, cross every one of those seams.
    rng = np.random.default_rng(n)
    npd = np.dtype(dtype)
    if npd.kind == "f":
        a, b = rng.standard_normal(n).astype(npd), rng.standard_normal(n).astype(npd)
    else:
        a, b = (rng.integers(np.iinfo(npd).min, np.iinfo(npd).max, n, dtype=npd, endpoint=True) for _ in range(2))
    for offset in (0, npd.itemsize, 3 * npd.itemsize):
        raw = np.zeros(n * npd.itemsize + offset, np.uint8)
        backup = raw[offset:].view(npd)
        dst = a.copy()
        K.reduce_into_saving(dst, b, backup, ReduceOp.SUM)
        assert_same(dst, K.reduce_oracle(a, b, ReduceOp.SUM))
        np.testing.assert_array_equal(bits(backup), bits(a))
    if npd.kind == "f":
        q = rng.integers(0, 65535, n, dtype=np.uint16, endpoint=True)
        params = K.QuantParams(-1.5, 0.001)
        acc, backup = a.copy(), np.empty_like(a)
        K.dequantize_reduce_saving(acc, q, params, backup, ReduceOp.MAX)
        assert_same(acc, K.dequantize_reduce_oracle(a, q, params, ReduceOp.MAX))
        np.testing.assert_array_equal(bits(backup), bits(a))


@FAST
@given(payload=st.binary(max_size=300), src_offset=st.integers(0, 17), dst_offset=st.integers(0, 17))
def test_save_copy_is_a_byte_exact_copy_at_any_alignment(payload: bytes, src_offset: int, dst_offset: int) -> None:
    # Streaming stores need 16-byte aligned destinations: a scalar head and tail cover the rest.
    src = np.frombuffer(bytes(src_offset) + payload, np.uint8, offset=src_offset)
    raw = np.full(len(payload) + dst_offset + 16, 0xAB, np.uint8)
    K.save_copy(raw[dst_offset : dst_offset + len(payload)], src)
    assert raw[dst_offset : dst_offset + len(payload)].tobytes() == payload
    assert (raw[:dst_offset] == 0xAB).all() and (raw[dst_offset + len(payload) :] == 0xAB).all()


def test_save_copy_of_large_float_arrays_keeps_every_bit() -> None:
    x = np.random.default_rng(1).integers(0, 2**32, 100_003, dtype=np.uint32).view(np.float32)  # NaNs too
    backup = np.empty_like(x)
    K.save_copy(backup, x)
    np.testing.assert_array_equal(bits(backup), bits(x))


@pytest.mark.parametrize("half", [DType.FLOAT16, DType.BFLOAT16], ids=lambda d: d.name.lower())
@FAST
@given(data=st.data(), op=st.sampled_from(OPS), raw=st.booleans(), unaligned=st.booleans())
def test_reduce_widen_half_into_f32(half: DType, data: st.DataObject, op: ReduceOp, raw: bool,
                                    unaligned: bool) -> None:
    src_bits = data.draw(HALF_BITS)
    dst0 = data.draw(arrays(np.float32, src_bits.size))
    src = src_bits if raw else src_bits.view(half.numpy_dtype())
    dst = place(dst0, unaligned)
    K.reduce_into(dst, place(src, unaligned), op, src_dtype=half if raw else None)
    # independent widening: f16 by numpy's cast, bf16 by shifting the bits
    wide = (src_bits.view(np.float16).astype(np.float32) if half is DType.FLOAT16
            else (src_bits.astype(np.uint32) << np.uint32(16)).view(np.float32))
    with np.errstate(all="ignore"):
        expected = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
                    ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op](dst0, wide)
    assert_same(dst, expected)


@pytest.mark.parametrize("dtype", SAME_TYPE, ids=lambda d: np.dtype(d).name)
@FAST
@given(data=st.data(), count=st.integers(1, 1000), unaligned=st.booleans())
def test_avg_finalize(dtype: type, data: st.DataObject, count: int, unaligned: bool) -> None:
    a = data.draw(arrays(dtype, data.draw(SIZES)))
    dst = place(a, unaligned)
    K.avg_finalize(dst, count)
    assert_same(dst, K.avg_oracle(a, count))
    if np.dtype(dtype).kind in "iu":  # floor division, checked without the oracle too
        expected = [int(v) // count for v in a.tolist()]
        assert dst.tolist() == expected


def test_integer_avg_rounds_toward_minus_infinity() -> None:
    x = np.array([-7, 7, -8, -1, 0], dtype=np.int32)
    K.avg_finalize(x, 2)
    assert x.tolist() == [-4, 3, -4, -1, 0]


# --- float16 / bfloat16 conversions -----------------------------------------------------------


@FAST
@given(x=f32_from_bits(), unaligned=st.booleans())
def test_narrow_f16_equals_numpy_cast(x: np.ndarray, unaligned: bool) -> None:
    out = place(np.zeros(x.size, np.float16), unaligned)
    K.narrow(out, place(x, unaligned))
    with np.errstate(all="ignore"):
        assert_same(out, x.astype(np.float16))


@FAST
@given(x=f32_from_bits(), raw=st.booleans(), unaligned=st.booleans())
def test_narrow_bf16_round_to_nearest_even(x: np.ndarray, raw: bool, unaligned: bool) -> None:
    out = place(np.zeros(x.size, np.uint16 if raw else ml_dtypes.bfloat16), unaligned)
    K.narrow(out, place(x, unaligned), dst_dtype=DType.BFLOAT16 if raw else None)
    got = out.view(np.uint16)
    assert_same(got, bf16_reference(x), DType.BFLOAT16)
    with np.errstate(invalid="ignore"):
        by_ml_dtypes = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert_same(got, by_ml_dtypes, DType.BFLOAT16)


def test_narrow_edge_cases() -> None:
    x = np.array([65504, 65519.996, 65520, 1e9, -1e9, np.inf, -np.inf, np.nan, -np.nan,
                  2.0**-24, 2.0**-25, 3 * 2.0**-26, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -0.0],
                 dtype=np.float32)
    f16 = np.empty(x.size, np.float16)
    K.narrow(f16, x)
    assert f16[:3].tolist() == [65504, 65504, np.inf]          # 65520 is a tie, rounds to even (Inf)
    assert f16[3:7].tolist() == [np.inf, -np.inf, np.inf, -np.inf]
    assert np.isnan(f16[7]) and np.isnan(f16[8]) and np.signbit(f16[8])
    assert f16[9:12].tolist() == [2.0**-24, 0.0, 2.0**-24]     # subnormal ties to even
    assert f16[12:14].tolist() == [1.0, 1 + 4 * 2.0**-11]      # ties to even in the normal range
    assert np.signbit(f16[14])
    big = np.array([3.4e38, np.float32(np.finfo(np.float32).max)], dtype=np.float32)
    bf = np.empty(2, ml_dtypes.bfloat16)
    K.narrow(bf, big)
    assert np.isinf(bf.astype(np.float32)[1])                   # overflow rounds to Inf


@pytest.mark.parametrize("half", [DType.FLOAT16, DType.BFLOAT16], ids=lambda d: d.name.lower())
@FAST
@given(src_bits=HALF_BITS, unaligned=st.booleans())
def test_widen_is_exact(half: DType, src_bits: np.ndarray, unaligned: bool) -> None:
    out = place(np.zeros(src_bits.size, np.float32), unaligned)
    K.widen(out, place(src_bits.view(half.numpy_dtype()), unaligned))
    expected = (src_bits.view(np.float16).astype(np.float32) if half is DType.FLOAT16
                else (src_bits.astype(np.uint32) << np.uint32(16)).view(np.float32))
    assert_same(out, expected)
    assert_same(out, K.widen_oracle(src_bits, half))


# --- min/max scan -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@FAST
@given(data=st.data(), unaligned=st.booleans())
def test_minmax_matches_numpy(dtype: type, data: st.DataObject, unaligned: bool) -> None:
    x = data.draw(arrays(dtype, data.draw(st.integers(1, 70)), allow_nan=False, allow_infinity=False))
    lo, hi = K.minmax(place(x, unaligned))
    assert (lo, hi) == (float(x.min()), float(x.max()))
    assert not np.signbit(lo) or lo < 0  # -0 is reported as +0


@FAST
@given(src_bits=hnp.arrays(np.uint16, st.integers(1, 70), elements=st.integers(0, 2**16 - 1)))
def test_minmax_bf16(src_bits: np.ndarray) -> None:
    x = src_bits.view(ml_dtypes.bfloat16)
    wide = (src_bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    if np.all(np.isfinite(wide)):
        assert K.minmax(x) == (float(wide.min()), float(wide.max()))
    else:
        with pytest.raises(pccl.InvalidArgument, match="NaN or Inf"):
            K.minmax(x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@FAST
@given(data=st.data())
def test_nonfinite_is_an_error(dtype: type, bad: float, data: st.DataObject) -> None:
    x = data.draw(arrays(dtype, data.draw(st.integers(1, 70)), allow_nan=False, allow_infinity=False))
    x[data.draw(st.integers(0, x.size - 1))] = bad
    with pytest.raises(pccl.InvalidArgument, match="NaN or Inf"):
        K.minmax(x)
    with pytest.raises(pccl.InvalidArgument, match="NaN or Inf"):
        K.quantize(x, np.empty(x.size, np.uint8))


def test_minmax_empty() -> None:
    assert K.minmax(np.empty(0, np.float32)) == (0.0, 0.0)


# --- quantization -----------------------------------------------------------------------------

QUANT_SOURCES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]


@st.composite
def quant_input(draw: st.DrawFn, dtype: type) -> np.ndarray:
    """Finite chunks of every scale: tiny (subnormal ranges), ordinary, huge (overflowing
    max - min), constant, and near-constant."""
    n = draw(SIZES)
    wide = np.float64 if dtype is np.float64 else np.float32
    bound = float(wide(draw(st.sampled_from([1e-42, 1e-38, 1e-6, 1.0, 1e4, 1e30, 3.4e38]))))
    base = draw(st.floats(-bound, bound, width=64 if dtype is np.float64 else 32))
    kind = draw(st.sampled_from(["free", "constant", "near"]))
    if kind == "constant":
        x = np.full(n, base, dtype=wide)
    else:
        elems = st.floats(-bound, bound, width=64 if dtype is np.float64 else 32)
        x = draw(hnp.arrays(wide, n, elements=elems))
        if kind == "near":
            x = np.nextafter(np.full(n, base, dtype=wide), x)
    with np.errstate(all="ignore"):
        x = x.astype(dtype)
    return x[np.isfinite(x.astype(np.float64))] if x.size else x


@pytest.mark.parametrize("dtype", QUANT_SOURCES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("qdtype", [np.uint8, np.uint16])
@FAST
@given(data=st.data(), unaligned=st.booleans())
def test_quantize_matches_oracle(dtype: type, qdtype: type, data: st.DataObject, unaligned: bool) -> None:
    x = data.draw(quant_input(dtype))
    q = place(np.full(x.size, 7, qdtype), unaligned)
    try:
        expected_q, expected_p = K.quantize_oracle(x, qdtype)
    except pccl.InvalidArgument:
        with pytest.raises(pccl.InvalidArgument, match="overflows"):
            K.quantize(place(x, unaligned), q)
        return
    params = K.quantize(place(x, unaligned), q)
    assert params == expected_p
    np.testing.assert_array_equal(q, expected_q)
    # accuracy: every value comes back within half a step (plus the rounding of lo + q*scale)
    acc = np.float64 if dtype is np.float64 else np.float32
    back = np.empty(x.size, acc)
    K.dequantize(q, params, back)
    assert_same(back, K.dequantize_oracle(q, params, acc))
    xs = x.astype(np.float64)
    if x.size:
        ulp = float(np.spacing(acc(max(abs(xs.min()), abs(xs.max())))))
        tol = 0.5 * params.scale * (1 + 1e-3) + 4 * ulp
        if params.scale < np.finfo(acc).tiny:
            # constant chunk (exact), or max - min so small that scale is subnormal and has
            # lost its relative precision: then the error is bounded by the range only
            tol = float(xs.max() - xs.min()) + params.scale + 4 * ulp
        assert np.max(np.abs(back.astype(np.float64) - xs)) <= tol


def test_constant_chunk_is_exact() -> None:
    for value in (3.25, -0.0, 1e-40, -7e30):
        x = np.full(33, value, np.float32)
        q = np.empty(33, np.uint8)
        params = K.quantize(x, q)
        assert params.scale == 0.0 and not q.any()
        back = np.empty(33, np.float32)
        K.dequantize(q, params, back)
        np.testing.assert_array_equal(back, x)


def test_quantize_overflowing_range_is_an_error() -> None:
    x = np.array([-3e38, 3e38], np.float32)
    with pytest.raises(pccl.InvalidArgument, match="overflows float32"):
        K.quantize(x, np.empty(2, np.uint8))


@pytest.mark.parametrize("acc_type", [np.float32, np.float64])
@pytest.mark.parametrize("qdtype", [np.uint8, np.uint16])
@FAST
@given(data=st.data(), op=st.sampled_from(OPS), unaligned=st.booleans())
def test_dequantize_reduce_matches_two_step(acc_type: type, qdtype: type, data: st.DataObject,
                                            op: ReduceOp, unaligned: bool) -> None:
    n = data.draw(SIZES)
    q = data.draw(arrays(qdtype, n))
    width = 32 if acc_type is np.float32 else 64
    params = K.QuantParams(data.draw(st.floats(-1e6, 1e6, width=width)),
                           data.draw(st.floats(0, 1e3, width=width)))
    acc0 = data.draw(arrays(acc_type, n))
    acc = place(acc0, unaligned)
    K.dequantize_reduce(acc, place(q, unaligned), params, op)
    assert_same(acc, K.dequantize_reduce_oracle(acc0, q, params, op))
    # the fused kernel equals dequantize + reduce_into, bit for bit
    tmp = np.empty(n, acc_type)
    K.dequantize(q, params, tmp)
    two_step = acc0.copy()
    K.reduce_into(two_step, tmp, op)
    assert_same(acc, two_step)


@pytest.mark.parametrize("acc_type", [np.float32, np.float64])
@pytest.mark.parametrize("qdtype", [np.uint8, np.uint16])
@FAST
@given(data=st.data(), op=st.sampled_from(OPS), unaligned=st.tuples(st.booleans(), st.booleans()))
def test_dequantize_reduce_saving_matches_oracle_and_keeps_the_old_bits(
        acc_type: type, qdtype: type, data: st.DataObject, op: ReduceOp, unaligned: tuple[bool, bool]) -> None:
    n = data.draw(SIZES)
    q = data.draw(arrays(qdtype, n))
    width = 32 if acc_type is np.float32 else 64
    params = K.QuantParams(data.draw(st.floats(-1e6, 1e6, width=width)),
                           data.draw(st.floats(0, 1e3, width=width)))
    acc0 = data.draw(pair(acc_type))[0][:n] if data.draw(st.booleans()) else data.draw(arrays(acc_type, n))
    q = q[: acc0.size]
    acc = place(acc0, unaligned[0])
    backup = place(np.zeros_like(acc0), unaligned[1])
    K.dequantize_reduce_saving(acc, place(q, unaligned[0]), params, backup, op)
    assert_same(acc, K.dequantize_reduce_oracle(acc0, q, params, op))
    plain = acc0.copy()
    K.dequantize_reduce(plain, q, params, op)
    np.testing.assert_array_equal(bits(acc), bits(plain))
    np.testing.assert_array_equal(bits(backup), bits(acc0))


def test_dequantize_rounds_twice_never_fused() -> None:
    # x' = lo + q*scale rounds the product, then the sum (no FMA, on every machine).  For these
    # values a fused multiply-add would give 0.23131248 instead of 0.23131245.
    lo, scale = np.float32(-0.3066942095756531), np.float32(0.008277026005089283)
    fused = np.float32(np.float64(lo) + 65.0 * np.float64(scale))
    two_roundings = lo + np.float32(65) * scale
    assert fused != two_roundings
    out = np.empty(1, np.float32)
    K.dequantize(np.array([65], np.uint8), K.QuantParams(float(lo), float(scale)), out)
    assert out[0] == two_roundings
    acc = np.zeros(1, np.float32)
    K.dequantize_reduce(acc, np.array([65], np.uint8), K.QuantParams(float(lo), float(scale)))
    assert acc[0] == two_roundings


def test_multidimensional_arrays_are_flat_sequences() -> None:
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    b = np.ones(12, dtype=np.float64)
    K.reduce_into(a, b, ReduceOp.SUM)
    np.testing.assert_array_equal(a.reshape(-1), np.arange(12) + 1.0)
