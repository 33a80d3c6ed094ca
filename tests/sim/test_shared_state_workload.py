"""The shared-state step in the simulator: joiners become bit-identical, a source killed
mid-transfer is replaced, and the checker has teeth (a non-deterministic update is caught)."""

from __future__ import annotations

import pathlib

import pytest

from pccl_sim.engine.runner import run
from pccl_sim.tools.scenarios import scenario_from_json
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.workloads.pccl.scenario import PcclScenario, pccl_schedule
from pccl_sim.workloads.pccl.shared_state import SharedStateAgreement


def _schedule(scenario: PcclScenario, events: list[FaultEvent], *, seed: int = 5, duration: float = 5.0) -> Schedule:
    return Schedule(seed=seed, events=events, duration=duration, quiet=scenario.liveness_bound + 2,
                    scenario=scenario.to_json())


def _state_bytes(n: int) -> int:
    return n * 4 + (n // 4 + 1) * 2 + 8 + 4 * 8  # w f32, m bf16, count i64, rng u64 (joiners get it)


def test_joiner_is_bit_identical_and_a_source_killed_mid_transfer_is_replaced() -> None:
    n = 2_000_000
    scenario = PcclScenario(peers=3, phases=["compute", {"name": "sync", "n": n}])
    events = [
        FaultEvent(2.0, "spawn", host="peer3", role="peer"),
        # once 1 MB of peer0's stripe reached the joiner, peer0 dies
        FaultEvent(2.0, "kill", host="peer0", trigger=Trigger("bytes", src="peer0", dst="peer3", bytes=1_000_000)),
    ]
    trace = run(scenario, _schedule(scenario, events))
    assert trace.ok, [str(f) for f in trace.failures]
    assert [e.data["host"] for e in trace.of_kind("kill") if e.source == "net"] == ["peer0"]
    joiner = [e for e in trace.of_kind("sync") if e.source == "peer3"]
    assert joiner[0].data["first"] and joiner[0].data["rx"] > _state_bytes(n)  # partial stripe + re-fetch
    assert all(e.data["rx"] == 0 for e in joiner[1:]) and len(joiner) > 3
    others = {e.data["digest"] for e in trace.of_kind("sync")
              if e.source in ("peer1", "peer2") and e.data["revision"] == joiner[0].data["revision"]}
    assert others == {joiner[0].data["digest"]}


def test_checker_catches_a_diverging_peer() -> None:
    scenario = PcclScenario(peers=3, phases=["compute", {"name": "sync", "n": 100, "diverge": "peer1"}])
    trace = run(scenario, _schedule(scenario, []))
    assert not trace.ok
    failure = next(f for f in trace.failures if f.source == SharedStateAgreement.name)
    assert failure.kind == "safety" and "after its first" in failure.message


def test_checker_catches_a_master_that_lets_a_newcomer_claiming_progress_win() -> None:
    # Every joiner claims up to 1000 revisions of progress; peer3 joins a running group.  The
    # planted master believes the claim (last round's defect): the checker must say so.  The
    # real master, same schedule: peer3 receives the group's state and the run passes.
    phases = ["compute", {"name": "sync", "n": 100, "high_joiners": 1.0}]
    events = [FaultEvent(2.0, "spawn", host="peer3", role="peer")]
    broken = PcclScenario(peers=3, phases=phases, master="newcomer-revision-wins")
    trace = run(broken, _schedule(broken, events))
    failure = next(f for f in trace.failures if f.source == SharedStateAgreement.name)
    assert failure.kind == "safety" and "a participant without the lineage changed the holders' state" in \
        failure.message, failure
    real = PcclScenario(peers=3, phases=phases)
    trace = run(real, _schedule(real, events))
    assert trace.ok, [str(f) for f in trace.failures]
    joined = [e for e in trace.of_kind("sync") if e.source == "peer3"]
    assert joined[0].data["rx"] > 0 and joined[0].data["revision"] < joined[0].data["offered"]
    holders = {e.data["digest"] for e in trace.of_kind("sync")
               if e.source != "peer3" and e.data["revision"] == joined[0].data["revision"]}
    assert holders == {joined[0].data["digest"]}


def test_checker_catches_a_master_that_ignores_the_lineage_peers_hold() -> None:
    # Blind to the lineage the peers report, a restarted master treats the running group's next
    # sync as the run's first and mints a new lineage: the holders' history is gone.
    scenario = PcclScenario(peers=3, phases=["compute", {"name": "sync", "n": 100}], master="lineage-blind")
    events = [FaultEvent(2.0, "master_restart", duration=1.0)]
    real = PcclScenario(peers=3, phases=["compute", {"name": "sync", "n": 100}])
    trace = run(real, _schedule(real, events))
    assert trace.ok, [str(f) for f in trace.failures]
    trace = run(scenario, _schedule(scenario, events))
    failure = next(f for f in trace.failures if f.source == SharedStateAgreement.name)
    assert failure.kind == "safety" and "minted a new lineage although a peer that held a lineage" in \
        failure.message, failure


@pytest.mark.parametrize("seeds", [
    pytest.param(range(2), id="two-seeds"),
    pytest.param(range(6), id="six-seeds", marks=pytest.mark.slow),
])
def test_chaos_seeds_keep_shared_state_invariants(seeds: range) -> None:
    # A bounded campaign (chaos profile: kills, stalls, partitions, joins, message-triggered
    # faults that now include the sync's own messages): two seeds in the default run, six slow.
    for seed in seeds:
        scenario, schedule = pccl_schedule(seed, profile="chaos", peers=4, duration=10.0,
                                           phases=["compute", {"name": "sync", "n": 20_000}, "all_reduce"])
        trace = run(scenario, schedule)
        assert trace.ok, (seed, [str(f) for f in trace.failures])
        syncs = trace.of_kind("sync")
        assert len(syncs) > 50 and any(e.data["first"] and e.data["rx"] for e in syncs)


def test_the_shrunk_lineage_failure_replays_clean() -> None:
    # pccl-sim seed 1 --phases compute,sync,all_reduce, shrunk to 7 events before the lineage
    # rule: every holder of the group's lineage dies, the group restarts from a newcomer's
    # revision, and the peer that comes back with the real state was kicked for its revision
    # again and again ("RevisionViolation: revision 25 but the group expects 1").
    schedule = Schedule.load(pathlib.Path(__file__).parent / "schedules" / "lineage_seed1_shrunk.json")
    trace = run(scenario_from_json(schedule.scenario), schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    syncs = trace.of_kind("sync")
    assert any(not e.data["first"] and e.data["revision"] > e.data["offered"] for e in syncs) or any(
        e.data["first"] and e.data["offered"] > 0 for e in syncs)  # a peer with progress rejoined
    assert not [e for e in trace.of_kind("sync_failed") if e.data["error"] == "RevisionViolation"]
