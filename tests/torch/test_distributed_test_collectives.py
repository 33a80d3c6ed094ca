"""DOCSTRING"""

from __future__ import annotations

import operator
import pathlib
import time
from collections.abc import Callable, Iterator
from functools import reduce
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import _get_default_group  # noqa: E402

import pccl  # noqa: E402
import pccl.torch  # noqa: E402
from pccl_torch_world import CFG, World, master_in_thread, pccl_world, run_peer_processes  # noqa: E402

# torch 2.13 calls all_reduce_coalesced deprecated
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent
WORLDS = (2, 3)

#: name -> case, in the order they are defined (the peer processes run them in this order).
CASES: dict[str, Callable[[Any, int, int], None]] = {}


def ported(fn: Callable[[Any, int, int], None]) -> Callable[[Any, int, int], None]:
    CASES[fn.__name__.removeprefix("case_")] = fn
    return fn


def assert_equal(expected: Any, actual: Any, msg: str | None = None) -> None:
    """torch's ``TestCase.assertEqual`` for tensors and lists of them."""
    torch.testing.assert_close(actual, expected, msg=msg)


def default(pg: Any) -> bool:
    """Whether ``pg`` is the default group (the init_process_group runs)."""
    return dist.is_initialized() and _get_default_group() is pg


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
            [master.address, str(world_size), str(rank), str(tmp_path / "store"), "0",
             "test_distributed_test_collectives"] for rank in range(world_size)], timeout=150)
    assert sorted(r["rank"] for r in reports) == list(range(world_size))
    failed = {}
    for report in reports:
        assert report["backend"] == "pccl" and report["world"] == world_size
        assert list(report["cases"]) == list(CASES)
        failed.update({f"{name} (rank {report['rank']})": outcome for name, outcome in report["cases"].items()
                       if outcome != "ok"})
    assert not failed, "\n".join(f"{name}:\n{outcome}" for name, outcome in failed.items())
