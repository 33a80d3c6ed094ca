"""Peers behind NAT and relays in the pccl workload (``pccl_sim.workloads.pccl.reachability``):
a run whose pairs need every path (local, advertised port maps, dial-backs, relays) passes; a
relay killed mid-run is survived (pairs move to the other relay, or to the same one when it is
back and registered again); same seed, same trace hash; and the ``chaos`` and ``phases``
profiles really put peers behind NAT and really kill relays."""

from __future__ import annotations

import collections

import pytest

from pccl.protocol import codec, handshake
from pccl.protocol import messages as m
from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Schedule
from pccl_sim.engine.tap import _FrameParser
from pccl_sim.engine.trace import Trace
from pccl_sim.workloads.pccl.frames import PcclFrames
from pccl_sim.workloads.pccl.reachability import MAPPED_PORT_BASE, RELAY_PORT, NatLayout
from pccl_sim.workloads.pccl.scenario import PcclScenario, pccl_schedule

#: Every place: two peers behind one NAT, two behind NATs of their own (one dropping, one
#: refusing), one with a port map of other numbers, one public.
LAYOUT = {"peer0": "shared", "peer1": "shared", "peer2": "isolated", "peer3": "isolated-refuse", "peer4": "mapped"}


def _scenario(**params: object) -> PcclScenario:
    base: dict[str, object] = dict(peers=6, nat=LAYOUT, relays=1, direct_connect_timeout=1.0,
                                   phases=("compute", "all_reduce"))
    base.update(params)
    return PcclScenario(**base)  # type: ignore[arg-type]


def _schedule(scenario: PcclScenario, events: list[FaultEvent], *, seed: int = 1, duration: float = 6.0) -> Schedule:
    return Schedule(seed=seed, events=events, duration=duration, quiet=round(scenario.liveness_bound * 1.2, 3),
                    scenario=scenario.to_json(), profile="custom")


def _connects(trace: Trace, remote: str, *, after: float = 0.0, before: float = float("inf")) -> list[str]:
    """Hosts that connected to ``remote`` in ``[after, before)``."""
    return [e.source for e in trace.events
            if e.kind == "connect" and e.data.get("remote") == remote and after <= e.t < before]


def _full_steps(trace: Trace, size: int) -> int:
    return sum(1 for e in trace.events if e.kind == "step" and e.data["world_size"] == size)


def test_every_path_is_used_and_the_run_passes() -> None:
    scenario = _scenario()
    trace = run(scenario, _schedule(scenario, []))
    assert trace.ok, trace.failures
    assert _full_steps(trace, 6) > 0
    # The shared pair at its private addresses, the mapped peer at its advertised public ports
    # (other numbers than the bound ones), the isolated ones through the relay.
    assert _connects(trace, "peer1:48150") or _connects(trace, "peer0:48150")
    assert _connects(trace, f"nat4:{MAPPED_PORT_BASE + 8}")
    relayed = set(_connects(trace, f"relay0:{RELAY_PORT}"))
    assert {"peer2", "peer3"} & relayed, relayed
    assert any(e.source == "relay0" and e.kind == "relay_registered" for e in trace.events)


def test_the_master_relays_when_there_is_no_relay_host() -> None:
    scenario = _scenario(relays=0, master_relay=True)
    trace = run(scenario, _schedule(scenario, []))
    assert trace.ok, trace.failures
    assert _full_steps(trace, 6) > 0
    # Relayed pairs join at the master's own port: more connects to it than registrations.
    assert len(_connects(trace, "master:48148")) > 6


def test_a_relay_killed_mid_run_pairs_move_to_the_other_relay() -> None:
    scenario = _scenario(relays=2)
    trace = run(scenario, _schedule(scenario, [FaultEvent(3.0, "kill", host="relay0")], duration=10.0))
    assert trace.ok, trace.failures
    before = set(_connects(trace, f"relay0:{RELAY_PORT}", before=3.0)) | set(
        _connects(trace, f"relay1:{RELAY_PORT}", before=3.0))
    assert before, "no pair was relayed before the kill"
    assert _connects(trace, f"relay1:{RELAY_PORT}", after=3.0, before=10.0), "no pair moved to relay1"
    assert not _connects(trace, f"relay0:{RELAY_PORT}", after=3.0, before=10.0)
    assert trace.stats["converged_after"] is not None


