"""Drawing a fault schedule from a seed: rates per fault kind (:class:`FaultRates`), named
profiles (:data:`PROFILES`) and :func:`generate`.

Generation is deterministic: the same seed and arguments give the same :class:`Schedule`, because
every draw comes from ``derive_rng(seed, "schedule")``.  A scenario wraps :func:`generate` with
its own vocabulary (the control messages a phase trigger may name, the peers it starts with): see
``Scenario.generate_schedule``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..engine.determinism import derive_rng
from ..engine.schedule import TRIGGER_DIRECTIONS, FaultEvent, Schedule, Trigger, provenance

__all__ = ["FaultRates", "PROFILES", "generate"]


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
    #: The master dies (kill -9) and comes back after ``restart_down``: at a drawn time...
    master_restart: float = 0.0
    #: ...or when a peer sends or receives a drawn control message, so that the master's death
    #: lands inside every phase a peer can be in (registration, votes, rounds, collectives, syncs).
    master_kill: float = 0.0
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
    "stress": FaultRates(master_restart=0.02, master_kill=0.02),
    "chaos": FaultRates(
        spawn=0.3, kill=0.15, power_off=0.05, restart=0.05, stall=0.1, partition=0.1, clog=0.1, triggered_kill=0.15,
        master_restart=0.02, master_kill=0.03,
    ),
    "network": FaultRates(spawn=0.0, kill=0.0, stall=0.3, partition=0.4, clog=0.3),
    # Chaos aimed at protocol phases: most faults fire on control messages, of every kind.
    "phases": FaultRates(
        spawn=0.15, kill=0.05, power_off=0.03, restart=0.03, stall=0.04, partition=0.05, clog=0.05,
        triggered_kill=0.4, triggered_join=0.2, master_restart=0.02, master_kill=0.06,
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
    master_message_directions: Mapping[str, Sequence[str]] | None = None,
) -> Schedule:
    """Draw a schedule from ``seed`` (deterministic: same arguments, same schedule).

    The generator keeps its own model of which peers are alive (initially ``initial_peers`` or
    ``peer0 … peer{peers-1}``) so that kills target live peers and spawns use fresh names.
    ``messages`` are the control-message names a message trigger may name (the scenario's
    vocabulary); without them ``triggered_kill`` falls back to byte triggers.
    ``message_directions`` (message -> the directions a peer can see it in: ``send``/``recv``)
    keeps triggers plausible ("peer1 *sends* VoteTopology", never "receives").
    ``master_message_directions`` (the same from the master's side) lets half of the
    ``master_kill`` faults watch the master itself ("after the master *reads* its 2nd
    ``CollectiveDone``"): the master's short phases between reading a message and answering it
    are reached only that way.  That choice is drawn from its own stream, so adding it shifted
    no other draw of a schedule.
    """
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
            "spawn", "kill", "power_off", "restart", "stall", "partition", "clog", "master_restart", "master_kill",
            "triggered_kill", "triggered_join",
        )
    }
    if master is None:
        weights["master_restart"] = weights["master_kill"] = 0.0
    t = rng.uniform(*rates.interval)
    while t < duration and any(weights.values()):
        names = [n for n, w in weights.items() if w > 0]
        while names:
            action = rng.choices(names, weights=[weights[n] for n in names])[0]
            removes_peer = action in ("kill", "power_off", "triggered_kill")
            if (action in ("spawn", "triggered_join") and len(alive) >= rates.max_peers) or (
                removes_peer and len(alive) <= rates.min_peers
            ) or (action in ("restart", "stall", "master_kill") and not alive):
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
        elif action == "master_kill":
            watched = rng.choice(sorted(alive))
            down = round(rng.uniform(*rates.restart_down), 6)
            trigger = _trigger(rng, rates, watched, hosts, messages, message_directions)
            if master_message_directions and master is not None:
                aim = derive_rng(seed, f"master-watch-{len(events)}")
                if aim.random() < 0.5:
                    trigger = _trigger(aim, rates, master, hosts, tuple(master_message_directions),
                                       master_message_directions)
            events.append(FaultEvent(t_event, "master_restart", host=master, duration=down, trigger=trigger))
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
            trigger = _trigger(rng, rates, victim, hosts, messages, message_directions,
                               nth=1 if action == "triggered_join" else None)
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


def _trigger(rng: Any, rates: FaultRates, host: str, hosts: Sequence[str], messages: Sequence[str],
             message_directions: Mapping[str, Sequence[str]] | None, *, nth: int | None = None) -> Trigger:
    """A phase trigger on ``host``: the ``nth`` time (drawn from 1-3 when ``None``) it sees one
    of the scenario's messages, in a direction it can see it in; a byte count on one of its
    links when the scenario names no messages."""
    if messages:
        if message_directions:
            message = rng.choice(list(messages))
            direction = rng.choice(list(message_directions.get(message, TRIGGER_DIRECTIONS)))
        else:
            direction, message = rng.choice(TRIGGER_DIRECTIONS), rng.choice(list(messages))
        return Trigger("message", host=host, direction=direction, message=message,
                       nth=rng.randint(1, 3) if nth is None else nth)
    others = [h for h in hosts if h != host]
    return Trigger("bytes", src=host, dst=rng.choice(others) if others else host,
                   bytes=rng.randint(*rates.bytes_trigger))
