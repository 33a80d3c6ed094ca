"""Which algorithm an all-reduce runs, and who exchanges with whom in the halving-doubling family.

Pure functions of agreed parameters only (the buffer's size in bytes, the world, the dtype's
width, quantization, segmentation, and whether partner links exist): every peer of an op
computes the same answer, so no message is needed to agree on it.

The algorithms
--------------
``RING``
    The ring schedule of :mod:`pccl.protocol.ring` (or, for tiny ops at small worlds, its
    exchange schedule, which :func:`~pccl.protocol.ring.uses_exchange` picks): ``2 (N - 1)`` (or
    ``N - 1``) link latencies.
``RECURSIVE_DOUBLING``
    ``log2 P`` steps (``P`` the largest power of two ``<= N``); at step ``k`` each peer swaps
    its whole working buffer with the peer whose virtual rank differs in bit ``k``.
``HALVING_DOUBLING``
    Rabenseifner: a recursive-halving reduce-scatter (distance ``P/2`` down to 1, each step
    swapping half of what is left), then a recursive-doubling all-gather (distance 1 up to
    ``P/2``): ``2 log2 P`` steps, each peer sending ``2 (P - 1) / P`` of the buffer in all.
``HIERARCHICAL``
    Only when the master found sites (:mod:`pccl.protocol.sites`, ``ConnectToPeers.sites``)
    and they suit it (:func:`~pccl.protocol.sites.site_table`: ``S >= 2`` sites of at least two
    peers each; ``K`` the largest site's size): a reduce-scatter inside each site onto its
    peers (``K`` shards, every peer owning a run of one or more,
    :func:`site_shards`), an all-reduce of each shard across the sites (between the peers
    holding it), an all-gather inside each site; four
    steps, two of them across sites (:mod:`pccl.collectives.hierarchical`).  With sites known,
    the automatic choice takes it for every op it can run: every other algorithm crosses sites
    on most of its steps.

Non-powers of two: the standard fold.  With ``r = N - P`` extra peers, the peers at ring
positions ``0, 2, .., 2r - 2`` send their input to the next position (``1, 3, .., 2r - 1``)
first, take no part in the ``P``-peer algorithm, and receive the final result from that
partner last.  The others take virtual ranks ``0 .. P - 1`` in ring order
(:func:`virtual_rank`), so the reduction tree — and the bits of the result — depend on the
ring order and the algorithm only.

Choice (:func:`choose_all_reduce`): a cost model in "bytes a link moves in one latency"
(:data:`NOMINAL_LATENCY_BYTES`), each algorithm's steps times that plus the bytes it moves on its
critical path; halving-doubling's bytes count :data:`UNPIPELINED_PENALTY` times (a step
receives a whole block before reducing it, where the ring overlaps receiving, reducing and
sending sub-chunk by sub-chunk).  Ties go to the ring.  Quantized or segmented ops, worlds
below :data:`MIN_WORLD` and rings without partner links always take the ring, and so does an op
whose halving-doubling schedule would need a data frame over the wire's limit
(:data:`~pccl.protocol.codec.MAX_DATA_PAYLOAD`, just under 4 GiB; :func:`largest_frame`) — even
when an algorithm is forced: the family sends each step's range as one frame, where the ring's
chunks and sub-chunks stay far below it.  The constants
are nominal, not measured per run: a run on a network far from them may force an algorithm
(``Config.all_reduce_algorithm``).
"""

from __future__ import annotations

import enum
import functools

from .codec import MAX_DATA_PAYLOAD
from .sites import site_table

__all__ = [
    "AllReduceAlgorithm", "NOMINAL_LATENCY_BYTES", "UNPIPELINED_PENALTY", "MIN_WORLD", "HALVING_MAX_BYTES",
    "power_of_two_below", "virtual_rank", "position_of", "fold_partner", "partner_positions",
    "choose_all_reduce", "parse_algorithm", "wants_partner_links", "largest_frame", "site_partners",
    "site_shards", "link_partner_positions",
    "BroadcastAlgorithm", "TREE_SEGMENT_BYTES", "tree_segment_elements", "broadcast_tree", "broadcast_costs",
    "choose_broadcast",
]


class AllReduceAlgorithm(enum.Enum):
    """How an all-reduce moves its data (see the module docstring)."""

    RING = "ring"
    RECURSIVE_DOUBLING = "recursive_doubling"
    HALVING_DOUBLING = "halving_doubling"
    HIERARCHICAL = "hierarchical"


