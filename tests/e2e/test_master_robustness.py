"""Hostile or buggy input must cost one connection, never the master or a peer (review H11).

Real TCP.  Each test attacks with crafted bytes (deeply nested msgpack, huge unknown tags, text
that imitates another error), an injected bug, idle connections or a descriptor shortage, and
then checks that a real peer is still served.  The command-line checks run ``python -m pccl``.
"""

from __future__ import annotations

import gc
import logging
import random
import resource
import socket
import struct
import subprocess
import sys
import warnings

import msgspec
import pytest
import trio
import trio.testing

import pccl
import pccl.testing
from pccl import Config
from pccl.errors import KickReason, PCCLError
from pccl.master.server import MAX_PENDING_HANDSHAKES
from pccl.net.base import Listener, Network, Stream, parse_address
from pccl.net.framed import FramedConnection, open_framed
from pccl.net.tcp import TcpNetwork
from pccl.protocol import codec, handshake
from pccl.protocol.master import machine as ms
from pccl.protocol import messages as m

TOKEN = "robustness-token"
CFG = Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0)
BOUND = 10.0
NESTED = b"\x91" * 1000  # 1 KiB: fits the handshake's frame limit, nests deeper than msgspec recurses


def _control_frame(body: bytes) -> bytes:
    return struct.pack(">IB", len(body), codec.FrameKind.CONTROL) + body


async def _closed_by_the_other_side(stream: Stream) -> None:
    buf = bytearray(4096)
    while True:
        try:
            if await stream.receive_into(buf) == 0:
                return
        except PCCLError:
            return


async def _still_serves(address: str) -> None:
    async with pccl.open_communicator(address, token=TOKEN, config=CFG) as comm:
        assert comm.world_size >= 1
        assert await comm.are_peers_pending() is False


async def _registered(address: str) -> FramedConnection:
    conn = await open_framed(TcpNetwork(CFG), address, token=TOKEN, config=CFG)
    await conn.send(m.Register(0, 9, 0, 0))
    assert isinstance(await conn.receive(), m.Welcome)
    return conn


async def _kick_notice(conn: FramedConnection) -> m.KickNotice:
    """The KickNotice, skipping heartbeats and the first peer's own acceptance round."""
    while not isinstance(notice := await conn.receive(), m.KickNotice):
        pass
    return notice


# --- crafted frames ------------------------------------------------------------------------------


async def test_deeply_nested_handshake_frame_only_fails_that_handshake() -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            raw = await TcpNetwork(CFG).connect(master.address)
            await raw.send_all(handshake.encode_preamble() + _control_frame(NESTED))  # before any token
            await _closed_by_the_other_side(raw)
            await raw.aclose()
            assert master.statistics().handshake_failures == 1
            await _still_serves(master.address)


async def test_deeply_nested_frame_on_a_p2p_port_does_not_end_the_peer() -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as comm:
                raw = await TcpNetwork(CFG).connect(_loopback(pccl.testing.listener_address(comm, "ring")))
                await raw.send_all(handshake.encode_preamble() + _control_frame(b"\x92\x05" + NESTED))
                await _closed_by_the_other_side(raw)
                await raw.aclose()
                assert await comm.are_peers_pending() is False


