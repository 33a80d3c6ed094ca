"""Collective benchmark: a master and N peers as OS processes on loopback (``pccl bench``).

nccl-tests conventions: ``time`` is, per iteration, the slowest peer's wall time of the
call(s), then the median over iterations; ``algbw = size / time`` and ``busbw = algbw x``
the collective's factor — what each peer's links carry: ``2 (N - 1) / N`` for all-reduce,
``(N - 1) / N`` for all-gather and reduce-scatter (``size`` is the whole gathered buffer, each
peer contributing ``size / N``; the whole buffer reduce-scattered), ``1`` for broadcast (the
root the smallest peer id).  ``--collective`` picks them (default all-reduce).  Everything goes
through the public API — :func:`pccl.open_master`, :func:`pccl.open_communicator`,
:meth:`pccl.Communicator.all_reduce` — so the master round trips of every operation are
included.  Buffers are float32, reduced with SUM in place (so the input backup that makes
aborts restorable is included too; ``--out-of-place`` reduces into a separate array instead);
the inputs are refilled before each iteration, untimed, and the peers meet at a tiny untimed all-reduce (a barrier) before each timed one.

``--concurrency k`` splits the buffer into ``k`` slices all-reduced at once under distinct
tags; ``--quant u8``/``u16``/``u4b128`` uses MIN_MAX quantization (u4b128: 4 bits, blocks of 128).

Roles: the driver (:func:`main`) starts ``python -m pccl.tools.bench master`` and
``python -m pccl.tools.bench peer`` processes; peers write their timings to a JSON file.
:func:`run_group` is the reusable part (``benchmarks/shared_bench/pccl_trio_bench.py`` uses it).
This is a measurement tool, not library code: it uses wall-clock time freely.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "run_group", "parse_size", "format_size", "bus_bandwidth", "admit", "free_port"]

_QUANT_NAMES = ("none", "u8", "u16", "u4b128")
#: Timed iterations per size (before ``--iters-scale``): small ones are cheap and noisy.
_BASE_ITERS = ((1 << 20, 30), (16 << 20, 10), (64 << 20, 6), (1 << 62, 4))
_BARRIER_TAG = 1 << 30
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
#: busbw = algbw x this (nccl-tests' factors; N the group size).
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def parse_size(text: str) -> int:
    """``"16K"``, ``"64M"``, ``"1G"``, ``"4096"`` → bytes (binary units)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def bus_bandwidth(nbytes: int, world: int, seconds: float, collective: str = "all_reduce") -> tuple[float, float]:
    """``(algbw, busbw)`` in bytes/s."""
    alg = nbytes / seconds
    return alg, alg * _BUS_FACTOR[collective](world)


def _iterations(nbytes: int, scale: float) -> int:
    base = next(n for limit, n in _BASE_ITERS if nbytes <= limit)
    return max(3, round(base * scale))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for benchmark masters)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the processes ---------------------------------------------------------------------------------


