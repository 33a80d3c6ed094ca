"""Begun ops (fast commit's derived seqs) run beside each other on the partner links, where each
reads its partners in its own order: a partner inbox keeps another running begun op's frame in
memory instead of parking it at the head of the link, and wakes that op if it waits for the link
(docs/protocol.rst, "Crossings"; ``Inbox.keep_running``)."""

from __future__ import annotations

import trio
import trio.testing

from pccl.collectives.links import Inbox, RingLinks
from pccl.net.framed import FramedConnection
from pccl.protocol.codec import DataHeader

from tcp_pairs import framed_tcp_pair

X = (1 << 63) | 1111  # two begun ops, both commenced on the receiver
Y = (1 << 63) | 2222
FRAME = 4096


def _payload(seq: int, step: int) -> bytes:
    return bytes([(seq + step) % 251]) * FRAME


async def _send(sender: FramedConnection, seq: int, step: int) -> None:
    await sender.send_data(DataHeader(seq, 0, step, 0, FRAME), _payload(seq, step))


async def _receive(inbox: Inbox, seq: int, step: int) -> bytes:
    destination = bytearray(FRAME)
    await inbox.receive_into(seq=seq, stream=0, step=step, offset=0, destination=memoryview(destination))
    return bytes(destination)


async def _links() -> tuple[RingLinks, dict[int, FramedConnection], list[FramedConnection]]:
    """Links with partner links from ring positions 1 and 2; returns them, the partners' sending
    ends, and every connection to close."""
    lane_out, lane_in = await framed_tcp_pair()
    p_out, p_in = await framed_tcp_pair()
    q_out, q_in = await framed_tcp_pair()
    links = RingLinks([lane_out], [lane_in], partners={1: p_in, 2: q_in})
    links.registry.commenced(X)
    links.registry.commenced(Y)
    return links, {1: p_out, 2: q_out}, [lane_out, lane_in, p_out, p_in, q_out, q_in]


async def test_begun_ops_reading_their_partners_in_opposite_orders_both_complete() -> None:
    # X reads position 1 then 2, Y reads 2 then 1, and each link brings the other op's frame
    # first.  Parked, Y's frame blocked X on link 1 while X's blocked Y on link 2: neither op
    # reads the link the other's frame waits on, and both hung.
    links, senders, connections = await _links()
    try:
        await _send(senders[1], Y, 1)
        await _send(senders[1], X, 0)
        await _send(senders[2], X, 1)
        await _send(senders[2], Y, 0)
        got: dict[int, list[bytes]] = {X: [], Y: []}

        async def op(seq: int, reads: list[tuple[int, int]]) -> None:
            async with links.partner_turn(seq, f"op {seq}"):
                for position, step in reads:
                    got[seq].append(await _receive(links.partners[position], seq, step))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(op, X, [(1, 0), (2, 1)])
                nursery.start_soon(op, Y, [(2, 0), (1, 1)])
        assert got == {X: [_payload(X, 0), _payload(X, 1)], Y: [_payload(Y, 0), _payload(Y, 1)]}
        assert links.kept_bytes == 0
    finally:
        for connection in connections:
            await connection.aclose()


async def test_a_begun_op_waiting_for_the_link_takes_its_frame_another_reader_kept() -> None:
    # X reads link 1 and waits for its frame; Y waits for link 1 too.  Y's frame comes first:
    # X reads it into memory and Y takes it from there at once, while X still waits for its own.
    links, senders, connections = await _links()
    try:
        got: dict[int, bytes] = {}

        async def op(seq: int) -> None:
            async with links.partner_turn(seq, f"op {seq}"):
                got[seq] = await _receive(links.partners[1], seq, 0)

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(op, X)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(op, Y)
                await trio.testing.wait_all_tasks_blocked()
                await _send(senders[1], Y, 0)
                while Y not in got:
                    await trio.sleep(0.01)
                assert X not in got
                await _send(senders[1], X, 0)
        assert got == {X: _payload(X, 0), Y: _payload(Y, 0)} and links.kept_bytes == 0
    finally:
        for connection in connections:
            await connection.aclose()
