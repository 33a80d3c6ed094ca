"""pccl.testing itself: an in-process cluster on the memory network, the hooks' snapshots, and
the clear errors its entry points give for bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import trio
import trio.testing

import pccl
import pccl.testing
from pccl.collectives.kinds import KIND_OPS
from pccl.errors import InvalidArgument
from pccl.protocol import messages as m
from pccl.protocol.messages import CollectiveKind
from pccl.protocol.master.peers import PeerStatus


async def test_a_cluster_on_the_memory_network_reduces_and_shows_its_ring() -> None:
    network = pccl.testing.MemoryNetwork()
    with trio.fail_after(30):
        async with pccl.testing.open_test_cluster(3, network=network) as (master, comms, networks):
            assert networks == dict.fromkeys(range(3), network)
            xs = [np.full(1000, i + 1, np.float32) for i in range(3)]
            infos = await pccl.testing.each(comms, lambda i, c: c.all_reduce(xs[i]))
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            assert all(np.array_equal(x, np.full(1000, 6, np.float32)) for x in xs)

            snapshot = pccl.testing.master_snapshot(master)
            assert sorted(p.peer_id for p in snapshot.peers) == sorted(c.peer_id for c in comms)
            assert all(p.status is PeerStatus.ACCEPTED for p in snapshot.peers) and snapshot.ops == ()
            for comm in comms:
                lanes = pccl.testing.ring_lanes(comm)
                ring = comm.ring
                assert lanes.successor == ring[(ring.index(comm.peer_id) + 1) % 3]
                assert lanes.predecessor == ring[ring.index(comm.peer_id) - 1]
                assert len(lanes.to_successor) == lanes.outgoing[lanes.successor] >= 1
                with pytest.raises(dataclasses.FrozenInstanceError):
                    lanes.successor = 0  # type: ignore[misc]
                phase = pccl.testing.phase_of(comm)
                assert phase.topology_vote is None and phase.collectives == frozenset() and not phase.syncing
                assert pccl.testing.failure_of(comm) is None


async def test_a_forced_rewire_keeps_the_lanes_of_an_unchanged_ring() -> None:
    with trio.fail_after(30):
        async with pccl.testing.open_test_cluster(2, network=pccl.testing.MemoryNetwork()) as (_, comms, _):
            before = [pccl.testing.ring_lanes(c) for c in comms]
            async with trio.open_nursery() as voters:
                for comm in comms:
                    voters.start_soon(pccl.testing.force_rewire, comm)
            assert [pccl.testing.ring_lanes(c).to_successor for c in comms] == [b.to_successor for b in before]


async def test_bad_input_to_the_harness_is_a_clear_pccl_error() -> None:
    with pytest.raises(InvalidArgument, match="at least one peer"):
        async with pccl.testing.open_test_cluster(0):
            pass  # pragma: no cover - never entered
    with pytest.raises(InvalidArgument, match="no collective kind 'max_index'"):
        pccl.testing.plant_kind_fault("max_index", lambda row: row)
    with pytest.raises(InvalidArgument, match="a row of kind BROADCAST"):
        pccl.testing.plant_kind_fault("broadcast", lambda row: None)  # type: ignore[arg-type,return-value]
    with trio.fail_after(30):
        async with pccl.testing.open_test_cluster(1, network=pccl.testing.MemoryNetwork()) as (_, (comm,), _):
            with pytest.raises(InvalidArgument, match="'ring' or 'sync'"):
                pccl.testing.listener_address(comm, "data")  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="lane 5"):
                await pccl.testing.send_on_lane(comm, 5, m.Heartbeat())


def test_a_planted_fault_is_removed_once() -> None:
    holder = type("Holder", (), {"entry": "real"})
    fault = pccl.testing.PlantedFault(holder, "entry", "planted")
    with fault:
        assert holder.entry == "planted"
    assert holder.entry == "real"
    fault.remove()
    assert holder.entry == "real"


def test_a_planted_kind_fault_replaces_the_row_and_restores_it() -> None:
    real = KIND_OPS[CollectiveKind.BROADCAST]
    with pccl.testing.plant_kind_fault("broadcast", lambda row: dataclasses.replace(row, result=lambda *a: "planted")):
        assert KIND_OPS[CollectiveKind.BROADCAST].result(None, None, 0, 0, 0, None) == "planted"
    assert KIND_OPS[CollectiveKind.BROADCAST] is real


async def test_a_route_inbox_loses_nothing_to_a_cancelled_wait_and_ends_when_closed() -> None:
    """The inbox a collective call waits on for the master's answers (``open_route``): a wait
    cancelled before anything came takes nothing, the Commence that comes next is received,
    ``async for`` drains what is queued, and closing the route ends a wait with
    ``EndOfChannel``."""
    with trio.fail_after(30):
        async with pccl.testing.open_test_cluster(2, network=pccl.testing.MemoryNetwork()) as (_, comms, _):
            inboxes = [pccl.testing.open_route(c, 9) for c in comms]
            with trio.move_on_after(0.05) as waited:
                await inboxes[0].receive()
            assert waited.cancelled_caught
            for comm in comms:
                await pccl.testing.send_raw(comm, m.CollectiveInit(9, 4, int(pccl.DType.FLOAT32), int(pccl.ReduceOp.SUM)))
            commences = [await inbox.receive() for inbox in inboxes]
            assert all(isinstance(c, m.CollectiveCommence) and c.tag == 9 for c in commences), commences
            assert commences[0].seq == commences[1].seq
            with pytest.raises(trio.WouldBlock):
                inboxes[0].receive_nowait()

            ended: list[bool] = []

            async def wait_for_more() -> None:
                try:
                    await inboxes[0].receive()
                except trio.EndOfChannel:
                    ended.append(True)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_for_more)
                await trio.testing.wait_all_tasks_blocked()
                pccl.testing.close_route(comms[0], 9)
            assert ended == [True]
            assert [msg async for msg in inboxes[0]] == []
            pccl.testing.close_route(comms[1], 9)
