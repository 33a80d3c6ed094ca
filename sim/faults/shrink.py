"""Shrinking a failing schedule to a minimal one that still fails, and replaying schedules.

:func:`ddmin` is Zeller's delta debugging over the event list: it returns a 1-minimal subset
(removing any single remaining event makes the failure go away), asking the oracle about
``O(n²)`` subsets in the worst case and ``O(log n)`` when one or two events are to blame.  The
seed stays fixed, so the hosts, links and trio's scheduler draw the same random numbers
(RNGs are derived per purpose, see :mod:`pccl_sim.engine.runner`); removing an event can still shift the
timing of what follows, which is why the result is 1-minimal, not globally minimal.

:func:`shrink` runs ddmin, then simplifies values: it halves durations and drops trigger
chains while the schedule still fails.  The oracle decides what "still fails" means; the default
built by :func:`same_failure` requires a failure of the same kind(s) as the original run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from ..engine.runner import RunOptions, Scenario, run
from ..engine.trace import Trace
from ..engine.schedule import FaultEvent, Schedule

__all__ = ["ddmin", "shrink", "ShrinkResult", "same_failure", "NotFailing"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class NotFailing(ValueError):
    """The schedule handed to the shrinker does not fail in the first place."""


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """A 1-minimal sub-list of ``items`` (order kept) for which ``fails`` still holds.

    ``fails(list(items))`` must be true.  Results are cached, so ``fails`` is asked about each
    subset at most once.
    """
    cache: dict[tuple[int, ...], bool] = {}
    everything = list(items)

    def test(indices: list[int]) -> bool:
        key = tuple(indices)
        if key not in cache:
            cache[key] = fails([everything[i] for i in indices])
        return cache[key]

    current = list(range(len(everything)))
    if not test(current):
        raise NotFailing("the full input does not fail")
    if current and test([]):
        return []
    granularity = 2
    while len(current) >= 2:
        size = len(current)
        bounds = [size * k // granularity for k in range(granularity + 1)]
        chunks = [current[bounds[k] : bounds[k + 1]] for k in range(granularity) if bounds[k] < bounds[k + 1]]
        for chunk in chunks:
            if test(chunk):
                current, granularity = chunk, 2
                break
        else:
            for k in range(len(chunks)):
                complement = [i for j, c in enumerate(chunks) if j != k for i in c]
                if test(complement):
                    current, granularity = complement, max(granularity - 1, 2)
                    break
            else:
                if granularity >= size:
                    break
                granularity = min(size, granularity * 2)
    return [everything[i] for i in current]


@dataclasses.dataclass
class ShrinkResult:
    schedule: Schedule
    original_events: int
    runs: int

    @property
    def events(self) -> list[FaultEvent]:
        return self.schedule.events


def _simplifications(event: FaultEvent) -> list[FaultEvent]:
    """Simpler variants of one event, most aggressive first."""
    out: list[FaultEvent] = []
    if event.trigger is not None and event.trigger.after is not None:
        out.append(dataclasses.replace(event, trigger=dataclasses.replace(event.trigger, after=None)))
    if event.duration > 0.01:
        out.append(dataclasses.replace(event, duration=round(event.duration / 2, 6)))
    return out


def shrink(
    schedule: Schedule,
    fails: Callable[[Schedule], bool],
    *,
    simplify: bool = True,
    max_runs: int = 500,
) -> ShrinkResult:
    """Minimise ``schedule.events`` while ``fails(schedule)`` holds (see the module docstring).

    Raises :class:`NotFailing` if the schedule does not fail to begin with.  Stops simplifying
    (keeping the best schedule so far) after ``max_runs`` oracle calls.
    """
    runs = 0

    def oracle(events: list[FaultEvent]) -> bool:
        nonlocal runs
        runs += 1
        verdict = fails(schedule.with_events(events))
        logger.info("shrink run %d: %d events -> %s", runs, len(events), "fails" if verdict else "passes")
        return verdict

    events = ddmin(schedule.events, oracle)
    if simplify:
        changed = True
        while changed and runs < max_runs:
            changed = False
            for i, event in enumerate(events):
                for simpler in _simplifications(event):
                    if runs >= max_runs:
                        break
                    candidate = events[:i] + [simpler] + events[i + 1 :]
                    if oracle(candidate):
                        events, changed = candidate, True
                        break
                if changed:
                    break
    return ShrinkResult(schedule.with_events(events), len(schedule.events), runs)


def same_failure(
    scenario_factory: Callable[[Schedule], Scenario],
    kinds: Sequence[str],
    *,
    options: RunOptions | None = None,
) -> Callable[[Schedule], bool]:
    """An oracle: the schedule, run, fails with one of ``kinds`` (e.g. the original's)."""
    wanted = set(kinds)

    def fails(candidate: Schedule) -> bool:
        trace: Trace = run(scenario_factory(candidate), candidate, options=options)
        return bool(wanted & set(trace.failure_kinds))

    return fails
