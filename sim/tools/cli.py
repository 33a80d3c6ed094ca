"""``pccl-sim``: chaos-test pccl in the deterministic simulator; replay and shrink failures.

    pccl-sim run --seed 7 [--peers 4 --duration 20 --quiet Q --profile chaos --master real]
    pccl-sim run --seed 7 --check-determinism      # twice; prints the first divergent event
    pccl-sim campaign --seeds 0..99 [--workers N | --cluster local:N | --cluster tcp://HOST:PORT]
                      [--json FILE --save-failing DIR]
    pccl-sim merge A.json B.json [--json ALL.json]  # one campaign's --json files, run in parts
    pccl-sim replay --seed 7 | FILE [--expect HASH] # prints the trace hash
    pccl-sim shrink --seed 7 [--out FILE] | FILE
    pccl-sim coverage --seeds 0..49                # where faults landed: victim x master phase x kind
    pccl-sim plot --seed 7 [--out run.png] | FILE  # membership and faults timeline (needs matplotlib)

The default scenario is ``pccl`` (:mod:`pccl_sim.workloads.pccl.scenario`: the real master and peers
running the recommended training loop); ``--scenario toy-echo`` runs the simulator's toy (the
choices are the names of :mod:`pccl_sim.tools.scenarios`).  A seed plus the generation options
(``--profile --peers --duration --quiet --master --phases``) determine the schedule; a schedule
FILE carries its own (it names its scenario).  Exit status: 0 if every run passed, 1 if one failed,
2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..engine.runner import Scenario, run
from ..engine.trace import Trace
from ..faults.generate import PROFILES
from ..engine.schedule import Schedule
from ..faults.shrink import NotFailing, same_failure, shrink
from ..observe.coverage import coverage_table
from .campaign import CampaignSpec, ProgressBar, SeedResult, parse_phases, parse_seeds, parse_sites, run_campaign, summary_table
from .cluster import ClusterError, parse_cluster, run_on_cluster
from .results import ResultsError, document, from_record
from .results import load as load_results
from .results import merge as merge_results
from .results import write as write_results
from .scenarios import scenario_from_json, scenario_names

__all__ = ["main"]


def _spec(args: argparse.Namespace) -> CampaignSpec:
    params: list[tuple[str, Any]] = []
    if args.master != "real":
        params.append(("master", args.master))
    if args.phases:
        params.append(("phases", parse_phases(args.phases)))
    if args.groups != 1:
        params.append(("groups", args.groups))
    if args.alone != "update":
        params.append(("alone", args.alone))
    if args.fast_commit:
        params.append(("fast_commit", True))
    if args.peer_commit:
        params.append(("peer_commit", True))
    if args.sites is not None:
        params.append(("sites", args.sites))
    return CampaignSpec(
        scenario=args.scenario, profile=args.profile, peers=args.peers, duration=args.duration, quiet=args.quiet,
        params=tuple(params),
    )


def _load(args: argparse.Namespace) -> tuple[Scenario, Schedule]:
    if getattr(args, "file", None):
        schedule = Schedule.load(args.file)
        return scenario_from_json(schedule.scenario), schedule
    if args.seed is None:
        raise SystemExit("give --seed S or a schedule FILE")
    return _spec(args).build(args.seed)


def _report(schedule: Schedule, trace: Trace, spec: CampaignSpec | None) -> None:
    stats = trace.stats
    print(f"seed {schedule.seed}: {len(schedule.events)} faults, {len(trace)} trace events, hash {trace.hash()}")
    print(
        f"  {stats['virtual_seconds']:.1f} virtual s in {stats['wall_seconds']:.2f} wall s "
        f"({stats['virtual_seconds'] / max(stats['wall_seconds'], 1e-9):.0f}x), {stats['loop_iterations']} loop iterations"
    )
    trips = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in stats.items() if k.startswith("master_round_trips_"))
    if trips:
        print("  master round trips per successful collective call: "
              + ", ".join(f"{n}: {calls} call{'s' * (calls != 1)}" for n, calls in trips))
    if trace.ok:
        print("  PASS")
    for failure in trace.failures:
        print(f"  FAIL {failure}")
    if not trace.ok:
        print(f"  replay: {spec.command(schedule.seed) if spec else 'pccl-sim replay FILE'}")


def _cmd_run(args: argparse.Namespace) -> int:
    scenario, schedule = _load(args)
    if args.save:
        schedule.save(args.save)
    trace = run(scenario, schedule)
    _report(schedule, trace, None if args.file else _spec(args))
    if args.trace_out:
        pathlib.Path(args.trace_out).write_text(json.dumps(trace.to_json()) + "\n")
    if args.verbose:
        print(trace.format())
    if args.check_determinism:
        again = run(scenario_from_json(schedule.scenario), schedule)
        divergence = trace.first_divergence(again)
        if divergence is not None:
            print(f"  NON-DETERMINISTIC: {divergence}")
            return 1
        print("  deterministic: a second run has the same trace hash")
    return 0 if trace.ok else 1


def _cmd_replay(args: argparse.Namespace) -> int:
    scenario, schedule = _load(args)
    trace = run(scenario, schedule)
    print(trace.hash())
    for failure in trace.failures:
        print(f"FAIL {failure}")
    if args.expect and args.expect != trace.hash():
        print(f"hash mismatch: expected {args.expect}", file=sys.stderr)
        return 1
    return 0 if trace.ok else 1


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be."""


