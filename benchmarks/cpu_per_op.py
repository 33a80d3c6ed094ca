"""A peer's CPU per small collective on loopback: back-to-back calls, no Gloo, no barrier.

    .venv/bin/python benchmarks/cpu_per_op.py [--peers 2] [--size 16K] [--calls 1000]
                                              [--collective all_reduce|broadcast] [--peer-commit]
                                              [--profile [--sort tottime] [--top 25]]

A master process and ``--peers`` peer processes (``interleaved_gloo.py``'s cluster); every peer
makes ``--calls`` calls of one collective on one float32 buffer of ``--size`` bytes, back to back
(after 50 untimed ones), and notes over them:

- its CPU (``time.process_time``: user + system of the whole process) per call, in µs, and the
  system (kernel) part of it (``getrusage``);
- the wall time per call, in µs (on a loaded machine: CPU that the others' processes took);
- the passes of its Trio run loop per call (the times it waited for I/O, a Trio instrument).

The peers run with the library's default ``Config`` (fast commit); ``--peer-commit`` adds
``Config.peer_commit`` (completion agreed among the peers by acks round the ring).

With ``--profile`` a second, shorter run (``--calls`` / 4) counts the Python function calls per
collective under ``cProfile`` (timed on the process's CPU clock; the profiler inflates CPU four
to five times, so that run's times are not in the table) and prints rank 0's top functions by
own time (``--sort cumulative``: by time under them).  Runs of the same code minutes apart differ by 10-20 %
on the shared machine: compare two revisions by running them alternately (``ab_revisions.py``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import resource
import signal
import sys
import time
from typing import Any

import numpy as np

from pccl.tools.bench import admit, format_size, parse_size

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from interleaved_gloo import run_cluster  # noqa: E402

WARMUP = 50


def _peer_main(rank: int, world: int, master_port: int, _gloo_file: str, nbytes: int, calls: int,
               collective: str, profile: bool, sort: str, top: int, peer_commit: bool = False) -> dict[str, Any]:
    import trio

    import pccl

    class Passes(trio.abc.Instrument):
        count = 0

        def before_io_wait(self, timeout: float) -> None:
            Passes.count += 1

    async def run() -> dict[str, Any]:
        config = pccl.Config(peer_commit=peer_commit)
        async with pccl.open_communicator(f"127.0.0.1:{master_port}", config=config) as comm:
            await admit(comm, world)
            root = min(comm.ring)
            buf = np.random.default_rng(rank).standard_normal(max(1, nbytes // 4), dtype=np.float32)

            async def call() -> None:
                if collective == "all_reduce":
                    buf[:] = 1.0  # keep the values finite over a thousand sums
                    await comm.all_reduce(buf, tag=1)
                else:
                    await comm.broadcast(buf, root=root, tag=2)

            for _ in range(WARMUP):
                await call()
            instrument = Passes()
            trio.lowlevel.add_instrument(instrument)
            usage0 = resource.getrusage(resource.RUSAGE_SELF)
            passes0, cpu0, wall0 = Passes.count, time.process_time(), time.perf_counter()
            for _ in range(calls):
                await call()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            passes = Passes.count - passes0
            usage = resource.getrusage(resource.RUSAGE_SELF)
            trio.lowlevel.remove_instrument(instrument)
            out: dict[str, Any] = {"cpu_us": cpu / calls * 1e6, "wall_us": wall / calls * 1e6,
                                   "sys_us": (usage.ru_stime - usage0.ru_stime) / calls * 1e6,
                                   "passes": passes / calls}
            if profile:
                n = max(1, calls // 4)
                prof = cProfile.Profile(time.process_time)
                prof.enable()
                for _ in range(n):
                    await call()
                prof.disable()
                stats = pstats.Stats(prof)
                out["py_calls"] = stats.total_calls / n  # type: ignore[attr-defined]
                if rank == 0:
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats(sort).print_stats(top)
                    out["top"] = text.getvalue()
            return out

    return trio.run(run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--size", default="16K", help="buffer size in bytes (4, 16K, 1M, ...)")
    parser.add_argument("--calls", type=int, default=1000, help="timed calls per peer")
    parser.add_argument("--collective", choices=("all_reduce", "broadcast"), default="all_reduce")
    parser.add_argument("--profile", action="store_true", help="count Python calls per op (cProfile)")
    parser.add_argument("--sort", default="tottime", help="--profile: the order of the top functions (pstats key)")
    parser.add_argument("--top", type=int, default=25, help="--profile: how many top functions to print")
    parser.add_argument("--peer-commit", action="store_true",
                        help="the peers run with Config.peer_commit (completion agreed among them by acks)")
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args(argv)
    if args.peers < 2 or args.calls < 1:
        parser.error("--peers must be at least 2 and --calls at least 1")
    nbytes = parse_size(args.size)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    per_rank = run_cluster(args.peers, _peer_main, (nbytes, args.calls, args.collective, args.profile, args.sort, args.top,
                                                          args.peer_commit),
                           args.timeout, "pccl-cpu-per-op-")
    commit = "peer commit" if args.peer_commit else "the default commit"
    print(f"# {args.collective} of {format_size(nbytes)} at N={args.peers}, {args.calls} back-to-back calls per peer, "
          f"{commit}")
    print(f"{'rank':>4} {'cpu µs/op':>10} {'of it sys':>10} {'wall µs/op':>11} {'passes/op':>10} {'py calls/op':>12}")
    for rank in sorted(per_rank):
        r = per_rank[rank]
        calls = f"{r['py_calls']:>12.0f}" if "py_calls" in r else f"{'-':>12}"
        print(f"{rank:>4} {r['cpu_us']:>10.0f} {r['sys_us']:>10.0f} {r['wall_us']:>11.0f} {r['passes']:>10.2f} {calls}")
    if "top" in per_rank.get(0, {}):
        print(per_rank[0]["top"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
