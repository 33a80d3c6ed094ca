"""The master's CPU per collective on loopback (not a test: figures vary with load).

    .venv/bin/python benchmarks/master_cpu.py [--peers 2 3] [--size 16K] [--iters 1000]
                                              [--fast-commit [--peer-commit]] [--profile FILE]

A master process and ``N`` peer processes (spawn) on loopback.  The peers join, warm up with a
few all-reduces, then make ``--iters`` back-to-back all-reduces of ``--size`` bytes (one tag, no
barrier between calls).  The master notes ``time.process_time()`` just before the peers start
and just after they all finished; the figure is its CPU over the calls divided by ``--iters``:
what the master spends on one collective (read the votes, decode, the state machine, encode,
write), heartbeats included (a few per second).  Each peer's own CPU per call and the wall
time per call are printed beside it, for context (on a host with fewer cores than processes the
master's CPU is on the peers' critical path).

``--fast-commit`` runs the peers with ``Config.fast_commit`` (one master round trip per
collective); ``--peer-commit`` adds ``Config.peer_commit`` (the peers commit on their acks, the
master still reads every Begin and Done and sends its Commence and Complete).  ``--profile FILE`` runs the master's calls under cProfile and writes its stats to
``FILE`` (read them with ``python -m pstats FILE``; the CPU figure then includes the profiler's
overhead).

``--machine`` times the master's state machine alone instead, no processes and no I/O
(:class:`pccl.protocol.master.machine.MasterState`, as ``master_votes.py`` does for topology
votes): ``N`` accepted peers, then ``--iters`` all-reduces, each every peer's vote (or, with
``--fast-commit``, its ``CollectiveBegin``) and its ``CollectiveDone``, every frame decoded from
its bytes and every message the machine sends encoded; it prints the CPU per op.  Groups of up
to hundreds of peers fit (``--peers 2 64 256``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from typing import Any

from pccl.tools.bench import admit, format_size, free_port, parse_size

_TAG = 1
_WARMUP = 20


def _master_main(port: int, ready: Any, control: Any, profile: str | None) -> None:
    """Serve a master; on each message from ``control`` answer with ``time.process_time()`` and
    the user and system parts of it (``os.times()``, coarser)
    ("start" also starts the profiler, "stop" stops it and writes its stats)."""
    import cProfile

    import trio

    import pccl

    profiler = cProfile.Profile(time.process_time) if profile else None  # CPU, not wall time

    async def serve() -> None:
        async with pccl.open_master(f"127.0.0.1:{port}"):
            ready.set()
            while True:
                what = await trio.to_thread.run_sync(control.recv)
                if what == "stop" and profiler is not None:
                    profiler.disable()
                times = os.times()
                control.send((time.process_time(), times.user, times.system))
                if what == "start" and profiler is not None:
                    profiler.enable()
                if what == "stop":
                    if profiler is not None and profile is not None:
                        profiler.dump_stats(profile)
                    return

    trio.run(serve)


def _peer_main(rank: int, world: int, port: int, nbytes: int, iters: int, fast_commit: bool,
               go: Any, results: Any, peer_commit: bool = False) -> None:
    import numpy as np
    import trio

    import pccl

    async def run() -> tuple[float, float, float]:
        config = pccl.Config(fast_commit=fast_commit, peer_commit=peer_commit)
        async with pccl.open_communicator(f"127.0.0.1:{port}", config=config) as comm:
            await admit(comm, world)
            buf = np.ones(max(nbytes // 4, 1), dtype=np.float32)
            for _ in range(_WARMUP):
                await comm.all_reduce(buf, tag=_TAG)
            results.put((rank, "ready", None))
            await trio.to_thread.run_sync(go.wait)
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(iters):
                await comm.all_reduce(buf, tag=_TAG)
            cpu1, t1 = time.process_time(), time.perf_counter()
            await comm.all_reduce(buf, tag=_TAG)  # nobody leaves while others still call
            return cpu1 - cpu0, t0, t1

    try:
        results.put((rank, "done", trio.run(run)))
    except BaseException as exc:
        results.put((rank, "failed", repr(exc)))
        raise


def measure(world: int, nbytes: int, iters: int, fast_commit: bool, profile: str | None,
            timeout: float = 600, peer_commit: bool = False) -> dict[str, float]:
    """The master's CPU per call, the mean peer CPU per call and the wall time per call (s)."""
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    control, master_end = ctx.Pipe()
    port = free_port()
    master = ctx.Process(target=_master_main, args=(port, ready, master_end, profile), daemon=True)
    peers = [ctx.Process(target=_peer_main, args=(r, world, port, nbytes, iters, fast_commit, go, results,
                                                           peer_commit), daemon=True) for r in range(world)]
    deadline = time.monotonic() + timeout

    def wait_all(kind: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        while len(got) < world:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the peers did not report {kind!r} within {timeout:g} s")
            try:
                rank, what, out = results.get(timeout=1)
            except Exception:
                continue
            if what == "failed":
                raise RuntimeError(f"peer {rank} failed: {out}")
            got[rank] = out
        return got

    try:
        master.start()
        if not ready.wait(30):
            raise RuntimeError("the master did not start within 30 s")
        for p in peers:
            p.start()
        wait_all("ready")
        control.send("start")
        master0 = control.recv()
        go.set()
        done = wait_all("done")
        control.send("stop")
        master1 = control.recv()
        master.join(10)
    finally:
        for p in (*peers, master):
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join(5)
    wall = max(t1 for _, _, t1 in done.values()) - min(t0 for _, t0, _ in done.values())
    return {"master": (master1[0] - master0[0]) / iters, "user": (master1[1] - master0[1]) / iters,
            "sys": (master1[2] - master0[2]) / iters, "peer": sum(c for c, _, _ in done.values()) / world / iters,
            "wall": wall / iters}


def _quiet_cluster(n: int) -> tuple[Any, list[int], int]:
    """A machine with ``n`` accepted peers (connections 1..n) in one group, no vote standing,
    and the id of the round that installed their ring (what a ``CollectiveBegin`` names)."""
    import random

    from pccl.protocol import messages as m
    from pccl.protocol.master.machine import MasterState, MessageReceived, PeerConnected, Send

    machine = MasterState(rng=random.Random(0), peer_timeout=1e9)
    conns = list(range(1, n + 1))
    wired = [0]

    def handle(conn: int, msg: Any) -> None:
        todo = [(conn, msg)]
        while todo:
            effects = machine.handle(MessageReceived(*todo.pop()), 0.0)
            for e in effects:  # every peer wires the ring it is told to at once
                if isinstance(e, Send) and isinstance(e.msg, m.ConnectToPeers):
                    wired.append(e.msg.round)
                    todo.append((e.conn_id, m.P2PReport(e.msg.round, True)))

    for c in conns:
        machine.handle(PeerConnected(c, "10.0.0.1"), 0.0)
        handle(c, m.Register(0, 4000, 5000))
    for _ in range(3):  # the first peer was accepted alone; votes let the others in and end
        for p in machine.peers():
            if p.topology_vote is None:
                handle(p.conn_id, m.VoteTopology(True))
        if all(p.topology_vote is None and not p.in_round for p in machine.peers()):
            break
    if sum(p.status.value == "accepted" for p in machine.peers()) != n or any(
            p.topology_vote is not None or p.in_round for p in machine.peers()):
        raise RuntimeError("the cluster did not settle")
    return machine, conns, max(wired)


def measure_machine(world: int, iters: int, fast_commit: bool) -> float:
    """The machine's CPU per all-reduce (s), frames decoded and encoded."""
    from pccl.protocol import codec
    from pccl.protocol import messages as m
    from pccl.protocol.master.machine import MessageReceived, Send

    machine, conns, round_id = _quiet_cluster(world)
    prefix = codec.PREFIX_SIZE

    def feed(conn: int, frame: bytes) -> list[Any]:
        effects = machine.handle(MessageReceived(conn, codec.decode_message(frame[prefix:])), 0.0)
        for effect in effects:
            if isinstance(effect, Send):
                codec.encode_message(effect.msg)
        return effects

    init = codec.encode_message(m.CollectiveInit(_TAG, 4096, 1, 0))
    started = 0.0
    for i in range(iters + _WARMUP):
        if i == _WARMUP:
            started = time.process_time()
        if fast_commit:
            seq = m.derived_seq(round_id, _TAG, i)
            begin = codec.encode_message(m.CollectiveBegin(_TAG, seq, round_id, 4096, 1, 0))
            for conn in conns:
                feed(conn, begin)
        else:
            for conn in conns:
                effects = feed(conn, init)
            seq = next(e.msg.seq for e in effects if isinstance(e, Send) and isinstance(e.msg, m.CollectiveCommence))
        done = codec.encode_message(m.CollectiveDone(_TAG, seq))
        for conn in conns:
            effects = feed(conn, done)
        if sum(isinstance(e, Send) and isinstance(e.msg, m.CollectiveComplete) for e in effects) != world:
            raise RuntimeError(f"all-reduce {i} did not complete: {effects}")
    return (time.process_time() - started) / iters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--size", default="16K", help="all-reduce buffer size (4, 16K, 1M, ...)")
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--fast-commit", action="store_true", help="peers run with Config.fast_commit")
    parser.add_argument("--peer-commit", action="store_true", help="peers also run with Config.peer_commit")
    parser.add_argument("--profile", help="write the master's cProfile stats to this file (N appended)")
    parser.add_argument("--machine", action="store_true", help="time the master's state machine alone (no I/O)")
    args = parser.parse_args(argv)
    try:
        nbytes = parse_size(args.size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.peer_commit and (args.machine or not args.fast_commit):
        parser.error("--peer-commit needs --fast-commit (and is not for --machine)")
    if args.iters < 1 or min(args.peers) < 2:
        parser.error("--iters must be at least 1 and --peers at least 2")
    if args.machine:
        print(f"# the master's state machine alone, CPU per all-reduce, {args.iters} calls, "
              f"fast_commit={'on' if args.fast_commit else 'off'}")
        for world in dict.fromkeys(args.peers):
            print(f"{world:>4} peers: {measure_machine(world, args.iters, args.fast_commit) * 1e6:10.1f} us/op",
                  flush=True)
        return 0
    print(f"# master CPU per all-reduce of {format_size(nbytes)}, {args.iters} calls back to back, "
          f"fast_commit={'on' if args.fast_commit else 'off'}, peer_commit={'on' if args.peer_commit else 'off'}")
    print(f"{'N':>3} {'master us/op':>13} {'(user':>7} {'sys)':>6} {'peer us/op':>11} {'wall us/op':>11}")
    for world in dict.fromkeys(args.peers):
        profile = f"{args.profile}.{world}" if args.profile else None
        row = measure(world, nbytes, args.iters, args.fast_commit, profile, peer_commit=args.peer_commit)
        print(f"{world:>3} {row['master'] * 1e6:>13.1f} {row['user'] * 1e6:>7.0f} {row['sys'] * 1e6:>6.0f} "
              f"{row['peer'] * 1e6:>11.1f} {row['wall'] * 1e6:>11.1f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
