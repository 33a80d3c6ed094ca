"""Wherever pccl takes a dtype it takes a ``pccl.DType`` and a torch dtype as well as a numpy one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import pccl
from pccl.types import dtype_of


@pytest.mark.parametrize("member", list(pccl.DType))
def test_every_dtype_member_is_a_dtype(member: pccl.DType) -> None:
    assert dtype_of(member) is member


@pytest.mark.parametrize("dtype", [pccl.DType.UINT8, np.uint8, "uint8"])
def test_quantization_takes_a_dtype_member(dtype: object) -> None:
    q = pccl.Quantization(pccl.QuantKind.MIN_MAX, dtype)
    assert dtype_of(q.dtype) is pccl.DType.UINT8


def test_quantization_still_refuses_a_float_target() -> None:
    with pytest.raises(pccl.InvalidArgument, match="uint8 or uint16"):
        pccl.Quantization(pccl.QuantKind.MIN_MAX, pccl.DType.FLOAT32)


def test_torch_dtypes_are_dtypes() -> None:
    assert dtype_of(torch.int16) is pccl.DType.INT16
    assert dtype_of(torch.bfloat16) is pccl.DType.BFLOAT16
    assert dtype_of(torch.half) is pccl.DType.FLOAT16
    assert dtype_of(pccl.Quantization(dtype=torch.uint8).dtype) is pccl.DType.UINT8


def test_what_is_no_dtype_says_what_is() -> None:
    with pytest.raises(pccl.InvalidArgument, match="a numpy dtype, a torch dtype or a pccl.DType"):
        dtype_of(object())


@pytest.mark.parametrize("target", ["uint4", "u4", "ml_dtypes", "np.dtype", "torch"])
def test_quantization_takes_four_bit_targets(target: str) -> None:
    import ml_dtypes

    dtype = {"uint4": "uint4", "u4": "u4", "ml_dtypes": ml_dtypes.uint4, "np.dtype": np.dtype(ml_dtypes.uint4),
             "torch": getattr(torch, "uint4", "uint4")}[target]
    q = pccl.Quantization(pccl.QuantKind.MIN_MAX, dtype, block=128)
    assert (q.bits, q.block, q.code_dtype) == (4, 128, pccl.DType.UINT8)


@pytest.mark.parametrize("dtype,bits", [(np.uint8, 8), (pccl.DType.UINT16, 16), (torch.uint8, 8)])
def test_blocks_work_with_eight_and_sixteen_bits(dtype: object, bits: int) -> None:
    q = pccl.Quantization(dtype=dtype, block=np.int64(64))
    assert (q.bits, q.block) == (bits, 64) and type(q.block) is int


@pytest.mark.parametrize("kwargs,message", [
    (dict(dtype="uint3"), 'needs dtype "uint4", uint8 or uint16'),
    (dict(dtype=np.int8), 'needs dtype "uint4", uint8 or uint16'),
    (dict(dtype="uint4", block=0), r"block must be None or an integer in \[1, 2\*\*31\]"),
    (dict(dtype="uint4", block=2**31 + 1), r"block must be None or an integer"),
    (dict(dtype="uint4", block=1.5), r"block must be None or an integer"),
    (dict(dtype="uint4", block=True), r"block must be None or an integer"),
    (dict(kind=pccl.QuantKind.NONE, block=8), "a quantization block needs kind MIN_MAX"),
    (dict(kind=9), "quantization kind must be a QuantKind"),
])
def test_bad_quantizations_are_invalid_argument_saying_why(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(pccl.InvalidArgument, match=message):
        pccl.Quantization(**kwargs)  # type: ignore[arg-type]
