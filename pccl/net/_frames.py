"""The sans-IO core of a framed connection: receive buffer, frame parsing, state and counters.

A :class:`FrameCore` holds everything about one connection's frames that does not depend on how
bytes move: the read-ahead buffer and the frame being parsed (:mod:`pccl.protocol.codec` does the
byte-level decoding), the data frame whose payload is being received, whether either direction
is broken or the connection closed, and the counters.  Two thin I/O loops drive it:

* :class:`pccl.net.framed.FramedConnection`, the Trio path (``await stream.receive_into``);
* :class:`pccl.net.framed_threads.BlockingDataChannel`, worker threads doing blocking I/O on
  the same connection (the bulk fast path on real TCP).

Neither imports the other: both only feed this core, so they cannot drift apart.  The core never
blocks and never touches a socket.  Receiving follows h11's receive buffer: :meth:`FrameCore.next_frame`
parses what is buffered and answers ``None`` when it needs more bytes; the caller then receives
into :meth:`FrameCore.read_buffer` and reports the count with :meth:`FrameCore.received`.  A data
frame's payload is not buffered here: after its header, the caller copies what the read-ahead
already holds with :meth:`FrameCore.take_payload` and receives the rest straight into the
destination (:meth:`FrameCore.payload_received`).

Memory follows the bytes that arrived, never the length a frame announces: the other side may
be anyone (without a run token, the handshake proves nothing), and announcing a 16 MiB frame
costs it 5 bytes.  The read-ahead buffer starts at 4 KiB and grows (×4, up to
:data:`READ_AHEAD`) only when it is full of bytes that arrived; a control frame larger than
that is received into a body that doubles as it fills.  Those bodies draw on one
per-process :class:`IncompleteFrameBudget` (:data:`PROCESS_BUDGET`): a frame that would take
the process past it fails its connection with a ``ProtocolError``, whatever the other
connections are, so a crowd of half-sent frames holds at most the budget.

:class:`FrameDecoder` is the same core behind a ``feed(bytes)`` / ``next_event()`` interface
that buffers payloads too (for tests and fuzzing, h11's style).
"""

from __future__ import annotations

import enum
import logging
from typing import NamedTuple

from ..errors import FrameTooLarge, InvalidArgument, InvalidUsage, PeerDisconnected, ProtocolError, StreamClosed
from ..protocol import codec
from ..protocol.codec import DATA_HEADER_SIZE, PREFIX_SIZE, DataHeader, FrameKind
from ..protocol.messages import Message

__all__ = [
    "READ_AHEAD",
    "IncompleteFrameBudget",
    "PROCESS_BUDGET",
    "COALESCE_LIMIT",
    "DISCARD_CHUNK",
    "FrameCore",
    "data_frame_parts",
    "byte_view",
    "FrameDecoder",
    "ControlFrame",
    "DataFrame",
    "NEED_DATA",
    "END_OF_STREAM",
]

logger = logging.getLogger(__name__)

#: Largest read-ahead buffer: once a connection is busy, many small frames arrive per syscall.
READ_AHEAD = 64 * 1024
#: A connection's first read-ahead buffer: a connection that has proved nothing (or only ever
#: exchanges a few small messages) costs no more; it grows towards READ_AHEAD while reads fill it.
_FIRST_READ_AHEAD = 4 * 1024
#: Payloads up to this size are copied behind their header and sent in one write (one segment
#: with TCP_NODELAY, lower latency); larger ones are sent from the caller's memory as they are.
COALESCE_LIMIT = 64 * 1024
#: Scratch size for discarding a payload nobody wants.
DISCARD_CHUNK = 1024 * 1024
#: Bytes that control frames still arriving may hold, over every connection of the process
#: (legitimate control frames are far smaller; see :class:`IncompleteFrameBudget`).
INCOMPLETE_FRAMES_BUDGET = 64 * 1024 * 1024

_COUNTERS = ("frames_sent", "frames_received", "bytes_sent", "bytes_received", "data_bytes_sent",
             "data_bytes_received")


