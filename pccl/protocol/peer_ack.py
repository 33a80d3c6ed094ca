"""Acks of completion agreed among peers: the op's digest, the ack's wire form, and whom a
participant acks (sans-IO).

The participant's machine is :mod:`pccl.protocol.peer_commit`; docs/protocol.rst ("Design:
completion agreed among peers") is the design; :mod:`pccl._peer.peer_commit_driver` sends and
reads the acks (:func:`encode_ack`, :func:`decode_ack`, :func:`accept`, as frames of
:func:`ack_seq`) to every :func:`ack_targets` position it has a link to, so the op commits
:func:`ack_hops` hops after its last participant is ready.

The digest rides in the ack
===========================

An ack is ``(seq, digest, known)``: the op's derived seq, its :func:`op_digest` (the round, the
seq, the kind and the fields the master compares for that kind: the row key of
:data:`pccl.protocol.master.kinds.KINDS`, exactly, so that peers never commit an op the master's
Begins would abort as ``PARAMETER_MISMATCH``), and the sender's known set as a bitset over ring
positions.  A receiver merges an ack only if its digest equals its own (:func:`accept`).  By
induction every id in a participant's known set then had its digest: its own id, and the ids of
sets it merged, each of which (by the same argument at the sender) had the sender's digest,
which equalled its own.  So a full known set proves that every participant ran the op with the
same parameters, without a digest in the data frames.  An ack with another digest is a doubt
(``MISMATCH``: the receiver asks the master, whose Begins show the disagreement and name every
peer's parameters); one for another seq is ``STALE`` (an op that ended here, or was never
begun: dropped).

Whom it acks
============

A participant sends its known set, whenever it grows (and it is ready or committed), to every
participant it has a link to: its ring neighbours and the partner links of the round
(:func:`pccl.protocol.algorithms.link_partner_positions`).  Any connected graph spreads every id
to everyone; the number of hops after the last participant is ready is the graph's diameter
(:func:`ack_hops`): 1 for two or three participants (the ring links every pair), at most
``log2 N`` with the halving-doubling partner links a round wires from 8 peers up (a hypercube
with the ring: 2 hops at 8, 5 at 64, 7 at 256), ``N // 2`` over the ring alone (4 to 7 peers,
or a ring forced).
The driver sends over all of them (:meth:`pccl.collectives.links.RingLinks.ack_links` picks the
connection of each pair); a participant relays what grew, so the last id arrives
:func:`ack_hops` hops after the last participant is ready.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Iterable
from typing import NamedTuple

from ..errors import InvalidArgument, ProtocolError
from . import messages as m
from .master.kinds import KINDS, kind_of

__all__ = ["Ack", "Acceptance", "DIGEST_SIZE", "accept", "ack_hops", "ack_seq", "ack_size", "ack_targets", "decode_ack",
           "encode_ack", "op_digest"]

DIGEST_SIZE = 8
_HEAD = struct.Struct(">Q8sI")  # seq, digest, participants


class Ack(NamedTuple):
    """One ack as it travels: the op's seq and digest, and the known set as ring positions."""

    seq: int
    digest: bytes
    known: frozenset[int]


class Acceptance:
    """What :func:`accept` says of an ack (plain strings: they are logged)."""

    MERGE = "merge"
    MISMATCH = "mismatch"
    STALE = "stale"


def op_digest(round_id: int, seq: int, init: m.CollectiveInit) -> bytes:
    """The digest of a fast-path op: its round, its seq, its kind and the fields the master
    compares for that kind (``KINDS[kind].key``), 8 bytes.  An all-gather (its counts are not
    agreed; it never begins) is :class:`pccl.InvalidArgument`."""
    row = KINDS[kind_of(init)]
    if row.sends_counts:
        raise InvalidArgument(f"{row.call} has no digest: its counts are not agreed (it never begins)")
    fields = (round_id, seq, int(row.kind), *(int(v) for v in row.key(init)))
    packed = struct.pack(f">{len(fields)}Q", *fields)
    return hashlib.blake2b(packed, digest_size=DIGEST_SIZE, person=b"pccl-ack").digest()


def ack_seq(seq: int) -> int:
    """The data-frame seq that carries op ``seq``'s acks on the ring lanes and partner links:
    derived from it (top bit set, like a begun op's, so that a receiver keeps the frames that
    arrive before it reads them), the same on every peer, and apart from every op's seq but by a 2**-63 chance."""
    digest = hashlib.blake2b(struct.pack(">Q", seq), digest_size=8, person=b"pccl-ack-seq").digest()
    return (1 << 63) | (int.from_bytes(digest, "big") >> 1)