def test_a_restarted_relay_registers_again_and_relays_again() -> None:
    scenario = _scenario()
    trace = run(scenario, _schedule(scenario, [FaultEvent(3.0, "restart", host="relay0", duration=1.0)],
                                    duration=10.0))
    assert trace.ok, trace.failures
    registered = [e.t for e in trace.events if e.source == "relay0" and e.kind == "relay_registered"]
    assert len(registered) == 2 and registered[1] > 4.0, registered
    assert _connects(trace, f"relay0:{RELAY_PORT}", before=3.0)
    assert _connects(trace, f"relay0:{RELAY_PORT}", after=registered[1], before=10.0)
    # Membership came back to all six after the relay did.
    assert any(e.kind == "step" and e.data["world_size"] == 6 and e.t > registered[1] for e in trace.events)


def _nat_seed(profile: str) -> tuple[PcclScenario, Schedule]:
    """The first seed of ``profile`` whose schedule has NATed peers and a relay death."""
    for seed in range(50):
        scenario, schedule = pccl_schedule(seed, profile=profile, peers=4, duration=6.0)
        if scenario.layout.active and any(e.host in scenario.relays and e.kind in ("kill", "power_off", "restart")
                                          for e in schedule.events):
            return scenario, schedule
    raise AssertionError(f"no seed of {profile} below 50 has NAT and a relay death")


@pytest.mark.parametrize("profile", ["chaos", "phases"])
def test_same_seed_same_trace_hash_with_nat_and_relays(profile: str) -> None:
    scenario, schedule = _nat_seed(profile)
    first = run(scenario, schedule)
    again = run(PcclScenario.from_json(schedule.scenario), Schedule.from_json(schedule.to_json()))
    assert first.hash() == again.hash()
    assert any(e.kind == "connect" and str(e.data.get("remote", "")).endswith(f":{RELAY_PORT}") for e in first.events) \
        or scenario.master_relay
    assert any(e.source == "net" and e.kind == "nat" for e in first.events)


@pytest.mark.parametrize("profile", ["chaos", "phases"])
def test_the_nat_profiles_place_peers_behind_nat_and_kill_relays(profile: str) -> None:
    kinds: collections.Counter[str] = collections.Counter()
    relay_deaths = nat_seeds = newcomers_behind_nat = mapped = 0
    relay_counts: set[int] = set()
    for seed in range(20):
        scenario, schedule = pccl_schedule(seed, profile=profile, peers=4)
        places = schedule.scenario.get("nat", {})
        assert places == dict(scenario.layout.places)
        if places:
            nat_seeds += 1
            assert scenario.relays or scenario.master_relay  # every pair has a path
            relay_counts.add(len(scenario.relays))
        kinds.update(places.values())
        mapped += sum(scenario.layout.advertise(h) is not None for h in places)
        spawned = {e.host for e in schedule.events if e.kind == "spawn" and e.role == "peer"}
        newcomers_behind_nat += bool(spawned & set(places))
        relay_deaths += sum(e.host in scenario.relays and e.kind in ("kill", "power_off", "restart")
                            for e in schedule.events)
    assert nat_seeds >= 12, nat_seeds
    assert set(kinds) == {"shared", "isolated", "isolated-refuse", "mapped"}, kinds
    assert mapped > 0 and newcomers_behind_nat > 0
    assert relay_deaths >= 1
    assert relay_counts == {1, 2}


def test_profiles_without_nat_keep_their_schedules() -> None:
    for profile in ("stress", "network", "none"):
        scenario, schedule = pccl_schedule(3, profile=profile, peers=4)
        assert not scenario.layout.active and not scenario.relays
        assert "nat" not in schedule.scenario and "relays" not in schedule.scenario


def test_explicit_nat_parameters_override_the_draw() -> None:
    scenario, schedule = pccl_schedule(3, profile="chaos", peers=3, nat={"peer1": "mapped"}, relays=1)
    assert dict(scenario.layout.places) == {"peer1": "mapped"}
    p2p = MAPPED_PORT_BASE + 2
    assert scenario.config_of("peer1").advertise == f"p2p=nat1:{p2p},shared_state=nat1:{p2p + 1}"
    assert scenario.config_of("peer0").advertise is None
    with pytest.raises(ValueError):
        NatLayout({"peer1": "carrier-grade"})


def test_the_tap_reads_a_spliced_connection_as_frames() -> None:
    """After ``RelayJoin`` the bytes are the two peers' own connection, preamble first."""
    frames = PcclFrames()
    parser = _FrameParser(frames)
    stream = (handshake.encode_preamble() + codec.encode_message(m.RelayJoin(b"k" * 16, 1, 2))
              + handshake.encode_preamble() + codec.encode_message(m.Knock(1, 2, 3, 0)))
    found: list[str] = []
    for i in range(0, len(stream), 7):  # in pieces, as a link delivers them
        parser.feed(stream[i:i + 7], found)
    assert found == ["RelayJoin", "Knock"]
