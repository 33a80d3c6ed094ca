"""The torch side of one :class:`pccl.torch.ProcessGroup` collective: the :class:`Work` a call
returns, the :class:`PendingOp` the group's completion thread finishes, and the
:class:`Settler` that completes its torch futures (and so runs their callbacks)."""

from __future__ import annotations

import collections
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .. import blocking
from ._args import timeout_seconds

__all__ = ["Work", "PendingOp", "Settler", "UnobservedWorks"]

log = logging.getLogger(__name__)

class Work(dist.Work):
    """One collective of a :class:`ProcessGroup`: what torch's collectives return with
    ``async_op=True`` (and wait on otherwise).

    :meth:`wait` blocks until the collective, its finishing copies and its future are done
    and raises the collective's pccl error; interrupted (Ctrl-C) it cancels the collective, as
    :meth:`pccl.blocking.CollectiveHandle.wait` does.  :meth:`get_future` is a
    ``torch.futures.Future`` of the op's output tensors (``[tensor]``; ``[]`` for a barrier),
    completed by the group's completion thread; on failure it fails (torch raises a
    ``RuntimeError`` naming the pccl error from it), as a C++ backend's does — torch's DDP
    reducer reads it.  :meth:`exception` is the pccl error itself.

    torch's C++ may hold the work after Python dropped it (DDP's ``join()`` keeps its forward
    pass's all-reduce and waits on it in the backward): a work dropped before anyone waited on
    it or took its future is kept by its group's :class:`UnobservedWorks`, so that C++ still
    reaches these methods.
    """

    def __init__(self, handle: blocking.CollectiveHandle[Any], future: torch.futures.Future[Any],
                 outcome: torch.futures.Future[Any], op: PendingOp | None = None,
                 unobserved: UnobservedWorks | None = None) -> None:
        super().__init__()
        self._handle = handle
        self._future = future
        self._outcome = outcome
        self._op = op
        self._unobserved = unobserved
        self._observed = False

    def __del__(self) -> None:
        # torch's C++ reaches a Python work's methods only while its Python object lives (pybind's
        # trampoline); once it is gone, C++'s wait() is torch's base class's, which never returns.
        # Nobody waited on this one nor took its future: C++ may still, so it lives on a while.
        if not self._observed and self._unobserved is not None:
            self._observed = True
            self._unobserved.keep(self)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the collective; return ``True`` or raise its error (a pccl error, or
        ``TimeoutError`` when ``timeout`` — a ``timedelta`` — passed first; the op goes on)."""
        self._observed = True
        seconds = timeout_seconds(timeout)
        try:
            self._handle.wait(seconds)
        except TimeoutError:
            if not self._handle.done():
                raise
        except Exception:  # noqa: BLE001 - the future holds the final word (alone: the identity)
            pass
        self._outcome.wait()  # raises the op's pccl error; the finishing copies are quick
        # torch's future completes in a callback just after the outcome, on a settling thread;
        # torch's C++ reads its value as soon as wait() returns (DDP's reducer, under join()).
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The future of the op's output tensors (see the class)."""
        self._observed = True
        return self._future

    def expiry(self) -> Callable[[BaseException], None]:
        """:meth:`expire` without the work: what the group's timeouts hold while the op runs.
        They must not keep the work itself alive: torch's C++ reaches a Python work's methods
        only through the Python object's own life (see :class:`UnobservedWorks`), and a work
        held elsewhere when Python drops it is never kept for C++ (DDP's ``join()`` hung)."""
        return self._op.expire if self._op is not None else _never_expires

    def when_done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the op's torch future is done: pccl.torch's own bookkeeping
        (its timeouts), which unlike :meth:`get_future` does not count as observing the work."""
        self._future.add_done_callback(lambda _: callback())

    def is_completed(self) -> bool:
        """Whether the collective and its finishing copies are done (successfully or not)."""
        return self._outcome.done()  # torch's future completes in a callback just after it

    def is_success(self) -> bool:
        """Whether it is done and succeeded."""
        if not self._outcome.done():
            return False
        try:
            self._outcome.value()
        except Exception:  # noqa: BLE001 - the error itself is the outcome's
            return False
        return True

    def exception(self) -> BaseException | None:
        """The op's error once done (None while running or after success)."""
        if not self._outcome.done():
            return None
        try:
            self._outcome.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        """The op's output tensors (waits for them)."""
        self.wait()
        value = self._outcome.value()
        return list(value) if value is not None else []

    def synchronize(self) -> None:
        """Nothing to do on CPU: results are in the tensors once the work is completed."""

    def expire(self, error: BaseException) -> None:
        """The op outlived its timeout: cancel it (pccl's cancellation: the other peers' calls of
        it abort, an in-place tensor holds its input again), and if that ends it, fail it with
        ``error`` (its cause: the cancelled call's own error).  Nothing once it has ended."""
        if self._op is not None:
            self._op.expire(error)


def _never_expires(error: BaseException) -> None:
    """A work without a pending op (a point-to-point one) has nothing to expire."""


