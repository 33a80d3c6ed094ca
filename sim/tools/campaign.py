"""Campaigns: many seeds of one generated workload, sharded across processes.

A :class:`CampaignSpec` says how to turn a seed into ``(scenario, schedule)`` (scenario name,
fault profile, cluster size, fault window, scenario parameters); :func:`run_campaign` runs a
range of seeds on ``workers`` processes and returns one plain :class:`SeedResult` per seed, in
seed order.  Each seed is one deterministic ``trio.run`` inside a worker, so results do not
depend on the sharding (the determinism test checks hashes across fresh processes).

Workers are started with the ``spawn`` method (a clean interpreter: no state inherited from
the parent), so a scenario, phase or master variant registered at run time in the parent is
unknown to them; campaigns of such things use ``workers=1`` (in-process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TextIO

from ..engine.runner import RunOptions, Scenario, run
from ..engine.trace import Trace
from ..engine.schedule import Schedule
from .scenarios import scenario_class

__all__ = ["CampaignSpec", "SeedResult", "run_seed", "run_campaign", "peer_seconds", "ProgressBar", "parse_seeds",
           "parse_phases", "format_phases", "parse_sites"]


@dataclasses.dataclass(frozen=True)
class CampaignSpec:
    """How a seed becomes a run.  ``quiet=None``: the scenario's default (pccl: 1.2 × the
    liveness bound).  ``params`` go to the scenario (e.g. ``{"master": "no-recheck-on-disconnect"}``)."""

    scenario: str = "pccl"
    profile: str = "chaos"
    peers: int = 4
    duration: float = 20.0
    quiet: float | None = None
    params: tuple[tuple[str, Any], ...] = ()

    def build(self, seed: int) -> tuple[Scenario, Schedule]:
        """The scenario and the schedule of ``seed`` (the registered scenario's generator)."""
        return scenario_class(self.scenario).generate_schedule(
            seed, profile=self.profile, peers=self.peers, duration=self.duration, quiet=self.quiet, **dict(self.params)
        )

    def command(self, seed: int) -> str:
        """The ``pccl-sim`` command line that replays ``seed`` of this campaign."""
        parts = [f"pccl-sim replay --seed {seed}"]
        defaults = CampaignSpec()
        if self.scenario != defaults.scenario:
            parts.append(f"--scenario {self.scenario}")
        if self.profile != defaults.profile:
            parts.append(f"--profile {self.profile}")
        if self.peers != defaults.peers:
            parts.append(f"--peers {self.peers}")
        if self.duration != defaults.duration:
            parts.append(f"--duration {self.duration:g}")
        if self.quiet is not None:
            parts.append(f"--quiet {self.quiet:g}")
        for key, value in self.params:
            if key == "master":
                parts.append(f"--master {value}")
            elif key == "phases":
                parts.append(f"--phases {format_phases(value)}")
            elif key == "groups":
                parts.append(f"--groups {value}")
            elif key == "alone":
                parts.append(f"--alone {value}")
            elif key == "fast_commit" and value:
                parts.append("--fast-commit")
            elif key == "peer_commit" and value:
                parts.append("--peer-commit")
            elif key == "sites":
                parts.append(f"--sites {shlex.quote(json.dumps(value, separators=(',', ':')))}")
        return " ".join(parts)


@dataclasses.dataclass
class SeedResult:
    """The outcome of one seed (plain data; crosses process boundaries)."""

    seed: int
    ok: bool
    kinds: tuple[str, ...]
    failures: list[str]
    hash: str
    events: int
    faults: int
    wall: float
    virtual: float
    peer_seconds: float
    loop_iterations: int
    coverage: list[list[str]]
    #: Seconds from the end of the faults to the first full-membership step (None: never).
    converged_after: float | None = None
    #: Faults of the schedule by kind (kill, partition, master_restart, ...).
    fault_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    #: The step body the seed ran (the scenario's ``phases`` parameter; None: it has none).
    phases: list[Any] | None = None
    #: Integer statistics the checkers left (``all_reduce_completed``, ``collectives_aborted``,
    #: ``master_round_trips_2`` (successful calls that waited for 2 master answers), ...).
    counters: dict[str, int] = dataclasses.field(default_factory=dict)


def parse_phases(text: str) -> tuple[Any, ...]:
    """The ``--phases`` option: comma-separated phase names, or (starting with ``[``) a JSON list
    of names and ``{"name": ..., param: value}`` objects.  ``ValueError`` if it is neither."""
    if not text.lstrip().startswith("["):
        return tuple(text.split(","))
    phases = json.loads(text)
    if not isinstance(phases, list) or not all(isinstance(p, (str, dict)) for p in phases):
        raise ValueError("--phases JSON must be a list of phase names and objects")
    return tuple(phases)


def parse_sites(text: str) -> dict[str, Any]:
    """``--sites``: a JSON object of :class:`~pccl_sim.workloads.pccl.scenario.PcclScenario`'s
    ``sites`` parameter (``count`` and ``uplink`` at least)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--sites: not JSON: {exc}") from None
    if not isinstance(value, dict) or "count" not in value or "uplink" not in value:
        raise argparse.ArgumentTypeError('--sites: need a JSON object with "count" and "uplink"')
    return value


def format_phases(phases: Sequence[Any]) -> str:
    """:func:`parse_phases`'s inverse, quoted for a shell when it is JSON."""
    if all(isinstance(p, str) for p in phases):
        return ",".join(phases)
    return shlex.quote(json.dumps(list(phases), separators=(",", ":")))


def peer_seconds(trace: Trace) -> float:
    """Sum of the lifetimes of all peer incarnations (virtual seconds) in ``trace``."""
    starts: dict[str, float] = {}
    total = 0.0
    end = trace.stats.get("virtual_seconds", trace.events[-1].t if trace.events else 0.0)
    for event in trace:
        if event.kind == "start" and event.source.startswith("peer"):
            starts[event.source] = event.t
        elif event.source == "net" and event.kind in ("kill", "power_off", "exit"):
            host = event.data.get("host") or ""
            if host in starts:
                total += event.t - starts.pop(host)
    return total + sum(end - t for t in starts.values())


def run_seed(spec: CampaignSpec, seed: int, options: RunOptions | None = None) -> SeedResult:
    """Build and run ``seed`` of ``spec`` in this process (one ``trio.run``); its result."""
    scenario, schedule = spec.build(seed)
    trace = run(scenario, schedule, options=options)
    stats = trace.stats
    return SeedResult(
        seed=seed,
        ok=trace.ok,
        kinds=trace.failure_kinds,
        failures=[str(f) for f in trace.failures],
        hash=trace.hash(),
        events=len(trace),
        faults=len(schedule.events),
        wall=stats["wall_seconds"],
        virtual=stats["virtual_seconds"],
        peer_seconds=peer_seconds(trace),
        loop_iterations=stats["loop_iterations"],
        coverage=[list(c) for c in stats.get("coverage", [])],
        converged_after=stats.get("converged_after"),
        fault_kinds=dict(Counter(e.kind for e in schedule.events)),
        phases=scenario.params.get("phases"),
        counters={k: v for k, v in stats.items()
                  if (k.endswith(("_completed", "_aborted")) or k.startswith(("master_round_trips_", "split_")))
                  and isinstance(v, int)},
    )


def _work(job: tuple[CampaignSpec, int]) -> SeedResult:
    import logging

    logging.disable(logging.CRITICAL)  # pccl's warnings about kicked peers are the point of chaos
    return run_seed(*job)


class ProgressBar:
    """``[#####.....] 12/30 seeds  2 failing  41 seeds/min`` on a terminal (redrawn in place);
    otherwise (a log file) one line per tenth, and one whenever ``quiet_lines`` seconds passed
    since the last line (a long campaign's log shows it is alive)."""

    def __init__(self, total: int, stream: TextIO | None = None, *, quiet_lines: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.failing = 0
        self.clock = clock
        self.start = clock()
        self.tty = self.stream.isatty()
        self.quiet_lines = quiet_lines
        self._last_tenth = -1
        self._last_line = self.start

    def update(self, result: SeedResult) -> None:
        self.done += 1
        self.failing += not result.ok
        now = self.clock()
        elapsed = max(now - self.start, 1e-9)
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} seeds  "
            f"{self.failing} failing  {60 * self.done / elapsed:.0f} seeds/min"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if self.done == self.total else ""))
            self.stream.flush()
        else:
            tenth = 10 * self.done // max(self.total, 1)
            if tenth != self._last_tenth or now - self._last_line >= self.quiet_lines:
                self._last_tenth = tenth
                self._last_line = now
                self.stream.write(line + "\n")
                self.stream.flush()


