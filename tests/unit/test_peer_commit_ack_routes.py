"""Peer commit's acks over the ring lanes both ways and the partner links
(pccl._peer.peer_commit_driver.ack_routes, PeerCommits.settle), on memory links: both ends of
every pair pick one connection, and every participant commits on its acks alone."""

from __future__ import annotations

import types
from typing import Any

import pytest
import trio

from pccl._peer.agreement import Agreement
from pccl._peer.host import Counters
from pccl._peer.peer_commit_driver import PeerCommits, ack_routes
from pccl.collectives.links import RingLinks
from pccl.protocol import messages as m
from pccl.protocol.codec import DataHeader
from pccl.protocol.op_lifecycle import Event, OpLifecycle, State
from pccl.protocol.peer_ack import ack_seq, ack_targets
from pccl.protocol.peer_commit import Phase
from pccl.testing.streams import memory_mesh, memory_ring

SEQ = m.derived_seq(1, 1, 0)
INIT = m.CollectiveInit(1, 4, 10, 0)


def _links(n: int) -> list[RingLinks]:
    return memory_mesh(n)[0] if n >= 8 else memory_ring(n)[0]


@pytest.mark.parametrize("n", [2, 3, 5, 8, 9, 12])
async def test_both_ends_of_every_pair_pick_one_connection(n: int) -> None:
    links = _links(n)
    ring = tuple(range(100, 100 + n))
    ags = [Agreement.of(ring, ring[p], 1, SEQ, INIT) for p in range(n)]
    routes = [ack_routes(ags[p], links[p]) for p in range(n)]
    for p in range(n):
        assert tuple(routes[p]) == ack_targets(p, n, links[p].partners)  # ring neighbours and partners
        if n >= 8:
            assert set(links[p].partners) <= set(routes[p]) and links[p].partners
    for p in range(n):  # p's frame to q comes in on the inbox q reads p's acks from
        for q, (send, _) in routes[p].items():
            seq, payload = ack_seq(m.derived_seq(1, 1 + p * n + q, 0)), bytes([p, q])
            await send.send_data(DataHeader(seq, 0, 0, 0, 2), payload)
            got = bytearray(2)
            with trio.fail_after(5):
                await routes[q][p][1].receive_into(seq=seq, stream=0, step=0, offset=0, destination=memoryview(got))
            assert bytes(got) == payload


def _participant(ring: tuple[int, ...], position: int, links: RingLinks) -> tuple[PeerCommits, Any, list[Event], Counters]:
    steps: list[Event] = []
    host = types.SimpleNamespace(peer_id=ring[position], counters=Counters(), on_query=None,
                                 config=types.SimpleNamespace(peer_timeout=3600.0), spawn=lambda *a: True)
    op = types.SimpleNamespace(seq=SEQ, agreement=Agreement.of(ring, ring[position], 1, SEQ, INIT), links=links,
                               epoch=0, settled=trio.Event(), ring_scope=trio.CancelScope(),
                               machine=OpLifecycle(State.REPORTED), plan=types.SimpleNamespace(what="all_reduce", tag=1))
    pcs = PeerCommits(host, lambda op, event, word=None: steps.append(event))  # type: ignore[arg-type]
    pcs.track(op)
    return pcs, op, steps, host.counters


@pytest.mark.parametrize("n", [3, 5, 8, 9, 16])
async def test_every_participant_commits_on_its_acks_alone(n: int) -> None:
    links = _links(n)
    ring = tuple(range(100, 100 + n))
    parts = [_participant(ring, p, links[p]) for p in range(n)]
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for p, (pcs, op, _, _) in enumerate(parts):
                if p != n // 2:
                    nursery.start_soon(pcs.settle, op)
            await trio.sleep(0.01)  # everyone else is ready and waits for the last one's id
            assert all(op.agreement.machine.phase is Phase.READY for _, op, _, _ in parts if op is not parts[n // 2][1])
            pcs, op, _, _ = parts[n // 2]
            nursery.start_soon(pcs.settle, op)
    assert all(steps == [Event.COMPLETE] for _, _, steps, _ in parts)
    assert all(op.agreement.machine.phase is Phase.COMMITTED for _, op, _, _ in parts)
    assert sum(counters.peer_commit_doubts for _, _, _, counters in parts) == 0