@contextmanager
def _sigterm_stops_like_ctrl_c(enabled: bool) -> Iterator[None]:
    """While a campaign runs in worker processes or on a cluster, SIGTERM (``kill``, a batch
    scheduler's time limit) stops it as Ctrl-C does: outstanding seeds cancelled, the finished
    ones' results written.  Not when the seeds run in this process (``--workers 1``): the
    exception would land inside a simulated Trio run, at any bytecode, where it can be swallowed
    (a destructor) or break the run's invariants; SIGTERM keeps its default action there.  Only
    the main thread can take signals; elsewhere (a test calling ``main``) nothing changes."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise _Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _cmd_campaign(args: argparse.Namespace, *, coverage: bool = False) -> int:
    spec = _spec(args)
    seeds = parse_seeds(args.seeds)
    bar = ProgressBar(len(seeds))
    done: list[SeedResult] = []
    saved_at = time.monotonic()

    def progress(result: SeedResult) -> None:
        nonlocal saved_at
        done.append(result)
        bar.update(result)
        if args.json and len(done) < len(seeds) and time.monotonic() - saved_at >= args.save_every:
            write_results(args.json, document(spec, done, ran_on=ran_on, complete=False,
                                              elapsed_seconds=round(time.perf_counter() - started, 3)))
            saved_at = time.monotonic()

    if args.cluster:
        ran_on = f"cluster {args.cluster}"
    else:
        workers = min(args.workers, len(seeds))
        ran_on = f"{workers} local worker processes" if workers > 1 else "this process"
    started = time.perf_counter()
    try:
        with _sigterm_stops_like_ctrl_c(bool(args.cluster) or (args.workers > 1 and len(seeds) > 1)):
            if args.cluster:
                results = run_on_cluster(spec, seeds, parse_cluster(args.cluster), progress=progress,
                                         batch=args.batch, dask_logs=logging.INFO if args.verbose else logging.ERROR)
            else:
                results = run_campaign(spec, seeds, workers=args.workers, progress=progress)
    except ClusterError as exc:
        print(f"pccl-sim {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, _Terminated) else "interrupted"
        print(f"\n{how}: {len(done)} of {len(seeds)} seeds finished, the others cancelled", file=sys.stderr)
        if args.json:
            write_results(args.json, document(spec, done, ran_on=ran_on, complete=False,
                                              elapsed_seconds=round(time.perf_counter() - started, 3)))
            print(f"the finished seeds' results are in {args.json}", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, _Terminated) else 130
    elapsed = time.perf_counter() - started
    failing = [r for r in results if not r.ok]
    print(f"campaign: scenario {spec.scenario}, profile {spec.profile}, {spec.peers} peers, "
          f"{spec.duration:g} s of faults, seeds {seeds[0]}..{seeds[-1]}, on {ran_on}")
    print(summary_table(results))
    print(f"  {'elapsed':<22}  {elapsed:.1f} s ({60 * len(results) / max(elapsed, 1e-9):.1f} seeds/min)")
    if coverage:
        phases, master_phases = _coverage_phases(spec, results)
        print()
        print(coverage_table([c for r in results for c in r.coverage], phases=phases, master_phases=master_phases))
    if args.json:
        write_results(args.json, document(spec, results, ran_on=ran_on, complete=True,
                                          elapsed_seconds=round(elapsed, 3)))
        print(f"\nresults of every seed: {args.json}")
    if failing:
        print(f"\n{len(failing)} failing seed(s):")
        for r in failing:
            print(f"  seed {r.seed}: {', '.join(r.kinds)}: {r.failures[0]}")
            print(f"    {spec.command(r.seed)}")
            print(f"    {spec.command(r.seed).replace('replay', 'shrink', 1)}")
        if args.save_failing:
            out = pathlib.Path(args.save_failing)
            out.mkdir(parents=True, exist_ok=True)
            for r in failing:
                spec.build(r.seed)[1].save(out / f"seed-{r.seed}.json")
            print(f"  schedules saved in {out}/")
    return 1 if failing else 0


def _coverage_phases(spec: CampaignSpec, results: list[SeedResult]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The phases the coverage table lists: those of every step body the seeds ran (a profile
    may draw a different one per seed), in first-seen order."""
    first_seed: dict[str, int] = {}
    for r in results:
        first_seed.setdefault(json.dumps(r.phases, sort_keys=True), r.seed)
    phases: dict[str, None] = {}
    master: dict[str, None] = {}
    for seed in first_seed.values():
        scenario = spec.build(seed)[0]
        phases.update(dict.fromkeys(scenario.coverage_phases()))
        master.update(dict.fromkeys(scenario.master_coverage_phases()))
    return tuple(phases), tuple(master)


