"""The sends of one lane that could not complete at once, shared by every small op on the lane.

A small op run inline (:mod:`pccl.collectives.inline`) offers each frame to the socket without
blocking; what the socket (or the lane's send lock, held by another op's sender thread) does not
take at once must be finished by a worker thread, and every later frame on that lane must follow
it in order.  :class:`LaneSends` is that queue for one lane, shared by *all* the ops on it: one
worker thread at a time drains it, whatever the number of ops.  (With a queue and a worker per
op, thousands of concurrent small ops on a busy lane started thousands of threads that queued on
the lane's send lock, and their contention for the GIL starved the event loop that reads the
sockets.)

Each job belongs to an *owner* (:class:`SendOwner`, one op): the worker tells the owner when a
job of its ends (with its error, if any).  An owner that stops takes its jobs that have not
started back (:meth:`LaneSends.withdraw`), so it waits at most for the job under way, which its
``cancel`` interrupts.  Frames are whole on the wire either way: a job that fails mid-frame marks
the connection broken (the op that owns it aborts it when it ends).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Protocol

import trio

__all__ = ["SendOwner", "LaneSends"]


class SendOwner(Protocol):
    """What :class:`LaneSends` needs of an op whose frames it sends."""

    def send_done(self, error: BaseException | None) -> None:
        """One of the owner's jobs ended (worker thread): ``error`` is what it raised, if anything."""


class LaneSends:
    """The queued sends of one lane, drained in order by one worker thread at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: collections.deque[tuple[SendOwner, Callable[[], None]]] = collections.deque()
        self._busy = False  # a worker owns the queue (guarded by _lock)

    def queue_if_busy(self, owner: SendOwner, job: Callable[[], None]) -> bool:
        """Queue ``job`` behind the lane's pending sends if there are any (True); False if the
        lane has none, so the caller may try the socket directly (then :meth:`start` the rest)."""
        with self._lock:
            if self._busy:
                self._jobs.append((owner, job))
            return self._busy

    def start(self, owner: SendOwner, job: Callable[[], None]) -> None:
        """Run ``job`` in a worker thread, first of the lane's queue (call only after
        :meth:`queue_if_busy` returned False, with no checkpoint since).  Errors starting the
        thread escape, with the job taken back."""
        with self._lock:
            self._busy = True
            self._jobs.append((owner, job))
        try:
            trio.lowlevel.start_thread_soon(self._drain, _ignore, name="pccl-ring-send")
        except BaseException:
            with self._lock:
                self._jobs.clear()
                self._busy = False
            raise

    def withdraw(self, owner: SendOwner) -> int:
        """Take ``owner``'s jobs that have not started out of the queue; returns how many."""
        with self._lock:
            kept = collections.deque(entry for entry in self._jobs if entry[0] is not owner)
            taken = len(self._jobs) - len(kept)
            self._jobs = kept
        return taken

    def _drain(self) -> None:
        """Worker thread: run the queued sends in order until none is left."""
        while True:
            with self._lock:
                if not self._jobs:
                    self._busy = False
                    return
                owner, job = self._jobs.popleft()
            try:
                job()
            except BaseException as exc:  # the owner's to report
                owner.send_done(exc)
            else:
                owner.send_done(None)


def _ignore(_result: object) -> None:
    """Nothing to deliver: every job reports to its owner."""
