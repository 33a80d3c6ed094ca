"""Where faults land: the (victim phase × master phase × fault kind) coverage matrix.

Time-triggered kills land where time is *spent* (idle, waiting in a vote); short protocol phases
are only reached by phase-triggered faults (the design study found twice as many failures with
them).  This module measures which protocol phases the faults of a run or a campaign actually hit.

A host's *phase* is the last control message it sent or read, as the network carries it — except
the scenario's *idle* messages (heartbeats, say: they tell nothing about the protocol's state) —
reset when the host (re)boots; or, when the frame format names data frames
(:class:`pccl_sim.engine.tap.DataParts`), the part its last data frame belonged to.  While the host
has more than one such operation in flight the data phase says so: ``data:all-gather [2 ops]``.
No hook in the code under test: :class:`PhaseTracker` subscribes to the frame sniffer
(:meth:`pccl_sim.engine.tap.Tap.watch`).  :class:`CoverageProbe` (a checker that never fails) reads
the victim's and the master's phase at the instant each fault is applied and appends a cell to
``trace.stats["coverage"]`` (statistics: not part of the trace hash).  :func:`coverage_table`
prints the campaign's matrix; the scenario says which phases it lists even when no fault hit them
(``Scenario.coverage_phases``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..engine.runner import Checker, Simulation
from ..engine.trace import TraceEvent

__all__ = ["PhaseTracker", "CoverageProbe", "fault_victims", "coverage_table", "NO_PHASE"]

#: Phase of a host that has not sent or read a control message in this incarnation.
NO_PHASE = "-"

Cell = tuple[str, str, str]  # (victim phase, master phase, fault kind)


class PhaseTracker:
    """Each host's protocol phase: the last control message it sent or read that is not in
    ``idle``, or the part its last named data frame belonged to (module docstring)."""

    def __init__(self, idle: Iterable[str] = ()) -> None:
        self.idle = frozenset(idle)
        self.phase: dict[str, str] = {}
        self._tap: Any = None

    def on_message(self, host: str, direction: str, name: str, peer: str, message: Any) -> None:
        if name not in self.idle:
            self.phase[host] = name

    def on_data(self, host: str, direction: str, header: Any, peer: str, part: str | None) -> None:
        if part is None:
            return  # not a frame of an operation in flight there (a bulk transfer, say)
        ops = self._tap.parts.in_flight(host)
        self.phase[host] = part + (f" [{ops} ops]" if ops > 1 else "")

    def attach(self, sim: Simulation) -> None:
        if sim.tap is not None:
            self._tap = sim.tap
            sim.tap.watch(self.on_message, decode=False)
            if sim.tap.parts is not None:
                sim.tap.watch_data(self.on_data)

    def reset(self, host: str) -> None:
        self.phase.pop(host, None)

    def of(self, host: str) -> str:
        return self.phase.get(host, NO_PHASE)


def fault_victims(event: Mapping[str, Any]) -> list[str]:
    """The hosts a fault (``FaultEvent.to_json()``) hits."""
    kind = event["kind"]
    if kind == "partition":
        return list(event.get("side", ()))
    if kind == "master_restart":
        return [event.get("host") or "master"]
    host = event.get("host")
    return [host] if host else []


class CoverageProbe(Checker):
    """Records the coverage cell of every fault applied in the run (never fails).  ``master``
    names the host whose phase is the second coordinate; ``idle`` are the control messages that
    do not change a phase."""

    name = "coverage"

    def __init__(self, master: str = "master", *, idle: Iterable[str] = ()) -> None:
        self.master = master
        self.tracker = PhaseTracker(idle)

    def attach(self, sim: Simulation) -> None:
        self.tracker.attach(sim)

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "start":
            self.tracker.reset(event.source)
        elif event.kind == "fault" and event.source == "faults":
            fault = event.data["event"]
            cells = sim.trace.stats.setdefault("coverage", [])
            master_phase = self.tracker.of(self.master) if self.master in sim.hosts else "down"
            for victim in fault_victims(fault):
                cells.append([self.tracker.of(victim), master_phase, fault["kind"]])


def coverage_table(
    cells: Iterable[Sequence[str]], *, phases: Sequence[str] = (), master_phases: Sequence[str] | None = None
) -> str:
    """Text tables of a campaign's cells: victim phase × fault kind, master phase × fault kind,
    then the full (victim, master, kind) matrix.  ``phases`` are listed in the victim table and
    ``master_phases`` (default: ``phases``) in the master's even when no fault hit them (an empty
    row is the finding)."""
    counter: Counter[Cell] = Counter(tuple(c) for c in cells)  # type: ignore[misc]
    kinds = sorted({k for _, _, k in counter})
    out: list[str] = []
    for title, index in (("victim phase", 0), ("master phase", 1)):
        rows: dict[str, Counter[str]] = {}
        for cell, n in counter.items():
            rows.setdefault(cell[index], Counter())[cell[2]] += n
        listed = phases if index == 0 or master_phases is None else master_phases
        names = list(dict.fromkeys([*listed, *sorted(rows)]))
        out.append(_table(title, names, kinds, rows))
    out.append(f"{len(counter)} distinct (victim phase, master phase, fault kind) cells, {sum(counter.values())} faults")
    width = max((len(v) for v, _, _ in counter), default=5)
    mwidth = max((len(m) for _, m, _ in counter), default=5)
    for (victim, master, kind), n in sorted(counter.items()):
        out.append(f"  {victim:<{width}}  {master:<{mwidth}}  {kind:<14} {n}")
    return "\n".join(out)


def _table(title: str, names: Sequence[str], kinds: Sequence[str], rows: Mapping[str, Counter[str]]) -> str:
    width = max([len(title), *(len(n) for n in names)])
    cols = [max(len(k), 5) for k in kinds]
    header = f"{title:<{width}} | " + " ".join(f"{k:>{w}}" for k, w in zip(kinds, cols)) + " | total"
    lines = [header, "-" * len(header)]
    for name in names:
        row = rows.get(name, Counter())
        cells = " ".join(f"{row.get(k, 0):>{w}}" for k, w in zip(kinds, cols))
        lines.append(f"{name:<{width}} | {cells} | {sum(row.values()):>5}")
    return "\n".join(lines) + "\n"