def _cmd_merge(args: argparse.Namespace) -> int:
    try:
        doc = merge_results([load_results(path) for path in args.files])
    except (ResultsError, OSError) as exc:
        print(f"pccl-sim merge: {exc}", file=sys.stderr)
        return 2
    results = [from_record(r) for r in doc["seeds"]]
    print(f"merged {len(args.files)} files: {len(results)} seeds")
    print(summary_table(results))
    for record in doc["seeds"]:
        if not record["passed"]:
            print(f"  seed {record['seed']}: {', '.join(record['failure_kinds'])}: {record['failures'][0]}")
            if "replay" in record:
                print(f"    {record['replay']}")
    if args.json:
        write_results(args.json, doc)
        print(f"merged results: {args.json}")
    return 0 if doc["summary"]["failed"] == 0 else 1


def _cmd_shrink(args: argparse.Namespace) -> int:
    scenario, schedule = _load(args)
    first = run(scenario, schedule)
    if first.ok:
        print(f"seed {schedule.seed} passes; nothing to shrink")
        return 0
    print(f"seed {schedule.seed} fails ({', '.join(first.failure_kinds)}) with {len(schedule.events)} faults; shrinking")
    oracle = same_failure(lambda s: scenario_from_json(s.scenario), first.failure_kinds)
    try:
        result = shrink(schedule, oracle)
    except NotFailing:  # pragma: no cover - the first run just failed
        print("the schedule did not fail again: non-deterministic?")
        return 1
    out = args.out or f"shrunk-{schedule.seed}.json"
    result.schedule.save(out)
    again = run(scenario_from_json(result.schedule.scenario), result.schedule)
    print(f"{result.original_events} -> {len(result.events)} events in {result.runs} runs; saved {out}")
    for event in result.events:
        print(f"  {event.describe()}")
    print(f"replay: pccl-sim replay {out}  (hash {again.hash()})")
    for failure in again.failures:
        print(f"  FAIL {failure}")
    return 1


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import MatplotlibMissing, plot_trace

    scenario, schedule = _load(args)
    trace = run(scenario, schedule)
    out = args.out or f"pccl-sim-{schedule.seed}.png"
    try:
        plot_trace(trace, schedule, out)
    except MatplotlibMissing as exc:
        print(f"pccl-sim plot: {exc}", file=sys.stderr)
        return 2
    print(f"seed {schedule.seed}: {'PASS' if trace.ok else 'FAIL ' + ', '.join(trace.failure_kinds)}; wrote {out}")
    return 0


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain_text(text: str) -> str:
    """``text`` (reST from a docstring) as a terminal shows it: roles and inline literals lose
    their markup (``:mod:`x``` and ````x```` become ``x``)."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def _parser() -> argparse.ArgumentParser:
    summary, _, details = (__doc__ or "").partition("\n\n")
    parser = argparse.ArgumentParser(prog="pccl-sim", description=plain_text(summary),
                                     epilog=plain_text(details), formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def generation(p: argparse.ArgumentParser) -> None:
        p.add_argument("--scenario", default="pccl", choices=scenario_names(),
                       help="what runs in the simulator (default %(default)s)")
        p.add_argument("--profile", default="chaos", choices=sorted(PROFILES),
                       help="fault schedule profile: which faults, how often (default %(default)s)")
        p.add_argument("--peers", type=int, default=4, help="peers at the start (default %(default)s)")
        p.add_argument("--duration", type=float, default=20.0, help="fault window (virtual s)")
        p.add_argument("--quiet", type=float, default=None, help="recovery window after it (default: scenario's)")
        p.add_argument("--master", default="real",
                       help="master variant (pccl_sim.workloads.pccl.mutants), e.g. no-recheck-on-disconnect")
        p.add_argument("--phases", default="",
                       help="step body, comma-separated names (default: compute), or a JSON list of names "
                            "and {\"name\": ..., param: value} objects")
        p.add_argument("--groups", type=int, default=1, help="peer groups (peerN joins group N %% groups)")
        p.add_argument("--alone", default="update", choices=("update", "pending"),
                       help="a lone peer's loop: update_topology (as steps() does) or are_peers_pending first")
        p.add_argument("--fast-commit", action="store_true",
                       help="peers begin collectives without the master's vote (pccl.Config.fast_commit)")
        p.add_argument("--peer-commit", action="store_true",
                       help="begun collectives commit among their peers, the master asked only in doubt "
                            "(pccl.Config.peer_commit; needs --fast-commit)")
        p.add_argument("--sites", type=parse_sites, default=None,
                       help="peers in datacenters: a JSON object of the scenario's sites parameter, e.g. "
                            "'{\"count\": 2, \"uplink\": 125e6}' (peerN in site N %% count; see docs/simulator.rst)")
        p.add_argument("-v", "--verbose", action="store_true")

    helps = {
        "run": "one simulated chaos run from a seed (or a schedule FILE)",
        "replay": "run a seed or schedule again and print its trace hash",
        "shrink": "reduce a failing schedule to a minimal one (saved as JSON)",
        "plot": "PNG timeline of a run: membership, steps and faults (needs matplotlib)",
        "campaign": "run many seeds in worker processes; failing seeds are listed with their replay command",
        "coverage": "a campaign, then which protocol phases its faults landed in",
        "merge": "merge the --json results of one campaign run in parts (on several machines)",
    }
    for name in ("run", "replay", "shrink", "plot"):
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        p.add_argument("file", nargs="?", help="a schedule JSON file (instead of --seed)")
        p.add_argument("--seed", type=int, help="seed of the fault schedule (and of the run's scheduler)")
        generation(p)
        if name == "run":
            p.add_argument("--save", help="write the schedule to this file")
            p.add_argument("--trace-out", help="write the trace (JSON) to this file")
            p.add_argument("--check-determinism", action="store_true")
        elif name == "replay":
            p.add_argument("--expect", help="fail unless the trace hash is this")
        elif name == "shrink":
            p.add_argument("--out", help="where to write the minimal schedule")
        elif name == "plot":
            p.add_argument("--out", help="PNG file (default pccl-sim-SEED.png)")
    for name in ("campaign", "coverage"):
        p = sub.add_parser(name, help=helps[name], description=helps[name])
        p.add_argument("--seeds", required=True, help="A..B (inclusive), or a comma list")
        p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                       help="worker processes (default %(default)s: one per core)")
        p.add_argument("--cluster", type=_cluster_arg, default=None, metavar="local:N | tcp://HOST:PORT",
                       help="run the seeds on a Dask cluster instead of local worker processes: a local cluster "
                            "of N worker processes, or an existing scheduler (needs pccl-trio[cluster])")
        p.add_argument("--batch", type=int, default=None,
                       help="with --cluster: seeds per task (default: up to 8, 16+ tasks per worker)")
        p.add_argument("--json", metavar="FILE", help="write every seed's result and a summary to FILE (JSON)")
        p.add_argument("--save-failing", help="directory for the failing seeds' schedules")
        p.add_argument("--save-every", type=float, default=60.0, metavar="SECONDS",
                       help="with --json: rewrite FILE with the seeds finished so far (marked incomplete) at "
                            "most this often while the campaign runs, so a campaign killed outright (SIGKILL, "
                            "a lost machine, SIGTERM with --workers 1) keeps them (default %(default)s; 0: "
                            "after every seed)")
        generation(p)
    p = sub.add_parser("merge", help=helps["merge"], description=helps["merge"])
    p.add_argument("files", nargs="+", help="results files written by campaign --json")
    p.add_argument("--json", metavar="FILE", help="write the merged results to FILE")
    return parser


def _cluster_arg(text: str) -> str:
    try:
        parse_cluster(text)
    except ClusterError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PYTHONHASHSEED", "0")  # for child processes; runs do not depend on it
    args = _parser().parse_args(argv)
    # Chaos makes pccl log warnings by design (kicks, lost masters); show them only on request.
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.CRITICAL,
                        format="%(name)s: %(message)s")
    if args.command == "campaign":
        return _cmd_campaign(args)
    if args.command == "coverage":
        return _cmd_campaign(args, coverage=True)
    return {"run": _cmd_run, "replay": _cmd_replay, "shrink": _cmd_shrink, "plot": _cmd_plot,
            "merge": _cmd_merge}[args.command](args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
