"""Simulator speed (not a test: figures vary with machine load).

    python benchmarks/sim_speed.py [--scenario pccl] [--profile chaos] [--peers 10] [--seeds 5]
                                   [--duration 30] [--quiet Q] [--phases compute,all_reduce]
                                   [--count-steps]

Runs the seeds one after another in this process and prints virtual seconds per wall second,
simulated peer-seconds per wall second (and per CPU second of this process, which a busy machine
disturbs less), seeds per minute (per core), scheduler loop iterations (and, with
``--count-steps``, trio task steps, whose counting costs a few per cent) per wall second, and how
many runs passed.  The default is the real pccl
workload (master + 10 peers running the recommended loop) under the chaos profile; the pccl runs
end ``hold`` seconds after recovery (see ``PcclScenario``), so a seed costs its fault window plus
a few seconds.  The step body is ``compute`` unless ``--phases`` says otherwise (``--phases ''``:
the profile's own bodies of concurrent collectives).  ``--scenario toy-echo`` measures the
simulator's toy instead.
"""

from __future__ import annotations

import argparse
import logging
import time

from pccl_sim.engine.runner import RunOptions, run
from pccl_sim.tools.campaign import CampaignSpec, peer_seconds
from pccl_sim.tools.scenarios import scenario_names


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", default="pccl", choices=scenario_names())
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--peers", type=int, default=10)
    parser.add_argument("--profile", default="chaos")
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--quiet", type=float, default=None)
    # Default for pccl: compute, so the figures stay comparable with earlier ones; "" runs the
    # profile's own step bodies
    # (pccl_sim.workloads.pccl.profiles: concurrent collectives, tens of times the cost of a seed).
    parser.add_argument("--phases", default=None)
    parser.add_argument("--count-steps", action="store_true")
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    if args.phases is None:
        args.phases = "compute" if args.scenario == "pccl" else ""
    params = (("phases", tuple(args.phases.split(","))),) if args.phases else ()
    spec = CampaignSpec(scenario=args.scenario, profile=args.profile, peers=args.peers, duration=args.duration,
                        quiet=args.quiet, params=params)
    wall = virtual = peers = cpu = 0.0
    iterations = steps = failures = faults = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        scenario, schedule = spec.build(seed)
        started = time.process_time()
        trace = run(scenario, schedule, options=RunOptions(count_task_steps=args.count_steps))
        cpu += time.process_time() - started
        wall += trace.stats["wall_seconds"]
        virtual += trace.stats["virtual_seconds"]
        iterations += trace.stats["loop_iterations"]
        steps += trace.stats.get("task_steps", 0)
        peers += peer_seconds(trace)
        failures += not trace.ok
        faults += len(schedule.events)
    print(
        f"{args.seeds} seeds ({args.scenario}, {args.profile}, {args.peers} peers, {args.duration:g} s of faults, "
        f"{faults} faults), {failures} failing, {virtual / args.seeds:.1f} virtual s per seed\n"
        f"  virtual/wall          {virtual / wall:8.1f}x\n"
        f"  peer-seconds / wall s {peers / wall:8.0f}\n"
        f"  peer-seconds / CPU s  {peers / cpu:8.0f}\n"
        f"  seeds / minute / core {60 * args.seeds / wall:8.1f}\n"
        f"  loop iterations / s   {iterations / wall:8.0f}"
        + (f"\n  task steps / s        {steps / wall:8.0f}" if args.count_steps else "")
    )


if __name__ == "__main__":
    main()
