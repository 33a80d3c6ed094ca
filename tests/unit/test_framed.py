"""FramedConnection (pccl/net/framed.py): handshake, authentication, framing over a Stream.

Most tests run over in-memory streams (pccl.testing); the last section repeats
the essentials over real TCP, and the TLS tests use a throwaway CA made by ``trustme``.
"""

from __future__ import annotations

import contextlib
import random
import ssl
import struct
import tracemalloc
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
import trio
import trio.testing
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pccl.testing import MemoryNetwork, MemoryStream, memory_stream_pair

from pccl.config import Config
from pccl.errors import (
    AuthenticationFailed,
    ConnectTimeout,
    InvalidArgument,
    InvalidUsage,
    PeerDisconnected,
    ProtocolError,
    StreamClosed,
)
from pccl.net.framed import FramedConnection, accept_framed, open_framed
from pccl.net.tcp import TcpNetwork
from pccl.protocol import codec, handshake
from pccl.protocol.codec import DataHeader, FrameKind
from pccl.protocol.messages import AuthProof, AuthResult, HandshakeRole, Heartbeat, Hello, Welcome

CONFIG = Config(connect_timeout=5.0)


async def framed_pair(
    *,
    client_token: str | bytes | None = None,
    server_token: str | bytes | None = None,
    config: Config = CONFIG,
    streams: tuple[MemoryStream, MemoryStream] | None = None,
    client_nonces: random.Random | None = None,
    server_nonces: random.Random | None = None,
) -> tuple[FramedConnection, FramedConnection]:
    """Handshake both ends of an in-memory pair concurrently; a failure of either side is raised."""
    client_stream, server_stream = streams or memory_stream_pair()
    client, server = await both_outcomes(
        lambda: _client_handshake(client_stream, client_token, config, nonce_source=client_nonces),
        lambda: accept_framed(server_stream, token=server_token, config=config, nonce_source=server_nonces),
    )
    for side in (client, server):
        if isinstance(side, Exception):
            raise side
    assert isinstance(client, FramedConnection) and isinstance(server, FramedConnection)
    return client, server


async def _client_handshake(stream: MemoryStream, token: object, config: Config, **kwargs: object) -> FramedConnection:
    network = MemoryNetwork()
    # Reuse the established stream: a one-shot network whose connect returns it.
    network.connect = _returning(stream)  # type: ignore[method-assign]
    return await open_framed(network, stream.remote_address, token=token, config=config, **kwargs)  # type: ignore[arg-type]


def _returning(stream: MemoryStream) -> Callable[..., Awaitable[MemoryStream]]:
    async def connect(address: str, *, timeout: float | None = None) -> MemoryStream:
        await trio.lowlevel.checkpoint()
        return stream

    return connect


async def both_outcomes(
    client: Callable[[], Awaitable[object]], server: Callable[[], Awaitable[object]]
) -> tuple[object, object]:
    """Run both sides to completion; return each side's result or exception."""
    outcome: dict[str, object] = {}

    async def run(name: str, fn: Callable[[], Awaitable[object]]) -> None:
        try:
            outcome[name] = await fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            outcome[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, "client", client)
        nursery.start_soon(run, "server", server)
    return outcome["client"], outcome["server"]


async def handshake_outcomes(client_token: object, server_token: object, **kwargs: object) -> tuple[object, object]:
    client_stream, server_stream = memory_stream_pair()
    return await both_outcomes(
        lambda: _client_handshake(client_stream, client_token, CONFIG, **kwargs),
        lambda: accept_framed(server_stream, token=server_token, config=CONFIG, **kwargs),  # type: ignore[arg-type]
    )


# --- handshake and authentication ------------------------------------------------------------------


async def test_handshake_without_token_then_messages_both_ways() -> None:
    client, server = await framed_pair()
    assert (client.role, server.role) == (HandshakeRole.CLIENT, HandshakeRole.SERVER)
    assert not client.authenticated and not server.authenticated
    await client.send(Welcome(peer_id=2**64 - 1))
    await server.send(Heartbeat())
    assert await server.receive() == Welcome(peer_id=2**64 - 1)
    assert await client.receive() == Heartbeat()
    await client.aclose()
    with pytest.raises(PeerDisconnected, match="closed the connection at a frame boundary"):
        await server.receive()


