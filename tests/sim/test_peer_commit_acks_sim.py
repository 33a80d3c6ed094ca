"""``Config.peer_commit`` at scale in the simulator: acks go to every ring neighbour and partner
link (pccl.collectives.links.RingLinks.ack_links), so a peer-agreed op commits ``ack_hops`` link
latencies after the last participant is ready (a log-diameter graph), well before the master's
``CollectiveComplete`` can arrive from 50 ms away; relayed round the ring alone they took
``N - 1`` hops and lost to it.  Virtual seconds: exact, no noise."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import trio

import pccl
from pccl.protocol.algorithms import link_partner_positions
from pccl.protocol.peer_ack import ack_hops
from pccl_sim.engine.runner import simulate
from pccl_sim.engine.topology import LinkSpec
from pccl_sim.workloads.pccl.network import PcclSimNetwork

HOP = 0.005  # one way on every peer link
MASTER = 0.050  # one way between the master and each peer


def _span_of_small_all_reduces(n: int, ops: int) -> tuple[list[float], list[pccl.CommunicatorStatistics]]:
    """Virtual seconds of ``ops`` 4 KiB all-reduces at ``n`` peers (first call to last return,
    each), and every peer's statistics after them."""
    config = pccl.Config(peer_timeout=60.0, heartbeat_interval=2.0, connect_timeout=30.0, p2p_base_port=0,
                         shared_state_base_port=0, kernel_threads=False, fast_commit=True, peer_commit=True)
    spans: list[list[tuple[float, float]]] = [[] for _ in range(ops)]
    stats: list[pccl.CommunicatorStatistics] = []

    async def body(world) -> None:  # type: ignore[no-untyped-def]
        gate = {"count": 0, "event": trio.Event()}

        async def barrier() -> None:
            event = gate["event"]
            gate["count"] += 1
            if gate["count"] == n:
                gate["count"], gate["event"] = 0, trio.Event()
                event.set()
            await event.wait()

        async def peer(index: int) -> None:
            async with pccl.open_communicator(master.address, config=config, network=world.boot(f"peer{index}"),
                                              rng=random.Random(index)) as comm:
                while comm.world_size < n:
                    if await comm.are_peers_pending():
                        await comm.update_topology()
                    else:
                        await trio.sleep(0.01)
                for k in range(ops):
                    await barrier()
                    x = np.full(1024, index + 1.0 + k, np.float32)
                    start = trio.current_time()
                    await comm.all_reduce(x)
                    spans[k].append((start, trio.current_time()))
                    assert np.array_equal(x, np.full(1024, n * (n + 1) / 2 + n * k, np.float32))
                await barrier()
                stats.append(comm.statistics())
                await barrier()

        async with pccl.open_master("master:48148", config=config, network=world.boot("master"),
                                    rng=random.Random(0)) as master:
            async with trio.open_nursery() as nursery:
                for index in range(n):
                    nursery.start_soon(peer, index)

    link = LinkSpec(latency=HOP, bandwidth=1e9 / 8, window=4 << 20)

    async def placed(world):  # type: ignore[no-untyped-def]
        for index in range(n):
            world.set_link("master", f"peer{index}", dataclasses.replace(link, latency=MASTER))
        await body(world)

    simulate(placed, seed=0, default_link=link, deadline=3600.0, network_class=PcclSimNetwork)
    return [max(e for _, e in s) - min(b for b, _ in s) for s in spans], stats


def test_a_peer_agreed_op_at_32_peers_commits_log_hops_after_its_ring_before_the_masters_complete() -> None:
    n = 32
    spans, stats = _span_of_small_all_reduces(n, 2)
    hops = ack_hops(n, [link_partner_positions(p, n, None) for p in range(n)])
    assert hops == 4
    # Recursive doubling: log2(32) = 5 steps of one hop; then the acks' 4 hops.  The master's
    # Complete needs a round trip after the last Done (100 ms); relayed round the ring, the
    # acks needed 31 hops (155 ms) and every op waited for the Complete.
    assert all(span < (5 + hops + 1) * HOP for span in spans), spans
    assert all(span < 2 * MASTER for span in spans), spans
    assert sum(s.peer_commits for s in stats) == 2 * n and sum(s.peer_commit_doubts for s in stats) == 0
