"""The one place that turns a caller's array into the numpy view pccl works on.

Everywhere pccl takes an array (``all_reduce``, ``all_reduce_many``, ``SharedState``) it accepts
a C-contiguous numpy array or a CPU torch tensor, and works on the caller's memory: a torch
tensor becomes its zero-copy numpy view (bfloat16 through an int16 view re-typed as
``ml_dtypes.bfloat16``, since numpy has no bfloat16 of its own).  Nothing here copies; what
cannot be viewed without a copy (a CUDA tensor, a non-contiguous one, one that requires grad) is
:class:`~pccl.errors.InvalidArgument` saying what to pass instead.

torch is optional: it is never imported here; a tensor can only exist once its caller imported
torch, so ``sys.modules`` tells whether an object may be one.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .errors import InvalidArgument
from .types import DType, dtype_of

__all__ = ["as_array", "is_torch_tensor", "like_input"]


def is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_array(obj: object, *, name: str = "array", writable: bool = True) -> np.ndarray:
    """``obj`` as a C-contiguous numpy array sharing its memory, of a dtype pccl supports.

    ``name`` is how error messages call the argument; ``writable`` refuses read-only arrays
    (results and received state are written into them).  Raises ``InvalidArgument``.
    """
    if isinstance(obj, np.ndarray):
        array = obj
    elif is_torch_tensor(obj):
        array = _tensor_view(obj, name)
    elif obj is None:
        raise InvalidArgument(f"{name} must be a numpy array or a CPU torch tensor, got NoneType (a parameter's "
                              ".grad is None until a backward pass has computed it, and for parameters that do "
                              "not require grad or took no part in the loss)")
    else:
        raise InvalidArgument(f"{name} must be a numpy array or a CPU torch tensor, got {type(obj).__name__}")
    if not array.flags.c_contiguous:
        raise InvalidArgument(f"{name} must be C-contiguous: pass np.ascontiguousarray(array) and keep that "
                              "array (the result lands in it)")
    if writable and not array.flags.writeable:
        raise InvalidArgument(f"{name} is read-only: pccl writes results into it")
    dtype_of(array.dtype)  # InvalidArgument for unsupported dtypes
    return array


def _tensor_view(tensor: Any, name: str) -> np.ndarray:
    import torch  # present: tensor is one

    if tensor.device.type != "cpu":
        raise InvalidArgument(f"{name} is a torch tensor on {tensor.device}; pccl works on CPU memory: pass "
                              "tensor.cpu() and copy the result back")
    if tensor.layout != torch.strided:
        raise InvalidArgument(f"{name} is a {tensor.layout} torch tensor; pass tensor.to_dense()")
    if tensor.requires_grad:
        raise InvalidArgument(f"{name} requires grad; pass tensor.detach() (it shares the memory) or reduce "
                              "the .grad tensors")
    if not tensor.is_contiguous():
        raise InvalidArgument(f"{name} is not contiguous: pass tensor.contiguous() and keep that tensor "
                              "(the result lands in it)")
    if tensor.is_conj() or tensor.is_neg():
        raise InvalidArgument(f"{name} has a lazy conjugate/negation bit; pass tensor.resolve_conj().resolve_neg()")
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(DType.BFLOAT16.numpy_dtype())
    try:
        return tensor.numpy()
    except (TypeError, RuntimeError) as exc:  # dtypes numpy lacks (complex32, float8, quantized)
        raise InvalidArgument(f"{name} has dtype {tensor.dtype}, which pccl does not support; supported: "
                              f"{', '.join(d.name.lower() for d in DType)}") from exc


def like_input(array: np.ndarray, template: object) -> Any:
    """``array`` as the caller passed its input: a torch tensor sharing ``array``'s memory when
    ``template`` is one (bfloat16 re-typed through int16, as :func:`as_array` views it), else
    ``array`` itself.  No copy."""
    if not is_torch_tensor(template):
        return array
    import torch  # present: template is a tensor

    if array.dtype == DType.BFLOAT16.numpy_dtype():
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
