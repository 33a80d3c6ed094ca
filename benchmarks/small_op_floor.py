"""The floor of pccl's protocol shape for a small all-reduce, in Python on Trio: what a lean
implementation of it costs on this machine (``latency.py --floor`` times it beside Gloo and pccl).

Not pccl, and not safe: a reference for how fast the *protocol* lets a small collective be when
every layer between the call and the socket is removed.  Per call, as pccl's fast commit does:
a one-way ``Begin`` to a master, the data, a ``Done`` to the master, and the wait for the
master's ``Complete`` (sent once every peer's ``Done`` is in): one master round trip.  The data
moves in one step (every peer sends its whole buffer to every other, with a 24-byte header of
seq, tag and size that the receiver checks) and every peer sums the buffers in rank order, so the
results are bit-identical across peers.  Nothing else: no phase rule, no watchdog, no abort, no
retry, no cancellation safety, no checks beyond the header.  Messages to the master are 16 bytes
(kind, seq).  The master is a plain Trio process with one task per peer.

What the numbers mean: pccl's all-reduce costs what the floor costs plus its own per-call
machinery (the call gate, routes, the op's state machine, plans, lanes and inboxes, the master's
generic message handling); the floor is what an express path for the steady state could reach
with the same round trips.  With ``acks`` the shape is peer commit's instead (``Done`` one-way,
then an ack from every other peer: no master message waited for).  ``docs/performance.rst`` has
the figures.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import numpy as np

#: seq, tag, payload bytes
HEADER = struct.Struct("<QQQ")
#: kind, seq
MESSAGE = struct.Struct("<QQ")
BEGIN, DONE, COMPLETE, REPORT = 1, 2, 3, 4
#: rank, listening port
HELLO = struct.Struct("<QQ")


def _nodelay(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


async def _send_all(sock: socket.socket, data: Any) -> None:
    import trio

    view = memoryview(data).cast("B")
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def _receive_exactly(sock: socket.socket, into: Any) -> None:
    import trio

    view = memoryview(into).cast("B")
    got = 0
    while got < len(view):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)
            continue
        if n == 0:
            raise EOFError("the floor's connection closed")
        got += n


def run_master(port: int, world: int, ready: Any) -> None:
    """The floor's master (a process): rendezvous of ``world`` peers, then ``Complete`` for each
    seq once every peer's ``Done`` for it is in; ends when the peers hang up."""
    import trio

    async def serve() -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(world)
        listener.setblocking(False)
        ready.set()
        conns: dict[int, socket.socket] = {}
        ports: dict[int, int] = {}
        while len(conns) < world:
            await trio.lowlevel.wait_readable(listener)
            sock = _nodelay(listener.accept()[0])
            hello = bytearray(HELLO.size)
            await _receive_exactly(sock, hello)
            rank, peer_port = HELLO.unpack(hello)
            conns[rank], ports[rank] = sock, peer_port
        table = struct.pack(f"<{world}Q", *(ports[r] for r in range(world)))
        for sock in conns.values():
            await _send_all(sock, table)
        dones: dict[int, int] = {}
        reports: dict[int, int] = {}

        async def reader(sock: socket.socket) -> None:
            message = bytearray(MESSAGE.size)
            while True:
                try:
                    await _receive_exactly(sock, message)
                except (EOFError, OSError):
                    return
                kind, seq = MESSAGE.unpack(message)
                if kind == REPORT:  # peer commit's one-way Done: counted, never answered
                    reports[seq] = reports.get(seq, 0) + 1
                    if reports[seq] == world:
                        del reports[seq]
                elif kind == DONE:
                    dones[seq] = dones.get(seq, 0) + 1
                    if dones[seq] == world:
                        del dones[seq]
                        complete = MESSAGE.pack(COMPLETE, seq)
                        for other in conns.values():
                            await _send_all(other, complete)

        async with trio.open_nursery() as nursery:
            for sock in conns.values():
                nursery.start_soon(reader, sock)

    trio.run(serve)


