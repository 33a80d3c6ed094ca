"""The ring solver against brute force, and on the datacenter layouts it exists for."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.protocol.topology import (
    DEFAULT_TOLERANCE,
    UNREACHABLE,
    Edge,
    fill_cost,
    ring_bottleneck,
    ring_time,
    solve_ring,
)

GBIT = 1e9 / 8


def brute_force(peers, edges, tolerance=DEFAULT_TOLERANCE):
    """(best bottleneck, least fill among rings within tolerance of it), over every ring."""
    first, rest = peers[0], peers[1:]
    rings = [(first, *p) for p in itertools.permutations(rest)]
    best = max(ring_bottleneck(r, edges) for r in rings)
    fill = min(fill_cost(r, edges) for r in rings if ring_bottleneck(r, edges) >= best * (1 - tolerance))
    return best, fill


@st.composite
def matrices(draw, max_peers=8):
    n = draw(st.integers(2, max_peers))
    peers = sorted(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n, unique=True)))
    # Few distinct values make ties (the interesting case); some pairs stay unmeasured.
    bandwidth = st.sampled_from([1e6, 5e6, 1e7, 1.05e7, 1.2e7, 1e8, 1e9])
    rtt = st.sampled_from([0.0, 0.001, 0.03, 0.08])
    edges = {}
    for a in peers:
        for b in peers:
            if a != b and draw(st.integers(0, 9)) != 0:
                edges[(a, b)] = Edge(draw(bandwidth), draw(rtt))
    return peers, edges


def assert_is_ring(order, peers):
    assert sorted(order) == sorted(peers)
    assert order[0] == min(peers)


@settings(max_examples=300, deadline=None)
@given(matrices())
def test_exact_solver_matches_brute_force(case):
    peers, edges = case
    solution = solve_ring(peers, edges)
    assert_is_ring(solution.order, peers)
    assert solution.exact
    best, fill = brute_force(peers, edges)
    assert solution.bottleneck >= best * (1 - DEFAULT_TOLERANCE)
    assert solution.bottleneck == ring_bottleneck(solution.order, edges)
    assert math.isclose(solution.fill, fill, rel_tol=1e-9)
    assert math.isclose(fill_cost(solution.order, edges), fill, rel_tol=1e-9)


@settings(max_examples=150, deadline=None)
@given(matrices(), st.sampled_from([0.0, 0.3]))
def test_tolerance_is_the_bottleneck_band(case, tolerance):
    peers, edges = case
    solution = solve_ring(peers, edges, tolerance=tolerance)
    best, fill = brute_force(peers, edges, tolerance)
    if tolerance == 0.0:
        assert solution.bottleneck == best
    assert math.isclose(solution.fill, fill, rel_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(matrices(max_peers=7), st.integers(200, 5000))
def test_heuristic_returns_a_ring_no_worse_than_its_start(case, budget):
    peers, edges = case
    start = list(reversed(peers))
    solution = solve_ring(peers, edges, exact_limit=0, budget=budget, start=start)
    assert_is_ring(solution.order, peers)
    assert not solution.exact or len(peers) <= 2
    start_bottleneck = ring_bottleneck(start, edges)
    assert solution.bottleneck >= start_bottleneck * (1 - DEFAULT_TOLERANCE)
    best, _ = brute_force(peers, edges)
    assert solution.bottleneck <= best


def test_solver_is_deterministic():
    rng = random.Random(7)
    peers = list(range(20))
    edges = {(a, b): Edge(rng.uniform(1e6, 1e9), rng.uniform(0, 0.1)) for a in peers for b in peers if a != b}
    first = solve_ring(peers, edges, budget=20_000)
    again = solve_ring(list(reversed(peers)), dict(reversed(list(edges.items()))), budget=20_000)
    assert first == again
    assert not first.exact


def sites_layout(sites, per_site, rng, noise=0.04):
    """Peers in datacenters: 10 Gbit/s inside a site; between sites, what a 1 Gbit/s uplink
    lets one pair measure, with 30-80 ms RTT per site pair; measurements a few % noisy."""
    site_of = {}
    ids = rng.sample(range(100, 1000), sites * per_site)   # join order is random
    for k, p in enumerate(ids):
        site_of[p] = k % sites
    site_rtt = {}
    for s in range(sites):
        for t in range(sites):
            if s < t:
                site_rtt[(s, t)] = site_rtt[(t, s)] = rng.uniform(0.03, 0.08)
    edges = {}
    for a in ids:
        for b in ids:
            if a == b:
                continue
            jitter = rng.uniform(1 - noise, 1 + noise)
            if site_of[a] == site_of[b]:
                edges[(a, b)] = Edge(10 * GBIT * jitter, 0.0005)
            else:
                edges[(a, b)] = Edge(1 * GBIT * jitter, site_rtt[(site_of[a], site_of[b])])
    return ids, edges, site_of


def crossings(order, site_of):
    return sum(site_of[order[i]] != site_of[order[(i + 1) % len(order)]] for i in range(len(order)))


@pytest.mark.parametrize("seed", range(5))
def test_three_sites_of_four_leave_each_site_once(seed):
    rng = random.Random(seed)
    ids, edges, site_of = sites_layout(3, 4, rng)
    join_order = tuple(ids)
    solution = solve_ring(ids, edges)
    assert solution.exact
    assert crossings(solution.order, site_of) == 3
    assert crossings(join_order, site_of) > 3       # the random join order scatters the sites
    assert ring_time(solution.order, edges, 256 << 20) < ring_time(join_order, edges, 256 << 20)


@pytest.mark.parametrize("seed", range(3))
def test_heuristic_on_five_sites_of_four_leaves_each_site_once(seed):
    rng = random.Random(100 + seed)
    ids, edges, site_of = sites_layout(5, 4, rng)
    solution = solve_ring(ids, edges)
    assert not solution.exact
    assert crossings(solution.order, site_of) == 5


def test_missing_edges_are_very_slow_not_errors():
    peers = [1, 2, 3, 4]
    # Only one direction of the ring 1 -> 2 -> 3 -> 4 -> 1 was measured.
    edges = {(1, 2): Edge(1e8, 0.001), (2, 3): Edge(1e8, 0.001), (3, 4): Edge(1e8, 0.001), (4, 1): Edge(1e8, 0.001)}
    solution = solve_ring(peers, edges)
    assert solution.order == (1, 2, 3, 4)
    assert solution.bottleneck == 1e8
    lonely = solve_ring(peers, {})
    assert lonely.bottleneck == UNREACHABLE.bandwidth


def test_small_groups_and_bad_input():
    assert solve_ring([5], {}).order == (5,)
    assert solve_ring([9, 3], {}).order == (3, 9)
    with pytest.raises(ValueError):
        solve_ring([1, 1, 2], {})
    with pytest.raises(ValueError):
        solve_ring([1, 2, 3], {}, start=[1, 2])
    with pytest.raises(ValueError):
        solve_ring([1, 2, 3], {}, tolerance=1.0)
    with pytest.raises(ValueError):
        Edge(0.0, 0.01)
    with pytest.raises(ValueError):
        Edge(1e6, float("nan"))


def test_twelve_peers_is_exact():
    rng = random.Random(3)
    ids, edges, site_of = sites_layout(4, 3, rng)
    solution = solve_ring(ids, edges)
    assert solution.exact and len(solution.order) == 12
    assert crossings(solution.order, site_of) == 4
