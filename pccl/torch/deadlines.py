"""Timeouts of a :class:`pccl.torch.ProcessGroup`'s collectives, as torch's Gloo honours them.

A collective's timeout is its options' ``timeout`` (``BarrierOptions.timeout``: what
``dist.barrier(timeout=...)`` passes; ``AllreduceOptions.timeout``, ...), or the ``timeout``
argument of the pybind call forms, else the group's own (``ProcessGroup(comm, timeout=...)``;
``init_process_group(timeout=...)`` and ``new_group(timeout=...)`` give it to the groups they
make; torch's default there is 30 minutes), else none.  A collective still running when its
timeout has passed since the call is cancelled — pccl's cancellation: the other participants'
calls of it abort (``CollectiveAborted``), an in-place tensor holds its input again — and its
work fails with :class:`CollectiveTimeout` ("Timed out waiting 1000ms ...", as Gloo words
it), a ``torch.distributed.DistBackendError`` (so a ``RuntimeError``, what Gloo raises) and a
:class:`~pccl.CollectiveAborted`.  A collective whose peer had already reported its success to
the master when it was cancelled ends as the master says, on every peer alike: if the master
completed it, its work succeeds with the result (the timeout came too late).  Unlike Gloo's,
the group stays usable: its next collective runs, as long as every peer issued the same
collectives (torch's rule) — the peers' calls of a collective that timed out end on every peer,
so their counts of the group's collectives (and so their tags) stay in step.  Point-to-point
calls are not timed here (a pccl ``send`` and ``recv`` end when the peer dies).  The group's ``abort()`` cancels its collectives still
running the same way (:meth:`Timeouts.cancel_running`).
"""

from __future__ import annotations

import datetime
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ..errors import CollectiveAborted
from ._args import timeout_seconds
from .work import Work

__all__ = ["CollectiveTimeout", "Deadlines", "Timeouts", "TIMED", "call_timeout"]


class CollectiveTimeout(CollectiveAborted, dist.DistBackendError):  # type: ignore[misc]  # torch's pybind class
    """A collective of a :class:`pccl.torch.ProcessGroup` did not finish within its timeout and
    was cancelled: the other peers' calls of it abort, an in-place tensor holds its input again
    (a collective the master completed all the same succeeds instead: see the module doc).
    Retry-safe, as every ``CollectiveAborted``; a ``RuntimeError`` too, as Gloo's timeout is.
    ``__cause__``: the cancelled call's own error."""


#: The group's methods whose calls are timed (torch's collectives and their aliases).
TIMED = ("allreduce", "allreduce_coalesced", "broadcast", "allgather", "all_gather_single", "_allgather_base",
         "allgather_into_tensor_coalesced", "allgather_coalesced", "reduce_scatter", "reduce_scatter_single",
         "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "barrier", "reduce", "gather", "scatter",
         "alltoall", "alltoall_base")


