"""A hostile host against a running job: the figures of issue 19 (not a test: times vary with load).

    python benchmarks/hostile_network.py idle [--connections 1000] [--seconds 8]
    python benchmarks/hostile_network.py memory [--connections 200]

``idle``: a master and two peers, each an OS process, run the recommended loop (``steps()``, a
1 MiB all-reduce per step) on 127.0.0.1.  This process then holds ``--connections`` idle
connections from 127.0.0.2 open to each of the master's port, one peer's ring port and the same
peer's shared-state port — reopening each one the moment it is closed — while a newcomer
process joins and downloads the 4 MiB state.  Printed side by side from one run: the loop's
median step time without and with the flood (and their ratio), the newcomer's join time
(``open_communicator`` until it returns) and download without and with the flood, and the
master's kick count (must stay 0).

``memory``: a master and one peer process.  ``--connections`` connections to each of the three
ports, each from its own address (127.0.1.x, so the admission lets as many in as it can),
complete the handshake (no token), announce a 16 MiB control frame and send 1,000 bytes of it;
printed: the resident memory of the master and the peer before and while they hang there.

The slow test ``tests/e2e/test_hostile_network.py::test_full_figures`` runs both and checks the
figures that are not speeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import trio

import pccl
from pccl.protocol import codec, handshake
from pccl.protocol import messages as m

CONFIG = pccl.Config(peer_timeout=5.0, heartbeat_interval=0.5, connect_timeout=10.0, p2p_base_port=0,
                     shared_state_base_port=0)
FLOOD_SOURCE = "127.0.0.2"
STATE_FLOATS = 1 << 20  # 4 MiB of shared state
GRAD_FLOATS = 1 << 18  # a 1 MiB all-reduce per step
MIB = 1024 * 1024


def _raise_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _emit(**record: Any) -> None:
    print(json.dumps(record), flush=True)


# --- the child processes ------------------------------------------------------------------------


async def _master() -> None:
    async with pccl.open_master("127.0.0.1:0", config=CONFIG) as master:
        _emit(address=master.address)
        while True:
            s = master.statistics()
            _emit(kicks=s.kicks, unproven=s.unproven_connections, waiting=s.waiting_connections,
                  refused=s.refused_connections, accepted=s.accepted_peers)
            await trio.sleep(0.5)


def _state(zeros: bool) -> pccl.SharedState:
    w = np.zeros(STATE_FLOATS, np.float32) if zeros else np.linspace(0, 1, STATE_FLOATS, dtype=np.float32)
    return pccl.SharedState({"w": w}, revision=0)


async def _looper(master: str) -> None:
    """A peer running the recommended loop; one line per step."""
    state = _state(zeros=False)
    grads = np.ones(GRAD_FLOATS, np.float32)
    async with pccl.open_communicator(master, config=CONFIG) as comm:
        _emit(ring=comm._session.p2p_listener.address, state=comm._sync.listener.address)  # noqa: SLF001
        last = time.perf_counter()
        async for _info in comm.steps(state):
            buf = grads.copy()
            try:
                await comm.all_reduce(buf, op=pccl.ReduceOp.AVG)
            except pccl.CollectiveAborted:
                continue  # a peer left mid-op (the newcomer leaving)
            state["w"][:GRAD_FLOATS] -= 0.001 * buf
            state.revision += 1
            now = time.perf_counter()
            _emit(step=now - last, world=comm.world_size)
            last = now


async def _newcomer(master: str) -> None:
    """Join, download the state through steps(), do one all-reduce, leave."""
    state = _state(zeros=True)
    start = time.perf_counter()
    async with pccl.open_communicator(master, config=CONFIG) as comm:
        joined = time.perf_counter() - start
        async for info in comm.steps(state):
            synced = time.perf_counter() - start - joined
            _emit(join=joined, sync=synced, rx=info.rx_bytes, expected=state.nbytes,
                  same=bool(state["w"][-1] != 0))
            break


async def _lone_peer(master: str) -> None:
    async with pccl.open_communicator(master, config=CONFIG) as comm:
        _emit(ring=comm._session.p2p_listener.address, state=comm._sync.listener.address)  # noqa: SLF001
        await trio.sleep_forever()


# --- the orchestration --------------------------------------------------------------------------


class Child:
    """A role of this script in its own process; its JSON lines are collected as they come."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.records: list[dict[str, Any]] = []
        self.changed = trio.Event()

    async def read(self) -> None:
        assert self.process.stdout is not None
        pending = b""
        async for chunk in self.process.stdout:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"{"):
                    self.records.append(json.loads(line))
            self.changed.set()
            self.changed = trio.Event()

    async def wait_for(self, key: str, *, after: int = 0, timeout: float = 60.0) -> dict[str, Any]:
        with trio.fail_after(timeout):
            while True:
                for record in self.records[after:]:
                    if key in record:
                        return record
                if self.process.returncode is not None:
                    raise RuntimeError(f"child {self.process.args} exited ({self.process.returncode}) before {key!r}")
                await self.changed.wait()

    def values(self, key: str, since: int = 0) -> list[Any]:
        return [r[key] for r in self.records[since:] if key in r]

    def latest(self, key: str) -> Any:
        return self.values(key)[-1]


