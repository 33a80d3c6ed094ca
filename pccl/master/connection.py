"""A master connection's outbox: the messages the machine sends a peer (or relay) go out in
order, written at once when the socket takes them, else queued for the connection's writer task;
a peer that lets :data:`OUTBOX_LIMIT` messages queue up is not reading (the server kicks it).
Used by :mod:`pccl.master.server`.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import trio

from ..errors import PCCLError, TransportError
from ..net.framed import FramedConnection
from ..net.serving import HandshakeSlot
from ..protocol import messages as m

__all__ = ["Connection", "Closing", "Flush", "OutboxItem", "OUTBOX_LIMIT", "KICK_NOTICE_TIMEOUT"]

log = logging.getLogger("pccl.master.server")

#: Messages queued for one peer before the master decides it is not reading and kicks it.
OUTBOX_LIMIT = 4096
#: How long the master tries to deliver a KickNotice to a peer before closing regardless.
KICK_NOTICE_TIMEOUT = 1.0


class Closing:
    """Outbox marker: deliver ``notice`` (if any), then close the connection."""

    def __init__(self, notice: m.KickNotice | None) -> None:
        self.notice = notice


class Flush:
    """Outbox marker: send the rest of a frame that ``FramedConnection.send_nowait`` began."""


OutboxItem = m.Message | Closing | Flush


@dataclasses.dataclass(eq=False)
class Connection:
    """One peer's (or relay's) connection to the master: its outbox and the writer task that
    drains it (:meth:`write`)."""

    conn_id: int
    framed: FramedConnection
    outbox: trio.MemorySendChannel[OutboxItem]
    scope: trio.CancelScope
    #: The connection's slot among the unproven ones, released when the machine registers it.
    slot: HandshakeSlot
    closing: bool = False
    #: Items put in the outbox and not yet written by the writer task (a message may skip the
    #: queue only when this is 0, or the order on the wire would change).
    queued: int = 0
    #: When a message last went to the transport (the heartbeats go to quiet connections).
    last_sent: float = -math.inf
    # What the status page's events name the peer on this connection by (set by the server's ``_record``).
    peer_id: int | None = None
    group: int = 0
    removed: bool = False  # kicked or left: its end is already in the events

    def enqueue(self, msg: m.Message | Flush, now: float | None = None) -> bool:
        """Send ``msg`` after everything queued before it; False when the outbox is full (the
        peer is not reading).  ``now``: Trio's time, if the caller just read it."""
        if not self.queued and not isinstance(msg, Flush):
            # Nothing queued: write it right here if the socket takes it at once (the common
            # case), which spares the writer task's wake-up — the master answers every vote of
            # every op, so this is on the latency path of each small all-reduce.
            try:
                sent = self.framed.send_nowait(msg)
            except PCCLError:
                sent = False  # the writer meets the same error and closes the connection
            if sent:
                self.last_sent = trio.current_time() if now is None else now
                if self.framed.needs_flush:
                    return self.enqueue(Flush())
                return True
        try:
            self.outbox.send_nowait(msg)
            self.queued += 1
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the writer is gone; its PeerDisconnected event is on the way
        return True

    def close(self, notice: m.KickNotice | None) -> None:
        """Deliver ``notice`` (if any) after what is queued, then close."""
        self.closing = True
        try:
            self.outbox.send_nowait(Closing(notice))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self.framed.abort()
            self.scope.cancel()

    async def write(self, outbox: trio.MemoryReceiveChannel[OutboxItem]) -> None:
        """The writer task: send what the outbox holds, in order, until closed or failed."""
        try:
            while True:
                item = await outbox.receive()
                if isinstance(item, Closing):
                    if item.notice is not None:
                        with trio.move_on_after(KICK_NOTICE_TIMEOUT):
                            await self.framed.send(item.notice)
                    await self.framed.aclose()
                    break
                if isinstance(item, Flush):
                    await self.framed.flush()
                else:
                    await self.framed.send(item)
                    self.last_sent = trio.current_time()
                self.queued -= 1  # only now: until it is written, later messages queue behind it
        except TransportError as exc:
            log.info("sending to connection %d (%s) failed: %s", self.conn_id, self.framed.remote_address, exc)
        except PCCLError as exc:
            # A message this side cannot encode (e.g. over the frame limit): the peer would miss
            # it and go out of step, so give up on this connection (only).
            log.error("cannot send to connection %d (%s), closing it: %s", self.conn_id,
                      self.framed.remote_address, exc)
            self.framed.abort()
        self.closing = True
        self.scope.cancel()
