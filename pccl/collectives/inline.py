"""Small all-reduces on real TCP: the whole ring in the calling Trio task.

Why: a 16 KiB all-reduce moves two 8 KiB frames each way at N = 2, yet the lane threads of
:mod:`pccl.collectives.threaded` (two thread hand-offs, condition variables and a wake-up of the
Trio loop per op) cost several hundred microseconds of CPU per op — on a 2-core box shared by the master and the peers that CPU *is* the latency.
Here one task does, step by step of the ring schedule: prepare and send this step's frames,
then receive and process this step's frames.  No task is spawned and no thread is started in
the common case.

Sends never block the task (that is what keeps the ring deadlock-free: a task stuck in a send
could not read the frame its neighbour is waiting to be read before that neighbour reads ours).
Each frame is offered to the socket with a non-blocking send
(:meth:`~pccl.net.framed_threads.BlockingDataChannel.send_data_soon`); if the kernel does not take
it all at once, or the lane's send lock is held by another operation's sender thread, the rest
of the frame goes to the lane's send queue (:class:`~pccl.collectives.lane_sends.LaneSends`,
shared by every small op on the lane and drained by one worker thread at a time), and every
later frame on that lane, of any small op, follows it there, in order.  Receives go through the lane's
:class:`~pccl.collectives.links.Inbox`, which hands the read role back and forth between this task
and the worker threads of concurrent large operations.  Kernels run inline (the frames are small).

Frames, schedule, arithmetic and buffers are those of the op (:class:`~pccl.collectives.lane_op.LaneOp`),
so the bytes on the wire and the results are identical to the other two paths.  Steps at which
this peer moves nothing (a broadcast's chain) are empty loops.

Aborts: cancellation or an error stops the op; send workers are cancelled (a transfer under way
is stopped by aborting its connection, which tears the lane as on every path) and waited for, so
nothing touches the caller's buffers after the op has returned.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable

import numpy as np
import trio

from ..net.framed_threads import FrameTail
from ..net.thread_io import ThreadCancel
from ..protocol.ring import Frame, RingSchedule
from .lane_op import LaneOp


__all__ = ["InlineRing", "INLINE_MAX_BYTES"]

logger = logging.getLogger(__name__)

#: Largest op (bytes of the caller's array) run inline; larger ones use the lane threads, whose
#: pipelining wins once frames are big enough to overlap receiving, reducing and sending.
INLINE_MAX_BYTES = 256 * 1024
#: Largest frame payload run inline: every frame must be one non-blocking send attempt.
INLINE_MAX_FRAME_BYTES = 64 * 1024


#: The staging buffer of an op whose frames all land where they belong.
_NO_STAGE = np.empty(0, np.uint8)

#: Per step of a schedule, its (lane, frame) pairs.
_Steps = tuple[tuple[tuple[int, Frame], ...], ...]


@functools.lru_cache(maxsize=64)
def _step_frames(schedule: RingSchedule, lanes: int) -> tuple[_Steps, _Steps]:
    """Per step, the frames this peer sends and receives there, with their lanes: the same
    for every op of a (shared, immutable) schedule, so worked out once, not per op."""
    def per_step(frames: Callable[[int, int], tuple[Frame, ...]]) -> _Steps:
        steps: list[list[tuple[int, Frame]]] = [[] for _ in range(schedule.num_steps)]
        for lane in range(lanes):
            for frame in frames(lane, lanes):
                steps[frame.step].append((lane, frame))
        return tuple(tuple(step) for step in steps)

    return per_step(schedule.send_frames), per_step(schedule.recv_frames)


def suits_inline(op: LaneOp) -> bool:
    """Whether ``op`` runs inline: threaded (real TCP) lanes, a small op and small frames."""
    if not op.links.threaded or op.op_nbytes > INLINE_MAX_BYTES:
        return False
    return op.max_frame_nbytes <= INLINE_MAX_FRAME_BYTES


class InlineRing:
    """One small operation's ring, run by the calling task (see the module docstring)."""

    def __init__(self, op: LaneOp) -> None:
        self.op = op
        self.cancel = ThreadCancel()
        self._lock = threading.Lock()
        self._pending = 0  # this op's jobs in the lanes' send queues (guarded by _lock)
        self._idle: trio.Event | None = None
        self._errors: list[BaseException] = []
        self._scope: trio.CancelScope | None = None
        self._token = trio.lowlevel.current_trio_token()

    async def run(self) -> None:
        op = self.op
        sends, receives = _step_frames(op.schedule, op.lanes)
        stage_nbytes = op.stage_nbytes
        stage = op.take(stage_nbytes) if stage_nbytes else _NO_STAGE
        try:
            for step in range(len(sends)):
                for lane, frame in sends[step]:
                    scratch = None
                    if op.sends_from_scratch(frame):
                        scratch = op.take(op.frame_nbytes(frame))  # owned until release
                    payload = op.prepare_payload(frame, scratch)
                    self._send(lane, frame, payload.view(np.uint8).data)
                    op.tx_bytes += op.frame_nbytes(frame)
                if self._pending or self._errors:
                    # A send went to a lane's worker: the rest of the op runs under a scope
                    # that a failed send cancels (:meth:`_failed`).  A small op's sends almost
                    # always complete in the kernel at once: it needs no scope.
                    with trio.CancelScope() as self._scope:
                        if self._errors:
                            self._scope.cancel()
                        await self._receive_from(step, sends, receives, stage)
                    break
                for lane, frame in receives[step]:
                    await self._receive(lane, frame, stage)
            if self._errors:
                raise self._errors[0]
        except BaseException:
            self._stop()
            with trio.CancelScope(shield=True):
                await self._wait_workers()
            if self._errors:
                raise self._errors[0] from None
            raise
        finally:
            self.cancel.close()

    async def _receive_from(self, step: int, sends: _Steps, receives: _Steps, stage: np.ndarray) -> None:
        """The rest of the op from ``step``'s receives on (its sends are out), then the wait for
        its queued sends."""
        op = self.op
        for lane, frame in receives[step]:
            await self._receive(lane, frame, stage)
        for later in range(step + 1, len(sends)):
            for lane, frame in sends[later]:
                scratch = None
                if op.sends_from_scratch(frame):
                    scratch = op.take(op.frame_nbytes(frame))
                payload = op.prepare_payload(frame, scratch)
                self._send(lane, frame, payload.view(np.uint8).data)
                op.tx_bytes += op.frame_nbytes(frame)
            for lane, frame in receives[later]:
                await self._receive(lane, frame, stage)
        await self._wait_workers()

    # --- receiving (this task) -----------------------------------------------------------------

    async def _receive(self, lane: int, frame: Frame, stage: np.ndarray) -> None:
        op = self.op
        received = await op.links.inboxes[lane].receive_into(
            seq=op.seq, stream=frame.index, step=frame.step, offset=frame.start * op.itemsize,
            destination=op.destination(frame, stage), schedule_point=False,  # the op yields soon enough
        )
        op.rx_bytes += received
        op.received(frame, stage)

    # --- sending (never blocks this task) -----------------------------------------------------

    def _send(self, lane: int, frame: Frame, payload: memoryview) -> None:
        op = self.op
        channels, queues = op.links.send_channels, op.links.send_queues
        assert channels is not None and queues is not None
        channel, queue = channels[lane], queues[lane]
        header = op.header(frame)
        with self._lock:
            self._pending += 1
        # Behind the lane's pending sends (any op's) if there are some: frames stay in order.
        if queue.queue_if_busy(self, lambda: channel.send_data(header, payload, self.cancel)):
            return
        try:
            job = channel.send_data_soon(header, payload, self.cancel)
        except BaseException:
            self._forget(1)
            raise
        if job is None:
            self._forget(1)
            return
        try:
            queue.start(self, job)
        except BaseException:
            self._forget(1)
            if isinstance(job, FrameTail):  # it holds the lane's send lock, maybe mid-frame
                job.abandon()
                channel.connection.abort()
            raise

    def send_done(self, error: BaseException | None) -> None:
        """One of this op's queued sends ended (a lane's worker thread)."""
        if error is not None:
            if self.cancel.cancelled:  # a consequence of stopping the op: not its cause
                logger.debug("send worker after the all-reduce was stopped: %r", error)
            else:
                with self._lock:
                    first = not self._errors
                    self._errors.append(error)
                if first:
                    self._token.run_sync_soon(self._failed)
        self._forget(1)

    def _forget(self, jobs: int) -> None:
        """``jobs`` of this op's sends are over (any thread): wake the op once none is left."""
        with self._lock:
            self._pending -= jobs
            idle = self._pending == 0 and self._idle is not None
        if idle:
            self._token.run_sync_soon(self._set_idle)

    def _set_idle(self) -> None:
        if self._idle is not None:
            self._idle.set()

    def _failed(self) -> None:
        """A send failed in a worker (Trio thread): stop the op's receives."""
        if self._scope is not None:
            self._scope.cancel()

    async def _wait_workers(self) -> None:
        while True:
            with self._lock:
                if self._pending == 0:
                    return
                self._idle = event = trio.Event()
            await event.wait()

    def _stop(self) -> None:
        """Cancel the send workers (Trio thread); transfers under way are stopped by aborting
        their connections."""
        for connection in self.cancel.cancel():
            connection.abort()  # type: ignore[attr-defined]
        queues = self.op.links.send_queues
        for queue in queues or ():
            taken = queue.withdraw(self)
            if taken:
                self._forget(taken)