#: Bytes one link moves in the time of one link latency, nominally (5 ms at ~400 Mbit/s, 1 ms
#: at 2 Gbit/s): the exchange rate between steps and bytes in :func:`choose_all_reduce`.
NOMINAL_LATENCY_BYTES = 256 * 1024
#: How much more a byte of the halving-doubling family costs than a byte of the pipelined ring.
UNPIPELINED_PENALTY = 1.5
#: Below this world the automatic choice keeps the ring and no partner links are wired: the
#: ring's exchange takes ``N - 1 <= 6`` steps there, recursive doubling 2 to 4 (with the fold),
#: so at most a few link latencies are to be won, against a connection per partner per round.
MIN_WORLD = 8
#: Largest buffer the automatic choice gives the halving-doubling family (bytes); above it the
#: ring's lane threads and striping move bulk bytes faster on real TCP than one frame per step.
HALVING_MAX_BYTES = 64 * 1024 * 1024


def parse_algorithm(value: object) -> AllReduceAlgorithm | None:
    """``None`` for ``"auto"`` (or ``None``), else the algorithm named; ``ValueError`` otherwise."""
    if value is None or value == "auto":
        return None
    if isinstance(value, AllReduceAlgorithm):
        return value
    try:
        return AllReduceAlgorithm(value)
    except ValueError:
        names = ", ".join(repr(a.value) for a in AllReduceAlgorithm)
        raise ValueError(f"all-reduce algorithm must be 'auto' or one of {names}, got {value!r}") from None


def wants_partner_links(world: int, forced: AllReduceAlgorithm | None) -> bool:
    """Whether a ring of ``world`` peers is wired with partner links: whenever an all-reduce on
    it may take the halving-doubling family (never when the ring is forced)."""
    if forced is AllReduceAlgorithm.RING or world < 2:
        return False
    return forced is not None or world >= MIN_WORLD


def site_partners(position: int, sites: tuple[int, ...]) -> tuple[int, ...]:
    """The ring positions ``position`` exchanges with in the hierarchical all-reduce, ascending:
    the rest of its site and, in every other site, the peers owning a shard it owns too
    (:func:`site_shards`); ``()`` unless ``sites`` (a site per ring position) suit it
    (:func:`~pccl.protocol.sites.site_table`)."""
    table = site_table(sites)
    if table is None:
        return ()
    site = sites[position]
    lo, hi = site_shards(table, site, table[site].index(position))
    across = {p for t, members in enumerate(table) if t != site for r, p in enumerate(members)
              if _overlap((lo, hi), site_shards(table, t, r))}
    return tuple(sorted({p for p in table[site] if p != position} | across))


