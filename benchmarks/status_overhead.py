"""Does a polled status page slow the master down?  Interleaved A/B of small all-reduces.

A master runs as its own process with ``--status``; this driver runs ``--peers`` communicators
(in-process, real TCP to the master and between them) and a poller process that GETs the HTML
page (``/``, the most expensive path) every ``--interval`` seconds while it is switched on.
Rounds alternate: A (poller off) and B (poller on), ``--rounds`` of each, one process tree, so
both arms see the same machine load.  Each round times ``--iters`` all-reduces of ``--size``
bytes (float32, SUM, in place; every peer calls at once; the time is the slowest peer's) and
keeps their median.  The report gives each arm's median of round medians, its spread, and the
ratio B/A.

    python benchmarks/status_overhead.py [--size 16K] [--rounds 10] [--iters 200] [--interval 0.1]

A measurement tool: it uses wall-clock time freely.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import trio

import pccl
from pccl.tools.bench import free_port, parse_size


def _poller(url: str, interval: float) -> None:
    """Child process: poll ``url`` every ``interval`` s while the last line on stdin was "1"."""
    on = threading.Event()
    polls = [0]

    def read_switch() -> None:
        for line in sys.stdin:
            if line.strip() == "1":
                on.set()
            else:
                on.clear()
                print(f"poller: {polls[0]} pages fetched so far", file=sys.stderr, flush=True)
        os._exit(0)

    threading.Thread(target=read_switch, daemon=True).start()
    while True:
        on.wait()
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        polls[0] += 1
        time.sleep(max(0.0, interval - (time.perf_counter() - started)))


async def _measure(args: argparse.Namespace, master: str, poller: subprocess.Popen[str]) -> None:
    config = pccl.Config(peer_timeout=30.0)
    count = args.size // 4
    comms: list[pccl.Communicator] = []
    done = trio.Event()
    results: dict[str, list[float]] = {"A (page not polled)": [], "B (page polled)": []}
    async with trio.open_nursery() as nursery:
        async def peer() -> None:
            async with pccl.open_communicator(master, config=config) as comm:
                comms.append(comm)
                await done.wait()

        for i in range(args.peers):
            nursery.start_soon(peer)
            while len(comms) < i + 1 and i == 0:
                await trio.sleep(0.01)
            if i:
                while not await comms[0].are_peers_pending():
                    await trio.sleep(0.01)
                async with trio.open_nursery() as voters:
                    for comm in list(comms):
                        voters.start_soon(comm.update_topology)
                while len(comms) < i + 1:
                    await trio.sleep(0.01)
        buffers = [np.ones(count, np.float32) for _ in comms]

        async def one_op() -> float:
            times: list[float] = []

            async def call(comm: pccl.Communicator, buf: np.ndarray) -> None:
                t0 = time.perf_counter()
                await comm.all_reduce(buf)
                times.append(time.perf_counter() - t0)

            async with trio.open_nursery() as group:
                for comm, buf in zip(comms, buffers):
                    group.start_soon(call, comm, buf)
            for buf in buffers:
                buf.fill(1.0)
            return max(times)

        for _ in range(50):  # warm-up
            await one_op()
        for r in range(2 * args.rounds):
            arm = "B (page polled)" if r % 2 else "A (page not polled)"
            assert poller.stdin is not None
            poller.stdin.write("1\n" if r % 2 else "0\n")
            poller.stdin.flush()
            await trio.sleep(0.3)  # let the switch take effect
            round_times = [await one_op() for _ in range(args.iters)]
            results[arm].append(statistics.median(round_times))
            print(f"round {r:2d} {arm:22s} median {results[arm][-1] * 1e6:8.1f} us", flush=True)
        done.set()
    a, b = (results[k] for k in results)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"\n{args.peers} peers, {args.size} B float32 SUM all-reduce, {args.rounds} rounds x {args.iters} ops per arm,"
          f" page polled every {args.interval:g} s in B")
    for name, values in results.items():
        print(f"{name:22s} median of round medians {statistics.median(values) * 1e6:8.1f} us "
              f"(rounds {min(values) * 1e6:.1f}..{max(values) * 1e6:.1f} us)")
    paired = sorted(bi / ai for ai, bi in zip(a, b))  # each B round against the A round just before it
    print(f"ratio B/A = {mb / ma:.3f} (medians of round medians); paired rounds: median {statistics.median(paired):.3f}, "
          f"range {paired[0]:.3f}..{paired[-1]:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=parse_size("16K"))
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--poller", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.poller:
        _poller(args.poller, args.interval)
        return 0
    port, status_port = free_port(), free_port()
    master = subprocess.Popen([sys.executable, "-m", "pccl", "master", "--listen", f"127.0.0.1:{port}", "--status",
                               f"127.0.0.1:{status_port}", "--log-level", "WARNING"])
    poller = subprocess.Popen([sys.executable, __file__, "--poller", f"http://127.0.0.1:{status_port}/",
                               "--interval", str(args.interval)], stdin=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:  # wait for the status endpoint (it starts with the master)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{status_port}/status.json", timeout=1) as r:
                    assert re.search(rb'"schema": 1', r.read())
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        trio.run(_measure, args, f"127.0.0.1:{port}", poller)
    finally:
        poller.kill()
        master.terminate()
        master.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
