"""pccl.collectives.trio_ring: the ring in one Trio task, sends that never wait.

The lanes here are in-memory streams with a bounded send window and a non-blocking
``send_nowait`` (what a socket offers, and the simulator's streams): a frame goes out at once,
in part, or not at all, and the rest is the lane's sender task's.  Results are compared with the
numpy model of the ring, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives import RingLinks, ring_all_reduce
from pccl.collectives.reference import ring_reference
from pccl.config import Config
from pccl.errors import PeerDisconnected, StreamClosed
from pccl.net.base import Stream
from pccl.net.framed import FramedConnection
from pccl.protocol.codec import DataHeader
from pccl.protocol.messages import HandshakeRole
from pccl.types import Quantization, ReduceOp

CONFIG = Config()


class _Pipe:
    """One direction: bytes written and not yet read, at most ``window`` of them."""

    def __init__(self, window: int) -> None:
        self.data = bytearray()
        self.window = window
        self.closed = False
        self.changed = trio.lowlevel.ParkingLot()
        self.read_paused = False  # a stalled reader: nothing is read while set

    def room(self) -> int:
        return self.window - len(self.data)

    def wake(self) -> None:
        self.changed.unpark_all()


class WindowStream(Stream):
    """A pccl Stream with a bounded send window and a non-blocking ``send_nowait``."""

    def __init__(self, out: _Pipe, inc: _Pipe, name: str) -> None:
        self._out, self._in = out, inc
        self.remote_address = name
        self.local_address = name + "/local"
        self._sending = False
        self.nowait_calls = 0
        self.nowait_partial = 0

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        self.nowait_calls += 1
        if self._sending or self._out.closed:
            return 0
        n = min(self._out.room(), len(data))
        if n <= 0:
            return 0
        self._out.data += memoryview(data).cast("B")[:n]
        self._out.wake()
        if n < len(data):
            self.nowait_partial += 1
        return n

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._sending = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            while view.nbytes:
                if self._out.closed:
                    raise PeerDisconnected(f"test: stream to {self.remote_address} closed")
                n = min(self._out.room(), view.nbytes)
                if n <= 0:
                    await self._out.changed.park()
                    continue
                self._out.data += view[:n]
                view = view[n:]
                self._out.wake()
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._sending = False

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = memoryview(buffer).cast("B")
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._in.data or self._in.read_paused:
            if self._in.closed:
                raise PeerDisconnected(f"test: stream from {self.remote_address} closed")
            await self._in.changed.park()
        n = min(view.nbytes, len(self._in.data))
        view[:n] = self._in.data[:n]
        del self._in.data[:n]
        self._in.wake()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return n

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.abort()
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        for pipe in (self._out, self._in):
            pipe.closed = True
            pipe.wake()


def window_ring(world: int, window: int, lanes: int = 1) -> tuple[list[RingLinks], list[list[WindowStream]],
                                                                  list[list[_Pipe]]]:
    """Links for a ring of ``world`` peers over window streams; also each peer's sending streams
    and sending pipes (lane order)."""
    out: list[list[FramedConnection]] = [[] for _ in range(world)]
    inc: list[list[FramedConnection]] = [[] for _ in range(world)]
    streams: list[list[WindowStream]] = [[] for _ in range(world)]
    pipes: list[list[_Pipe]] = [[] for _ in range(world)]
    for r in range(world):
        nxt = (r + 1) % world
        for lane in range(lanes):
            forward, backward = _Pipe(window), _Pipe(window)
            sa = WindowStream(forward, backward, f"peer{nxt}.{lane}")
            sb = WindowStream(backward, forward, f"peer{r}.{lane}")
            streams[r].append(sa)
            pipes[r].append(forward)
            out[r].append(FramedConnection(sa, role=HandshakeRole.CLIENT, config=CONFIG))
            inc[nxt].append(FramedConnection(sb, role=HandshakeRole.SERVER, config=CONFIG))
    links = [RingLinks(out[r], inc[r]) for r in range(world)]
    assert not any(link.threaded for link in links)  # the Trio path
    return links, streams, pipes


def inputs_for(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-1000, 1000, n).astype(np.float32) for _ in range(world)]


async def all_reduce_all(links: Sequence[RingLinks], inputs: Sequence[np.ndarray], *, op: ReduceOp = ReduceOp.SUM,
                         quantization: Quantization | None = None, max_subchunk_bytes: int = 1 << 16,
                         seq: int = 1) -> list[np.ndarray]:
    world = len(inputs)
    outputs = [x.copy() for x in inputs]

    async def peer(r: int) -> None:
        await ring_all_reduce(outputs[r], None, op=op, links=links[r], rank=r, world=world, seq=seq,
                              quantization=quantization, max_subchunk_bytes=max_subchunk_bytes,
                              exchange_max_bytes=0)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for r in range(world):
                nursery.start_soon(peer, r)
    return outputs


class _TaskCounter(trio.abc.Instrument):
    def __init__(self) -> None:
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned += 1


@pytest.mark.parametrize("lanes", [1, 3])
async def test_an_op_whose_sends_fit_runs_in_the_calling_task_alone(lanes: int) -> None:
    """Every frame fits the send window: no task is spawned for the op on any peer (the path
    with a receiver, a processor and a sender task per lane spawned 3 x lanes per peer)."""
    world, n = 4, 4 * 3 * (1 << 14)  # 3 frames of 64 KiB per chunk: every lane carries frames
    links, streams, _ = window_ring(world, window=1 << 20, lanes=lanes)
    inputs = inputs_for(world, n, seed=1)
    counter = _TaskCounter()
    outputs = [x.copy() for x in inputs]

    async def peer(r: int) -> None:
        await ring_all_reduce(outputs[r], None, op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=1,
                              max_subchunk_bytes=1 << 16, exchange_max_bytes=0)

    trio.lowlevel.add_instrument(counter)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for r in range(world):
                    nursery.start_soon(peer, r)
    finally:
        trio.lowlevel.remove_instrument(counter)
    expected = ring_reference(inputs, ReduceOp.SUM)
    for out in outputs:
        assert np.array_equal(out.view(np.uint8), expected.view(np.uint8))
    assert counter.spawned == world  # the peers' own tasks, nothing else
    assert all(s.nowait_calls > 0 for peer_streams in streams for s in peer_streams)


@pytest.mark.parametrize("window", [1000, 30_000, 100_000])
@pytest.mark.parametrize("quantized", [False, True])
async def test_frames_the_window_takes_in_part_or_not_at_all_go_out_whole_and_in_order(
        window: int, quantized: bool) -> None:
    """Windows smaller than a frame: frames go out in part (the rest from the lane's sender
    task) or wait whole for it, interleaved with frames that fit; every result is still exact
    and bit-identical, quantized too."""
    world, n = 3, 3 * 2 * (1 << 14)  # 2 frames of 64 KiB per chunk, one per lane
    links, streams, _ = window_ring(world, window=window, lanes=2)
    inputs = inputs_for(world, n, seed=window)
    quant = Quantization(dtype=np.dtype(np.uint8)) if quantized else None
    outputs = await all_reduce_all(links, inputs, quantization=quant)
    for out in outputs[1:]:
        assert np.array_equal(out.view(np.uint8), outputs[0].view(np.uint8))
    if not quantized:
        expected = ring_reference(inputs, ReduceOp.SUM)
        assert np.array_equal(outputs[0].view(np.uint8), expected.view(np.uint8))
    if window == 1000:  # smaller than any frame
        assert sum(s.nowait_partial for peer_streams in streams for s in peer_streams) > 0
    # The lanes are left clean: another op runs on them.
    again = await all_reduce_all(links, inputs, seq=2)
    assert np.array_equal(again[0].view(np.uint8), ring_reference(inputs, ReduceOp.SUM).view(np.uint8))


async def test_cancelled_with_the_rest_of_a_frame_unsent_tears_that_lane_and_restores_the_input() -> None:
    """Peer 0's successor stops reading: peer 0's first frame is taken in part and its rest waits
    in the connection.  Cancelling peer 0 then aborts that connection (the rest would be read
    from a buffer the op gives back) and restores its input; nothing of the op runs after."""
    world, n = 3, 6000
    links, _, pipes = window_ring(world, window=1000)  # one 8 KB frame per chunk
    pipes[0][0].read_paused = True  # peer 1 never reads what peer 0 sends
    inputs = inputs_for(world, n, seed=7)
    x = inputs[0].copy()
    sending = links[0].to_next[0]
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: ring_all_reduce(x, None, op=ReduceOp.SUM, links=links[0], rank=0, world=world,
                                                       seq=1, exchange_max_bytes=0))
            await trio.testing.wait_all_tasks_blocked()
            assert sending.needs_flush  # 1000 bytes of the frame are in the window, the rest waits
            scope.cancel()
    assert np.array_equal(x.view(np.uint8), inputs[0].view(np.uint8))
    assert sending.broken and not sending.needs_flush
    assert pipes[0][0].closed
    with pytest.raises(StreamClosed, match="abandoned"):
        await sending.send_data(DataHeader(op_seq=2, stream=0, step=0, offset=0, nbytes=1), b"x")


async def test_a_rest_left_by_another_op_is_sent_first_and_not_torn_by_this_one() -> None:
    """The connection's unsent rest belongs to whoever began the frame: an op that ends does not
    tear a rest it does not own, and its own frames go out after it."""
    links, streams, pipes = window_ring(2, window=10)
    connection = links[0].to_next[0]
    owner = object()
    header = DataHeader(op_seq=9, stream=0, step=0, offset=0, nbytes=100)
    assert connection.send_data_nowait(header, bytes(range(100)), owner=owner)
    assert connection.needs_flush
    assert not connection.tear_unsent(object())
    assert connection.needs_flush and not connection.broken
    receiving = links[1].inboxes[0].connection

    async def read() -> tuple[DataHeader, bytes]:
        got = await receiving.receive_data_header()
        buf = bytearray(got.nbytes)
        await receiving.receive_data_into(buf)
        return got, bytes(buf)

    async with trio.open_nursery() as nursery:
        results: list[tuple[DataHeader, bytes]] = []

        async def reader() -> None:
            results.append(await read())
            results.append(await read())

        nursery.start_soon(reader)
        await connection.send_data(DataHeader(op_seq=10, stream=0, step=0, offset=0, nbytes=3), b"abc")
    assert results[0] == (header, bytes(range(100)))
    assert results[1][1] == b"abc"
    assert not connection.needs_flush
    assert connection.tear_unsent(owner) is False  # nothing left to tear
