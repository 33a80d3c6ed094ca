"""Hierarchical all-reduce across sites: reduce-scatter in each site, all-reduce of each shard
across the sites, all-gather in each site.

When the master's link measurements show sites (:mod:`pccl.protocol.sites`) that suit it
(:func:`~pccl.protocol.sites.site_table`: ``S >= 2`` sites of at least two peers; ``rank`` below
is a peer's index in its site, in ring order; ``K`` the largest site's size), an all-reduce
runs in four steps over partner links (:func:`~pccl.protocol.algorithms.site_partners`):

1. **Reduce-scatter in the site.**  The buffer is cut into ``K`` shards
   (:func:`~pccl.collectives.halving.block_bounds`); in a site of ``L`` peers each rank owns a
   run of one or more consecutive shards (:func:`~pccl.protocol.algorithms.site_shards`: one
   each when ``L = K``).  Every peer sends each run of its input to its owner, which folds the
   ``L`` contributions of its site in rank order: ``x[0] op x[1] op .. op x[L-1]``.
2. **Reduce-scatter across sites.**  A peer's run is cut where any site's runs begin, into
   segments that have one owner in every site (a shard each when the sites are even); each
   segment is cut into ``S`` pieces, and its owner in site ``s`` sends piece ``t`` of its site's
   partial to its owner in site ``t``, which folds the ``S`` site partials in site order:
   ``p[0] op p[1] op .. op p[S-1]``, then finalizes (AVG's division, canonical NaN, one
   rounding for f16/bf16) into the caller's buffer.
3. **All-gather across sites** of those pieces among each segment's owners, then
4. **all-gather in the site** of the runs.

Every peer takes part in every step, so none waits through the steps across sites with no
byte moving on its own connections (its transfer watchdog, ``peer_timeout``, would take that
for a stall: sharding by the smallest site left the larger sites' extra ranks idle there, and
large ops over slow uplinks never completed).  A peer sends its frames to one partner in the
order the partner reads them (one task per partner and step).

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
schedule: the same partner links and turns, the same scratch memory (working copy, and a stage of this
peer's run), the same whole-buffer save before the first write of the caller's buffer (restored by
:func:`~pccl.collectives.execute.execute` on an abort), the same single exception.
"""

from __future__ import annotations

import numpy as np
import trio

