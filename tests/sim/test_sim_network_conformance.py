"""The simulator's network passes the same transport conformance suite as real TCP.

Each check of ``tests/net_conformance.py`` runs inside a deterministic simulated ``trio.run`` on
the virtual clock, on the pccl flavour of the simulated network (``PcclSimNetwork``: pccl's
``Network`` interface and transport errors), over three link models: a LAN-like link, a WAN-like
link with limited bandwidth and a small window (so flow control and backpressure are exercised),
and loopback (client and server on one host).
"""

from __future__ import annotations

import pytest
from net_conformance import CHECKS, ConformanceEnv, check_connect_timeout, run_check

from pccl_sim.engine.network import LinkSpec, World
from pccl_sim.engine.runner import simulate
from pccl_sim.workloads.pccl.network import PcclSimNetwork

MiB = 1024 * 1024

LINKS = {
    "lan": LinkSpec(latency=0.0002),
    "wan": LinkSpec(latency=0.03, bandwidth=20 * MiB, window=256 * 1024, jitter=0.005),
}


def _env(world: World, *, loopback: bool) -> ConformanceEnv:
    server = world.boot("server")
    client = server if loopback else world.boot("client")
    return ConformanceEnv(
        server=server,
        client=client,
        listen_address="server:0",
        large_size=2 * MiB,  # bytes are really copied; the model, not the volume, is under test
        blocking_send_size=8 * MiB,
        connections=50,
        timeout=120.0,
    )


@pytest.mark.parametrize("link", ["lan", "wan", "loopback"])
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_conformance(check, link: str) -> None:
    async def body(world: World) -> None:
        env = _env(world, loopback=link == "loopback")
        await run_check(check, env)

    simulate(body, seed=1, default_link=LINKS.get(link, LINKS["lan"]), network_class=PcclSimNetwork)


@pytest.mark.parametrize("link", ["lan", "wan"])
def test_connect_timeout_to_powered_off_host(link: str) -> None:
    async def body(world: World) -> None:
        env = _env(world, loopback=False)
        world.boot("ghost")
        world.power_off("ghost")  # SYNs to it vanish: nobody ever answers
        await run_check(lambda e: check_connect_timeout(e, "ghost:7000"), env)

    simulate(body, seed=2, default_link=LINKS[link], network_class=PcclSimNetwork)
