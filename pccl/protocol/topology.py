"""The ring solver: measured peer-to-peer links in, the best ring order per group out.

Pure and deterministic: no I/O, no clock, no randomness; the same measurements give the same
ring on every run (the simulator relies on it), and the heuristic's budget is counted in
candidate evaluations, not seconds.

Model.  A directed edge ``a -> b`` carries ``a``'s sends to its ring successor ``b``; its cost
is measured as a bandwidth (bytes/s) and a round-trip time (s), and ``a -> b`` need not equal
``b -> a``.  An edge nobody measured (or whose probe failed) is :data:`UNREACHABLE`: a very slow
edge, never an error, so a ring always exists.

A ring all-reduce of ``S`` bytes over ``N`` peers sends ``2 (N - 1)`` chunks of ``S / N`` bytes
along every ring edge at once, pipelined frame by frame, so (:func:`ring_time`)::

    T = 2 (N - 1) / N * S / min_e bw_e          the bottleneck edge paces every step
      + 2 (N - 1) / N * sum_e (rtt_e / 2 + F / bw_e)   one frame's trip through the pipeline

where ``F`` is one data frame.  The bottleneck term dominates large ops, so the solver first
maximises the bottleneck bandwidth ``B*``.  Measured bandwidths are noisy, so bottlenecks within
``tolerance`` of each other count as the same: among the rings whose every edge reaches
``(1 - tolerance) B*``, it takes the one with the least fill term ``sum_e (rtt_e / 2 + F / bw_e)``.
That is what makes a ring leave each datacenter once: every inter-site edge measures about the
same (the uplink), so all rings share the bottleneck, and each extra crossing adds an RTT.

Exact up to :data:`EXACT_LIMIT` peers: the bottleneck by a binary search over the measured
bandwidths with a Hamiltonian-cycle test (reachable end sets per subset, as bitmasks), then
Held-Karp dynamic programming over the admissible edges.  Above it: greedy construction from
every start, then Or-opt (segment moves) and 2-opt (segment reversals, re-costed since edges
are directed) local search, first improvement, within ``budget`` candidate evaluations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

__all__ = [
    "Edge",
    "UNREACHABLE",
    "EXACT_LIMIT",
    "DEFAULT_TOLERANCE",
    "DEFAULT_BUDGET",
    "RingSolution",
    "solve_ring",
    "ring_time",
    "ring_bottleneck",
    "fill_cost",
    "MAX_LANES",
    "lanes_for_link",
]


@dataclasses.dataclass(frozen=True)
class Edge:
    """One directed link as measured: ``bandwidth`` in bytes/s, ``rtt`` in seconds."""

    bandwidth: float
    rtt: float

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)):
            raise ValueError(f"bandwidth must be positive and finite, got {self.bandwidth!r}")
        if not (self.rtt >= 0 and math.isfinite(self.rtt)):
            raise ValueError(f"rtt must be non-negative and finite, got {self.rtt!r}")


#: A link that could not be measured: one kilobyte per second and a minute's round trip, slow
#: enough that any measured ring beats a ring using it, finite so rings still compare.
UNREACHABLE = Edge(bandwidth=1e3, rtt=60.0)
#: Largest group solved exactly (2^11 subsets x 12 ends: well under a second in Python).
EXACT_LIMIT = 12
#: Bottlenecks within this fraction of the best count as equal (probe noise is ~ a few %).
DEFAULT_TOLERANCE = 0.1
#: Candidate evaluations the heuristic may spend (each costs O(N)).
DEFAULT_BUDGET = 200_000
#: Frame size of the fill term: the data path's largest frame (``ring.DEFAULT_SUBCHUNK_BYTES``).
_FRAME_BYTES = 4 << 20


#: The most connections one ring edge may use (``Config.p2p_lanes``' range; every lane costs a
#: socket, a handshake slot and a frame queue on both ends).
MAX_LANES = 64
#: Lanes sized from the bandwidth-delay product alone reach it only if every connection's
#: window is full all the time; TCP's does not stay full (slow start, loss recovery), so
#: ``"auto"`` asks for a quarter more connections than the exact quotient.
_LANE_HEADROOM = 1.25


def lanes_for_link(bandwidth: float, rtt: float, window: int, *, probe_streams: int | None = None) -> int:
    """How many connections an edge of ``bandwidth`` (bytes/s) and ``rtt`` (s) needs so that
    one connection's ``window`` (bytes in flight, so at most ``window / rtt`` bytes/s each)
    does not cap it: the bandwidth-delay product over the window, with headroom, in
    ``[1, MAX_LANES]``.

    ``probe_streams``: the parallel streams the measurement used.  A figure at (90% of) what
    that many windows allow says only that the link is at least that fast, so it gets
    ``MAX_LANES``.
    """
    if not (bandwidth > 0 and math.isfinite(bandwidth)):
        raise ValueError(f"bandwidth must be positive and finite, got {bandwidth!r}")
    if not (rtt >= 0 and math.isfinite(rtt)):
        raise ValueError(f"rtt must be non-negative and finite, got {rtt!r}")
    if window <= 0:
        raise ValueError(f"window must be positive, got {window!r}")
    if rtt == 0:
        return 1
    if probe_streams is not None and bandwidth >= 0.9 * probe_streams * window / rtt:
        return MAX_LANES
    wanted = math.ceil(_LANE_HEADROOM * bandwidth * rtt / window)
    return max(1, min(MAX_LANES, wanted))


@dataclasses.dataclass(frozen=True)
class RingSolution:
    """A ring order (``order[i]`` sends to ``order[i + 1]``, the last to the first), its
    bottleneck bandwidth, its fill term, and whether it is proven optimal."""

    order: tuple[int, ...]
    bottleneck: float
    fill: float
    exact: bool


def _edge(edges: Mapping[tuple[int, int], Edge], a: int, b: int) -> Edge:
    return edges.get((a, b), UNREACHABLE)


def _ring_edges(order: Sequence[int]) -> list[tuple[int, int]]:
    n = len(order)
    if n < 2:
        return []
    return [(order[i], order[(i + 1) % n]) for i in range(n)]


def ring_bottleneck(order: Sequence[int], edges: Mapping[tuple[int, int], Edge]) -> float:
    """The slowest edge's bandwidth along ``order`` (infinite for a ring of one)."""
    return min((_edge(edges, a, b).bandwidth for a, b in _ring_edges(order)), default=math.inf)


