"""Test-only helper: two framed connections over real loopback TCP, handshake done."""

from __future__ import annotations

import trio

from pccl.config import Config
from pccl.net.framed import FramedConnection, accept_framed, open_framed
from pccl.net.tcp import TcpNetwork


async def framed_tcp_pair(config: Config | None = None) -> tuple[FramedConnection, FramedConnection]:
    """``(dialed, accepted)``: the two ends of one authenticated loopback connection."""
    config = config or Config()
    network = TcpNetwork(config)
    listener = await network.listen("127.0.0.1:0")
    accepted: list[FramedConnection] = []

    async def accept() -> None:
        accepted.append(await accept_framed(await listener.accept(), config=config))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        dialed = await open_framed(network, listener.address, config=config)
    await listener.aclose()
    return dialed, accepted[0]
