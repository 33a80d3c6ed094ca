"""The simulated host's view of the network: ``SimNetwork``, ``SimStream``, ``SimListener``.

They behave exactly as real TCP does for a program (``pccl.testing.conformance`` holds pccl's TCP
network and the simulated one to one contract); the model behind them is the world's
(:mod:`pccl_sim.engine.network`).  Every method is a trio checkpoint.  Addresses are ``"host:port"``
strings (IPv6 hosts bracketed).  Errors come from the network's :class:`TransportErrors`
vocabulary (:mod:`pccl_sim.engine.errors`): ``peer_disconnected`` (reset, peer gone),
``stream_closed`` (this side closed), ``connection_refused``, ``connect_timeout``,
``address_in_use``, ``invalid_argument``, and ``invalid_usage`` for two tasks sending (or
receiving) at once.

A workload gives the simulated network its own flavour by subclassing :class:`SimNetwork`: its
``errors`` vocabulary, and the ``stream_class`` / ``listener_class`` it makes (subclasses that also
implement the workload's transport interfaces, as :mod:`pccl_sim.workloads.pccl.network` does for
:class:`pccl.net.base.Network`).  The runner boots each host with the scenario's
``network_class``.

A network object belongs to one host incarnation.  After that incarnation died, its operations
fail (``peer_disconnected``; ``aclose`` is a silent no-op); if that happens at a later virtual
instant than the death, the world records a zombie failure: in reality nothing runs after kill -9.
While the host is stalled, every operation blocks until the stall ends.

Behind a NAT (:mod:`pccl_sim.engine.nat`) a host's own addresses stay private: its streams show
its own name as ``local_address``, and the hosts it dials out to see the NAT's public name.

The streams and listeners are handles: what the kernel keeps of a connection or a bound port is
its :class:`~pccl_sim.engine.sockets.Socket` or :class:`~pccl_sim.engine.sockets.ListenSocket`, which the
rest of the model fills, resets and tears down.  A handle holds its socket and checks, blocks and
raises as a program sees it; the handshake makes the sockets, ``connect`` and ``accept`` the
handles.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, ClassVar

import trio

from .delivery import Pipe
from .errors import ENGINE_ERRORS, TransportErrors
from .hosts import CURRENT_INCARNATION, LOOPBACK, WILDCARD, Incarnation
from .sockets import ListenSocket, Socket

if TYPE_CHECKING:
    from .nat import Nat, Route
    from .network import World

__all__ = ["SimNetwork", "SimStream", "SimListener", "parse_address", "format_address"]

logger = logging.getLogger(__name__)


def parse_address(address: str, errors: TransportErrors = ENGINE_ERRORS) -> tuple[str, int]:
    """Split ``"host:port"`` / ``"[v6]:port"`` into ``(host, port)``; ``errors.invalid_argument``
    if malformed."""
    if not isinstance(address, str):
        raise errors.invalid_argument(f"address must be a 'host:port' string, got {type(address).__name__}")
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise errors.invalid_argument(f"malformed IPv6 address {address!r}; expected '[host]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise errors.invalid_argument(f"address {address!r} has no port; expected 'host:port'")
        if ":" in host:
            raise errors.invalid_argument(f"IPv6 address {address!r} must be bracketed: '[host]:port'")
    if not host:
        raise errors.invalid_argument(f"address {address!r} has no host")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise errors.invalid_argument(f"address {address!r} has an invalid port")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """Inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _send_view(data: Any, errors: TransportErrors) -> memoryview:
    """``data`` as a flat byte view (no copy): like a kernel, take any contiguous buffer."""
    if type(data) is bytes or type(data) is bytearray:  # flat bytes already (most sends)
        return memoryview(data)
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise errors.invalid_argument(f"cannot send a {type(data).__name__}: not a buffer") from exc
    if not view.c_contiguous:
        raise errors.invalid_argument("send buffer must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _receive_view(buffer: Any, errors: TransportErrors) -> memoryview:
    """``buffer`` as a flat writable byte view (no copy).  Empty is refused: a zero-length
    receive could not tell "nothing yet" from EOF."""
    if type(buffer) is memoryview and buffer.format == "B" and buffer.ndim == 1 and not buffer.readonly \
            and buffer.c_contiguous and buffer.nbytes:
        return buffer  # flat and writable already (most receives)
    if type(buffer) is bytearray and buffer:
        return memoryview(buffer)
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise errors.invalid_argument(f"cannot receive into a {type(buffer).__name__}: not a buffer") from exc
    if view.readonly:
        raise errors.invalid_argument("receive buffer is read-only")
    if not view.c_contiguous:
        raise errors.invalid_argument("receive buffer must be C-contiguous")
    if view.nbytes == 0:
        raise errors.invalid_argument("receive buffer is empty; receive_into needs room for at least one byte")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _dead_caller(inc: Incarnation, operation: str) -> Incarnation | None:
    """The dead incarnation behind a call on ``inc``'s network, if any: ``inc`` itself, or the
    incarnation whose task makes the call (recording a zombie if it is late)."""
    current = CURRENT_INCARNATION.get()
    if inc.alive and (current is None or current.alive):
        return None  # the common case, checked without building the loop below
    for dead in (inc, current):
        if dead is not None and not dead.alive:
            assert dead.died_at is not None
            if trio.current_time() > dead.died_at:
                dead.zombie(operation)
            return dead
    return None


def _raise_if_dead(inc: Incarnation, errors: TransportErrors, operation: str) -> None:
    dead = _dead_caller(inc, operation)
    if dead is not None:
        raise errors.peer_disconnected(f"{operation}: host {dead.name} (incarnation {dead.number}) is dead")


async def _enter(inc: Incarnation, errors: TransportErrors, operation: str, *, yield_now: bool = True) -> None:
    """The checks every operation starts with; a schedule point unless ``yield_now`` is false,
    when only a pending cancellation is raised (the caller yields later itself)."""
    if yield_now:
        await trio.lowlevel.checkpoint()
    else:
        await trio.lowlevel.checkpoint_if_cancelled()
    _raise_if_dead(inc, errors, operation)
    if inc.host.stalled:
        await _gate(inc, errors, operation)


async def _gate(inc: Incarnation, errors: TransportErrors, operation: str) -> None:
    """Block while ``inc``'s host is stalled (a frozen process makes no progress)."""
    host = inc.host
    while host.stalled and inc.alive:
        await host.stall_lot.park()
    _raise_if_dead(inc, errors, operation)


class SimStream:
    """One end of a simulated TCP connection: the application's handle on a kernel
    :class:`~pccl_sim.engine.sockets.Socket` (the model: :mod:`pccl_sim.engine.delivery`).

    Its semantics are those of :class:`pccl.net.base.Stream` (the contract
    ``pccl.testing.conformance`` checks): one task may send while another receives; a cancelled
    ``receive_into`` loses no bytes; after ``aclose``/``abort`` every operation raises
    ``stream_closed``; after the peer's clean close ``receive_into`` returns 0, after its abort it
    raises ``peer_disconnected``.  ``net`` made it (``connect``, or ``accept`` on its listener).
    """

    def __init__(self, net: SimNetwork, socket: Socket) -> None:
        self._errors = net.errors
        self._socket = socket
        self._inc = socket.inc
        self._delivery = socket.delivery
        self.local_address = socket.local
        self.remote_address = socket.remote
        self._sending = False
        self._receiving = False

    @property
    def is_reset(self) -> bool:
        """Whether the connection was reset (a kill, a power-off's timeout, an abort)."""
        return self._socket.reset

    @property
    def outbound(self) -> Pipe:
        """The pipe this end's sends go into (its ``transmitted`` and ``queued`` bytes)."""
        return self._socket.outbound

    def __repr__(self) -> str:
        socket = self._socket
        state = "closed" if socket.closed else "reset" if socket.reset else "open"
        return f"<SimStream {self.local_address} -> {self.remote_address} {state}>"

    # -- sending --

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = _send_view(data, self._errors)
        # A schedule point as a socket's send is: cancellation is checked first, and the call
        # yields once, parking if it had to wait for room or else right before it returns.
        await _enter(self._inc, self._errors, "send_all", yield_now=False)
        socket = self._socket
        if socket.closed:
            raise self._errors.stream_closed(f"send on a closed stream to {self.remote_address}")
        if socket.eof_sent:
            raise self._errors.stream_closed(f"send after send_eof on the stream to {self.remote_address}")
        if self._sending:
            raise self._errors.invalid_usage("another task is already sending on this stream")
        self._sending = True
        try:
            out = socket.outbound
            delivery = self._delivery
            total = len(view)
            offset = 0
            check = False  # _enter just checked closed and dead
            waited = False
            while True:
                if check:
                    if socket.closed:
                        raise self._errors.stream_closed(f"stream to {self.remote_address} was closed during a send")
                    _raise_if_dead(self._inc, self._errors, "send_all")
                if socket.reset or out.dead:
                    raise self._errors.peer_disconnected(f"connection to {self.remote_address} was reset")
                if offset >= total:
                    if not waited:
                        await trio.lowlevel.cancel_shielded_checkpoint()  # all of it is sent
                    return
                room = delivery.send_buffer - out.queued
                if room > 0:
                    n = min(room, total - offset)
                    # Copy, as a kernel does: the caller may reuse its buffer once we return
                    # (an immutable ``bytes`` sent whole needs no copy).
                    chunk = data if n == total and type(data) is bytes else bytes(view[offset : offset + n])
                    offset += n
                    out.enqueue(chunk)
                    if delivery.tap is not None:
                        delivery.tap.on_sent(socket, chunk)  # (a phase trigger may kill us here)
                    check = True
                    continue
                await out.send_lot.park()
                check = waited = True
                if self._inc.host.stalled:
                    await _gate(self._inc, self._errors, "send_all")
        finally:
            self._sending = False

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Put what fits in the send buffer now, without waiting (the non-blocking ``send`` of
        a real socket, as :meth:`pccl.net.tcp.TcpStream.send_nowait`): the byte count, ``0``
        when nothing fits or the stream cannot send at the moment (another send runs, it is
        closed, reset, or its host is stalled or dead) — then use :meth:`send_all`, which also
        reports the error.  Not a schedule point."""
        view = _send_view(data, self._errors)
        socket = self._socket
        if socket.closed or socket.eof_sent or self._sending or socket.reset:
            return 0
        out = socket.outbound
        if out.dead or self._inc.host.stalled or _dead_caller(self._inc, "send_nowait") is not None:
            return 0
        delivery = self._delivery
        n = min(delivery.send_buffer - out.queued, len(view))
        if n <= 0:
            return 0
        chunk = data if n == len(view) and type(data) is bytes else bytes(view[:n])
        out.enqueue(chunk)
        if delivery.tap is not None:
            delivery.tap.on_sent(socket, chunk)
        return n

    async def send_eof(self) -> None:
        await _enter(self._inc, self._errors, "send_eof")
        socket = self._socket
        if socket.closed:
            raise self._errors.stream_closed(f"send_eof on a closed stream to {self.remote_address}")
        if socket.eof_sent:
            return
        if self._sending:
            raise self._errors.invalid_usage("send_eof while another task is sending on this stream")
        socket.send_fin()

    # -- receiving --

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = _receive_view(buffer, self._errors)
        # A schedule point as a socket's receive is: cancellation is checked first (nothing is
        # consumed yet), and the call yields once, parking until data comes or, when data was
        # there already, after taking it (a shielded yield: taken bytes are never lost).
        await _enter(self._inc, self._errors, "receive_into", yield_now=False)
        socket = self._socket
        if socket.closed:
            raise self._errors.stream_closed(f"receive on a closed stream from {self.remote_address}")
        if self._receiving:
            raise self._errors.invalid_usage("another task is already receiving on this stream")
        self._receiving = True
        try:
            check = False  # _enter just checked closed and dead
            waited = False
            while True:
                if check:
                    if socket.closed:
                        raise self._errors.stream_closed(f"stream from {self.remote_address} was closed during a receive")
                    _raise_if_dead(self._inc, self._errors, "receive_into")
                if socket.rbuf_bytes:
                    n = socket.consume(view)
                    if not waited:
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    return n
                if socket.eof:
                    if not waited:
                        await trio.lowlevel.cancel_shielded_checkpoint()
                    return 0
                if socket.reset:
                    raise self._errors.peer_disconnected(f"connection from {self.remote_address} was reset")
                await socket.recv_lot.park()
                check = waited = True
                if self._inc.host.stalled:
                    await _gate(self._inc, self._errors, "receive_into")
        finally:
            self._receiving = False

    async def receive_exactly_into(self, buffer: memoryview | bytearray) -> None:
        """Fill ``buffer`` completely; ``peer_disconnected`` if EOF comes first.  Cancelled: the
        buffer may be partly written and those bytes are consumed (close the stream)."""
        if isinstance(buffer, (bytearray, memoryview)) and memoryview(buffer).nbytes == 0:
            return  # nothing to fill; receive_into would refuse the empty buffer
        view = _receive_view(buffer, self._errors)
        filled = 0
        total = len(view)
        while filled < total:
            n = await self.receive_into(view[filled:])
            if n == 0:
                raise self._errors.peer_disconnected(
                    f"connection to {self.remote_address} closed after {filled} of {total} expected bytes"
                )
            filled += n

    async def receive_exactly(self, n: int) -> bytearray:
        """Receive exactly ``n`` bytes (``peer_disconnected`` on early EOF)."""
        buf = bytearray(n)
        await self.receive_exactly_into(buf)
        return buf

    # -- closing --

    async def __aenter__(self) -> SimStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if _dead_caller(self._inc, "aclose") is None:  # checked first: a late corpse is a zombie
            self._socket.close(abortive=False)
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        if _dead_caller(self._inc, "abort") is None:
            self._socket.close(abortive=True)


class SimListener:
    """A bound port on a simulated host: the application's handle on a kernel
    :class:`~pccl_sim.engine.sockets.ListenSocket`; connections queue in its backlog until accepted."""

    def __init__(self, net: SimNetwork, port: ListenSocket) -> None:
        self._net = net
        self._errors = net.errors
        self._inc = port.inc
        self._port = port
        self.address = port.address
        self._accepting = False

    def __repr__(self) -> str:
        return f"<SimListener {self.address}{' closed' if self._port.closed else ''}>"

    @property
    def port(self) -> int:
        return self._port.port

    async def __aenter__(self) -> SimListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def accept(self) -> SimStream:
        """Next incoming connection.  ``stream_closed`` after (or during) ``aclose``.
        Cancelled: no connection is taken off the backlog."""
        await _enter(self._inc, self._errors, "accept")
        if self._accepting:
            raise self._errors.invalid_usage("another task is already accepting on this listener")
        self._accepting = True
        try:
            port = self._port
            while True:
                if port.closed:
                    raise self._errors.stream_closed(f"listener {self.address} is closed")
                _raise_if_dead(self._inc, self._errors, "accept")
                if port.backlog:
                    stream = self._net.stream_class(self._net, port.backlog.popleft())
                    self._inc.record("accept", local=self.address, remote=stream.remote_address)
                    return stream
                await port.lot.park()
                if self._inc.host.stalled:
                    await _gate(self._inc, self._errors, "accept")
        finally:
            self._accepting = False

    async def aclose(self) -> None:
        if _dead_caller(self._inc, "listener aclose") is None:
            self._port.shutdown(reset_backlog=True)
        await trio.lowlevel.checkpoint()


class _ConnectAttempt:
    """A SYN in flight from incarnation ``inc``; ``result`` becomes the client socket or an
    exception."""

    def __init__(self, inc: Incarnation, world: World, errors: TransportErrors, target: str, port: int,
                 route: Route | None = None) -> None:
        self.inc = inc
        self.hosts = world.hosts
        self.delivery = world.delivery
        self.errors = errors
        self.target = target
        self.port = port
        #: Through a NAT (pccl_sim.engine.nat): the address the dialler sees as its remote, and
        #: the NAT that translates its source address; ``None`` without one.
        self.shown: str | None = None
        self.nat: Nat | None = None
        if route is not None:
            self.target, self.port, self.shown, self.nat = route.host, route.port, route.shown, route.nat
        self.result: Socket | Exception | None = None
        self.abandoned = False
        self.lot = trio.lowlevel.ParkingLot()

    def abandon(self) -> None:
        self.abandoned = True
        self.lot.unpark_all()

    def refused(self) -> None:
        if not self.abandoned:
            where = f"{self.target}:{self.port}" if self.shown is None else self.shown
            self.result = self.errors.connection_refused(f"connection to {where} refused")
            self.lot.unpark_all()

    def established(self, client: Socket) -> None:
        if self.abandoned or not client.inc.alive:
            client.close(abortive=True)  # the server side learns via RST
            return
        self.result = client
        self.lot.unpark_all()


def _syn_arrive(attempt: _ConnectAttempt) -> None:
    src_inc = attempt.inc
    host = attempt.hosts.get(attempt.target)
    if host is None or not host.machine_up:
        return  # nobody answers: the client times out
    delivery = attempt.delivery
    back = delivery.link(attempt.target, src_inc.name)
    listener: ListenSocket | None = host.listeners.get(attempt.port)
    if listener is None or listener.closed or not listener.inc.alive:
        back.send_control(attempt.refused, ())
        return
    client_port = src_inc.host.ephemeral_port()
    client = Socket(
        delivery, src_inc, local=format_address(src_inc.name, client_port),
        remote=format_address(attempt.target, attempt.port) if attempt.shown is None else attempt.shown,
    )
    nat = attempt.nat
    observed = client.local if nat is None else nat.source(src_inc.name, client_port)
    server = Socket(delivery, listener.inc, local=listener.address, remote=observed)
    client.wire(server, delivery.link(src_inc.name, attempt.target))
    server.wire(client, back)
    listener.backlog.append(server)
    if listener.lot:
        listener.lot.unpark_all()
    # The SYN-ACK rides the server→client pipe, so server data sent at once arrives after it.
    back.send_control(attempt.established, (client,), server.outbound)


class SimNetwork:
    """The network of one simulated host incarnation: ``connect`` and ``listen``.

    Obtain it from :meth:`pccl_sim.engine.network.World.boot` (the runner hands it to the scenario as
    ``host.network``).  ``connect_timeout`` is the default ``connect`` timeout.  Subclasses choose
    the errors raised and the stream and listener classes made (module docstring).
    """

    #: The exception classes raised (shared by this network's streams and listeners).
    errors: ClassVar[TransportErrors] = ENGINE_ERRORS
    stream_class: ClassVar[type[SimStream]] = SimStream
    listener_class: ClassVar[type[SimListener]] = SimListener

    def __init__(self, world: World, incarnation: Incarnation, *, connect_timeout: float = 10.0) -> None:
        self._world = world
        self._inc = incarnation
        self._connect_timeout = connect_timeout

    @property
    def host(self) -> str:
        return self._inc.name

    @property
    def incarnation(self) -> Incarnation:
        return self._inc

    def __repr__(self) -> str:
        return f"<SimNetwork {self._inc.name}#{self._inc.number}>"

    def local_addresses(self, family: str = "ipv4") -> list[str]:
        """The host's interface addresses: its own name (behind a NAT, its private address;
        loopback names are not listed).  A simulated host has one interface, whatever the
        ``family``."""
        return [self._inc.name]

    def _resolve(self, name: str) -> str | None:
        if name == self._inc.name or name in LOOPBACK:
            return self._inc.name
        return name if name in self._world.hosts else None

    # -- Network --

    async def connect(self, address: str, *, timeout: float | None = None) -> SimStream:
        """Open a stream (one RTT).  ``connection_refused`` if nothing listens there or the name
        is unknown, ``connect_timeout`` if no answer comes within ``timeout`` (partition, machine
        off, a NAT dropping the SYN: :mod:`pccl_sim.engine.nat`).  Cancelled: the half-open
        connection is reset."""
        errors = self.errors
        name, port = parse_address(address, errors)
        if port == 0:
            raise errors.invalid_argument(f"cannot connect to port 0 ({address!r})")
        limit = self._connect_timeout if timeout is None else timeout
        if limit < 0:
            raise errors.invalid_argument(f"connect timeout must not be negative, got {limit}")
        inc = self._inc
        await _enter(inc, errors, "connect")
        target = self._resolve(name)
        if target is None:
            inc.record("connect_failed", address=address, reason="unknown host")
            raise errors.connection_refused(f"cannot resolve {name!r} for {address}")
        world = self._world
        if world.nats.active:  # pccl_sim.engine.nat: where the SYN goes, or nowhere (dropped)
            route = world.nats.route(inc.name, target, port)
            attempt = _ConnectAttempt(inc, world, errors, target, port, route)
            inc.attempts.append(attempt)
            if route is not None:
                world.delivery.link(inc.name, attempt.target).send_control(_syn_arrive, (attempt,))
        else:
            attempt = _ConnectAttempt(inc, world, errors, target, port)
            inc.attempts.append(attempt)
            world.delivery.link(inc.name, target).send_control(_syn_arrive, (attempt,))
        try:
            with trio.move_on_after(limit):
                while attempt.result is None:
                    await attempt.lot.park()
        finally:
            if attempt.result is None:
                attempt.abandon()
            if attempt in inc.attempts:
                inc.attempts.remove(attempt)
        _raise_if_dead(inc, errors, "connect")
        if inc.host.stalled:
            await _gate(inc, errors, "connect")
        result = attempt.result
        if isinstance(result, Socket):
            stream = self.stream_class(self, result)
            inc.record("connect", local=stream.local_address, remote=stream.remote_address)
            return stream
        if result is None:
            inc.record("connect_failed", address=address, reason="timeout")
            raise errors.connect_timeout(f"no connection to {address} within {limit} s")
        inc.record("connect_failed", address=address, reason="refused")
        raise result

    async def listen(self, address: str, *, port_range: int = 1) -> SimListener:
        """Bind ``address`` (the host's own name, a loopback or wildcard address).  The listener's
        ``address`` is always ``"<host name>:<port>"``, which other hosts can connect to."""
        errors = self.errors
        name, port = parse_address(address, errors)
        if port_range < 1:
            raise errors.invalid_argument(f"port_range must be at least 1, got {port_range}")
        inc = self._inc
        await _enter(inc, errors, "listen")
        if name != inc.name and name not in LOOPBACK and name not in WILDCARD:
            raise errors.transport(f"cannot listen on {address}: not an address of host {inc.name}")
        host = inc.host
        if port == 0:
            chosen = host.ephemeral_port()
            while chosen in host.listeners:
                chosen = host.ephemeral_port()
        else:
            candidates = [p for p in range(port, min(port + port_range, 65536)) if p not in host.listeners]
            if not candidates:
                raise errors.address_in_use(f"no free port for {inc.name} in {port}..{port + port_range - 1}")
            chosen = candidates[0]
        bound = ListenSocket(inc, chosen, format_address(inc.name, chosen))
        listener = self.listener_class(self, bound)
        host.listeners[chosen] = bound
        inc.listeners[chosen] = bound
        inc.record("listen", port=chosen)
        return listener
