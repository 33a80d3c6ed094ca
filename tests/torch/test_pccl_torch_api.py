"""pccl's own cases for ``pccl.torch.ProcessGroup`` as torch users call it (issue 44): the
pybind call forms and their futures, checks at the call, inference mode, functional
collectives and the group's name, sparse tensors under torch's DDP, and ``new_group`` inside a
pccl world.  PyTorch's own cases are test_c10d_ported.py."""

from __future__ import annotations

import gc
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch._C._distributed_c10d as _c10d  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
from torch.distributed.distributed_c10d import _resolve_process_group  # noqa: E402

import pccl  # noqa: E402
import pccl.blocking  # noqa: E402
from pccl_torch_world import CFG, World, master_in_thread, pccl_world, run_peer_processes  # noqa: E402

# torch 2.13 calls all_gather_into_tensor, reduce_scatter_tensor and their functional twins
# deprecated names
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=(2, 3), ids=("world2", "world3"))
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    with pccl_world(request.param) as w:
        yield w


def test_the_pybind_call_forms(world: World) -> None:
    def case(pg: Any, rank: int, n: int) -> list[Any]:
        seen = []
        x = torch.arange(100, dtype=torch.float32) + rank  # a bare tensor is one tensor, not 100 rows
        value = pg.allreduce(x).get_future().wait()
        seen.append(len(value) == 1 and value[0] is x and x.shape == (100,))
        y = torch.tensor([rank + 1.0])
        pg.allreduce([y], dist.ReduceOp.MAX).wait()
        pg.allreduce(y, dist.ReduceOp.MIN).wait()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pg.allreduce([y], opts).wait()
        pg.allreduce([y], op=dist.ReduceOp.AVG).wait()
        b = torch.tensor([float(rank)])
        pg.broadcast(b, root=n - 1).wait()
        c = torch.tensor([float(rank)])
        pg.broadcast([c], 0).wait()
        outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
        pg.allgather(outs, torch.full((2,), rank, dtype=torch.int64)).wait()
        nested = [[torch.empty(2, dtype=torch.int64) for _ in range(n)]]
        pg.allgather(nested, [torch.full((2,), rank, dtype=torch.int64)], _c10d.AllgatherOptions()).wait()
        pg.barrier().wait()
        pg.barrier(dist.BarrierOptions()).wait()
        r = torch.tensor([rank + 1])
        pg.reduce(r, 0, dist.ReduceOp.SUM).wait()
        s = torch.empty(1, dtype=torch.int64)
        pg.reduce_scatter(s, [torch.tensor([i + rank]) for i in range(n)], dist.ReduceOp.SUM).wait()
        return seen + [x[:2].tolist(), y.item(), b.item(), c.item(), [o.tolist() for o in outs],
                       [o.tolist() for o in nested[0]], s.item()]

    n = world.size
    total = n * (n - 1) / 2
    expected_ar = [total, total + n]
    for rank, got in enumerate(world.run(case)):
        assert got[0] is True
        assert got[1] == expected_ar
        assert got[2] == float(n * n)  # MAX: n, then MIN: n, SUM: n * n, AVG: n * n
        assert (got[3], got[4]) == (n - 1.0, 0.0)
        assert got[5] == got[6] == [[r, r] for r in range(n)]
        assert got[7] == sum(range(n)) + n * rank


def test_checks_come_at_the_call_not_at_wait(world: World) -> None:
    def case(pg: Any, rank: int, n: int) -> list[str]:
        errors = []
        for call in (lambda: pg.allgather([[torch.empty(2, dtype=torch.float64) for _ in range(n)]],
                                          [torch.ones(2)]),  # float32 into float64: no silent cast
                     lambda: pg.allgather([torch.empty(3) for _ in range(n)], torch.ones(2)),  # own place's size
                     lambda: dist.all_gather_into_tensor(torch.empty(2 * n + 1), torch.ones(2), group=pg),
                     lambda: pg.reduce_scatter_single(torch.empty(2), torch.empty(2 * n + 1)),
                     lambda: pg.allreduce([torch.ones(2), torch.ones(3)])):
            with pytest.raises(pccl.InvalidArgument) as info:
                call()
            errors.append(str(info.value))
        pg.barrier().wait()  # nothing was started: the group's tags are still in step
        return errors

    for errors in world.run(case):
        assert "invalid tensor type" in errors[0] and "invalid tensor size" in errors[1]


