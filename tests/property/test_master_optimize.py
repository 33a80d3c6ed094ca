"""The master's optimise vote: probes asked for the missing links only, measurements kept while
both ends stay, the solved ring installed by a group round and kept by later rounds; and, mixed
into the master's full state machine, no optimise vote ever gets stuck."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, precondition, rule

from pccl.errors import KickReason
from pccl.protocol import messages as m
from pccl.protocol.master.machine import GLOBAL_SCOPE, PeerStatus, TopologyVote
from pccl.protocol.topology import fill_cost, Edge

from test_master_state import Harness, MasterMachine, accepted_cluster, peer_id_of_conn

GB = 1e9 / 8


def open_probe(h: Harness, conn: int) -> m.ProbeRequest | None:
    """The probe request ``conn`` has not answered yet, if any."""
    req = h.last(conn, m.ProbeRequest)
    if req is None or conn in h.gone:
        return None
    answered = getattr(h, "answered", set())
    return None if (conn, req.probe) in answered else req


def answer(h: Harness, conn: int, bandwidth=lambda a, b: GB, rtt=lambda a, b: 0.01) -> m.ProbeRequest:
    req = open_probe(h, conn)
    assert req is not None
    me = peer_id_of_conn(h, conn)
    results = tuple(m.ProbeResult(t.peer_id, bandwidth(me, t.peer_id), rtt(me, t.peer_id)) for t in req.targets)
    h.send(conn, m.ProbeReport(req.probe, results))
    if not hasattr(h, "answered"):
        h.answered = set()
    h.answered.add((conn, req.probe))
    return req


def optimise(h: Harness, conns: list[int], **links) -> dict[int, m.ProbeRequest]:
    for c in conns:
        h.send(c, m.VoteOptimize())
    asked = {c: answer(h, c, **links) for c in conns if open_probe(h, c) is not None}
    h.settle_rounds()
    return asked


def two_sites(h: Harness, conns: list[int]):
    """Peers alternate between two sites: fast inside, a slow uplink with 40 ms between."""
    site = {pid: i % 2 for i, pid in enumerate(sorted(peer_id_of_conn(h, c) for c in conns))}  # id order alternates
    bandwidth = lambda a, b: 10 * GB if site[a] == site[b] else GB   # noqa: E731
    rtt = lambda a, b: 0.0002 if site[a] == site[b] else 0.04        # noqa: E731
    return site, dict(bandwidth=bandwidth, rtt=rtt)


def crossings(ring, site):
    return sum(site[ring[i]] != site[ring[(i + 1) % len(ring)]] for i in range(len(ring)))


def test_optimise_probes_every_missing_link_then_installs_the_solved_ring():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0, 0])
    site, links = two_sites(h, conns)
    assert crossings(h.ms.rings()[0], site) == 4          # the join ring (id order) alternates
    asked = optimise(h, conns, **links)
    # Each peer was asked for the three others, in tournament waves.
    assert all(len(req.targets) == 3 for req in asked.values())
    ring = h.ms.rings()[0]
    assert crossings(ring, site) == 2
    for c in conns:
        done = h.last(c, m.TopologyComplete)
        assert tuple(e.peer_id for e in done.ring) == ring
        assert h.info(c).topology_vote is None
    assert len(h.ms.measured_links()) == 12
    # The round carries the two sites the probes show, numbered along the ring (none before).
    expected = tuple(0 if site[pid] == site[ring[0]] else 1 for pid in ring)
    assert {h.last(c, m.ConnectToPeers).sites for c in conns} == {expected}


def test_measurements_are_kept_so_a_newcomer_costs_only_its_own_links():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0])
    optimise(h, conns)
    newcomer = h.join(0)
    for c in conns:
        h.send(c, m.VoteTopology(True))
    h.settle_rounds()
    everyone = conns + [newcomer]
    asked = optimise(h, everyone)
    new_id = peer_id_of_conn(h, newcomer)
    assert [t.peer_id for t in asked[newcomer].targets] and len(asked[newcomer].targets) == 3
    for c in conns:
        assert [t.peer_id for t in asked[c].targets] == [new_id]   # only the link to the newcomer
    # A second optimisation with nothing missing asks for no probes at all.
    again = optimise(h, everyone)
    assert all(req.targets == () for req in again.values())


def test_a_leaver_takes_its_links_with_it_and_the_ring_keeps_its_order():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0, 0, 0, 0])
    site, links = two_sites(h, conns)
    optimise(h, conns, **links)
    ring = h.ms.rings()[0]
    assert crossings(ring, site) == 2
    gone = conns[2]
    gone_id = peer_id_of_conn(h, gone)
    h.kill(gone)
    assert not any(gone_id in k for k in h.ms.measured_links())
    survivors = [c for c in conns if c != gone]
    for c in survivors:
        h.send(c, m.VoteTopology(False))
    h.settle_rounds()
    assert h.ms.rings()[0] == tuple(p for p in ring if p != gone_id)


def test_a_failed_probe_is_a_slow_link_and_is_probed_again():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0])
    ids = [peer_id_of_conn(h, c) for c in conns]
    dead_link = (ids[0], ids[1])
    optimise(h, conns, bandwidth=lambda a, b: 0.0 if (a, b) == dead_link else GB)
    ring = h.ms.rings()[0]
    # The ring avoids the failed direction: ids[0] does not send to ids[1].
    assert ring[(ring.index(ids[0]) + 1) % 3] != ids[1]
    assert dead_link not in h.ms.measured_links()
    again = optimise(h, conns)
    assert [t.peer_id for t in again[conns[0]].targets] == [ids[1]]


def test_a_peer_dying_mid_probe_is_removed_and_the_others_finish():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0])
    for c in conns:
        h.send(c, m.VoteOptimize())
    answer(h, conns[0])
    h.kill(conns[1])
    assert h.ms.probing_groups() == frozenset({0})
    answer(h, conns[2])
    h.settle_rounds()
    assert not h.ms.probing_groups()
    assert sorted(h.ms.rings()[0]) == sorted(peer_id_of_conn(h, c) for c in (conns[0], conns[2]))
    assert h.last(conns[0], m.TopologyComplete).membership.world_size == 2


def test_bad_probe_reports_are_kicked():
    h = Harness()
    conns = accepted_cluster(h, [0, 0, 0])
    for c in conns:
        h.send(c, m.VoteOptimize())
    req = open_probe(h, conns[0])
    h.send(conns[0], m.ProbeReport(req.probe, ()))                      # misses its targets
    assert h.kicks.get(conns[0]) is KickReason.PROTOCOL_ERROR
    h.send(conns[1], m.ProbeReport(req.probe + 7, ()))                  # a probe never asked
    assert h.kicks.get(conns[1]) is KickReason.OUT_OF_PHASE
    answer(h, conns[2])
    h.settle_rounds()
    assert h.ms.rings()[0] == (peer_id_of_conn(h, conns[2]),)


def test_optimise_and_update_topology_in_one_group_is_a_phase_mismatch():
    h = Harness()
    conns = accepted_cluster(h, [0, 0])
    h.send(conns[0], m.VoteOptimize())
    h.send(conns[1], m.VoteTopology(True))
    h.advance(h.ms.mismatch_grace * 2)
    assert h.last(conns[0], m.TopologyRejected) is not None
    assert h.last(conns[1], m.TopologyRejected) is not None
    assert all(h.info(c).topology_vote is None for c in conns)


def test_collective_during_optimise_is_out_of_phase():
    h = Harness()
    conns = accepted_cluster(h, [0, 0])
    h.send(conns[0], m.VoteOptimize())
    h.send(conns[0], m.CollectiveInit(0, 8, 0, 0, 0, 0))
    assert h.kicks.get(conns[0]) is KickReason.OUT_OF_PHASE


class OptimiseMachine(MasterMachine):
    """The master's state machine with optimise votes and probe reports mixed in."""

    @precondition(lambda self: self.h.accepted())
    @rule(i=st.integers(0, 10))
    def vote_optimize(self, i: int) -> None:
        c = self.pick(self.h.accepted(), i)
        info = self.h.info(c)
        busy = any(self.h.ms.peer_id_of(c) in (op.voters | set(op.participants)) for op in self.h.ms.ops())
        self.h.send(c, m.VoteOptimize())
        if info.topology_vote is not None or info.in_round or busy:
            assert self.h.kicks.get(c) is KickReason.OUT_OF_PHASE

    @precondition(lambda self: any(open_probe(self.h, c) for c in self.h.accepted()))
    @rule(i=st.integers(0, 10), bandwidth=st.sampled_from([0.0, 1e6, 1e8, 1e9]))
    def report_probe(self, i: int, bandwidth: float) -> None:
        waiting = [c for c in self.h.accepted() if open_probe(self.h, c)]
        answer(self.h, self.pick(waiting, i), bandwidth=lambda a, b: bandwidth)

    @rule(group=st.sampled_from([0, 1]))
    def group_optimises(self, group: int) -> None:
        for c in self.h.accepted():
            info = self.h.info(c)
            if info.group == group and info.topology_vote is None and not info.in_round and not any(
                    info.peer_id in (op.voters | set(op.participants)) for op in self.h.ms.ops()) \
                    and not any(s for s in self.h.ms.syncs()):
                self.h.send(c, m.VoteOptimize())

    @invariant()
    def optimise_never_stuck(self) -> None:
        ms = self.h.ms
        rounds = ms.rounds_in_progress()
        acc = [p for p in ms.peers() if p.status is PeerStatus.ACCEPTED]
        for g in {p.group for p in acc}:
            mem = [p for p in acc if p.group == g]
            if g in ms.probing_groups():
                targets, reports = ms.probes()[g]
                live = [pid for pid in targets if ms.conn_of(pid) is not None]
                assert not all(pid in reports for pid in live), f"optimise of group {g} stuck after reports"
            elif GLOBAL_SCOPE not in rounds and g not in rounds:
                assert not all(p.topology_vote is TopologyVote.OPTIMIZE for p in mem), f"optimise vote of {g} stuck"
        for g in ms.probing_groups():
            assert all(p.topology_vote is TopologyVote.OPTIMIZE for p in acc if p.group == g)


OptimiseMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_master_with_optimise = OptimiseMachine.TestCase