def site_shards(table: tuple[tuple[int, ...], ...], site: int, rank: int) -> tuple[int, int]:
    """The shards ``[first, stop)`` that rank ``rank`` of site ``site`` owns in the hierarchical
    all-reduce: ``K`` shards (``K`` the largest site's size), each site's ranks owning
    consecutive runs of them, one shard or more each (the first ``K % L`` runs one longer)."""
    shards, peers = max(len(t) for t in table), len(table[site])
    base, extra = divmod(shards, peers)
    first = rank * base + min(rank, extra)
    return first, first + base + (1 if rank < extra else 0)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def link_partner_positions(position: int, world: int, forced: AllReduceAlgorithm | None,
                           sites: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Every ring position ``position`` has a partner link to in a round (ascending): its
    halving-doubling partners when :func:`wants_partner_links`, and its :func:`site_partners`
    unless an algorithm other than ``HIERARCHICAL`` is forced."""
    out: set[int] = set()
    if wants_partner_links(world, forced) and forced is not AllReduceAlgorithm.HIERARCHICAL:
        out.update(partner_positions(position, world))
    if forced is None or forced is AllReduceAlgorithm.HIERARCHICAL:
        out.update(site_partners(position, sites))
    return tuple(sorted(out))


def power_of_two_below(world: int) -> int:
    """The largest power of two ``<= world`` (``world >= 1``)."""
    return 1 << (world.bit_length() - 1)


def virtual_rank(position: int, world: int) -> int | None:
    """The rank of ring ``position`` among the ``P`` peers that run the power-of-two algorithm;
    ``None`` for a peer that folds its input into its partner (see the module docstring)."""
    extra = world - power_of_two_below(world)
    if position < 2 * extra:
        return position // 2 if position % 2 else None
    return position - extra


def position_of(vrank: int, world: int) -> int:
    """The ring position of virtual rank ``vrank`` (the inverse of :func:`virtual_rank`)."""
    extra = world - power_of_two_below(world)
    return 2 * vrank + 1 if vrank < extra else vrank + extra


def fold_partner(position: int, world: int) -> int | None:
    """The peer ``position`` exchanges with in the fold (its input in, the result out), if any."""
    extra = world - power_of_two_below(world)
    if position >= 2 * extra:
        return None
    return position + 1 if position % 2 == 0 else position - 1


@functools.lru_cache(maxsize=256)
def partner_positions(position: int, world: int) -> tuple[int, ...]:
    """Every ring position ``position`` exchanges data with in either algorithm, ascending: the
    partner links a ring position needs (asked by every all-reduce: remembered)."""
    partners: set[int] = set()
    fold = fold_partner(position, world)
    if fold is not None:
        partners.add(fold)
    vrank = virtual_rank(position, world)
    if vrank is not None:
        size = power_of_two_below(world)
        distance = 1
        while distance < size:
            partners.add(position_of(vrank ^ distance, world))
            distance <<= 1
    return tuple(sorted(partners))


def _log2(size: int) -> int:
    return size.bit_length() - 1


def costs(nbytes: int, world: int, *, itemsize: int, acc_itemsize: int,
          exchange_max_bytes: int) -> dict[AllReduceAlgorithm, float]:
    """Each algorithm's nominal cost for an op of ``nbytes`` (see the module docstring), in bytes."""
    latency = NOMINAL_LATENCY_BYTES
    wide = nbytes * acc_itemsize / itemsize  # partial results travel in the accumulator's dtype
    ring: float
    if world >= 2 and (world - 1) * nbytes <= exchange_max_bytes:
        ring = (world - 1) * (latency + nbytes)
    else:
        ring = 2 * (world - 1) * latency + (world - 1) / world * (wide + nbytes)
    size = power_of_two_below(world)
    steps = _log2(size)
    fold = 0 if size == world else 1
    doubling = (steps + 2 * fold) * latency + UNPIPELINED_PENALTY * (steps * wide + fold * (wide + nbytes))
    halving = (2 * steps + 2 * fold) * latency + UNPIPELINED_PENALTY * (
        (size - 1) / size * (wide + nbytes) + fold * (wide + nbytes))
    return {AllReduceAlgorithm.RING: ring, AllReduceAlgorithm.RECURSIVE_DOUBLING: doubling,
            AllReduceAlgorithm.HALVING_DOUBLING: halving}


def largest_frame(nbytes: int, world: int, algorithm: AllReduceAlgorithm, *, itemsize: int,
                  acc_itemsize: int) -> int:
    """The payload of the largest data frame ``algorithm`` sends (bytes) for an all-reduce of
    ``nbytes`` on ``world >= 2`` peers, as :mod:`pccl.collectives.halving` frames it: one frame
    per step and partner.  Recursive doubling and the fold move the whole partial result (in the
    accumulator's dtype, ``acc_itemsize`` bytes an element); Rabenseifner's first step moves
    half of the blocks (the first ``count % P`` blocks one element longer), its other steps
    less.  ``RING``: 0 (its frames are chunks and sub-chunks, split below the limit)."""
    if algorithm is AllReduceAlgorithm.RING:
        return 0
    count = nbytes // itemsize
    wide = count * acc_itemsize
    if algorithm is AllReduceAlgorithm.HIERARCHICAL:
        return wide                          # at most: a site's shard, or the whole for sites of one
    size = power_of_two_below(world)
    if algorithm is AllReduceAlgorithm.RECURSIVE_DOUBLING or size != world:
        return wide
    base, extra = divmod(count, size)
    half = size // 2
    return (half * base + min(half, extra)) * acc_itemsize


def choose_all_reduce(nbytes: int, world: int, *, itemsize: int, acc_itemsize: int, quantized: bool,
                      segmented: bool, partner_links: bool, exchange_max_bytes: int,
                      forced: AllReduceAlgorithm | None = None, sites: tuple[int, ...] = (),
                      site_links: bool = False) -> AllReduceAlgorithm:
    """The algorithm an all-reduce of ``nbytes`` (the caller's buffer) runs on ``world`` peers.

    ``itemsize``/``acc_itemsize``: bytes per element of the buffer and of its accumulator (4
    for float16/bfloat16); ``partner_links``: whether the ring's links include the partner
    links :func:`partner_positions` names.  ``forced`` (every peer passes the same) wins
    whenever it can run: quantized and segmented ops, and rings without partner links, always
    take the ring, as do empty ops, worlds below 2 and ops whose :func:`largest_frame` in the
    forced algorithm would exceed :data:`~pccl.protocol.codec.MAX_DATA_PAYLOAD`.

    ``sites``: the site of each ring position (``ConnectToPeers.sites``, ``()`` unknown) and
    ``site_links``: whether the links include every :func:`site_partners` of this position.
    ``HIERARCHICAL`` runs when the sites suit it and are linked, chosen automatically then or
    forced; forced without such sites, the op takes the ring.
    """
    if quantized or segmented or world < 2 or nbytes == 0:
        return AllReduceAlgorithm.RING
    if forced in (None, AllReduceAlgorithm.HIERARCHICAL):
        hierarchical = site_links and len(sites) == world and site_table(sites) is not None and largest_frame(
            nbytes, world, AllReduceAlgorithm.HIERARCHICAL, itemsize=itemsize, acc_itemsize=acc_itemsize,
        ) <= MAX_DATA_PAYLOAD
        if hierarchical:
            return AllReduceAlgorithm.HIERARCHICAL
        if forced is not None:
            return AllReduceAlgorithm.RING
    if not partner_links:
        return AllReduceAlgorithm.RING
    if forced is not None:
        if largest_frame(nbytes, world, forced, itemsize=itemsize, acc_itemsize=acc_itemsize) > MAX_DATA_PAYLOAD:
            return AllReduceAlgorithm.RING
        return forced
    if world < MIN_WORLD or nbytes > HALVING_MAX_BYTES:
        return AllReduceAlgorithm.RING
    table = costs(nbytes, world, itemsize=itemsize, acc_itemsize=acc_itemsize, exchange_max_bytes=exchange_max_bytes)
    best = AllReduceAlgorithm.RING
    for algorithm in (AllReduceAlgorithm.RECURSIVE_DOUBLING, AllReduceAlgorithm.HALVING_DOUBLING):
        if table[algorithm] < table[best]:
            best = algorithm
    return best


# --- broadcast -----------------------------------------------------------------------------------


class BroadcastAlgorithm(enum.Enum):
    """How a broadcast moves its data (:func:`choose_broadcast`)."""

    #: The pipelined chain along the ring from the root (:class:`~pccl.protocol.ring.BroadcastSchedule`):
    #: ``N - 1`` hops, each link carrying the buffer once.
    CHAIN = "chain"
    #: A pipelined binomial tree over the partner links (:func:`broadcast_tree`): ``log2 P`` hops
    #: (one more on each side of the fold), the root sending the buffer ``log2 P`` times.
    TREE = "tree"
    #: A scatter (recursive halving from the root) then a recursive-doubling all-gather over the
    #: partner links (:func:`~pccl.protocol.scatter_gather.scatter_all_gather_plan`): ``2 log2 P``
    #: hops (one more on each side of the fold), no peer sending more than twice the buffer.
    SCATTER_ALL_GATHER = "scatter_all_gather"


#: Largest frame (bytes of payload) of the tree broadcast: the buffer travels in segments of this
#: size, each forwarded as soon as it is in, so the tree's hops overlap on large buffers.
TREE_SEGMENT_BYTES = 1 << 20


def tree_segment_elements(itemsize: int) -> int:
    """Elements per segment (frame) of the tree broadcast: :data:`TREE_SEGMENT_BYTES` of data."""
    return max(1, TREE_SEGMENT_BYTES // itemsize)


def broadcast_tree(position: int, world: int, root: int) -> tuple[tuple[int, int] | None, tuple[tuple[int, int], ...]]:
    """Ring position ``position``'s place in the tree broadcast from ring position ``root`` on
    ``world >= 2`` peers: ``(parent, step)`` it receives from (``None`` at the root) and the
    ``(child, step)`` it sends to, in send order.  Every edge is a partner link
    (:func:`partner_positions`).

    The binomial tree over the ``P`` virtual ranks, rooted at the root's virtual rank ``t`` (a
    folded root's is its fold partner's, which receives the buffer from it first, at step 0):
    with ``rel = v XOR t``, at step ``s = 1 .. log2 P`` (distance ``d = P >> s``) every peer
    with ``rel % 2d == 0`` sends to virtual rank ``v XOR d``.  At step ``log2 P + 1`` every
    peer with a folded partner sends it the buffer (except to the root).  ``ValueError`` for
    positions outside the ring."""
    if world < 2 or not 0 <= position < world or not 0 <= root < world:
        raise ValueError(f"position {position} / root {root} / world {world}: not a ring of 2+ peers")
    size = power_of_two_below(world)
    steps = _log2(size)

    def step_of(distance: int) -> int:
        return steps - _log2(distance)

    root_v = virtual_rank(root, world)
    root_folded = root_v is None
    if root_folded:
        fold = fold_partner(root, world)
        assert fold is not None
        root_v = virtual_rank(fold, world)
    assert root_v is not None
    v = virtual_rank(position, world)
    if v is None:  # a folded peer: the root itself (sends first), or it receives last
        partner = fold_partner(position, world)
        assert partner is not None
        if position == root:
            return None, ((partner, 0),)
        return (partner, steps + 1), ()
    rel = v ^ root_v
    parent: tuple[int, int] | None
    if rel == 0:
        parent = (root, 0) if root_folded else None
        low = size
    else:
        low = rel & -rel
        parent = (position_of(v ^ low, world), step_of(low))
    children = []
    distance = low >> 1
    while distance:
        children.append((position_of(v ^ distance, world), step_of(distance)))
        distance >>= 1
    fold = fold_partner(position, world)
    if fold is not None and fold != root:
        children.append((fold, steps + 1))
    return parent, tuple(children)


def broadcast_costs(nbytes: int, world: int) -> dict[BroadcastAlgorithm, float]:
    """Each broadcast algorithm's nominal cost for a buffer of ``nbytes`` on ``world >= 2``
    peers, in bytes (the unit of :func:`costs`): the chain ``(N - 1)`` latencies plus the
    buffer plus ``N - 2`` of its sub-chunks (a hop forwards a sub-chunk once it is whole); the
    tree its depth in latencies and segments plus ``log2 P`` buffers (its root sends the buffer
    to every child over one uplink); the scatter + all-gather ``2 log2 P`` latencies plus
    ``2 (P - 1) / P`` buffers (its steps do not overlap: a step sends what the previous one
    brought), and with the fold two more latencies and two more buffers (a folded root's
    buffer to its partner first, the whole result to each folded peer last; counted whatever
    the root, so the choice does not depend on it)."""
    latency = NOMINAL_LATENCY_BYTES
    size = power_of_two_below(world)
    steps = _log2(size)
    sub = min(4 << 20, max(64 * 1024, -(-nbytes // (2 * world))))  # the ring's sub-chunk (ring.py)
    chain = (world - 1) * latency + nbytes + max(0, world - 2) * min(sub, nbytes)
    fold = 2 if size != world else 0  # the fold in (a folded root) and out
    tree = (steps + fold) * (latency + min(nbytes, TREE_SEGMENT_BYTES)) + max(1, steps) * nbytes
    scatter = (2 * steps + fold) * latency + (2 * (size - 1) / size + fold) * nbytes
    return {BroadcastAlgorithm.CHAIN: chain, BroadcastAlgorithm.TREE: tree,
            BroadcastAlgorithm.SCATTER_ALL_GATHER: scatter}


def choose_broadcast(nbytes: int, world: int, *, quantized: bool, segmented: bool, partner_links: bool,
                     forced: BroadcastAlgorithm | None = None) -> BroadcastAlgorithm:
    """The algorithm a broadcast of ``nbytes`` runs on ``world`` peers: the cheapest of
    :func:`broadcast_costs` (ties to the chain, then the tree), or ``forced`` (every peer passes
    the same).  Quantized and segmented ops, rings without partner links and empty ops always
    take the chain; so does the automatic choice below :data:`MIN_WORLD` (where the chain has
    at most 6 hops and no partner links are wired).  The scatter + all-gather sends a run of
    blocks in frames of at most :data:`TREE_SEGMENT_BYTES`, so it has no frame limit to check."""
    if quantized or segmented or not partner_links or world < 2 or nbytes == 0:
        return BroadcastAlgorithm.CHAIN
    if forced is not None:
        return forced
    if world < MIN_WORLD:
        return BroadcastAlgorithm.CHAIN
    table = broadcast_costs(nbytes, world)
    best = BroadcastAlgorithm.CHAIN
    for algorithm in (BroadcastAlgorithm.TREE, BroadcastAlgorithm.SCATTER_ALL_GATHER):
        if table[algorithm] < table[best]:
            best = algorithm
    return best
