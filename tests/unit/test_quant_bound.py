"""The error bound documented in :class:`pccl.Quantization`, checked by Hypothesis against a float64
reference: per hop on the kernels (one quantization of a block), and end to end on ring
all-reduces (2-4 peers on in-memory streams, every float dtype, 4, 8 and 16 bits, with and
without blocks, SUM and AVG, frames small enough that every op has many)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.lib.stride_tricks import sliding_window_view

from pccl import blockquant as B
from pccl.types import Quantization, ReduceOp

from test_allreduce_ring import assert_bit_identical, run_ring

FLOATS = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]
#: unit roundoff of the accumulator type, and the relative rounding of a 16-bit result
U = {np.float64: 2.0**-53, np.float32: 2.0**-24}
HALF_ROUNDING = {np.dtype(np.float16): 2.0**-11, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
#: half the spacing of a 16-bit type's subnormals: the least that rounding a result moves it by
#: (a float16 average of 3e-6 and 4e-6 lands 2**-25 from the exact one, relatively 0.9 %)
HALF_SUBNORMAL = {np.dtype(np.float16): 2.0**-25, np.dtype(ml_dtypes.bfloat16): 2.0**-134}


def final_rounding(dtype: Any, exact: np.ndarray) -> np.ndarray:
    """Half an ulp of a 16-bit result (0 for float32 and float64, whose rounding is in ``u``):
    relative in the normal range, half the subnormal spacing below it."""
    d = np.dtype(dtype)
    if d not in HALF_ROUNDING:
        return np.zeros_like(exact)
    return np.maximum(HALF_ROUNDING[d] * np.abs(exact) * 1.01, HALF_SUBNORMAL[d])


def _acc(dtype: Any) -> Any:
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def per_hop_bound(rng: float, mag: float, bits: int, u: float) -> float:
    """``e(R) = R / (2 QMAX) + 8 u (R + M)`` (the Quantization docstring)."""
    return rng / (2 * B.QMAX[bits]) + 8 * u * (rng + mag)


def end_to_end_bound(r: np.ndarray, m: np.ndarray, bits: int, u: float, world: int) -> np.ndarray:
    """``(r / 2 + 9 u QMAX (r + m)) ((1 + 1/QMAX + 32 u)**N - 1)`` (the Quantization docstring)."""
    qmax = B.QMAX[bits]
    return (r / 2 + 9 * u * qmax * (r + m)) * ((1 + 1 / qmax + 32 * u) ** world - 1)


@st.composite
def inputs(draw: st.DrawFn, world: int, dtype: Any) -> list[np.ndarray]:
    """Peers' arrays whose regions differ in scale (so blocks matter), values either 0 or far from
    underflow (the bound holds while a block's scale is a normal number)."""
    n = draw(st.integers(1, 400))
    scales = np.repeat(np.array(draw(st.lists(st.sampled_from([1e-2, 1.0, 1e3]), min_size=4, max_size=4))),
                       -(-n // 4))[:n]
    out = []
    for _ in range(world):
        base = np.array(draw(st.lists(st.floats(-1, 1), min_size=n, max_size=n)))
        x = base * scales
        x[np.abs(x) < 1e-6] = 0
        out.append(x.astype(dtype))
    return out


def window_stats(xs: list[np.ndarray], block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per element: ``r`` = the sum over the peers of each one's range, and ``m`` the sum of their
    largest magnitudes, over every element that may share a block with it (within ``block - 1``
    of it; every element without blocks)."""
    n = xs[0].size
    r, m = np.zeros(n), np.zeros(n)
    for x in xs:
        v = x.astype(np.float64)
        if block is None or block >= n:
            r += np.ptp(v)
            m += np.abs(v).max()
            continue
        pad = np.pad(v, block - 1, mode="edge")
        w = sliding_window_view(pad, 2 * block - 1)
        r += w.max(axis=1) - w.min(axis=1)
        m += np.abs(w).max(axis=1)
    return r, m


@settings(max_examples=60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(FLOATS), bits=st.sampled_from([4, 8, 16]),
       block=st.none() | st.integers(1, 150))
def test_one_quantization_moves_a_value_by_at_most_e_of_its_block_range(data: st.DataObject, dtype: Any,
                                                                        bits: int, block: int | None) -> None:
    (x,) = data.draw(inputs(1, dtype))
    k = block or x.size
    nb, acc = B.num_blocks(x.size, k), _acc(dtype)
    q = np.zeros(B.code_nbytes(x.size, bits) // (2 if bits == 16 else 1), np.uint16 if bits == 16 else np.uint8)
    lo, scale = np.zeros(nb, acc), np.zeros(nb, acc)
    B.quantize_blocks(x, q, lo, scale, bits=bits, block=k)
    back = B.dequantize_blocks_oracle(q, lo, scale, x.size, bits, k).astype(np.float64)
    v = x.astype(np.float64)
    for b in range(nb):
        part = v[b * k : (b + 1) * k]
        bound = per_hop_bound(float(np.ptp(part)), float(np.abs(part).max()), bits, U[acc])
        assert np.abs(back[b * k : (b + 1) * k] - part).max() <= bound


@settings(max_examples=60, deadline=None)
@given(data=st.data(), world=st.integers(2, 4), dtype=st.sampled_from(FLOATS), bits=st.sampled_from([4, 8, 16]),
       block=st.none() | st.integers(1, 150), op=st.sampled_from([ReduceOp.SUM, ReduceOp.AVG]))
def test_all_reduce_stays_within_the_documented_end_to_end_bound(data: st.DataObject, world: int, dtype: Any,
                                                                bits: int, block: int | None, op: ReduceOp) -> None:
    xs = data.draw(inputs(world, dtype))
    quant = Quantization(dtype={4: "uint4", 8: np.uint8, 16: np.uint16}[bits], block=block)
    outputs, _ = trio.run(lambda: run_ring(xs, op, quantization=quant, max_subchunk_bytes=256))
    assert_bit_identical(outputs)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    r, m = window_stats(xs, block)
    u = U[_acc(dtype)]
    bound = end_to_end_bound(r, m, bits, u, world)
    if op is ReduceOp.AVG:
        exact, bound = exact / world, (bound + u * m) / world
    bound = bound + final_rounding(dtype, exact) + 1e-30
    err = np.abs(outputs[0].astype(np.float64) - exact)
    assert np.all(err <= bound), (float(err.max()), float(bound[np.argmax(err - bound)]))


def test_a_float16_result_below_the_normal_range_is_off_by_half_its_ulp_at_most() -> None:
    """The case Hypothesis found against a bound that took a 16-bit result's rounding as relative
    only: exact quantization (one element a block), the average of two float16 subnormals."""
    xs = [np.array([3e-6, 1.0], np.float16), np.array([4e-6, 1.0], np.float16)]
    quant = Quantization(dtype=np.uint16, block=1)
    outputs, _ = trio.run(lambda: run_ring(xs, ReduceOp.AVG, quantization=quant, max_subchunk_bytes=256))
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0) / 2
    err = np.abs(outputs[0].astype(np.float64) - exact)
    assert err[0] == 2.0**-25 > HALF_ROUNDING[np.dtype(np.float16)] * exact[0]  # relative alone is too tight
    assert np.all(err <= final_rounding(np.float16, exact))