def test_collectives_under_inference_mode(world: World) -> None:
    def case(pg: Any, rank: int, n: int) -> list[Any]:
        with torch.inference_mode():
            t = torch.full((3,), float(rank + 1))
            dist.all_reduce(t, group=pg)
            out = torch.empty(3 * n)
            dist.all_gather_into_tensor(out, t, group=pg)
            b = torch.full((2,), float(rank))
            dist.broadcast(b, group_src=1, group=pg)
            shard = torch.empty(1)
            dist.reduce_scatter_tensor(shard, torch.ones(n), group=pg)
        return [t.tolist(), out.tolist(), b.tolist(), shard.item()]

    n = world.size
    s = n * (n + 1) / 2
    for got in world.run(case):
        assert got == [[s] * 3, [s] * (3 * n), [1.0, 1.0], float(n)]


def test_functional_collectives_find_the_group_by_its_name(world: World) -> None:
    def case(pg: Any, rank: int, n: int) -> list[Any]:
        assert _resolve_process_group(pg.group_name) is pg
        t = torch.full((4,), float(rank + 1))
        summed = funcol.all_reduce(t, "sum", pg)
        gathered = funcol.all_gather_tensor(torch.full((2,), float(rank)), 0, pg)
        scattered = funcol.reduce_scatter_tensor(torch.arange(2 * n, dtype=torch.float32), "sum", 0, pg)
        broadcast = funcol.broadcast(torch.full((2,), float(rank)), 0, pg)
        return [t.tolist(), funcol.wait_tensor(summed).tolist(), funcol.wait_tensor(gathered).tolist(),
                funcol.wait_tensor(scattered).tolist(), funcol.wait_tensor(broadcast).tolist(), pg.group_name]

    n = world.size
    results = world.run(case)
    for rank, got in enumerate(results):
        assert got[0] == [float(rank + 1)] * 4  # functional collectives leave their input alone
        assert got[1] == [n * (n + 1) / 2] * 4
        assert got[2] == [float(r) for r in range(n) for _ in range(2)]
        assert got[3] == [float(n * (2 * rank)), float(n * (2 * rank + 1))]
        assert got[4] == [0.0, 0.0]
    assert len({got[5] for got in results}) == n  # one process: every group has a name of its own


def test_a_group_leaves_torchs_registry_at_shutdown() -> None:
    with master_in_thread(CFG) as master, pccl.blocking.open_communicator(master.address, config=CFG) as comm:
        pg = pccl.torch.ProcessGroup(comm)
        name = pg.group_name
        assert name.startswith("pccl:0:") and _resolve_process_group(name) is pg
        # in torch's world's rank table as new_group's groups are: its ranks are global ranks
        assert dist.get_process_group_ranks(pg) == [0] and dist.get_global_rank(pg, 0) == 0
        with pytest.raises(ValueError, match="not part of group"):
            dist.get_global_rank(pg, 1)
        pg.shutdown()
        with pytest.raises(Exception, match="Could not resolve|not found|unknown"):
            _resolve_process_group(name)
        with pytest.raises(ValueError, match="not registered"):
            dist.get_global_rank(pg, 0)


def test_sparse_gradients_under_torchs_ddp_are_refused_not_a_crash(world: World) -> None:
    # before the check, torch's reducer handed pccl a sparse gradient and the process died
    # (SIGSEGV): this test then fails as a crashed worker
    from torch.nn.parallel import DistributedDataParallel

    def case(pg: Any, rank: int, n: int) -> str:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True)), process_group=pg)
        with pytest.raises(pccl.InvalidArgument, match="invalid tensor layout") as info:
            ddp(torch.tensor([1, 2, 3])).sum().backward()
        return str(info.value)

    assert all("sparse" in message for message in world.run(case))


def test_new_group_in_a_pccl_world_shares_the_communicator_or_refuses_at_once(tmp_path: pathlib.Path) -> None:
    world = 2
    with master_in_thread(CFG) as master:
        reports = run_peer_processes(HERE / "torch_group_peer.py", [
            [master.address, str(world), str(rank), str(tmp_path / "store")] for rank in range(world)], timeout=120)
    for report in sorted(reports, key=lambda r: r["rank"]):
        assert report["new_group_seconds"] < 10
        assert report["sums"] == [[3.0] * 4, [20.0] * 4]
        assert report["subgroup_seconds"] < 10
        if report["rank"] == 0:
            assert report["subgroup"].startswith("InvalidUsage") and "whole peer group" in report["subgroup"]
        else:
            assert report["subgroup"] == "non-member"


def test_opening_a_communicator_for_the_backend_gives_up_after_the_groups_timeout() -> None:
    from pccl.torch.backend import open_within

    with master_in_thread(CFG) as master, pccl.blocking.open_communicator(master.address, config=CFG):
        started = time.monotonic()
        with pytest.raises(pccl.TooFewPeers, match="within 1 s"):
            open_within(master.address, 0, 1.0)  # the accepted peer never votes it in
        assert time.monotonic() - started < 5