async def test_matching_tokens_authenticate_both_sides() -> None:
    client, server = await framed_pair(client_token="s3cret", server_token=b"s3cret")
    assert client.authenticated and server.authenticated
    await server.send(Heartbeat())
    assert await client.receive() == Heartbeat()


async def test_wrong_token_fails_on_both_sides_saying_why() -> None:
    client, server = await handshake_outcomes("alpha", "beta")
    for side in (client, server):
        assert isinstance(side, AuthenticationFailed)
        assert "did not prove the run token" in str(side)


async def test_only_server_has_token() -> None:
    client, server = await handshake_outcomes(None, "tok")
    assert isinstance(client, AuthenticationFailed) and "requires a run token, but none is configured" in str(client)
    assert isinstance(server, AuthenticationFailed) and "presented no run token" in str(server)


async def test_only_client_has_token() -> None:
    client, server = await handshake_outcomes("tok", None)
    assert isinstance(client, AuthenticationFailed) and "presented no run token" in str(client)
    assert isinstance(server, AuthenticationFailed) and "requires a run token" in str(server)


class RawPeer:
    """A hand-driven end of a connection for adversarial tests: raw bytes and single frames."""

    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def receive_exactly(self, n: int) -> bytes:
        return bytes(await self.stream.receive_exactly(n))

    async def send_message(self, message: object) -> None:
        await self.send(codec.encode_message(message))  # type: ignore[arg-type]

    async def receive_message(self) -> object:
        kind, length = codec.parse_prefix(await self.receive_exactly(codec.PREFIX_SIZE), max_frame_size=4096)
        assert kind is FrameKind.CONTROL
        return codec.decode_message(await self.receive_exactly(length))


async def test_reflected_proof_is_rejected() -> None:
    # An attacker without the token opens two connections to a server and plays them against
    # each other: in connection 2 it echoes connection 1's server nonce as its own challenge, so
    # the server computes HMAC(token, role | N_s1 | N_s2) there; it then presents that MAC as
    # its proof in connection 1, where the server expects HMAC(token, CLIENT | N_s1 | N_s2).
    # Only the role byte differs — binding the prover's role is what makes this fail.
    token = "run-token"
    c1, s1 = memory_stream_pair()
    c2, s2 = memory_stream_pair()
    a1, a2 = RawPeer(c1), RawPeer(c2)
    results: dict[str, object] = {}

    async def server(name: str, stream: MemoryStream) -> None:
        try:
            results[name] = await accept_framed(stream, token=token, config=CONFIG)
        except Exception as exc:  # noqa: BLE001
            results[name] = exc

    async with trio.open_nursery() as nursery:
        nursery.start_soon(server, "conn1", s1)
        nursery.start_soon(server, "conn2", s2)
        for peer in (a1, a2):
            await peer.send(handshake.encode_preamble())
            await peer.receive_exactly(handshake.PREAMBLE_SIZE)
        hello1, hello2 = await a1.receive_message(), await a2.receive_message()
        assert isinstance(hello1, Hello) and isinstance(hello2, Hello)
        await a1.send_message(Hello(HandshakeRole.CLIENT, True, hello2.nonce))
        await a2.send_message(Hello(HandshakeRole.CLIENT, True, hello1.nonce))
        server_proof2 = await a2.receive_message()
        assert isinstance(server_proof2, AuthProof)
        await a1.receive_message()  # the server's own proof in connection 1
        await a1.send_message(AuthProof(mac=server_proof2.mac))
        verdict = await a1.receive_message()
        assert verdict == AuthResult(ok=False, reason="the run token proof did not verify (different tokens)")
        await a1.send_message(AuthResult(ok=True))
        c2.abort()
    assert isinstance(results["conn1"], AuthenticationFailed)
    assert "did not prove the run token" in str(results["conn1"])
    assert isinstance(results["conn2"], (PeerDisconnected, ProtocolError))


