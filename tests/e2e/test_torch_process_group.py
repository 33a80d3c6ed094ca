"""pccl.torch.ProcessGroup against gloo: three real processes, each in a gloo group (FileStore)
and in a pccl group (a master on loopback, real TCP), run the same torch.distributed calls on
both and must end with the same tensors — bit for bit where the result is exact (integers,
small integers in floating point, broadcast, gather, MIN/MAX), to rounding otherwise (a float
sum in another order).  Then a pccl error comes back through the future and ``wait()``, torch's
shape contract is refused at the call, and the registered backend ``"pccl"`` works as the
default group of ``init_process_group``."""

from __future__ import annotations

import concurrent.futures
import json
import math
import pathlib
from typing import Any

import pytest

import pccl
from pccl.testing import master_in_thread
from forked_peers import run_scripts

torch = pytest.importorskip("torch")

# torch 2.13 calls all_gather_into_tensor and reduce_scatter_tensor deprecated names (they are
# the ones SPEC §2d and most code use)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent
WORLD = 3
CFG = pccl.Config(peer_timeout=5.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("gloo") / "store"
    with master_in_thread(CFG) as master:
        # forked from a server that has imported torch (forked_peers.py): not 3 imports of it
        outputs = run_scripts(HERE / "torch_pg_peer.py", [[master.address, str(store), str(rank), str(WORLD)]
                                                          for rank in range(WORLD)], 120,
                              lambda index, code, out, err: f"a peer failed:\n{out}\n{err}")
    outs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    return outs


#: Results that depend on the rank of the process in the group (its reduce-scatter shard):
#: compared between the processes of the same rank in either group.
BY_RANK = ("reduce_scatter_i64", "reduce_scatter_f32_max", "reduce_scatter_list")


def test_every_call_gives_the_same_tensors_as_on_gloo(results: list[dict[str, Any]]) -> None:
    gloo_by_rank = {res["gloo"]["rank"]: res["gloo"] for res in results}
    assert sorted(gloo_by_rank) == sorted(res["pccl"]["rank"] for res in results) == list(range(WORLD))
    for res in results:
        gloo, ours = res["gloo"], res["pccl"]
        assert set(gloo) == set(ours)
        for case, expected in gloo.items():
            if case == "sum_f32_random":  # a float sum in another order: equal to rounding
                assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(ours[case], expected))
            elif case in BY_RANK:
                assert ours[case] == gloo_by_rank[ours["rank"]][case], case
            elif case not in ("rank", "async_callback_thread"):
                assert ours[case] == expected, case
        assert ours["reduce_scatter_input_kept"] is True and ours["async_future_is_the_tensor"] is True
    # every peer ends with the same all-reduce, all-gather and broadcast results (ranks differ
    # only in which reduce-scatter shard they hold)
    for case in ("sum_i64", "sum_f32_random", "all_gather_cat", "broadcast_f32"):
        assert len({json.dumps(res["pccl"][case]) for res in results}) == 1, case
    assert len({res["pccl"]["reduce_scatter_i64"] for res in results}) == WORLD


def test_ranks_are_ring_positions_and_futures_complete_off_the_callers_thread(results: list[dict[str, Any]]) -> None:
    assert all(res["checks"]["rank_is_ring_position"] and res["checks"]["size"] == WORLD for res in results)
    for res in results:
        thread = res["pccl"]["async_callback_thread"]
        assert thread != res["checks"]["main_thread"] and not thread.startswith("pccl-trio"), thread


def test_a_pccl_error_comes_back_through_the_future_and_wait(results: list[dict[str, Any]]) -> None:
    for res in results:
        checks = res["checks"]
        # the peers disagreed on the element count: the master refused the op on every peer;
        # torch's future fails as a C++ backend's does (torch's RuntimeError naming the error)
        assert checks["wait_error"] == checks["work_exception"] == "InvalidUsage"
        assert checks["future_error"] == "RuntimeError" and "InvalidUsage" in checks["future_message"]
        assert checks["work_completed"] is True
        assert "reduce_scatter_tensor needs an input of 3 x 4 elements" in checks["shape_error"]
        assert "SUM, AVG, PRODUCT, MIN or MAX" in checks["op_error"]
        assert checks["after_errors"] == [WORLD] * 3