class UnobservedWorks:
    """A group's most recent :class:`Work` objects that Python dropped before anyone waited on
    them or took their future (the last :data:`KEPT`; the group's ``shutdown`` drops them all).

    torch hands a work to C++ as a pointer to its C++ part alone: DDP's ``join()`` gives the
    all-reduce that counts the processes still training to its reducer, which waits on it and
    reads its future in the backward pass, after the Python object was dropped; through a
    Python work whose object is gone that wait blocks forever (pybind's trampoline finds no
    Python method to call, and torch's base class waits for a completion that no one marks).
    Such a consumer waits on a work soon after the op, before :data:`KEPT` later unobserved
    works were dropped."""

    #: How many dropped, unobserved works a group keeps alive.
    KEPT = 64

    def __init__(self) -> None:
        self._works: collections.deque[Work] = collections.deque(maxlen=self.KEPT)

    def keep(self, work: Work) -> None:
        self._works.append(work)  # atomic: a finalizer may run on any thread

    def clear(self) -> None:
        self._works.clear()


class PendingOp:
    """A started collective: its handle, how to finish it, and the trivial result when alone."""

    def __init__(self, handle: blocking.CollectiveHandle[Any], finish: Callable[[Any], list[torch.Tensor]],
                 alone: Callable[[], list[torch.Tensor]] | None) -> None:
        self.handle = handle
        self.finish = finish
        self.alone = alone
        # The completion thread copies into the caller's tensors in the caller's mode: an
        # inference tensor takes an in-place copy only inside inference mode.
        self.inference = torch.is_inference_mode_enabled()
        #: The op's outputs or its pccl error (``Work.wait`` raises that error).
        self.outcome: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        #: torch's future of the op (``Work.get_future``): a Python error set on a
        #: ``torch.futures.Future`` is the future's *value* to C++, which torch's DDP reducer
        #: took for the bucket's tensors and crashed on (SIGSEGV); an error raised in a ``then``
        #: callback fails the future itself.
        self.future: torch.futures.Future[list[torch.Tensor]] = self.outcome.then(_settled)
        #: The error the op fails with if it fails after :meth:`expire` (its timeout passed).
        self.expired: BaseException | None = None

    def succeed(self, value: list[torch.Tensor]) -> None:
        self.outcome.set_result(value)

    def fail(self, exc: BaseException) -> None:
        expired = self.expired
        if expired is not None and expired is not exc:
            expired.__cause__ = exc
            exc = expired
        self.outcome.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: any exception

    def expire(self, error: BaseException) -> None:
        """Cancel the op (its timeout passed); if that ends it, it fails with ``error``.  An op
        that has finished already keeps its outcome."""
        if self.handle.done():
            return
        self.expired = error
        self.handle.cancel()


def _settled(outcome: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
    return outcome.value()  # raises the op's error: torch fails the future with it


class Settler:
    """Completes finished ops' torch futures off the group's completion thread.

    ``set_result`` runs the future's ``then`` callbacks in the thread that calls it, and a
    callback may start another collective of the group and wait for it (torch's PowerSGD hook
    all-reduces inside its callback): on the completion thread, that wait would block the only
    thread that finishes the inner collective.  Here a task runs on an idle settling thread, in
    the order submitted; when every settling thread is busy (a callback waiting, say) a new one
    starts, so a later op's settling never queues behind an earlier op's callback.  Threads that
    are not needed any more stay idle until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._tasks: collections.deque[Callable[[], None]] = collections.deque()
        self._idle = 0
        self._busy = 0
        self._threads = 0
        self._closed = False
        self._local = threading.local()  # ``settling``: set on the settling threads

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            self._tasks.append(task)
            if self._idle > len(self._tasks) - 1:
                self._wake.notify_all()  # all: close() waits on the same condition
                return
            self._threads += 1
            n = self._threads
        threading.Thread(target=self._run, name=f"{self._name}-settle-{n}", daemon=True).start()

    def close(self, timeout: float = 30.0) -> bool:
        """Let the settling threads end once the submitted tasks are done, and wait up to
        ``timeout`` seconds for those tasks (a process must not exit while a thread runs a torch
        callback); whether they were done in time.  Called from a task (a callback that shuts
        its group down), it waits for the other tasks, not for that one."""
        own = 1 if getattr(self._local, "settling", False) else 0
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            return self._wake.wait_for(lambda: not self._tasks and self._busy <= own, timeout)

    def _run(self) -> None:
        self._local.settling = True
        while True:
            with self._lock:
                while not self._tasks:
                    if self._closed:
                        return
                    self._idle += 1
                    self._wake.wait()
                    self._idle -= 1
                task = self._tasks.popleft()
                self._busy += 1
            try:
                task()
            except Exception:  # noqa: BLE001 - a torch callback's own error is its future's
                log.exception("settling a collective's torch future failed")
            finally:
                del task  # the op's tensors and futures: not held by an idle thread
                with self._lock:
                    self._busy -= 1
                    self._wake.notify_all()

