"""More upstream tests ported to ``pccl.torch.ProcessGroup``: pytorch/pytorch's
``test/distributed/test_c10d_common.py`` (commit 00eb953b), the ``reduce_scatter`` case and the
CPU DDP cases of ``test/distributed/test_c10d_gloo.py`` (commit 005a6a0b), torch 2.13's
``torch/testing/_internal/distributed/distributed_test.py::test_all_gather_coalesced_with_empty``
and torchft's ``torchft/process_group_test.py`` (pytorch/torchft commit 73dafea4).

Each ``case_*`` function is one upstream test or helper (its docstring names the file and the
function), with the same inputs and assertions; ``case(pg, rank, world)`` takes the place of
upstream's ``self.rank``, ``self.world_size`` and the group the test built (upstream's default
group: ``group=pg`` is passed where upstream leaves the group out).  The ``CASES`` run on worlds
of 2 and 3 peers, in two ways, as test_c10d_ported.py's do: threads of this process, each with a
``pccl.torch.ProcessGroup(comm)``, and processes whose default group
``init_process_group("pccl")`` made (c10d_ported_peer.py).  The ``WORLD1_CASES`` are upstream's
one-rank cases (their roots are ``self.rank``): they run on a world of one peer, both ways.  The
backend-registration cases are plain tests of one process at the end.

torchft's cases are the ``run_*_test`` functions its ``MultiPgBaseTest.test_collective`` runs on
every rank with ``tensor = torch.tensor([rank + 1])``, and ``test_gloo_apis`` (one rank).

Ported: test_c10d_common.py 13 (``_test_tensor_dtype_mismatch``, ``_test_tensor_dtype_complex``,
``_test_bool_tensors``, ``_test_allreduce_coalesced``, ``_test_collectives``,
``_test_all_to_all_single``, ``_test_ddp_with_process_group`` twice as test_c10d_gloo.py's
``test_gloo_backend_cpu_module`` and ``..._grad_is_view`` run it, ``test_send_recv``'s checks,
``test_shutdown``, ``test_backend_class_attr``, ``test_is_backend_available``,
``test_backend_config``); test_c10d_gloo.py 1 (``test_reduce_scatter``); distributed_test.py 1
(``test_all_gather_coalesced_with_empty``); torchft 12 (11 ``run_*_test`` and
``test_gloo_apis``).

Looked at, not applicable to a CPU pccl group, and why:

* ``test_c10d_common.py``: ``TimeoutTest``, ``BackendEntryPointTest``, ``DefaultBackendTypeTest``,
  ``ComputeBucketAssignmentTest``, ``SplitGroupOptionsTest``, ``ReduceOpTest``, ``LocalRankTest``,
  ``RecordCommTest``, ``ThreadLocalSafetyLintTest``, ``MultiProcContinuousSkipTest``,
  ``CommTest.test_debug_level`` and ``test_parse_backend_string`` (torch's own store barrier,
  entry points, NCCL, bucket sizes, C++ backend splitting, ``ReduceOp`` objects, env and string
  parsing, source lint: no backend's process group takes part); every other
  ``CommonDistributedDataParallelTest`` test (``@skip_if_lt_x_gpu(2)``: ``device_ids=[self.rank]``
  on GPUs) and ``test_invalid_powerSGD_state`` (``process_group=None``); ``AbstractCommTest``'s
  ``_test_sequence_num_*`` (a C++ backend's sequence numbers, checked over a gloo ``new_group``),
  ``_test_warn_not_in_group`` and ``_test_rank_membership`` (``new_group`` over a subset of the
  ranks: a pccl group is a whole peer group, ``InvalidUsage`` at once); ``AbstractLargeCommTest``
  (world size 4, subsets of the ranks); ``PythonProcessGroupExtensionTest``'s cases that assert
  ``DummyProcessGroup``'s own behaviour (``test_get_backend_name``, ``test_collectives``'s ``+2``
  arithmetic, ``test_send_recv`` past torch's own ``ValueError`` checks — every rank sends
  before it receives, which a real send waits on —, ``test_canonicalize_helper``'s 124-rank
  unregistered group, the ``extended_api`` delegation of ``test_new_group_delegates_to_pg*``),
  ``test_get_backend_impl`` (``dist.get_backend_impl`` is not in torch 2.13),
  ``test_init_process_group_with_multiple_backends`` (``"cpu:dummy,cuda:dummy,xpu:dummy"``:
  pccl registers for the CPU only; ``test_backend_config`` covers ``"cpu:pccl"``) and
  ``test_abort`` (not ported: pccl's ``abort()`` is its ``shutdown()``, which the
  ``test_shutdown`` port covers); ``ProcessGroupWithDispatchedCollectivesTests``'
  ``test_init_process_group_optional_backend``, ``test_init_process_group_for_all_backends``
  and ``test_default_process_group`` (gloo's and NCCL's defaults; a check that a C++-wrapped
  plugin is named ``"custom"``, where pccl's group is the Python group itself, named ``"pccl"``:
  test_c10d_ported.py's ``case_attr_overrides``).
* ``test_c10d_gloo.py``'s other ``DistributedDataParallelTest`` cases: test_c10d_gloo_more.py
  (the CPU ones ported, the others listed with the reason).
* torchft: ``_run_with_resiliency`` (torchft's ``configure`` / ``set_timeout`` / ``errored``
  reconfiguration API; pccl recovers by membership votes: test_torch_ddp_kill.py,
  tests/e2e/test_torch_ddp.py); ``test_nccl_*``, ``test_baby_*`` (torchft's subprocess groups),
  ``test_gloo_timeout``, ``test_dummy``, ``test_device_mesh``, ``test_process_group_wrapper``,
  ``test_error_swallowing_process_group_wrapper``, ``test_managed_process_group``,
  ``DeviceMeshTest`` (torchft's own classes and gloo's timeouts); ``test_functional_collectives``
  is pccl's test_pccl_torch_api.py::test_functional_collectives_find_the_group_by_its_name.
"""

