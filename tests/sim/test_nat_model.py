"""The simulator's NAT (``pccl_sim.engine.nat``): every rule of its module docstring, one test or
more each — the observed address of a NATed dialler, port maps (with other numbers), drop and
refuse, private names, hairpin, two hosts behind one NAT, two NATs, maps changing at run time,
static membership, that the bytes keep the real hosts' links — and determinism with NAT in use."""

from __future__ import annotations

import pytest
import trio

from pccl_sim.engine.errors import ConnectionRefused, ConnectTimeout
from pccl_sim.engine.nat import TRANSLATED_PORTS
from pccl_sim.engine.network import LinkSpec, World
from pccl_sim.engine.runner import simulate
from pccl_sim.engine.streams import SimListener, SimNetwork, SimStream
from pccl_sim.engine.trace import Trace
from pccl_sim.workloads.pccl.network import PcclSimNetwork

LATENCY = 0.01
LINK = LinkSpec(latency=LATENCY)
FIRST = TRANSLATED_PORTS.start


async def _dial(client: SimNetwork, listener: SimListener, address: str, *,
                timeout: float = 1.0) -> tuple[SimStream, SimStream]:
    """``client`` dials ``address``, which leads to ``listener``; the two ends."""
    accepted: list[SimStream] = []
    async with trio.open_nursery() as nursery:

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        stream = await client.connect(address, timeout=timeout)
    return stream, accepted[0]


async def _echo(a: SimStream, b: SimStream, payload: bytes = b"through the NAT") -> None:
    await a.send_all(payload)
    assert await b.receive_exactly(len(payload)) == payload
    await b.send_all(payload[::-1])
    assert await a.receive_exactly(len(payload)) == payload[::-1]


async def _fails(net: SimNetwork, address: str, timeout: float = 1.0) -> tuple[str, float]:
    """How a connect to ``address`` fails (``"refused"`` / ``"timeout"``) and after how long."""
    start = trio.current_time()
    try:
        stream = await net.connect(address, timeout=timeout)
    except ConnectionRefused:
        return "refused", trio.current_time() - start
    except ConnectTimeout:
        return "timeout", trio.current_time() - start
    raise AssertionError(f"connect to {address} succeeded: {stream}")


def _run(body, *, seed: int = 0, trace: Trace | None = None, network_class=SimNetwork):  # type: ignore[no-untyped-def]
    return simulate(body, seed=seed, default_link=LINK, trace=trace, network_class=network_class)


# --- outbound ---------------------------------------------------------------------------------


def test_a_natted_dialler_is_seen_from_the_nat_with_a_translated_port() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["laptop"])
        laptop, server = world.boot("laptop"), world.boot("server")
        listener = await server.listen("server:9000")
        client, accepted = await _dial(laptop, listener, "server:9000")
        # The dialler's own view stays private; the acceptor sees the NAT's name and port.
        assert client.local_address == "laptop:49152"
        assert client.remote_address == "server:9000"
        assert accepted.local_address == "server:9000"
        assert accepted.remote_address == f"home:{FIRST}"
        assert world.nat("home").translation("laptop", 49152) == FIRST
        await _echo(client, accepted)
        again, accepted_again = await _dial(laptop, listener, "server:9000")
        assert accepted_again.remote_address == f"home:{FIRST + 1}"  # one public port per connection
        events = [(e.source, e.kind, dict(e.data)) for e in world.trace if e.kind in ("connect", "accept")]
        assert ("laptop", "connect", {"local": "laptop:49152", "remote": "server:9000"}) in events
        assert ("server", "accept", {"local": "server:9000", "remote": f"home:{FIRST}"}) in events

    _run(body)


