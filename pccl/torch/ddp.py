"""torch's DistributedDataParallel with pccl averaging the gradients: peers may die and join.

::

    comm = pccl.blocking.open_communicator(master)
    model = Net()
    ddp = pccl.torch.DistributedDataParallel(model, comm)     # alone: no collective of torch's
    optimizer = torch.optim.AdamW(ddp.parameters())
    state = pccl.SharedState({...model parameters, optimizer state, step...})
    for info in comm.steps(state):            # update_topology + wait while alone + sync_shared_state
        loss = loss_fn(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()                        # every bucket averaged over the peers by the hook
        try:
            ddp.reduced()                      # ReduceInfo of this backward, or the error that ended it
        except pccl.CollectiveAborted:
            continue                           # master lost / loops diverged: skip the step
        optimizer.step()
        state.revision += 1

:func:`ddp_comm_hook` is a DDP communication hook (the contract of
``torch.distributed.algorithms.ddp_comm_hooks``: ``hook(state, bucket) -> Future[Tensor]``).  For
each gradient bucket it starts ``all_reduce_many([bucket.buffer()], op=AVG)`` on the
:class:`~pccl.blocking.Communicator` of its :class:`CommHookState` (tag ``first_tag +
bucket.index()``, so buckets overlap with the rest of the backward and with each other) and
returns a future that a helper thread completes when the op is done.  A peer that dies mid-op
aborts the buckets it was in; pccl retries them on the survivors, so the backward returns with
every bucket averaged over the peers that took part (bit-identical on every survivor).  Alone
in the group, a bucket keeps this peer's own gradients (the average over one peer).  The errors
that end an op without a retry (``CollectiveAborted`` when the master restarted or the peers'
loops diverged; ``Kicked``, ``MasterUnreachable``, ``InvalidUsage`` …) are not raised inside the
backward — torch would turn them into an untyped ``RuntimeError`` — but recorded: the bucket
keeps this peer's own gradients, and :meth:`CommHookState.reduced` raises the first such error
after the backward (``CollectiveAborted``: skip the optimizer step and ``continue``; the next
step's ``update_topology`` and sync realign the peers).

:class:`DistributedDataParallel` is torch's DDP built over a single-process group of its own (a
process group of size 1 whose collectives return at once), as torchft does: DDP's constructor
checks the parameters' shapes across the group and broadcasts rank 0's parameters, collectives
that a newcomer would run alone, so here they stay local and a peer may construct the wrapper at
any time; the newcomer receives the model through the shared state instead, at its first sync.
Every bucket goes through :func:`ddp_comm_hook`.  ``find_unused_parameters=True`` is forced (as
torchft does): it keeps DDP from re-ordering its buckets after the first iteration, which a
newcomer would do one step later than the others, so every peer keeps the same buckets in the
same order (pccl checks that every peer's bucket ``k`` has the same size and dtype).  torch
then warns once that it found no unused parameter: harmless.

Where the membership calls go: ``update_topology()`` and ``sync_shared_state()`` must not run
while a bucket's all-reduce is in flight, and none is once ``loss.backward()`` has returned (DDP
waits for every bucket's future before it returns) — so the loop of ``comm.steps(state)``, with
the forward, the backward and the optimizer step in its body, is the intended shape: a newcomer
is accepted at the top of a step, receives the parameters and the optimizer state at that
step's sync, and runs the same backward as everyone else.  Buffers (BatchNorm's running
statistics) are not averaged by DDP's gradient buckets and are not broadcast either (the group
has one process): put them in the shared state if they must agree.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from ..blocking import CollectiveHandle, Communicator
from ..errors import InvalidArgument, InvalidUsage, PCCLError, TooFewPeers
from ..types import Quantization, ReduceInfo, ReduceOp

__all__ = ["CommHookState", "DDP_FIRST_TAG", "DistributedDataParallel", "ddp_comm_hook"]

log = logging.getLogger(__name__)

#: Bucket ``k`` of a hook is all-reduced on tag ``first_tag + k``; by default far from the small
#: tags loops pick and below ``all_reduce_many``'s own default (``1 << 62``).
DDP_FIRST_TAG = 1 << 61

#: Seconds without a bucket after which the helper thread of a CommHookState stops.
_IDLE = 5.0


@dataclasses.dataclass
class _Bucket:
    """One bucket's op, waiting for the completer thread."""

    handle: CollectiveHandle[ReduceInfo]
    future: torch.futures.Future[torch.Tensor]
    buffer: torch.Tensor
    index: int


