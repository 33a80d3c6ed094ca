"""optimize_topology end to end on real TCP (loopback): probes over the p2p port, the master's
solve, the ring installed and used by the next all-reduce; probe authentication and bounds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import Config
from pccl.errors import AuthenticationFailed, PCCLError
from pccl.net.base import Listener, Network, Stream, parse_address
from pccl.net.framed import open_framed
from pccl.net.tcp import TcpNetwork
from pccl.protocol import messages as m
from pccl.testing import admit

TOKEN = "optimise-token"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0,
             probe_seconds=0.3, probe_streams=4)
BOUND = 30.0
#: A throttled stream's rate (bytes/s): far below what loopback gives a probe stream.
SLOW = 2 << 20


class _Throttled(Stream):
    """A real TCP stream whose sends go at ``SLOW`` bytes/s (a slow link, on loopback)."""

    def __init__(self, inner: Stream) -> None:
        self._inner = inner
        self.remote_address, self.local_address = inner.remote_address, inner.local_address

    async def send_all(self, data) -> None:
        await trio.sleep(memoryview(data).nbytes / SLOW)
        await self._inner.send_all(data)

    async def receive_into(self, buffer) -> int:
        return await self._inner.receive_into(buffer)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def abort(self) -> None:
        self._inner.abort()


class SlowToSome(Network):
    """Real TCP; connections to the ports in ``slow_ports`` are throttled."""

    def __init__(self) -> None:
        self._tcp = TcpNetwork(CFG)
        self.slow_ports: set[int] = set()

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        stream = await self._tcp.connect(address, timeout=timeout)
        return _Throttled(stream) if parse_address(address)[1] in self.slow_ports else stream

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        return await self._tcp.listen(address, port_range=port_range)


async def _group(master: pccl.Master, networks: list[Network | None], nursery: trio.Nursery,
                 config: Config = CFG) -> list[pccl.Communicator]:
    """Open a communicator per network, accepting each newcomer with update_topology."""
    comms: list[pccl.Communicator] = []
    for network in networks:
        comm, _ = await admit(nursery, master, comms, lambda network=network: pccl.open_communicator(  # type: ignore[misc]
            master.address, token=TOKEN, config=config, network=network))
        comms.append(comm)
    return comms


async def _all(fns) -> None:
    async with trio.open_nursery() as nursery:
        for fn in fns:
            nursery.start_soon(fn)


def _successor(ring: tuple[int, ...], peer: int) -> int:
    return ring[(ring.index(peer) + 1) % len(ring)]


async def test_optimize_topology_installs_a_ring_that_avoids_the_slow_link() -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with trio.open_nursery() as nursery:
                slow = SlowToSome()
                a, b, c = await _group(master, [slow, None, None], nursery)
                ring = a.ring
                assert b.ring == c.ring == ring
                # Make the link a -> (a's successor in the join ring) slow: the best ring of
                # three is then the other direction.
                succ = _successor(ring, a.peer_id)
                slow.slow_ports = {e.p2p_port for e in a.ring_endpoints if e.peer_id == succ}
                await _all([a.optimize_topology, b.optimize_topology, c.optimize_topology])
                new_ring = a.ring
                assert b.ring == c.ring == new_ring
                assert sorted(new_ring) == sorted(ring)
                assert _successor(new_ring, a.peer_id) != succ
                assert a.statistics().ring == new_ring
                # The links were measured and kept: the slow one is the slowest by far.
                links = pccl.testing.master_snapshot(master).measured_links
                assert len(links) == 6
                assert links[(a.peer_id, succ)] < min(v for k, v in links.items() if k != (a.peer_id, succ)) / 3
                # The status page labels the installed ring's edges with those figures.
                (group,) = master.status()["groups"]
                labelled = {(e["from"], e["to"]): e["bandwidth_bps"] for e in group["edges"]}
                assert labelled == {(f"{x:016x}", f"{y:016x}"): links[(x, y)] * 8
                                    for x, y in zip(new_ring, new_ring[1:] + new_ring[:1])}
                # The next all-reduce runs on the new ring and is right.
                inputs = [np.full(1000, i + 1, np.float32) for i in range(3)]
                results: dict[int, np.ndarray] = {}

                async def reduce(comm, x) -> None:
                    info = await comm.all_reduce(x)
                    assert info.world_size == 3
                    results[comm.peer_id] = x

                await _all([lambda comm=comm, x=x: reduce(comm, x) for comm, x in zip((a, b, c), inputs)])
                for x in results.values():
                    assert np.all(x == 6)
                # A second call measures nothing new and keeps the ring.
                await _all([a.optimize_topology, b.optimize_topology, c.optimize_topology])
                assert a.ring == new_ring and len(pccl.testing.master_snapshot(master).measured_links) == 6
                nursery.cancel_scope.cancel()


async def test_a_wrong_token_on_the_probe_port_is_refused() -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with trio.open_nursery() as nursery:
                (a,) = await _group(master, [None], nursery)
                port = a.ring_endpoints[0].p2p_port
                with pytest.raises(AuthenticationFailed):
                    conn = await open_framed(TcpNetwork(CFG), f"127.0.0.1:{port}", token="wrong", config=CFG)
                    await conn.send(m.ProbeHello(1, 1, 0, 0))
                    await conn.receive()
                nursery.cancel_scope.cancel()


async def test_a_probe_of_a_stalled_peer_ends_within_its_bound() -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with trio.open_nursery() as nursery:
                (a,) = await _group(master, [None], nursery)
                # A "peer" that accepts TCP connections and then says nothing, ever.
                stalled = await TcpNetwork(CFG).listen("127.0.0.1:0")
                held: list[Stream] = []

                async def hold() -> None:
                    while True:
                        held.append(await stalled.accept())

                nursery.start_soon(hold)
                target = m.PeerEndpoint(12345, "127.0.0.1", stalled.port, 0)
                start = trio.current_time()
                report = await pccl.testing.probe(a, m.ProbeRequest(7, (target,)))
                elapsed = trio.current_time() - start
                assert report == m.ProbeReport(7, (m.ProbeResult(12345, 0.0, 0.0),))
                assert held                                          # it did connect
                assert elapsed <= pccl.testing.probe_bound(CFG) + 1.0
                nursery.cancel_scope.cancel()
