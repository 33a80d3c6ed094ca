"""torch 2.13's own ``DistributedTest._DistTestBase`` tests of collectives, groups and model
averaging, ported to ``pccl.torch.ProcessGroup``.

Upstream: ``torch/testing/_internal/distributed/distributed_test.py`` as torch 2.13.0 ships it
(the copy in the installed torch 2.13.0 wheel), where
``DistributedTest._DistTestBase`` runs on every backend; the port treats ``BACKEND`` as
``"gloo"`` on the CPU, with "pccl" where a test names the backend.  Each ``case_*`` function is
one upstream test (or the ``_sum``/``_product``/``_min``/``_max`` family of one helper, run one
after the other), its docstring naming the upstream function, with the same inputs and
assertions on CPU tensors; upstream's helpers (``_test_*_helper``, ``_build_tensor``) are
copied with their CUDA branches left out.  ``case(pg, rank, world)`` takes the place of
``dist.get_rank()``, ``dist.get_world_size()`` and the default group: ``group_id`` is ``pg``
where upstream's is ``dist.group.WORLD``, ``group=pg`` is passed where upstream leaves the
group out and ``pg`` is not the default group, and upstream's ``self._barrier()`` (the test
harness's store barrier) is ``dist.barrier(group=pg)``.  ``_init_full_group_test``'s
``dist.new_group()`` is torch's own under init_process_group, and on a thread world (no
default group) the group that call makes: one more ``ProcessGroup`` over the communicator
with tags of its own.  Every case runs on worlds of 2 and 3 peers, in two ways (as
test_c10d_ported.py's): ``test_<case>[world]``, threads of this process each with a
``pccl.torch.ProcessGroup(comm)``; and ``test_under_init_process_group[world]``, processes whose
default group ``init_process_group("pccl")`` made (c10d_ported_peer.py runs every case in order
and reports each).  The ``DEFAULT_GROUP_ONLY`` cases (torch's ``new_group`` and
``new_subgroups`` need its default group) run the second way only.

Adaptations: ``_test_all_reduce_helper`` upstream asserts only on profiler events (for
backends in ``PROFILING_SUPPORTED_BACKENDS``, of which a Python group is none) and not on the
result; the port asserts the result against the expected value upstream passes.  Profiler
event checks of ``call_dist_op`` are not ported anywhere (torch's profiler records a C++
backend's work; a Python group's calls emit none).  The objects' ``Foo(torch.randn(3, 3))``
comes from a generator seeded alike at every rank (upstream's harness seeds each process;
the thread world's peers share torch's generator).  ``test_get_rank``'s shared directory is
made by rank 0 and broadcast (upstream: ``$TEMP_DIR``).  ``@require_exact_world_size(4)`` of
the ``gather_object`` tests is not kept (nothing in them depends on it).

Ported (74 upstream tests in 53 cases): ``test_get_rank``, ``test_get_backend`` (its
``new_group([0, 1])`` on a world of 2 under init_process_group; on a world of 3 its
``new_group([1, 2])`` raises ``InvalidUsage`` at once on ranks 1 and 2, which is checked, and
rank 0 checks upstream's non-member errors), ``test_Backend_enum_class``,
``test_destroy_group`` and ``test_get_rank_size_group`` (the same way), ``test_destroy_full_group``,
``test_get_rank_size_full_group``, ``test_new_subgroups`` (a world of 2; on a world of 3
torch's refusal of the size is checked), ``test_new_subgroups_group_size_exceeds_world_size``,
``test_new_subgroups_by_enumeration_negative_input_rank``, ``test_average_parameters`` (its
global half), ``test_periodic_model_averager``, ``test_periodic_model_averager_param_group``,
``test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager``,
``test_broadcast``, ``test_broadcast_full_group``, ``test_reduce_{sum,product,min,max}``,
``test_reduce_full_group_{sum,product,min,max}``, ``test_reduce_sum_twice``,
``test_all_reduce_{sum,product,min,max}``, ``test_all_reduce_sum_async``,
``test_all_reduce_sum_complex``, ``test_all_reduce_complex_unsupported_ops``, ``test_get_future``,
``test_all_reduce_full_group_{sum,product,min,max}``,
``test_all_reduce_coalesced_{sum,product,min,max}``,
``test_all_reduce_coalesced_full_group_{sum,product,min,max}``,
``test_all_reduce_coalesced_max_complex_unsupported``, ``test_scatter_checks``,
``test_scatter``, ``test_scatter_complex``, ``test_scatter_full_group``, ``test_gather_checks``,
``test_gather``, ``test_gather_full_group``, ``test_all_gather``, ``test_all_gather_complex``,
``test_all_gather_full_group``, ``test_all_gather_coalesced_full_group``,
``test_all_to_all_single_{equal,unequal}_split_full_group``, ``test_all_to_all_full_group``, ``test_barrier``, ``test_barrier_full_group``,
``test_all_gather_object_default_pg``, ``test_all_gather_object_subgroup``,
``test_gather_object``, ``test_gather_object_subgroup``, ``test_scatter_object_list``,
``test_DistributedSampler_padding``.

Ported in other files: the point-to-point and all-to-all tests (``test_send_recv``,
``test_send_recv_with_tag``, ``test_isend``, ``test_irecv``, ``test_batch_isend_irecv_gloo``,
``test_batch_isend_irecv_gloo_tags``, ``test_batch_isend_irecv_op_list_err``,
``test_all_to_all_single_{equal,unequal}_split`` and ``test_all_to_all``, each with its
``_complex`` twin; ``test_send_recv_any_source`` is refused there as pccl names every sender)
in test_c10d_ported_p2p.py; ``test_all_gather_coalesced_simple``, ``_complex`` and
``test_reduce_scatter_v_cuda`` (on CPU tensors) in test_c10d_ported.py;
``test_all_gather_coalesced_with_empty`` in test_ported_common_torchft.py.

Looked at, not applicable to a CPU pccl group, and why:

* GPUs (``*_cuda`` and ``*_nccl`` tests, ``@skip_if_no_gpu`` / NCCL only, with nothing left on
  the CPU): ``test_broadcast_cuda``, ``test_nccl_high_priority_stream``, ``test_reduce_sum_cuda``,
  ``test_reduce_sum_cuda_twice``, ``test_reduce_scatter_tensor_cuda``,
  ``test_all_reduce_sum_cuda``, ``test_all_reduce_sum_cuda_async``,
  ``test_all_reduce_sum_cuda_complex``, ``test_sparse_all_reduce_sum_cuda``,
  ``test_scatter_cuda``, ``test_scatter_cuda_complex``, ``test_gather_cuda``,
  ``test_all_gather_cuda``, ``test_all_gather_cuda_complex``, ``test_all_gather_v_cuda``,
  ``test_all_gather_into_cat_tensor_cuda``, ``test_all_gather_into_stack_tensor_cuda``, every
  ``test_all_to_all*_cuda*``, ``test_barrier_cuda``, ``test_barrier_group_cuda``,
  ``test_barrier_full_group_cuda``, ``test_nccl_backend_bool_{allreduce,allgather,reduce,broadcast}``,
  ``test_batch_isend_irecv_nccl``, ``_ring_exchange_nccl``, ``_self_nccl``,
  ``_no_rank_zero_nccl``, ``test_batch_isend_irecv_op_err`` and ``_mixed_backend_err`` (NCCL
  groups and GPU tensors), ``test_send_recv_nccl``, ``test_send_recv_nccl_autograd_profiler``,
  ``test_send_recv_nccl_torch_profiler``,
  ``test_coalescing_manager`` and ``_async`` (NCCL only upstream: torch's coalescing hooks,
  which pccl does not implement).
* Groups over a subset of the ranks (``_init_group_test``'s ``new_group([1, 2])``: a pccl group
  spans its whole peer group, ``InvalidUsage`` at once): ``test_broadcast_group``,
  ``test_reduce_group_{sum,product,min,max}``, ``test_all_reduce_group_{sum,product,min,max}``,
  ``test_all_reduce_coalesced_group_{sum,product,min,max}``, ``test_scatter_group``,
  ``test_gather_group``, ``test_all_gather_group``, ``test_all_gather_coalesced_group``,
  ``test_barrier_group``, ``test_all_to_all_single_equal_split_group``,
  ``test_all_to_all_single_unequal_split_group``, ``test_all_to_all_group``;
  ``test_new_subgroups_with_group_param``, ``_world_size_not_divisible_by_group_size``,
  ``test_new_subgroups_by_enumeration``, ``_input_rank_exceeds_world_size``,
  ``test_new_subgroups_overlap_not_allowed`` (worlds of 4 and GPUs; subsets of the ranks);
  ``test_3_level_hierarchical_model_averager`` (a world of 4, subgroups of 2);
  ``test_average_parameters``' partial half (an NCCL ``new_group([0, 1])``);
  ``test_SyncBatchNorm_process_group`` (``new_group([0])``, and torchvision's resnet50, not
  installed: it checks torch's ``convert_sync_batchnorm`` hands the group down, no collective).
* ``monitored_barrier`` (torch raises "monitored_barrier is only implemented for GLOO backend"
  for any other backend): ``test_monitored_barrier_gloo``, ``_gloo_subgroup``,
  ``_allreduce_hang``, ``_allreduce_hang_wait_all_ranks``, ``_gloo_rank_0_timeout``,
  ``_failure_order``, ``_wait_all_ranks``.
* Sparse tensors (pccl refuses them with ``InvalidArgument``; test_c10d_ported.py's
  ``case_sparse_allreduce_checks``): ``test_sparse_all_reduce_sum``.
* Profiler variants (torch's profiler events of a C++ backend's work, see above):
  ``test_send_recv_autograd_profiler``, ``test_send_recv_torch_profiler``,
  ``test_send_recv_any_source_autograd_profiler``, ``test_send_recv_any_source_torch_profiler``,
  ``test_send_recv_with_tag_autograd_profiler``, ``test_send_recv_with_tag_torch_profiler``,
  ``test_isend_autograd_profiler``, ``test_isend_torch_profiler``; and
  ``test_send_recv_any_source`` (a pccl receive names its sender).
* Skipped upstream on every backend: ``test_broadcast_object_list`` (``@unittest.skip``,
  pytorch#113620; its ``_test_broadcast_object_list_subgroup`` is not a test);
  ``test_barrier_timeout_arg`` (skipped on Linux, pytorch#179691).
* ``test_barrier_timeout_global``, ``_group`` and ``_full_group``: ported in
  test_distributed_test_timeouts.py.
* DistributedDataParallel under other names than ``test_DistributedDataParallel*`` and
  ``test_ddp_*``: left to the DDP port (another file).  Most need GPUs upstream
  (``@skip_if_lt_x_gpu``); the ones that run DDP on CPU modules under gloo are ported in
  test_distributed_test_ddp.py (``test_grads_same_across_ranks_with_no_sync``, the four
  ``test_accumulate_gradients_no_sync*``, ``test_static_graph_api_cpu``).  The list:
  ``test_dump_DDP_relevant_env_vars`` (torch's env logging, no backend),
  ``test_get_data_parallel_params``,
  ``test_post_localSGD_optimizer_parity``, ``test_post_localSGD_optimizer_parity_grad_is_view``,
  ``test_post_localSGD_optimizer_parity_with_hierarchical_sgd``,
  ``test_post_localSGD_optimizer_parity_with_hierarchical_sgd_grad_is_view`` and
  ``test_post_localSGD_optimizer_step_reload`` (DDP with post-localSGD hooks on GPUs),
  ``test_invalid_static_graph``, ``test_compute_bucket_assignment_by_size_sparse_error_*``,
  ``test_verify_model_across_rank_*``, ``test_output_unused_in_loss_{tuple,dict}_module``,
  ``test_undefined_grad_parity_unused_parameters``, ``test_different_graph_across_ranks``,
  ``test_detect_ddp_is_actually_static``, ``test_static_graph_multi_forward``,
  ``test_sync_bn_logged``, ``test_stateless_api_with_ddp``,
  ``test_skip_all_reduce_unused_parameters``.
"""