async def test_refused_prover_that_goes_silent_still_gets_authentication_failed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client_stream, server_stream = memory_stream_pair()
    peer = RawPeer(client_stream)

    async def impostor() -> None:
        await peer.send(handshake.encode_preamble())
        await peer.receive_exactly(handshake.PREAMBLE_SIZE)
        await peer.send_message(Hello(HandshakeRole.CLIENT, True, bytes(handshake.NONCE_SIZE)))
        await peer.send_message(AuthProof(mac=bytes(32)))
        await trio.sleep_forever()  # never sends its AuthResult

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(impostor)
        with pytest.raises(AuthenticationFailed, match="did not prove the run token"):
            await accept_framed(server_stream, token="tok", config=CONFIG)
        nursery.cancel_scope.cancel()
    assert trio.current_time() - start < CONFIG.connect_timeout


async def test_version_mismatch_names_both_versions() -> None:
    client_stream, server_stream = memory_stream_pair()
    peer = RawPeer(client_stream)
    await peer.send(handshake.encode_preamble(handshake.PROTOCOL_VERSION + 1))
    with pytest.raises(
        ProtocolError,
        match=f"this side speaks version {handshake.PROTOCOL_VERSION}, the peer speaks version {handshake.PROTOCOL_VERSION + 1}",
    ):
        await accept_framed(server_stream, config=CONFIG)
    # The refusing side closed the stream after telling its own version.
    assert handshake.parse_preamble(await peer.receive_exactly(handshake.PREAMBLE_SIZE)) == handshake.PROTOCOL_VERSION
    assert await client_stream.receive_into(bytearray(1)) == 0


async def test_wrong_magic_is_not_a_pccl_peer() -> None:
    client_stream, server_stream = memory_stream_pair()
    await client_stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(ProtocolError, match="not a pccl peer"):
        await accept_framed(server_stream, config=CONFIG)


async def test_an_accepted_connection_that_sends_nothing_is_dropped_at_the_first_bytes_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    # An idle connection must not hold a handshake slot for the whole connect_timeout.
    _client_stream, server_stream = memory_stream_pair()
    start = trio.current_time()
    with pytest.raises(ConnectTimeout, match=r"sent no handshake within 1.5 s .*first_bytes_timeout"):
        await accept_framed(server_stream, config=Config(connect_timeout=30.0, first_bytes_timeout=1.5))
    assert trio.current_time() - start == pytest.approx(1.5)


async def test_a_dribbling_connection_gets_the_first_bytes_deadline_for_its_preamble(
        autojump_clock: trio.testing.MockClock) -> None:
    client_stream, server_stream = memory_stream_pair()

    async def dribble() -> None:  # a byte a second: the preamble is not complete in time
        with contextlib.suppress(PeerDisconnected):  # until the server closes
            for byte in handshake.encode_preamble():
                await client_stream.send_all(bytes([byte]))
                await trio.sleep(1.0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(dribble)
        start = trio.current_time()
        with pytest.raises(ConnectTimeout, match="first_bytes_timeout"):
            await accept_framed(server_stream, config=Config(connect_timeout=30.0, first_bytes_timeout=5.0))
        assert trio.current_time() - start == pytest.approx(5.0)
        nursery.cancel_scope.cancel()


async def test_handshake_times_out_against_a_peer_silent_after_its_preamble(
        autojump_clock: trio.testing.MockClock) -> None:
    client_stream, server_stream = memory_stream_pair()
    await client_stream.send_all(handshake.encode_preamble())
    start = trio.current_time()
    with pytest.raises(ConnectTimeout, match=r"did not complete within 3 s"):
        await accept_framed(server_stream, config=Config(connect_timeout=3.0))
    assert trio.current_time() - start == pytest.approx(3.0)


async def test_dialler_is_not_held_to_the_first_bytes_deadline(autojump_clock: trio.testing.MockClock) -> None:
    # The accepting side may be slow to answer (its slots are busy): only connect_timeout applies.
    network = MemoryNetwork()
    listener = await network.listen("server:1")
    start = trio.current_time()
    with pytest.raises(ConnectTimeout, match=r"did not complete within 3 s"):
        await open_framed(network, "server:1", config=Config(connect_timeout=3.0, first_bytes_timeout=0.5))
    assert trio.current_time() - start == pytest.approx(3.0)
    await listener.aclose()


async def test_open_framed_over_a_network_and_refusal() -> None:
    network = MemoryNetwork()
    listener = await network.listen("10.9.9.9:0")

    async def serve() -> FramedConnection:
        return await accept_framed(await listener.accept(), token="t", config=CONFIG)

    client, server = await both_outcomes(lambda: open_framed(network, listener.address, token="t", config=CONFIG), serve)
    assert isinstance(client, FramedConnection) and isinstance(server, FramedConnection)
    assert client.authenticated and server.authenticated


async def test_seeded_nonce_source_makes_the_handshake_reproducible() -> None:
    wires = []
    for _ in range(2):
        client_stream, server_stream = memory_stream_pair()
        await framed_pair(
            streams=(client_stream, server_stream),
            client_token="t",
            server_token="t",
            client_nonces=random.Random(7),
            server_nonces=random.Random(8),
        )
        wires.append(bytes(client_stream.sent))
    assert wires[0] == wires[1]
    expected_nonce = random.Random(7).randbytes(handshake.NONCE_SIZE)
    assert expected_nonce in wires[0]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=120), valid_preamble=st.booleans(), token=st.sampled_from([None, "tok"]))
