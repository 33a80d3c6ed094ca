"""The simulator's network passes the same transport conformance suite as real TCP.

Each check of ``pccl.testing.conformance`` runs inside a deterministic simulated ``trio.run`` on
the virtual clock, on the pccl flavour of the simulated network (``PcclSimNetwork``: pccl's
``Network`` interface and transport errors), over three link models: a LAN-like link, a WAN-like
link with limited bandwidth and a small window (so flow control and backpressure are exercised),
and loopback (client and server on one host).  Through the simulator's NAT the same checks pass
for a client behind a NAT dialling a public server and for a public client dialling a server
behind a NAT through a mapped public port (with another number than the server's).
"""

from __future__ import annotations

import dataclasses

import pytest
from pccl.testing.conformance import CHECKS, ConformanceEnv, check_connect_timeout, run_check

from pccl.net.base import Listener, parse_address
from pccl_sim.engine.network import LinkSpec, Nat, World
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


@dataclasses.dataclass
class NatEnv(ConformanceEnv):
    """The checks' environment with a NAT between client and server: ``client_nat`` translates
    the client's source address; ``server_nat`` forwards a public port (``offset`` below the
    listener's) to each listener the checks dial."""

    client_nat: Nat | None = None
    server_nat: Nat | None = None
    offset: int = 20000

    def connect_address(self, listener: Listener) -> str:
        if self.server_nat is None:
            return listener.address
        public = listener.port - self.offset
        self.server_nat.map(public, "server", listener.port)
        return f"{self.server_nat.name}:{public}"

    def seen_as(self, address: str) -> str:
        host, port = parse_address(address)
        if self.client_nat is not None and host == "client":
            public = self.client_nat.translation(host, port)
            assert public is not None, f"{address} was never translated"
            return f"{self.client_nat.name}:{public}"
        if self.server_nat is not None and host == "server":
            return f"{self.server_nat.name}:{port - self.offset}"
        return address


def _nat_env(world: World, *, behind: str) -> NatEnv:
    server, client = world.boot("server"), world.boot("client")
    env = NatEnv(server=server, client=client, listen_address="server:0", large_size=2 * MiB,
                 blocking_send_size=8 * MiB, connections=50, timeout=120.0)
    if behind == "client":
        env.client_nat = world.add_nat("home", inside=["client"])
    else:
        env.server_nat = world.add_nat("office", inside=["server"], inbound="refuse")
    return env


@pytest.mark.parametrize("link", ["lan", "wan"])
@pytest.mark.parametrize("behind", ["client", "server"])
@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_conformance_through_nat(check, behind: str, link: str) -> None:
    async def body(world: World) -> None:
        await run_check(check, _nat_env(world, behind=behind))

    simulate(body, seed=3, default_link=LINKS[link], network_class=PcclSimNetwork)


@pytest.mark.parametrize("behind", ["client", "server"])
def test_connect_timeout_through_nat(behind: str) -> None:
    async def body(world: World) -> None:
        env = _nat_env(world, behind=behind)
        # From outside its NAT the server's private name is unroutable; the client's own NAT,
        # without hairpin, answers its public name as an unmapped port: it drops the SYN.
        unresponsive = "server:7000" if behind == "server" else "home:7000"
        await run_check(lambda e: check_connect_timeout(e, unresponsive), env)

    simulate(body, seed=4, default_link=LINKS["lan"], network_class=PcclSimNetwork)
