"""The thread-side fast path of the ring all-reduce on real TCP (pccl.collectives.threaded).

Covers what the Trio path's tests cannot: that TCP lanes run in threads (and in-memory streams do
not), that a thread waiting for a frame is cancelled without tearing the lane, that a thread
blocked mid-transfer is stopped by aborting its connection (and the in-place input is restored,
with no thread left running), and the blocking frame channel itself.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives import KernelRunner, RingLinks, ring_all_reduce
from pccl.collectives.ring_op import RingOp
from pccl.collectives.buffers import OpBuffers, ReduceArgs
from pccl.collectives.inline import suits_inline
from pccl.collectives.links import Inbox, SeqRegistry
from pccl.config import Config
from pccl.errors import StreamClosed
from pccl.net.thread_io import Interrupted, ThreadCancel
from pccl.protocol.codec import DataHeader
from pccl.protocol.ring import DEFAULT_SUBCHUNK_BYTES
from pccl.types import ReduceOp

from tcp_pairs import framed_tcp_pair

CONFIG = Config()


async def tcp_pair() -> tuple[RingLinks, RingLinks]:
    """Two peers, one lane each way (with two peers each connection carries both directions)."""
    dialed, accepted = await framed_tcp_pair(CONFIG)
    return RingLinks([dialed], [dialed]), RingLinks([accepted], [accepted])


async def both(a: RingLinks, b: RingLinks, bufs: list[np.ndarray], seq: int) -> None:
    async with trio.open_nursery() as nursery:
        for rank, links in enumerate((a, b)):
            nursery.start_soon(
                lambda rank=rank, links=links: ring_all_reduce(
                    bufs[rank], op=ReduceOp.SUM, links=links, rank=rank, world=2, seq=seq
                )
            )


async def test_tcp_links_run_in_threads_and_reduce_correctly() -> None:
    a, b = await tcp_pair()
    try:
        assert a.threaded and b.threaded
        inputs = [np.arange(300_001, dtype=np.float32) * (r + 1) for r in range(2)]
        bufs = [x.copy() for x in inputs]
        with trio.fail_after(20):
            await both(a, b, bufs, seq=1)
        assert np.array_equal(bufs[0], inputs[0] + inputs[1])
        assert np.array_equal(bufs[1], bufs[0])
    finally:
        await a.aclose()
        await b.aclose()


async def test_cancel_while_waiting_for_a_frame_keeps_the_lane() -> None:
    a, b = await tcp_pair()
    try:
        data = np.ones(50_000, np.float32)
        original = data.copy()
        # Peer b never runs seq 1: a's receiver thread waits for a frame that never comes.
        with trio.move_on_after(0.3) as scope:
            await ring_all_reduce(data, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1)
        assert scope.cancelled_caught
        assert np.array_equal(data, original)  # restored (a had reduced its own half partly)
        b.retire(1)  # what the communicator does for a seq it never ran: its frames are discarded
        assert not a.to_next[0].broken
        bufs = [np.full(50_000, 2, np.float32), np.full(50_000, 3, np.float32)]
        with trio.fail_after(20):
            await both(a, b, bufs, seq=2)  # the same lanes still work
        assert np.array_equal(bufs[0], np.full(50_000, 5, np.float32))
    finally:
        await a.aclose()
        await b.aclose()


def test_cancel_mid_transfer_aborts_the_lane_and_restores_the_input() -> None:
    async def main() -> None:
        a, b = await tcp_pair()
        try:
            data = np.random.default_rng(0).standard_normal(16 << 20, dtype=np.float32)  # 64 MiB
            original = data.copy()
            # b never reads: a's sender blocks in sendall once the socket buffers are full.
            with trio.move_on_after(0.5) as scope:
                await ring_all_reduce(data, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1)
            assert scope.cancelled_caught
            assert np.array_equal(data, original)
            with pytest.raises(StreamClosed):
                await a.to_next[0].send_data(DataHeader(op_seq=9, stream=0, step=0, offset=0, nbytes=1), b"x")
        finally:
            await a.aclose()
            await b.aclose()

    trio.run(main)
    # Every lane thread has returned (idle thread-cache workers of earlier tests may linger or
    # retire meanwhile, so the total thread count proves nothing either way).
    assert not [t for t in threading.enumerate() if t.name == "pccl-ring-lane"]


async def test_blocking_channel_frames_and_interrupted_wait() -> None:
    a, b = await tcp_pair()
    try:
        sender = a.send_channels[0] if a.send_channels else None
        receiver = b.inboxes[0].channel
        assert sender is not None and receiver is not None
        cancel = ThreadCancel()
        payload = np.arange(100_000, dtype=np.uint8)

        def send() -> None:
            sender.send_data(DataHeader(op_seq=7, stream=1, step=0, offset=0, nbytes=payload.nbytes),
                             memoryview(payload), cancel)

        def receive() -> tuple[DataHeader, bytearray]:
            header = receiver.receive_data_header(cancel)
            out = bytearray(header.nbytes)
            receiver.receive_data_into(memoryview(out), cancel)
            return header, out

        await trio.to_thread.run_sync(send)
        header, out = await trio.to_thread.run_sync(receive)
        assert (header.op_seq, header.stream, header.nbytes) == (7, 1, payload.nbytes)
        assert bytes(out) == payload.tobytes()

        # Nothing is coming: a cancel wakes the waiting thread without consuming anything.
        waiting = trio.Event()

        async def cancel_soon() -> None:
            await trio.sleep(0.1)
            cancel.cancel()
            waiting.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_soon)
            with pytest.raises(Interrupted):
                await trio.to_thread.run_sync(lambda: receiver.receive_data_header(cancel))
        cancel.close()
        assert not b.inboxes[0].connection.broken
    finally:
        await a.aclose()
        await b.aclose()


async def test_concurrent_ops_share_threaded_lanes_and_late_frames_are_discarded() -> None:
    a, b = await tcp_pair()
    try:
        # Eight ops at once on the same lanes, started in opposite orders on the two peers, so
        # the receivers keep finding each other's frames first (parked for their owner).
        sizes = [1, 3, 1025, 70_000, 200_000, 5, 300_000, 4096]
        inputs = [[np.arange(n, dtype=np.float32) + 7 * (r + 1) for n in sizes] for r in range(2)]
        bufs = [[x.copy() for x in row] for row in inputs]

        async def peer(rank: int, links: RingLinks) -> None:
            order = range(len(sizes)) if rank == 0 else reversed(range(len(sizes)))
            async with trio.open_nursery() as nursery:
                for i in order:
                    nursery.start_soon(
                        lambda i=i: ring_all_reduce(
                            bufs[rank][i], op=ReduceOp.SUM, links=links, rank=rank, world=2, seq=100 + i
                        )
                    )

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer, 0, a)
                nursery.start_soon(peer, 1, b)
        for i in range(len(sizes)):
            assert np.array_equal(bufs[0][i], inputs[0][i] + inputs[1][i])
            assert np.array_equal(bufs[1][i], bufs[0][i])

        # Frames of an op that ended on the receiver (seq 5: only b runs it, a retired it) are
        # discarded by a's next op instead of being taken for its own.
        a.retire(5)
        lone = np.ones(100_000, np.float32)
        with trio.move_on_after(0.3):
            await ring_all_reduce(lone, op=ReduceOp.SUM, links=b, rank=1, world=2, seq=5)
        assert not b.to_next[0].broken  # b only waited for a's frames: the lane is intact
        after = [np.full(100_000, 2, np.float32), np.full(100_000, 3, np.float32)]
        with trio.fail_after(20):
            await both(a, b, after, seq=6)  # a first reads (and drops) b's seq-5 frame
        assert np.array_equal(after[0], np.full(100_000, 5, np.float32))
        assert np.array_equal(after[1], after[0])
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("taken", [0, 7])
async def test_small_ops_finish_sends_in_a_worker_when_the_socket_takes_too_little(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> None:
    """The inline path (pccl.collectives.inline) offers each frame to the socket without
    blocking; what is not taken (all of it, or all but a few bytes: a frame cut in two) is
    finished by a worker thread, and the lane's later frames queue behind it in order."""
    from pccl.collectives import inline
    from pccl.net import tcp

    real = tcp.TcpBlockingIO.send_nowait
    monkeypatch.setattr(tcp.TcpBlockingIO, "send_nowait",
                        lambda self, data: real(self, data[:taken]) if taken else 0)
    started = []
    real_start = trio.lowlevel.start_thread_soon
    monkeypatch.setattr(inline.trio.lowlevel, "start_thread_soon",
                        lambda *a, **k: (started.append(k.get("name")), real_start(*a, **k))[1])
    a, b = await tcp_pair()
    try:
        for n, lanes_frames in ((4096, 2), (40_000, 2)):  # 16 KiB and 160 KiB: one frame per step
            inputs = [np.arange(n, dtype=np.float32) * (r + 2) for r in range(2)]
            bufs = [x.copy() for x in inputs]
            with trio.fail_after(20):
                await both(a, b, bufs, seq=n)
            assert np.array_equal(bufs[0], inputs[0] + inputs[1]) and np.array_equal(bufs[1], bufs[0])
        assert started and set(started) == {"pccl-ring-send"}
        assert not a.to_next[0].broken and not b.to_next[0].broken
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("when", ["before the receive", "during the receive"])
async def test_a_small_op_whose_queued_send_fails_stops_waiting_for_its_frame(
    monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A frame the socket did not take goes to a send worker; when that send fails (at once, or
    while the op already waits for its neighbour's frame, which never comes: the neighbour runs
    no op), the op stops waiting, raises the send's error and restores its input."""
    from pccl.net import tcp

    release = threading.Event()
    monkeypatch.setattr(tcp.TcpBlockingIO, "send_nowait", lambda self, data: 0)

    def failing_send_all(self: Any, data: memoryview) -> None:
        if when == "during the receive":
            release.wait(10)
        raise StreamClosed("the send worker's socket broke")

    monkeypatch.setattr(tcp.TcpBlockingIO, "send_all", failing_send_all)
    a, b = await tcp_pair()
    try:
        x = np.arange(4096, dtype=np.float32)
        # Without the worker's error the op would wait for the frame until cancelled (and then
        # raise the send's error all the same): the deadline must not be what ended it.
        with trio.move_on_after(3) as deadline:
            async with trio.open_nursery() as nursery:
                if when == "during the receive":
                    async def fail_later() -> None:
                        await trio.sleep(0.2)  # the op is waiting for b's frame by then
                        release.set()

                    nursery.start_soon(fail_later)
                with pytest.raises(StreamClosed, match="send worker"):
                    await ring_all_reduce(x, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1)
        assert not deadline.cancel_called
        assert np.array_equal(x, np.arange(4096, dtype=np.float32))
    finally:
        release.set()
        await a.aclose()
        await b.aclose()


def test_cancelling_a_small_op_stops_its_send_worker_and_restores_the_input(monkeypatch: pytest.MonkeyPatch) -> None:
    from pccl.net import tcp

    stuck = threading.Event()
    sending: list[int] = []  # one entry per send worker still inside its send
    monkeypatch.setattr(tcp.TcpBlockingIO, "send_nowait", lambda self, data: 0)

    def wedged_send_all(self: Any, data: memoryview) -> None:
        sending.append(1)
        try:
            stuck.set()
            while not self.stream.closed:  # until the op's cancellation aborts the connection
                time.sleep(0.005)
            raise StreamClosed("aborted")
        finally:
            sending.pop()

    monkeypatch.setattr(tcp.TcpBlockingIO, "send_all", wedged_send_all)

    async def main() -> None:
        a, b = await tcp_pair()
        try:
            x = np.arange(4096, dtype=np.float32)
            with trio.move_on_after(5) as scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(lambda: ring_all_reduce(x, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1))
                    await trio.to_thread.run_sync(stuck.wait)
                    nursery.cancel_scope.cancel()
            assert not scope.cancelled_caught  # the op returned promptly once cancelled
            assert np.array_equal(x, np.arange(4096, dtype=np.float32))
            assert a.to_next[0].broken  # the frame was torn: the lane is dead
            # The send worker has left its send: nothing touches x after the op returned.  (Not
            # the thread count: Trio keeps idle worker threads cached for seconds, so that count
            # depended on which tests ran before in the process.)
            assert sending == []
        finally:
            await a.aclose()
            await b.aclose()

    trio.run(main)


def test_cancelling_a_small_op_whose_send_waits_for_another_ops_lock_returns_promptly() -> None:
    """A frame that must wait for the lane's send lock (another op's sender thread holds it for a
    long transfer) is sent by a worker; cancelling the op stops that wait, not only transfers."""

    async def main() -> None:
        a, b = await tcp_pair()
        try:
            channel = a.send_channels[0]
            x = np.arange(4096, dtype=np.float32)
            channel.send_lock.acquire()  # as if a large op's sender were mid-frame
            try:
                with trio.fail_after(5):
                    with trio.move_on_after(0.3) as scope:
                        await ring_all_reduce(x, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1)
                assert scope.cancelled_caught
            finally:
                channel.send_lock.release()
            assert np.array_equal(x, np.arange(4096, dtype=np.float32))
            assert not a.to_next[0].broken  # nothing was written: the lane is intact
        finally:
            await a.aclose()
            await b.aclose()

    trio.run(main)


async def test_a_small_op_that_cannot_get_a_send_thread_gives_the_lane_lock_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame the socket took only partly, and no thread to finish it: the op fails with the
    thread error, the frame counts as torn (lane aborted), and the send lock is free again."""
    from pccl.collectives import inline
    from pccl.net import tcp

    real = tcp.TcpBlockingIO.send_nowait
    monkeypatch.setattr(tcp.TcpBlockingIO, "send_nowait", lambda self, data: real(self, data[:7]))

    def no_thread(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(inline.trio.lowlevel, "start_thread_soon", no_thread)
    a, b = await tcp_pair()
    try:
        x = np.arange(4096, dtype=np.float32)
        with pytest.raises(RuntimeError, match="new thread"):
            await ring_all_reduce(x, op=ReduceOp.SUM, links=a, rank=0, world=2, seq=1)
        assert np.array_equal(x, np.arange(4096, dtype=np.float32))
        assert a.to_next[0].broken
        channel = a.send_channels[0]
        assert channel.send_lock.acquire(blocking=False)
        channel.send_lock.release()
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda d: np.dtype(d).name)
async def test_small_two_peer_ops_on_tcp_run_inline(dtype: Any) -> None:
    # Frames of at most 64 KiB of what actually travels: 16-bit exchange frames are not sized as
    # f32 partial sums (which sent 32-64 KiB f16 ops to the lane threads).
    a, b = await tcp_pair()
    try:
        n = 32_768
        bufs = OpBuffers.for_args(ReduceArgs.check(np.ones(n, dtype), np.zeros(n, dtype), ReduceOp.SUM, None))
        op = RingOp(bufs, links=a, rank=0, world=2, seq=1, backup=None, runner=KernelRunner(),
                     max_subchunk_bytes=DEFAULT_SUBCHUNK_BYTES)
        assert op.exchange and op.max_reduce_scatter_nbytes == 64 * 1024  # one 64 KiB sub-chunk
        assert suits_inline(op)
        bufs.release()
    finally:
        await a.aclose()
        await b.aclose()


@pytest.mark.parametrize("path", ["trio", "thread"])
@pytest.mark.parametrize("moment", ["payload", "discard"])
async def test_a_cancel_after_a_frames_header_keeps_the_lane(path: str, moment: str) -> None:
    # An op is cancelled right after a frame's header was read: at the start of its own payload
    # ("payload": op 1 reads its frame), or while discarding a late frame of an op that ended
    # ("discard": op 2's reader meets op 1's frame, between two discard chunks on the thread
    # path).  The rest of that frame must still be discarded later, not left unread: the next
    # op's frame arrives intact on the same lane.
    dialed, accepted = await framed_tcp_pair(CONFIG)
    try:
        registry = SeqRegistry()
        inbox = Inbox(accepted, registry)
        nbytes = 3 << 20  # more than the read buffer and several discard chunks
        first, good = np.full(nbytes, 1, np.uint8), np.arange(nbytes, dtype=np.uint64).astype(np.uint8)
        destination = bytearray(nbytes)
        reader = 1 if moment == "payload" else 2
        if moment == "discard":
            registry.retire(1)  # op 1 ended here: its frame is late
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                await dialed.send_data(DataHeader(op_seq=1, stream=0, step=0, offset=0, nbytes=nbytes), first)
                await dialed.send_data(DataHeader(op_seq=3, stream=0, step=0, offset=0, nbytes=nbytes), good)

            nursery.start_soon(send)
            if path == "trio":
                scope = trio.CancelScope()
                real = accepted.receive_data_into

                async def cancelled_first(buffer: Any, **kwargs: Any) -> None:
                    scope.cancel()
                    await real(buffer, **kwargs)

                accepted.receive_data_into = cancelled_first  # type: ignore[method-assign]
                with scope:
                    await inbox.receive_into(seq=reader, stream=0, step=0, offset=0,
                                             destination=memoryview(destination))
                del accepted.receive_data_into
                assert scope.cancelled_caught
            else:
                cancel = ThreadCancel()
                channel = inbox.channel
                assert channel is not None
                real_blocking = channel.receive_data_into
                calls = [0]
                interrupt_at = 1 if moment == "payload" else 2  # no transfer registered then

                def interrupted(buffer: Any, c: ThreadCancel) -> None:
                    calls[0] += 1
                    if calls[0] == interrupt_at:
                        cancel.cancel()
                    real_blocking(buffer, c)

                channel.receive_data_into = interrupted  # type: ignore[method-assign]
                with pytest.raises(Interrupted):
                    await trio.to_thread.run_sync(lambda: inbox.receive_blocking(
                        seq=reader, stream=0, step=0, offset=0, destination=memoryview(destination), cancel=cancel))
                del channel.receive_data_into
                cancel.close()
            assert not accepted.broken
            registry.retire(reader)  # the cancelled op ended: frames of seqs 1 and 2 are late now
            with trio.fail_after(10):
                got = await inbox.receive_into(seq=3, stream=0, step=0, offset=0, destination=memoryview(destination))
        assert got == nbytes and bytes(destination) == good.tobytes()
    finally:
        await dialed.aclose()
        await accepted.aclose()


class _Reschedules(trio.abc.Instrument):
    """Counts how often tasks are scheduled to run (every wake-up of a waiting task)."""

    def __init__(self) -> None:
        self.count = 0

    def task_scheduled(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def test_readers_waiting_on_a_lane_are_woken_only_when_their_frame_is_next() -> None:
    # 200 ops wait on one lane and their frames arrive in reverse order: each frame must wake
    # its owner, not every waiting reader (which cost quadratic time with thousands of tags).
    dialed, accepted = await framed_tcp_pair(CONFIG)
    readers = 200
    try:
        inbox = Inbox(accepted, SeqRegistry())
        got: dict[int, bytes] = {}

        async def read(seq: int) -> None:
            destination = bytearray(8)
            await inbox.receive_into(seq=seq, stream=0, step=0, offset=0, destination=memoryview(destination))
            got[seq] = bytes(destination)

        counter = _Reschedules()
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for seq in range(1, readers + 1):
                    nursery.start_soon(read, seq)
                await trio.testing.wait_all_tasks_blocked()
                trio.lowlevel.add_instrument(counter)
                try:
                    for seq in range(readers, 0, -1):
                        await dialed.send_data(DataHeader(op_seq=seq, stream=0, step=0, offset=0, nbytes=8),
                                               seq.to_bytes(8, "little"))
                    while len(got) < readers:
                        await trio.sleep(0.01)
                finally:
                    trio.lowlevel.remove_instrument(counter)
        assert got == {seq: seq.to_bytes(8, "little") for seq in range(1, readers + 1)}
        # Waking every waiter at every frame makes ~readers**2 / 2 (20,000) wake-ups.
        assert counter.count < 20 * readers, counter.count
    finally:
        await dialed.aclose()
        await accepted.aclose()


async def test_concurrent_small_ops_share_one_send_thread_per_lane() -> None:
    # 300 small (inline) all-reduces at once on one lane each way, their frames more than the
    # sockets take at once: the sends left over wait in the lane's one queue, drained by one
    # worker thread per lane, instead of a thread per op queuing on the lane's send lock.
    a, b = await tcp_pair()
    ops, count = 300, 16384  # 64 KiB each
    alive: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            alive.append(sum(t.name == "pccl-ring-send" for t in threading.enumerate()))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        inputs = [[np.full(count, seq + r, np.float32) for r in range(2)] for seq in range(ops)]
        bufs = [[x.copy() for x in row] for row in inputs]
        watcher.start()
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for seq in range(ops):
                    nursery.start_soon(both, a, b, bufs[seq], seq + 1)
        for seq in range(ops):
            assert all(np.array_equal(buf, inputs[seq][0] + inputs[seq][1]) for buf in bufs[seq])
        assert 0 < max(alive) <= 2, max(alive)  # one lane per peer
    finally:
        stop.set()
        watcher.join()
        await a.aclose()
        await b.aclose()