def _run_master(port: int) -> None:
    import trio

    import pccl

    async def serve() -> None:
        async with pccl.open_master(f"127.0.0.1:{port}"):
            print("MASTER_READY", flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # the driver closes stdin when done

    trio.run(serve)


async def admit(comm: Any, world: int, *, timeout: float = 120.0) -> None:
    """Admit pending peers into ``comm``'s group (``update_topology``) until it has ``world``
    peers; ``RuntimeError`` after ``timeout`` seconds.  For benchmark peers started together."""
    import trio

    deadline = time.monotonic() + timeout
    while comm.world_size < world:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group never reached {world} peers within {timeout:g} s")
        if await comm.are_peers_pending():
            await comm.update_topology()
        else:
            await trio.sleep(0.01)


def _run_peer(args: argparse.Namespace) -> None:
    import numpy as np
    import trio

    import pccl

    quants = {"none": None, "u8": pccl.Quantization(dtype=np.uint8), "u16": pccl.Quantization(dtype=np.uint16),
              "u4b128": pccl.Quantization(dtype="uint4", block=128)}

    def make_inputs(count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        base = np.random.default_rng(1234).standard_normal(count, dtype=np.float32)
        inputs = base * np.float32(args.index + 1)  # peer r contributes (r+1)*base
        return base, inputs, inputs.copy()

    async def run() -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        config = pccl.Config()
        if args.local_socket_buffer_size is not None:
            config = pccl.Config(local_socket_buffer_size=args.local_socket_buffer_size)
        async with pccl.open_communicator(f"127.0.0.1:{args.port}", config=config) as comm:
            await admit(comm, args.world)
            small = np.ones(4, np.float32)
            root = min(comm.ring)

            async def barrier() -> None:
                small[:] = 1
                await comm.all_reduce(small, tag=_BARRIER_TAG)

            for collective in args.collective:
                for quant_name in args.quant:
                    quant = quants[quant_name]
                    for conc in args.concurrency:
                        for nbytes in args.sizes:
                            total = max(nbytes // 4, 1)
                            # all-gather: each peer contributes its share of the gathered buffer.
                            count = max(total // args.world, 1) if collective == "all_gather" else total
                            # Seconds of numpy work for large buffers: in a thread, so that this
                            # peer's Trio loop keeps answering the master's heartbeats meanwhile.
                            base, inputs, buf = await trio.to_thread.run_sync(make_inputs, count)
                            out = np.empty_like(buf) if args.out_of_place and collective == "all_reduce" else buf
                            step = -(-count // conc)
                            slices = [(buf[a : a + step], out[a : a + step]) for a in range(0, count, step)]
                            last: list[Any] = [None] * len(slices)

                            async def call(i: int, piece: np.ndarray, result: np.ndarray) -> None:
                                if collective == "all_reduce":
                                    last[i] = await comm.all_reduce(piece, result, op=pccl.ReduceOp.SUM, tag=i,
                                                                    quantization=quant)
                                elif collective == "broadcast":
                                    last[i] = await comm.broadcast(piece, root=root, tag=i, quantization=quant)
                                elif collective == "all_gather":
                                    last[i] = await comm.all_gather(piece, tag=i, quantization=quant)
                                else:
                                    last[i] = await comm.reduce_scatter(piece, op=pccl.ReduceOp.SUM, tag=i,
                                                                        quantization=quant)

                            async def one_call() -> tuple[float, float]:
                                await trio.to_thread.run_sync(np.copyto, buf, inputs)
                                await barrier()
                                t0 = time.perf_counter()
                                if len(slices) == 1:
                                    await call(0, *slices[0])
                                else:
                                    async with trio.open_nursery() as nursery:
                                        for i, (piece, result) in enumerate(slices):
                                            nursery.start_soon(call, i, piece, result)
                                return t0, time.perf_counter()

                            warmups = 1 if nbytes >= 256 << 20 else 2
                            for _ in range(warmups):
                                await one_call()
                            times = []
                            for _ in range(_iterations(nbytes, args.iters_scale)):
                                t0, t1 = await one_call()
                                times.append(t1 - t0)
                            rel = await trio.to_thread.run_sync(_result_error, collective, base, out, last, step,
                                                                args.world)
                            del base, inputs, buf, out, slices, last
                            results.append({"collective": collective, "quant": quant_name, "conc": conc,
                                            "bytes": (count * args.world if collective == "all_gather" else count) * 4,
                                            "times": times, "max_rel_err": rel})
            await barrier()  # nobody leaves while others still run
        return results

    results = trio.run(run)
    with open(args.result_file, "w") as f:
        json.dump({"index": args.index, "results": results}, f)


def _result_error(collective: str, base: Any, out: Any, last: Sequence[Any], step: int, world: int) -> float:
    """The largest relative error of the last iteration's results.  Peer ``r`` contributes
    ``(r + 1) * base``: a sum is ``world (world + 1) / 2 * base``; a broadcast or gathered array is
    ``f * base`` for the factor ``f`` of the peer it came from (read off the result itself)."""
    import numpy as np

    def error(expect: Any, result: Any) -> float:
        scale = max(float(np.max(np.abs(expect), initial=0.0)), 1e-30)
        return float(np.max(np.abs(result.astype(np.float64) - expect), initial=0.0)) / scale

    def factor_error(part: Any, result: Any) -> float:
        if not part.size:
            return 0.0
        factor = float(np.round(np.median(result[:1000].astype(np.float64) / part[:1000])))
        return error(part.astype(np.float64) * factor, result) if 1 <= factor <= world else float("inf")

    total = world * (world + 1) / 2
    worst = 0.0
    for i, info in enumerate(last):
        part = base[i * step : (i + 1) * step]
        if collective == "all_reduce":
            worst = max(worst, error(part * total, out[i * step : (i + 1) * step]))
        elif collective == "broadcast":
            worst = max(worst, factor_error(part, out[i * step : (i + 1) * step]))
        elif collective == "all_gather":
            worst = max([worst, *(factor_error(part, array) for array in info.arrays)])
        else:
            piece = out[i * step : (i + 1) * step]
            worst = max(worst, error(part[info.start:info.stop] * total, piece[info.start:info.stop]))
    return worst


# --- the driver ------------------------------------------------------------------------------------


def run_group(
    world: int,
    *,
    sizes: Sequence[int],
    quant: Sequence[str] = ("none",),
    concurrency: Sequence[int] = (1,),
    collectives: Sequence[str] = ("all_reduce",),
    iters_scale: float = 1.0,
    timeout: float = 1800.0,
    logdir: str | None = None,
    python: str = sys.executable,
    out_of_place: bool = False,
    local_socket_buffer_size: int | None = None,
) -> list[dict[str, Any]]:
    """Run one master and ``world`` peers through every (collective, quant, concurrency, size) and
    return one row per configuration: ``{collective, quant, conc, N, bytes, times (per-iteration max over peers),
    per_rank_times, max_rel_err}``.  Raises ``RuntimeError`` if a process fails (its logs stay
    in ``logdir``; a temporary one is removed after a run that succeeded)."""
    own_logdir = logdir is None
    logdir = logdir or tempfile.mkdtemp(prefix="pccl-bench-")
    os.makedirs(logdir, exist_ok=True)
    # -P: the children import the installed pccl even when the current directory holds a pccl/
    # (``python -m`` would put it first on sys.path).
    python_m = [python, "-P", "-m", "pccl.tools.bench"]
    port = free_port()
    master_log = open(os.path.join(logdir, f"master_N{world}.log"), "w")
    master = subprocess.Popen([*python_m, "master", "--port", str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=master_log, text=True)
    peers: list[tuple[subprocess.Popen[str], str, Any]] = []
    try:
        line = master.stdout.readline() if master.stdout else ""
        if not line.startswith("MASTER_READY"):
            raise RuntimeError(f"master did not start; see {master_log.name}")
        for index in range(world):
            result_file = os.path.join(logdir, f"peer_N{world}_{index}.json")
            if os.path.exists(result_file):
                os.remove(result_file)
            log = open(os.path.join(logdir, f"peer_N{world}_{index}.log"), "w")
            cmd = [*python_m, "peer", "--port", str(port), "--world", str(world),
                   "--index", str(index), "--result-file", result_file, "--iters-scale", str(iters_scale),
                   "--sizes", *map(str, sizes), "--quant", *quant, "--concurrency", *map(str, concurrency),
                   "--collective", *collectives]
            if out_of_place:
                cmd.append("--out-of-place")
            if local_socket_buffer_size is not None:
                cmd += ["--local-socket-buffer-size", str(local_socket_buffer_size)]
            peers.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), result_file, log))
        outputs = []
        deadline = time.monotonic() + timeout
        for proc, result_file, log in peers:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            log.close()
            if proc.returncode != 0 or not os.path.exists(result_file):
                raise RuntimeError(f"peer failed (exit {proc.returncode}); see {log.name}")
            with open(result_file) as f:
                outputs.append(json.load(f)["results"])
    finally:
        for proc, _, _ in peers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if master.stdin:
            master.stdin.close()
        try:
            master.wait(timeout=10)
        except subprocess.TimeoutExpired:
            master.kill()
            master.wait()
        master_log.close()
    if own_logdir:  # nothing failed: the logs are not worth keeping
        shutil.rmtree(logdir, ignore_errors=True)
    rows = []
    for k, first in enumerate(outputs[0]):
        per_rank = [out[k]["times"] for out in outputs]
        rows.append({
            "collective": first["collective"], "quant": first["quant"], "conc": first["conc"], "N": world, "bytes": first["bytes"],
            "times": [max(ts) for ts in zip(*per_rank)], "per_rank_times": per_rank,
            "max_rel_err": max(out[k]["max_rel_err"] for out in outputs),
        })
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [f"{'collective':>14} {'N':>3} {'size':>8} {'quant':>5} {'conc':>4} {'iters':>5} {'time ms':>10} "
             f"{'min ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11} {'rel err':>9}"]
    for r in rows:
        t = statistics.median(r["times"])
        collective = r.get("collective", "all_reduce")
        alg, bus = bus_bandwidth(r["bytes"], r["N"], t, collective)
        lines.append(f"{collective:>14} {r['N']:>3} {format_size(r['bytes']):>8} {r['quant']:>5} {r['conc']:>4} "
                     f"{len(r['times']):>5} "
                     f"{t * 1e3:>10.3f} {min(r['times']) * 1e3:>9.3f} {alg / 1e9:>11.3f} {bus / 1e9:>11.3f} "
                     f"{r['max_rel_err']:>9.1e}")
    return "\n".join(lines)


def average_bus_bandwidth(rows: Sequence[dict[str, Any]]) -> str:
    """nccl-tests' closing line: the mean of every row's bus bandwidth."""
    values = [bus_bandwidth(r["bytes"], r["N"], statistics.median(r["times"]), r.get("collective", "all_reduce"))[1]
              for r in rows]
    mean = sum(values) / len(values) if values else 0.0
    return f"# Avg bus bandwidth    : {mean / 1e9:.3f} GB/s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The driver's options (shared by ``benchmarks/allreduce.py`` and ``pccl bench``)."""
    parser.add_argument("--peers", type=int, nargs="+", default=[2], help="group sizes to run (default 2)")
    parser.add_argument("--sizes", type=parse_size, nargs="+", default=[parse_size(s) for s in ("16K", "64M")],
                        help="buffer sizes, e.g. 16K 64M 256M (default 16K 64M)")
    parser.add_argument("--quant", nargs="+", choices=_QUANT_NAMES, default=["none"],
                        help="MIN_MAX quantization to none/u8/u16/u4b128 (4 bits, blocks of 128; several: each is run)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1],
                        help="split each buffer into k slices run at once under distinct tags (default 1)")
    parser.add_argument("--collective", nargs="+", choices=COLLECTIVES, default=["all_reduce"],
                        help="the collectives to time (several: each is run; default all_reduce)")
    parser.add_argument("--iters-scale", type=float, default=1.0, help="multiply the iteration counts")
    parser.add_argument("--out-of-place", action="store_true",
                        help="reduce into a separate output array (default: in place, which includes the "
                             "input backup that makes an aborted op restorable)")
    parser.add_argument("--local-socket-buffer-size", type=parse_size, default=None,
                        help="the peers' Config.local_socket_buffer_size, e.g. 256K (default: the "
                             "library's; 0: the OS's autotuning)")
    parser.add_argument("--json", help="also write every row (with per-iteration times) to this file")
    parser.add_argument("--logdir", help="where process logs go (default: a fresh temporary directory)")


def run_driver(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    where = "out of place" if args.out_of_place else "in place"
    print(f"# pccl {', '.join(args.collective)}, float32 (SUM) {where}, loopback, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    for world in args.peers:
        group = run_group(world, sizes=args.sizes, quant=args.quant, concurrency=args.concurrency,
                          collectives=args.collective,
                          iters_scale=args.iters_scale, logdir=args.logdir, out_of_place=args.out_of_place,
                          local_socket_buffer_size=args.local_socket_buffer_size)
        rows.extend(group)
        print(format_table(group), flush=True)
    print(average_bus_bandwidth(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("master", "peer"):
        parser = argparse.ArgumentParser(prog="pccl.tools.bench")
        parser.add_argument("role", choices=["master", "peer"])
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--world", type=int)
        parser.add_argument("--index", type=int)
        parser.add_argument("--result-file")
        parser.add_argument("--iters-scale", type=float, default=1.0)
        parser.add_argument("--sizes", type=int, nargs="+")
        parser.add_argument("--quant", nargs="+")
        parser.add_argument("--concurrency", type=int, nargs="+")
        parser.add_argument("--collective", nargs="+", default=["all_reduce"])
        parser.add_argument("--out-of-place", action="store_true")
        parser.add_argument("--local-socket-buffer-size", type=int)
        args = parser.parse_args(argv)
        if args.role == "master":
            _run_master(args.port)
        else:
            _run_peer(args)
        return 0
    parser = argparse.ArgumentParser(prog="pccl bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.local_socket_buffer_size is not None:
        from ..config import Config
        from ..errors import InvalidArgument

        try:  # refuse it here, not in every peer process
            Config(local_socket_buffer_size=args.local_socket_buffer_size)
        except InvalidArgument as exc:
            parser.error(str(exc))
    return run_driver(args)


if __name__ == "__main__":
    sys.exit(main())
