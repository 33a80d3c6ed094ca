"""Sites: which peers share a datacenter, from the master's link measurements (sans-IO).

Pure and deterministic: no I/O, no clock, no randomness.  The master runs :func:`find_sites`
over its link store (:mod:`pccl.protocol.master.link_store`) when it starts a topology round and
sends the answer with ``ConnectToPeers.sites`` (:func:`ring_sites`: a site index per ring
position), so every peer of the round holds the same sites without computing them.

The rule
--------
1. **Link cost.**  A measured directed link ``a -> b`` costs what a reference message of
   :data:`REFERENCE_BYTES` takes on it, ``rtt / 2 + REFERENCE_BYTES / bandwidth``, but never less
   than :data:`COST_FLOOR` (below it, differences are measurement noise: on one host every link
   costs the floor).  A pair ``{a, b}`` costs the smaller of its two directions: a probe
   disturbed in one direction (a fault, a burst of other traffic on a short probe) does not
   split a site, and links between datacenters are slow both ways.
2. **Unknown.**  If any pair lacks a measurement in either direction, or a probe of it failed
   (:data:`~pccl.protocol.topology.UNREACHABLE`), there are no sites (``None``): a newcomer not
   yet probed, or a link that could not be measured, never splits a site by accident.
3. **Single linkage.**  The merge heights of single-linkage clustering over the pair costs are
   the edge costs of a minimum spanning tree, ``h_1 <= .. <= h_{n-1}``.  The largest ratio
   between consecutive heights ``h_{k+1} / h_k`` is the gap between "inside a site" and "across
   sites"; ties go to the higher ``k`` (fewer, larger sites).  If that ratio is below
   :data:`SITE_RATIO` there are no sites (``None``: the links look alike).  Otherwise the sites
   are the connected components of the pairs costing at most ``h_k``.

Consequences (the property tests check them): every two peers of one site are joined by a chain
of links each costing at most ``h_k``; every pair across sites costs at least ``SITE_RATIO * h_k``;
the sites do not depend on peer ids (relabelling the peers relabels the sites); scaling every
cost above the floor by one factor changes nothing; at least two sites, and at least one site
of two peers or more.

Sites are named by their members (sorted peer ids), listed by their smallest member.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .topology import UNREACHABLE, Edge

__all__ = [
    "REFERENCE_BYTES", "COST_FLOOR", "SITE_RATIO", "link_cost", "find_sites", "ring_sites",
    "check_ring_sites", "site_table",
]

#: The message size the link cost is taken at: 1 MiB, where a 10 Gbit/s LAN link costs ~1 ms
#: and a 1 Gbit/s uplink ~8 ms plus its latency.
REFERENCE_BYTES = 1 << 20
#: Links costing less than this (seconds) count as equal: probe noise on fast links.
COST_FLOOR = 1e-3
#: The least gap between the dearest link inside a site and the cheapest across (a ratio).
SITE_RATIO = 4.0


def link_cost(edge: Edge) -> float:
    """What :data:`REFERENCE_BYTES` cost on ``edge`` (seconds), at least :data:`COST_FLOOR`."""
    return max(COST_FLOOR, edge.rtt / 2 + REFERENCE_BYTES / edge.bandwidth)


def _pair_costs(ids: list[int], edges: Mapping[tuple[int, int], Edge]) -> list[list[float]] | None:
    """The cost of every pair (the cheaper direction), ``None`` if any direction is unmeasured
    or unreachable.  One pass over ``edges`` fills the directed costs (a missing one stays
    ``inf``; an unreachable one is ``nan``, which no comparison passes)."""
    n = len(ids)
    index = {pid: i for i, pid in enumerate(ids)}
    directed = [[math.inf] * n for _ in range(n)]
    floor, ref = COST_FLOOR, REFERENCE_BYTES
    unreachable = (UNREACHABLE.bandwidth, UNREACHABLE.rtt)
    for (a, b), edge in edges.items():
        i, j = index.get(a), index.get(b)
        if i is None or j is None or i == j:
            continue
        if edge is UNREACHABLE or (edge.bandwidth, edge.rtt) == unreachable:
            directed[i][j] = math.nan
        else:
            c = edge.rtt / 2 + ref / edge.bandwidth
            directed[i][j] = c if c > floor else floor
    cost = [[0.0] * n for _ in range(n)]
    for i in range(n):
        row, out = cost[i], directed[i]
        for j in range(i + 1, n):
            there, back = out[j], directed[j][i]
            if not (there < math.inf and back < math.inf):      # missing (inf) or unreachable (nan)
                return None
            row[j] = cost[j][i] = there if there < back else back
    return cost


def _spanning_tree(cost: list[list[float]]) -> list[tuple[float, int, int]]:
    """Prim's minimum spanning tree from vertex 0 (ties to the lower index): ``(cost, i, j)``.

    ``O(n^2)`` over the dense matrix; the vertices outside the tree are kept in ascending order,
    so ``min`` (which keeps the first of equal keys) breaks ties to the lower index."""
    n = len(cost)
    best = [math.inf] * n
    via = [-1] * n
    best[0] = 0.0
    outside = list(range(n))
    tree: list[tuple[float, int, int]] = []
    while outside:
        v = min(outside, key=best.__getitem__)
        outside.remove(v)
        if via[v] >= 0:
            tree.append((best[v], via[v], v))
        row = cost[v]
        for u in outside:
            c = row[u]
            if c < best[u]:
                best[u] = c
                via[u] = v
    return tree


def find_sites(peers: Sequence[int], edges: Mapping[tuple[int, int], Edge], *,
               ratio: float = SITE_RATIO) -> tuple[tuple[int, ...], ...] | None:
    """The sites of ``peers`` under the rule above, or ``None`` (unknown, or no gap).

    ``edges`` maps ``(sender, receiver)`` to its measurement (other pairs are ignored).
    """
    if not ratio > 1 or not math.isfinite(ratio):
        raise ValueError(f"ratio must be finite and above 1, got {ratio!r}")
    ids = sorted(peers)
    if len(set(ids)) != len(ids):
        raise ValueError("peer ids must be distinct")
    if len(ids) < 3:
        return None
    cost = _pair_costs(ids, edges)
    if cost is None:
        return None
    tree = _spanning_tree(cost)
    heights = sorted(c for c, _, _ in tree)
    gap, cut = 0.0, -1
    for k in range(len(heights) - 1):
        g = heights[k + 1] / heights[k]
        if g >= gap:
            gap, cut = g, k
    if gap < ratio:
        return None
    threshold = heights[cut]
    # Two peers are joined by a chain of pairs costing at most the threshold exactly when the
    # spanning tree joins them by such a chain (a minimum spanning tree holds a minimax path
    # between every two vertices), so the tree's edges alone give the components.
    site = list(range(len(ids)))            # union-find over the tree edges within the threshold

    def root(i: int) -> int:
        while site[i] != i:
            site[i] = site[site[i]]
            i = site[i]
        return i

    for c, i, j in tree:
        if c <= threshold:
            a, b = root(i), root(j)
            if a != b:
                site[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i, pid in enumerate(ids):
        groups.setdefault(root(i), []).append(pid)
    return tuple(sorted(tuple(g) for g in groups.values()))


def ring_sites(ring: Sequence[int], sites: Sequence[Sequence[int]] | None) -> tuple[int, ...]:
    """The site index of each ring position, sites numbered in the order the ring first enters
    them (so position 0 is in site 0); ``()`` when ``sites`` is ``None`` or does not cover the
    ring exactly (what ``ConnectToPeers.sites`` carries)."""
    if sites is None:
        return ()
    site_of = {pid: k for k, members in enumerate(sites) for pid in members}
    if sorted(site_of) != sorted(ring) or len(site_of) != sum(len(s) for s in sites):
        return ()
    number: dict[int, int] = {}
    for pid in ring:
        number.setdefault(site_of[pid], len(number))
    return tuple(number[site_of[pid]] for pid in ring)


def check_ring_sites(ring: Sequence[int], sites: Sequence[int]) -> None:
    """``ValueError`` unless ``sites`` is ``()`` or a site index per position of ``ring`` numbered
    as :func:`ring_sites` numbers them (what a peer checks of the master's message)."""
    if not sites:
        return
    if len(sites) != len(ring):
        raise ValueError(f"{len(sites)} site indices for a ring of {len(ring)}")
    seen = -1
    for s in sites:
        if s > seen + 1 or s < 0:
            raise ValueError(f"site indices {tuple(sites)} are not numbered in ring order")
        seen = max(seen, s)


def site_table(sites: Sequence[int]) -> tuple[tuple[int, ...], ...] | None:
    """The ring positions of each site, if the sites suit the hierarchical all-reduce: at least
    two sites, each of at least two peers (sizes may differ); else ``None`` (the op takes the
    flat algorithms).  Each site's positions ascend (the ring's order inside the site)."""
    if not sites:
        return None
    count = max(sites) + 1
    positions: list[list[int]] = [[] for _ in range(count)]
    for pos, s in enumerate(sites):
        positions[s].append(pos)
    if count < 2 or any(len(p) < 2 for p in positions):
        return None
    return tuple(tuple(p) for p in positions)