def test_the_bytes_through_a_nat_keep_the_real_hosts_link_and_partitions() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["laptop"])
        world.set_link("laptop", "server", LinkSpec(latency=0.1))
        world.set_link("laptop", "home", LinkSpec(latency=5.0))  # never used: the NAT is no hop
        laptop, server = world.boot("laptop"), world.boot("server")
        listener = await server.listen("server:9000")
        start = trio.current_time()
        client, accepted = await _dial(laptop, listener, "server:9000")
        assert trio.current_time() - start == pytest.approx(0.2)  # one RTT of laptop<->server
        pid = world.partition(["laptop"], ["server"])
        await client.send_all(b"held")
        with trio.move_on_after(1.0):
            await accepted.receive_exactly(4)
            raise AssertionError("the partition between the real hosts did not hold the bytes")
        world.heal(pid)
        assert await accepted.receive_exactly(4) == b"held"
        # Partitioning the NAT's own name does not touch what it translates.
        world.partition(["home"])
        await _echo(client, accepted)

    _run(body)


def test_two_hosts_behind_one_nat_get_distinct_ports_and_reach_each_other_directly() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["a", "b"])
        a, b, server = world.boot("a"), world.boot("b"), world.boot("server")
        # Both hosts' first ephemeral port is 49152: the NAT tells them apart.
        listener = await server.listen("server:9000")
        from_a, at_server_a = await _dial(a, listener, "server:9000")
        from_b, at_server_b = await _dial(b, listener, "server:9000")
        assert from_a.local_address == "a:49152" and from_b.local_address == "b:49152"
        assert at_server_a.remote_address == f"home:{FIRST}"
        assert at_server_b.remote_address == f"home:{FIRST + 1}"
        await _echo(from_a, at_server_a)
        await _echo(from_b, at_server_b)
        # Inside the same NAT: private names route, nothing is translated.
        a_to_b, at_b = await _dial(a, await b.listen("b:7000"), "b:7000")
        assert a_to_b.remote_address == "b:7000"
        assert at_b.remote_address == a_to_b.local_address == "a:49153"
        await _echo(a_to_b, at_b)

    _run(body)


# --- inbound: the port map --------------------------------------------------------------------


def test_a_mapped_port_forwards_to_another_number_on_the_inside_host() -> None:
    async def body(world: World) -> None:
        nat = world.add_nat("office", inside=["relay"])
        nat.map(443, "relay", 9000)
        assert nat.mapping(443) == ("relay", 9000) and nat.mappings == {443: ("relay", 9000)}
        relay, client = world.boot("relay"), world.boot("client")
        listener = await relay.listen("relay:9000")
        start = trio.current_time()
        stream, accepted = await _dial(client, listener, "office:443")
        assert trio.current_time() - start == pytest.approx(2 * LATENCY)  # client<->relay RTT
        assert stream.remote_address == "office:443"  # what the client dialled
        assert stream.local_address == "client:49152"
        assert accepted.local_address == "relay:9000"
        assert accepted.remote_address == "client:49152"  # a public dialler is seen as itself
        await _echo(stream, accepted)

    _run(body)


def test_a_mapped_port_with_nothing_listening_is_refused_by_the_inside_host() -> None:
    async def body(world: World) -> None:
        world.add_nat("office", inside=["relay"]).map(443, "relay", 9000)
        world.boot("relay")
        client = world.boot("client")
        how, after = await _fails(client, "office:443")
        assert how == "refused" and after == pytest.approx(2 * LATENCY)

    _run(body)


@pytest.mark.parametrize("inbound", ["drop", "refuse"])
def test_an_unmapped_port_is_dropped_or_refused(inbound: str) -> None:
    async def body(world: World) -> tuple[str, float]:
        nat = world.add_nat("office", inside=["relay"], inbound=inbound)  # type: ignore[arg-type]
        nat.map(443, "relay", 9000)
        relay, client = world.boot("relay"), world.boot("client")
        await relay.listen("relay:9000")
        await relay.listen("relay:444")  # listening inside does not make the port public
        return await _fails(client, "office:444", timeout=3.0)

    how, after = _run(body)
    if inbound == "drop":
        assert how == "timeout" and after == pytest.approx(3.0)
    else:
        assert how == "refused" and after == pytest.approx(2 * LATENCY)  # the box answers RST


def test_a_refusing_nat_answers_over_the_link_to_its_own_name() -> None:
    async def body(world: World) -> float:
        world.add_nat("office", inbound="refuse")
        world.set_link("client", "office", LinkSpec(latency=0.3))
        client = world.boot("client")
        how, after = await _fails(client, "office:80")
        assert how == "refused"
        return after

    assert _run(body) == pytest.approx(0.6)


