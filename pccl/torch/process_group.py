"""A ``torch.distributed.ProcessGroup`` over a :mod:`pccl.blocking` communicator.

::

    import torch, torch.distributed as dist, pccl.blocking, pccl.torch

    with pccl.blocking.open_communicator("127.0.0.1:48148") as comm:
        pg = pccl.torch.ProcessGroup(comm)
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=pg)      # over the group's peers now
        dist.broadcast(weights, group_src=0, group=pg)             # from ring position 0

The group is the communicator's peer group as it is *now*: :meth:`ProcessGroup.size` is its
world size and :meth:`ProcessGroup.rank` this peer's position in its ring, both re-read at every
call (peers leave and join; pccl's collectives run over whoever is accepted).  Each collective
starts the matching ``*_async`` call of the communicator and returns a :class:`Work` at once; the
Trio thread of the communicator runs it, and a completion thread of the group finishes it (copies
results into torch's output tensors) and completes the work's ``torch.futures.Future``, so
``then`` callbacks never run on the caller's thread nor on the communicator's Trio thread.

Errors are pccl's (:class:`~pccl.errors.CollectiveAborted` when a peer died mid-op — the inputs
of an in-place op hold their values again —, ``InvalidUsage``, ``Kicked``, …): ``Work.wait()``
raises them, and the future holds them.  Arguments that cannot meet torch's contract (a list of
several tensors, an output of the wrong size, an op pccl has no equivalent for) raise
``InvalidArgument`` at the call.  Alone in its group (world size 1) every collective is the
identity, as on any one-process group.

Tags: the group's ``k``-th collective uses the tag ``first_tag + k`` (``1 << 61`` by default,
clear of pccl's own defaults), so the peers must issue the group's collectives in the same order
— torch's own rule.  The count starts again at 0 at the first call after the ring changed
(a topology update: every peer is idle then) while none of the group's collectives is running,
so a newcomer's ``ProcessGroup`` counts in step with the veterans' from its first call.
"""

from __future__ import annotations

import datetime
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .. import blocking
from ..errors import CollectiveAborted, InvalidArgument, InvalidUsage, TooFewPeers
from ..types import DType, ReduceOp

