"""Frames of a begun op this peer has not begun yet (fast commit): an inbox keeps them in memory
only up to its bound (``Inbox.kept_limit``), parks the rest at the head of the lane (TCP then
holds the sender back), and drops what it keeps when the links are replaced or closed
(docs/protocol.rst, "Frames for an op a neighbour has not begun yet")."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl.collectives.frame_finish import FINISH_FRAME_TIMEOUT
from pccl.collectives.links import KEPT_BYTES_LIMIT, Inbox, RingLinks, SeqRegistry
from pccl.config import Config
from pccl.errors import TransferTimeout
from pccl.net.framed import FramedConnection
from pccl.net.thread_io import ThreadCancel
from pccl.protocol.codec import DataHeader, encode_data_prefix
from pccl.protocol.messages import HandshakeRole
from pccl.testing import memory_stream_pair

from tcp_pairs import framed_tcp_pair

BEGUN = (1 << 63) | 12345  # a begun op's derived seq, not known on the receiver (yet)
NEVER = (1 << 63) | 777  # a begun op's derived seq that never starts on the receiver
MASTER = 7  # an op the master commenced on the receiver
ACKS = (1 << 63) | 4242  # an idle reader's seq (a peer-commit agreement's acks)
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


@pytest.mark.parametrize("frame", ["kept", "late"])
async def test_a_reader_cancelled_while_it_reads_another_ops_frame_finishes_it(frame: str) -> None:
    """A reader idle on a lane holds its read role (a peer-commit agreement's ack reader, say);
    another op's frame arrives and it starts reading it — into memory for that op (begun, not
    known here), or into nothing (ended here: late) — and is cancelled midway, as the ack
    readers are the moment their agreement ends.  The frame is finished: the lane stays intact
    and its owner gets it whole (before, the cut aborted the connection, failing the op)."""
    raw, wire = memory_stream_pair(record=False)
    receiver = FramedConnection(wire, role=HandshakeRole.SERVER, config=Config())
    registry = SeqRegistry()
    inbox = Inbox(receiver, registry)
    if frame == "late":
        registry.retire(BEGUN)
    payload = bytes(range(256)) * (FRAME // 256)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            reader = trio.CancelScope()

            async def idle_reader() -> None:
                with reader:
                    await _receive(inbox, ACKS, 0, 8, "task")

            nursery.start_soon(idle_reader)
            await trio.testing.wait_all_tasks_blocked()
            await raw.send_all(encode_data_prefix(DataHeader(BEGUN, 0, 0, 0, FRAME)) + payload[: FRAME // 2])
            await trio.testing.wait_all_tasks_blocked()  # the reader waits for the payload's rest
            reader.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not receiver.broken
            await raw.send_all(payload[FRAME // 2:])
        assert inbox.kept_bytes == (FRAME if frame == "kept" else 0)
        await raw.send_all(encode_data_prefix(DataHeader(ACKS, 0, 0, 0, 8)) + b"a" * 8)
        assert await _receive(inbox, ACKS, 0, 8, "task") == b"a" * 8
        if frame == "kept":
            registry.started(BEGUN)
            assert await _receive(inbox, BEGUN, 0, FRAME, "task") == payload
    assert not receiver.broken and inbox.kept_bytes == 0
    await receiver.aclose()


async def test_a_cancelled_reader_waits_for_the_rest_of_another_ops_frame_only_so_long(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The sender stops midway through the frame: the cancelled reader gives up after
    FINISH_FRAME_TIMEOUT, the connection aborted (its payload was cut) and TransferTimeout raised."""
    raw, wire = memory_stream_pair(record=False)
    receiver = FramedConnection(wire, role=HandshakeRole.SERVER, config=Config())
    inbox = Inbox(receiver, SeqRegistry())
    reader = trio.CancelScope()
    start = trio.current_time()
    raised: list[BaseException] = []
    async with trio.open_nursery() as nursery:
        async def idle_reader() -> None:
            with reader:
                try:
                    await _receive(inbox, ACKS, 0, 8, "task")
                except TransferTimeout as exc:
                    raised.append(exc)

        nursery.start_soon(idle_reader)
        await trio.testing.wait_all_tasks_blocked()
        await raw.send_all(encode_data_prefix(DataHeader(BEGUN, 0, 0, 0, FRAME)) + b"x" * 100)
        await trio.testing.wait_all_tasks_blocked()
        reader.cancel()
    assert [type(e) for e in raised] == [TransferTimeout] and "did not arrive whole" in str(raised[0])
    assert trio.current_time() - start >= FINISH_FRAME_TIMEOUT and receiver.broken
