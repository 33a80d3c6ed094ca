"""Point-to-point messages between two members of a group: ``Communicator.send`` / ``recv``.

No master round trip: a sender dials the receiver's p2p port over the pair's path
(:mod:`pccl._peer.connector`: direct, dialled back or relayed) and presents ``PointHello``; the
connection is kept for the pair's later messages in that direction (one connection per peer and
direction, dialled by the side whose messages it carries).  A receive dials its sender the same
way, so that a pending receive watches the sender's liveness even before the sender's first
message comes (see "Faults" below).

One message (the wire flow is in :mod:`pccl.protocol.messages._point`): the sender numbers it
(``seq``, per connection) and announces it with ``PointOffer(seq, tag, dtype, count)``; the
receiver matches offers to its posted receives per ``tag``, both in order, so two sends to one
peer on one tag are received in call order.  A match with the same dtype and element count is
answered ``PointReady`` and the sender streams data frames of at most :data:`CHUNK` bytes (data
frames of several messages may interleave: each names its ``seq``; a message's come in order),
which the receiver takes straight into the caller's array — each piece saved into a backup
first, so that a failed receive can restore it (:mod:`pccl._peer.point_data` moves the bytes,
in worker threads on real TCP) — then answers ``PointAck``: the send completes then
(rendezvous).  The receive completes once that answer was handed to the connection (a link
that fails before fails the receive too, its array restored), and a final answer the sender
has read stands though the link fails right after (the receiver's close).  A match that disagrees is answered
``PointMismatch`` and both calls raise ``InvalidArgument`` naming both shapes; nothing is
written into the receiver's array.

Faults.  Both sides of every connection send ``PointKeepalive`` every
``min(heartbeat_interval, peer_timeout / 3)`` and read it continuously; a connection that breaks
(the peer died: reset or closed), or that is silent for ``Config.peer_timeout`` — a receiver
takes each :data:`PIECE` (:data:`LARGE_PIECE` while data comes fast) of a data frame within
``peer_timeout``; a sender in the middle of a
frame still reads the receiver's keepalives on the same connection — fails the pair's *link*: both its
connections are aborted and every pending send to and receive from that peer raises
``PeerDisconnected`` naming it (the other side sees its connections close and does the same).
A receiver's array then holds its old values.  The next call dials afresh.  Cancelling a call
(or its ``timeout=``) before its message was announced/matched just withdraws it; once the
message is under way the link fails the same way (a half-sent or half-read message is never
left on a connection that is reused).  A communicator that closes ends its connections
gracefully (:mod:`pccl._peer.point_close`), so that its last answers reach their senders.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import trio

from ..arrays import as_array
from ..collectives.buffers import SCRATCH
from ..errors import InvalidArgument, InvalidUsage, PCCLError, PeerDisconnected, ProtocolError, TransferTimeout
from ..net.framed import FramedConnection
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.paths import Port
from ..types import DType, dtype_of
from .host import PeerHost
from .point_close import linger
from .point_data import receive_payload, send_payload
from .votes import fresh_error

__all__ = ["PointService", "CHUNK", "frame_bytes"]

log = logging.getLogger(__name__)

#: Payload bytes of one data frame of a point-to-point message, at most (a message of several
#: frames lets another message's frames through in between).  Each frame costs both sides a
#: hand-off between the Trio thread and a worker thread, during which the bytes stop flowing:
#: with 16 MiB frames a 64 MiB send moved ~12% less than with one 64 MiB frame on a busy 2-core
#: host (``benchmarks/p2p_send.py``).  But another message on the same connection waits for the
#: frame under way: so a frame carries about :data:`FRAME_SECONDS` of the rate the link showed
#: on its frame before (:func:`frame_bytes`), between :data:`MIN_FRAME` and this; a link's
#: first frame is :data:`FIRST_FRAME`.  On loopback every frame after the first is 64 MiB; at
#: 1 Gbit/s ~29 MiB, at 100 Mbit/s ~3 MiB.
CHUNK = 64 << 20
MIN_FRAME = 1 << 20
FIRST_FRAME = 16 << 20
FRAME_SECONDS = 0.25
#: A receiver takes a data frame's payload in pieces of at most this many bytes, each within
#: ``Config.peer_timeout``: a sender slower than ``PIECE / peer_timeout`` counts as stalled.
PIECE = 1 << 20
#: On the thread path (real TCP) pieces of this many bytes follow a piece that came at 16 times
#: ``LARGE_PIECE / peer_timeout`` or faster (:func:`pccl._peer.point_data.next_piece`): a sender
#: whose rate then falls below ``LARGE_PIECE / peer_timeout`` within one piece counts as stalled.
LARGE_PIECE = 4 << 20

#: An answer to a peer's offer, and what to call once it was handed to the connection.
Reply = tuple[m.Message, Callable[[], None] | None]


def frame_bytes(sent: int, seconds: float) -> int:
    """The size of a link's next data frame after one of ``sent`` bytes took ``seconds`` to
    hand to the connection: :data:`FRAME_SECONDS` of that rate, within ``[MIN_FRAME, CHUNK]``."""
    if seconds <= 0:
        return CHUNK
    return int(min(CHUNK, max(MIN_FRAME, sent / seconds * FRAME_SECONDS)))


def _shape(dtype: DType, count: int) -> str:
    return f"{count} {dtype.name.lower()} element{'s' * (count != 1)}"


@dataclasses.dataclass(eq=False)
class Outgoing:
    """A send in flight: its offer went out (or is about to), it waits for the receiver."""

    seq: int
    tag: int
    dtype: DType
    count: int
    answered: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: What the receiver answered last: PointReady, PointAck or PointMismatch.
    answer: m.Message | None = None
    error: PCCLError | None = None

    def answer_with(self, answer: m.Message) -> None:
        self.answer = answer
        self.answered.set()

    @property
    def settled(self) -> bool:
        """Whether the receiver's final answer came (PointAck or PointMismatch): the outcome is
        known, and a failure of the link after it changes nothing."""
        return isinstance(self.answer, (m.PointAck, m.PointMismatch))


@dataclasses.dataclass(eq=False)
class Incoming:
    """A posted receive: waits for a matching offer, then for its data."""

    tag: int
    target: np.ndarray
    dtype: DType
    count: int
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    error: PCCLError | None = None
    #: The matched offer's seq (None until matched), and the copy of the target's old bytes
    #: (from the scratch arena) the data's receiver fills ahead of overwriting them.
    seq: int | None = None
    backup: np.ndarray | None = None
    #: Payload bytes received, and the target's leading bytes saved into :attr:`backup`.
    received: int = 0
    saved: int = 0
    #: Set while a task writes into the target (then until it has stopped).
    writer: trio.Event | None = None

    def saver(self, offset: int) -> Callable[[int], None]:
        """What a frame's receiver at ``offset`` calls (any thread) once the target's bytes up to
        ``offset + n`` are in the backup."""
        def note(n: int) -> None:
            self.saved = max(self.saved, offset + n)
        return note

    def target_bytes(self) -> memoryview:
        return self.target.reshape(-1).view(np.uint8).data

    async def restore(self) -> None:
        """The receive failed: once nothing writes into the target any more, give it back its
        old bytes (shielded: a cancelled receive must still leave its array as it was)."""
        if self.writer is not None:
            with trio.CancelScope(shield=True):
                await self.writer.wait()
        self.release(restore=True)

    def release(self, *, restore: bool) -> None:
        backup, self.backup = self.backup, None
        if backup is not None:
            if restore and self.saved:
                self.target_bytes()[:self.saved] = backup.data[:self.saved]
            SCRATCH.give(backup)

    def finish(self, error: PCCLError | None = None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class PeerLink:
    """This peer's connections with one other peer and the messages under way on them."""

    def __init__(self, peer: int) -> None:
        self.peer = peer
        #: Dialled by this peer: its sends to ``peer`` (and the answers to them).
        self.outgoing: FramedConnection | None = None
        #: Dialled by ``peer``: its sends to this peer (and this peer's answers).
        self.incoming: FramedConnection | None = None
        #: Set once a dial of :attr:`outgoing` ended (``None``: none under way).
        self.opening: trio.Event | None = None
        self.next_seq = 1
        #: The payload bytes of this link's next data frame (:func:`frame_bytes`).
        self.frame = FIRST_FRAME
        self.sends: dict[int, Outgoing] = {}
        #: Offers from ``peer`` no receive matched yet, and receives no offer matched yet, by tag.
        self.offers: dict[int, collections.deque[m.PointOffer]] = {}
        self.posted: dict[int, collections.deque[Incoming]] = {}
        #: Matched receives whose data is arriving, by seq.
        self.receiving: dict[int, Incoming] = {}
        #: The answers to ``peer``'s offers, sent on :attr:`incoming` by its writer, each with
        #: what to do once it was handed to the connection.
        self.replies, self.outbox = trio.open_memory_channel[Reply](math.inf)
        self.error: PCCLError | None = None
        #: The cancel scopes of the connections' reader and writer tasks (:meth:`PointService._run`).
        self.runs: set[trio.CancelScope] = set()
        #: Set by :meth:`close`: the connections end gracefully (:func:`~pccl._peer.point_close.linger`).
        self.lingering = False
        #: Set once the task serving :attr:`incoming` has ended (and closed it).
        self.incoming_closed = trio.Event()
        #: The seq whose ``PointAck`` the writer of :attr:`incoming` is handing to the connection
        #: (its receive is the writer's to complete or fail, not :meth:`_end`'s).
        self.acking: int | None = None

    def fail(self, error: PCCLError) -> None:
        """End the link: abort both connections, fail everything pending with ``error``."""
        if self.error is not None:
            return
        self._end(error)
        for conn in (self.outgoing, self.incoming):
            if conn is not None:
                conn.abort()

    def close(self, error: PCCLError) -> None:
        """The communicator closes: fail everything pending with ``error`` as :meth:`fail` does,
        but close the connections gracefully: their tasks stop and linger on them
        (:func:`~pccl._peer.point_close.linger`), so that the answers already sent reach the peer."""
        if self.error is not None:
            return
        self.lingering = True
        self._end(error)
        for scope in self.runs:
            scope.cancel()

    def _end(self, error: PCCLError) -> None:
        self.error = error
        self.replies.close()
        for send in self.sends.values():
            if send.error is None and not send.settled:  # an answer already read stands
                send.error = fresh_error(error)
            send.answered.set()
        for queue in self.posted.values():
            for recv in queue:
                recv.finish(fresh_error(error))
        for seq, recv in self.receiving.items():
            if seq != self.acking:
                recv.finish(fresh_error(error))
        if self.opening is not None:
            self.opening.set()

    def match(self, tag: int) -> None:
        """Pair the oldest offer and the oldest receive of ``tag`` while both exist."""
        offers, posted = self.offers.get(tag), self.posted.get(tag)
        while offers and posted:
            offer, recv = offers.popleft(), posted.popleft()
            offered = _shape(DType(offer.dtype), offer.count)
            wanted = _shape(recv.dtype, recv.count)
            if offer.dtype != recv.dtype or offer.count != recv.count:
                self.reply(m.PointMismatch(offer.seq, int(recv.dtype), recv.count))
                recv.finish(InvalidArgument(f"recv from peer {self.peer:x} on tag {tag}: the sender sends "
                                            f"{offered}, this receive takes {wanted}; nothing was received"))
                continue
            recv.seq = offer.seq
            self.receiving[offer.seq] = recv
            nbytes = recv.target.nbytes
            if nbytes == 0:
                self.acknowledge(offer.seq)
                continue
            recv.backup = SCRATCH.take(nbytes)  # reused memory: no page faults
            self.reply(m.PointReady(offer.seq))
        self.tidy(tag)

    def acknowledge(self, seq: int) -> None:
        """Message ``seq`` is all in: answer ``PointAck``, and complete its receive once the
        answer was handed to the connection — not before, so that a receive that returned has
        its sender's ``send`` succeed unless the sender's own side fails (a receiver that
        returns and closes its communicator at once must not lose the answer).  If the link
        fails first, the receive fails too and its array gets its old values back."""
        def sent() -> None:
            recv = self.receiving.pop(seq, None)
            if recv is not None and not recv.done.is_set():
                recv.release(restore=False)
                recv.finish()
        self.reply(m.PointAck(seq), sent)

    def unacked(self) -> None:
        """The ``PointAck`` of :attr:`acking` (if any) was not handed to the connection: if the
        link failed meanwhile (which left that receive alone), the receive fails as the others did."""
        seq, self.acking = self.acking, None
        recv = self.receiving.get(seq) if seq is not None else None
        if recv is not None and self.error is not None:
            recv.finish(fresh_error(self.error))

    def tidy(self, tag: int) -> None:
        """Forget ``tag``'s empty queues (a loop may use a new tag every step)."""
        if not self.offers.get(tag, True):
            del self.offers[tag]
        if not self.posted.get(tag, True):
            del self.posted[tag]

    def reply(self, msg: m.Message, sent: Callable[[], None] | None = None) -> None:
        try:
            self.replies.send_nowait((msg, sent))
        except trio.ClosedResourceError:
            pass  # the link failed: the receive that would be answered failed too


