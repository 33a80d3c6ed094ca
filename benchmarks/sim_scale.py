"""How pccl's step grows with the number of peers, in the simulator (virtual seconds).

    python benchmarks/sim_scale.py [--peers 4 16 64] [--steps 5] [--latency-ms 5]
                                   [--master-latency-ms 50] [--gbit 1] [--state-mib 4]
                                   [--mib 16] [--collectives all_reduce broadcast] [--seed 0]
                                   [--fast-commit | --no-fast-commit] [--peer-commit]
                                   [--broadcast-algorithm auto|chain|tree|scatter_all_gather]

Every link is ``--latency-ms`` one way and ``--gbit`` Gbit/s (4 MiB windows), except the
master's to each peer, ``--master-latency-ms`` one way (default: ``--latency-ms``), so that the
table shows what the master's round trips cost a collective (``--fast-commit``: with
``pccl.Config.fast_commit``, one round trip per collective instead of two; ``--peer-commit``:
with ``pccl.Config.peer_commit`` too, none in the steady state; ``--no-fast-commit``:
the vote; the default is pccl's); reductions take no virtual time
(``kernel_cost`` unset), so the figures are the protocol's and the network's.  The peers start
together; then each step is, phase by phase with a barrier between phases:

* ``vote``: ``update_topology()`` with nobody pending (one unanimous micro-vote with the master);
* ``sync``: ``sync_shared_state()`` of a ``--state-mib`` MiB state that every peer holds
  already (hashes to the master, its verdict back; nothing moves);
* ``all-reduce 4 KiB``: the ring's latency (``2(N-1)`` hops of one frame each);
* ``all-reduce MiB``: a ``--mib`` MiB float32 all-reduce (bandwidth plus latency);
* ``broadcast 4 KiB`` and ``broadcast MiB``: the same sizes broadcast from the peer with the
  smallest id (``--collectives`` picks all-reduce, broadcast or both; ``--broadcast-algorithm``
  forces one where it can run, :func:`pccl.testing.force_broadcast_algorithm`: partner links
  are wired from 8 peers up).

Nothing checks the results (the tests do), so the peers share their buffers: the MiB all-reduce
reduces one input array into one output array (out of place: no input backup), the broadcasts
overwrite one array, the state is one array: 256 peers need no more memory than one — only
pccl's per-op scratch (a broadcast receiver's backup) is per peer.  The values are garbage; the
bytes on the wire, and so the virtual times, are those of separate buffers.

``join`` is from the first peer's ``open_communicator()`` to every peer seeing ``world_size ==
N`` (the master admits pending peers at its votes, so a crowd joins in a few rounds).  A phase's
time is from the first peer's call to the last peer's return; the table shows the median over
``--steps`` steps and, last, the ratio of the largest world's to the smallest's.

Deterministic: the same arguments print the same virtual figures (the wall time differs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np
import trio

import pccl
import pccl.testing
from pccl.protocol.algorithms import BroadcastAlgorithm
from pccl_sim.engine.runner import simulate
from pccl_sim.engine.topology import LinkSpec
from pccl_sim.workloads.pccl.network import PcclSimNetwork

PHASES = ("vote", "sync", "all-reduce 4 KiB", "all-reduce MiB", "broadcast 4 KiB", "broadcast MiB")
COLLECTIVES = ("all_reduce", "broadcast")


#: The collective a phase runs (the others, the vote and the sync, always run).
_COLLECTIVE_OF = {"all-reduce 4 KiB": "all_reduce", "all-reduce MiB": "all_reduce",
                  "broadcast 4 KiB": "broadcast", "broadcast MiB": "broadcast"}


def phases_of(args: argparse.Namespace) -> list[str]:
    """The phases a run times: the vote, the sync and the chosen collectives'."""
    return [p for p in PHASES if _COLLECTIVE_OF.get(p, args.collectives[0]) in args.collectives]


