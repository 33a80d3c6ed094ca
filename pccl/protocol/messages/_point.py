"""Point-to-point messages (tags 160–169): ``Communicator.send`` / ``recv``.

Import them from :mod:`pccl.protocol.messages`, which re-exports everything.
"""

from __future__ import annotations

from ._base import U32, U64, Message


# --- 160–169: point-to-point (peer side in pccl/_peer/point.py) ----------------------------------
#
# A peer that sends to another (or waits to receive from it) dials the other's p2p port over the
# pair's path (pccl/_peer/connector.py) and presents PointHello; the other answers PointHelloAck.
# Each direction of a pair has its own connection, dialled by the sending side and kept for later
# messages.  On it the sender announces each message with PointOffer(seq, tag, dtype, count);
# the receiver matches offers to its posted receives per tag in order and answers PointReady(seq)
# — then the sender streams data frames (op_seq = seq) — or PointMismatch(seq, its dtype and
# count).  Once the whole payload is in, the receiver answers PointAck(seq) (at once, instead of
# PointReady, for an empty message).  Both sides send PointKeepalive while the connection is
# open, so a silent peer is noticed within Config.peer_timeout.  A peer whose communicator
# closes half-closes its connections (EOF after its last answers; the one carrying its answers
# first) and reads them until the other side closes them, rather than resetting them.


class PointHello(Message, tag=160):
    """Dialler → acceptor, first message on a point-to-point connection: peer ``peer_id`` of
    master ``instance`` will send its messages for the acceptor on this connection."""

    peer_id: U64
    instance: U64 = 0


class PointHelloAck(Message, tag=161):
    """Acceptor → dialler: the connection is taken (``peer_id``: who answered)."""

    peer_id: U64


class PointOffer(Message, tag=162):
    """Sender → receiver: message ``seq`` (this connection's count) on ``tag``, ``count``
    elements of ``dtype`` (a ``types.DType``); its data follows once the receiver is ready."""

    seq: U64
    tag: U64
    dtype: U32
    count: U64


class PointReady(Message, tag=163):
    """Receiver → sender: a receive matched offer ``seq`` with the same dtype and count; send."""

    seq: U64


class PointMismatch(Message, tag=164):
    """Receiver → sender: the receive that matched offer ``seq`` takes ``count`` elements of
    ``dtype``, not what was offered; both calls fail, nothing is sent."""

    seq: U64
    dtype: U32
    count: U64


class PointAck(Message, tag=165):
    """Receiver → sender: the whole payload of message ``seq`` arrived; the send is complete."""

    seq: U64


class PointKeepalive(Message, tag=166):
    """Either way, every ``Config.heartbeat_interval`` while the connection is open."""


POINT_MESSAGES: tuple[type[Message], ...] = (
    PointHello, PointHelloAck, PointOffer, PointReady, PointMismatch, PointAck, PointKeepalive,
)
