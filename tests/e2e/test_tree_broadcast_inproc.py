"""The broadcast's algorithm choice in a real TCP cluster (peers as Trio tasks in this process):
at 8 and 9 peers (partner links wired) a small broadcast goes down the binomial tree and a large
one along the chain, from any root; every peer ends with the root's bytes, and the bytes each
peer sends say which algorithm ran."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pccl
from pccl import Config
from pccl.protocol.algorithms import BroadcastAlgorithm, broadcast_tree, choose_broadcast
from pccl.testing import each, open_test_cluster

TOKEN = "tree-broadcast-inproc"
SOON = 30.0


def _config() -> Config:
    return Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0)


@pytest.mark.parametrize("world", [8, 9])
async def test_small_broadcasts_take_the_tree_and_large_ones_the_chain(world: int) -> None:
    async with open_test_cluster(world, token=TOKEN, config=_config(), soon=SOON) as (_, comms, _):
        ring = comms[0].ring
        rng = np.random.default_rng(world)
        for n, algorithm in ((1000, BroadcastAlgorithm.TREE), (300_000, BroadcastAlgorithm.CHAIN)):
            nbytes = n * 4
            assert choose_broadcast(nbytes, world, quantized=False, segmented=False,
                                    partner_links=True) is algorithm
            for root_pos in (0, world // 2, world - 1):
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
                    if algorithm is BroadcastAlgorithm.TREE:  # a peer sends the buffer to each child
                        children = broadcast_tree(position, world, root_pos)[1]
                        assert info.tx_bytes == len(children) * nbytes, (position, info)
                    else:  # the chain: every peer but the root's predecessor forwards it once
                        last = (root_pos - 1) % world
                        assert info.tx_bytes == (0 if position == last else nbytes), (position, info)
                    assert info.rx_bytes == (0 if position == root_pos else nbytes)
