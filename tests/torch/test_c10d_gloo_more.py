"""The rest of pytorch/pytorch's ``test/distributed/test_c10d_gloo.py`` (commit 005a6a0b) and
``test/distributed/test_c10d_pypg.py`` (commit 024070f4), ported to ``pccl.torch.ProcessGroup``:
the tests test_c10d_ported.py, test_c10d_ported_p2p.py and test_ported_common_torchft.py
neither port nor list.

Each ``case_*`` function is one upstream test (its docstring names the file and the function),
with the same inputs and assertions; ``case(pg, rank, world)`` takes the place of upstream's
``self.rank``, ``self.world_size`` and the group the test built (upstream's default group:
``group=pg`` where upstream leaves the group out).  Every case runs on worlds of 2 and 3 peers,
in two ways, as test_c10d_ported.py's do: threads of this process, each with a
``pccl.torch.ProcessGroup(comm)``, and processes whose default group
``init_process_group("pccl")`` made (c10d_ported_peer.py with this module).  Upstream's
``ReducerTest`` and ``TestDDPWith*`` build a group of one rank; the port runs them on the worlds
of 2 and 3 (every rank does the same; DDP's gradients are averaged over equal ones).

Ported (17): test_c10d_gloo.py's ``ReducerTest`` — ``test_single_dtype_single_bucket``,
``test_multi_dtype_single_bucket``, ``test_multi_dtype_multi_bucket``,
``test_forward_backward``, ``test_forward_backward_unused_parameters``,
``test_forward_backward_optimizer`` —; ``CommTest.test_broadcast_coalesced_gloo_cpu``;
``GlooProcessGroupWithDispatchedCollectivesTests.test_allgather_coalesced``;
``DistributedDataParallelTest``'s CPU cases ``test_ignored_output``,
``test_ignored_output_with_unused_parameters``, ``test_ddp_comm_hook_future_passing_cpu``,
``test_ddp_invalid_comm_hook_init``, ``test_ddp_invalid_comm_hook_return_type``,
``test_ddp_comm_hook_register_just_once``; test_c10d_pypg.py's ``test_ddp_invoke_work_object``,
``test_ddp_no_init_sync`` and ``TestBatchSendRecv.test_batch_isend_irecv``.

Looked at, not applicable to a CPU pccl group, and why (besides test_c10d_ported.py's list):

* ``test_c10d_gloo.py``:
  ``ProcessGroupGlooTest.test_sparse_allreduce_cuda_dispatched`` (GPUs);
  ``ProcessGroupGlooLazyInitTest`` (``ProcessGroupGlooTest`` again with gloo's
  ``TORCH_GLOO_LAZY_INIT`` connections: test_c10d_ported.py runs those cases);
  ``DistributedDataParallelTest``'s ``test_sparse_gradients``, ``..._grad_is_view`` and
  ``test_ddp_comm_hook_sparse_gradients`` (sparse gradients: pccl refuses sparse tensors,
  test_pccl_torch_api.py::test_sparse_gradients_under_torchs_ddp_are_refused_not_a_crash),
  ``test_ignored_sharded_tensor``, ``test_save_load_checkpoint``, the
  ``test_gloo_backend_*gpu*``, ``test_global_local_unused_params_grad*`` and
  ``test_find_unused_parameters_when_unused_parameters_empty`` (``@skip_if_lt_x_gpu``: they
  build CUDA models), ``test_ddp_comm_hook_future_passing_gpu_gloo`` (GPUs); its
  ``test_gloo_backend_cpu_module*`` and the inherited ``CommonDistributedDataParallelTest``
  cases are test_ported_common_torchft.py's;
  ``CommTest``: ``test_broadcast_coalesced_gloo_cuda`` (GPUs), ``test_sequence_num_*`` (a C++
  backend's sequence numbers, over a gloo ``new_group`` as well), ``test_gloo_warn_not_in_group``
  and ``test_gloo_rank_membership`` (``new_group`` over a subset of the ranks: pccl raises
  ``InvalidUsage`` at once), ``test_tensor_dtype_mismatch``, ``test_tensor_dtype_complex`` and
  ``test_bool_tensors`` (their ``AbstractCommTest._test_*`` helpers are ported in
  test_ported_common_torchft.py);
  ``GlooProcessGroupWithDispatchedCollectivesTests``: ``test_collectives``,
  ``test_allreduce_coalesced`` and ``test_all_to_all_single`` (their ``_test_*`` helpers are
  in test_ported_common_torchft.py), ``test_monitored_barrier`` (torch implements
  ``monitored_barrier`` for the gloo backend only: ``ValueError`` for any other);
  ``LargeCommTest`` (``AbstractLargeCommTest``: world size 4, ``new_group`` over subsets of the
  ranks).
* ``test_c10d_pypg.py``: ``AbstractDDPSingleRank.test_ddp_with_pypg`` and
  ``..._with_grad_views`` (``_test_ddp_with_process_group``, on CPU: test_ported_common_torchft.py's
  ``case_ddp_cpu_module*``), its inherited ``CommonDistributedDataParallelTest`` cases (GPUs,
  see test_ported_common_torchft.py); ``TestBatchSendRecv.test_batch_isend_irecv_coalescing``
  (torch's ``supports_coalescing`` / start / end coalescing hooks, which pccl does not
  implement: its ``batch_isend_irecv`` is the per-op path ``test_batch_isend_irecv`` ports);
  every ``TestPyProcessGroup`` case is ported or listed in test_c10d_ported.py.
"""

