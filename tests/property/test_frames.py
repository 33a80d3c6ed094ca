"""The frame core (pccl/net/_frames.py) and its two I/O loops agree however the bytes arrive.

The same byte stream — control frames of every message type and data frames with payloads — is
received once delivered all at once, once one byte at a time and once in arbitrary pieces
(h11 tests its receive buffer this way), through

* the Trio path (:class:`~pccl.net.framed.FramedConnection`), and
* the worker-thread path (:class:`~pccl.net.framed_threads.BlockingDataChannel`) taking the
  data frames while the Trio path takes the control frames, on one connection, as a ring lane
  alternates its read role between tasks and threads,

and every way yields exactly the frames that were sent, with the same counters.
"""

from __future__ import annotations

from typing import Any

import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import strategy_for

from pccl.config import Config
from pccl.testing.units import ControlFrame, DataFrame, FrameCore
from pccl.net.base import Stream
from pccl.net.framed import FramedConnection
from pccl.net.framed_threads import thread_channel
from pccl.net.thread_io import BlockingIO, ThreadCancel
from pccl.protocol import codec, messages
from pccl.protocol.codec import DataHeader
from pccl.protocol.messages import HandshakeRole

_frames = st.one_of(
    st.sampled_from(messages.ALL_MESSAGES).flatmap(strategy_for).map(ControlFrame),
    st.builds(
        lambda seq, step, size, salt: DataFrame(DataHeader(seq, 0, step, 0, size), _payload(size, salt)),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        # Sizes around the first read-ahead buffer (4 KiB) and up to past the largest (64 KiB),
        # so frames straddle its ends and its growth.
        st.one_of(st.integers(0, 64), st.integers(3900, 4200), st.integers(0, 70_000)),
        st.integers(0, 255),
    ),
)


