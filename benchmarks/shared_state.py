"""Shared-state figures (not a test: numbers vary with machine load).

    python benchmarks/shared_state.py hash [--mib 256 1024]
    python benchmarks/shared_state.py loopback [--mib 256] [--sources 1 3]
    python benchmarks/shared_state.py sim [--mib 256] [--sources 1 3] [--gbit 1]

``hash``: xxh3-128 over a tensor's raw bytes (what every sync does per tensor), GB/s.
``loopback``: a joiner fetches ``--mib`` MiB of state from N up-to-date peers, each an OS
process, over real TCP on 127.0.0.1; prints the joiner's sync_shared_state wall time (hashing
included) and its receive throughput.
``sim``: the same in the simulator over ``--gbit`` Gbit/s links (5 ms latency, windows large
enough that bandwidth is the limit); prints the virtual time of the joiner's sync.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

import numpy as np
import trio

import pccl
from pccl.shared_state import hash_array

TOKEN = "bench-token"


def make_state(mib: int, *, zeros: bool = False) -> pccl.SharedState:
    """Sources hold revision 1, the joiner (zeros) revision 0: it is outdated, whatever a tie says."""
    n = mib * 1024 * 1024 // 4
    tensors = {"a": np.arange(n // 2, dtype=np.float32), "b": np.arange(n // 2, dtype=np.int32) * 3}
    if zeros:
        tensors = {k: np.zeros_like(v) for k, v in tensors.items()}
    return pccl.SharedState(tensors, revision=0 if zeros else 1)


def bench_hash(sizes: list[int]) -> None:
    for mib in sizes:
        array = np.random.default_rng(0).integers(0, 255, size=mib * 1024 * 1024, dtype=np.uint8)
        hash_array(array)  # warm up
        best = min(_timed(hash_array, array) for _ in range(5))
        print(f"xxh3-128 over {mib:5d} MiB: {mib * 1024 * 1024 / best / 1e9:6.2f} GB/s ({best * 1e3:.1f} ms)")


def _timed(fn, *args) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


# --- loopback -----------------------------------------------------------------------------------


async def _source(master: str, mib: int, total: int) -> None:
    """An up-to-date peer: accept newcomers until ``total`` peers are in, then sync once."""
    config = pccl.Config(p2p_base_port=0, shared_state_base_port=0)
    state = make_state(mib)
    async with pccl.open_communicator(master, token=TOKEN, config=config) as comm:
        while comm.world_size < total:
            if await comm.are_peers_pending():
                await comm.update_topology()
            else:
                await trio.sleep(0.05)
        info = await comm.sync_shared_state(state)
        print("SERVED", info.tx_bytes, flush=True)


async def _loopback_once(mib: int, sources: int) -> float:
    config = pccl.Config(p2p_base_port=0, shared_state_base_port=0)
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=config) as master:
        procs = []
        for i in range(sources):
            procs.append(subprocess.Popen([sys.executable, __file__, "_source", master.address, str(mib),
                                           str(sources + 1)], stdout=subprocess.PIPE, text=True))
            while master.statistics().accepted_peers < i + 1:
                await trio.sleep(0.05)
        joiner = make_state(mib, zeros=True)
        async with pccl.open_communicator(master.address, token=TOKEN, config=config) as comm:
            start = trio.current_time()
            info = await comm.sync_shared_state(joiner)
            elapsed = trio.current_time() - start
        assert info.rx_bytes == joiner.nbytes, info
        for p in procs:
            p.wait(timeout=60)
        return elapsed


def bench_loopback(mib: int, source_counts: list[int]) -> None:
    for n in source_counts:
        times = [trio.run(_loopback_once, mib, n) for _ in range(3)]
        best = min(times)
        print(f"loopback: joiner fetches {mib} MiB from {n} source(s): {best:.3f} s "
              f"({mib / 1024 / best * 8:.2f} Gbit/s incl. hashing; runs {', '.join(f'{t:.3f}' for t in times)})")


# --- simulator ----------------------------------------------------------------------------------


def bench_sim(mib: int, source_counts: list[int], gbit: float) -> None:
    from pccl_sim.engine.network import LinkSpec
    from pccl_sim.engine.runner import simulate
    from pccl_sim.workloads.pccl.network import PcclSimNetwork

    link = LinkSpec(latency=0.005, bandwidth=gbit * 1e9 / 8, window=64 << 20)
    config = pccl.Config(p2p_base_port=0, shared_state_base_port=0, peer_timeout=30.0, heartbeat_interval=1.0)

    for n in source_counts:
        async def scenario(world) -> float:  # type: ignore[no-untyped-def]
            result: list[float] = []
            master_net = world.boot("master")
            async with pccl.open_master("master:48148", config=config, network=master_net,
                                        rng=random.Random(1)) as master:
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(_sim_source, master.address, world.boot(f"src{i}"), mib, n + 1, config, i)
                        while master.statistics().accepted_peers < i + 1:
                            await trio.sleep(0.05)
                    joiner = make_state(mib, zeros=True)
                    async with pccl.open_communicator(master.address, config=config, network=world.boot("joiner"),
                                                      rng=random.Random(99)) as comm:
                        start = trio.current_time()
                        info = await comm.sync_shared_state(joiner)
                        result.append(trio.current_time() - start)
                    assert info.rx_bytes == joiner.nbytes
            return result[0]

        wall = time.perf_counter()
        virtual = simulate(scenario, seed=n, default_link=link, deadline=600.0, network_class=PcclSimNetwork)
        wall = time.perf_counter() - wall
        print(f"sim {gbit:g} Gbit/s links: joiner fetches {mib} MiB from {n} source(s): {virtual:.3f} virtual s "
              f"({mib * 1024 * 1024 * 8 / virtual / 1e9:.2f} Gbit/s; {wall:.1f} s wall)")


async def _sim_source(master: str, network, mib: int, total: int, config: pccl.Config, i: int) -> None:  # type: ignore[no-untyped-def]
    state = make_state(mib)
    async with pccl.open_communicator(master, config=config, network=network, rng=random.Random(i)) as comm:
        while comm.world_size < total:
            if await comm.are_peers_pending():
                await comm.update_topology()
            else:
                await trio.sleep(0.05)
        await comm.sync_shared_state(state)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_source":
        trio.run(_source, sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["hash", "loopback", "sim"])
    parser.add_argument("--mib", type=int, nargs="+", default=None)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--gbit", type=float, default=1.0)
    args = parser.parse_args()
    if args.what == "hash":
        bench_hash(args.mib or [256, 1024])
    elif args.what == "loopback":
        bench_loopback((args.mib or [256])[0], args.sources)
    else:
        bench_sim((args.mib or [256])[0], args.sources, args.gbit)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