def run_campaign(
    spec: CampaignSpec,
    seeds: Iterable[int],
    *,
    workers: int = 2,
    progress: Callable[[SeedResult], None] | None = None,
) -> list[SeedResult]:
    """Run every seed; return the results sorted by seed.  ``workers <= 1`` runs in this
    process.  ``progress(result)`` is called as each seed finishes (completion order)."""
    seeds = list(seeds)
    results: list[SeedResult] = []
    if workers <= 1 or len(seeds) <= 1:
        for seed in seeds:
            result = run_seed(spec, seed)
            results.append(result)
            if progress is not None:
                progress(result)
    else:
        # concurrent.futures, not multiprocessing.Pool: a worker that dies (or cannot even import
        # the code) raises BrokenProcessPool here instead of hanging the campaign.
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(workers, len(seeds)), mp_context=context) as pool:
            futures = [pool.submit(_work, (spec, seed)) for seed in seeds]
            try:
                for future in concurrent.futures.as_completed(futures):
                    result = future.result()
                    results.append(result)
                    if progress is not None:
                        progress(result)
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # a simulator bug: stop, don't finish the range
                raise
    return sorted(results, key=lambda r: r.seed)


def parse_seeds(text: str) -> list[int]:
    """``"7"``, ``"0..29"`` (inclusive) or ``"1,5,9"``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if ".." in part:
            a, b = part.split("..", 1)
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"empty seed range {part!r}")
            out.extend(range(lo, hi + 1))
        elif part:
            out.append(int(part))
    if not out:
        raise ValueError(f"no seeds in {text!r}")
    return out


def summary_table(results: Sequence[SeedResult]) -> str:
    """Totals and speed figures of a campaign."""
    n = len(results)
    wall = sum(r.wall for r in results)
    virtual = sum(r.virtual for r in results)
    peers = sum(r.peer_seconds for r in results)
    failing = [r for r in results if not r.ok]
    kinds: dict[str, int] = {}
    for r in failing:
        for k in r.kinds:
            kinds[k] = kinds.get(k, 0) + 1
    rows = [
        ("seeds", f"{n}"),
        ("passing", f"{n - len(failing)}"),
        ("failing", f"{len(failing)}" + (f" ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})" if kinds else "")),
        ("faults injected", f"{sum(r.faults for r in results)}"),
        ("faults by kind", ", ".join(f"{k} {v}" for k, v in sorted(
            sum((Counter(r.fault_kinds) for r in results), Counter()).items())) or "none"),
        ("virtual seconds", f"{virtual:.0f}"),
        ("run wall seconds (sum)", f"{wall:.1f}"),
        ("virtual / wall", f"{virtual / max(wall, 1e-9):.0f}x"),
        ("peer-seconds / wall s", f"{peers / max(wall, 1e-9):.0f}"),
        ("seeds / minute / core", f"{60 * n / max(wall, 1e-9):.1f}"),
    ]
    recovery = sorted(r.converged_after for r in results if r.converged_after is not None)
    if recovery:
        rows.append(("recovery after faults", f"median {recovery[len(recovery) // 2]:.2f} s, max {recovery[-1]:.2f} s"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
