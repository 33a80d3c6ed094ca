"""A peer process for the network-namespace test (run inside a namespace with ``ip netns exec``).

Usage: ``python netns_peer.py MASTER TOKEN PEERS MIB SITE``.  Joins, waits for ``PEERS`` peers,
times one ``MIB`` MiB all-reduce on the join ring, calls ``optimize_topology()``, times another
on the optimised ring, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import trio

import pccl


async def main(master: str, token: str, peers: int, mib: int, site: str) -> None:
    config = pccl.Config(peer_timeout=20.0, heartbeat_interval=0.5, connect_timeout=5.0, p2p_base_port=0,
                         shared_state_base_port=0, probe_seconds=1.0, probe_streams=4)
    async with pccl.open_communicator(master, token=token, config=config) as comm:
        while comm.world_size < peers:
            if await comm.are_peers_pending():
                await comm.update_topology()
            else:
                await trio.sleep(0.05)
        x = np.ones(mib * (1 << 18), np.float32)
        ring_before = comm.ring
        start = time.perf_counter()
        await comm.all_reduce(x)
        before = time.perf_counter() - start
        start = time.perf_counter()
        await comm.optimize_topology()
        optimise = time.perf_counter() - start
        ring_after = comm.ring
        start = time.perf_counter()
        await comm.all_reduce(x)
        after = time.perf_counter() - start
        assert float(x[0]) == peers * peers
        print(json.dumps({"peer_id": comm.peer_id, "site": site, "ring_before": ring_before,
                          "ring_after": ring_after, "before": before, "after": after, "optimise": optimise}),
              flush=True)
        await trio.sleep(1.0)   # let the others finish their all-reduce before this peer leaves


if __name__ == "__main__":
    address, token, count, mib, site = sys.argv[1:6]
    trio.run(main, address, token, int(count), int(mib), site)