async def test_handshake_garbage_fails_cleanly(garbage: bytes, valid_preamble: bool, token: str | None) -> None:
    client_stream, server_stream = memory_stream_pair()
    await client_stream.send_all((handshake.encode_preamble() if valid_preamble else b"") + garbage)
    await client_stream.send_eof()
    with pytest.raises((ProtocolError, AuthenticationFailed, PeerDisconnected)) as info:
        await accept_framed(server_stream, token=token, config=CONFIG)
    assert str(info.value)


# --- frames after the handshake --------------------------------------------------------------------


async def test_data_frames_go_straight_into_the_destination_in_pieces() -> None:
    client, server = await framed_pair()
    source = np.arange(300_000, dtype=np.float32)  # 1.2 MB: larger than the coalescing limit
    destination = np.zeros_like(source)
    header = DataHeader(op_seq=5, stream=2, step=1, offset=4 * 1000, nbytes=4 * 200_000)

    async def send() -> None:
        await client.send_data(header, source[1000:201_000])
        await client.send_data(DataHeader(5, 2, 2, 0, 40), source[:10])
        await client.send(Heartbeat())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        got = await server.receive_data_header(op_seq=5, stream=2, step=1, buffer_nbytes=destination.nbytes)
        assert got == header
        target = memoryview(destination).cast("B")[got.offset : got.end]
        await server.receive_data_into(target[:333])
        assert server.data_remaining == got.nbytes - 333
        with pytest.raises(InvalidUsage, match="payload bytes of the previous data frame are unread"):
            await server.receive()
        await server.receive_data_into(target[333:])
        small = await server.receive_data_header(nbytes=40)
        await server.receive_data_into(memoryview(destination)[:10])
        assert await server.receive() == Heartbeat()
    np.testing.assert_array_equal(destination[1000:201_000], source[1000:201_000])
    np.testing.assert_array_equal(destination[:10], source[:10])
    assert small.step == 2
    stats = server.statistics()
    assert stats.data_bytes_received == header.nbytes + 40
    assert client.statistics().data_bytes_sent == header.nbytes + 40


async def test_data_header_mismatch_and_misuse() -> None:
    client, server = await framed_pair()
    await client.send_data(DataHeader(1, 0, 0, 96, 64), bytes(64))
    with pytest.raises(ProtocolError, match=r"\[96, 160\) does not fit the 128-byte destination"):
        await server.receive_data_header(buffer_nbytes=128)
    with pytest.raises(ProtocolError, match="unusable after an earlier failure"):
        await server.receive()
    with pytest.raises(InvalidArgument, match="header says 10 payload bytes, the payload has 64"):
        await client.send_data(DataHeader(1, 0, 0, 0, 10), bytes(64))
    with pytest.raises(InvalidArgument, match="read-only"):
        await server.receive_data_into(memoryview(b"abc"))