class CommHookState:
    """The state :func:`ddp_comm_hook` is registered with: the communicator, the tags, the
    quantization on the wire, and the outcome of the current backward.

    Register it on a torch DDP yourself (``ddp.register_comm_hook(CommHookState(comm),
    ddp_comm_hook)``) or let :class:`DistributedDataParallel` do it.  ``first_tag``: bucket
    ``k`` uses tag ``first_tag + k`` (two DDP models on one communicator need tag ranges that
    do not overlap).  The helper thread that completes the buckets' futures starts with a
    bucket and stops after a few seconds without one, or at :meth:`close` (a daemon: it never
    holds up the interpreter's exit).
    """

    def __init__(self, comm: Communicator, *, first_tag: int = DDP_FIRST_TAG,
                 quantization: Quantization | None = None) -> None:
        if isinstance(first_tag, bool) or not isinstance(first_tag, int) or first_tag < 0:
            raise InvalidArgument(f"first_tag must be a non-negative integer, got {first_tag!r}")
        self.comm = comm
        self.first_tag = first_tag
        self.quantization = quantization
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Bucket | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # The current backward's outcome: one ReduceInfo per bucket done, the first error.
        self._infos: list[ReduceInfo] = []
        self._error: BaseException | None = None
        self._buckets = 0

    # --- the hook's side (the backward's thread) ------------------------------------------------

    def start(self, buffer: torch.Tensor, index: int) -> torch.futures.Future[torch.Tensor]:
        """Start the all-reduce (AVG) of one bucket and return the future DDP waits for.
        Bucket 0 begins a new backward's outcome (DDP launches its buckets in index order)."""
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        with self._lock:
            if self._closed:
                raise InvalidUsage("the DDP comm hook's state is closed")
            if index == 0:
                self._infos, self._error, self._buckets = [], None, 0
            self._buckets += 1
        try:
            handle = self.comm.all_reduce_many_async([buffer], op=ReduceOp.AVG, quantization=self.quantization,
                                                     first_tag=self.first_tag + index, bucket_bytes=0)
        except PCCLError as exc:  # the communicator is closed
            self._record(None, exc)
            future.set_result(buffer)
            return future
        with self._lock:  # queued under the lock: the thread leaves only with the queue empty, under it too
            self._queue.put(_Bucket(handle, future, buffer, index))
            if self._thread is None:
                self._thread = threading.Thread(target=self._complete, name="pccl-ddp-hook", daemon=True)
                self._thread.start()
        return future

    # --- the completer thread -------------------------------------------------------------------

    def _complete(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_IDLE)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():  # the next bucket starts a new thread
                        self._thread = None
                        return
                continue
            if item is None:
                return
            info: ReduceInfo | None = None
            error: BaseException | None = None
            try:
                info = item.handle.wait()
            except TooFewPeers:
                info = ReduceInfo(world_size=1, tx_bytes=0, rx_bytes=0)  # alone: its own gradients
            except BaseException as exc:  # recorded; the bucket holds this peer's own gradients again
                log.info("DDP bucket %d was not reduced: %s", item.index, exc)
                error = exc
            self._record(info, error)
            item.future.set_result(item.buffer)

    def _record(self, info: ReduceInfo | None, error: BaseException | None) -> None:
        with self._lock:
            if info is not None:
                self._infos.append(info)
            if error is not None and self._error is None:
                self._error = error

    # --- after the backward -----------------------------------------------------------------------

    def reduced(self) -> ReduceInfo:
        """The outcome of the last backward: ``ReduceInfo`` with the smallest number of peers any
        bucket was averaged over and the summed payload bytes.  Raises the first error that
        ended a bucket's all-reduce without a retry — ``CollectiveAborted`` (the master
        restarted, or the peers' loops diverged: skip this step, the next step's sync realigns
        the peers), ``Kicked``, ``MasterUnreachable``, ``InvalidUsage`` (the peers' buckets
        differ, or a call of this peer's was outstanding), ``InvalidArgument`` — such a bucket
        holds this peer's own gradients.  ``InvalidUsage`` if no bucket was reduced yet."""
        with self._lock:
            if self._error is not None:
                raise self._error
            if not self._infos or len(self._infos) < self._buckets:
                raise InvalidUsage("no backward through the DDP comm hook has finished yet")
            return ReduceInfo(world_size=min(i.world_size for i in self._infos),
                              tx_bytes=sum(i.tx_bytes for i in self._infos),
                              rx_bytes=sum(i.rx_bytes for i in self._infos))

    def close(self) -> None:
        """Stop the helper thread once the buckets already started are completed.  Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join()


def ddp_comm_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average ``bucket`` over the peers of ``state.comm``'s group with
    pccl (AVG), retried on the survivors when a peer dies; the future holds the averaged
    bucket.  Never fails the future: what ends a bucket's op without a retry is recorded and
    raised by ``state.reduced()`` after the backward (the bucket keeps this peer's gradients).
    Raises ``InvalidUsage`` (in the backward) once ``state`` is closed.

    Cancellation: DDP waits for the buckets' futures inside torch's C++ code, so a Ctrl-C during
    the backward is seen once the buckets' ops have ended (they are not cancelled); closing the
    communicator cancels them (``reduced()`` then raises ``InvalidUsage``, and each bucket holds
    either this peer's own gradients or, when its op had completed, the average: the close
    does not say which, so the step is skipped)."""
    return state.start(bucket.buffer(), bucket.index())


