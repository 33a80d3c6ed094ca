"""all_reduce_many over a real model's parameter list: bucketed, per tensor, flat, and Gloo.

    .venv/bin/python benchmarks/bucketed_many.py [--peers 2] [--width 768] [--iters 5]

The list is GPT-2 small's (148 float32 tensors, 124 M parameters at ``--width 768``: token and
position embeddings, 12 blocks of layer norms, attention and MLP weights and biases, the final
norm).  Each peer process holds it once, plus one flat buffer of the same bytes, and a Gloo
process group besides its pccl communicator; every iteration times, in an order shuffled afresh
each iteration (the same on every rank), one call of each configuration on the same data:

* ``bucketed``: ``comm.all_reduce_many(params)`` with the default ``bucket_bytes`` (or
  ``--bucket-bytes``): buckets above ``SEGMENTED_MIN_BYTES`` run in place over their members;
* ``packed``: how pccl bucketed before segmented buckets: every bucket packed into scratch and
  unpacked afterwards (``SEGMENTED_MIN_BYTES`` raised for the call), 25 MiB buckets;
* ``per-tensor``: ``comm.all_reduce_many(params, bucket_bytes=0)`` (one op per tensor);
* ``flat``: ``comm.all_reduce(flat)`` — one all-reduce of the same bytes, in place;
* ``gloo``: ``dist.all_reduce(t)`` for every tensor of the list in a loop (in a worker thread,
  so the peer's Trio loop keeps answering the master meanwhile).

A call's time is the slowest rank's; the table shows the median and minimum over iterations
and each configuration's median relative to ``flat`` and to ``gloo``.  The peers meet at a tiny
pccl all-reduce (a barrier) before each timed call.  This is a measurement tool: wall-clock time
is what it is for.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

from interleaved_gloo import run_cluster  # the same master and peer processes (this folder is on sys.path)
from pccl.tools.bench import admit

CONFIGS = ("bucketed", "packed", "per-tensor", "flat", "gloo")
_BARRIER_TAG = 1 << 30


def gpt2_shapes(width: int = 768, layers: int = 12, vocab: int = 50257, context: int = 1024) -> list[tuple[int, ...]]:
    """The parameter shapes of GPT-2 (small at the defaults), in ``named_parameters()`` order."""
    shapes: list[tuple[int, ...]] = [(vocab, width), (context, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width), (width,),
                   (width,), (width,), (width, 4 * width), (4 * width,), (4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


def _peer_main(rank: int, world: int, port: int, gloo_file: str, width: int, iters: int,
               bucket_bytes: int | None) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    import trio

    import pccl
    from pccl.collectives import buckets
    from pccl.collectives.buffers import SCRATCH

    # A training loop runs one of these configurations every step, and pccl's scratch arena keeps
    # the buffers it needs warm (fresh pages cost page faults).  Here four configurations take
    # turns, and together they need more than the arena's default 1 GiB: let it keep them all,
    # so that no configuration pays for another's buffers.
    SCRATCH.retain_bytes = 4 << 30
    dist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=world)
    generator = torch.Generator().manual_seed(rank)
    params = [torch.randn(shape, generator=generator) for shape in gpt2_shapes(width)]
    flat = torch.cat([p.reshape(-1) for p in params])
    many_kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    segmented_min = buckets.SEGMENTED_MIN_BYTES

    def gloo_loop() -> float:
        t0 = time.perf_counter()
        for p in params:
            dist.all_reduce(p)
        return time.perf_counter() - t0

    async def run() -> dict[str, list[float]]:
        out: dict[str, list[float]] = {c: [] for c in CONFIGS}
        async with pccl.open_communicator(f"127.0.0.1:{port}") as comm:
            await admit(comm, world)
            small = np.ones(4, np.float32)
            for i in range(iters + 1):  # iteration 0 warms up (page faults, scratch memory)
                for cfg in random.Random(i).sample(CONFIGS, len(CONFIGS)):
                    small[:] = 1
                    await comm.all_reduce(small, tag=_BARRIER_TAG)
                    t0 = time.perf_counter()
                    if cfg == "gloo":
                        elapsed = await trio.to_thread.run_sync(gloo_loop)
                    else:
                        if cfg == "bucketed":
                            await comm.all_reduce_many(params, **many_kw)
                        elif cfg == "packed":
                            buckets.SEGMENTED_MIN_BYTES = 1 << 62
                            try:
                                await comm.all_reduce_many(params, bucket_bytes=buckets.PACKED_BUCKET_BYTES)
                            finally:
                                buckets.SEGMENTED_MIN_BYTES = segmented_min
                        elif cfg == "per-tensor":
                            await comm.all_reduce_many(params, bucket_bytes=0)
                        else:
                            await comm.all_reduce(flat)
                        elapsed = time.perf_counter() - t0
                    if i:
                        out[cfg].append(elapsed)
                # the sums grow by a factor of `world` per call: keep them finite and comparable
                with torch.no_grad():
                    for p in params:
                        p.mul_(1.0 / world ** 3)
                    flat.mul_(1.0 / world)
            small[:] = 1
            await comm.all_reduce(small, tag=_BARRIER_TAG)  # nobody leaves while others time
        return out

    try:
        return trio.run(run)
    finally:
        dist.destroy_process_group()


def measure(world: int, width: int, iters: int, timeout: float,
            bucket_bytes: int | None = None) -> dict[str, list[float]]:
    per_rank = run_cluster(world, _peer_main, (width, iters, bucket_bytes), timeout, "pccl-bucketed-")
    return {cfg: [max(per_rank[r][cfg][i] for r in range(world)) for i in range(iters)] for cfg in CONFIGS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--width", type=int, default=768, help="model width (768: GPT-2 small)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="bucket_bytes of the bucketed configuration (default: pccl's)")
    args = parser.parse_args(argv)
    shapes = gpt2_shapes(args.width)
    nbytes = 4 * sum(int(np.prod(s)) for s in shapes)
    print(f"# {len(shapes)} float32 tensors, {nbytes / 2**20:.1f} MiB, {args.peers} peers, "
          f"{args.iters} iterations, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}, "
          f"bucket_bytes {args.bucket_bytes or 'default'}", flush=True)
    times = measure(args.peers, args.width, args.iters, args.timeout, args.bucket_bytes)
    med = {cfg: statistics.median(ts) for cfg, ts in times.items()}
    print(f"{'config':>11} {'median ms':>10} {'min ms':>9} {'/ flat':>7} {'/ gloo':>7}")
    for cfg in CONFIGS:
        print(f"{cfg:>11} {med[cfg] * 1e3:>10.1f} {min(times[cfg]) * 1e3:>9.1f} {med[cfg] / med['flat']:>7.3f} "
              f"{med[cfg] / med['gloo']:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
