"""Test-only in-memory transport: trio's memory streams behind pccl's Stream/Network seam.

``memory_stream_pair()`` gives two connected pccl Streams without sockets; ``MemoryNetwork`` is a
minimal Network over them (``connect`` hands the other end to a listener's ``accept``).
Setting ``stall_sends`` on a stream makes its next ``send_all`` deliver half the data and then
block forever, like a send into a full TCP window — the way to have a send still in progress.
"""

from __future__ import annotations

import itertools

import trio
import trio.testing

from pccl.errors import AddressInUse, ConnectionRefused, PeerDisconnected, StreamClosed
from pccl.net.base import Listener, Network, Stream, parse_address

_ports = itertools.count(40000)


class MemoryStream(Stream):
    """One end of a trio memory stream pair, as a pccl Stream."""

    def __init__(self, inner: trio.StapledStream, *, local: str, remote: str) -> None:
        self._inner = inner
        self.local_address = local
        self.remote_address = remote
        self.sent = bytearray()  # everything this end sent, for tests that inspect the wire
        self.stall_sends = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self.stall_sends:
            await self._inner.send_all(memoryview(data)[: len(data) // 2])
            await trio.sleep_forever()
        try:
            await self._inner.send_all(data)
        except trio.ClosedResourceError as exc:
            raise StreamClosed("memory stream closed") from exc
        except trio.BrokenResourceError as exc:
            raise PeerDisconnected("memory stream broken") from exc
        self.sent += data

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = memoryview(buffer).cast("B")
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


def memory_stream_pair() -> tuple[MemoryStream, MemoryStream]:
    """Two connected pccl Streams: (client end, server end)."""
    a, b = trio.testing.memory_stream_pair()
    client_addr, server_addr = f"10.0.0.1:{next(_ports)}", f"10.0.0.2:{next(_ports)}"
    return (
        MemoryStream(a, local=client_addr, remote=server_addr),
        MemoryStream(b, local=server_addr, remote=client_addr),
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
    """A Network whose connections are in-memory stream pairs."""

    def __init__(self) -> None:
        self.listeners: dict[str, MemoryListener] = {}

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        await trio.lowlevel.checkpoint()
        parse_address(address)
        listener = self.listeners.get(address)
        if listener is None:
            raise ConnectionRefused(f"nothing listens on {address}")
        client, server = memory_stream_pair()
        await listener.send_side.send(server)
        return client

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        await trio.lowlevel.checkpoint()
        host, port = parse_address(address)
        address = f"{host}:{port or next(_ports)}"
        if address in self.listeners:
            raise AddressInUse(address)
        listener = self.listeners[address] = MemoryListener(self, address)
        return listener
