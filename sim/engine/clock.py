"""Virtual time's to-do list: the world's event queue.

Everything the simulated network does later — a segment arriving, an acknowledgement returning,
a link becoming free, a host's simulated work ending — is a callback in one :class:`EventQueue`,
a heap ordered by ``(time, sequence)``: equal times run in the order they were queued, so a run
is a function of its seed alone.  The clock itself is trio's: :func:`pccl_sim.engine.determinism.sim_clock`
delivers the queue whenever the run goes idle, before virtual time moves on (a scenario's run and
:func:`pccl_sim.engine.runner.simulate` alike).  Nothing polls.

Rules:

* callbacks run in the scheduler, not in a task: they may reschedule and cancel tasks, queue
  more events and read the time, never await;
* an event queued for an instant that is being delivered runs in that same delivery;
* the queue only orders work: what the callbacks mean is up to the parts that queue them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

import trio

__all__ = ["EventQueue"]


class EventQueue:
    """Callbacks due at virtual instants (see the module docstring)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        #: Callbacks run so far (the run's statistics).
        self.events_processed = 0

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Call ``fn(*args)`` at virtual time ``when`` (FIFO among equal times)."""
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, fn, args))

    async def sleep_until(self, when: float) -> None:
        """Sleep until virtual time ``when``, for simulated work (a workload's compute), woken by
        this queue: the event reschedules the task, where trio's sleep expires a cancel scope's
        deadline and raises ``Cancelled`` through the task to end it, several times the cost.
        Cancellation works as for ``trio.sleep_until`` (the event then finds nobody to wake).

        Unlike ``trio.sleep_until``, the wake-up is this queue's event: at its instant it comes
        before trio's deadlines (:func:`~pccl_sim.engine.determinism.sim_clock` delivers the
        events), and a ``when`` already past waits until the current instant goes idle.
        ``ValueError`` for NaN."""
        if math.isnan(when):
            raise ValueError("sleep_until: when is NaN")
        task: list[trio.lowlevel.Task | None] = [trio.lowlevel.current_task()]

        def wake() -> None:
            sleeper = task[0]
            if sleeper is not None:
                task[0] = None
                trio.lowlevel.reschedule(sleeper)

        def abort(_: object) -> trio.lowlevel.Abort:
            task[0] = None
            return trio.lowlevel.Abort.SUCCEEDED

        self.at(when, wake)
        await trio.lowlevel.wait_task_rescheduled(abort)

    def next_time(self) -> float:
        """When the earliest pending event is due (``inf``: none)."""
        heap = self._heap
        return heap[0][0] if heap else math.inf

    def deliver(self, now: float) -> None:
        """Run every event due at or before ``now``, in (time, FIFO) order (events they add for
        ``now`` included)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            _, _, fn, args = heapq.heappop(heap)
            self.events_processed += 1
            fn(*args)
