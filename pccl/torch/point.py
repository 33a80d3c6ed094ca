"""Point to point in a :class:`pccl.torch.ProcessGroup`: torch's ``send``/``recv`` (so
``dist.send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv``) over the communicator's
``send_async``/``recv_async``, and ``all_to_all_single``/``all_to_all`` built from send/recv pairs.

Ranks are the group's (``pg.rank()``, :mod:`pccl.torch.ranks`); the peer at rank ``r`` is
``pg.peers_by_rank()[r]`` when the call is made.  A receive names its sender: pccl has no
receive from any source, so ``recv_anysource`` (``dist.recv(t)`` / ``dist.irecv(t)`` without
``src``) raises ``InvalidUsage``.  ``all_to_all_single`` takes contiguous tensors only, as gloo
and NCCL do (its chunks are rows in memory).

Tags: torch's tag ``t`` (``0 <= t < 2**47``) is pccl's point-to-point tag
``first_tag + POINT_TAGS + t`` — inside the group's own tag range (``SHARED_TAGS`` wide), clear of
the tags its collectives count through (``first_tag + k``).  An all-to-all is one of the group's
collectives (issued in the same order on every peer, as torch requires): its messages go on the
point-to-point channel with the collective's tag ``first_tag + k``, which no torch tag reaches.

Faults: a peer that dies (or closes its communicator) ends every pending send to it and receive
from it with pccl's ``PeerDisconnected`` (retry-safe: the next call dials afresh); an all-to-all
waits for all its messages and raises the first error.  A receive's tensor then holds its old
values.

The futures of point-to-point works are completed by a thread of their own, fed as each message
finishes (in any order: a receive may depend on a later send of this peer), never on the
caller's thread nor on the communicator's Trio thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import blocking
from ..errors import InvalidArgument, InvalidUsage
from ._args import contiguous_buffer, dense, tensor_list, wire_view
from .work import PendingOp, UnobservedWorks, Work

__all__ = ["PointToPoint", "HandleGroup", "POINT_TAGS"]

#: torch's tag ``t`` on a group whose first tag is ``F`` is pccl's point-to-point tag
#: ``F + POINT_TAGS + t``; torch's tags are below ``POINT_TAGS``.
POINT_TAGS = 1 << 47


class HandleGroup:
    """Several handles as one (an all-to-all's messages): done when all are; :meth:`wait`
    waits for every one and raises the first error."""

    def __init__(self, handles: Sequence[blocking.CollectiveHandle[Any]]) -> None:
        self.handles = list(handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def cancel(self) -> None:
        for handle in self.handles:
            handle.cancel()

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        error: BaseException | None = None
        for handle in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handle.wait(left)
            except TimeoutError:
                if not handle.done():
                    raise
                error = error or handle_error(handle)
            except Exception as exc:  # noqa: BLE001 - raised once all are done
                error = error or exc
        if error is not None:
            raise error


def handle_error(handle: blocking.CollectiveHandle[Any]) -> BaseException | None:
    try:
        handle.wait(0)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def _split(tensor: torch.Tensor, sizes: Sequence[int], world: int, what: str) -> list[int]:
    """Element offsets of ``tensor``'s ``world`` chunks along dim 0: ``sizes`` rows each, or
    equal chunks when ``sizes`` is empty (torch's ``all_to_all_single`` contract)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if not sizes:
        if rows % world:
            raise InvalidArgument(f"{what}: {rows} rows do not split into {world} equal chunks (the group has "
                                  f"{world} peers now): pass split sizes")
        sizes = [rows // world] * world
    if len(sizes) != world or any(s < 0 for s in sizes) or sum(sizes) != rows:
        raise InvalidArgument(f"{what}: split sizes {list(sizes)} must be {world} counts of rows (one per peer "
                              f"now) adding up to the tensor's {rows} rows")
    per_row = tensor.numel() // rows if rows else 0
    offsets = [0]
    for s in sizes:
        offsets.append(offsets[-1] + s * per_row)
    return offsets


class PointToPoint:
    """The point-to-point methods of :class:`pccl.torch.ProcessGroup` (a mixin: it runs on
    the group's communicator, first tag and collective machinery)."""

    _comm: blocking.Communicator
    _first_tag: int
    _lock: threading.Lock
    _closed: bool
    _unobserved: UnobservedWorks
    _points: PointCompleter | None = None

    def _start(self, call: Callable[[int], Any], finish: Callable[[Any], list[torch.Tensor]],
               alone: Callable[[], list[torch.Tensor]] | None) -> Work:
        raise NotImplementedError  # the group's

    def getRank(self) -> int:  # noqa: N802 - torch's name
        raise NotImplementedError  # the group's

    def peers_by_rank(self) -> tuple[int, ...]:
        raise NotImplementedError  # the group's

    # --- torch's calls ------------------------------------------------------------------------

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Work:  # type: ignore[override]  # noqa: N803
        """Send the one tensor of ``tensors`` to the peer at rank ``dstRank``
        (:meth:`pccl.blocking.Communicator.send_async`; the work completes once the receiver has
        all of it).  ``tag``: torch's, ``0 <= tag < 2**47``."""
        self._check_open()
        tensor = self._one_tensor(tensors, "send")
        peer, pccl_tag = self._peer_at(dstRank, "destination"), self._point_tag(tag)
        wire = wire_view(contiguous_buffer(tensor))
        return self._start_point(self._comm.send_async(wire, to=peer, tag=pccl_tag), lambda: [tensor])

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Work:  # type: ignore[override]  # noqa: N803
        """Receive into the one tensor of ``tensors`` the next message on ``tag`` of the peer at
        rank ``srcRank`` (:meth:`pccl.blocking.Communicator.recv_async`: the sender's
        dtype and element count; nothing is cast).  On an error the tensor keeps its values."""
        self._check_open()
        tensor = self._one_tensor(tensors, "recv")
        peer, pccl_tag = self._peer_at(srcRank, "source"), self._point_tag(tag)
        buffer = contiguous_buffer(tensor)

        def finish() -> list[torch.Tensor]:
            if buffer.data_ptr() != tensor.data_ptr() or not tensor.is_contiguous():
                tensor.copy_(buffer)
            return [tensor]

        return self._start_point(self._comm.recv_async(wire_view(buffer), from_=peer, tag=pccl_tag), finish)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Work:  # type: ignore[override]
        """Not offered (``InvalidUsage``): a pccl receive names its sender."""
        raise InvalidUsage("pccl receives from a named peer only: pass src= (or group_src=) to recv/irecv; "
                           "a receive from any source has no pccl equivalent")

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,  # type: ignore[override]  # noqa: A002
                      outputSplitSizes: Sequence[int] = (), inputSplitSizes: Sequence[int] = (),  # noqa: N803
                      opts: Any = None) -> Work:
        """torch's ``all_to_all_single``: chunk ``r`` of ``input`` (along dim 0: equal chunks,
        or ``inputSplitSizes[r]`` rows) goes to the peer at rank ``r``, and chunk ``r``
        of ``output`` (``outputSplitSizes``) gets that peer's chunk for this one.  One of the
        group's collectives, run as a send and a receive with every other peer (each pair's
        chunks may differ in size, as torch's uneven splits do; each side's sizes must match
        its partner's)."""
        dense(output, "all_to_all_single")
        dense(input, "all_to_all_single")
        if not (input.is_contiguous() and output.is_contiguous()):  # gloo's and NCCL's rule: chunks are rows in memory
            raise InvalidArgument("all_to_all_single: Tensors must be contiguous")
        if output.dtype != input.dtype:
            raise InvalidArgument(f"all_to_all_single: invalid tensor type: {output.dtype} output for "
                                  f"{input.dtype} input (pccl does not cast)")
        world = len(self._comm.ring)
        ins = _split(input, inputSplitSizes, world, "all_to_all_single")
        outs = _split(output, outputSplitSizes, world, "all_to_all_single")
        send = wire_view(contiguous_buffer(input)).reshape(-1)
        buffer = contiguous_buffer(output)
        recv = wire_view(buffer).reshape(-1)
        sends = [send[ins[r]:ins[r + 1]] for r in range(world)]
        recvs = [recv[outs[r]:outs[r + 1]] for r in range(world)]

        def finish(info: Any = None) -> list[torch.Tensor]:
            if buffer.data_ptr() != output.data_ptr() or not output.is_contiguous():
                output.copy_(buffer)
            return [output]

        return self._all_to_all(sends, recvs, finish, "all_to_all_single")

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Work:  # type: ignore[override]
        """torch's ``all_to_all``: ``input_tensors[r]`` goes to the peer at rank ``r``,
        ``output_tensors[r]`` gets that peer's tensor for this one (sizes may differ from pair
        to pair; one dtype).  One of the group's collectives, run as send/receive pairs."""
        outputs = tensor_list(output_tensors, "all_to_all")
        inputs = tensor_list(input_tensors, "all_to_all")
        world = len(self._comm.ring)
        if len(outputs) != world or len(inputs) != world:
            raise InvalidArgument(f"all_to_all takes one input and one output per peer ({world} now), got "
                                  f"{len(inputs)} and {len(outputs)}")
        for t in outputs + inputs:
            if t.dtype != inputs[0].dtype:
                raise InvalidArgument(f"all_to_all: invalid tensor type: {t.dtype}, expected {inputs[0].dtype} "
                                      "(pccl does not cast)")
        sends = [wire_view(contiguous_buffer(t)) for t in inputs]
        buffers = [contiguous_buffer(t) for t in outputs]

        def finish(info: Any = None) -> list[torch.Tensor]:
            for out, buffer in zip(outputs, buffers):
                if buffer.data_ptr() != out.data_ptr() or not out.is_contiguous():
                    out.copy_(buffer)
            return outputs

        return self._all_to_all(sends, [wire_view(b) for b in buffers], finish, "all_to_all")

    # --- the machinery ------------------------------------------------------------------------------

    def _all_to_all(self, sends: list[torch.Tensor], recvs: list[torch.Tensor],
                    finish: Callable[[Any], list[torch.Tensor]], what: str) -> Work:
        order, rank = self.peers_by_rank(), self.getRank()
        if sends[rank].numel() != recvs[rank].numel():
            raise InvalidArgument(f"{what}: this peer's chunk for itself has {sends[rank].numel()} elements to send "
                                  f"and {recvs[rank].numel()} to receive")

        def call(tag: int) -> HandleGroup:
            handles = []
            for r, peer in enumerate(order):
                if r != rank:
                    handles.append(self._comm.send_async(sends[r], to=peer, tag=tag))
                    handles.append(self._comm.recv_async(recvs[r], from_=peer, tag=tag))
            return HandleGroup(handles)

        def done(info: Any = None) -> list[torch.Tensor]:
            recvs[rank].copy_(sends[rank].reshape(recvs[rank].shape))
            return finish(info)

        return self._start(call, done, lambda: done())

    def _one_tensor(self, tensors: Any, what: str) -> torch.Tensor:
        listed = tensor_list(tensors, what)
        if len(listed) != 1:
            raise InvalidArgument(f"{what} takes a single-element tensor list, got {len(listed)}")
        return listed[0]

    def _peer_at(self, rank: int, what: str) -> int:
        order = self.peers_by_rank()
        if not 0 <= rank < len(order):
            raise InvalidArgument(f"Invalid {what} rank {rank}: the group has {len(order)} peers now")
        peer = order[rank]
        if peer == self._comm.peer_id:
            raise InvalidArgument(f"Invalid {what} rank {rank}: it is this peer's own rank")
        return peer

    def _point_tag(self, tag: int) -> int:
        if not 0 <= tag < POINT_TAGS:
            raise InvalidArgument(f"pccl takes point-to-point tags in [0, 2**47), got {tag}")
        return self._first_tag + POINT_TAGS + tag

    def _start_point(self, handle: blocking.CollectiveHandle[None], finish: Callable[[], list[torch.Tensor]]) -> Work:
        op = PendingOp(handle, lambda info: finish(), None)
        with self._lock:
            if self._points is None:
                self._points = PointCompleter(f"pccl-torch-p2p-{id(self):x}")
            points = self._points
        points.watch(op)
        return Work(handle, op.future, op.outcome, unobserved=self._unobserved)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidUsage("the process group was shut down")

    def _stop_points(self) -> None:
        with self._lock:
            points = self._points
        if points is not None:
            points.stop()


class PointCompleter:
    """A thread that finishes each point-to-point work as its message ends (in any order).
    Once stopped, the works still running are finished on the thread that ends them."""

    def __init__(self, name: str) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._queue: queue.SimpleQueue[PendingOp | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, op: PendingOp) -> None:
        op.handle.add_done_callback(lambda: self._ended(op))

    def stop(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self._queue.put(None)
        if threading.current_thread() is not self._thread:  # a callback of a work it settled: it ends after
            self._thread.join(30)

    def _ended(self, op: PendingOp) -> None:
        with self._lock:
            if not self._stopped:
                self._queue.put(op)
                return
        settle(op)

    def _run(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            settle(op)


def settle(op: PendingOp) -> None:
    """Complete a finished op's future: its finishing copies' result, or its error."""
    try:
        op.handle.wait(0)
        with torch.inference_mode(op.inference), torch.no_grad():
            value = op.finish(None)
    except Exception as exc:  # noqa: BLE001 - delivered through the future
        op.fail(exc)
    else:
        op.succeed(value)
