"""FramedConnection.send_nowait: control messages written without a trip through the run loop.

The master and the peers use it for every vote; these tests cut the kernel's acceptance short
(a frame only partly written) and check that the rest goes out first, in order, on real TCP.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl.config import Config
from pccl.net import tcp
from pccl.protocol import messages as m

from tcp_pairs import framed_tcp_pair

CONFIG = Config()


async def _pair() -> tuple[Any, Any]:
    return await framed_tcp_pair(CONFIG)


def _cut_short(monkeypatch: pytest.MonkeyPatch, taken: int) -> None:
    real = tcp.TcpStream.send_nowait
    monkeypatch.setattr(tcp.TcpStream, "send_nowait", lambda self, data: real(self, memoryview(data)[:taken]))


async def test_whole_frames_go_out_at_once_and_count() -> None:
    a, b = await _pair()
    try:
        msgs = [m.CollectiveInit(t, 10, 1, 0) for t in range(5)]
        assert all(a.send_nowait(x) for x in msgs) and not a.needs_flush
        with trio.fail_after(5):
            assert [await b.receive() for _ in msgs] == msgs
        assert a.statistics().frames_sent >= 5
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_partly_written_frame_is_finished_first(monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = await _pair()
    try:
        _cut_short(monkeypatch, 3)
        first, second, third = m.CollectiveInit(1, 10, 1, 0), m.CollectiveDone(1, 7), m.VotePeersPending()
        assert a.send_nowait(first) and a.needs_flush
        assert not a.send_nowait(second)  # nothing may overtake the unfinished frame
        await a.send(second)  # sends the rest of the first frame, then this one
        assert not a.needs_flush
        assert a.send_nowait(third) and a.needs_flush
        await a.flush()
        assert not a.needs_flush
        with trio.fail_after(5):
            assert [await b.receive() for _ in range(3)] == [first, second, third]
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_busy_or_broken_connection_refuses() -> None:
    a, b = await _pair()
    try:
        async with a.send_lock:  # another task is sending
            assert not a.send_nowait(m.VotePeersPending())
        a.abort()
        assert not a.send_nowait(m.VotePeersPending())
    finally:
        await a.aclose()
        await b.aclose()


async def test_master_and_peers_survive_partly_written_votes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every control frame cut after 5 bytes: the master's queue and the peers' votes finish
    the frames (``Flush`` in the master's outbox, ``flush`` on the peers) and stay in order."""
    _cut_short(monkeypatch, 5)
    async with pccl.open_master("127.0.0.1:0") as master, pccl.open_communicator(master.address) as c1:
        comms = [c1]
        done = trio.Event()

        async def second() -> None:
            async with pccl.open_communicator(master.address) as c2:
                comms.append(c2)
                await done.wait()

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(second)
                while master.statistics().registered_peers == 0:
                    await trio.sleep(0.005)
                await c1.update_topology()  # accepts the second peer
                while len(comms) < 2:
                    await trio.sleep(0.005)
                bufs = [np.full(1000, 1, np.float32), np.full(1000, 2, np.float32)]
                for _ in range(5):
                    bufs[0][:], bufs[1][:] = 1, 2
                    async with trio.open_nursery() as ops:
                        for c, x in zip(comms, bufs):
                            ops.start_soon(lambda c=c, x=x: c.all_reduce(x, tag=3))
                    assert np.array_equal(bufs[0], np.full(1000, 3, np.float32))
                    assert np.array_equal(bufs[1], bufs[0])
                done.set()
