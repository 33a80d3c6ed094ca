"""A ``torch.distributed.ProcessGroup`` over a :mod:`pccl.blocking` communicator.

::

    import torch, torch.distributed as dist, pccl.blocking, pccl.torch

    with pccl.blocking.open_communicator("127.0.0.1:48148") as comm:
        pg = pccl.torch.ProcessGroup(comm)
        dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=pg)      # over the group's peers now
        dist.broadcast(weights, group_src=0, group=pg)             # from rank 0

The group is the communicator's peer group as it is *now*: :meth:`ProcessGroup.size` is its
world size and :meth:`ProcessGroup.rank` this peer's position in its ring (or, in a group
``init_process_group`` made, in the order of the ranks the processes passed:
:mod:`pccl.torch.ranks`), both re-read at every call (peers leave and join; pccl's collectives
run over whoever is accepted).  Each collective
starts the matching ``*_async`` call of the communicator and returns a :class:`Work` at once; the
Trio thread of the communicator runs it, and a completion thread of the group finishes it (copies
results into torch's output tensors) and completes the work's ``torch.futures.Future``, so
``then`` callbacks never run on the caller's thread nor on the communicator's Trio thread.

Errors are pccl's (:class:`~pccl.errors.CollectiveAborted` when a peer died mid-op — the inputs
of an in-place op hold their values again —, ``InvalidUsage``, ``Kicked``, …): ``Work.wait()``
raises them, and the future holds them.  Arguments that cannot meet torch's contract (an output
of the wrong size or dtype — nothing is cast —, a sparse tensor, an op pccl has no equivalent
for) raise ``InvalidArgument`` at the call, with the words of gloo's own checks ("invalid tensor
type", "invalid root rank", …).  The methods take the argument forms of torch's pybind
``ProcessGroup`` too: ``pg.allreduce(t)``, ``pg.allreduce([t], ReduceOp.MAX)``,
``pg.broadcast(t, root=0)``, ``pg.allgather(outputs, t)``, ``pg.barrier()``.  Alone in its
group (world size 1) every collective is the identity, as on any one-process group.
Point to point (``send``/``recv``, so ``dist.isend``/``irecv``/``batch_isend_irecv``) and
``all_to_all``/``all_to_all_single`` are :mod:`pccl.torch.point`'s; the list forms
``reduce_scatter`` (uneven outputs too) and ``allgather_coalesced`` :mod:`pccl.torch.lists`'.

Tags: the group's ``k``-th collective uses the tag ``first_tag + k`` (``1 << 61`` by default,
clear of pccl's own defaults), so the peers must issue the group's collectives in the same order
— torch's own rule.  The count starts again at 0 at the first call after the ring changed
(a topology update: every peer is idle then) while none of the group's collectives is running,
so a newcomer's ``ProcessGroup`` counts in step with the veterans' from its first call.
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
# torch's registry of groups by name, where its own groups go (functional collectives look a
# group up there): private to torch, with no public way in for a Python ProcessGroup.
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed.distributed_c10d import GroupName, _world

from .. import blocking
from ..errors import CollectiveAborted, InvalidArgument, InvalidUsage, TooFewPeers
from ..types import DType, ReduceOp
from ._args import (LOCAL_REDUCE, bool_reduce_op, check_alike, checked_root, contiguous_buffer, dense,
                    root_list, split_columns, tensor_list, timeout_seconds, torch_reduce_op, wire_view)
from .deadlines import Timeouts
from .lists import ListForms
from .point import PointToPoint
from .ranks import GroupRanks, by_rank, peers_by_rank
from .work import PendingOp, Settler, UnobservedWorks, Work

__all__ = ["ProcessGroup", "Work", "BACKEND", "FIRST_TAG", "SHARED_TAGS"]

log = logging.getLogger(__name__)


#: The backend name :func:`register` registers and :meth:`ProcessGroup.getBackendName` reports.
BACKEND = "pccl"
#: The first tag a group's collectives use (op ``k``: ``FIRST_TAG + k``): clear of a plain call's
#: tag 0 and of ``all_reduce_many``'s ``1 << 62``.
FIRST_TAG = 1 << 61
#: The tags of the ``k``-th group made over an existing one start at ``FIRST_TAG + k * SHARED_TAGS``.
SHARED_TAGS = 1 << 48
#: The environment a process group created by the registered backend reads.
MASTER_ENV, PEER_GROUP_ENV = "PCCL_MASTER", "PCCL_PEER_GROUP"

# A bfloat16 tensor's first use resolves its numpy type, which imports ml_dtypes: seconds of
# holding the GIL, during which no communicator's Trio thread can send a heartbeat.  Done here,
# at import, before the caller opens a communicator.
DType.BFLOAT16.numpy_dtype()

#: Numbers the groups this process builds, for their names in torch's registry.
_GROUP_NUMBERS = itertools.count()


class ProcessGroup(Timeouts, PointToPoint, ListForms, dist.ProcessGroup):  # type: ignore[misc]  # torch's overloads
    """``comm``'s peer group as a ``torch.distributed.ProcessGroup``: ``size()`` is its world
    size now, ``rank()`` this peer's rank now (its ring position, or the rank
    ``init_process_group`` gave it); each collective starts the
    communicator's ``*_async`` twin and returns a :class:`Work` at once.

    ``comm`` is an open :class:`pccl.blocking.Communicator`; the group uses it and leaves it
    open unless ``owns_communicator`` (then :meth:`shutdown` closes it).  ``first_tag``: the tag
    of the group's first collective (op ``k`` uses ``first_tag + k``).  ``ranks``: the peer ids
    of ranks ``0, 1, ...`` as ``init_process_group`` gave them (:mod:`pccl.torch.ranks`: those
    still in the group keep that order, newcomers follow in ring order); ring positions when
    ``None``.  ``timeout`` (a ``timedelta`` or seconds): a collective whose options set no
    timeout of their own is cancelled after it (:mod:`pccl.torch.deadlines`); None: no limit.
    """

    def __init__(self, comm: blocking.Communicator, *, first_tag: int = FIRST_TAG, owns_communicator: bool = False,
                 ranks: Sequence[int] | None = None, timeout: Any = None) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # static rank and size; getRank/getSize answer
        self.timeout_seconds = timeout_seconds(timeout)
        self._comm = comm
        self._first_tag = first_tag
        self._owns = owns_communicator
        self._given = tuple(ranks) if ranks is not None else None
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified as each collective ends
        self._seq = 0
        self._ring: tuple[int, ...] | None = None
        self._running = 0
        self._closed = False
        self._queue: queue.SimpleQueue[PendingOp | None] = queue.SimpleQueue()
        self._settler = Settler(f"pccl-torch-{id(self):x}")  # runs the futures' callbacks
        self._unobserved = UnobservedWorks()  # works torch's C++ may still wait on
        self._completer = threading.Thread(target=self._complete, name=f"pccl-torch-{id(self):x}", daemon=True)
        self._completer.start()
        # A name in torch's registry of groups, as torch's own groups have: functional
        # collectives (torch.distributed._functional_collectives) find a group by its name.
        # torch renames a group it creates (init_process_group, new_group) and registers it
        # under that name itself.
        self._group_name = f"pccl:{comm.peer_group}:{next(_GROUP_NUMBERS)}"
        self._registered: str | None = self._group_name
        self._group_desc = "pccl"
        self._shared = 0  # the groups made over this one's communicator (the backend's new_group)
        _register_process_group(GroupName(self._group_name), self)
        # torch's own groups are in its world's rank table too (new_group puts them there);
        # torch replaces this entry by its own when it builds the group.  Beside another
        # default group (gloo inside a site, say) global ranks are that world's, not ours.
        self._ranks = GroupRanks(self.getSize)
        if not dist.is_initialized():
            _world.pg_group_ranks[self] = self._ranks  # type: ignore[assignment]  # a Mapping, read only

    # --- what torch asks ------------------------------------------------------------------------

    @property
    def communicator(self) -> blocking.Communicator:
        """The communicator the group runs on."""
        return self._comm

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` (or :meth:`abort`) ended the group."""
        return self._closed

    def next_shared_first_tag(self) -> int:
        """The first tag of one more group over this group's communicator (the backend's
        ``new_group``): ``first_tag + k * SHARED_TAGS`` for the ``k``-th such group."""
        with self._lock:
            self._shared += 1
            return self._first_tag + self._shared * SHARED_TAGS

    @property
    def given_ranks(self) -> tuple[int, ...] | None:
        """The peer ids of ranks ``0, 1, ...`` as ``init_process_group`` gave them (the
        ``ranks`` argument), or ``None``: ranks are ring positions."""
        return self._given

    def peers_by_rank(self) -> tuple[int, ...]:
        """The group's peer ids in rank order now: the members among :attr:`given_ranks` in
        that order, then the others (newcomers) in ring order."""
        return peers_by_rank(self._comm.ring, self._given)

    def getRank(self) -> int:  # noqa: N802 - torch's name
        """This peer's rank now: its place in :meth:`peers_by_rank` (the rank
        ``init_process_group`` was given while the members are the processes that started the
        group; its ring position in a group built without given ranks)."""
        order, peer_id = self.peers_by_rank(), self._comm.peer_id
        return order.index(peer_id) if peer_id in order else 0

    def getSize(self) -> int:  # noqa: N802 - torch's name
        """The number of accepted peers in the group now."""
        return self._comm.world_size

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """``"pccl"``."""
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
        """Take the name torch gives the group (``init_process_group``, ``new_group``): the
        name the group registered itself under is dropped from torch's registry."""
        with self._lock:
            registered, self._registered = self._registered, None
            self._group_name = name
        if registered is not None and registered != name:
            _unregister_process_group(GroupName(registered))

    def getGroupName(self) -> str:  # noqa: N802 - torch's name
        """The group's name in torch's registry of groups (``pg.group_name``): ``pccl:G:K``
        for the ``K``-th group this process built over peer group ``G``, or the name torch
        gave it."""
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
        return self._group_desc

    def __repr__(self) -> str:
        return f"pccl.torch.ProcessGroup(peer_group={self._comm.peer_group}, peer_id={self._comm.peer_id:x})"

    # --- collectives ------------------------------------------------------------------------------
    #
    # Each takes the argument forms of torch's pybind ProcessGroup: a list of tensors and an
    # options object (what torch.distributed.* passes), or a bare tensor and a root / op /
    # timeout (``pg.allreduce(t)``, ``pg.broadcast(t, root=0)``, ``pg.allgather(outs, t)``).

    def allreduce(self, tensors: Any, opts: Any = None, timeout: Any = None, *,  # type: ignore[override]
                  op: Any = None) -> Work:
        """All-reduce in place over the group (:meth:`pccl.blocking.Communicator.all_reduce_async`;
        ``opts``: ``AllreduceOptions`` or a ``ReduceOp``, SUM by default; SUM, AVG, PRODUCT, MIN
        or MAX — AVG divides by the peers that took part).  ``tensors``: one tensor, or a list of
        tensors of one dtype and size, all of which end with the reduction over every tensor of
        every peer (gloo's meaning; every peer passes as many).  The future's value is
        ``tensors`` as a list."""
        listed = tensor_list(tensors, "allreduce")
        check_alike(listed, "allreduce")
        boolean = listed[0].dtype == torch.bool
        reduce_op = bool_reduce_op(opts, op) if boolean else torch_reduce_op(opts, op)
        if len(listed) == 1 and listed[0].is_contiguous():
            tensor = wire_view(listed[0].detach())
            return self._start(lambda tag: self._comm.all_reduce_async(tensor, op=reduce_op, tag=tag),
                               lambda info: listed, lambda: listed)
        acc = listed[0].detach().clone(memory_format=torch.contiguous_format)
        for t in listed[1:]:
            acc = LOCAL_REDUCE[reduce_op](acc, t.detach())
        if reduce_op is ReduceOp.AVG:
            if not acc.is_floating_point():
                raise InvalidArgument("allreduce: AVG over several tensors per peer takes floating-point tensors")
            acc /= len(listed)
        wire = wire_view(acc)

        def finish(info: Any = None) -> list[torch.Tensor]:
            for t in listed:
                t.copy_(acc.reshape(t.shape))
            return listed

        return self._start(lambda tag: self._comm.all_reduce_async(wire, op=reduce_op, tag=tag), finish, finish)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """All-reduce each tensor of ``tensors`` in place, in one pccl all-reduce of their
        concatenation (one dtype; ``opts``: ``AllreduceCoalescedOptions`` or a ``ReduceOp``).
        torch's ``all_reduce_coalesced``; the future's value is ``tensors``."""
        listed = tensor_list(tensors, "allreduce_coalesced")
        for t in listed:
            if t.dtype != listed[0].dtype:
                raise InvalidArgument(f"allreduce_coalesced: tensors must all have the same type "
                                      f"({listed[0].dtype} and {t.dtype})")
        reduce_op = torch_reduce_op(opts)
        flat = torch.cat([t.detach().reshape(-1) for t in listed])

        def finish(info: Any = None) -> list[torch.Tensor]:
            start = 0
            for t in listed:
                t.copy_(flat[start:start + t.numel()].reshape(t.shape))
                start += t.numel()
            return listed

        return self._start(lambda tag: self._comm.all_reduce_async(flat, op=reduce_op, tag=tag), finish, finish)

    def broadcast(self, tensors: Any, opts: Any = None, timeout: Any = None, *,  # type: ignore[override]
                  root: int | None = None) -> Work:
        """Overwrite ``tensors`` with the peer's at ring position ``opts.rootRank`` (or
        ``root``: ``pg.broadcast(t, root=0)``) — :meth:`pccl.blocking.Communicator.broadcast_async`,
        whose root is that peer's id.  With several tensors (one dtype and size), every one
        gets the root's ``tensors[opts.rootTensor]``."""
        if isinstance(opts, int) or root is not None:
            options = dist.BroadcastOptions()
            options.rootRank = root if root is not None else int(opts)  # type: ignore[arg-type]
            opts = options
        opts = opts if opts is not None else dist.BroadcastOptions()
        order = self.peers_by_rank()
        root_rank = checked_root(opts, len(order), "broadcast")
        count = 1 if isinstance(tensors, torch.Tensor) else len(tensors)
        if not 0 <= opts.rootTensor < count:
            raise InvalidArgument(f"broadcast: invalid root tensor {opts.rootTensor} of {count}")
        listed = tensor_list(tensors, "broadcast")
        check_alike(listed, "broadcast")
        tensor = contiguous_buffer(listed[opts.rootTensor])

        def finish(info: Any = None) -> list[torch.Tensor]:
            for t in listed:
                if t.data_ptr() != tensor.data_ptr() or not t.is_contiguous():
                    t.copy_(tensor.reshape(t.shape))
            return listed

        alone = finish if root_rank == 0 else None
        return self._start(lambda tag: self._comm.broadcast_async(wire_view(tensor), root=order[root_rank], tag=tag),
                           finish, alone)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None,  # type: ignore[override]
                  timeout: Any = None) -> Work:
        """Gather every peer's input into the outputs, in rank order.

        torch's list form: ``input_tensors`` one tensor (``pg.allgather(outs, t)``: ``outs``
        one tensor per peer; sizes may differ from peer to peer, as long as each output fits
        its peer's input and this peer's has its input's), or a list of ``k`` inputs of one
        dtype and size (``output_tensors``: ``k`` lists of ``k x size()`` tensors, each list
        getting peer ``r``'s inputs at ``r*k ...``, gloo's layout).  Outputs have the inputs'
        dtype (``InvalidArgument`` at the call otherwise: nothing is cast)."""
        order = self.peers_by_rank()
        world = len(order)
        bare = isinstance(input_tensors, torch.Tensor)
        inputs = tensor_list(input_tensors, "allgather", "input tensor list")
        if bare or (output_tensors and all(isinstance(o, torch.Tensor) for o in output_tensors)):
            output_lists = [list(output_tensors)]
        else:
            output_lists = [list(o) for o in output_tensors]
        if len(output_lists) != len(inputs):
            raise InvalidArgument(f"allgather requires input/output tensor lists to have the same length "
                                  f"({len(inputs)} and {len(output_lists)})")
        k = len(inputs)
        check_alike(inputs, "allgather")
        for outputs in output_lists:
            if len(outputs) != k * world:
                raise InvalidArgument(f"allgather: invalid output tensor list: {len(outputs)} tensors, the group "
                                      f"has {world} peers now ({k * world} needed)")
            for out in outputs:
                dense(out, "allgather")
                if out.dtype != inputs[0].dtype:
                    raise InvalidArgument(f"allgather: invalid tensor type: an output of {out.dtype} for an input "
                                          f"of {inputs[0].dtype} (pccl does not cast)")
            if k > 1:
                check_alike(outputs, "allgather", like=inputs[0])
            elif outputs[self.getRank()].numel() != inputs[0].numel():
                raise InvalidArgument(f"allgather: invalid tensor size: this peer's output holds "
                                      f"{outputs[self.getRank()].numel()} elements, its input {inputs[0].numel()}")
        tensor = contiguous_buffer(inputs[0]) if k == 1 else torch.cat([t.detach().reshape(-1) for t in inputs])
        result: list[Any] = output_lists[0] if k == 1 else output_lists

        def place(parts: Sequence[torch.Tensor]) -> list[Any]:
            if len(parts) != world:
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {len(parts)} peers, "
                                        f"not the {world} the outputs were made for; retry")
            n = inputs[0].numel()
            for outputs in output_lists:
                for r, part in enumerate(parts):
                    if part.numel() != k * outputs[r * k].numel() and k == 1:
                        raise InvalidArgument(f"allgather: a peer sent {part.numel()} elements for an output "
                                              f"tensor of {outputs[r * k].numel()}")
                    for i in range(k):
                        out = outputs[r * k + i]
                        out.copy_(part.reshape(-1)[i * n:(i + 1) * n].reshape(out.shape) if k > 1
                                  else part.reshape(out.shape))
            return result

        def finish(gathered: Any) -> list[Any]:
            return place(by_rank(gathered.peers, gathered.arrays, order))

        return self._start(lambda tag: self._comm.all_gather_async(wire_view(tensor), tag=tag), finish,
                           (lambda: place([tensor])) if world == 1 else None)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        """torch's ``all_gather_into_tensor``: every peer's ``input`` (the same size on all)
        concatenated in rank order into ``output`` (``size()`` times ``input``'s elements)."""
        dense(output, "all_gather_into_tensor")
        dense(input, "all_gather_into_tensor")
        order = self.peers_by_rank()
        world = len(order)
        if output.numel() != input.numel() * world or output.dtype != input.dtype:
            raise InvalidArgument(f"all_gather_into_tensor needs an output of {world} x {input.numel()} elements "
                                  f"of {input.dtype} (the group has {world} peers now), got {output.numel()} "
                                  f"of {output.dtype}")

        def finish(gathered: Any) -> list[torch.Tensor]:
            if gathered.buffer.numel() != output.numel():
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {gathered.world_size} "
                                        f"peers ({gathered.buffer.numel()} elements), the output holds "
                                        f"{output.numel()}; retry")
            if tuple(gathered.peers) == order:
                output.copy_(gathered.buffer.reshape(output.shape))
            else:
                parts = by_rank(gathered.peers, gathered.arrays, order)
                output.copy_(torch.cat([p.reshape(-1) for p in parts]).reshape(output.shape))
            return [output]

        def alone() -> list[torch.Tensor]:
            output.copy_(input.reshape(output.shape))
            return [output]

        send = contiguous_buffer(input)
        return self._start(lambda tag: self._comm.all_gather_async(wire_view(send), tag=tag), finish,
                           alone if world == 1 else None)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Several ``all_gather_into_tensor`` in one pccl all-gather: ``outputs[i]`` gets every
        peer's ``inputs[i]`` in rank order (``size()`` times its elements; one dtype)."""
        ins = tensor_list(inputs, "allgather_into_tensor_coalesced")
        outs = tensor_list(outputs, "allgather_into_tensor_coalesced")
        order = self.peers_by_rank()
        world = len(order)
        if len(ins) != len(outs):
            raise InvalidArgument(f"allgather_into_tensor_coalesced: {len(outs)} outputs for {len(ins)} inputs")
        for out, inp in zip(outs, ins):
            if out.numel() != inp.numel() * world or out.dtype != inp.dtype or inp.dtype != ins[0].dtype:
                raise InvalidArgument(f"allgather_into_tensor_coalesced needs outputs of {world} x their input's "
                                      f"elements, all of {ins[0].dtype}: got {out.numel()} of {out.dtype} for "
                                      f"{inp.numel()} of {inp.dtype}")
        flat = torch.cat([t.detach().reshape(-1) for t in ins])

        def place(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            if len(parts) != world:
                raise CollectiveAborted(f"the group changed size: the all-gather ran over {len(parts)} peers, "
                                        f"not the {world} the outputs were made for; retry")
            for out, chunks in zip(outs, split_columns(parts, [t.numel() for t in ins])):
                out.copy_(torch.cat(chunks).reshape(out.shape))
            return outs

        return self._start(lambda tag: self._comm.all_gather_async(wire_view(flat), tag=tag),
                           lambda gathered: place(by_rank(gathered.peers, gathered.arrays, order)),
                           (lambda: place([flat])) if world == 1 else None)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]  # noqa: A002
                              opts: Any = None) -> Work:
        """torch's ``reduce_scatter_tensor``: ``output`` gets the reduction over the group of
        the ``rank()``-th of ``size()`` equal slices of ``input``, which is left as it was.

        pccl's reduce-scatter works in place over a copy of ``input``; its shards are equal
        when ``input`` holds ``size()`` times ``output``'s elements, which is torch's contract
        and is checked here (``InvalidArgument`` otherwise)."""
        dense(output, "reduce_scatter_tensor")
        dense(input, "reduce_scatter_tensor")
        world = self.getSize()
        op = torch_reduce_op(opts if opts is not None else dist.ReduceScatterOptions())
        if input.numel() != output.numel() * world or output.dtype != input.dtype:
            raise InvalidArgument(f"reduce_scatter_tensor needs an input of {world} x {output.numel()} elements "
                                  f"of {output.dtype} (the group has {world} peers now: one equal slice each), "
                                  f"got {input.numel()} of {input.dtype}; pccl.blocking.Communicator."
                                  "reduce_scatter takes other sizes")
        work = input.detach().reshape(-1).clone()  # pccl reduces in place; torch leaves the input alone
        return self._reduce_scatter(work, [output], op)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """Several ``reduce_scatter_tensor`` in one pccl reduce-scatter: ``outputs[i]`` gets
        the reduction of the ``rank()``-th of ``size()`` equal slices of ``inputs[i]`` (one
        dtype); the inputs are left as they were."""
        ins = tensor_list(inputs, "reduce_scatter_tensor_coalesced")
        outs = tensor_list(outputs, "reduce_scatter_tensor_coalesced")
        world = self.getSize()
        op = torch_reduce_op(opts if opts is not None else dist.ReduceScatterOptions())
        if len(ins) != len(outs):
            raise InvalidArgument(f"reduce_scatter_tensor_coalesced: {len(outs)} outputs for {len(ins)} inputs")
        for out, inp in zip(outs, ins):
            if inp.numel() != out.numel() * world or out.dtype != inp.dtype or inp.dtype != ins[0].dtype:
                raise InvalidArgument(f"reduce_scatter_tensor_coalesced needs inputs of {world} x their output's "
                                      f"elements, all of {ins[0].dtype}: got {inp.numel()} of {inp.dtype} for "
                                      f"{out.numel()} of {out.dtype}")
        # peer r's shard is slice r of every input, one after the other
        slices = [t.detach().reshape(world, -1) for t in ins]
        work = torch.cat([torch.cat([s[r] for s in slices]) for r in range(world)])
        return self._reduce_scatter(work, outs, op)

    def _reduce_scatter(self, work: torch.Tensor, outputs: list[torch.Tensor], op: ReduceOp) -> Work:
        """Reduce-scatter ``work`` (flat, ``size()`` equal shards) in place; this peer's shard,
        split in order, fills ``outputs``."""
        ring, order = self._comm.ring, self.peers_by_rank()
        world = len(ring)
        shard_len = work.numel() // world
        if order != ring:  # ring position i reduces slice i: lay the ranks' slices out in ring order
            work = work.reshape(world, -1)[[order.index(p) for p in ring]].reshape(-1)

        def place(shard: torch.Tensor) -> list[torch.Tensor]:
            start = 0
            for out in outputs:
                out.copy_(shard[start:start + out.numel()].reshape(out.shape))
                start += out.numel()
            return outputs

        def finish(shard: Any) -> list[torch.Tensor]:
            if tuple(shard.peers) != ring or shard.stop - shard.start != shard_len:
                raise CollectiveAborted(f"the group changed size: the reduce-scatter ran over {shard.world_size} "
                                        f"peers, the tensors were made for {world}; retry")
            return place(work[shard.start:shard.stop])

        return self._start(lambda tag: self._comm.reduce_scatter_async(work, op=op, tag=tag), finish,
                           (lambda: place(work)) if world == 1 else None)

    def barrier(self, opts: Any = None, timeout: Any = None) -> Work:  # type: ignore[override]
        """Return once every peer of the group reached its barrier (a one-byte all-reduce)."""
        token = torch.zeros(1, dtype=torch.uint8)
        return self._start(lambda tag: self._comm.all_reduce_async(token, tag=tag), lambda info: [], lambda: [])

    def reduce(self, tensors: Any, opts: Any = None, op: Any = None, timeout: Any = None) -> Work:  # type: ignore[override]
        """torch's ``reduce`` (``opts``: ``ReduceOptions``; or ``pg.reduce(t, root, op)``): an
        all-reduce whose result only the peer at rank ``rootRank`` keeps — in place;
        the others' tensors keep their values (they reduce a copy)."""
        if isinstance(opts, int):
            options = dist.ReduceOptions()
            options.rootRank = opts
            if op is not None:
                options.reduceOp = op
            opts = options
        opts = opts if opts is not None else dist.ReduceOptions()
        root = checked_root(opts, self.getSize(), "reduce")
        if opts.rootTensor != 0:
            raise InvalidArgument(f"reduce: invalid root tensor {opts.rootTensor}: one tensor per process")
        listed = tensor_list(tensors, "reduce")
        if len(listed) != 1:
            raise InvalidArgument(f"reduce requires a single-element tensor list, got {len(listed)}")
        reduce_op = torch_reduce_op(opts)
        tensor, is_root = listed[0], root == self.getRank()
        work = contiguous_buffer(tensor) if is_root else tensor.detach().clone(memory_format=torch.contiguous_format)

        def finish(info: Any = None) -> list[torch.Tensor]:
            if is_root and work.data_ptr() != tensor.data_ptr():
                tensor.copy_(work)
            return listed

        return self._start(lambda tag: self._comm.all_reduce_async(work, op=reduce_op, tag=tag), finish, finish)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None,  # type: ignore[override]
               timeout: Any = None) -> Work:
        """torch's ``gather`` (``opts``: ``GatherOptions``; or ``pg.gather(outs, t, root)``): the
        peer at rank ``rootRank`` gets every peer's input in ``output_tensors[0]`` (one
        tensor per peer, rank order); the others pass no outputs.  An all-gather of which the
        other peers keep nothing."""
        if isinstance(input_tensors, torch.Tensor):
            options = dist.GatherOptions()
            options.rootRank = int(opts) if opts is not None else 0
            opts, input_tensors = options, [input_tensors]
            output_tensors = [output_tensors] if output_tensors else []
        opts = opts if opts is not None else dist.GatherOptions()
        world, rank = self.getSize(), self.getRank()
        root = checked_root(opts, world, "gather")
        inputs = list(input_tensors)
        if len(inputs) != 1:
            raise InvalidArgument(f"gather requires a single-element input tensor list, got {len(inputs)}")
        tensor = contiguous_buffer(dense(inputs[0], "gather"))
        outputs = root_list([list(o) for o in output_tensors], rank=rank, root=root, world=world, what="gather",
                            side="output", like=tensor)

        def place(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
            if len(parts) != world:
                raise CollectiveAborted(f"the group changed size: the gather ran over {len(parts)} peers, "
                                        f"not the {world} the outputs were made for; retry")
            for out, part in zip(outputs, parts):
                out.copy_(part.reshape(out.shape))
            return outputs

        order = self.peers_by_rank()
        return self._start(lambda tag: self._comm.all_gather_async(wire_view(tensor), tag=tag),
                           lambda gathered: place(by_rank(gathered.peers, gathered.arrays, order)),
                           (lambda: place([tensor])) if world == 1 else None)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None,  # type: ignore[override]
                timeout: Any = None) -> Work:
        """torch's ``scatter`` (``opts``: ``ScatterOptions``; or ``pg.scatter(out, inputs,
        root)``): the peer at rank ``rootRank`` passes one input per peer (rank order),
        the others none; every peer's one output gets its input.  A broadcast of the root's
        inputs (``size()`` times the output's bytes on the wire) of which each keeps its own."""
        if isinstance(output_tensors, torch.Tensor):
            options = dist.ScatterOptions()
            options.rootRank = int(opts) if opts is not None else 0
            opts, output_tensors = options, [output_tensors]
            input_tensors = [input_tensors] if input_tensors else []
        opts = opts if opts is not None else dist.ScatterOptions()
        world, rank = self.getSize(), self.getRank()
        order = self.peers_by_rank()
        root = checked_root(opts, world, "scatter")
        outputs = list(output_tensors)
        if len(outputs) != 1:
            raise InvalidArgument(f"scatter requires a single-element output tensor list, got {len(outputs)}")
        output = dense(outputs[0], "scatter")
        inputs = root_list([list(i) for i in input_tensors], rank=rank, root=root, world=world, what="scatter",
                           side="input", like=output)
        if rank == root:
            buffer = torch.cat([t.detach().reshape(-1) for t in inputs])
        else:
            buffer = output.new_empty(world * output.numel())
        n = output.numel()

        def finish(info: Any = None) -> list[torch.Tensor]:
            output.copy_(buffer[rank * n:(rank + 1) * n].reshape(output.shape))
            return outputs

        return self._start(lambda tag: self._comm.broadcast_async(wire_view(buffer), root=order[root], tag=tag), finish,
                           finish if world == 1 else None)

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
            registered, self._registered = self._registered, None
        if registered is not None:
            _unregister_process_group(GroupName(registered))
        if _world.pg_group_ranks.get(self) is self._ranks:  # torch's own entry is torch's to delete
            del _world.pg_group_ranks[self]
        if self._owns:
            self._comm.close()  # cancels what still runs; the completion threads then finish
        self._completer.join(30)
        self._settler.close()
        self._unobserved.clear()
        self._stop_points()
        self._stop_deadlines()

    def abort(self) -> None:
        """Cancel the group's collectives still running (they fail with ``CollectiveAborted``;
        one the master completes at once may succeed; one a call is starting meanwhile, as the
        call returns: :meth:`Timeouts.cancel_running`), then :meth:`shutdown`."""
        self.cancel_running("the process group was aborted", for_good=True)
        self.shutdown()

    def wait_for_pending_works(self, timeout: float | None = None) -> bool:
        """Wait until every collective the group started has ended (succeeded or failed); return
        whether they had within ``timeout`` seconds.  After a failed call — torch's DDP raises
        from ``backward()`` at the first bucket whose all-reduce failed while the later ones
        still run — call it before the communicator's ``update_topology()``, which refuses to
        vote while a collective of this peer is still under way.  torch's
        ``destroy_process_group`` calls it (as ``_wait_for_pending_works``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._running == 0, timeout)

    def _wait_for_pending_works(self) -> None:  # torch's name (destroy_process_group)
        self.wait_for_pending_works()

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
            op = PendingOp(call(tag), finish, alone)
            self._seq += 1
            self._running += 1
            self._queue.put(op)  # under the lock: in the order started, and never after shutdown's None
        return Work(op.handle, op.future, op.outcome, op, self._unobserved)

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
                self._settler.submit(functools.partial(op.fail, exc))
            else:
                self._settle(op, lambda: op.finish(result))

    def _alone(self, op: PendingOp, exc: TooFewPeers) -> list[torch.Tensor]:
        if op.alone is None:
            raise exc
        return op.alone()

    def _settle(self, op: PendingOp, compute: Callable[[], list[torch.Tensor]]) -> None:
        try:
            # the copies into torch's outputs are not autograd's: a leaf that requires grad
            # takes them, as it does from any other backend
            with torch.inference_mode(op.inference), torch.no_grad():
                value = compute()
        except Exception as exc:  # noqa: BLE001 - delivered through the future
            self._done()
            self._settler.submit(functools.partial(op.fail, exc))
            return
        self._done()
        self._settler.submit(functools.partial(op.succeed, value))

    def _done(self) -> None:
        with self._lock:
            self._running -= 1
            self._idle.notify_all()


# --- the registered backend -------------------------------------------------------------------------