def test_a_translated_outbound_port_takes_no_inbound_connection() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["laptop"], inbound="refuse")
        laptop, server = world.boot("laptop"), world.boot("server")
        await laptop.listen("laptop:49152")  # the port its connection will come from ...
        listener = await server.listen("server:9000")
        stream = await laptop.connect("server:9000")
        accepted = await listener.accept()
        observed = accepted.remote_address
        assert observed.startswith("home:")
        # ... and dialling back the observed address reaches nothing: no hole punching.
        assert (await _fails(server, observed))[0] == "refused"
        await _echo(stream, accepted)

    _run(body)


def test_a_private_name_is_not_routable_from_outside_its_nat() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["laptop"], inbound="refuse")  # refuse: for its own name only
        laptop, server = world.boot("laptop"), world.boot("server")
        await laptop.listen("laptop:9000")
        how, after = await _fails(server, "laptop:9000", timeout=2.0)
        assert how == "timeout" and after == pytest.approx(2.0)
        # Unknown names stay refused at once, as before.
        assert (await _fails(server, "nowhere:9000"))[0] == "refused"

    _run(body)


@pytest.mark.parametrize("inbound", ["drop", "refuse"])
def test_hairpin_is_off_by_default_and_the_public_name_then_answers_as_unmapped(inbound: str) -> None:
    async def body(world: World) -> None:
        nat = world.add_nat("home", inside=["a", "b"], inbound=inbound)  # type: ignore[arg-type]
        nat.map(8000, "b", 9000)
        a, b = world.boot("a"), world.boot("b")
        listener = await b.listen("b:9000")
        how, _ = await _fails(a, "home:8000", timeout=1.0)
        assert how == ("timeout" if inbound == "drop" else "refused")
        await _dial(a, listener, "b:9000")  # the private name works

    _run(body)


def test_with_hairpin_the_map_applies_inside_and_the_dialler_is_seen_from_the_nat() -> None:
    async def body(world: World) -> None:
        nat = world.add_nat("home", inside=["a", "b"], hairpin=True)
        nat.map(8000, "b", 9000)
        a, b = world.boot("a"), world.boot("b")
        stream, accepted = await _dial(a, await b.listen("b:9000"), "home:8000")
        assert stream.remote_address == "home:8000"
        assert accepted.remote_address == f"home:{FIRST}"
        await _echo(stream, accepted)

    _run(body)


def test_two_nats_a_host_behind_one_dials_a_mapped_port_of_the_other() -> None:
    async def body(world: World) -> None:
        world.add_nat("n1", inside=["a"])
        n2 = world.add_nat("n2", inside=["b"])
        n2.map(5000, "b", 6000)
        a, b = world.boot("a"), world.boot("b")
        stream, accepted = await _dial(a, await b.listen("b:6000"), "n2:5000")
        assert stream.local_address == "a:49152" and stream.remote_address == "n2:5000"
        assert accepted.local_address == "b:6000" and accepted.remote_address == f"n1:{FIRST}"
        await _echo(stream, accepted)
        # Private names across NATs do not route, either way; unmapped ports drop.
        assert (await _fails(a, "b:6000"))[0] == "timeout"
        assert (await _fails(b, "a:6000"))[0] == "timeout"
        assert (await _fails(b, f"n1:{FIRST}"))[0] == "timeout"

    _run(body)


