"""In-memory transport for tests: trio's memory streams behind pccl's Stream/Network seam.

- :func:`memory_stream_pair`: two connected pccl Streams without sockets;
- :class:`MemoryNetwork`: a minimal Network over them (``connect`` hands the other end to a
  listener's ``accept``);
- :func:`memory_ring`: the framed lanes of a ring of peers, for the data path's own tests.

A :class:`MemoryStream` can plant a fault on its sending side: ``stall_sends`` makes its next
``send_all`` deliver half the data and then block forever (a send into a full TCP window);
``break_after`` aborts it once that many bytes were sent (a peer vanishing mid-op);
``stall_after`` blocks the send forever from that byte on (a SIGSTOPped peer).
"""

from __future__ import annotations

import itertools

import trio
import trio.testing

from ..collectives import RingLinks
from ..config import Config
from ..errors import AddressInUse, ConnectionRefused, PeerDisconnected, StreamClosed
from ..net.base import Listener, Network, Stream, parse_address, receive_view, send_view
from ..net.framed import FramedConnection
from ..protocol.algorithms import partner_positions, site_partners
from ..protocol.messages import HandshakeRole

__all__ = ["MemoryStream", "MemoryListener", "MemoryNetwork", "memory_stream_pair", "memory_ring", "memory_mesh"]

_ports = itertools.count(40000)