def test_the_registered_backend_is_a_default_group(results: list[dict[str, Any]]) -> None:
    for res in results:
        backend = res["backend"]
        assert backend["world"] == WORLD and backend["backend"] == "pccl"
        assert backend["sum_i64"] == res["gloo"]["sum_i64"]
        assert backend["broadcast_i64"] == res["gloo"]["broadcast_i64"]


# --- in this process: a lone peer, and a newcomer's tags ----------------------------------------------


def _each(fns: list[Any]) -> list[Any]:
    """Run blocking calls that must meet, one thread each; their results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result(timeout=60) for f in futures]


def test_alone_every_collective_is_the_identity() -> None:
    import torch.distributed as dist

    import pccl.blocking
    import pccl.torch

    with master_in_thread(CFG) as master, pccl.blocking.open_communicator(master.address, config=CFG) as comm:
        pg = pccl.torch.ProcessGroup(comm)
        assert (pg.rank(), pg.size(), pg.name()) == (0, 1, "pccl")
        t = torch.arange(5, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.AVG, group=pg)
        dist.broadcast(t, group_src=0, group=pg)
        out = torch.empty(5, dtype=torch.int64)
        dist.all_gather_into_tensor(out, t, group=pg)
        shard = torch.empty(5, dtype=torch.int64)
        dist.reduce_scatter_tensor(shard, t, group=pg)
        dist.barrier(group=pg)
        assert t.tolist() == out.tolist() == shard.tolist() == list(range(5))
        work = dist.all_reduce(t, group=pg, async_op=True)
        assert work.wait() and work.get_future().wait()[0] is t
        pg.shutdown()


def test_a_newcomers_group_counts_its_tags_in_step_with_the_veterans() -> None:
    import torch.distributed as dist

    import pccl.blocking
    import pccl.torch
    from pccl.torch.backend import wait_for_peers  # a submodule: not an attribute until imported

    with master_in_thread(CFG) as master:
        first = pccl.blocking.open_communicator(master.address, config=CFG)
        second_f = concurrent.futures.ThreadPoolExecutor(1).submit(pccl.blocking.open_communicator, master.address,
                                                                   config=CFG)
        comms = [first]
        try:
            wait_for_peers(first, 2, 30)
            comms.append(second_f.result(timeout=30))
            pgs = [pccl.torch.ProcessGroup(c) for c in comms]
            tensors = [torch.ones(4, dtype=torch.int64) for _ in pgs]
            for _ in range(3):  # the veterans' groups count 3 collectives
                _each([lambda pg=pg, t=t: dist.all_reduce(t, group=pg) for pg, t in zip(pgs, tensors)])
            third_f = concurrent.futures.ThreadPoolExecutor(1).submit(pccl.blocking.open_communicator,
                                                                      master.address, config=CFG)
            _each([lambda c=c: wait_for_peers(c, 3, 30) for c in comms])
            comms.append(third_f.result(timeout=30))
            pgs.append(pccl.torch.ProcessGroup(comms[2]))  # counts from 0, as the veterans do again
            tensors = [torch.full((4,), i + 1, dtype=torch.int64) for i in range(3)]
            _each([lambda pg=pg, t=t: dist.all_reduce(t, group=pg) for pg, t in zip(pgs, tensors)])
            assert all(t.tolist() == [6] * 4 for t in tensors)
            assert sorted(pg.rank() for pg in pgs) == [0, 1, 2] and {pg.size() for pg in pgs} == {3}
            for pg in pgs:
                pg.shutdown()
        finally:
            for c in comms:
                c.close()