def fill_cost(order: Sequence[int], edges: Mapping[tuple[int, int], Edge],
              frame_bytes: int = _FRAME_BYTES) -> float:
    """``sum_e (rtt_e / 2 + frame / bw_e)`` along ``order``: the pipeline's fill time per lap."""
    total = 0.0
    for a, b in _ring_edges(order):
        e = _edge(edges, a, b)
        total += e.rtt / 2 + frame_bytes / e.bandwidth
    return total


def ring_time(order: Sequence[int], edges: Mapping[tuple[int, int], Edge], nbytes: int,
              frame_bytes: int = _FRAME_BYTES) -> float:
    """The model's time of a ring all-reduce of ``nbytes`` along ``order`` (seconds)."""
    n = len(order)
    if n < 2:
        return 0.0
    laps = 2 * (n - 1) / n
    return laps * nbytes / ring_bottleneck(order, edges) + laps * fill_cost(order, edges, frame_bytes)


def solve_ring(
    peers: Sequence[int],
    edges: Mapping[tuple[int, int], Edge],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
    exact_limit: int = EXACT_LIMIT,
    budget: int = DEFAULT_BUDGET,
    frame_bytes: int = _FRAME_BYTES,
    start: Sequence[int] | None = None,
) -> RingSolution:
    """The best ring over ``peers`` under the model above.

    ``edges`` maps ``(sender, receiver)`` to its measurement; missing pairs are
    :data:`UNREACHABLE`.  ``start`` (an order of the same peers, e.g. the current ring) seeds
    the heuristic, so background improvement never returns a worse ring than it was given.
    The result starts at the smallest peer id (rotations are the same ring).
    """
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    ids = sorted(peers)
    if len(set(ids)) != len(ids):
        raise ValueError("peer ids must be distinct")
    if start is not None and sorted(start) != ids:
        raise ValueError("start must be an order of the same peers")
    n = len(ids)
    if n <= 2:
        order = tuple(ids)
        return RingSolution(order, ring_bottleneck(order, edges), fill_cost(order, edges, frame_bytes), True)
    bw = [[_edge(edges, a, b).bandwidth if a != b else 0.0 for b in ids] for a in ids]
    w = [[_edge(edges, a, b).rtt / 2 + frame_bytes / _edge(edges, a, b).bandwidth for b in ids] for a in ids]
    if n <= exact_limit:
        best = _best_bottleneck(bw)
        idx = _held_karp(w, bw, best * (1 - tolerance))
        exact = True
    else:
        seed_idx = [ids.index(p) for p in start] if start is not None else None
        idx = _heuristic(w, bw, tolerance, budget, seed_idx)
        exact = False
    order = _canonical(tuple(ids[i] for i in idx))
    return RingSolution(order, ring_bottleneck(order, edges), fill_cost(order, edges, frame_bytes), exact)