# DDP's register_comm_hook compares the annotations with the classes themselves; this module's
# ``from __future__ import annotations`` would leave strings there.
ddp_comm_hook.__annotations__ = {"state": CommHookState, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}


class _Done(dist.Work):
    """A collective of the single-process group: done when created."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future


class _SoloGroup(dist.ProcessGroup):
    """A process group of one process (rank 0 of 1) whose collectives are the identity: what DDP's
    constructor and forward run over it (the parameter check, the broadcasts from rank 0) costs
    nothing and waits for no one."""

    def __init__(self) -> None:
        # (rank, size): the constructor of Python-side groups (torchft's too); torch's stub lists
        # only the (store, rank, size) one.
        super().__init__(0, 1)  # type: ignore[call-arg]

    def getBackendName(self) -> str:
        return "pccl-solo"

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def broadcast(self, tensors: Any, opts: Any = None) -> _Done:  # type: ignore[override]
        return _Done(tensors)

    def allreduce(self, tensors: Any, opts: Any = None) -> _Done:  # type: ignore[override]
        return _Done(tensors)

    def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> _Done:  # type: ignore[override]
        for out, tensor in zip(outputs, inputs):
            out[0].copy_(tensor)
        return _Done(outputs)

    def _allgather_base(self, output: Any, tensor: Any, opts: Any = None) -> _Done:  # type: ignore[override]
        output.copy_(tensor)
        return _Done([output])

    def barrier(self, opts: Any = None) -> _Done:  # type: ignore[override]
        return _Done([])


class DistributedDataParallel(_TorchDDP):
    """torch's ``DistributedDataParallel`` over a single-process group, with every gradient bucket
    averaged over the pccl peers of ``comm`` by :func:`ddp_comm_hook` (the module docstring
    shows the loop).  Constructing it runs no collective across peers, so a newcomer may build
    it alone, at any time.

    ``first_tag`` and ``quantization`` go to the hook's :class:`CommHookState` (``hook_state``);
    other keyword arguments go to torch's DDP (``bucket_cap_mb``, ``gradient_as_bucket_view`` …),
    except ``process_group``, ``device_mesh`` and ``static_graph`` (``InvalidArgument``) and
    ``find_unused_parameters`` (forced to ``True``).  The gradients must be tensors pccl
    reduces (CPU tensors).  Raises ``InvalidArgument`` and what torch's constructor raises."""

    def __init__(self, module: torch.nn.Module, comm: Communicator, *, first_tag: int = DDP_FIRST_TAG,
                 quantization: Quantization | None = None, **kwargs: Any) -> None:
        for refused in ("process_group", "device_mesh", "static_graph"):
            if kwargs.get(refused):
                raise InvalidArgument(f"pccl.torch.DistributedDataParallel chooses its own group; "
                                      f"{refused}= is not supported")
            kwargs.pop(refused, None)
        kwargs["find_unused_parameters"] = True
        state = CommHookState(comm, first_tag=first_tag, quantization=quantization)
        super().__init__(module, process_group=_SoloGroup(), **kwargs)
        self.hook_state = state
        self.register_comm_hook(state, ddp_comm_hook)

    def reduced(self) -> ReduceInfo:
        """The last backward's outcome (:meth:`CommHookState.reduced`): ``ReduceInfo``, or the
        error that ended a bucket's all-reduce (``CollectiveAborted``: skip the step)."""
        return self.hook_state.reduced()
