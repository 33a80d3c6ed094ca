"""Simulator speed on the toy echo scenario (not a test: figures vary with machine load).

    python benchmarks/sim_speed.py [--seeds 5] [--peers 10] [--profile stress]

Prints virtual seconds per wall second, simulated peer-seconds per wall second, seeds per
minute, scheduler loop iterations and trio task steps per wall second.
"""

from __future__ import annotations

import argparse

from sim.runner import RunOptions, run
from sim.toy import toy_schedule


def peer_seconds(trace) -> float:  # type: ignore[no-untyped-def]
    """Sum of the lifetimes of all peer incarnations in the run."""
    starts: dict[str, float] = {}
    total = 0.0
    for event in trace:
        if event.kind == "start" and event.source.startswith("peer"):
            starts[event.source] = event.t
        elif event.source == "net" and event.kind in ("kill", "power_off", "exit"):
            host = event.data.get("host") or ""
            if host in starts:
                total += event.t - starts.pop(host)
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--peers", type=int, default=10)
    parser.add_argument("--profile", default="stress")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--quiet", type=float, default=30.0)
    args = parser.parse_args()
    wall = virtual = peers = 0.0
    iterations = steps = failures = 0
    for seed in range(args.seeds):
        toy, schedule = toy_schedule(seed, profile=args.profile, peers=args.peers, duration=args.duration, quiet=args.quiet)
        trace = run(toy, schedule, options=RunOptions(count_task_steps=True))
        wall += trace.stats["wall_seconds"]
        virtual += trace.stats["virtual_seconds"]
        iterations += trace.stats["loop_iterations"]
        steps += trace.stats["task_steps"]
        peers += peer_seconds(trace)
        failures += not trace.ok
    print(
        f"{args.seeds} seeds ({args.profile}, {args.peers} peers, {args.duration + args.quiet:.0f} virtual s each), "
        f"{failures} failing\n"
        f"  virtual/wall          {virtual / wall:8.0f}x\n"
        f"  peer-seconds / wall s {peers / wall:8.0f}\n"
        f"  seeds / minute        {60 * args.seeds / wall:8.1f}\n"
        f"  loop iterations / s   {iterations / wall:8.0f}\n"
        f"  task steps / s        {steps / wall:8.0f}"
    )


if __name__ == "__main__":
    main()
