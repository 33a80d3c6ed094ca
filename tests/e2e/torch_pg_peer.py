"""One process of test_torch_process_group.py: the same torch.distributed calls on a gloo group
and on a pccl.torch.ProcessGroup of the same processes.

    python torch_pg_peer.py MASTER GLOO_STORE_FILE RANK WORLD

Inputs depend on the rank *in the group the call runs on* (gloo's rank, or the ring position
for pccl), so the same program must end with the same tensors on both.  Prints one JSON line:
``{"gloo": {case: value}, "pccl": {case: value}, "checks": {...}, "backend": {case: value}}``,
where an exact case's value is its bytes in hex and a rounded one's a list of floats.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

import pccl
import pccl.blocking
import pccl.torch
from pccl.torch.backend import wait_for_peers

CONFIG = pccl.Config(peer_timeout=5.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
R = dist.ReduceOp


def _hex(t: torch.Tensor) -> str:
    return t.contiguous().view(torch.uint8).numpy().tobytes().hex() + f":{t.dtype}:{tuple(t.shape)}"


def cases(group: Any, avg: bool) -> dict[str, Any]:
    """The calls every group runs; ``avg``: the group reduces AVG itself (gloo does not)."""
    r, n = group.rank(), group.size()
    out: dict[str, Any] = {"rank": r}

    for dtype, op, name in ((torch.int64, R.SUM, "sum_i64"), (torch.int32, R.MAX, "max_i32"),
                            (torch.int8, R.MIN, "min_i8"), (torch.int64, R.PRODUCT, "prod_i64"),
                            (torch.float32, R.SUM, "sum_f32_exact"), (torch.bfloat16, R.SUM, "sum_bf16_exact"),
                            (torch.uint8, R.SUM, "sum_u8")):
        t = (torch.arange(37) % 5 + 3 * r + 1).to(dtype)
        dist.all_reduce(t, op=op, group=group)
        out[name] = _hex(t)
    g = torch.Generator().manual_seed(1234 + r)
    t = torch.randn(1000, generator=g)
    dist.all_reduce(t, group=group)
    out["sum_f32_random"] = t.tolist()
    t = torch.full((12,), float(2 * (r + 1)))
    if avg:
        dist.all_reduce(t, op=R.AVG, group=group)
    else:
        dist.all_reduce(t, op=R.SUM, group=group)
        t /= n
    out["avg_f32_exact"] = _hex(t)

    # all_gather_into_tensor: concatenated and stacked outputs
    x = torch.arange(5, dtype=torch.int64) + 10 * r
    cat = torch.empty(5 * n, dtype=torch.int64)
    dist.all_gather_into_tensor(cat, x, group=group)
    out["all_gather_cat"] = _hex(cat)
    y = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (r + 1)
    rows = torch.empty(2 * n, 3)
    dist.all_gather_into_tensor(rows, y, group=group)
    out["all_gather_2d"] = _hex(rows)
    parts = [torch.empty(4, dtype=torch.int32) for _ in range(n)]
    dist.all_gather(parts, torch.full((4,), r * 7 + 1, dtype=torch.int32), group=group)
    out["all_gather_list"] = [_hex(p) for p in parts]

    # broadcast from group rank 1 (its tensor is the only one that counts)
    b = torch.arange(9, dtype=torch.int64) * (r + 2)
    dist.broadcast(b, group_src=1, group=group)
    out["broadcast_i64"] = _hex(b)
    f = torch.randn(33, generator=torch.Generator().manual_seed(99 + r))
    dist.broadcast(f, group_src=0, group=group)
    out["broadcast_f32"] = _hex(f)

    # reduce_scatter_tensor: rank i gets the reduction of the i-th slice; the input stays
    inp = torch.arange(4 * n, dtype=torch.int64) * (r + 1)
    before = inp.clone()
    shard = torch.empty(4, dtype=torch.int64)
    dist.reduce_scatter_tensor(shard, inp, group=group)
    out["reduce_scatter_i64"] = _hex(shard)
    out["reduce_scatter_input_kept"] = bool(torch.equal(inp, before))
    inp = (torch.arange(6 * n, dtype=torch.float32) + r).reshape(n, 6)
    shard = torch.empty(1, 6)
    dist.reduce_scatter_tensor(shard, inp, op=R.MAX, group=group)
    out["reduce_scatter_f32_max"] = _hex(shard)
    lists = [torch.full((3,), float(r + i)) for i in range(n)]
    shard = torch.empty(3)
    dist.reduce_scatter(shard, lists, group=group)
    out["reduce_scatter_list"] = _hex(shard)

    out["barrier"] = dist.barrier(group=group)

    # async: wait() and the future's value; the callback thread
    t = torch.ones(10, dtype=torch.int64) * (r + 1)
    work = dist.all_reduce(t, group=group, async_op=True)
    seen: list[str] = []
    chained = work.get_future().then(lambda fut: seen.append(threading.current_thread().name) or fut.value())
    work.wait()
    value = chained.wait()
    out["async_sum"] = _hex(t)
    out["async_future_is_the_tensor"] = bool(value[0] is t or value[0].data_ptr() == t.data_ptr())
    out["async_callback_thread"] = seen[0] if seen else None
    return out


def pccl_checks(pg: pccl.torch.ProcessGroup, comm: pccl.blocking.Communicator) -> dict[str, Any]:
    """What only the pccl group is asked: errors through the future, the shape contract."""
    checks: dict[str, Any] = {"main_thread": threading.current_thread().name,
                              "rank_is_ring_position": pg.rank() == comm.ring.index(comm.peer_id),
                              "size": pg.size()}
    # peers disagree on the element count: the master refuses the op on every peer
    t = torch.zeros(10 + pg.rank(), dtype=torch.int64)
    work = dist.all_reduce(t, group=pg, async_op=True)
    try:
        work.get_future().wait()
        checks["future_error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        checks["future_error"] = type(exc).__name__
        checks["future_message"] = str(exc)
    try:
        work.wait()
        checks["wait_error"] = None
    except Exception as exc:  # noqa: BLE001
        checks["wait_error"] = type(exc).__name__
    checks["work_exception"] = type(work.exception()).__name__
    checks["work_completed"] = work.is_completed() and not work.is_success()
    # torch's shape contract, checked at the call (called on the group itself: with a default
    # group initialised, torch 2.13's exception logger replaces an error raised inside
    # dist.*(group=pg) by its own ValueError, as the group is not in its world map)
    try:
        pg.reduce_scatter_single(torch.empty(4), torch.empty(4 * pg.size() + 1))
        checks["shape_error"] = None
    except pccl.InvalidArgument as exc:
        checks["shape_error"] = str(exc)
    try:
        opts = dist.AllreduceOptions()
        opts.reduceOp = R.BAND
        pg.allreduce([torch.ones(2, dtype=torch.int64)], opts)
        checks["op_error"] = None
    except pccl.InvalidArgument as exc:
        checks["op_error"] = str(exc)
    # and the group goes on
    t = torch.ones(3, dtype=torch.int64)
    dist.all_reduce(t, group=pg)
    checks["after_errors"] = t.tolist()
    return checks


def backend(rank: int, world: int, master: str, store_file: str) -> dict[str, Any]:
    """The registered backend as the default group: init_process_group("pccl") (with a store
    the processes share, where they note which peer has which rank)."""
    os.environ["PCCL_MASTER"] = master
    pccl.torch.register()
    dist.init_process_group("pccl", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out: dict[str, Any] = {"world": dist.get_world_size(), "backend": dist.get_backend()}
    r = dist.get_rank()
    t = (torch.arange(37) % 5 + 3 * r + 1).to(torch.int64)
    dist.all_reduce(t)
    out["sum_i64"] = _hex(t)
    b = torch.arange(9, dtype=torch.int64) * (r + 2)
    dist.broadcast(b, src=1)
    out["broadcast_i64"] = _hex(b)
    dist.barrier()
    dist.destroy_process_group()
    return out


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # all_gather_into_tensor & co. are deprecated names
    master, store_file, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    result: dict[str, Any] = {"gloo": cases(dist.group.WORLD, avg=False)}
    with pccl.blocking.open_communicator(master, config=CONFIG) as comm:
        wait_for_peers(comm, world, 30)
        pg = pccl.torch.ProcessGroup(comm)
        result["pccl"] = cases(pg, avg=True)
        result["checks"] = pccl_checks(pg, comm)
        pg.shutdown()
    dist.barrier()  # every pccl communicator has left before the backend opens new ones
    dist.destroy_process_group()
    result["backend"] = backend(rank, world, master, store_file + ".pccl")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