@contextlib.asynccontextmanager
async def _children() -> AsyncIterator[Any]:
    started: list[Child] = []
    async with trio.open_nursery() as nursery:

        async def spawn(*args: str) -> Child:
            process = await trio.lowlevel.open_process([sys.executable, __file__, *args], stdout=subprocess.PIPE)
            child = Child(process)
            started.append(child)
            nursery.start_soon(child.read)
            return child

        try:
            yield spawn
        finally:
            with trio.CancelScope(shield=True):
                for child in reversed(started):  # the peers before the master they would miss
                    with contextlib.suppress(ProcessLookupError):
                        child.process.kill()
                    await child.process.wait()
            nursery.cancel_scope.cancel()


async def _hold_idle(address: str, count: int, opened: list[int], stop: trio.Event) -> None:
    """``count`` connections to ``address`` that say nothing, each reopened when closed."""
    host, port = address.rsplit(":", 1)

    async def one() -> None:
        while not stop.is_set():
            try:
                stream = await trio.open_tcp_stream(host, int(port), local_address=FLOOD_SOURCE)
            except OSError:
                await trio.sleep(0.05)
                continue
            opened[0] += 1
            try:
                while await stream.receive_some(4096):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            await stream.aclose()
            await trio.sleep(0.01)  # the server closed it: reopen, as a flood would

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one)
        await stop.wait()
        nursery.cancel_scope.cancel()


async def run_idle(connections: int = 1000, seconds: float = 8.0) -> dict[str, Any]:
    """The ``idle`` figures (see the module docstring) as a dict."""
    _raise_descriptor_limit()
    async with _children() as spawn:
        master = await spawn("_master")
        address = (await master.wait_for("address"))["address"]
        loopers = [await spawn("_looper", address) for _ in range(2)]
        ports = [await looper.wait_for("ring") for looper in loopers]
        await loopers[0].wait_for("step", timeout=120)

        async def window() -> list[float]:
            since = len(loopers[0].records)
            await trio.sleep(seconds)
            return loopers[0].values("step", since)

        quiet_steps = await window()
        quiet_newcomer = await spawn("_newcomer", address)
        quiet = await quiet_newcomer.wait_for("join", timeout=120)

        stop, opened = trio.Event(), [0]
        async with trio.open_nursery() as nursery:
            for target in (address, ports[0]["ring"], ports[0]["state"]):
                nursery.start_soon(_hold_idle, target, connections, opened, stop)
            with trio.fail_after(120):
                while opened[0] < 3 * connections:
                    await trio.sleep(0.1)
            flooded_steps = await window()
            newcomer = await spawn("_newcomer", address)
            flooded = await newcomer.wait_for("join", timeout=120)
            await trio.sleep(1.0)  # one more master report
            master_stats = master.records[-1]
            stop.set()
        world = loopers[0].latest("world")
    quiet_median, flooded_median = statistics.median(quiet_steps), statistics.median(flooded_steps)
    return {
        "connections_per_port": connections,
        "opened": opened[0],
        "step_quiet": quiet_median,
        "step_flooded": flooded_median,
        "step_ratio": flooded_median / quiet_median,
        "join_quiet": quiet["join"],
        "join_flooded": flooded["join"],
        "download_quiet": quiet["sync"],
        "download_flooded": flooded["sync"],
        "download_ok": flooded["rx"] == flooded["expected"] and flooded["same"],
        "kicks": master_stats["kicks"],
        "master_waiting": master_stats["waiting"],
        "master_refused": master_stats["refused"],
        "world_after": world,
    }


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def _announce(address: str, source: str) -> trio.SocketStream:
    host, port = address.rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port), local_address=source)
    hello = m.Hello(role=m.HandshakeRole.CLIENT, has_token=False, nonce=bytes(handshake.NONCE_SIZE))
    await stream.send_all(handshake.encode_preamble() + codec.encode_message(hello, max_frame_size=1024)
                          + struct.pack(">IB", 16 * MIB - 1, codec.FrameKind.CONTROL) + b"\x00" * 1000)
    return stream


