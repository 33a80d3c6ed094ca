"""All-reduces on links without the thread-side fast path: one Trio task walks the ring.

Used for every op on lanes that offer no blocking I/O (:attr:`RingLinks.threaded` is false): the
simulator's streams and TLS.  One task does, in the order frames arrive from the predecessor:
receive frame ``k`` of step ``s`` into its destination, process it (reduce, dequantize, or
nothing when it was received in place), and at once send frame ``k`` of step ``s + 1``, which is
made from it; the frames of step 0 go out first.  That is the ring's whole dependency graph, so
sub-chunks still pipeline across steps as they would with a task per role, without the tasks:
on the simulator's streams an op usually runs start to end in its calling task, with one
schedule point per frame received.

Sends never make the task wait.  A task stuck in a send could not read the frame its
predecessor needs read before the predecessor can read ours, and around a ring that is a
deadlock.  A frame goes out at once when the connection takes it without waiting
(:meth:`~pccl.net.framed.FramedConnection.send_data_nowait`, all of it or a first part); otherwise
— a full send window, a lane busy with another op's frame, a TLS stream, which offers no such
send — it goes, with every later frame of that lane, to the lane's *sender task*, which sends them
in order and ends when none is left.  The rest of a frame the connection took only in part goes
out through the sender task too, at once (the successor waits for it).

Buffers: reduce-scatter payloads land in one staging buffer (each is reduced before the next is
received); quantized reduce-scatter sends are quantized into scratch buffers that return to a
free list once sent.  A frame is sent from the op's memory (the caller's array, the working
array, the gather store): nothing writes a slice again once it is sent, and the op waits for its
sender tasks before it returns.  If it fails or is cancelled while the rest of one of its frames
still waits in a connection, that connection is aborted (:meth:`FramedConnection.tear_unsent`):
the frame can no longer be completed, as with a send cancelled midway on any path.

Frames, schedule, arithmetic and buffers are those of the op (:class:`~pccl.collectives.lane_op.LaneOp`:
the all-reduce's :class:`~pccl.collectives.ring_op.RingOp` or another collective's), so the bytes on
the wire and the results are identical to the other paths.  A step at which this peer receives
nothing is skipped; frames of the next step made from nothing received (the root of a broadcast)
all go at step 0.
"""

from __future__ import annotations

import collections

import numpy as np
import trio

from .._groups import single_exception
from ..net.framed import FramedConnection
from ..protocol.codec import DataHeader
from ..protocol.ring import Frame
from .lane_op import LaneOp

__all__ = ["TrioRing"]


class _LaneOut:
    """The frames of one lane that could not go out at once, in order.  The lane's sender task
    runs exactly while there are any (it removes a frame once sent, and ends on an empty queue).
    An entry with no header sends the rest of a frame the connection took in part."""

    __slots__ = ("connection", "queue")

    def __init__(self, connection: FramedConnection) -> None:
        self.connection = connection
        self.queue: collections.deque[tuple[DataHeader | None, memoryview | None, np.ndarray | None, int]] = (
            collections.deque()
        )


class TrioRing:
    """One operation's ring, run by the calling task plus sender tasks when sends must wait
    (see the module docstring)."""

    def __init__(self, op: LaneOp) -> None:
        self.op = op
        self._outs = [_LaneOut(c) for c in op.links.to_next]
        #: Free quantized send buffers (reduce-scatter); a new one is taken when none is free.
        self._free_scratch: list[np.ndarray] = []
        self._nursery: trio.Nursery | None = None

    async def run(self) -> None:
        op = self.op
        schedule = op.schedule
        receives = schedule.step_frames(True)
        sends = schedule.step_frames(False)
        last = schedule.num_steps - 1
        stage = op.take(max(op.stage_nbytes, 1))
        try:
            async with trio.open_nursery() as self._nursery:
                for frame in sends[0]:
                    await self._send(frame)
                for step, frames in enumerate(receives):
                    following = sends[step + 1] if step < last else ()
                    for frame in frames:
                        await self._receive(frame, stage)
                        if following:
                            await self._send(following[frame.index])
        except BaseExceptionGroup as group:
            raise single_exception(group) from None
        finally:
            self._nursery = None
            for out in self._outs:
                out.connection.tear_unsent(self)

    # --- receiving -----------------------------------------------------------------------------

    async def _receive(self, frame: Frame, stage: np.ndarray) -> None:
        op = self.op
        cost = op.receive_cost(frame)
        save = op.save_before_receive(frame)  # received in place: saved first
        if save is not None:
            assert op.backup is not None
            await op.runner.run(op.frame_nbytes(frame), op.backup.save, *save)
        received = await op.links.inboxes[frame.index % op.lanes].receive_into(
            seq=op.seq,
            stream=frame.index,
            step=frame.step,
            offset=frame.start * op.itemsize,
            destination=op.destination(frame, stage),
        )
        op.rx_bytes += received
        if cost:
            if op.runner.inline(cost):
                op.received(frame, stage)
            else:
                await op.runner.run(cost, op.received, frame, stage)

    # --- sending (never waits for the connection) ---------------------------------------------

    async def _send(self, frame: Frame) -> None:
        op = self.op
        scratch: np.ndarray | None = None
        if op.sends_from_scratch(frame):
            scratch = self._free_scratch.pop() if self._free_scratch else op.take(op.send_scratch_nbytes)
        cost = op.payload_cost(frame)
        if cost and not op.runner.inline(cost):
            payload = await op.runner.run(cost, op.prepare_payload, frame, scratch)
        else:
            payload = op.prepare_payload(frame, scratch)
        view = payload.view(np.uint8).data
        header = op.header(frame)
        out = self._outs[frame.index % op.lanes]
        connection = out.connection
        idle = not out.queue  # no sender task: this frame may go out now
        if idle and connection.send_data_nowait(header, view, owner=self):
            op.tx_bytes += header.nbytes
            if not connection.needs_flush:
                if scratch is not None:
                    self._free_scratch.append(scratch)
                return
            out.queue.append((None, None, scratch, 0))  # the rest goes out now, from the task
        else:
            out.queue.append((header, view, scratch, header.nbytes))
        if idle:
            assert self._nursery is not None
            self._nursery.start_soon(self._sender, out)

    async def _sender(self, out: _LaneOut) -> None:
        """A lane's sender task: send its queued frames in order, end when none is left."""
        connection = out.connection
        queue = out.queue
        while queue:
            header, view, scratch, nbytes = queue[0]
            if header is None:
                await connection.flush()
            else:
                assert view is not None
                await connection.send_data(header, view)
                self.op.tx_bytes += nbytes
            queue.popleft()  # only now: until it is sent, later frames queue behind it
            if scratch is not None:
                self._free_scratch.append(scratch)
