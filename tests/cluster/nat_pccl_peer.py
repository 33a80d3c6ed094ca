"""A training peer for the real-NAT pccl tests (``test_nat_pccl.py``), run inside a namespace.

    nat_pccl_peer.py --master HOST:PORT --name NAME --plan FILE [--size N] [--p2p-port P --ss-port S]

The token comes from ``$PCCL_TOKEN``, an advertisement (if any) from ``$PCCL_ADVERTISE`` (pccl
reads it itself).  The loop is the recommended one (``Communicator.steps``): each step
all-reduces (AVG) the peer's gradient toward its own random target (from ``NAME``) and moves the
shared weights by it, so the weights depend on every peer's contribution and on the order of
the steps: peers that ever diverged would end with different hashes.

The test steers the run through the JSON file ``--plan`` (written atomically), read after every
sync (all peers stand at the same revision there):

* ``min_world``: no step (the revision stays) until the group has that many peers;
* ``optimize``: at revision 0, with ``min_world`` peers, call ``optimize_topology()`` once
  (bandwidth probes between every pair: every pair's path is negotiated and reported);
* ``hold``: at that revision, print ``held`` and wait until the file ``<plan>.go<REV>`` exists
  (the test starts a newcomer, kills a peer, rewrites the plan meanwhile), then re-read the plan;
* ``bulk`` / ``bulk_floats``: the all-reduce of that revision carries ``bulk_floats`` more
  float32 values (a long op, for a fault mid-op);
* ``stop``: leave at that revision.

Prints one JSON object per line: ``joined``, ``held``, ``op_start``, ``aborted`` (a
``CollectiveAborted``: the step is retried), ``step``, ``done`` (revision, the xxh3-128 of the
weights, the peer's paths from ``statistics()``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pathlib
import zlib

import numpy as np
import trio
import xxhash

import pccl

LEARNING_RATE = 0.05


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def read_plan(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


async def main(args: argparse.Namespace) -> None:
    plan_path = pathlib.Path(args.plan)
    ports = {}
    if args.p2p_port:
        # a port-mapped host: its ports are pinned, or the mapping would not hold
        ports = dict(p2p_base_port=args.p2p_port, shared_state_base_port=args.ss_port, port_search_range=1)
    # Generous timeouts: the machine is shared and loaded; a SIGKILLed process's connections are
    # closed by its kernel at once, so nothing here waits for a timeout to notice a death.
    config = pccl.Config(peer_timeout=20.0, heartbeat_interval=0.5, connect_timeout=10.0,
                         probe_seconds=0.2, probe_streams=1, **ports)
    rng = np.random.default_rng(zlib.crc32(args.name.encode()))
    target = rng.standard_normal(args.size, dtype=np.float32)
    weights = np.zeros(args.size, np.float32)
    state = pccl.SharedState({"weights": weights}, revision=0)
    optimized = False
    first = True
    released: set[int] = set()
    async with pccl.open_communicator(args.master, token=os.environ.get("PCCL_TOKEN"), config=config) as comm:
        emit(event="joined", peer_id=f"{comm.peer_id:016x}", world=comm.world_size)
        async for info in comm.steps(state):
            plan = read_plan(plan_path)
            revision = state.revision
            if first:
                emit(event="synced", revision=revision, rx_bytes=info.rx_bytes, world=comm.world_size)
                first = False
            if plan.get("stop") is not None and revision >= plan["stop"]:
                break
            if plan.get("hold") == revision and revision not in released:
                released.add(revision)
                go = plan_path.with_name(f"{plan_path.name}.go{revision}")
                emit(event="held", revision=revision, world=comm.world_size)
                while not go.exists():
                    await trio.sleep(0.05)
                continue  # meet the others (and any newcomer) at update_topology
            if comm.world_size < plan.get("min_world", 2):
                await trio.sleep(0.1)
                continue
            if plan.get("optimize") and revision == 0 and not optimized:
                await comm.optimize_topology()
                optimized = True
                emit(event="optimized", ring=[f"{p:016x}" for p in comm.ring])
            grad = 2.0 * (weights - target)
            extra = plan.get("bulk_floats", 0) if plan.get("bulk") == revision else 0
            buffer = np.concatenate([grad, np.full(extra, 1.0, np.float32)]) if extra else grad
            emit(event="op_start", revision=revision, world=comm.world_size, floats=int(buffer.size))
            try:
                reduced = await comm.all_reduce(buffer, op=pccl.ReduceOp.AVG)
            except pccl.CollectiveAborted as exc:
                emit(event="aborted", revision=revision, error=str(exc)[:300])
                continue
            except pccl.TooFewPeers:
                continue
            if extra and not np.all(buffer[args.size:] == 1.0):
                raise AssertionError("the bulk part of the all-reduce came back wrong")
            weights -= np.float32(LEARNING_RATE) * buffer[: args.size]
            state.revision += 1
            emit(event="step", revision=state.revision, world=reduced.world_size)
        stats = comm.statistics()
        emit(event="done", peer_id=f"{comm.peer_id:016x}", revision=state.revision,
             hash=xxhash.xxh3_128_hexdigest(weights.data),
             paths=[[f"{peer:016x}", port, kind, via] for peer, port, kind, via in stats.paths])
        # Stay a moment: a peer that leaves at once can end the others' last sync early.
        await trio.sleep(0.5)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--plan", required=True)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--p2p-port", type=int, default=0)
    parser.add_argument("--ss-port", type=int, default=0)
    # pccl's log lines go to stderr (the test merges them into the output it shows on failure)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(main, parser.parse_args())
