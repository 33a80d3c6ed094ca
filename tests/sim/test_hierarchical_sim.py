"""The hierarchical all-reduce in the simulator: peers in three sites optimise their topology,
the master finds the sites from the probes, and the production peer runs its all-reduces across
sites hierarchically over the site partner links; a peer killed inside such an op makes every
survivor abort and restore its input, and the retry on the survivors (sites of 3, 3 and 2: still
hierarchical) is bit-identical on every peer and equal to the model of the algorithm that ran
(the workload's checkers: pccl.collectives.reference)."""

from __future__ import annotations

import collections

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec

#: Three sites (peerN in site N % 3): 10 Gbit/s and 0.1 ms inside, a 1 Gbit/s uplink and 15 ms across.
SITES = {"count": 3, "uplink": 125e6, "latency": 0.015, "inside_latency": 0.0001, "inside_bandwidth": 1.25e9}


def test_a_peer_killed_inside_a_hierarchical_op() -> None:
    # 9 peers, 200,000 f32 (800 KB).  Every step optimises (the first one probes, later ones
    # find every link measured), then all-reduces.  The kill is armed once the first optimise
    # has returned (2.975 s on this seed) and fires right after peer1 sent its 3rd data frame
    # from then on: two went to its site mates (step 1), the third is its first across sites
    # (step 2; the tap names every step below N - 1 "reduce-scatter").
    phase = {"name": "all_reduce", "n": 200_000}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=9, duration=6.0, quiet=None,
                        params=(("phases", ("compute", "optimize", phase)), ("sites", SITES)))
    scenario, schedule = spec.build(0)
    trigger = Trigger("message", host="peer1", direction="send", message="data:reduce-scatter", nth=3)
    schedule = schedule.with_events([*schedule.events, FaultEvent(2.98, "kill", host="peer1", trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    killed = trace.of_kind("triggered")[0].t
    # Before the kill every peer holds the three sites of three (numbered along its ring), so
    # the op peer1 died in ran hierarchically (the unit tests pin the choice).
    before = [e for e in trace.of_kind("optimize") if e.t < killed]
    assert len(before) == 9
    assert len({tuple(e.data["sites"]) for e in before}) == 1
    assert sorted(collections.Counter(before[0].data["sites"]).values()) == [3, 3, 3]
    assert not [e for e in trace.of_kind("all_reduce") if e.t < killed]
    # Inside the transfer: every peer's op aborted (each restored its input, or the checkers fail).
    kinds = collections.Counter(e.kind for e in trace.events)
    assert kinds["all_reduce_aborted"] == 9
    # The survivors retry and go on hierarchically: 8 peers in sites of 3, 3 and 2 (three
    # shards: each peer of the site of 2 owns one or two, and every peer sends more than its
    # whole buffer, 800 KB: its part across sites on top of its site's steps).
    after = [e for e in trace.of_kind("all_reduce") if e.t > killed]
    assert after and {e.data["world_size"] for e in after} == {8}
    assert {tuple(sorted(collections.Counter(e.data["sites"]).values())) for e in after} == {(2, 3, 3)}
    assert min(e.data["tx"] for e in after if e.data["k"] == 2) > 800_000


def test_uneven_sites_and_a_slow_uplink_leave_no_peer_idle_past_the_watchdog() -> None:
    # 5 peers in sites of 2 and 3 (peerN in site N % 2) behind a 10 MB/s uplink, all-reducing
    # 32 MB.  The steps across sites last longer than peer_timeout (2 s here); a peer that took
    # no part in them (rank 2 of the site of 3 while shards followed the smallest site) moved no
    # byte meanwhile, its transfer watchdog aborted every op, and every retry again: none ever
    # completed.  Sharded by the largest site, every peer moves bytes across sites throughout.
    uneven = {**SITES, "count": 2, "uplink": 10e6}
    phase = {"name": "all_reduce", "n": 8_000_000}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=5, duration=8.0, quiet=None,
                        params=(("phases", ("compute", "optimize", phase)), ("sites", uneven)))
    trace = run(*spec.build(0))
    assert trace.ok, [f.message for f in trace.failures]
    done = trace.of_kind("all_reduce")
    assert len(done) >= 5 and not trace.of_kind("all_reduce_aborted"), [
        e.data["error"] for e in trace.of_kind("all_reduce_aborted")][:3]
    assert {tuple(e.data["sites"]) for e in done} == {(0, 1, 1, 1, 0)}, "not hierarchical across sites of 2 and 3"
