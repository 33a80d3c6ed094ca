"""pccl and torch Gloo all-reducing the same buffer, op by op in turn, in the same processes.

    .venv/bin/python benchmarks/interleaved_gloo.py --peers 3 --sizes 64M 256M [--iters 10]

(Any torch with Gloo works: the test extra's, or one put on ``PYTHONPATH``.)

Why: on this shared 2-core machine, runs of the same code minutes apart differ by 10-20%, so two
implementations measured in separate runs (as an external harness does) can swap places from
one run to the next when they are close.  Here each peer process holds both a pccl communicator
and a Gloo process group over one float32 buffer, and every iteration times one call of each
configuration in turn (Gloo, pccl in place, pccl out of place, in an order shuffled afresh each
iteration, the same on every rank), so drift hits all of them alike.  Before each timed call the
buffer is refreshed from the input and the peers meet at a barrier (a small pccl all-reduce); the
untimed first iteration also checks that the configurations' results agree (to float tolerance:
the summation orders differ).  A call's time is the slowest rank's; the
table shows the median and the minimum over iterations, bus bandwidth from the median, the ratio
of Gloo's median to each configuration's (above 1: faster than Gloo), and the CPU time (user +
system, summed over the ranks) per call.

For bandwidth sizes: a small call's time here includes the skew with which the ranks leave the
barrier; ``latency.py`` times the fixed cost of small calls without it (from the last rank's
call to the last return).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import queue
import random
import resource
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from pccl.tools.bench import admit, bus_bandwidth, format_size, free_port, parse_size

CONFIGS = ("gloo", "in-place", "out-of-place")
#: The barriers' tag: one the timed calls never use.
BARRIER_TAG = 1 << 30
#: Below this size a row's Gloo figure is not Gloo's standalone latency (see the docstring).
_SMALL = 1 << 20


def _run_master(port: int, ready: Any) -> None:
    import trio

    import pccl

    async def serve() -> None:
        async with pccl.open_master(f"127.0.0.1:{port}"):
            ready.set()
            await trio.sleep_forever()

    trio.run(serve)


def _peer_main(rank: int, world: int, master_port: int, gloo_file: str, sizes: list[int], iters: int,
               configs: list[str]) -> dict[tuple[int, str], list[tuple[float, float]]]:
    import torch
    import torch.distributed as dist
    import trio

    import pccl

    dist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=world)

    def gloo_call(tensor: Any) -> float:
        # In a thread (timed there, so the hop is not counted): the Trio loop keeps serving the
        # master connection meanwhile.
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        return time.perf_counter() - t0

    def check_agree(results: dict[str, np.ndarray], nbytes: int) -> None:
        """The warm-up results of every configuration agree (float sums differ in order only)."""
        ref_name, ref = next(iter(results.items()))
        for name, result in results.items():
            if not np.allclose(result, ref, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(ref)))):
                raise RuntimeError(f"{format_size(nbytes)}: {name} and {ref_name} results differ")

    async def run() -> dict[tuple[int, str], list[tuple[float, float]]]:
        out: dict[tuple[int, str], list[tuple[float, float]]] = {}
        async with pccl.open_communicator(f"127.0.0.1:{master_port}") as comm:
            await admit(comm, world)
            barrier = pccl_barrier(comm)
            for nbytes in sizes:
                src = await trio.to_thread.run_sync(functools.partial(random_floats, rank, nbytes // 4))
                buf = src.copy()
                dst = np.empty_like(buf)
                tensor = torch.from_numpy(buf)  # shares buf's memory
                warm: dict[str, np.ndarray] = {}
                for i in range(iters + 1):  # iteration 0 warms up (page faults, scratch memory)
                    # A fresh order every iteration, the same on every rank (seeded by i), so
                    # that no configuration always runs first or after the same one.
                    for cfg in random.Random(i).sample(configs, len(configs)):
                        np.copyto(buf, src)
                        await barrier()
                        r0 = resource.getrusage(resource.RUSAGE_SELF)
                        t0 = time.perf_counter()
                        if cfg == "gloo":
                            elapsed = await trio.to_thread.run_sync(gloo_call, tensor)
                        elif cfg == "in-place":
                            await comm.all_reduce(buf, tag=0)
                        else:
                            await comm.all_reduce(buf, dst, tag=0)
                        if cfg != "gloo":
                            elapsed = time.perf_counter() - t0
                        r1 = resource.getrusage(resource.RUSAGE_SELF)
                        if i:
                            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
                            out.setdefault((nbytes, cfg), []).append((elapsed, cpu))
                        else:
                            warm[cfg] = (dst if cfg == "out-of-place" else buf).copy()
                    if i == 0:
                        check_agree(warm, nbytes)
                        warm.clear()
            await barrier()  # nobody leaves while others time
        return out

    try:
        return trio.run(run)
    finally:
        dist.destroy_process_group()


def checked_sizes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The common options checked (``--iters``, ``--peers``, ``--timeout``; a usage error
    otherwise) and ``--sizes`` in bytes, each once, in the order given."""
    if args.iters < 1 or any(n < 2 for n in args.peers) or not args.timeout > 0:
        parser.error("--iters must be at least 1, every --peers at least 2 and --timeout positive")
    try:
        sizes = list(dict.fromkeys(parse_size(s) for s in args.sizes))
    except ValueError as exc:
        parser.error(str(exc))
    if any(s < 4 or s % 4 for s in sizes):
        parser.error("sizes must be positive multiples of 4 bytes (float32 elements)")
    return sizes