# No ``from __future__ import annotations``: DDP checks a comm hook's annotations (objects, not
# strings), as upstream's file has them.

import pathlib
import random
import threading
from itertools import groupby
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from pccl_torch_world import WORLDS, run_cases_in_processes, thread_world_tests, world, case_table, assert_equal, default, group_kw as _kw  # noqa: E402,F401

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


#: name -> case, in the order they are defined (the peer processes run them in this order).
CASES, ported = case_table()

#: torch's global random generator is one per process: the thread-world peers that need the
#: same draws as their peers seed and draw under this lock, as upstream's processes do.
_RNG = threading.Lock()


# --- test_c10d_gloo.py::ReducerTest -------------------------------------------------------------------


class ReducerModule(nn.Module):
    """test/distributed/test_c10d_gloo.py::ReducerModule"""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 4, bias=False)
        self.fc3 = nn.Linear(4, 4, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: Any, use_fc3: bool = True) -> Any:
        x = self.relu(self.fc1(x)).float()
        x = self.relu(self.fc2(x)).float()
        if use_fc3:
            x = self.fc3(x).float()
        return F.softmax(x, dim=1)


def _create_mixed_precision_model() -> ReducerModule:
    """test/distributed/test_c10d_gloo.py::ReducerTest._create_mixed_precision_model"""
    model = ReducerModule()
    model.float()
    model.fc1.double()
    return model


def _create_reducer_for_models(pg: Any, models: list[Any], find_unused_parameters: bool = False) -> Any:
    """test/distributed/test_c10d_gloo.py::ReducerTest._create_reducer_for_models"""
    assert len(models) == 1
    parameters = list(models[0].parameters())
    group_by_dtype = groupby(range(len(parameters)), key=lambda i: parameters[i].dtype)
    buckets = [list(indices) for _, indices in group_by_dtype]
    return dist.Reducer(parameters, buckets, [dist._DEFAULT_FIRST_BUCKET_BYTES for _ in range(len(buckets))], pg,
                        find_unused_parameters=find_unused_parameters)


@ported
def case_reducer_single_dtype_single_bucket(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_single_dtype_single_bucket"""
    model = ReducerModule()
    parameters = list(model.parameters())
    buckets = [list(range(len(parameters)))]
    dist.Reducer(parameters, buckets, [dist._DEFAULT_FIRST_BUCKET_BYTES], pg)


@ported
def case_reducer_multi_dtype_single_bucket(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_multi_dtype_single_bucket"""
    model = _create_mixed_precision_model()
    # Raise if there are multiple types per bucket.
    # In this case we create one bucket for all parameters.
    with pytest.raises(RuntimeError):
        parameters = list(model.parameters())
        buckets = [list(range(len(parameters)))]
        dist.Reducer(parameters, buckets, [dist._DEFAULT_FIRST_BUCKET_BYTES], pg)


@ported
def case_reducer_multi_dtype_multi_bucket(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_multi_dtype_multi_bucket"""
    model = _create_mixed_precision_model()
    parameters = list(model.parameters())
    group_by_dtype = groupby(range(len(parameters)), key=lambda i: parameters[i].dtype)
    buckets = [list(indices) for _, indices in group_by_dtype]
    dist.Reducer(parameters, buckets, [dist._DEFAULT_FIRST_BUCKET_BYTES for _ in buckets], pg)


@ported
def case_reducer_forward_backward(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_forward_backward"""
    batch_size = 10
    model = _create_mixed_precision_model()
    reducer = _create_reducer_for_models(pg, [model])
    reducer.prepare_for_forward()
    loss = nn.CrossEntropyLoss()
    input = torch.rand([batch_size, 2], dtype=torch.double)  # noqa: A001 - upstream's name
    target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)])
    output = loss(model(input), target)
    reducer.prepare_for_backward(output)
    output.backward()


