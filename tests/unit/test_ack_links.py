"""Which connection carries peer commit's acks between two participants
(pccl.collectives.links.RingLinks.ack_links): on memory links with and without partner links,
both ends of every pair pick the same one, and every ack target has one."""

from __future__ import annotations

import pytest
import trio

from pccl.collectives.links import RingLinks
from pccl.protocol import messages as m
from pccl.protocol.codec import DataHeader
from pccl.protocol.peer_ack import ack_seq, ack_targets
from pccl.testing.streams import memory_mesh, memory_ring


def _links(n: int) -> list[RingLinks]:
    return memory_mesh(n)[0] if n >= 8 else memory_ring(n)[0]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 12])
async def test_both_ends_of_every_pair_pick_one_connection(n: int) -> None:
    links = _links(n)
    routes = [links[p].ack_links(p, n) for p in range(n)]
    for p in range(n):
        assert tuple(routes[p]) == ack_targets(p, n, links[p].partners)  # ring neighbours and partners
        if n >= 8:
            assert links[p].partners and set(links[p].partners) <= set(routes[p])
    for p in range(n):  # p's frame to q comes in on the inbox q reads p's acks from
        for q, (send, _) in routes[p].items():
            seq, payload = ack_seq(m.derived_seq(1, 1 + p * n + q, 0)), bytes([p, q])
            await send.send_data(DataHeader(seq, 0, 0, 0, 2), payload)
            got = bytearray(2)
            with trio.fail_after(5):
                await routes[q][p][1].receive_into(seq=seq, stream=0, step=0, offset=0, destination=memoryview(got))
            assert bytes(got) == payload


def test_a_lone_participant_acks_nobody() -> None:
    assert memory_ring(2)[0][0].ack_links(0, 1) == {}
