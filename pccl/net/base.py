"""The transport seam: the ``Network`` every pccl component talks through.

Real TCP (:mod:`pccl.net.tcp`) and the simulator's virtual network both implement it, and the
same protocol code runs over either.  Nothing above ``pccl.net`` sees a trio or OS exception:
implementations raise the :class:`~pccl.errors.TransportError` subclasses below, with the
original exception as ``__cause__``.

Addresses are ``"host:port"`` strings; IPv6 hosts are bracketed (``"[::1]:48148"``).
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..errors import InvalidArgument, PeerDisconnected

if TYPE_CHECKING:
    from .thread_io import BlockingIO

__all__ = [
    "Network",
    "Stream",
    "Listener",
    "parse_address",
    "format_address",
    "send_view",
    "receive_view",
]


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` / ``"[v6]:port"`` into ``(host, port)``; :class:`InvalidArgument` if malformed."""
    if not isinstance(address, str):
        raise InvalidArgument(f"address must be a 'host:port' string, got {type(address).__name__}")
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise InvalidArgument(f"malformed IPv6 address {address!r}; expected '[host]:port'")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            raise InvalidArgument(f"address {address!r} has no port; expected 'host:port'")
        if ":" in host:
            raise InvalidArgument(f"IPv6 address {address!r} must be bracketed: '[host]:port'")
    if not host:
        raise InvalidArgument(f"address {address!r} has no host")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidArgument(f"address {address!r} has an invalid port")
    return host, int(port_text)