@ported
def case_reducer_forward_backward_unused_parameters(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_forward_backward_unused_parameters"""
    batch_size = 10
    model = _create_mixed_precision_model()
    reducer = _create_reducer_for_models(pg, [model], find_unused_parameters=True)
    reducer.prepare_for_forward()
    loss = nn.CrossEntropyLoss()
    input = torch.rand([batch_size, 2], dtype=torch.double)  # noqa: A001 - upstream's name
    target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)])
    output = loss(model(input, use_fc3=False), target)

    # Check that the grad of fc3 is not set.
    assert model.fc3.weight.grad is None

    # Compute and accumulate gradients.
    reducer.prepare_for_backward(output)
    output.backward()

    # The reducer will have marked the grad of fc3 as ready, because
    # it doesn't show up in the autograd graph of `output`. Since fc3.weight
    # is considered being globally unused, it will be kept untouched as None.
    assert model.fc3.weight.grad is None


@ported
def case_reducer_forward_backward_optimizer(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::ReducerTest.test_forward_backward_optimizer"""
    batch_size = 10
    model = _create_mixed_precision_model()
    reducer = _create_reducer_for_models(pg, [model], find_unused_parameters=True)
    reducer.prepare_for_forward()
    loss = nn.CrossEntropyLoss()
    optimizer = torch.optim.Adam(model.parameters())
    for i in range(3):
        input = torch.rand([batch_size, 2], dtype=torch.double)  # noqa: A001 - upstream's name
        target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)])

        # The `zero_grad` function calls `detach_` and `zero_` on the grad
        # tensors of model parameters. If we tried to set the grad tensors
        # to a view of the reducer's bucket tensors, this would blow up.
        optimizer.zero_grad()

        # Unused parameter only in the first iteration.
        output = loss(model(input, use_fc3=(i > 0)), target)
        reducer.prepare_for_backward(output)
        output.backward()
        optimizer.step()


# --- test_c10d_gloo.py::CommTest and GlooProcessGroupWithDispatchedCollectivesTests --------------------


def _broadcast_coalesced(pg: Any, rank: int, device: Any, root_rank: int) -> None:
    """test/distributed/test_c10d_gloo.py::CommTest._test_broadcast_coalesced"""
    half = torch.float16

    # No support for float16 for CPU tensors
    if device == torch.device("cpu"):
        half = torch.float32

    target = torch.arange(60, dtype=half, device=device).chunk(5)
    target += torch.arange(60, dtype=torch.float32, device=device).chunk(5)
    target += torch.arange(60, dtype=half, device=device).chunk(5)
    target += torch.arange(60, dtype=torch.float64, device=device).chunk(5)
    target += torch.arange(60, dtype=half, device=device).chunk(5)
    target += torch.arange(60, dtype=torch.float32, device=device).chunk(5)

    # The tensors to pass to broadcast are identical to the target
    # only on the process that is the root of the broadcast.
    if rank == root_rank:
        tensors = [tensor.clone() for tensor in target]
    else:
        tensors = [torch.zeros_like(tensor) for tensor in target]

    if rank != root_rank:
        assert not all(torch.equal(t, x) for t, x in zip(tensors, target))  # assertNotEqual

    dist._broadcast_coalesced(pg, tensors, buffer_size=256, src=root_rank)

    if rank != root_rank:
        assert_equal(list(target), tensors)


@ported
def case_broadcast_coalesced_gloo_cpu(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::CommTest.test_broadcast_coalesced_gloo_cpu (gloo's
    ``backend.create_device(interface=LOOPBACK)`` left out: pccl has no devices)"""
    device = torch.device("cpu")
    ranks = list(range(world))
    for root_rank in ranks:
        _broadcast_coalesced(pg, rank, device, root_rank)


@ported
def case_allgather_coalesced(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::GlooProcessGroupWithDispatchedCollectivesTests.test_allgather_coalesced
    (upstream's world has one rank, one output list; here one per rank, each the same ones)"""
    input_tensor = torch.ones(10, 10, dtype=torch.float32)
    output_tensor_lists = [[torch.zeros_like(input_tensor)] for _ in range(world)]
    dist.all_gather_coalesced(output_tensor_lists, [input_tensor], **_kw(pg))
    for output_tensor_list in output_tensor_lists:
        assert_equal([input_tensor], output_tensor_list)


# --- test_c10d_gloo.py::DistributedDataParallelTest (CPU) ----------------------------------------------


class Task(nn.Module):
    """test/distributed/test_c10d_common.py::Task"""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x: Any) -> Any:
        return self.p + x


