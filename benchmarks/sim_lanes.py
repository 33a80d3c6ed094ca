"""Lanes against one long fat link, in the simulator (issue 20's second figure).

    python benchmarks/sim_lanes.py [--gbit 10] [--rtt 0.1] [--window-mib 4] [--mib 256]
                                   [--lanes 1,2,4,8,16,32,64]

Two peers joined by one link of ``--gbit`` Gbit/s and ``--rtt`` s round trip, each connection
capped by a ``--window-mib`` MiB window (so one connection carries at most window / RTT).  For
each fixed ``p2p_lanes`` and for ``"auto"`` (after ``optimize_topology()`` measured the link),
one ``--mib`` MiB float32 all-reduce is timed in virtual seconds; the throughput is the bytes each
peer sent (``--mib``: a ring of two sends its half twice) over that time.  Deterministic.
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
from pccl_sim.engine.network import LinkSpec
from pccl_sim.engine.runner import simulate
from pccl_sim.workloads.pccl.network import PcclSimNetwork


def run(lanes: int | str, args: argparse.Namespace) -> tuple[float, int, float]:
    """(all-reduce seconds, lanes used, optimize_topology seconds) for one setting."""
    link = LinkSpec(latency=args.rtt / 2, bandwidth=args.gbit * 1e9 / 8, window=int(args.window_mib * (1 << 20)))
    config = pccl.Config(peer_timeout=30.0, heartbeat_interval=1.0, connect_timeout=10.0, p2p_base_port=0,
                         shared_state_base_port=0, kernel_threads=False, p2p_lanes=lanes,  # type: ignore[arg-type]
                         p2p_lane_window=int(args.window_mib * (1 << 20)), probe_seconds=args.probe_seconds)
    count = args.mib * (1 << 20) // 4
    out: dict[str, float] = {}

    async def body(world) -> None:  # type: ignore[no-untyped-def]
        async with pccl.open_master("master:48148", config=config, network=world.boot("master"),
                                    rng=random.Random(1)) as master:
            ready = trio.Event()
            go = [0]

            async def peer(i: int) -> None:
                async with pccl.open_communicator(master.address, config=config, network=world.boot(f"peer{i}"),
                                                  rng=random.Random(i)) as comm:
                    while comm.world_size < 2:
                        if await comm.are_peers_pending():
                            await comm.update_topology()
                        else:
                            await trio.sleep(0.05)
                    if lanes == "auto":
                        t = trio.current_time()
                        await comm.optimize_topology()
                        out["optimise"] = trio.current_time() - t
                    go[0] += 1
                    if go[0] == 2:
                        ready.set()
                    await ready.wait()
                    x = np.ones(count, np.float32)
                    start = trio.current_time()
                    await comm.all_reduce(x)
                    out[f"t{i}"] = trio.current_time() - start
                    out["lanes"] = len(pccl.testing.ring_lanes(comm).to_successor)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(peer, 0)
                while not pccl.testing.master_snapshot(master).peers:
                    await trio.sleep(0.01)
                nursery.start_soon(peer, 1)

    simulate(body, seed=0, deadline=36000.0, default_link=link, network_class=PcclSimNetwork)
    return max(out["t0"], out["t1"]), int(out["lanes"]), out.get("optimise", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gbit", type=float, default=10.0)
    parser.add_argument("--rtt", type=float, default=0.1)
    parser.add_argument("--window-mib", type=float, default=4.0)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--lanes", default="1,2,4,8,16,32,64")
    parser.add_argument("--probe-seconds", type=float, default=0.5)
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)
    wall = time.perf_counter()
    settings: list[int | str] = [int(x) for x in args.lanes.split(",")] + ["auto"]
    rows = [(s, *run(s, args)) for s in settings]
    wall = time.perf_counter() - wall
    per_peer_bytes = args.mib * (1 << 20)     # two peers: each sends half its input, twice
    print(f"one {args.gbit:g} Gbit/s link, RTT {args.rtt * 1e3:g} ms, {args.window_mib:g} MiB window per connection, "
          f"{args.mib} MiB all-reduce (virtual; {wall:.0f} s wall)")
    best = min(t for s, t, _, _ in rows if s != "auto")
    for setting, seconds, used, optimise in rows:
        extra = f"   (optimize_topology {optimise:.2f} s)" if setting == "auto" else ""
        print(f"  p2p_lanes={str(setting):5s} lanes used {used:3d}: {seconds:8.3f} s  "
              f"{per_peer_bytes * 8 / seconds / 1e9:6.2f} Gbit/s  {best / seconds:6.1%} of the best fixed{extra}")


if __name__ == "__main__":
    main()
