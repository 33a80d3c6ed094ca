"""The fixed cost per collective on loopback: pccl's all-reduce and broadcast beside torch Gloo's,
4 B to 1 MiB, call by call in turn in the same processes.

    .venv/bin/python benchmarks/latency.py [--peers 2 3 4] [--sizes 4 64 1K 16K 64K 256K 1M]
                                           [--iters 50] [--collectives all_reduce broadcast]
                                           [--clock group|slowest] [--[no-]fast-commit] [--peer-commit]
                                           [--floor]

Each peer process holds a pccl communicator and a Gloo process group (the cluster of
``interleaved_gloo.py``).  For every size, each iteration times one call of each configuration
(Gloo's and pccl's all-reduce and broadcast) in an order shuffled afresh, the same on every
rank, so the machine's drift hits all alike.  Before each call the buffer is refreshed from the
input and the peers meet at a barrier (a small pccl all-reduce); the untimed first iteration
checks that pccl's results equal Gloo's (broadcast exactly, all-reduce to float tolerance).

What is timed is the collective's fixed cost as a group sees it: from the moment the *last* peer
calls to the moment the last peer's call returns (every rank notes both on the host's monotonic
clock, which all processes share).  So the skew with which the peers leave the barrier is not
counted, for either library, and the ranks that arrive early wait in the call as they would in
a training loop.  Gloo's call runs in a worker thread (the Trio loop keeps serving pccl's
connections meanwhile) and notes its times there, so the hand-off to the thread is not counted
either.  pccl's call goes through the public API: the master's round trips are included.
``--clock slowest`` times instead as ``pccl bench`` and ``interleaved_gloo.py`` do: each rank's
own call, the slowest rank's per iteration (the barrier's skew included).  ``--fast-commit``
(the library's default) runs pccl's peers with ``Config.fast_commit`` (the call skips the
master's vote: one round trip per collective instead of two); ``--no-fast-commit`` votes.
``--peer-commit`` adds ``Config.peer_commit`` (the participants agree on completion among
themselves: no master round trip in the steady state; needs fast commit).

The table shows, per group size, size and collective, the median and the minimum over
iterations of Gloo and of pccl, and Gloo's over pccl's (above 1: pccl faster).  ``--floor`` adds
two more all-reduces, timed the same way in the same processes: the floor of pccl's protocol
shape (``small_op_floor.py``: one-way Begin, the data, Done and the master's Complete, with
nothing else around them), and the floor of peer commit's (the Done one-way, then an ack from
every other peer), with their medians and minima.
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import sys
import time
from typing import Any

import numpy as np

from pccl.tools.bench import admit, format_size, free_port

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from interleaved_gloo import checked_sizes, gloo_rank_of, pccl_barrier, run_cluster  # noqa: E402
from small_op_floor import FloorPeer, start_master  # noqa: E402

COLLECTIVES = ("all_reduce", "broadcast")
DEFAULT_SIZES = ("4", "64", "1K", "16K", "64K", "256K", "1M")
_TAGS = {"all_reduce": 1, "broadcast": 2}

#: One call's (start, end) on the host's monotonic clock, per (size, config), per iteration.
Spans = dict[tuple[int, str], list[tuple[float, float]]]


def _peer_main(rank: int, world: int, master_port: int, gloo_file: str, sizes: list[int], iters: int,
               configs: list[str], fast_commit: bool = False, peer_commit: bool = False,
               floor_port: int = 0) -> Spans:
    import torch
    import torch.distributed as dist
    import trio

    import pccl

    dist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=world)

    async def run() -> Spans:
        spans: Spans = {}
        config = pccl.Config(fast_commit=fast_commit, peer_commit=peer_commit)
        async with pccl.open_communicator(f"127.0.0.1:{master_port}", config=config) as comm:
            await admit(comm, world)
            root = min(comm.ring)
            gloo_root = gloo_rank_of(comm, root, rank, world)
            barrier = pccl_barrier(comm)
            floor = await FloorPeer.connect(rank, world, floor_port) if floor_port else None
            for nbytes in sizes:
                src = np.random.default_rng(rank).standard_normal(nbytes // 4, dtype=np.float32)
                buf = src.copy()
                tensor = torch.from_numpy(buf)  # shares buf's memory

                def gloo(kind: str) -> tuple[float, float]:
                    t0 = time.perf_counter()
                    if kind == "all_reduce":
                        dist.all_reduce(tensor)
                    else:
                        dist.broadcast(tensor, src=gloo_root)
                    return t0, time.perf_counter()

                warm: dict[str, np.ndarray] = {}
                for i in range(iters + 1):  # iteration 0 warms up and checks
                    for cfg in random.Random(i).sample(configs, len(configs)):
                        who, kind = cfg.split(":")
                        np.copyto(buf, src)
                        await barrier()
                        if who == "gloo":
                            span = await trio.to_thread.run_sync(gloo, kind)
                        elif who.startswith("floor"):
                            assert floor is not None
                            t0 = time.perf_counter()
                            await floor.all_reduce(buf, tag=_TAGS[kind], acks=who == "floor-acks")
                            span = (t0, time.perf_counter())
                        else:
                            t0 = time.perf_counter()
                            if kind == "all_reduce":
                                await comm.all_reduce(buf, tag=_TAGS[kind])
                            else:
                                await comm.broadcast(buf, root=root, tag=_TAGS[kind])
                            span = (t0, time.perf_counter())
                        if i:
                            spans.setdefault((nbytes, cfg), []).append(span)
                        else:
                            warm[cfg] = buf.copy()
                    if i == 0:
                        _check_agree(warm, nbytes)
            await barrier()  # nobody leaves while others time
            if floor is not None:
                floor.close()
        return spans

    try:
        return trio.run(run)
    finally:
        dist.destroy_process_group()


def _check_agree(warm: dict[str, np.ndarray], nbytes: int) -> None:
    """pccl's warm-up results equal Gloo's: a broadcast bit for bit, an all-reduce to float
    tolerance (the summation orders differ)."""
    for kind in COLLECTIVES:
        gloos = warm.get(f"gloo:{kind}")
        for who in ("pccl", "floor", "floor-acks"):
            ours = warm.get(f"{who}:{kind}")
            if ours is None or gloos is None:
                continue
            same = (np.array_equal(ours, gloos) if kind == "broadcast"
                    else np.allclose(ours, gloos, rtol=1e-4, atol=1e-5))
            if not same:
                raise RuntimeError(f"{format_size(nbytes)}: {who}'s and Gloo's {kind} results differ")


def group_times(per_rank: list[list[tuple[float, float]]]) -> list[float]:
    """Per iteration, from the last rank's start to the last rank's end (``--clock group``)."""
    return [max(end for _, end in calls) - max(start for start, _ in calls) for calls in zip(*per_rank)]


def slowest_times(per_rank: list[list[tuple[float, float]]]) -> list[float]:
    """Per iteration, the slowest rank's own call (``--clock slowest``)."""
    return [max(end - start for start, end in calls) for calls in zip(*per_rank)]


