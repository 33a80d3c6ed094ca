"""``pccl demo``: a local demo cluster — a master and N peer processes training in lockstep.

Each peer runs the recommended training loop through the public API: ``open_communicator``,
``Communicator.steps(state)`` (accept newcomers, wait while alone, sync the shared state), an
all-reduce of its gradient (``all_reduce_many``, which retries on the survivors when a peer dies
mid-op), and a deterministic update of the shared weights.  The model is deliberately tiny: each
peer pulls the weights toward its own random target, so the averaged gradient moves every peer's
copy identically and the loss visibly falls.

With ``--chaos`` the driver SIGKILLs a random peer every few seconds (once the group has taken a
step since the last kill) and starts a fresh one in its place; the newcomer downloads the
popular state at its first sync and continues at the same step.  At the end every peer prints
the xxh3-128 hash of its weights, and the driver checks they are all equal: bit-identical state
despite the kills.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio
import xxhash

from ..config import Config
from ..errors import CollectiveAborted, TooFewPeers
from ..types import ReduceOp

__all__ = ["add_parsers", "COMMANDS", "Cluster", "run_chaos"]

log = logging.getLogger(__name__)

#: Short timeouts so that a killed peer is noticed within a few seconds.
DEMO_CONFIG = Config(peer_timeout=3.0, heartbeat_interval=0.5, connect_timeout=5.0)
LEARNING_RATE = 0.05


def add_parsers(commands: Any) -> None:
    """Add ``demo`` (and the internal ``demo-peer``) to the ``pccl`` command's sub-parsers."""
    demo = commands.add_parser("demo", help="run a local demo cluster (master + N peer processes)")
    demo.add_argument("--peers", type=int, default=3, help="number of peer processes (default %(default)s)")
    demo.add_argument("--steps", type=int, default=30, help="training steps (default %(default)s)")
    demo.add_argument("--size", type=int, default=1_000_000,
                      help="float32 parameters in the shared state (default %(default)s)")
    demo.add_argument("--chaos", action="store_true",
                      help="SIGKILL a random peer every --chaos-interval seconds and start a new one")
    demo.add_argument("--chaos-interval", type=float, default=2.0,
                      help="seconds between kills with --chaos (default %(default)s)")
    demo.add_argument("--step-time", type=float, default=0.1,
                      help="seconds of simulated compute per step (default %(default)s)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seeds the peers' targets and the choice of chaos victims (default %(default)s)")
    demo.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    demo.add_argument("--status", metavar="HOST:PORT",
                      help="serve the master's status page here (a bare PORT: loopback; default: off)")

    # No help: a sub-command without one gets no line in ``pccl --help`` (help=SUPPRESS would
    # print "==SUPPRESS==" there); cli.py leaves it out of the choices shown.
    peer = commands.add_parser("demo-peer")
    peer.add_argument("--master", required=True)
    peer.add_argument("--name", required=True)
    peer.add_argument("--steps", type=int, required=True)
    peer.add_argument("--size", type=int, required=True)
    peer.add_argument("--seed", type=int, default=0)
    peer.add_argument("--step-time", type=float, default=0.0)


# --- one peer ---------------------------------------------------------------------------------


def _emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


async def _peer_main(args: argparse.Namespace) -> None:
    from .. import SharedState, open_communicator

    token = os.environ.get("PCCL_TOKEN") or None
    rng = np.random.default_rng([args.seed, zlib.crc32(args.name.encode())])
    target = rng.standard_normal(args.size, dtype=np.float32)
    weights = np.zeros(args.size, np.float32)
    grad = np.empty_like(weights)
    state = SharedState({"weights": weights}, revision=0)
    # TLS when $PCCL_TLS_CERT/KEY/CA are set (the driver's master reads the same variables).
    async with open_communicator(args.master, token=token, config=DEMO_CONFIG.with_tls_from_env()) as comm:
        _emit(event="joined", world=comm.world_size)
        async for info in comm.steps(state):
            if state.revision >= args.steps:
                break
            # d/dw mean((w - target)^2) — each peer pulls toward its own target.
            np.subtract(weights, target, out=grad)
            grad *= 2.0
            await trio.sleep(args.step_time)  # stands in for the forward/backward pass
            try:
                reduced = await comm.all_reduce_many([grad], op=ReduceOp.AVG)
            except TooFewPeers:
                continue  # alone: steps() waits for a newcomer
            except CollectiveAborted:
                continue
            weights -= np.float32(LEARNING_RATE) * grad
            state.revision += 1
            loss = float(np.mean(np.square(weights - target)))
            _emit(event="step", step=state.revision, world=reduced.world_size, loss=round(loss, 5),
                  sync_rx=info.rx_bytes, reduce_tx=reduced.tx_bytes)
        _emit(event="done", step=state.revision, hash=xxhash.xxh3_128_hexdigest(weights.data))