def test_bool_tensors_reduce_with_min_max_as_and_or(world: World) -> None:
    def case(pg: Any, rank: int, n: int) -> list[Any]:
        out = []
        for op in (dist.ReduceOp.MIN, dist.ReduceOp.BAND, dist.ReduceOp.MAX, dist.ReduceOp.BOR):
            t = torch.tensor([True, rank == 0, False])
            dist.all_reduce(t, op=op, group=pg)
            out.append(t.tolist())
        both = [torch.tensor([True, rank == 0]), torch.tensor([rank == 1, False])]
        pg.allreduce(both, dist.ReduceOp.MAX).wait()  # several per peer: or over all of them
        out.append([t.tolist() for t in both])
        with pytest.raises(pccl.InvalidArgument, match="bool tensors"):
            pg.allreduce(torch.tensor([True]), dist.ReduceOp.SUM)
        return out

    for got in world.run(case):
        assert got == [[True, False, False]] * 2 + [[True, True, False]] * 2 + [[[True, True]] * 2]


def test_a_future_callback_may_run_a_collective_and_wait_for_it(world: World) -> None:
    """torch's PowerSGD DDP hook all-reduces inside a future's ``then`` callback and waits for
    it: the group completes that inner collective meanwhile (the callbacks run off its
    completion thread; on it, the wait blocked the only thread that could finish the inner op)."""
    def case(pg: Any, rank: int, n: int) -> list[float]:
        x = torch.full((4,), float(rank + 1))

        def then(fut: Any) -> Any:
            y = fut.value()[0] * 2
            dist.all_reduce(y, group=pg)  # synchronous: waits for the inner collective
            return y

        return pg.allreduce(x).get_future().then(then).wait().tolist()  # type: ignore[no-any-return]

    for got in world.run(case, timeout=60):
        n = world.size
        assert got == [float(n * 2 * n * (n + 1) // 2)] * 4, got


def test_a_future_callback_may_shut_its_own_group_down(world: World) -> None:
    """A ``then`` callback that calls ``shutdown()`` on the group whose work it follows: the
    shutdown waits for the group's other callbacks, not for the one it runs in (it waited its
    whole 30 s for itself), and a point-to-point work's callback, run on the group's
    point-to-point thread, may do the same (that thread joined itself: ``RuntimeError``)."""
    def collective(pg: Any, rank: int, n: int) -> list[float]:
        shut = threading.Event()

        def then(fut: Any) -> Any:
            pg.shutdown()
            shut.set()
            return fut.value()[0]

        future = pg.allreduce(torch.ones(2)).get_future().then(then)
        assert shut.wait(20), "shutdown() in a callback did not return"
        with pytest.raises(pccl.InvalidUsage, match="shut down"):
            pg.allreduce(torch.ones(1))
        return future.wait().tolist()  # type: ignore[no-any-return]

    for got in world.run(collective, timeout=60):
        assert got == [float(world.size)] * 2

    def point(pg: Any, rank: int, n: int) -> list[float]:
        shut = threading.Event()
        if rank == 0:
            pg.send([torch.full((2,), 7.0)], 1, 0).wait()
            return []
        if rank != 1:
            return []
        t = torch.zeros(2)

        def then(fut: Any) -> Any:
            pg.shutdown()
            shut.set()
            return fut.value()

        future = pg.recv([t], 0, 0).get_future().then(then)
        assert shut.wait(20), "shutdown() in a point-to-point callback did not return"
        future.wait()
        return t.tolist()  # type: ignore[no-any-return]

    assert world.run(point, timeout=60)[1] == [7.0, 7.0]


def test_a_work_python_dropped_unwaited_still_answers_torchs_cpp(world: World) -> None:
    """torch's DDP ``join()`` hands the forward pass's all-reduce to its C++ reducer and drops
    it; the reducer waits on it and reads its future in the backward.  A Python work whose
    Python object is gone answers C++ from torch's base class, whose ``wait`` never returns (DDP's
    ``join(divide_by_initial_world_size=False)`` hung in the backward): the work, reached again
    from its C++ part after Python dropped it, is still pccl's and waits as pccl's does."""

    def case(pg: Any, rank: int, n: int) -> list[Any]:
        t = torch.ones(1)
        work = dist.all_reduce(t, group=pg, async_op=True)
        boxed = work.boxed()  # torch's C++ holds the work, as DDP's reducer does
        del work
        gc.collect()
        again = dist.Work.unbox(boxed)  # the C++ part, as C++ sees it
        # torch's base class's wait would never return: fail, not hang
        assert isinstance(again, pccl.torch.Work), f"C++ reaches a {type(again)}"
        assert again.wait()
        return again.get_future().wait()[0].item()

    assert world.run(case) == [float(world.size)] * world.size
