"""A message connection over a pccl Stream: framing, handshake, run-token authentication, TLS.

:class:`FramedConnection` sends and receives the frames of :mod:`pccl.protocol.codec` — control
messages and data frames whose payload goes straight from the sender's memory to the receiver's
destination buffer — over any :class:`~pccl.net.base.Stream` (real TCP or the simulator's).

Open one with :func:`open_framed` (dial an address; this side is the ``CLIENT``) or
:func:`accept_framed` (a stream a Listener accepted; ``SERVER``).  Both run, within
``Config.connect_timeout``: optional TLS (``Config.tls_client_context``/``tls_server_context``),
then the handshake of :mod:`pccl.protocol.handshake` (magic + version, then HMAC challenge-response
in both directions when a run token is set).  Failures: :class:`~pccl.errors.ProtocolError` (not a
pccl peer, version mismatch, malformed handshake), :class:`~pccl.errors.AuthenticationFailed` (on
both sides, each saying why), :class:`~pccl.errors.ConnectTimeout`, or another
:class:`~pccl.errors.TransportError`; the stream is closed before the error escapes.

Receiving is resumable: cancelling :meth:`~FramedConnection.receive` (for example by a timeout)
loses nothing — the next call continues the same frame.  Two operations are not resumable and
therefore *abort* the connection when cancelled or failed midway: a send that has started
writing a frame (the peer would otherwise read a torn frame), and
:meth:`~FramedConnection.receive_data_into` once the payload is arriving.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import trio

from ..config import Config
from ..errors import (
    AuthenticationFailed,
    ConnectTimeout,
    InvalidArgument,
    InvalidUsage,
    PCCLError,
    PeerDisconnected,
    ProtocolError,
    StreamClosed,
)
from ..protocol import codec, handshake
from ..protocol.codec import DATA_HEADER_SIZE, PREFIX_SIZE, DataHeader, FrameKind
from ..protocol.messages import AuthProof, AuthResult, HandshakeRole, Hello, Message
from . import tls
from .base import Network, Stream, parse_address

if TYPE_CHECKING:
    from .framed_threads import BlockingDataChannel

__all__ = [
    "FramedConnection",
    "FramedStatistics",
    "NonceSource",
    "open_framed",
    "accept_framed",
]

logger = logging.getLogger(__name__)

#: Where handshake nonces come from: a ``random.Random`` (the simulator's seeded RNG) or a
#: callable ``n -> n random bytes``.  ``None`` means :func:`secrets.token_bytes`.
NonceSource = Callable[[int], bytes] | random.Random

_M = TypeVar("_M", bound=Message)

# Bytes read per receive when no payload is expected: many small frames arrive in one syscall.
_READ_AHEAD = 64 * 1024
# Payloads up to this size are copied behind their header and sent in one write (one segment
# with TCP_NODELAY, lower latency); larger ones are sent from the caller's memory as they are.
_COALESCE_LIMIT = 64 * 1024
_DISCARD_CHUNK = 1024 * 1024
# How long a side that refused the peer's token proof waits for the peer's verdict before closing.
_VERDICT_GRACE = 1.0


@dataclasses.dataclass(frozen=True)
class FramedStatistics:
    """Counters of one connection (all frames, including the handshake)."""

    frames_sent: int
    frames_received: int
    bytes_sent: int
    bytes_received: int
    #: Payload bytes of data frames only (what ``ReduceInfo.tx_bytes``/``rx_bytes`` count).
    data_bytes_sent: int
    data_bytes_received: int


class FramedConnection:
    """Frames over one Stream.  Obtain one from :func:`open_framed` or :func:`accept_framed`.

    Sends may come from several tasks at once (a lock keeps frames whole); receives must come
    from one task at a time (``InvalidUsage`` otherwise).  ``async with`` closes it.
    """

    def __init__(self, stream: Stream, *, role: HandshakeRole, config: Config) -> None:
        """Wrap an already-connected ``stream`` *without* a handshake (the entry points do that)."""
        self._stream = stream
        self.role = role
        self.remote_address = stream.remote_address
        self.local_address = stream.local_address
        #: Whether the peer proved the run token during the handshake.
        self.authenticated = False
        self._max_frame_size = config.max_frame_size
        self._send_lock = trio.Lock()
        self._send_broken: str | None = None
        #: The tail of a frame that :meth:`send_nowait` could only partly write: it goes out
        #: first, under the send lock, in the next send (or :meth:`flush`).
        self._unsent: memoryview | None = None
        self._receiving = False
        self._receive_broken: str | None = None
        self._rbuf = bytearray(_READ_AHEAD)
        self._rpos = 0
        self._rend = 0
        # A control frame too large for the read-ahead buffer, being received directly.
        self._big_body: bytearray | None = None
        self._big_filled = 0
        self._data_header: DataHeader | None = None
        self._data_remaining = 0
        self._closed = False
        self._blocking: BlockingDataChannel | None = None  # see blocking_channel()
        self._stats = dict.fromkeys(
            ("frames_sent", "frames_received", "bytes_sent", "bytes_received", "data_bytes_sent", "data_bytes_received"),
            0,
        )

    # --- sending ---------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Send one control message.

        ``InvalidArgument`` if it is not a registered message or encodes to more than
        ``Config.max_frame_size`` bytes (the peer, configured alike, would refuse it); transport errors as for ``Stream.send_all``.  Cancellation while waiting for the
        send lock sends nothing; cancellation once writing started aborts the connection.
        """
        frame = codec.encode_message(message, max_frame_size=self._max_frame_size)
        await self._send_frame((frame,), payload_bytes=0)

    def send_nowait(self, message: Message) -> bool:
        """Send one control message now, without waiting, if that can be done (Trio thread).

        ``True``: the frame went to the transport — all of it, or, if the kernel took only a
        part, the rest is kept and goes out first in the next send; :attr:`needs_flush` then
        says so, and the caller must see to it that :meth:`flush` (or another send) runs.
        ``False``: nothing was sent (the connection is busy or broken, or the transport offers
        no such path, as the simulator's and TLS streams do not); use :meth:`send`, which also
        reports errors.  A control message is latency-bound: this saves the lock, the
        cancellation machinery and the trip through the run loop that :meth:`send` costs.
        ``InvalidArgument`` as for :meth:`send`.
        """
        try_send = getattr(self._stream, "send_nowait", None)
        if (try_send is None or self._send_lock.locked() or self._unsent is not None
                or self._send_broken is not None or self._closed):
            return False
        frame = codec.encode_message(message, max_frame_size=self._max_frame_size)
        sent = try_send(frame)
        if not sent:
            return False
        if sent < len(frame):
            self._unsent = memoryview(frame)[sent:]
        self._stats["frames_sent"] += 1
        self._stats["bytes_sent"] += len(frame)
        return True

    @property
    def needs_flush(self) -> bool:
        """Whether part of a frame from :meth:`send_nowait` still waits to be sent."""
        return self._unsent is not None

    async def flush(self) -> None:
        """Send what :meth:`send_nowait` left over; errors as for :meth:`send`.

        The frame is already partly on the wire, so cancellation here aborts the connection
        (as cancelling :meth:`send` midway does).  With nothing left over this is a schedule
        point that never raises ``Cancelled`` (the message went out)."""
        if self._unsent is None:
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        await self._send_frame((), payload_bytes=0, count=False)

    async def send_data(self, header: DataHeader, payload: bytes | bytearray | memoryview) -> None:
        """Send one data frame: ``header`` then ``payload`` (any C-contiguous buffer, e.g. a numpy
        array or a memoryview slice of one), without copying large payloads.

        ``header.nbytes`` must equal the payload's size in bytes (``InvalidArgument`` otherwise).
        Cancellation as for :meth:`send`.
        """
        view = _byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        prefix = codec.encode_data_prefix(header)
        parts: tuple[bytes | memoryview, ...]
        parts = (prefix + view,) if view.nbytes <= _COALESCE_LIMIT else (prefix, view)
        await self._send_frame(parts, payload_bytes=view.nbytes)

    async def _send_frame(self, parts: tuple[bytes | memoryview, ...], *, payload_bytes: int, count: bool = True) -> None:
        # An idle lock is taken without the schedule point of ``Lock.acquire``: the send below
        # ends in one anyway, and a control message (the master's votes) is latency-bound, so
        # one trip through the run loop less per frame is measurable.  A cancel already
        # pending surfaces at the check below, before anything is written.
        try:
            self._send_lock.acquire_nowait()
        except trio.WouldBlock:
            await self._send_lock.acquire()
        try:
            if self._send_broken is not None:
                raise StreamClosed(f"connection to {self.remote_address} is unusable: {self._send_broken}")
            if self._closed:
                raise StreamClosed(f"connection to {self.remote_address} is closed")
            # Taking a contended lock ends in a schedule point that does not raise Cancelled (an
            # idle one has none); a pending cancel must surface now, while nothing is written
            # and the connection is intact, not at send_all's first check, where it would
            # count as a torn frame.  Nothing yields between this check and send_all's own.
            # (A frame send_nowait began is torn already if it is not finished: no check.)
            if self._unsent is None:
                await trio.lowlevel.checkpoint_if_cancelled()
            try:
                if self._unsent is not None:  # a frame send_nowait began comes first
                    await self._stream.send_all(self._unsent)
                    self._unsent = None
                for part in parts:
                    await self._stream.send_all(part)
            except BaseException as exc:
                # Some unknown prefix of the frame may be on the wire: the peer must not go on
                # parsing, so kill the connection (cancellation included).
                self._send_broken = f"a send was interrupted mid-frame ({type(exc).__name__})"
                self._stream.abort()
                raise
            if count:
                self._stats["frames_sent"] += 1
                self._stats["bytes_sent"] += sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
                self._stats["data_bytes_sent"] += payload_bytes
        finally:
            self._send_lock.release()

    # --- receiving -------------------------------------------------------------------------------

    async def receive(self) -> Message:
        """The next control message.

        ``ProtocolError`` if a data frame or a malformed/oversized frame arrives instead (the
        connection is then unusable for receiving); ``PeerDisconnected`` on EOF or reset.
        Cancellation loses nothing: the next call continues the same frame.
        """
        frame = await self.receive_frame()
        if isinstance(frame, DataHeader):
            self._receive_broken = "an unexpected data frame arrived"
            raise ProtocolError(
                f"{self.remote_address} sent a data frame ({frame.describe()}) where a control message was expected"
            )
        return frame

    async def receive_data_header(
        self,
        *,
        op_seq: int | None = None,
        stream: int | None = None,
        step: int | None = None,
        buffer_nbytes: int | None = None,
        nbytes: int | None = None,
    ) -> DataHeader:
        """The header of the next data frame, checked against the given expectations
        (:meth:`DataHeader.check`).  Then call :meth:`receive_data_into` (once or in pieces) or
        :meth:`discard_data` for its payload.

        ``ProtocolError`` if a control frame arrives instead or the header does not match.
        Cancellation loses nothing.
        """
        frame = await self.receive_frame()
        if not isinstance(frame, DataHeader):
            self._receive_broken = "an unexpected control frame arrived"
            raise ProtocolError(
                f"{self.remote_address} sent {type(frame).__name__} where a data frame was expected"
            )
        try:
            frame.check(op_seq=op_seq, stream=stream, step=step, buffer_nbytes=buffer_nbytes, nbytes=nbytes)
        except ProtocolError as exc:
            self._receive_broken = str(exc)
            logger.warning("bad data frame from %s: %s", self.remote_address, exc)
            raise
        return frame

    async def receive_frame(self) -> Message | DataHeader:
        """The next frame: a control message, or a data frame's header (whose payload must be
        consumed next).  Errors and cancellation as for :meth:`receive`."""
        self._check_receivable()
        if self._data_remaining:
            raise InvalidUsage(
                f"{self._data_remaining} payload bytes of the previous data frame are unread; "
                "call receive_data_into or discard_data first"
            )
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            try:
                return await self._receive_frame()
            except ProtocolError as exc:
                self._receive_broken = str(exc)
                logger.warning("protocol error from %s: %s", self.remote_address, exc)
                raise
        finally:
            self._receiving = False

    async def _receive_frame(self) -> Message | DataHeader:
        if self._big_body is not None:
            return await self._finish_big_body()
        await self._fill(PREFIX_SIZE)
        kind, length = codec.parse_prefix(self._peek(PREFIX_SIZE), max_frame_size=self._max_frame_size)
        if kind is FrameKind.DATA:
            await self._fill(PREFIX_SIZE + DATA_HEADER_SIZE)
            start = self._rpos + PREFIX_SIZE
            header = codec.parse_data_header(self._rbuf[start : start + DATA_HEADER_SIZE], length)
            self._rpos += PREFIX_SIZE + DATA_HEADER_SIZE
            self._stats["frames_received"] += 1
            self._data_header = header if header.nbytes else None
            self._data_remaining = header.nbytes
            return header
        if PREFIX_SIZE + length <= _READ_AHEAD:
            await self._fill(PREFIX_SIZE + length)
            start = self._rpos + PREFIX_SIZE
            body = memoryview(self._rbuf)[start : start + length]
            try:
                message = codec.decode_message(body)
            finally:
                body.release()
            self._rpos = start + length
            self._stats["frames_received"] += 1
            return message
        # Larger than the read-ahead buffer (length already checked against max_frame_size):
        # move what is buffered into a body of exactly the announced size, then fill it directly.
        self._rpos += PREFIX_SIZE
        self._big_body = bytearray(length)
        taken = min(length, self._rend - self._rpos)
        self._big_body[:taken] = self._rbuf[self._rpos : self._rpos + taken]
        self._rpos += taken
        self._big_filled = taken
        return await self._finish_big_body()

    async def _finish_big_body(self) -> Message:
        assert self._big_body is not None
        body = self._big_body
        with memoryview(body) as view:
            while self._big_filled < len(body):
                n = await self._stream.receive_into(view[self._big_filled :])
                if n == 0:
                    raise self._eof_error(f"in the middle of a {len(body)}-byte control frame")
                self._big_filled += n
                self._stats["bytes_received"] += n
        self._big_body = None
        self._stats["frames_received"] += 1
        return codec.decode_message(body)

    async def receive_data_into(self, buffer: memoryview | bytearray) -> None:
        """Receive the next ``len(buffer)`` payload bytes of the current data frame into
        ``buffer`` (writable, C-contiguous; e.g. ``memoryview(array)[a:b]``).

        The payload may be consumed in several calls; ``InvalidUsage`` if ``buffer`` is larger
        than what remains (validate the header first) or no data frame is current.
        ``PeerDisconnected`` on EOF.  Cancellation (or any failure) once the payload is arriving
        aborts the connection: the amount received is unknown.
        """
        view = _byte_view(buffer, writable=True)
        self._check_receivable()
        if not view.nbytes:
            await trio.lowlevel.checkpoint()
            return
        if self._data_header is None:
            raise InvalidUsage("receive_data_into called without a current data frame (receive_data_header first)")
        if view.nbytes > self._data_remaining:
            raise InvalidUsage(
                f"destination of {view.nbytes} bytes is larger than the {self._data_remaining} payload bytes "
                "left in the current data frame"
            )
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            taken = min(view.nbytes, self._rend - self._rpos)
            view[:taken] = self._rbuf[self._rpos : self._rpos + taken]
            self._rpos += taken
            self._consume_payload(taken)
            rest = view[taken:]
            if not rest.nbytes:
                await trio.lowlevel.cancel_shielded_checkpoint()
                return
            try:
                await self._stream.receive_exactly_into(rest)
            except BaseException as exc:
                self._receive_broken = f"a payload receive was interrupted ({type(exc).__name__})"
                self._stream.abort()
                raise
            self._stats["bytes_received"] += rest.nbytes
            self._consume_payload(rest.nbytes)
        finally:
            self._receiving = False

    async def discard_data(self) -> None:
        """Read and drop the rest of the current data frame's payload (e.g. of an aborted op).
        Cancellation as for :meth:`receive_data_into`."""
        scratch = bytearray(min(self._data_remaining, _DISCARD_CHUNK))
        while self._data_remaining:
            await self.receive_data_into(memoryview(scratch)[: min(self._data_remaining, len(scratch))])
        await trio.lowlevel.checkpoint()

    @property
    def broken(self) -> bool:
        """Whether a torn frame or a protocol error made this connection unusable (abort it)."""
        return self._send_broken is not None or self._receive_broken is not None

    @property
    def data_remaining(self) -> int:
        """Payload bytes of the current data frame not yet received."""
        return self._data_remaining

    def _consume_payload(self, n: int) -> None:
        self._data_remaining -= n
        self._stats["data_bytes_received"] += n
        if not self._data_remaining:
            self._data_header = None

    def _check_receivable(self) -> None:
        if self._receiving:
            raise InvalidUsage(f"another task is already receiving on the connection to {self.remote_address}")
        if self._closed:
            raise StreamClosed(f"connection to {self.remote_address} is closed")
        if self._receive_broken is not None:
            raise ProtocolError(
                f"connection to {self.remote_address} is unusable after an earlier failure: {self._receive_broken}"
            )

    def _peek(self, n: int) -> bytes:
        return bytes(self._rbuf[self._rpos : self._rpos + n])

    async def _fill(self, n: int) -> None:
        """Make at least ``n`` (≤ read-ahead size) bytes available at ``_rpos``."""
        if self._rend - self._rpos >= n:
            return
        if self._rpos + n > _READ_AHEAD:
            # Compact: keep the unread bytes, make room behind them.
            pending = self._rend - self._rpos
            self._rbuf[:pending] = self._rbuf[self._rpos : self._rend]
            self._rpos, self._rend = 0, pending
        with memoryview(self._rbuf) as view:
            while self._rend - self._rpos < n:
                got = await self._stream.receive_into(view[self._rend :])
                if got == 0:
                    have = self._rend - self._rpos
                    raise self._eof_error("at a frame boundary" if have == 0 else f"after {have} bytes of a frame")
                self._rend += got
                self._stats["bytes_received"] += got

    def _eof_error(self, where: str) -> PeerDisconnected:
        return PeerDisconnected(f"{self.remote_address} closed the connection {where}")

    # --- handshake ------------------------------------------------------------------------------

    async def _handshake(self, token: bytes | None, draw_nonce: Callable[[int], bytes]) -> None:
        """Run the handshake of :mod:`pccl.protocol.handshake` on this fresh connection."""
        peer = self.remote_address
        limit, self._max_frame_size = self._max_frame_size, handshake.HANDSHAKE_MAX_FRAME_SIZE
        try:
            await self._send_frame((handshake.encode_preamble(),), payload_bytes=0)
            await self._fill(handshake.PREAMBLE_SIZE)
            preamble = self._peek(handshake.PREAMBLE_SIZE)
            self._rpos += handshake.PREAMBLE_SIZE
            handshake.parse_preamble(preamble)

            nonce = bytes(draw_nonce(handshake.NONCE_SIZE))
            if len(nonce) != handshake.NONCE_SIZE:
                raise InvalidArgument(f"nonce source returned {len(nonce)} bytes, expected {handshake.NONCE_SIZE}")
            await self.send(Hello(role=self.role, has_token=token is not None, nonce=nonce))
            hello = await self._receive_expected(Hello)
            handshake.check_hello(hello, local_role=self.role)
            if token is None and hello.has_token:
                raise AuthenticationFailed(f"{peer} requires a run token, but none is configured on this side")
            if token is not None and not hello.has_token:
                raise AuthenticationFailed(f"{peer} presented no run token, but this side requires one")
            if token is None:
                return

            peer_role = HandshakeRole(hello.role)
            mac = handshake.auth_proof(token, prover=self.role, prover_nonce=nonce, verifier_nonce=hello.nonce)
            await self.send(AuthProof(mac=mac))
            proof = await self._receive_expected(AuthProof)
            accepted = handshake.verify_proof(
                token, proof.mac, prover=peer_role, prover_nonce=hello.nonce, verifier_nonce=nonce
            )
            reason = "" if accepted else "the run token proof did not verify (different tokens)"
            await self.send(AuthResult(ok=accepted, reason=reason))
            if not accepted:
                # Read the peer's verdict before closing, so that closing with it unread does not
                # turn into a reset that destroys our AuthResult on its way; but a peer that
                # failed to authenticate gets only a short grace period for that.
                with trio.move_on_after(_VERDICT_GRACE):
                    try:
                        await self._receive_expected(AuthResult)
                    except PCCLError:
                        pass
                raise AuthenticationFailed(f"{peer} did not prove the run token: {reason}")
            verdict = await self._receive_expected(AuthResult)
            if not verdict.ok:
                raise AuthenticationFailed(f"{peer} rejected this side's run token: {verdict.reason or 'no reason given'}")
            self.authenticated = True
        finally:
            self._max_frame_size = limit

    async def _receive_expected(self, kind: type[_M]) -> _M:
        message = await self.receive()
        if not isinstance(message, kind):
            raise ProtocolError(
                f"{self.remote_address} sent {type(message).__name__} during the handshake; expected {kind.__name__}"
            )
        return message

    # --- the thread-side fast path ----------------------------------------------------------------

    def blocking_channel(self) -> BlockingDataChannel | None:
        """Data frames from worker threads with blocking I/O, if the stream offers it (real TCP
        does, the simulator and TLS do not: ``None``).  See :class:`BlockingDataChannel`."""
        if self._blocking is None:
            io = self._stream.blocking_io()
            if io is None:
                return None
            from .framed_threads import BlockingDataChannel  # imports this module

            self._blocking = BlockingDataChannel(self, io)
        return self._blocking

    # --- lifetime -------------------------------------------------------------------------------

    def statistics(self) -> FramedStatistics:
        """A snapshot of this connection's counters."""
        return FramedStatistics(**self._stats)

    async def aclose(self) -> None:
        """Close the connection (idempotent; closes even when cancelled; never raises a
        transport error).  A task blocked in a receive gets the stream's closed error."""
        self._closed = True
        await self._stream.aclose()

    def abort(self) -> None:
        """Close at once without a goodbye (RST where the transport has one)."""
        self._closed = True
        self._stream.abort()

    async def __aenter__(self) -> FramedConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def _byte_view(buffer: object, *, writable: bool) -> memoryview:
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


