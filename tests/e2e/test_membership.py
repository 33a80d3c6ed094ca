"""Membership end to end on real TCP: a master and peers as Trio tasks, and as OS processes where
a real SIGSTOP / SIGKILL matters (reference/pccl.md §7 scenarios 1, 2, 14, 27, 35, 36)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import signal
import subprocess
import sys
from typing import Literal

import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import Config
from pccl.errors import (
    AuthenticationFailed,
    Kicked,
    KickReason,
    MasterUnreachable,
    StreamClosed,
    TopologyUpdateFailed,
    TransportError,
)
from pccl.net.admission import AdmissionLimits
from pccl.net.base import Listener, Network, Stream, parse_address
from pccl.net.framed import open_framed
from pccl.net.tcp import TcpNetwork
from pccl.protocol import codec
from pccl.protocol import messages as m
from pccl.protocol.phases import TopologyVote
from pccl.testing import admit

TOKEN = "e2e-run-token"
PEER_TIMEOUT = 2.0
HEARTBEAT = 0.25
CFG = Config(peer_timeout=PEER_TIMEOUT, heartbeat_interval=HEARTBEAT, connect_timeout=2.0, p2p_base_port=0)
HERE = pathlib.Path(__file__).resolve().parent
#: Upper bound for anything that should happen "promptly"; generous for a loaded 2-core CI box.
BOUND = 10.0


class KillableNetwork(Network):
    """Real TCP that can be cut like a crashed host (every stream reset at once) and can hold
    this host's p2p dials (anything but the master) to catch it inside p2p establishment."""

    def __init__(self, master_address: str | None = None) -> None:
        self._tcp = TcpNetwork(CFG)
        self._master = master_address
        self.streams: list[Stream] = []
        self._listeners: list[Listener] = []
        self.hold_p2p_dials = False
        self.dialing = trio.Event()

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        if self.hold_p2p_dials and address != self._master:
            self.dialing.set()
            await trio.sleep_forever()
        stream = await self._tcp.connect(address, timeout=timeout)
        self.streams.append(stream)
        return stream

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        listener = await self._tcp.listen(address, port_range=port_range)
        network = self

        class Tracked(Listener):
            def __init__(self) -> None:
                self.address = listener.address

            async def accept(self) -> Stream:
                stream = await listener.accept()
                network.streams.append(stream)
                return stream

            async def aclose(self) -> None:
                await listener.aclose()

        tracked = Tracked()
        self._listeners.append(tracked)
        return tracked

    async def kill(self) -> None:
        for stream in self.streams:
            stream.abort()
        with trio.CancelScope(shield=True):
            for listener in self._listeners:
                await listener.aclose()


@pytest.fixture
async def master():
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as running:
        yield running


def _open(master_address: str, group: int = 0, *, config: Config = CFG, **kw: object):
    return pccl.open_communicator(master_address, peer_group=group, token=TOKEN, config=config, **kw)  # type: ignore[arg-type]


async def _wait_until(predicate, what: str) -> None:
    with trio.fail_after(BOUND):
        while not predicate():
            await trio.sleep(0.01)


def _attrs(comm: pccl.Communicator) -> tuple[int, int, int, int]:
    return comm.world_size, comm.global_world_size, comm.num_peer_groups, comm.largest_peer_group_size


async def _admit(nursery: trio.Nursery, master: pccl.Master, existing: list[pccl.Communicator], *,
                 group: int = 0, network: Network | None = None,
                 config: Config = CFG) -> tuple[pccl.Communicator, trio.CancelScope]:
    """Start a peer task and have every existing peer vote it in; return it and its scope."""
    return await admit(nursery, master, existing,
                       lambda: _open(master.address, group, network=network, config=config), soon=BOUND)


async def _run_peer(master_address: str, *, accepted: dict, done: trio.Event) -> None:
    """A peer task: open, record the attributes it was accepted with, stay until ``done``."""
    async with _open(master_address) as comm:
        accepted[comm.peer_id] = _attrs(comm)
        await done.wait()


