"""Conformance checks for any :class:`pccl.net.base.Network`: real TCP and the simulator's.

Each check is a plain ``async def check_<name>(env: ConformanceEnv) -> None`` that asserts, with
no pytest-trio dependency, so the simulator can run the very same checks inside its own
``trio.run`` with a ``MockClock``.  Every wait is bounded with ``trio.fail_after`` /
``trio.move_on_after`` or ``trio.sleep``, so virtual time works; nothing uses threads or
wall-clock time.  Run one with :func:`run_check` (which also bounds the whole check by
``env.timeout``)::

    for check in CHECKS:
        trio.run(run_check, check, env, clock=MockClock(autojump_threshold=0))

What a transport must provide beyond the obvious (see ``pccl/net/base.py``):

* bounded buffering: a ``send_all`` of ``env.blocking_send_size`` bytes that the peer never reads
  must block (so that cancelling it and closing while it is blocked can be observed);
* ``abort()`` makes the peer's receives raise ``PeerDisconnected`` (never a clean EOF) and its
  sends raise ``PeerDisconnected`` soon after;
* ``listen`` honours port 0 and ``port_range`` bump allocation; a closed listener's port is
  free again at once (SO_REUSEADDR on TCP).

:func:`check_connect_timeout` is not in :data:`CHECKS` because it needs an address that never
answers, which each environment makes in its own way; call it with one.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import trio

from pccl.errors import (
    AddressInUse,
    ConnectionRefused,
    ConnectTimeout,
    InvalidArgument,
    PeerDisconnected,
    StreamClosed,
)
from pccl.net.base import Listener, Network, Stream, format_address, parse_address

MiB = 1024 * 1024


@dataclasses.dataclass
class ConformanceEnv:
    """Where a check listens and connects from, and how big its transfers are."""

    #: The Network that listens (and owns the accepted streams).
    server: Network
    #: The Network that connects (may be the same object as ``server``).
    client: Network
    #: Passed to ``server.listen``: a host with port 0, e.g. ``"127.0.0.1:0"``, ``"[::1]:0"``.
    listen_address: str
    #: Bytes per direction in :func:`check_large_transfer_both_directions`.
    large_size: int = 8 * MiB
    #: More than the transport can buffer between two streams, so a send of it blocks when
    #: the peer does not read.
    blocking_send_size: int = 64 * MiB
    #: Clients in :func:`check_many_concurrent_connections`.
    connections: int = 50
    #: Bound on one whole check, in (possibly virtual) seconds.
    timeout: float = 30.0
    #: Host to connect to when it differs from the listener's (e.g. listening on a wildcard).
    connect_host: str | None = None

    def connect_address(self, listener: Listener) -> str:
        if self.connect_host is None:
            return listener.address
        return format_address(self.connect_host, listener.port)

    def seen_as(self, address: str) -> str:
        """The address the other end of a connection sees for an end whose own address is
        ``address``: the same, unless a NAT between client and server translates it (a NATed
        client's source address, a server behind a forwarded public port).  An environment
        with a NAT overrides this (and :meth:`connect_address`, to dial the public port)."""
        return address

    @property
    def listen_host(self) -> str:
        return parse_address(self.listen_address)[0]


Check = Callable[[ConformanceEnv], Awaitable[None]]


async def run_check(check: Check, env: ConformanceEnv) -> None:
    """Run one check under ``env.timeout`` (``trio.TooSlowError`` if it hangs)."""
    with trio.fail_after(env.timeout):
        await check(env)


# --- helpers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def expect(exc_type: type[BaseException], what: str) -> Iterator[None]:
    """Assert that the block raises ``exc_type`` (and nothing else escapes)."""
    try:
        yield
    except exc_type:
        return
    raise AssertionError(f"{what}: expected {exc_type.__name__}, nothing was raised")


@contextlib.asynccontextmanager
async def connected_pair(env: ConformanceEnv) -> AsyncIterator[tuple[Stream, Stream]]:
    """``(client_stream, server_stream)`` over a fresh listener; all three closed on exit."""
    listener = await env.server.listen(env.listen_address)
    try:
        client: Stream | None = None
        server: Stream | None = None
        async with trio.open_nursery() as nursery:

            async def accept() -> None:
                nonlocal server
                server = await listener.accept()

            nursery.start_soon(accept)
            client = await env.client.connect(env.connect_address(listener))
        assert server is not None
        try:
            yield client, server
        finally:
            with trio.CancelScope(shield=True):
                await client.aclose()
                await server.aclose()
    finally:
        with trio.CancelScope(shield=True):
            await listener.aclose()


async def receive_until_eof(stream: Stream, chunk: int = 64 * 1024) -> bytes:
    """Everything up to EOF (``PeerDisconnected`` propagates)."""
    out = bytearray()
    buf = bytearray(chunk)
    while True:
        n = await stream.receive_into(buf)
        if n == 0:
            return bytes(out)
        out += buf[:n]


async def drain_until_end(stream: Stream) -> tuple[int, str]:
    """Read until EOF or a reset; return ``(bytes_read, "eof" | "reset")``."""
    buf = bytearray(1024 * 1024)
    total = 0
    try:
        while True:
            n = await stream.receive_into(buf)
            if n == 0:
                return total, "eof"
            total += n
    except PeerDisconnected:
        return total, "reset"


async def send_until_disconnected(stream: Stream, attempts: int = 200) -> None:
    """Keep sending until ``PeerDisconnected``; AssertionError if it never comes."""
    chunk = b"z" * 4096
    for _ in range(attempts):
        try:
            await stream.send_all(chunk)
        except PeerDisconnected:
            return
        await trio.sleep(0.01)
    raise AssertionError(f"send kept succeeding after the peer went away ({attempts} attempts)")


def pattern(n: int, seed: int) -> bytes:
    """``n`` reproducible pseudo-random bytes (built in pieces: randbytes caps below 256 MiB)."""
    rng = random.Random(seed)
    piece = 16 * MiB
    return b"".join(rng.randbytes(min(piece, n - start)) for start in range(0, n, piece))


# --- listening and connecting --------------------------------------------------------------------


async def check_port_zero_gets_real_port(env: ConformanceEnv) -> None:
    async with await env.server.listen(env.listen_address) as listener:
        host, port = parse_address(listener.address)
        assert port != 0, f"listener reports port 0: {listener.address}"
        assert listener.port == port
        assert host == env.listen_host, (host, env.listen_host)


async def check_addresses_are_consistent(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        # Every address parses, and each end's view matches the other's (through a NAT, if any).
        for text in (client.local_address, client.remote_address, server.local_address, server.remote_address):
            parse_address(text)
        seen_client, seen_server = env.seen_as(client.local_address), env.seen_as(server.local_address)
        assert seen_client == server.remote_address, (client.local_address, seen_client, server.remote_address)
        assert client.remote_address == seen_server, (client.remote_address, server.local_address, seen_server)
        assert parse_address(seen_server)[1] == parse_address(client.remote_address)[1]


async def check_connect_refused(env: ConformanceEnv) -> None:
    listener = await env.server.listen(env.listen_address)
    address = env.connect_address(listener)
    await listener.aclose()
    with expect(ConnectionRefused, f"connect to closed listener {address}"):
        await env.client.connect(address, timeout=5)


async def check_malformed_addresses_rejected(env: ConformanceEnv) -> None:
    for bad in ("no-port", "[::1:5", "::1:5", "host:99999", "host:-1", ":80"):
        with expect(InvalidArgument, f"connect({bad!r})"):
            await env.client.connect(bad, timeout=1)
        with expect(InvalidArgument, f"listen({bad!r})"):
            await env.server.listen(bad)


async def check_listener_aclose_wakes_accept(env: ConformanceEnv) -> None:
    listener = await env.server.listen(env.listen_address)
    outcome: list[str] = []

    async def accept() -> None:
        try:
            await listener.accept()
        except StreamClosed:
            outcome.append("closed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        await trio.sleep(0.05)  # let accept block
        await listener.aclose()
    assert outcome == ["closed"], outcome
    await listener.aclose()  # idempotent
    with expect(StreamClosed, "accept after aclose"):
        await listener.accept()


async def check_bump_allocation(env: ConformanceEnv) -> None:
    first = await env.server.listen(env.listen_address)
    try:
        base = format_address(env.listen_host, first.port)
        with expect(AddressInUse, f"listen on taken {base} with port_range=1"):
            await env.server.listen(base)
        second = await env.server.listen(base, port_range=16)
        try:
            assert first.port < second.port < first.port + 16, (first.address, second.address)
            # Each listener gets the connections made to its own address.
            for listener, payload in ((first, b"first"), (second, b"second")):
                async with trio.open_nursery() as nursery:
                    accepted: list[Stream] = []

                    async def accept(listener: Listener = listener) -> None:
                        accepted.append(await listener.accept())

                    nursery.start_soon(accept)
                    client = await env.client.connect(env.connect_address(listener))
                async with client, accepted[0] as server:
                    await client.send_all(payload)
                    assert await server.receive_exactly(len(payload)) == payload
        finally:
            await second.aclose()
    finally:
        await first.aclose()


async def check_port_reusable_after_close(env: ConformanceEnv) -> None:
    # The server closes first, which leaves its side in TIME_WAIT on real TCP.
    async with connected_pair(env) as (client, server):
        port = parse_address(server.local_address)[1]
        await client.send_all(b"ping")
        assert await server.receive_exactly(4) == b"ping"
        await server.aclose()
        assert await client.receive_into(bytearray(8)) == 0
    again = await env.server.listen(format_address(env.listen_host, port))
    async with again:
        assert again.port == port, (again.address, port)


async def check_many_concurrent_connections(env: ConformanceEnv) -> None:
    count = env.connections
    async with await env.server.listen(env.listen_address) as listener:
        address = env.connect_address(listener)
        echoed: dict[int, bytes] = {}

        async def serve_one(stream: Stream) -> None:
            async with stream:
                header = await stream.receive_exactly(8)
                size = int.from_bytes(header[4:], "little")
                body = await stream.receive_exactly(size)
                await stream.send_all(header + bytes(reversed(body)))

        async def serve(nursery: trio.Nursery) -> None:
            for _ in range(count):
                nursery.start_soon(serve_one, await listener.accept())

        async def client(index: int) -> None:
            body = pattern(1000 + index * 37, seed=index)
            async with await env.client.connect(address) as stream:
                await stream.send_all(index.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body)
                header = await stream.receive_exactly(8)
                assert int.from_bytes(header[:4], "little") == index
                echoed[index] = bytes(await stream.receive_exactly(len(body)))
                assert bytes(reversed(echoed[index])) == body, f"client {index} got a wrong echo"
                assert await stream.receive_into(bytearray(1)) == 0  # server closed after echoing

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve, nursery)
            for index in range(count):
                nursery.start_soon(client, index)
        assert sorted(echoed) == list(range(count))


async def check_connect_timeout(env: ConformanceEnv, unresponsive_address: str) -> None:
    """``connect`` to an address that never answers raises ``ConnectTimeout`` in time."""
    start = trio.current_time()
    with expect(ConnectTimeout, f"connect to unresponsive {unresponsive_address}"):
        await env.client.connect(unresponsive_address, timeout=0.5)
    elapsed = trio.current_time() - start
    assert 0.4 <= elapsed < 5, f"ConnectTimeout after {elapsed:.2f} s for a 0.5 s timeout"


# --- data: ordering, partial reads, large transfers ----------------------------------------------


async def check_messages_keep_order_both_ways(env: ConformanceEnv) -> None:
    messages = 1500

    def message(direction: int, seq: int) -> bytes:
        body = random.Random(direction * 1_000_003 + seq).randbytes(seq % 3001)
        return seq.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body

    async def send(stream: Stream, direction: int) -> None:
        for seq in range(messages):
            await stream.send_all(message(direction, seq))

    async def receive(stream: Stream, direction: int) -> None:
        for seq in range(messages):
            header = await stream.receive_exactly(8)
            assert int.from_bytes(header[:4], "little") == seq, f"direction {direction}: out of order at {seq}"
            body = await stream.receive_exactly(int.from_bytes(header[4:], "little"))
            assert bytes(header + body) == message(direction, seq), f"direction {direction}: message {seq} corrupted"

    async with connected_pair(env) as (client, server):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, client, 0)
            nursery.start_soon(receive, server, 0)
            nursery.start_soon(send, server, 1)
            nursery.start_soon(receive, client, 1)


async def check_partial_reads_with_small_buffers(env: ConformanceEnv) -> None:
    data = pattern(20_000, seed=7)
    async with connected_pair(env) as (client, server):
        await client.send_all(data)
        got = bytearray()
        for size, reads in ((1, 300), (2, 200), (7, 100), (13, 100), (4096, 1)):
            for _ in range(reads):
                buf = bytearray(size)
                n = await server.receive_into(buf)
                assert 1 <= n <= size, (n, size)
                got += buf[:n]
        # A typed, multi-byte-format buffer is filled byte-wise too.
        words = array.array("i", [0] * 16)
        await server.receive_exactly_into(memoryview(words))
        got += words.tobytes()
        # A slice of a larger memoryview receives into exactly that window.
        backing = bytearray(b"\xee" * (len(data) - len(got) + 20))
        window = memoryview(backing)[10:-10]
        await server.receive_exactly_into(window)
        assert backing[:10] == b"\xee" * 10 and backing[-10:] == b"\xee" * 10, "wrote outside the window"
        got += window
        assert bytes(got) == data


async def check_receive_exactly_across_segment_boundaries(env: ConformanceEnv) -> None:
    rng = random.Random(11)
    pieces = [rng.randbytes(rng.randint(1, 300)) for _ in range(400)]
    data = b"".join(pieces)
    reads = []
    left = len(data)
    while left:
        take = min(left, rng.randint(1, 700))
        reads.append(take)
        left -= take

    async def send(stream: Stream) -> None:
        for i, piece in enumerate(pieces):
            await stream.send_all(piece)
            if i % 50 == 0:
                await trio.sleep(0.001)  # let some writes arrive separately

    async with connected_pair(env) as (client, server):
        got = bytearray()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, client)
            for take in reads:
                got += await server.receive_exactly(take)
        assert bytes(got) == data


async def check_large_transfer_both_directions(env: ConformanceEnv) -> None:
    size = env.large_size
    upstream, downstream = pattern(size, seed=1), pattern(size, seed=2)

    async def send(stream: Stream, data: bytes, seed: int) -> None:
        rng = random.Random(seed)
        view = memoryview(data)
        offset = 0
        while offset < size:
            # Mix large bulk sends with small ones (both transfer paths of a transport).
            step = rng.choice((rng.randint(1, 5000), rng.randint(MiB // 2, 4 * MiB)))
            await stream.send_all(view[offset : offset + step])
            offset += step
        await stream.send_eof()

    async def receive(stream: Stream, into: bytearray, seed: int) -> None:
        rng = random.Random(seed)
        view = memoryview(into)
        offset = 0
        while offset < size:
            if rng.random() < 0.5:
                step = min(size - offset, rng.choice((rng.randint(1, 3000), rng.randint(MiB // 2, 3 * MiB))))
                await stream.receive_exactly_into(view[offset : offset + step])
                offset += step
            else:
                offset += await stream.receive_into(view[offset : offset + 256 * 1024])
        assert await stream.receive_into(bytearray(1)) == 0, "data beyond the end"

    got_up, got_down = bytearray(size), bytearray(size)
    async with connected_pair(env) as (client, server):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, client, upstream, 3)
            nursery.start_soon(send, server, downstream, 4)
            nursery.start_soon(receive, server, got_up, 5)
            nursery.start_soon(receive, client, got_down, 6)
    assert hashlib.sha256(got_up).digest() == hashlib.sha256(upstream).digest(), "client->server corrupted"
    assert hashlib.sha256(got_down).digest() == hashlib.sha256(downstream).digest(), "server->client corrupted"


async def check_zero_length_and_readonly_buffers(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        with expect(InvalidArgument, "receive_into(empty buffer)"):
            await server.receive_into(bytearray())
        with expect(InvalidArgument, "receive_into(read-only buffer)"):
            await server.receive_into(memoryview(b"read-only"))
        await server.receive_exactly_into(bytearray())  # nothing to fill: fine
        await client.send_all(b"")  # empty send: a no-op
        await client.send_all(b"after")
        assert await server.receive_exactly(5) == b"after"


# --- closing and half-closing --------------------------------------------------------------------


async def check_send_eof_half_closes(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.send_all(b"request")
        await client.send_eof()
        await client.send_eof()  # idempotent
        assert await receive_until_eof(server) == b"request"
        assert await server.receive_into(bytearray(4)) == 0, "EOF must repeat"
        # The other direction still works.
        await server.send_all(b"response")
        assert await client.receive_exactly(8) == b"response"
        with expect(StreamClosed, "send_all after send_eof"):
            await client.send_all(b"more")
        await server.send_eof()
        assert await client.receive_into(bytearray(4)) == 0


async def check_peer_aclose_gives_eof_then_send_fails(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.send_all(b"last words")
        await client.aclose()
        assert await receive_until_eof(server) == b"last words"
        await send_until_disconnected(server)


async def check_use_after_aclose_raises_stream_closed(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.aclose()
        await client.aclose()  # idempotent
        client.abort()  # harmless after aclose
        with expect(StreamClosed, "send_all after aclose"):
            await client.send_all(b"x")
        with expect(StreamClosed, "receive_into after aclose"):
            await client.receive_into(bytearray(1))
        with expect(StreamClosed, "receive_exactly after aclose"):
            await client.receive_exactly(4 * MiB)
        with expect(StreamClosed, "send_eof after aclose"):
            await client.send_eof()
        assert await server.receive_into(bytearray(1)) == 0


async def check_aclose_closes_even_when_cancelled(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        with trio.CancelScope() as scope:
            scope.cancel()
            await client.aclose()
        with expect(StreamClosed, "send_all after a cancelled aclose"):
            await client.send_all(b"x")
        assert await server.receive_into(bytearray(1)) == 0, "the peer must see EOF"


async def check_abort_resets_peer(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.send_all(b"before the reset")
        assert await server.receive_exactly(16) == b"before the reset"
        client.abort()
        client.abort()  # idempotent
        with expect(StreamClosed, "send_all after abort"):
            await client.send_all(b"x")
        with expect(PeerDisconnected, "receive after the peer aborted"):
            await server.receive_into(bytearray(64))
        with expect(PeerDisconnected, "receive again after the reset"):
            await server.receive_into(bytearray(64))  # sticky, never a clean EOF afterwards
        await send_until_disconnected(server)


async def check_abort_wakes_peer_blocked_in_receive(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        seen: list[str] = []

        async def blocked_receive() -> None:
            try:
                await server.receive_exactly_into(bytearray(4 * MiB))
            except PeerDisconnected:
                seen.append("reset")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_receive)
            await client.send_all(b"partial")
            await trio.sleep(0.05)
            client.abort()
        assert seen == ["reset"], seen


async def check_abort_while_sending_resets_peer(env: ConformanceEnv) -> None:
    data = memoryview(bytearray(env.blocking_send_size))
    async with connected_pair(env) as (client, server):
        seen: list[str] = []

        async def blocked_send() -> None:
            try:
                await client.send_all(data)
            except StreamClosed:
                seen.append("closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_send)
            await trio.sleep(0.2)  # the peer reads nothing: the send fills the buffers and blocks
            client.abort()
        assert seen == ["closed"], seen
        received, end = await drain_until_end(server)
        assert end == "reset", f"an aborted sender looked like a clean EOF after {received} bytes"
        assert received < len(data)


async def check_aclose_wakes_blocked_receive(env: ConformanceEnv) -> None:
    for label, receive in (
        ("receive_into", lambda s: s.receive_into(bytearray(1024))),
        ("receive_exactly_into (large)", lambda s: s.receive_exactly_into(bytearray(4 * MiB))),
    ):
        async with connected_pair(env) as (client, server):
            seen: list[str] = []

            async def blocked() -> None:
                try:
                    await receive(server)
                except StreamClosed:
                    seen.append("closed")

            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocked)
                await trio.sleep(0.05)
                await server.aclose()
            assert seen == ["closed"], f"{label}: {seen}"
            assert await client.receive_into(bytearray(8)) == 0, f"{label}: the peer must see EOF"


async def check_aclose_wakes_blocked_send(env: ConformanceEnv) -> None:
    data = memoryview(bytearray(env.blocking_send_size))
    async with connected_pair(env) as (client, server):
        seen: list[str] = []

        async def blocked_send() -> None:
            try:
                await client.send_all(data)
            except StreamClosed:
                seen.append("closed")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(blocked_send)
            await trio.sleep(0.2)  # the peer reads nothing: the send fills the buffers and blocks
            await client.aclose()
        assert seen == ["closed"], seen
        received, _end = await drain_until_end(server)
        assert received < len(data), "a send the peer never read cannot have completed"


# --- cancellation --------------------------------------------------------------------------------


async def check_cancelled_receive_loses_no_bytes(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.send_all(b"abc")
        await trio.sleep(0.01)
        # Cancelled before it starts: must not consume what is waiting.
        with trio.CancelScope() as scope:
            scope.cancel()
            await server.receive_into(bytearray(16))
        assert scope.cancelled_caught
        assert await server.receive_exactly(3) == b"abc"
        # Cancelled while blocked: nothing arrives, nothing is lost afterwards.
        with trio.move_on_after(0.1) as scope:
            await server.receive_into(bytearray(16))
        assert scope.cancelled_caught
        await client.send_all(b"after cancel")
        assert await server.receive_exactly(12) == b"after cancel"


async def check_cancelled_large_send_then_clean_close(env: ConformanceEnv) -> None:
    data = memoryview(bytearray(env.blocking_send_size))
    async with connected_pair(env) as (client, server):
        with trio.move_on_after(0.3) as scope:
            await client.send_all(data)  # the peer reads nothing: blocks until cancelled
        assert scope.cancelled_caught, "send_all of more than the transport buffers completed unread"
        await client.aclose()
        received, end = await drain_until_end(server)
        assert received < len(data), (received, end)


async def check_cancelled_large_receive_then_clean_close(env: ConformanceEnv) -> None:
    async with connected_pair(env) as (client, server):
        await client.send_all(b"x" * 1000)  # part of what the receive waits for
        with trio.move_on_after(0.2) as scope:
            await server.receive_exactly_into(bytearray(4 * MiB))
        assert scope.cancelled_caught
        await server.aclose()
        with expect(StreamClosed, "receive after aclose"):
            await server.receive_into(bytearray(1))


#: Every check that needs nothing beyond a :class:`ConformanceEnv`, in a stable order.
CHECKS: list[Check] = [
    check_port_zero_gets_real_port,
    check_addresses_are_consistent,
    check_connect_refused,
    check_malformed_addresses_rejected,
    check_listener_aclose_wakes_accept,
    check_bump_allocation,
    check_port_reusable_after_close,
    check_many_concurrent_connections,
    check_messages_keep_order_both_ways,
    check_partial_reads_with_small_buffers,
    check_receive_exactly_across_segment_boundaries,
    check_large_transfer_both_directions,
    check_zero_length_and_readonly_buffers,
    check_send_eof_half_closes,
    check_peer_aclose_gives_eof_then_send_fails,
    check_use_after_aclose_raises_stream_closed,
    check_aclose_closes_even_when_cancelled,
    check_abort_resets_peer,
    check_abort_wakes_peer_blocked_in_receive,
    check_abort_while_sending_resets_peer,
    check_aclose_wakes_blocked_receive,
    check_aclose_wakes_blocked_send,
    check_cancelled_receive_loses_no_bytes,
    check_cancelled_large_send_then_clean_close,
    check_cancelled_large_receive_then_clean_close,
]
