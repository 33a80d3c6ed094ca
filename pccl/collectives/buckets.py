"""Buckets of ``all_reduce_many``: small same-dtype arrays reduced by one all-reduce.

A model's gradient list is hundreds of tensors, most of them small (biases, norms); one
all-reduce each would pay the op's fixed cost — master round trips, the ring's set-up, its
threads' hand-offs — per tensor.  As torch DDP does, the arrays are grouped into buckets of at
most ``bucket_bytes``: arrays of one dtype, in list order, share a bucket until it is full; an
array of ``bucket_bytes`` or more is reduced in place on its own.

Arrays of at least :data:`SEGMENTED_MIN_BYTES` are not packed at all: they share buckets of
their own, and such a bucket's op runs in place over its members, seen as one
:class:`~pccl.collectives.segments.Segments` buffer whose arrays' boundaries no frame straddles.
No copy in, no copy out, and the in-place backup rides along with the reduce-scatter kernel as
for one flat array: on a CPU-bound ring those two copies were most of the gap to one flat
all-reduce.  Smaller arrays are packed into buckets of their own: each boundary in a segmented
buffer costs extra frames (a frame per member and step at least), which for a bias of a few
KiB cost more than copying it, and a bucket of small arrays may be small enough for the
small-op paths (the exchange, the staged in-place result), which work on one flat buffer.

A packed bucket is reduced out of place between two scratch buffers: its members are copied
into the send buffer, reduced into the result buffer, and copied back into the members only
when the op completed.  An aborted op leaves the members untouched (there is nothing to
restore), and its retry reduces the same packed input again.  A segmented bucket is restored
from its backup when its op aborts, and its retry reduces the same members again.  So the
restore semantics of ``all_reduce`` hold per bucket.  Which arrays share a bucket depends only
on the list's dtypes and sizes, so every peer that passes the same list forms the same buckets;
the master's per-tag check compares count and dtype, and for a segmented bucket a digest of its
members' sizes, so peers whose lists were cut differently get a clear ``PARAMETER_MISMATCH``
rather than frames that do not line up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .buffers import SCRATCH, ScratchArena
from .segments import Segments

__all__ = ["DEFAULT_BUCKET_BYTES", "PACKED_BUCKET_BYTES", "SEGMENTED_MIN_BYTES", "Bucket", "plan_buckets"]

#: Large, unlike torch DDP's 25 MiB (whose buckets overlap the backward pass, which this call
#: does not see): a segmented bucket costs no copy, so what bounds it is the op's in-place backup
#: (scratch of the bucket's size per op in flight) and how much one retry redoes.  Every op is
#: a barrier across the peers (it commences when the slowest one votes) plus master round
#: trips, which on a loaded host cost more than the ops overlap: on GPT-2 small's list
#: (``benchmarks/bucketed_many.py --peers 2``, 475 MiB, 20 iterations side by side) buckets of
#: 25 MiB took 1.34x the time of one flat all-reduce, 256 MiB 1.17x, 512 MiB (the large arrays
#: in one op, the small ones in another) 1.06x.
DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
#: Buckets of small (packed) arrays hold at most this much, whatever ``bucket_bytes``: their
#: copies in and out then run in worker threads while other buckets' transfers go on, and
#: their scratch (two buffers of the bucket's size) stays small.  torch DDP's ``bucket_cap_mb``.
PACKED_BUCKET_BYTES = 25 * 1024 * 1024
#: Arrays of at least this size share segmented buckets (reduced in place over the members);
#: smaller ones share packed buckets.  At least 256 KiB, so that a segmented bucket (two members
#: or more) is never small enough to be staged or exchanged: both work on one flat buffer
#: (:class:`~pccl.collectives.backup.InputGuard`'s ``stage_up_to``, ``ring.EXCHANGE_MAX_BYTES``).
SEGMENTED_MIN_BYTES = 1024 * 1024


@dataclasses.dataclass(eq=False)
class Bucket:
    """Arrays reduced by one op: one array in place, several in place as segments, or several
    packed (see the module doc)."""

    members: list[np.ndarray]
    #: Positions of the members in the caller's list.
    indices: list[int]
    #: A bucket of arrays of at least :data:`SEGMENTED_MIN_BYTES` (else of smaller ones).
    large: bool = False
    _storage: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def segmented(self) -> bool:
        return self.large and len(self.members) > 1

    @property
    def packed(self) -> bool:
        return not self.large and len(self.members) > 1

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.members)

    def buffers(self, arena: ScratchArena = SCRATCH) -> tuple[np.ndarray | Segments, np.ndarray | None]:
        """``(send, recv)`` for the op: the array itself or its members as :class:`Segments`
        and ``None`` (in place), or the packed input and a result buffer from ``arena`` (held
        until :meth:`release`)."""
        if self.segmented:
            return Segments(self.members), None
        if not self.packed:
            return self.members[0], None
        dtype, count = self.members[0].dtype, sum(int(a.size) for a in self.members)
        self._storage = [arena.take(self.nbytes), arena.take(self.nbytes)]
        send, recv = (buf[: self.nbytes].view(dtype) for buf in self._storage)
        offset = 0
        for a in self.members:
            send[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        assert offset == count
        return send, recv

    def unpack(self, recv: np.ndarray | None) -> None:
        """Copy a completed packed op's result into the members (nothing to do in place)."""
        if recv is None:
            return
        offset = 0
        for a in self.members:
            a.reshape(-1)[...] = recv[offset : offset + a.size]
            offset += a.size

    def release(self, arena: ScratchArena = SCRATCH) -> None:
        for buf in self._storage:
            arena.give(buf)
        self._storage = []


def plan_buckets(arrays: list[np.ndarray], bucket_bytes: int) -> list[Bucket]:
    """Group ``arrays`` (numpy views, checked) into buckets of at most ``bucket_bytes`` each;
    0 puts every array in a bucket of its own.  Arrays of one dtype and one kind (at least
    :data:`SEGMENTED_MIN_BYTES`, or smaller) share a bucket in list order until it is full
    (small ones: at most :data:`PACKED_BUCKET_BYTES`).
    Buckets are ordered by their first member."""
    buckets: list[Bucket] = []
    open_buckets: dict[tuple[np.dtype, bool], Bucket] = {}
    for i, a in enumerate(arrays):
        if a.nbytes >= bucket_bytes:
            buckets.append(Bucket([a], [i]))
            continue
        large = a.nbytes >= SEGMENTED_MIN_BYTES
        cap = bucket_bytes if large else min(bucket_bytes, PACKED_BUCKET_BYTES)
        current = open_buckets.get((a.dtype, large))
        if current is None or current.nbytes + a.nbytes > cap:
            current = Bucket([], [], large)
            buckets.append(current)
            open_buckets[(a.dtype, large)] = current
        current.members.append(a)
        current.indices.append(i)
    return buckets