async def test_unexpected_frame_kinds_are_protocol_errors() -> None:
    client, server = await framed_pair()
    await client.send_data(DataHeader(1, 0, 0, 0, 3), b"abc")
    with pytest.raises(ProtocolError, match="sent a data frame .* where a control message was expected"):
        await server.receive()
    client2, server2 = await framed_pair()
    await client2.send(Heartbeat())
    with pytest.raises(ProtocolError, match="sent Heartbeat where a data frame was expected"):
        await server2.receive_data_header()


async def test_discard_data_skips_a_payload() -> None:
    client, server = await framed_pair()
    await client.send_data(DataHeader(1, 0, 0, 0, 3_000_000), np.ones(3_000_000, np.uint8))
    await client.send(Heartbeat())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, Heartbeat())
        await server.receive_data_header()
        await server.discard_data()
        assert await server.receive() == Heartbeat()
        assert await server.receive() == Heartbeat()


async def test_control_frames_larger_than_the_read_ahead_buffer() -> None:
    client, server = await framed_pair()
    big = AuthResult(ok=False, reason="x" * 300_000)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, big)
        assert await server.receive() == big


async def test_concurrent_senders_never_interleave_frames() -> None:
    client, server = await framed_pair()
    payload = np.arange(100_000, dtype=np.int32)  # above the coalescing limit: two writes

    async def sender(index: int) -> None:
        for seq in range(5):
            await client.send(Welcome(peer_id=index * 100 + seq))
            await client.send_data(DataHeader(index, 0, seq, 0, payload.nbytes), payload)

    received = np.zeros_like(payload)
    async with trio.open_nursery() as nursery:
        for index in range(4):
            nursery.start_soon(sender, index)
        seen = []
        for _ in range(40):
            frame = await server.receive_frame()
            if isinstance(frame, DataHeader):
                await server.receive_data_into(memoryview(received))
                np.testing.assert_array_equal(received, payload)
            else:
                seen.append(frame)
    assert sorted(m.peer_id for m in seen) == sorted(i * 100 + s for i in range(4) for s in range(5))  # type: ignore[attr-defined]


@pytest.mark.parametrize("reason_size", [50, 200_000], ids=["buffered", "larger-than-read-ahead"])
async def test_cancelled_receive_resumes_the_same_frame(autojump_clock: trio.testing.MockClock, reason_size: int) -> None:
    client_stream, server_stream = memory_stream_pair()
    _client, server = await framed_pair(streams=(client_stream, server_stream))
    message = AuthResult(ok=True, reason="x" * reason_size)
    frame = codec.encode_message(message)
    cuts = [0, 3, 9, len(frame) // 2, len(frame)]  # inside the prefix, the body start, mid-body
    for start, end in zip(cuts, cuts[1:-1]):
        await client_stream.send_all(frame[start:end])
        with trio.move_on_after(1) as scope:
            await server.receive()
        assert scope.cancelled_caught
    await client_stream.send_all(frame[cuts[-2] :])
    assert await server.receive() == message


async def test_cancelled_send_mid_frame_aborts_the_connection(autojump_clock: trio.testing.MockClock) -> None:
    client_stream, server_stream = memory_stream_pair()
    client, server = await framed_pair(streams=(client_stream, server_stream))
    client_stream.stall_sends = True
    with trio.move_on_after(1) as scope:
        await client.send(AuthResult(ok=True, reason="x" * 100))
    assert scope.cancelled_caught
    with pytest.raises(StreamClosed, match="interrupted mid-frame"):
        await client.send(Heartbeat())
    # The peer sees the connection end instead of parsing a torn frame and whatever follows.
    with pytest.raises(PeerDisconnected, match=r"closed the connection after \d+ bytes of a frame"):
        await server.receive()


async def test_concurrent_receives_are_refused() -> None:
    client, server = await framed_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(InvalidUsage, match="already receiving"):
            await server.receive()
        await client.send(Heartbeat())


async def test_oversized_length_is_refused_at_once_without_allocating() -> None:
    client_stream, server_stream = memory_stream_pair()
    _client, server = await framed_pair(streams=(client_stream, server_stream))
    # Announce a 4 GiB control frame and send nothing else: the receiver must not wait for the
    # body (the test would hang) nor allocate room for it.
    await client_stream.send_all(struct.pack(">IB", 0xFFFFFFFF, FrameKind.CONTROL))
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="control frame of 4294967295 bytes exceeds the limit of 16777216"):
            await server.receive()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


