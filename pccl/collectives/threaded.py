"""The ring all-reduce's lane loops in worker threads: the fast path on real TCP.

Why: on the project's 2-core loopback box a ring of blocking sockets driven by one sender and
one receiver thread per process moved 2-3x the bytes of the same ring driven through Trio
(measured for this module: 64 MiB float32 at N = 2 took ~31 ms
that way against ~83 ms through the Trio tasks of :mod:`pccl.collectives.allreduce`).  Trio's
event loop costs a scheduling round per partial ``send``/``recv`` and serializes receiving,
reducing and sending on one thread; here the kernel (which releases the GIL) and both socket
directions run concurrently, with no per-frame thread hand-off.

How: when every lane of a :class:`~pccl.collectives.links.RingLinks` offers a
:class:`~pccl.net.framed_threads.BlockingDataChannel`, an operation starts, per lane, one *sender*
thread (prepare a frame's payload — quantize, finalize — then a blocking send) and one
*receiver* thread (take the lane's next frame of this op through the inbox, straight into its
destination, then reduce / dequantize it right there).  They synchronize through a condition
variable: the sender of ``(step, k)`` waits until ``(step - 1, k)`` was processed.  The Trio task
waits for all of them without polling and is woken once.  The threads are
:mod:`pccl.net.workers`', woken through a pipe with the GIL released, so the root's first bytes
leave without waiting for the Trio thread to let the GIL go.  Schedule, frames, arithmetic and
buffers are exactly those of the Trio path (the same :class:`~pccl.collectives.lane_op.LaneOp` methods), so results are
bit-identical whichever path runs.  A lane with no frame of the op to send or receive (an idle
link of a broadcast's chain, an empty contribution to an all-gather) has threads that return
at once.

Many ops at once: each op's threads start only once it has its turn
(:class:`~pccl.collectives.turns.ThreadTurns`, taken by
:func:`~pccl.collectives.execute.execute_op`): a few ops of a set of links at a time, in the
order the master commenced them, so hundreds of concurrent large ops never start thousands of
threads.

Cancellation and errors: cancelling the Trio task cancels the op's
:class:`~pccl.net.thread_io.ThreadCancel` — threads waiting for a frame, a lane or a ready slice
wake and stop; transfers already under way are stopped by aborting their connections (a torn
frame kills a lane on either path).  The task always waits until every thread has returned, so
no thread touches the caller's buffers (or the scratch memory) after the op has returned — the
in-place restore is safe.  The first real error of any thread (``PeerDisconnected``,
``ProtocolError``, ``InvalidArgument`` for NaN/Inf under quantization…) cancels the others and is
raised; errors caused by that cancellation are only logged.  ``Cancelled`` is raised only when
the Trio scope was cancelled and nothing else went wrong.  Connections left broken are aborted
when the op ends (:meth:`~pccl.collectives.links.RingLinks.abort_broken`).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import numpy as np
import outcome
import trio

from ..errors import StreamClosed
from ..net import workers
from ..net.thread_io import Interrupted, ThreadCancel
from .lane_op import LaneOp


__all__ = ["LaneThreads", "receiver_first"]

logger = logging.getLogger(__name__)


class LaneThreads:
    """One operation's sender and receiver threads, one pair per lane."""

    def __init__(self, op: LaneOp) -> None:
        self.op = op
        self.cancel: ThreadCancel  # created by run()
        self._cond = threading.Condition()
        self._ready: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self._running = 0
        self._errors: list[BaseException] = []
        self._interrupted = False
        self._tx = 0
        self._rx = 0

    # --- Trio side -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run the op's lanes in threads; returns when every thread has returned."""
        await trio.lowlevel.checkpoint_if_cancelled()
        op = self.op
        links = op.links
        assert links.send_channels is not None
        self.cancel = ThreadCancel()
        jobs: list[tuple[Any, ...]] = []
        for lane in range(op.lanes):
            # Scratch is taken here, on the Trio thread (the arena bookkeeping is not per-thread).
            send_buf = op.take(op.send_scratch_nbytes) if op.send_scratch_nbytes else None
            send = (self._send_loop, lane, send_buf)
            receive = (self._receive_loop, lane, op.take(op.stage_nbytes))
            jobs.extend((receive, send) if receiver_first(op, lane) else (send, receive))
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        self._token = token
        self._running = len(jobs)

        def done(_result: outcome.Outcome[None]) -> None:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                token.run_sync_soon(trio.lowlevel.reschedule, task, outcome.Value(None))

        def abort(_raise_cancel: object) -> trio.lowlevel.Abort:
            self._interrupted = True
            self._stop()
            return trio.lowlevel.Abort.FAILED  # keep waiting: the threads return promptly

        try:
            for started, (fn, *args) in enumerate(jobs):
                try:
                    workers.start_soon(functools.partial(self._guarded, fn, *args), done, name="pccl-ring-lane")
                except BaseException:  # no thread to be had: stop those already running
                    with self._lock:
                        self._running -= len(jobs) - started
                        still_running = self._running
                    self._stop()
                    if still_running:
                        with trio.CancelScope(shield=True):
                            await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)
                    raise
            await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self.cancel.close()
        op.tx_bytes += self._tx
        op.rx_bytes += self._rx
        if self._errors:
            raise self._errors[0]
        if self._interrupted:
            await trio.lowlevel.checkpoint()  # raises the Cancelled that stopped the threads
            raise StreamClosed("the all-reduce was interrupted")  # only under a shield raised meanwhile

    def _stop(self) -> None:
        """Cancel every thread (Trio thread): wake the waiters, abort transfers under way."""
        for connection in self.cancel.cancel():
            connection.abort()  # type: ignore[attr-defined]
        self._wake_all()

    def _wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()
        for inbox in self.op.links.inboxes:
            inbox.wake_threads()

    # --- thread side -----------------------------------------------------------------------------

    def _guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Interrupted:
            pass
        except BaseException as exc:  # recorded and re-raised on the Trio thread
            with self._lock:
                first = not self.cancel.cancelled
                if first:
                    self._errors.append(exc)
            if first:
                # Stop the other threads; transfers under way need their connection aborted,
                # which only the Trio thread may do.
                torn = self.cancel.cancel()
                self._wake_all()
                if torn:
                    self._token.run_sync_soon(_abort_all, torn)
            else:
                logger.debug("after the all-reduce was stopped: %r", exc)

    def _wait_ready(self, key: tuple[int, int], idle_work: list[tuple[int, int]] | None = None) -> None:
        """Wait until ``key`` is processed; meanwhile save pending in-place backup slices
        (``idle_work``, consumed in order) instead of sleeping."""
        while idle_work:
            with self._cond:
                if key in self._ready:
                    return
            self.cancel.check()
            backup = self.op.backup
            assert backup is not None
            backup.save(*idle_work.pop())
        with self._cond:
            while key not in self._ready:
                self.cancel.check()
                self._cond.wait()

    def _mark_ready(self, key: tuple[int, int]) -> None:
        with self._cond:
            self._ready.add(key)
            self._cond.notify_all()

    def _send_loop(self, lane: int, scratch: np.ndarray | None) -> None:
        op = self.op
        channels = op.links.send_channels
        assert channels is not None
        channel = channels[lane]
        sent = 0
        # In place, every slice must be backed up before its first overwrite; most of those
        # copies would fall on the receiver (the busier thread).  The sender saves the ones
        # the op names (LaneOp.backup_ahead), in the order the receiver will need them,
        # whenever it would otherwise wait.
        idle_work = op.backup_ahead(lane)
        try:
            for frame in op.schedule.send_frames(lane, op.lanes):
                if frame.step > 0:
                    self._wait_ready((frame.step - 1, frame.index), idle_work)
                self.cancel.check()
                payload = op.prepare_payload(frame, scratch)
                channel.send_data(op.header(frame), payload.view(np.uint8).data, self.cancel)
                sent += op.frame_nbytes(frame)
            # Saves still pending once this lane sent everything (a broadcast's last peer sends
            # nothing at all): made here, alongside the receiver, rather than by it in turn.
            backup = op.backup
            while idle_work and backup is not None:
                self.cancel.check()
                backup.save(*idle_work.pop())
        finally:
            with self._lock:
                self._tx += sent

    def _receive_loop(self, lane: int, stage: np.ndarray) -> None:
        op = self.op
        inbox = op.links.inboxes[lane]
        received = 0
        try:
            for frame in op.schedule.recv_frames(lane, op.lanes):
                received += inbox.receive_blocking(
                    seq=op.seq,
                    stream=frame.index,
                    step=frame.step,
                    offset=frame.start * op.itemsize,
                    destination=op.destination(frame, stage),
                    cancel=self.cancel,
                )
                op.received(frame, stage)
                self._mark_ready((frame.step, frame.index))
        finally:
            with self._lock:
                self._rx += received


def receiver_first(op: LaneOp, lane: int) -> bool:
    """Whether ``lane``'s receiver thread is started before its sender: when the lane receives
    before it sends (a broadcast's peers past the root, which forward what came in) or sends
    nothing (the chain's last peer, whose sender only saves the input backup meanwhile).  A
    woken worker takes the GIL at once and holds it until its first blocking call, so the thread
    started first runs first; the receiver must drain the socket from the start, or the
    sender's bytes stop once the socket buffers are full (on a link whose rate is the limit, the
    link idles meanwhile)."""
    sends = op.schedule.send_frames(lane, op.lanes)
    if not sends:
        return True
    receives = op.schedule.recv_frames(lane, op.lanes)
    return bool(receives) and receives[0].step < sends[0].step


def _abort_all(connections: list[object]) -> None:
    for connection in connections:
        connection.abort()  # type: ignore[attr-defined]