@pytest.mark.parametrize(("body", "reason"), [
    # A known tag with a deeply nested trailing field (msgspec recurses to skip it).
    (b"\x92\x05" + b"\x91" * 5000, KickReason.PROTOCOL_ERROR),
    # An unknown 5 MiB string tag: its repr used to make the KickNotice unsendable.
    (msgspec.msgpack.encode(["\x00" * (5 * 1024 * 1024)]), KickReason.PROTOCOL_ERROR),
    # Peer-chosen text that imitates the oversized-frame error is still a protocol error.
    (msgspec.msgpack.encode(["control frame of 99 bytes exceeds the limit of 1 bytes"]), KickReason.PROTOCOL_ERROR),
], ids=["nested", "huge-unknown-tag", "imitated-too-large"])
async def test_crafted_frames_after_registration_get_a_short_kick(body: bytes, reason: KickReason,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            conn = await _registered(master.address)
            await conn.stream.send_all(_control_frame(body))  # bypass the encoder
            notice = await _kick_notice(conn)
            await conn.aclose()
            assert notice.reason == reason
            assert len(notice.detail) <= codec.MAX_DETAIL + 50
            assert all(len(record.getMessage()) < 2000 for record in caplog.records)
            await _still_serves(master.address)


async def test_a_data_frame_after_registration_gets_a_short_kick() -> None:
    """The master reads control messages only: a data frame, arriving in the same receive right
    behind a valid message, is a protocol error that costs that connection alone."""
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            conn = await _registered(master.address)
            header = codec.DataHeader(op_seq=1, stream=0, step=0, offset=0, nbytes=4)
            await conn.stream.send_all(codec.encode_message(m.Heartbeat()) + codec.encode_data_prefix(header)
                                       + bytes(4))
            notice = await _kick_notice(conn)
            await conn.aclose()
            assert notice.reason == KickReason.PROTOCOL_ERROR
            assert "data frame" in notice.detail
            await _still_serves(master.address)


async def test_a_lone_silent_peer_is_kicked_by_the_timer_alone() -> None:
    # No other connection sends anything, so no event but the master's own timer can notice.
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            conn = await _registered(master.address)
            started = trio.current_time()
            notice = await _kick_notice(conn)
            await conn.aclose()
            assert notice.reason == KickReason.TIMEOUT
            assert trio.current_time() - started >= CFG.peer_timeout * 0.9


class _WriterSteps(trio.abc.Instrument):
    """Counts steps of the master's per-connection writer tasks."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if getattr(task.coro, "cr_code", None) is not None and task.coro.cr_code.co_qualname == "_MasterServer._writer":
            self.steps += 1


async def test_idle_connections_get_heartbeats_without_a_task_wake_up_each() -> None:
    """Every connection hears a Heartbeat each interval, sent by one task for all of them: idle
    connections wake no task of their own (at 1,000 peers, 1,000 wake-ups per interval)."""
    cfg = Config(peer_timeout=30.0, heartbeat_interval=0.05, connect_timeout=5.0, p2p_base_port=0)
    counter = _WriterSteps()
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=cfg) as master:
            conns = [await open_framed(TcpNetwork(cfg), master.address, token=TOKEN, config=cfg) for _ in range(8)]
            try:
                heard = [0] * len(conns)

                async def listen(i: int) -> None:
                    while True:
                        assert isinstance(await conns[i].receive(), m.Heartbeat)
                        heard[i] += 1

                await trio.testing.wait_all_tasks_blocked()  # every writer has started and waits
                trio.lowlevel.add_instrument(counter)
                try:
                    async with trio.open_nursery() as nursery:
                        for i in range(len(conns)):
                            nursery.start_soon(listen, i)
                        await trio.sleep(12 * cfg.heartbeat_interval)
                        nursery.cancel_scope.cancel()
                finally:
                    trio.lowlevel.remove_instrument(counter)
            finally:
                for conn in conns:
                    await conn.aclose()
    assert min(heard) >= 6, heard
    assert counter.steps == 0


def test_the_machine_clips_kick_details() -> None:
    state = ms.MasterState(rng=random.Random(1), peer_timeout=5.0)
    state.handle(ms.PeerConnected(1, "10.0.0.1"), 0.0)
    effects = state.handle(ms.ProtocolViolation(1, KickReason.PROTOCOL_ERROR, "k" * 100_000), 0.0)
    kicks = [e for e in effects if isinstance(e, ms.Kick)]
    assert len(kicks) == 1 and kicks[0].conn_id == 1
    assert kicks[0].detail.startswith("k" * 100) and len(kicks[0].detail) <= codec.MAX_DETAIL + 50


# --- bugs stay inside their connection -----------------------------------------------------------


class _FailingNonces(random.Random):
    """Peer ids as usual; the first handshake nonce draw raises (a stand-in for any bug)."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.failed = False

    def randbytes(self, n: int) -> bytes:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected handshake bug")
        return super().randbytes(n)


async def test_a_bug_in_one_handshake_closes_only_that_connection(caplog: pytest.LogCaptureFixture) -> None:
    with trio.fail_after(BOUND):
        rng = _FailingNonces(7)
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG, rng=rng) as master:
            with pytest.raises(PCCLError):
                async with pccl.open_communicator(master.address, token=TOKEN, config=CFG):
                    pass
            assert rng.failed
            await _still_serves(master.address)
            assert master.statistics().internal_errors == 1
    assert any("injected handshake bug" in r.getMessage() or (r.exc_info and "injected handshake bug" in str(r.exc_info[1]))
               for r in caplog.records if r.levelno >= logging.ERROR)


