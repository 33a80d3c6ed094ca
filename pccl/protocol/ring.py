"""The ring all-reduce schedule: which chunk moves at which step, cut into which frames.

Pure arithmetic, no I/O: :mod:`pccl.collectives.allreduce` executes this plan over the data
connections, tests check it exhaustively, and both ends of every link derive the same plan from
the same agreed inputs (element count, world size, sub-chunk size), so a frame's header can be
validated against what the receiver expects.

Rules (PCCL's ``reduce.cpp`` with sub-chunk pipelining added):

* **Chunks.**  ``count`` elements are cut into ``world`` contiguous chunks in rank order:
  ``base = count // world`` and the first ``count % world`` chunks get one element more.
* **Reduce-scatter**, steps ``0 … world-2``: at step ``s`` the peer at ring position ``r`` sends
  chunk ``(r - s) mod N`` to its successor and receives chunk ``(r - s - 1) mod N`` from its
  predecessor, reducing it into its accumulator.  Afterwards ``r`` holds the complete reduction
  of chunk ``(r + 1) mod N``: it *owns* that chunk.
* **All-gather**, steps ``world-1 … 2·world-3`` (gather step ``g = step - (world-1)``): ``r``
  sends chunk ``(r + 1 - g) mod N`` — its owned chunk first, then whatever it received last —
  and receives chunk ``(r - g) mod N``, which it stores.
* **Sub-chunks.**  Each chunk is cut into sub-chunks of at most ``subchunk_elements`` elements
  (the last one shorter).  A frame carries one sub-chunk of one step.  Sending frame
  ``(step, k)`` depends only on having processed the received frame ``(step - 1, k)`` (the same
  chunk, see :meth:`RingSchedule.send_chunk`), so the steps pipeline sub-chunk by sub-chunk.
* **Breaks.**  An op over a segmented buffer (several arrays reduced as one, without packing
  them: :mod:`pccl.collectives.buckets`) passes the element offsets where one array ends and the
  next begins; sub-chunks are also cut there, so no frame straddles two arrays.  The breaks are
  part of what every peer must agree on, like the element count.
* **Lanes.**  When one op is striped over several connections per neighbour, sub-chunk ``k``
  of every step travels on lane ``k mod lanes``; each lane carries its frames in schedule order.

:class:`ExchangeSchedule` is the plan for small ops: every input travels around the ring (an
all-gather of the inputs, ``world - 1`` trips instead of ``2 (world - 1)``) and every peer
reduces them all in ring order.  At two peers that is one exchange, for the same bytes as the
ring.
The other collectives run on the same lanes and frames with plans of their own, each stated in
its class: :class:`ReduceScatterSchedule` (the first half of the ring; position ``r`` owns chunk
``r``), :class:`AllGatherSchedule` (the second half, contributions of any sizes laid out in
position order) and :class:`BroadcastSchedule` (a pipelined chain from the root).  Every plan
keeps the property the execution paths rely on: frame ``k`` received at step ``s`` is what frame
``k`` sent at step ``s + 1`` is made from, and a step may move no frame at all.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .algorithms import partner_positions, site_partners

__all__ = [
    "build_ring",
    "ring_neighbours",
    "ring_contacts",
    "ring_successor",
    "ring_predecessor",
    "Phase",
    "Frame",
    "RingSchedule",
    "ExchangeSchedule",
    "ReduceScatterSchedule",
    "AllGatherSchedule",
    "BroadcastSchedule",
    "gather_bounds",
    "shared_schedule",
    "uses_exchange",
    "EXCHANGE_MAX_BYTES",
    "chunk_bounds",
    "split_range",
    "split_at_breaks",
    "subchunk_elements",
    "DEFAULT_SUBCHUNK_BYTES",
    "MIN_SUBCHUNK_BYTES",
]

#: Largest payload of one data frame (of user data).  Per-frame costs (two or three thread
#: hand-offs, Trio scheduling) are what limits loopback throughput, and on a busy 2-core machine
#: 4 MiB frames beat 1 MiB ones by ~1.5-2x; the pipeline still gets several frames per chunk.
DEFAULT_SUBCHUNK_BYTES = 4 << 20
#: Floor of the adaptive sub-chunk size for small ops (below it per-frame overhead dominates).
MIN_SUBCHUNK_BYTES = 64 * 1024
#: Largest number of bytes a peer sends in an op run as an exchange (:class:`ExchangeSchedule`:
#: ``(world - 1) * input bytes``) instead of reduce-scatter + all-gather.  Above it the ring's
#: fewer bytes, pipelining and ``1 / world`` share of the reduction win.
EXCHANGE_MAX_BYTES = 256 * 1024
#: How many sub-chunks per chunk the adaptive size aims for, so that a mid-sized op still
#: overlaps receiving, reducing and sending a chunk.  Two, not four: each frame costs ~50 us of
#: CPU and a thread wake-up, and with four, 1-4 MiB ops were 7-28% slower on loopback (measured
#: op by op, in place: 1 MiB 8.5 -> 6.3 ms at N = 3 and 15.2 -> 10.9 ms at N = 4, 4 MiB 13.1 ->
#: 11.4 ms at N = 3).  One frame per chunk was no faster than two from 4 MiB up and gives up
#: that overlap.  Ops whose chunks are at least four times ``DEFAULT_SUBCHUNK_BYTES`` (16 MiB:
#: 64 MiB at N <= 4) got capped frames with four and still do.
_PIPELINE_DEPTH = 2


def build_ring(peer_ids: Iterable[int]) -> tuple[int, ...]:
    """A group's ring order: ascending peer id (until a topology optimisation orders it)."""
    return tuple(sorted(peer_ids))