async def test_first_peer_is_accepted_alone(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as comm:
            assert _attrs(comm) == (1, 1, 1, 1)
            assert comm.ring == (comm.peer_id,)
            assert await comm.are_peers_pending() is False
            await comm.update_topology()  # nothing to do: returns at once
            stats = comm.statistics()
            assert stats.world_size == 1 and stats.peer_id == comm.peer_id and stats.topology_updates == 2


async def test_second_peer_waits_for_update_topology(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as first, trio.open_nursery() as nursery:
            accepted: dict[int, tuple] = {}
            done = trio.Event()
            nursery.start_soon(lambda: _run_peer(master.address, accepted=accepted, done=done))
            await _wait_until(lambda: master.statistics().registered_peers == 1, "second peer registered")
            await trio.sleep(0.3)
            assert accepted == {}, "the newcomer must wait until the accepted peer votes"
            assert await first.are_peers_pending() is True
            await first.update_topology()
            await _wait_until(lambda: accepted, "newcomer accepted")
            assert _attrs(first) == (2, 2, 1, 2) and list(accepted.values()) == [(2, 2, 1, 2)]
            assert set(first.ring) == {first.peer_id, *accepted}
            assert len(pccl.testing.ring_lanes(first).outgoing) == 1 and len(pccl.testing.ring_lanes(first).incoming) == 1
            done.set()


async def test_ring_links_have_the_configured_lanes() -> None:
    config = dataclasses.replace(CFG, p2p_lanes=3)
    with trio.fail_after(BOUND):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=config) as master:
            async with _open(master.address, config=config) as a, trio.open_nursery() as nursery:
                b, _ = await _admit(nursery, master, [a], config=config)
                c, _ = await _admit(nursery, master, [a, b], config=config)
                peers = {x.peer_id: x for x in (a, b, c)}
                for x in peers.values():
                    lanes = pccl.testing.ring_lanes(x)
                    assert len(lanes.to_successor) == 3
                    assert lanes.successor in peers and lanes.successor != x.peer_id
                # lane j of a peer's successor links is lane j of the successor's predecessor links
                for x in peers.values():
                    succ = peers[pccl.testing.ring_lanes(x).successor]
                    for lane in range(3):
                        await pccl.testing.send_on_lane(x, lane, m.Welcome(lane))
                    assert [(await pccl.testing.receive_on_lane(succ, lane)).peer_id for lane in range(3)] == [0, 1, 2]
                nursery.cancel_scope.cancel()


async def test_three_peers_in_two_groups_agree_on_attributes(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address, group=0) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a], group=0)
            c, _ = await _admit(nursery, master, [a, b], group=1)
            assert _attrs(a) == _attrs(b) == (2, 3, 2, 2)
            assert _attrs(c) == (1, 3, 2, 2)
            assert set(a.ring) == set(b.ring) == {a.peer_id, b.peer_id} and c.ring == (c.peer_id,)
            async with trio.open_nursery() as voters:  # a plain update keeps everything identical
                for comm in (a, b, c):
                    voters.start_soon(comm.update_topology)
            assert [_attrs(x) for x in (a, b, c)] == [(2, 3, 2, 2), (2, 3, 2, 2), (1, 3, 2, 2)]
            nursery.cancel_scope.cancel()


async def test_group_rewire_needs_only_the_group(master: pccl.Master) -> None:
    """The re-wire after a failed collective involves only the group's peers (PCCL makes it
    global, which can deadlock groups against each other)."""
    with trio.fail_after(BOUND):
        async with _open(master.address, group=0) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a], group=0)
            c, _ = await _admit(nursery, master, [a, b], group=1)
            rounds_before = a.statistics().p2p_rounds, c.statistics().p2p_rounds
            async with trio.open_nursery() as voters:  # c never votes
                voters.start_soon(pccl.testing.force_rewire, a)
                voters.start_soon(pccl.testing.force_rewire, b)
            assert a.statistics().p2p_rounds == rounds_before[0] + 1  # really reconnected
            assert c.statistics().p2p_rounds == rounds_before[1]
            assert _attrs(a) == _attrs(b) == (2, 3, 2, 2)
            assert await pccl.testing.lanes_from_predecessor(a) and pccl.testing.ring_lanes(a).to_successor
            nursery.cancel_scope.cancel()


