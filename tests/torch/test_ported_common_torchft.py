"""More upstream tests ported to ``pccl.torch.ProcessGroup``: pytorch/pytorch's
``test/distributed/test_c10d_common.py`` (commit 00eb953b), the ``reduce_scatter`` cases of
``test/distributed/test_c10d_gloo.py`` and torchft's ``torchft/process_group_test.py``
(pytorch/torchft commit 73dafea4).

Each ``case_*`` function is one upstream test or helper (its docstring names the file and the
function), with the same inputs and assertions; ``case(pg, rank, world)`` takes the place of
upstream's ``self.rank``, ``self.world_size`` and the group the test built (upstream's default
group: ``group=pg`` is passed where upstream leaves the group out).  Every case runs on worlds of
2 and 3 peers, in two ways, as test_c10d_ported.py's do: threads of this process, each with a
``pccl.torch.ProcessGroup(comm)``, and processes whose default group
``init_process_group("pccl")`` made (c10d_ported_peer.py).  The single-process cases (torch's
registry of backends) are plain tests at the end.

torchft's cases are the ``run_*_test`` functions its ``MultiPgBaseTest.test_collective`` runs on
every rank of a world with ``tensor = torch.tensor([rank + 1])``; ``case_torchft_*`` passes that
tensor.

Looked at, not applicable to a CPU pccl group, and why:

* ``test_c10d_common.py``: ``TimeoutTest``, ``BackendEntryPointTest``, ``DefaultBackendTypeTest``,
  ``ComputeBucketAssignmentTest``, ``SplitGroupOptionsTest``, ``ReduceOpTest``, ``LocalRankTest``,
  ``RecordCommTest``, ``ThreadLocalSafetyLintTest``, ``MultiProcContinuousSkipTest`` and
  ``CommTest.test_debug_level`` (torch's own store barrier, entry points, NCCL, bucket sizes,
  C++ backend splitting, ``ReduceOp`` objects, env parsing and source lint: no process group
  of a backend takes part); every ``CommonDistributedDataParallelTest`` test but the CPU
  helper ported here (``@skip_if_lt_x_gpu(2)``: ``device_ids=[self.rank]`` on GPUs) and
  ``test_invalid_powerSGD_state`` (``process_group=None``); ``AbstractCommTest``'s
  ``_test_sequence_num_*`` (a C++ backend's sequence numbers, checked over a gloo
  ``new_group``), ``_test_warn_not_in_group`` and ``_test_rank_membership`` (``new_group`` over a
  subset of the ranks: a pccl group is a whole peer group, ``InvalidUsage`` at once);
  ``AbstractLargeCommTest`` (world size 4, subsets of the ranks); the
  ``PythonProcessGroupExtensionTest`` cases that assert ``DummyProcessGroup``'s own arithmetic
  (``test_collectives``; ``test_send_recv`` past torch's own ``ValueError`` checks, which are
  ported), its 124-rank unregistered group (``test_canonicalize_helper``), its ``extended_api``
  delegation (``test_new_group_delegates_to_pg*``) and ``"cpu:dummy,cuda:dummy,xpu:dummy"``
  (``test_init_process_group_with_multiple_backends``: pccl registers for the CPU only; the
  ``"cpu:pccl"`` form is ``test_backend_config``'s); ``ProcessGroupWithDispatchedCollectivesTests``'
  ``test_init_process_group_optional_backend``, ``test_init_process_group_for_all_backends``
  and ``test_default_process_group`` (gloo and NCCL's defaults, and a name check of
  ``"custom"`` for a C++-wrapped plugin where pccl's group is the Python group itself:
  ``name()`` is ``"pccl"``, test_c10d_ported.py's ``case_attr_overrides``).
* ``test_c10d_gloo.py``'s ``reduce_scatter`` cases: ``test_reduce_scatter_checks``'s gloo-only
  messages are matched by their words; ``test_reduce_scatter_*_cuda`` (GPUs).
* torchft: ``run_*`` under ``_run_with_resiliency`` (torchft's ``configure`` / ``set_timeout``
  / ``errored`` reconfiguration API; pccl recovers by membership votes:
  tests/torch/test_torch_ddp_kill.py, tests/e2e/test_torch_ddp.py); ``_test_pg`` as
  ``test_gloo_apis`` runs it (a one-rank group: ``alltoall_base`` with one split and
  ``allgather_into_tensor_coalesced`` into an output of the input's size only fit world size
  1); ``test_nccl_*``, ``test_baby_*`` (torchft's subprocess groups), ``test_dummy``,
  ``test_device_mesh``, ``test_process_group_wrapper``,
  ``test_error_swallowing_process_group_wrapper``, ``test_managed_process_group``,
  ``DeviceMeshTest`` (torchft's own classes); ``test_functional_collectives`` is pccl's
  test_pccl_torch_api.py::test_functional_collectives_find_the_group_by_its_name.
"""

from __future__ import annotations

import copy
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._C._distributed_c10d import (AllgatherOptions, AllreduceCoalescedOptions, AllreduceOptions,  # noqa: E402
                                       AllToAllOptions, BarrierOptions, BroadcastOptions, ReduceOp,
                                       ReduceScatterOptions)
from torch.distributed.distributed_c10d import _get_default_group  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import pccl  # noqa: E402
import pccl.torch  # noqa: E402
from pccl_torch_world import CFG, World, master_in_thread, pccl_world, run_peer_processes  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent
WORLDS = (2, 3)

#: name -> case, in the order they are defined (the peer processes run them in this order).
CASES: dict[str, Callable[[Any, int, int], None]] = {}


def ported(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def assert_equal(expected: Any, actual: Any) -> None:
    """torch's ``TestCase.assertEqual`` for tensors and lists of them."""
    torch.testing.assert_close(actual, expected)


def default(pg: Any) -> bool:
    """Whether ``pg`` is the default group (the init_process_group runs)."""
    return dist.is_initialized() and _get_default_group() is pg


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


# --- running them -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{n}" for n in WORLDS])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    with pccl_world(request.param) as w:
        yield w


def _test(name: str, case: Callable[[Any, int, int], None]) -> Callable[[World], None]:
    def test(world: World) -> None:
        world.run(case)

    test.__name__ = test.__qualname__ = f"test_{name}"
    test.__doc__ = case.__doc__
    return test


for _name, _case in CASES.items():
    globals()[f"test_{_name}"] = _test(_name, _case)


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py), with upstream's global ranks."""
    with master_in_thread(CFG) as master:
        reports = run_peer_processes(HERE / "c10d_ported_peer.py", [
            [master.address, str(world_size), str(rank), str(tmp_path / "store"), "0", "test_ported_common_torchft"]
            for rank in range(world_size)], timeout=150)
    assert sorted(r["rank"] for r in reports) == list(range(world_size))
    failed = {}
    for report in reports:
        assert report["backend"] == "pccl" and report["world"] == world_size
        assert list(report["cases"]) == list(CASES)
        failed.update({f"{name} (rank {report['rank']})": outcome for name, outcome in report["cases"].items()
                       if outcome != "ok"})
    assert not failed, "\n".join(f"{name}:\n{outcome}" for name, outcome in failed.items())
