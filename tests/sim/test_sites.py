"""Sites (datacenters) in the virtual network: fast inside, one shared uplink between sites."""

from __future__ import annotations

import math

import pytest
import trio

from pccl_sim.engine.network import LinkSpec, SiteSpec, World
from pccl_sim.engine.runner import simulate

MiB = 1024 * 1024
INSIDE = LinkSpec(latency=0.0001, bandwidth=1000 * MiB, window=64 * MiB)
BETWEEN = LinkSpec(latency=0.02, window=64 * MiB)          # the uplink is the only limit
UPLINK = 10 * MiB


def two_sites(world: World, hosts: dict[str, str]) -> None:
    world.add_site("east", SiteSpec(inside=INSIDE, uplink=UPLINK))
    world.add_site("west", SiteSpec(inside=INSIDE, uplink=UPLINK))
    world.set_site_link("east", "west", BETWEEN)
    for host, site in hosts.items():
        world.place(host, site)


async def transfers(world: World, pairs: list[tuple[str, str]], size: int) -> list[float]:
    """One connection per (src, dst) pair, all sending ``size`` bytes at once: completion delays."""
    nets = {name: world.boot(name) for name in sorted({h for pair in pairs for h in pair})}
    listeners = {}
    for name in sorted({dst for _, dst in pairs}):
        listeners[name] = await nets[name].listen(f"{name}:9000")
    streams = []
    for src, dst in pairs:
        accepted: list = []
        async with trio.open_nursery() as nursery:
            async def accept(listener=listeners[dst]) -> None:
                accepted.append(await listener.accept())
            nursery.start_soon(accept)
            client = await nets[src].connect(f"{dst}:9000")
        streams.append((client, accepted[0]))
    done = [math.nan] * len(pairs)
    t0 = trio.current_time()

    async def receive(i: int, server) -> None:
        await server.receive_exactly_into(bytearray(size))
        done[i] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for i, (client, server) in enumerate(streams):
            nursery.start_soon(client.send_all, bytes(size))
            nursery.start_soon(receive, i, server)
    return done


SIZE = 4 * MiB
HOSTS = {"a1": "east", "a2": "east", "b1": "west", "b2": "west"}


def run(pairs):
    def body(world: World):
        two_sites(world, HOSTS)
        return transfers(world, pairs, SIZE)
    return simulate(body)


def test_one_flow_between_sites_gets_the_uplink():
    (elapsed,) = run([("a1", "b1")])
    assert elapsed == pytest.approx(SIZE / UPLINK + BETWEEN.latency, rel=0.02)


def test_flows_leaving_one_site_share_its_uplink_fairly():
    # Different host pairs, different links, one uplink: each gets half.
    first, second = run([("a1", "b1"), ("a2", "b2")])
    expected = 2 * SIZE / UPLINK + BETWEEN.latency
    assert first == pytest.approx(expected, rel=0.03)
    assert second == pytest.approx(expected, rel=0.03)


def test_opposite_directions_use_different_uplinks():
    first, second = run([("a1", "b1"), ("b2", "a2")])
    expected = SIZE / UPLINK + BETWEEN.latency
    assert first == pytest.approx(expected, rel=0.02)
    assert second == pytest.approx(expected, rel=0.02)


def test_traffic_inside_a_site_bypasses_the_uplink():
    outside, inside = run([("a1", "b1"), ("a2", "a1")])
    assert outside == pytest.approx(SIZE / UPLINK + BETWEEN.latency, rel=0.02)
    assert inside == pytest.approx(SIZE / INSIDE.bandwidth + INSIDE.latency, rel=0.05)


def test_window_still_caps_one_connection_between_sites():
    window = 256 * 1024

    def body(world: World):
        two_sites(world, HOSTS)
        world.set_site_link("east", "west", LinkSpec(latency=0.02, window=window))
        return transfers(world, [("a1", "b1")], SIZE)

    (elapsed,) = simulate(body)
    assert elapsed == pytest.approx(SIZE / window * 0.04, rel=0.15)   # window / RTT, not the uplink


def test_an_explicit_host_link_wins_over_the_site_layout():
    def body(world: World):
        two_sites(world, HOSTS)
        world.set_link("a1", "a2", LinkSpec(latency=0.0001, bandwidth=1 * MiB, window=64 * MiB))
        return transfers(world, [("a1", "a2")], SIZE)

    (elapsed,) = simulate(body)
    assert elapsed == pytest.approx(SIZE / MiB, rel=0.02)


def test_sites_are_deterministic():
    assert run([("a1", "b1"), ("a2", "b2"), ("b1", "a2")]) == run([("a1", "b1"), ("a2", "b2"), ("b1", "a2")])


def test_bad_site_layout_is_refused():
    world = World(seed=0, network_class=lambda *a, **k: None)
    with pytest.raises(ValueError):
        world.place("a1", "nowhere")
    with pytest.raises(ValueError):
        SiteSpec(uplink=0)


SITES = {"count": 3, "uplink": 1e9 / 8, "latency": [0.015, 0.025, 0.04], "window": 4 << 20}


@pytest.mark.parametrize("peers", [4, pytest.param(6, marks=pytest.mark.slow)])
def test_pccl_chaos_over_sites_passes_and_replays(peers):
    from pccl_sim.engine.runner import run as run_scenario
    from pccl_sim.workloads.pccl.scenario import pccl_schedule

    scenario, schedule = pccl_schedule(3, profile="phases", peers=peers, duration=6.0,
                                       phases=["compute", "all_reduce"], sites=SITES)
    assert scenario.to_json()["sites"] == SITES
    first = run_scenario(scenario, schedule)
    assert first.ok, first.failures
    again = run_scenario(*pccl_schedule(3, profile="phases", peers=peers, duration=6.0,
                                        phases=["compute", "all_reduce"], sites=SITES))
    assert again.hash() == first.hash()
    flat = run_scenario(*pccl_schedule(3, profile="phases", peers=peers, duration=6.0,
                                       phases=["compute", "all_reduce"]))
    assert flat.hash() != first.hash()     # the layout changes the timing


def test_site_layout_is_checked():
    from pccl_sim.workloads.pccl.scenario import SiteLayout

    with pytest.raises(ValueError, match="3 site-pair latencies"):
        SiteLayout.from_params({"count": 3, "uplink": 1e8, "latency": [0.01]})
    with pytest.raises(ValueError, match="unknown"):
        SiteLayout.from_params({"count": 2, "uplink": 1e8, "rtt": 0.1})
    layout = SiteLayout.from_params({"count": 3, "uplink": 1e8})
    assert [layout.site_of(h) for h in ("peer0", "peer4", "peer5", "master")] == ["site0", "site1", "site2", "site0"]