def run(n: int, args: argparse.Namespace) -> dict[str, float]:
    config = pccl.Config(peer_timeout=60.0, heartbeat_interval=2.0, connect_timeout=30.0, p2p_base_port=0,
                         shared_state_base_port=0, kernel_threads=False, fast_commit=args.fast_commit,
                         peer_commit=args.peer_commit)
    small = np.ones(1024, np.float32)
    big_count = args.mib * (1 << 20) // 4
    # Shared by every peer (see the module docstring): one input, one output, one state.
    big, big_out = np.ones(big_count, np.float32), np.empty(big_count, np.float32)
    state_array = np.full(args.state_mib * (1 << 20) // 4, 0.5, np.float32)
    phases = phases_of(args)
    times: dict[str, list[float]] = {name: [] for name in phases}
    out: dict[str, float] = {}

    async def body(world) -> None:  # type: ignore[no-untyped-def]
        arrived = {"count": 0, "event": trio.Event()}
        spans: dict[str, list[tuple[float, float]]] = {}

        async def barrier() -> None:
            event = arrived["event"]
            arrived["count"] += 1
            if arrived["count"] == n:
                arrived["count"] = 0
                arrived["event"] = trio.Event()
                event.set()
            await event.wait()

        async def timed(key: str, call: Callable[[], Awaitable[object]]) -> None:
            await barrier()
            start = trio.current_time()
            await call()
            spans.setdefault(key, []).append((start, trio.current_time()))

        async def peer(index: int, started: float) -> None:
            async with pccl.open_communicator(master.address, config=config, network=world.boot(f"peer{index}"),
                                              rng=random.Random(index)) as comm:
                while comm.world_size < n:
                    if await comm.are_peers_pending():
                        await comm.update_topology()
                    else:
                        await trio.sleep(0.01)
                await barrier()
                out["join"] = max(out.get("join", 0.0), trio.current_time() - started)
                state = pccl.SharedState({"w": state_array})
                root = min(comm.ring)
                for step in range(args.steps):
                    await timed(f"vote/{step}", comm.update_topology)
                    await timed(f"sync/{step}", lambda: comm.sync_shared_state(state))
                    if "all-reduce MiB" in phases:
                        await timed(f"all-reduce 4 KiB/{step}", lambda: comm.all_reduce(small.copy()))
                        await timed(f"all-reduce MiB/{step}", lambda: comm.all_reduce(big, big_out))
                    if "broadcast MiB" in phases:
                        await timed(f"broadcast 4 KiB/{step}", lambda: comm.broadcast(small.copy(), root=root))
                        await timed(f"broadcast MiB/{step}", lambda: comm.broadcast(big_out, root=root))
                    state.revision += 1

        async with pccl.open_master("master:48148", config=config, network=world.boot("master"),
                                    rng=random.Random(args.seed)) as master:
            async with trio.open_nursery() as nursery:
                started = trio.current_time()
                for index in range(n):
                    nursery.start_soon(peer, index, started)
        for key, pairs in spans.items():
            name = key.rsplit("/", 1)[0]
            times[name].append(max(e for _, e in pairs) - min(s for s, _ in pairs))

    link = LinkSpec(latency=args.latency_ms / 1000, bandwidth=args.gbit * 1e9 / 8, window=4 << 20)
    master_ms = args.latency_ms if args.master_latency_ms is None else args.master_latency_ms
    master_link = dataclasses.replace(link, latency=master_ms / 1000)

    async def placed(world):  # type: ignore[no-untyped-def]
        for index in range(n):
            world.set_link("master", f"peer{index}", master_link)
        await body(world)

    simulate(placed, seed=args.seed, default_link=link, deadline=36000.0, network_class=PcclSimNetwork)
    return {"join": out["join"], **{name: statistics.median(values) for name, values in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--master-latency-ms", type=float, default=None,
                        help="one way between the master and each peer (default: --latency-ms)")
    parser.add_argument("--gbit", type=float, default=1.0)
    parser.add_argument("--state-mib", type=int, default=4)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fast-commit", action=argparse.BooleanOptionalAction, default=pccl.Config.fast_commit,
                        help="peers begin collectives without the master's vote (pccl.Config.fast_commit; "
                             "default: pccl's default)")
    parser.add_argument("--broadcast-algorithm", default="auto",
                        choices=["auto", *(a.value for a in BroadcastAlgorithm)],
                        help="force the broadcasts' algorithm where it can run (default: pccl's choice per op)")
    parser.add_argument("--peer-commit", action="store_true",
                        help="begun collectives commit among their peers (pccl.Config.peer_commit; needs fast commit)")
    args = parser.parse_args()
    if args.peer_commit and not args.fast_commit:
        parser.error("--peer-commit needs fast commit")
    if any(n < 2 for n in args.peers) or args.steps < 1 or args.mib < 1 or args.state_mib < 1:
        parser.error("every --peers must be at least 2, and --steps, --mib and --state-mib at least 1")
    if not args.latency_ms >= 0 or not (args.master_latency_ms is None or args.master_latency_ms >= 0) \
            or not args.gbit > 0:
        parser.error("latencies must not be negative and --gbit must be positive")
    phases = phases_of(args)
    logging.disable(logging.CRITICAL)
    if args.broadcast_algorithm != "auto":
        pccl.testing.force_broadcast_algorithm(args.broadcast_algorithm)  # for the whole process
    rows = []
    for n in args.peers:
        wall = time.perf_counter()
        figures = run(n, args)
        rows.append((n, figures, time.perf_counter() - wall))
    columns = ["join", *phases]
    labels = [c.replace(" MiB", f" {args.mib} MiB") for c in columns]
    master_ms = args.latency_ms if args.master_latency_ms is None else args.master_latency_ms
    print(f"{args.latency_ms:g} ms one way, {args.gbit:g} Gbit/s links, the master {master_ms:g} ms from each peer; "
          f"state {args.state_mib} MiB; median of {args.steps} steps, virtual seconds; "
          f"{'peer' if args.peer_commit else 'fast' if args.fast_commit else 'voted'} commit; "
          f"broadcast algorithm {args.broadcast_algorithm}")
    print(f"{'peers':>6} " + " ".join(f"{label:>18}" for label in labels) + f" {'step':>9} {'wall s':>8}")
    for n, figures, wall in rows:
        step = sum(figures[p] for p in phases)
        print(f"{n:>6} " + " ".join(f"{figures[c]:>18.4f}" for c in columns) + f" {step:>9.4f} {wall:>8.1f}")
    if len(rows) > 1:
        (n0, first, _), (n1, last, _) = rows[0], rows[-1]
        ratios = " ".join(f"{last[c] / first[c]:>18.2f}" if first[c] else f"{'-':>18}" for c in columns)
        step_ratio = sum(last[p] for p in phases) / sum(first[p] for p in phases)
        print(f"{f'{n1}/{n0}':>6} {ratios} {step_ratio:>9.2f}")


if __name__ == "__main__":
    main()
