"""Real TCP: the :class:`~pccl.net.base.Network` of production runs.

Trio drives every connection: connects, accepts, waits and cancellation.  Bytes move on one of
two paths behind the same :class:`TcpStream` methods:

* **the Trio path** (default for everything): ``send``/``recv_into`` straight from/into the
  caller's memory with ``MSG_DONTWAIT``, and ``trio.lowlevel.wait_writable/readable`` only when a
  call would block.  Measured on the project's 2-core loopback box: 0.9-1.1x a blocking
  ``sendall``/``recv_into`` loop for 1-16 MiB chunks, one direction or both at once.
* **the worker-thread path** (opt-in, ``TcpNetwork(bulk_threshold=n)``): ``send_all`` and
  ``receive_exactly_into`` of at least ``n`` bytes run plain blocking ``sendall``/``recv_into``
  in a Trio worker thread (GIL released in the syscalls), so a process can copy in both
  directions on two cores while its Trio thread does other work.  A thread hand-off costs
  ~35 us per call, which made it slower than the Trio path on the 2-core box for chunks below
  ~4 MiB and no faster above; it is there for many-core hosts.

A third way is for bulk data paths that want whole loops in threads: :meth:`TcpStream.blocking_io`
(:mod:`pccl.net.thread_io`) hands out blocking ``sendall``/``recv_into``/``poll`` for worker threads
to call directly — no hand-off per call.  The ring all-reduce uses it (about 2x the Trio path's
throughput on the 2-core box).

The socket stays in *blocking* mode (for the workers) and the Trio path asks for non-blocking
behaviour per call (``MSG_DONTWAIT``, Linux/BSD).  A worker blocked in the kernel is interrupted
with ``shutdown()`` of its direction: cancelling a bulk send shuts the sending half down (the
peer sees EOF after a prefix of the data), cancelling a bulk receive shuts the receiving half
down; either way that direction is dead afterwards (``StreamClosed``), which the ``Stream``
contract allows (a cancelled transfer leaves the stream unusable for framing).  ``aclose``/
``abort`` from another task shut both directions down, and the socket is released when the last
worker has returned (closing a descriptor another thread is blocked on would not wake it, and
the number could be reused).  The simulator never gets here: it has its own Network.

The streams themselves are :mod:`pccl.net.tcp_stream`'s; this module dials, listens and
configures the sockets.

Errors: every OS or Trio failure leaves this module as a :class:`~pccl.errors.TransportError`
subclass with the original exception as ``__cause__``; malformed arguments as
:class:`~pccl.errors.InvalidArgument`, and two tasks sending (or receiving) on one stream at once
as :class:`~pccl.errors.InvalidUsage`.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
import sys

import trio

from ..config import Config
from ..errors import (
    AddressInUse,
    ConnectionRefused,
    ConnectTimeout,
    InvalidArgument,
    InvalidUsage,
    StreamClosed,
    TransportError,
)
from .base import Listener, Network, Stream, parse_address
from .tcp_stream import TcpBlockingIO, TcpStream, sockaddr_text

__all__ = ["TcpNetwork", "TcpStream", "TcpBlockingIO", "TcpListener", "DEFAULT_BULK_THRESHOLD", "is_same_host"]

logger = logging.getLogger(__name__)

#: Default ``bulk_threshold``: no worker threads (the Trio path was as fast on the test box).
DEFAULT_BULK_THRESHOLD: int | None = None

# accept() failures that concern only the one half-open connection (the same list as trio's).
_ACCEPT_RETRY_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM})
# accept() failures from running out of descriptors or kernel memory: transient, so back off and
# retry like trio.serve_listeners does, instead of ending the accept loop (the same list as trio's).
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
#: Seconds :meth:`TcpListener.accept` waits before retrying after a capacity error.
ACCEPT_BACKOFF = 0.1
_CONNECT_TIMEOUT_ERRNOS = frozenset({errno.ETIMEDOUT})


# --- listener ------------------------------------------------------------------------------------


class TcpListener(Listener):
    """A listening TCP socket; :meth:`accept` yields configured :class:`TcpStream` objects."""

    def __init__(self, sock: socket.socket, network: TcpNetwork) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._network = network
        self._closed = False
        self.address = sockaddr_text(sock.getsockname())

    @property
    def socket(self) -> socket.socket:
        """The listening socket, for inspecting options.  Do no I/O on it."""
        return self._sock

    def __repr__(self) -> str:
        return f"<TcpListener {self.address}{' closed' if self._closed else ''}>"

    async def accept(self) -> TcpStream:
        """Next incoming connection.  ``StreamClosed`` after (or during) ``aclose``;
        ``TransportError`` if the OS refuses for good.  Out of file descriptors or kernel memory
        (EMFILE, ENFILE, ENOMEM, ENOBUFS) is waited out: logged once, then retried every
        :data:`ACCEPT_BACKOFF` seconds until a connection is accepted.  Cancelled: no connection
        is taken off the queue."""
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        starved_since: float | None = None
        while True:
            if self._closed:
                raise StreamClosed(f"listener {self.address} is closed")
            try:
                conn, sockaddr = self._sock.accept()
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(self._sock)
                except trio.ClosedResourceError as exc:
                    raise StreamClosed(f"listener {self.address} was closed") from exc
                except trio.BusyResourceError as exc:
                    raise InvalidUsage("another task is already accepting on this listener") from exc
                waited = True
                continue
            except OSError as exc:
                if exc.errno in _ACCEPT_RETRY_ERRNOS:
                    continue
                if self._closed:
                    raise StreamClosed(f"listener {self.address} was closed") from exc
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    if starved_since is None:
                        starved_since = trio.current_time()
                        logger.error("accept on %s failed: %s; retrying every %g s", self.address, exc, ACCEPT_BACKOFF)
                    await trio.sleep(ACCEPT_BACKOFF)
                    waited = True
                    continue
                logger.warning("accept on %s failed: %s", self.address, exc)
                raise TransportError(f"accept on {self.address} failed: {exc}") from exc
            try:
                stream = self._network.wrap_socket(conn, remote_address=sockaddr_text(sockaddr))
            except OSError as exc:  # the connection died before we could configure it
                conn.close()
                logger.debug("dropping connection from %s: %s", sockaddr, exc)
                continue
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            if starved_since is not None:
                logger.warning("accept on %s works again after %.1f s", self.address, trio.current_time() - starved_since)
            logger.debug("accepted %s on %s", stream.remote_address, self.address)
            return stream

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        await trio.lowlevel.checkpoint()


# --- network -------------------------------------------------------------------------------------


def is_same_host(sock: socket.socket) -> bool:
    """Whether connected ``sock``'s remote end is on this host: a loopback address, or the
    socket's own address (a connection to one of this host's addresses stays on it)."""
    try:
        local, remote = sock.getsockname()[0], sock.getpeername()[0]
    except (OSError, IndexError, TypeError):
        return False
    try:
        address = ipaddress.ip_address(remote.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or remote == local


class TcpNetwork(Network):
    """Streams and listeners over real TCP (IPv4 and IPv6; host names are resolved).

    ``config.socket_buffer_size`` sets SO_SNDBUF/SO_RCVBUF of every socket (before connect/
    listen, so TCP window scaling can use them; 0 leaves Linux's autotuning alone, except on
    connections within this host, which get ``config.local_socket_buffer_size`` once
    connected, with the window clamp raised to match);
    ``config.connect_timeout`` is the default ``connect`` timeout.  ``bulk_threshold`` (bytes)
    turns on the worker-thread path for transfers at least that large (module docstring).
    """

    def __init__(self, config: Config | None = None, *, bulk_threshold: int | None = DEFAULT_BULK_THRESHOLD) -> None:
        if bulk_threshold is not None and bulk_threshold < 1:
            raise InvalidArgument("bulk_threshold must be at least 1 byte")
        self._config = config if config is not None else Config()
        self._bulk_threshold = bulk_threshold

    @property
    def config(self) -> Config:
        return self._config

    def local_addresses(self, family: str = "ipv4") -> list[str]:
        """This host's interface addresses (:func:`pccl.net.interfaces.interface_addresses`)."""
        from .interfaces import interface_addresses

        return interface_addresses(socket.AF_INET6 if family == "ipv6" else socket.AF_INET)

    def _configure(self, sock: socket.socket) -> None:
        size = self._config.socket_buffer_size
        if size > 0:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)

    def wrap_socket(self, sock: socket.socket, *, remote_address: str | None = None) -> TcpStream:
        """A connected socket (dialled or accepted by this network) as a configured stream."""
        # Small control messages must not wait for Nagle's algorithm (PCCL's 44 ms latency).
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        local_size = self._config.local_socket_buffer_size
        if self._config.socket_buffer_size == 0 and local_size > 0 and is_same_host(sock):
            # After the handshake (only now is it known where the connection goes), before the
            # bulk transfers.  The handshake fixed the window scale, which suits any smaller
            # buffer, and the largest window this end advertises (from the buffer it had then,
            # ~64 KiB): raise that to the new size at once.  Linux 6.x raises it after the first
            # segment anyway; older kernels may never grow the clamp of a socket whose buffer
            # size was set.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, local_size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, local_size)
            if hasattr(socket, "TCP_WINDOW_CLAMP"):  # Linux
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_WINDOW_CLAMP, local_size)
        return TcpStream(sock, bulk_threshold=self._bulk_threshold, remote_address=remote_address)

    async def connect(self, address: str, *, timeout: float | None = None) -> TcpStream:
        """Connect to ``address``, trying each resolved address in turn.

        ``timeout`` (default ``config.connect_timeout``) bounds the whole attempt, name
        resolution included.  Raises ``ConnectionRefused`` (refused, unreachable, or the name does
        not resolve), ``ConnectTimeout``, ``InvalidArgument``.  Cancelled: no socket is left open.
        """
        host, port = parse_address(address)
        if port == 0:
            raise InvalidArgument(f"cannot connect to port 0 ({address!r})")
        limit = self._config.connect_timeout if timeout is None else timeout
        if limit < 0:
            raise InvalidArgument(f"connect timeout must not be negative, got {limit}")
        stream: TcpStream | None = None
        with trio.move_on_after(limit):
            stream = await self._connect(host, port, address)
        if stream is None:
            logger.debug("connect to %s timed out after %s s", address, limit)
            raise ConnectTimeout(f"no connection to {address} within {limit} s")
        logger.debug("connected %s -> %s", stream.local_address, stream.remote_address)
        return stream

    async def _connect(self, host: str, port: int, address: str) -> TcpStream:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:  # socket.gaierror included
            raise ConnectionRefused(f"cannot resolve {host!r} for {address}: {exc}") from exc
        last_error: OSError | None = None
        for family, kind, proto, _name, sockaddr in infos:
            sock = socket.socket(family, kind, proto)
            try:
                self._configure(sock)
                sock.setblocking(False)
                await self._connect_socket(sock, sockaddr)
                return self.wrap_socket(sock)
            except OSError as exc:
                sock.close()
                last_error = exc
            except BaseException:
                sock.close()
                raise
        assert last_error is not None  # getaddrinfo never returns an empty list
        if last_error.errno in _CONNECT_TIMEOUT_ERRNOS:
            raise ConnectTimeout(f"connecting to {address} timed out: {last_error}") from last_error
        raise ConnectionRefused(f"cannot connect to {address}: {last_error}") from last_error

    @staticmethod
    async def _connect_socket(sock: socket.socket, sockaddr: tuple) -> None:  # type: ignore[type-arg]
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            sock.connect(sockaddr)
        except BlockingIOError:  # EINPROGRESS: writable once the handshake finished or failed
            pass
        await trio.lowlevel.wait_writable(sock)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, os.strerror(err))

    async def listen(self, address: str, *, port_range: int = 1) -> TcpListener:
        """Bind and listen on ``address`` (the first address its host resolves to).

        Port 0: any free port.  Otherwise ports ``port … port+port_range-1`` are tried in order.
        SO_REUSEADDR is set (not on Windows, where it would allow stealing a port): on POSIX it
        only lets a port with connections in TIME_WAIT be re-bound, a port someone listens on
        still fails with EADDRINUSE, so bump allocation still sees it as taken.  Raises
        ``AddressInUse`` (no free port in range), ``InvalidArgument``, ``TransportError``
        (e.g. the host is not a local address).
        """
        host, port = parse_address(address)
        if port_range < 1:
            raise InvalidArgument(f"port_range must be at least 1, got {port_range}")
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except OSError as exc:
            raise TransportError(f"cannot resolve {host!r} to listen on {address}: {exc}") from exc
        family, kind, proto, _name, sockaddr = infos[0]
        candidates = [0] if port == 0 else range(port, min(port + port_range, 65536))
        last_error: OSError | None = None
        for candidate in candidates:
            sock = socket.socket(family, kind, proto)
            try:
                if sys.platform != "win32":
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    # "[::]:p" must not also grab the IPv4 port p (the same choice trio makes).
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                self._configure(sock)  # accepted sockets inherit the buffer sizes
                sock.bind((sockaddr[0], candidate, *sockaddr[2:]))
                sock.listen(socket.SOMAXCONN)
            except OSError as exc:
                sock.close()
                if exc.errno == errno.EADDRINUSE:
                    last_error = exc
                    continue
                raise TransportError(f"cannot listen on {address}: {exc}") from exc
            except BaseException:
                sock.close()
                raise
            listener = TcpListener(sock, self)
            logger.debug("listening on %s", listener.address)
            return listener
        last = candidates[-1]
        raise AddressInUse(f"no free port for {host} in {port}..{last}") from last_error
