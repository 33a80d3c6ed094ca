"""PyTorch's own point-to-point and all-to-all tests, ported to ``pccl.torch.ProcessGroup``.

Each ``case_*`` function is one upstream test (its docstring names the file and the function),
with the same inputs and assertions; ``case(pg, rank, world)`` takes the place of upstream's
``dist.get_rank()``, ``dist.get_world_size()`` and the default group.  The upstream files are
``torch/testing/_internal/distributed/distributed_test.py`` as torch 2.13.0 ships it (the
``DistributedTest._DistTestBase`` methods, run there on the gloo backend) and pytorch/pytorch's
``test/distributed/test_c10d_gloo.py`` (commit 005a6a0b).  Upstream calls
``dist.send(t, dst)`` on the default group; the port calls ``dist.send(t, group=pg,
group_dst=dst)`` (the same thing when ``pg`` is the default group: the ranks are the group's)
— except under ``init_process_group``, where ``peer()`` passes upstream's ``dst=``/``src=``.
Upstream's ``self._barrier()`` is ``dist.barrier(group=pg)``.  Every case runs on worlds of 2
and 3 peers, in two ways (as test_c10d_ported.py): threads of this process, each with a
``pccl.torch.ProcessGroup(comm)``, and processes whose default group
``init_process_group("pccl")`` made (c10d_ported_peer.py).

Ported: 14 upstream tests in 11 cases — distributed_test.py's ``test_send_recv``, ``test_send_recv_with_tag``,
``test_isend``, ``test_irecv``, ``test_batch_isend_irecv_gloo``,
``test_batch_isend_irecv_gloo_tags``, ``test_batch_isend_irecv_op_list_err``,
``test_all_to_all_single_equal_split`` (and ``_complex``), ``test_all_to_all_single_unequal_split``
(and ``_complex``), ``test_all_to_all`` (and ``_complex``) — the ``_complex`` twins run as a
parameter of one case each —; test_c10d_gloo.py's ``test_send_recv_all_to_all``.

Looked at, not applicable: ``test_send_recv_any_source`` (a pccl receive names its sender:
``recv_anysource`` raises ``InvalidUsage``, see ``case_recv_any_source_refused``); the
``*_profiler`` variants (torch's profiler events of gloo's C++ work, which a Python group does
not emit); the ``*_nccl`` and ``*_cuda`` variants (GPUs); ``test_batch_isend_irecv_self_nccl``
(a send to oneself: pccl refuses it, ``InvalidArgument``); ``test_all_to_all*_group`` and
``*_full_group`` (the same helpers over a ``new_group`` of a subset of ranks, which a pccl group
cannot be, or of all ranks: the plain cases already).
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import _get_default_group  # noqa: E402

import pccl  # noqa: E402
from pccl_torch_world import WORLDS, pccl_world, run_cases_in_processes, thread_world_tests, world, case_table, assert_equal  # noqa: E402,F401


CASES, ported = case_table()


def _build_tensor(size: int, value: Any = None, dtype: Any = torch.float) -> Any:
    """distributed_test.py::_build_tensor (CPU)."""
    if value is None:
        value = size
    return torch.empty(size, size, size, dtype=dtype).fill_(value)


def peer(pg: Any, key: str, rank: int) -> dict[str, Any]:
    """Upstream's ``dst=rank`` / ``src=rank`` on the default group; ``group=pg,
    group_dst=rank`` on a group of ours."""
    if dist.is_initialized() and _get_default_group() is pg:
        return {key: rank}
    return {"group": pg, f"group_{key}": rank}


def recv(pg: Any, tensor: Any, src: int, tag: int = 0) -> None:
    """Upstream's ``dist.recv(t, src)``; ``group=pg, group_src=src`` on a group of ours."""
    dist.recv(tensor, tag=tag, **peer(pg, "src", src))


def p2p_op(pg: Any, op: Any, tensor: Any, rank: int, tag: int = 0) -> Any:
    if dist.is_initialized() and _get_default_group() is pg:
        return dist.P2POp(op, tensor, rank, tag=tag)
    return dist.P2POp(op, tensor, group=pg, tag=tag, group_peer=rank)


def barrier(pg: Any) -> None:
    dist.barrier(group=pg)


# --- send / recv -----------------------------------------------------------------------------------


