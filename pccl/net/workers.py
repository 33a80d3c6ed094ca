"""Worker threads that wait for their next job in a system call: the bulk path's hand-off.

Why: an operation's lane threads (:mod:`pccl.collectives.threaded`) must start moving bytes as
soon as the Trio thread hands them their job.  Trio's thread cache hands a job over by releasing
a lock while the Trio thread holds the GIL: the woken worker cannot run before the Trio thread
lets the GIL go (its next blocking system call, or the interpreter's 5 ms switch interval), and
on a busy host the kernel often runs the woken worker at once on the waker's core, where it
finds the GIL taken and sleeps again, while the Trio thread has lost its core (traced on the
2-core box: a broadcast's first byte 1-20 ms after the hand-off, docs/performance.rst).  Here an
idle worker waits in ``poll`` on a pipe of its own; the hand-off is an ``os.write`` to that
pipe, a system call during which the Trio thread does not hold the GIL, so the woken worker
takes it and runs into its own first blocking call (a socket send, in which it lets the GIL go
again) before the Trio thread goes on.

:func:`start_soon` is :func:`trio.lowlevel.start_thread_soon`'s contract: ``fn`` runs in a
worker thread, then ``deliver`` gets its :class:`outcome.Outcome` there; the thread carries
``name`` while it runs the job.  Idle workers are kept (most recently used first) and retire
after :data:`IDLE_TIMEOUT` seconds without a job.  A forked child starts with none (the
parent's threads do not exist there).
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Callable
from typing import Any

import outcome

__all__ = ["IDLE_TIMEOUT", "start_soon", "idle_workers"]

#: Seconds an idle worker waits for a job before it retires (Trio's thread cache: 10).
IDLE_TIMEOUT = 10.0

_IDLE_NAME = "pccl-worker (idle)"

_lock = threading.Lock()
#: Idle workers, the most recently idle last (taken first: its stack and caches are warm).
_idle: list[_Worker] = []
#: Every worker alive (a forked child closes their pipes).
_alive: set[_Worker] = set()


class _Worker:
    """One thread and the pipe it waits on; ``job`` is set before the byte that wakes it."""

    def __init__(self, job: tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], object], str]) -> None:
        self.job: tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], object], str] | None = job
        self.read_fd, self.write_fd = os.pipe()
        self.poller = select.poll()  # not select(): a busy process's pipe may be past FD_SETSIZE
        self.poller.register(self.read_fd, select.POLLIN)
        self.thread = threading.Thread(target=self._work, name=job[2], daemon=True)
        try:
            self.thread.start()
        except BaseException:
            self.close()
            raise
        with _lock:
            _alive.add(self)

    def wake(self) -> None:
        os.write(self.write_fd, b"\0")

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            try:
                os.close(fd)
            except OSError:  # pragma: no cover - closed twice
                pass

    def _work(self) -> None:
        thread = self.thread
        while True:
            job, self.job = self.job, None
            if job is not None:
                fn, deliver, name = job
                thread.name = name
                result = outcome.capture(fn)
                thread.name = _IDLE_NAME
                del fn, job
                with _lock:
                    _idle.append(self)  # before deliver: a job it triggers may come back here
                try:
                    deliver(result)
                except BaseException:  # pragma: no cover - pccl's callbacks do not raise
                    import traceback

                    traceback.print_exc()
                del deliver, result
            if not self._wait():
                return

    def _wait(self) -> bool:
        """Wait for the next job (``True``) or retire (``False``) after :data:`IDLE_TIMEOUT`."""
        while True:
            if self.poller.poll(IDLE_TIMEOUT * 1000):
                os.read(self.read_fd, 64)
                return True
            with _lock:
                try:
                    _idle.remove(self)
                except ValueError:
                    continue  # taken just now: its job's byte is on the way
                _alive.discard(self)
            self.close()
            return False


def start_soon(fn: Callable[[], Any], deliver: Callable[[outcome.Outcome[Any]], object], *, name: str) -> None:
    """Run ``fn`` in an idle worker (a new one if none is idle), then ``deliver(outcome)`` in
    that thread.  Any thread may call it.  Raises (``RuntimeError``, ``OSError``) only when no
    thread could be started, and then ``fn`` does not run."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        _Worker((fn, deliver, name))
        return
    worker.job = (fn, deliver, name)
    worker.wake()


def idle_workers() -> int:
    """How many workers wait for a job now."""
    with _lock:
        return len(_idle)


def _forget_after_fork() -> None:
    """In a forked child: the parent's workers are not there; their pipes are closed."""
    global _lock
    _lock = threading.Lock()
    for worker in _alive:
        worker.close()
    _alive.clear()
    _idle.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
