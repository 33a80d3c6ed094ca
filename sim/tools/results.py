"""Campaign results as data: the ``--json FILE`` of ``pccl-sim campaign`` and ``coverage``.

The file is one JSON object (``"format": "pccl-sim-campaign/1"``)::

    {"format": "pccl-sim-campaign/1",
     "campaign": {"scenario": "pccl", "profile": "chaos", "peers": 4, "duration": 20.0,
                  "quiet": null, "params": {...}},          # what turns a seed into a run
     "seeds": [{"seed": 0, "passed": true, "failure_kinds": [], "failures": [],
                "trace_hash": "…", "faults": 12, "faults_by_kind": {"kill": 3, …},
                "recovery_seconds": 1.42, "wall_seconds": 2.1, "virtual_seconds": 31.0,
                "peer_seconds": 120.5, "events": 5123, "loop_iterations": 40211,
                "phases": ["compute", …], "counters": {"all_reduce_completed": 80, …},
                "coverage": [["VoteTopology", "idle", "kill"], …],
                "replay": "pccl-sim replay --seed 0 …"}, …],     # in seed order
     "summary": {"seeds": 20, "passed": 20, "failed": 0, "failure_kinds": {}, …,
                 "ran_on": "cluster local:2", "elapsed_seconds": 31.5}}

A seed's record depends only on the seed and the campaign, except its ``wall_seconds`` (and the
summary's speed figures and ``ran_on``): the same seed gives the same ``trace_hash`` on any
machine, in any worker.  So files of one campaign run on several machines *merge*
(:func:`merge`, ``pccl-sim merge A.json B.json --json ALL.json``): the union of their seeds, the
summary computed again; a seed present in two files with different hashes is an error
(non-determinism, or different code).
"""

from __future__ import annotations

import json
import pathlib
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .campaign import CampaignSpec, SeedResult

__all__ = ["FORMAT", "ResultsError", "seed_record", "from_record", "campaign_record", "summary",
           "document", "write", "load", "merge"]

FORMAT = "pccl-sim-campaign/1"


class ResultsError(ValueError):
    """A results file that is not one, or files that cannot be merged."""


def seed_record(result: SeedResult, spec: CampaignSpec | None = None) -> dict[str, Any]:
    """One seed's record (plain JSON data); with ``spec``, its replay command too."""
    record: dict[str, Any] = {
        "seed": result.seed,
        "passed": result.ok,
        "failure_kinds": list(result.kinds),
        "failures": list(result.failures),
        "trace_hash": result.hash,
        "faults": result.faults,
        "faults_by_kind": dict(sorted(result.fault_kinds.items())),
        "recovery_seconds": result.converged_after,
        "wall_seconds": round(result.wall, 4),
        "virtual_seconds": result.virtual,
        "peer_seconds": result.peer_seconds,
        "events": result.events,
        "loop_iterations": result.loop_iterations,
        "phases": result.phases,
        "counters": dict(sorted(result.counters.items())),
        "coverage": [list(c) for c in result.coverage],
    }
    if spec is not None:
        record["replay"] = spec.command(result.seed)
    return record


def from_record(record: Mapping[str, Any]) -> SeedResult:
    """The :class:`SeedResult` a record describes (:func:`seed_record`'s inverse)."""
    return SeedResult(
        seed=int(record["seed"]), ok=bool(record["passed"]), kinds=tuple(record["failure_kinds"]),
        failures=list(record["failures"]), hash=str(record["trace_hash"]), events=int(record["events"]),
        faults=int(record["faults"]), wall=float(record["wall_seconds"]), virtual=float(record["virtual_seconds"]),
        peer_seconds=float(record["peer_seconds"]), loop_iterations=int(record["loop_iterations"]),
        coverage=[list(c) for c in record.get("coverage", [])], converged_after=record.get("recovery_seconds"),
        fault_kinds=dict(record.get("faults_by_kind", {})), phases=record.get("phases"),
        counters=dict(record.get("counters", {})),
    )


def campaign_record(spec: CampaignSpec) -> dict[str, Any]:
    """What turns a seed into a run (the generation options)."""
    return {"scenario": spec.scenario, "profile": spec.profile, "peers": spec.peers, "duration": spec.duration,
            "quiet": spec.quiet, "params": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.params}}


def summary(results: Sequence[SeedResult]) -> dict[str, Any]:
    """Totals over the seeds (the figures of the summary table, as data)."""
    wall = sum(r.wall for r in results)
    recovery = sorted(r.converged_after for r in results if r.converged_after is not None)
    counters: Counter[str] = Counter()
    for r in results:
        counters.update(r.counters)
    return {
        "seeds": len(results),
        "passed": sum(r.ok for r in results),
        "failed": sum(not r.ok for r in results),
        "failing_seeds": [r.seed for r in results if not r.ok],
        "failure_kinds": dict(sorted(Counter(k for r in results for k in r.kinds).items())),
        "faults": sum(r.faults for r in results),
        "faults_by_kind": dict(sorted(sum((Counter(r.fault_kinds) for r in results), Counter()).items())),
        "recovery_seconds": {"median": statistics.median(recovery), "max": recovery[-1]} if recovery else None,
        "unrecovered": sum(r.converged_after is None for r in results),
        "counters": dict(sorted(counters.items())),
        "virtual_seconds": sum(r.virtual for r in results),
        "wall_seconds": round(wall, 3),
        "peer_seconds_per_wall_second": sum(r.peer_seconds for r in results) / max(wall, 1e-9),
    }


def document(spec: CampaignSpec, results: Sequence[SeedResult], **extra: Any) -> dict[str, Any]:
    """The whole file: the campaign, the seeds' records in seed order, the summary (plus
    ``extra`` figures of this run: ``ran_on``, ``elapsed_seconds``, ``complete``)."""
    ordered = sorted(results, key=lambda r: r.seed)
    return {"format": FORMAT, "campaign": campaign_record(spec), "seeds": [seed_record(r, spec) for r in ordered],
            "summary": {**summary(ordered), **extra}}


def write(path: str | pathlib.Path, doc: Mapping[str, Any]) -> None:
    """Write ``doc`` as JSON (via a temporary file: a reader never sees half a file)."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def load(path: str | pathlib.Path) -> dict[str, Any]:
    """A results file; :class:`ResultsError` if it is not one (``OSError`` if unreadable)."""
    try:
        doc = json.loads(pathlib.Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ResultsError(f"{path}: not a pccl-sim campaign results file (format {FORMAT})")
    return doc


def merge(docs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One document with the union of the seeds of ``docs`` (all of one campaign), the summary
    computed again.  :class:`ResultsError` if the campaigns differ or a seed has two hashes."""
    docs = list(docs)
    if not docs:
        raise ResultsError("nothing to merge")
    campaign = docs[0]["campaign"]
    seeds: dict[int, Mapping[str, Any]] = {}
    for doc in docs:
        if doc["campaign"] != campaign:
            raise ResultsError(f"different campaigns: {doc['campaign']} and {campaign}")
        for record in doc["seeds"]:
            seen = seeds.setdefault(record["seed"], record)
            if seen["trace_hash"] != record["trace_hash"]:
                raise ResultsError(f"seed {record['seed']} has two trace hashes, {seen['trace_hash']} and "
                                   f"{record['trace_hash']}: non-deterministic, or run by different code")
    results = [from_record(seeds[s]) for s in sorted(seeds)]
    return {"format": FORMAT, "campaign": dict(campaign), "seeds": [dict(seeds[s]) for s in sorted(seeds)],
            "summary": {**summary(results), "merged_from": len(docs)}}