class MemoryStream(Stream):
    """One end of a trio memory stream pair, as a pccl Stream."""

    def __init__(self, inner: trio.StapledStream, *, local: str, remote: str, record: bool = False) -> None:
        self._inner = inner
        self.local_address = local
        self.remote_address = remote
        #: Bytes this end has sent so far.
        self.sent_bytes = 0
        #: With ``record``: everything this end sent, for tests that inspect the wire.
        self.sent = bytearray() if record else None
        self.stall_sends = False
        self.break_after: int | None = None
        self.stall_after: int | None = None
        #: Set when a planted fault (``break_after``/``stall_after``) fired.
        self.broke = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = send_view(data)
        if self.stall_sends:
            await self._inner.send_all(bytes(view[: len(view) // 2]))
            await trio.sleep_forever()
        if self.break_after is not None and self.sent_bytes + len(view) > self.break_after:
            cut = max(0, self.break_after - self.sent_bytes)
            await self._inner.send_all(bytes(view[:cut]))
            self.abort()
            self.broke.set()
            raise PeerDisconnected(f"test: stream to {self.remote_address} broken after {self.break_after} bytes")
        if self.stall_after is not None and self.sent_bytes + len(view) > self.stall_after:
            self.broke.set()
            await trio.sleep_forever()
        try:
            await self._inner.send_all(bytes(view))
        except trio.ClosedResourceError as exc:
            raise StreamClosed("memory stream closed") from exc
        except trio.BrokenResourceError as exc:
            raise PeerDisconnected("memory stream broken") from exc
        self.sent_bytes += len(view)
        if self.sent is not None:
            self.sent += view

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = receive_view(buffer)
        try:
            data = await self._inner.receive_some(len(view))
        except trio.ClosedResourceError as exc:
            raise StreamClosed("memory stream closed") from exc
        except trio.BrokenResourceError as exc:
            raise PeerDisconnected("memory stream broken") from exc
        view[: len(data)] = data
        return len(data)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def abort(self) -> None:
        self._inner.send_stream.close()
        self._inner.receive_stream.close()


def memory_stream_pair(*, record: bool = True) -> tuple[MemoryStream, MemoryStream]:
    """Two connected pccl Streams: (client end, server end), each recording what it sent
    (``record=False``: counting it only, as a :class:`MemoryNetwork`'s connections do)."""
    a, b = trio.testing.memory_stream_pair()
    client_addr, server_addr = f"10.0.0.1:{next(_ports)}", f"10.0.0.2:{next(_ports)}"
    return (
        MemoryStream(a, local=client_addr, remote=server_addr, record=record),
        MemoryStream(b, local=server_addr, remote=client_addr, record=record),
    )


class MemoryListener(Listener):
    def __init__(self, network: MemoryNetwork, address: str) -> None:
        self._network = network
        self.address = address
        self.send_side, self._receive = trio.open_memory_channel[MemoryStream](16)

    async def accept(self) -> Stream:
        try:
            return await self._receive.receive()
        except (trio.ClosedResourceError, trio.EndOfChannel) as exc:
            raise StreamClosed(f"listener {self.address} closed") from exc

    async def aclose(self) -> None:
        self._network.listeners.pop(self.address, None)
        await self._receive.aclose()


class MemoryNetwork(Network):
    """A Network whose connections are in-memory stream pairs.

    One flat address space: a listener on ``0.0.0.0:port`` (or ``[::]:port``) answers a connect
    to any host at that port, and ``listen`` honours ``port_range`` (the first free port of the
    range), so communicators and a master can share one network.
    """

    def __init__(self) -> None:
        self.listeners: dict[str, MemoryListener] = {}

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        await trio.lowlevel.checkpoint()
        _, port = parse_address(address)
        listener = (self.listeners.get(address) or self.listeners.get(f"0.0.0.0:{port}")
                    or self.listeners.get(f"[::]:{port}"))
        if listener is None:
            raise ConnectionRefused(f"nothing listens on {address}")
        client, server = memory_stream_pair(record=False)  # a cluster's bytes are not kept
        await listener.send_side.send(server)
        return client

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        await trio.lowlevel.checkpoint()
        host, port = parse_address(address)
        candidates = [f"{host}:{port + i}" for i in range(max(1, port_range))] if port else [f"{host}:{next(_ports)}"]
        for candidate in candidates:
            if candidate not in self.listeners:
                listener = self.listeners[candidate] = MemoryListener(self, candidate)
                return listener
        raise AddressInUse(candidates[0] if len(candidates) == 1 else f"{candidates[0]} .. {candidates[-1]}")


def memory_ring(world: int, lanes: int = 1, *, config: Config | None = None,
                ) -> tuple[list[RingLinks], list[list[MemoryStream]]]:
    """Framed links for a ring of ``world`` peers over memory streams, handshake-free; also each
    peer's sending streams (lane order), where a test plants a fault."""
    config = config or Config()
    out: list[list[FramedConnection]] = [[] for _ in range(world)]
    inc: list[list[FramedConnection]] = [[] for _ in range(world)]
    raw: list[list[MemoryStream]] = [[] for _ in range(world)]
    for r in range(world):
        nxt = (r + 1) % world
        for lane in range(lanes):
            a, b = trio.testing.memory_stream_pair()
            sa = MemoryStream(a, local=f"peer{r}.{lane}/local", remote=f"peer{nxt}.{lane}")
            sb = MemoryStream(b, local=f"peer{nxt}.{lane}/local", remote=f"peer{r}.{lane}")
            raw[r].append(sa)
            out[r].append(FramedConnection(sa, role=HandshakeRole.CLIENT, config=config))
            inc[nxt].append(FramedConnection(sb, role=HandshakeRole.SERVER, config=config))
    return [RingLinks(out[r], inc[r]) for r in range(world)], raw


def memory_mesh(world: int, lanes: int = 1, *, config: Config | None = None, sites: tuple[int, ...] = (),
                ) -> tuple[list[RingLinks], list[list[MemoryStream]], list[dict[int, MemoryStream]]]:
    """:func:`memory_ring` with partner links: every ring position also gets one connection to
    each position :func:`~pccl.protocol.algorithms.partner_positions` names (the
    halving-doubling all-reduce's partners) and, with ``sites`` (a site per ring position, as
    ``ConnectToPeers.sites``), each :func:`~pccl.protocol.algorithms.site_partners` (the
    hierarchical all-reduce's).  Returns the links, each peer's lane streams and, per peer, its
    sending stream to each partner (by ring position), where a test plants a fault."""
    config = config or Config()
    ring, raw = memory_ring(world, lanes, config=config)
    conns: list[dict[int, FramedConnection]] = [{} for _ in range(world)]
    streams: list[dict[int, MemoryStream]] = [{} for _ in range(world)]
    for r in range(world):
        for p in sorted(set(partner_positions(r, world)) | set(site_partners(r, sites))):
            if p < r:
                continue  # the pair was made from the lower side
            a, b = trio.testing.memory_stream_pair()
            sa = MemoryStream(a, local=f"peer{r}/partner{p}", remote=f"peer{p}")
            sb = MemoryStream(b, local=f"peer{p}/partner{r}", remote=f"peer{r}")
            streams[r][p], streams[p][r] = sa, sb
            conns[r][p] = FramedConnection(sa, role=HandshakeRole.CLIENT, config=config)
            conns[p][r] = FramedConnection(sb, role=HandshakeRole.SERVER, config=config)
    links = [RingLinks(ring[r].to_next, [inbox.connection for inbox in ring[r].inboxes], partners=conns[r],
                       sites=sites) for r in range(world)]
    return links, raw, streams
