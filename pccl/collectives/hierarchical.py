"""Hierarchical all-reduce across sites: reduce-scatter in each site, all-reduce of each shard
across the sites, all-gather in each site.

When the master's link measurements show sites (:mod:`pccl.protocol.sites`) that suit it
(:func:`~pccl.protocol.sites.site_table`: ``S >= 2`` sites of at least two peers; ``rank`` below
is a peer's index in its site, in ring order; ``K`` the smallest site's size), an all-reduce
runs in four steps over partner links (:func:`~pccl.protocol.algorithms.site_partners`):

1. **Reduce-scatter in the site.**  The buffer is cut into ``K`` shards
   (:func:`~pccl.collectives.halving.block_bounds`); every peer sends shard ``j`` of its input to
   the peer of rank ``j`` of its site, which folds the ``L`` contributions of its site in rank
   order: ``x[0] op x[1] op .. op x[L-1]``.  Ranks from ``K`` up own no shard: they send in this
   step and receive in the last one only.
2. **Reduce-scatter across sites.**  Shard ``j`` is cut into ``S`` pieces; the peer of rank
   ``j`` in site ``s`` sends piece ``t`` of its site's partial to the peer of rank ``j`` in site
   ``t``, which folds the ``S`` site partials in site order: ``p[0] op p[1] op .. op p[S-1]``,
   then finalizes (AVG's division, canonical NaN, one rounding for f16/bf16) into the caller's
   buffer.
3. **All-gather across sites** of those pieces among the peers of rank ``j``, then
4. **all-gather in the site** of the shards.

Bit-identical results: every element is combined at one place only, in one fixed order
(ranks in site order, then sites in ring order), and copied from there to every peer; the
reference model is :func:`~pccl.collectives.reference.hierarchical_reference`.  Partial results
travel in the accumulator's dtype (f32 for f16/bf16).

Why shards rather than the leader scheme (reduce to a site leader, ring across the leaders,
broadcast in the site): for ``B`` bytes each site's uplink carries ``2 (S - 1) / S * B`` out in
both schemes (the optimised flat ring: ``2 (N - 1) / N * B``), but the leader receives
``(L - 1) B`` and sends as much in its site, where here every peer moves ``2 (L - 1) / L * B``
inside; and the leaders' ring takes ``2 (S - 1)`` steps across sites where this takes two.
docs/collectives.rst gives the cost model.

The op is a :class:`~pccl.collectives.halving.HalvingDoublingOp` in everything but its
schedule: the same partner links and turns, the same scratch memory (working copy, and a stage of one
shard),
the same whole-buffer save before the first write of the caller's buffer (restored by
:func:`~pccl.collectives.execute.execute` on an abort), the same single exception.
"""

from __future__ import annotations

import numpy as np
import trio

from .. import kernels
from ..protocol.algorithms import AllReduceAlgorithm
from ..protocol.codec import DataHeader
from ..protocol.sites import site_table
from .backup import InputBackup
from .buffers import KernelRunner, OpBuffers
from .halving import HalvingDoublingOp, block_bounds
from .links import RingLinks

__all__ = ["HierarchicalOp"]