CLOCKS = {"group": group_times, "slowest": slowest_times}


def measure(world: int, sizes: list[int], iters: int, configs: list[str], timeout: float,
            clock: str = "group", fast_commit: bool = False, peer_commit: bool = False) -> list[dict[str, Any]]:
    floor_master, floor_port = None, 0
    if any(cfg.startswith("floor") for cfg in configs):
        floor_port = free_port()
        floor_master = start_master(world, floor_port)
    try:
        per_rank = run_cluster(world, _peer_main, (sizes, iters, configs, fast_commit, peer_commit, floor_port),
                               timeout, "pccl-latency-")
    finally:
        if floor_master is not None:
            floor_master.terminate()
            floor_master.join(5)
    rows = []
    for nbytes in sizes:
        for cfg in configs:
            times = CLOCKS[clock]([per_rank[r][(nbytes, cfg)] for r in range(world)])
            rows.append({"N": world, "bytes": nbytes, "cfg": cfg, "median": statistics.median(times),
                         "min": min(times)})
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """One line per group size, size and collective: Gloo's and pccl's median and min (ms) and
    Gloo's over pccl's; with ``--floor``, the floor's median and min too."""
    by = {(r["N"], r["bytes"], r["cfg"]): r for r in rows}
    floors = any(r["cfg"].startswith("floor") for r in rows)
    lines = [f"{'N':>3} {'size':>6} {'collective':>11} {'gloo med':>9} {'gloo min':>9} {'pccl med':>9} "
             f"{'pccl min':>9} {'gloo/pccl med':>14} {'gloo/pccl min':>14}"
             + (f" {'floor med':>10} {'floor min':>10} {'acks med':>9} {'acks min':>9}" if floors else "")]
    for key in dict.fromkeys((r["N"], r["bytes"], r["cfg"].split(":")[1]) for r in rows):
        world, nbytes, kind = key
        gloo, ours = by.get((world, nbytes, f"gloo:{kind}")), by.get((world, nbytes, f"pccl:{kind}"))
        floor, acks = by.get((world, nbytes, f"floor:{kind}")), by.get((world, nbytes, f"floor-acks:{kind}"))

        def ms(row: dict[str, Any] | None, what: str, width: int = 9) -> str:
            return f"{row[what] * 1e3:>{width}.3f}" if row else f"{'-':>{width}}"

        def ratio(what: str) -> str:
            return f"{gloo[what] / ours[what]:>14.2f}" if gloo and ours else f"{'-':>14}"

        lines.append(f"{world:>3} {format_size(nbytes):>6} {kind:>11} {ms(gloo, 'median')} {ms(gloo, 'min')} "
                     f"{ms(ours, 'median')} {ms(ours, 'min')} {ratio('median')} {ratio('min')}"
                     + (f" {ms(floor, 'median', 10)} {ms(floor, 'min', 10)} {ms(acks, 'median')} {ms(acks, 'min')}"
                        if floors else ""))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str]]:
    """The options, the sizes in bytes and the configurations (``"gloo:all_reduce"``, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="buffer sizes (4, 16K, 1M, ...)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per configuration and size")
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="group",
                        help="group: last rank's call to last return; slowest: the slowest rank's own call")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one group size may take")
    parser.add_argument("--fast-commit", action=argparse.BooleanOptionalAction, default=_library_default(),
                        help="pccl's peers run with Config.fast_commit (the call skips the master's vote; "
                             "the library's default) or without it (every call votes)")
    parser.add_argument("--peer-commit", action="store_true",
                        help="pccl's peers also run with Config.peer_commit (completion agreed among them, "
                             "no master round trip in the steady state; needs fast commit)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the floor of pccl's protocol shapes (small_op_floor.py) for all_reduce")
    args = parser.parse_args(argv)
    if args.peer_commit and not args.fast_commit:
        parser.error("--peer-commit needs fast commit")
    sizes = checked_sizes(parser, args)
    configs = [f"{who}:{kind}" for kind in dict.fromkeys(args.collectives) for who in ("gloo", "pccl")]
    if args.floor and "all_reduce" in args.collectives:
        configs += ["floor:all_reduce", "floor-acks:all_reduce"]
    return args, sizes, configs


def _library_default() -> bool:
    import pccl

    return bool(pccl.Config().fast_commit)


def main(argv: list[str] | None = None) -> int:
    args, sizes, configs = parse_args(argv)
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        print("latency.py needs torch (with Gloo) importable", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C does, so that run_cluster stops the master and the peers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    clock = "last call to last return" if args.clock == "group" else "the slowest rank's own call"
    commit = "peer commit" if args.peer_commit else "fast commit" if args.fast_commit else "voted commit"
    print(f"# fixed cost per collective, float32 on loopback, {clock}, pccl {commit}; {args.iters} iterations, "
          f"interleaved", flush=True)
    for world in dict.fromkeys(args.peers):
        print(format_rows(measure(world, sizes, args.iters, configs, args.timeout, args.clock, args.fast_commit,
                                  args.peer_commit)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
