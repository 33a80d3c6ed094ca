"""The simulated host's view of the network: ``SimNetwork``, ``SimStream``, ``SimListener``.

These implement :mod:`pccl.net.base` exactly as real TCP does (``tests/net_conformance.py`` holds
both to one contract); the model behind them is in :mod:`sim.engine.network`.  Every method is a trio
checkpoint.  Errors are pccl's transport errors: ``PeerDisconnected`` (reset, peer gone),
``StreamClosed`` (this side closed), ``ConnectionRefused``, ``ConnectTimeout``, ``AddressInUse``,
``InvalidArgument``, and ``InvalidUsage`` for two tasks sending (or receiving) at once.

A network object belongs to one host incarnation.  After that incarnation died, its operations
fail (``PeerDisconnected``; ``aclose`` is a silent no-op); if that happens at a later virtual
instant than the death, the world records a zombie failure: in reality nothing runs after kill -9.
While the host is stalled, every operation blocks until the stall ends.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

import trio

from pccl.config import Config
from pccl.errors import (
    AddressInUse,
    ConnectionRefused,
    ConnectTimeout,
    InvalidArgument,
    InvalidUsage,
    PeerDisconnected,
    StreamClosed,
    TransportError,
)
from pccl.net.base import Listener, Network, Stream, format_address, parse_address, receive_view, send_view

from .network import _LOOPBACK, _WILDCARD, CURRENT_INCARNATION, Incarnation, Pipe

if TYPE_CHECKING:
    from .network import World

__all__ = ["SimNetwork", "SimStream", "SimListener"]

logger = logging.getLogger(__name__)


class SimNetwork(Network):
    """The :class:`~pccl.net.base.Network` of one simulated host incarnation.

    Obtain it from :meth:`sim.engine.network.World.boot` (the runner hands it to the scenario as
    ``host.network``).  ``config.connect_timeout`` is the default ``connect`` timeout, as for
    :class:`pccl.net.tcp.TcpNetwork`.
    """

    def __init__(self, world: "World", incarnation: Incarnation, *, config: Config | None = None) -> None:
        self._world = world
        self._inc = incarnation
        self._config = config if config is not None else Config()

    @property
    def host(self) -> str:
        return self._inc.name

    @property
    def incarnation(self) -> Incarnation:
        return self._inc

    def __repr__(self) -> str:
        return f"<SimNetwork {self._inc.name}#{self._inc.number}>"

    # -- guards --

    def _dead_caller(self, operation: str) -> Incarnation | None:
        """The dead incarnation behind this call, if any (recording a zombie if it is late)."""
        for inc in (self._inc, CURRENT_INCARNATION.get()):
            if inc is not None and not inc.alive:
                assert inc.died_at is not None
                if trio.current_time() > inc.died_at:
                    self._world.zombie(inc, operation)
                return inc
        return None

    def _raise_if_dead(self, operation: str) -> None:
        dead = self._dead_caller(operation)
        if dead is not None:
            raise PeerDisconnected(f"{operation}: host {dead.name} (incarnation {dead.number}) is dead")

    async def _enter(self, operation: str) -> None:
        await trio.lowlevel.checkpoint()
        self._raise_if_dead(operation)
        if self._inc.host.stalled:
            await self._gate(operation)

    async def _gate(self, operation: str) -> None:
        """Block while this host is stalled (a frozen process makes no progress)."""
        host = self._inc.host
        while host.stalled and self._inc.alive:
            await host.stall_lot.park()
        self._raise_if_dead(operation)

    def _resolve(self, name: str) -> str | None:
        if name == self._inc.name or name in _LOOPBACK:
            return self._inc.name
        return name if name in self._world.hosts else None

    # -- Network --

    async def connect(self, address: str, *, timeout: float | None = None) -> "SimStream":
        """Open a stream (one RTT).  ``ConnectionRefused`` if nothing listens there or the name
        is unknown, ``ConnectTimeout`` if no answer comes within ``timeout`` (partition, machine
        off).  Cancelled: the half-open connection is reset."""
        name, port = parse_address(address)
        if port == 0:
            raise InvalidArgument(f"cannot connect to port 0 ({address!r})")
        limit = self._config.connect_timeout if timeout is None else timeout
        if limit < 0:
            raise InvalidArgument(f"connect timeout must not be negative, got {limit}")
        await self._enter("connect")
        world = self._world
        target = self._resolve(name)
        if target is None:
            world.trace.record(self._inc.name, "connect_failed", address=address, reason="unknown host")
            raise ConnectionRefused(f"cannot resolve {name!r} for {address}")
        attempt = _ConnectAttempt(self, target, port)
        self._inc.attempts.append(attempt)
        world.link(self._inc.name, target).send_control(_syn_arrive, (attempt,))
        try:
            with trio.move_on_after(limit):
                while attempt.result is None:
                    await attempt.lot.park()
        finally:
            if attempt.result is None:
                attempt.abandon()
            if attempt in self._inc.attempts:
                self._inc.attempts.remove(attempt)
        self._raise_if_dead("connect")
        if self._inc.host.stalled:
            await self._gate("connect")
        result = attempt.result
        if isinstance(result, SimStream):
            world.trace.record(self._inc.name, "connect", local=result.local_address, remote=result.remote_address)
            return result
        if result is None:
            world.trace.record(self._inc.name, "connect_failed", address=address, reason="timeout")
            raise ConnectTimeout(f"no connection to {address} within {limit} s")
        world.trace.record(self._inc.name, "connect_failed", address=address, reason="refused")
        raise result

    async def listen(self, address: str, *, port_range: int = 1) -> "SimListener":
        """Bind ``address`` (the host's own name, a loopback or wildcard address).  The listener's
        ``address`` is always ``"<host name>:<port>"``, which other hosts can connect to."""
        name, port = parse_address(address)
        if port_range < 1:
            raise InvalidArgument(f"port_range must be at least 1, got {port_range}")
        await self._enter("listen")
        if name != self._inc.name and name not in _LOOPBACK and name not in _WILDCARD:
            raise TransportError(f"cannot listen on {address}: not an address of host {self._inc.name}")
        host = self._inc.host
        if port == 0:
            chosen = host.ephemeral_port()
            while chosen in host.listeners:
                chosen = host.ephemeral_port()
        else:
            candidates = [p for p in range(port, min(port + port_range, 65536)) if p not in host.listeners]
            if not candidates:
                raise AddressInUse(f"no free port for {self._inc.name} in {port}..{port + port_range - 1}")
            chosen = candidates[0]
        listener = SimListener(self, chosen)
        host.listeners[chosen] = listener
        self._inc.listeners[chosen] = listener
        self._world.trace.record(self._inc.name, "listen", port=chosen)
        return listener


class _ConnectAttempt:
    """A SYN in flight; ``result`` becomes the client stream or an exception."""

    def __init__(self, net: SimNetwork, target: str, port: int) -> None:
        self.net = net
        self.target = target
        self.port = port
        self.result: SimStream | TransportError | None = None
        self.abandoned = False
        self.lot = trio.lowlevel.ParkingLot()

    def abandon(self) -> None:
        self.abandoned = True
        self.lot.unpark_all()

    def refused(self) -> None:
        if not self.abandoned:
            self.result = ConnectionRefused(f"connection to {self.target}:{self.port} refused")
            self.lot.unpark_all()

    def established(self, client: "SimStream") -> None:
        if self.abandoned or not client._inc.alive:
            client._close(abortive=True)  # the server side learns via RST
            return
        self.result = client
        self.lot.unpark_all()


def _syn_arrive(attempt: _ConnectAttempt) -> None:
    world = attempt.net._world
    src_inc = attempt.net._inc
    host = world.hosts.get(attempt.target)
    if host is None or not host.machine_up:
        return  # nobody answers: the client times out
    back = world.link(attempt.target, src_inc.name)
    listener = host.listeners.get(attempt.port)
    if listener is None or listener._closed or not listener._net._inc.alive:
        back.send_control(attempt.refused, ())
        return
    client_port = src_inc.host.ephemeral_port()
    client = SimStream(
        attempt.net, local=format_address(src_inc.name, client_port),
        remote=format_address(attempt.target, attempt.port),
    )
    server = SimStream(listener._net, local=listener.address, remote=client.local_address)
    client._wire(server, world.link(src_inc.name, attempt.target))
    server._wire(client, back)
    listener._backlog.append(server)
    if listener._lot:
        listener._lot.unpark_all()
    # The SYN-ACK rides the server→client pipe, so server data sent at once arrives after it.
    back.send_control(attempt.established, (client,), server._out)


class SimStream(Stream):
    """One end of a simulated TCP connection (see :mod:`sim.engine.network` for the model)."""

    def __init__(self, net: SimNetwork, *, local: str, remote: str) -> None:
        self._net = net
        self._world = net._world
        self._inc = net._inc
        self._id = self._world._stream_id()
        self.local_address = local
        self.remote_address = remote
        self._out: Pipe = None  # type: ignore[assignment]  # set by _wire
        self._in: Pipe = None  # type: ignore[assignment]
        self._peer: SimStream = None  # type: ignore[assignment]
        self._rbuf: deque[memoryview] = deque()
        self._rbuf_bytes = 0
        self._eof = False
        self._reset = False
        self._closed = False
        self._eof_sent = False
        self._rst_sent = False
        self._sending = False
        self._receiving = False
        self._recv_lot = trio.lowlevel.ParkingLot()
        if self._inc.alive:
            self._inc.streams[self._id] = self
        else:
            self._closed = True

    def _wire(self, peer: "SimStream", link: Any) -> None:
        self._peer = peer
        self._out = Pipe(link, self, peer)
        peer._in = self._out

    def __repr__(self) -> str:
        state = "closed" if self._closed else "reset" if self._reset else "open"
        return f"<SimStream {self.local_address} -> {self.remote_address} {state}>"

    # -- sending --

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = send_view(data)
        await self._net._enter("send_all")
        if self._closed:
            raise StreamClosed(f"send on a closed stream to {self.remote_address}")
        if self._eof_sent:
            raise StreamClosed(f"send after send_eof on the stream to {self.remote_address}")
        if self._sending:
            raise InvalidUsage("another task is already sending on this stream")
        self._sending = True
        try:
            out = self._out
            world = self._world
            total = len(view)
            offset = 0
            while True:
                if self._closed:
                    raise StreamClosed(f"stream to {self.remote_address} was closed during a send")
                self._net._raise_if_dead("send_all")
                if self._reset or out.dead:
                    raise PeerDisconnected(f"connection to {self.remote_address} was reset")
                if offset >= total:
                    return
                room = world.send_buffer - out.queued
                if room > 0:
                    n = min(room, total - offset)
                    # Copy, as a kernel does: the caller may reuse its buffer once we return.
                    chunk = bytes(view[offset : offset + n])
                    offset += n
                    out.enqueue(chunk)
                    if world.tap is not None:
                        world.tap.on_sent(self, chunk)
                    continue
                await out.send_lot.park()
                if self._inc.host.stalled:
                    await self._net._gate("send_all")
        finally:
            self._sending = False

    async def send_eof(self) -> None:
        await self._net._enter("send_eof")
        if self._closed:
            raise StreamClosed(f"send_eof on a closed stream to {self.remote_address}")
        if self._eof_sent:
            return
        if self._sending:
            raise InvalidUsage("send_eof while another task is sending on this stream")
        self._eof_sent = True
        if not self._reset:
            self._out.fin_pending = True
            self._out.link.activate(self._out)

    # -- receiving --

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = receive_view(buffer)
        await self._net._enter("receive_into")
        if self._closed:
            raise StreamClosed(f"receive on a closed stream from {self.remote_address}")
        if self._receiving:
            raise InvalidUsage("another task is already receiving on this stream")
        self._receiving = True
        try:
            while True:
                if self._closed:
                    raise StreamClosed(f"stream from {self.remote_address} was closed during a receive")
                self._net._raise_if_dead("receive_into")
                if self._rbuf_bytes:
                    return self._consume(view)
                if self._eof:
                    return 0
                if self._reset:
                    raise PeerDisconnected(f"connection from {self.remote_address} was reset")
                await self._recv_lot.park()
                if self._inc.host.stalled:
                    await self._net._gate("receive_into")
        finally:
            self._receiving = False

    def _consume(self, view: memoryview) -> int:
        rbuf = self._rbuf
        want = len(view)
        filled = 0
        while rbuf and filled < want:
            head = rbuf[0]
            k = min(len(head), want - filled)
            view[filled : filled + k] = head[:k]
            if k == len(head):
                rbuf.popleft()
            else:
                rbuf[0] = head[k:]
            filled += k
        self._rbuf_bytes -= filled
        pipe = self._in
        pipe.read += filled
        if pipe.window_blocked:
            pipe.link.unblock(pipe)
        tap = self._world.tap
        if tap is not None:
            tap.on_read(self, view[:filled])
        return filled

    # -- closing --

    async def aclose(self) -> None:
        if self._net._dead_caller("aclose") is None:  # checked first: a late corpse is a zombie
            self._close(abortive=False)
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        if self._net._dead_caller("abort") is None:
            self._close(abortive=True)

    def _close(self, *, abortive: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._reset:
            if abortive or self._rbuf_bytes:
                self._send_rst()  # Linux resets when unread data is thrown away
            elif not self._eof_sent:
                self._eof_sent = True
                self._out.fin_pending = True
                self._out.link.activate(self._out)
        self._discard()
        self._inc.streams.pop(self._id, None)

    def _discard(self) -> None:
        self._rbuf.clear()
        self._rbuf_bytes = 0
        self._recv_lot.unpark_all()
        self._out.send_lot.unpark_all()

    def _send_rst(self) -> None:
        if self._rst_sent or self._reset:
            return
        self._rst_sent = True
        out = self._out
        out.drop()
        out.link.send_control(self._world._arrive_rst, (self._peer,), out)

    def _on_reset(self) -> None:
        """An RST arrived: the connection is gone (a received EOF still reads as EOF)."""
        if self._reset or self._closed:
            return
        self._reset = True
        self._out.drop()
        if not self._eof:
            self._rbuf.clear()
            self._rbuf_bytes = 0
        self._recv_lot.unpark_all()
        self._world.trace.record(self._inc.name, "reset", local=self.local_address, remote=self.remote_address)

    def _die(self, *, reset: bool) -> None:
        """The owning incarnation ended: RST the peer (kill) or vanish silently (power-off)."""
        if self._closed:
            return
        self._closed = True
        if reset:
            self._send_rst()
        else:
            self._out.drop()
        self._discard()


class SimListener(Listener):
    """A bound port on a simulated host; connections queue in its backlog until accepted."""

    def __init__(self, net: SimNetwork, port: int) -> None:
        self._net = net
        self.address = format_address(net._inc.name, port)
        self._port = port
        self._backlog: deque[SimStream] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False
        self._accepting = False

    def __repr__(self) -> str:
        return f"<SimListener {self.address}{' closed' if self._closed else ''}>"

    async def accept(self) -> SimStream:
        """Next incoming connection.  ``StreamClosed`` after (or during) ``aclose``.
        Cancelled: no connection is taken off the backlog."""
        await self._net._enter("accept")
        if self._accepting:
            raise InvalidUsage("another task is already accepting on this listener")
        self._accepting = True
        try:
            while True:
                if self._closed:
                    raise StreamClosed(f"listener {self.address} is closed")
                self._net._raise_if_dead("accept")
                if self._backlog:
                    stream = self._backlog.popleft()
                    self._net._world.trace.record(self._net._inc.name, "accept", local=self.address, remote=stream.remote_address)
                    return stream
                await self._lot.park()
                if self._net._inc.host.stalled:
                    await self._net._gate("accept")
        finally:
            self._accepting = False

    async def aclose(self) -> None:
        if self._net._dead_caller("listener aclose") is None:
            self._shutdown(reset_backlog=True)
        await trio.lowlevel.checkpoint()

    def _shutdown(self, *, reset_backlog: bool) -> None:
        if self._closed:
            return
        self._closed = True
        inc = self._net._inc
        if inc.host.listeners.get(self._port) is self:
            del inc.host.listeners[self._port]
        inc.listeners.pop(self._port, None)
        if reset_backlog:
            while self._backlog:
                self._backlog.popleft()._close(abortive=True)
        self._lot.unpark_all()
