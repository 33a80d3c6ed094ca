"""Frames of a begun op this peer has not begun yet (fast commit): an inbox keeps them in memory
only up to its bound (``Inbox.kept_limit``), parks the rest at the head of the lane (TCP then
holds the sender back), and drops what it keeps when the links are replaced or closed
(docs/protocol.rst, "Frames for an op a neighbour has not begun yet")."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl.collectives.links import KEPT_BYTES_LIMIT, Inbox, RingLinks, SeqRegistry
from pccl.net.framed import FramedConnection
from pccl.net.thread_io import ThreadCancel
from pccl.protocol.codec import DataHeader

from tcp_pairs import framed_tcp_pair

BEGUN = (1 << 63) | 12345  # a begun op's derived seq, not known on the receiver (yet)
NEVER = (1 << 63) | 777  # a begun op's derived seq that never starts on the receiver
MASTER = 7  # an op the master commenced on the receiver
LIMIT = 40_000
FRAME = 16_384


async def _send(sender: FramedConnection, seq: int, payloads: list[bytes]) -> None:
    for step, payload in enumerate(payloads):
        await sender.send_data(DataHeader(seq, 0, step, 0, len(payload)), payload)


async def _receive(inbox: Inbox, seq: int, step: int, nbytes: int, reader: str) -> bytes:
    destination = bytearray(nbytes)
    if reader == "task":
        await inbox.receive_into(seq=seq, stream=0, step=step, offset=0, destination=memoryview(destination))
    else:
        await trio.to_thread.run_sync(lambda: inbox.receive_blocking(
            seq=seq, stream=0, step=step, offset=0, destination=memoryview(destination), cancel=ThreadCancel()))
    return bytes(destination)


def test_the_default_bound_keeps_a_few_frame_windows() -> None:
    assert 1 << 20 <= KEPT_BYTES_LIMIT <= 64 << 20


@pytest.mark.parametrize("reader", ["task", "thread"])
@pytest.mark.parametrize(("frames", "kept"), [
    ([FRAME] * 4, 2 * FRAME),  # more than the bound in all: two frames fit
    ([LIMIT + 1], 0),  # one frame over the bound alone: never read into memory
])
async def test_frames_of_an_op_not_begun_here_are_kept_up_to_the_bound_and_the_rest_parks(
    reader: str, frames: list[int], kept: int
) -> None:
    sender, receiver = await framed_tcp_pair()
    try:
        registry = SeqRegistry()
        inbox = Inbox(receiver, registry, kept_limit=LIMIT)
        registry.commenced(MASTER)
        begun = [bytes([step + 1]) * n for step, n in enumerate(frames)]
        await _send(sender, BEGUN, begun)
        await _send(sender, MASTER, [b"m" * 8])
        got: list[bytes] = []

        async def master_op() -> None:
            got.append(await _receive(inbox, MASTER, 0, 8, reader))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(master_op)
                while inbox.kept_bytes < kept:  # a worker thread may still be reading them
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                # The master's op waits behind the frame that did not fit: kept within the bound.
                assert got == []
                assert inbox.kept_bytes == kept
                registry.started(BEGUN)  # the op begins here: it takes its frames, kept then parked
                for step, payload in enumerate(begun):
                    assert await _receive(inbox, BEGUN, step, len(payload), reader) == payload
                    assert inbox.kept_bytes <= LIMIT
        assert got == [b"m" * 8] and inbox.kept_bytes == 0
    finally:
        await sender.aclose()
        await receiver.aclose()


async def test_frames_kept_for_an_op_that_never_begins_are_dropped_with_the_links() -> None:
    sender, receiver = await framed_tcp_pair()
    try:
        links = RingLinks([sender], [receiver], kept_limit=LIMIT)
        inbox = links.inboxes[0]
        links.registry.commenced(MASTER)
        await _send(sender, NEVER, [b"n" * FRAME] * 2)  # kept
        await _send(sender, BEGUN, [b"b" * FRAME])  # over the bound: parks
        await _send(sender, MASTER, [b"m" * 8])
        got: list[bytes] = []

        async def master_op() -> None:
            got.append(await _receive(inbox, MASTER, 0, 8, "task"))

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(master_op)
                while links.kept_bytes < 2 * FRAME:
                    await trio.sleep(0.01)
                await trio.testing.wait_all_tasks_blocked(cushion=0.2)
                assert got == [] and links.kept_bytes == 2 * FRAME
                # The links are replaced (a new topology round): NEVER can no longer start on them.
                links.drop_kept("a new topology round")
        # Room again: the parked frame is kept after all, and the master's op gets its frame.
        assert got == [b"m" * 8] and links.kept_bytes == FRAME
        await links.aclose()
        assert links.kept_bytes == 0
    finally:
        await sender.aclose()
        await receiver.aclose()
