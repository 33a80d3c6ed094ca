"""``pccl.blocking``: the communicator's API for ordinary synchronous training loops.

::

    with pccl.blocking.open_communicator("127.0.0.1:48148") as comm:
        state = pccl.SharedState({n: p.detach() for n, p in model.named_parameters()})
        for info in comm.steps(state):                     # a plain iterator
            handle = comm.all_reduce_async(grads, op=pccl.ReduceOp.AVG)  # returns at once
            other_work()                                   # overlaps the communication
            handle.wait()                                  # ReduceInfo, or raises

Each :class:`Communicator` owns a background thread running a Trio loop with the async
:class:`pccl.Communicator` in it.  Calls are handed to that loop with ``trio.from_thread`` and
their results come back through a :class:`concurrent.futures.Future`, so the caller's thread
may compute for as long as it likes: the heartbeats to the master and every other background
task of the communicator keep running on the Trio thread meanwhile (the C kernels and torch
release the GIL; pure-Python work still lets the Trio thread run every few milliseconds).

Every async method has a twin here with the same name and arguments, returning the same
values and raising the same :class:`~pccl.errors.PCCLError` types in the caller's thread.
``all_reduce_async``, ``broadcast_async``, ``all_gather_async``, ``reduce_scatter_async`` and
``all_reduce_many_async`` start the operation and return a :class:`CollectiveHandle` at once; the buffers belong to pccl until the handle is done (the result
lands in them; on ``CollectiveAborted`` an in-place buffer holds its input again, as with the
async call).  ``send_async`` and ``recv_async`` (point to point) return the same kind of handle.

Ctrl-C: a ``KeyboardInterrupt`` (or any exception) in the caller's thread while it waits for a
call cancels that call (an in-place all-reduce gets its input back and the other peers abort
it; once its peer reported its success to the master, it ends as the master says instead, with
the others: ``CollectiveHandle.cancel``); leaving the ``with`` block, :meth:`Communicator.close`, or interpreter exit then leaves the
run cleanly (the master sees a leave, not a timeout).  Closing cancels every call still running,
including one waiting for the master's word on a success its peer reported: that one ends at
once with its input restored, while the others may complete the op (closing stops the reading
of the master's messages).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import trio

from . import communicator as _async
from .collectives.buckets import DEFAULT_BUCKET_BYTES
from ._peer.collective_service import MANY_FIRST_TAG
from .config import Config
from .errors import InvalidUsage, PCCLError
from .shared_state import SharedState
from .types import CollectiveInfo, Gathered, Quantization, ReduceInfo, ReduceOp, Shard, SyncInfo, SyncStrategy

__all__ = ["Communicator", "CollectiveHandle", "ReduceHandle", "open_communicator"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: How long close() waits for the Trio thread to leave the run (the leave itself is bounded by
#: the communicator: at most a second to tell the master, then the connections close).
_CLOSE_WAIT = 30.0


class CollectiveHandle(Generic[_T]):
    """A collective started by one of the ``*_async`` calls (``all_reduce_async``,
    ``broadcast_async``, ``all_gather_async``, ``reduce_scatter_async``,
    ``all_reduce_many_async``)."""

    def __init__(self, future: concurrent.futures.Future[_T],
                 wait: Callable[[concurrent.futures.Future[_T], float | None], _T],
                 cancel: Callable[[concurrent.futures.Future[_T]], None] | None = None) -> None:
        self._future = future
        self._wait_for = wait  # the communicator's: waits, and cancels the operation if interrupted
        self._cancel_call = cancel  # the communicator's: cancels the operation's task

    def done(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the operation has finished (at once if it has): on the
        communicator's Trio thread, or on this one — keep it short, and never wait in it."""
        self._future.add_done_callback(lambda _: fn())

    def wait(self, timeout: float | None = None) -> _T:
        """Wait for the operation and return its result (``ReduceInfo``, ``CollectiveInfo``,
        ``Gathered``, ``Shard``), or raise its error (``CollectiveAborted``, ``TooFewPeers``, ...).
        ``TimeoutError`` if it is still running after ``timeout`` seconds (it keeps running; wait
        again).  Interrupted (Ctrl-C), the operation is cancelled."""
        return self._wait_for(self._future, timeout)

    def cancel(self) -> None:
        """Cancel the operation, as an interrupted :meth:`wait` does (the async call's
        cancellation: an in-place buffer holds its input again, the other participants' calls
        of a collective abort; a cancelled vote is withdrawn).  :meth:`wait` then raises the
        operation's error — except for a collective whose peer had reported its success to the
        master already: that one ends as the master says, the others' calls alike, so
        :meth:`wait` returns its result if it completed (docs/reference/errors.rst).  Not so for
        ``all_reduce_many``: cancelled, its :meth:`wait` raises ``InvalidUsage`` even when every
        op completed (each array then holds its reduction if its op completed, else its input).
        Returns at once; nothing happens once the operation has finished."""
        if self._cancel_call is not None and not self._future.done():
            self._cancel_call(self._future)


