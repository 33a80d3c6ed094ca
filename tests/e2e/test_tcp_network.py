"""pccl.net.tcp: the conformance suite on real TCP, plus what only real sockets have."""

from __future__ import annotations

import errno
import socket
import sys

import pytest
import trio

from pccl.config import Config
from pccl.errors import (
    AddressInUse,
    ConnectionRefused,
    ConnectTimeout,
    InvalidArgument,
    InvalidUsage,
    PeerDisconnected,
    TransportError,
)
from pccl.net.base import parse_address
from pccl.testing import conformance
from pccl.net.tcp import TcpNetwork, is_same_host


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


IPV4 = pytest.param("127.0.0.1:0", id="ipv4")
IPV6 = pytest.param(
    "[::1]:0", id="ipv6", marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no ::1")
)
CHECK_IDS = [check.__name__.removeprefix("check_") for check in conformance.CHECKS]


def tcp_env(listen_address: str = "127.0.0.1:0", **network_options: object) -> conformance.ConformanceEnv:
    return conformance.ConformanceEnv(
        server=TcpNetwork(**network_options),  # type: ignore[arg-type]
        client=TcpNetwork(**network_options),  # type: ignore[arg-type]
        listen_address=listen_address,
    )


@pytest.mark.parametrize("listen_address", [IPV4, IPV6])
@pytest.mark.parametrize("check", conformance.CHECKS, ids=CHECK_IDS)
async def test_conformance(check: conformance.Check, listen_address: str) -> None:
    await conformance.run_check(check, tcp_env(listen_address))


@pytest.mark.parametrize("bulk_threshold", [1, 256 * 1024], ids=["all-bulk", "mixed"])
@pytest.mark.parametrize("check", conformance.CHECKS, ids=CHECK_IDS)
async def test_conformance_with_worker_threads(check: conformance.Check, bulk_threshold: int) -> None:
    # The opt-in worker-thread path must pass the whole suite too: with bulk_threshold=1 every
    # send_all and receive_exactly_into goes through it; with 256 KiB small and large transfers
    # alternate between the two paths on the same stream.
    await conformance.run_check(check, tcp_env(bulk_threshold=bulk_threshold))


@pytest.mark.slow
@pytest.mark.parametrize("bulk_threshold", [None, 1024 * 1024], ids=["trio-path", "worker-threads"])
async def test_large_transfer_256_mib_both_directions(bulk_threshold: int | None) -> None:
    env = tcp_env(bulk_threshold=bulk_threshold)
    env.large_size = 256 * 1024 * 1024
    env.timeout = 300
    await conformance.run_check(conformance.check_large_transfer_both_directions, env)


async def test_localhost_name_resolves() -> None:
    network = TcpNetwork()
    async with await network.listen("127.0.0.1:0") as listener:
        async with trio.open_nursery() as nursery:
            accepted = []

            async def accept() -> None:
                accepted.append(await listener.accept())

            nursery.start_soon(accept)
            # "localhost" may resolve to ::1 first: connect must fall through to 127.0.0.1.
            client = await network.connect(f"localhost:{listener.port}")
        async with client, accepted[0] as server:
            assert client.remote_address == f"127.0.0.1:{listener.port}"
            await client.send_all(b"hi")
            assert await server.receive_exactly(2) == b"hi"


async def test_nodelay_and_buffer_sizes_on_both_ends() -> None:
    size = 1024 * 1024  # above this machine's default (tcp_rmem[1] = 128 KiB), within rmem_max
    env = conformance.ConformanceEnv(
        server=TcpNetwork(Config(socket_buffer_size=size)),
        client=TcpNetwork(Config(socket_buffer_size=size)),
        listen_address="127.0.0.1:0",
    )
    async with conformance.connected_pair(env) as (client, server):
        for stream in (client, server):
            sock = stream.socket  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= size
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= size