def byte_view(buffer: object, *, writable: bool) -> memoryview:
    """A flat unsigned-byte view of ``buffer`` (no copy); ``InvalidArgument`` if impossible."""
    try:
        view = memoryview(buffer)  # type: ignore[arg-type]
    except TypeError as exc:
        raise InvalidArgument(f"expected a buffer (bytes, bytearray, memoryview, numpy array), got {type(buffer).__name__}") from exc
    if not view.c_contiguous:
        raise InvalidArgument("buffer must be C-contiguous")
    if writable and view.readonly:
        raise InvalidArgument("destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def data_frame_parts(header: DataHeader, payload: memoryview) -> tuple[bytes | memoryview, ...]:
    """The writes that send one data frame: prefix and header, then the payload — in one piece
    when the payload is small (:data:`COALESCE_LIMIT`), from the caller's memory otherwise.
    ``payload`` is a flat byte view whose size ``header.nbytes`` must equal (callers check)."""
    prefix = codec.encode_data_prefix(header)
    if payload.nbytes <= COALESCE_LIMIT:
        return (prefix + payload,)
    return (prefix, payload)


class IncompleteFrameBudget:
    """The bytes that bodies of control frames still arriving may hold, shared by every
    connection that draws on it (:data:`PROCESS_BUDGET`: the whole process).

    It always has room for two frames of the largest ``max_frame_size`` a connection using it
    was created with (:meth:`admit_frame_size`), so a large configured limit still works.
    Used from the Trio thread only: the worker-thread path receives data frames only and refuses
    a control frame from its prefix (``next_frame(data_only=True)``), before any body exists."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        #: Bytes reserved by bodies being received.
        self.in_use = 0

    def admit_frame_size(self, max_frame_size: int) -> None:
        self.limit = max(self.limit, 2 * max_frame_size)

    def reserve(self, nbytes: int) -> bool:
        """Take ``nbytes`` if the budget has them."""
        if self.in_use + nbytes > self.limit:
            return False
        self.in_use += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.in_use -= nbytes


#: The budget every connection of this process draws on by default.
PROCESS_BUDGET = IncompleteFrameBudget(INCOMPLETE_FRAMES_BUDGET)


class FrameCore:
    """One connection's frame state (see the module docstring).  Not thread-safe by itself: at
    most one receiver at a time (``InvalidUsage`` otherwise) and senders serialised by their
    I/O loop's lock; the two directions may run in different threads."""

    def __init__(self, *, max_frame_size: int, remote_address: str,
                 budget: IncompleteFrameBudget | None = None) -> None:
        self.remote_address = remote_address
        #: Largest control frame accepted (``Config.max_frame_size``); the handshake lowers it.
        self.max_frame_size = max_frame_size
        self._budget = PROCESS_BUDGET if budget is None else budget
        self._budget.admit_frame_size(max_frame_size)
        self._rbuf = bytearray(_FIRST_READ_AHEAD)
        self._grow = False  # the last receive filled the buffer: make it larger
        self._rpos = 0
        self._rend = 0
        self._need = PREFIX_SIZE  # bytes the frame being parsed needs at _rpos
        # A control frame too large for the read-ahead buffer, being received directly into a
        # body that grows as it fills (its size is reserved from the budget).
        self._big_body: bytearray | None = None
        self._big_length = 0
        self._big_filled = 0
        self._data_header: DataHeader | None = None
        self._data_remaining = 0
        self._receiving = False
        self._receive_broken: str | None = None
        self._send_broken: str | None = None
        self._closed = False
        self.counters = dict.fromkeys(_COUNTERS, 0)

    # --- state ---------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """This side closed (or aborted) the connection: every later use fails."""
        self._closed = True
        self._drop_big_body()

    def __del__(self) -> None:
        # A connection dropped without close() must not keep its share of the budget.
        self._drop_big_body()

    @property
    def allocated(self) -> int:
        """Bytes this core holds for receiving: the read-ahead buffer and a body in progress."""
        return len(self._rbuf) + (len(self._big_body) if self._big_body is not None else 0)

    @property
    def broken(self) -> bool:
        """Whether a torn frame or a protocol error made this connection unusable (abort it)."""
        return self._send_broken is not None or self._receive_broken is not None

    @property
    def at_rest(self) -> bool:
        """Whether the receiving side is between frames with nothing received unread: nobody
        receives, no payload of a data frame is pending, no bytes wait in the buffer."""
        return not self._receiving and not self._data_remaining and self.buffered == 0

    def mark_receive_broken(self, reason: str) -> None:
        """Receiving cannot go on (a torn payload, a frame that is not what was expected)."""
        self._receive_broken = reason

    def mark_send_broken(self, reason: str) -> None:
        """Some unknown prefix of a frame may be on the wire: no further frame may follow."""
        self._send_broken = reason

    def check_sendable(self) -> None:
        if self._send_broken is not None:
            raise StreamClosed(f"connection to {self.remote_address} is unusable: {self._send_broken}")
        if self._closed:
            raise StreamClosed(f"connection to {self.remote_address} is closed")

    def check_receivable(self) -> None:
        if self._receiving:
            raise InvalidUsage(f"another task is already receiving on the connection to {self.remote_address}")
        if self._closed:
            raise StreamClosed(f"connection to {self.remote_address} is closed")
        if self._receive_broken is not None:
            raise ProtocolError(
                f"connection to {self.remote_address} is unusable after an earlier failure: {self._receive_broken}"
            )

    def begin_receive(self) -> None:
        """Take the receiving side for the next frame (release it with :meth:`end_receive`):
        the checks of :meth:`check_receivable`, and the previous data frame must be consumed."""
        self.check_receivable()
        if self._data_remaining:
            raise InvalidUsage(
                f"{self._data_remaining} payload bytes of the previous data frame are unread; "
                "call receive_data_into or discard_data first"
            )
        self._receiving = True

    def begin_payload(self, nbytes: int) -> bool:
        """Take the receiving side for ``nbytes`` of the current data frame's payload; False
        (nothing taken) for zero bytes.  ``InvalidUsage`` without a current data frame or for
        more bytes than it has left."""
        self.check_receivable()
        if not nbytes:
            return False
        if self._data_header is None:
            raise InvalidUsage("receive_data_into called without a current data frame (receive_data_header first)")
        if nbytes > self._data_remaining:
            raise InvalidUsage(
                f"destination of {nbytes} bytes is larger than the {self._data_remaining} payload bytes "
                "left in the current data frame"
            )
        self._receiving = True
        return True

    def end_receive(self) -> None:
        self._receiving = False

    # --- parsing ---------------------------------------------------------------------------------

    def next_frame(self, *, data_only: bool = False) -> Message | DataHeader | None:
        """The next frame from what is buffered: a control message, or a data frame's header
        (whose payload must be consumed next), or ``None`` when more bytes are needed (receive
        into :meth:`read_buffer`).  ``ProtocolError`` (receiving is then broken) for a malformed
        or oversized frame, and with ``data_only`` for a control frame, refused from its prefix
        (the worker-thread path, which must not draw on the budget).  Logged at DEBUG only:
        the caller gets the error and logs it with its context."""
        try:
            return self._next_frame(data_only)
        except ProtocolError as exc:
            self._receive_broken = str(exc)
            logger.debug("protocol error from %s: %s", self.remote_address, exc)
            raise

    def _next_frame(self, data_only: bool) -> Message | DataHeader | None:
        if self._big_body is not None:
            return self._finish_big_body()
        have = self._rend - self._rpos
        if have < PREFIX_SIZE:
            self._need = PREFIX_SIZE
            return None
        kind, length = codec.parse_prefix(self._rbuf[self._rpos : self._rpos + PREFIX_SIZE],
                                          max_frame_size=self.max_frame_size)
        if data_only and kind is not FrameKind.DATA:
            raise ProtocolError(f"{self.remote_address} sent a {length}-byte control frame where a data frame "
                                "was expected")
        if kind is FrameKind.DATA:
            if have < PREFIX_SIZE + DATA_HEADER_SIZE:
                self._need = PREFIX_SIZE + DATA_HEADER_SIZE
                return None
            start = self._rpos + PREFIX_SIZE
            header = codec.parse_data_header(self._rbuf[start : start + DATA_HEADER_SIZE], length)
            self._rpos = start + DATA_HEADER_SIZE
            self._need = PREFIX_SIZE
            self.counters["frames_received"] += 1
            self._data_header = header if header.nbytes else None
            self._data_remaining = header.nbytes
            return header
        if PREFIX_SIZE + length <= READ_AHEAD:  # received through the (grown) read-ahead buffer
            if have < PREFIX_SIZE + length:
                self._need = PREFIX_SIZE + length
                return None
            start = self._rpos + PREFIX_SIZE
            with memoryview(self._rbuf) as view:
                body = view[start : start + length]
                try:
                    message = codec.decode_message(body)
                finally:
                    body.release()
            self._rpos = start + length
            self._need = PREFIX_SIZE
            self.counters["frames_received"] += 1
            return message
        # Larger than the read-ahead buffer (length already checked against max_frame_size):
        # move what is buffered into a body sized by what arrived, then fill it directly.
        taken = min(length, have - PREFIX_SIZE)
        self._big_body = self._reserve_body(bytearray(), min(length, max(_FIRST_READ_AHEAD, 2 * taken)), length)
        self._big_length = length
        self._rpos += PREFIX_SIZE
        self._big_body[:taken] = self._rbuf[self._rpos : self._rpos + taken]
        self._rpos += taken
        self._big_filled = taken
        return self._finish_big_body()

    def _reserve_body(self, body: bytearray, capacity: int, length: int) -> bytearray:
        """``body`` grown to ``capacity`` bytes (its contents kept), the growth reserved from
        the budget; ``ProtocolError`` if the budget has no room for it."""
        if not self._budget.reserve(capacity - len(body)):
            raise ProtocolError(
                f"{self.remote_address} sends a {length}-byte control frame, and control frames still "
                f"arriving already hold {self._budget.in_use} bytes, this process's limit "
                f"({self._budget.limit} bytes): refused"
            )
        grown = bytearray(capacity)
        grown[: len(body)] = body
        return grown

    def _drop_big_body(self) -> None:
        body = getattr(self, "_big_body", None)  # __del__ may run on a half-built core
        if body is not None:
            self._budget.release(len(body))
            self._big_body = None

    def _finish_big_body(self) -> Message | None:
        body = self._big_body
        assert body is not None
        if self._big_filled < self._big_length:
            return None
        self._drop_big_body()
        self._need = PREFIX_SIZE
        self.counters["frames_received"] += 1
        return codec.decode_message(body)

    def take_raw(self, n: int) -> bytes | None:
        """The next ``n`` raw bytes (``n`` ≤ :data:`READ_AHEAD`; the handshake's preamble, which
        is not a frame), or ``None`` while fewer are buffered."""
        if self._rend - self._rpos < n:
            self._need = n
            return None
        raw = bytes(self._rbuf[self._rpos : self._rpos + n])
        self._rpos += n
        self._need = PREFIX_SIZE
        return raw

    def take_buffered(self) -> bytes:
        """Everything received and not yet consumed, as raw bytes, leaving the buffer empty:
        for a connection whose framing ends here (a relay splices the raw stream from now on,
        :meth:`pccl.net.framed.FramedConnection.detach`).  ``InvalidUsage`` inside a frame."""
        if self._big_body is not None or self._data_remaining or self._receiving:
            raise InvalidUsage("cannot take the raw bytes of a connection in the middle of a frame")
        raw = bytes(self._rbuf[self._rpos : self._rend])
        self._rpos = self._rend = 0
        self._need = PREFIX_SIZE
        return raw

    def read_buffer(self) -> memoryview:
        """Where the next received bytes go (a writable view; receive into it, then call
        :meth:`received`).  Compacts the read-ahead buffer when the frame being parsed would
        not fit behind the unread bytes, and grows it (up to :data:`READ_AHEAD`) when the frame
        needs more room or the last receive filled it."""
        if self._big_body is not None:
            body = self._big_body
            if self._big_filled == len(body):  # full, and the frame is not complete: double it
                self._big_body = body = self._reserve_body(body, min(self._big_length, 2 * len(body)),
                                                           self._big_length)
            return memoryview(body)[self._big_filled :]
        size = len(self._rbuf)
        pending = self._rend - self._rpos
        # Grow only a buffer that arrived bytes filled: the frame being parsed may announce more
        # (up to READ_AHEAD), but room for bytes that never come is not allocated up front.
        if size < READ_AHEAD and (self._grow or pending == size):
            bigger = bytearray(min(READ_AHEAD, size * 4))
            bigger[:pending] = self._rbuf[self._rpos : self._rend]
            self._rbuf, self._rpos, self._rend = bigger, 0, pending
        elif self._rpos + self._need > size or self._rend == size or (pending == 0 and self._rpos):
            # (Nothing unread: start over at no cost, so a whole small frame lands in one receive.)
            self._rbuf[:pending] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, pending
        self._grow = False
        return memoryview(self._rbuf)[self._rend :]

    def received(self, n: int) -> None:
        """``n`` bytes landed in :meth:`read_buffer`; ``0`` means the other side closed
        (``PeerDisconnected`` saying where in a frame)."""
        if n == 0:
            raise self.eof_error(self._eof_position())
        self.counters["bytes_received"] += n
        if self._big_body is not None:
            self._big_filled += n
        else:
            self._rend += n
            self._grow = self._rend == len(self._rbuf)

    def _eof_position(self) -> str:
        if self._big_body is not None:
            return f"in the middle of a {self._big_length}-byte control frame"
        have = self._rend - self._rpos
        return "at a frame boundary" if have == 0 else f"after {have} bytes of a frame"

    def eof_error(self, where: str) -> PeerDisconnected:
        return PeerDisconnected(f"{self.remote_address} closed the connection {where}")

    def partial_frame(self) -> tuple[int, int]:
        """``(have, needs)``: bytes buffered of the frame being parsed, and how many it needs in
        all as far as known (after :meth:`next_frame` answered ``None``)."""
        if self._big_body is not None:
            return PREFIX_SIZE + self._big_filled, PREFIX_SIZE + self._big_length
        have = self._rend - self._rpos
        return have, max(self._need, have)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed (a partial frame, or frames not yet parsed)."""
        extra = self._big_filled if self._big_body is not None else 0
        return self._rend - self._rpos + extra

    # --- data frame payloads ---------------------------------------------------------------------

    @property
    def data_header(self) -> DataHeader | None:
        """The data frame whose payload is being received (``None`` when none is)."""
        return self._data_header

    @property
    def data_remaining(self) -> int:
        """Payload bytes of the current data frame not yet received."""
        return self._data_remaining

    def check_data_header(self, header: DataHeader, **expected: int | None) -> None:
        """``header.check(**expected)``, marking receiving broken (and logging) on a mismatch."""
        try:
            header.check(**expected)
        except ProtocolError as exc:
            self._receive_broken = str(exc)
            logger.debug("bad data frame from %s: %s", self.remote_address, exc)
            raise

    def unexpected_frame(self, frame: Message | DataHeader, wanted: str) -> ProtocolError:
        """The error for a frame of the wrong kind (``wanted``: "a control message" or "a data
        frame"); receiving is broken from now on."""
        if isinstance(frame, DataHeader):
            self._receive_broken = "an unexpected data frame arrived"
            got = f"a data frame ({frame.describe()})"
        else:
            self._receive_broken = "an unexpected control frame arrived"
            got = type(frame).__name__
        return ProtocolError(f"{self.remote_address} sent {got} where {wanted} was expected")

    def take_payload(self, destination: memoryview) -> int:
        """Copy the current payload's bytes that the read-ahead buffer already holds into the
        start of ``destination`` (a flat byte view); returns how many."""
        taken = min(destination.nbytes, self._rend - self._rpos, self._data_remaining)
        if taken:
            destination[:taken] = self._rbuf[self._rpos : self._rpos + taken]
            self._rpos += taken
            self._consume_payload(taken)
        return taken

    def payload_received(self, n: int) -> None:
        """``n`` payload bytes were received straight into the destination."""
        self.counters["bytes_received"] += n
        self._consume_payload(n)

    def _consume_payload(self, n: int) -> None:
        self._data_remaining -= n
        self.counters["data_bytes_received"] += n
        if not self._data_remaining:
            self._data_header = None

    # --- sending ---------------------------------------------------------------------------------

    def count_sent(self, frame_bytes: int, payload_bytes: int = 0) -> None:
        """One whole frame went out (``payload_bytes`` of it data payload)."""
        counters = self.counters
        counters["frames_sent"] += 1
        counters["bytes_sent"] += frame_bytes
        counters["data_bytes_sent"] += payload_bytes


# --- the buffering decoder ---------------------------------------------------------------------


class ControlFrame(NamedTuple):
    """Event: a complete control frame."""

    message: Message


class DataFrame(NamedTuple):
    """Event: a complete data frame (the decoder buffers the payload)."""

    header: DataHeader
    payload: bytes


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    END_OF_STREAM = "END_OF_STREAM"


#: Event: the buffered bytes do not yet hold a complete frame.
NEED_DATA = _Sentinel.NEED_DATA
#: Event: the input ended cleanly at a frame boundary.
END_OF_STREAM = _Sentinel.END_OF_STREAM


class FrameDecoder:
    """:class:`FrameCore` in the style of h11: :meth:`feed` bytes, pull :meth:`next_event`.

    The parsing, checks and errors are the connections' own (the same core); unlike a
    connection the decoder buffers data payloads, so it refuses any data frame longer than
    ``max_data_payload`` (default ``max_frame_size``) once its header is known.
    """

    def __init__(self, *, max_frame_size: int, max_data_payload: int | None = None) -> None:
        self._core = FrameCore(max_frame_size=max_frame_size, remote_address="the decoder's input")
        self._max_data_payload = max_frame_size if max_data_payload is None else max_data_payload
        self._input = bytearray()
        self._header: DataHeader | None = None
        self._payload = bytearray()
        self._eof = False
        self._broken: ProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes fed but not yet consumed by an event."""
        return len(self._input) + self._core.buffered + len(self._payload)

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes.  Feeding after :meth:`feed_eof` is a :class:`ProtocolError`."""
        if self._eof and len(data):
            raise ProtocolError("data fed after end of stream")
        self._input += data

    def feed_eof(self) -> None:
        """Mark the end of input: a partial frame left over becomes a :class:`ProtocolError`."""
        self._eof = True

    def next_event(self) -> ControlFrame | DataFrame | _Sentinel:
        """The next complete frame, :data:`NEED_DATA` or :data:`END_OF_STREAM`.

        Raises :class:`ProtocolError` on malformed input; after that every call raises it again.
        """
        if self._broken is not None:
            raise ProtocolError(f"decoder unusable after an earlier error: {self._broken}")
        try:
            return self._next_event()
        except ProtocolError as exc:
            self._broken = exc
            raise

    def _next_event(self) -> ControlFrame | DataFrame | _Sentinel:
        core = self._core
        while True:
            if self._header is not None:
                event = self._continue_payload()
                if event is not None:
                    return event
            else:
                frame = core.next_frame()
                if isinstance(frame, DataHeader):
                    if frame.nbytes > self._max_data_payload:
                        raise FrameTooLarge(
                            f"data frame of {frame.nbytes} payload bytes exceeds this decoder's "
                            f"limit of {self._max_data_payload}"
                        )
                    self._header = frame
                    continue
                if frame is not None:
                    return ControlFrame(frame)
            if not self._input:
                return self._incomplete()
            self._move_input(core.read_buffer() if self._header is None else None)

    def _continue_payload(self) -> DataFrame | None:
        header, core = self._header, self._core
        assert header is not None
        want = header.nbytes - len(self._payload)
        if want:
            scratch = bytearray(want)
            with memoryview(scratch) as view:
                got = core.take_payload(view)
            self._payload += scratch[:got]
            want -= got
        if want:
            return None
        self._header = None
        payload, self._payload = bytes(self._payload), bytearray()
        return DataFrame(header, payload)

    def _move_input(self, target: memoryview | None) -> None:
        """Hand fed bytes on: into the core's read buffer, or straight to the payload."""
        if target is None:  # a payload beyond the core's buffer: take it from the input
            assert self._header is not None
            n = min(len(self._input), self._header.nbytes - len(self._payload))
            self._payload += self._input[:n]
            self._core.payload_received(n)
        else:
            n = min(len(self._input), target.nbytes)
            target[:n] = self._input[:n]
            target.release()
            self._core.received(n)
        del self._input[:n]

    def _incomplete(self) -> _Sentinel:
        if not self._eof:
            return NEED_DATA
        if self._header is not None:
            before = PREFIX_SIZE + DATA_HEADER_SIZE
            have, needs = before + len(self._payload), before + self._header.nbytes
        else:
            have, needs = self._core.partial_frame()
            if not have:
                return END_OF_STREAM
        raise ProtocolError(f"truncated frame at end of stream: {have} of {needs} bytes")