def _nonce_drawer(source: NonceSource | None) -> Callable[[int], bytes]:
    if source is None:
        return secrets.token_bytes
    if isinstance(source, random.Random):
        return source.randbytes
    if callable(source):
        return source
    raise InvalidArgument(f"nonce_source must be a random.Random or a callable, got {type(source).__name__}")


async def _establish(
    stream: Stream,
    *,
    role: HandshakeRole,
    token: str | bytes | None,
    config: Config,
    nonce_source: NonceSource | None,
    deadline: float,
    server_hostname: str | None = None,
) -> FramedConnection:
    key = handshake.normalize_token(token)
    draw_nonce = _nonce_drawer(nonce_source)
    remote = stream.remote_address
    try:
        with trio.fail_at(deadline):
            if config.tls_client_context is not None and config.tls_server_context is not None:
                if role is HandshakeRole.CLIENT:
                    stream = await tls.wrap_client(stream, config.tls_client_context, server_hostname=server_hostname)
                else:
                    stream = await tls.wrap_server(stream, config.tls_server_context)
            connection = FramedConnection(stream, role=role, config=config)
            await connection._handshake(key, draw_nonce)
    except trio.TooSlowError:
        await stream.aclose()
        logger.info("handshake with %s timed out", remote)
        raise ConnectTimeout(
            f"handshake with {remote} did not complete within {config.connect_timeout:g} s (Config.connect_timeout)"
        ) from None
    except PCCLError as exc:
        await stream.aclose()
        logger.info("handshake with %s failed: %s", remote, exc)
        raise
    except BaseException:
        await stream.aclose()
        raise
    logger.debug("connection with %s established (role %s, authenticated=%s)", remote, role.name, connection.authenticated)
    return connection