class ModuleForDdpCommHook(nn.Module):
    """test/distributed/test_c10d_common.py::ModuleForDdpCommHook"""

    def __init__(self) -> None:
        super().__init__()
        self.t0 = Task()

    def forward(self, x: Any, rank: int) -> Any:
        return self.t0(x + rank)


def _ignored_output(pg: Any, model: nn.Module, find_unused_parameters: bool) -> None:
    """The body of test_c10d_gloo.py's test_ignored_output*."""
    model = DistributedDataParallel(model, process_group=pg, find_unused_parameters=find_unused_parameters)

    batch_size = 4
    criterion = nn.CrossEntropyLoss()
    input = torch.rand([batch_size, 2], dtype=torch.float)  # noqa: A001 - upstream's name
    target = torch.LongTensor([random.randrange(4) for _ in range(batch_size)])

    # Run a few iterations where we ignore the output.
    for _ in range(4):
        output = model(input)
        del output

    # Run a few iterations where we use the output.
    for _ in range(4):
        output = model(input)
        loss = criterion(output, target)
        loss.backward()


@ported
def case_ignored_output(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ignored_output"""

    class IgnoredOutput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(2, 10, bias=False)
            self.fc2 = nn.Linear(10, 4, bias=False)
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            x = self.relu(self.fc1(x))
            x = self.relu(self.fc2(x))
            return F.softmax(x, dim=1)

    _ignored_output(pg, IgnoredOutput().float(), find_unused_parameters=False)


@ported
def case_ignored_output_with_unused_parameters(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ignored_output_with_unused_parameters"""

    class IgnoredOutputWithUnusedParameters(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(2, 10, bias=False)
            self.fc2 = nn.Linear(10, 4, bias=False)
            self.fc3 = nn.Linear(4, 4, bias=False)
            self.relu = nn.ReLU()

        def forward(self, x: Any) -> Any:
            x = self.relu(self.fc1(x))
            x = self.relu(self.fc2(x))
            return F.softmax(x, dim=1)

    _ignored_output(pg, IgnoredOutputWithUnusedParameters().float(), find_unused_parameters=True)


def _simple_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """test/distributed/test_c10d_common.py::CommonDistributedDataParallelTest._simple_hook"""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(torch.ones_like(bucket.buffer()))

    def fut_then(fut: Any) -> Any:
        # Add ones to fut's result.
        t = fut.value()
        return t + torch.ones_like(t)

    return fut.then(fut_then)


@ported
def case_ddp_comm_hook_future_passing_cpu(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ddp_comm_hook_future_passing_cpu"""
    # Test on CPU
    cpu_model = DistributedDataParallel(ModuleForDdpCommHook().cpu(), process_group=pg)

    # Register DDP Communication Hook
    cpu_model.register_comm_hook(None, _simple_hook)

    # check whether the grads are equal to what then callback returns.
    # without the comm_hook, result would be 0.25 * torch.ones(2, 2).
    # (CommonDistributedDataParallelTest._run_and_verify_hook)
    output = cpu_model(8, rank)
    output.mean().backward()
    for p in cpu_model.parameters():
        assert_equal(2 * torch.ones(2, 2), p.grad)


@ported
def case_ddp_invalid_comm_hook_init(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ddp_invalid_comm_hook_init"""
    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=pg)

    with pytest.raises(TypeError, match="Communication hook must be callable."):
        model.register_comm_hook(state=None, hook=1)

    with pytest.raises(ValueError, match="bucket annotation should be dist.GradBucket."):

        def comm_hook(state: object, bucket: int) -> torch.futures.Future[torch.Tensor]:
            return torch.futures.Future()

        model.register_comm_hook(state=None, hook=comm_hook)


def verify_ddp_error_logged(model_ddp: Any, err_substr: str) -> None:
    """torch/testing/_internal/common_distributed.py::verify_ddp_error_logged (that module
    imports ``expecttest``, which is not a dependency here)"""
    ddp_logging_data = model_ddp._get_ddp_logging_data()
    assert "iteration" in ddp_logging_data
    assert "has_error" in ddp_logging_data
    assert "error" in ddp_logging_data
    logging_err = ddp_logging_data["error"]
    # Remove C++ stacktrace if needed.
    actual = err_substr if err_substr.find("\nException raised from ") == -1 else \
        err_substr.split("\nException raised from ")[0]
    assert actual in logging_err, f"Did not find expected {actual} in ddp logging data error: {logging_err}"


@ported
def case_ddp_invalid_comm_hook_return_type(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ddp_invalid_comm_hook_return_type"""
    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=pg)

    expected_err = "Communication hook: return annotation should be torch.futures.Future"
    with pytest.raises(ValueError, match=expected_err):

        def comm_hook(state: object, bucket: dist.GradBucket) -> int:
            return torch.futures.Future()  # type: ignore[return-value]  # upstream's wrong annotation

        model.register_comm_hook(state=None, hook=comm_hook)

    verify_ddp_error_logged(model, expected_err)

    with pytest.raises(RuntimeError, match="callback must return a torch.futures.Future object, but got"):

        def comm_hook2(state: object, bucket: dist.GradBucket):  # type: ignore[no-untyped-def]  # upstream's
            return 1

        model.register_comm_hook(state=None, hook=comm_hook2)

        # Run forward
        output = model(8, rank)

        # Run backward
        output.mean().backward()


@ported
def case_ddp_comm_hook_register_just_once(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_gloo.py::DistributedDataParallelTest.test_ddp_comm_hook_register_just_once"""
    model = DistributedDataParallel(ModuleForDdpCommHook(), process_group=pg)

    def dummy_hook(state, bucket):  # type: ignore[no-untyped-def]  # upstream's: DDP checks annotations
        fut: torch.futures.Future[Any] = torch.futures.Future()
        fut.set_result([bucket.buffer()])
        return fut

    model.register_comm_hook(None, dummy_hook)

    with pytest.raises(RuntimeError,
                       match="register_comm_hook or register_builtin_comm_hook can only be called once."):
        model.register_comm_hook(None, dummy_hook)


# --- test_c10d_pypg.py ---------------------------------------------------------------------------------


@ported
def case_ddp_invoke_work_object(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_pypg.py::AbstractDDPSingleRank.test_ddp_invoke_work_object
    (every rank draws the same model and input, so DDP's averaged gradient is the local one;
    the ``wait_count`` / ``get_future_count`` checks count upstream's own ``MyWork`` calls and
    are left out)"""
    with _RNG:
        torch.manual_seed(123)
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        input_tensor = torch.rand(2)
    wrapped_model = model
    model = DistributedDataParallel(model, process_group=pg)
    model(input_tensor).sum().backward()

    ddp_grad = wrapped_model[0].bias.grad.clone()

    wrapped_model.zero_grad()
    wrapped_model(input_tensor).sum().backward()
    assert_equal(wrapped_model[0].bias.grad, ddp_grad)


@ported
def case_ddp_no_init_sync(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_pypg.py::AbstractDDPSingleRank.test_ddp_no_init_sync (upstream
    checks its group waited on no work; here each rank's own parameters, which the initial sync
    would have replaced by rank 0's, are still its own)"""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(rank + 1))
    model = DistributedDataParallel(model, process_group=pg, init_sync=False)

    for p in model.parameters():
        assert_equal(torch.full_like(p, float(rank + 1)), p.detach())


@ported
def case_batch_isend_irecv(pg: Any, rank: int, world: int) -> None:
    """test/distributed/test_c10d_pypg.py::TestBatchSendRecv.test_batch_isend_irecv (upstream's
    ``DummyProcessGroup`` adds 1 to what it sends and 2 to what it receives; a real send leaves
    its tensor alone and the receive gets the sender's; upstream sends to and receives from
    ``rank + 1``, which in a world of 3 nobody sends to: the port receives from ``rank - 1``, the
    same peer in a world of 2)"""
    dst, src = (rank + 1) % world, (rank - 1) % world
    send_tensor = torch.zeros(2, 2) + rank + 1
    recv_tensor = torch.zeros(2, 2)
    if default(pg):
        ops = [dist.P2POp(dist.isend, send_tensor, dst), dist.P2POp(dist.irecv, recv_tensor, src)]
    else:
        ops = [dist.P2POp(dist.isend, send_tensor, group=pg, group_peer=dst),
               dist.P2POp(dist.irecv, recv_tensor, group=pg, group_peer=src)]
    reqs = dist.batch_isend_irecv(ops)
    for req in reqs:
        req.wait()

    assert_equal(torch.zeros(2, 2) + rank + 1, send_tensor)
    assert_equal(torch.zeros(2, 2) + src + 1, recv_tensor)

    dist.barrier(**_kw(pg))


# --- running them -------------------------------------------------------------------------------------------


globals().update(thread_world_tests(CASES))


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py), with upstream's global ranks."""
    run_cases_in_processes("test_c10d_gloo_more", world_size, tmp_path / "store", list(CASES))
