"""Real TCP streams: :class:`TcpStream` (the Trio path and the worker-thread path of every
connection) and :class:`TcpBlockingIO` (the blocking access worker threads use).  Dialling and
listening are :mod:`pccl.net.tcp`'s; its docstring says how the paths work and what they cost.

Errors: every OS or Trio failure leaves this module as a :class:`~pccl.errors.TransportError`
subclass with the original exception as ``__cause__``; malformed arguments as
:class:`~pccl.errors.InvalidArgument`, and two tasks sending (or receiving) on one stream at once
as :class:`~pccl.errors.InvalidUsage`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import outcome
import trio

from ..errors import InvalidArgument, InvalidUsage, PeerDisconnected, StreamClosed, TransportError
from .base import Stream, format_address, receive_view, send_view
from .thread_io import BlockingIO, Interrupted, ThreadCancel

__all__ = ["TcpStream", "TcpBlockingIO"]

logger = logging.getLogger("pccl.net.tcp")

#: ``socket.socket`` under a name no class member shadows (annotations in class bodies).
_Socket = socket.socket
_MSG_NOSIGNAL = int(getattr(socket, "MSG_NOSIGNAL", 0))  # EPIPE instead of SIGPIPE, even if embedded
_MSG_DONTWAIT = int(socket.MSG_DONTWAIT)
#: A non-blocking send's flags, combined once: or-ing the ``socket.MsgFlag`` members goes through
#: ``enum`` on every call (a few microseconds per small send on a loaded host).
_SEND_NOWAIT = _MSG_DONTWAIT | _MSG_NOSIGNAL
_MSG_WAITALL = getattr(socket, "MSG_WAITALL", 0)
_SEND, _RECEIVE = "send", "receive"

_T = TypeVar("_T")


def sockaddr_text(sockaddr: tuple) -> str:  # type: ignore[type-arg]
    """``host:port`` of a socket address."""
    return format_address(str(sockaddr[0]), int(sockaddr[1]))


# --- worker-thread side --------------------------------------------------------------------------


def _send_in_worker(sock: socket.socket, view: memoryview) -> None:
    """Blocking ``sendall``; a ``shutdown(SHUT_WR)`` from the Trio thread makes it fail (EPIPE)."""
    sock.sendall(view, _MSG_NOSIGNAL)


def _receive_in_worker(sock: socket.socket, view: memoryview) -> tuple[int, bool]:
    """Fill ``view`` with blocking ``recv_into``; return ``(filled, eof)``.

    A ``shutdown(SHUT_RD)`` from the Trio thread makes the blocked ``recv_into`` return 0, which
    looks like EOF here; the caller knows it interrupted the worker and classifies it.
    """
    filled, total = 0, len(view)
    while filled < total:
        n = sock.recv_into(view[filled:])
        if n == 0:
            return filled, True
        filled += n
    return filled, False


# --- streams -------------------------------------------------------------------------------------


class TcpStream(Stream):
    """One TCP connection.  See :class:`~pccl.net.base.Stream` for the contract.

    With a ``bulk_threshold``, ``send_all`` and ``receive_exactly_into`` of at least that many
    bytes run in a worker thread.  Cancelling one raises ``Cancelled`` promptly with an unknown
    prefix of the data transferred and shuts that direction down (later use: ``StreamClosed``);
    close the stream.  ``receive_into`` always runs on the Trio thread; cancelling it loses
    nothing.
    """

    def __init__(
        self, sock: socket.socket, *, bulk_threshold: int | None = None, remote_address: str | None = None
    ) -> None:
        sock.setblocking(True)  # for the workers; the Trio path passes MSG_DONTWAIT
        self._sock = sock
        self._bulk_threshold = sys.maxsize if bulk_threshold is None else bulk_threshold
        self.local_address = sockaddr_text(sock.getsockname())
        self.remote_address = remote_address if remote_address is not None else sockaddr_text(sock.getpeername())
        self._closed = False
        self._eof_sent = False
        self._sending = False
        self._receiving = False
        #: Directions shut down because a bulk transfer in them was cancelled.
        self._dead: set[str] = set()
        #: The OS error of a reset seen by a receive; Linux reports ECONNRESET once and EOF after.
        self._receive_error: OSError | None = None
        #: The last receive on the Trio thread got fewer bytes than it asked for: the socket was
        #: empty then, so the next one waits for data before asking (see :meth:`receive_into`).
        self._drained = False
        # Threads inside a syscall on the socket (Trio workers and BlockingIO callers).  The
        # socket is closed by whoever brings this to zero after _closed is set; the lock makes
        # "close now or leave it to the last worker" race-free.
        self._workers_active = 0
        self._workers_lock = threading.Lock()
        self._blocking_io: TcpBlockingIO | None = None

    @property
    def socket(self) -> socket.socket:
        """The underlying socket, for inspecting options.  Do no I/O on it."""
        return self._sock

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<TcpStream {self.local_address} -> {self.remote_address} {state}>"

    # -- sending --

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = send_view(data)
        if self._closed:
            raise StreamClosed(f"send on a closed stream to {self.remote_address}")
        if self._eof_sent:
            raise StreamClosed(f"send after send_eof on the stream to {self.remote_address}")
        if _SEND in self._dead:
            raise StreamClosed(f"send on the stream to {self.remote_address} after a cancelled bulk send")
        if self._sending:
            raise InvalidUsage("another task is already sending on this stream")
        self._sending = True
        try:
            if len(view) >= self._bulk_threshold:
                await self._send_bulk(view)
            else:
                await self._send_small(view)
        finally:
            self._sending = False

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        """Send what the kernel takes at once (Trio thread, never waits): the byte count, ``0``
        when nothing fits now or the stream cannot send at the moment (another send runs, it is
        closed or broken) — then use :meth:`send_all`, which also reports the error."""
        if self._closed or self._eof_sent or self._sending or _SEND in self._dead:
            return 0
        try:
            return self._sock.send(data, _SEND_NOWAIT)
        except OSError:  # BlockingIOError included
            return 0

    async def _send_small(self, view: memoryview) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        sent = 0
        while sent < len(view):
            if self._closed:
                raise StreamClosed(f"stream to {self.remote_address} was closed during a send")
            try:
                sent += self._sock.send(view[sent:], _SEND_NOWAIT)
            except BlockingIOError:
                await self._wait(trio.lowlevel.wait_writable)
                waited = True
            except OSError as exc:
                raise self.failure(exc, "send") from exc
        if not waited:
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _send_bulk(self, view: memoryview) -> None:
        try:
            await self._in_worker(_SEND, _send_in_worker, view)
        except OSError as exc:
            raise self.failure(exc, "send") from exc

    async def send_eof(self) -> None:
        await trio.lowlevel.checkpoint()
        if self._closed:
            raise StreamClosed(f"send_eof on a closed stream to {self.remote_address}")
        if self._eof_sent or _SEND in self._dead:
            return
        if self._sending:
            raise InvalidUsage("send_eof while another task is sending on this stream")
        self._eof_sent = True
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:  # ENOTCONN: the peer is already gone; EOF is moot
                raise self.failure(exc, "send_eof") from exc

    # -- receiving --

    def _begin_receive(self) -> None:
        if self._closed:
            raise StreamClosed(f"receive on a closed stream from {self.remote_address}")
        if _RECEIVE in self._dead:
            raise StreamClosed(f"receive on the stream from {self.remote_address} after a cancelled bulk receive")
        if self._receiving:
            raise InvalidUsage("another task is already receiving on this stream")
        if self._receive_error is not None:
            raise PeerDisconnected(
                f"connection from {self.remote_address} was reset: {self._receive_error}"
            ) from self._receive_error
        self._receiving = True

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        view = receive_view(buffer)
        self._begin_receive()
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            waited = False
            if self._drained:
                # The socket was empty after the last receive: wait until it is readable rather
                # than ask first — a receive that finds nothing costs a syscall and a raised
                # BlockingIOError, once per message on a latency-bound connection.  If data came
                # meanwhile the wait returns at the next pass of the run loop, which is the
                # schedule point a receive that finds data makes anyway.
                await self._wait(trio.lowlevel.wait_readable)  # cancellable: nothing consumed yet
                waited = True
            while True:
                if self._closed:
                    raise StreamClosed(f"stream from {self.remote_address} was closed during a receive")
                try:
                    n = self._sock.recv_into(view, 0, _MSG_DONTWAIT)
                except BlockingIOError:
                    # Cancellation can only strike here, before anything was consumed.
                    await self._wait(trio.lowlevel.wait_readable)
                    waited = True
                    continue
                except OSError as exc:
                    raise self.receive_failure(exc) from exc
                self._drained = 0 < n < len(view)
                if not waited:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return n
        finally:
            self._receiving = False

    async def receive_exactly_into(self, buffer: memoryview | bytearray) -> None:
        if isinstance(buffer, (bytearray, memoryview)) and memoryview(buffer).nbytes == 0:
            await trio.lowlevel.checkpoint()
            return
        view = receive_view(buffer)
        if len(view) < self._bulk_threshold:
            await super().receive_exactly_into(view)
            return
        self._begin_receive()
        try:
            try:
                filled, eof = await self._in_worker(_RECEIVE, _receive_in_worker, view)
            except OSError as exc:
                raise self.receive_failure(exc) from exc
            if eof:
                raise PeerDisconnected(
                    f"connection to {self.remote_address} closed after {filled} of {len(view)} expected bytes"
                )
        finally:
            self._receiving = False

    def blocking_io(self) -> BlockingIO:
        """Blocking ``sendall``/``recv_into`` on this socket for worker threads (the bulk path of
        :mod:`pccl.net.thread_io`).  ``aclose``/``abort`` on the Trio thread wake a blocked thread
        (its call raises ``StreamClosed``/``PeerDisconnected``)."""
        if self._blocking_io is None:
            self._blocking_io = TcpBlockingIO(self)
        return self._blocking_io

    @property
    def closed(self) -> bool:
        """Whether this side closed the stream."""
        return self._closed

    @property
    def receive_error(self) -> OSError | None:
        """The error that broke the receive direction, if one did."""
        return self._receive_error

    @contextlib.contextmanager
    def thread_in_socket(self) -> Iterator[_Socket]:
        """Count a worker thread in a syscall on the socket (any thread; for the blocking I/O
        of :meth:`blocking_io`)."""
        sock = self.enter_socket()
        try:
            yield sock
        finally:
            self._worker_left()

    def enter_socket(self) -> _Socket:
        """:meth:`thread_in_socket` without the context manager (a small op's every send goes
        through it): the socket, counted in until :meth:`leave_socket`."""
        with self._workers_lock:
            if self._closed:
                raise StreamClosed(f"stream to {self.remote_address} is closed")
            self._workers_active += 1
        return self._sock

    def leave_socket(self) -> None:
        self._worker_left()

    def _worker_left(self) -> None:
        with self._workers_lock:
            self._workers_active -= 1
            close = self._closed and self._workers_active == 0
        if close:
            self._sock.close()

    # -- closing --

    async def aclose(self) -> None:
        self._close(abortive=False)
        await trio.lowlevel.checkpoint()

    def abort(self) -> None:
        self._close(abortive=True)

    def _close(self, *, abortive: bool) -> None:
        if self._closed:
            return
        self._closed = True
        logger.debug(
            "%s connection %s -> %s", "aborting" if abortive else "closing", self.local_address, self.remote_address
        )
        if abortive:
            try:
                # Linger on with a zero timeout: close() discards the send queue and sends RST.
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:  # pragma: no cover - the socket is already dead; close() suffices
                pass
        # Wake tasks parked in wait_readable/wait_writable (they raise ClosedResourceError,
        # which _wait maps to StreamClosed).
        trio.lowlevel.notify_closing(self._sock)
        with self._workers_lock:
            close_now = self._workers_active == 0
        if close_now:
            self._sock.close()
            return
        # Wake the workers blocked in the kernel; the last one to return closes the socket.
        # (After an abort a blocked sender's queue is full, so the FIN queued behind it never
        # leaves before close() turns everything into a RST.)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    # -- helpers --

    async def _wait(self, wait: Callable[[_Socket], object]) -> None:
        try:
            await wait(self._sock)  # type: ignore[misc]
        except trio.ClosedResourceError as exc:
            raise StreamClosed(f"stream to {self.remote_address} was closed by this side") from exc
        except trio.BusyResourceError as exc:  # pragma: no cover - guarded by _sending/_receiving
            raise InvalidUsage("two tasks wait on the same stream direction") from exc

    def failure(self, exc: OSError, operation: str) -> TransportError:
        if self._closed:
            return StreamClosed(f"stream to {self.remote_address} was closed by this side")
        logger.debug("%s to %s failed: %s", operation, self.remote_address, exc)
        return PeerDisconnected(f"connection to {self.remote_address} broke during {operation}: {exc}")

    def receive_failure(self, exc: OSError) -> TransportError:
        """As :meth:`failure` for a receive, remembering the error for the next receive."""
        if not self._closed:
            self._receive_error = exc
        return self.failure(exc, "receive")

    async def _in_worker(self, direction: str, work: Callable[[_Socket, memoryview], _T], view: memoryview) -> _T:
        """Run ``work(sock, view)`` in a worker thread and wait for it, cancellably.

        Cancellation shuts ``direction`` down, which makes the blocked syscall return at once;
        then this raises ``Cancelled`` (or ``StreamClosed`` if the stream was closed meanwhile),
        whatever the worker reported.  Otherwise the worker's result or OSError comes out.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise StreamClosed(f"stream to {self.remote_address} was closed by this side")
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()
        sock = self._sock
        interrupted = False

        def deliver(result: outcome.Outcome[_T]) -> None:
            token.run_sync_soon(trio.lowlevel.reschedule, task, result)

        def abort(_raise_cancel: object) -> trio.lowlevel.Abort:
            nonlocal interrupted
            interrupted = True
            self._dead.add(direction)
            try:
                self._sock.shutdown(socket.SHUT_WR if direction == _SEND else socket.SHUT_RD)
            except OSError:  # already disconnected: the worker is returning anyway
                pass
            return trio.lowlevel.Abort.FAILED  # keep waiting: the worker reports back promptly

        with self._workers_lock:
            self._workers_active += 1
        try:
            trio.lowlevel.start_thread_soon(lambda: work(sock, view), deliver, name=f"pccl-tcp-{direction}")
            try:
                result: _T = await trio.lowlevel.wait_task_rescheduled(abort)
            except OSError:
                if not (interrupted or self._closed):
                    raise
                result = None  # type: ignore[assignment]  # replaced by the exception below
        finally:
            self._worker_left()
        if self._closed:
            raise StreamClosed(f"stream to {self.remote_address} was closed during a transfer")
        if interrupted:
            await trio.lowlevel.checkpoint()  # raises the Cancelled that interrupted the worker
            # Only a shield raised meanwhile gets here; the direction is shut down regardless.
            raise StreamClosed(f"{direction} on the stream to {self.remote_address} was interrupted")
        return result


