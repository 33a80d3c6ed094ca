"""The overhead of ``pccl.torch.ProcessGroup``: ``torch.distributed.all_reduce(t, group=pg)``
against calling ``pccl.blocking.Communicator.all_reduce(t)`` directly, op by op in turn, in the
same processes.

    .venv/bin/python benchmarks/torch_process_group.py --peers 3 --sizes 64M [--iters 10]

Each peer process opens one blocking communicator and a ``ProcessGroup`` over it; every
iteration times one in-place SUM all-reduce of a float32 tensor of ``size`` bytes each way, in an
order shuffled afresh each iteration (the same on every rank), so the machine's drift hits both
alike (see ``interleaved_gloo.py``, whose cluster this reuses).  Before each timed call the tensor
is refreshed and the peers meet at a barrier (a small all-reduce).  A call's time is the slowest
rank's; the table shows the median and minimum over iterations and the ratio of the process
group's median to the direct call's (the acceptance: at most 1.10).  The untimed first
iteration checks that both ways give bit-identical tensors.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any

from pccl.tools.bench import format_size, parse_size

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from interleaved_gloo import run_cluster  # noqa: E402

CONFIGS = ("direct", "process_group")
_BARRIER_TAG = 1 << 30
_DIRECT_TAG = 7


def _peer_main(rank: int, world: int, master_port: int, gloo_file: str, sizes: list[int],
               iters: int) -> dict[tuple[int, str], list[float]]:
    import torch
    import torch.distributed as dist

    import pccl.blocking
    import pccl.torch
    from pccl.torch.backend import wait_for_peers

    out: dict[tuple[int, str], list[float]] = {}
    with pccl.blocking.open_communicator(f"127.0.0.1:{master_port}") as comm:
        wait_for_peers(comm, world, 120)
        pg = pccl.torch.ProcessGroup(comm)
        small = torch.ones(4)

        def barrier() -> None:
            small.fill_(1)
            comm.all_reduce(small, tag=_BARRIER_TAG)

        for nbytes in sizes:
            count = nbytes // 4
            src = torch.randn(count, generator=torch.Generator().manual_seed(comm.peer_id & 0xFFFF))
            tensor = src.clone()
            warm: dict[str, torch.Tensor] = {}
            for i in range(iters + 1):  # iteration 0 warms up and checks
                for cfg in random.Random(i).sample(CONFIGS, len(CONFIGS)):
                    tensor.copy_(src)
                    barrier()
                    t0 = time.perf_counter()
                    if cfg == "direct":
                        comm.all_reduce(tensor, tag=_DIRECT_TAG)
                    else:
                        dist.all_reduce(tensor, group=pg)
                    elapsed = time.perf_counter() - t0
                    if i:
                        out.setdefault((nbytes, cfg), []).append(elapsed)
                    else:
                        warm[cfg] = tensor.clone()
                if i == 0 and not torch.equal(warm["direct"], warm["process_group"]):
                    raise RuntimeError(f"{format_size(nbytes)}: the process group's result differs from the direct call's")
        barrier()
        pg.shutdown()
    return out


def measure(world: int, sizes: list[int], iters: int, timeout: float) -> list[dict[str, Any]]:
    per_rank = run_cluster(world, _peer_main, (sizes, iters), timeout, "pccl-torch-pg-")
    rows = []
    for nbytes in sizes:
        for cfg in CONFIGS:
            samples = [per_rank[r][(nbytes, cfg)] for r in range(world)]
            times = [max(s[i] for s in samples) for i in range(iters)]
            rows.append({"N": world, "bytes": nbytes, "cfg": cfg, "median": statistics.median(times),
                         "min": min(times)})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>3} {'size':>8} {'config':>14} {'median ms':>10} {'min ms':>9} {'pg/direct':>10}"]
    by = {(r["N"], r["bytes"], r["cfg"]): r["median"] for r in rows}
    for r in rows:
        direct = by[(r["N"], r["bytes"], "direct")]
        ratio = f"{r['median'] / direct:.3f}" if r["cfg"] == "process_group" else "-"
        lines.append(f"{r['N']:>3} {format_size(r['bytes']):>8} {r['cfg']:>14} {r['median'] * 1e3:>10.1f} "
                     f"{r['min'] * 1e3:>9.1f} {ratio:>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[3])
    parser.add_argument("--sizes", nargs="+", default=["64M"], help="tensor sizes (16K, 64M, ...)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per configuration and size")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one group size may take")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes]
    print(f"# torch.distributed.all_reduce(group=pccl.torch.ProcessGroup) vs pccl.blocking all_reduce, "
          f"float32 SUM in place, loopback, interleaved; {args.iters} iterations", flush=True)
    for world in args.peers:
        print(format_rows(measure(world, sizes, args.iters, args.timeout)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