def ring_successor(ring: Sequence[int], peer_id: int) -> int:
    """The peer after ``peer_id`` in ``ring`` (``peer_id`` itself when alone): the one it sends
    to.  ``ValueError`` if ``peer_id`` is not in the ring."""
    i = list(ring).index(peer_id)
    return ring[(i + 1) % len(ring)]


def ring_predecessor(ring: Sequence[int], peer_id: int) -> int:
    """The peer before ``peer_id`` in ``ring`` (``peer_id`` itself when alone): the one it
    receives from.  ``ValueError`` if ``peer_id`` is not in the ring."""
    i = list(ring).index(peer_id)
    return ring[(i - 1) % len(ring)]


def ring_neighbours(ring: Sequence[int], peer_id: int) -> tuple[int, ...]:
    """The distinct neighbours of ``peer_id`` in ``ring``, predecessor first: two, one for a ring
    of two, none when alone.  ``ValueError`` if ``peer_id`` is not in the ring."""
    out: list[int] = []
    for other in (ring_predecessor(ring, peer_id), ring_successor(ring, peer_id)):
        if other != peer_id and other not in out:
            out.append(other)
    return tuple(out)


def ring_contacts(ring: Sequence[int], peer_id: int, sites: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The peers whose endpoints ``peer_id`` gets for a topology round: its ring neighbours,
    then its halving-doubling partners (:func:`~pccl.protocol.algorithms.partner_positions`),
    then its hierarchical partners (:func:`~pccl.protocol.algorithms.site_partners`, when the
    round has ``sites``), each once."""
    out = list(ring_neighbours(ring, peer_id))
    me = list(ring).index(peer_id)
    for position in partner_positions(me, len(ring)) + site_partners(me, sites):
        if ring[position] not in out:
            out.append(ring[position])
    return tuple(out)


class Phase(enum.Enum):
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


def chunk_bounds(count: int, world: int) -> tuple[tuple[int, int], ...]:
    """``world`` contiguous ``(start, stop)`` element ranges covering ``count`` elements.

    The first ``count % world`` chunks are one element longer (PCCL's ``computeChunkBoundaries``).
    """
    if world < 1:
        raise ValueError(f"world size must be at least 1, got {world}")
    if count < 0:
        raise ValueError(f"element count must be non-negative, got {count}")
    base, extra = divmod(count, world)
    bounds = []
    start = 0
    for i in range(world):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def split_range(start: int, stop: int, max_elements: int) -> tuple[tuple[int, int], ...]:
    """Cut ``[start, stop)`` into consecutive pieces of ``max_elements`` (the last may be shorter).

    An empty range has no pieces.
    """
    if max_elements < 1:
        raise ValueError("max_elements must be positive")
    return tuple((a, min(a + max_elements, stop)) for a in range(start, stop, max_elements))


def split_at_breaks(
    start: int, stop: int, max_elements: int, breaks: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    """:func:`split_range`, with ``[start, stop)`` first cut at every offset of ``breaks``
    (ascending) inside it: each piece is then split from its own start."""
    if not breaks:
        return split_range(start, stop, max_elements)
    cuts = [start, *breaks[bisect.bisect_right(breaks, start) : bisect.bisect_left(breaks, stop)], stop]
    return tuple(piece for a, b in zip(cuts, cuts[1:]) for piece in split_range(a, b, max_elements))


def subchunk_elements(
    count: int,
    world: int,
    itemsize: int,
    *,
    max_bytes: int = DEFAULT_SUBCHUNK_BYTES,
    min_bytes: int = MIN_SUBCHUNK_BYTES,
) -> int:
    """The sub-chunk size in elements for an op, a pure function of agreed parameters.

    Aims at :data:`_PIPELINE_DEPTH` sub-chunks per chunk, clamped to ``[min_bytes, max_bytes]``
    of user data.  Both ends of a link must call it with the same arguments (they are part of
    what the master checks agree, or constants), otherwise frame headers will not match.
    """
    if itemsize < 1 or world < 1:
        raise ValueError("itemsize and world must be positive")
    largest_chunk = -(-count // world)
    wanted = -(-largest_chunk // _PIPELINE_DEPTH) * itemsize
    size_bytes = max(min_bytes, min(max_bytes, wanted))
    return max(1, size_bytes // itemsize)


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One data frame of the schedule: sub-chunk ``index`` of ``chunk`` at ``step``."""

    step: int
    chunk: int
    index: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


class RingSchedule:
    """The complete plan of one all-reduce for the peer at ring position ``rank``.

    ``breaks``: ascending element offsets in ``(0, count)`` where sub-chunks are also cut (the
    boundaries of a segmented buffer's arrays); empty for one flat array.
    """

    __slots__ = ("count", "world", "rank", "subchunk_elements", "breaks", "chunks", "_subchunks", "_frame_lists")

    def __init__(
        self, count: int, world: int, rank: int, subchunk_elements: int, breaks: Sequence[int] = ()
    ) -> None:
        if world < 2:
            raise ValueError(f"a ring needs at least 2 peers, got {world}")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a ring of {world}")
        breaks = tuple(breaks)
        if any(not 0 < b < count for b in breaks) or any(a >= b for a, b in zip(breaks, breaks[1:])):
            raise ValueError("breaks must be strictly ascending offsets inside the buffer")
        self.count = count
        self.world = world
        self.rank = rank
        self.subchunk_elements = subchunk_elements
        self.breaks = breaks
        self.chunks = chunk_bounds(count, world)
        self._subchunks = tuple(split_at_breaks(a, b, subchunk_elements, breaks) for a, b in self.chunks)
        # (receiving, lane, lanes) -> that lane's frames, and (receiving, -1, 0) -> the frames
        # per step, built on first use: a schedule is immutable, and a training loop runs the
        # same op (one shared schedule) every step.
        self._frame_lists: dict[tuple[bool, int, int], tuple[Any, ...]] = {}

    # --- steps -------------------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        return 2 * (self.world - 1)

    def phase(self, step: int) -> Phase:
        self._check_step(step)
        return Phase.REDUCE_SCATTER if step < self.world - 1 else Phase.ALL_GATHER

    @property
    def owned_chunk(self) -> int:
        """The chunk this peer completes in reduce-scatter and is the first to send in all-gather."""
        return (self.rank + 1) % self.world

    def send_chunk(self, step: int) -> int:
        """Chunk sent to the successor at ``step``; equals ``recv_chunk(step - 1)`` for step > 0."""
        self._check_step(step)
        n = self.world
        if step < n - 1:
            return (self.rank - step) % n
        return (self.rank + 1 - (step - (n - 1))) % n

    def recv_chunk(self, step: int) -> int:
        """Chunk received from the predecessor at ``step``."""
        self._check_step(step)
        n = self.world
        if step < n - 1:
            return (self.rank - step - 1) % n
        return (self.rank - (step - (n - 1))) % n

    def subchunks(self, chunk: int) -> tuple[tuple[int, int], ...]:
        return self._subchunks[chunk]

    @property
    def max_subchunks(self) -> int:
        """The most sub-chunks of any chunk: an upper bound on frames per step."""
        return max(len(s) for s in self._subchunks)

    # --- frames ------------------------------------------------------------------------------

    def _frames(self, step: int, chunk: int) -> Iterator[Frame]:
        for k, (a, b) in enumerate(self._subchunks[chunk]):
            yield Frame(step, chunk, k, a, b)

    def step_chunks(self, step: int, receiving: bool) -> tuple[int, ...]:
        """The chunks this peer receives (``receiving``) or sends at ``step``: one for every
        ring schedule; none at the steps where a chain's peer is idle
        (:class:`BroadcastSchedule`)."""
        return (self.recv_chunk(step) if receiving else self.send_chunk(step),)

    def send_frames(self, lane: int = 0, lanes: int = 1) -> tuple[Frame, ...]:
        """Frames this peer sends on ``lane`` (of ``lanes``), in the order it sends them."""
        return self._lane_frames(False, lane, lanes)

    def recv_frames(self, lane: int = 0, lanes: int = 1) -> tuple[Frame, ...]:
        """Frames this peer receives on ``lane`` (of ``lanes``), in the order they arrive."""
        return self._lane_frames(True, lane, lanes)

    def step_frames(self, receiving: bool) -> tuple[tuple[Frame, ...], ...]:
        """Per step, the frames this peer receives (``receiving``) or sends at that step, in
        sub-chunk order: frame ``k`` received at step ``s`` is what frame ``k`` sent at step
        ``s + 1`` is made from (the same chunk)."""
        key = (receiving, -1, 0)
        frames = self._frame_lists.get(key)
        if frames is None:
            frames = self._frame_lists[key] = tuple(
                tuple(f for chunk in self.step_chunks(step, receiving) for f in self._frames(step, chunk))
                for step in range(self.num_steps)
            )
        return frames

    def _lane_frames(self, receiving: bool, lane: int, lanes: int) -> tuple[Frame, ...]:
        frames = self._frame_lists.get((receiving, lane, lanes))
        if frames is None:
            self._check_lane(lane, lanes)
            frames = self._frame_lists[(receiving, lane, lanes)] = tuple(
                f
                for step in range(self.num_steps)
                for chunk in self.step_chunks(step, receiving)
                for f in self._frames(step, chunk)
                if f.index % lanes == lane
            )
        return frames

    @property
    def moves_nothing(self) -> bool:
        """Whether no frame moves at all (an empty buffer: every chunk is)."""
        return not any(self._subchunks)

    def sent_elements(self) -> int:
        """Elements this peer sends over the whole op (each step's chunk once)."""
        return sum(self.chunk_size(c) for s in range(self.num_steps) for c in self.step_chunks(s, False))

    def received_elements(self) -> int:
        return sum(self.chunk_size(c) for s in range(self.num_steps) for c in self.step_chunks(s, True))

    def chunk_size(self, chunk: int) -> int:
        a, b = self.chunks[chunk]
        return b - a

    # --- checks ------------------------------------------------------------------------------

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step {step} outside 0..{self.num_steps - 1}")

    @staticmethod
    def _check_lane(lane: int, lanes: int) -> None:
        if lanes < 1 or not 0 <= lane < lanes:
            raise ValueError(f"lane {lane} outside 0..{lanes - 1}")


@functools.lru_cache(maxsize=64)
def shared_schedule(exchange: bool, count: int, world: int, rank: int, subchunk_elements: int,
                    breaks: tuple[int, ...] = ()) -> RingSchedule:
    """The (immutable) schedule of an op with these parameters, shared by every op that has
    them: a training loop reduces the same buffers every step, and building a schedule and its
    frame lists per op costs more than a small op's own work on the Trio path."""
    kind = ExchangeSchedule if exchange else RingSchedule
    return kind(count, world, rank, subchunk_elements, breaks)


def uses_exchange(world: int, nbytes: int, *, quantized: bool, max_bytes: int = EXCHANGE_MAX_BYTES) -> bool:
    """Whether an op runs as an :class:`ExchangeSchedule`: unquantized (quantized ops keep the
    ring, where only a chunk's owner quantizes its final values) and at most
    ``max_bytes`` (default :data:`EXCHANGE_MAX_BYTES`) sent per peer, which is
    ``(world - 1) * nbytes``: at most 256 KiB of input at two peers, 128 KiB at three, 85 KiB
    at four.  Only agreed parameters decide, so every peer chooses the same plan (``max_bytes``
    must be the same on every peer; 0 forces the ring for any non-empty op)."""
    return world >= 2 and not quantized and (world - 1) * nbytes <= max_bytes


class ExchangeSchedule(RingSchedule):
    """Small ops: every input travels around the ring to every peer, which reduces them all.

    An all-gather of the inputs followed by a local reduction: ``world - 1`` steps instead of
    the ring's ``2 (world - 1)``.  At two peers it is a plain exchange (recursive doubling with
    one round): each peer sends its whole input and receives the other's in one step.

    The same interface as :class:`RingSchedule`, where chunk ``c`` is *the input of ring
    position* ``c``, spanning the whole buffer: at step ``s`` the peer at position ``r`` sends
    input ``(r - s) mod N`` (its own at step 0, then whatever it received at step ``s - 1``) and
    receives input ``(r - s - 1) mod N`` — the reduce-scatter's formulas, so the frames pipeline
    sub-chunk by sub-chunk as the ring's do.  Inputs travel in their own dtype (f16/bf16 too:
    each peer widens all of them to f32 and rounds the result once, as the ring's owner does).
    Once sub-chunk ``k`` of every input is in, each peer folds ``x[0] op x[1] op …`` in ring
    order; to end bit-identical the peers must use that one order (MIN/MAX of +0 and -0) and
    make NaN results canonical (which payload a NaN sum keeps is up to the instruction), which
    :mod:`pccl.collectives.allreduce` does.

    Each peer sends ``(world - 1) * count`` elements where the ring sends
    ``2 (world - 1) / world * count``, and reduces the whole buffer instead of ``1 / world`` of
    it: worth it only while the trips cost more than the bytes (:func:`uses_exchange`).
    """

    __slots__ = ()

    def __init__(
        self, count: int, world: int, rank: int, subchunk_elements: int, breaks: Sequence[int] = ()
    ) -> None:
        super().__init__(count, world, rank, subchunk_elements, breaks)
        pieces = split_at_breaks(0, count, subchunk_elements, self.breaks)
        self.chunks = ((0, count),) * world
        self._subchunks = (pieces,) * world

    @property
    def num_steps(self) -> int:
        return self.world - 1

    def phase(self, step: int) -> Phase:
        self._check_step(step)
        return Phase.REDUCE_SCATTER

    @property
    def owned_chunk(self) -> int:
        """No chunk is owned: every peer computes the whole result.  Its own input."""
        return self.rank


# --- the other collectives: halves of the ring, and a chain --------------------------------------


class ReduceScatterSchedule(RingSchedule):
    """A reduce-scatter: the first half of the ring, shifted so that position ``r`` owns chunk ``r``.

    Chunks are :func:`chunk_bounds` (the first ``count % world`` one element longer).  At step
    ``s`` (``0 … world-2``) the peer at position ``r`` sends chunk ``(r - s - 1) mod N`` and
    receives chunk ``(r - s - 2) mod N``, reducing it into its accumulator; the chunk it receives
    at ``s`` is the one it sends at ``s + 1``.  After the last step it holds the complete
    reduction of chunk ``r`` (:attr:`owned_chunk`), folded starting at position ``r + 1`` and
    ending with its own contribution.  Sub-chunks and breaks as :class:`RingSchedule`.
    """

    __slots__ = ()

    @property
    def num_steps(self) -> int:
        return self.world - 1

    def phase(self, step: int) -> Phase:
        self._check_step(step)
        return Phase.REDUCE_SCATTER

    @property
    def owned_chunk(self) -> int:
        return self.rank

    def send_chunk(self, step: int) -> int:
        self._check_step(step)
        return (self.rank - step - 1) % self.world

    def recv_chunk(self, step: int) -> int:
        self._check_step(step)
        return (self.rank - step - 2) % self.world


def gather_bounds(counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The ``(start, stop)`` element range of every position's contribution in an all-gather's
    output: position ``p``'s at offset ``sum(counts[:p])``."""
    bounds = []
    start = 0
    for c in counts:
        if c < 0:
            raise ValueError(f"element counts must be non-negative, got {c}")
        bounds.append((start, start + c))
        start += c
    return tuple(bounds)


class AllGatherSchedule(RingSchedule):
    """An all-gather of contributions of any sizes: the second half of the ring.

    Chunk ``p`` is the contribution of ring position ``p``: ``counts[p]`` elements (0 allowed) at
    offset ``sum(counts[:p])`` of the output (:func:`gather_bounds`; without ``counts`` the
    :func:`chunk_bounds` of ``count``).  At step ``g`` (``0 … world-2``) the peer at position
    ``r`` sends chunk ``(r - g) mod N`` — its own at step 0, then what it received at ``g - 1``
    — and receives chunk ``(r - g - 1) mod N``, straight into the output, to forward it verbatim
    at ``g + 1``.  A chunk's frames are its sub-chunks (an empty chunk has none), so a step of
    an empty chunk moves nothing on that link.
    """

    __slots__ = ()

    def __init__(
        self, count: int, world: int, rank: int, subchunk_elements: int, breaks: Sequence[int] = (),
        *, counts: Sequence[int] | None = None,
    ) -> None:
        super().__init__(count, world, rank, subchunk_elements, breaks)
        if counts is not None:
            if len(counts) != world or sum(counts) != count:
                raise ValueError(f"counts {tuple(counts)} must be {world} sizes adding up to {count}")
            self.chunks = gather_bounds(counts)
            self._subchunks = tuple(split_at_breaks(a, b, subchunk_elements, self.breaks) for a, b in self.chunks)

    @property
    def num_steps(self) -> int:
        return self.world - 1

    def phase(self, step: int) -> Phase:
        self._check_step(step)
        return Phase.ALL_GATHER

    @property
    def owned_chunk(self) -> int:
        """Its own contribution: the chunk it sends first."""
        return self.rank

    def send_chunk(self, step: int) -> int:
        self._check_step(step)
        return (self.rank - step) % self.world

    def recv_chunk(self, step: int) -> int:
        self._check_step(step)
        return (self.rank - step - 1) % self.world


class BroadcastSchedule(RingSchedule):
    """A broadcast from ring position ``root``: a pipelined chain along the ring.

    The buffer is one chunk (chunk 0, all ``count`` elements), cut into sub-chunks.  The peer at
    distance ``d = (rank - root) mod N`` from the root receives every sub-chunk at step ``d - 1``
    and sends it on at step ``d``; the root (``d = 0``) sends at step 0 and receives nothing, the
    last peer (``d = N - 1``) sends nothing.  At every other step a peer moves nothing
    (:meth:`step_chunks` is empty there), so frame ``k`` it received at ``d - 1`` is what its
    frame ``k`` at ``d`` is made from, and the chain pipelines sub-chunk by sub-chunk: frame
    ``(d, k)`` leaves as soon as ``(d - 1, k)`` is in.
    """

    __slots__ = ("root",)

    def __init__(
        self, count: int, world: int, rank: int, subchunk_elements: int, breaks: Sequence[int] = (),
        *, root: int = 0,
    ) -> None:
        super().__init__(count, world, rank, subchunk_elements, breaks)
        if not 0 <= root < world:
            raise ValueError(f"root {root} outside a ring of {world}")
        self.root = root
        self.chunks = ((0, count),)
        self._subchunks = (split_at_breaks(0, count, subchunk_elements, self.breaks),)

    @property
    def num_steps(self) -> int:
        return self.world - 1

    @property
    def distance(self) -> int:
        """How many hops after the root this peer is."""
        return (self.rank - self.root) % self.world

    def phase(self, step: int) -> Phase:
        self._check_step(step)
        return Phase.ALL_GATHER

    @property
    def owned_chunk(self) -> int:
        return 0

    def send_chunk(self, step: int) -> int:
        self._check_step(step)
        return 0

    def recv_chunk(self, step: int) -> int:
        self._check_step(step)
        return 0

    def step_chunks(self, step: int, receiving: bool) -> tuple[int, ...]:
        self._check_step(step)
        active = self.distance - 1 if receiving else self.distance
        return (0,) if step == active else ()