def _as_set(size: int) -> tuple[int, int]:
    """(SO_SNDBUF, SO_RCVBUF) as the OS reports them once both are set to ``size`` (Linux
    doubles the request)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
        return (probe.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                probe.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))


def _buffers(stream: object) -> tuple[int, int]:
    sock = stream.socket  # type: ignore[attr-defined]
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF), sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)


@pytest.mark.parametrize("listen_address", [IPV4, IPV6])
async def test_same_host_connections_get_the_local_buffer_size(listen_address: str) -> None:
    local = Config().local_socket_buffer_size
    assert local > 0
    env = conformance.ConformanceEnv(server=TcpNetwork(), client=TcpNetwork(), listen_address=listen_address)
    async with conformance.connected_pair(env) as (client, server):
        assert _buffers(client) == _buffers(server) == _as_set(local)
        if hasattr(socket, "TCP_WINDOW_CLAMP"):
            # Set once connected, so the largest window each end advertises (fixed by the
            # handshake from the buffer it had then) is raised to the new size too.
            for stream in (client, server):
                clamp = stream.socket.getsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP)  # type: ignore[attr-defined]
                assert clamp >= local


async def test_local_buffer_size_zero_keeps_the_os_default_and_an_explicit_size_wins() -> None:
    with socket.socket() as raw_listener:
        # What the OS gives a connected loopback pair nobody configured.
        raw_listener.bind(("127.0.0.1", 0))
        raw_listener.listen(1)
        with socket.create_connection(raw_listener.getsockname()) as raw_client:
            raw_server, _ = raw_listener.accept()
            with raw_server:
                os_default = _buffers(_Wrapped(raw_client))
                assert _buffers(_Wrapped(raw_server)) == os_default
    if os_default == _as_set(Config().local_socket_buffer_size):
        pytest.skip("this host's default socket buffers equal the local size: nothing to tell apart")
    for config, expected in (
        (Config(local_socket_buffer_size=0), os_default),
        (Config(socket_buffer_size=1 << 20), _as_set(1 << 20)),
    ):
        env = conformance.ConformanceEnv(
            server=TcpNetwork(config), client=TcpNetwork(config), listen_address="127.0.0.1:0"
        )
        async with conformance.connected_pair(env) as (client, server):
            assert _buffers(client) == _buffers(server) == expected


class _Wrapped:
    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock


def test_same_host_is_a_loopback_or_the_sockets_own_address() -> None:
    class Fake:
        def __init__(self, local: str, remote: str | None) -> None:
            self.local, self.remote = local, remote

        def getsockname(self) -> tuple[str, int]:
            return (self.local, 1)

        def getpeername(self) -> tuple[str, int]:
            if self.remote is None:
                raise OSError(errno.ENOTCONN, "not connected")
            return (self.remote, 2)

    def same(local: str, remote: str | None) -> bool:
        return is_same_host(Fake(local, remote))  # type: ignore[arg-type]

    assert same("127.0.0.1", "127.0.0.1")
    assert same("127.0.0.1", "127.3.4.5")  # all of 127/8 is loopback
    assert same("::1", "::1")
    assert same("::ffff:127.0.0.1", "::ffff:127.0.0.1")
    assert same("192.0.2.7", "192.0.2.7")  # a connection to this host's own address
    assert same("fe80::1%eth0", "fe80::1%eth0")
    assert not same("192.0.2.7", "192.0.2.8")
    assert not same("10.0.0.1", "203.0.113.9")
    assert not same("2001:db8::1", "2001:db8::2")
    assert not same("::ffff:10.0.0.1", "::ffff:10.0.0.2")
    assert not same("127.0.0.1", None)  # not connected (any more)


async def test_connect_timeout_when_nobody_answers() -> None:
    # A listener that never accepts, with a backlog of 0: once its accept queue is full, Linux
    # drops further SYNs, so a connect hears nothing at all.
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    raw.bind(("127.0.0.1", 0))
    raw.listen(0)
    address = "127.0.0.1:%d" % raw.getsockname()[1]
    env = tcp_env()
    queued = []
    try:
        for _ in range(8):
            try:
                queued.append(await env.client.connect(address, timeout=0.5))
            except ConnectTimeout:
                break
        else:
            pytest.fail("the accept queue never filled up")
        await conformance.check_connect_timeout(env, address)
    finally:
        for stream in queued:
            await stream.aclose()
        raw.close()


async def test_refused_and_reset_errors_chain_the_os_error() -> None:
    env = tcp_env()
    listener = await env.server.listen("127.0.0.1:0")
    await listener.aclose()
    with pytest.raises(ConnectionRefused) as refused:
        await env.client.connect(listener.address)
    assert isinstance(refused.value.__cause__, ConnectionRefusedError)

    async with conformance.connected_pair(env) as (client, server):
        client.abort()
        with pytest.raises(PeerDisconnected) as reset:
            await server.receive_into(bytearray(16))
        assert isinstance(reset.value.__cause__, OSError)
        assert reset.value.__cause__.errno == errno.ECONNRESET
        with pytest.raises(PeerDisconnected) as broken:
            for _ in range(100):
                await server.send_all(b"x" * 1024)
        assert isinstance(broken.value.__cause__, OSError)
        assert broken.value.__cause__.errno in (errno.EPIPE, errno.ECONNRESET)


CHILD = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"ready")
while True:  # stream until killed; never read what the parent sends
    s.sendall(b"x" * 65536)
"""


