"""Latency-optimal broadcast for large groups: a pipelined binomial tree over the partner links.

The chain broadcast (:mod:`.broadcast`) takes ``N - 1`` hops: at 64 peers a 4 KiB broadcast
waits for 63 link latencies.  :class:`TreeBroadcastOp` sends the buffer down the binomial tree
of :func:`~pccl.protocol.algorithms.broadcast_tree` instead: ``log2 P`` hops (``P`` the largest
power of two ``<= N``), one more on each side of the fold for a non-power of two.  Every edge of
the tree is a partner link (the halving-doubling all-reduce's,
:attr:`~pccl.collectives.links.RingLinks.partners`), so the tree needs no connection the ring
does not already have.

* **Pipelined.**  The buffer travels in segments of at most
  :data:`~pccl.protocol.algorithms.TREE_SEGMENT_BYTES` (one frame each, ``stream`` = the
  segment's index, ``step`` = the tree level); a peer forwards each segment to each of its
  children as soon as it is in, one sending task per child, so the levels overlap on large
  buffers.  Which algorithm runs is :func:`~pccl.protocol.algorithms.choose_broadcast`'s pure
  choice; every algorithm leaves the root's bytes, bit for bit, on every peer.
* **Buffers.**  Frames are received straight into the output (zero copy) and forwarded from
  it.  In place, a receiver's buffer is saved whole into the backup before its first frame is
  received (through the kernel runner: a worker thread when large); the root's is never
  written.  Out of place the root copies its input into ``dst`` first and sends from there.
* **Turns.**  Ops on the partner links run one at a time in commence order, begun ops beside
  each other (:attr:`~pccl.collectives.links.RingLinks.partner_turns`), as the halving-doubling
  all-reduce does (see :mod:`.halving`, "Turns", for why and for ops not recorded as commenced).
* **Aborts.**  The receiving task and the sending tasks share one nursery: a cancellation or an
  error (a broken partner link, a frame that does not fit the tree) stops them all and the op
  raises one exception; the executor (:func:`~pccl.collectives.execute.execute`) restores the
  input from the backup.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import trio

from .._groups import single_exception
from ..protocol.algorithms import broadcast_tree, tree_segment_elements
from ..protocol.codec import DataHeader
from .backup import InputBackup
from .buffers import KernelRunner, ReduceArgs
from .links import RingLinks

__all__ = ["PartnerBroadcastOp", "TreeBroadcastOp"]


class PartnerBroadcastOp:
    """What the broadcasts over the partner links share (this tree, and the scatter +
    all-gather of :mod:`.scatter_broadcast`): their state, the turn, the root's own bytes and a
    receiver's backup.  A subclass runs its moves in :meth:`_run`.

    ``args`` as for :func:`~pccl.collectives.broadcast.broadcast_checked`, unquantized and
    unsegmented (:func:`~pccl.protocol.algorithms.choose_broadcast` sends those along the chain).
    """

    def __init__(self, args: ReduceArgs, *, root: int, links: RingLinks, rank: int, world: int, seq: int,
                 backup: InputBackup | None, runner: KernelRunner) -> None:
        assert args.quant is None and isinstance(args.src, np.ndarray) and isinstance(args.dst, np.ndarray)
        self.src: np.ndarray = args.src
        self.dst: np.ndarray = args.dst
        self.in_place = args.in_place
        self.root = root
        self.links = links
        self.rank = rank
        self.world = world
        self.seq = seq
        self.backup = backup
        self.runner = runner
        self.tx_bytes = 0
        self.rx_bytes = 0
        self.count = self.src.size

    # --- what the executor asks ---------------------------------------------------------------

    def moves_nothing(self) -> bool:
        return self.count == 0

    def release(self) -> None:
        """Nothing to give back: the op has no scratch memory."""

    # --- the run --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the op once its turn on the partner links came (cancellable while it waits);
        raises one exception on failure (module docstring)."""
        async with self.links.partner_turn(self.seq, f"broadcast seq {self.seq}"):
            try:
                await self._run()
            except BaseExceptionGroup as group:
                raise single_exception(group) from None

    async def _run(self) -> None:
        raise NotImplementedError

    async def _prepare(self) -> None:
        """The root's input into ``dst`` (out of place), or a receiver's buffer into the backup
        (in place) before its first frame lands."""
        if self.rank == self.root:
            if not self.in_place:
                await self._kernel(self.dst.nbytes, np.copyto, self.dst, self.src)
        elif self.in_place and self.backup is not None:
            await self._kernel(self.dst.nbytes, self.backup.save, 0, self.count)

    async def _kernel(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> None:
        if self.runner.inline(nbytes):
            fn(*args)
        else:
            await self.runner.run(nbytes, fn, *args)


class TreeBroadcastOp(PartnerBroadcastOp):
    """One broadcast on this peer down the binomial tree (module docstring)."""

    def __init__(self, args: ReduceArgs, *, root: int, links: RingLinks, rank: int, world: int, seq: int,
                 backup: InputBackup | None, runner: KernelRunner) -> None:
        super().__init__(args, root=root, links=links, rank=rank, world=world, seq=seq, backup=backup,
                         runner=runner)
        count = self.count
        self.parent, self.children = broadcast_tree(rank, world, root)
        per = tree_segment_elements(self.src.itemsize)
        #: The segments' element ranges: one frame each, every peer cutting the same way.
        self.segments = [(a, min(a + per, count)) for a in range(0, count, per)]
        self._arrived = [trio.Event() for _ in self.segments]

    async def _run(self) -> None:
        async with trio.open_nursery() as nursery:
            for child, step in self.children:
                nursery.start_soon(self._feed, child, step)
            await self._take_in()

    async def _take_in(self) -> None:
        """The root's buffer into ``dst`` (its own input, or every segment from the parent)."""
        await self._prepare()
        if self.parent is None:
            for k in range(len(self.segments)):
                self.arrived(k, 0)
            return
        parent, step = self.parent
        inbox = self.links.partners[parent]
        item = self.dst.itemsize
        for k, (a, b) in enumerate(self.segments):
            nbytes = await inbox.receive_into(seq=self.seq, stream=k, step=step, offset=a * item,
                                              destination=self.dst[a:b].view(np.uint8).data)
            self.arrived(k, nbytes)

    def arrived(self, k: int, nbytes: int) -> None:
        """Segment ``k`` is in ``dst`` (``nbytes`` received from the parent; 0 at the root): the
        children's senders may forward it."""
        self.rx_bytes += nbytes
        self._arrived[k].set()

    def sent(self, k: int, nbytes: int) -> None:
        """Segment ``k`` (``nbytes``) went to one child."""
        self.tx_bytes += nbytes

    async def _feed(self, child: int, step: int) -> None:
        """Every segment to ``child``, each as soon as this peer has it."""
        connection = self.links.partners[child].connection
        item = self.dst.itemsize
        for k, (a, b) in enumerate(self.segments):
            await self._arrived[k].wait()
            header = DataHeader(op_seq=self.seq, stream=k, step=step, offset=a * item, nbytes=(b - a) * item)
            await connection.send_data(header, self.dst[a:b].view(np.uint8).data)
            self.sent(k, header.nbytes)