async def test_peer_killed_during_the_accept_vote_does_not_wedge_the_others(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            victim_net = KillableNetwork()
            victim, victim_scope = await _admit(nursery, master, [a, b], network=victim_net)
            assert _attrs(a) == _attrs(b) == _attrs(victim) == (3, 3, 1, 3)
            async with trio.open_nursery() as voters:
                voters.start_soon(a.update_topology)
                voters.start_soon(b.update_topology)
                await _wait_until(lambda: sum(p.topology_vote is not None for p in pccl.testing.master_snapshot(master).peers) == 2,
                                  "a and b voted, the victim did not")
                await victim_net.kill()  # dies as the last missing vote
                victim_scope.cancel()
            assert _attrs(a) == _attrs(b) == (2, 2, 1, 2)
            assert set(a.ring) == {a.peer_id, b.peer_id}
            nursery.cancel_scope.cancel()


async def test_peer_killed_during_p2p_establishment_does_not_wedge_the_others(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            victim_net = KillableNetwork(master.address)
            victim_net.hold_p2p_dials = True
            victim_scope = trio.CancelScope()

            async def victim() -> None:
                with victim_scope, pytest.raises(MasterUnreachable):  # its own connections were cut
                    async with _open(master.address, network=victim_net):
                        pytest.fail("the victim must never be accepted")

            nursery.start_soon(victim)
            await _wait_until(lambda: master.statistics().registered_peers == 1, "victim registered")
            async with trio.open_nursery() as inner:
                inner.start_soon(a.update_topology)
                with trio.fail_after(BOUND):
                    await victim_net.dialing.wait()  # the victim is inside the p2p round now
                await victim_net.kill()
                victim_scope.cancel()
            assert _attrs(a) == (1, 1, 1, 1)
            assert master.statistics().accepted_peers == 1


def _spawn_peer(master_address: str, group: int = 0) -> trio.Process:
    return trio.lowlevel.open_process(  # type: ignore[return-value]
        [sys.executable, str(HERE / "peer_process.py"), master_address, str(group), TOKEN, str(PEER_TIMEOUT),
         str(HEARTBEAT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)


async def _reap(proc: trio.Process) -> None:
    """Kill (if still running), wait for, and close the pipes of a child process."""
    proc.kill()
    await proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            await pipe.aclose()


class _Lines:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buf = b""

    async def next(self) -> str:
        while b"\n" not in self._buf:
            chunk = await self._stream.receive_some(4096)
            if not chunk:
                raise EOFError("process closed its stdout")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()


async def test_sigstopped_peer_is_removed_after_the_timeout(master: pccl.Master) -> None:
    proc = await _spawn_peer(master.address)
    try:
        with trio.fail_after(BOUND * 2):
            async with _open(master.address) as a:
                lines = _Lines(proc.stdout)
                await _wait_until(lambda: master.statistics().registered_peers == 1, "process registered")
                await a.update_topology()
                assert (await lines.next()).split() == ["ACCEPTED", "2", "2"]
                os.kill(proc.pid, signal.SIGSTOP)
                stopped_at = trio.current_time()
                await a.update_topology()  # blocked by the stopped peer until the master drops it
                # removed by the timeout (its last heartbeat may predate the SIGSTOP by one interval)
                assert trio.current_time() - stopped_at >= PEER_TIMEOUT - 2 * HEARTBEAT
                assert _attrs(a) == (1, 1, 1, 1)
                assert master.statistics().kicks >= 1
    finally:
        await _reap(proc)


async def _spawn_master() -> tuple[trio.Process, str]:
    """``python -m pccl master`` on a free port; returns the process and its address."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--token", TOKEN,
         "--peer-timeout", str(PEER_TIMEOUT), "--heartbeat-interval", str(HEARTBEAT)],
        stderr=subprocess.PIPE)
    lines = _Lines(proc.stderr)
    with trio.fail_after(BOUND):
        while "master listening on" not in (line := await lines.next()):
            pass
    return proc, line.rsplit(" ", 1)[-1]


#: A master that does not come back: the peers' reconnection policy gives up after this long.
GIVE_UP = dataclasses.replace(CFG, master_reconnect_timeout=1.5)


async def test_killing_the_master_fails_every_peer_within_the_reconnect_policy() -> None:
    master_proc, address = await _spawn_master()
    try:
        with trio.fail_after(BOUND * 2):
            async with _open(address, config=GIVE_UP) as a, trio.open_nursery() as nursery:
                peer_b: list[pccl.Communicator] = []

                async def b_peer() -> None:
                    async with _open(address, config=GIVE_UP) as b:
                        peer_b.append(b)
                        with pytest.raises(MasterUnreachable):
                            await b.update_topology()  # pending when the master dies
                        with pytest.raises(MasterUnreachable):
                            await b.are_peers_pending()  # and every later call

                nursery.start_soon(b_peer)
                await trio.sleep(0.2)
                await a.update_topology()
                await _wait_until(lambda: peer_b, "b accepted")
                await trio.sleep(0.2)  # b's vote is now waiting for a's
                master_proc.kill()
                killed_at = trio.current_time()
                with pytest.raises(MasterUnreachable, match="could not reconnect within 1.5 s"):
                    await a.are_peers_pending()  # waits while reconnecting, then gives up
                assert GIVE_UP.master_reconnect_timeout <= trio.current_time() - killed_at < BOUND
    finally:
        await _reap(master_proc)


async def test_a_stalled_master_is_detected_by_its_silence() -> None:
    master_proc, address = await _spawn_master()
    try:
        with trio.fail_after(BOUND * 2):
            async with _open(address, config=GIVE_UP) as a:
                os.kill(master_proc.pid, signal.SIGSTOP)  # connections stay open, nothing arrives
                with pytest.raises(MasterUnreachable, match="silent"):
                    await a.are_peers_pending()
                with pytest.raises(MasterUnreachable):
                    await a.update_topology()
    finally:
        await _reap(master_proc)


async def test_garbage_and_oversized_frames_get_that_connection_kicked(master: pccl.Master) -> None:
    network = TcpNetwork(CFG)
    with trio.fail_after(BOUND):
        async with _open(master.address) as a:
            # 1. Garbage instead of a handshake: closed, never registered.
            raw = await network.connect(master.address)
            await raw.send_all(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
            buf = bytearray(1024)
            while True:
                try:
                    if await raw.receive_into(buf) == 0:
                        break
                except pccl.errors.PeerDisconnected:
                    break
            await raw.aclose()
            assert master.statistics().handshake_failures == 1
            # 2. and 3. After a valid handshake and registration: garbage / an oversized frame.
            control = int(codec.FrameKind.CONTROL).to_bytes(1, "big")
            for payload, reason in [
                ((9).to_bytes(4, "big") + control + b"\xc1" * 9, KickReason.PROTOCOL_ERROR),  # undecodable body
                ((2**30).to_bytes(4, "big") + control, KickReason.FRAME_TOO_LARGE),  # announces 1 GiB
            ]:
                conn = await open_framed(network, master.address, token=TOKEN, config=CFG)
                await conn.send(m.Register(0, 9, 0, 0))
                assert isinstance(await conn.receive(), m.Welcome)
                await conn.stream.send_all(payload)  # bypass the encoder on purpose
                notice = await conn.receive()
                while isinstance(notice, m.Heartbeat):
                    notice = await conn.receive()
                assert isinstance(notice, m.KickNotice) and notice.reason == reason
                await conn.aclose()
            # The real peer never noticed.
            assert await a.are_peers_pending() is False
            await a.update_topology()
            assert _attrs(a) == (1, 1, 1, 1)


async def test_peer_without_the_run_token_is_refused(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        with pytest.raises(AuthenticationFailed):
            async with pccl.open_communicator(master.address, config=CFG):
                pass
        with pytest.raises(AuthenticationFailed):
            async with pccl.open_communicator(master.address, token="wrong", config=CFG):
                pass
        async with _open(master.address) as comm:  # the master still serves
            assert comm.world_size == 1


async def test_kicked_peer_raises_kicked_with_the_reason(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            await _admit(nursery, master, [a], group=1)  # a second member, so a's vote below waits
            async with trio.open_nursery() as voters:
                async def vote() -> None:
                    with pytest.raises(Kicked) as info:
                        await a.update_topology()
                    assert info.value.reason is KickReason.OUT_OF_PHASE

                voters.start_soon(vote)
                await _wait_until(lambda: any(p.topology_vote for p in pccl.testing.master_snapshot(master).peers), "a voted")
                await pccl.testing.send_raw(a, m.VoteTopology(True))  # a second vote: out of phase
            with pytest.raises(Kicked):
                await a.are_peers_pending()  # every later call, too
            assert master.statistics().accepted_peers == 1
            nursery.cancel_scope.cancel()


async def test_cancelled_update_topology_leaves_its_vote_standing(master: pccl.Master) -> None:
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            with trio.move_on_after(0.2) as cancelled:
                await a.update_topology()  # waits for b's vote
            assert cancelled.cancelled_caught
            votes = [p.topology_vote for p in pccl.testing.master_snapshot(master).peers if p.topology_vote is not None]
            assert len(votes) == 1, "a's vote must stand after the cancellation"
            async with trio.open_nursery() as voters:
                voters.start_soon(a.update_topology)  # resumes waiting for the same vote (no second vote)
                voters.start_soon(b.update_topology)
            assert master.statistics().kicks == 0 and _attrs(a) == (2, 2, 1, 2)
            nursery.cancel_scope.cancel()


async def test_collective_or_sync_during_a_standing_vote_is_refused_locally(master: pccl.Master) -> None:
    # The master kicks a peer that starts a collective or sync while its topology vote stands
    # (OUT_OF_PHASE); the communicator must refuse that locally instead.
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            with trio.move_on_after(0.2):
                await a.update_topology()  # b does not vote: a's vote stands
            data = np.ones(8, np.float32)
            with pytest.raises(pccl.InvalidUsage, match="topology vote"):
                await a.all_reduce(data)
            with pytest.raises(pccl.InvalidUsage, match="topology vote"):
                await a.sync_shared_state(pccl.SharedState({"x": np.zeros(4, np.float32)}))
            async with trio.open_nursery() as voters:
                voters.start_soon(a.update_topology)
                voters.start_soon(b.update_topology)
            assert master.statistics().kicks == 0
            nursery.cancel_scope.cancel()


async def test_pending_query_while_a_collective_is_in_flight(master: pccl.Master) -> None:
    """The collective vote path the all-reduce builds on, and are_peers_pending beside it."""
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            inboxes = {c: pccl.testing.open_route(c, 5) for c in (a, b)}
            for c in (a, b):
                await pccl.testing.send_raw(c, m.CollectiveInit(5, 100, int(pccl.DType.FLOAT32), int(pccl.ReduceOp.SUM)))
            commence = {c: await inboxes[c].receive() for c in (a, b)}
            assert all(isinstance(x, m.CollectiveCommence) for x in commence.values())
            assert commence[a].ring == commence[b].ring == a.ring
            # The ring links are in place and usable: a's successor receives what a sends.
            assert pccl.testing.ring_lanes(a).successor == b.peer_id and pccl.testing.ring_lanes(b).predecessor == a.peer_id
            assert len(pccl.testing.ring_lanes(a).to_successor) == 1
            await pccl.testing.send_on_lane(a, 0, m.Heartbeat())
            assert isinstance(await pccl.testing.receive_on_lane(b, 0), m.Heartbeat)
            with pytest.raises(pccl.InvalidUsage):
                await a.update_topology()  # not while a collective is in flight
            with pytest.raises(pccl.InvalidUsage):
                pccl.testing.open_route(a, 5)  # the tag is taken

            answers: list[bool] = []

            async def pending(c: pccl.Communicator) -> None:
                answers.append(await c.are_peers_pending())

            async with trio.open_nursery() as voters:
                voters.start_soon(pending, a)
                voters.start_soon(pending, b)
            assert answers == [False, False]
            for c in (a, b):
                await pccl.testing.send_raw(c, m.CollectiveDone(5, commence[c].seq))
            for c in (a, b):
                assert isinstance(await inboxes[c].receive(), m.CollectiveComplete)
                pccl.testing.close_route(c, 5)
            nursery.cancel_scope.cancel()


async def test_closing_logs_no_lost_master_when_the_master_hangs_up_first(
        master: pccl.Master, caplog: pytest.LogCaptureFixture) -> None:
    # aclose() sends Leave, and the master closes the connection as soon as it has it.  If this
    # peer's reader sees that end before aclose() goes on (a race: it happened in about one
    # clean close in three of a benchmark's peers), it must not be reported as a lost master.
    with trio.fail_after(BOUND):
        async with _open(master.address) as comm:
            async def wait_for_the_hang_up(msg: m.Message) -> None:  # hold aclose() right after its Leave
                if isinstance(msg, m.Leave):
                    await _wait_until(lambda: pccl.testing.failure_of(comm) is not None, "the reader saw the master hang up")

            pccl.testing.after_master_link_sends(comm, wait_for_the_hang_up)
        assert isinstance(pccl.testing.failure_of(comm), pccl.InvalidUsage)
    lost = [r.getMessage() for r in caplog.records if "lost the connection to the master" in r.getMessage()]
    assert lost == []



async def test_a_failure_met_while_closing_is_the_close_not_a_lost_master(
        master: pccl.Master, caplog: pytest.LogCaptureFixture) -> None:
    # The same end met by the heartbeat's send instead of the reader: once aclose() has begun,
    # whatever breaks is the closed communicator (no MasterUnreachable, no warning).
    met: list[BaseException] = []
    with trio.fail_after(BOUND):
        async with _open(master.address) as comm:
            async def fail_a_heartbeat(msg: m.Message) -> None:  # aclose() has sent its Leave: a heartbeat's send fails now
                if isinstance(msg, m.Leave):
                    try:
                        pccl.testing.fail_master_send(comm, StreamClosed("the master hung up"))
                    except pccl.PCCLError as exc:
                        met.append(exc)

            pccl.testing.after_master_link_sends(comm, fail_a_heartbeat)
    assert len(met) == 1 and isinstance(met[0], pccl.InvalidUsage) and "closed" in str(met[0])
    assert isinstance(pccl.testing.failure_of(comm), pccl.InvalidUsage)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "peer" in r.getMessage()]

@pytest.mark.parametrize("which", ["ring", "shared state"])
async def test_idle_connections_cannot_pile_up_in_a_peers_listener(master: pccl.Master, which: str,
                                                                   ) -> None:
    # A peer's ports face the network: connections that have proved nothing hold a handshake
    # slot each (until Config.first_bytes_timeout); beyond the slots they are parked, unread,
    # until one frees, and the newest waiter gets it.
    small = AdmissionLimits(pending=3, per_address=3, waiting=100)
    patient = dataclasses.replace(CFG, connect_timeout=60.0, first_bytes_timeout=60.0)  # no slot frees itself
    port_name: Literal["ring", "sync"] = "ring" if which == "ring" else "sync"
    with trio.fail_after(BOUND), pccl.testing.peer_admission_limits(small):
        async with _open(master.address, config=patient) as comm:
            host, port = parse_address(pccl.testing.listener_address(comm, port_name))
            counts = lambda: dataclasses.astuple(pccl.testing.admission_counts(comm, port_name))  # noqa: E731
            idle = []
            for _ in range(8):
                idle.append(await trio.open_tcp_stream(host, port))
                await _wait_until(lambda: sum(counts()) == len(idle), "the connection accepted")
            assert counts() == (3, 5)
            for stream in idle[:2]:  # their handshakes fail at once: two slots go to waiters
                await stream.aclose()
            await _wait_until(lambda: counts() == (3, 3), "two waiters got a slot")
            for stream in idle[2:]:
                await stream.aclose()
            # The parked ones are found closed as they get their slots.
            await _wait_until(lambda: counts() == (0, 0), "everything refused")
            late = await trio.open_tcp_stream(host, port)
            await _wait_until(lambda: counts() == (1, 0), "a later connection gets a slot")
            await late.aclose()


class FailingRingListenerNetwork(Network):
    """Real TCP whose first listener (a peer binds its ring port first) fails for good once
    ``trip`` is set, as a listening socket that the OS invalidates would."""

    def __init__(self) -> None:
        self._tcp = TcpNetwork(CFG)
        self.trip = trio.Event()
        self._wrapped = False

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        return await self._tcp.connect(address, timeout=timeout)

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        listener = await self._tcp.listen(address, port_range=port_range)
        if self._wrapped:
            return listener
        self._wrapped = True
        trip = self.trip

        class Failing(Listener):
            def __init__(self) -> None:
                self.address = listener.address

            async def accept(self) -> Stream:
                got: list[Stream] = []
                async with trio.open_nursery() as nursery:
                    async def real() -> None:
                        got.append(await listener.accept())
                        nursery.cancel_scope.cancel()

                    async def tripped() -> None:
                        await trip.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(real)
                    nursery.start_soon(tripped)
                if got:
                    return got[0]
                raise TransportError("accept failed: the listening socket is gone (planted)")

            async def aclose(self) -> None:
                await listener.aclose()

        return Failing()


async def test_a_peer_whose_ring_listener_fails_leaves_at_once_with_topology_update_failed(
        master: pccl.Master) -> None:
    # Such a peer can never be wired into a ring again: it must not stall the group's topology
    # rounds until the master gives up on it (P2P_UNREACHABLE after several attempts).
    network = FailingRingListenerNetwork()
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a], network=network)
            assert a.world_size == b.world_size == 2
            network.trip.set()
            with pytest.raises(TopologyUpdateFailed, match="p2p listener failed"):
                await b.update_topology()
            with pytest.raises(TopologyUpdateFailed):
                await b.are_peers_pending()  # every later call says the same
            await _wait_until(lambda: master.statistics().accepted_peers == 1, "b left the run")
            await a.update_topology()  # without b, in one round
            assert a.world_size == 1
            assert master.statistics().kicks == 0  # b left; nobody had to be declared unreachable
            nursery.cancel_scope.cancel()


async def test_an_accept_vote_and_a_rewire_vote_in_one_group_do_not_wait_for_each_other(
        master: pccl.Master) -> None:
    # One peer in update_topology, another re-wiring its group after a stale ring (what the
    # all-reduce does internally): the accept round re-wires the group and satisfies both.
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            async with trio.open_nursery() as voters:
                voters.start_soon(a.update_topology)
                voters.start_soon(pccl.testing.force_rewire, b)  # the all-reduce's internal vote
            assert a.world_size == b.world_size == 2 and a.ring == b.ring
            nursery.cancel_scope.cancel()


async def test_a_collective_called_while_an_internal_rewire_stands_waits_for_it_not_refused(
        master: pccl.Master) -> None:
    # PCCL's stress pattern, at its race: one call met a stale ring and re-wires the group (the
    # all-reduce's internal vote), and a call on another tag arrives meanwhile.  That call is
    # legal: it waits for the re-wire and runs on the new ring (it was refused with
    # "cannot start a collective while a topology vote (rewire) is outstanding").
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a])
            nursery.start_soon(pccl.testing.force_rewire, a)
            await _wait_until(lambda: pccl.testing.phase_of(a).topology_vote is TopologyVote.REWIRE,
                              "a's re-wire vote stands")
            results: dict[str, np.ndarray] = {}

            async def reduce(comm: pccl.Communicator, name: str, value: float) -> None:
                x = np.full(1000, value, np.float32)
                await comm.all_reduce(x, tag=7)
                results[name] = x

            async with trio.open_nursery() as calls:
                calls.start_soon(reduce, a, "a", 1.0)
                await trio.sleep(0.2)
                assert not results and pccl.testing.phase_of(a).topology_vote is TopologyVote.REWIRE
                calls.start_soon(pccl.testing.force_rewire, b)  # b's own internal vote: the round completes
                while pccl.testing.phase_of(b).topology_vote is not TopologyVote.REWIRE:
                    await trio.lowlevel.checkpoint()  # b's vote is out; the master's answer is a round trip away
                calls.start_soon(reduce, b, "b", 2.0)  # b too calls while its re-wire stands
            assert results["a"].tolist() == results["b"].tolist() == [3.0] * 1000
            assert master.statistics().kicks == 0
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fast_commit", [False, True])
async def test_a_call_waiting_for_a_peer_that_re_wires_first_is_ended_so_both_meet_on_the_new_ring(
        master: pccl.Master, fast_commit: bool) -> None:
    # After a failure, concurrent calls of two peers cross: b votes tag 7 before it learns the
    # ring is stale, a meets the stale ring first and re-wires, and its own call on tag 7 waits
    # for that re-wire.  b's held tag kept it from ever voting the re-wire (a silent wait across
    # tags until the phase-mismatch grace ended it); the master now ends b's vote as STALE_RING,
    # b re-wires too, and both run tag 7 on the new ring.  (With fast commit b's lone call
    # begins instead of voting; the master refuses the Begin as STALE_RING at once, and b
    # re-wires with a all the same.)
    config = dataclasses.replace(CFG, fast_commit=fast_commit)
    with trio.fail_after(BOUND):
        async with _open(master.address, config=config) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a], config=config)
            c, c_scope = await _admit(nursery, master, [a, b], config=config)
            c_scope.cancel()  # c leaves: the group's ring is stale
            await _wait_until(lambda: master.statistics().accepted_peers == 2, "c left")
            results: dict[str, np.ndarray] = {}

            async def reduce(comm: pccl.Communicator, name: str, value: float) -> None:
                x = np.full(1000, value, np.float32)
                await comm.all_reduce(x, tag=7)
                results[name] = x

            async with trio.open_nursery() as calls:
                calls.start_soon(reduce, b, "b", 2.0)  # b's vote waits for a's
                if not fast_commit:
                    await _wait_until(lambda: pccl.testing.phase_of(b).collectives == {7}, "b votes tag 7")
                await trio.sleep(0.1)
                calls.start_soon(pccl.testing.force_rewire, a)  # a met the stale ring on another tag
                while pccl.testing.phase_of(a).topology_vote is not TopologyVote.REWIRE:
                    await trio.lowlevel.checkpoint()  # a's vote is out; the round is a round trip away
                calls.start_soon(reduce, a, "a", 1.0)  # joins a's re-wire
            assert results["a"].tolist() == results["b"].tolist() == [3.0] * 1000
            assert a.world_size == b.world_size == 2
            nursery.cancel_scope.cancel()


async def test_a_lone_peer_says_so_once_and_the_master_logs_membership_once_each(
        master: pccl.Master, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl.protocol.master.machine")
    caplog.set_level(logging.INFO, logger="pccl.communicator")
    with trio.fail_after(BOUND):
        async with _open(master.address) as a, trio.open_nursery() as nursery:
            state_a = pccl.SharedState({"x": np.zeros(4, np.float32)})
            loop = a.steps(state_a)
            first: list[pccl.SyncInfo] = []

            async def first_step() -> None:
                first.append(await loop.__anext__())

            nursery.start_soon(first_step)
            await trio.sleep(4 * HEARTBEAT)  # a asks several times whether someone waits
            b_scope = trio.CancelScope()

            async def peer_b() -> None:
                with b_scope:
                    async with _open(master.address) as b:
                        await b.sync_shared_state(pccl.SharedState({"x": np.zeros(4, np.float32)}))
                        await trio.sleep_forever()

            nursery.start_soon(peer_b)
            await _wait_until(lambda: first, "a's first step")
            b_scope.cancel()  # b leaves
            await _wait_until(lambda: master.statistics().accepted_peers == 1, "b gone")
            await a.update_topology()
            await loop.aclose()
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert sum("is alone in group 0" in line for line in lines) == 1, lines
    assert sum("joined group 0" in line for line in lines) == 2, lines
    assert sum("accepted into group 0" in line for line in lines) == 2, lines
    left = [line.split()[1] for line in lines if line.endswith(" left the run")]
    assert len(left) == 2, lines  # one line per departure
    assert sorted(left) == sorted({line.split()[1] for line in lines if "joined group" in line}), lines  # b, then a
    sizes = [line for line in lines if line.startswith("group 0: world size")]
    assert sizes == ["group 0: world size 1 (was 0)", "group 0: world size 2 (was 1)",
                     "group 0: world size 1 (was 2)"], lines


@pytest.mark.parametrize("lone_loop", ["steps", "asks_pending"])
async def test_a_lone_peer_does_not_hold_up_the_other_groups(master: pccl.Master, lone_loop: str) -> None:
    # Accept votes are global, and so is the are_peers_pending() vote: a lone peer that only asks
    # it while the other group's peers wait in update_topology for its accept vote would wait for
    # ever (and so would they).  steps() votes with them; a hand-written loop that asks
    # are_peers_pending() first hears True (the others wait in update_topology) and votes too.
    with trio.fail_after(3 * BOUND):
        async with _open(master.address, 0) as a, trio.open_nursery() as nursery:
            b, _ = await _admit(nursery, master, [a], group=0)
            lone, _ = await _admit(nursery, master, [a, b], group=1)
            assert (a.world_size, lone.world_size, a.num_peer_groups) == (2, 1, 2)
            progress: dict[str, int] = {"a": 0, "b": 0}

            async def loop(name: str, comm: pccl.Communicator) -> None:
                state = pccl.SharedState({"x": np.zeros(4, np.float32)})
                async for _ in comm.steps(state):
                    x = np.ones(4, np.float32)
                    await comm.all_reduce(x)
                    state.revision += 1
                    progress[name] += 1

            async def lone_steps() -> None:
                state = pccl.SharedState({"y": np.zeros(2, np.float32)})
                async for _ in lone.steps(state):
                    raise AssertionError("a peer alone in its group must not step")

            async def lone_asks_pending() -> None:  # PCCL's own loop while alone
                while True:
                    if await lone.are_peers_pending():
                        await lone.update_topology()
                    else:
                        await trio.sleep(HEARTBEAT)

            # The loops stop before the communicators close: b's and lone's owner tasks are in
            # ``nursery``, and an op ending in a shielded CollectiveDone after its owner closed
            # the communicator raises InvalidUsage (closed), not Cancelled.
            async with trio.open_nursery() as loops:
                loops.start_soon(loop, "a", a)
                loops.start_soon(loop, "b", b)
                loops.start_soon(lone_steps if lone_loop == "steps" else lone_asks_pending)
                await _wait_until(lambda: min(progress.values()) >= 5, "five steps of group 0")
                assert lone.world_size == 1 and a.world_size == b.world_size == 2
                loops.cancel_scope.cancel()
            nursery.cancel_scope.cancel()