def random_floats(seed: int, count: int) -> np.ndarray:
    """``count`` float32 normals from ``seed`` (the rank): every run's inputs alike."""
    return np.random.default_rng(seed).standard_normal(count, dtype=np.float32)


def pccl_barrier(comm: Any) -> Callable[[], Awaitable[object]]:
    """A barrier for the timed calls: a 16-byte all-reduce on :data:`BARRIER_TAG`."""
    small = np.ones(4, np.float32)

    async def barrier() -> object:
        small[:] = 1
        return await comm.all_reduce(small, tag=BARRIER_TAG)

    return barrier


def gloo_rank_of(comm: Any, peer_id: int, rank: int, world: int) -> int:
    """The Gloo rank of the process whose communicator is pccl's ``peer_id`` (a broadcast's
    root, for Gloo to broadcast from the same process).  Collective: every rank calls it, after
    the Gloo group is up (the ranks trade their peer ids in a Gloo all-reduce)."""
    import torch
    import torch.distributed as dist

    ids = torch.zeros(world, dtype=torch.int64)
    ids[rank] = comm.peer_id & 0x7FFFFFFFFFFFFFFF  # peer ids are unsigned 64-bit
    dist.all_reduce(ids)
    return int(ids.tolist().index(peer_id & 0x7FFFFFFFFFFFFFFF))


def _run_peer(peer_main: Any, rank: int, world: int, master_port: int, gloo_file: str, *args: Any) -> None:
    """A peer process: ``peer_main``'s result, or the traceback it raised, on the results queue
    (``args``' last item)."""
    *peer_args, results = args
    try:
        results.put((rank, peer_main(rank, world, master_port, gloo_file, *peer_args), None))
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
        raise


