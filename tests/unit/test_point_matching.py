"""The point-to-point link's matching (pccl._peer.point.PeerLink.match), without connections:
offers and receives pair per tag in arrival / call order, a mismatch answers the sender and
fails only that receive, an empty message is acknowledged at once (its receive completes once
the answer went to the connection), and a failed link ends every pending receive and send with
its own copy of the error — but not a send whose final answer had come."""

from __future__ import annotations

import collections

import numpy as np
import trio

from pccl.errors import InvalidArgument, PeerDisconnected
from pccl.testing.units import Incoming, Outgoing, PeerLink
from pccl.protocol import messages as m
from pccl.types import DType


def _recv(link: PeerLink, tag: int, array: np.ndarray) -> Incoming:
    recv = Incoming(tag, array, DType.FLOAT32 if array.dtype == np.float32 else DType.INT64, array.size)
    link.posted.setdefault(tag, collections.deque()).append(recv)
    link.match(tag)
    return recv


def _offer(link: PeerLink, seq: int, tag: int, dtype: DType, count: int) -> None:
    link.offers.setdefault(tag, collections.deque()).append(m.PointOffer(seq, tag, int(dtype), count))
    link.match(tag)


def _replies(link: PeerLink) -> list[m.Message]:
    """The answers queued for the connection, handed to it (as the writer task does)."""
    out = []
    while True:
        try:
            msg, sent = link.outbox.receive_nowait()
        except trio.WouldBlock:
            return out
        out.append(msg)
        if sent is not None:
            sent()


def test_offers_and_receives_pair_in_order_per_tag() -> None:
    link = PeerLink(0xAB)
    first, second = _recv(link, 1, np.zeros(3, np.float32)), _recv(link, 1, np.zeros(3, np.float32))
    other = _recv(link, 2, np.zeros(5, np.float32))
    _offer(link, 7, 2, DType.FLOAT32, 5)
    _offer(link, 8, 1, DType.FLOAT32, 3)
    _offer(link, 9, 1, DType.FLOAT32, 3)
    assert (other.seq, first.seq, second.seq) == (7, 8, 9)
    assert [type(r).__name__ for r in _replies(link)] == ["PointReady"] * 3
    assert link.offers == {} and link.posted == {}  # no empty queue is kept per tag


def test_a_mismatch_fails_that_receive_only_and_names_both_shapes() -> None:
    link = PeerLink(0xAB)
    y = np.full(10, 7, np.float32)
    bad = _recv(link, 0, y)
    good = _recv(link, 0, np.zeros(12, np.float32))
    _offer(link, 1, 0, DType.FLOAT32, 12)
    _offer(link, 2, 0, DType.FLOAT32, 12)
    assert bad.done.is_set() and isinstance(bad.error, InvalidArgument)
    assert "12 float32 elements" in str(bad.error) and "10 float32 elements" in str(bad.error)
    assert bool((y == 7).all())
    assert good.seq == 2
    assert _replies(link) == [m.PointMismatch(1, int(DType.FLOAT32), 10), m.PointReady(2)]


def test_an_empty_message_is_acknowledged_at_once() -> None:
    link = PeerLink(0xAB)
    recv = _recv(link, 0, np.zeros(0, np.float32))
    _offer(link, 4, 0, DType.FLOAT32, 0)
    assert not recv.done.is_set(), "the receive completed before its PointAck went to the connection"
    assert _replies(link) == [m.PointAck(4)]
    assert recv.done.is_set() and recv.error is None
    assert link.receiving == {}


def test_a_receive_whose_ack_was_not_sent_when_the_link_failed_fails_and_keeps_its_old_values() -> None:
    """The whole message came, but the link failed before the PointAck went out: the sender's
    send fails, and so does this receive (its array restored), rather than one side
    succeeding alone."""
    link = PeerLink(0xAB)
    y = np.full(4, 7, np.float32)
    recv = _recv(link, 0, y)
    _offer(link, 3, 0, DType.FLOAT32, 4)
    assert recv.backup is not None
    recv.saver(0)(y.nbytes)
    # What the data's receiver saves (the scratch pool may hand out a larger buffer).
    recv.backup[:y.nbytes] = np.frombuffer(y.tobytes(), np.uint8)
    y[...] = 1  # the payload, all in
    recv.received = y.nbytes
    link.acknowledge(3)
    assert not recv.done.is_set()
    link.fail(PeerDisconnected("peer ab died"))
    assert isinstance(recv.error, PeerDisconnected)
    trio.run(recv.restore)
    assert (y == 7).all()


def test_a_send_whose_ack_came_succeeds_though_the_link_fails_before_it_resumes() -> None:
    """The reader took the PointAck, then the receiver's close (its EOF) failed the link
    before the send's task ran: the send completed, the failure does not overwrite it."""
    link = PeerLink(0xAB)
    done = link.sends[5] = Outgoing(5, 0, DType.FLOAT32, 4)
    done.answer_with(m.PointAck(5))
    refused = link.sends[6] = Outgoing(6, 0, DType.FLOAT32, 4)
    refused.answer_with(m.PointMismatch(6, int(DType.FLOAT32), 3))
    moving = link.sends[7] = Outgoing(7, 0, DType.FLOAT32, 4)
    moving.answer_with(m.PointReady(7))
    link.fail(PeerDisconnected("peer ab closed the connection"))
    assert done.error is None and refused.error is None
    assert isinstance(moving.error, PeerDisconnected)


def test_a_failed_link_ends_everything_pending_with_its_own_error() -> None:
    link = PeerLink(0xAB)
    waiting = _recv(link, 0, np.zeros(4, np.float32))
    moving = _recv(link, 1, np.zeros(4, np.float32))
    _offer(link, 1, 1, DType.FLOAT32, 4)
    send = link.sends[5] = Outgoing(5, 0, DType.FLOAT32, 4)
    link.fail(PeerDisconnected("peer ab died"))
    errors = [waiting.error, moving.error, send.error]
    assert all(isinstance(e, PeerDisconnected) for e in errors)
    assert len({id(e) for e in errors}) == 3  # a fresh copy each: raised from several tasks
    assert send.answered.is_set() and waiting.done.is_set() and moving.done.is_set()
    link.reply(m.PointAck(1))  # after the failure: dropped, not raised