class PointService:
    """``send`` and ``recv`` of one communicator, and the p2p connections they use."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host
        self._links: dict[int, PeerLink] = {}
        self._failure: PCCLError | None = None

    # --- the calls -------------------------------------------------------------------------------

    async def send(self, x: Any, *, to: int, tag: int = 0, timeout: float | None = None,
                   quantization: object = None) -> None:
        array, endpoint = self._check(x, to, tag, timeout, quantization, writable=False, call="send", role="to")
        with _bounded(timeout, f"send to peer {to:x} on tag {tag}"):
            await self._send(array, endpoint, tag)

    async def recv(self, x: Any, *, from_: int, tag: int = 0, timeout: float | None = None,
                   quantization: object = None) -> None:
        array, endpoint = self._check(x, from_, tag, timeout, quantization, writable=True, call="recv",
                                      role="from_")
        with _bounded(timeout, f"recv from peer {from_:x} on tag {tag}"):
            await self._recv(array, endpoint, tag)

    def _check(self, x: Any, peer: Any, tag: Any, timeout: Any, quantization: object, *, writable: bool,
               call: str, role: str) -> tuple[np.ndarray, m.PeerEndpoint]:
        host = self._host
        if quantization is not None:
            raise InvalidArgument(f"{call} does not support quantization yet: pass quantization=None")
        if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag < 2**64:
            raise InvalidArgument(f"tag must be an integer in [0, 2**64), got {tag!r}")
        if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
            raise InvalidArgument(f"timeout must be a positive number of seconds or None, got {timeout!r}")
        array = as_array(x, name="x", writable=writable)
        host.raise_if_failed()
        if self._failure is not None:
            raise fresh_error(self._failure)
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise InvalidArgument(f"{role} must be a peer id (an int), got {peer!r}")
        if peer == host.peer_id:
            raise InvalidArgument(f"{call}: {role}={peer:x} is this peer's own id")
        for endpoint in host.ring_endpoints:
            if endpoint.peer_id == peer:
                return array, endpoint
        members = ", ".join(f"{e.peer_id:x}" for e in host.ring_endpoints) or "none"
        raise InvalidArgument(f"{call}: {role}={peer:x} is not an accepted member of this peer's group as of the "
                              f"last topology update (its members: {members})")

    async def _send(self, array: np.ndarray, endpoint: m.PeerEndpoint, tag: int) -> None:
        link = await self._outgoing(endpoint)
        conn = link.outgoing
        assert conn is not None
        dtype, count = dtype_of(array.dtype), array.size
        send = Outgoing(link.next_seq, tag, dtype, count)
        link.next_seq += 1
        link.sends[send.seq] = send
        announced = False
        try:
            await self._guarded(link, conn.send(m.PointOffer(send.seq, tag, int(dtype), count)))
            announced = True
            answer = await self._answer(send)
            if isinstance(answer, m.PointMismatch):
                raise InvalidArgument(f"send to peer {link.peer:x} on tag {tag}: the receiver takes "
                                      f"{_shape(DType(answer.dtype), answer.count)}, this send has "
                                      f"{_shape(dtype, count)}; nothing was sent")
            if isinstance(answer, m.PointAck):
                return  # an empty message
            if not isinstance(answer, m.PointReady):
                raise ProtocolError(f"peer {link.peer:x} answered an offer with {type(answer).__name__}")
            payload = array.reshape(-1).view(np.uint8).data
            send.answered = trio.Event()
            # No deadline per frame: a receiver that stalls stops its keepalives, and this
            # connection's reader fails the link (aborting a send under way) within peer_timeout.
            start = 0
            while start < payload.nbytes:
                piece = payload[start:start + link.frame]
                began = trio.current_time()
                await self._guarded(link, send_payload(conn, DataHeader(send.seq, 0, 0, start, piece.nbytes), piece))
                if piece.nbytes >= MIN_FRAME:  # a smaller one says little about the link's rate
                    link.frame = frame_bytes(piece.nbytes, trio.current_time() - began)
                start += piece.nbytes
            answer = await self._answer(send)
            if not isinstance(answer, m.PointAck):
                raise ProtocolError(f"peer {link.peer:x} answered a message's data with {type(answer).__name__}")
            self._host.counters.p2p_tx_bytes += array.nbytes
        except BaseException as exc:
            if announced and not isinstance(exc, PCCLError):  # cancelled with the message under way
                link.fail(PeerDisconnected(f"a send to peer {link.peer:x} was cancelled mid-message; its "
                                           "connections were closed"))
            raise
        finally:
            link.sends.pop(send.seq, None)

    async def _answer(self, send: Outgoing) -> m.Message | None:
        await send.answered.wait()
        if send.error is not None:
            raise fresh_error(send.error)
        return send.answer

    async def _recv(self, array: np.ndarray, endpoint: m.PeerEndpoint, tag: int) -> None:
        # The outgoing connection watches the sender's liveness while nothing arrives from it.
        link = await self._outgoing(endpoint)
        recv = Incoming(tag, array, dtype_of(array.dtype), array.size)
        link.posted.setdefault(tag, collections.deque()).append(recv)
        try:
            link.match(tag)
            await recv.done.wait()
        except BaseException as exc:
            if not recv.done.is_set():
                if recv.seq is None:
                    link.posted[tag].remove(recv)  # not matched: withdrawn, nothing else changes
                    link.tidy(tag)
                elif link.acking == recv.seq:
                    # All in, its PointAck being handed to the connection: nothing is half-read,
                    # so the link stays, and the writer says at once whether the answer went out.
                    with trio.CancelScope(shield=True):
                        await recv.done.wait()
                else:
                    link.fail(PeerDisconnected(f"a recv from peer {link.peer:x} was cancelled mid-message; its "
                                               "connections were closed"))
            if recv.error is not None:
                await recv.restore()
            # A receive whose answer went out is done (its sender is told the message arrived):
            # it returns; a cancellation that came too late to stop it (``timeout=`` included)
            # takes effect at the caller's next checkpoint.
            if not (recv.done.is_set() and recv.error is None and isinstance(exc, trio.Cancelled)):
                raise
        finally:
            if recv.seq is not None:
                link.receiving.pop(recv.seq, None)
        if recv.error is not None:
            await recv.restore()
            raise recv.error
        self._host.counters.p2p_rx_bytes += array.nbytes

    async def _guarded(self, link: PeerLink, op: Any) -> None:
        """Await a send on one of ``link``'s connections; a transport failure fails the link."""
        try:
            await op
        except PCCLError as exc:
            link.fail(PeerDisconnected(f"the connection with peer {link.peer:x} failed: {exc}"))
            raise fresh_error(link.error) from exc  # type: ignore[arg-type]

    # --- links -----------------------------------------------------------------------------------

    def _link(self, peer: int) -> PeerLink:
        link = self._links.get(peer)
        if link is None or link.error is not None:
            link = self._links[peer] = PeerLink(peer)
        return link

    async def _outgoing(self, endpoint: m.PeerEndpoint) -> PeerLink:
        """The link to ``endpoint`` with its outgoing connection open (dialled if need be;
        concurrent calls wait for one dial).  ``PeerUnreachable`` if the dial fails."""
        host = self._host
        while True:
            link = self._link(endpoint.peer_id)
            if link.outgoing is not None:
                return link
            if link.opening is not None:
                await link.opening.wait()
                if link.error is not None:
                    raise fresh_error(link.error)
                continue
            done = link.opening = trio.Event()
            try:
                conn = await host.open_peer(endpoint, Port.P2P)
                try:
                    with trio.fail_after(host.config.connect_timeout):
                        await conn.send(m.PointHello(host.peer_id, host.master_instance))
                        ack = await conn.receive()
                except trio.TooSlowError:
                    conn.abort()
                    raise PeerDisconnected(f"peer {endpoint.peer_id:x} did not answer the point-to-point hello "
                                           f"within {host.config.connect_timeout:g} s") from None
                except BaseException:
                    conn.abort()
                    raise
                if not isinstance(ack, m.PointHelloAck) or ack.peer_id != endpoint.peer_id:
                    conn.abort()
                    raise ProtocolError(f"peer {endpoint.peer_id:x} answered the point-to-point hello with {ack!r}")
            except PCCLError as exc:
                link.fail(exc)
                raise
            finally:
                link.opening = None
                done.set()
            if link.error is not None:  # failed meanwhile (the communicator closed, the peer's dial broke)
                conn.abort()
                raise fresh_error(link.error)
            link.outgoing = conn
            if not host.spawn(self._run_outgoing, link, conn):
                link.fail(InvalidUsage("the communicator is closed"))
                raise fresh_error(link.error)  # type: ignore[arg-type]
            return link

    async def serve(self, conn: FramedConnection, hello: m.PointHello) -> None:
        """Take ``hello.peer_id``'s connection for its messages to this peer (the p2p listener
        hands it over after reading ``hello``) and serve it until it or the link fails."""
        if self._failure is not None:
            conn.abort()
            return
        link = self._links.get(hello.peer_id)
        if link is not None and link.incoming is not None:
            # The peer dials again only after its end of the link failed: so did this one.
            link.fail(PeerDisconnected(f"peer {hello.peer_id:x} opened a new point-to-point connection; the old "
                                       "one's messages failed"))
        link = self._link(hello.peer_id)
        link.incoming = conn
        try:
            await conn.send(m.PointHelloAck(self._host.peer_id))
        except PCCLError as exc:
            link.fail(PeerDisconnected(f"the connection from peer {hello.peer_id:x} failed: {exc}"))
            return
        await self._run(link, conn, self._read_incoming, self._write_incoming, incoming=True)

    def under_way(self) -> int:
        """Messages whose data is moving: this peer's sends the receiver took, and its matched
        receives not yet complete (for tests and diagnostics)."""
        links = [link for link in self._links.values() if link.error is None]
        sends = sum(isinstance(s.answer, m.PointReady) for link in links for s in link.sends.values())
        return sends + sum(len(link.receiving) for link in links)

    def fail_all(self, error: PCCLError, *, graceful: bool = False) -> None:
        """The communicator failed or closes: every pending call raises ``error``, every
        connection closes (``graceful``: as :meth:`PeerLink.close` does, else aborted), later
        calls raise it too."""
        if self._failure is None:
            self._failure = error
        for link in list(self._links.values()):
            if graceful:
                link.close(error)
            else:
                link.fail(error)
        self._links.clear()

    # --- the connections' tasks ------------------------------------------------------------------

    async def _run_outgoing(self, link: PeerLink, conn: FramedConnection) -> None:
        await self._run(link, conn, self._read_outgoing, self._keepalive, incoming=False)

    async def _run(self, link: PeerLink, conn: FramedConnection, reader: Any, writer: Any, *,
                   incoming: bool) -> None:
        try:
            if link.error is None:
                async with trio.open_nursery() as nursery:
                    link.runs.add(nursery.cancel_scope)
                    nursery.start_soon(writer, link, conn)
                    try:
                        await reader(link, conn)
                    except (PCCLError, trio.TooSlowError) as exc:
                        if isinstance(exc, trio.TooSlowError):
                            why = f"peer {link.peer:x} was silent for {self._host.config.peer_timeout:g} s " \
                                  "(Config.peer_timeout)"
                        else:
                            why = f"the connection with peer {link.peer:x} failed: {exc}"
                        if link.error is None:
                            log.info("peer %x: point-to-point link to peer %x ends: %s", self._host.peer_id,
                                     link.peer, why)
                        link.fail(PeerDisconnected(why))
                    nursery.cancel_scope.cancel()
        finally:
            # Cancelled from outside with the link intact: the communicator closes (its close
            # then ends the link with PeerLink.close).
            if link.lingering or (link.error is None and trio.current_effective_deadline() == -math.inf):
                await linger(conn, incoming=incoming,
                             after=None if incoming or link.incoming is None else link.incoming_closed)
            conn.abort()
            if incoming:
                link.incoming_closed.set()

    def _interval(self) -> float:
        config = self._host.config
        return min(config.heartbeat_interval, config.peer_timeout / 3)

    async def _keepalive(self, link: PeerLink, conn: FramedConnection) -> None:
        try:
            while True:
                await trio.sleep(self._interval())
                await conn.send(m.PointKeepalive())
        except PCCLError as exc:
            link.fail(PeerDisconnected(f"the connection with peer {link.peer:x} failed: {exc}"))

    async def _write_incoming(self, link: PeerLink, conn: FramedConnection) -> None:
        """Send the answers to the peer's offers, and keepalives when there is nothing to say."""
        try:
            while True:
                reply: Reply = (m.PointKeepalive(), None)
                with trio.move_on_after(self._interval()):
                    reply = await link.outbox.receive()
                msg, sent = reply
                # An answer handed to the transport stands: a link failing while the send comes
                # back (the peer read the PointAck and closed at once) leaves its receive to this.
                link.acking = msg.seq if isinstance(msg, m.PointAck) else None
                try:
                    await conn.send(msg)  # never under the timeout: a torn frame would break the connection
                except BaseException:
                    link.unacked()
                    raise
                link.acking = None
                if sent is not None:
                    sent()
        except (PCCLError, trio.EndOfChannel) as exc:
            link.fail(PeerDisconnected(f"the connection with peer {link.peer:x} failed: {exc}"))

    async def _frame(self, conn: FramedConnection) -> m.Message | DataHeader:
        with trio.fail_after(self._host.config.peer_timeout):
            return await conn.receive_frame()

    async def _read_outgoing(self, link: PeerLink, conn: FramedConnection) -> None:
        while True:
            frame = await self._frame(conn)
            if isinstance(frame, m.PointKeepalive):
                continue
            if not isinstance(frame, (m.PointReady, m.PointAck, m.PointMismatch)):
                raise ProtocolError(f"unexpected {type(frame).__name__} on a point-to-point connection")
            send = link.sends.get(frame.seq)
            if send is None:
                raise ProtocolError(f"peer {link.peer:x} answered message {frame.seq}, which is not under way")
            send.answer_with(frame)

    async def _read_incoming(self, link: PeerLink, conn: FramedConnection) -> None:
        timeout = self._host.config.peer_timeout
        while True:
            frame = await self._frame(conn)
            if isinstance(frame, m.PointKeepalive):
                continue
            if isinstance(frame, m.PointOffer):
                try:
                    DType(frame.dtype)
                except ValueError:
                    raise ProtocolError(f"peer {link.peer:x} offers an unknown dtype {frame.dtype}") from None
                link.offers.setdefault(frame.tag, collections.deque()).append(frame)
                link.match(frame.tag)
                continue
            if not isinstance(frame, DataHeader):
                raise ProtocolError(f"unexpected {type(frame).__name__} on a point-to-point connection")
            recv = link.receiving.get(frame.op_seq)
            if recv is None or recv.backup is None or recv.received >= recv.target.nbytes \
                    or frame.offset != recv.received or frame.end > recv.target.nbytes:
                raise ProtocolError(f"peer {link.peer:x} sent data for message {frame.op_seq} (bytes {frame.offset}"
                                    f"..{frame.end}), which no receive expects")
            # Straight into the target, each piece saved into the backup first: a failed
            # receive restores what it overwrote (Incoming.restore, once this has stopped).
            target, backup = recv.target_bytes(), recv.backup.data
            recv.writer = writer = trio.Event()
            try:
                await receive_payload(conn, target[frame.offset:frame.end], timeout=timeout, piece=PIECE,
                                      large_piece=LARGE_PIECE, backup=backup[frame.offset:frame.end],
                                      saved=recv.saver(frame.offset))
            finally:
                recv.writer = None
                writer.set()
            recv.received += frame.nbytes
            if recv.received >= recv.target.nbytes:
                link.acknowledge(frame.op_seq)


@contextmanager
def _bounded(timeout: float | None, what: str) -> Iterator[None]:
    """Run the block within ``timeout`` seconds (None: unbounded); ``TransferTimeout`` when it
    ran out (the call was cancelled as by a cancel scope)."""
    if timeout is None:
        yield
        return
    with trio.move_on_after(timeout) as scope:
        yield
    if scope.cancelled_caught:
        raise TransferTimeout(f"{what} did not complete within {timeout:g} s")
