"""Thread-side blocking I/O: the optional bulk fast path a :class:`~pccl.net.base.Stream` may offer.

Trio's event loop costs real throughput on bulk bytes (measured: a ring of blocking
sockets moved about twice what the same traffic through Trio streams did on the 2-core test box).
A transport that can do better offers :meth:`Stream.blocking_io`, which returns a
:class:`BlockingIO`: plain blocking ``send_all``/``receive_into`` to be called from *worker
threads* (the GIL is released in the syscalls), plus :meth:`BlockingIO.wait_readable`, which waits
for data or for a :class:`ThreadCancel` — so a thread waiting for a frame can be cancelled without
tearing the connection.  Real TCP offers it; the simulator's streams and TLS do not (they return
``None`` and callers use the ordinary async methods).

Cancellation model: a :class:`ThreadCancel` is the cancel flag of one operation's threads.  A thread
waiting for data or for another thread wakes when it is cancelled and raises :class:`Interrupted`.
A thread in the middle of a transfer cannot be woken that way; it registers the transfer with
:meth:`ThreadCancel.transfer`, and whoever cancels gets the list of those connections back and
must abort them (on the Trio thread) — which makes the blocked syscall fail at once.  Mid-frame
cancellation therefore kills the connection, exactly as cancelling an async mid-frame transfer
does.

Errors raised by :class:`BlockingIO` methods are the :class:`~pccl.errors.TransportError`
subclasses (OS errors chained), like the async methods.
"""

from __future__ import annotations

import abc
import contextlib
import os
import threading
from collections.abc import Iterator

__all__ = ["BlockingIO", "ThreadCancel", "Interrupted"]


class Interrupted(Exception):
    """A worker thread noticed that its operation was cancelled.

    Internal to pccl: the code that started the threads turns it into ``trio.Cancelled`` or the
    error that caused the cancellation; it never reaches a user.
    """


class ThreadCancel:
    """The cancel flag of one operation's worker threads, pollable together with a socket.

    Backed by a pipe: :meth:`cancel` writes a byte, so a thread blocked in
    :meth:`BlockingIO.wait_readable` wakes.  :meth:`close` releases the pipe (after every thread
    using it has stopped).
    """

    def __init__(self) -> None:
        # The pipe is made on first use of fileno(): an operation whose threads never wait for
        # a socket (a small all-reduce's sends) needs none.
        self._read_fd = self._write_fd = -1
        self._lock = threading.Lock()
        self._cancelled = False
        # Transfers under way: key -> what to abort when cancelled (opaque to this class).
        self._transfers: dict[tuple[int, str], object] = {}

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def fileno(self) -> int:
        """Readable once cancelled."""
        with self._lock:
            if self._read_fd < 0:
                self._read_fd, self._write_fd = os.pipe()
                os.set_blocking(self._write_fd, False)
                if self._cancelled:
                    os.write(self._write_fd, b"x")
            return self._read_fd

    def check(self) -> None:
        """Raise :class:`Interrupted` if cancelled."""
        if self._cancelled:
            raise Interrupted("the operation was cancelled")

    def cancel(self) -> list[object]:
        """Cancel (idempotent; any thread).  Returns the objects registered by transfers still in
        progress: the caller must abort those connections so that the blocked threads return."""
        with self._lock:
            if not self._cancelled:
                self._cancelled = True
                if self._write_fd >= 0:
                    try:
                        os.write(self._write_fd, b"x")
                    except BlockingIOError:  # pragma: no cover - one byte never fills a pipe
                        pass
            return list(self._transfers.values())

    @contextlib.contextmanager
    def transfer(self, connection: object, direction: str) -> Iterator[None]:
        """Mark a transfer on ``connection`` (``direction``: "send" or "receive"; one of each may
        run at once) that cannot be interrupted without killing the connection.

        Raises :class:`Interrupted` instead of starting it if already cancelled, so a cancel
        either sees the transfer registered (and aborts the connection) or prevents it.
        """
        key = (id(connection), direction)
        with self._lock:
            self.check()
            if key in self._transfers:  # pragma: no cover - one transfer per direction per op
                raise RuntimeError(f"nested {direction} transfers on one connection")
            self._transfers[key] = connection
        try:
            yield
        finally:
            with self._lock:
                del self._transfers[key]

    def close(self) -> None:
        with self._lock:
            for fd in (self._read_fd, self._write_fd):
                if fd >= 0:
                    try:
                        os.close(fd)
                    except OSError:  # pragma: no cover - closed twice
                        pass
            self._read_fd = self._write_fd = -1


class BlockingIO(abc.ABC):
    """Blocking transfers on one connection, for worker threads only (never the Trio thread).

    At most one thread sends and one thread receives at a time (the callers' locks ensure it);
    a thread may run these concurrently with the other direction.  Do not mix them with the
    stream's async ``send_all``/``receive_into`` on the same direction while they run.
    """

    @abc.abstractmethod
    def send_all(self, data: memoryview) -> None:
        """Send every byte; ``PeerDisconnected``/``StreamClosed`` on failure."""

    def send_nowait(self, data: memoryview) -> int:
        """Send what the kernel takes at once, without blocking; returns the byte count (``0``
        when nothing fits now).  The one method that may also be called on the Trio thread.
        The default sends nothing (callers then finish with :meth:`send_all` in a thread)."""
        return 0

    @abc.abstractmethod
    def receive_into(self, buffer: memoryview, *, fill: bool = False) -> int:
        """Receive at least one byte (blocking); ``0`` means EOF.  ``fill``: keep waiting until
        the whole buffer is filled (one call per payload instead of one per segment batch; it
        may still return less on EOF or when interrupted)."""

    @abc.abstractmethod
    def wait_readable(self, cancel: ThreadCancel) -> None:
        """Block until data (or EOF) can be received, or raise :class:`Interrupted` once
        ``cancel`` is cancelled.  Nothing is consumed."""
