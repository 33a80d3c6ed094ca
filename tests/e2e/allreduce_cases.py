"""Deterministic all-reduce cases shared by the e2e tests and their peer processes.

A peer process and the test regenerate the same inputs from ``(seed, index)`` — ``index`` being
the position the test gave the process, not its (random) peer id — so the processes only
report digests of their outputs and the test computes the numpy reference itself.
"""

from __future__ import annotations

import hashlib
from typing import Any

import ml_dtypes
import numpy as np

from pccl import Quantization, ReduceOp

DTYPES = ["uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "bfloat16", "float32", "float64"]
OPS = ["SUM", "AVG", "PROD", "MIN", "MAX"]
#: 200_004 elements: divisible by 2, 3 and 4, so the per-peer byte counts are exact too.
SIZES = [1, 3, 1025, 200_004]
QUANT_DTYPES = ["float16", "bfloat16", "float32", "float64"]
QUANT_OPS = ["SUM", "AVG", "MAX"]
QUANT_SIZES = [1025, 200_004]
QUANT_WIRE = ["uint8", "uint16"]


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def quantization(wire: str | None) -> Quantization | None:
    return None if wire is None else Quantization(dtype=np.dtype(wire))


def make_input(seed: int, index: int, n: int, dtype: str, op: str) -> np.ndarray:
    """Peer ``index``'s input of case ``seed``: small integers (tiny ones for PROD), or normal
    floats (scale 2 for PROD so products stay finite in f16)."""
    rng = np.random.default_rng([seed, index])
    dt = np_dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        hi = 4 if op == "PROD" else min(int(info.max), 1000)
        lo = -hi if dt.kind == "i" else 0
        return rng.integers(lo, hi, n, endpoint=True).astype(dt)
    scale = 2.0 if op == "PROD" else 100.0
    return (rng.standard_normal(n) * scale).astype(dt)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).view(np.uint8).tobytes()).hexdigest()


def matrix_cases() -> list[dict[str, Any]]:
    """Every op x dtype x size unquantized, and the quantized ones; each with its own seed."""
    cases: list[dict[str, Any]] = []
    for dtype in DTYPES:
        for op in OPS:
            for n in SIZES:
                cases.append({"dtype": dtype, "op": op, "n": n, "quant": None})
    for dtype in QUANT_DTYPES:
        for op in QUANT_OPS:
            for n in QUANT_SIZES:
                for wire in QUANT_WIRE:
                    cases.append({"dtype": dtype, "op": op, "n": n, "quant": wire})
    for seed, case in enumerate(cases, start=1000):
        case["seed"] = seed
        case["key"] = f"{case['dtype']}-{case['op']}-{case['n']}-{case['quant'] or 'plain'}"
    return cases


def reduce_op(name: str) -> ReduceOp:
    return ReduceOp[name]
