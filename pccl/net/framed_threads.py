"""Thread-side data frames on a framed connection: the bulk fast path.

:func:`thread_channel` returns a connection's :class:`BlockingDataChannel` when its stream
offers blocking I/O (:meth:`~pccl.net.base.Stream.blocking_io`; real TCP does).  Worker threads
then send and receive whole data frames with blocking calls — the same wire format, the same
receive buffer and the same checks as the connection's async methods, because both drive one
:class:`~pccl.net._frames.FrameCore` — without a Trio hand-off per call
(:mod:`pccl.collectives.threaded` runs the ring all-reduce's lane loops this way).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

from ..errors import InvalidArgument
from ..protocol.codec import DataHeader
from ._frames import COALESCE_LIMIT, DISCARD_CHUNK, FrameCore, byte_view, data_frame_parts
from .thread_io import BlockingIO, Interrupted, ThreadCancel

__all__ = ["BlockingDataChannel", "ThreadedConnection", "thread_channel"]

#: How often a thread waiting for a connection's send lock checks for cancellation (seconds).
_LOCK_POLL = 0.05

logger = logging.getLogger(__name__)


class ThreadedConnection(Protocol):
    """What a connection offers the thread path (:class:`pccl.net.framed.FramedConnection` does)."""

    frames: FrameCore
    thread_channel: BlockingDataChannel | None
    remote_address: str

    def blocking_io(self) -> BlockingIO | None: ...

    def abort(self) -> None: ...


def thread_channel(connection: ThreadedConnection) -> BlockingDataChannel | None:
    """The connection's thread-side data channel (one per connection, made on first use), or
    ``None`` if its stream offers no blocking I/O (the simulator's and TLS streams)."""
    channel = connection.thread_channel
    if channel is None:
        io = connection.blocking_io()
        if io is None:
            return None
        channel = connection.thread_channel = BlockingDataChannel(connection, io)
    return channel


class BlockingDataChannel:
    """Thread-side data frames on one connection (the bulk fast path).

    Driven by blocking calls from worker threads: one thread may send while another receives,
    and a threading lock keeps concurrent senders' frames whole.  Do not use the connection's
    async send methods while threads use the channel (send through :meth:`send_data_soon` from
    the Trio thread instead); async and thread-side receives may only alternate under an
    :class:`~pccl.collectives.links.Inbox`'s read role.

    Failures mark the connection unusable in that direction (as the async methods do) and raise;
    a transfer torn midway leaves the peer a torn frame, so the caller must then abort the
    connection — on the Trio thread, after its threads have stopped (or to stop them: see
    :class:`~pccl.net.thread_io.ThreadCancel`, with which transfers register the connection).
    """

    def __init__(self, connection: ThreadedConnection, io: BlockingIO) -> None:
        self.connection = connection
        self._frames = connection.frames
        self._io = io
        self._send_lock = threading.Lock()

    @property
    def send_lock(self) -> threading.Lock:
        """Held while a frame is being written (tests hold it as if a sender were mid-frame)."""
        return self._send_lock

    @property
    def remote_address(self) -> str:
        return self.connection.remote_address

    # -- sending --

    @property
    def sending(self) -> bool:
        """Whether a thread holds the send lock (a frame, or a job that finishes one, is under
        way)."""
        return self._send_lock.locked()

    def send_data(self, header: DataHeader, payload: memoryview, cancel: ThreadCancel) -> None:
        """Send one data frame (blocking).  ``Interrupted`` (before anything was written) if
        ``cancel`` is cancelled; transport errors leave the connection unusable for sending."""
        view = byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        parts = data_frame_parts(header, view)
        self._acquire(cancel)
        try:
            self._frames.check_sendable()
            with cancel.transfer(self.connection, "send"):
                try:
                    for part in parts:
                        self._io.send_all(memoryview(part))
                except BaseException as exc:
                    self._frames.mark_send_broken(f"a send was interrupted mid-frame ({type(exc).__name__})")
                    raise
            self._frames.count_sent(sum(len(p) for p in parts), view.nbytes)
        finally:
            self._send_lock.release()

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
        the job — finish the frame (or send all of it, if the send lock was busy or the frame
        large) — which the caller must run in a worker thread, in order with the lane's later
        frames; until it has run, the connection's send lock may stay held.  A job that will
        never run must be given up with its ``abandon()`` (when it is a :class:`FrameTail`),
        which releases the lock and marks a begun frame torn (then abort the connection).
        Errors as for :meth:`send_data`.
        """
        view = byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        if view.nbytes > COALESCE_LIMIT or not self._send_lock.acquire(blocking=False):
            return lambda: self.send_data(header, view, cancel)
        try:
            (whole,) = data_frame_parts(header, view)
            frame = memoryview(whole)
            self._frames.check_sendable()
            cancel.check()
            sent = self._io.send_nowait(frame)
        except BaseException:
            self._send_lock.release()
            raise
        if sent == len(frame):
            self._frames.count_sent(len(frame), view.nbytes)
            self._send_lock.release()
            return None
        return FrameTail(self, frame, sent, view.nbytes, cancel)

    def finish_frame(self, frame: memoryview, sent: int, payload_bytes: int, cancel: ThreadCancel) -> None:
        """Send the rest of a frame whose first ``sent`` bytes :meth:`send_data_soon` wrote
        (worker thread, the send lock held), then release the lock."""
        try:
            with cancel.transfer(self.connection, "send"):
                try:
                    self._io.send_all(frame[sent:])
                except BaseException as exc:
                    self._frames.mark_send_broken(f"a send was interrupted mid-frame ({type(exc).__name__})")
                    raise
            self._frames.count_sent(len(frame), payload_bytes)
        except Interrupted:
            if sent:  # a torn frame: the peer must not take what follows for a header
                self._frames.mark_send_broken("a send was interrupted mid-frame (Interrupted)")
            raise
        finally:
            self._send_lock.release()

    def abandon_frame(self, sent: int) -> None:
        """Give up a frame :meth:`send_data_soon` began (its job will not run): release the
        send lock; a frame partly written is torn."""
        if sent:
            self._frames.mark_send_broken("a send was abandoned mid-frame")
        self._send_lock.release()

    # -- receiving (one thread at a time: the caller's inbox serializes) --

    def receive_data_header(self, cancel: ThreadCancel) -> DataHeader:
        """The next data frame's header (blocking).  ``Interrupted`` if ``cancel`` fires while
        waiting (nothing is lost: a partial header stays buffered); ``ProtocolError`` if a
        control frame or a malformed header arrives."""
        frames = self._frames
        frames.begin_receive()
        try:
            while (frame := frames.next_frame(data_only=True)) is None:
                self._io.wait_readable(cancel)
                frames.received(self._io.receive_into(frames.read_buffer()))
        finally:
            frames.end_receive()
        if not isinstance(frame, DataHeader):
            raise frames.unexpected_frame(frame, "a data frame")
        return frame

    def receive_data_into(self, buffer: memoryview, cancel: ThreadCancel) -> None:
        """The next ``len(buffer)`` payload bytes of the current frame (blocking).  A failure or
        a cancellation midway leaves the connection unusable for receiving."""
        frames = self._frames
        view = byte_view(buffer, writable=True)
        if not frames.begin_payload(view.nbytes):
            return
        try:
            filled = taken = frames.take_payload(view)
            total = view.nbytes
            if filled == total:
                return
            with cancel.transfer(self.connection, "receive"):
                try:
                    while filled < total:
                        n = self._io.receive_into(view[filled:], fill=True)
                        if n == 0:
                            raise frames.eof_error(f"after {filled} of {total} payload bytes")
                        filled += n
                except BaseException as exc:
                    frames.mark_receive_broken(f"a payload receive was interrupted ({type(exc).__name__})")
                    raise
            frames.payload_received(total - taken)
        finally:
            frames.end_receive()

    def discard_data(self, cancel: ThreadCancel) -> None:
        """Read and drop the rest of the current frame's payload."""
        frames = self._frames
        scratch = bytearray(min(frames.data_remaining, DISCARD_CHUNK))
        while frames.data_remaining:
            self.receive_data_into(memoryview(scratch)[: min(frames.data_remaining, len(scratch))], cancel)


class FrameTail:
    """The rest of a frame :meth:`BlockingDataChannel.send_data_soon` began while holding the
    send lock: calling it (in a worker thread) sends the rest and releases the lock;
    :meth:`abandon` releases the lock without sending (the frame is torn if it began)."""

    def __init__(self, channel: BlockingDataChannel, frame: memoryview, sent: int, payload_bytes: int,
                 cancel: ThreadCancel) -> None:
        self._channel, self._frame, self._sent = channel, frame, sent
        self._payload_bytes, self._cancel = payload_bytes, cancel

    def __call__(self) -> None:
        self._channel.finish_frame(self._frame, self._sent, self._payload_bytes, self._cancel)

    def abandon(self) -> None:
        self._channel.abandon_frame(self._sent)
