"""optimize_topology in the simulator: over sites the installed ring leaves each site once, and
every peer holds the sites the master found (``Communicator.sites``), and
``p2p_lanes="auto"`` sizes the lanes from the probed bandwidth-delay product.  Deterministic."""

from __future__ import annotations

import random

import numpy as np
import trio

import pccl
import pccl.testing
from pccl.collectives.reference import hierarchical_reference, ring_reference
from pccl_sim.engine.network import LinkSpec
from pccl_sim.engine.runner import simulate
from pccl_sim.workloads.pccl.network import PcclSimNetwork
from pccl_sim.workloads.pccl.scenario import SiteLayout

BASE = dict(peer_timeout=30.0, heartbeat_interval=1.0, connect_timeout=10.0, p2p_base_port=0,
            shared_state_base_port=0, kernel_threads=False, probe_seconds=0.2)


def group_run(n: int, config: pccl.Config, *, layout: SiteLayout | None = None, link: LinkSpec | None = None,
              seed: int = 0) -> dict:
    """n peers join in a seeded random order, all-reduce, optimise, all-reduce again."""
    out: dict = {"lanes": {}, "rings": {}, "sums": []}

    async def body(world) -> None:  # type: ignore[no-untyped-def]
        if layout is not None:
            layout.install(world)
        hosts = [f"peer{i}" for i in random.Random(seed).sample(range(n), n)]
        comms: dict[str, pccl.Communicator] = {}
        arrived = [0, 0, 0]
        gates = [trio.Event() for _ in range(3)]

        async def barrier(k: int) -> None:
            arrived[k] += 1
            if arrived[k] == n:
                gates[k].set()
            await gates[k].wait()

        async def peer(host: str) -> None:
            async with pccl.open_communicator(master.address, config=config, network=world.boot(host),
                                              rng=random.Random(host)) as comm:
                comms[host] = comm
                while comm.world_size < n:
                    if await comm.are_peers_pending():
                        await comm.update_topology()
                    else:
                        await trio.sleep(0.05)
                x = np.full(1000, float(int(host[4:]) + 1), np.float32)
                await barrier(0)
                out["rings"].setdefault("before", comm.ring)
                out.setdefault("sites_before", comm.sites)
                out["lanes"].setdefault("before", len(pccl.testing.ring_lanes(comm).to_successor))
                await comm.all_reduce(x)
                await barrier(1)
                await comm.optimize_topology()
                out["rings"].setdefault("after", comm.ring)
                assert comm.ring == out["rings"]["after"]
                out.setdefault("sites", {})[host] = comm.sites
                out["lanes"][host] = len(pccl.testing.ring_lanes(comm).to_successor)
                await comm.all_reduce(x)
                out["sums"].append(float(x[0]))
                out.setdefault("partner_dials", []).append(comm.statistics().p2p_partner_dials)
                # Order-sensitive floats: which reduction order ran shows in the bits.
                y = (np.random.default_rng(int(host[4:])).standard_normal(1000) * 1e4).astype(np.float32)
                out.setdefault("inputs", {})[comm.peer_id] = y.copy()
                await comm.all_reduce(y)
                out.setdefault("floats", []).append(y.tobytes())
                await barrier(2)

        async with pccl.open_master("master:48148", config=config, network=world.boot("master"),
                                    rng=random.Random(seed)) as master:
            async with trio.open_nursery() as nursery:
                for host in hosts:
                    nursery.start_soon(peer, host)
                    while host not in comms:
                        await trio.sleep(0.05)
            out["peer_ids"] = {h: c.peer_id for h, c in comms.items()}
            out["measured"] = pccl.testing.master_snapshot(master).measured_links

    simulate(body, seed=seed, deadline=3600.0, default_link=link, network_class=PcclSimNetwork)
    return out


def crossings(ring, site_of):
    return sum(site_of[ring[i]] != site_of[ring[(i + 1) % len(ring)]] for i in range(len(ring)))


def test_the_optimised_ring_leaves_each_site_once():
    layout = SiteLayout(count=3, uplink=1e9 / 8, latency=(0.015, 0.025, 0.04), inside_bandwidth=4e9 / 8,
                        window=4 << 20)
    out = group_run(6, pccl.Config(**{**BASE, "probe_seconds": 0.1}, p2p_lanes=2), layout=layout, seed=0)
    site_of = {pid: layout.site_of(h) for h, pid in out["peer_ids"].items()}
    assert crossings(out["rings"]["before"], site_of) > 3      # this seed's join order scatters the sites
    assert crossings(out["rings"]["after"], site_of) == 3
    assert len(out["measured"]) == 30
    # The master found the three sites from the probes and every peer holds them, along the ring.
    assert out["sites_before"] == ()
    ring = out["rings"]["after"]
    assert all(sites == out["sites"]["peer0"] for sites in out["sites"].values())
    named = [f"site{k}" for k in range(3)]
    seen = list(dict.fromkeys(site_of[pid] for pid in ring))   # sites in the order the ring enters them
    assert out["sites"]["peer0"] == tuple(seen.index(site_of[pid]) for pid in ring)
    assert sorted(seen) == named
    # After it, all-reduces run hierarchically over the site partner links (each peer has one
    # partner in its site and one in each other site: 9 links), in that schedule's order.
    assert sum(out["partner_dials"]) == 9
    inputs = [out["inputs"][pid] for pid in ring]
    assert len(set(out["floats"])) == 1
    assert out["floats"][0] == hierarchical_reference(inputs, pccl.ReduceOp.SUM, out["sites"]["peer0"]).tobytes()
    assert out["floats"][0] != ring_reference(inputs, pccl.ReduceOp.SUM).tobytes()
    # Right results on both rings: 'peerN' starts from N + 1; 21 after the first all-reduce
    # (in place), 6 * 21 after the second.
    assert out["sums"] == [126.0] * 6


def test_auto_lanes_follow_the_probed_link():
    # 50 MB/s at 100 ms RTT through 1 MiB windows: ~5 MB in flight, 5 windows, 6 with headroom.
    link = LinkSpec(latency=0.05, bandwidth=50e6, window=1 << 20)
    config = pccl.Config(**BASE, p2p_lanes="auto", p2p_lane_window=1 << 20, probe_streams=8)
    out = group_run(2, config, link=link)
    assert out["lanes"]["before"] == 1                         # nothing measured yet
    assert {v for k, v in out["lanes"].items() if k != "before"} == {6}
    assert all(48e6 <= bw <= 52e6 for bw in out["measured"].values()), out["measured"]
    again = group_run(2, config, link=link)
    assert again["measured"] == out["measured"]                # deterministic