def call_timeout(args: tuple[Any, ...], kwargs: dict[str, Any]) -> float | None:
    """A call's own timeout in seconds: a ``timedelta`` argument (the pybind forms'
    ``timeout``), else the ``timeout`` of an options argument; None when neither is set
    (torch's unset timeout is negative)."""
    values = (*args, *kwargs.values())
    for value in values:
        if isinstance(value, datetime.timedelta):
            return timeout_seconds(value)
    for value in values:
        timeout = getattr(value, "timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout_seconds(timeout)
    return None


class Deadlines:
    """A thread that expires the works still running at their deadlines (earliest first); a
    work that ends before is forgotten."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._heap: list[tuple[float, int]] = []
        self._works: dict[int, tuple[Callable[[BaseException], None], str, float]] = {}
        self._keys = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, work: Work, deadline: float, what: str, seconds: float) -> None:
        """Expire ``work`` (a call of ``what`` with a timeout of ``seconds``) at ``deadline``
        (``time.monotonic()``) unless it ended before."""
        key = next(self._keys)
        with self._lock:
            if self._closed:
                return
            self._works[key] = (work.expiry(), what, seconds)
            heapq.heappush(self._heap, (deadline, key))
            self._wake.notify()
        work.when_done(lambda: self._forget(key))

    def close(self) -> None:
        """Stop the thread (the works still watched are not expired any more)."""
        with self._lock:
            self._closed = True
            self._works.clear()
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(5)

    def _forget(self, key: int) -> None:
        with self._lock:
            self._works.pop(key, None)
            if not self._works:
                self._heap.clear()
            elif len(self._heap) > 64 + 4 * len(self._works):  # ended works' entries: dropped
                self._heap = [entry for entry in self._heap if entry[1] in self._works]
                heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    while self._heap and self._heap[0][1] not in self._works:
                        heapq.heappop(self._heap)
                    now = time.monotonic()
                    if self._heap and self._heap[0][0] <= now:
                        expire, what, seconds = self._works.pop(heapq.heappop(self._heap)[1])
                        break
                    self._wake.wait(self._heap[0][0] - now if self._heap else None)
            expire(CollectiveTimeout(
                f"pccl {what}: Timed out waiting {seconds * 1000:.0f}ms for the collective to complete; it was "
                "cancelled on this peer (the other peers' calls of it abort, an in-place tensor holds its input "
                "again) and the group goes on with its next collective"))
            del expire


_WRAPPED: set[Callable[..., Any]] = set()


def _timed(what: str, method: Callable[..., Work]) -> Callable[..., Work]:
    @functools.wraps(method)
    def call(self: Timeouts, *args: Any, **kwargs: Any) -> Work:
        started = time.monotonic()
        work = method(self, *args, **kwargs)
        self.note_running(work)
        seconds = call_timeout(args, kwargs)
        if seconds is None:
            seconds = self.timeout_seconds
        if seconds is not None:
            self.watch_deadline(work, started + seconds, what.lstrip("_"), seconds)
        return work

    _WRAPPED.add(call)
    return call


class Timeouts:
    """The timeouts of :class:`pccl.torch.ProcessGroup` (a mixin): the group's own timeout,
    every collective method of the :data:`TIMED` names (the subclass's) timed, and the works of
    those calls still running, which :meth:`cancel_running` ends (the group's ``abort()``)."""

    _deadlines: Deadlines | None = None
    _deadlines_lock = threading.Lock()
    #: how to expire each work still running (never the work itself: see ``Work.expiry``)
    _running_works: dict[int, Callable[[BaseException], None]] | None = None
    _running_keys = itertools.count()
    #: The group's own timeout in seconds (None: none).
    timeout_seconds: float | None = None
    #: Why :meth:`cancel_running` ended the group for good (``abort()``): a work noted from then
    #: on is cancelled at once.
    _aborted: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in TIMED:
            method = getattr(cls, name, None)
            if method is not None and method not in _WRAPPED:
                setattr(cls, name, _timed(name, method))

    @property
    def timeout(self) -> datetime.timedelta | None:
        """The group's own timeout (collectives whose options set none are cancelled after it;
        :mod:`pccl.torch.deadlines`), or None: no limit."""
        return None if self.timeout_seconds is None else datetime.timedelta(seconds=self.timeout_seconds)

    def set_timeout(self, timeout: datetime.timedelta | float | None) -> None:
        """Set the group's own timeout (torch's ``ProcessGroup.set_timeout``; None or a
        non-positive one: no limit), for the collectives called from now on."""
        self.timeout_seconds = timeout_seconds(timeout)

    def watch_deadline(self, work: Work, deadline: float, what: str, seconds: float) -> None:
        """Expire ``work`` at ``deadline`` (``time.monotonic()``) unless it ended before."""
        with self._deadlines_lock:
            if self._deadlines is None:
                self._deadlines = Deadlines(f"pccl-torch-deadlines-{id(self):x}")
            deadlines = self._deadlines
        deadlines.watch(work, deadline, what, seconds)

    def note_running(self, work: Work) -> None:
        """Keep ``work`` among the running works until it ends; after :meth:`cancel_running`
        for good, cancel it at once instead."""
        key = next(self._running_keys)
        with self._deadlines_lock:
            aborted = self._aborted
            if aborted is None:
                if self._running_works is None:
                    self._running_works = {}
                self._running_works[key] = work.expiry()
        if aborted is not None:
            work.expire(CollectiveAborted(aborted))
            return
        work.when_done(lambda: self._work_ended(key))

    def cancel_running(self, why: str, *, for_good: bool = False) -> None:
        """Cancel every collective of the group still running (pccl's cancellation: the other
        peers' calls of it abort, an in-place tensor holds its input again); each that this ends
        fails with ``CollectiveAborted(why)``.  One whose peer had reported its success to the
        master ends as the master says: if the master completed it, its work succeeds with the
        result, as the other peers' do — unless the communicator closes first (the group's
        ``abort()`` closes one it owns right after): closing ends it at once, failed, its input
        restored.  ``for_good`` (the group's ``abort()``): a collective whose call was under way
        meanwhile — its op started, its work not yet among the running ones — is cancelled as
        its call returns, as is every later one."""
        with self._deadlines_lock:
            if for_good:
                self._aborted = why
            running = list((self._running_works or {}).values())
        for expire in running:
            expire(CollectiveAborted(why))

    def _work_ended(self, key: int) -> None:
        with self._deadlines_lock:
            if self._running_works is not None:
                self._running_works.pop(key, None)

    def _stop_deadlines(self) -> None:
        with self._deadlines_lock:
            deadlines, self._deadlines = self._deadlines, None
        if deadlines is not None:
            deadlines.close()
