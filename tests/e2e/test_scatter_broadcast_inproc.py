"""The scatter + all-gather broadcast in a real TCP cluster (peers as Trio tasks in this process),
forced (:func:`pccl.testing.force_broadcast_algorithm`) at 5 to 9 peers — the odd worlds and
6 fold — with partner links wired (``Config.all_reduce_algorithm`` forced, as below 8 peers
nothing wires them otherwise): from a folded root and others, every peer ends with the root's
bytes exactly, and the bytes each peer sends and receives say the scatter + all-gather ran (every
peer but the root receives the buffer once; the chain's and the tree's counts differ)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pccl
from pccl import Config
from pccl.protocol.algorithms import BroadcastAlgorithm
from pccl.protocol.scatter_gather import scatter_all_gather_plan
from pccl.testing import each, force_broadcast_algorithm, open_test_cluster

TOKEN = "scatter-broadcast-inproc"
SOON = 30.0


def _config() -> Config:
    return Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0, all_reduce_algorithm="halving_doubling")


def _sent_blocks(position: int, world: int, root: int) -> int:
    return sum(m.stop - m.first for m in scatter_all_gather_plan(position, world, root) if m.send)


@pytest.mark.parametrize("world", [5, 6, 7, 8, 9])
async def test_the_forced_scatter_all_gather_broadcast_is_exact(world: int) -> None:
    size = 1 << (world.bit_length() - 1)
    with force_broadcast_algorithm(BroadcastAlgorithm.SCATTER_ALL_GATHER):
        async with open_test_cluster(world, token=TOKEN, config=_config(), soon=SOON) as (_, comms, _):
            ring = comms[0].ring
            rng = np.random.default_rng(world)
            for n in (8 * 1000, 8 * 300_000):  # one frame a move; several (1 MiB frames)
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
                        assert info.tx_bytes == _sent_blocks(position, world, root_pos) * 4 * n // size
