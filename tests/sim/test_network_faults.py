"""Fault semantics of the virtual network: kill, power-off, stall, partition/heal, zombies."""

from __future__ import annotations

import pytest
import trio

from pccl_sim.engine.errors import ConnectionRefused, ConnectTimeout, PeerDisconnected
from pccl_sim.engine.network import LinkSpec, World
from pccl_sim.engine.runner import simulate
from pccl_sim.engine.streams import SimNetwork, SimStream

LATENCY = 0.01
LINK = LinkSpec(latency=LATENCY)


async def _connect(client: SimNetwork, server: SimNetwork, port: int = 9000) -> tuple[SimStream, SimStream]:
    listener = await server.listen(f"{server.host}:{port}")
    accepted: list[SimStream] = []
    async with trio.open_nursery() as nursery:

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        stream = await client.connect(f"{server.host}:{port}")
    return stream, accepted[0]


def test_kill_resets_peer_connections_after_one_latency() -> None:
    async def body(world: World) -> tuple[float, str]:
        a, b = world.boot("a"), world.boot("b")
        a_end, b_end = await _connect(a, b)
        killed_at = trio.current_time()
        world.kill("a")
        try:
            await b_end.receive_into(bytearray(10))
        except PeerDisconnected:
            return trio.current_time() - killed_at, "reset"
        return trio.current_time() - killed_at, "eof"

    delay, how = simulate(body, default_link=LINK)
    assert how == "reset"  # no goodbye: never a clean EOF
    assert delay == pytest.approx(LATENCY)


def test_kill_closes_listeners_and_new_incarnation_can_rebind() -> None:
    async def body(world: World) -> list[str]:
        a, b = world.boot("a"), world.boot("b")
        await b.listen("b:9000")
        world.kill("b")
        seen = []
        try:
            await a.connect("b:9000", timeout=5)
        except ConnectionRefused:
            seen.append("refused")  # the machine is up: its kernel answers RST
        b2 = world.boot("b")
        assert b2.incarnation.number > b.incarnation.number
        await _connect(a, b2)
        seen.append("rebound")
        return seen

    assert simulate(body, default_link=LINK) == ["refused", "rebound"]


def test_dead_incarnation_operations_fail_and_late_ones_are_zombies() -> None:
    async def body(world: World) -> tuple[list[str], list[str]]:
        zombies: list[str] = []
        world.on_zombie = lambda inc, op: zombies.append(f"{inc.name}:{op}")
        a, b = world.boot("a"), world.boot("b")
        a_end, _ = await _connect(a, b)
        world.kill("a")
        with pytest.raises(PeerDisconnected):  # same instant as the death: fails, not a zombie
            await a_end.send_all(b"x")
        before = list(zombies)
        await trio.sleep(1)
        with pytest.raises(PeerDisconnected):
            await a.connect("b:9000")  # a second later: the corpse is still running code
        await a_end.aclose()  # never raises, but is another zombie operation
        return before, zombies

    before, after = simulate(body, default_link=LINK)
    assert before == []
    assert after == ["a:connect", "a:aclose"]


def test_power_off_is_silent() -> None:
    async def body(world: World) -> dict[str, object]:
        a, b = world.boot("a"), world.boot("b")
        a_end, b_end = await _connect(a, b)
        world.power_off("a")
        out: dict[str, object] = {}
        with trio.move_on_after(30) as scope:
            await b_end.receive_into(bytearray(10))
        out["receive_silent"] = scope.cancelled_caught
        with trio.move_on_after(30) as scope:
            await b_end.send_all(bytes(8 << 20))  # never acknowledged: the window fills, it blocks
        out["send_blocks"] = scope.cancelled_caught
        with pytest.raises(ConnectTimeout):
            await b.connect("a:9000", timeout=2)
        # When the machine comes back, its kernel answers the old connection with RST.
        world.boot("a")
        with pytest.raises(PeerDisconnected):
            await b_end.send_all(b"hello?")
            await trio.sleep(1)
            await b_end.send_all(b"hello?")
        out["rst_after_reboot"] = True
        return out

    assert simulate(body, default_link=LINK) == {"receive_silent": True, "send_blocks": True, "rst_after_reboot": True}


def test_stall_holds_traffic_and_freezes_the_host_then_releases() -> None:
    async def body(world: World) -> dict[str, float]:
        a, b = world.boot("a"), world.boot("b")
        a_end, b_end = await _connect(a, b)
        t0 = trio.current_time()
        world.stall("a")
        arrivals: dict[str, float] = {}

        async def a_receives() -> None:
            await a_end.receive_exactly(5)
            arrivals["a got"] = trio.current_time() - t0

        async def b_receives() -> None:
            await b_end.receive_exactly(3)
            arrivals["b got"] = trio.current_time() - t0

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a_receives)
            nursery.start_soon(b_receives)
            await b_end.send_all(b"hello")  # b is not stalled: its send is accepted
            nursery.start_soon(a_end.send_all, b"hey")  # a is frozen: blocks at the gate
            await trio.sleep(2.0)
            assert arrivals == {}, "a stalled host received or sent something"
            assert not a_end.is_reset and not b_end.is_reset, "a stall must not break connections"
            world.unstall("a")
        return arrivals

    arrivals = simulate(body, default_link=LINK)
    assert arrivals["a got"] == pytest.approx(2.0 + LATENCY)
    assert arrivals["b got"] == pytest.approx(2.0 + LATENCY)


def test_partition_holds_both_ways_until_heal_and_connects_time_out() -> None:
    async def body(world: World) -> dict[str, object]:
        a, b, c = world.boot("a"), world.boot("b"), world.boot("c")
        a_end, b_end = await _connect(a, b)
        await c.listen("c:9100")
        pid = world.partition(["a"])
        out: dict[str, object] = {}
        await a_end.send_all(b"across")
        with pytest.raises(ConnectTimeout):
            await a.connect("c:9100", timeout=1)
        with trio.move_on_after(1) as scope:
            await b_end.receive_exactly(6)
        out["held"] = scope.cancelled_caught
        healed_at = trio.current_time()
        world.heal(pid)
        assert await b_end.receive_exactly(6) == b"across"  # nothing lost: TCP retransmits
        out["after_heal"] = trio.current_time() - healed_at
        return out

    out = simulate(body, default_link=LINK)
    assert out["held"] is True
    assert out["after_heal"] == pytest.approx(LATENCY)


def test_one_way_clog_blocks_only_its_direction() -> None:
    async def body(world: World) -> tuple[bool, bytes]:
        a, b = world.boot("a"), world.boot("b")
        a_end, b_end = await _connect(a, b)
        world.partition(["a"], ["b"], both_ways=False)
        await a_end.send_all(b"blocked")
        await b_end.send_all(b"flows")
        got = await a_end.receive_exactly(5)
        with trio.move_on_after(1) as scope:
            await b_end.receive_exactly(7)
        return scope.cancelled_caught, bytes(got)

    assert simulate(body, default_link=LINK) == (True, b"flows")