def _payload(size: int, salt: int) -> bytes:
    pattern = bytes((i * 7 + salt) % 251 for i in range(251))
    return (pattern * (size // 251 + 1))[:size]


def _wire(frames: list[ControlFrame | DataFrame]) -> bytes:
    return b"".join(codec.encode_message(f.message) if isinstance(f, ControlFrame)
                    else codec.encode_data_prefix(f.header) + f.payload for f in frames)


class _Source:
    """The bytes to deliver, at most ``chunk`` per receive."""

    def __init__(self, wire: bytes, chunk: int) -> None:
        self.wire, self.chunk, self.position = wire, chunk, 0

    def read_into(self, buffer: memoryview) -> int:
        n = min(self.chunk, len(buffer), len(self.wire) - self.position)
        buffer[:n] = self.wire[self.position : self.position + n]
        self.position += n
        return n


class _ByteStream(Stream):
    remote_address = local_address = "test:1"

    def __init__(self, source: _Source, *, threads: bool) -> None:
        self.source, self.threads = source, threads

    async def send_all(self, data: Any) -> None:
        raise AssertionError("nothing is sent")

    async def receive_into(self, buffer: Any) -> int:
        await trio.lowlevel.checkpoint()
        return self.source.read_into(memoryview(buffer).cast("B"))

    async def send_eof(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def blocking_io(self) -> BlockingIO | None:
        return _ByteIO(self.source) if self.threads else None


class _ByteIO(BlockingIO):
    """Blocking I/O over the same source: never blocks (the bytes are all there)."""

    def __init__(self, source: _Source) -> None:
        self.source = source

    def send_all(self, data: memoryview) -> None:
        raise AssertionError("nothing is sent")

    def receive_into(self, buffer: memoryview, *, fill: bool = False) -> int:
        if not fill:
            return self.source.read_into(buffer)
        filled = 0
        while filled < len(buffer) and (n := self.source.read_into(buffer[filled:])):
            filled += n
        return filled

    def wait_readable(self, cancel: ThreadCancel) -> None:
        pass


async def _receive_all(wire: bytes, count: int, chunk: int, *, threads: bool,
                       cuts: list[int]) -> tuple[list[ControlFrame | DataFrame], dict[str, int]]:
    """Receive ``count`` frames; data payloads in pieces cut at ``cuts`` (fractions in 1/8)."""
    conn = FramedConnection(_ByteStream(_Source(wire, chunk), threads=threads), role=HandshakeRole.CLIENT,
                            config=Config())
    channel = thread_channel(conn)
    assert (channel is not None) == threads
    cancel = ThreadCancel()
    got: list[ControlFrame | DataFrame] = []
    for _ in range(count):
        if channel is not None and conn.frames.buffered == 0 and _next_kind(wire, conn) == codec.FrameKind.DATA:
            header = channel.receive_data_header(cancel)
            payload = bytearray(header.nbytes)
            for a, b in _pieces(header.nbytes, cuts):
                channel.receive_data_into(memoryview(payload)[a:b], cancel)
            got.append(DataFrame(header, bytes(payload)))
            continue
        frame = await conn.receive_frame()
        if isinstance(frame, DataHeader):
            payload = bytearray(frame.nbytes)
            for a, b in _pieces(frame.nbytes, cuts):
                if channel is not None and a % 2:  # alternate the paths within one payload too
                    channel.receive_data_into(memoryview(payload)[a:b], cancel)
                else:
                    await conn.receive_data_into(memoryview(payload)[a:b])
            got.append(DataFrame(frame, bytes(payload)))
        else:
            got.append(ControlFrame(frame))
    cancel.close()
    assert conn.frames.buffered == 0 and conn.data_remaining == 0
    return got, dict(conn.frames.counters)


def _next_kind(wire: bytes, conn: FramedConnection) -> int:
    """The kind byte of the next frame (the test's own peek: which path takes it)."""
    position = conn.frames.counters["bytes_received"]
    return wire[position + 4]


def _pieces(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    points = sorted({0, n, *(n * c // 8 for c in cuts)})
    return list(zip(points, points[1:]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frames, min_size=1, max_size=6), chunk=st.integers(2, 5000),
       cuts=st.lists(st.integers(1, 7), max_size=3), threads=st.booleans())
def test_frames_are_the_same_whole_and_byte_by_byte(frames: list[ControlFrame | DataFrame], chunk: int,
                                                     cuts: list[int], threads: bool) -> None:
    wire = _wire(frames)

    async def main() -> None:
        whole = await _receive_all(wire, len(frames), len(wire), threads=threads, cuts=cuts)
        one_by_one = await _receive_all(wire, len(frames), 1, threads=threads, cuts=cuts)
        pieces = await _receive_all(wire, len(frames), chunk, threads=threads, cuts=cuts)
        assert whole[0] == frames
        assert one_by_one == whole
        assert pieces == whole
        assert whole[1]["frames_received"] == len(frames) and whole[1]["bytes_received"] == len(wire)

    trio.run(main)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frames, min_size=1, max_size=6), data=st.data())
def test_the_core_alone_parses_any_split_alike(frames: list[ControlFrame | DataFrame], data: st.DataObject) -> None:
    wire = _wire(frames)
    splits = [len(wire), 1, data.draw(st.integers(1, len(wire)), label="chunk")]
    results = []
    for chunk in splits:
        core = FrameCore(max_frame_size=Config().max_frame_size, remote_address="test")
        source = _Source(wire, chunk)
        got: list[Any] = []
        while len(got) < len(frames):
            frame = core.next_frame()
            if frame is None:
                core.received(source.read_into(core.read_buffer()))
                continue
            if isinstance(frame, DataHeader):
                payload = bytearray(frame.nbytes)
                view = memoryview(payload)
                filled = core.take_payload(view)
                while filled < frame.nbytes:
                    n = source.read_into(view[filled:])
                    core.payload_received(n)
                    filled += n
                got.append(DataFrame(frame, bytes(payload)))
            else:
                got.append(ControlFrame(frame))
        results.append((got, dict(core.counters)))
    assert results[0][0] == frames
    assert results[1] == results[0] and results[2] == results[0]
