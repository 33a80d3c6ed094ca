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