from __future__ import annotations

import copy
import pathlib
import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,  # noqa: E402
                                       AllToAllOptions, BarrierOptions, BroadcastOptions, ReduceOp,
                                       ReduceScatterOptions)
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import pccl  # noqa: E402
import pccl.torch  # noqa: E402
from pccl_torch_world import CFG, WORLDS, master_in_thread, pccl_world, run_cases_in_processes, run_peer_processes, thread_world_tests, world, case_table, assert_equal, default, group_kw as _kw  # noqa: E402,F401

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent

#: name -> case, in the order they are defined (the peer processes run them in this order).
CASES, ported = case_table()


# --- test/distributed/test_c10d_common.py -------------------------------------------------------------


@ported
def case_tensor_dtype_mismatch(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::AbstractCommTest._test_tensor_dtype_mismatch (torch's
    own checks, before the backend: pccl's group must not get in their way)"""
    g = _kw(pg)
    tensor = torch.ones(2, 2) * 7
    tensor_h = tensor.half()
    tensor_list = [torch.zeros(2, 2) for _ in range(world)]
    tensor_list_h = list(tensor_list)
    tensor_list_h[1] = tensor_list_h[1].half()
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_gather(tensor_list_h, tensor, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_gather(tensor_list, tensor_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_gather_coalesced([tensor_list_h], tensor_list, **g)
        dist.all_gather_coalesced([tensor_list], tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_reduce_coalesced(tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.reduce_scatter(tensor, tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.reduce_scatter(tensor_h, tensor_list, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_to_all_single(tensor_h, tensor, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_to_all(tensor_list_h, tensor_list, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.all_to_all(tensor_list, tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.scatter(tensor, tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.gather(tensor_h, tensor_list, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.gather(tensor, tensor_list_h, **g)
    with pytest.raises(ValueError, match="tensors with different dtypes"):
        dist.scatter(tensor_h, tensor_list, **g)


@ported
def case_tensor_dtype_complex(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::AbstractCommTest._test_tensor_dtype_complex"""
    g = _kw(pg)
    tensor = torch.rand(2)
    tensor_c = torch.view_as_complex(tensor)
    tensor_list = [torch.rand(2) for _ in range(world)]
    tensor_list_c = list(tensor_list)
    tensor_list_c[1] = torch.view_as_complex(tensor_list_c[1])
    dist.all_gather(tensor_list, tensor, **g)
    dist.all_gather(tensor_list, tensor_c, **g)
    dist.all_gather(tensor_list_c, tensor, **g)
    dist.all_gather(tensor_list_c, tensor_c, **g)


@ported
def case_bool_tensors(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::AbstractCommTest._test_bool_tensors"""
    g = _kw(pg)
    tensor = torch.tensor([1, 0, 0, 1], dtype=torch.bool)
    zeros = torch.tensor([0, 0, 0, 0], dtype=torch.bool)
    outensor = zeros if rank > 0 else tensor
    if default(pg):
        dist.broadcast(outensor, src=0)
    else:
        dist.broadcast(outensor, group_src=0, **g)
    assert_equal(tensor, outensor)


@ported
def case_allreduce_coalesced_dispatched(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::ProcessGroupWithDispatchedCollectivesTests._test_allreduce_coalesced
    (test_c10d_gloo.py's test_allreduce_coalesced; upstream's world has one rank, the
    expectation scales with the world)"""
    tensors = [torch.ones(10, 10)]
    dist.all_reduce_coalesced(tensors, dist.ReduceOp.SUM, **_kw(pg))
    for tensor in tensors:
        assert_equal(torch.ones(10, 10) * world, tensor)


@ported
def case_send_recv_checks(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::PythonProcessGroupExtensionTest.test_send_recv, its
    ``ValueError`` checks (the sends and receives between them assert DummyProcessGroup's
    arithmetic, ``+1`` and ``+2``, and everyone sends before receiving: a real send waits)"""
    input_tensor = torch.zeros(2, 2)
    if default(pg):
        with pytest.raises(ValueError):
            dist.send(input_tensor, dist.get_rank())
        with pytest.raises(ValueError):
            dist.send(input_tensor, group_dst=dist.get_rank())
        with pytest.raises(ValueError):
            dist.send(input_tensor, dist.get_rank(), group_dst=dist.get_rank())
        with pytest.raises(ValueError):
            dist.send(input_tensor)
        with pytest.raises(ValueError):
            dist.recv(input_tensor, src=0, group_src=0)
    else:
        with pytest.raises(ValueError):
            dist.send(input_tensor, group=pg, group_dst=pg.rank())
        with pytest.raises(ValueError):
            dist.send(input_tensor, pg.rank(), group=pg, group_dst=pg.rank())
        with pytest.raises(ValueError):
            dist.send(input_tensor, group=pg)
        with pytest.raises(ValueError):
            dist.recv(input_tensor, src=0, group=pg, group_src=0)
    dist.barrier(**_kw(pg))


class Net(nn.Module):
    """test/distributed/test_c10d_common.py::Net"""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: Any) -> Any:
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        x = self.fc3(x)
        return F.softmax(x, dim=1)


#: torch's global random generator is one per process: the thread-world peers draw their
#: models and inputs under this lock, each after seeding, as upstream's processes do.
_RNG = threading.Lock()


def _ddp_with_process_group(pg: Any, rank: int, world: int, gradient_as_bucket_view: bool) -> None:
    """test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest._test_ddp_with_process_group
    with test_c10d_gloo.py's CPU arguments (``devices=[torch.device("cpu")]``, ``device_ids=None``)"""
    devices = [torch.device("cpu")]
    local_batch_size = len(devices)
    global_batch_size = world * local_batch_size
    with _RNG:  # _prepare_single_device_module's draws (building the DDP draws nothing; it waits for the peers)
        torch.manual_seed(0)  # upstream's processes start from one seed
        model = Net()
        input = torch.randn(global_batch_size, 2)  # noqa: A001 - upstream's name
        target = torch.randn(global_batch_size, 4)
    device = devices[0]
    ddp_model = DistributedDataParallel(copy.deepcopy(model).to(device), device_ids=None, process_group=pg,
                                        bucket_cap_mb=0.001, gradient_as_bucket_view=gradient_as_bucket_view)
    model.to(device)
    input, target = input.to(device), target.to(device)  # noqa: A001
    ddp_logging_data = ddp_model._get_ddp_logging_data()
    assert not ddp_logging_data.get("is_multi_device_module")

    def step_model(model: Any, input: Any, target: Any) -> None:  # noqa: A002
        model.train()
        output = model(input)
        loss = F.mse_loss(output, target.to(output.device))
        loss.backward()

    def update_parameters(model: Any) -> None:
        for param in model.parameters():
            with torch.no_grad():
                param -= param.grad
            param.grad = None

    # check two model parameters over 2 iterations
    for iteration in range(2):
        # single cpu/gpu training
        step_model(model, input, target)
        # DDP training, DDP scatters subsets of input_cpu to nodes/GPUs
        step_model(ddp_model, input[rank * local_batch_size:(rank + 1) * local_batch_size],
                   target[rank * local_batch_size:(rank + 1) * local_batch_size])
        # Update weights and run a second iteration to shake out errors
        update_parameters(model)
        update_parameters(ddp_model)
        assert len(list(model.parameters())) == len(list(ddp_model.parameters()))
        for i, j in zip(model.parameters(), ddp_model.parameters()):
            torch.testing.assert_close(i, j, rtol=1.3e-06, atol=5e-5)
        # Shuffle the input so that DDP input is different
        with _RNG:
            torch.manual_seed(1337 + iteration)
            input = input[torch.randperm(global_batch_size)]  # noqa: A001


@ported
def case_ddp_cpu_module(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest._test_ddp_with_process_group
    as test_c10d_gloo.py::DistributedDataParallelTest.test_gloo_backend_cpu_module runs it"""
    _ddp_with_process_group(pg, rank, world, gradient_as_bucket_view=False)


@ported
def case_ddp_cpu_module_grad_is_view(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest._test_ddp_with_process_group
    as test_c10d_gloo.py::DistributedDataParallelTest.test_gloo_backend_cpu_module_grad_is_view runs it"""
    _ddp_with_process_group(pg, rank, world, gradient_as_bucket_view=True)


# --- test/distributed/test_c10d_gloo.py and distributed_test.py ----------------------------------------


@ported
def case_reduce_scatter(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ProcessGroupGlooTest.test_reduce_scatter (variable
    size per rank: rank 0's output is empty; ``torch.manual_seed(42)`` is a generator seeded
    42, the same numbers, as the thread-world peers share torch's global one)"""
    generator = torch.Generator().manual_seed(42)
    # variable size per rank
    inputs = [torch.rand(i, generator=generator) for i in range(world)]
    output = torch.empty(rank)
    work = dist.reduce_scatter(output, inputs, async_op=True, **_kw(pg))
    work.wait()
    expect = inputs[rank] * world
    assert torch.allclose(output, expect)


@ported
def case_all_gather_coalesced_with_empty(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::test_all_gather_coalesced_with_empty
    (torch 2.13)"""
    group = range(world)
    input_tensors = [rank * torch.ones([2, 2]), torch.ones([0]), (rank + 1) * torch.ones([3, 3]), torch.ones([0]),
                     torch.ones([0])]
    output_tensors_lists = [[-1 * torch.ones([2, 2]), -1 * torch.ones([0]), -1 * torch.ones([3, 3]),
                             -1 * torch.ones([0]), -1 * torch.ones([0])] for _ in group]
    expected_tensors = [[r * torch.ones([2, 2]), torch.ones([0]), (r + 1) * torch.ones([3, 3]), torch.ones([0]),
                         torch.ones([0])] for r in group]
    dist.all_gather_coalesced(output_tensors_lists, input_tensors, **_kw(pg))  # _run_all_gather_coalesced_and_verify
    for l1, l2 in zip(output_tensors_lists, expected_tensors, strict=True):
        for t1, t2 in zip(l1, l2, strict=True):
            assert torch.equal(t1, t2), "output tensors do not match expected outputs"
    dist.barrier(**_kw(pg))


# --- torchft/process_group_test.py ------------------------------------------------------------------


@ported
def case_torchft_allgather(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_allgather_test"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    to_gather = torch.stack([tensor, tensor + 1], dim=0)
    to_gather = to_gather.reshape(-1)
    output_list = [torch.zeros(2, device=tensor.device, dtype=tensor.dtype) for _ in range(world_sz)]
    work = pg.allgather([output_list], [to_gather], AllgatherOptions())
    work.wait()
    for r in range(world_sz):
        expected = torch.tensor([r + 1, r + 2], device=tensor.device, dtype=tensor.dtype)
        torch.testing.assert_close(output_list[r], expected)


@ported
def case_torchft_allgather_into_tensor_coalesced(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_allgather_into_tensor_coalesced_test"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    t0 = torch.tensor([rank + 1], device=tensor.device, dtype=tensor.dtype)
    t1 = torch.tensor([rank + 10], device=tensor.device, dtype=tensor.dtype)
    out0 = torch.zeros(world_sz, device=tensor.device, dtype=tensor.dtype)
    out1 = torch.zeros(world_sz, device=tensor.device, dtype=tensor.dtype)
    work = pg.allgather_into_tensor_coalesced([out0, out1], [t0, t1], AllgatherOptions())
    work.wait()
    for r in range(world_sz):
        expected0 = torch.tensor([r + 1], device=t0.device, dtype=t0.dtype)
        torch.testing.assert_close(out0[r], expected0[0])
        expected1 = torch.tensor([r + 10], device=t1.device, dtype=t1.dtype)
        torch.testing.assert_close(out1[r], expected1[0])


@ported
def case_torchft_allreduce(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_allreduce_test"""
    tensor = torch.tensor([rank + 1])
    tc = tensor.clone()
    world_sz = pg.size()
    work = pg.allreduce([tc], ReduceOp.SUM)
    work.wait()
    expected_val = sum(r + 1 for r in range(world_sz))
    torch.testing.assert_close(tc, torch.tensor([expected_val], device=tensor.device))


@ported
def case_torchft_allreduce_coalesced(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_allreduce_coalesced_test"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    t0 = tensor.clone()
    t1 = tensor.clone() + 1
    work = pg.allreduce_coalesced([t0, t1], AllreduceCoalescedOptions())
    work.wait()
    sum_t0 = sum(r + 1 for r in range(world_sz))
    sum_t1 = sum(r + 2 for r in range(world_sz))
    torch.testing.assert_close(t0, torch.tensor([sum_t0], device=t0.device))
    torch.testing.assert_close(t1, torch.tensor([sum_t1], device=t1.device))


@ported
def case_torchft_alltoall_base(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_alltoall_test (torchft skips it on gloo, which has no
    all-to-all)"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    input_tensor = torch.arange(start=rank * world_sz + 1, end=rank * world_sz + 1 + world_sz, device=tensor.device,
                                dtype=tensor.dtype)
    output_tensor = torch.empty(world_sz, device=tensor.device, dtype=tensor.dtype)
    send_sz = [1] * world_sz
    recv_sz = [1] * world_sz
    alltoall_work = pg.alltoall_base(output_tensor, input_tensor, send_sz, recv_sz, AllToAllOptions())
    alltoall_work.wait()
    expected = torch.empty(world_sz, device=tensor.device, dtype=tensor.dtype)
    for k in range(world_sz):
        val = k * world_sz + (rank + 1)
        expected[k] = val
    torch.testing.assert_close(output_tensor, expected)


@ported
def case_torchft_barrier(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_barrier_test"""
    opts = BarrierOptions()
    barrier_work = pg.barrier(opts)
    barrier_work.wait()
    assert barrier_work.is_completed()  # pccl's addition: upstream only waits


@ported
def case_torchft_broadcast(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_broadcast_test"""
    tensor = torch.tensor([rank + 1])
    broadcast_tensor = tensor.clone() if rank == 0 else torch.zeros_like(tensor)
    broadcast_work = pg.broadcast([broadcast_tensor], BroadcastOptions())
    broadcast_work.wait()
    expected_broadcast = torch.tensor([1], device=tensor.device)
    torch.testing.assert_close(broadcast_tensor, expected_broadcast)


@ported
def case_torchft_broadcast_one(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_broadcast_one_test (torchft's ``pg.broadcast_one(t,
    0)`` is its own method; torch's pybind form of it is ``pg.broadcast(t, 0)``)"""
    tensor = torch.tensor([rank + 1])
    broadcast_one_tensor = tensor.clone() if rank == 0 else torch.zeros_like(tensor)
    broadcast_one_work = pg.broadcast(broadcast_one_tensor, 0)
    broadcast_one_work.wait()
    torch.testing.assert_close(broadcast_one_tensor, torch.tensor([1], device=tensor.device))


@ported
def case_torchft_reduce_scatter(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_reduce_scatter_test (upstream returns at once on CPU
    tensors: gloo has no reduce_scatter; pccl runs it)"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    local_data = []
    for r in range(world_sz):
        row_vals = torch.arange(start=r * world_sz + 1, end=r * world_sz + world_sz + 1, device=tensor.device,
                                dtype=torch.float32)
        local_data.append(row_vals)
    out = torch.zeros(world_sz, device=tensor.device, dtype=torch.float32)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    work = pg.reduce_scatter([out], [local_data], opts)
    work.wait()
    expected_row = torch.arange(start=rank * world_sz + 1, end=rank * world_sz + world_sz + 1, device=tensor.device,
                                dtype=torch.float32)
    expected_sum = expected_row * world_sz
    torch.testing.assert_close(out, expected_sum)


@ported
def case_torchft_reduce_scatter_tensor_coalesced(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_reduce_scatter_tensor_coalesced_test"""
    tensor = torch.tensor([rank + 1])
    world_sz = pg.size()
    m0 = []
    m1 = []
    for r in range(world_sz):
        row0 = torch.arange(start=r * world_sz + 1, end=r * world_sz + world_sz + 1, device=tensor.device,
                            dtype=torch.float32)
        row1 = torch.arange(start=r * world_sz + 100, end=r * world_sz + 100 + world_sz, device=tensor.device,
                            dtype=torch.float32)
        m0.append(row0)
        m1.append(row1)
    out0 = torch.zeros(world_sz, device=tensor.device, dtype=torch.float32)
    out1 = torch.zeros(world_sz, device=tensor.device, dtype=torch.float32)
    opts = ReduceScatterOptions()
    opts.reduceOp = ReduceOp.SUM
    work = pg.reduce_scatter_tensor_coalesced([out0, out1], [torch.stack(m0), torch.stack(m1)], opts)
    work.wait()
    base0 = torch.arange(start=rank * world_sz + 1, end=rank * world_sz + world_sz + 1, device=tensor.device,
                         dtype=torch.float32) * world_sz
    base1 = torch.arange(start=rank * world_sz + 100, end=rank * world_sz + 100 + world_sz, device=tensor.device,
                         dtype=torch.float32) * world_sz
    torch.testing.assert_close(out0, base0)
    torch.testing.assert_close(out1, base1)


@ported
def case_torchft_send_recv(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::run_send_recv_test"""
    tensor = torch.tensor([rank + 1])
    if rank == 0:
        send_tensor = tensor.clone()
        send_work = pg.send([send_tensor], 1, 0)
        send_work.wait()
    elif rank == 1:
        recv_tensor = torch.zeros_like(tensor)
        recv_work = pg.recv([recv_tensor], 0, 0)
        recv_work.wait()
        expected = torch.tensor([1], device=tensor.device)
        torch.testing.assert_close(recv_tensor, expected)


# --- upstream's one-rank cases (run in a world of one peer) ----------------------------------------------

#: Cases upstream runs in a world of one rank only (their roots are ``self.rank``, their splits
#: one chunk): they run on a pccl world of one peer, as a thread and as a process.
WORLD1_CASES: dict[str, Callable[[Any, int, int], None]] = {}


def one_rank(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
    WORLD1_CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


@one_rank
def case_dispatched_collectives(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::ProcessGroupWithDispatchedCollectivesTests._test_collectives
    (with ``_call_collective_with_varying_tensors``; pccl runs ``reduce_scatter`` and
    ``all_to_all``, which upstream leaves out for gloo; pccl also checks the values, the
    identity in a world of one)"""
    g = _kw(pg)
    root = {"dst": rank} if default(pg) else {"group_dst": rank}
    src = {"src": rank} if default(pg) else {"group_src": rank}
    tensor = torch.zeros(2, 2)
    dist.reduce(tensor, **root, **g)
    dist.broadcast(tensor, **src, **g)
    dist.all_reduce(tensor, **g)
    gathered = [torch.ones(2, 2)]
    dist.all_gather(gathered, tensor, **g)
    dist.reduce_scatter(tensor, [torch.ones(2, 2)], **g)
    dist.barrier(**g)
    outs = [torch.zeros(2, 2)]
    dist.all_to_all(outs, [tensor], **g)
    dist.scatter(tensor, [torch.full((2, 2), 3.0)], **src, **g)
    assert_equal(torch.zeros(2, 2), gathered[0])
    assert_equal(torch.ones(2, 2), outs[0])
    assert_equal(torch.full((2, 2), 3.0), tensor)


@one_rank
def case_all_to_all_single_dispatched(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_common.py::ProcessGroupWithDispatchedCollectivesTests._test_all_to_all_single"""
    g = _kw(pg)
    input_tensor = torch.ones(2, 2)
    output_tensor = torch.zeros(2, 2)
    dist.all_to_all_single(output_tensor, input_tensor, **g)
    assert_equal(input_tensor, output_tensor)  # pccl's addition: upstream checks the call only
    input_tensor = input_tensor.t()
    with pytest.raises(ValueError, match="Tensors must be contiguous"):
        dist.all_to_all_single(output_tensor, input_tensor, **g)


@one_rank
def case_torchft_gloo_apis(pg: Any, rank: int, world: int) -> None:
    """torchft/process_group_test.py::ProcessGroupTest.test_gloo_apis (device "cpu") with its
    ``_test_pg(pg, torch.tensor([2]))``; ``broadcast_one`` is torchft's own method, left out
    with ``_test_pg``'s ``skip``"""
    _test_pg(pg, torch.tensor([2]), skip=["broadcast_one"])
    m = nn.Linear(3, 4)
    m = DistributedDataParallel(m, process_group=pg)
    m(torch.rand(2, 3))


def _test_pg(pg: Any, example_tensor: Any, skip: list[str]) -> dict[str, Any]:
    """torchft/process_group_test.py::_test_pg"""
    shape = example_tensor.shape
    dtype = example_tensor.dtype
    input_tensor = example_tensor.clone()
    output_tensors = [[torch.empty_like(input_tensor) for _ in range(pg.size())]]
    tensor_list = [torch.empty_like(input_tensor)]

    def check_tensors(arg: Any) -> None:
        if isinstance(arg, torch.Tensor):
            assert arg.dtype == dtype, f"Output dtype mismatch: {arg.dtype} != {dtype}"
            assert arg.shape == shape, f"Output shape mismatch: {arg.shape} != {shape}"
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                check_tensors(item)

    collectives = [
        ("allreduce", ([input_tensor], AllreduceOptions())),
        ("allreduce", ([input_tensor], ReduceOp.SUM)),
        ("allreduce_coalesced", ([input_tensor], AllreduceCoalescedOptions())),
        ("allgather", (output_tensors, [input_tensor], AllgatherOptions())),
        ("allgather_into_tensor_coalesced", (output_tensors[0], [input_tensor], AllgatherOptions())),
        ("alltoall_base", (output_tensors[0][0], input_tensor, [input_tensor.shape[0]], [input_tensor.shape[0]],
                           AllToAllOptions())),
        ("barrier", (BarrierOptions(),)),
        ("broadcast", (tensor_list, BroadcastOptions())),
        ("broadcast_one", (input_tensor, 0)),
        ("reduce_scatter", (output_tensors[0], [[input_tensor]], ReduceScatterOptions())),
        ("reduce_scatter_tensor_coalesced", (output_tensors[0], [input_tensor], ReduceScatterOptions())),
    ]
    works: dict[str, Any] = {}
    for coll_str, args in collectives:
        if coll_str in skip:
            continue
        coll = getattr(pg, coll_str)
        work = coll(*args)
        works[coll_str] = work
        work.wait()
        fut = work.get_future()
        fut.wait()
        # Check that all tensor arguments have the expected shapes and dtypes
        check_tensors(args)
    return works


# --- running them -------------------------------------------------------------------------------------------


globals().update(thread_world_tests(CASES))


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py), with upstream's global ranks."""
    run_cases_in_processes("test_ported_common_torchft", world_size, tmp_path / "store", list(CASES))


@pytest.mark.parametrize("name", list(WORLD1_CASES))
def test_one_rank_case(name: str) -> None:
    """Upstream's one-rank cases on a pccl world of one peer (a thread)."""
    with pccl_world(1) as w:
        w.run(WORLD1_CASES[name])


def test_one_rank_cases_under_init_process_group(tmp_path: pathlib.Path) -> None:
    """Upstream's one-rank cases in one process whose default group ``init_process_group("pccl")``
    made; ``destroy_process_group`` shuts the group down (test_c10d_common.py::
    PythonProcessGroupExtensionTest.test_shutdown)."""
    with master_in_thread(CFG) as master:
        [report] = run_peer_processes(HERE / "c10d_ported_peer.py", [
            [master.address, "1", "0", str(tmp_path / "store"), "0", "test_ported_common_torchft", "WORLD1_CASES"]],
            timeout=150)
    assert report["backend"] == "pccl" and report["world"] == 1 and report["closed_after_destroy"] is True
    assert list(report["cases"]) == list(WORLD1_CASES)
    failed = {name: outcome for name, outcome in report["cases"].items() if outcome != "ok"}
    assert not failed, "\n".join(f"{name}:\n{outcome}" for name, outcome in failed.items())


# --- test/distributed/test_c10d_common.py's backend registration (one process, no group) --------------


def test_backend_class_attr() -> None:
    """test/distributed/test_c10d_common.py::PythonProcessGroupExtensionTest.test_backend_class_attr
    (the ``"pccl"`` backend for upstream's ``"dummy"``)"""
    pccl.torch.register()
    from pccl.torch.backend import _create
    assert dist.Backend.PCCL == "pccl"
    assert dist.Backend._plugins["PCCL"].creator_fn is _create


def test_is_backend_available() -> None:
    """test/distributed/test_c10d_common.py::PythonProcessGroupExtensionTest.test_is_backend_available
    (upstream checks ``"dummy"`` is not available before it registers it; pccl's may already be
    registered by an earlier test of this process)"""
    assert dist.is_ucc_available() == dist.is_backend_available("ucc")
    pccl.torch.register()
    assert dist.is_backend_available("pccl")


def test_backend_config() -> None:
    """test/distributed/test_c10d_common.py::PythonProcessGroupExtensionTest.test_backend_config
    (upstream's rows, ``"pccl"`` for ``"dummy"``; pccl registers for the CPU only, so its
    default config is ``"cpu:pccl"``)"""
    pccl.torch.register()
    rows = [
        (dist.Backend.GLOO, "cpu:gloo,cuda:gloo"),
        (dist.Backend.NCCL, "cuda:nccl"),
        (dist.Backend.MPI, "cpu:mpi,cuda:mpi"),
        (dist.Backend.UCC, "cpu:ucc,cuda:ucc"),
        (dist.Backend.PCCL, "cpu:pccl"),
        ("PCCL", "cpu:pccl"),
        ("pccl", "cpu:pccl"),
        ("cpu:pccl,cuda:pccl", "cpu:pccl,cuda:pccl"),
        ("cpu:pccl,cuda:nccl", "cpu:pccl,cuda:nccl"),
        ("cpu:gloo,cuda:pccl", "cpu:gloo,cuda:pccl"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
    ]
    for config_str, expected_value in rows:
        assert str(dist.BackendConfig(config_str)) == expected_value, config_str
    for config_str in ["cpu:gloo,cuda:nccl,", "cpu:gloo,cuda:nccl,cpu:pccl", "cpu:gloo,xpu:xccl,",
                       "cpu:gloo,xpu:xccl,cpu:pccl"]:
        with pytest.raises(ValueError):
            dist.BackendConfig(config_str)
