"""Fault schedules: plain data (JSON), generated from a seed, replayed, shrunk.

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
``master_restart`` ``restart`` of the host named ``master`` (placeholder until the master can
                   resume a run; the runner applies it as a restart)
``stall``          freeze ``host`` for ``duration`` seconds (traffic held, connections open)
``partition``      hold traffic between ``side`` and ``other`` (default: everyone else) for
                   ``duration`` seconds, both ways unless ``both_ways`` is false
``clog``           hold traffic from ``host`` to ``other[0]`` (one way) for ``duration`` seconds
=================  ==========================================================================

An event with a :class:`Trigger` is *phase-triggered*: at ``t`` it is armed, and it fires the
first time its trigger condition holds afterwards (before the fault window ends) — "kill H after
it sends message M for the n-th time", "after link a→b carried x bytes".  Time-triggered kills
land where time is spent; short protocol phases are only reached by triggers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import platform
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "FAULT_KINDS",
    "Trigger",
    "FaultEvent",
    "Schedule",
    "FaultRates",
    "PROFILES",
    "generate",
    "provenance",
]

FAULT_KINDS = ("spawn", "kill", "power_off", "restart", "master_restart", "stall", "partition", "clog")
_DIRECTIONS = ("send", "recv", "any")


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
            if not self.host or not self.message or self.nth < 1 or self.direction not in _DIRECTIONS:
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
        root = pathlib.Path(__file__).resolve().parent.parent
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


# --- generation ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FaultRates:
    """How a generated schedule behaves: relative weights per tick, tick spacing, bounds.

    Every ``interval`` (uniform in the range) one action is drawn by weight; an action that
    would leave fewer than ``min_peers`` or more than ``max_peers`` live peers is redrawn among
    the others.  Durations are uniform in ``*_duration``.
    """

    interval: tuple[float, float] = (0.5, 2.0)
    min_peers: int = 2
    max_peers: int = 10
    spawn: float = 0.6
    kill: float = 0.4
    power_off: float = 0.0
    restart: float = 0.0
    stall: float = 0.0
    partition: float = 0.0
    clog: float = 0.0
    master_restart: float = 0.0
    triggered_kill: float = 0.0
    #: A new peer joins and a fault is armed on its own first protocol messages (``messages``),
    #: so faults land in the short join phases (registration, first round) too.
    triggered_join: float = 0.0
    #: What a phase-triggered fault does (``triggered_kill`` / ``triggered_join``): drawn
    #: uniformly from kill, power_off, stall, partition (the victim alone), restart.
    triggered_kinds: tuple[str, ...] = ("kill",)
    stall_duration: tuple[float, float] = (0.1, 3.0)
    partition_duration: tuple[float, float] = (0.1, 5.0)
    clog_duration: tuple[float, float] = (0.05, 2.0)
    restart_down: tuple[float, float] = (0.5, 3.0)
    bytes_trigger: tuple[int, int] = (1, 256 * 1024)


#: Named generation profiles.  ``stress`` is PCCL's own stress test: every 0.5–2 s spawn a peer
#: with p = 0.6 or kill one with p = 0.4, keeping 2–10 peers.
PROFILES: dict[str, FaultRates] = {
    "none": FaultRates(spawn=0.0, kill=0.0),
    "stress": FaultRates(),
    "chaos": FaultRates(
        spawn=0.3, kill=0.15, power_off=0.05, restart=0.05, stall=0.1, partition=0.1, clog=0.1, triggered_kill=0.15
    ),
    "network": FaultRates(spawn=0.0, kill=0.0, stall=0.3, partition=0.4, clog=0.3),
    # Chaos aimed at protocol phases: most faults fire on control messages, of every kind.
    "phases": FaultRates(
        spawn=0.15, kill=0.05, power_off=0.03, restart=0.03, stall=0.04, partition=0.05, clog=0.05,
        triggered_kill=0.4, triggered_join=0.2,
        triggered_kinds=("kill", "kill", "power_off", "stall", "partition", "restart"),
    ),
}


def generate(
    seed: int,
    *,
    profile: str | FaultRates = "stress",
    peers: int = 4,
    duration: float = 30.0,
    quiet: float = 30.0,
    scenario: Mapping[str, Any] | None = None,
    messages: Sequence[str] = (),
    master: str | None = "master",
    peer_prefix: str = "peer",
    initial_peers: Sequence[str] | None = None,
    message_directions: Mapping[str, Sequence[str]] | None = None,
) -> Schedule:
    """Draw a schedule from ``seed`` (deterministic: same arguments, same schedule).

    The generator keeps its own model of which peers are alive (initially ``initial_peers`` or
    ``peer0 … peer{peers-1}``) so that kills target live peers and spawns use fresh names.
    ``messages`` are the control-message names a message trigger may name (the scenario's
    vocabulary); without them ``triggered_kill`` falls back to byte triggers.
    ``message_directions`` (message -> the directions a peer can see it in: ``send``/``recv``)
    keeps triggers plausible ("peer1 *sends* VoteTopology", never "receives").
    """
    from .engine.determinism import derive_rng

    rates = PROFILES[profile] if isinstance(profile, str) else profile
    rng = derive_rng(seed, "schedule")
    alive = list(initial_peers) if initial_peers is not None else [f"{peer_prefix}{i}" for i in range(peers)]
    next_index = len(alive)
    while f"{peer_prefix}{next_index}" in alive:
        next_index += 1
    events: list[FaultEvent] = []
    weights = {
        name: getattr(rates, name)
        for name in (
            "spawn", "kill", "power_off", "restart", "stall", "partition", "clog", "master_restart", "triggered_kill",
            "triggered_join",
        )
    }
    if master is None:
        weights["master_restart"] = 0.0
    t = rng.uniform(*rates.interval)
    while t < duration and any(weights.values()):
        names = [n for n, w in weights.items() if w > 0]
        while names:
            action = rng.choices(names, weights=[weights[n] for n in names])[0]
            removes_peer = action in ("kill", "power_off", "triggered_kill")
            if (action in ("spawn", "triggered_join") and len(alive) >= rates.max_peers) or (
                removes_peer and len(alive) <= rates.min_peers
            ) or (action in ("restart", "stall") and not alive):
                names.remove(action)
                continue
            break
        else:
            t += rng.uniform(*rates.interval)
            continue
        t_event = round(t, 6)
        hosts = sorted(alive) + ([master] if master else [])
        if action == "spawn":
            name = f"{peer_prefix}{next_index}"
            next_index += 1
            alive.append(name)
            events.append(FaultEvent(t_event, "spawn", host=name, role="peer"))
        elif action in ("kill", "power_off"):
            victim = rng.choice(sorted(alive))
            alive.remove(victim)
            events.append(FaultEvent(t_event, action, host=victim))
        elif action == "restart":
            victim = rng.choice(sorted(alive))
            events.append(FaultEvent(t_event, "restart", host=victim, duration=round(rng.uniform(*rates.restart_down), 6)))
        elif action == "master_restart":
            events.append(
                FaultEvent(t_event, "master_restart", host=master, duration=round(rng.uniform(*rates.restart_down), 6))
            )
        elif action == "stall":
            victim = rng.choice(hosts)
            events.append(FaultEvent(t_event, "stall", host=victim, duration=round(rng.uniform(*rates.stall_duration), 6)))
        elif action == "partition":
            size = rng.randint(1, max(1, len(hosts) // 2))
            side = tuple(sorted(rng.sample(hosts, size)))
            events.append(
                FaultEvent(t_event, "partition", side=side, duration=round(rng.uniform(*rates.partition_duration), 6))
            )
        elif action == "clog":
            a, b = rng.sample(hosts, 2) if len(hosts) >= 2 else (hosts[0], hosts[0])
            events.append(
                FaultEvent(t_event, "clog", host=a, other=(b,), duration=round(rng.uniform(*rates.clog_duration), 6))
            )
        elif action in ("triggered_kill", "triggered_join"):
            if action == "triggered_join":
                victim = f"{peer_prefix}{next_index}"
                next_index += 1
                alive.append(victim)
                events.append(FaultEvent(t_event, "spawn", host=victim, role="peer"))
            else:
                victim = rng.choice(sorted(alive))
            kind = rng.choice(rates.triggered_kinds) if len(rates.triggered_kinds) > 1 else rates.triggered_kinds[0]
            if kind in ("kill", "power_off"):
                alive.remove(victim)
            if messages:
                if message_directions:
                    message = rng.choice(list(messages))
                    direction = rng.choice(list(message_directions.get(message, _DIRECTIONS)))
                else:
                    direction, message = rng.choice(_DIRECTIONS), rng.choice(list(messages))
                trigger = Trigger(
                    "message", host=victim, direction=direction, message=message,
                    nth=1 if action == "triggered_join" else rng.randint(1, 3),
                )
            else:
                others = [h for h in hosts if h != victim]
                trigger = Trigger(
                    "bytes", src=victim, dst=rng.choice(others) if others else victim,
                    bytes=rng.randint(*rates.bytes_trigger),
                )
            if kind in ("kill", "power_off"):
                events.append(FaultEvent(t_event, kind, host=victim, trigger=trigger))
            elif kind == "stall":
                length = round(rng.uniform(*rates.stall_duration), 6)
                events.append(FaultEvent(t_event, "stall", host=victim, duration=length, trigger=trigger))
            elif kind == "partition":
                length = round(rng.uniform(*rates.partition_duration), 6)
                events.append(FaultEvent(t_event, "partition", side=(victim,), duration=length, trigger=trigger))
            elif kind == "restart":
                length = round(rng.uniform(*rates.restart_down), 6)
                events.append(FaultEvent(t_event, "restart", host=victim, duration=length, trigger=trigger))
            else:
                raise ValueError(f"unsupported triggered fault kind {kind!r}")
        t += rng.uniform(*rates.interval)
    return Schedule(
        seed=seed,
        events=events,
        duration=duration,
        quiet=quiet,
        scenario=dict(scenario or {}),
        profile=profile if isinstance(profile, str) else "custom",
        meta=provenance(),
    )
