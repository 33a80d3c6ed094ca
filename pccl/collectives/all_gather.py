"""Ring all-gather of contributions of any sizes: the second half of the all-reduce's ring.

:func:`all_gather_checked` gathers every participant's contribution (its
:class:`GatherArgs`, checked before the vote) into every participant's output and returns the
payload bytes it sent and received.

Layout
------
``counts[p]`` is the element count of ring position ``p`` (0 allowed; ``counts[rank]`` is this
peer's own ``src.size``).  ``out`` is a flat array of the contributions' dtype with
``sum(counts)`` elements; position ``p``'s contribution lands at offset ``sum(counts[:p])``
(:func:`~pccl.protocol.ring.gather_bounds`).  The caller's input is never written (it may be a
view of its own slot of ``out``: then that slot is not copied at all).

Design
------
The plan is :class:`~pccl.protocol.ring.AllGatherSchedule`: at step ``g`` (``0 … n-2``)
position ``r`` sends chunk ``(r - g) mod n`` — its own first, then what it received last — and
receives chunk ``(r - g - 1) mod n`` straight into ``out`` (zero copy), to forward it verbatim.
The op is a :class:`~pccl.collectives.chain_op.ChainOp`, run by the all-reduce's execution
paths (:func:`~pccl.collectives.execute.execute`) with the same sub-chunk pipelining,
frame headers (``offset`` is the byte offset in ``out``), striping over lanes and abort rules.
Sub-chunks are sized from the largest contribution as the all-reduce sizes them from its
chunks.  Any dtype travels as it is (f16/bf16 too).  Under MIN_MAX quantization (float dtypes)
each source quantizes its own contribution once per sub-chunk (the 16-byte parameter header
and the codes, as the all-reduce's gather store) and applies the dequantized values to its own
slot; every other peer dequantizes the same bytes into its ``out`` and forwards them unchanged,
so every peer's ``out`` is bit-identical, the source's own slot included.  Nothing of the
caller's needs a backup: an abort leaves ``out`` unspecified and the input untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import as_array
from ..errors import InvalidArgument
from ..protocol.ring import DEFAULT_SUBCHUNK_BYTES, AllGatherSchedule, gather_bounds, subchunk_elements
from ..types import DType, dtype_of
from .buffers import KernelRunner, check_quantization, quant_for
from .chain_op import ChainOp
from .execute import Place, execute
from .links import RingLinks
from .wire_quant import WireQuant

__all__ = ["GatherArgs", "all_gather_checked", "all_gather_op"]


@dataclasses.dataclass(frozen=True)
class GatherArgs:
    """One all-gather's contribution, checked: the caller's input as a flat read-only view."""

    src: np.ndarray
    dtype: DType
    #: How min-max quantized frames travel; ``None`` when unquantized.
    quant: WireQuant | None

    @classmethod
    def check(cls, x: Any, quantization: Any) -> GatherArgs:
        """Check ``x`` (a numpy array or CPU torch tensor of any supported dtype, viewed without
        a copy by :func:`pccl.arrays.as_array`) and ``quantization`` (a
        :class:`~pccl.types.Quantization` or ``None``; min-max only for float dtypes).
        :class:`InvalidArgument` says what is wrong, as :meth:`ReduceArgs.check
        <pccl.collectives.buffers.ReduceArgs.check>` would."""
        quantization = check_quantization(quantization)
        src = as_array(x, name="send", writable=False).reshape(-1)
        dtype = dtype_of(src.dtype)
        return cls(src, dtype, quant_for(dtype, quantization))


def _check_output(args: GatherArgs, out: Any, counts: Sequence[int], rank: int, world: int) -> np.ndarray:
    if len(counts) != world or any(int(c) != c or c < 0 for c in counts):
        raise InvalidArgument(f"counts {tuple(counts)} must be {world} non-negative element counts")
    if counts[rank] != args.src.size:
        raise InvalidArgument(f"counts[{rank}] is {counts[rank]} but this peer contributes {args.src.size} elements")
    flat = as_array(out, name="out").reshape(-1)
    if flat.dtype != args.src.dtype or flat.size != sum(counts):
        raise InvalidArgument(
            f"out ({flat.dtype}, {flat.size} elements) must be {args.src.dtype} with sum(counts) = {sum(counts)} elements"
        )
    if args.src.size and np.shares_memory(flat, args.src):
        a, b = gather_bounds(counts)[rank]
        own = flat[a:b]
        if own.__array_interface__["data"][0] != args.src.__array_interface__["data"][0]:
            raise InvalidArgument("send overlaps out other than as its own slot of out")
    return flat


async def all_gather_checked(
    args: GatherArgs,
    out: np.ndarray,
    *,
    counts: Sequence[int],
    links: RingLinks,
    rank: int,
    world: int,
    seq: int,
    runner: KernelRunner | None = None,
    max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES,
) -> tuple[int, int]:
    """Gather every ring position's contribution into ``out`` (see the module docstring for the
    layout): ``args`` is this peer's (:meth:`GatherArgs.check`), ``counts`` every position's
    element count, the same on every peer, as are the dtype, quantization,
    ``max_subchunk_bytes`` and the number of lanes.

    ``rank``/``world``/``links``/``seq`` as for :func:`~pccl.collectives.allreduce.reduce_checked`.
    Returns ``(tx_bytes, rx_bytes)`` (payload bytes, quantization headers included).
    ``InvalidArgument`` for bad ``counts``/``out``/``rank``/``world`` before anything is sent;
    other errors as the all-reduce's.  The seq is retired on exit, whatever the outcome.
    """
    op = await execute(lambda place: all_gather_op(args, out, place, counts=counts,
                                                   max_subchunk_bytes=max_subchunk_bytes),
                       links=links, rank=rank, world=world, seq=seq, runner=runner)
    return op.tx_bytes, op.rx_bytes


def all_gather_op(args: GatherArgs, out: np.ndarray, place: Place, *, counts: Sequence[int],
                  max_subchunk_bytes: int = DEFAULT_SUBCHUNK_BYTES) -> ChainOp:
    """The all-gather of ``args`` into ``out`` at ``place``, ready to run (``InvalidArgument``
    for bad ``counts``/``out``)."""
    flat = _check_output(args, out, counts, place.rank, place.world)
    sub = subchunk_elements(max(counts) * place.world, place.world, args.dtype.itemsize, max_bytes=max_subchunk_bytes)
    schedule = AllGatherSchedule(flat.size, place.world, place.rank, sub, counts=counts)
    # Nothing of the caller's is overwritten: no backup.
    return ChainOp(schedule, src=args.src, out=flat, base=schedule.chunks[place.rank][0], quant=args.quant,
                   links=place.links, world=place.world, seq=place.seq, backup=None, runner=place.runner)