async def test_control_frames_are_capped_during_the_handshake() -> None:
    client_stream, server_stream = memory_stream_pair()
    await client_stream.send_all(handshake.encode_preamble() + struct.pack(">IB", 100_000, FrameKind.CONTROL))
    with pytest.raises(ProtocolError, match=f"exceeds the limit of {handshake.HANDSHAKE_MAX_FRAME_SIZE}"):
        await accept_framed(server_stream, config=CONFIG)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(max_size=300), valid_first=st.booleans())
async def test_garbage_after_the_handshake_fails_cleanly(garbage: bytes, valid_first: bool) -> None:
    client_stream, server_stream = memory_stream_pair()
    _client, server = await framed_pair(streams=(client_stream, server_stream))
    prefix = codec.encode_message(Heartbeat()) if valid_first else b""
    await client_stream.send_all(prefix + garbage)
    await client_stream.send_eof()
    scratch = bytearray(1 << 16)
    with pytest.raises((ProtocolError, PeerDisconnected)) as info:
        for _ in range(1000):
            frame = await server.receive_frame()
            if isinstance(frame, DataHeader):
                await server.receive_data_into(memoryview(scratch)[: min(frame.nbytes, len(scratch))])
                await server.discard_data()
    assert str(info.value)
    if isinstance(info.value, PeerDisconnected):
        assert "closed the connection" in str(info.value)


async def test_send_cancelled_on_getting_the_lock_leaves_the_connection_intact() -> None:
    # Taking a contended lock ends with the lock handed over and no cancellation check: a cancel
    # that lands just then must not count as "interrupted mid-frame", since nothing was written.
    client, server = await framed_pair()
    scope = trio.CancelScope()
    outcome: list[str] = []

    async def victim() -> None:
        with scope:
            await client.send(Welcome(peer_id=1))
            outcome.append("sent")
        if scope.cancelled_caught:
            outcome.append("cancelled")

    async with trio.open_nursery() as nursery:
        async with client.send_lock:  # hold the lock so that the victim parks on it
            nursery.start_soon(victim)
            await trio.testing.wait_all_tasks_blocked()
        scope.cancel()  # the lock now belongs to the victim, which has not run yet
    assert outcome == ["cancelled"]
    await client.send(Welcome(peer_id=2))  # still usable, and nothing torn reached the peer
    assert await server.receive() == Welcome(peer_id=2)


# --- TLS ---------------------------------------------------------------------------------------------


def tls_config(ca: object, cert: object, *, trust: bool = True) -> Config:
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)  # type: ignore[attr-defined]
    client_ctx = ssl.create_default_context()
    if trust:
        ca.configure_trust(client_ctx)  # type: ignore[attr-defined]
    return Config(connect_timeout=5.0, tls_client_context=client_ctx, tls_server_context=server_ctx)


@pytest.fixture(scope="module")
def certificate_authority() -> tuple[object, object]:
    ca = trustme.CA()
    return ca, ca.issue_cert("localhost", "127.0.0.1", "::1", "10.0.0.2")


async def test_tls_handshake_with_token_and_data(certificate_authority: tuple[object, object]) -> None:
    config = tls_config(*certificate_authority)
    client_stream, server_stream = memory_stream_pair()
    client, server = await framed_pair(streams=(client_stream, server_stream), config=config, client_token="t", server_token="t")
    assert client.authenticated and server.authenticated
    payload = np.arange(50_000, dtype=np.float64)
    received = np.zeros_like(payload)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_data, DataHeader(1, 0, 0, 0, payload.nbytes), payload)
        await server.receive_data_header(nbytes=payload.nbytes)
        await server.receive_data_into(memoryview(received))
    np.testing.assert_array_equal(received, payload)
    # The wire carries ciphertext: the magic never appears in clear.
    assert handshake.MAGIC not in client_stream.sent
    await client.aclose()
    with pytest.raises(PeerDisconnected):
        await server.receive()


