"""Bandwidth-lean broadcast for large buffers in large groups: a scatter, then an all-gather.

The chain broadcast (:mod:`.broadcast`) takes ``N - 1`` hops: at 256 peers a 16 MiB broadcast
waits for 255 link latencies.  The binomial tree (:mod:`.tree_broadcast`) takes ``log2 P`` hops
but its root sends the whole buffer ``log2 P`` times.  :class:`ScatterAllGatherOp` runs the plan
of :func:`~pccl.protocol.scatter_gather.scatter_all_gather_plan` instead: the root scatters the
buffer's ``P`` blocks by recursive halving (half of it, then a quarter, ...), then the peers
gather them by recursive doubling, as the halving-doubling all-reduce's second half does
(:mod:`.halving`): ``2 log2 P`` hops (one more on each side of the fold) and no peer sending
more than about twice the buffer.  Every edge is a partner link
(:attr:`~pccl.collectives.links.RingLinks.partners`).

* **Frames.**  A move of the plan (a run of blocks to or from one partner at one step) travels
  in frames of at most :data:`~pccl.protocol.algorithms.TREE_SEGMENT_BYTES` (``stream`` = the
  frame's index in the move, ``step`` = the plan's step), so no frame nears the wire's limit.
  A step's send runs in a child task while the calling task receives, as in :mod:`.halving`;
  steps do not overlap.  Which algorithm runs is
  :func:`~pccl.protocol.algorithms.choose_broadcast`'s pure choice; all of them leave the
  root's bytes, bit for bit, on every peer (a copy: nothing is computed).
* **Buffers.**  Frames are received straight into the output (zero copy) and sent from it.  In
  place, a receiver's buffer is saved whole into the backup before its first frame is received
  (through the kernel runner: a worker thread when large); the root's is never written (it
  receives nothing).  Out of place the root copies its input into ``dst`` first.
* **Turns** and **aborts** as for the tree (:mod:`.tree_broadcast`): one op at a time on the
  partner links in commence order (begun ops beside each other); the sending and receiving tasks share one nursery, the op
  raises one exception, and the executor (:func:`~pccl.collectives.execute.execute`) restores
  the input from the backup.
"""

from __future__ import annotations

import itertools

import numpy as np
import trio

from ..protocol.algorithms import power_of_two_below, tree_segment_elements
from ..protocol.codec import DataHeader
from ..protocol.scatter_gather import BlockMove, scatter_all_gather_plan
from .backup import InputBackup
from .buffers import KernelRunner, ReduceArgs
from .halving import block_bounds
from .links import RingLinks
from .tree_broadcast import PartnerBroadcastOp

__all__ = ["ScatterAllGatherOp"]


class ScatterAllGatherOp(PartnerBroadcastOp):
    """One broadcast on this peer by scatter + all-gather (module docstring)."""

    def __init__(self, args: ReduceArgs, *, root: int, links: RingLinks, rank: int, world: int, seq: int,
                 backup: InputBackup | None, runner: KernelRunner) -> None:
        super().__init__(args, root=root, links=links, rank=rank, world=world, seq=seq, backup=backup,
                         runner=runner)
        self.size = power_of_two_below(world)
        self.plan = scatter_all_gather_plan(rank, world, root)
        self._per = tree_segment_elements(self.src.itemsize)

    async def _run(self) -> None:
        await self._prepare()
        for _, moves in itertools.groupby(self.plan, key=lambda m: m.step):
            async with trio.open_nursery() as nursery:
                receive = None
                for move in moves:
                    if move.send:
                        nursery.start_soon(self._send, move)
                    else:
                        receive = move
                if receive is not None:
                    await self._receive(receive)

    def frames(self, move: BlockMove) -> list[tuple[int, int]]:
        """The element ranges of ``move``'s frames, cut the same way on both ends."""
        a = block_bounds(self.count, self.size, move.first)[0]
        b = block_bounds(self.count, self.size, move.stop - 1)[1]
        return [(x, min(x + self._per, b)) for x in range(a, b, self._per)]

    async def _receive(self, move: BlockMove) -> None:
        inbox = self.links.partners[move.partner]
        item = self.dst.itemsize
        for k, (a, b) in enumerate(self.frames(move)):
            nbytes = await inbox.receive_into(seq=self.seq, stream=k, step=move.step, offset=a * item,
                                              destination=self.dst[a:b].view(np.uint8).data)
            self.arrived(k, nbytes)

    async def _send(self, move: BlockMove) -> None:
        connection = self.links.partners[move.partner].connection
        item = self.dst.itemsize
        for k, (a, b) in enumerate(self.frames(move)):
            header = DataHeader(op_seq=self.seq, stream=k, step=move.step, offset=a * item, nbytes=(b - a) * item)
            await connection.send_data(header, self.dst[a:b].view(np.uint8).data)
            self.sent(k, header.nbytes)

    def arrived(self, k: int, nbytes: int) -> None:
        """Frame ``k`` of a move (``nbytes``) is in ``dst``."""
        self.rx_bytes += nbytes

    def sent(self, k: int, nbytes: int) -> None:
        """Frame ``k`` of a move (``nbytes``) went to a partner."""
        self.tx_bytes += nbytes
