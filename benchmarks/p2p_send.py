"""Point-to-point ``send`` throughput vs. a raw socket pair, in the same run.

    python benchmarks/p2p_send.py [--mib 64] [--count 8] [--repeats 3]

*raw*: one thread ``sendall``s the payload, the other ``recv_into``s it (``MSG_WAITALL``: one
call per message, as fast as a receiving thread gets), on plain blocking
loopback sockets with TCP_NODELAY — the ceiling for one TCP stream on this machine — once with
the kernel's buffer autotuning (*auto*) and once with the buffers pccl sets on a same-host
connection (*bufs*: ``Config.local_socket_buffer_size``).  *send*: two peer processes of one run (a master on a thread of this
process); the sender times ``--count`` consecutive ``comm.send(x, to=receiver)`` of ``--mib``
MiB each (after one warm-up message, which dials the pair's connections), the receiver keeps a
``comm.recv`` posted.  A send completes when the receiver has acknowledged the whole payload,
so the figure includes the rendezvous, the receiver's backup copy of its array (what restores
it after a failed recv) and the acknowledgement.  Methods alternate within each repeat; the table shows the best and the
median of the repeats and the ratio send/raw of the bests.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import trio

import pccl

MIB = 1024 * 1024
CONFIG = pccl.Config(p2p_base_port=0)


def raw_transfer(payload: np.ndarray, count: int, *, pccl_buffers: bool) -> float:
    """Seconds to move ``count`` copies of ``payload`` over loopback with blocking sockets:
    with the kernel's buffer autotuning, or (``pccl_buffers``) with the buffers
    :class:`~pccl.net.tcp.TcpNetwork` gives a same-host connection by default
    (``Config.local_socket_buffer_size`` after connecting, when ``socket_buffer_size`` is 0)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.socket()
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender.connect(server.getsockname())
        receiver, _ = server.accept()
        receiver.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if pccl_buffers:
            size = CONFIG.socket_buffer_size or CONFIG.local_socket_buffer_size
            for sock in (sender, receiver):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
                if hasattr(socket, "TCP_WINDOW_CLAMP"):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, size)
    destination = memoryview(np.empty_like(payload)).cast("B")

    def send() -> None:
        for _ in range(count):
            sender.sendall(payload)

    with sender, receiver:
        start = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        for _ in range(count):
            filled = 0
            while filled < len(destination):
                n = receiver.recv_into(destination[filled:], 0, socket.MSG_WAITALL)
                if n == 0:
                    raise RuntimeError("raw sender closed early")
                filled += n
        elapsed = time.perf_counter() - start
        thread.join()
    return elapsed


async def peer(master: str, role: str, nbytes: int, count: int) -> None:
    """One peer process: ``recv`` keeps receiving; ``send`` prints the seconds of each round."""
    async with pccl.open_communicator(master, config=CONFIG) as comm:
        if role == "recv":  # the first peer: accept the sender
            while not await comm.are_peers_pending():
                await trio.sleep(0.02)
            await comm.update_topology()
        other = next(p for p in comm.ring if p != comm.peer_id)
        buffer = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
        if role == "recv":
            while True:
                await comm.recv(buffer, from_=other)
        await comm.send(buffer, to=other)  # warm-up: dials the pair's connections
        print(json.dumps({"ready": True}), flush=True)
        while line := await trio.to_thread.run_sync(sys.stdin.readline):  # a round per line
            start = time.perf_counter()
            for _ in range(int(line)):
                await comm.send(buffer, to=other)
            print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


def pccl_runs(master: str, nbytes: int, count: int) -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    argv = [sys.executable, __file__, "--peer", "--master", master, "--mib", str(nbytes / MIB), "--count", str(count)]
    receiver = subprocess.Popen([*argv, "--role", "recv"], text=True)
    time.sleep(1.0)  # the receiver registers first (it accepts the sender)
    sender = subprocess.Popen([*argv, "--role", "send"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              bufsize=1)
    assert sender.stdout is not None
    assert json.loads(sender.stdout.readline())["ready"]
    return receiver, sender


def master_thread() -> tuple[str, threading.Thread, list[trio.CancelScope]]:
    started: list[str] = []
    scope = trio.CancelScope()
    ready = threading.Event()

    async def serve() -> None:
        with scope:
            async with pccl.open_master("127.0.0.1:0", config=CONFIG) as master:
                started.append(master.address)
                ready.set()
                await trio.sleep_forever()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    ready.wait(30)
    return started[0], thread, [scope]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=64.0)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--role", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    nbytes = int(args.mib * MIB)
    if args.peer:
        trio.run(peer, args.master, args.role, nbytes, args.count)
        return 0
    address, _thread, _scopes = master_thread()
    receiver, sender = pccl_runs(address, nbytes, args.count)
    assert sender.stdin is not None and sender.stdout is not None
    payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    rates: dict[str, list[float]] = {"auto": [], "bufs": [], "send": []}
    try:
        for _ in range(args.repeats):
            for name in ("auto", "bufs"):
                seconds = raw_transfer(payload, args.count, pccl_buffers=name == "bufs")
                rates[name].append(args.count * nbytes / seconds / 1e9)
            sender.stdin.write(f"{args.count}\n")
            sender.stdin.flush()
            seconds = json.loads(sender.stdout.readline())["seconds"]
            rates["send"].append(args.count * nbytes / seconds / 1e9)
    finally:
        sender.kill()
        receiver.kill()
        sender.wait()
        receiver.wait()
    print(f"loopback TCP, {args.count} messages of {args.mib:g} MiB per measurement, best/median of "
          f"{args.repeats}, GB/s; ratio: send best / raw best")
    print(f"{'method':>10} | {'best':>6} {'median':>6} | {'ratio':>5}")
    print("-" * 36)
    for name, label in (("auto", "raw auto"), ("bufs", "raw bufs"), ("send", "comm.send")):
        print(f"{label:>10} | {max(rates[name]):>6.2f} {statistics.median(rates[name]):>6.2f} | "
              f"{max(rates['send']) / max(rates[name]):>5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