async def test_tls_untrusted_certificate_fails(certificate_authority: tuple[object, object]) -> None:
    client_stream, server_stream = memory_stream_pair()
    client, server = await both_outcomes(
        lambda: _client_handshake(client_stream, None, tls_config(*certificate_authority, trust=False)),
        lambda: accept_framed(server_stream, config=tls_config(*certificate_authority)),
    )
    assert isinstance(client, PeerDisconnected) and "CERTIFICATE_VERIFY_FAILED" in str(client)
    assert isinstance(server, PeerDisconnected)


async def test_tls_stream_refuses_empty_and_read_only_receive_buffers(certificate_authority: tuple[object, object]) -> None:
    config = tls_config(*certificate_authority)
    client_stream, server_stream = memory_stream_pair()
    client, server = await framed_pair(streams=(client_stream, server_stream), config=config)
    tls_stream = server.stream  # the TlsStream under the framed connection
    for bad in (bytearray(0), memoryview(bytearray(0)), b"read-only", memoryview(bytes(8))):
        with pytest.raises(InvalidArgument):
            await tls_stream.receive_into(bad)  # type: ignore[arg-type]
    await client.send(Welcome(peer_id=3))  # the stream is still fine
    assert await server.receive() == Welcome(peer_id=3)


# --- over real TCP -------------------------------------------------------------------------------


async def tcp_outcomes(
    client_token: str | None, server_token: str | None, config: Config = CONFIG
) -> tuple[object, object]:
    network = TcpNetwork(config)
    async with await network.listen("127.0.0.1:0") as listener:

        async def serve() -> FramedConnection:
            return await accept_framed(await listener.accept(), token=server_token, config=config)

        return await both_outcomes(lambda: open_framed(network, listener.address, token=client_token, config=config), serve)


async def test_tcp_handshake_and_bulk_data_frame() -> None:
    client, server = await tcp_outcomes("tok", "tok")
    assert isinstance(client, FramedConnection) and isinstance(server, FramedConnection)
    assert client.authenticated and server.authenticated
    assert server.remote_address == client.local_address
    payload = np.random.default_rng(1).integers(0, 255, 8 * 1024 * 1024, dtype=np.uint8)  # bulk path
    received = np.zeros_like(payload)
    async with client, server, trio.open_nursery() as nursery:
        nursery.start_soon(client.send_data, DataHeader(3, 0, 0, 0, payload.nbytes), payload)
        nursery.start_soon(client.send, Heartbeat())
        frames = [await server.receive_frame()]
        if isinstance(frames[0], DataHeader):
            await server.receive_data_into(memoryview(received))
            frames.append(await server.receive())
        else:
            frames.append(await server.receive_data_header())
            await server.receive_data_into(memoryview(received))
        np.testing.assert_array_equal(received, payload)
        assert Heartbeat() in frames


async def test_tcp_wrong_token_fails_on_both_sides() -> None:
    client, server = await tcp_outcomes("right", "wrong")
    assert isinstance(client, AuthenticationFailed) and isinstance(server, AuthenticationFailed)


async def test_tcp_with_tls(certificate_authority: tuple[object, object]) -> None:
    client, server = await tcp_outcomes("tok", "tok", tls_config(*certificate_authority))
    assert isinstance(client, FramedConnection) and isinstance(server, FramedConnection)
    async with client, server:
        await client.send(Welcome(peer_id=9))
        assert await server.receive() == Welcome(peer_id=9)
        await server.send_data(DataHeader(1, 0, 0, 0, 300_000), bytes(range(256)) * 1171 + bytes(224))
        header = await client.receive_data_header()
        received = bytearray(header.nbytes)
        await client.receive_data_into(received)
        assert received == bytes(range(256)) * 1171 + bytes(224)