def test_a_removed_mapping_keeps_its_connections_and_a_new_one_takes_new_dials() -> None:
    async def body(world: World) -> None:
        nat = world.add_nat("office", inside=["relay"], inbound="refuse")
        nat.map(443, "relay", 9000)
        relay, client = world.boot("relay"), world.boot("client")
        stream, accepted = await _dial(client, await relay.listen("relay:9000"), "office:443")
        assert nat.unmap(443) == ("relay", 9000)
        assert nat.unmap(443) is None and nat.mapping(443) is None
        await _echo(stream, accepted)  # conntrack keeps the established connection
        assert (await _fails(client, "office:443"))[0] == "refused"
        # The relay restarts on another port and gets a new mapping.
        world.kill("relay")
        relay = world.boot("relay")
        nat.map(443, "relay", 9100)
        stream2, accepted2 = await _dial(client, await relay.listen("relay:9100"), "office:443")
        assert accepted2.local_address == "relay:9100" and stream2.remote_address == "office:443"
        await _echo(stream2, accepted2)
        kinds = [(e.kind, dict(e.data)) for e in world.trace if e.kind.startswith("nat")]
        assert kinds == [
            ("nat", {"name": "office", "inbound": "refuse", "hairpin": False, "inside": ["relay"]}),
            ("nat_map", {"nat": "office", "port": 443, "host": "relay", "to": 9000}),
            ("nat_unmap", {"nat": "office", "port": 443}),
            ("nat_map", {"nat": "office", "port": 443, "host": "relay", "to": 9100}),
        ]

    _run(body)


def test_the_inside_host_dying_resets_connections_through_its_mapping_as_without_nat() -> None:
    async def body(world: World) -> None:
        world.add_nat("office", inside=["relay"]).map(443, "relay", 9000)
        relay, client = world.boot("relay"), world.boot("client")
        stream, _ = await _dial(client, await relay.listen("relay:9000"), "office:443")
        world.kill("relay")
        assert await _fails(client, "office:443") == ("refused", pytest.approx(2 * LATENCY))
        await trio.sleep(1)
        assert stream.is_reset

    _run(body)


# --- membership, names, the allocator ---------------------------------------------------------


def test_nat_by_places_hosts_that_join_later_and_membership_is_static() -> None:
    async def body(world: World) -> None:
        world.add_nat("nat0")
        world.add_nat("nat1")
        world.nat_by(lambda host: f"nat{int(host[4:]) % 2}" if host.startswith("peer") else None)
        world.put_behind("peer9", "nat0")  # explicit beats locate
        listener = await world.boot("master").listen("master:9000")
        for name, nat in (("peer0", "nat0"), ("peer1", "nat1"), ("peer9", "nat0")):
            net = world.boot(name)
            assert net.local_addresses() == [name]
            _, accepted = await _dial(net, listener, "master:9000")
            assert accepted.remote_address.startswith(f"{nat}:"), (name, accepted.remote_address)
        assert world.nat_of("master") is None and world.nat_of("peer3") is world.nat("nat1")
        with pytest.raises(ValueError, match="static"):
            world.put_behind("peer0", "nat1")
        with pytest.raises(RuntimeError, match="static"):
            world.nat_by(lambda host: None)

    _run(body)


def test_names_are_checked() -> None:
    async def body(world: World) -> None:
        world.boot("taken")
        with pytest.raises(ValueError, match="host already"):
            world.add_nat("taken")
        nat = world.add_nat("home", inside=["a"])
        with pytest.raises(ValueError, match="exists already"):
            world.add_nat("home")
        with pytest.raises(ValueError, match="do not nest"):
            world.add_nat("other", inside=["home"])
        assert "other" not in world.nats and "other" not in world.hosts  # refused whole
        with pytest.raises(ValueError, match="behind home already"):
            world.add_nat("other", inside=["a"])
        world.add_nat("other")
        with pytest.raises(ValueError, match="behind home already"):
            world.put_behind("a", "other")
        with pytest.raises(ValueError, match="itself"):
            world.add_nat("self", inside=["self"])
        with pytest.raises(ValueError, match="unknown NAT"):
            world.put_behind("b", "nowhere")
        with pytest.raises(ValueError, match="inbound"):
            world.add_nat("bad", inbound="reject")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="not behind home"):
            nat.map(80, "taken")
        with pytest.raises(ValueError, match="invalid public port"):
            nat.map(0, "a")
        with pytest.raises(RuntimeError, match="appliance"):
            world.boot("home")
        with pytest.raises(KeyError):
            world.nat("nowhere")
        nat.map(80, "a")
        assert nat.mapping(80) == ("a", 80)  # no number given: the same

    _run(body)