#: The handle of an all-reduce (the name earlier releases gave it).
ReduceHandle = CollectiveHandle

class Communicator:
    """A peer's membership in a run, for synchronous code.  Obtain one from
    :func:`open_communicator`; use it as a context manager or call :meth:`close`."""

    def __init__(self, master_address: str, *, peer_group: int, token: str | bytes | None,
                 config: Config | None) -> None:
        self._closed = False
        self._close_lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._comm: _async.Communicator | None = None
        self._nursery: trio.Nursery | None = None
        self._main_scope = trio.CancelScope()
        self._scopes: dict[concurrent.futures.Future[Any], trio.CancelScope] = {}
        self._opened: concurrent.futures.Future[None] = concurrent.futures.Future()
        if "torch" in sys.modules:
            # A torch bfloat16 tensor is viewed as ml_dtypes.bfloat16, whose first import holds
            # the GIL for seconds under load: done here, before the Trio thread's heartbeats run,
            # not on that thread in the middle of a call (the master would time the peer out).
            import ml_dtypes  # noqa: F401
        self._thread = threading.Thread(
            target=trio.run, args=(self._main, master_address, peer_group, token, config),
            name=f"pccl-trio-{master_address}", daemon=True)
        self._thread.start()
        try:
            self._opened.result()
        except BaseException:
            self.close()
            raise
        _OPEN.add(self)

    # --- the Trio thread ----------------------------------------------------------------------

    async def _main(self, master_address: str, peer_group: int, token: str | bytes | None,
                    config: Config | None) -> None:
        self._token = trio.lowlevel.current_trio_token()
        try:
            with self._main_scope:
                async with _async.open_communicator(master_address, peer_group=peer_group, token=token,
                                                    config=config) as comm:
                    # Calls run as tasks of this nursery until close() cancels it; leaving the
                    # block then leaves the run.
                    async with trio.open_nursery() as nursery:
                        self._comm, self._nursery = comm, nursery
                        self._opened.set_result(None)
                        await trio.sleep_forever()
            if not self._opened.done():
                self._opened.set_exception(InvalidUsage("the communicator was closed while it was opening"))
        except BaseException as exc:
            if not self._opened.done():
                self._opened.set_exception(exc)
            elif not isinstance(exc, (PCCLError, trio.Cancelled)):
                log.exception("the communicator's Trio thread failed")

    async def _task(self, future: concurrent.futures.Future[Any], fn: Callable[[], Awaitable[Any]],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        scope = trio.CancelScope()
        self._scopes[future] = scope
        # started() before the call: nursery.start() returns once the call ran up to its first
        # schedule point, so calls begin in the order the caller made them.
        task_status.started()
        try:
            with scope:
                result = await fn()
                future.set_result(result)
                return
            future.set_exception(InvalidUsage("the call was cancelled"))
        except trio.Cancelled:
            future.set_exception(InvalidUsage("the communicator is closed"))
            raise
        except BaseException as exc:  # delivered to the caller, not to the communicator's nursery
            future.set_exception(exc)
        finally:
            del self._scopes[future]

    async def _start(self, future: concurrent.futures.Future[Any], fn: Callable[[], Awaitable[Any]]) -> None:
        if self._nursery is None:
            future.set_exception(InvalidUsage("the communicator is closed"))
            return
        await self._nursery.start(self._task, future, fn)

    # --- the caller's thread ------------------------------------------------------------------

    def _submit(self, fn: Callable[[], Awaitable[_T]]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._closed or self._token is None:
            raise InvalidUsage("the communicator is closed")
        try:
            trio.from_thread.run(self._start, future, fn, trio_token=self._token)
        except trio.RunFinishedError:
            raise InvalidUsage("the communicator is closed") from None
        return future

    def _wait(self, future: concurrent.futures.Future[_T], timeout: float | None) -> _T:
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():
                raise  # the call itself raised it
            raise TimeoutError(f"the operation is still running after {timeout:g} s") from None
        except BaseException as exc:
            if not future.done() and not isinstance(exc, PCCLError):  # interrupted while waiting
                self._cancel(future)
            raise

    def _cancel(self, future: concurrent.futures.Future[Any]) -> None:
        token = self._token
        if token is None:
            return

        def cancel() -> None:
            scope = self._scopes.get(future)
            if scope is not None:
                scope.cancel()

        try:
            trio.from_thread.run_sync(cancel, trio_token=token)
        except trio.RunFinishedError:
            pass

    def _call(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        return self._wait(self._submit(fn), None)

    def _read(self, get: Callable[[_async.Communicator], _T]) -> _T:
        """An attribute of the async communicator, read on its thread."""
        comm = self._comm
        if comm is None:
            raise InvalidUsage("the communicator is closed")
        if self._closed or self._token is None:
            return get(comm)  # the Trio thread is gone or going: nothing changes it any more
        try:
            return trio.from_thread.run_sync(get, comm, trio_token=self._token)
        except trio.RunFinishedError:
            return get(comm)

    # --- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Cancel every call still running, leave the run (the master is told) and stop the
        Trio thread.  Idempotent; safe from any thread but the communicator's own."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        _OPEN.discard(self)
        token = self._token
        if token is not None:
            try:
                trio.from_thread.run_sync(self._main_scope.cancel, trio_token=token)
            except trio.RunFinishedError:
                pass
        self._thread.join(_CLOSE_WAIT)
        if self._thread.is_alive():  # pragma: no cover - the leave is bounded
            log.warning("the communicator's Trio thread did not stop within %g s", _CLOSE_WAIT)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- attributes -----------------------------------------------------------------------------

    @property
    def peer_id(self) -> int:
        return self._read(lambda c: c.peer_id)

    @property
    def peer_group(self) -> int:
        return self._read(lambda c: c.peer_group)

    @property
    def master_address(self) -> str:
        return self._read(lambda c: c.master_address)

    @property
    def world_size(self) -> int:
        """Accepted peers in this peer's group."""
        return self._read(lambda c: c.world_size)

    @property
    def global_world_size(self) -> int:
        return self._read(lambda c: c.global_world_size)

    @property
    def num_peer_groups(self) -> int:
        return self._read(lambda c: c.num_peer_groups)

    @property
    def largest_peer_group_size(self) -> int:
        return self._read(lambda c: c.largest_peer_group_size)

    @property
    def ring(self) -> tuple[int, ...]:
        return self._read(lambda c: c.ring)

    @property
    def sites(self) -> tuple[int, ...]:
        return self._read(lambda c: c.sites)

    def statistics(self) -> _async.CommunicatorStatistics:
        return self._read(lambda c: c.statistics())

    # --- calls (see pccl.Communicator for what each does and raises) -----------------------------

    def update_topology(self) -> None:
        """Vote to accept the pending peers and re-wire the ring; return when every accepted
        peer voted and the new ring is connected (:meth:`pccl.Communicator.update_topology`).

        Raises ``InvalidUsage`` (a collective or a sync of this peer is in flight),
        ``PhaseMismatch`` (every other peer of the group waits in another call; go on to the
        next step), ``Kicked``, ``MasterUnreachable``.  Interrupted (Ctrl-C), the vote stands
        and the next call waits for it."""
        comm = self._live()
        self._call(comm.update_topology)

    def optimize_topology(self) -> None:
        """Measure the missing peer-to-peer links of this group and install the ring with the
        best bottleneck; every peer of the group calls it, like :meth:`update_topology`
        (:meth:`pccl.Communicator.optimize_topology`).  Errors as for :meth:`update_topology`."""
        comm = self._live()
        self._call(comm.optimize_topology)

    def are_peers_pending(self) -> bool:
        """Whether a registered peer waits to be accepted, i.e. whether :meth:`update_topology`
        has something to do (:meth:`pccl.Communicator.are_peers_pending`).  Every accepted peer
        asks; legal while collectives run.  Raises ``Kicked``, ``MasterUnreachable``."""
        comm = self._live()
        return self._call(comm.are_peers_pending)

    def sync_shared_state(self, state: SharedState,
                          strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> SyncInfo:
        """Make ``state`` bit-identical to the group's popular state and adopt its revision
        (written back into ``state.revision``); returns the :class:`~pccl.SyncInfo`
        (:meth:`pccl.Communicator.sync_shared_state`).

        Raises ``InvalidArgument``/``InvalidUsage`` (a bad state or strategy; a collective, a
        topology vote or another sync outstanding), ``RevisionViolation`` (it offers more than
        the group's last revision + 1; this peer is kicked), ``Kicked``, ``SharedStateSyncFailed``,
        ``PhaseMismatch``, ``MasterUnreachable``.  Interrupted after its vote went out, the sync
        goes on in the background and the next call with the same state resumes it."""
        comm = self._live()
        return self._call(lambda: comm.sync_shared_state(state, strategy))

    def all_reduce(self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0,
                   quantization: Quantization | None = None) -> ReduceInfo:
        """Ring all-reduce of ``send`` into ``recv`` (``None``: in place) over the group's
        accepted peers; blocks until done and returns the :class:`~pccl.ReduceInfo`
        (:meth:`pccl.Communicator.all_reduce`: arguments, errors and guarantees are the same).

        Arrays are C-contiguous numpy arrays or CPU torch tensors, used without a copy.  Raises
        ``InvalidArgument`` (a bad buffer), ``InvalidUsage`` (``tag`` already in flight, a
        topology vote or sync outstanding, the peers' parameters disagree), ``TooFewPeers``
        (alone; the buffers are untouched), ``CollectiveAborted`` (a participant failed; an
        in-place buffer holds its input again: retry or go on to the next step), ``Kicked``,
        ``MasterUnreachable``.  Interrupted (Ctrl-C), the operation is cancelled and an in-place
        buffer gets its input back.  :meth:`all_reduce_async` returns at once instead."""
        return self.all_reduce_async(send, recv, op=op, tag=tag, quantization=quantization).wait()

    def all_reduce_async(self, send: Any, recv: Any = None, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0,
                         quantization: Quantization | None = None) -> CollectiveHandle[ReduceInfo]:
        """Start :meth:`pccl.Communicator.all_reduce` and return at once; its errors (argument
        checks included) come from the handle's ``wait``."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.all_reduce(send, recv, op=op, tag=tag,
                                                                     quantization=quantization)),
                                self._wait, self._cancel)

    def broadcast(self, x: Any, *, root: int, tag: int = 0,
                  quantization: Quantization | None = None) -> CollectiveInfo:
        """Overwrite ``x`` on every participant with the root's (``root``: its peer id); blocks
        until done (:meth:`pccl.Communicator.broadcast`: arguments, errors and guarantees are the
        same).  :meth:`broadcast_async` returns at once instead."""
        return self.broadcast_async(x, root=root, tag=tag, quantization=quantization).wait()

    def broadcast_async(self, x: Any, *, root: int, tag: int = 0,
                        quantization: Quantization | None = None) -> CollectiveHandle[CollectiveInfo]:
        """Start :meth:`pccl.Communicator.broadcast` and return at once with its handle."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.broadcast(x, root=root, tag=tag, quantization=quantization)),
                                self._wait, self._cancel)

    def all_gather(self, x: Any, *, tag: int = 0, quantization: Quantization | None = None) -> Gathered:
        """Gather every participant's ``x`` (counts may differ) on every participant; blocks until
        done (:meth:`pccl.Communicator.all_gather`).  :meth:`all_gather_async` returns at once."""
        return self.all_gather_async(x, tag=tag, quantization=quantization).wait()

    def all_gather_async(self, x: Any, *, tag: int = 0,
                         quantization: Quantization | None = None) -> CollectiveHandle[Gathered]:
        """Start :meth:`pccl.Communicator.all_gather` and return at once with its handle."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.all_gather(x, tag=tag, quantization=quantization)),
                                self._wait, self._cancel)

    def reduce_scatter(self, x: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0,
                       quantization: Quantization | None = None) -> Shard:
        """Reduce ``x`` in place, each participant keeping its slice; blocks until done
        (:meth:`pccl.Communicator.reduce_scatter`).  :meth:`reduce_scatter_async` returns at once."""
        return self.reduce_scatter_async(x, op=op, tag=tag, quantization=quantization).wait()

    def reduce_scatter_async(self, x: Any, *, op: ReduceOp = ReduceOp.SUM, tag: int = 0,
                             quantization: Quantization | None = None) -> CollectiveHandle[Shard]:
        """Start :meth:`pccl.Communicator.reduce_scatter` and return at once with its handle."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.reduce_scatter(x, op=op, tag=tag,
                                                                         quantization=quantization)),
                                self._wait, self._cancel)

    def all_reduce_many(self, arrays: Sequence[Any], *, op: ReduceOp = ReduceOp.SUM,
                        quantization: Quantization | None = None, max_in_flight: int = 4,
                        first_tag: int = MANY_FIRST_TAG, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ReduceInfo:
        """All-reduce each array of ``arrays`` in place, a few buckets at a time, retrying
        the ones that abort on the survivors until all succeeded; blocks until done
        (:meth:`pccl.Communicator.all_reduce_many`: arguments, bucketing and errors are the
        same).  Every peer passes arrays of the same dtypes and sizes in the same order.

        Returns the smallest world size any op ran over and the summed payload bytes.  Raises
        ``TooFewPeers`` once alone, ``CollectiveAborted`` only when the master was lost (it
        restarted) or the group's loops diverged (caused by ``PhaseMismatch``) — go on to the
        next step, where ``steps()`` realigns them — and the other errors of :meth:`all_reduce`.
        :meth:`all_reduce_many_async` returns at once instead."""
        return self.all_reduce_many_async(arrays, op=op, quantization=quantization, max_in_flight=max_in_flight,
                                          first_tag=first_tag, bucket_bytes=bucket_bytes).wait()

    def all_reduce_many_async(self, arrays: Sequence[Any], *, op: ReduceOp = ReduceOp.SUM,
                              quantization: Quantization | None = None, max_in_flight: int = 4,
                              first_tag: int = MANY_FIRST_TAG,
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> CollectiveHandle[ReduceInfo]:
        """Start :meth:`pccl.Communicator.all_reduce_many` and return at once with its handle."""
        comm = self._live()
        arrays = list(arrays)
        return CollectiveHandle(self._submit(lambda: comm.all_reduce_many(
            arrays, op=op, quantization=quantization, max_in_flight=max_in_flight, first_tag=first_tag,
            bucket_bytes=bucket_bytes)), self._wait, self._cancel)

    def send(self, x: Any, *, to: int, tag: int = 0, timeout: float | None = None,
             quantization: Quantization | None = None) -> None:
        """Send ``x`` to peer ``to``; blocks until the receiver has all of it
        (:meth:`pccl.Communicator.send`: arguments, matching, errors are the same).
        :meth:`send_async` returns at once instead."""
        self.send_async(x, to=to, tag=tag, timeout=timeout, quantization=quantization).wait()

    def send_async(self, x: Any, *, to: int, tag: int = 0, timeout: float | None = None,
                   quantization: Quantization | None = None) -> CollectiveHandle[None]:
        """Start :meth:`pccl.Communicator.send` and return at once with its handle (``x``
        belongs to pccl until the handle is done)."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.send(x, to=to, tag=tag, timeout=timeout,
                                                               quantization=quantization)), self._wait, self._cancel)

    def recv(self, x: Any, *, from_: int, tag: int = 0, timeout: float | None = None,
             quantization: Quantization | None = None) -> None:
        """Receive peer ``from_``'s next message on ``tag`` into ``x``; blocks until it is all in
        (:meth:`pccl.Communicator.recv`).  :meth:`recv_async` returns at once instead."""
        self.recv_async(x, from_=from_, tag=tag, timeout=timeout, quantization=quantization).wait()

    def recv_async(self, x: Any, *, from_: int, tag: int = 0, timeout: float | None = None,
                   quantization: Quantization | None = None) -> CollectiveHandle[None]:
        """Start :meth:`pccl.Communicator.recv` and return at once with its handle (``x``
        belongs to pccl until the handle is done; on an error it holds its old values)."""
        comm = self._live()
        return CollectiveHandle(self._submit(lambda: comm.recv(x, from_=from_, tag=tag, timeout=timeout,
                                                               quantization=quantization)), self._wait, self._cancel)

    def steps(self, state: SharedState, *,
              strategy: SyncStrategy = SyncStrategy.ENFORCE_POPULAR) -> Iterator[SyncInfo]:
        """:meth:`pccl.Communicator.steps` as a plain iterator (each step's ``SyncInfo``)."""
        comm = self._live()
        agen = comm.steps(state, strategy=strategy)
        try:
            while True:
                try:
                    info = self._call(agen.__anext__)
                except StopAsyncIteration:
                    return
                yield info
        finally:
            if not self._closed:
                self._call(agen.aclose)

    def _live(self) -> _async.Communicator:
        if self._closed or self._comm is None:
            raise InvalidUsage("the communicator is closed")
        return self._comm


def open_communicator(master_address: str, *, peer_group: int = 0, token: str | bytes | None = None,
                      config: Config | None = None) -> Communicator:
    """Connect to the master, register in ``peer_group`` and wait until accepted (as
    :func:`pccl.open_communicator`), on a Trio loop in a new background thread.  Returns the
    open :class:`Communicator`; use it in a ``with`` block (or call ``close()``).  ``token``
    None reads ``$PCCL_TOKEN`` (when set and not empty), as the async call does.  Raises what
    the async call raises."""
    return Communicator(master_address, peer_group=peer_group, token=token, config=config)


#: Communicators still open at interpreter exit leave the run then (their threads are daemons,
#: so a forgotten close() neither hangs the exit nor drops the connections unannounced).
_OPEN: weakref.WeakSet[Communicator] = weakref.WeakSet()


@atexit.register
def _close_open_communicators() -> None:
    for comm in list(_OPEN):
        comm.close()
