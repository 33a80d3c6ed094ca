"""The blockwise and 4-bit quantization kernels (pccl.blockquant) against their numpy oracles, bit
for bit: quantize (codes, lo, scale), the min/max pass, dequantize and dequantize-reduce (every
op, with and without saving), at every source type, code width, block size (blocks that
straddle bytes and the kernels' 2048-element tiles), count (odd: the last byte half used) and
alignment; constant blocks exact; NaN/Inf and overflowing ranges refused."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pccl
from pccl import blockquant as B
from pccl import kernels as K
from pccl.types import ReduceOp

FAST = settings(max_examples=40, deadline=None)
SOURCES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
BITS = [4, 8, 16]


def _acc(dtype: Any) -> Any:
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _codes(n: int, bits: int) -> np.ndarray:
    return np.full(B.code_nbytes(n, bits) // (2 if bits == 16 else 1), 0xAB, np.uint16 if bits == 16 else np.uint8)


def _misplace(a: np.ndarray, unaligned: bool) -> np.ndarray:
    if not unaligned:
        return a.copy()
    view = np.frombuffer(bytearray(a.nbytes + 1), dtype=a.dtype, count=a.size, offset=1)
    view[...] = a.reshape(-1)
    return view


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


@st.composite
def block_input(draw: st.DrawFn, dtype: Any) -> np.ndarray:
    """Finite arrays whose blocks differ in scale (outliers, constant and near-constant runs)."""
    n = draw(st.integers(0, 300))
    wide = _acc(dtype)
    width = 64 if wide is np.float64 else 32
    bound = float(wide(draw(st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]))))
    x = draw(hnp.arrays(wide, n, elements=st.floats(-bound, bound, width=width)))
    if n and draw(st.booleans()):  # a constant run and an outlier
        a = draw(st.integers(0, n - 1))
        x[a : a + draw(st.integers(1, 50))] = x[a]
        x[draw(st.integers(0, n - 1))] = bound * 0.99
    with np.errstate(all="ignore"):
        y = x.astype(dtype)
    y[~np.isfinite(y.astype(np.float64))] = 0
    return y


@pytest.mark.parametrize("dtype", SOURCES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@FAST
@given(data=st.data(), unaligned=st.booleans())
def test_quantize_and_dequantize_match_the_oracle_bit_for_bit(dtype: Any, bits: int, data: st.DataObject,
                                                              unaligned: bool) -> None:
    x = data.draw(block_input(dtype))
    block = data.draw(st.integers(1, 80) | st.just(max(x.size, 1)))
    n, nb, acc = x.size, B.num_blocks(x.size, block), _acc(dtype)
    q = _misplace(_codes(n, bits), unaligned)
    lo, scale = _misplace(np.zeros(nb, acc), unaligned), _misplace(np.zeros(nb, acc), unaligned)
    B.quantize_blocks(_misplace(x, unaligned), q, lo, scale, bits=bits, block=block)
    eq, elo, escale = B.quantize_blocks_oracle(x, bits, block)
    _same(q, eq)
    _same(lo, elo)
    _same(scale, escale)
    if bits == 4 and n % 2:
        assert q[-1] >> 4 == 0  # the unused high nibble of an odd count is 0
    mlo, mhi = np.zeros(nb, acc), np.zeros(nb, acc)
    B.minmax_blocks(x, mlo, mhi, block=block)
    olo, ohi = B.minmax_blocks_oracle(x, block)
    _same(mlo, olo)
    _same(mhi, ohi)

    expected = B.dequantize_blocks_oracle(q, lo, scale, n, bits, block)
    out = _misplace(np.full(n, 9, acc), unaligned)
    B.dequantize_blocks(q, lo, scale, out, bits=bits, block=block)
    _same(out, expected)
    start = data.draw(hnp.arrays(acc, n, elements=st.floats(-1e3, 1e3, width=64 if acc is np.float64 else 32)))
    for op in ReduceOp:
        target = _misplace(start, unaligned)
        B.dequantize_reduce_blocks(target, q, lo, scale, op, bits=bits, block=block)
        _same(target, K.reduce_oracle(start.copy(), expected, op).astype(acc))
        target, backup = _misplace(start, unaligned), np.zeros(n, acc)
        B.dequantize_reduce_blocks_saving(target, q, lo, scale, backup, op, bits=bits, block=block)
        _same(target, K.reduce_oracle(start.copy(), expected, op).astype(acc))
        _same(backup, start)


@pytest.mark.parametrize("dtype", SOURCES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n,block", [(5001, 77), (4096, 2048), (6145, 3000), (2049, 1), (4097, 10**6)])
def test_blocks_across_tiles(dtype: Any, bits: int, n: int, block: int) -> None:
    # The kernels pack and unpack 4-bit codes 2048 elements at a time: blocks straddle tiles.
    rng = np.random.default_rng(n + block)
    x = (rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-3, 4, n // 500 + 1), 500)[:n]).astype(dtype)
    nb, acc = B.num_blocks(n, block), _acc(dtype)
    q, lo, scale = _codes(n, bits), np.zeros(nb, acc), np.zeros(nb, acc)
    B.quantize_blocks(x, q, lo, scale, bits=bits, block=block)
    eq, elo, escale = B.quantize_blocks_oracle(x, bits, block)
    _same(q, eq)
    _same(lo, elo)
    _same(scale, escale)
    acc_in = rng.standard_normal(n).astype(acc)
    got, backup = acc_in.copy(), np.zeros(n, acc)
    B.dequantize_reduce_blocks_saving(got, q, lo, scale, backup, ReduceOp.SUM, bits=bits, block=block)
    _same(got, acc_in + B.dequantize_blocks_oracle(q, lo, scale, n, bits, block))
    _same(backup, acc_in)


@pytest.mark.parametrize("dtype", SOURCES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bits", [8, 16])
def test_one_block_is_the_chunk_quantization(dtype: Any, bits: int) -> None:
    x = (np.random.default_rng(3).standard_normal(1001) * 5).astype(dtype)
    q, lo, scale = _codes(x.size, bits), np.zeros(1, _acc(dtype)), np.zeros(1, _acc(dtype))
    B.quantize_blocks(x, q, lo, scale, bits=bits, block=x.size)
    chunk = np.zeros_like(q)
    params = K.quantize(x, chunk)
    _same(q, chunk)
    assert (params.lo, params.scale) == (float(lo[0]), float(scale[0]))


@pytest.mark.parametrize("bits", BITS)
def test_constant_blocks_are_exact(bits: int) -> None:
    x = np.repeat(np.array([3.25, -0.0, 1e-40, -7e30, 0.1], np.float32), 64)
    nb = B.num_blocks(x.size, 64)
    q, lo, scale = _codes(x.size, bits), np.zeros(nb, np.float32), np.zeros(nb, np.float32)
    B.quantize_blocks(x, q, lo, scale, bits=bits, block=64)
    assert not scale.any() and not q.any()
    back = np.empty(x.size, np.float32)
    B.dequantize_blocks(q, lo, scale, back, bits=bits, block=64)
    assert np.array_equal(back, x + np.float32(0))  # -0 comes back as +0


@pytest.mark.parametrize("dtype", SOURCES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_is_refused_with_a_clear_error(dtype: Any, bad: float) -> None:
    x = np.ones(300, dtype)
    x[257] = bad
    nb = B.num_blocks(300, 128)
    with pytest.raises(pccl.InvalidArgument, match="NaN or Inf"):
        B.quantize_blocks(x, _codes(300, 4), np.zeros(nb, _acc(dtype)), np.zeros(nb, _acc(dtype)), bits=4, block=128)
    with pytest.raises(pccl.InvalidArgument, match="NaN or Inf"):
        B.minmax_blocks(x, np.zeros(nb, _acc(dtype)), np.zeros(nb, _acc(dtype)), block=128)


def test_overflowing_range_is_refused() -> None:
    x = np.array([-3e38, 3e38, 1.0], np.float32)
    with pytest.raises(pccl.InvalidArgument, match="overflows float32"):
        B.quantize_blocks(x, _codes(3, 4), np.zeros(1, np.float32), np.zeros(1, np.float32), bits=4, block=4)
    # in blocks of their own the same values quantize
    B.quantize_blocks(x, _codes(3, 4), np.zeros(3, np.float32), np.zeros(3, np.float32), bits=4, block=1)


def test_bad_arguments_name_the_argument() -> None:
    x = np.ones(10, np.float32)
    ok = dict(bits=4, block=4)
    cases = [
        (lambda: B.quantize_blocks(x, _codes(10, 4), np.zeros(3, np.float32), np.zeros(3, np.float32), bits=5, block=4),
         "bits must be 4, 8 or 16"),
        (lambda: B.quantize_blocks(x, _codes(10, 4), np.zeros(3, np.float32), np.zeros(3, np.float32), bits=4, block=0),
         "block must be a positive integer"),
        (lambda: B.quantize_blocks(x, _codes(11, 4), np.zeros(3, np.float32), np.zeros(3, np.float32), **ok),
         "q must hold 5"),
        (lambda: B.quantize_blocks(x, _codes(10, 4), np.zeros(2, np.float32), np.zeros(3, np.float32), **ok),
         "lo must hold one value per block"),
        (lambda: B.quantize_blocks(x, _codes(10, 4), np.zeros(3, np.float64), np.zeros(3, np.float32), **ok),
         "lo must be a float32 array"),
        (lambda: B.quantize_blocks(np.ones(10, np.int32), _codes(10, 4), np.zeros(3, np.float32),
                                   np.zeros(3, np.float32), **ok), "x must be a float16/bfloat16/float32/float64"),
        (lambda: B.dequantize_blocks(_codes(10, 4), np.zeros(3, np.float32), np.zeros(3, np.float32),
                                     np.zeros(10, np.float16), **ok), "out must be a float32 or float64"),
    ]
    for call, message in cases:
        with pytest.raises(pccl.InvalidArgument, match=message):
            call()
    shared = np.zeros(6, np.float32)
    with pytest.raises(pccl.InvalidArgument, match="overlap"):
        B.quantize_blocks(x, _codes(10, 4), shared[:3], shared[2:5], **ok)
