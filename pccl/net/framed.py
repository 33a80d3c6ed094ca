"""A message connection over a pccl Stream: framing, handshake, run-token authentication, TLS.

:class:`FramedConnection` sends and receives the frames of :mod:`pccl.protocol.codec` — control
messages and data frames whose payload goes straight from the sender's memory to the receiver's
destination buffer — over any :class:`~pccl.net.base.Stream` (real TCP or the simulator's).

Open one with :func:`open_framed` (dial an address; this side is the ``CLIENT``) or
:func:`accept_framed` (a stream a Listener accepted; ``SERVER``, which also holds the dialler to
``Config.first_bytes_timeout`` for its first bytes).  Both run, within
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
import math
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
    ProtocolError,
)
from ..protocol import codec, handshake
from ..protocol.codec import DataHeader
from ..protocol.messages import AuthProof, AuthResult, HandshakeRole, Hello, Message
from . import tls
from ._frames import DISCARD_CHUNK, FrameCore, byte_view, data_frame_parts
from .base import Network, Stream, parse_address, receive_view

if TYPE_CHECKING:
    from .framed_threads import BlockingDataChannel
    from .thread_io import BlockingIO

__all__ = [
    "FramedConnection",
    "FramedStatistics",
    "NonceSource",
    "open_framed",
    "accept_framed",
    "establish_over",
    "PrefixedStream",
]

logger = logging.getLogger(__name__)

#: Where handshake nonces come from: a ``random.Random`` (the simulator's seeded RNG) or a
#: callable ``n -> n random bytes``.  ``None`` means :func:`secrets.token_bytes`.
NonceSource = Callable[[int], bytes] | random.Random

_M = TypeVar("_M", bound=Message)

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
    from one task at a time (``InvalidUsage`` otherwise).  ``async with`` closes it.  The frame
    state lives in :attr:`frames` (a :class:`~pccl.net._frames.FrameCore`), which the
    worker-thread path (:mod:`pccl.net.framed_threads`) drives as well.
    """

    def __init__(self, stream: Stream, *, role: HandshakeRole, config: Config) -> None:
        """Wrap an already-connected ``stream`` *without* a handshake (the entry points do that)."""
        self._stream = stream
        self.role = role
        self.remote_address = stream.remote_address
        self.local_address = stream.local_address
        #: Whether the peer proved the run token during the handshake.
        self.authenticated = False
        #: The sans-IO frame state shared with the worker-thread path.
        self.frames = FrameCore(max_frame_size=config.max_frame_size, remote_address=stream.remote_address)
        #: The connection's thread-side data channel once made (see
        #: :func:`pccl.net.framed_threads.thread_channel`), so every user shares its send lock.
        self.thread_channel: BlockingDataChannel | None = None
        self._send_lock = trio.Lock()
        #: The tail of a frame that :meth:`send_nowait` or :meth:`send_data_nowait` could only
        #: partly write (its remaining pieces): it goes out first, under the send lock, in the
        #: next send (or :meth:`flush`).  ``_unsent_owner`` is whom the sender named for it.
        self._unsent: list[memoryview] | None = None
        self._unsent_owner: object = None

    # --- sending ---------------------------------------------------------------------------------

    async def send(self, message: Message) -> None:
        """Send one control message.

        ``InvalidArgument`` if it is not a registered message or encodes to more than
        ``Config.max_frame_size`` bytes (the peer, configured alike, would refuse it); transport
        errors as for ``Stream.send_all``.  Cancellation while waiting for the send lock sends
        nothing; cancellation once writing started aborts the connection.
        """
        frame = codec.encode_message(message, max_frame_size=self.frames.max_frame_size)
        await self._send_frame((frame,), payload_bytes=0)

    def send_nowait(self, message: Message) -> bool:
        """Send one control message now, without waiting, if that can be done (Trio thread).

        ``True``: the frame went to the transport — all of it, or, if the kernel took only a
        part, the rest is kept and goes out first in the next send; :attr:`needs_flush` then
        says so, and the caller must see to it that :meth:`flush` (or another send) runs.
        ``False``: nothing was sent (the connection is busy or broken, or the transport offers
        no such path, as TLS streams do not: :meth:`~pccl.net.base.Stream.send_nowait`); use :meth:`send`, which also
        reports errors.  A control message is latency-bound: this saves the lock, the
        cancellation machinery and the trip through the run loop that :meth:`send` costs.
        ``InvalidArgument`` as for :meth:`send`.
        """
        if self._send_lock.locked() or self._unsent is not None or self.frames.broken or self.frames.closed:
            return False
        try_send = self._stream.send_nowait
        frame = codec.encode_message(message, max_frame_size=self.frames.max_frame_size)
        sent = try_send(frame)
        if not sent:
            return False
        if sent < len(frame):
            self._unsent, self._unsent_owner = [memoryview(frame)[sent:]], None
        self.frames.count_sent(len(frame))
        return True

    def send_data_nowait(self, header: DataHeader, payload: bytes | bytearray | memoryview, *,
                         owner: object = None) -> bool:
        """:meth:`send_data` now, without waiting, if that can be done (Trio thread).

        ``True``: the frame went to the transport, all of it or a first part; the rest then
        waits as for :meth:`send_nowait` (:attr:`needs_flush`; :meth:`flush` must run soon, and
        until the rest is sent it is read from ``payload``, which must not change meanwhile).
        ``owner`` names the sender of such a rest (:meth:`tear_unsent`).  ``False``: nothing
        was sent; use :meth:`send_data`.  ``InvalidArgument`` as for :meth:`send_data`.
        """
        view = byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        if self._send_lock.locked() or self._unsent is not None or self.frames.broken or self.frames.closed:
            return False
        try_send = self._stream.send_nowait
        parts = data_frame_parts(header, view)
        first = parts[0]
        sent = try_send(first)
        if not sent:
            return False
        rest: list[memoryview] = []
        if sent < len(first):
            rest.append(memoryview(first)[sent:])
            rest.extend(memoryview(p) for p in parts[1:])
        else:
            for i, part in enumerate(parts[1:], 1):
                sent = try_send(part)
                if sent < len(part):
                    rest.append(memoryview(part)[sent:])
                    rest.extend(memoryview(p) for p in parts[i + 1:])
                    break
        if rest:
            self._unsent, self._unsent_owner = rest, owner
        self.frames.count_sent(sum(len(p) for p in parts), view.nbytes)
        return True

    def tear_unsent(self, owner: object) -> bool:
        """If the rest of a frame :meth:`send_data_nowait` began for ``owner`` is still unsent,
        abort the connection (Trio thread; the frame can no longer be completed from memory the
        owner is giving up) and return ``True``."""
        if self._unsent is None or self._unsent_owner is not owner:
            return False
        self._unsent = self._unsent_owner = None
        self.frames.mark_send_broken("the rest of a data frame begun without waiting was abandoned")
        self.abort()
        return True

    @property
    def stream(self) -> Stream:
        """The stream under the framing (tests write raw bytes on it)."""
        return self._stream

    @property
    def send_lock(self) -> trio.Lock:
        """Held while a frame is being written (tests hold it to park a sender)."""
        return self._send_lock

    @property
    def needs_flush(self) -> bool:
        """Whether part of a frame from :meth:`send_nowait` or :meth:`send_data_nowait` still
        waits to be sent."""
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
        view = byte_view(payload, writable=False)
        if header.nbytes != view.nbytes:
            raise InvalidArgument(f"data header says {header.nbytes} payload bytes, the payload has {view.nbytes}")
        await self._send_frame(data_frame_parts(header, view), payload_bytes=view.nbytes)

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
            self.frames.check_sendable()
            # Taking a contended lock ends in a schedule point that does not raise Cancelled (an
            # idle one has none); a pending cancel must surface now, while nothing is written
            # and the connection is intact, not at send_all's first check, where it would
            # count as a torn frame.  Nothing yields between this check and send_all's own.
            # (A frame send_nowait began is torn already if it is not finished: no check.)
            if self._unsent is None:
                await trio.lowlevel.checkpoint_if_cancelled()
            try:
                if self._unsent is not None:  # a frame send_nowait began comes first
                    for piece in self._unsent:
                        await self._stream.send_all(piece)
                    self._unsent = self._unsent_owner = None
                for part in parts:
                    await self._stream.send_all(part)
            except BaseException as exc:
                # Some unknown prefix of the frame may be on the wire: the peer must not go on
                # parsing, so kill the connection (cancellation included).
                self.frames.mark_send_broken(f"a send was interrupted mid-frame ({type(exc).__name__})")
                self._stream.abort()
                raise
            if count:
                self.frames.count_sent(sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts),
                                       payload_bytes)
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
            raise self.frames.unexpected_frame(frame, "a control message")
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
            raise self.frames.unexpected_frame(frame, "a data frame")
        self.frames.check_data_header(frame, op_seq=op_seq, stream=stream, step=step, buffer_nbytes=buffer_nbytes,
                                      nbytes=nbytes)
        return frame

    async def receive_frame(self) -> Message | DataHeader:
        """The next frame: a control message, or a data frame's header (whose payload must be
        consumed next).  Errors and cancellation as for :meth:`receive`."""
        frames = self.frames
        frames.begin_receive()
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            while (frame := frames.next_frame()) is None:
                frames.received(await self._stream.receive_into(frames.read_buffer()))
            return frame
        finally:
            frames.end_receive()

    async def receive_data_into(self, buffer: memoryview | bytearray, *, schedule_point: bool = True) -> None:
        """Receive the next ``len(buffer)`` payload bytes of the current data frame into
        ``buffer`` (writable, C-contiguous; e.g. ``memoryview(array)[a:b]``).

        The payload may be consumed in several calls; ``InvalidUsage`` if ``buffer`` is larger
        than what remains (validate the header first) or no data frame is current.
        ``PeerDisconnected`` on EOF.  Cancellation (or any failure) once the payload is arriving
        aborts the connection: the amount received is unknown.

        ``schedule_point=False``: a payload that was read ahead with its header whole is taken
        without yielding to the scheduler (it stays a cancellation point), for a caller that
        yields soon anyway — a small op's ring, where each yield is a pass of the run loop.
        """
        view = byte_view(buffer, writable=True)
        frames = self.frames
        if not frames.begin_payload(view.nbytes):
            await trio.lowlevel.checkpoint()
            return
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            rest = view[frames.take_payload(view) :]
            if not rest.nbytes:
                if schedule_point:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return
            try:
                await self._stream.receive_exactly_into(rest)
            except BaseException as exc:
                frames.mark_receive_broken(f"a payload receive was interrupted ({type(exc).__name__})")
                self._stream.abort()
                raise
            frames.payload_received(rest.nbytes)
        finally:
            frames.end_receive()

    async def discard_data(self) -> None:
        """Read and drop the rest of the current data frame's payload (e.g. of an aborted op).
        Cancellation as for :meth:`receive_data_into`."""
        frames = self.frames
        scratch = bytearray(min(frames.data_remaining, DISCARD_CHUNK))
        while frames.data_remaining:
            await self.receive_data_into(memoryview(scratch)[: min(frames.data_remaining, len(scratch))])
        await trio.lowlevel.checkpoint()

    @property
    def broken(self) -> bool:
        """Whether a torn frame or a protocol error made this connection unusable (abort it)."""
        return self.frames.broken

    @property
    def at_rest(self) -> bool:
        """Whether the next frame either way starts on a frame boundary and nothing is under
        way: open and not broken, no frame (or rest of one) being sent, nobody receiving, no
        payload pending, no bytes received and unread.  A connection at rest can carry a new
        conversation (a ring lane kept for the next topology round, :mod:`pccl._peer.wiring`)."""
        frames = self.frames
        if frames.closed or frames.broken or self._unsent is not None or self._send_lock.locked():
            return False
        if self.thread_channel is not None and self.thread_channel.sending:
            return False
        return frames.at_rest

    @property
    def data_remaining(self) -> int:
        """Payload bytes of the current data frame not yet received."""
        return self.frames.data_remaining

    # --- handshake ------------------------------------------------------------------------------

    async def handshake(self, token: bytes | None, draw_nonce: Callable[[int], bytes], *,
                        opening_deadline: float = math.inf, late: PCCLError | None = None) -> None:
        """Run the handshake of :mod:`pccl.protocol.handshake` on this fresh connection (the
        entry points :func:`open_framed` and :func:`accept_framed` do; bounded by their caller).

        The preambles must be exchanged by ``opening_deadline``, else ``late`` (default: a
        ``ConnectTimeout``) is raised."""
        peer = self.remote_address
        frames = self.frames
        limit, frames.max_frame_size = frames.max_frame_size, handshake.HANDSHAKE_MAX_FRAME_SIZE
        try:
            with trio.move_on_at(opening_deadline) as opening:
                await self._send_frame((handshake.encode_preamble(),), payload_bytes=0)
                while (preamble := frames.take_raw(handshake.PREAMBLE_SIZE)) is None:
                    frames.received(await self._stream.receive_into(frames.read_buffer()))
            if opening.cancelled_caught:
                raise late if late is not None else ConnectTimeout(f"{peer} sent no handshake in time")
            assert preamble is not None  # the loop only ends with one
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
            frames.max_frame_size = limit

    async def _receive_expected(self, kind: type[_M]) -> _M:
        message = await self.receive()
        if not isinstance(message, kind):
            raise ProtocolError(
                f"{self.remote_address} sent {type(message).__name__} during the handshake; expected {kind.__name__}"
            )
        return message

    # --- lifetime -------------------------------------------------------------------------------

    def blocking_io(self) -> BlockingIO | None:
        """The stream's thread-side blocking I/O, if it offers it (real TCP does, the simulator
        and TLS do not): what :mod:`pccl.net.framed_threads` drives this connection with."""
        return self._stream.blocking_io()

    def statistics(self) -> FramedStatistics:
        """A snapshot of this connection's counters."""
        return FramedStatistics(**self.frames.counters)

    def detach(self, *, remote_address: str | None = None) -> Stream:
        """End the framing: the stream under this connection, as a :class:`~pccl.net.base.Stream`
        that first yields the bytes already received and not yet parsed (a relay's partner may
        have sent its first bytes right behind the relay's last frame).  The connection is
        unusable afterwards; the stream is the caller's.  ``InvalidUsage`` unless the connection
        is between frames with nothing left to send.  ``remote_address`` renames the far end
        (what a relayed connection's logs call it)."""
        frames = self.frames
        if self._unsent is not None or self._send_lock.locked() or frames.broken or frames.closed:
            raise InvalidUsage(f"cannot detach the connection to {self.remote_address}: it is not at rest")
        leftover = frames.take_buffered()
        frames.close()
        return PrefixedStream(self._stream, leftover, remote_address=remote_address)

    async def aclose(self) -> None:
        """Close the connection (idempotent; closes even when cancelled; never raises a
        transport error).  A task blocked in a receive gets the stream's closed error."""
        self.frames.close()
        await self._stream.aclose()

    def abort(self) -> None:
        """Close at once without a goodbye (RST where the transport has one)."""
        self.frames.close()
        self._stream.abort()

    async def __aenter__(self) -> FramedConnection:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class PrefixedStream(Stream):
    """A stream whose first received bytes are ``prefix`` (bytes a framing layer had read ahead,
    :meth:`FramedConnection.detach`), then the inner stream's; everything else is the inner
    stream's.  Its bulk thread path (:meth:`blocking_io`) is offered once the prefix is gone."""

    def __init__(self, inner: Stream, prefix: bytes, *, remote_address: str | None = None) -> None:
        self._inner = inner
        self._prefix = memoryview(prefix)
        self.remote_address = remote_address if remote_address is not None else inner.remote_address
        self.local_address = inner.local_address

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    def send_nowait(self, data: bytes | bytearray | memoryview) -> int:
        return self._inner.send_nowait(data)

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        if self._prefix.nbytes:
            view = receive_view(buffer)
            n = min(view.nbytes, self._prefix.nbytes)
            view[:n] = self._prefix[:n]
            self._prefix = self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return n
        return await self._inner.receive_into(buffer)

    async def receive_exactly_into(self, buffer: memoryview | bytearray) -> None:
        if self._prefix.nbytes:
            await Stream.receive_exactly_into(self, buffer)
        else:
            await self._inner.receive_exactly_into(buffer)

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def abort(self) -> None:
        self._inner.abort()

    def blocking_io(self) -> BlockingIO | None:
        return None if self._prefix.nbytes else self._inner.blocking_io()


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
    opening_deadline: float | None = None,
    server_hostname: str | None = None,
) -> FramedConnection:
    # Failures are logged at DEBUG only: the caller logs the one line a failed connection gets
    # (a listener through its rate-limited refusal log, a dialler with its own context).
    key = handshake.normalize_token(token)
    draw_nonce = _nonce_drawer(nonce_source)
    remote = stream.remote_address
    if opening_deadline is None or opening_deadline >= deadline:
        opening_deadline = math.inf  # the whole handshake's deadline comes first anyway
    late = ConnectTimeout(f"{remote} sent no handshake within {config.first_bytes_timeout:g} s of being accepted "
                          "(Config.first_bytes_timeout)")
    try:
        with trio.fail_at(deadline):
            if config.tls_client_context is not None and config.tls_server_context is not None:
                with trio.move_on_at(opening_deadline) as opening:
                    if role is HandshakeRole.CLIENT:
                        stream = await tls.wrap_client(stream, config.tls_client_context,
                                                       server_hostname=server_hostname)
                    else:
                        stream = await tls.wrap_server(stream, config.tls_server_context)
                if opening.cancelled_caught:
                    raise late
            connection = FramedConnection(stream, role=role, config=config)
            await connection.handshake(key, draw_nonce, opening_deadline=opening_deadline, late=late)
    except trio.TooSlowError:
        await stream.aclose()
        logger.debug("handshake with %s timed out", remote)
        raise ConnectTimeout(
            f"handshake with {remote} did not complete within {config.connect_timeout:g} s (Config.connect_timeout)"
        ) from None
    except PCCLError as exc:
        await stream.aclose()
        logger.debug("handshake with %s failed: %s", remote, exc)
        raise
    except BaseException:
        await stream.aclose()
        raise
    logger.debug("connection with %s established (role %s, authenticated=%s)", remote, role.name, connection.authenticated)
    return connection


