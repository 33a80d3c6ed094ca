"""Latency-optimal all-reduce for small buffers and large groups: the halving-doubling family.

A ring all-reduce pays ``2 (N - 1)`` link latencies (its exchange schedule ``N - 1``): at 64 peers
a 4 KiB all-reduce waits for 126 hops.  :class:`HalvingDoublingOp` runs the two algorithms of
:mod:`pccl.protocol.algorithms` instead, with the fold for non-powers of two:

* **recursive doubling**, ``log2 P`` steps: each peer swaps its whole working buffer with the peer
  whose virtual rank differs in bit ``k``, and both combine the two;
* **Rabenseifner** (``HALVING_DOUBLING``), ``2 log2 P`` steps: recursive halving (each peer
  keeps half of what is left and sends the other half to its partner) leaves virtual rank ``v``
  with block ``v`` reduced over everyone; recursive doubling then gathers the blocks.

Bit-identical results
---------------------
Every combination of two partial results is formed as ``lower op upper``, whichever peer
computes it (the kernel's ``dst op= src`` with ``dst`` the lower one: MIN/MAX of +0 and -0 and
float sums depend on the operand order).  ``lower`` is the partial of the partner with the lower
virtual rank, and in the fold the folded peer's input (it sits at the lower ring position).  In
recursive doubling that partial covers a run of virtual ranks just below the other's; in
Rabenseifner's halving, at distance ``d`` each partial covers the virtual ranks of one residue
class modulo ``2d`` (``r`` and ``r + d``, ``r`` the smaller), so the two interleave and ``lower``
is the one whose smallest virtual rank is lower (:func:`~pccl.collectives.reference.halving_reference`
spells the tree out).  In
recursive doubling both partners compute the same combination of the same bits, so after step
``k`` every peer of an aligned block of ``2^(k+1)`` virtual ranks holds the same bits, and after
the last step everyone does.  In Rabenseifner each element is combined at one place per level
and its final value is copied from its block's owner.  f16/bf16 accumulate in f32 (partial
results travel as f32) and are rounded once at the end; AVG divides the sum by the world size
once at the end (floats: IEEE division; integers: floor division); NaN results are made the
canonical quiet NaN (which NaN payload a sum keeps depends on the instruction the kernel used
for that element, so on alignment); the kernels compute in IEEE's default mode whatever the
calling thread's.  Quantized ops never come here: they take the ring, where only a chunk's
owner quantizes (:func:`~pccl.protocol.algorithms.choose_all_reduce`).

Links
-----
Partners at distance ``2^k`` in ring order are not ring neighbours.  The op exchanges with them
over *partner links*: one framed connection per partner, part of the ring's
:class:`~pccl.collectives.links.RingLinks` (:attr:`~pccl.collectives.links.RingLinks.partners`),
demultiplexed by seq with the same :class:`~pccl.collectives.links.Inbox` as the ring's lanes.
Why not ``Communicator.send``/``recv``'s point-to-point connections: a point message is a
rendezvous (offer, ready, data, acknowledgement: three link latencies where a collective step
needs one), its tags are the user's, and its failures are reported per call rather than
through the op's seq; the partner links carry bare data frames with no handshake per step, so a
step costs one latency, and they live and die with the ring's wiring (a re-wire after an abort
rebuilds them with the lanes).

Turns
-----
Ops on the partner links run one at a time, in commence order (a
:class:`~pccl.collectives.turns.ThreadTurns` with one slot,
:attr:`~pccl.collectives.links.RingLinks.partner_turns`).  A link is read in the order its
frames come, a frame of another op waiting for its owner; with ops whose partners come in
different orders (recursive doubling at distance 1 first, Rabenseifner at ``P/2`` first) and
peers that went through them in different orders, each op could wait behind a frame of the
other.  In commence order every peer runs the earliest unfinished op, whose frames precede every
later op's on every link.  Concurrent small ops therefore queue (each takes ``log2 N`` link
latencies) while ring ops run beside them on the lanes.  Except begun ops (fast commit's derived
seqs), which run beside each other: two of them meet on a peer only in a crossing, whose
commence order differs between peers (in turns each peer's first op waited for the other's
frames until the watchdog), and a partner link keeps another running begun op's frames in
memory rather than parking them (docs/protocol.rst, "Crossings").  An op whose seq was not recorded as
commenced (:meth:`~pccl.collectives.seq_registry.SeqRegistry.commenced`; the collectives called
directly, without a communicator) has no order known to be the same on every peer: it takes
the turn only if it is free, and raises ``InvalidUsage`` when another op holds or awaits it
(record the seqs as commenced, in the same order on every peer, to run such ops at once).

Aborts
------
A step sends in a child task while the calling task receives, both inside one nursery: a
cancellation or an error (a broken partner link, a frame that does not fit the schedule) stops
both, and the op raises exactly one exception (:func:`~pccl._groups.single_exception`).  The
caller's buffer is written only from the moment the final values exist (the result's blocks in
Rabenseifner's gather, the whole result otherwise), each time saved first into the
:class:`~pccl.collectives.backup.InputBackup` the executor gives an in-place op, which restores
it (:func:`~pccl.collectives.execute.execute`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from .. import kernels
from .._groups import single_exception
from ..protocol.algorithms import (
    AllReduceAlgorithm,
    fold_partner,
    position_of,
    power_of_two_below,
    virtual_rank,
)
from ..protocol.codec import DataHeader
from ..types import ReduceOp
from .backup import InputBackup
from .buffers import KernelRunner, OpBuffers
from .links import Inbox, RingLinks

__all__ = ["HalvingDoublingOp", "block_bounds"]


def block_bounds(count: int, blocks: int, index: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of block ``index`` of ``count`` split in ``blocks`` (the first
    ``count % blocks`` one element longer)."""
    base, extra = divmod(count, blocks)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class HalvingDoublingOp:
    """One all-reduce on this peer by recursive doubling or Rabenseifner (module docstring).

    Made on the Trio thread with its scratch memory; :meth:`run` moves the data; the executor
    (:func:`~pccl.collectives.execute.execute`) calls :meth:`release` once it has stopped.
    """

    def __init__(self, bufs: OpBuffers, *, algorithm: AllReduceAlgorithm, links: RingLinks, rank: int,
                 world: int, seq: int, backup: InputBackup | None, runner: KernelRunner,
                 stage_count: int | None = None) -> None:
        assert algorithm is not AllReduceAlgorithm.RING and not bufs.quantized
        assert isinstance(bufs.src, np.ndarray) and isinstance(bufs.dst, np.ndarray)
        self.bufs = bufs
        self.algorithm = algorithm
        self.links = links
        self.rank = rank
        self.world = world
        self.seq = seq
        self.backup = backup
        self.runner = runner
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.src: np.ndarray = bufs.src
        self.dst: np.ndarray = bufs.dst
        self.count = count = bufs.src.size
        acc = np.dtype(np.float32) if bufs.half else bufs.src.dtype
        #: The partial result, in the accumulator's dtype; what is swapped with partners (for
        #: f16/bf16 the buffers' f32 working array; never the caller's buffer).
        if bufs.half:
            assert isinstance(bufs.acc, np.ndarray)
            self.work = bufs.acc
        else:
            self.work = bufs.take(count * acc.itemsize).view(acc)
        #: Where a partner's partial lands before it is combined with :attr:`work` (``stage_count``
        #: elements: the whole buffer unless a schedule receives less at a time).
        self.stage = bufs.take((count if stage_count is None else stage_count) * acc.itemsize).view(acc)
        self.size = power_of_two_below(world)
        self.vrank = virtual_rank(rank, world)
        self.fold = fold_partner(rank, world)
        self._dst_saved = False
        self._step = 0

    # --- what the executor asks -------------------------------------------------------------------

    def moves_nothing(self) -> bool:
        return self.count == 0

    def release(self) -> None:
        self.bufs.release()

    # --- the run ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the op (see the module docstring for errors and cancellation), once its turn on
        the partner links came (cancellable while it waits)."""
        async with self.links.partner_turn(self.seq, f"all-reduce seq {self.seq}"):
            try:
                await self._run()
            except BaseExceptionGroup as group:
                raise single_exception(group) from None

    async def _run(self) -> None:
        bufs, work = self.bufs, self.work
        await self._kernel(work.nbytes, kernels.widen if bufs.half else np.copyto, work, self.src)
        if self.vrank is None:  # fold in, take the result from the partner at the end
            assert self.fold is not None
            await self._exchange(self.fold, send=(0, self.count), receive=None, wire=work)
            self._step = self._last_step()
            await self._save_dst()
            await self._exchange(self.fold, send=None, receive=(0, self.count), wire=self.dst)
            return
        if self.fold is not None:  # the folded peer is at the lower ring position
            await self._exchange(self.fold, send=None, receive=(0, self.count), wire=work)
            await self._combine(0, self.count, own_is_lower=False)
        self._step = 1
        if self.algorithm is AllReduceAlgorithm.RECURSIVE_DOUBLING:
            await self._recursive_doubling()
        else:
            await self._rabenseifner()
        if self.fold is not None:
            self._step = self._last_step()
            await self._exchange(self.fold, send=(0, self.count), receive=None, wire=self.dst)

    def _last_step(self) -> int:
        steps = self.size.bit_length() - 1
        return 1 + (steps if self.algorithm is AllReduceAlgorithm.RECURSIVE_DOUBLING else 2 * steps)

    async def _recursive_doubling(self) -> None:
        assert self.vrank is not None
        distance = 1
        while distance < self.size:
            partner = self.vrank ^ distance
            await self._exchange(position_of(partner, self.world), send=(0, self.count), receive=(0, self.count),
                                 wire=self.work)
            await self._combine(0, self.count, own_is_lower=self.vrank < partner)
            distance <<= 1
        await self._save_dst()
        await self._finalize(0, self.count)

    async def _rabenseifner(self) -> None:
        v, size = self.vrank, self.size
        assert v is not None
        lo, hi = 0, size  # the blocks this peer still reduces
        distance = size >> 1
        while distance:
            lower = not v & distance
            keep, give = ((lo, lo + distance), (lo + distance, hi)) if lower else ((lo + distance, hi), (lo, lo + distance))
            kept, given = self._blocks(*keep), self._blocks(*give)
            await self._exchange(position_of(v ^ distance, self.world), send=given, receive=kept, wire=self.work)
            await self._combine(*kept, own_is_lower=lower)
            lo, hi = keep
            distance >>= 1
        assert (lo, hi) == (v, v + 1)
        await self._save_dst()
        await self._finalize(*self._blocks(v, v + 1))
        distance = 1
        while distance < size:
            held = v - v % distance
            partner_held = held ^ distance
            await self._exchange(position_of(v ^ distance, self.world), send=self._blocks(held, held + distance),
                                 receive=self._blocks(partner_held, partner_held + distance), wire=self.dst)
            distance <<= 1

    def _blocks(self, first: int, stop: int) -> tuple[int, int]:
        """Elements of blocks ``[first, stop)``."""
        return block_bounds(self.count, self.size, first)[0], block_bounds(self.count, self.size, stop - 1)[1]

    # --- one step -----------------------------------------------------------------------------------

    async def _exchange(self, partner: int, *, send: tuple[int, int] | None, receive: tuple[int, int] | None,
                        wire: np.ndarray) -> None:
        """This step's frames with ``partner``: ``wire[send]`` out, and in, the partner's
        ``wire[receive]`` into :attr:`stage` (the working dtype) or, when ``wire`` is the
        result, into :attr:`dst` itself.  Empty ranges move no frame (both sides agree)."""
        step = self._step
        self._step += 1
        inbox = self.links.partners[partner]
        item = wire.itemsize
        async with trio.open_nursery() as nursery:
            if send is not None and send[1] > send[0]:
                a, b = send
                header = DataHeader(op_seq=self.seq, stream=0, step=step, offset=a * item, nbytes=(b - a) * item)
                nursery.start_soon(self._send, inbox, header, wire[a:b])
            if receive is not None and receive[1] > receive[0]:
                a, b = receive
                into = self.dst[a:b] if wire is self.dst else self.stage[: b - a]
                self.rx_bytes += await inbox.receive_into(seq=self.seq, stream=0, step=step, offset=a * item,
                                                          destination=into.view(np.uint8).data)

    async def _send(self, inbox: Inbox, header: DataHeader, payload: np.ndarray) -> None:
        await inbox.connection.send_data(header, payload.view(np.uint8).data)
        self.tx_bytes += header.nbytes

    async def _combine(self, a: int, b: int, *, own_is_lower: bool) -> None:
        """``work[a:b]`` becomes ``lower op upper`` of it and the partner's partial in :attr:`stage`
        (``own_is_lower``: this peer's partial is the lower one, module docstring)."""
        if b <= a:
            return
        own, other = self.work[a:b], self.stage[: b - a]
        await self._kernel(own.nbytes * 2, _combine, own, other, self.bufs.op, own_is_lower)

    async def _finalize(self, a: int, b: int) -> None:
        """The final values of elements ``[a, b)`` into the caller's buffer: AVG's division, NaN
        made canonical, f16/bf16 rounded once."""
        if b > a:
            await self._kernel(self.work[a:b].nbytes * 2, _finalize, self.work[a:b], self.dst[a:b], self.bufs.op,
                               self.world, self.bufs.half)

    async def _save_dst(self) -> None:
        """In place, the caller's buffer is about to be written first: save it whole (a copy of
        up to the whole buffer, so through the runner: a worker thread when large)."""
        if self.backup is not None and not self._dst_saved and self.bufs.in_place:
            await self._kernel(self.dst.nbytes, self.backup.save, 0, self.count)
        self._dst_saved = True

    async def _kernel(self, nbytes: int, fn: Callable[..., None], *args: Any) -> None:
        if self.runner.inline(nbytes):
            fn(*args)
        else:
            await self.runner.run(nbytes, fn, *args)


def _combine(own: np.ndarray, other: np.ndarray, op: ReduceOp, own_is_lower: bool) -> None:
    if own_is_lower:
        kernels.reduce_into(own, other, op)
    else:
        kernels.reduce_into(other, own, op)
        np.copyto(own, other)


def _finalize(acc: np.ndarray, out: np.ndarray, op: ReduceOp, world: int, half: bool) -> None:
    if op is ReduceOp.AVG:
        kernels.avg_finalize(acc, world)
    if acc.dtype.kind == "f" and acc.size and np.isnan(np.minimum.reduce(acc, axis=None)):
        # (the minimum is NaN iff an element is: one pass, no mask, and no Python-level call)
        acc[np.isnan(acc)] = np.nan
    if half:
        kernels.narrow(out, acc)
    else:
        np.copyto(out, acc)
