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
of the frame goes to a worker thread for that lane, and every later frame of this op on that lane
follows it there, in order.  Receives go through the lane's
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

import collections
import logging
import threading
from collections.abc import Callable

import numpy as np
import outcome
import trio

from ..net.framed_threads import FrameTail
from ..net.thread_io import ThreadCancel
from ..protocol.ring import Frame
from .lane_op import LaneOp


__all__ = ["InlineRing", "INLINE_MAX_BYTES"]

logger = logging.getLogger(__name__)

#: Largest op (bytes of the caller's array) run inline; larger ones use the lane threads, whose
#: pipelining wins once frames are big enough to overlap receiving, reducing and sending.
INLINE_MAX_BYTES = 256 * 1024
#: Largest frame payload run inline: every frame must be one non-blocking send attempt.
INLINE_MAX_FRAME_BYTES = 64 * 1024


def suits_inline(op: LaneOp) -> bool:
    """Whether ``op`` runs inline: threaded (real TCP) lanes, a small op and small frames."""
    if not op.links.threaded or op.op_nbytes > INLINE_MAX_BYTES:
        return False
    return op.max_frame_nbytes <= INLINE_MAX_FRAME_BYTES


class _LaneSends:
    """The sends of one lane that could not complete at once, run in order by one worker thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: collections.deque[Callable[[], None]] = collections.deque()
        self.busy = False  # a worker owns the queue (guarded by lock)


class InlineRing:
    """One small operation's ring, run by the calling task (see the module docstring)."""

    def __init__(self, op: LaneOp) -> None:
        self.op = op
        self.cancel = ThreadCancel()
        self._lanes = [_LaneSends() for _ in range(op.lanes)]
        self._lock = threading.Lock()
        self._workers = 0
        self._idle: trio.Event | None = None
        self._errors: list[BaseException] = []
        self._scope: trio.CancelScope | None = None
        self._token = trio.lowlevel.current_trio_token()

    async def run(self) -> None:
        op = self.op
        schedule = op.schedule
        sends: list[list[tuple[int, Frame]]] = [[] for _ in range(schedule.num_steps)]
        receives: list[list[tuple[int, Frame]]] = [[] for _ in range(schedule.num_steps)]
        for lane in range(op.lanes):
            for frame in schedule.send_frames(lane, op.lanes):
                sends[frame.step].append((lane, frame))
            for frame in schedule.recv_frames(lane, op.lanes):
                receives[frame.step].append((lane, frame))
        stage = op.take(op.stage_nbytes)
        try:
            with trio.CancelScope() as self._scope:
                for step in range(schedule.num_steps):
                    for lane, frame in sends[step]:
                        scratch = None
                        if op.sends_from_scratch(frame):
                            scratch = op.take(op.frame_nbytes(frame))  # owned until release
                        payload = op.prepare_payload(frame, scratch)
                        self._send(lane, frame, payload.view(np.uint8).data)
                        op.tx_bytes += op.frame_nbytes(frame)
                    for lane, frame in receives[step]:
                        await self._receive(lane, frame, stage)
                await self._wait_workers()
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

    # --- receiving (this task) -----------------------------------------------------------------

    async def _receive(self, lane: int, frame: Frame, stage: np.ndarray) -> None:
        op = self.op
        received = await op.links.inboxes[lane].receive_into(
            seq=op.seq, stream=frame.index, step=frame.step, offset=frame.start * op.itemsize,
            destination=op.destination(frame, stage),
        )
        op.rx_bytes += received
        op.received(frame, stage)

    # --- sending (never blocks this task) -----------------------------------------------------

    def _send(self, lane: int, frame: Frame, payload: memoryview) -> None:
        op = self.op
        channels = op.links.send_channels
        assert channels is not None
        channel = channels[lane]
        header = op.header(frame)
        queue = self._lanes[lane]
        with queue.lock:
            queued = queue.busy
            if queued:  # keep the lane's frames in order behind the one a worker is finishing
                queue.jobs.append(lambda: channel.send_data(header, payload, self.cancel))
        if queued:
            return
        job = channel.send_data_soon(header, payload, self.cancel)
        if job is None:
            return
        with queue.lock:
            queue.busy = True
            queue.jobs.append(job)
        with self._lock:
            self._workers += 1
        try:
            trio.lowlevel.start_thread_soon(lambda: self._drain(queue), self._worker_done, name="pccl-ring-send")
        except BaseException:
            with self._lock:
                self._workers -= 1
            with queue.lock:
                queue.jobs.clear()
                queue.busy = False
            if isinstance(job, FrameTail):  # it holds the lane's send lock, maybe mid-frame
                job.abandon()
                channel.connection.abort()
            raise

    def _drain(self, queue: _LaneSends) -> None:
        """Worker thread: run the lane's queued sends in order until none is left."""
        while True:
            with queue.lock:
                if not queue.jobs:
                    queue.busy = False
                    return
                job = queue.jobs.popleft()
            try:
                job()
            except BaseException as exc:
                with queue.lock:
                    queue.jobs.clear()
                    queue.busy = False
                if self.cancel.cancelled:  # a consequence of stopping the op: not its cause
                    logger.debug("send worker after the all-reduce was stopped: %r", exc)
                    return
                with self._lock:
                    first = not self._errors
                    self._errors.append(exc)
                if first:
                    self._token.run_sync_soon(self._failed)
                return

    def _worker_done(self, _result: outcome.Outcome[None]) -> None:
        with self._lock:
            self._workers -= 1
            idle = self._workers == 0 and self._idle is not None
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
                if self._workers == 0:
                    return
                self._idle = event = trio.Event()
            await event.wait()

    def _stop(self) -> None:
        """Cancel the send workers (Trio thread); transfers under way are stopped by aborting
        their connections."""
        for connection in self.cancel.cancel():
            connection.abort()  # type: ignore[attr-defined]