async def establish_over(
    stream: Stream,
    *,
    role: HandshakeRole,
    token: str | bytes | None = None,
    config: Config | None = None,
    nonce_source: NonceSource | None = None,
) -> FramedConnection:
    """Run the handshake as ``role`` on a stream that is connected already but not through a
    listener or a dial of this side's own: one end of a relay's splice (both ends dialled the
    relay).  No TLS (the hops to the relay have their own); the whole handshake within
    ``config.connect_timeout``.  Errors as for :func:`open_framed`; the stream is closed on any
    failure."""
    config = config or Config()
    if config.tls_client_context is not None:
        config = dataclasses.replace(config, tls_client_context=None, tls_server_context=None)
    return await _establish(
        stream,
        role=role,
        token=token,
        config=config,
        nonce_source=nonce_source,
        deadline=trio.current_time() + config.connect_timeout,
    )


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

    The dialler sends its first bytes at once, so they (the TLS handshake and the preamble)
    must arrive within ``config.first_bytes_timeout``, and the whole handshake within
    ``config.connect_timeout`` (the shorter applies): an idle connection is closed early.
    Errors as for :func:`open_framed` (``ConnectTimeout`` for either deadline).  On any failure
    the stream is closed.
    """
    config = config or Config()
    now = trio.current_time()
    return await _establish(
        stream,
        role=HandshakeRole.SERVER,
        token=token,
        config=config,
        nonce_source=nonce_source,
        deadline=now + config.connect_timeout,
        opening_deadline=now + config.first_bytes_timeout,
    )
