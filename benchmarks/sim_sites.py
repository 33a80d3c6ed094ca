"""Topology optimisation across datacenters, in the simulator (issue 20's first figure).

    python benchmarks/sim_sites.py [--sites 3] [--per-site 4] [--mib 256 | --kib 4] [--lanes 4]
                                   [--seed 0] [--probe-seconds 0.1]

Peers in ``--sites`` sites (10 Gbit/s, 0.1 ms inside a site; each site's traffic to the others
shares one 1 Gbit/s uplink; 15-40 ms one way between sites; 4 MiB per-connection windows) join
one by one in a random order, so the first ring (peer-id order) crosses between sites often.
Each run times one ``--mib`` MiB (or ``--kib`` KiB) float32 all-reduce (virtual seconds: from
the first peer's call to the last peer's return):

* ``join order``: the ring as the peers joined;
* ``optimised``: after ``optimize_topology()`` (real probes through the simulated network), the
  ring forced (``Config.all_reduce_algorithm="ring"``);
* ``best``: the same with the master's link store filled with the true link parameters instead
  of probes: the exact solver (Held-Karp, which the property tests check against brute force)
  over the truth, i.e. the best ring under the model;
* ``hierarchical``: after ``optimize_topology()`` with the automatic choice, which runs the
  hierarchical all-reduce once the master found the sites (:mod:`pccl.protocol.sites`;
  :mod:`pccl.collectives.hierarchical`).

Deterministic: the same arguments print the same figures.
"""

from __future__ import annotations

import argparse
import logging
import random
import time

import numpy as np
import trio

import pccl
import pccl.testing
from pccl_sim.engine.runner import simulate
from pccl_sim.workloads.pccl.network import PcclSimNetwork
from pccl_sim.workloads.pccl.scenario import SiteLayout

GBIT = 1e9 / 8


def layout(sites: int) -> SiteLayout:
    pairs = sites * (sites - 1) // 2
    latencies = [0.015 + 0.025 * k / max(1, pairs - 1) for k in range(pairs)]   # 15..40 ms one way
    return SiteLayout(count=sites, uplink=1 * GBIT, latency=tuple(latencies), inside_latency=0.0001,
                      inside_bandwidth=10 * GBIT, window=4 << 20)


def true_link(sites: SiteLayout, a: str, b: str) -> tuple[float, float]:
    sa, sb = sites.site_of(a), sites.site_of(b)
    if sa == sb:
        return sites.inside_bandwidth, 2 * sites.inside_latency
    i, j = sorted((int(sa[4:]), int(sb[4:])))
    pairs = [(x, y) for x in range(sites.count) for y in range(x + 1, sites.count)]
    return sites.uplink, 2 * sites.latency[pairs.index((i, j))]


def crossings(ring: tuple[int, ...], site_of_peer: dict[int, str]) -> int:
    return sum(site_of_peer[ring[k]] != site_of_peer[ring[(k + 1) % len(ring)]] for k in range(len(ring)))


