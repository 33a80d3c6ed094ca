"""Throughput of pccl's native kernels next to the numpy expression each one replaces.

    python benchmarks/kernels.py [--size-mib 64] [--repeat 7] [--check]

Each row times the kernel and its numpy equivalent on the same arrays, in the same process,
interleaved, and reports the median of ``--repeat`` runs as GB/s of payload: the bytes an ideal
single pass reads and writes (e.g. ``a += b`` on float32: 4 bytes read from a, 4 from b, 4
written to a per element).  Both columns use the same byte count, so the ratio is the speed-up.
``--size-mib`` sizes the main float32 array; the other arrays hold as many elements.

``--check`` exits non-zero unless the acceptance targets of the kernels issue are met in this
run: float32 SUM >= 0.9x ``np.add(a, b, out=a)``, fused dequantize(uint8)+SUM >= 3x
``a += q.astype(np.float32) * scale + lo``, quantize >= 2x the numpy expression; and of the
low-bit issue: 4-bit quantize in blocks of 128 (per-block min/max, codes packed two per byte)
and the fused 4-bit dequantize + SUM each >= 3x their numpy expressions.

The machine is shared and small: absolute figures swing; ratios measured side by side are what
mean something.  OPENBLAS_CORETYPE (set on some machines here to work around old OpenBLAS bugs)
only affects BLAS calls; none of the numpy operations below use BLAS, so it does not matter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from pccl import blockquant as B
from pccl import kernels as K
from pccl.types import ReduceOp

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - optional extra
    ml_dtypes = None


class Row(NamedTuple):
    name: str
    nbytes: int
    kernel: Callable[[], object]
    numpy: Callable[[], object]


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build_rows(n: int) -> list[Row]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    c = np.empty(n, np.float32)
    a64 = rng.standard_normal(n)
    b64 = rng.standard_normal(n)
    ai = rng.integers(-1000, 1000, n, dtype=np.int32)
    bi = rng.integers(-1000, 1000, n, dtype=np.int32)
    h = b.astype(np.float16)
    h_out = np.empty(n, np.float16)
    q = np.empty(n, np.uint8)
    deq = np.empty(n, np.float32)
    params = K.quantize(b, q)
    lo, scale = np.float32(params.lo), np.float32(params.scale)

    def np_quantize() -> np.ndarray:
        mn, mx = b.min(), b.max()
        inv = np.float32(255) / (mx - mn)
        return np.rint(np.clip((b - mn) * inv, 0, 255)).astype(np.uint8)

    rows = [
        Row("f32 SUM  a += b", 12 * n, lambda: K.reduce_into(a, b, ReduceOp.SUM),
            lambda: np.add(a, b, out=a)),
        Row("f64 SUM  a += b", 24 * n, lambda: K.reduce_into(a64, b64, ReduceOp.SUM),
            lambda: np.add(a64, b64, out=a64)),
        Row("f32 MAX", 12 * n, lambda: K.reduce_into(a, b, ReduceOp.MAX),
            lambda: np.maximum(a, b, out=a)),
        Row("f32 SUM  c = a + b", 12 * n, lambda: K.reduce_to(c, a, b, ReduceOp.SUM),
            lambda: np.add(a, b, out=c)),
        Row("i32 SUM", 12 * n, lambda: K.reduce_into(ai, bi, ReduceOp.SUM),
            lambda: np.add(ai, bi, out=ai)),
        Row("f16 into f32 SUM", 10 * n, lambda: K.reduce_into(a, h, ReduceOp.SUM),
            lambda: np.add(a, h.astype(np.float32), out=a)),
        Row("f32 -> f16", 6 * n, lambda: K.narrow(h_out, b), lambda: np.copyto(h_out, b, casting="unsafe")),
        Row("AVG finalise f32 /= 3", 8 * n, lambda: K.avg_finalize(a, 3),
            lambda: np.divide(a, np.float32(3), out=a)),
        Row("min/max scan f32", 4 * n, lambda: K.minmax(b), lambda: (b.min(), b.max())),
        Row("quantize f32 -> u8", 5 * n, lambda: K.quantize(b, q), np_quantize),
        Row("dequantize u8 -> f32", 5 * n, lambda: K.dequantize(q, params, deq),
            lambda: np.add(q.astype(np.float32) * scale, lo, out=deq)),
        Row("dequantize u8 + SUM (fused)", 9 * n, lambda: K.dequantize_reduce(a, q, params, ReduceOp.SUM),
            lambda: np.add(a, q.astype(np.float32) * scale + lo, out=a)),
    ]
    rows += _four_bit_rows(a, b)
    if ml_dtypes is not None:
        bf = b.astype(ml_dtypes.bfloat16)
        bf_out = np.empty(n, ml_dtypes.bfloat16)
        rows.insert(6, Row("bf16 into f32 SUM", 10 * n, lambda: K.reduce_into(a, bf, ReduceOp.SUM),
                           lambda: np.add(a, bf.astype(np.float32), out=a)))
        rows.insert(7, Row("f32 -> bf16", 6 * n, lambda: K.narrow(bf_out, b),
                           lambda: np.copyto(bf_out, b, casting="unsafe")))
    return rows


def _four_bit_rows(a_full: np.ndarray, b_full: np.ndarray, block: int = 128) -> list[Row]:
    """4-bit blockwise quantize and fused dequantize + SUM, next to the numpy expressions that
    compute the same (per-block min/max, codes, packing two per byte; unpacking, decoding, adding)."""
    n = a_full.size - a_full.size % (2 * block)
    a, b = a_full[:n], b_full[:n]
    nb = n // block
    q = np.empty(n // 2, np.uint8)
    lo, scale = np.empty(nb, np.float32), np.empty(nb, np.float32)
    B.quantize_blocks(b, q, lo, scale, bits=4, block=block)

    def np_quantize() -> np.ndarray:
        v = b.reshape(nb, block)
        mn, mx = v.min(axis=1, keepdims=True), v.max(axis=1, keepdims=True)
        codes = np.rint(np.clip((v - mn) * (np.float32(15) / (mx - mn)), 0, 15)).astype(np.uint8).reshape(-1)
        return codes[0::2] | (codes[1::2] << np.uint8(4))

    def np_dequantize_sum() -> None:
        codes = np.empty(n, np.uint8)
        codes[0::2] = q & np.uint8(15)
        codes[1::2] = q >> np.uint8(4)
        np.add(a, (codes.reshape(nb, block).astype(np.float32) * scale[:, None] + lo[:, None]).reshape(-1), out=a)

    params = 8 * nb  # lo and scale, float32 each
    return [
        Row("quantize f32 -> u4 b128", 4 * n + n // 2 + params,
            lambda: B.quantize_blocks(b, q, lo, scale, bits=4, block=block), np_quantize),
        Row("dequantize u4 b128 + SUM", 8 * n + n // 2 + params,
            lambda: B.dequantize_reduce_blocks(a, q, lo, scale, ReduceOp.SUM, bits=4, block=block), np_dequantize_sum),
    ]


TARGETS = {"f32 SUM  a += b": 0.9, "quantize f32 -> u8": 2.0, "dequantize u8 + SUM (fused)": 3.0,
           "quantize f32 -> u4 b128": 3.0, "dequantize u4 b128 + SUM": 3.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=float, default=64.0, help="size of the float32 array (MiB)")
    parser.add_argument("--repeat", type=int, default=7, help="runs per measurement; the median is reported")
    parser.add_argument("--check", action="store_true", help="exit 1 unless the acceptance targets are met")
    args = parser.parse_args(argv)
    n = int(args.size_mib * 2**20) // 4
    print(f"{n} float32 elements ({args.size_mib:g} MiB), median of {args.repeat} runs, numpy {np.__version__}")
    if os.environ.get("OPENBLAS_CORETYPE"):
        print(f"OPENBLAS_CORETYPE={os.environ['OPENBLAS_CORETYPE']} (no BLAS call is timed here)")
    print(f"{'kernel':<30} {'pccl GB/s':>10} {'numpy GB/s':>11} {'ratio':>7}")
    failed = []
    for row in build_rows(n):
        row.kernel()  # warm up: page faults, dispatch
        row.numpy()
        k_times, n_times = [], []
        for _ in range(args.repeat):  # interleave, so both see the same machine load
            k_times.append(_median_seconds(row.kernel, 1))
            n_times.append(_median_seconds(row.numpy, 1))
        k_gbs = row.nbytes / statistics.median(k_times) / 1e9
        n_gbs = row.nbytes / statistics.median(n_times) / 1e9
        ratio = k_gbs / n_gbs
        target = TARGETS.get(row.name)
        mark = ""
        if target is not None:
            ok = ratio >= target
            mark = f"  target >= {target:g}x: {'ok' if ok else 'MISSED'}"
            if not ok:
                failed.append(row.name)
        print(f"{row.name:<30} {k_gbs:>10.1f} {n_gbs:>11.1f} {ratio:>6.2f}x{mark}")
    if failed:
        print(f"targets missed: {', '.join(failed)}")
    return 1 if (failed and args.check) else 0


if __name__ == "__main__":
    sys.exit(main())