def test_the_allocator_skips_mapped_ports_and_the_oldest_entry_gives_its_port_up_on_wrap() -> None:
    async def body(world: World) -> None:
        nat = world.add_nat("home", inside=["a"])
        nat.map(FIRST + 1, "a", 22)
        assert nat.source("a", 1) == f"home:{FIRST}"
        assert nat.source("a", 2) == f"home:{FIRST + 2}"  # FIRST + 1 is mapped
        assert nat.source("a", 1) == f"home:{FIRST}"  # endpoint-independent: the same pair, the same port
        for port in range(3, len(TRANSLATED_PORTS)):  # one port is mapped: these fill the rest
            nat.source("a", port)
        assert nat.translation("a", len(TRANSLATED_PORTS) - 1) == TRANSLATED_PORTS.stop - 1
        # Wrapped: the oldest entry ("a", 1) gives FIRST up.
        assert nat.source("b", 1) == f"home:{FIRST}"
        assert nat.translation("a", 1) is None and nat.translation("a", 2) == FIRST + 2
        # Mapping a port an outbound entry holds takes it over.
        nat.map(FIRST + 2, "a", 23)
        assert nat.translation("a", 2) is None

    _run(body)


def test_local_addresses_are_the_hosts_own_name_in_pccls_network_too() -> None:
    async def body(world: World) -> None:
        world.add_nat("home", inside=["laptop"])
        laptop, server = world.boot("laptop"), world.boot("server")
        assert isinstance(laptop, PcclSimNetwork)
        assert laptop.local_addresses() == ["laptop"]
        assert server.local_addresses() == ["server"]

    _run(body, network_class=PcclSimNetwork)


# --- determinism, and nothing changes without NAT --------------------------------------------


async def _traffic(world: World, *, nat: bool) -> None:
    """Two clients, a server, jittery links; with ``nat``, the clients behind one NAT and the
    server reached through a mapped port."""
    world.default_link = LinkSpec(latency=0.01, jitter=0.004, bandwidth=5e6, window=64 * 1024)
    if nat:
        world.add_nat("home", inside=["c1", "c2"])
        world.add_nat("dc", inside=["server"], inbound="refuse").map(80, "server", 9000)
    server = world.boot("server")
    listener = await server.listen("server:9000")
    address = "dc:80" if nat else "server:9000"

    async def serve(nursery: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            nursery.start_soon(echo, stream)

    async def echo(stream: SimStream) -> None:
        async with stream:
            await stream.send_all(bytes(await stream.receive_exactly(50_000)))

    async def client(name: str) -> None:
        net = world.boot(name)
        for round in range(3):
            async with await net.connect(address) as stream:
                payload = bytes([round]) * 50_000
                await stream.send_all(payload)
                assert await stream.receive_exactly(len(payload)) == payload
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, nursery)
        async with trio.open_nursery() as clients:
            clients.start_soon(client, "c1")
            clients.start_soon(client, "c2")
        nursery.cancel_scope.cancel()


def _trace_of(seed: int, *, nat: bool) -> Trace:
    trace = Trace()
    _run(lambda world: _traffic(world, nat=nat), seed=seed, trace=trace)
    return trace


def test_the_same_seed_gives_the_same_trace_hash_with_nat_in_use() -> None:
    first, second = _trace_of(5, nat=True), _trace_of(5, nat=True)
    assert first.hash() == second.hash()
    assert any(e.kind == "accept" and str(e.data["remote"]).startswith("home:") for e in first)
    assert _trace_of(6, nat=True).hash() != first.hash()  # jitter draws from the seed


def test_an_unused_nat_changes_nothing_but_its_own_trace_events() -> None:
    async def body(world: World, nat: bool) -> None:
        if nat:
            world.add_nat("unused", inside=["bystander"]).map(80, "bystander")
        await _traffic(world, nat=False)

    def events(nat: bool) -> list[tuple[float, str, str, str]]:
        trace = Trace()
        _run(lambda world: body(world, nat), seed=8, trace=trace)
        return [(e.t, e.source, e.kind, repr(sorted(e.data.items()))) for e in trace if not e.kind.startswith("nat")]

    assert events(nat=True) == events(nat=False)
