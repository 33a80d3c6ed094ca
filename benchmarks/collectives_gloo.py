"""pccl's broadcast, all-gather and reduce-scatter against torch Gloo's same collective (and
pccl's own all-reduce), call by call in turn, in the same processes.

    .venv/bin/python benchmarks/collectives_gloo.py --peers 2 3 --sizes 64M [--iters 10] [--rate 4gbit]
                                                    [--phases] [--[no-]fast-commit] [--peer-commit]

Each peer process holds a pccl communicator and a Gloo process group over float32 buffers of
``size`` bytes; every iteration times one call of each configuration in an order shuffled
afresh (the same on every rank), so the machine's drift hits all alike (see
``interleaved_gloo.py``, whose cluster this reuses).  ``size`` is the whole buffer: the
broadcast's, the all-reduce's and reduce-scatter's input, the all-gather's result (each peer
contributing ``size / N``).  A call's time is the slowest rank's; the table shows medians, bus
bandwidth with nccl-tests' factors (broadcast 1, all-gather and reduce-scatter ``(N-1)/N``,
all-reduce ``2(N-1)/N``), the ratio of Gloo's same collective to pccl's (above 1: pccl faster)
and, for reduce-scatter, its time as a fraction of pccl's all-reduce of the same size.  The
untimed first iteration checks pccl's results against Gloo's.

Plain loopback is CPU-bound: moving a byte costs two kernel copies, as cheap as the reduction
and the in-place input backup pccl adds, so the comparison is one of CPU work on a machine
with few cores.  ``--rate`` (needs root) runs the whole cluster in a fresh network namespace whose
loopback device is shaped by ``tc tbf`` to ``RATE``: every byte of every peer shares that one
link, as a link-bound group does, and the comparison becomes one of bytes on the wire.

``--phases`` also prints where each pccl call's time went, per ring position (medians, ms):
from the call to its data path (the master's vote), the data path itself (``execute``: the
bytes), and from there to the return (the completion round trip through the master).
``--fast-commit`` (the library's default) runs pccl's peers with ``Config.fast_commit`` (the
call skips the vote; the ``vote`` span is then the call's own cost); ``--no-fast-commit`` votes.
``--peer-commit`` adds ``Config.peer_commit`` (the participants agree on completion among
themselves; the ``done`` span is then the acks' round; needs fast commit).
``--local-socket-buffer-size`` sets pccl's peers' ``Config.local_socket_buffer_size`` (``0``: the
OS's autotuned buffers, as pccl's connections to other hosts have; Gloo's always are): the
shaped loopback of ``--rate`` stands in for a network link, where pccl would not use its small
same-host buffers.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from pccl.tools.bench import admit, bus_bandwidth, format_size, parse_size

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from interleaved_gloo import gloo_rank_of, pccl_barrier, random_floats, run_cluster  # noqa: E402

CONFIGS = ("gloo:broadcast", "pccl:broadcast", "gloo:all_gather", "pccl:all_gather",
           "gloo:reduce_scatter", "pccl:reduce_scatter", "pccl:all_reduce")


def _peer_main(rank: int, world: int, master_port: int, gloo_file: str, sizes: list[int], iters: int,
               configs: list[str], phases: bool = False,
               fast_commit: bool = False, peer_commit: bool = False,
               local_socket_buffer_size: int | None = None) -> dict[tuple[int, str], list[float]]:
    import torch
    import torch.distributed as dist
    import trio

    import pccl
    import pccl.testing

    dist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=world)
    #: When the data path of the pccl call being timed started and ended (``--phases``).
    marks: list[float] = []

    def marking(real: Any) -> Any:
        async def execute(*args: Any, **kwargs: Any) -> Any:
            marks.append(time.perf_counter())
            try:
                return await real(*args, **kwargs)
            finally:
                marks.append(time.perf_counter())

        return execute

    async def run() -> dict[tuple[int, str], list[float]]:
        out: dict[tuple[int, str], list[float]] = {}
        config = pccl.Config(fast_commit=fast_commit, peer_commit=peer_commit)
        if local_socket_buffer_size is not None:
            config = dataclasses.replace(config, local_socket_buffer_size=local_socket_buffer_size)
        async with pccl.open_communicator(f"127.0.0.1:{master_port}", config=config) as comm:
            await admit(comm, world)
            root = min(comm.ring)
            position = comm.ring.index(comm.peer_id)
            # pccl's root is the process holding the smallest peer id: Gloo broadcasts from it too.
            gloo_root = gloo_rank_of(comm, root, rank, world)
            barrier = pccl_barrier(comm)
            for nbytes in sizes:
                count = nbytes // 4
                count -= count % world
                src = await trio.to_thread.run_sync(functools.partial(random_floats, rank, count))
                buf = src.copy()
                part = buf[: count // world]  # an all-gather's contribution
                gathered = torch.empty(count, dtype=torch.float32)
                shard_out = torch.empty(count // world, dtype=torch.float32)
                tensor = torch.from_numpy(buf)
                parts = list(gathered.chunk(world))

                def gloo(kind: str) -> float:
                    t0 = time.perf_counter()
                    if kind == "broadcast":
                        dist.broadcast(tensor, src=gloo_root)
                    elif kind == "all_gather":
                        dist.all_gather(parts, torch.from_numpy(part))
                    else:
                        dist.reduce_scatter(shard_out, list(tensor.chunk(world)))
                    return time.perf_counter() - t0

                warm: dict[str, Any] = {}
                for i in range(iters + 1):  # iteration 0 warms up and checks
                    for cfg in random.Random(i).sample(configs, len(configs)):
                        np.copyto(buf, src)
                        await barrier()
                        who, kind = cfg.split(":")
                        marks.clear()
                        t0 = time.perf_counter()
                        if who == "gloo":
                            elapsed = await trio.to_thread.run_sync(gloo, kind)
                            result: Any = {"broadcast": lambda: buf.copy(), "all_gather": lambda: gathered.numpy().copy(),
                                           "reduce_scatter": lambda: shard_out.numpy().copy()}[kind]() if i == 0 else None
                        else:
                            # The clock stops when the call returns, as Gloo's does; the copies
                            # kept for the check are made after it.
                            if kind == "broadcast":
                                await comm.broadcast(buf, root=root, tag=1)
                                elapsed = time.perf_counter() - t0
                                result = buf.copy() if i == 0 else None
                            elif kind == "all_gather":
                                got = await comm.all_gather(part, tag=2)
                                elapsed = time.perf_counter() - t0
                                result = got.buffer.copy() if i == 0 else None
                            elif kind == "reduce_scatter":
                                shard = await comm.reduce_scatter(buf, tag=3)
                                elapsed = time.perf_counter() - t0
                                result = buf[shard.start:shard.stop].copy() if i == 0 else None
                            else:
                                await comm.all_reduce(buf, tag=4)
                                elapsed = time.perf_counter() - t0
                                result = None
                        if i:
                            out.setdefault((nbytes, cfg), []).append(elapsed)
                            if who == "pccl" and len(marks) == 2:  # one data path: vote, data, completion
                                spans = (marks[0] - t0, marks[1] - marks[0], t0 + elapsed - marks[1])
                                for name, span in zip(("vote", "data", "done"), spans):
                                    out.setdefault((nbytes, f"{cfg}|{name}|{position}"), []).append(span)
                        elif result is not None:
                            warm[cfg] = result
                    if i == 0:
                        for kind in ("broadcast", "all_gather", "reduce_scatter"):
                            a, b = warm.get(f"gloo:{kind}"), warm.get(f"pccl:{kind}")
                            if a is None or b is None:
                                continue
                            if kind == "all_gather" and position is not None:
                                # Gloo's order is by process, pccl's by ring: compare as sets of parts.
                                a = np.sort(a.reshape(world, -1), axis=0)
                                b = np.sort(b.reshape(world, -1), axis=0)
                            if kind == "reduce_scatter":
                                continue  # the slices differ (process order vs ring order)
                            if not np.allclose(a, b, rtol=1e-4, atol=1e-4):
                                raise RuntimeError(f"{format_size(nbytes)}: pccl's and Gloo's {kind} differ")
                        warm.clear()
            await barrier()
        return out

    try:
        if phases:
            with pccl.testing.plant_execute_fault(marking):
                return trio.run(run)
        return trio.run(run)
    finally:
        dist.destroy_process_group()


def measure(world: int, sizes: list[int], iters: int, configs: list[str], timeout: float,
            phases: bool = False, fast_commit: bool = False, peer_commit: bool = False,
            local_socket_buffer_size: int | None = None) -> list[dict[str, Any]]:
    per_rank = run_cluster(world, _peer_main, (sizes, iters, configs, phases, fast_commit, peer_commit,
                                               local_socket_buffer_size), timeout, "pccl-collectives-")
    if phases:
        print(format_phases(world, per_rank), flush=True)
    rows = []
    for nbytes in sizes:
        for cfg in configs:
            samples = [per_rank[r][(nbytes, cfg)] for r in range(world)]
            times = [max(s[i] for s in samples) for i in range(iters)]
            rows.append({"N": world, "bytes": nbytes, "cfg": cfg, "median": statistics.median(times),
                         "min": min(times)})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>3} {'size':>8} {'config':>20} {'median ms':>10} {'min ms':>9} {'busbw GB/s':>11} "
             f"{'gloo/pccl':>10} {'of AR':>6}"]
    by = {(r["N"], r["bytes"], r["cfg"]): r["median"] for r in rows}
    for r in rows:
        who, kind = r["cfg"].split(":")
        _, busbw = bus_bandwidth(r["bytes"], r["N"], r["median"], kind)
        gloo = by.get((r["N"], r["bytes"], f"gloo:{kind}"))
        ratio = f"{gloo / r['median']:.3f}" if who == "pccl" and gloo else "-"
        ar = by.get((r["N"], r["bytes"], "pccl:all_reduce"))
        of_ar = f"{r['median'] / ar:.2f}" if who == "pccl" and kind == "reduce_scatter" and ar else "-"
        lines.append(f"{r['N']:>3} {format_size(r['bytes']):>8} {r['cfg']:>20} {r['median'] * 1e3:>10.1f} "
                     f"{r['min'] * 1e3:>9.1f} {busbw / 1e9:>11.3f} {ratio:>10} {of_ar:>6}")
    return "\n".join(lines)


def format_phases(world: int, per_rank: dict[int, dict[tuple[int, str], list[float]]]) -> str:
    """``--phases``: per pccl config, size and ring position, the median vote, data and
    completion spans (ms) of its calls."""
    spans: dict[tuple[int, str, int], dict[str, float]] = {}
    for out in per_rank.values():
        for (nbytes, key), values in out.items():
            if "|" in key:
                cfg, name, at = key.split("|")
                spans.setdefault((nbytes, cfg, int(at)), {})[name] = statistics.median(values)
    lines = [f"{'N':>3} {'size':>8} {'config':>20} {'position':>8} {'vote ms':>8} {'data ms':>8} {'done ms':>8}"]
    for (nbytes, cfg, position), got in sorted(spans.items()):
        lines.append(f"{world:>3} {format_size(nbytes):>8} {cfg:>20} {position:>8} {got['vote'] * 1e3:>8.2f} "
                     f"{got['data'] * 1e3:>8.2f} {got['done'] * 1e3:>8.2f}")
    return "\n".join(lines)


def _library_default() -> bool:
    import pccl

    return bool(pccl.Config().fast_commit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--sizes", nargs="+", default=["64M"], help="buffer sizes (16K, 64M, ...)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per configuration and size")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one group size may take")
    parser.add_argument("--rate", help="shape the loopback to RATE (tc tbf, e.g. 4gbit) in a fresh network "
                                       "namespace the run happens in; needs root")
    parser.add_argument("--phases", action="store_true",
                        help="also print each pccl call's vote, data path and completion (median ms per ring position)")
    parser.add_argument("--fast-commit", action=argparse.BooleanOptionalAction, default=_library_default(),
                        help="pccl's peers run with Config.fast_commit (the call skips the master's vote; "
                             "the library's default) or without it (every call votes)")
    parser.add_argument("--peer-commit", action="store_true",
                        help="pccl's peers also run with Config.peer_commit (completion agreed among them, "
                             "no master round trip in the steady state; needs fast commit)")
    parser.add_argument("--local-socket-buffer-size", type=parse_size,
                        help="pccl's peers' Config.local_socket_buffer_size (e.g. 256K; 0: the OS's default and "
                             "autotuning; default: the library's)")
    args = parser.parse_args(argv)
    if args.peer_commit and not args.fast_commit:
        parser.error("--peer-commit needs fast commit")
    if args.rate and os.environ.get(_NETNS_ENV) != args.rate:
        return _rerun_shaped(args.rate, sys.argv[1:] if argv is None else argv)
    sizes = [parse_size(s) for s in args.sizes]
    configs = args.configs.split(",")
    link = f"loopback shaped to {args.rate} (tbf)" if args.rate else "loopback"
    commit = "peer commit" if args.peer_commit else "fast commit" if args.fast_commit else "voted commit"
    if args.local_socket_buffer_size is not None:
        size = args.local_socket_buffer_size
        commit += f", local socket buffers {format_size(size) if size else 'autotuned'}"
    print(f"# pccl vs Gloo, float32, {link}, pccl {commit}, interleaved; {args.iters} iterations", flush=True)
    for world in args.peers:
        print(format_rows(measure(world, sizes, args.iters, configs, args.timeout, args.phases, args.fast_commit,
                                  args.peer_commit, args.local_socket_buffer_size)),
              flush=True)
    return 0


_NETNS_ENV = "PCCL_BENCH_SHAPED_RATE"


def _rerun_shaped(rate: str, argv: list[str]) -> int:
    """Run this script again inside a new network namespace whose ``lo`` is shaped to ``rate``."""
    ns = f"pccl-bench-{os.getpid()}"
    setup = [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"],
             ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
              "burst", "4mb", "latency", "100ms"]]
    try:
        for command in setup:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                print(f"{' '.join(command)}: {done.stderr.strip()} (--rate needs root and iproute2's ip/tc)",
                      file=sys.stderr)
                return 2
        return subprocess.call(["ip", "netns", "exec", ns, sys.executable, __file__, *argv],
                               env={**os.environ, _NETNS_ENV: rate})
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
