"""The hierarchical all-reduce in a real TCP cluster (peers as Trio tasks in this process):
the master's link store holds two (planted) sites, ``optimize_topology()`` sends them with its
round, the round wires the site partner links, and every all-reduce then runs hierarchically,
bit-identical on every peer and equal to its model, through the real lanes and kernels."""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

import pccl
from pccl import Config, ReduceOp
from pccl.collectives.reference import hierarchical_reference, ring_reference
from pccl.testing import each, master_state, open_test_cluster

TOKEN = "hierarchical-inproc"


async def test_planted_sites_make_every_all_reduce_hierarchical() -> None:
    config = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                    shared_state_base_port=0, probe_seconds=0.05, probe_streams=1)
    async with open_test_cluster(4, token=TOKEN, config=config, soon=30.0) as (master, comms, _):
        assert all(c.sites == () for c in comms)          # loopback: every link alike, no sites
        # Two sites by join order (peers 0, 2 and 1, 3): 10 Gbit/s and 0.2 ms inside, 1 Gbit/s
        # and 30 ms across, as if probed.
        site = {c.peer_id: i % 2 for i, c in enumerate(comms)}
        for a in site:
            for b in site:
                if a != b:
                    inside = site[a] == site[b]
                    master_state(master).record_link(a, b, 1.25e9 if inside else 1.25e8, 0.0002 if inside else 0.03)

        async def optimise(i: int, comm: pccl.Communicator) -> Any:
            await comm.optimize_topology()

        await each(comms, optimise)
        ring = comms[0].ring
        sites = comms[0].sites
        assert all(c.ring == ring and c.sites == sites for c in comms)
        assert sorted(sites) == [0, 0, 1, 1]
        assert all(sites[ring.index(a)] == sites[ring.index(b)] for a in site for b in site if site[a] == site[b])
        assert sum(c.statistics().p2p_partner_dials for c in comms) == 4   # 2 in-site + 2 across pairs
        rng = np.random.default_rng(4)
        for op in (ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX):
            for dtype in (np.float32, np.float16):
                inputs = {pid: (rng.standard_normal(10_001) * 1e4).astype(dtype) for pid in ring}
                buffers = {pid: x.copy() for pid, x in inputs.items()}

                async def reduce(i: int, comm: pccl.Communicator) -> Any:
                    return await comm.all_reduce(buffers[comm.peer_id], op=op, tag=3)

                with trio.fail_after(30):
                    await each(comms, reduce)
                in_order = [inputs[pid] for pid in ring]
                expected = hierarchical_reference(in_order, op, sites)
                for pid in ring:
                    assert buffers[pid].tobytes() == expected.tobytes(), (op, dtype)
                if op is ReduceOp.SUM and dtype is np.float32:   # another order than the ring's
                    assert expected.tobytes() != ring_reference(in_order, op).tobytes()
