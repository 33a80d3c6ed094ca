"""The arguments of :class:`pccl.torch.ProcessGroup`'s methods as torch passes them: torch's
reduce ops as pccl's, a bare tensor or a list, the checks torch's own backends make at the call
(dtype, size, layout, device, root), and torch's timeouts in seconds."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidArgument
from ..types import ReduceOp

__all__ = ["OPS", "LOCAL_REDUCE", "torch_reduce_op", "bool_reduce_op", "wire_view", "tensor_list", "dense",
           "check_alike", "contiguous_buffer", "checked_root", "root_list", "split_columns", "timeout_seconds"]

OPS: tuple[tuple[Any, ReduceOp], ...] = (
    (dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVG), (dist.ReduceOp.PRODUCT, ReduceOp.PROD),
    (dist.ReduceOp.MIN, ReduceOp.MIN), (dist.ReduceOp.MAX, ReduceOp.MAX))


def torch_reduce_op(opts: Any, op: Any = None) -> ReduceOp:
    """pccl's op for torch's: ``op`` if given, else ``opts`` — an options object (its
    ``reduceOp``), a ``ReduceOp`` (pybind's ``allreduce(t, ReduceOp.MAX)``) or None (SUM)."""
    if op is None:
        op = opts.reduceOp if hasattr(opts, "reduceOp") else opts
    if op is None:
        return ReduceOp.SUM
    for theirs, ours in OPS:
        if op == theirs:
            return ours
    raise InvalidArgument(f"pccl reduces with SUM, AVG, PRODUCT, MIN or MAX, not {op}")


def bool_reduce_op(opts: Any, op: Any = None) -> ReduceOp:
    """A bool tensor's reduction: MIN or BAND (and), MAX or BOR (or), over its bytes."""
    if op is None:
        op = opts.reduceOp if hasattr(opts, "reduceOp") else opts
    # ``op == theirs``, not ``op in (...)``: a ReduceOp equals its RedOpType, not the reverse
    if op is None or op == dist.ReduceOp.MAX or op == dist.ReduceOp.BOR:
        return ReduceOp.MAX
    if op == dist.ReduceOp.MIN or op == dist.ReduceOp.BAND:
        return ReduceOp.MIN
    raise InvalidArgument(f"pccl reduces bool tensors with MIN or BAND (and), MAX or BOR (or), not {op}")


def wire_view(t: torch.Tensor) -> torch.Tensor:
    """What pccl reduces for ``t``: its bytes when it is a bool tensor (pccl has no bool dtype;
    MIN and MAX over 0/1 bytes are and and or), else ``t``."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def tensor_list(tensors: Any, what: str, noun: str = "tensor list") -> list[torch.Tensor]:
    """torch's tensor arguments as a list: a bare tensor (pybind's ``allreduce(t)``) or a list
    of them; at least one, dense (``InvalidArgument`` otherwise: a sparse tensor has no pccl
    layout, and a bare tensor is never taken for a list of its rows)."""
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if not listed:
        raise InvalidArgument(f"{what} requires non-empty {noun}")
    for index, t in enumerate(listed):
        dense(t, what, index)
    return listed


def dense(t: Any, what: str, index: int = 0) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what} takes torch tensors, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise InvalidArgument(f"{what}: invalid tensor layout at index {index}: pccl takes dense tensors only, "
                              f"not {t.layout} (unsupported layout; sparse gradients, as "
                              "nn.Embedding(sparse=True) makes, need dense ones)")
    if t.device.type != "cpu":
        raise InvalidArgument(f"{what}: pccl takes CPU tensors, got one on {t.device}")
    return t


def check_alike(tensors: Sequence[torch.Tensor], what: str, like: torch.Tensor | None = None) -> None:
    """Every tensor of ``tensors`` has ``like``'s (default: the first's) dtype and element count
    (torch's "invalid tensor type" / "invalid tensor size")."""
    first = like if like is not None else tensors[0]
    for t in tensors:
        if t.dtype != first.dtype:
            raise InvalidArgument(f"{what}: invalid tensor type: {t.dtype}, expected {first.dtype} "
                                  "(pccl does not cast)")
        if t.numel() != first.numel():
            raise InvalidArgument(f"{what}: invalid tensor size: {t.numel()} elements, expected {first.numel()}")


def contiguous_buffer(t: torch.Tensor) -> torch.Tensor:
    """What pccl reads or writes for ``t``: ``t`` itself (detached: the same memory) when it is
    contiguous, else a contiguous copy (whose result the op's finish copies back)."""
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def checked_root(opts: Any, world: int, what: str) -> int:
    root = int(opts.rootRank)
    if not 0 <= root < world:
        raise InvalidArgument(f"{what}: invalid root rank {root}: the group has {world} peers now")
    return root


#: How a peer reduces its several tensors of one all-reduce before the group does (gloo's
#: meaning of ``allreduce([t1, t2])``).
LOCAL_REDUCE: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.AVG: torch.add, ReduceOp.PROD: torch.mul, ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum}


def split_columns(parts: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[list[torch.Tensor]]:
    """Each peer's part of a gathered concatenation, split by ``sizes``: for each tensor, its
    chunks in ring order."""
    columns: list[list[torch.Tensor]] = [[] for _ in sizes]
    for part in parts:
        flat, start = part.reshape(-1), 0
        for column, size in zip(columns, sizes):
            column.append(flat[start:start + size])
            start += size
    return columns


def timeout_seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """torch's timeouts: None or a non-positive timedelta (torch's "unset") mean no limit."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def root_list(lists: Sequence[Sequence[torch.Tensor]], *, rank: int, root: int, world: int, what: str, side: str,
              like: torch.Tensor) -> list[torch.Tensor]:
    """The per-peer tensor list of a rooted op (gather's outputs, scatter's inputs): at the root
    one list of ``world`` dense tensors like ``like``; elsewhere none (``[]``).  Checked with
    gloo's words."""
    if rank != root:
        if lists:
            raise InvalidArgument(f"{what} requires empty {side} on non-root peers")
        return []
    if len(lists) != 1:
        raise InvalidArgument(f"{what} requires a single-element {side} list at the root, got {len(lists)}")
    tensors = list(lists[0])
    if len(tensors) != world:
        label = side.capitalize()
        raise InvalidArgument(f"{what}: Incorrect {side} list size {len(tensors)}. {label} list size "
                              f"should be {world}")
    for t in tensors:
        dense(t, what)
    check_alike(tensors, what, like=like)
    return tensors