class TcpBlockingIO(BlockingIO):
    """:class:`~pccl.net.thread_io.BlockingIO` on a :class:`TcpStream`'s (blocking-mode) socket."""

    def __init__(self, stream: TcpStream) -> None:
        self._stream = stream

    @property
    def stream(self) -> TcpStream:
        return self._stream

    def send_all(self, data: memoryview) -> None:
        stream = self._stream
        with stream.thread_in_socket() as sock:
            try:
                sock.sendall(data, _MSG_NOSIGNAL)
            except OSError as exc:
                raise stream.failure(exc, "send") from exc

    def send_nowait(self, data: memoryview) -> int:
        stream = self._stream
        sock = stream.enter_socket()
        try:
            return sock.send(data, _SEND_NOWAIT)
        except BlockingIOError:
            return 0
        except OSError as exc:
            raise stream.failure(exc, "send") from exc
        finally:
            stream.leave_socket()

    def receive_into(self, buffer: memoryview, *, fill: bool = False) -> int:
        stream = self._stream
        if stream.receive_error is not None:
            raise PeerDisconnected(
                f"connection from {stream.remote_address} was reset: {stream.receive_error}"
            ) from stream.receive_error
        with stream.thread_in_socket() as sock:
            try:
                # MSG_WAITALL: the kernel fills the whole payload in one call, so the GIL is
                # released and re-taken once per frame rather than once per segment batch.
                n = sock.recv_into(buffer, 0, _MSG_WAITALL if fill else 0)
            except OSError as exc:
                raise stream.receive_failure(exc) from exc
        if n == 0 and stream.closed:
            raise StreamClosed(f"stream from {stream.remote_address} was closed by this side")
        return n

    def wait_readable(self, cancel: ThreadCancel) -> None:
        stream = self._stream
        with stream.thread_in_socket() as sock:
            poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN | select.POLLPRI)
            poller.register(cancel.fileno(), select.POLLIN)
            while True:
                events = poller.poll()
                if cancel.cancelled:
                    raise Interrupted("the operation was cancelled")
                if events:
                    return