def run_cluster(world: int, peer_main: Any, peer_args: Any, timeout: float, prefix: str) -> dict[int, Any]:
    """Start a master process and ``world`` peer processes (spawn), each running
    ``peer_main(rank, world, master_port, gloo_file, *peer_args)`` (a module-level function);
    return every rank's result.  The first peer to fail (or die without reporting) raises,
    naming it; every process is stopped on the way out."""
    ctx = mp.get_context("spawn")
    ready, results = ctx.Event(), ctx.Queue()
    master_port = free_port()
    master = ctx.Process(target=_run_master, args=(master_port, ready), daemon=True)
    peers: list[Any] = []
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        try:
            master.start()
            started = time.monotonic()
            while not ready.wait(0.2):
                if master.exitcode is not None:
                    raise RuntimeError(f"the master exited at start (exit code {master.exitcode}); see above")
                if time.monotonic() - started > 30:
                    raise RuntimeError("the master did not start within 30 s")
            gloo_file = os.path.join(tmp, "gloo-rendezvous")
            peers = [ctx.Process(target=_run_peer,
                                 args=(peer_main, r, world, master_port, gloo_file, *peer_args, results))
                     for r in range(world)]
            for p in peers:
                p.start()
            deadline = time.monotonic() + timeout
            per_rank: dict[int, Any] = {}
            while len(per_rank) < world:
                try:
                    rank, out, error = results.get(timeout=1)
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"no result from peers {sorted(set(range(world)) - set(per_rank))} "
                                           f"within {timeout:g} s") from None
                    dead = [r for r, p in enumerate(peers) if p.exitcode is not None and r not in per_rank]
                    if dead:  # died without reporting (killed, or the interpreter crashed)
                        raise RuntimeError(f"peer {dead[0]} exited with code {peers[dead[0]].exitcode} "
                                           "without a result") from None
                    continue
                if error is not None:  # the first peer to fail is the one to blame
                    raise RuntimeError(f"peer {rank} failed:\n{error}")
                per_rank[rank] = out
            for p in peers:
                p.join()
        finally:
            for p in (*peers, master):
                if p.is_alive():
                    p.terminate()
            for p in (*peers, master):
                if p.pid is not None:  # started (join() refuses a process that never was)
                    p.join(5)
    return per_rank


def measure(world: int, sizes: list[int], iters: int, configs: list[str], timeout: float) -> list[dict[str, Any]]:
    per_rank = run_cluster(world, _peer_main, (sizes, iters, configs), timeout, "pccl-interleaved-")
    rows = []
    for nbytes in sizes:
        for cfg in configs:
            samples = [per_rank[r][(nbytes, cfg)] for r in range(world)]
            times = [max(s[i][0] for s in samples) for i in range(iters)]
            cpu = [sum(s[i][1] for s in samples) for i in range(iters)]
            rows.append({"N": world, "bytes": nbytes, "cfg": cfg, "median": statistics.median(times),
                         "min": min(times), "cpu": statistics.median(cpu)})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'N':>3} {'size':>8} {'config':>13} {'median ms':>10} {'min ms':>9} {'busbw GB/s':>11} "
             f"{'gloo/this':>10} {'cpu ms':>8}"]
    gloo = {(r["N"], r["bytes"]): r["median"] for r in rows if r["cfg"] == "gloo"}
    for r in rows:
        _, busbw = bus_bandwidth(r["bytes"], r["N"], r["median"])
        ref = gloo.get((r["N"], r["bytes"]))
        ratio = f"{ref / r['median']:.3f}" if ref else "-"
        lines.append(f"{r['N']:>3} {format_size(r['bytes']):>8} {r['cfg']:>13} {r['median'] * 1e3:>10.1f} "
                     f"{r['min'] * 1e3:>9.1f} {busbw / 1e9:>11.3f} {ratio:>10} {r['cpu'] * 1e3:>8.0f}")
    if any(r["bytes"] < _SMALL for r in rows):
        lines.append(f"(sizes under {format_size(_SMALL)}: the barrier's skew counts here; compare latency with "
                     "benchmarks/latency.py)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[3])
    parser.add_argument("--sizes", nargs="+", default=["64M", "256M"], help="buffer sizes (16K, 64M, ...)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per configuration and size")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {CONFIGS}")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one group size may take")
    args = parser.parse_args(argv)
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        parser.error("needs torch (with Gloo) importable: see the module docstring for PYTHONPATH")
    configs = list(dict.fromkeys(args.configs.split(",")))  # repeated names would pool their samples
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {CONFIGS}")
    sizes = checked_sizes(parser, args)
    # SIGTERM unwinds like Ctrl-C does, so that measure() stops the master and the peers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rows = []
    for world in dict.fromkeys(args.peers):
        rows += measure(world, sizes, args.iters, configs, args.timeout)
        print(format_rows([r for r in rows if r["N"] == world]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
