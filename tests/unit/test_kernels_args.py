"""Argument validation of pccl.kernels: every bad call raises pccl.InvalidArgument, names the
problem, and leaves the destination untouched."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

import pccl
from pccl import kernels as K
from pccl._kernels import lib
from pccl.types import DType, ReduceOp

from fp_mode import flush_denormals, mxcsr, needs_sse_modes


def f32(n: int = 8) -> np.ndarray:
    return np.arange(n, dtype=np.float32)


def test_enum_codes_match_the_wire_values() -> None:
    for dt in DType:
        name = {"UINT": "U", "INT": "I", "FLOAT": "F", "BFLOAT": "BF"}
        prefix = next(p for p in ("BFLOAT", "FLOAT", "UINT", "INT") if dt.name.startswith(p))
        assert getattr(lib, "PCCL_" + name[prefix] + dt.name[len(prefix):]) == dt
    for op in ReduceOp:
        assert getattr(lib, "PCCL_" + op.name) == op


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: K.reduce_into(f32(), np.arange(8, dtype=np.float64)), "must match"),
        (lambda: K.reduce_into(f32(), f32(7)), "8 elements but src has 7"),
        (lambda: K.reduce_into(f32(), f32(16)[::2]), "C-contiguous"),
        (lambda: K.reduce_into(f32(16)[::2], f32()), "C-contiguous"),
        (lambda: K.reduce_into(f32(), [1.0] * 8), "numpy array"),
        (lambda: K.reduce_into(np.arange(8, dtype=np.complex64), np.arange(8, dtype=np.complex64)), "unsupported dtype"),
        (lambda: K.reduce_into(np.zeros(8, np.float16), np.zeros(8, np.float16)), "float32 dst"),
        (lambda: K.reduce_into(np.zeros(8, np.float64), np.zeros(8, np.float16)), "float32 dst"),
        (lambda: K.reduce_into(f32(), np.zeros(8, np.int16), src_dtype=DType.BFLOAT16), "cannot hold bfloat16"),
        (lambda: K.reduce_into(f32(), f32(), op=7), "unknown reduce op"),
        (lambda: K.reduce_to(f32(), f32(), np.arange(8, dtype=np.float64)), "b has float64; they must match"),
        (lambda: K.reduce_to(f32(), np.arange(8, dtype=np.int32), f32()), "a has int32; they must match"),
        (lambda: K.reduce_to(f32(), f32(7), f32()), "8 elements but a has 7"),
        (lambda: K.reduce_to(f32(), f32(), f32(16)[::2]), "b must be C-contiguous"),
        (lambda: K.reduce_to(f32(16)[::2], f32(), f32()), "dst must be C-contiguous"),
        (lambda: K.reduce_to(f32(), f32(), [1.0] * 8), "b must be a numpy array"),
        (lambda: K.reduce_to(np.zeros(8, np.float16), np.zeros(8, np.float16), np.zeros(8, np.float16)),
         "widen to float32 first"),
        (lambda: K.reduce_to(f32(), f32(), f32(), op=7), "unknown reduce op"),
        (lambda: K.avg_finalize(f32(), 0), r"\[1, 2\*\*63\)"),
        (lambda: K.avg_finalize(f32(), 2.0), r"\[1, 2\*\*63\)"),
        (lambda: K.avg_finalize(np.zeros(4, np.float16), 2), "float32 accumulator"),
        (lambda: K.widen(np.zeros(4, np.float64), np.zeros(4, np.float16)), "writes float32"),
        (lambda: K.widen(f32(4), np.zeros(4, np.int16)), "reads float16 or bfloat16"),
        (lambda: K.narrow(np.zeros(4, np.float32), f32(4)), "writes float16 or bfloat16"),
        (lambda: K.narrow(np.zeros(4, np.float16), np.zeros(4, np.float64)), "reads float32"),
        (lambda: K.narrow(np.zeros(4, np.uint16), f32(4)), "writes float16 or bfloat16"),
        (lambda: K.minmax(np.arange(4)), "float arrays"),
        (lambda: K.quantize(np.arange(4), np.zeros(4, np.uint8)), "float arrays"),
        (lambda: K.quantize(f32(4), np.zeros(4, np.int8)), "uint8 or uint16"),
        (lambda: K.quantize(f32(4), np.zeros(5, np.uint8)), "4 elements but q has 5"),
        (lambda: K.dequantize(np.zeros(4, np.uint8), K.QuantParams(0, 1), np.zeros(4, np.float16)),
         "float32 or float64 accumulator"),
        (lambda: K.dequantize(np.zeros(4, np.int32), K.QuantParams(0, 1), f32(4)), "uint8 or uint16"),
        (lambda: K.dequantize_reduce(f32(4), np.zeros(3, np.uint8), K.QuantParams(0, 1)), "4 elements but q has 3"),
        (lambda: K.reduce_into_saving(f32(), f32(), np.zeros(8, np.float64)), "backup has dtype float64"),
        (lambda: K.reduce_into_saving(f32(), f32(), f32(7)), "backup has 7 elements but dst has 8"),
        (lambda: K.reduce_into_saving(f32(), f32(), f32(16)[::2]), "backup must be C-contiguous"),
        (lambda: K.reduce_into_saving(f32(), f32(), [0.0] * 8), "numpy array"),
        (lambda: K.reduce_into_saving(f32(), np.arange(8, dtype=np.float64), f32()), "must match"),
        (lambda: K.reduce_into_saving(np.zeros(8, np.float16), np.zeros(8, np.float16), np.zeros(8, np.float16)),
         "float32/float64/integer"),
        (lambda: K.reduce_into_saving(f32(), f32(), f32(), op=9), "unknown reduce op"),
        (lambda: K.dequantize_reduce_saving(f32(4), np.zeros(4, np.uint8), K.QuantParams(0, 1), np.zeros(4, np.float64)),
         "backup has dtype float64 but acc has float32"),
        (lambda: K.dequantize_reduce_saving(f32(4), np.zeros(4, np.uint8), K.QuantParams(0, 1), f32(5)),
         "backup has 5 elements but acc has 4"),
        (lambda: K.dequantize_reduce_saving(f32(4), np.zeros(4, np.int8), K.QuantParams(0, 1), f32(4)), "uint8 or uint16"),
        (lambda: K.save_copy(f32(), np.arange(8, dtype=np.int32)), "backup has dtype float32 but src has int32"),
        (lambda: K.save_copy(f32(7), f32()), "backup has 7 elements but src has 8"),
        (lambda: K.save_copy(f32(), f32(16)[::2]), "src must be C-contiguous"),
    ],
)
def test_bad_arguments_raise_invalid_argument(call: Callable[[], object], match: str) -> None:
    with pytest.raises(pccl.InvalidArgument, match=match):
        call()


def test_invalid_argument_is_a_value_error_and_a_pccl_error() -> None:
    with pytest.raises(ValueError):
        K.reduce_into(f32(), f32(3))
    with pytest.raises(pccl.PCCLError):
        K.reduce_into(f32(), f32(3))


def test_readonly_destination() -> None:
    dst = f32()
    dst.flags.writeable = False
    with pytest.raises(pccl.InvalidArgument, match="read-only"):
        K.reduce_into(dst, f32())
    ro = np.frombuffer(bytes(32), dtype=np.float32)
    with pytest.raises(pccl.InvalidArgument, match="read-only"):
        K.dequantize(np.zeros(8, np.uint8), K.QuantParams(0, 1), ro)
    with pytest.raises(pccl.InvalidArgument, match="read-only"):
        K.quantize(f32(), np.frombuffer(bytes(8), dtype=np.uint8))
    with pytest.raises(pccl.InvalidArgument, match="backup is read-only"):
        K.reduce_into_saving(f32(), f32(), np.frombuffer(bytes(32), dtype=np.float32))
    with pytest.raises(pccl.InvalidArgument, match="backup is read-only"):
        K.save_copy(np.frombuffer(bytes(32), dtype=np.float32), f32())


def test_readonly_source_is_fine() -> None:
    src = np.frombuffer(np.ones(8, np.float32).tobytes(), dtype=np.float32)
    dst = f32()
    K.reduce_into(dst, src)
    np.testing.assert_array_equal(dst, np.arange(8) + 1.0)


def test_overlapping_buffers() -> None:
    buf = np.arange(16, dtype=np.float32)
    before = buf.copy()
    with pytest.raises(pccl.InvalidArgument, match="overlap"):
        K.reduce_into(buf[:8], buf[4:12])
    with pytest.raises(pccl.InvalidArgument, match="overlap"):
        K.reduce_into(buf, buf)
    raw = np.zeros(64, np.uint8)
    with pytest.raises(pccl.InvalidArgument, match="overlap"):
        K.quantize(raw[:32].view(np.float32), raw[28:36])
    with pytest.raises(pccl.InvalidArgument, match="overlap"):
        K.dequantize_reduce(raw[:32].view(np.float32), raw[31:39], K.QuantParams(0, 1))
    with pytest.raises(pccl.InvalidArgument, match="backup and dst overlap"):
        K.reduce_into_saving(buf[:8], buf[8:], buf[4:12])
    with pytest.raises(pccl.InvalidArgument, match="backup and src overlap"):
        K.reduce_into_saving(buf[:4], buf[8:12], buf[10:14])
    with pytest.raises(pccl.InvalidArgument, match="backup and acc overlap"):
        K.dequantize_reduce_saving(buf[:4], np.zeros(4, np.uint8), K.QuantParams(0, 1), buf[:4])
    with pytest.raises(pccl.InvalidArgument, match="backup and src overlap"):
        K.save_copy(buf[:8], buf[4:12])
    with pytest.raises(pccl.InvalidArgument, match="dst and a overlap"):
        K.reduce_to(buf[:8], buf[4:12], buf[8:])
    with pytest.raises(pccl.InvalidArgument, match="dst and b overlap"):
        K.reduce_to(buf[:8], buf[8:], buf[:8])
    with pytest.raises(pccl.InvalidArgument, match="backup and q overlap"):
        K.dequantize_reduce_saving(raw[:16].view(np.float32), raw[32:36], K.QuantParams(0, 1),
                                   raw[32:48].view(np.float32))
    np.testing.assert_array_equal(buf, before)
    # adjacent is not overlapping; a and b may be one array
    K.reduce_into(buf[:8], buf[8:])
    np.testing.assert_array_equal(buf[:8], before[:8] + before[8:])
    K.reduce_to(buf[:8], buf[8:], buf[8:], ReduceOp.PROD)
    np.testing.assert_array_equal(buf[:8], before[8:] * before[8:])


def test_empty_arrays() -> None:
    e = np.empty(0, np.float32)
    K.reduce_into(e, np.empty(0, np.float32))
    K.reduce_into(e, np.empty(0, ml_dtypes.bfloat16))
    K.avg_finalize(e, 3)
    K.widen(e, np.empty(0, np.float16))
    K.narrow(np.empty(0, np.float16), e)
    assert K.quantize(e, np.empty(0, np.uint16)) == K.QuantParams(0.0, 0.0)
    K.dequantize(np.empty(0, np.uint8), K.QuantParams(1.0, 2.0), e)
    K.dequantize_reduce(e, np.empty(0, np.uint8), K.QuantParams(1.0, 2.0), ReduceOp.MAX)
    K.reduce_into_saving(e, np.empty(0, np.float32), np.empty(0, np.float32))
    K.reduce_to(e, np.empty(0, np.float32), np.empty(0, np.float32))
    K.save_copy(e, np.empty(0, np.float32))
    K.dequantize_reduce_saving(e, np.empty(0, np.uint8), K.QuantParams(1.0, 2.0), np.empty(0, np.float32))


def test_bfloat16_raw_bits_need_the_declaration() -> None:
    bits = np.array([0x3F80, 0x4000], np.uint16)  # 1.0, 2.0 as bfloat16
    dst = np.zeros(2, np.float32)
    K.reduce_into(dst, bits, ReduceOp.SUM, src_dtype=DType.BFLOAT16)
    assert dst.tolist() == [1.0, 2.0]
    with pytest.raises(pccl.InvalidArgument, match="must match"):
        K.reduce_into(dst, bits)  # undeclared uint16 is uint16, not bfloat16
    typed = bits.view(ml_dtypes.bfloat16)
    K.reduce_into(dst, typed)
    assert dst.tolist() == [2.0, 4.0]


def test_accumulator_dtype() -> None:
    assert K.accumulator_dtype(DType.FLOAT64) is DType.FLOAT64
    for dt in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32):
        assert K.accumulator_dtype(dt) is DType.FLOAT32
    assert K.accumulator_dtype(DType.INT8) is DType.INT8


# --- the calling thread's floating-point mode does not change a kernel's bits -----------------


@needs_sse_modes
def test_kernels_compute_ieee_bits_under_flush_to_zero() -> None:
    # Subnormal operands and results: flush-to-zero / denormals-are-zero would make them 0.
    tiny = np.full(37, 3e-39, np.float32)  # subnormal in float32
    halves = np.full(37, 1e-45, np.float32)
    before = mxcsr()
    with flush_denormals():
        assert np.add(tiny, tiny)[0] == 0.0  # the mode is on: numpy flushes
        total = tiny.copy()
        K.reduce_into(total, tiny, ReduceOp.SUM)
        mins = tiny.copy()
        K.reduce_into(mins, halves, ReduceOp.MIN)
        avg = tiny.copy()
        K.avg_finalize(avg, 2)
        widened = np.zeros(37, np.float32)
        K.widen(widened, np.full(37, 1e-7, np.float16))  # a float16 subnormal
        wsum = np.zeros(37, np.float32)
        K.reduce_into(wsum, np.full(37, 1e-7, np.float16), ReduceOp.SUM)
        deq = np.zeros(37, np.float32)
        K.dequantize(np.full(37, 3, np.uint8), K.QuantParams(0.0, 1e-39), deq)
        deq_sum = tiny.copy()
        K.dequantize_reduce(deq_sum, np.full(37, 3, np.uint8), K.QuantParams(0.0, 1e-39))
        saved_sum, backup = tiny.copy(), np.zeros(37, np.float32)
        K.reduce_into_saving(saved_sum, tiny, backup, ReduceOp.SUM)
        sum_to = np.zeros(37, np.float32)
        K.reduce_to(sum_to, tiny, tiny, ReduceOp.SUM)
        inside = mxcsr()
    assert inside & 0x8040 == 0x8040  # the kernels left the caller's mode as they found it
    assert mxcsr() == before
    assert np.array_equal(total, tiny + tiny) and total[0] != 0.0
    assert np.array_equal(mins, np.minimum(tiny, halves)) and mins[0] != 0.0
    assert np.array_equal(avg, tiny / np.float32(2)) and avg[0] != 0.0
    assert np.array_equal(widened, np.full(37, 1e-7, np.float16).astype(np.float32)) and widened[0] != 0.0
    assert np.array_equal(wsum, widened)
    assert np.all(deq == np.float32(0.0) + np.float32(3) * np.float32(1e-39)) and deq[0] != 0.0
    assert np.array_equal(deq_sum, tiny + deq)
    assert np.array_equal(saved_sum, tiny + tiny) and np.array_equal(backup, tiny)
    assert np.array_equal(sum_to, tiny + tiny)
