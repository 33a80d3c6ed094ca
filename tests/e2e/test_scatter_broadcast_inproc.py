"""The scatter + all-gather broadcast in a real TCP cluster (peers as Trio tasks in this process),
forced (:func:`pccl.testing.force_broadcast_algorithm`) at 5 to 9 peers — the odd worlds and
6 fold — on counts the ``P`` blocks split evenly and one they do not, with partner links wired (``Config.all_reduce_algorithm`` forced, as below 8 peers
nothing wires them otherwise): from a folded root and others, every peer ends with the root's
bytes exactly, and the bytes each peer sends and receives say the scatter + all-gather ran (every
peer but the root receives the buffer once; the chain's and the tree's counts differ).  Forcing
the algorithm keeps a fault planted on the broadcast's row before it, and the other way round."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import numpy as np
import pytest

import pccl
from pccl import Config
from pccl.collectives.halving import block_bounds
from pccl.collectives.scatter_broadcast import ScatterAllGatherOp
from pccl.protocol.algorithms import BroadcastAlgorithm
from pccl.protocol.scatter_gather import scatter_all_gather_plan
from pccl.testing import each, force_broadcast_algorithm, open_test_cluster, plant_kind_fault

TOKEN = "scatter-broadcast-inproc"
SOON = 30.0


def _config() -> Config:
    return Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0, all_reduce_algorithm="halving_doubling")


def _sent_elements(position: int, world: int, root: int, count: int) -> int:
    """Elements ``position`` sends: its moves' runs of the ``P`` blocks (the first
    ``count % P`` one element longer)."""
    size = 1 << (world.bit_length() - 1)
    return sum(block_bounds(count, size, m.stop - 1)[1] - block_bounds(count, size, m.first)[0]
               for m in scatter_all_gather_plan(position, world, root) if m.send)


# 7: three folded peers (the most below 8), 8: no fold; worlds 2 to 9, 12 and 16 run on memory
# links in tests/unit/test_scatter_broadcast.py, and 9 (a folded root) as processes.
@pytest.mark.parametrize("world", [7, 8])
async def test_the_forced_scatter_all_gather_broadcast_is_exact(world: int) -> None:
    with force_broadcast_algorithm(BroadcastAlgorithm.SCATTER_ALL_GATHER):
        async with open_test_cluster(world, token=TOKEN, config=_config(), soon=SOON) as (_, comms, _):
            ring = comms[0].ring
            rng = np.random.default_rng(world)
            # one frame a move; uneven blocks (8003 is no multiple of P); several (1 MiB frames)
            for n in (8 * 1000, 8 * 1000 + 3, 8 * 300_000):
                for root_pos in (0, world // 2, world - 1):  # position 0 folds below a power of two
                    root = ring[root_pos]
                    inputs = {pid: rng.standard_normal(n).astype(np.float32) for pid in ring}
                    buffers = {pid: x.copy() for pid, x in inputs.items()}

                    async def cast(i: int, comm: pccl.Communicator) -> Any:
                        return await comm.broadcast(buffers[comm.peer_id], root=root, tag=root_pos)

                    infos = await each(comms, cast)
                    for pid in ring:
                        assert buffers[pid].tobytes() == inputs[root].tobytes(), (n, root_pos, pid)
                    for info, comm in zip(infos, comms):
                        position = ring.index(comm.peer_id)
                        assert info.rx_bytes == (0 if position == root_pos else 4 * n), (position, info)
                        assert info.tx_bytes == 4 * _sent_elements(position, world, root_pos, n), (n, position)
                    assert sum(info.tx_bytes for info in infos) == (world - 1) * 4 * n


@pytest.mark.parametrize("fault_first", [True, False], ids=["fault-then-force", "force-then-fault"])
async def test_forcing_the_algorithm_keeps_a_fault_planted_on_the_row(fault_first: bool) -> None:
    made: list[type] = []

    def recording(row: Any) -> Any:  # a fault that wraps the row's make_op (here: records the op)
        real = row.make_op

        def make_op(*args: Any) -> Any:
            op = real(*args)
            made.append(type(op))
            return op

        return dataclasses.replace(row, make_op=make_op)

    world = 5
    with contextlib.ExitStack() as planted:
        plants = [lambda: plant_kind_fault("broadcast", recording),
                  lambda: force_broadcast_algorithm(BroadcastAlgorithm.SCATTER_ALL_GATHER)]
        for plant in plants if fault_first else reversed(plants):
            planted.enter_context(plant())
        async with open_test_cluster(world, token=TOKEN, config=_config(), soon=SOON) as (_, comms, _):
            root = comms[0].ring[1]
            buffers = {comm.peer_id: np.full(4000, comm.ring.index(comm.peer_id), np.float32) for comm in comms}

            async def cast(i: int, comm: pccl.Communicator) -> Any:
                return await comm.broadcast(buffers[comm.peer_id], root=root, tag=7)

            await each(comms, cast)
    assert all((b == 1).all() for b in buffers.values())
    assert made == [ScatterAllGatherOp] * world  # the fault ran on every peer, and made the forced op
