"""Peers behind NAT and relays in the pccl workload: the layout (:class:`NatLayout`, drawn from a
seed by :func:`draw_layout`), how it is installed in the world, and the relay faults
(:func:`relay_faults`).

A layout is plain data, kept in the schedule's scenario parameters (``nat``, ``relays``,
``master_relay``; :func:`draw_relays` and :func:`draw_layout` draw them from a seed), so a saved
schedule replays with the hosts where they were.  Each peer host name is in one place for the
whole run (a restarted peer comes back behind the same NAT):

* ``"shared"``: behind the one shared NAT ``nat``, with the other shared peers (they reach each
  other at their local candidates; nobody outside reaches them);
* ``"isolated"`` / ``"isolated-refuse"``: behind a NAT of its own, ``natN`` for ``peerN``,
  nothing forwarded; SYNs to it are dropped (connects time out) or refused.  It can dial out, so
  a public peer reaches it by a dial-back; a pair of two such peers (or one and a shared peer)
  needs a relay;
* ``"mapped"``: behind a NAT of its own whose public ports forward to its listeners under
  *other* numbers (:data:`MAPPED_PORT_BASE` + 2N, + 2N + 1), and ``Config.advertise`` says so:
  everyone dials it directly at the advertised endpoints;
* absent from ``nat``: a public host.

Relays are hosts ``relay0``, ``relay1``... running :func:`pccl.relay.serve_relay` on
:data:`RELAY_PORT`, registered with the master (``master_relay``: the master relays too).  They
are hosts that can die: :func:`relay_faults` draws kill -9 with a restart, a kill or a power-off
and a later start, a restart when a peer's ``RelayJoin`` reaches the relay (the death lands in a
rendezvous), stalls and partitions, from the seed's own stream (``derive_rng(seed,
"relay-faults")``), so the peers' fault draws are those of a run without relays.  A relay that
is down when the faults stop is started again (``on_quiet``), as the master is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from ...engine.determinism import derive_rng
from ...engine.network import World
from ...engine.schedule import FaultEvent, Trigger

__all__ = ["NatLayout", "NAT_PROFILES", "PLACES", "RELAY_PORT", "MAPPED_PORT_BASE", "SHARED_NAT", "draw_relays",
           "draw_layout", "relay_faults", "relay_names", "host_index", "layout_params"]

#: The port simulated relays listen on (``pccl relay``'s default).
RELAY_PORT = 48147
#: A mapped peer ``peerN``'s NAT forwards ``MAPPED_PORT_BASE + 2N`` to its p2p listener and
#: ``+ 2N + 1`` to its shared-state listener (numbers unlike the bound ones).
MAPPED_PORT_BASE = 20000
#: The public name of the NAT the ``"shared"`` peers are behind.
SHARED_NAT = "nat"
#: Where a peer can be (besides public).
PLACES = ("shared", "isolated", "isolated-refuse", "mapped")
#: The profiles whose seeds draw a layout (when the caller gives none).
NAT_PROFILES = frozenset({"chaos", "phases"})

#: Of the seeds of a NAT profile, those with nobody behind NAT (and no relay).
_NO_NAT = 0.15
#: How a peer host name is placed: public, or one of :data:`PLACES`.
_PLACE_WEIGHTS = {"public": 0.4, "shared": 0.2, "isolated": 0.17, "isolated-refuse": 0.08, "mapped": 0.15}
_TWO_RELAYS = 0.35
_MASTER_RELAY = 0.3


def host_index(host: str) -> int:
    digits = "".join(c for c in host if c.isdigit())
    return int(digits or 0)


def relay_names(count: int) -> list[str]:
    return [f"relay{i}" for i in range(count)]


@dataclasses.dataclass(frozen=True)
class NatLayout:
    """Where each peer host stands (module docstring); ``places``: host -> place, public hosts
    omitted."""

    places: Mapping[str, str]

    def __post_init__(self) -> None:
        for host, place in self.places.items():
            if place not in PLACES:
                raise ValueError(f"unknown NAT place {place!r} for {host}; expected one of {PLACES}")

    @property
    def active(self) -> bool:
        return bool(self.places)

    def nat_name(self, host: str) -> str | None:
        """The public name of the NAT ``host`` is behind, or ``None`` (public)."""
        place = self.places.get(host)
        if place is None:
            return None
        return SHARED_NAT if place == "shared" else f"nat{host_index(host)}"

    def advertise(self, host: str) -> str | None:
        """``Config.advertise`` for ``host``: its mapped endpoints (``None``: nothing to say)."""
        if self.places.get(host) != "mapped":
            return None
        nat, p2p = self.nat_name(host), MAPPED_PORT_BASE + 2 * host_index(host)
        return f"p2p={nat}:{p2p},shared_state={nat}:{p2p + 1}"

    def install(self, world: World, *, p2p_port: int, shared_state_port: int) -> None:
        """Make the NATs and put the hosts behind them (before any host connects)."""
        if not self.active:
            return
        if "shared" in self.places.values():
            world.add_nat(SHARED_NAT)
        for host in sorted(self.places, key=host_index):
            place = self.places[host]
            name = self.nat_name(host)
            assert name is not None
            if place != "shared":
                world.add_nat(name, inbound="refuse" if place == "isolated-refuse" else "drop")
            world.put_behind(host, name)
            if place == "mapped":
                public = MAPPED_PORT_BASE + 2 * host_index(host)
                world.nat(name).map(public, host, p2p_port)
                world.nat(name).map(public + 1, host, shared_state_port)


def draw_relays(seed: int) -> tuple[int, bool]:
    """Whether the seed puts peers behind NAT: its relay count (0: no NAT, no relay) and whether
    the master relays too (``derive_rng(seed, "nat")``)."""
    rng = derive_rng(seed, "nat")
    if rng.random() < _NO_NAT:
        return 0, False
    relays = 2 if rng.random() < _TWO_RELAYS else 1
    return relays, rng.random() < _MASTER_RELAY


def draw_layout(seed: int, peer_names: Iterable[str], initial: Sequence[str]) -> NatLayout:
    """The seed's places for ``peer_names`` (every peer host of the run, newcomers included):
    one draw per host index, in index order (``derive_rng(seed, "nat-places")``), so ``peerN``'s
    place depends on the seed and N only.  At least one of the ``initial`` peers is behind NAT."""
    rng = derive_rng(seed, "nat-places")
    names, weights = list(_PLACE_WEIGHTS), list(_PLACE_WEIGHTS.values())
    places: dict[str, str] = {}
    for host in sorted(set(peer_names), key=host_index):
        place = rng.choices(names, weights=weights)[0]
        if place != "public":
            places[host] = place
    if initial and not any(h in places for h in initial):
        places[rng.choice(sorted(initial, key=host_index))] = rng.choice(PLACES)
    return NatLayout(places)


def relay_faults(seed: int, relays: Sequence[str], *, duration: float, messages: bool = True,
                 restart_down: tuple[float, float] = (0.5, 3.0)) -> list[FaultEvent]:
    """Faults on the relay hosts over the fault window ``[0, duration)`` (module docstring),
    drawn from the seed's ``relay-faults`` stream.  ``messages``: the scenario's wire is read, so
    a restart may wait for a peer's ``RelayJoin`` at the relay."""
    if not relays:
        return []
    rng = derive_rng(seed, "relay-faults")
    kinds = {"restart": 0.3, "kill": 0.15, "power_off": 0.1, "triggered": 0.2 if messages else 0.0,
             "stall": 0.12, "partition": 0.13}
    names, weights = list(kinds), list(kinds.values())
    down_until = {relay: 0.0 for relay in relays}
    events: list[FaultEvent] = []
    t = rng.uniform(1.0, 4.0)
    while t < duration:
        up = [r for r in relays if down_until[r] <= t]
        if up:
            kind = rng.choices(names, weights=weights)[0]
            victim = rng.choice(up)
            at = round(t, 6)
            if kind in ("restart", "triggered"):
                down = round(rng.uniform(*restart_down), 6)
                trigger = None
                if kind == "triggered":
                    trigger = Trigger("message", host=victim, direction="recv", message="RelayJoin",
                                      nth=rng.randint(1, 3))
                events.append(FaultEvent(at, "restart", host=victim, duration=down, trigger=trigger))
                # A triggered one fires later, if at all (then the relay is down for a while).
                down_until[victim] = t + down + (3.0 if trigger is not None else 0.0)
            elif kind in ("kill", "power_off"):
                down = round(rng.uniform(2.0, 8.0), 6)
                events.append(FaultEvent(at, kind, host=victim))
                if t + down < duration:
                    events.append(FaultEvent(round(t + down, 6), "spawn", host=victim, role="relay"))
                down_until[victim] = t + down
            elif kind == "stall":
                events.append(FaultEvent(at, "stall", host=victim, duration=round(rng.uniform(0.1, 3.0), 6)))
            else:
                events.append(FaultEvent(at, "partition", side=(victim,), duration=round(rng.uniform(0.1, 5.0), 6)))
        t += rng.uniform(1.5, 4.0)
    return events


def layout_params(layout: NatLayout) -> dict[str, str]:
    """The scenario parameter ``nat`` that describes a layout (plain data, in host order)."""
    return dict(sorted(layout.places.items(), key=lambda kv: host_index(kv[0])))
