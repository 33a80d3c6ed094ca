"""How a large op's lanes start on the worker threads (pccl.collectives.threaded).

On a shaped link whose bucket of tokens is full when an op starts, every millisecond the link
idles then is lost; on a loaded host the op's threads take milliseconds to start and a receiver
that first copies a whole frame into its input backup takes milliseconds more.  So: a lane's
first frame, when it needs nothing received, is begun on the Trio thread before the threads
start (:meth:`BlockingDataChannel.begin_data`, finished by the sender thread); the first frame
a lane receives in place is saved a piece at a time, right before each piece lands, while
the lane's sender saves the other slices ahead, whole.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import trio

from pccl import kernels as K
from pccl.collectives import InputGuard, ReduceArgs, broadcast_checked
from pccl.collectives.threaded import LaneThreads
from pccl.errors import PCCLError
from pccl.net.framed_threads import RECEIVE_PIECE
from pccl.net.tcp_stream import TcpBlockingIO
from pccl.net.thread_io import ThreadCancel
from pccl.protocol.codec import DataHeader
from pccl.types import ReduceOp

from test_allreduce_ring import make_inputs, tcp_ring
from test_threaded_lanes import tcp_pair

FRAME = 1 << 20  # the broadcasts' frames here (max_subchunk_bytes)


async def test_begin_data_writes_what_the_socket_takes_and_the_tail_finishes_the_frame() -> None:
    a, b = await tcp_pair()
    try:
        sender, receiver = a.send_channels[0] if a.send_channels else None, b.inboxes[0].channel
        assert sender is not None and receiver is not None
        cancel = ThreadCancel()
        payload = np.random.default_rng(3).integers(0, 256, 8 * FRAME, dtype=np.uint8)
        header = DataHeader(op_seq=5, stream=0, step=0, offset=0, nbytes=payload.nbytes)
        tail = sender.begin_data(header, memoryview(payload), cancel)  # on the Trio thread: never blocks
        assert tail is not None and 0 < tail.sent < payload.nbytes  # 8 MiB, nobody reading yet
        assert sender.sending  # the lock stays held for the rest
        assert sender.begin_data(header, memoryview(payload), cancel) is None  # another frame waits its turn
        out = np.zeros_like(payload)

        def receive() -> None:
            assert receiver.receive_data_header(cancel) == header
            receiver.receive_data_into(memoryview(out), cancel)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, tail)
            await trio.to_thread.run_sync(receive)
        assert np.array_equal(out, payload) and not sender.sending
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_begun_frame_given_up_tears_the_connection() -> None:
    a, b = await tcp_pair()
    try:
        sender = a.send_channels[0] if a.send_channels else None
        assert sender is not None
        cancel = ThreadCancel()
        payload = np.ones(16 * FRAME, np.uint8)
        tail = sender.begin_data(DataHeader(op_seq=5, stream=0, step=0, offset=0, nbytes=payload.nbytes),
                                 memoryview(payload), cancel)
        assert tail is not None and 0 < tail.sent < payload.nbytes
        tail.abandon()
        assert not sender.sending
        with pytest.raises(PCCLError):  # the peer would take what follows for a header
            sender.send_data(DataHeader(op_seq=6, stream=0, step=0, offset=0, nbytes=4), memoryview(b"abcd"), cancel)
    finally:
        await a.aclose()
        await b.aclose()


async def _broadcast(world: int, xs: list[np.ndarray]) -> list[InputGuard]:
    """Broadcast ``xs[0]`` into every ``xs[r]`` in place, on TCP lanes (the worker threads)."""
    guards = [InputGuard(ReduceArgs.check(x, None, ReduceOp.SUM, None)) for x in xs]
    links = await tcp_ring(world, lanes=1)
    try:
        async def peer(r: int) -> None:
            await broadcast_checked(guards[r].args, root=0, links=links[r], rank=r, world=world, seq=1,
                                    backup=guards[r].backup, max_subchunk_bytes=FRAME)

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for r in range(world):
                    nursery.start_soon(peer, r)
    finally:
        for link in links:
            await link.aclose()
    return guards


async def test_the_roots_first_frame_goes_out_before_its_lane_threads_start(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, bool, int]] = []
    real_nowait, real_loop = TcpBlockingIO.send_nowait, LaneThreads._send_loop

    def send_nowait(self: TcpBlockingIO, data: memoryview) -> int:
        n = real_nowait(self, data)
        events.append(("nowait", threading.current_thread() is threading.main_thread(), n))
        return n

    def send_loop(self: LaneThreads, lane: int, *args: Any) -> None:
        if self.op.schedule.send_frames(lane, self.op.lanes):  # the root (the last peer sends nothing)
            events.append(("root sender thread", False, 0))
        real_loop(self, lane, *args)

    monkeypatch.setattr(TcpBlockingIO, "send_nowait", send_nowait)
    monkeypatch.setattr(LaneThreads, "_send_loop", send_loop)
    inputs = make_inputs(2, 2 * FRAME, np.float32, ReduceOp.SUM, seed=4)  # 8 MiB: 8 frames of 1 MiB
    xs = [x.copy() for x in inputs]
    await _broadcast(2, xs)
    assert np.array_equal(xs[1], inputs[0])
    started = events.index(("root sender thread", False, 0))
    assert any(name == "nowait" and on_trio and n > 0 for name, on_trio, n in events[:started]), events[:started + 1]


async def test_the_first_frame_received_in_place_is_saved_piece_by_piece_the_rest_whole(
        monkeypatch: pytest.MonkeyPatch) -> None:
    world = 3
    inputs = make_inputs(world, 6 * FRAME // 4, np.float32, ReduceOp.SUM, seed=11)  # 6 frames of 1 MiB
    xs = [x.copy() for x in inputs]
    base = {r: xs[r].__array_interface__["data"][0] for r in range(1, world)}  # the receivers' buffers
    copies: dict[int, list[tuple[int, int]]] = {r: [] for r in range(1, world)}
    real = K.save_copy
    lock = threading.Lock()

    def recorded(dst: np.ndarray, src: np.ndarray) -> None:
        at = src.__array_interface__["data"][0]
        with lock:
            for r, start in base.items():
                if start <= at < start + xs[r].nbytes:
                    copies[r].append((at - start, src.nbytes))
        real(dst, src)

    monkeypatch.setattr(K, "save_copy", recorded)
    guards = await _broadcast(world, xs)
    for r in range(1, world):
        assert np.array_equal(xs[r], inputs[0])
        first = sorted((at, n) for at, n in copies[r] if at < FRAME)
        assert len(first) >= FRAME // RECEIVE_PIECE and all(n <= RECEIVE_PIECE for _, n in first), first
        assert sum(n for _, n in first) == FRAME and first[0][0] == 0
        assert sorted((at, n) for at, n in copies[r] if at >= FRAME) == [(k * FRAME, FRAME) for k in range(1, 6)]
        guards[r].restore()
        assert np.array_equal(xs[r], inputs[r])
