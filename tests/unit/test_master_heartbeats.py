"""The master's heartbeats: every peer hears from the master within each heartbeat interval, and a
peer the master is talking to anyway gets no heartbeats on top.

A master on an in-memory network under Trio's autojump clock (virtual time, so the bounds below
are exact); the peers are raw framed connections speaking the protocol by hand.
"""

from __future__ import annotations

import trio
import trio.testing

import pccl
from pccl import Config
from pccl.net.framed import FramedConnection, open_framed
from pccl.protocol import messages as m

from pccl.testing import MemoryNetwork

INTERVAL = 0.5
CFG = Config(peer_timeout=30.0, heartbeat_interval=INTERVAL, connect_timeout=2.0)  # nobody is kicked here


async def _accepted(network: MemoryNetwork, address: str) -> FramedConnection:
    """A peer registered and accepted alone (its one-peer ring round answered)."""
    conn = await open_framed(network, address, config=CFG)
    await conn.send(m.Register(0, 9, 0))
    while not isinstance(msg := await conn.receive(), m.TopologyComplete):
        if isinstance(msg, m.ConnectToPeers):
            await conn.send(m.P2PReport(msg.round, True))
    return conn


def _gaps(times: list[float], start: float, end: float) -> float:
    points = [start, *times, end]
    return max(b - a for a, b in zip(points, points[1:]))


async def test_a_busy_peer_gets_no_heartbeats_and_an_idle_one_gets_one_each_interval(
        autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=CFG, network=network) as master:
        conn = await _accepted(network, master.address)
        idle = await open_framed(network, master.address, config=CFG)  # handshake only: hears heartbeats
        received: list[tuple[float, type]] = []
        idle_heard: list[float] = []

        async def read_idle() -> None:
            while True:
                assert isinstance(await idle.receive(), m.Heartbeat)
                idle_heard.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_idle)
            start = trio.current_time()
            # Busy: a vote every tenth of an interval, for 8 intervals; then 8 quiet intervals.
            busy_until = start + 8 * INTERVAL
            while trio.current_time() < busy_until:
                await conn.send(m.VotePeersPending())
                while not isinstance(msg := await conn.receive(), m.PeersPendingResult):
                    received.append((trio.current_time(), type(msg)))
                received.append((trio.current_time(), type(msg)))
                await trio.sleep(INTERVAL / 10)
            quiet_until = trio.current_time() + 8 * INTERVAL
            with trio.move_on_at(quiet_until):
                while True:
                    kind = type(await conn.receive())
                    received.append((trio.current_time(), kind))
            nursery.cancel_scope.cancel()
        end = trio.current_time()
        await conn.aclose()
        await idle.aclose()

    busy = [(t, kind) for t, kind in received if t <= busy_until]
    quiet = [t for t, kind in received if t > busy_until]
    assert busy and all(kind is m.PeersPendingResult for _, kind in busy)  # no heartbeat while busy
    assert len(quiet) >= 8 and all(kind is m.Heartbeat for t, kind in received if t > busy_until)
    assert _gaps([t for t, _ in received], start, end) <= INTERVAL
    assert len(idle_heard) >= 16 and _gaps(idle_heard, start, end) <= INTERVAL


async def test_a_blocked_master_loop_is_not_blamed_on_the_peers(autojump_clock: trio.testing.MockClock) -> None:
    # While the master's loop was blocked (or its process not scheduled on a busy host), a
    # peer's heartbeat came: the master must read it before its deadline removes the peer.
    config = Config(peer_timeout=2.0, heartbeat_interval=INTERVAL, connect_timeout=2.0)
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=config, network=network) as master:
        conn = await _accepted(network, master.address)

        async def beat() -> None:
            while True:
                await trio.sleep(INTERVAL)
                await conn.send(m.Heartbeat())

        async def drain() -> None:
            while True:
                await conn.receive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(beat)
            nursery.start_soon(drain)
            await trio.sleep(INTERVAL / 2)
            autojump_clock.jump(3 * config.peer_timeout)  # time passes, no task runs: a blocked loop
            await trio.sleep(4 * INTERVAL)
            assert master.statistics().kicks == 0
            assert master.statistics().accepted_peers == 1
            nursery.cancel_scope.cancel()
        await conn.aclose()


async def test_a_silent_peer_is_still_removed_after_a_blocked_master_loop(
        autojump_clock: trio.testing.MockClock) -> None:
    config = Config(peer_timeout=2.0, heartbeat_interval=INTERVAL, connect_timeout=2.0)
    network = MemoryNetwork()
    async with pccl.open_master("10.0.0.9:7000", config=config, network=network) as master:
        conn = await _accepted(network, master.address)
        autojump_clock.jump(3 * config.peer_timeout)
        await trio.sleep(config.peer_timeout + INTERVAL)  # its silence counts again once the loop runs
        assert master.statistics().kicks == 1
        await conn.aclose()
