"""``pccl-sim``: run, replay and shrink simulated runs (minimal; campaigns and coverage come later).

    pccl-sim run --seed 7 [--profile chaos --peers 3 --duration 20 --quiet 15 --save FILE]
    pccl-sim run --seed 7 --check-determinism
    pccl-sim replay --seed 7 | FILE
    pccl-sim shrink --seed 7 [--out FILE] | FILE

Until the pccl workload lands the scenario is the toy echo service (:mod:`sim.toy`); a schedule
file names its own scenario.  Exit status: 0 if the run passed, 1 if it failed, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .faults import Schedule
from .runner import run
from .scenarios import scenario_from_json
from .shrink import NotFailing, same_failure, shrink
from .toy import toy_schedule
from .trace import Trace

__all__ = ["main"]


def _schedule(args: argparse.Namespace) -> Schedule:
    if getattr(args, "file", None):
        return Schedule.load(args.file)
    if args.seed is None:
        raise SystemExit("give --seed S or a schedule FILE")
    _, schedule = toy_schedule(
        args.seed, profile=args.profile, peers=args.peers, duration=args.duration, quiet=args.quiet
    )
    return schedule


def _report(schedule: Schedule, trace: Trace) -> None:
    stats = trace.stats
    print(f"seed {schedule.seed}: {len(schedule.events)} faults, {len(trace)} trace events, hash {trace.hash()}")
    print(
        f"  {stats['virtual_seconds']:.1f} virtual s in {stats['wall_seconds']:.2f} wall s "
        f"({stats['virtual_seconds'] / max(stats['wall_seconds'], 1e-9):.0f}x), {stats['loop_iterations']} loop iterations"
    )
    if trace.ok:
        print("  PASS")
    for failure in trace.failures:
        print(f"  FAIL {failure}")
    if not trace.ok:
        print(f"  replay: pccl-sim replay --seed {schedule.seed}")


def _run(args: argparse.Namespace) -> int:
    schedule = _schedule(args)
    if args.save:
        schedule.save(args.save)
    trace = run(scenario_from_json(schedule.scenario), schedule)
    _report(schedule, trace)
    if args.check_determinism:
        again = run(scenario_from_json(schedule.scenario), schedule)
        divergence = trace.first_divergence(again)
        if divergence is not None:
            print(f"  NON-DETERMINISTIC: {divergence}")
            return 1
        print("  deterministic: second run has the same trace hash")
    return 0 if trace.ok else 1


def _shrink(args: argparse.Namespace) -> int:
    schedule = _schedule(args)
    first = run(scenario_from_json(schedule.scenario), schedule)
    if first.ok:
        print(f"seed {schedule.seed} passes; nothing to shrink")
        return 0
    oracle = same_failure(lambda s: scenario_from_json(s.scenario), first.failure_kinds)
    try:
        result = shrink(schedule, oracle)
    except NotFailing:  # pragma: no cover - the first run just failed
        print("the schedule did not fail again: non-deterministic?")
        return 1
    out = args.out or f"shrunk-{schedule.seed}.json"
    result.schedule.save(out)
    print(f"{result.original_events} -> {len(result.events)} events in {result.runs} runs; saved {out}")
    for event in result.events:
        print(f"  {event.describe()}")
    return 1


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")  # for child processes; runs do not depend on it
    parser = argparse.ArgumentParser(prog="pccl-sim", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "replay", "shrink"):
        p = sub.add_parser(name)
        p.add_argument("file", nargs="?", help="a schedule JSON file")
        p.add_argument("--seed", type=int)
        p.add_argument("--profile", default="chaos")
        p.add_argument("--peers", type=int, default=3)
        p.add_argument("--duration", type=float, default=20.0)
        p.add_argument("--quiet", type=float, default=15.0)
        p.add_argument("--save", help="write the schedule to this file")
        p.add_argument("--out", help="shrink: where to write the minimal schedule")
        p.add_argument("--check-determinism", action="store_true")
        p.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.command == "shrink":
        return _shrink(args)
    return _run(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