def run(mode: str, args: argparse.Namespace, algorithm: str = "ring") -> dict[str, object]:
    sites = layout(args.sites)
    n = args.sites * args.per_site
    config = pccl.Config(peer_timeout=30.0, heartbeat_interval=1.0, connect_timeout=10.0, p2p_base_port=0,
                         shared_state_base_port=0, kernel_threads=False, p2p_lanes=args.lanes,
                         probe_seconds=args.probe_seconds, probe_streams=8, all_reduce_algorithm=algorithm)
    count = (args.kib << 10 if args.kib else args.mib << 20) // 4
    out: dict[str, object] = {}

    async def body(world) -> None:  # type: ignore[no-untyped-def]
        sites.install(world)
        join_order = random.Random(args.seed).sample(range(n), n)
        hosts = [f"peer{i}" for i in range(n)]
        comms: dict[str, pccl.Communicator] = {}
        starts: dict[str, list[float]] = {}
        ends: dict[str, list[float]] = {}
        phase = [trio.Event() for _ in range(4)]
        done = [0] * 4

        async def peer(host: str, index: int) -> None:
            async with pccl.open_communicator(master.address, config=config, network=world.boot(host),
                                              rng=random.Random(index)) as comm:
                comms[host] = comm
                while comm.world_size < n:
                    if await comm.are_peers_pending():
                        await comm.update_topology()
                    else:
                        await trio.sleep(0.05)
                x = np.ones(count, np.float32)
                for step in range(4):
                    done[step] += 1
                    if done[step] == n:
                        phase[step].set()
                    await phase[step].wait()
                    if step in (0, 2):
                        starts.setdefault(host, []).append(trio.current_time())
                        await comm.all_reduce(x)
                        ends.setdefault(host, []).append(trio.current_time())
                    elif step == 1:
                        if mode == "best":
                            fill_truth()
                        t = trio.current_time()
                        await comm.optimize_topology()
                        out.setdefault("optimise_s", trio.current_time() - t)
                        out["ring_after"] = comm.ring
                        out["sites"] = comm.sites

        def fill_truth() -> None:
            if out.get("filled"):
                return
            out["filled"] = True
            for a in hosts:
                for b in hosts:
                    if a != b:
                        bw, rtt = true_link(sites, a, b)
                        pccl.testing.master_state(master).record_link(comms[a].peer_id, comms[b].peer_id, bw, rtt)

        async with pccl.open_master("master:48148", config=config, network=world.boot("master"),
                                    rng=random.Random(args.seed)) as master:
            async with trio.open_nursery() as nursery:
                for index in join_order:
                    nursery.start_soon(peer, hosts[index], index)
                    while hosts[index] not in comms:
                        await trio.sleep(0.05)
                await phase[0].wait()
                out["ring_before"] = next(iter(comms.values())).ring
                site_of_peer = {comms[h].peer_id: sites.site_of(h) for h in hosts}
                out["site_of_peer"] = site_of_peer
                await phase[3].wait()
                nursery.cancel_scope.cancel()
        out["before_s"] = max(e[0] for e in ends.values()) - min(s[0] for s in starts.values())
        out["after_s"] = max(e[1] for e in ends.values()) - min(s[1] for s in starts.values())

    simulate(body, seed=args.seed, deadline=36000.0, network_class=PcclSimNetwork)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sites", type=int, default=3)
    parser.add_argument("--per-site", type=int, default=4)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--kib", type=int, default=0, help="the buffer in KiB instead (a latency case)")
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-seconds", type=float, default=0.1)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    wall = time.perf_counter()
    probed = run("probe", args)
    best = run("best", args)
    hier = run("probe", args, algorithm="auto")
    wall = time.perf_counter() - wall
    sites = probed["site_of_peer"]
    rows = [("join order", probed["ring_before"], probed["before_s"]),
            ("optimised (probes)", probed["ring_after"], probed["after_s"]),
            ("best (exact solver over the true links)", best["ring_after"], best["after_s"]),
            ("hierarchical (probes, sites found)", hier["ring_after"], hier["after_s"])]
    size = f"{args.kib} KiB" if args.kib else f"{args.mib} MiB"
    print(f"{args.sites} sites x {args.per_site} peers, {size} float32 all-reduce, {args.lanes} lanes, "
          f"seed {args.seed} (virtual seconds; {wall:.0f} s wall)")
    for name, ring, seconds in rows:
        print(f"  {name:42s} {seconds:8.3f} s   ring crosses sites {crossings(ring, sites):2d} times")  # type: ignore[arg-type]
    print(f"  optimize_topology() took {probed['optimise_s']:.2f} virtual s (probes + solve + re-wire); "
          f"sites found along the ring: {hier['sites'] or 'none'}")
    print(f"  join order / optimised = {probed['before_s'] / probed['after_s']:.2f}x;"  # type: ignore[operator]
          f"  optimised / best = {probed['after_s'] / best['after_s']:.3f};"  # type: ignore[operator]
          f"  optimised / hierarchical = {probed['after_s'] / hier['after_s']:.2f}x")  # type: ignore[operator]


if __name__ == "__main__":
    main()