def format_address(host: str, port: int) -> str:
    """Inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def send_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat byte view (no copy); :class:`InvalidArgument` if it is not contiguous.

    Implementations call it at the top of ``send_all`` so every transport accepts the same
    buffers (bytes, bytearray, any C-contiguous memoryview or numpy array, whatever its format).
    """
    try:
        view = memoryview(data)
    except TypeError as exc:
        raise InvalidArgument(f"cannot send a {type(data).__name__}: not a buffer") from exc
    if not view.c_contiguous:
        raise InvalidArgument("send buffer must be C-contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def receive_view(buffer: memoryview | bytearray) -> memoryview:
    """``buffer`` as a flat writable byte view (no copy) for ``receive_into``.

    :class:`InvalidArgument` if it is read-only, not contiguous or empty (a zero-length receive
    could not tell "nothing yet" from EOF, so every transport refuses it).
    """
    try:
        view = memoryview(buffer)
    except TypeError as exc:
        raise InvalidArgument(f"cannot receive into a {type(buffer).__name__}: not a buffer") from exc
    if view.readonly:
        raise InvalidArgument("receive buffer is read-only")
    if not view.c_contiguous:
        raise InvalidArgument("receive buffer must be C-contiguous")
    if view.nbytes == 0:
        raise InvalidArgument("receive buffer is empty; receive_into needs room for at least one byte")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class Stream(abc.ABC):
    """A reliable, ordered, bidirectional byte stream.

    Every method is a trio checkpoint.  One task may send while another receives; two tasks
    sending (or two receiving) at once is a caller bug (``InvalidUsage``).

    Cancellation: cancelling a ``send_all`` may leave a prefix of the data sent: the stream is
    then unusable for framing and callers close it.  Cancelling a ``receive_into`` loses no
    bytes (either it returned a count or nothing was consumed).  Cancelling a
    ``receive_exactly_into`` may leave the buffer partly written and the bytes consumed: the
    stream is then unusable for framing, like a cancelled send.

    Closing: after ``aclose``/``abort`` every operation on this side raises ``StreamClosed``, and
    a ``send_all``/``receive_into`` blocked in another task wakes with ``StreamClosed``.  After the
    peer closed cleanly, ``receive_into`` returns ``0`` (repeatedly) and sends eventually raise
    ``PeerDisconnected``; after the peer aborted (or its machine vanished), receives raise
    ``PeerDisconnected`` (possibly after delivering data that was already in flight), never EOF.
    """

    #: ``"host:port"`` of the remote end as this side sees it (the master uses it as the
    #: peer's observed address).
    remote_address: str
    local_address: str

    @abc.abstractmethod
    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        """Send every byte of ``data`` (any C-contiguous buffer; empty is a no-op checkpoint).

        Raises ``PeerDisconnected`` (peer gone), ``StreamClosed`` (this side closed, or after
        ``send_eof``), ``InvalidArgument`` (not a contiguous buffer).
        """

    @abc.abstractmethod
    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        """Receive at least one byte into ``buffer``; return how many.  ``0`` means EOF.

        ``buffer`` must be non-empty, writable and contiguous (see :func:`receive_view`), else
        ``InvalidArgument``.  Raises ``PeerDisconnected`` on a reset, ``StreamClosed`` after
        this side's ``aclose``.  Cancelled: nothing was consumed.
        """

    @abc.abstractmethod
    async def send_eof(self) -> None:
        """Half-close: the peer's receives return EOF after the data sent so far.

        Receiving still works.  Idempotent; later ``send_all`` raises ``StreamClosed``.
        """

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the stream.  Idempotent; never raises a transport error.

        Closes even when cancelled (the close happens first, then ``Cancelled`` propagates).
        """

    @abc.abstractmethod
    def abort(self) -> None:
        """Close at once without a goodbye (RST where the transport has one).  Synchronous.

        The peer's receives raise ``PeerDisconnected`` (not EOF); this side behaves as after
        ``aclose``.  Idempotent; never raises.
        """

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the transport takes at once, without waiting (Trio thread, never a
        checkpoint): the number of bytes taken — ``0`` when nothing fits now, another send runs,
        the stream is closed or broken, or this transport has no such path (the default; TLS)
        — then use :meth:`send_all`, which also reports the error.  A prefix taken is on its
        way: the caller sends the rest before anything else."""
        return 0

    def blocking_io(self) -> BlockingIO | None:
        """Blocking access for worker threads (the bulk fast path of :mod:`pccl.net.thread_io`),
        or ``None`` if this transport has none (the default: callers use the async methods)."""
        return None

    async def receive_exactly_into(self, buffer: memoryview | bytearray) -> None:
        """Fill ``buffer`` completely; ``PeerDisconnected`` if EOF comes first.

        Transports may override it with a faster bulk path.  Cancelled: the buffer may be partly
        written and those bytes are consumed (close the stream).
        """
        if isinstance(buffer, (bytearray, memoryview)) and memoryview(buffer).nbytes == 0:
            return  # nothing to fill; receive_view would refuse the empty buffer
        view = receive_view(buffer)
        filled = 0
        total = len(view)
        while filled < total:
            n = await self.receive_into(view[filled:])
            if n == 0:
                raise PeerDisconnected(
                    f"connection to {self.remote_address} closed after {filled} of {total} expected bytes"
                )
            filled += n

    async def receive_exactly(self, n: int) -> bytearray:
        """Receive exactly ``n`` bytes (``PeerDisconnected`` on early EOF)."""
        buf = bytearray(n)
        await self.receive_exactly_into(buf)
        return buf

    async def __aenter__(self) -> "Stream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Listener(abc.ABC):
    """Accepts incoming streams on one bound address."""

    #: The bound ``"host:port"`` (with the real port when port 0 or bump allocation was used).
    address: str

    @property
    def port(self) -> int:
        return parse_address(self.address)[1]

    @abc.abstractmethod
    async def accept(self) -> Stream:
        """Wait for and return the next incoming stream.  ``StreamClosed`` after ``aclose``.

        A transient shortage (out of file descriptors) is waited out inside ``accept``; any
        other ``TransportError`` means the listener is unusable for good."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop listening; a blocked ``accept`` raises ``StreamClosed``.  Idempotent."""

    async def __aenter__(self) -> "Listener":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class Network(abc.ABC):
    """Factory of streams and listeners: real TCP or the simulator's virtual network."""

    @abc.abstractmethod
    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        """Open a stream to ``address``.

        ``timeout=None`` means the implementation's default (``Config.connect_timeout`` for TCP).
        Raises ``ConnectionRefused`` (nothing listening), ``ConnectTimeout`` (no answer within
        ``timeout`` seconds), ``InvalidArgument`` (malformed address) or another ``TransportError``.
        """

    @abc.abstractmethod
    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        """Bind ``address`` and listen.

        Port 0 asks for any free port.  With ``port_range > 1`` the ports ``port,
        port+1, … port+port_range-1`` are tried in order and the first free one is bound (PCCL's
        bump allocation from 48148/48149…).  ``AddressInUse`` if none is free.
        """

    def local_addresses(self, family: str = "ipv4") -> list[str]:
        """This host's interface addresses of ``family`` (``"ipv4"`` or ``"ipv6"``), as hosts
        other machines might dial (what a peer registers as its local candidates,
        :mod:`pccl.protocol.paths`; the caller leaves out loopback and link-local ones).  The
        default: none."""
        return []

    def kernel_wait(self) -> Callable[[int], Awaitable[None]] | None:
        """How kernel work over ``nbytes`` takes time on this network's clock, when that clock is
        not the CPU's: the simulator's virtual clock, on which work run inline takes none, while
        on a real machine a worker thread computes for a while and an aborted operation waits
        for it.  The data path awaits it after each kernel, shielded from cancellation
        (:class:`~pccl.collectives.buffers.KernelRunner`); it returns when the work would be
        done, or earlier if the process doing it dies.  ``None`` (the default; real networks):
        work takes the real time it takes, nothing is added."""
        return None