from .. import kernels
from ..protocol.algorithms import AllReduceAlgorithm, site_shards
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
        site = links.sites[rank]
        me = table[site].index(rank)
        #: Shards: the largest site's size; each rank of a site owns a run of them (site_shards).
        self.shards = max(len(t) for t in table)
        #: Each site's ranks' runs of shards, and elements.
        self.runs = [[site_shards(table, t, r) for r in range(len(members))] for t, members in enumerate(table)]
        mine = self._elements(count, self.runs[site][me])
        super().__init__(bufs, algorithm=AllReduceAlgorithm.HIERARCHICAL, links=links, rank=rank, world=world,
                         seq=seq, backup=backup, runner=runner, stage_count=mine[1] - mine[0])
        #: Ring positions by site, each site's in rank order.
        self.table = table
        self.site = site
        self.site_rank = me
        #: The elements this peer's run of shards covers (reduced in the site onto it).
        self.mine = mine
        #: Where a fold accumulates (this peer's run at most, in the accumulator's dtype).
        self.fold_into = bufs.take((mine[1] - mine[0]) * self.work.itemsize).view(self.work.dtype)

    def _elements(self, count: int, run: tuple[int, int]) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the shards ``run`` (``[first, stop)``)."""
        first, stop = run
        return block_bounds(count, self.shards, first)[0], block_bounds(count, self.shards, stop - 1)[1]

    def _segments(self) -> list[tuple[int, int]]:
        """This peer's shards cut where any site's runs begin: each segment has one owner per site."""
        cuts = {first for runs in self.runs for first, _ in runs} | {self.shards}
        first, stop = self.runs[self.site][self.site_rank]
        bounds = sorted(c for c in cuts if first <= c <= stop)
        return list(zip(bounds, bounds[1:]))

    def _owner(self, site: int, shard: int) -> int:
        """The ring position of site ``site`` that owns ``shard``."""
        return next(self.table[site][r] for r, (a, b) in enumerate(self.runs[site]) if a <= shard < b)

    async def _run(self) -> None:
        bufs, work = self.bufs, self.work
        await self._kernel(work.nbytes, kernels.widen if bufs.half else np.copyto, work, self.src)
        site, me, table, count = self.site, self.site_rank, self.table, self.count
        peers, sites = len(table[site]), len(table)
        runs = self.runs[site]
        mates = [(table[site][r], self._elements(count, runs[r])) for r in range(peers) if r != me]
        # 1: each run of shards to its owner in the site, fold mine in rank order.
        await self._fold(1, mates, [(list(table[site]), me, self.mine)])
        # 2: pieces of my site's partial to their owners across sites, fold mine in site order,
        # segment by segment (a segment has one owner per site: the pieces' peers).
        segments = [(self._elements(count, g), [self._owner(t, g[0]) for t in range(sites)]) for g in self._segments()]
        sends = [(owners[t], _piece(elements, sites, t)) for elements, owners in segments
                 for t in range(sites) if t != site]
        kept = [_piece(elements, sites, site) for elements, _ in segments]
        await self._fold(2, sends, [(owners, site, piece) for (_, owners), piece in zip(segments, kept)])
        await self._save_dst()
        for piece in kept:
            await self._finalize(*piece)
        # 3 and 4: the final values back, across sites, then in the site.
        await self._gather(3, [(owners[t], piece) for (_, owners), piece in zip(segments, kept)
                               for t in range(sites) if t != site],
                           [(owners[t], _piece(elements, sites, t)) for elements, owners in segments
                            for t in range(sites) if t != site])
        await self._gather(4, [(position, self.mine) for position, _ in mates], mates)

    async def _fold(self, step: int, sends: list[tuple[int, tuple[int, int]]],
                    folds: list[tuple[list[int], int, tuple[int, int]]]) -> None:
        """Send ``work[range]`` to each ``(position, range)`` of ``sends`` (in that order to each
        position) while, for each ``(order, own, kept)`` of ``folds`` in turn, folding elements
        ``kept`` over the peers at ``order`` (this peer at index ``own``: its ``work``) in that
        order, ``order[0] op order[1] op ..``, into ``work[kept]``."""
        item = self.work.itemsize
        async with trio.open_nursery() as nursery:
            self._start_sends(nursery, step, sends, self.work)
            for order, own, (a, b) in folds:
                n = b - a
                if n == 0:
                    continue
                acc = self.fold_into[:n]
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
                # No send reads work[kept]: the pieces sent are the others'.
                await self._kernel(acc.nbytes, np.copyto, self.work[a:b], acc)

    async def _gather(self, step: int, sends: list[tuple[int, tuple[int, int]]],
                      receives: list[tuple[int, tuple[int, int]]]) -> None:
        """Send the final ``dst[range]`` to each ``(position, range)`` of ``sends`` and receive
        each one of ``receives`` into ``dst``, in those orders (empty ranges: no frame)."""
        dst, item = self.dst, self.dst.itemsize
        async with trio.open_nursery() as nursery:
            self._start_sends(nursery, step, sends, dst)
            for position, (lo, hi) in receives:
                if hi > lo:
                    self.rx_bytes += await self.links.partners[position].receive_into(
                        seq=self.seq, stream=0, step=step, offset=lo * item, destination=dst[lo:hi].view(np.uint8).data)

    def _start_sends(self, nursery: trio.Nursery, step: int, sends: list[tuple[int, tuple[int, int]]],
                     wire: np.ndarray) -> None:
        """One task per peer, sending its ranges of ``wire`` in the order listed (the order its
        receives expect them: a connection carries one frame at a time)."""
        by_position: dict[int, list[tuple[int, int]]] = {}
        for position, (lo, hi) in sends:
            if hi > lo:
                by_position.setdefault(position, []).append((lo, hi))
        for position, ranges in by_position.items():
            nursery.start_soon(self._send_ranges, step, position, ranges, wire)

    async def _send_ranges(self, step: int, position: int, ranges: list[tuple[int, int]], wire: np.ndarray) -> None:
        inbox, item = self.links.partners[position], wire.itemsize
        for lo, hi in ranges:
            header = DataHeader(op_seq=self.seq, stream=0, step=step, offset=lo * item, nbytes=(hi - lo) * item)
            await self._send(inbox, header, wire[lo:hi])


def _piece(shard: tuple[int, int], sites: int, index: int) -> tuple[int, int]:
    """Elements of piece ``index`` of ``shard`` cut in ``sites`` pieces."""
    lo, hi = block_bounds(shard[1] - shard[0], sites, index)
    return shard[0] + lo, shard[0] + hi
