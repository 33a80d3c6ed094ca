"""Fault schedules: plain data (JSON) that, with the code, determines a simulated run.

A :class:`Schedule` is everything a run needs besides the code: the seed (which also drives
trio's scheduler, link jitter and every host's RNG), the scenario's parameters, the fault window
(``duration``) and the quiet window after it (``quiet``: everything healed, the system must
recover), and the :class:`FaultEvent` list.  It also records provenance — the pccl commit, trio
and Python versions — because a seed replays bit-for-bit only with the same code (VOPR pairs the
seed with the commit for the same reason).

Fault kinds (``FaultEvent.kind``):

=================  ==========================================================================
``spawn``          start ``host`` (role ``role`` or the scenario's default): a join, or a
                   restart of a dead host (new incarnation)
``kill``           kill -9 the process on ``host``: its connections reset, its tasks cancelled
``power_off``      the machine vanishes silently (no FIN, no RST)
``restart``        ``kill`` now, ``spawn`` again after ``duration`` seconds
``master_restart`` ``restart`` of the host named ``master``: kill -9 now (or when its trigger,
                   on a peer's message, fires), start again after ``duration``; the peers
                   reconnect and the run goes on (pccl's master restart)
``stall``          freeze ``host`` for ``duration`` seconds (traffic held, connections open)
``partition``      hold traffic between ``side`` and ``other`` (default: everyone else) for
                   ``duration`` seconds, both ways unless ``both_ways`` is false
``clog``           hold traffic from ``host`` to ``other[0]`` (one way) for ``duration`` seconds
=================  ==========================================================================

An event with a :class:`Trigger` is *phase-triggered*: at ``t`` it is armed, and it fires the
first time its trigger condition holds afterwards (before the fault window ends) — "kill H after
it sends message M for the n-th time", "after link a→b carried x bytes".  Time-triggered kills
land where time is spent; short protocol phases are only reached by triggers.

Schedules are drawn from a seed by :mod:`pccl_sim.faults.generate` and minimised by
:mod:`pccl_sim.faults.shrink`; a saved one replays from its JSON alone (its ``scenario`` names the
scenario by its registered short name, e.g. ``"pccl"``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import platform
import subprocess
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "TRIGGER_DIRECTIONS",
    "Trigger",
    "FaultEvent",
    "Schedule",
    "provenance",
]

FAULT_KINDS = ("spawn", "kill", "power_off", "restart", "master_restart", "stall", "partition", "clog")
#: How a message trigger watches its host: sending, reading, or either.
TRIGGER_DIRECTIONS = ("send", "recv", "any")


@dataclasses.dataclass(frozen=True)
class Trigger:
    """When an armed fault fires.

    ``type="message"``: ``host`` sent (``direction="send"``), read (``"recv"``) or either
    (``"any"``) the control message named ``message`` for the ``nth`` time since arming.
    ``type="bytes"``: the links ``src``→``dst`` carried ``bytes`` payload bytes since arming.
    ``after``: another trigger that must fire first (arming this one), e.g. "200 KiB after
    peer2 received its 3rd ``Commence``".
    """

    type: str
    host: str | None = None
    direction: str = "any"
    message: str | None = None
    nth: int = 1
    src: str | None = None
    dst: str | None = None
    bytes: int = 0
    after: "Trigger | None" = None

    def __post_init__(self) -> None:
        if self.type == "message":
            if not self.host or not self.message or self.nth < 1 or self.direction not in TRIGGER_DIRECTIONS:
                raise ValueError(f"message trigger needs host, message, nth >= 1 and a direction: {self}")
        elif self.type == "bytes":
            if not self.src or not self.dst or self.bytes < 0:
                raise ValueError(f"bytes trigger needs src, dst and bytes >= 0: {self}")
        else:
            raise ValueError(f"unknown trigger type {self.type!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "message":
            out.update(host=self.host, direction=self.direction, message=self.message, nth=self.nth)
        else:
            out.update(src=self.src, dst=self.dst, bytes=self.bytes)
        if self.after is not None:
            out["after"] = self.after.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Trigger":
        fields = {k: v for k, v in data.items() if k != "after"}
        after = data.get("after")
        return cls(**fields, after=None if after is None else cls.from_json(after))

    def describe(self) -> str:
        head = (
            f"{self.host} {self.direction} {self.message} #{self.nth}"
            if self.type == "message"
            else f"{self.src}->{self.dst} carried {self.bytes} B"
        )
        return head if self.after is None else f"{head} after ({self.after.describe()})"


@dataclasses.dataclass(frozen=True)
class FaultEvent:
    """One fault (see the module docstring for the kinds)."""

    t: float
    kind: str
    host: str | None = None
    duration: float = 0.0
    role: str | None = None
    side: tuple[str, ...] = ()
    other: tuple[str, ...] | None = None
    both_ways: bool = True
    trigger: Trigger | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}; expected one of {FAULT_KINDS}")
        if self.t < 0 or self.duration < 0:
            raise ValueError(f"negative time in {self}")
        if self.kind == "partition":
            if not self.side:
                raise ValueError("a partition needs a non-empty side")
        elif self.kind == "clog":
            if not self.host or not self.other or len(self.other) != 1:
                raise ValueError("a clog needs host and other=(destination,)")
        elif self.kind != "master_restart" and not self.host:
            raise ValueError(f"a {self.kind} needs a host")

    @property
    def victim(self) -> str | None:
        return "master" if self.kind == "master_restart" and not self.host else self.host

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "kind": self.kind}
        if self.host is not None:
            out["host"] = self.host
        if self.duration:
            out["duration"] = self.duration
        if self.role is not None:
            out["role"] = self.role
        if self.side:
            out["side"] = list(self.side)
        if self.other is not None:
            out["other"] = list(self.other)
        if not self.both_ways:
            out["both_ways"] = False
        if self.trigger is not None:
            out["trigger"] = self.trigger.to_json()
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "FaultEvent":
        trigger = data.get("trigger")
        other = data.get("other")
        return cls(
            t=float(data["t"]),
            kind=data["kind"],
            host=data.get("host"),
            duration=float(data.get("duration", 0.0)),
            role=data.get("role"),
            side=tuple(data.get("side", ())),
            other=None if other is None else tuple(other),
            both_ways=bool(data.get("both_ways", True)),
            trigger=None if trigger is None else Trigger.from_json(trigger),
        )

    def describe(self) -> str:
        parts = [f"t={self.t:.3f}", self.kind]
        if self.host:
            parts.append(self.host)
        if self.kind in ("partition",):
            parts.append(f"{list(self.side)}|{'rest' if self.other is None else list(self.other)}")
        if self.kind == "clog" and self.other:
            parts.append(f"->{self.other[0]}")
        if self.duration:
            parts.append(f"for {self.duration:.3f}s")
        if self.trigger is not None:
            parts.append(f"when {self.trigger.describe()}")
        return " ".join(parts)


def provenance() -> dict[str, str]:
    """The replay key besides the seed: pccl commit, trio and Python versions."""
    return dict(_provenance())


@functools.lru_cache(maxsize=1)
def _provenance() -> tuple[tuple[str, str], ...]:
    import trio

    commit = "unknown"
    try:
        root = pathlib.Path(__file__).resolve().parents[2]  # the repository
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
        if out.returncode == 0 and out.stdout.strip():
            commit = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return (("pccl", commit), ("trio", trio.__version__), ("python", platform.python_version()))


@dataclasses.dataclass
class Schedule:
    """A complete, replayable description of one simulated run (module docstring)."""

    seed: int
    events: list[FaultEvent] = dataclasses.field(default_factory=list)
    duration: float = 30.0
    quiet: float = 30.0
    scenario: dict[str, Any] = dataclasses.field(default_factory=dict)
    profile: str = "custom"
    meta: dict[str, str] = dataclasses.field(default_factory=dict)

    FORMAT = 1

    @property
    def horizon(self) -> float:
        """Virtual time at which the run ends."""
        return self.duration + self.quiet

    def with_events(self, events: Iterable[FaultEvent]) -> "Schedule":
        return dataclasses.replace(self, events=list(events))

    def sorted_events(self) -> list[tuple[int, FaultEvent]]:
        """``(index, event)`` in firing order (time, then position in the list)."""
        return sorted(enumerate(self.events), key=lambda item: (item[1].t, item[0]))

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.FORMAT,
            "seed": self.seed,
            "profile": self.profile,
            "duration": self.duration,
            "quiet": self.quiet,
            "scenario": self.scenario,
            **{k: self.meta[k] for k in sorted(self.meta)},
            "events": [e.to_json() for e in self.events],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Schedule":
        if data.get("format") != cls.FORMAT:
            raise ValueError(f"unsupported schedule format {data.get('format')!r} (expected {cls.FORMAT})")
        meta = {k: str(data[k]) for k in ("pccl", "trio", "python") if k in data}
        return cls(
            seed=int(data["seed"]),
            events=[FaultEvent.from_json(e) for e in data.get("events", [])],
            duration=float(data.get("duration", 30.0)),
            quiet=float(data.get("quiet", 30.0)),
            scenario=dict(data.get("scenario", {})),
            profile=str(data.get("profile", "custom")),
            meta=meta,
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n"

    def save(self, path: str | pathlib.Path) -> None:
        pathlib.Path(path).write_text(self.dumps())

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "Schedule":
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))