async def test_peer_process_killed_mid_stream() -> None:
    network = TcpNetwork()
    async with await network.listen("127.0.0.1:0") as listener:
        process = await trio.lowlevel.open_process([sys.executable, "-c", CHILD, str(listener.port)])
        try:
            with trio.fail_after(20):
                stream = await listener.accept()
            async with stream:
                assert await stream.receive_exactly(5) == b"ready"
                # Bytes the child never reads make the kernel answer its death with a reset.
                await stream.send_all(b"unread" * 10_000)
                await stream.receive_exactly(1024 * 1024)  # mid-stream
                process.kill()
                await process.wait()
                with pytest.raises(PeerDisconnected):
                    with trio.fail_after(10):
                        while True:
                            if await stream.receive_into(bytearray(256 * 1024)) == 0:
                                pytest.fail("a killed peer's reset looked like a clean EOF")
                with pytest.raises(PeerDisconnected):
                    await stream.send_all(b"anyone there?")
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def test_two_concurrent_senders_are_a_usage_error() -> None:
    async with conformance.connected_pair(tcp_env()) as (client, _server):
        errors = []

        async def send() -> None:
            try:
                await client.send_all(bytearray(64 * 1024 * 1024))  # blocks: nobody reads
            except InvalidUsage:
                errors.append("busy")

        with trio.move_on_after(0.3):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                nursery.start_soon(send)
        assert errors == ["busy"]


async def test_listen_on_a_foreign_address_is_a_transport_error() -> None:
    # 192.0.2.1 (TEST-NET-1) is never a local address: bind fails with EADDRNOTAVAIL.
    with pytest.raises(TransportError) as info:
        await TcpNetwork().listen("192.0.2.1:0")
    assert info.value.__cause__ is not None


async def test_bump_allocation_stops_at_the_range_end() -> None:
    network = TcpNetwork()
    async with await network.listen("127.0.0.1:0") as first:
        with pytest.raises(AddressInUse):
            await network.listen(first.address, port_range=1)
        # The range is clipped at 65535 rather than wrapping or failing oddly.
        high = await network.listen("127.0.0.1:65535", port_range=10)
        async with high:
            assert parse_address(high.address)[1] == 65535


def test_bad_constructor_arguments() -> None:
    with pytest.raises(InvalidArgument):
        TcpNetwork(bulk_threshold=0)
