"""How long a job waits for its worker thread: Trio's thread cache against pccl's workers.

    .venv/bin/python benchmarks/thread_handoff.py [--jobs 200] [--busy-ms 1.0]

Each job records when it started; the Trio thread hands it over and then goes on with
``--busy-ms`` of Python work (as the Trio thread does after an op's lane threads were started),
then waits for the job.  The two hand-offs alternate job by job
(:func:`trio.lowlevel.start_thread_soon` and :func:`pccl.net.workers.start_soon`); the table is
the delay from the hand-off to the job's start (ms).  A worker woken by Trio's cache needs the
GIL the Trio thread holds; one of pccl's is woken by an ``os.write`` during which the Trio thread
does not hold it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import trio

from pccl.net import workers


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


async def measure(jobs: int, busy_ms: float) -> dict[str, list[float]]:
    starts: dict[str, Callable[..., Any]] = {"trio thread cache": trio.lowlevel.start_thread_soon,
                                            "pccl workers": workers.start_soon}
    delays: dict[str, list[float]] = {name: [] for name in starts}
    token = trio.lowlevel.current_trio_token()
    for i in range(jobs):
        for name in sorted(starts, reverse=bool(i % 2)):
            started: list[float] = []
            finished = trio.Event()
            t0 = time.perf_counter()
            starts[name](lambda: started.append(time.perf_counter()),
                         lambda _result: token.run_sync_soon(finished.set), name="pccl-handoff")
            busy(busy_ms)
            await finished.wait()
            delays[name].append((started[0] - t0) * 1e3)
            await trio.sleep(0.002)
    return delays


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--busy-ms", type=float, default=1.0)
    args = parser.parse_args()
    delays = trio.run(measure, args.jobs, args.busy_ms)
    print(f"{'hand-off':>18} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
    for name, values in delays.items():
        values.sort()
        print(f"{name:>18} {statistics.median(values):>10.3f} {values[int(len(values) * 0.9)]:>8.3f} "
              f"{values[-1]:>8.3f}")


if __name__ == "__main__":
    main()