def ack_size(n: int) -> int:
    """The bytes of one ack of an op with ``n`` participants (:func:`encode_ack`)."""
    return _HEAD.size + (n + 7) // 8


def encode_ack(ack: Ack, n: int) -> bytes:
    """``ack`` for an op of ``n`` participants: a header and ``ceil(n / 8)`` bytes of bitset
    (position ``p`` is bit ``p % 8`` of byte ``p // 8``)."""
    if len(ack.digest) != DIGEST_SIZE:
        raise InvalidArgument(f"a digest is {DIGEST_SIZE} bytes, got {len(ack.digest)}")
    value = 0  # the bitset as one little-endian integer: bit p is position p
    for p in ack.known:
        if not 0 <= p < n:
            raise InvalidArgument(f"known positions {sorted(ack.known)} are not all in 0..{n - 1}")
        value |= 1 << p
    return _HEAD.pack(ack.seq, ack.digest, n) + value.to_bytes((n + 7) // 8, "little")


def decode_ack(payload: bytes, n: int) -> Ack:
    """An ack read from a participant of an op with ``n`` participants here.  A payload of
    the wrong size, another participant count or a bit past the last position is a
    :class:`pccl.ProtocolError`."""
    if len(payload) < _HEAD.size:
        raise ProtocolError(f"an ack of {len(payload)} bytes is shorter than its {_HEAD.size}-byte header")
    seq, digest, count = _HEAD.unpack_from(payload)
    if count != n:
        raise ProtocolError(f"an ack for seq {seq} counts {count} participants, this peer {n}")
    bits = payload[_HEAD.size:]
    if len(bits) != (n + 7) // 8:
        raise ProtocolError(f"an ack for {n} participants has {len(bits)} bitset bytes, not {(n + 7) // 8}")
    value = int.from_bytes(bits, "little")  # bit p: position p (bit p % 8 of byte p // 8)
    if value.bit_length() > n:
        raise ProtocolError(f"an ack names position {value.bit_length() - 1} of an op with {n} participants")
    positions = []
    while value:  # (a loop, not a generator: one call per ack, not one per bit)
        low = value & -value
        positions.append(low.bit_length() - 1)
        value ^= low
    return Ack(seq, digest, frozenset(positions))


def accept(ack: Ack, seq: int, digest: bytes) -> str:
    """:attr:`Acceptance.MERGE` an ack of this op with this digest, :attr:`Acceptance.STALE` one of
    another seq, :attr:`Acceptance.MISMATCH` one of this seq with another digest."""
    if ack.seq != seq:
        return Acceptance.STALE
    return Acceptance.MERGE if ack.digest == digest else Acceptance.MISMATCH


def ack_targets(position: int, n: int, partners: Iterable[int] = ()) -> tuple[int, ...]:
    """The ring positions that ``position`` acks: its ring neighbours and its ``partners``
    (the round's partner links), ascending, without itself."""
    if not 0 <= position < n:
        raise InvalidArgument(f"ring position {position} is not in 0..{n - 1}")
    out = {(position + 1) % n, (position - 1) % n, *partners}
    bad = sorted(p for p in out if not 0 <= p < n)
    if bad:
        raise InvalidArgument(f"partner positions {bad} are not in 0..{n - 1}")
    out.discard(position)
    return tuple(sorted(out))


def ack_hops(n: int, partners_of: Collection[Collection[int]] = ()) -> int:
    """Hops an id takes, at most, to reach every participant over :func:`ack_targets` (the
    graph's diameter); ``partners_of[p]``: the partner positions of position ``p`` (none when
    empty).  0 for a single participant."""
    if n < 1:
        raise InvalidArgument(f"an op has at least one participant, got {n}")
    partners = list(partners_of) or [()] * n
    if len(partners) != n:
        raise InvalidArgument(f"partner positions for {len(partners)} positions, not {n}")
    edges = [ack_targets(p, n, partners[p]) if n > 1 else () for p in range(n)]
    worst = 0
    for start in range(n):
        seen, frontier, hops = {start}, [start], 0
        while len(seen) < n:
            frontier = [q for p in frontier for q in edges[p] if q not in seen]
            if not frontier:
                raise InvalidArgument(f"position {start} reaches only {len(seen)} of {n} positions")
            seen.update(frontier)
            hops += 1
        worst = max(worst, hops)
    return worst
