"""One careless or hostile host must not stop a run: a bounded flood on real TCP (issue 19).

The flood comes from its own loopback address (127.0.0.2, as an attacker has its own address);
the run lives on 127.0.0.1.  Timeouts are long (30 s) so that nothing frees itself during a
test: only the admission rule (pccl.net.admission) lets the legitimate traffic through, and
without it these tests run into their bounds.  The full figures (1,000 connections per port,
step times, process memory) are ``benchmarks/hostile_network.py`` and the slow test that runs
it (``pytest -m slow tests/e2e/test_hostile_network.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import pathlib
import re
import struct
import tracemalloc
from collections.abc import AsyncIterator

import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import Config, SharedState
from pccl.errors import PCCLError
from pccl.master.server import MASTER_LIMITS
from pccl.net.base import parse_address
from pccl.net.framed import open_framed
from pccl.net.serving import PEER_LIMITS, REFUSALS_LOGGED_PER_WINDOW
from pccl.net.tcp import TcpNetwork
from pccl.protocol import codec, handshake
from pccl.protocol import messages as m
from pccl.protocol.master.machine import PeerStatus

FLOOD_SOURCE = "127.0.0.2"
PATIENT = Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=30.0, first_bytes_timeout=30.0,
                 p2p_base_port=0, shared_state_base_port=0)
BOUND = 20.0  # far below the 30 s an idle connection may hold a slot
MIB = 1024 * 1024


async def connect_from(source: str, address: str) -> trio.SocketStream:
    host, port = parse_address(address)
    return await trio.open_tcp_stream(host, port, local_address=source)


@contextlib.asynccontextmanager
async def idle_flood(address: str, count: int, source: str = FLOOD_SOURCE) -> AsyncIterator[list[trio.SocketStream]]:
    """``count`` connections to ``address`` from ``source`` that say nothing, held open."""
    streams: list[trio.SocketStream] = []
    try:
        for _ in range(count):
            streams.append(await connect_from(source, address))
        yield streams
    finally:
        for stream in streams:
            await stream.aclose()


async def _wait_until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(BOUND):
        while not predicate():
            await trio.sleep(0.01)


@pytest.fixture
async def flood_source_works() -> None:
    try:
        sock = trio.socket.socket()
        await sock.bind((FLOOD_SOURCE, 0))
        sock.close()
    except OSError:
        pytest.skip(f"this host cannot send from {FLOOD_SOURCE}")


class Run:
    """A master and peers in this process, joined the way a training loop joins them."""

    def __init__(self, master: pccl.Master, nursery: trio.Nursery) -> None:
        self.master = master
        self.nursery = nursery
        self.comms: list[pccl.Communicator] = []
        self.states: list[SharedState] = []
        self._stop = trio.Event()

    async def _peer(self, state: SharedState, task_status: trio.TaskStatus[pccl.Communicator]) -> None:
        async with pccl.open_communicator(self.master.address, config=PATIENT) as comm:
            task_status.started(comm)
            await self._stop.wait()

    async def join(self, state: SharedState) -> pccl.Communicator:
        """Open a peer; the existing ones vote it in.  Returns once it is accepted."""
        if not self.comms:
            comm = await self.nursery.start(self._peer, state)
        else:
            joined: list[pccl.Communicator] = []

            async def newcomer() -> None:
                joined.append(await self.nursery.start(self._peer, state))

            async with trio.open_nursery() as voters:
                voters.start_soon(newcomer)
                await _wait_until(lambda: any(p.status is PeerStatus.REGISTERED for p in pccl.testing.master_snapshot(self.master).peers),
                                  "the newcomer registered")
                for comm in self.comms:
                    voters.start_soon(comm.update_topology)
            comm = joined[0]
        self.comms.append(comm)
        self.states.append(state)
        return comm

    async def sync(self) -> list[pccl.SyncInfo]:
        infos: list[pccl.SyncInfo | None] = [None] * len(self.comms)

        async def one(i: int) -> None:
            infos[i] = await self.comms[i].sync_shared_state(self.states[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(self.comms)):
                nursery.start_soon(one, i)
        return infos  # type: ignore[return-value]

    def stop(self) -> None:
        self._stop.set()


@contextlib.asynccontextmanager
async def run() -> AsyncIterator[Run]:
    async with pccl.open_master("127.0.0.1:0", config=PATIENT) as master, trio.open_nursery() as nursery:
        r = Run(master, nursery)
        try:
            yield r
        finally:
            r.stop()


def _state(seed: int) -> SharedState:
    return SharedState({"w": np.random.default_rng(seed).standard_normal(50_000).astype(np.float32)})


# --- items 1-3: idle connections never starve anyone -------------------------------------------


async def test_idle_connections_at_the_master_do_not_delay_a_join(flood_source_works: None) -> None:
    # 200 idle connections: more than the 128 that used to take every handshake slot.
    with trio.fail_after(BOUND):
        async with run() as r, idle_flood(r.master.address, 200):
            await _wait_until(lambda: r.master.statistics().waiting_connections == 200 - MASTER_LIMITS.per_address,
                              "the flood accepted")
            assert r.master.statistics().unproven_connections == MASTER_LIMITS.per_address
            await r.join(_state(0))
            await r.join(_state(0))
            assert r.comms[1].world_size == 2
            assert r.master.statistics().kicks == 0


async def test_idle_connections_at_a_ring_port_do_not_get_the_peer_kicked(flood_source_works: None) -> None:
    with trio.fail_after(BOUND):
        async with run() as r:
            a = await r.join(_state(0))
            b = await r.join(_state(0))
            ring_port = pccl.testing.listener_address(b, "ring")
            async with idle_flood(ring_port, 100):  # more than the 32 slots a peer used to have
                await _wait_until(lambda: pccl.testing.admission_counts(b, "ring").waiting == 100 - PEER_LIMITS.per_address,
                                  "the flood accepted")
                c = await r.join(_state(0))  # a new round: b's ring predecessor dials b's port
                assert a.world_size == b.world_size == c.world_size == 3
                x = np.arange(1000, dtype=np.float32)
                results = [x.copy() for _ in range(3)]
                async with trio.open_nursery() as nursery:
                    for comm, buf in zip(r.comms, results):
                        nursery.start_soon(comm.all_reduce, buf)
                assert all(np.array_equal(buf, 3 * x) for buf in results)
            assert r.master.statistics().kicks == 0


async def test_idle_connections_at_the_shared_state_ports_do_not_break_a_download(flood_source_works: None) -> None:
    with trio.fail_after(BOUND):
        async with run() as r:
            await r.join(_state(1))
            await r.join(_state(1))
            await r.sync()
            sources = [pccl.testing.listener_address(c, "sync") for c in r.comms]
            async with idle_flood(sources[0], 100), idle_flood(sources[1], 100):
                newcomer_state = _state(2)
                await r.join(newcomer_state)
                infos = await r.sync()
                assert infos[2].rx_bytes == newcomer_state["w"].nbytes
                assert np.array_equal(newcomer_state["w"], r.states[0]["w"])
            assert r.master.statistics().kicks == 0


# --- item 4: memory follows the bytes that arrived ----------------------------------------------


async def _announce_big_frame(address: str, source: str) -> trio.SocketStream:
    """Complete the handshake without a token, then announce a 16 MiB control frame and send
    1,000 bytes of it."""
    stream = await connect_from(source, address)
    hello = m.Hello(role=m.HandshakeRole.CLIENT, has_token=False, nonce=bytes(handshake.NONCE_SIZE))
    await stream.send_all(handshake.encode_preamble() + codec.encode_message(hello, max_frame_size=1024)
                          + struct.pack(">IB", 16 * MIB - 1, codec.FrameKind.CONTROL) + b"\x00" * 1000)
    return stream


async def test_half_sent_big_frames_cost_what_arrived(flood_source_works: None) -> None:
    # 30 connections per port, each from its own address (so the admission lets every one in),
    # announce 16 MiB and send 1,000 bytes: the master and a peer used to allocate 16 MiB each.
    count = 30
    with trio.fail_after(BOUND * 2):
        async with run() as r:
            peer = await r.join(_state(0))
            ports = [r.master.address, pccl.testing.listener_address(peer, "ring"), pccl.testing.listener_address(peer, "sync")]
            tracemalloc.start()
            try:
                before = tracemalloc.get_traced_memory()[0]
                streams = [await _announce_big_frame(port, f"127.0.1.{i + 1}") for port in ports for i in range(count)]
                await trio.sleep(1.0)  # let every frame start arriving
                grown = tracemalloc.get_traced_memory()[0] - before
            finally:
                tracemalloc.stop()
            for stream in streams:
                await stream.aclose()
    assert grown < 3 * count * 256 * 1024, f"{grown / MIB:.0f} MiB for {3 * count} half-sent frames"


# --- item 5: connected but never registered -----------------------------------------------------


async def test_a_connection_that_only_heartbeats_is_closed_at_the_registration_deadline() -> None:
    config = dataclasses.replace(PATIENT, peer_timeout=1.0)
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", config=config) as master:
            start = trio.current_time()  # before the master can have seen the connection
            conn = await open_framed(TcpNetwork(config), master.address, config=config)
            notice = None
            with trio.move_on_after(BOUND / 2):
                async with trio.open_nursery() as nursery:
                    async def heartbeats() -> None:
                        with contextlib.suppress(PCCLError):
                            while True:
                                await conn.send(m.Heartbeat())
                                await trio.sleep(0.1)

                    nursery.start_soon(heartbeats)
                    while not isinstance(notice := await conn.receive(), m.KickNotice):
                        pass
                    nursery.cancel_scope.cancel()
            await conn.aclose()
            assert isinstance(notice, m.KickNotice), "still connected after many registration deadlines"
            assert "did not register" in notice.detail
            assert trio.current_time() - start >= config.peer_timeout
            await _wait_until(lambda: master.statistics().unproven_connections == 0, "its slot came back")


# --- item 8: refusals are logged once each, rate-limited ----------------------------------------


async def test_a_flood_of_slow_connections_is_logged_in_a_few_lines(flood_source_works: None,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    # 300 connections that send a byte now and then: each is refused at its first-bytes
    # deadline; the log has one line for each of the first few and a count for the rest.
    config = dataclasses.replace(PATIENT, first_bytes_timeout=0.3)
    with caplog.at_level(logging.INFO, logger="pccl"):
        with trio.fail_after(BOUND):
            async with pccl.open_master("127.0.0.1:0", config=config) as master:
                async with idle_flood(master.address, 300) as streams:
                    for stream in streams:
                        await stream.send_all(b"\x89")
                    await _wait_until(lambda: master.statistics().refused_connections == 300, "all refused")
    about_flood = [r.getMessage() for r in caplog.records if FLOOD_SOURCE in r.getMessage()]
    individual = [line for line in about_flood if line.startswith("master refused 127.0.0.2:")]
    counted = [int(re.search(r"and (\d+) more connections refused", line).group(1))  # type: ignore[union-attr]
               for line in about_flood if line not in individual]
    assert len(individual) + sum(counted) == 300, about_flood  # each refusal once, in a line or a count
    windows = len(counted)  # one summary per 10 s window with more refusals than it logs (normally 1)
    assert 1 <= windows <= 2 and len(individual) == REFUSALS_LOGGED_PER_WINDOW * windows, about_flood


# --- the full figures (slow) --------------------------------------------------------------------


def _benchmark_module():  # type: ignore[no-untyped-def]
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "hostile_network.py"
    spec = importlib.util.spec_from_file_location("hostile_network_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
async def test_full_figures(flood_source_works: None) -> None:
    # The acceptance run with OS processes: 1,000 idle connections held open (reopened
    # when closed) to each port; 200 half-sent 16 MiB frames per port.  Speeds are reported by
    # the benchmark; here only what is not a speed: nobody kicked, the join and the download
    # complete, the loop goes on, memory stays within 100 MiB.
    bench = _benchmark_module()
    idle = await bench.run_idle(connections=1000, seconds=4.0)
    assert idle["kicks"] == 0 and idle["download_ok"] and idle["world_after"] >= 2, idle
    memory = await bench.run_memory(connections=200)
    assert memory["master_growth_mib"] <= 100 and memory["peer_growth_mib"] <= 100, memory
