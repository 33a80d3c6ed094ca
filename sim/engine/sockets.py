"""The kernel's side of the simulated connections: sockets and listening ports.

A simulated host's program holds *handles* (:mod:`pccl_sim.engine.streams`: ``SimStream``,
``SimListener``) with exactly the transport contract of real TCP.  Behind each handle is what a
real kernel keeps, and what the rest of the model works on: a :class:`Socket` per connection end
(receive buffer, EOF and reset state, its two pipes), a :class:`ListenSocket` per bound port
(its backlog of connections not yet accepted).  Arrivals (:mod:`pccl_sim.engine.delivery`) fill a
socket, an incarnation's ending (:mod:`pccl_sim.engine.hosts`) closes or kills its sockets and ports,
the handshake makes sockets before any program accepts them — all through the public members
below, so no part reaches into another's private state, and the handles stay free of them.

Rules:

* a socket belongs to one incarnation; made for a dead one it is closed from the start;
* a close sends FIN behind the data — or RST when unread data is thrown away (as Linux does) or
  when the close is abortive; a socket that was reset sends nothing more;
* an RST that arrives ends the connection, but an EOF received before it still reads as EOF;
* a port's backlog holds connections the handshake completed; shutting the port down with
  ``reset_backlog`` resets them (an ``exit`` or ``aclose``), else they die with the process.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import trio

from .delivery import OneWaiter, Pipe

if TYPE_CHECKING:
    from .delivery import Delivery, Link
    from .hosts import Incarnation

__all__ = ["Socket", "ListenSocket"]


class Socket:
    """One end of a connection, as the kernel keeps it (see the module docstring).

    ``outbound`` carries this end's sends, ``inbound`` its peer's (both set by :meth:`wire`);
    ``rbuf`` holds the arrived bytes the application has not read, ``rbuf_bytes`` their count,
    ``recv_lot`` the task waiting to read.  ``id`` numbers it world-wide (the tap keys its frame
    parsers by it)."""

    __slots__ = (
        "delivery", "inc", "id", "local", "remote", "outbound", "inbound", "peer", "rbuf", "rbuf_bytes",
        "eof", "reset", "closed", "eof_sent", "rst_sent", "recv_lot",
    )

    def __init__(self, delivery: Delivery, inc: Incarnation, *, local: str, remote: str) -> None:
        self.delivery = delivery
        self.inc = inc
        self.id = delivery.next_socket_id()
        self.local = local
        self.remote = remote
        self.outbound: Pipe = None  # type: ignore[assignment]  # set by wire
        self.inbound: Pipe = None  # type: ignore[assignment]
        self.peer: Socket = None  # type: ignore[assignment]
        self.rbuf: deque[memoryview] = deque()
        self.rbuf_bytes = 0
        self.eof = False
        self.reset = False
        self.closed = False
        self.eof_sent = False
        self.rst_sent = False
        self.recv_lot = OneWaiter()
        if inc.alive:
            inc.sockets[self.id] = self
        else:
            self.closed = True

    def wire(self, peer: Socket, link: Link) -> None:
        """Connect this end's sends to ``peer`` over ``link``."""
        self.peer = peer
        self.outbound = Pipe(link, self, peer)
        peer.inbound = self.outbound

    def peer_sending(self) -> bool:
        """Whether the peer still has bytes queued for this socket or on the wire towards it."""
        pipe = self.inbound
        return pipe is not None and bool(pipe.queued or pipe.transmitted > pipe.arrived)

    def consume(self, view: memoryview) -> int:
        """Move received bytes into ``view`` (as many as fit); their count.  What is read opens
        the sender's window again."""
        rbuf = self.rbuf
        want = len(view)
        filled = 0
        while rbuf and filled < want:
            head = rbuf[0]
            size = len(head)
            k = want - filled
            if size <= k:
                view[filled : filled + size] = head
                rbuf.popleft()
                filled += size
            else:
                view[filled:want] = head[:k]
                rbuf[0] = head[k:]
                filled = want
        self.rbuf_bytes -= filled
        pipe = self.inbound
        pipe.read += filled
        if pipe.window_blocked:
            pipe.link.unblock(pipe)
        tap = self.delivery.tap
        if tap is not None:
            tap.on_read(self, view[:filled])
        return filled

    def send_fin(self) -> None:
        """No more sends: FIN goes behind the data (unless the connection was reset)."""
        self.eof_sent = True
        if not self.reset:
            self.outbound.fin_pending = True
            self.outbound.link.activate(self.outbound)

    def close(self, *, abortive: bool) -> None:
        """The application closes (or aborts) the socket; nothing if it is closed already."""
        if self.closed:
            return
        self.closed = True
        if not self.reset:
            if abortive or self.rbuf_bytes:
                self.send_rst()  # Linux resets when unread data is thrown away
            elif not self.eof_sent:
                self.send_fin()
        self._discard()
        self.inc.sockets.pop(self.id, None)

    def _discard(self) -> None:
        self.rbuf.clear()
        self.rbuf_bytes = 0
        self.recv_lot.unpark_all()
        self.outbound.send_lot.unpark_all()

    def send_rst(self) -> None:
        """Reset the connection from this end: the unsent bytes go, an RST follows the data on
        the wire (once)."""
        if self.rst_sent or self.reset:
            return
        self.rst_sent = True
        out = self.outbound
        out.drop()
        out.link.send_control(self.delivery.arrive_rst, (self.peer,), out)

    def on_reset(self) -> None:
        """An RST arrived: the connection is gone (a received EOF still reads as EOF)."""
        if self.reset or self.closed:
            return
        self.reset = True
        self.outbound.drop()
        if not self.eof:
            self.rbuf.clear()
            self.rbuf_bytes = 0
        self.recv_lot.unpark_all()
        self.inc.record("reset", local=self.local, remote=self.remote)

    def die(self, *, reset: bool) -> None:
        """The owning incarnation ended: RST the peer (kill) or vanish silently (power-off)."""
        if self.closed:
            return
        self.closed = True
        if reset:
            self.send_rst()
        else:
            self.outbound.drop()
        self._discard()


class ListenSocket:
    """A bound port, as the kernel keeps it: the connections whose handshake completed wait in
    ``backlog`` until accepted; ``lot`` holds the task waiting to accept."""

    def __init__(self, inc: Incarnation, port: int, address: str) -> None:
        self.inc = inc
        self.port = port
        self.address = address
        self.backlog: deque[Socket] = deque()
        self.lot = trio.lowlevel.ParkingLot()
        self.closed = False

    def shutdown(self, *, reset_backlog: bool) -> None:
        """Unbind the port (nothing if it is closed already); ``reset_backlog`` resets the
        connections nobody accepted."""
        if self.closed:
            return
        self.closed = True
        inc = self.inc
        if inc.host.listeners.get(self.port) is self:
            del inc.host.listeners[self.port]
        inc.listeners.pop(self.port, None)
        if reset_backlog:
            while self.backlog:
                self.backlog.popleft().close(abortive=True)
        self.lot.unpark_all()