from __future__ import annotations

import copy
import math
import operator
import os
import pathlib
import re
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from functools import reduce
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.distributed.algorithms.model_averaging.averagers as averagers  # noqa: E402
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as hierarchicalSGD  # noqa: E402,N812
import torch.distributed.algorithms.model_averaging.utils as model_averaging_utils  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

import pccl  # noqa: E402
import pccl.torch  # noqa: E402
from pccl_torch_world import WORLDS, run_cases_in_processes, thread_world_tests, world, case_table, assert_equal, default  # noqa: E402,F401

# torch 2.13 calls all_reduce_coalesced deprecated
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


#: name -> case, in the order they are defined (the peer processes run them in this order).
CASES, ported = case_table()


#: the cases that need torch's default group (``new_group``, ``new_subgroups``): they run under
#: init_process_group only.
DEFAULT_GROUP_ONLY: set[str] = set()


def default_group_only(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
    DEFAULT_GROUP_ONLY.add(fn.__name__.removeprefix("case_"))
    return ported(fn)


# --- upstream's module-level helpers and _DistTestBase's group set-ups ---------------------------------


def _build_tensor(size: int, value: Any = None, dtype: Any = None) -> Any:
    """distributed_test.py::_build_tensor (CPU)."""
    if value is None:
        value = size
    return torch.empty(size, size, size, dtype=dtype or torch.float).fill_(value)


def _barrier(pg: Any) -> None:
    """Upstream's ``self._barrier()`` (a store barrier of the test harness): the group's barrier."""
    dist.barrier(group=pg)


def _init_global_test(pg: Any) -> tuple[list[int], Any, int]:
    """_DistTestBase._init_global_test: every rank, the default group (``pg``)."""
    return list(range(pg.size())), pg, pg.rank()


class _FullGroup:
    """_DistTestBase._init_full_group_test: ``dist.new_group()`` over every rank.  Under
    init_process_group that is torch's own ``new_group`` (pccl's backend makes a group over
    the same communicator); on a thread world, where torch has no default group, the group
    that ``new_group`` would make: one more ``pccl.torch.ProcessGroup`` over ``pg``'s
    communicator with tags of its own (shut down on leaving)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.made: Any = None

    def __enter__(self) -> tuple[list[int], Any, int]:
        if default(self.pg):
            group_id = dist.new_group()
        else:
            group_id = self.made = pccl.torch.ProcessGroup(
                self.pg.communicator, first_tag=self.pg.next_shared_first_tag(), ranks=self.pg.given_ranks)
        return list(range(self.pg.size())), group_id, self.pg.rank()

    def __exit__(self, *exc: object) -> None:
        if self.made is not None:
            self.made.shutdown()


def _assert_greater_almost_equal(first: float, second: float, msg: str) -> None:
    """torch's ``TestCase.assertGreaterAlmostEqual`` with its default 7 places."""
    assert first >= second or round(second - first, 7) == 0, msg


# --- broadcast -------------------------------------------------------------------------------------------


def _test_broadcast_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_broadcast_helper on CPU tensors (its half entry is CUDA-only)."""
    for dtype, value, requires_cuda in [
        (torch.float, -1e-10, False),
        (torch.double, -1e-100, False),
        (torch.half, -0.1, True),
        (torch.int8, -2, False),
        (torch.uint8, 129, False),
        (torch.int, -1e5, False),
        (torch.long, -1e15, False),
    ]:
        if requires_cuda:
            continue
        for src in group:
            expected_tensor = _build_tensor(src + 1, value, dtype)
            if rank == src:
                dist.broadcast(expected_tensor, src, group_id)
            else:
                tensor = _build_tensor(src + 1, -1, dtype)
                dist.broadcast(tensor, src, group_id)
                assert tensor.size() == expected_tensor.size()
                assert_equal(torch.tensor(False), tensor.ne(expected_tensor).max())
    _barrier(pg)


@ported
def case_broadcast(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_broadcast"""
    group, group_id, rank = _init_global_test(pg)
    _test_broadcast_helper(pg, group, group_id, rank)


@ported
def case_broadcast_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_broadcast_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_broadcast_helper(pg, group, group_id, rank)


# --- reduce --------------------------------------------------------------------------------------------


def _test_reduce_helper(pg: Any, group: list[int], group_id: Any, rank: int, op: Any, master_value: Any,
                        worker_value: Any, expected_value: Any) -> None:
    """_DistTestBase._test_reduce_helper (CPU)."""
    for src in group:
        tensor = _build_tensor(src + 1).fill_(master_value if rank == src else worker_value)
        dist.reduce(tensor, src, op, group_id)
        if rank == src:
            assert_equal(_build_tensor(src + 1, expected_value), tensor)
    _barrier(pg)


def _test_reduce_twice_helper(pg: Any, group: list[int], group_id: Any, rank: int, op: Any,
                              master_value: Any, worker_value: Any, expected_value: Any) -> None:
    """_DistTestBase._test_reduce_twice_helper (CPU; upstream's ``secondary_op_call``: the
    second reduce right after the first)."""
    for src in group:
        tensors = [_build_tensor(src + 1).fill_(master_value if rank == src else worker_value) for i in range(2)]
        dist.reduce(tensors[0], src, op, group_id)
        dist.reduce(tensors[1], src, op, group_id)
        if rank == src:
            for tensor in tensors:
                assert_equal(_build_tensor(src + 1, expected_value), tensor)
    _barrier(pg)


def _reduce_rows(n: int) -> list[tuple[str, Any, Any, Any, Any]]:
    """The arguments test_reduce_sum, _product, _min and _max pass (for ``len(group) == n``)."""
    return [("sum", dist.ReduceOp.SUM, 2, 10, 2 + (10 * (n - 1))),
            ("product", dist.ReduceOp.PRODUCT, 2, 10, reduce(operator.mul, [10] * (n - 1), 2)),
            ("min", dist.ReduceOp.MIN, 1010, 1, 1),
            ("max", dist.ReduceOp.MAX, -1, 10, 10)]


@ported
def case_reduce(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_reduce_sum,
    test_reduce_product, test_reduce_min and test_reduce_max (one after the other)"""
    group, group_id, rank = _init_global_test(pg)
    for _, op, master, worker, expected in _reduce_rows(len(group)):
        _test_reduce_helper(pg, group, group_id, rank, op, master, worker, expected)


@ported
def case_reduce_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_reduce_full_group_sum,
    _product, _min and _max"""
    with _FullGroup(pg) as (group, group_id, rank):
        for _, op, master, worker, expected in _reduce_rows(len(group)):
            _test_reduce_helper(pg, group, group_id, rank, op, master, worker, expected)


@ported
def case_reduce_sum_twice(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_reduce_sum_twice"""
    group, group_id, rank = _init_global_test(pg)
    _test_reduce_twice_helper(pg, group, group_id, rank, dist.ReduceOp.SUM, 2, 10, 2 + (10 * (len(group) - 1)))


# --- all_reduce -------------------------------------------------------------------------------------------


def _test_all_reduce_helper(pg: Any, group: list[int], group_id: Any, rank: int, op: Any, master_value: Any,
                            worker_value: Any, expected_value: Any, dtype: Any = None,
                            async_op: bool = False) -> None:
    """_DistTestBase._test_all_reduce_helper (CPU).  Upstream checks only the profiler's events
    (for backends in PROFILING_SUPPORTED_BACKENDS) and not the result; the port checks the
    result against ``expected_value``, which the upstream tests pass."""
    dtype = dtype or torch.float
    for src in group:
        curr_value = master_value if rank == src else worker_value
        tensor = _build_tensor(src + 1, dtype=dtype).fill_(curr_value)
        work = dist.all_reduce(tensor, op, group_id, async_op=async_op)
        if async_op:
            work.wait()
        assert_equal(_build_tensor(src + 1, dtype=dtype).fill_(expected_value), tensor)
    _barrier(pg)


@ported
def case_all_reduce(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_sum,
    test_all_reduce_product, test_all_reduce_min and test_all_reduce_max"""
    group, group_id, rank = _init_global_test(pg)
    for _, op, master, worker, expected in _reduce_rows(len(group)):
        _test_all_reduce_helper(pg, group, group_id, rank, op, master, worker, expected)


@ported
def case_all_reduce_sum_async(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_sum_async"""
    group, group_id, rank = _init_global_test(pg)
    _test_all_reduce_helper(pg, group, group_id, rank, dist.ReduceOp.SUM, 2, 10, 2 + (10 * (len(group) - 1)),
                            async_op=True)


@ported
def case_all_reduce_sum_complex(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_sum_complex"""
    group, group_id, rank = _init_global_test(pg)
    _test_all_reduce_helper(pg, group, group_id, rank, dist.ReduceOp.SUM, complex(2, 3), complex(10, 11),
                            complex(2, 3) + (complex(10, 11) * (len(group) - 1)), dtype=torch.cfloat)


@ported
def case_all_reduce_complex_unsupported_ops(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_complex_unsupported_ops
    (torch's own check, before the backend)"""
    unsupported_ops = [dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND,
                       dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    _group, group_id, _rank = _init_global_test(pg)
    for unsupported_op in unsupported_ops:
        with pytest.raises(ValueError, match="all_reduce does not support"):
            dist.all_reduce(_build_tensor(1, dtype=torch.cfloat), unsupported_op, group_id)


@ported
def case_all_reduce_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_full_group_sum,
    _product, _min and _max"""
    with _FullGroup(pg) as (group, group_id, rank):
        for _, op, master, worker, expected in _reduce_rows(len(group)):
            _test_all_reduce_helper(pg, group, group_id, rank, op, master, worker, expected)


@ported
def case_get_future(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_get_future
    (the group's ``allreduce`` future, chained with ``then``)"""
    def mult(fut: Any) -> Any:
        return [t * 3 for t in fut.wait()]

    def add(fut: Any) -> Any:
        return [t + 1 for t in fut.wait()]

    group, group_id, rank = _init_global_test(pg)
    input = _build_tensor(3, 2)  # noqa: A001 - upstream's name
    fut = group_id.allreduce([input]).get_future()
    res = fut.then(mult).then(add).wait()
    expected = _build_tensor(3, 2 * len(group) * 3 + 1)
    assert_equal(expected, res[0])


# --- all_reduce_coalesced ------------------------------------------------------------------------------------


def _all_reduce_coalesced_cases(op: Any, group_size: int) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """_DistTestBase._all_reduce_coalesced_{sum,product,min,max}_test_cases."""
    return {
        dist.ReduceOp.SUM: ([2, 3, complex(2, 3)], [10, 11, complex(10, 11)],
                            [2 + 10 * (group_size - 1), 3 + 11 * (group_size - 1),
                             complex(2, 3) + complex(10, 11) * (group_size - 1)],
                            [torch.float, torch.float, torch.cfloat]),
        dist.ReduceOp.PRODUCT: ([1, 2], [3, 4], [1 * 3 ** (group_size - 1), 2 * 4 ** (group_size - 1)],
                                [torch.float, torch.float]),
        dist.ReduceOp.MIN: ([1, 4], [2, 3], [1, 3], [torch.float, torch.float]),
        dist.ReduceOp.MAX: ([1, 4], [2, 3], [2, 4], [torch.float, torch.float]),
    }[op]


def _test_all_reduce_coalesced_helper(pg: Any, group: list[int], group_id: Any, rank: int, op: Any) -> None:
    """_DistTestBase._test_all_reduce_coalesced_helper (CPU)."""
    master_values, worker_values, expected_values, dtypes = _all_reduce_coalesced_cases(op, len(group))
    for src in group:
        curr_values = master_values if rank == src else worker_values
        tensors = [_build_tensor(src + 1, val, dtype=dtype) for dtype, val in zip(dtypes, curr_values, strict=True)]
        dist.all_reduce_coalesced(tensors, op, group_id)
        expected_tensors = [_build_tensor(src + 1, expected_value, dtype=dtype)
                            for dtype, expected_value in zip(dtypes, expected_values, strict=True)]
        assert_equal(expected_tensors, tensors)
    _barrier(pg)


_COALESCED_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN, dist.ReduceOp.MAX)


@ported
def case_all_reduce_coalesced(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_coalesced_sum,
    _product, _min and _max"""
    group, group_id, rank = _init_global_test(pg)
    for op in _COALESCED_OPS:
        _test_all_reduce_coalesced_helper(pg, group, group_id, rank, op)


@ported
def case_all_reduce_coalesced_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_coalesced_full_group_sum,
    _product, _min and _max"""
    with _FullGroup(pg) as (group, group_id, rank):
        for op in _COALESCED_OPS:
            _test_all_reduce_coalesced_helper(pg, group, group_id, rank, op)


@ported
def case_all_reduce_coalesced_max_complex_unsupported(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_reduce_coalesced_max_complex_unsupported"""
    _group, group_id, _rank = _init_global_test(pg)
    with pytest.raises(ValueError, match="all_reduce does not support"):
        dist.all_reduce_coalesced([_build_tensor(1, dtype=torch.cfloat)], dist.ReduceOp.MAX, group_id)


# --- scatter, gather, all_gather ------------------------------------------------------------------------------


def _test_scatter_helper(pg: Any, group: list[int], group_id: Any, rank: int, dtype: Any = None) -> None:
    """_DistTestBase._test_scatter_helper (CPU)."""
    dtype = dtype or torch.float
    for dest in group:
        tensor = _build_tensor(dest + 1, -1, dtype=dtype)
        expected_tensor = _build_tensor(dest + 1, rank, dtype=dtype)
        tensors = [_build_tensor(dest + 1, i, dtype=dtype) for i in group] if rank == dest else []
        dist.scatter(tensor, src=dest, scatter_list=tensors, group=group_id)
        assert_equal(expected_tensor, tensor)
    _barrier(pg)


@ported
def case_scatter_checks(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_scatter_checks
    (upstream's default group: ``group=pg`` where it is not the default one)"""
    group, _group_id, rank = _init_global_test(pg)
    g = {} if default(pg) else {"group": pg}
    one = torch.ones([1])

    # Specify scatter_list argument only on source rank.
    output = one.clone() * -1
    if rank == 0:
        scatter_list = [one.clone() * i for i in group]
        dist.scatter(output, src=0, scatter_list=scatter_list, **g)
    else:
        dist.scatter(output, src=0, **g)
    assert_equal(one * rank, output)

    # Don't specify src argument.
    output = one.clone() * -1
    if rank == 0:
        scatter_list = [one.clone() * i for i in group]
        dist.scatter(output, scatter_list=scatter_list, **g)
    else:
        dist.scatter(output, **g)
    assert_equal(one * rank, output)


@ported
def case_scatter(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_scatter"""
    group, group_id, rank = _init_global_test(pg)
    _test_scatter_helper(pg, group, group_id, rank)


@ported
def case_scatter_complex(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_scatter_complex"""
    group, group_id, rank = _init_global_test(pg)
    _test_scatter_helper(pg, group, group_id, rank, dtype=torch.cfloat)


@ported
def case_scatter_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_scatter_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_scatter_helper(pg, group, group_id, rank)


def _test_gather_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_gather_helper (CPU)."""
    for dest in group:
        tensor = _build_tensor(dest + 1, rank)
        tensors = [_build_tensor(dest + 1, -1) for i in group] if rank == dest else []
        dist.gather(tensor, dst=dest, gather_list=tensors, group=group_id)
        if rank == dest:
            expected_tensors = [_build_tensor(dest + 1, i) for i in group]
            for t1, t2 in zip(tensors, expected_tensors, strict=True):
                assert_equal(t2, t1)
    _barrier(pg)


@ported
def case_gather_checks(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_gather_checks
    (upstream's default group: ``group=pg`` where it is not the default one)"""
    group, _group_id, rank = _init_global_test(pg)
    g = {} if default(pg) else {"group": pg}
    one = torch.ones([1])

    # Specify gather_list argument only on destination rank.
    if rank == 0:
        gather_list = [one.clone() for _ in group]
        dist.gather(one * rank, dst=0, gather_list=gather_list, **g)
        for i in group:
            assert_equal(one * i, gather_list[i])
    else:
        dist.gather(one * rank, dst=0, **g)

    # Don't specify dst argument.
    if rank == 0:
        gather_list = [one.clone() for _ in group]
        dist.gather(one * rank, gather_list=gather_list, **g)
        for i in group:
            assert_equal(one * i, gather_list[i])
    else:
        dist.gather(one * rank, **g)


@ported
def case_gather(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_gather"""
    group, group_id, rank = _init_global_test(pg)
    _test_gather_helper(pg, group, group_id, rank)


@ported
def case_gather_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_gather_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_gather_helper(pg, group, group_id, rank)


def _test_all_gather_helper(pg: Any, group: list[int], group_id: Any, rank: int, dtype: Any = None) -> None:
    """_DistTestBase._test_all_gather_helper (CPU)."""
    dtype = dtype or torch.float
    for dest in group:
        tensor = _build_tensor(dest + 1, rank, dtype=dtype)
        tensors = [_build_tensor(dest + 1, -1, dtype=dtype) for i in group]
        dist.all_gather(tensors, tensor, group_id, False)
        expected_tensors = [_build_tensor(dest + 1, i, dtype=dtype) for i in group]
        for t1, t2 in zip(tensors, expected_tensors, strict=True):
            assert_equal(t2, t1)
    _barrier(pg)


@ported
def case_all_gather(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather"""
    group, group_id, rank = _init_global_test(pg)
    _test_all_gather_helper(pg, group, group_id, rank)


@ported
def case_all_gather_complex(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather_complex"""
    group, group_id, rank = _init_global_test(pg)
    _test_all_gather_helper(pg, group, group_id, rank, dtype=torch.cfloat)


@ported
def case_all_gather_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_all_gather_helper(pg, group, group_id, rank)


def _build_multidim_tensor(dim: int, dim_size: int, value: Any = None, dtype: Any = None) -> Any:
    """distributed_test.py::_build_multidim_tensor."""
    if value is None:
        value = dim
    return torch.empty(size=[dim_size for _ in range(dim)], dtype=dtype or torch.float).fill_(value)


def _test_all_gather_coalesced_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_all_gather_coalesced_helper with _run_all_gather_coalesced_and_verify."""
    for test_case_id in range(2, 5):
        # Make sure we create tensors of incompatible sizes, e.g.
        # [1], [2x2], [3x3x3] ... to be sent in one batch
        input_tensors = [_build_multidim_tensor(tensor_id, tensor_id, rank + tensor_id)
                         for tensor_id in range(1, test_case_id)]
        output_tensor_lists = [[_build_multidim_tensor(tensor_id, tensor_id, -1)
                                for tensor_id in range(1, test_case_id)] for _ in group]
        expected_tensors = [[_build_multidim_tensor(tensor_id, tensor_id, rank_iter + tensor_id)
                             for tensor_id in range(1, test_case_id)] for rank_iter in group]
        dist.all_gather_coalesced(output_tensor_lists, input_tensors, group_id)
        for l1, l2 in zip(output_tensor_lists, expected_tensors, strict=True):
            for t1, t2 in zip(l1, l2, strict=True):
                assert torch.equal(t1, t2), "output tensors do not match expected outputs"
    _barrier(pg)


@ported
def case_all_gather_coalesced_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather_coalesced_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_all_gather_coalesced_helper(pg, group, group_id, rank)


# --- all_to_all over a new_group of every rank (the plain cases: test_c10d_ported_p2p.py) ------------------


def _test_all_to_all_single_equal_split_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_all_to_all_single_equal_split_helper (CPU)."""
    size = len(group)
    in_tensor = torch.ones([size, size]) * rank
    expected_tensor = torch.cat([torch.ones([1, size]) * i for i in group])
    out_tensor = torch.ones([size, size]) * -1
    dist.all_to_all_single(out_tensor, in_tensor, group=group_id)
    assert_equal(expected_tensor, out_tensor)
    _barrier(pg)


def _test_all_to_all_single_unequal_split_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_all_to_all_single_unequal_split_helper (CPU)."""
    size = len(group)
    in_splits = [i + 1 for i in group]
    out_splits = [rank + 1 for _ in group]
    in_tensor = torch.ones([sum(in_splits), size]) * rank
    out_tensor = torch.ones([(rank + 1) * size, size])
    expected_tensor = torch.cat([torch.ones([rank + 1, size]) * i for i in group])
    dist.all_to_all_single(out_tensor, in_tensor, out_splits, in_splits, group=group_id)
    assert_equal(expected_tensor, out_tensor)
    _barrier(pg)


def _test_all_to_all_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_all_to_all_helper (CPU)."""
    size = len(group)
    in_splits = [i + 1 for i in group]
    in_tensors = [torch.ones([in_splits[i], size]) * rank for i, _ in enumerate(group)]
    out_tensors = [torch.ones([(rank + 1), size]) for _ in group]
    expected_tensors = [torch.ones([rank + 1, size]) * i for i in group]
    dist.all_to_all(out_tensors, in_tensors, group=group_id)
    for t1, t2 in zip(out_tensors, expected_tensors, strict=True):
        assert_equal(t2, t1)
    _barrier(pg)


@ported
def case_all_to_all_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_to_all_single_equal_split_full_group,
    test_all_to_all_single_unequal_split_full_group and test_all_to_all_full_group (MPI only
    upstream, where gloo skips them; pccl runs all-to-all on the CPU)"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_all_to_all_single_equal_split_helper(pg, group, group_id, rank)
        _test_all_to_all_single_unequal_split_helper(pg, group, group_id, rank)
        _test_all_to_all_helper(pg, group, group_id, rank)


# --- barrier -----------------------------------------------------------------------------------------------


def _test_barrier_helper(pg: Any, group: list[int], group_id: Any, rank: int) -> None:
    """_DistTestBase._test_barrier_helper (CPU): no rank leaves the barrier before the rank
    that sleeps first reaches it (an order of events, not a speed)."""
    wait_time = 0.3  # seconds
    for dest in group:
        expected_time = torch.DoubleTensor(1).fill_(0.0)
        if dest == rank:
            expected_time.fill_(time.time() + wait_time)
            dist.broadcast(expected_time, dest, group_id)
            time.sleep(wait_time + 0.1)  # sleep a little bit longer
            dist.barrier(group_id)
        else:
            dist.broadcast(expected_time, dest, group_id)
            dist.barrier(group_id)
            _assert_greater_almost_equal(float(time.time()), float(expected_time[0]),
                                         msg=f"destination rank: {dest:d}, my rank: {rank:d}")
    _barrier(pg)


@ported
def case_barrier(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_barrier"""
    group, group_id, rank = _init_global_test(pg)
    _test_barrier_helper(pg, group, group_id, rank)


@ported
def case_barrier_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_barrier_full_group"""
    with _FullGroup(pg) as (group, group_id, rank):
        _test_barrier_helper(pg, group, group_id, rank)


# --- ranks, backend and groups ---------------------------------------------------------------------------


@ported
def case_get_rank(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_get_rank (each
    rank writes its rank to a file of a shared directory, and every rank reads them all back:
    ``world`` distinct ranks.  Upstream names the directory by ``$TEMP_DIR`` and the files by
    process id; here rank 0 names a fresh directory and broadcasts it, and the files are named
    by process and thread, the thread world's peers sharing a process)"""
    g = {} if default(pg) else {"group": pg}
    holder = [tempfile.mkdtemp(prefix="pccl-get-rank-") if rank == 0 else None]
    dist.broadcast_object_list(holder, src=0, **g)
    test_dir = str(holder[0])
    num_processes = dist.get_world_size(**g)
    with open(os.path.join(test_dir, f"{os.getpid()}-{threading.get_ident()}"), "w") as f:
        f.write(str(dist.get_rank() if default(pg) else pg.rank()))

    _barrier(pg)

    all_ranks = set()
    for f_name in os.listdir(test_dir):
        with open(os.path.join(test_dir, f_name)) as f:
            all_ranks.add(int(f.read()))
    assert len(all_ranks) == num_processes

    _barrier(pg)

    if rank == 0:
        for f_name in os.listdir(test_dir):
            os.unlink(os.path.join(test_dir, f_name))
        os.rmdir(test_dir)

    _barrier(pg)


@ported
def case_get_backend(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_get_backend
    ("pccl" for upstream's ``BACKEND``).  Upstream's ``new_group([0, 1])`` on a world of 2 is
    every rank; on a world of 3 its ``new_group([1, 2])`` is a subset of the ranks, which a
    pccl group cannot be: ``InvalidUsage`` at once on ranks 1 and 2 (:func:`_subset_group`),
    while rank 0, not a member, checks upstream's ``ValueError``.  On a thread world (no
    default group, and torch's ``get_backend`` reads only the map of groups
    ``init_process_group`` and ``new_group`` made) the check is on ``pg``'s backend name"""
    backend_str = "pccl"
    if not default(pg):
        assert pg.name() == backend_str
        return
    group = [1, 2] if world > 2 else [0, 1]
    group_id = _subset_group(group, rank, world)
    assert dist.get_backend() == backend_str
    if rank in group:
        if group_id is not None:
            assert dist.get_backend(group_id) == backend_str
            dist.destroy_process_group(group_id)
    else:
        with pytest.raises(ValueError, match="Invalid process group specified"):
            dist.get_backend(group_id)


def _subset_group(group: list[int], rank: int, world: int) -> Any:
    """Upstream's ``dist.new_group(group)`` for ``group`` ``[0, 1]`` on a world of 2 (every
    rank: the group) or ``[1, 2]`` on a larger one: a pccl group spans its whole peer group, so
    there its members get ``InvalidUsage`` at once (checked here; ``None``), and the others
    torch's ``NON_GROUP_MEMBER``."""
    if len(group) < world and rank in group:
        started = time.monotonic()
        with pytest.raises(pccl.InvalidUsage, match="spans its whole peer group"):
            dist.new_group(group)
        assert time.monotonic() - started < 30, "InvalidUsage came only after a timeout"
        return None
    group_id = dist.new_group(group)
    assert (rank in group) == (group_id is not dist.GroupMember.NON_GROUP_MEMBER)
    return group_id


@ported
def case_Backend_enum_class(pg: Any, rank: int, world: int) -> None:  # noqa: N802 - upstream's name
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_Backend_enum_class
    ("PCCL"/"pccl" for upstream's ``BACKEND``)"""
    backend = "pccl"
    assert dist.Backend("PCCL") == backend
    assert dist.Backend("pccl") == backend
    with pytest.raises(ValueError):
        dist.Backend(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        dist.Backend(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        dist.Backend(["gloo"])  # type: ignore[arg-type]


@ported
def case_destroy_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_destroy_full_group
    (on a thread world, where torch has no default group, the group's own ``shutdown``), then
    the default group still runs"""
    full = _FullGroup(pg)
    _, group_id, _ = full.__enter__()
    _barrier(pg)
    if default(pg):
        dist.destroy_process_group(group_id)
    else:
        full.__exit__()
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    assert_equal(torch.full((1,), float(world)), t)


@ported
def case_get_rank_size_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_get_rank_size_full_group
    (without a default group, the thread world compares with ``pg``'s rank and size)"""
    with _FullGroup(pg) as (_, group_id, _):
        if default(pg):
            assert dist.get_world_size(group_id) == dist.get_world_size()
            assert dist.get_rank(group_id) == dist.get_rank()
        else:
            assert dist.get_world_size(group_id) == dist.get_world_size(pg)
            assert group_id.rank() == pg.rank()


@default_group_only
def case_destroy_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_destroy_group
    (upstream's ``new_group([0, 1])`` on a world of 2; on a world of 3 its ``[1, 2]`` raises
    ``InvalidUsage`` at once on its members, :func:`_subset_group`, and the others destroy
    their ``NON_GROUP_MEMBER`` as upstream does)"""
    group = [1, 2] if world > 2 else [0, 1]
    group_id = _subset_group(group, rank, world)
    _barrier(pg)
    if group_id is not None:
        dist.destroy_process_group(group_id)


@default_group_only
def case_get_rank_size_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_get_rank_size_group
    (on a world of 3, as case_destroy_group: ``InvalidUsage`` on ranks 1 and 2; rank 0, not a
    member, checks upstream's -1 rank and size)"""
    group = [1, 2] if world > 2 else [0, 1]
    group_id = _subset_group(group, rank, world)
    if rank in group:
        if group_id is not None:
            assert dist.get_world_size(group_id) == 2
            assert dist.get_rank(group_id) in list(range(2))
    else:
        assert dist.get_world_size(group_id) == -1
        assert dist.get_rank(group_id) == -1
    if group_id is not None and rank in group:
        dist.destroy_process_group(group_id)


@default_group_only
def case_new_subgroups(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_new_subgroups
    (subgroups of 2 ranks: on a world of 2, one subgroup of every rank.  Upstream requires a
    world of 4 and is skipped on Linux, pytorch#164195.  On a world of 3 torch refuses the
    size before any backend runs — the check of upstream's
    ``test_new_subgroups_world_size_not_divisible_by_group_size`` — which is what is checked
    there)"""
    subgroup_size = 2
    if world % subgroup_size:
        with pytest.raises(ValueError, match=re.escape(f"The world size ({world}) must be divisible by "
                                                       f"'group_size={subgroup_size}'")):
            dist.new_subgroups(subgroup_size)
        return
    cur_subgroup, subgroups = dist.new_subgroups(subgroup_size)
    world_size = dist.get_world_size()
    assert cur_subgroup.size() == subgroup_size
    assert len(subgroups) == world_size / subgroup_size
    assert not dist._rank_not_in_group(cur_subgroup)
    for subgroup in subgroups:
        dist.destroy_process_group(subgroup)


@default_group_only
def case_new_subgroups_group_size_exceeds_world_size(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_new_subgroups_group_size_exceeds_world_size
    (torch's check, before any backend; upstream skips it without a GPU)"""
    with pytest.raises(ValueError, match="must not exceed"):
        dist.new_subgroups(100)


@default_group_only
def case_new_subgroups_by_enumeration_negative_input_rank(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_new_subgroups_by_enumeration_negative_input_rank
    (torch's check, before any backend; upstream skips it without a GPU)"""
    with pytest.raises(ValueError, match=r"Rank -\d+ is out of range"):
        dist.new_subgroups_by_enumeration(ranks_per_subgroup_list=[[-1, -2], [-3, -4]])


# --- objects ----------------------------------------------------------------------------------------------


class Foo:
    """distributed_test.py::Foo."""

    def __init__(self, x: Any) -> None:
        # Can be tensor or int
        self.x = x

    def __eq__(self, other: object) -> bool:
        def eq(value: Any, other: Any) -> bool:
            if isinstance(value, torch.Tensor):
                return bool(torch.equal(value, other))
            return bool(value == other)

        for attr, value in self.__dict__.items():
            other_value = other.__dict__[attr]
            if not eq(value, other_value):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]


f = Foo(10)
f.bar = 1  # type: ignore[attr-defined]


def create_collectives_object_test_list() -> list[Any]:
    """distributed_test.py::create_collectives_object_test_list.  Upstream's harness seeds every
    process alike before the ``randn``; the thread world's peers share torch's generator, so
    the tensor comes from a generator of its own, seeded alike at every rank."""
    return [
        {"key1": 3, "key2": 4, "key3": {"nested": True}},
        f,
        Foo(torch.randn(3, 3, generator=torch.Generator().manual_seed(0))),
        "foo",
        [1, 2, True, "string", [4, 5, "nested"]],
    ]


def _test_allgather_object(rank: int, world: int, subgroup: Any) -> None:
    """_DistTestBase._test_allgather_object (gloo)."""
    gather_objects = create_collectives_object_test_list()
    output_gathered = [None for _ in range(world)]
    dist.all_gather_object(output_gathered, gather_objects[rank % len(gather_objects)], group=subgroup)
    for i, val in enumerate(output_gathered):
        expected = gather_objects[i % len(gather_objects)]
        assert val == expected


@ported
def case_all_gather_object_default_pg(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather_object_default_pg
    (``group=pg``: ``None`` upstream; upstream runs it at debug levels OFF, INFO and DETAIL,
    which only torch's C++ groups' wrappers read)"""
    _test_allgather_object(rank, world, None if default(pg) else pg)


@ported
def case_all_gather_object_subgroup(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_all_gather_object_subgroup
    (``new_group(backend=...)`` over every rank)"""
    with _FullGroup(pg) as (_, subgroup, _):
        _test_allgather_object(rank, world, subgroup)


def _test_gather_object(pg: Any, rank: int, world: int, group: Any) -> None:
    """_DistTestBase._test_gather_object (gloo; ``dist.get_rank(pg)``: the group's rank)."""
    # Ensure stateful objects can be gathered
    gather_objects = create_collectives_object_test_list()
    my_rank = group.rank() if group is not None else dist.get_rank()
    output_gathered = [None for _ in range(world)]
    gather_on_rank = 0
    dist.gather_object(gather_objects[rank % len(gather_objects)],
                       object_gather_list=output_gathered if my_rank == gather_on_rank else None,
                       dst=gather_on_rank, group=group)
    if my_rank != gather_on_rank:
        assert output_gathered == [None for _ in range(world)]
    else:
        for i, val in enumerate(output_gathered):
            expected = gather_objects[i % len(gather_objects)]
            assert val == expected

    # Validate errors when objects can't be pickled.
    class Bar:
        pass

    b = Bar()
    gather_objects = [b for _ in range(world)]
    with pytest.raises(AttributeError):
        dist.all_gather_object([None for _ in range(world)], gather_objects[rank], group=group)


@ported
def case_gather_object(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_gather_object
    (upstream requires a world of exactly 4; nothing in it depends on that)"""
    _test_gather_object(pg, rank, world, None if default(pg) else pg)


@ported
def case_gather_object_subgroup(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_gather_object_subgroup
    (``new_group(backend=...)`` over every rank; upstream requires a world of exactly 4)"""
    with _FullGroup(pg) as (_, subgroup, _):
        _test_gather_object(pg, rank, world, subgroup)


@ported
def case_scatter_object_list(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_scatter_object_list
    (``group=pg`` where ``pg`` is not the default group)"""
    g = {} if default(pg) else {"group": pg}
    src_rank = 0
    collectives_object_test_list = create_collectives_object_test_list()
    scatter_list = (collectives_object_test_list if rank == src_rank
                    else [None for _ in collectives_object_test_list])
    world_size = world
    scatter_list = scatter_list[:world_size]
    i = 0
    while len(scatter_list) < world_size:
        scatter_list.append(scatter_list[i])
        i += 1

    output_obj_list = [None]
    dist.scatter_object_list(output_obj_list, scatter_list, src=src_rank, **g)
    assert output_obj_list[0] == collectives_object_test_list[rank % len(collectives_object_test_list)]

    # Ensure errors are raised upon incorrect arguments.
    with pytest.raises(ValueError,
                       match="Expected argument scatter_object_output_list to be a list of size at least 1."):
        dist.scatter_object_list([], scatter_list, src=src_rank, **g)


@ported
def case_DistributedSampler_padding(pg: Any, rank: int, world: int) -> None:  # noqa: N802 - upstream's name
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_DistributedSampler_padding
    (CPU tensors: upstream moves them to GPU ``self.rank``; on a thread world, where torch has
    no default group, the samplers are given ``num_replicas=world, rank=rank`` — what they read
    from the default group — and ``all_gather`` is given ``group=pg``)"""
    world_size = world
    g = {} if default(pg) else {"group": pg}
    where = {} if default(pg) else {"num_replicas": world, "rank": rank}

    # Simulates the 'casual' dataset size
    dataset_size = 100 + world_size + 1
    dataset = [torch.ones(1) * i for i in range(dataset_size)]

    # Simulates the 'tiny' dataset size
    dataset_tiny_size = max(world_size // 2 - 1, 1)
    dataset_tiny = [torch.ones(1) * i for i in range(dataset_tiny_size)]

    # Specifying drop_last=True will cause the tail of the data to be dropped.
    dist_sampler = DistributedSampler(dataset=dataset, drop_last=True, **where)
    local_num_samples, local_dataset_size = (dist_sampler.num_samples, dist_sampler.total_size)
    # The effective dataset size should be the greatest integer that is <=
    # dataset_size that is divisible by the world_size. This is to ensure each
    # rank processes the same number of samples.
    effective_dataset_size = (math.ceil((dataset_size - world_size) / world_size)
                              if dataset_size % world_size != 0 else dataset_size / world_size)
    assert local_num_samples == effective_dataset_size
    assert local_dataset_size == local_num_samples * world_size
    indices_list = list(iter(dist_sampler))
    assert len(indices_list) == local_num_samples

    def validate_global_samples(local_num_samples: int) -> None:
        # Ensure that each rank processes the same number of samples.
        world_samples = [torch.LongTensor([0]) for _ in range(world_size)]
        dist.all_gather(world_samples, torch.tensor([local_num_samples]), **g)
        samples = [sample.item() for sample in world_samples]
        assert len(set(samples)) == 1

    validate_global_samples(local_num_samples)

    # drop_last=False is the default and will add additional indices to be sampled,
    # increasing the effective dataset size.
    dist_sampler_added_samples = DistributedSampler(dataset=dataset, **where)
    local_num_samples, local_dataset_size = (dist_sampler_added_samples.num_samples,
                                             dist_sampler_added_samples.total_size)
    # The effective dataset size is the smallest integer that is >= dataset_size
    # and divisible by the world size.
    assert local_num_samples == math.ceil(dataset_size / world_size)
    assert local_dataset_size == local_num_samples * world_size
    indices_list = list(iter(dist_sampler_added_samples))
    assert len(indices_list) == local_num_samples

    # Ensure that each rank processes the same number of samples.
    validate_global_samples(local_num_samples)

    # Ensure additional samples are padded even when
    # the extremely small dataset is given.
    dist_sampler_added_samples_tiny = DistributedSampler(dataset=dataset_tiny, **where)
    local_num_samples, local_dataset_size = (dist_sampler_added_samples_tiny.num_samples,
                                             dist_sampler_added_samples_tiny.total_size)
    assert local_num_samples == math.ceil(dataset_tiny_size / world_size)
    assert local_dataset_size == local_num_samples * world_size
    indices_list = list(iter(dist_sampler_added_samples_tiny))
    assert len(indices_list) == local_num_samples
    validate_global_samples(local_num_samples)


# --- model averaging -------------------------------------------------------------------------------------


@ported
def case_average_parameters(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_average_parameters
    (the model on the CPU; ``process_group=pg``: ``None`` upstream.  Its second half, partial
    averaging over ``new_group(ranks=[0, 1], backend="nccl")``, needs NCCL and a subset of the
    ranks: not ported)"""
    model = nn.Sequential(nn.Conv2d(3, 3, kernel_size=3, padding=1), nn.ReLU(), nn.Linear(1, 5, bias=False))
    # Test global model averaging
    for p in model.parameters():
        p.data = torch.ones_like(p.data)
    model_averaging_utils.average_parameters(params=model.parameters(), process_group=None if default(pg) else pg)
    # Every element will be the same as the input.
    for p in model.parameters():
        assert_equal(torch.ones_like(p.data), p.data)


def _periodic_model_averager(pg: Any, rank: int, world_size: int, make: Callable[[int, int], Any]) -> None:
    """The body of test_periodic_model_averager (and of the 1-level hierarchical one)."""
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    tensor = torch.ones_like(param.data) * rank
    expected_avg_tensor = torch.ones_like(param.data) * sum(range(world_size)) / world_size
    period = 4
    for warmup_steps in [12, 13, 14, 15]:
        averager = make(period, warmup_steps)
        for step in range(20):
            # Reset the parameters at every step.
            param.data = copy.deepcopy(tensor)
            for params in model.parameters():
                # mock grad
                params.grad = torch.ones_like(param.data)
            averager.average_parameters(model.parameters())
            if step >= warmup_steps and (step - warmup_steps) % period == 0:
                assert_equal(expected_avg_tensor, param.data)
            else:
                # No model averaging, so the parameters are not updated.
                assert_equal(tensor, param.data)


@ported
def case_periodic_model_averager(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_periodic_model_averager
    (the model on the CPU; ``process_group=pg``: ``None`` upstream)"""
    group = None if default(pg) else pg
    _periodic_model_averager(pg, rank, world, lambda period, warmup_steps: averagers.PeriodicModelAverager(
        period=period, warmup_steps=warmup_steps, process_group=group))


@ported
def case_periodic_model_averager_param_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_periodic_model_averager_param_group
    (the model on the CPU; ``process_group=pg``: ``None`` upstream)"""
    world_size = world
    model = nn.Linear(1, 5, bias=False)
    param = next(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    period = 4
    for warmup_steps in [12, 13, 14, 15]:
        averager = averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps,
                                                   process_group=None if default(pg) else pg)
        for step in range(20):
            # Reset the parameters at every step.
            for param_group in opt.param_groups:
                for params in param_group["params"]:
                    # mock grad
                    params.grad = torch.ones_like(param.data) * rank
                    params.data = torch.ones_like(param.data) * rank
            averager.average_parameters(opt.param_groups)
            if step >= warmup_steps and (step - warmup_steps) % period == 0:
                for param_group in opt.param_groups:
                    for params in param_group["params"]:
                        if params.grad is None:
                            continue
                        assert_equal(torch.ones_like(param.data) * sum(range(world_size)) / world_size, param.data)
            else:
                # No model averaging, so the parameters are not updated.
                for param_group in opt.param_groups:
                    for params in param_group["params"]:
                        if params.grad is None:
                            continue
                        assert_equal(torch.ones_like(param.data) * rank, param.data)


@ported
def case_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager(
        pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_1_level_hierarchical_model_averager_equivalent_to_periodic_model_averager
    (the model on the CPU).  Upstream builds a ``HierarchicalModelAverager`` over
    ``{period: world_size}`` (``new_subgroups(world_size)``: one group of every rank) and then
    replaces it by a ``PeriodicModelAverager`` before use; the port does the same — the
    hierarchical averager's construction runs under init_process_group only, as
    ``new_subgroups`` needs torch's default group"""
    group = None if default(pg) else pg

    def make(period: int, warmup_steps: int) -> Any:
        if default(pg):
            hierarchicalSGD.HierarchicalModelAverager(period_group_size_dict=OrderedDict([(period, world)]),
                                                      warmup_steps=warmup_steps)
        return averagers.PeriodicModelAverager(period=period, warmup_steps=warmup_steps, process_group=group)

    _periodic_model_averager(pg, rank, world, make)


# --- running them -------------------------------------------------------------------------------------------


globals().update(thread_world_tests(CASES, leave_out=DEFAULT_GROUP_ONLY))


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py), with upstream's global ranks."""
    run_cases_in_processes("test_distributed_test_collectives", world_size, tmp_path / "store", list(CASES))