@ported
def case_send_recv(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_send_recv (test_send_recv)"""
    send_size = rank + 1
    tensor = _build_tensor(send_size)
    for src in range(world):
        if src == rank:
            # Send mode
            for dst in range(world):
                if dst == rank:
                    continue
                dist.send(tensor, **peer(pg, "dst", dst))
        else:
            # Recv mode
            recv_size = src + 1
            expected_tensor = _build_tensor(recv_size)
            output_tensor = _build_tensor(recv_size, value=-1)
            recv(pg, output_tensor, src)
            assert_equal(expected_tensor, output_tensor)


@ported
def case_send_recv_with_tag(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_send_recv_with_tag
    (test_send_recv_with_tag)"""
    send_recv_size = 10
    tensor = _build_tensor(send_recv_size, value=rank)
    for dst in range(world):
        if dst == rank:
            # Recv mode
            for src in range(world):
                if src == rank:
                    continue
                output_tensor = _build_tensor(send_recv_size, value=-1)
                recv(pg, output_tensor, src, tag=src)
                assert output_tensor.eq(src).all()
        else:
            # Send mode
            dist.send(tensor, tag=rank, **peer(pg, "dst", dst))


@ported
def case_isend(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_isend (test_isend)"""
    if rank == 0:
        requests = [dist.isend(_build_tensor(dest, 10), **peer(pg, "dst", dest)) for dest in range(1, world)]
        for request in requests:
            request.wait()
            assert request.is_completed()
    else:
        tensor = _build_tensor(rank, -1)
        recv(pg, tensor, 0)
        assert_equal(_build_tensor(rank, 10), tensor)
    barrier(pg)


@ported
def case_irecv(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::test_irecv"""
    if rank == 0:
        expected_tensors = [_build_tensor(src, -1) for src in range(1, world)]
        requests = [dist.irecv(expected_tensors[src - 1], **peer(pg, "src", src)) for src in range(1, world)]
        for src in range(1, world):
            requests[src - 1].wait()
            assert requests[src - 1].is_completed()
            assert_equal(_build_tensor(src, 10), expected_tensors[src - 1])
    else:
        tensor = _build_tensor(rank, 10)
        dist.send(tensor, **peer(pg, "dst", 0))
    barrier(pg)


def _batch_isend_irecv(pg: Any, rank: int, world: int, tags: bool) -> None:
    barrier(pg)
    p2p_op_list = []
    recvs = []
    for src in range(world):
        if src == rank:
            continue
        send_tensor = _build_tensor(rank + 1)
        recv_tensor = _build_tensor(src + 1, value=-1)
        recvs.append((src, recv_tensor))
        p2p_op_list.append(p2p_op(pg, dist.irecv, recv_tensor, src, tag=src if tags else 0))
        p2p_op_list.append(p2p_op(pg, dist.isend, send_tensor, src, tag=rank if tags else 0))
    reqs = dist.batch_isend_irecv(p2p_op_list)
    for req in reqs:
        req.wait()
    barrier(pg)
    for src, recv_tensor in recvs:  # pccl's addition: upstream only waits
        assert_equal(_build_tensor(src + 1), recv_tensor)


@ported
def case_batch_isend_irecv_gloo(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::test_batch_isend_irecv_gloo
    (pccl also checks the received values)"""
    _batch_isend_irecv(pg, rank, world, tags=False)


@ported
def case_batch_isend_irecv_gloo_tags(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::test_batch_isend_irecv_gloo_tags
    (pccl also checks the received values)"""
    _batch_isend_irecv(pg, rank, world, tags=True)


@ported
def case_batch_isend_irecv_op_list_err(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::test_batch_isend_irecv_op_list_err
    (upstream runs it on NCCL; the check is torch's, before any backend)"""
    barrier(pg)
    if rank == 0:
        with pytest.raises(ValueError, match="^Invalid ``p2p_op_list``"):
            dist.batch_isend_irecv([1, 2])


@ported
def case_send_recv_all_to_all(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ProcessGroupGlooTest.test_send_recv_all_to_all"""
    # Preallocate tensors for input/output
    inputs = [torch.tensor([rank]) for _ in range(world)]
    outputs = [torch.tensor([-1]) for _ in range(world)]
    # Issue sends
    send_work = []
    for i in range(world):
        if i == rank:
            continue
        send_work.append(pg.send([inputs[i]], i, 0))
    # Issue recvs
    recv_work = []
    for i in range(world):
        if i == rank:
            continue
        recv_work.append(pg.recv([outputs[i]], i, 0))
    # Wait for sends to complete
    for work in send_work:
        work.wait()
        assert work.is_completed()
    # Wait for recvs to complete
    for work in recv_work:
        work.wait()
        assert work.is_completed()
    # Test that every output other than our own contains the respective rank
    for i in range(world):
        if i == rank:
            continue
        assert_equal(torch.tensor([i]), outputs[i])


@ported
def case_recv_any_source_refused(pg: Any, rank: int, world: int) -> None:
    """pccl's: ``dist.recv(t)`` without a source (upstream's test_send_recv_any_source) raises
    InvalidUsage at once, naming the way out; so do a tag out of range and a send to oneself."""
    with pytest.raises(pccl.InvalidUsage, match="pass src="):
        dist.irecv(torch.zeros(1), group=pg)
    with pytest.raises(pccl.InvalidArgument, match="tags in"):
        pg.send([torch.zeros(1)], (rank + 1) % world, -1)
    with pytest.raises(pccl.InvalidArgument, match="own rank"):
        pg.send([torch.zeros(1)], rank, 0)


# --- all_to_all ---------------------------------------------------------------------------------------


def _dtypes(fn: Callable[[Any, int, int, Any], None]) -> Callable[[Any, int, int], None]:
    def both(pg: Any, rank: int, world: int) -> None:
        for dtype in (torch.float, torch.cfloat):  # the case and its _complex twin
            fn(pg, rank, world, dtype)

    both.__name__, both.__doc__ = fn.__name__, fn.__doc__
    return both


@ported
@_dtypes
def case_all_to_all_single_equal_split(pg: Any, rank: int, world: int, dtype: Any) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_all_to_all_single_equal_split_helper
    (test_all_to_all_single_equal_split and test_all_to_all_single_equal_split_complex)"""
    group = range(world)
    size = len(group)
    in_tensor = torch.ones([size, size], dtype=dtype) * rank
    expected_tensor = torch.cat([torch.ones([1, size], dtype=dtype) * i for i in group])
    out_tensor = torch.ones([size, size], dtype=dtype) * -1
    dist.all_to_all_single(out_tensor, in_tensor, group=pg)
    assert_equal(expected_tensor, out_tensor)
    barrier(pg)


@ported
@_dtypes
def case_all_to_all_single_unequal_split(pg: Any, rank: int, world: int, dtype: Any) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_all_to_all_single_unequal_split_helper
    (test_all_to_all_single_unequal_split and test_all_to_all_single_unequal_split_complex)"""
    group = range(world)
    size = len(group)
    in_splits = [i + 1 for i in group]
    out_splits = [rank + 1 for _ in group]
    in_tensor = torch.ones([sum(in_splits), size], dtype=dtype) * rank
    out_tensor = torch.ones([(rank + 1) * size, size], dtype=dtype)
    expected_tensor = torch.cat([torch.ones([rank + 1, size], dtype=dtype) * i for i in group])
    dist.all_to_all_single(out_tensor, in_tensor, out_splits, in_splits, group=pg)
    assert_equal(expected_tensor, out_tensor)
    barrier(pg)


@ported
@_dtypes
def case_all_to_all(pg: Any, rank: int, world: int, dtype: Any) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_test_all_to_all_helper
    (test_all_to_all and test_all_to_all_complex)"""
    group = range(world)
    size = len(group)
    in_splits = [i + 1 for i in group]
    in_tensors = [torch.ones([in_splits[i], size], dtype=dtype) * rank for i, _ in enumerate(group)]
    out_tensors = [torch.ones([(rank + 1), size], dtype=dtype) for _ in group]
    expected_tensors = [torch.ones([rank + 1, size], dtype=dtype) * i for i in group]
    dist.all_to_all(out_tensors, in_tensors, group=pg)
    for t1, t2 in zip(out_tensors, expected_tensors, strict=True):
        assert_equal(t2, t1)
    barrier(pg)


# --- pccl's own: a dead peer ---------------------------------------------------------------------------


def test_a_closed_peer_ends_a_pending_irecv_with_peer_disconnected() -> None:
    """A receive from a peer that leaves (its communicator closes) ends with PeerDisconnected,
    pccl's retry-safe error, through ``Work.wait()`` and the future — not a hang."""
    with pccl_world(2) as w:
        pgs = [pccl.torch.ProcessGroup(c) for c in w.comms]
        try:
            receiver = next(pg for pg in pgs if pg.rank() == 0)
            leaver = next(pg for pg in pgs if pg.rank() == 1)
            warm = torch.zeros(1)  # a first message: the pair's connections are up
            sent = leaver.send([torch.ones(1)], 0, 0)
            receiver.recv([warm], 1, 0).wait()
            sent.wait()
            got = torch.full((4,), -1.0)
            work = dist.irecv(got, group=receiver, group_src=1)
            time.sleep(0.3)  # the receive is posted on the communicator's thread
            leaver.communicator.close()
            with pytest.raises(pccl.PeerDisconnected):
                work.wait()
            assert isinstance(work.exception(), pccl.PeerDisconnected)
            assert_equal(torch.full((4,), -1.0), got)  # its old values
        finally:
            for pg in pgs:
                pg.shutdown()


# --- running them -------------------------------------------------------------------------------------------


globals().update(thread_world_tests(CASES))


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py), with upstream's global ranks."""
    run_cases_in_processes("test_c10d_ported_p2p", world_size, tmp_path / "store", list(CASES))
