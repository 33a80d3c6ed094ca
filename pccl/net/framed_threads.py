"""Thread-side data frames on a :class:`~pccl.net.framed.FramedConnection`: the bulk fast path.

:meth:`FramedConnection.blocking_channel` returns a :class:`BlockingDataChannel` when the stream
offers blocking I/O (:meth:`~pccl.net.base.Stream.blocking_io`; real TCP does).  Worker threads
then send and receive whole data frames with blocking calls — the same wire format and the same
receive buffer as the connection's async methods — without a Trio hand-off per call
(:mod:`pccl.collectives.threaded` runs the ring all-reduce's lane loops this way).  This module
is the connection's thread-side half and uses its internals.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import InvalidArgument, InvalidUsage, ProtocolError, StreamClosed
from ..protocol import codec
from ..protocol.codec import DATA_HEADER_SIZE, PREFIX_SIZE, DataHeader, FrameKind
from .blocking import BlockingIO, Interrupted, ThreadCancel
from .framed import _COALESCE_LIMIT, _DISCARD_CHUNK, _READ_AHEAD, FramedConnection, _byte_view

__all__ = ["BlockingDataChannel"]

#: How often a thread waiting for a connection's send lock checks for cancellation (seconds).
_LOCK_POLL = 0.05

logger = logging.getLogger(__name__)


class BlockingDataChannel:
    """Thread-side data frames on a :class:`FramedConnection` (the bulk fast path).

    The same wire format and the same receive buffer as the connection's async methods, driven
    by blocking calls from worker threads: one thread may send while another receives, and a
    threading lock keeps concurrent senders' frames whole.  Do not use the connection's async
    send methods while threads use the channel (send through :meth:`send_data_soon` from the
    Trio thread instead); async and thread-side receives may only alternate under an
    :class:`~pccl.collectives.links.Inbox`'s read role.

    Failures mark the connection unusable in that direction (as the async methods do) and raise;
    a transfer torn midway leaves the peer a torn frame, so the caller must then
    :meth:`FramedConnection.abort` the connection — on the Trio thread, after its threads have
    stopped (or to stop them: see :class:`~pccl.net.blocking.ThreadCancel`).
    """

    def __init__(self, connection: FramedConnection, io: BlockingIO) -> None:
        self.connection = connection
        self._io = io
        self._send_lock = threading.Lock()

    @property
    def remote_address(self) -> str:
        return self.connection.remote_address

    # -- sending --

    def send_data(self, header: DataHeader, payload: memoryview, cancel: ThreadCancel) -> None:
        """Send one data frame (blocking).  ``Interrupted`` (before anything was written) if
        ``cancel`` is cancelled; transport errors leave the connection unusable for sending."""
        conn = self.connection
        view = _byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        prefix = codec.encode_data_prefix(header)
        self._acquire(cancel)
        try:
            self._check_sendable()
            with cancel.transfer(conn, "send"):
                try:
                    if view.nbytes <= _COALESCE_LIMIT:
                        self._io.send_all(memoryview(prefix + view))
                    else:
                        self._io.send_all(memoryview(prefix))
                        self._io.send_all(view)
                except BaseException as exc:
                    conn._send_broken = f"a send was interrupted mid-frame ({type(exc).__name__})"
                    raise
            self._count_sent(len(prefix) + view.nbytes, view.nbytes)
        finally:
            self._send_lock.release()

    def _check_sendable(self) -> None:
        conn = self.connection
        if conn._send_broken is not None:
            raise StreamClosed(f"connection to {conn.remote_address} is unusable: {conn._send_broken}")
        if conn._closed:
            raise StreamClosed(f"connection to {conn.remote_address} is closed")

    def _acquire(self, cancel: ThreadCancel) -> None:
        """Take the send lock, or raise ``Interrupted`` once ``cancel`` is cancelled meanwhile
        (another operation's sender may hold it for a long transfer)."""
        while not self._send_lock.acquire(timeout=_LOCK_POLL):
            cancel.check()
        if cancel.cancelled:
            self._send_lock.release()
            cancel.check()

    def send_data_soon(
        self, header: DataHeader, payload: memoryview, cancel: ThreadCancel
    ) -> Callable[[], None] | None:
        """Start sending one data frame without blocking (any thread, the Trio thread included).

        Returns ``None`` when the whole frame went out at once.  Otherwise returns the rest of
        the job — finish the frame (or send all of it, if the send lock was busy) — which the
        caller must run in a worker thread, in order with the lane's later frames; until it has
        run, the connection's send lock may stay held.  A job that will never run must be given
        up with its ``abandon()`` (when it is a ``_FrameTail``), which releases the lock and marks a begun
        frame torn (then abort the connection).  Errors as for :meth:`send_data`.
        """
        view = _byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        if view.nbytes > _COALESCE_LIMIT or not self._send_lock.acquire(blocking=False):
            return lambda: self.send_data(header, view, cancel)
        try:
            frame = memoryview(codec.encode_data_prefix(header) + view)
            self._check_sendable()
            cancel.check()
            sent = self._io.send_nowait(frame)
        except BaseException:
            self._send_lock.release()
            raise
        if sent == len(frame):
            self._count_sent(len(frame), view.nbytes)
            self._send_lock.release()
            return None

        return _FrameTail(self, frame, sent, view.nbytes, cancel)

    def _count_sent(self, frame_bytes: int, payload_bytes: int) -> None:
        stats = self.connection._stats
        stats["frames_sent"] += 1
        stats["bytes_sent"] += frame_bytes
        stats["data_bytes_sent"] += payload_bytes

    # -- receiving (one thread at a time: the caller's inbox serializes) --

    def receive_data_header(self, cancel: ThreadCancel) -> DataHeader:
        """The next data frame's header (blocking).  ``Interrupted`` if ``cancel`` fires while
        waiting (nothing is lost: a partial header stays buffered); ``ProtocolError`` if a
        control frame or a malformed header arrives."""
        conn = self.connection
        self._check_receivable()
        if conn._data_remaining:
            raise InvalidUsage(f"{conn._data_remaining} payload bytes of the previous data frame are unread")
        try:
            self._fill(PREFIX_SIZE, cancel)
            kind, length = codec.parse_prefix(conn._peek(PREFIX_SIZE), max_frame_size=conn._max_frame_size)
            if kind is not FrameKind.DATA:
                raise ProtocolError(f"{conn.remote_address} sent a control frame where a data frame was expected")
            self._fill(PREFIX_SIZE + DATA_HEADER_SIZE, cancel)
            start = conn._rpos + PREFIX_SIZE
            header = codec.parse_data_header(conn._rbuf[start : start + DATA_HEADER_SIZE], length)
        except ProtocolError as exc:
            conn._receive_broken = str(exc)
            logger.warning("protocol error from %s: %s", conn.remote_address, exc)
            raise
        conn._rpos += PREFIX_SIZE + DATA_HEADER_SIZE
        conn._stats["frames_received"] += 1
        conn._data_header = header if header.nbytes else None
        conn._data_remaining = header.nbytes
        return header

    def receive_data_into(self, buffer: memoryview, cancel: ThreadCancel) -> None:
        """The next ``len(buffer)`` payload bytes of the current frame (blocking).  A failure or
        a cancellation midway leaves the connection unusable for receiving."""
        conn = self.connection
        view = _byte_view(buffer, writable=True)
        self._check_receivable()
        if view.nbytes > conn._data_remaining:
            raise InvalidUsage(
                f"destination of {view.nbytes} bytes is larger than the {conn._data_remaining} payload bytes left"
            )
        taken = min(view.nbytes, conn._rend - conn._rpos)
        if taken:
            view[:taken] = conn._rbuf[conn._rpos : conn._rpos + taken]
            conn._rpos += taken
            conn._consume_payload(taken)
        filled, total = taken, view.nbytes
        if filled == total:
            return
        with cancel.transfer(conn, "receive"):
            try:
                while filled < total:
                    n = self._io.receive_into(view[filled:], fill=True)
                    if n == 0:
                        raise conn._eof_error(f"after {filled} of {total} payload bytes")
                    filled += n
            except BaseException as exc:
                conn._receive_broken = f"a payload receive was interrupted ({type(exc).__name__})"
                raise
        conn._stats["bytes_received"] += total - taken
        conn._consume_payload(total - taken)

    def discard_data(self, cancel: ThreadCancel) -> None:
        """Read and drop the rest of the current frame's payload."""
        conn = self.connection
        scratch = bytearray(min(conn._data_remaining, _DISCARD_CHUNK))
        while conn._data_remaining:
            self.receive_data_into(memoryview(scratch)[: min(conn._data_remaining, len(scratch))], cancel)

    def _check_receivable(self) -> None:
        conn = self.connection
        if conn._closed:
            raise StreamClosed(f"connection to {conn.remote_address} is closed")
        if conn._receive_broken is not None:
            raise ProtocolError(
                f"connection to {conn.remote_address} is unusable after an earlier failure: {conn._receive_broken}"
            )

    def _fill(self, n: int, cancel: ThreadCancel) -> None:
        conn = self.connection
        if conn._rend - conn._rpos >= n:
            return
        if conn._rpos + n > _READ_AHEAD:
            pending = conn._rend - conn._rpos
            conn._rbuf[:pending] = conn._rbuf[conn._rpos : conn._rend]
            conn._rpos, conn._rend = 0, pending
        with memoryview(conn._rbuf) as view:
            while conn._rend - conn._rpos < n:
                self._io.wait_readable(cancel)
                got = self._io.receive_into(view[conn._rend :])
                if got == 0:
                    have = conn._rend - conn._rpos
                    raise conn._eof_error("at a frame boundary" if have == 0 else f"after {have} bytes of a frame")
                conn._rend += got
                conn._stats["bytes_received"] += got


class _FrameTail:
    """The rest of a frame :meth:`BlockingDataChannel.send_data_soon` began while holding the
    send lock: calling it (in a worker thread) sends the rest and releases the lock;
    :meth:`abandon` releases the lock without sending (the frame is torn if it began)."""

    def __init__(self, channel: BlockingDataChannel, frame: memoryview, sent: int, payload_bytes: int,
                 cancel: ThreadCancel) -> None:
        self._channel, self._frame, self._sent = channel, frame, sent
        self._payload_bytes, self._cancel = payload_bytes, cancel

    def __call__(self) -> None:
        channel, conn = self._channel, self._channel.connection
        try:
            with self._cancel.transfer(conn, "send"):
                try:
                    channel._io.send_all(self._frame[self._sent :])
                except BaseException as exc:
                    conn._send_broken = f"a send was interrupted mid-frame ({type(exc).__name__})"
                    raise
            channel._count_sent(len(self._frame), self._payload_bytes)
        except Interrupted:
            if self._sent:  # a torn frame: the peer must not take what follows for a header
                conn._send_broken = "a send was interrupted mid-frame (Interrupted)"
            raise
        finally:
            channel._send_lock.release()

    def abandon(self) -> None:
        if self._sent:
            self._channel.connection._send_broken = "a send was abandoned mid-frame"
        self._channel._send_lock.release()