async def test_a_bug_while_serving_one_connection_closes_only_it(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    real_handle = ms.MasterState.handle
    poison = m.P2PReport(round=987654321, ok=True)

    def handle(self: ms.MasterState, event: ms.Event, now: float) -> list[ms.Effect]:
        if isinstance(event, ms.MessageReceived) and event.msg == poison:
            raise RuntimeError("injected machine bug")
        return real_handle(self, event, now)

    monkeypatch.setattr(ms.MasterState, "handle", handle)
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as bystander:
                conn = await _registered(master.address)
                await conn.send(poison)  # raised inside the connection's nursery: an ExceptionGroup
                with pytest.raises(PCCLError):
                    while True:
                        await conn.receive()
                await conn.aclose()
                assert await bystander.are_peers_pending() is False
                assert master.statistics().connections == 1
                assert master.statistics().internal_errors == 1
    assert any(r.levelno >= logging.ERROR and r.exc_info for r in caplog.records)


async def test_a_message_the_master_cannot_encode_closes_only_that_connection(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    real_handle = ms.MasterState.handle

    def handle(self: ms.MasterState, event: ms.Event, now: float) -> list[ms.Effect]:
        effects = real_handle(self, event, now)
        if isinstance(event, ms.MessageReceived) and isinstance(event.msg, m.Heartbeat) and event.conn_id == 2:
            effects.append(ms.Send(event.conn_id, m.SyncRejected(1, "x" * (CFG.max_frame_size + 1))))
        return effects

    monkeypatch.setattr(ms.MasterState, "handle", handle)
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as bystander:
                conn = await _registered(master.address)  # connection 2
                await conn.send(m.Heartbeat())
                with pytest.raises(PCCLError):
                    while True:
                        await conn.receive()
                await conn.aclose()
                assert await bystander.are_peers_pending() is False
    # Handled as a send failure of that connection (not as an unexpected bug).
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("cannot send to connection 2" in e and "frame limit" in e for e in errors), [r.getMessage()[:200] for r in caplog.records]
    assert not any("failed unexpectedly" in e for e in errors)


# --- descriptors and idle connections ------------------------------------------------------------


async def test_idle_connections_hold_at_most_the_handshake_slots() -> None:
    # Beyond max_pending_handshakes, connections are parked (accepted, unread) until a slot frees.
    assert MAX_PENDING_HANDSHAKES >= 16
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG, max_pending_handshakes=2) as master:
            host, port = master.address.rsplit(":", 1)
            idle = [socket.create_connection((host, int(port))) for _ in range(5)]  # say nothing
            try:
                while master.statistics().waiting_connections < 3:
                    await trio.sleep(0.01)
                stats = master.statistics()
                assert (stats.unproven_connections, stats.waiting_connections) == (2, 3)
            finally:
                for sock in idle:
                    sock.close()
            await _still_serves(master.address)  # slots come back as the idle handshakes fail
            assert master.statistics().refused_connections == 5
    with pytest.raises(pccl.InvalidArgument):
        async with pccl.open_master("127.0.0.1:0", max_pending_handshakes=0):
            pass


_FD_STARVED_MASTER = """
import os, resource, sys, trio
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
import pccl
async def main():
    async with pccl.open_master("127.0.0.1:0", config=pccl.Config(connect_timeout=30.0)) as master:
        # The master keeps its unproven connections within a quarter of the limit, so here
        # something else takes the process's descriptors: all but two are hoarded until stdin
        # says to let go.
        hoard = []
        try:
            while True:
                hoard.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for fd in hoard[-2:]:
            os.close(fd)
        del hoard[-2:]
        print(master.address, flush=True)
        await trio.to_thread.run_sync(sys.stdin.readline)
        for fd in hoard:
            os.close(fd)
        await trio.sleep_forever()
trio.run(main)
"""


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_NOFILE"), reason="needs POSIX descriptor limits")
async def test_master_out_of_descriptors_backs_off_and_recovers() -> None:
    proc = await trio.lowlevel.open_process([sys.executable, "-c", _FD_STARVED_MASTER], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with trio.fail_after(BOUND * 2):
            line = b""
            while not line.endswith(b"\n"):
                line += await proc.stdout.receive_some(1)
            address = line.decode().strip()
            host, port = address.rsplit(":", 1)
            # More idle connections than the master has descriptors: accept() fails with EMFILE.
            idle = [socket.create_connection((host, int(port))) for _ in range(10)]
            await trio.sleep(0.5)
            assert proc.poll() is None, "the master exited when it ran out of descriptors"
            for sock in idle:
                sock.close()
            await proc.stdin.send_all(b"let go\n")
            async with pccl.open_communicator(address, config=CFG) as comm:
                assert comm.world_size == 1
    finally:
        proc.kill()
        stderr = await proc.stderr.receive_some(65536) if proc.stderr else b""
        await proc.wait()
    assert b"Too many open files" in stderr and b"retrying" in stderr


# --- the command line ----------------------------------------------------------------------------


def test_missing_token_file_is_a_clean_error() -> None:
    done = subprocess.run([sys.executable, "-m", "pccl", "master", "--token-file", "/nonexistent/token"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "cannot read the run token" in done.stderr and "/nonexistent/token" in done.stderr


async def test_log_level_is_accepted_after_the_sub_command() -> None:
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--log-level", "DEBUG"],
        stderr=subprocess.PIPE)
    seen = b""
    try:
        with trio.fail_after(BOUND):
            while b"master listening on" not in seen:
                chunk = await proc.stderr.receive_some(4096)
                assert chunk, seen.decode()
                seen += chunk
    finally:
        proc.kill()
        await proc.wait()
    assert b"DEBUG" in seen  # pccl.net.tcp logs "listening on" at DEBUG before the master's INFO line


# --- a peer's p2p listener -----------------------------------------------------------------------


async def test_pending_p2p_connection_is_closed_when_the_peer_closes() -> None:
    # A connection that finished the framed handshake but never sent its P2PHello: closing the
    # communicator cancels the wait, and the socket must be closed then, not left to the GC.
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ResourceWarning)
                async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as comm:
                    address = _loopback(pccl.testing.listener_address(comm, "ring"))
                    silent = await open_framed(TcpNetwork(CFG), address, token=TOKEN, config=CFG)
                    await trio.sleep(0.1)  # the peer now waits for a hello
                with pytest.raises(PCCLError):
                    await silent.receive()  # closed by the peer
                await silent.aclose()
                gc.collect()
            assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def _loopback(address: str) -> str:
    """The same port on 127.0.0.1 (the peer may listen on every interface)."""
    return f"127.0.0.1:{parse_address(address)[1]}"