async def run_memory(connections: int = 200) -> dict[str, Any]:
    """The ``memory`` figures (see the module docstring) as a dict."""
    _raise_descriptor_limit()
    async with _children() as spawn:
        master = await spawn("_master")
        address = (await master.wait_for("address"))["address"]
        peer = await spawn("_lone_peer", address)
        ports = await peer.wait_for("ring")
        await trio.sleep(1.0)
        pids = {"master": master.process.pid, "peer": peer.process.pid}
        before = {name: _rss(pid) for name, pid in pids.items()}
        streams = []
        for target in (address, ports["ring"], ports["state"]):
            for i in range(connections):
                streams.append(await _announce(target, f"127.0.{1 + i // 250}.{1 + i % 250}"))
        await trio.sleep(2.0)
        during = {name: _rss(pid) for name, pid in pids.items()}
        for stream in streams:
            await stream.aclose()
    return {"connections_per_port": connections,
            **{f"{name}_before_mib": before[name] / MIB for name in pids},
            **{f"{name}_during_mib": during[name] / MIB for name in pids},
            **{f"{name}_growth_mib": (during[name] - before[name]) / MIB for name in pids}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    idle = sub.add_parser("idle")
    idle.add_argument("--connections", type=int, default=1000)
    idle.add_argument("--seconds", type=float, default=8.0)
    memory = sub.add_parser("memory")
    memory.add_argument("--connections", type=int, default=200)
    for role in ("_master", "_looper", "_newcomer", "_lone_peer"):
        child = sub.add_parser(role)
        if role != "_master":
            child.add_argument("master")
    args = parser.parse_args(argv)
    if args.command == "idle":
        r = trio.run(run_idle, args.connections, args.seconds)
        print(f"{args.connections} idle connections from {FLOOD_SOURCE} held open (reopened when closed; "
              f"{r['opened']} opened) to the master, a peer's ring port and its shared-state port:")
        print(f"  step time (median, 2-peer loop): {r['step_quiet'] * 1e3:.1f} ms quiet, "
              f"{r['step_flooded'] * 1e3:.1f} ms flooded (ratio {r['step_ratio']:.2f})")
        print(f"  newcomer join: {r['join_quiet']:.3f} s quiet, {r['join_flooded']:.3f} s flooded")
        print(f"  newcomer download of {STATE_FLOATS * 4 // MIB} MiB: {r['download_quiet']:.3f} s quiet, "
              f"{r['download_flooded']:.3f} s flooded, complete and correct: {r['download_ok']}")
        print(f"  master: {r['kicks']} kicks, {r['master_waiting']} connections parked, "
              f"{r['master_refused']} refused; world size after: {r['world_after']}")
    elif args.command == "memory":
        r = trio.run(run_memory, args.connections)
        print(f"{args.connections} connections per port (master, ring, shared state), each announcing 16 MiB "
              "and sending 1,000 bytes:")
        for name in ("master", "peer"):
            print(f"  {name}: {r[f'{name}_before_mib']:.0f} MiB resident before, {r[f'{name}_during_mib']:.0f} MiB "
                  f"during (+{r[f'{name}_growth_mib']:.1f} MiB)")
    else:
        _raise_descriptor_limit()
        role = {"_master": _master, "_looper": _looper, "_newcomer": _newcomer, "_lone_peer": _lone_peer}
        fn = role[args.command]
        trio.run(fn) if args.command == "_master" else trio.run(fn, args.master)


if __name__ == "__main__":
    main()
