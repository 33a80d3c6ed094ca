"""Closing a point-to-point connection gracefully as the communicator closes.

A receive completes once its ``PointAck`` was handed to the connection; the sender may not have
read it yet.  Closing the connection at once would lose it: an abort resets the connection, and
so does a plain close while unread bytes (the sender's keepalives) wait in this side's receive
buffer — and a reset makes the sender's kernel drop what its reader had not taken, so its
``send`` would fail with ``PeerDisconnected`` although this side's ``recv`` returned.  So a
closing communicator ends what it sends with EOF and reads (and drops) what comes until the peer
closes the connection too, for at most :data:`LINGER` seconds.

The order across a link's two connections matters: the peer's link fails at the first of them
that ends.  The incoming connection (the peer's messages, this side's answers) ends first; the
outgoing one only once that one is closed, so the peer reads this side's last answers before its
link fails.  The outgoing one is read meanwhile: a peer closing at the same time ends it first
(its own incoming one), and neither side waits for the other.
"""

from __future__ import annotations

import trio

from ..errors import PCCLError
from ..net.framed import FramedConnection

__all__ = ["LINGER", "linger"]

#: A closing communicator waits at most this many seconds for a peer to close a point-to-point
#: connection after its own side's EOF (a peer alive reads it within a loop's round; one that
#: is gone has its kernel reset the connection at once).
LINGER = 5.0


async def linger(conn: FramedConnection, *, incoming: bool, after: trio.Event | None) -> None:
    """Close ``conn`` gracefully (shielded, at most :data:`LINGER` seconds; the caller aborts it
    then).  ``incoming``: it carries the peer's messages and this side's answers — EOF at once,
    then read until the peer closes it.  Else it is this side's outgoing connection: read it
    until the peer closes it, and send EOF once ``after`` (the incoming connection's end, if
    there is one) is set."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + LINGER):
        if incoming:
            if await _send_eof(conn):
                await _drain(conn)
            return
        async with trio.open_nursery() as nursery:
            async def drain() -> None:
                await _drain(conn)
                nursery.cancel_scope.cancel()

            nursery.start_soon(drain)
            if after is not None:
                await after.wait()
            if not await _send_eof(conn):
                nursery.cancel_scope.cancel()


async def _send_eof(conn: FramedConnection) -> bool:
    """Half-close ``conn``; ``False`` if that failed (broken, reset, or a transport without
    half-close: TLS)."""
    try:
        async with conn.send_lock:
            await conn.stream.send_eof()
    except PCCLError:
        return False
    return True


async def _drain(conn: FramedConnection) -> None:
    """Read and drop what comes on ``conn`` until EOF or a transport error."""
    buffer = bytearray(1 << 16)
    try:
        while await conn.stream.receive_into(buffer):
            pass
    except PCCLError:
        pass
