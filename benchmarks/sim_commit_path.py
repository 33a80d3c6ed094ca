"""The fixed cost of a collective's commit path, in the simulator: vote + verdict against
``Config.fast_commit``'s Begin + verdict (issue 46).

    python benchmarks/sim_commit_path.py [--peers 4] [--latency 0.005,0.025] [--n 1024]

Every peer all-reduces ``--n`` float32 elements in place, one call per step (a short compute
step between), for a few virtual seconds on links of ``--latency`` s one way (the master
included, so a master round trip costs twice that).  For each latency and each commit path:
the calls, their duration from the call to its result in virtual seconds (min and median: the
median includes waiting for the slowest peer to reach the call), and the master round trips
each successful call waited for (the simulator's ``master_round_trips_<n>`` counters).
Deterministic; every run must pass the simulator's checkers.
"""

from __future__ import annotations

import argparse
import statistics

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import Schedule
from pccl_sim.workloads.pccl.scenario import PcclScenario


def measure(peers: int, latency: float, n: int, fast: bool) -> tuple[list[float], dict[str, int]]:
    scenario = PcclScenario(peers=peers, phases=("compute", {"name": "all_reduce", "n": n}), fast_commit=fast,
                            latency=latency, step_time=0.05)
    trace = run(scenario, Schedule(seed=1, duration=3.0, quiet=4.0, scenario=scenario.to_json()))
    if not trace.ok:
        raise SystemExit(f"the run failed its checkers: {[str(f) for f in trace.failures]}")
    began: dict[tuple[str, int], float] = {}
    durations = []
    for event in trace:
        if event.kind == "all_reduce_call":
            began[(event.source, event.data["k"])] = event.t
        elif event.kind == "all_reduce" and (event.source, event.data["k"]) in began:
            durations.append(event.t - began[(event.source, event.data["k"])])
    return durations, {k: v for k, v in trace.stats.items() if k.startswith("master_round_trips_")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--latency", default="0.005,0.025", help="one-way seconds on every link, comma-separated")
    parser.add_argument("--n", type=int, default=1024, help="float32 elements per all-reduce")
    args = parser.parse_args()
    print(f"{args.peers} peers, {args.n * 4} B all-reduce, one call per step")
    print(f"{'one-way':>8} {'path':>7} {'calls':>6} {'min ms':>8} {'median ms':>10}  round trips per call")
    for latency in (float(x) for x in args.latency.split(",")):
        for fast in (False, True):
            durations, trips = measure(args.peers, latency, args.n, fast)
            shown = ", ".join(f"{k.rsplit('_', 1)[1]}: {v}" for k, v in sorted(trips.items()))
            print(f"{latency * 1000:>6.0f}ms {'fast' if fast else 'vote':>7} {len(durations):>6} "
                  f"{min(durations) * 1000:>8.1f} {statistics.median(durations) * 1000:>10.1f}  {shown}")


if __name__ == "__main__":
    main()
