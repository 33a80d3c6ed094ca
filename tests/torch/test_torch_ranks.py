"""The ranks ``init_process_group("pccl", rank=r)`` gives (issue 44): honoured while the group's
members are the processes that started it; after a change the surviving starters keep their
order and newcomers follow in ring order (pccl.torch.ranks)."""

from __future__ import annotations

import concurrent.futures
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

import pccl  # noqa: E402
from pccl.torch.ranks import given_ranks, peers_by_rank  # noqa: E402
from pccl_torch_world import CFG, World, master_in_thread, pccl_world, run_peer_processes  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=(2, 3), ids=("world2", "world3"))
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    with pccl_world(request.param) as w:
        yield w


def _every_collective(pg: Any, rank: int, n: int) -> dict[str, Any]:
    """What each rank-ordered call gives at ``rank`` of ``n``."""
    out: dict[str, Any] = {"rank": pg.rank(), "peer": pg.communicator.peer_id}
    gathered = [torch.zeros(1) for _ in range(n)]
    dist.all_gather(gathered, torch.tensor([float(rank)]), group=pg)
    out["all_gather"] = [t.item() for t in gathered]
    into = torch.zeros(2 * n)
    dist.all_gather_into_tensor(into, torch.tensor([float(rank), 10.0 + rank]), group=pg)
    out["all_gather_into_tensor"] = into.tolist()
    lists = [[torch.zeros(1), torch.zeros(2)] for _ in range(n)]
    dist.all_gather_coalesced(lists, [torch.tensor([float(rank)]), torch.full((2,), 10.0 + rank)], group=pg)
    out["all_gather_coalesced"] = [[t.tolist() for t in ts] for ts in lists]
    root = torch.tensor([float(rank)])
    dist.broadcast(root, group=pg, group_src=n - 1)
    out["broadcast"] = root.item()
    shard = torch.zeros(2)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * n), group=pg)
    out["reduce_scatter_tensor"] = shard.tolist()
    uneven = torch.zeros(rank + 1)
    dist.reduce_scatter(uneven, [torch.full((r + 1,), float(r)) for r in range(n)], group=pg)
    out["reduce_scatter_uneven"] = uneven.tolist()
    even = torch.zeros(1)
    dist.reduce_scatter(even, [torch.tensor([float(r)]) for r in range(n)], group=pg)
    out["reduce_scatter"] = even.tolist()
    gather = [torch.zeros(1) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank)]), gather, group=pg, group_dst=0)
    out["gather"] = [t.item() for t in gather] if gather is not None else None
    scattered = torch.zeros(1)
    dist.scatter(scattered, [torch.tensor([100.0 + r]) for r in range(n)] if rank == 1 else None, group=pg,
                 group_src=1)
    out["scatter"] = scattered.item()
    reduced = torch.tensor([float(rank + 1)])
    dist.reduce(reduced, group=pg, group_dst=n - 1)
    out["reduce"] = reduced.item()
    received = torch.zeros(1)
    sent = dist.isend(torch.tensor([float(rank)]), group=pg, group_dst=(rank + 1) % n)
    dist.recv(received, group=pg, group_src=(rank - 1) % n)
    sent.wait()
    out["send_recv"] = received.item()
    a2a = torch.zeros(n)
    dist.all_to_all_single(a2a, torch.tensor([10.0 * rank + j for j in range(n)]), group=pg)
    out["all_to_all_single"] = a2a.tolist()
    return out


def test_given_ranks_order_every_collective(world: World) -> None:
    ring = world.comms[0].ring
    n = len(ring)
    given = ring[1:] + ring[:1]  # rank r is the peer at ring position r + 1: no rank is a ring position
    results = world.run(_every_collective, ranks=given)
    for rank, got in enumerate(results):
        assert got["rank"] == rank and got["peer"] == given[rank]
        assert got["all_gather"] == [float(r) for r in range(n)]
        assert got["all_gather_into_tensor"] == [x for r in range(n) for x in (float(r), 10.0 + r)]
        assert got["all_gather_coalesced"] == [[[float(r)], [10.0 + r] * 2] for r in range(n)]
        assert got["broadcast"] == float(n - 1)
        assert got["reduce_scatter_tensor"] == [n * 2.0 * rank, n * (2.0 * rank + 1)]
        assert got["reduce_scatter_uneven"] == [n * float(rank)] * (rank + 1)
        assert got["reduce_scatter"] == [n * float(rank)]
        assert got["gather"] == ([float(r) for r in range(n)] if rank == 0 else None)
        assert got["scatter"] == 100.0 + rank
        if rank == n - 1:
            assert got["reduce"] == n * (n + 1) / 2
        assert got["send_recv"] == float((rank - 1) % n)
        assert got["all_to_all_single"] == [10.0 * j + rank for j in range(n)]


def test_survivors_keep_their_order_and_newcomers_follow() -> None:
    given = (7, 5, 9)
    assert peers_by_rank((5, 9, 7), given) == given
    assert peers_by_rank((9, 7), given) == (7, 9)  # peer 5 (rank 1) left: 9 moves down to rank 1
    assert peers_by_rank((9, 11, 7, 12), given) == (7, 9, 11, 12)  # newcomers after, in ring order
    assert peers_by_rank((5, 11, 7), given) == (7, 5, 11)  # a replacement of the last rank gets it again
    assert peers_by_rank((11, 12), given) == (11, 12)  # none of the starters left: ring order
    assert peers_by_rank((5, 9, 7), None) == (5, 9, 7)


def test_the_ranks_are_read_from_torchs_store() -> None:
    store = dist.HashStore()
    ring = (0xB, 0xA)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(given_ranks, store, rank, 2, peer, ring, 10.0) for rank, peer in ((0, 0xA), (1, 0xB))]
        assert [f.result() for f in futures] == [(0xA, 0xB), (0xA, 0xB)]
    # a replacement for rank 1, whose first holder left: the starters' table as it stands
    assert given_ranks(store, 1, 2, 0xC, (0xA, 0xC), 10.0) == (0xA, 0xB)
    assert peers_by_rank((0xC, 0xA), (0xA, 0xB)) == (0xA, 0xC)  # and so it is rank 1 again
    # two live processes that passed one rank: refused, naming both
    with pytest.raises(pccl.InvalidUsage, match="rank 1 was passed to init_process_group by two processes"):
        given_ranks(store, 1, 2, 0xC, (0xA, 0xB, 0xC), 10.0)
    # a store of this process's own: the others' ranks never come; refused, naming the store
    with pytest.raises(pccl.InvalidUsage, match="share the store"):
        given_ranks(dist.HashStore(), 1, 2, 0xC, (0xA, 0xC), 0.2)


def test_get_rank_is_the_rank_init_process_group_was_given(tmp_path: pathlib.Path) -> None:
    """Three processes pass ranks 0, 1, 2: ``get_rank()`` and the order of an all-gather follow
    them, whatever the ring (test_c10d_ported*.py's process runs check every collective)."""
    with master_in_thread(CFG) as master:
        reports = run_peer_processes(HERE / "torch_rank_peer.py", [
            [master.address, "3", str(rank), str(tmp_path / "store")] for rank in range(3)], timeout=120)
    for rank, report in enumerate(reports):
        assert report["rank"] == rank
        assert report["all_gather"] == [0.0, 1.0, 2.0]
        assert report["peers_by_rank"] == reports[0]["peers_by_rank"]
        assert report["peers_by_rank"][rank] == report["peer"]
