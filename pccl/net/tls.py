"""Optional TLS for any pccl :class:`~pccl.net.base.Stream`, via :class:`trio.SSLStream`.

``trio.SSLStream`` wraps a ``trio.abc.Stream``, while pccl's transports (real TCP, the
simulator's network) hand out pccl Streams.  Two adapters bridge the gap:

* :class:`_TrioTransport` presents a pccl Stream as a ``trio.abc.Stream`` (what SSLStream
  writes its ciphertext to), turning pccl transport errors into the trio errors SSLStream
  understands;
* :class:`TlsStream` presents the SSLStream as a pccl Stream again, turning trio and ssl errors
  back into pccl :class:`~pccl.errors.TransportError` subclasses with the cause chained.

TLS costs one copy per received chunk (plaintext comes out of OpenSSL as a new bytes object), so
``receive_into`` is not zero-copy here; that is the price of encryption.
"""

from __future__ import annotations

import logging
import ssl

import trio

from ..errors import InvalidUsage, PeerDisconnected, StreamClosed, TransportError
from .base import Stream, receive_view

__all__ = ["TlsStream", "wrap_client", "wrap_server"]

logger = logging.getLogger(__name__)

# Ciphertext read size when SSLStream asks for "whatever is available".
_TRANSPORT_CHUNK = 256 * 1024


class _TrioTransport(trio.abc.Stream):
    """A pccl Stream seen as a ``trio.abc.Stream`` (the ciphertext side of TLS)."""

    def __init__(self, inner: Stream) -> None:
        self.inner = inner

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        try:
            await self.inner.send_all(data)
        except StreamClosed as exc:
            raise trio.ClosedResourceError(str(exc)) from exc
        except TransportError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        buffer = bytearray(max_bytes or _TRANSPORT_CHUNK)
        try:
            n = await self.inner.receive_into(buffer)
        except StreamClosed as exc:
            raise trio.ClosedResourceError(str(exc)) from exc
        except TransportError as exc:
            raise trio.BrokenResourceError(str(exc)) from exc
        return bytes(buffer[:n])

    async def aclose(self) -> None:
        await self.inner.aclose()


def _transport_error(exc: BaseException, remote: str) -> TransportError:
    """Map an exception out of SSLStream to the pccl error with the most useful message."""
    if isinstance(exc, trio.ClosedResourceError):
        return StreamClosed(f"TLS stream to {remote} is closed")
    cause = exc.__cause__
    if isinstance(cause, TransportError):
        return type(cause)(f"TLS connection to {remote}: {cause}")
    if isinstance(cause, (ssl.SSLError, ssl.CertificateError)):
        return PeerDisconnected(f"TLS connection to {remote} failed: {cause}")
    return PeerDisconnected(f"TLS connection to {remote} broke: {exc or type(exc).__name__}")


class TlsStream(Stream):
    """A pccl Stream carried over TLS.  Create it with :func:`wrap_client`/:func:`wrap_server`.

    ``send_eof`` is not supported (TLS in trio has no half-close) and raises ``InvalidUsage``.
    """

    def __init__(self, ssl_stream: trio.SSLStream[_TrioTransport], inner: Stream) -> None:
        self._ssl = ssl_stream
        self._inner = inner
        self.remote_address = inner.remote_address
        self.local_address = inner.local_address
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise StreamClosed(f"TLS stream to {self.remote_address} is closed")
        try:
            await self._ssl.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _transport_error(exc, self.remote_address) from exc
        except trio.BusyResourceError as exc:
            raise InvalidUsage("two tasks sent on one TLS stream at once") from exc

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        if self._closed:
            raise StreamClosed(f"TLS stream to {self.remote_address} is closed")
        view = receive_view(buffer)  # InvalidArgument for an empty or read-only buffer, as on TCP
        try:
            chunk = await self._ssl.receive_some(len(view))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _transport_error(exc, self.remote_address) from exc
        except trio.BusyResourceError as exc:
            raise InvalidUsage("two tasks received on one TLS stream at once") from exc
        view[: len(chunk)] = chunk
        return len(chunk)

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        raise InvalidUsage("TLS streams do not support half-close (send_eof)")

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            # Sends close_notify (without waiting for the reply) and closes the transport; on
            # cancellation or a broken transport trio closes the transport forcefully.
            await self._ssl.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError, ssl.SSLError):
            logger.debug("unclean TLS close to %s", self.remote_address, exc_info=True)
        finally:
            await self._inner.aclose()

    def abort(self) -> None:
        self._closed = True
        self._inner.abort()


async def _handshake(ssl_stream: trio.SSLStream[_TrioTransport], inner: Stream) -> TlsStream:
    try:
        await ssl_stream.do_handshake()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await inner.aclose()
        raise _transport_error(exc, inner.remote_address) from exc
    except BaseException:
        await inner.aclose()
        raise
    return TlsStream(ssl_stream, inner)


async def wrap_client(inner: Stream, context: ssl.SSLContext, *, server_hostname: str | None) -> TlsStream:
    """Run the TLS client handshake over ``inner``.

    On failure ``inner`` is closed and a ``TransportError`` (``PeerDisconnected`` naming the TLS
    problem, e.g. certificate verification) escapes.  Cancellation closes ``inner`` too.
    """
    ssl_stream = trio.SSLStream(_TrioTransport(inner), context, server_hostname=server_hostname)
    return await _handshake(ssl_stream, inner)


async def wrap_server(inner: Stream, context: ssl.SSLContext) -> TlsStream:
    """Run the TLS server handshake over ``inner``; failures as for :func:`wrap_client`."""
    ssl_stream = trio.SSLStream(_TrioTransport(inner), context, server_side=True)
    return await _handshake(ssl_stream, inner)
