"""Framed data throughput over loopback TCP vs. a raw blocking-socket loop, in the same run.

    python benchmarks/transport.py [--frame-mib 64 1] [--total-mib 512] [--repeats 3]

*raw*: one thread ``sendall``s the payload, the other ``recv_into``s it (``MSG_WAITALL``: one
call per message, as fast as a receiving thread gets), on plain blocking
loopback sockets with TCP_NODELAY — the ceiling for one TCP stream on this machine — once with
the kernel's buffer autotuning (*auto*) and once with the buffers pccl gives a same-host
connection (*bufs*: ``Config.socket_buffer_size`` if set, else ``Config.local_socket_buffer_size``
and the window clamp, after connecting, as :class:`~pccl.net.tcp.TcpNetwork` does).  *framed*:
pccl's :class:`~pccl.net.framed.FramedConnection` over :class:`~pccl.net.tcp.TcpNetwork` (after
the handshake, with a run token): ``send_data`` of each frame, ``receive_data_header`` +
``receive_data_into`` straight into the destination array.  Methods alternate within each repeat
so that machine noise hits all alike; the table shows the best and the median of the repeats
and the ratio of framed's best to the better raw best (target: ≥ 0.85).
"""

from __future__ import annotations

import argparse
import functools
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import trio

from pccl.config import Config
from pccl.net.framed import accept_framed, open_framed
from pccl.net.tcp import TcpNetwork
from pccl.protocol.codec import DataHeader

MIB = 1024 * 1024


def raw_transfer(payload: np.ndarray, frames: int, config: Config, *, pccl_buffers: bool) -> float:
    """Seconds to move ``frames`` copies of ``payload`` over loopback with blocking sockets: with
    the kernel's buffer autotuning, or (``pccl_buffers``) with the buffers ``TcpNetwork`` gives a
    same-host connection under ``config`` (none if both sizes are 0: autotuning again)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        sender = socket.socket()
        sender.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sender.connect(server.getsockname())
        receiver, _ = server.accept()
        receiver.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        size = config.socket_buffer_size or config.local_socket_buffer_size
        if pccl_buffers and size > 0:
            for sock in (sender, receiver):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
                if config.socket_buffer_size == 0 and hasattr(socket, "TCP_WINDOW_CLAMP"):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, size)
    destination = memoryview(np.empty_like(payload)).cast("B")

    def send() -> None:
        for _ in range(frames):
            sender.sendall(payload)

    with sender, receiver:
        start = time.perf_counter()
        thread = threading.Thread(target=send)
        thread.start()
        for _ in range(frames):
            filled = 0
            while filled < len(destination):
                n = receiver.recv_into(destination[filled:], 0, socket.MSG_WAITALL)
                if n == 0:
                    raise RuntimeError("raw sender closed early")
                filled += n
        elapsed = time.perf_counter() - start
        thread.join()
    return elapsed


def framed_transfer(payload: np.ndarray, frames: int, config: Config) -> float:
    """Seconds to move ``frames`` data frames of ``payload`` through FramedConnection."""

    async def main() -> float:
        network = TcpNetwork(config)
        destination = np.empty_like(payload)
        async with await network.listen("127.0.0.1:0") as listener:
            connections = {}

            async def serve() -> None:
                connections["server"] = await accept_framed(await listener.accept(), token="bench", config=config)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                connections["client"] = await open_framed(network, listener.address, token="bench", config=config)
        client, server = connections["client"], connections["server"]

        async def send() -> None:
            for index in range(frames):
                await client.send_data(DataHeader(1, 0, index, 0, payload.nbytes), payload)

        async with client, server:
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send)
                target = memoryview(destination).cast("B")
                for index in range(frames):
                    await server.receive_data_header(op_seq=1, step=index, buffer_nbytes=destination.nbytes)
                    await server.receive_data_into(target)
                elapsed = time.perf_counter() - start
        assert np.array_equal(destination[:: max(1, destination.size // 4096)], payload[:: max(1, payload.size // 4096)])
        return elapsed

    return trio.run(main)


def measure(frame_mib: float, total_mib: float, repeats: int, config: Config) -> dict[str, list[float]]:
    frame_bytes = int(frame_mib * MIB)
    frames = max(1, int(total_mib * MIB) // frame_bytes)
    payload = np.random.default_rng(0).integers(0, 256, frame_bytes, dtype=np.uint8)
    methods: dict[str, Callable[[np.ndarray, int, Config], float]] = {
        "auto": functools.partial(raw_transfer, pccl_buffers=False),
        "bufs": functools.partial(raw_transfer, pccl_buffers=True),
        "framed": framed_transfer,
    }
    rates: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, run in methods.items():
            seconds = run(payload, frames, config)
            rates[name].append(frames * frame_bytes / seconds / 1e9)
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frame-mib", type=float, nargs="+", default=[64.0, 1.0])
    parser.add_argument("--total-mib", type=float, default=512.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = Config()
    print(f"loopback TCP, {args.total_mib:g} MiB per measurement, best/median of {args.repeats}, GB/s; "
          "ratio: framed best / the better raw best")
    print(f"{'frame':>9} | {'auto best':>9} {'auto med':>8} | {'bufs best':>9} {'bufs med':>8} | "
          f"{'framed best':>11} {'framed med':>10} | {'ratio':>5}")
    print("-" * 86)
    for frame_mib in args.frame_mib:
        rates = measure(frame_mib, args.total_mib, args.repeats, config)
        auto, bufs, framed = rates["auto"], rates["bufs"], rates["framed"]
        ratio = max(framed) / max(max(auto), max(bufs))
        print(
            f"{frame_mib:>5g} MiB | {max(auto):>9.2f} {statistics.median(auto):>8.2f} | {max(bufs):>9.2f} "
            f"{statistics.median(bufs):>8.2f} | {max(framed):>11.2f} {statistics.median(framed):>10.2f} | {ratio:>5.2f}"
        )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