def _canonical(order: tuple[int, ...]) -> tuple[int, ...]:
    k = order.index(min(order))
    return order[k:] + order[:k]


# -- exact ---------------------------------------------------------------------------------

def _has_cycle(bw: list[list[float]], threshold: float) -> bool:
    """Whether a Hamiltonian cycle uses only edges of at least ``threshold``.

    Paths start at vertex 0; ``ends[mask]`` is the bitmask of vertices a path covering exactly
    ``mask`` (bit 0 always set) can end at.
    """
    n = len(bw)
    out = [sum(1 << j for j in range(n) if j != i and bw[i][j] >= threshold) for i in range(n)]
    full = (1 << n) - 1
    ends = [0] * (1 << n)
    ends[1] = 1
    for mask in range(1, full + 1, 2):
        e = ends[mask]
        if not e:
            continue
        nxt = 0
        while e:
            v = (e & -e).bit_length() - 1
            e &= e - 1
            nxt |= out[v]
        nxt &= ~mask
        while nxt:
            bit = nxt & -nxt
            nxt &= nxt - 1
            ends[mask | bit] |= bit
    e = ends[full]
    while e:
        v = (e & -e).bit_length() - 1
        e &= e - 1
        if bw[v][0] >= threshold:
            return True
    return False


def _best_bottleneck(bw: list[list[float]]) -> float:
    """The largest bottleneck of any Hamiltonian cycle (a binary search over edge values)."""
    values = _bottleneck_candidates(bw)
    lo, hi = 0, len(values) - 1          # values[0] works: the graph is complete
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _has_cycle(bw, values[mid]):
            lo = mid
        else:
            hi = mid - 1
    return values[lo]


def _held_karp(w: list[list[float]], bw: list[list[float]], threshold: float) -> list[int]:
    """The cycle of least total ``w`` using only edges whose bandwidth reaches ``threshold``."""
    n = len(w)
    inf = math.inf
    size = 1 << (n - 1)               # subsets of vertices 1..n-1; vertex 0 is the start
    cost = [[inf] * n for _ in range(size)]
    parent = [[-1] * n for _ in range(size)]
    for j in range(1, n):
        if bw[0][j] >= threshold:
            cost[1 << (j - 1)][j] = w[0][j]
            parent[1 << (j - 1)][j] = 0
    for mask in range(1, size):
        row = cost[mask]
        for j in range(1, n):
            c = row[j]
            if c == inf:
                continue
            wj = w[j]
            bj = bw[j]
            for k in range(1, n):
                bit = 1 << (k - 1)
                if mask & bit or bj[k] < threshold:
                    continue
                c2 = c + wj[k]
                m2 = mask | bit
                if c2 < cost[m2][k]:
                    cost[m2][k] = c2
                    parent[m2][k] = j
    full = size - 1
    best_end, best = -1, inf
    for j in range(1, n):
        if bw[j][0] >= threshold and cost[full][j] + w[j][0] < best:
            best, best_end = cost[full][j] + w[j][0], j
    assert best_end >= 0, "threshold admits no cycle"
    path = []
    mask, j = full, best_end
    while j != 0:
        path.append(j)
        j, mask = parent[mask][j], mask & ~(1 << (j - 1))
    path.append(0)
    return path[::-1]


# -- heuristic -----------------------------------------------------------------------------