async def open_framed(
    network: Network,
    address: str,
    *,
    token: str | bytes | None = None,
    config: Config | None = None,
    nonce_source: NonceSource | None = None,
    server_hostname: str | None = None,
) -> FramedConnection:
    """Dial ``address`` and run the handshake as the ``CLIENT``.

    Connect and handshake together take at most ``config.connect_timeout`` (``ConnectTimeout``).
    ``server_hostname`` is the name TLS verifies (default: the host part of ``address``).
    Raises ``ConnectionRefused``/``ConnectTimeout``/``PeerDisconnected``, ``ProtocolError``,
    ``AuthenticationFailed``; cancellation closes the half-open connection.
    """
    config = config or Config()
    deadline = trio.current_time() + config.connect_timeout
    stream = await network.connect(address, timeout=config.connect_timeout)
    if server_hostname is None:
        server_hostname = parse_address(address)[0]
    return await _establish(
        stream,
        role=HandshakeRole.CLIENT,
        token=token,
        config=config,
        nonce_source=nonce_source,
        deadline=deadline,
        server_hostname=server_hostname,
    )


async def accept_framed(
    stream: Stream,
    *,
    token: str | bytes | None = None,
    config: Config | None = None,
    nonce_source: NonceSource | None = None,
) -> FramedConnection:
    """Run the handshake as the ``SERVER`` on a stream a Listener accepted.

    Bounded by ``config.connect_timeout``; errors as for :func:`open_framed`.  On any failure the
    stream is closed.
    """
    config = config or Config()
    deadline = trio.current_time() + config.connect_timeout
    return await _establish(
        stream,
        role=HandshakeRole.SERVER,
        token=token,
        config=config,
        nonce_source=nonce_source,
        deadline=deadline,
    )
