"""Crossings over the partner links (docs/protocol.rst, "Crossings") with fast commit, 8 peers
as Trio tasks in this process (real TCP): half the peers begin tag 1 and then call tag 2 (they
vote: tag 1 is in flight, and join the op the other half began), the other half, sequential,
begin tag 2 and call tag 1 only after it.  The first half commence tag 1 first, the second half
tag 2: taking the partner links one op at a time in commence order, each half's first op waited
for the other half's frames of it, which come only after the other half's first op, until the
watchdog aborted both (``CollectiveAborted``, then a re-wire)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import Config
from pccl.protocol.algorithms import BroadcastAlgorithm
from pccl.testing import force_broadcast_algorithm, open_test_cluster

TOKEN = "partner-crossing"
SOON = 60.0  # a hang check only: the watchdog (peer_timeout) ends a stalled crossing in seconds


def _config(algorithm: str) -> Config:
    return Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0, fast_commit=True, all_reduce_algorithm=algorithm)


async def _cross(comms: list[pccl.Communicator], call: Any) -> list[Any]:
    """Ring positions 0-3 begin tag 1, then call tag 2 beside it; positions 4-7 begin tag 2 and
    call tag 1 after it.  Returns every call's outcome (result or pccl error)."""
    ring = comms[0].ring
    first = {pid for pid in ring[:4]}
    outcomes: list[Any] = []

    async def one(comm: pccl.Communicator, tag: int) -> None:
        try:
            outcomes.append(await call(comm, tag))
        except pccl.PCCLError as exc:
            outcomes.append(exc)

    async def beside(comm: pccl.Communicator) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, comm, 1)
            await trio.sleep(0.1)
            nursery.start_soon(one, comm, 2)

    async def after(comm: pccl.Communicator) -> None:
        await trio.sleep(0.05)
        await one(comm, 2)
        await one(comm, 1)

    with trio.fail_after(SOON):
        async with trio.open_nursery() as nursery:
            for comm in comms:
                nursery.start_soon(beside if comm.peer_id in first else after, comm)
    return outcomes


@pytest.mark.parametrize("size", [1000, 300_000])  # one frame per step; steps of 1.2 MB (under the bound)
@pytest.mark.parametrize("algorithm", ["recursive_doubling", "halving_doubling"])
async def test_all_reduces_crossing_over_the_partner_links_complete(algorithm: str, size: int) -> None:
    async with open_test_cluster(8, token=TOKEN, config=_config(algorithm), soon=SOON) as (_, comms, _):
        rounds = [c.statistics().p2p_rounds for c in comms]
        xs = {(c.peer_id, tag): np.full(size, float(i + 1) * tag, np.float32)
              for i, c in enumerate(comms) for tag in (1, 2)}

        async def reduce(comm: pccl.Communicator, tag: int) -> Any:
            return await comm.all_reduce(xs[(comm.peer_id, tag)], tag=tag)

        outcomes = await _cross(comms, reduce)
        assert len(outcomes) == 16 and all(isinstance(o, pccl.ReduceInfo) for o in outcomes), outcomes
        for (pid, tag), x in xs.items():
            assert np.array_equal(x, np.full(size, 36.0 * tag, np.float32)), (pid, tag)
        assert [c.statistics().collectives_aborted for c in comms] == [0] * 8
        assert [c.statistics().p2p_rounds for c in comms] == rounds  # no re-wire


@pytest.mark.parametrize("algorithm", [BroadcastAlgorithm.TREE, BroadcastAlgorithm.SCATTER_ALL_GATHER],
                         ids=lambda a: a.value)
async def test_broadcasts_crossing_over_the_partner_links_complete(algorithm: BroadcastAlgorithm) -> None:
    size = 300_000
    with force_broadcast_algorithm(algorithm):
        async with open_test_cluster(8, token=TOKEN, config=_config("halving_doubling"), soon=SOON) as (_, comms, _):
            ring = comms[0].ring
            rounds = [c.statistics().p2p_rounds for c in comms]
            roots = {1: ring[5], 2: ring[2]}  # each tag's root is in the half that calls it second
            xs = {(c.peer_id, tag): np.full(size, float(i + 1) * tag, np.float32)
                  for i, c in enumerate(comms) for tag in (1, 2)}
            want = {tag: xs[(roots[tag], tag)].copy() for tag in (1, 2)}

            async def cast(comm: pccl.Communicator, tag: int) -> Any:
                return await comm.broadcast(xs[(comm.peer_id, tag)], root=roots[tag], tag=tag)

            outcomes = await _cross(comms, cast)
            assert len(outcomes) == 16 and not any(isinstance(o, pccl.PCCLError) for o in outcomes), outcomes
            for (pid, tag), x in xs.items():
                assert np.array_equal(x, want[tag]), (pid, tag)
            assert [c.statistics().collectives_aborted for c in comms] == [0] * 8
            assert [c.statistics().p2p_rounds for c in comms] == rounds  # no re-wire