def _run_peer(args: argparse.Namespace) -> int:
    trio.run(_peer_main, args)
    return 0


# --- the driver -------------------------------------------------------------------------------


@dataclass
class Cluster:
    """The demo driver's view of its peers: processes by name, their final reports, the kills."""

    master: str
    args: argparse.Namespace
    procs: dict[str, trio.Process] = field(default_factory=dict)
    finals: dict[str, dict] = field(default_factory=dict)
    killed: list[str] = field(default_factory=list)
    #: Set when the first peer reports it finished; stragglers get a grace period, then SIGKILL.
    first_done: trio.Event = field(default_factory=trio.Event)
    spawned: int = 0
    last_step: int = 0


async def _pump_output(cluster: Cluster, name: str, proc: trio.Process) -> None:
    buffer = b""
    assert proc.stdout is not None
    async for chunk in proc.stdout:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                print(f"[{name}] {line.decode(errors='replace')}")
                continue
            if record.get("event") == "step":
                cluster.last_step = max(cluster.last_step, record["step"])
                print(f"[{name}] step {record['step']:>4}  world {record['world']}  loss {record['loss']:.5f}"
                      f"  sync rx {record['sync_rx']:>9} B  all-reduce tx {record['reduce_tx']:>9} B")
            elif record.get("event") == "done":
                cluster.finals[name] = record
                cluster.first_done.set()
                print(f"[{name}] done at step {record['step']}, weights hash {record['hash']}")
            elif record.get("event") == "joined":
                print(f"[{name}] joined (world {record['world']})")
            else:
                print(f"[{name}] " + ", ".join(f"{k} {v}" for k, v in record.items()))


async def _spawn(cluster: Cluster, nursery: trio.Nursery) -> None:
    name = f"peer{cluster.spawned}"
    cluster.spawned += 1
    args = cluster.args
    # -P: the child imports the installed pccl even when the current directory holds a pccl/.
    cmd = [sys.executable, "-P", "-m", "pccl", "--log-level", "WARNING", "demo-peer", "--master", cluster.master,
           "--name", name, "--steps", str(args.steps), "--size", str(args.size), "--seed", str(args.seed),
           "--step-time", str(args.step_time)]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    cluster.procs[name] = proc
    print(f"[demo] started {name} (pid {proc.pid})")
    nursery.start_soon(_pump_output, cluster, name, proc)


def _chaos_over(cluster: Cluster) -> bool:
    """Whether the chaos must stop: a peer finished, or the run is past two thirds of its steps
    (a newcomer started later could find every other peer finished and wait alone)."""
    return cluster.first_done.is_set() or cluster.last_step >= cluster.args.steps * 2 // 3


