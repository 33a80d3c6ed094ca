"""A numpy model of the ring all-reduce's exact result, for tests and the simulator's checkers.

The ring folds chunk ``c`` starting at ring position ``c`` and going around the ring
(``acc = x[c]; acc = x[c+1] op acc; …``) in the accumulator type (f32 for f16/bf16), then the
owner divides for AVG (IEEE division for floats, floor division for integers) and rounds once to
the buffer's dtype.  Floating-point sums depend on that order, so a reference that ignores it
would not match bit for bit; this one does (unquantized).  Chunk boundaries are those of
:func:`pccl.protocol.ring.chunk_bounds`.  Small ops run as an exchange
(:func:`pccl.protocol.ring.uses_exchange`): every element is ``x[0] op x[1] op … op x[N-1]``
folded left (in f32 for f16/bf16, rounded once), and a NaN result is the canonical quiet NaN.

:func:`halving_reference` models the halving-doubling family (:mod:`pccl.collectives.halving`):
the fold's ``x[2i] op x[2i+1]``, then a fixed tree over the virtual ranks, NaN made canonical;
:func:`hierarchical_reference` the hierarchical schedule (:mod:`pccl.collectives.hierarchical`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..protocol.algorithms import (
    AllReduceAlgorithm,
    choose_all_reduce,
    position_of,
    power_of_two_below,
    wants_partner_links,
)
from ..protocol.sites import site_table
from ..protocol.ring import EXCHANGE_MAX_BYTES, chunk_bounds, uses_exchange
from ..types import DType, ReduceOp, dtype_of

__all__ = ["ring_reference", "halving_reference", "hierarchical_reference", "all_reduce_reference"]

_NP_OP: dict[ReduceOp, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


def ring_reference(inputs_in_ring_order: Sequence[np.ndarray], op: ReduceOp, *,
                   exchange_max_bytes: int = EXCHANGE_MAX_BYTES) -> np.ndarray:
    """The all-reduce of ``inputs_in_ring_order`` (one array per participant, in the order of the
    master's ``Commence.ring``) as the unquantized ring computes it, as a new flat array
    (``exchange_max_bytes``: as passed to :func:`~pccl.collectives.allreduce.ring_all_reduce`)."""
    world = len(inputs_in_ring_order)
    if world == 0:
        raise ValueError("need at least one input")
    op = ReduceOp(op)
    flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs_in_ring_order]
    dtype = flat[0].dtype
    half = dtype_of(dtype) in (DType.FLOAT16, DType.BFLOAT16)
    acc_t = np.dtype(np.float32) if half else dtype
    out = np.empty(flat[0].size, dtype)
    exchange = uses_exchange(world, flat[0].nbytes, quantized=False, max_bytes=exchange_max_bytes)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for c, (start, stop) in enumerate(((0, flat[0].size),) if exchange else chunk_bounds(flat[0].size, world)):
            if exchange:
                acc = flat[0][start:stop].astype(acc_t)
                for j in range(1, world):
                    acc = _NP_OP[op](acc, flat[j][start:stop].astype(acc_t))
                if np.issubdtype(acc_t, np.floating):
                    acc[np.isnan(acc)] = np.nan
            else:
                acc = flat[c][start:stop].astype(acc_t)
                for j in range(1, world):
                    acc = _NP_OP[op](flat[(c + j) % world][start:stop].astype(acc_t), acc)
            if op is ReduceOp.AVG:
                divisor = acc_t.type(world)
                acc = acc // divisor if np.issubdtype(acc_t, np.integer) else acc / divisor
            out[start:stop] = acc.astype(dtype)
    return out


def halving_reference(inputs_in_ring_order: Sequence[np.ndarray], op: ReduceOp,
                      algorithm: AllReduceAlgorithm) -> np.ndarray:
    """The all-reduce of ``inputs_in_ring_order`` as ``algorithm`` (recursive doubling or
    halving-doubling) computes it, as a new flat array.  Every combination is
    ``lower op upper``, ``lower`` the partial of the lower virtual rank (the fold: the folded
    peer's input, at the lower ring position).  Recursive doubling pairs virtual ranks at
    distance 1 first (``v[2i] op v[2i+1]``, then pairs of those...); Rabenseifner's halving
    pairs them at distance ``P/2`` first (``v[i] op v[i+P/2]``, then at ``P/4``: partials of
    interleaved virtual ranks...).  Then AVG's division, canonical NaN, one rounding."""
    world = len(inputs_in_ring_order)
    if world == 0:
        raise ValueError("need at least one input")
    op = ReduceOp(op)
    flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs_in_ring_order]
    dtype = flat[0].dtype
    half = dtype_of(dtype) in (DType.FLOAT16, DType.BFLOAT16)
    acc_t = np.dtype(np.float32) if half else dtype
    size = power_of_two_below(world)
    extra = world - size
    fn = _NP_OP[op]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        vals = []
        for v in range(size):
            position = position_of(v, world)
            val = flat[position].astype(acc_t)
            if v < extra:  # the fold: the peer before it sent its input
                val = fn(flat[position - 1].astype(acc_t), val)
            vals.append(val)
        while len(vals) > 1:
            d = len(vals) // 2
            if algorithm is AllReduceAlgorithm.RECURSIVE_DOUBLING:
                vals = [fn(vals[2 * i], vals[2 * i + 1]) for i in range(d)]
            else:
                vals = [fn(vals[i], vals[i + d]) for i in range(d)]
        acc = vals[0]
        if op is ReduceOp.AVG:
            divisor = acc_t.type(world)
            acc = acc // divisor if np.issubdtype(acc_t, np.integer) else acc / divisor
        if np.issubdtype(acc_t, np.floating):
            acc[np.isnan(acc)] = np.nan
        return acc.astype(dtype)


def hierarchical_reference(inputs_in_ring_order: Sequence[np.ndarray], op: ReduceOp,
                           sites: tuple[int, ...]) -> np.ndarray:
    """The all-reduce of ``inputs_in_ring_order`` as the hierarchical schedule computes it
    (:mod:`pccl.collectives.hierarchical`; ``sites``: the site of each ring position), as a
    new flat array: each site's inputs folded in ring order (``x[0] op x[1] op ..``, the site's
    peers), then the site partials folded in site order, in the accumulator type; then AVG's
    division, canonical NaN, one rounding."""
    table = site_table(sites)
    if table is None or len(sites) != len(inputs_in_ring_order):
        raise ValueError(f"sites {sites!r} do not suit the hierarchical schedule of {len(inputs_in_ring_order)} inputs")
    op = ReduceOp(op)
    flat = [np.ascontiguousarray(x).reshape(-1) for x in inputs_in_ring_order]
    dtype = flat[0].dtype
    half = dtype_of(dtype) in (DType.FLOAT16, DType.BFLOAT16)
    acc_t = np.dtype(np.float32) if half else dtype
    fn = _NP_OP[op]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        partials = []
        for positions in table:
            part = flat[positions[0]].astype(acc_t)
            for p in positions[1:]:
                part = fn(part, flat[p].astype(acc_t))
            partials.append(part)
        acc = partials[0]
        for part in partials[1:]:
            acc = fn(acc, part)
        if op is ReduceOp.AVG:
            divisor = acc_t.type(len(flat))
            acc = acc // divisor if np.issubdtype(acc_t, np.integer) else acc / divisor
        if np.issubdtype(acc_t, np.floating):
            acc[np.isnan(acc)] = np.nan
        return acc.astype(dtype)


def all_reduce_reference(inputs_in_ring_order: Sequence[np.ndarray], op: ReduceOp, *,
                         algorithm: AllReduceAlgorithm | None = None, partner_links: bool | None = None,
                         exchange_max_bytes: int = EXCHANGE_MAX_BYTES, sites: tuple[int, ...] = ()) -> np.ndarray:
    """The unquantized all-reduce of a whole :class:`~pccl.Communicator` (one flat, unsegmented
    buffer per participant, in ring order): the model of the algorithm the data path chooses
    (:func:`~pccl.protocol.algorithms.choose_all_reduce`).  ``algorithm``: what
    ``Config.all_reduce_algorithm`` forces (``None``: auto); ``partner_links``: whether the ring
    has them (default: as the topology round wires them,
    :func:`~pccl.protocol.algorithms.wants_partner_links`); ``sites``: the round's sites
    (``Communicator.sites``; the hierarchical schedule runs when they suit it)."""
    world = len(inputs_in_ring_order)
    first = np.ascontiguousarray(inputs_in_ring_order[0])
    half = dtype_of(first.dtype) in (DType.FLOAT16, DType.BFLOAT16)
    links = wants_partner_links(world, algorithm) if partner_links is None else partner_links
    chosen = choose_all_reduce(first.nbytes, world, itemsize=first.itemsize, acc_itemsize=4 if half else first.itemsize,
                               quantized=False, segmented=False, partner_links=links,
                               exchange_max_bytes=exchange_max_bytes, forced=algorithm, sites=sites,
                               site_links=True)
    if chosen is AllReduceAlgorithm.HIERARCHICAL:
        return hierarchical_reference(inputs_in_ring_order, op, sites)
    if chosen is AllReduceAlgorithm.RING:
        return ring_reference(inputs_in_ring_order, op, exchange_max_bytes=exchange_max_bytes)
    return halving_reference(inputs_in_ring_order, op, chosen)