class _Search:
    """First-improvement local search on ``(edges below threshold, sum of w)``, counting
    every candidate it evaluates against the budget."""

    def __init__(self, w: list[list[float]], bw: list[list[float]], budget: int) -> None:
        self.w, self.bw, self.left = w, bw, budget

    def key(self, tour: list[int], threshold: float) -> tuple[int, float]:
        self.left -= 1
        n = len(tour)
        below, total = 0, 0.0
        for i in range(n):
            a, b = tour[i], tour[(i + 1) % n]
            if self.bw[a][b] < threshold:
                below += 1
            total += self.w[a][b]
        return below, total

    def greedy(self, start: int, threshold: float) -> list[int]:
        n = len(self.w)
        self.left -= n                  # n^2 work: as much as n candidate evaluations
        tour, free = [start], [v for v in range(n) if v != start]
        while free:
            a = tour[-1]
            b = min(free, key=lambda j: (self.bw[a][j] < threshold, self.w[a][j]))
            tour.append(b)
            free.remove(b)
        return tour

    def improve(self, tour: list[int], threshold: float) -> tuple[list[int], tuple[int, float]]:
        best = self.key(tour, threshold)
        while self.left > 0:
            for cand in _neighbours(tour):
                k = self.key(cand, threshold)
                if k < best:
                    tour, best = cand, k
                    break
                if self.left <= 0:
                    return tour, best
            else:
                return tour, best           # a local optimum
        return tour, best

    def best_tour(self, threshold: float, seeds: list[list[int]]) -> tuple[list[int], tuple[int, float]]:
        best_tour, best_key = seeds[0], self.key(seeds[0], threshold)
        candidates = iter(list(seeds) + list(range(len(self.w))))
        for candidate in candidates:
            if self.left <= 0:
                break
            tour = self.greedy(candidate, threshold) if isinstance(candidate, int) else candidate
            tour, k = self.improve(tour, threshold)
            if k < best_key:
                best_tour, best_key = tour, k
        return best_tour, best_key


def _neighbours(tour: list[int]) -> Iterator[list[int]]:
    """Or-opt moves (a segment of 1-3 peers moved elsewhere, direction kept), then 2-opt moves
    (a segment reversed: its edges change direction, so the caller re-costs it whole)."""
    n = len(tour)
    for seg in (1, 2, 3):
        for i in range(n - seg + 1):
            rest = tour[:i] + tour[i + seg:]
            piece = tour[i:i + seg]
            for j in range(len(rest) + 1):
                if j != i:
                    yield rest[:j] + piece + rest[j:]
    for i in range(1, n - 1):
        for j in range(i + 1, n):
            yield tour[:i] + tour[i:j + 1][::-1] + tour[j + 1:]


def _bottleneck_candidates(bw: list[list[float]]) -> list[float]:
    """The edge values a ring's bottleneck can take, ascending: every vertex needs an out- and
    an in-edge, so nothing above the weakest vertex's best one."""
    n = len(bw)
    cap = min(min(max(bw[i][j] for j in range(n) if j != i) for i in range(n)),
              min(max(bw[j][i] for j in range(n) if j != i) for i in range(n)))
    return sorted({bw[i][j] for i in range(n) for j in range(n) if i != j and bw[i][j] <= cap})


def _heuristic(w: list[list[float]], bw: list[list[float]], tolerance: float, budget: int,
               start: list[int] | None) -> list[int]:
    n = len(w)
    search = _Search(w, bw, 0)
    seeds = [list(start)] if start is not None else [list(range(n))]
    remaining = budget

    def run(threshold: float, allowance: int) -> tuple[list[int], tuple[int, float]]:
        nonlocal remaining
        search.left = min(allowance, remaining)
        given = search.left
        result = search.best_tour(threshold, seeds)
        remaining -= given - max(0, search.left)
        return result

    # The bottleneck: a binary search over edge values for the largest one the local search
    # can meet with no edge below it; half the budget, shared between its steps.
    values = _bottleneck_candidates(bw)
    # Never below what the seed already has (a ring's bottleneck is at most ``cap``).
    lo, hi = values.index(min(bw[a][b] for a, b in zip(seeds[0], seeds[0][1:] + seeds[0][:1]))), len(values) - 1
    share = max(1, budget // (2 * max(1, math.ceil(math.log2(len(values) + 1)))))
    while lo < hi and remaining > 0:
        mid = (lo + hi + 1) // 2
        tour, (below, _) = run(values[mid], share)
        if below == 0:
            lo = mid
            seeds = [tour]
        else:
            hi = mid - 1
    tour, _ = run(values[lo] * (1 - tolerance), remaining)
    return tour