__all__ = ["ProcessGroup", "Work", "register", "BACKEND", "FIRST_TAG"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: The backend name :func:`register` registers and :meth:`ProcessGroup.getBackendName` reports.
BACKEND = "pccl"
#: The first tag a group's collectives use (op ``k``: ``FIRST_TAG + k``): clear of a plain call's
#: tag 0 and of ``all_reduce_many``'s ``1 << 62``.
FIRST_TAG = 1 << 61
#: The environment a process group created by the registered backend reads.
MASTER_ENV, PEER_GROUP_ENV = "PCCL_MASTER", "PCCL_PEER_GROUP"

# A bfloat16 tensor's first use resolves its numpy type, which imports ml_dtypes: seconds of
# holding the GIL, during which no communicator's Trio thread can send a heartbeat.  Done here,
# at import, before the caller opens a communicator.
DType.BFLOAT16.numpy_dtype()

_OPS: tuple[tuple[Any, ReduceOp], ...] = (
    (dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.AVG), (dist.ReduceOp.PRODUCT, ReduceOp.PROD),
    (dist.ReduceOp.MIN, ReduceOp.MIN), (dist.ReduceOp.MAX, ReduceOp.MAX))


def _reduce_op(opts: Any) -> ReduceOp:
    op = opts.reduceOp
    for theirs, ours in _OPS:
        if op == theirs:
            return ours
    raise InvalidArgument(f"pccl reduces with SUM, AVG, PRODUCT, MIN or MAX, not {op}")


def _one(tensors: Sequence[_T], what: str) -> _T:
    if len(tensors) != 1:
        raise InvalidArgument(f"{what} takes one tensor per process on pccl, got {len(tensors)}")
    return tensors[0]


def _seconds(timeout: datetime.timedelta | float | None) -> float | None:
    """torch's timeouts: None or a non-positive timedelta (torch's "unset") mean no limit."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return seconds if seconds > 0 else None


class Work(dist.Work):
    """One collective of a :class:`ProcessGroup`: what torch's collectives return with
    ``async_op=True`` (and wait on otherwise).

    :meth:`wait` blocks until the collective and its finishing copies are done and raises the
    collective's pccl error; interrupted (Ctrl-C) it cancels the collective, as
    :meth:`pccl.blocking.CollectiveHandle.wait` does.  :meth:`get_future` is a
    ``torch.futures.Future`` of the op's output tensors (``[tensor]``; ``[]`` for a barrier),
    completed by the group's completion thread, holding the pccl error on failure.
    """

    def __init__(self, handle: blocking.CollectiveHandle[Any], future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._handle = handle
        self._future = future

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Wait for the collective; return ``True`` or raise its error (a pccl error, or
        ``TimeoutError`` when ``timeout`` — a ``timedelta`` — passed first; the op goes on)."""
        seconds = _seconds(timeout)
        try:
            self._handle.wait(seconds)
        except TimeoutError:
            if not self._handle.done():
                raise
        except Exception:  # noqa: BLE001 - the future holds the final word (alone: the identity)
            pass
        self._future.wait()  # raises the op's error; the finishing copies are quick
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        """The future of the op's output tensors (see the class)."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the collective and its finishing copies are done (successfully or not)."""
        return self._future.done()

    def is_success(self) -> bool:
        """Whether it is done and succeeded."""
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the error itself is the future's
            return False
        return True

    def exception(self) -> BaseException | None:
        """The op's error once done (None while running or after success)."""
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        """The op's output tensors (waits for them)."""
        self.wait()
        value = self._future.value()
        return list(value) if value is not None else []

    def synchronize(self) -> None:
        """Nothing to do on CPU: results are in the tensors once the work is completed."""


class _Op:
    """A started collective: its handle, how to finish it, and the trivial result when alone."""

    def __init__(self, handle: blocking.CollectiveHandle[Any], finish: Callable[[Any], list[torch.Tensor]],
                 alone: Callable[[], list[torch.Tensor]] | None) -> None:
        self.handle = handle
        self.finish = finish
        self.alone = alone
        self.future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()


class ProcessGroup(dist.ProcessGroup):
    """``comm``'s peer group as a ``torch.distributed.ProcessGroup``: ``size()`` is its world
    size now, ``rank()`` this peer's ring position now; each collective starts the
    communicator's ``*_async`` twin and returns a :class:`Work` at once.

    ``comm`` is an open :class:`pccl.blocking.Communicator`; the group uses it and leaves it
    open unless ``owns_communicator`` (then :meth:`shutdown` closes it).  ``first_tag``: the tag
    of the group's first collective (op ``k`` uses ``first_tag + k``).
    """

    def __init__(self, comm: blocking.Communicator, *, first_tag: int = FIRST_TAG,
                 owns_communicator: bool = False) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # static rank and size; getRank/getSize answer
        self._comm = comm
        self._first_tag = first_tag
        self._owns = owns_communicator
        self._lock = threading.Lock()
        self._seq = 0
        self._ring: tuple[int, ...] | None = None
        self._running = 0
        self._closed = False
        self._queue: queue.SimpleQueue[_Op | None] = queue.SimpleQueue()
        self._completer = threading.Thread(target=self._complete, name=f"pccl-torch-{id(self):x}", daemon=True)
        self._completer.start()

    # --- what torch asks ------------------------------------------------------------------------

    @property
    def communicator(self) -> blocking.Communicator:
        """The communicator the group runs on."""
        return self._comm

    def getRank(self) -> int:  # noqa: N802 - torch's name
        """This peer's position in its group's ring now."""
        ring, peer_id = self._comm.ring, self._comm.peer_id
        return ring.index(peer_id) if peer_id in ring else 0

    def getSize(self) -> int:  # noqa: N802 - torch's name
        """The number of accepted peers in the group now."""
        return self._comm.world_size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"pccl"``."""
        return BACKEND

    def __repr__(self) -> str:
        return f"pccl.torch.ProcessGroup(peer_group={self._comm.peer_group}, peer_id={self._comm.peer_id:x})"

    # --- collectives ------------------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """All-reduce the one tensor of ``tensors`` in place over the group
        (:meth:`pccl.blocking.Communicator.all_reduce_async`; ``opts.reduceOp`` SUM, AVG, PRODUCT,
        MIN or MAX — AVG divides by the peers that took part)."""
        tensor = _one(tensors, "allreduce")
        op = _reduce_op(opts if opts is not None else dist.AllreduceOptions())
        return self._start(lambda tag: self._comm.all_reduce_async(tensor, op=op, tag=tag),
                           lambda info: [tensor], lambda: [tensor])

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        """Overwrite the one tensor of ``tensors`` with the one of the peer at ring position
        ``opts.rootRank`` (:meth:`pccl.blocking.Communicator.broadcast_async`; the root is that
        peer's id)."""
        tensor = _one(tensors, "broadcast")
        opts = opts if opts is not None else dist.BroadcastOptions()
        if opts.rootTensor != 0:
            raise InvalidArgument(f"broadcast takes one tensor per process on pccl (rootTensor {opts.rootTensor})")
        ring, root_rank = self._comm.ring, opts.rootRank
        if not 0 <= root_rank < len(ring):
            raise InvalidArgument(f"broadcast from rank {root_rank}: the group has {len(ring)} peers now")
        root = ring[root_rank]
        alone = (lambda: [tensor]) if root_rank == 0 else None
        return self._start(lambda tag: self._comm.broadcast_async(tensor, root=root, tag=tag),
                           lambda info: [tensor], alone)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Work:
        """Gather every peer's one input into ``output_tensors[0]`` (one tensor per peer, in
        ring order; sizes may differ from peer to peer as long as each output fits its input)."""
        tensor = _one(input_tensors, "allgather")
        outputs = list(_one(output_tensors, "allgather"))
        if len(outputs) != self.getSize():
            raise InvalidArgument(f"allgather needs one output tensor per peer: the group has {self.getSize()} "
                                  f"peers now, got {len(outputs)}")

        def finish(gathered: Any) -> list[torch.Tensor]:
            if len(gathered.arrays) != len(outputs):
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {gathered.world_size} "
                                        f"peers, not the {len(outputs)} the outputs were made for; retry")
            for out, part in zip(outputs, gathered.arrays):
                if part.numel() != out.numel():
                    raise InvalidArgument(f"allgather: a peer sent {part.numel()} elements for an output "
                                          f"tensor of {out.numel()}")
                out.copy_(part.reshape(out.shape))
            return outputs

        def alone() -> list[torch.Tensor]:
            outputs[0].copy_(tensor.reshape(outputs[0].shape))
            return outputs

        return self._start(lambda tag: self._comm.all_gather_async(tensor, tag=tag), finish,
                           alone if len(outputs) == 1 else None)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """torch's ``all_gather_into_tensor``: every peer's ``input`` (the same size on all)
        concatenated in ring order into ``output`` (``size()`` times ``input``'s elements)."""
        world = self.getSize()
        if output.numel() != input.numel() * world or output.dtype != input.dtype:
            raise InvalidArgument(f"all_gather_into_tensor needs an output of {world} x {input.numel()} elements "
                                  f"of {input.dtype} (the group has {world} peers now), got {output.numel()} "
                                  f"of {output.dtype}")

        def finish(gathered: Any) -> list[torch.Tensor]:
            if gathered.buffer.numel() != output.numel():
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {gathered.world_size} "
                                        f"peers ({gathered.buffer.numel()} elements), the output holds "
                                        f"{output.numel()}; retry")
            output.copy_(gathered.buffer.reshape(output.shape))
            return [output]

        def alone() -> list[torch.Tensor]:
            output.copy_(input.reshape(output.shape))
            return [output]

        return self._start(lambda tag: self._comm.all_gather_async(input, tag=tag), finish,
                           alone if world == 1 else None)

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]  # noqa: A002
                              opts: Any = None) -> Work:
        """torch's ``reduce_scatter_tensor``: ``output`` gets the reduction over the group of
        the ``rank()``-th of ``size()`` equal slices of ``input``, which is left as it was.

        pccl's reduce-scatter works in place over a copy of ``input``; its shards are equal
        when ``input`` holds ``size()`` times ``output``'s elements, which is torch's contract
        and is checked here (``InvalidArgument`` otherwise)."""
        world = self.getSize()
        op = _reduce_op(opts if opts is not None else dist.ReduceScatterOptions())
        if input.numel() != output.numel() * world or output.dtype != input.dtype:
            raise InvalidArgument(f"reduce_scatter_tensor needs an input of {world} x {output.numel()} elements "
                                  f"of {output.dtype} (the group has {world} peers now: one equal slice each), "
                                  f"got {input.numel()} of {input.dtype}; pccl.blocking.Communicator."
                                  "reduce_scatter takes other sizes")
        work = input.detach().reshape(-1).clone()  # pccl reduces in place; torch leaves the input alone

        def finish(shard: Any) -> list[torch.Tensor]:
            if shard.world_size != world or shard.stop - shard.start != output.numel():
                raise CollectiveAborted(f"the group changed size: the reduce-scatter ran over {shard.world_size} "
                                        f"peers, the tensors were made for {world}; retry")
            output.copy_(work[shard.start:shard.stop].reshape(output.shape))
            return [output]

        def alone() -> list[torch.Tensor]:
            output.copy_(input.reshape(output.shape))
            return [output]

        return self._start(lambda tag: self._comm.reduce_scatter_async(work, op=op, tag=tag), finish,
                           alone if world == 1 else None)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> Work:
        """torch's list ``reduce_scatter``: the one output gets the reduction over the group of
        ``input_tensors[0][rank()]``; every input tensor has the output's size."""
        output = _one(output_tensors, "reduce_scatter")
        inputs = list(_one(input_tensors, "reduce_scatter"))
        if len(inputs) != self.getSize() or any(t.numel() != output.numel() for t in inputs):
            raise InvalidArgument(f"reduce_scatter needs one input per peer ({self.getSize()} now), each of the "
                                  f"output's {output.numel()} elements")
        flat = torch.cat([t.detach().reshape(-1) for t in inputs]) if inputs else output.new_empty(0)
        return self.reduce_scatter_single(output, flat, opts)

    def barrier(self, opts: Any = None) -> Work:  # type: ignore[override]
        """Return once every peer of the group reached its barrier (a one-byte all-reduce)."""
        token = torch.zeros(1, dtype=torch.uint8)
        return self._start(lambda tag: self._comm.all_reduce_async(token, tag=tag), lambda info: [], lambda: [])

    def _unsupported(self, name: str) -> Work:
        raise InvalidUsage(f"pccl's process group has no {name}: it offers all-reduce, broadcast, all-gather, "
                           "reduce-scatter and barrier")

    def reduce(self, *args: Any, **kwargs: Any) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): all-reduce instead."""
        return self._unsupported("reduce")

    def gather(self, *args: Any, **kwargs: Any) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): all-gather instead."""
        return self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): broadcast instead."""
        return self._unsupported("scatter")

    def send(self, *args: Any, **kwargs: Any) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): pccl has no point-to-point calls."""
        return self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): pccl has no point-to-point calls."""
        return self._unsupported("recv")

    # --- lifecycle --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the completion thread once the running collectives are finished, and close the
        communicator when the group owns it (``torch.distributed.destroy_process_group`` calls
        this).  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(None)
        if self._owns:
            self._comm.close()  # cancels what still runs; the completion thread then finishes
        self._completer.join(30)

    def abort(self) -> None:
        """As :meth:`shutdown`."""
        self.shutdown()

    # --- the machinery ------------------------------------------------------------------------------

    def _start(self, call: Callable[[int], blocking.CollectiveHandle[Any]],
               finish: Callable[[Any], list[torch.Tensor]], alone: Callable[[], list[torch.Tensor]] | None) -> Work:
        ring = self._comm.ring
        with self._lock:
            if self._closed:
                raise InvalidUsage("the process group was shut down")
            if ring != self._ring and self._running == 0:
                self._ring, self._seq = ring, 0  # a new ring: every peer starts counting again
            tag = self._first_tag + self._seq
            op = _Op(call(tag), finish, alone)
            self._seq += 1
            self._running += 1
            self._queue.put(op)  # under the lock: in the order started, and never after shutdown's None
        return Work(op.handle, op.future)

    def _complete(self) -> None:
        """The completion thread: finish each op in the order they started."""
        while True:
            op = self._queue.get()
            if op is None:
                return
            try:
                result = op.handle.wait()
            except TooFewPeers as exc:
                self._settle(op, lambda: self._alone(op, exc))
            except Exception as exc:  # noqa: BLE001 - delivered through the future
                self._done()
                op.future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: any exception
            else:
                self._settle(op, lambda: op.finish(result))

    def _alone(self, op: _Op, exc: TooFewPeers) -> list[torch.Tensor]:
        if op.alone is None:
            raise exc
        return op.alone()

    def _settle(self, op: _Op, compute: Callable[[], list[torch.Tensor]]) -> None:
        try:
            value = compute()
        except Exception as exc:  # noqa: BLE001 - delivered through the future
            self._done()
            op.future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub: any exception
            return
        self._done()
        op.future.set_result(value)

    def _done(self) -> None:
        with self._lock:
            self._running -= 1


# --- the registered backend -------------------------------------------------------------------------


def register() -> None:
    """Register the ``torch.distributed`` backend ``"pccl"`` (idempotent).

    Then ``torch.distributed.init_process_group("pccl", store=..., rank=r, world_size=n)`` (or
    ``new_group(backend="pccl")``) opens a :mod:`pccl.blocking` communicator to the master named
    by ``$PCCL_MASTER`` (``host:port``; ``pccl run`` sets it), in the peer group
    ``$PCCL_PEER_GROUP`` (default 0), with the token of ``$PCCL_TOKEN``, waits until the group
    has ``n`` peers (voting them in; the group's timeout bounds the wait: ``TooFewPeers``), and
    returns a :class:`ProcessGroup` that owns the communicator.  Its ranks are ring positions:
    as the default group, ``get_rank()`` is this peer's ring position; in a group made by
    ``new_group`` inside another backend's world, name broadcast roots with ``group_src=``.
    Raises ``InvalidUsage`` (no ``$PCCL_MASTER``) and what opening a communicator raises.
    """
    dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])


def _create(store: Any, rank: int, world_size: int, timeout: datetime.timedelta | None) -> ProcessGroup:
    master = os.environ.get(MASTER_ENV, "")
    if not master:
        raise InvalidUsage(f"the pccl backend connects to the master named by ${MASTER_ENV} (host:port): set it "
                           "(pccl run does), or build pccl.torch.ProcessGroup(comm) over a communicator of yours")
    try:
        peer_group = int(os.environ.get(PEER_GROUP_ENV, "0"))
    except ValueError:
        raise InvalidArgument(f"${PEER_GROUP_ENV} must be an integer, got {os.environ[PEER_GROUP_ENV]!r}") from None
    comm = blocking.open_communicator(master, peer_group=peer_group)
    try:
        wait_for_peers(comm, world_size, _seconds(timeout))
    except BaseException:
        comm.close()
        raise
    log.info("pccl backend: peer %x in a group of %d", comm.peer_id, comm.world_size)
    return ProcessGroup(comm, owns_communicator=True)


def wait_for_peers(comm: blocking.Communicator, world_size: int, timeout: float | None = None) -> None:
    """Vote pending peers in (``update_topology``) until ``comm``'s group has ``world_size``
    peers; every accepted peer of the run calls it (or otherwise takes part in the votes).
    Raises ``TooFewPeers`` when ``timeout`` seconds pass first, and the errors of
    :meth:`pccl.blocking.Communicator.update_topology`."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while comm.world_size < world_size:
        if deadline is not None and time.monotonic() > deadline:
            raise TooFewPeers(f"the group has {comm.world_size} of the {world_size} peers after {timeout:g} s")
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.05)