class FloorPeer:
    """One peer of the floor: its master link and a connection to every other peer."""

    def __init__(self, rank: int, world: int, master: socket.socket, peers: dict[int, socket.socket]) -> None:
        self.rank, self.world, self.master, self.peers = rank, world, master, peers
        self.seq = 0
        self._header = bytearray(HEADER.size)
        self._message = bytearray(MESSAGE.size)
        self._scratch: dict[int, np.ndarray] = {}

    @classmethod
    async def connect(cls, rank: int, world: int, master_port: int) -> FloorPeer:
        import trio

        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(world)
        listener.setblocking(False)
        master = _nodelay(socket.create_connection(("127.0.0.1", master_port)))
        await _send_all(master, HELLO.pack(rank, listener.getsockname()[1]))
        table = bytearray(8 * world)
        await _receive_exactly(master, table)
        ports = struct.unpack(f"<{world}Q", table)
        peers: dict[int, socket.socket] = {}
        for other in range(rank):  # connect to the lower ranks, accept the higher ones
            sock = _nodelay(socket.create_connection(("127.0.0.1", ports[other])))
            await _send_all(sock, HELLO.pack(rank, 0))
            peers[other] = sock
        while len(peers) < world - 1:
            await trio.lowlevel.wait_readable(listener)
            sock = _nodelay(listener.accept()[0])
            hello = bytearray(HELLO.size)
            await _receive_exactly(sock, hello)
            peers[HELLO.unpack(hello)[0]] = sock
        listener.close()
        return cls(rank, world, master, peers)

    async def all_reduce(self, buf: np.ndarray, tag: int = 0, *, acks: bool = False) -> None:
        """Sum ``buf`` over the peers in place (rank order, bit-identical everywhere).  ``acks``:
        peer commit's shape instead of fast commit's -- the ``Done`` to the master is one-way and
        the call returns once every other peer's ack (16 bytes: ready, seq) is in."""
        seq, self.seq = self.seq, self.seq + 1
        nbytes = buf.nbytes
        await _send_all(self.master, MESSAGE.pack(BEGIN, seq))
        header = HEADER.pack(seq, tag, nbytes)
        for sock in self.peers.values():
            await _send_all(sock, header)
            await _send_all(sock, buf)
        parts = {self.rank: buf}
        for rank, sock in self.peers.items():
            scratch = self._scratch.get(rank)
            if scratch is None or scratch.shape != buf.shape or scratch.dtype != buf.dtype:
                scratch = self._scratch[rank] = np.empty_like(buf)
            await _receive_exactly(sock, self._header)
            got = HEADER.unpack(self._header)
            if got != (seq, tag, nbytes):
                raise RuntimeError(f"floor: peer {rank} sent {got}, expected {(seq, tag, nbytes)}")
            await _receive_exactly(sock, scratch)
            parts[rank] = scratch
        total = parts[0].copy()
        for rank in range(1, self.world):
            total += parts[rank]
        np.copyto(buf, total)
        if acks:
            await _send_all(self.master, MESSAGE.pack(REPORT, seq))
            ack = MESSAGE.pack(DONE, seq)
            for sock in self.peers.values():
                await _send_all(sock, ack)
            for rank, sock in self.peers.items():
                await _receive_exactly(sock, self._message)
                if MESSAGE.unpack(self._message) != (DONE, seq):
                    raise RuntimeError(f"floor: peer {rank} acked {MESSAGE.unpack(self._message)}, expected {seq}")
            return
        await _send_all(self.master, MESSAGE.pack(DONE, seq))
        await _receive_exactly(self.master, self._message)
        if MESSAGE.unpack(self._message) != (COMPLETE, seq):
            raise RuntimeError(f"floor: the master sent {MESSAGE.unpack(self._message)}, expected Complete {seq}")

    def close(self) -> None:
        for sock in (self.master, *self.peers.values()):
            sock.close()


def start_master(world: int, port: int) -> Any:
    """Start the floor's master process (spawn) on ``port``; returns it once it listens."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    process = ctx.Process(target=run_master, args=(port, world, ready), daemon=True)
    process.start()
    started = time.monotonic()
    while not ready.wait(0.2):
        if process.exitcode is not None or time.monotonic() - started > 30:
            raise RuntimeError("the floor's master did not start")
    return process