class HierarchicalOp(HalvingDoublingOp):
    """One all-reduce on this peer by the hierarchical schedule (module docstring)."""

    def __init__(self, bufs: OpBuffers, *, links: RingLinks, rank: int, world: int, seq: int,
                 backup: InputBackup | None, runner: KernelRunner) -> None:
        table = site_table(links.sites)
        assert table is not None and len(links.sites) == world
        count = bufs.src.size
        largest = block_bounds(count, min(len(t) for t in table), 0)   # shard 0 is the longest
        super().__init__(bufs, algorithm=AllReduceAlgorithm.HIERARCHICAL, links=links, rank=rank, world=world,
                         seq=seq, backup=backup, runner=runner, stage_count=largest[1] - largest[0])
        #: Ring positions by site, each site's in rank order.
        self.table = table
        self.site = links.sites[rank]
        self.site_rank = table[self.site].index(rank)
        #: Shards: the smallest site's size (the ranks below it own one each, in every site).
        self.shards = min(len(t) for t in table)
        #: Where a fold accumulates (one shard at most, in the accumulator's dtype).
        self.fold_into = bufs.take((largest[1] - largest[0]) * self.work.itemsize).view(self.work.dtype)

    async def _run(self) -> None:
        bufs, work = self.bufs, self.work
        await self._kernel(work.nbytes, kernels.widen if bufs.half else np.copyto, work, self.src)
        site, me, table, shards = self.site, self.site_rank, self.table, self.shards
        peers, sites = len(table[site]), len(table)
        owner = me < shards
        mine = block_bounds(self.count, shards, me) if owner else (0, 0)
        # 1: shards to their owners in the site, fold mine (if any) in rank order.
        sends = [(table[site][j], block_bounds(self.count, shards, j)) for j in range(shards) if j != me]
        await self._fold(1, sends, self.work, list(table[site]), me, mine)
        if not owner:
            await self._save_dst()
            await self._gather(4, [(table[site][j], block_bounds(self.count, shards, j)) for j in range(shards)],
                               (0, 0))
            return
        await self._kernel(self.fold_into.nbytes, np.copyto, work[mine[0]:mine[1]],
                           self.fold_into[: mine[1] - mine[0]])
        # 2: pieces of my site's partial to their owners across sites, fold mine in site order.
        piece = _piece(mine, sites, site)
        sends = [(table[t][me], _piece(mine, sites, t)) for t in range(sites) if t != site]
        await self._fold(2, sends, self.work, [table[t][me] for t in range(sites)], site, piece)
        await self._kernel(self.fold_into.nbytes, np.copyto, work[piece[0]:piece[1]],
                           self.fold_into[: piece[1] - piece[0]])
        await self._save_dst()
        await self._finalize(*piece)
        # 3 and 4: the final values back, across sites, then in the site.
        await self._gather(3, [(table[t][me], _piece(mine, sites, t)) for t in range(sites) if t != site], piece)
        await self._gather(4, [(table[site][j], block_bounds(self.count, shards, j) if j < shards else (0, 0))
                               for j in range(peers) if j != me], mine)

    async def _fold(self, step: int, sends: list[tuple[int, tuple[int, int]]], wire: np.ndarray,
                    order: list[int], own: int, kept: tuple[int, int]) -> None:
        """Send ``wire[range]`` to each ``(position, range)`` of ``sends`` while folding elements
        ``kept`` over the peers at ``order`` (this peer at index ``own``: its ``work``) into
        :attr:`fold_into`, in that order: ``order[0] op order[1] op ..``."""
        a, b = kept
        n = b - a
        acc = self.fold_into[:n]
        item = wire.itemsize
        async with trio.open_nursery() as nursery:
            for position, (lo, hi) in sends:
                if hi > lo:
                    header = DataHeader(op_seq=self.seq, stream=0, step=step, offset=lo * item, nbytes=(hi - lo) * item)
                    nursery.start_soon(self._send, self.links.partners[position], header, wire[lo:hi])
            if n == 0:
                return
            for k, position in enumerate(order):
                if k == own:
                    if k == 0:
                        await self._kernel(acc.nbytes, np.copyto, acc, self.work[a:b])
                    else:
                        await self._kernel(acc.nbytes * 2, kernels.reduce_into, acc, self.work[a:b], self.bufs.op)
                    continue
                into = acc if k == 0 else self.stage[:n]
                self.rx_bytes += await self.links.partners[position].receive_into(
                    seq=self.seq, stream=0, step=step, offset=a * item, destination=into.view(np.uint8).data)
                if k:
                    await self._kernel(acc.nbytes * 2, kernels.reduce_into, acc, into, self.bufs.op)

    async def _gather(self, step: int, peers: list[tuple[int, tuple[int, int]]], mine: tuple[int, int]) -> None:
        """Send the final ``dst[mine]`` to every peer of ``peers``, and receive each one's
        range of the result into ``dst`` (an empty range: nothing either way)."""
        dst, item = self.dst, self.dst.itemsize
        a, b = mine
        async with trio.open_nursery() as nursery:
            if b > a:
                for position, _ in peers:
                    header = DataHeader(op_seq=self.seq, stream=0, step=step, offset=a * item, nbytes=(b - a) * item)
                    nursery.start_soon(self._send, self.links.partners[position], header, dst[a:b])
            for position, (lo, hi) in peers:
                if hi > lo:
                    self.rx_bytes += await self.links.partners[position].receive_into(
                        seq=self.seq, stream=0, step=step, offset=lo * item, destination=dst[lo:hi].view(np.uint8).data)


def _piece(shard: tuple[int, int], sites: int, index: int) -> tuple[int, int]:
    """Elements of piece ``index`` of ``shard`` cut in ``sites`` pieces."""
    lo, hi = block_bounds(shard[1] - shard[0], sites, index)
    return shard[0] + lo, shard[0] + hi