async def run_chaos(cluster: Cluster, nursery: trio.Nursery, rng: random.Random,
                    spawn: Callable[[Cluster, trio.Nursery], Awaitable[None]] | None = None) -> None:
    """Every ``--chaos-interval`` seconds SIGKILL a random peer that is still training and start
    a newcomer (``spawn``, default: a new peer process), until :func:`_chaos_over`.

    A kill waits for the group to finish a step after the previous one: on a loaded machine a
    newcomer can take longer to start than the interval, and kills at a fixed pace then took
    every peer before the group could step again (the run never ended)."""
    spawn = spawn or _spawn
    stepped_past = -1  # the step reported when the last kill happened (none yet)
    while not _chaos_over(cluster):
        await trio.sleep(cluster.args.chaos_interval)
        if _chaos_over(cluster):  # checked again: the run went on during the sleep
            break
        if cluster.last_step <= stepped_past:
            continue  # no step since the last kill
        # Only peers still training: one that reported "done" may not have exited yet.
        live = sorted(n for n, p in cluster.procs.items() if p.returncode is None and n not in cluster.finals)
        if len(live) < 2:
            continue
        victim = rng.choice(live)
        stepped_past = cluster.last_step
        cluster.procs[victim].send_signal(signal.SIGKILL)
        cluster.killed.append(victim)
        print(f"[demo] SIGKILL {victim} at step ~{cluster.last_step}")
        await spawn(cluster, nursery)


async def _demo_main(args: argparse.Namespace) -> int:
    from ..master import open_master

    problems = [msg for bad, msg in ((args.peers < 2, "--peers must be at least 2"),
                                     (args.steps < 1, "--steps must be at least 1"),
                                     (args.size < 0, "--size must not be negative"),
                                     (args.step_time < 0, "--step-time must not be negative"),
                                     (args.chaos_interval <= 0, "--chaos-interval must be positive"))
                if bad]
    if problems:
        print("[demo] " + "; ".join(problems), file=sys.stderr)
        return 2
    token = os.environ.get("PCCL_TOKEN") or None
    async with open_master("127.0.0.1:0", token=token, config=DEMO_CONFIG.with_tls_from_env(),
                           status=args.status) as master:
        cluster = Cluster(master.address, args)
        if master.status_address is not None:
            print(f"[demo] status page on http://{master.status_address}/")
        print(f"[demo] master on {master.address}; {args.peers} peers, {args.steps} steps, "
              f"{args.size} float32 parameters{', chaos on' if args.chaos else ''}")
        with trio.move_on_after(args.timeout) as deadline:
            async with trio.open_nursery() as nursery:
                for _ in range(args.peers):
                    await _spawn(cluster, nursery)
                chaos_scope = trio.CancelScope()
                if args.chaos:
                    async def chaos() -> None:
                        with chaos_scope:
                            await run_chaos(cluster, nursery, random.Random(args.seed))
                    nursery.start_soon(chaos)
                # A peer that joined just as the others finished waits alone for a partner
                # forever (that is the protocol: it waits while alone) — give stragglers a grace
                # period after the first peer finished, then stop them.
                with trio.move_on_after(float("inf")) as grace:
                    async def stop_stragglers() -> None:
                        await cluster.first_done.wait()
                        grace.deadline = trio.current_time() + 10.0
                    nursery.start_soon(stop_stragglers)
                    while any(p.returncode is None for p in cluster.procs.values()):
                        for proc in list(cluster.procs.values()):
                            await proc.wait()
                chaos_scope.cancel()
                for proc in cluster.procs.values():
                    if proc.returncode is None:
                        proc.kill()
                nursery.cancel_scope.cancel()
        for proc in cluster.procs.values():
            if proc.returncode is None:
                proc.kill()
        if deadline.cancelled_caught:
            print(f"[demo] timed out after {args.timeout} s", file=sys.stderr)
            return 1
    hashes = {record["hash"] for record in cluster.finals.values()}
    survivors = sorted(cluster.finals)
    print(f"[demo] finished: {len(survivors)} peers completed {args.steps} steps; "
          f"killed {len(cluster.killed)} ({', '.join(cluster.killed) or 'none'})")
    if len(hashes) == 1 and survivors:
        print(f"[demo] all surviving peers hold bit-identical weights: {hashes.pop()}")
        return 0
    print(f"[demo] MISMATCH: weights differ between peers: {cluster.finals}", file=sys.stderr)
    return 1


def _run_demo(args: argparse.Namespace) -> int:
    return trio.run(_demo_main, args)


COMMANDS = {"demo": _run_demo, "demo-peer": _run_peer}
