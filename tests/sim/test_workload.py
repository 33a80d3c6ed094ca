"""The pccl scenario: real master and peers in the simulator, the recommended loop, recovery."""

from __future__ import annotations

import pytest
import trio

from pccl_sim.engine.runner import run
from pccl_sim.engine.schedule import FaultEvent, Schedule, Trigger
from pccl_sim.tools.scenarios import scenario_from_json
from pccl_sim.workloads.pccl.phases import PHASES, Phase, StepContext, register_phase
from pccl_sim.workloads.pccl.scenario import PcclScenario, pccl_schedule


def _schedule(scenario: PcclScenario, events: list[FaultEvent], *, seed: int = 3, duration: float = 6.0,
              quiet: float | None = None) -> Schedule:
    return Schedule(seed=seed, events=events, duration=duration,
                    quiet=quiet if quiet is not None else scenario.liveness_bound + 2, scenario=scenario.to_json())


def test_peers_are_accepted_and_step_together_without_faults() -> None:
    scenario = PcclScenario(peers=4)
    trace = run(scenario, _schedule(scenario, []))
    assert trace.ok, [str(f) for f in trace.failures]
    accepted = trace.of_kind("accepted")
    assert sorted(e.source for e in accepted) == ["peer0", "peer1", "peer2", "peer3"]
    steps = trace.of_kind("step")
    assert len({e.source for e in steps}) == 4 and len(steps) > 40
    last = {e.source: e.data for e in steps}
    assert all(d["world_size"] == d["global_world_size"] == 4 and d["num_peer_groups"] == 1 for d in last.values())
    assert trace.stats["converged_after"] is not None and trace.stats["converged_after"] < 1.0
    # Recovered: the run ended ``hold`` seconds later instead of idling through the quiet window.
    schedule = _schedule(scenario, [])
    assert trace.stats["virtual_seconds"] == pytest.approx(
        schedule.duration + trace.stats["converged_after"] + scenario.hold, abs=scenario.probe_interval)
    patient = PcclScenario(peers=4, hold=None)
    assert run(patient, _schedule(patient, [])).stats["virtual_seconds"] == schedule.horizon


def test_newcomer_enters_the_loop_with_the_peers_that_accepted_it() -> None:
    scenario = PcclScenario(peers=2)
    trace = run(scenario, _schedule(scenario, [FaultEvent(2.0, "spawn", host="peer2", role="peer")]))
    assert trace.ok, [str(f) for f in trace.failures]
    joined = next(e for e in trace.of_kind("accepted") if e.source == "peer2")
    assert joined.data["world_size"] == 3
    # The old peers' update_topology that accepted it returned at the same instant ...
    same_round = [e for e in trace.of_kind("topology") if e.t == joined.t]
    assert sorted(e.source for e in same_round) == ["peer0", "peer1"]
    assert all(e.data["world_size"] == 3 for e in same_round)
    # ... and the newcomer skips update_topology on its first step.
    first_own = next(e for e in trace if e.source == "peer2" and e.kind in ("step", "topology") and e.t >= joined.t)
    assert first_own.kind == "step" and first_own.data["step"] == 1


def test_lone_peer_waits_with_update_topology_until_someone_joins() -> None:
    scenario = PcclScenario(peers=1)
    trace = run(scenario, _schedule(scenario, [FaultEvent(1.5, "spawn", host="peer1", role="peer")]))
    assert trace.ok, [str(f) for f in trace.failures]
    alone = [e for e in trace.of_kind("alone") if e.source == "peer0"]
    assert len(alone) > 5 and all(e.t < 1.6 for e in alone)
    assert not [e for e in trace.of_kind("step") if e.t < 1.5]
    assert {e.data["world_size"] for e in trace.of_kind("step")} == {2}


def test_master_restart_peers_reconnect_and_keep_going() -> None:
    # A master restart: the peers keep their communicators, reconnect, register again
    # (a restarted master gives their ids back) and train on at full membership.
    scenario = PcclScenario(peers=3)
    trace = run(scenario, _schedule(scenario, [FaultEvent(2.0, "master_restart", host="master", duration=1.0)]))
    assert trace.ok, [str(f) for f in trace.failures]
    assert not trace.of_kind("left") and not trace.of_kind("join_failed")
    before = {e.source: e.data["peer_id"] for e in trace.of_kind("step") if e.t < 2.0}
    after = [e for e in trace.of_kind("step") if e.data["began"] > 3.0]
    assert {e.source for e in after if e.data["world_size"] == 3} == {"peer0", "peer1", "peer2"}
    assert {e.source: e.data["peer_id"] for e in after} == before


def test_a_lone_peer_asking_are_peers_pending_does_not_stop_the_other_group() -> None:
    # peer1 is alone in group 1 and runs PCCL's loop (are_peers_pending first); group 0 steps,
    # and when peer3 joins group 1 the lone peer's "True" leads it into the accept vote.
    scenario = PcclScenario(peers=3, groups=2, alone="pending")
    trace = run(scenario, _schedule(scenario, [FaultEvent(3.0, "spawn", host="peer3", role="peer")]))
    assert trace.ok, [str(f) for f in trace.failures]
    steps = trace.of_kind("step")
    assert len([e for e in steps if e.source in ("peer0", "peer2") and e.t < 3.0]) > 10
    assert [e for e in steps if e.source == "peer1" and e.data["world_size"] == 2]


def test_a_lone_peer_asking_are_peers_pending_across_a_master_restart_meets_its_group_again() -> None:
    # Chaos seed 12165 (two groups, PCCL's lone loop): peer3 waits alone in are_peers_pending()
    # when the master dies; at the restarted master a newcomer of its group is accepted first and
    # accepts peer3 by its update_topology, then moves on into its step.  Asking the new master
    # again would wait for that newcomer, which waits in its sync for peer3: are_peers_pending()
    # answers True instead, and peer3 meets it at update_topology.
    scenario, schedule = pccl_schedule(12165, profile="chaos", peers=6, duration=15.0, groups=2, alone="pending",
                                       phases=["compute", "sync", "all_reduce"])
    trace = run(scenario, schedule)
    assert trace.ok, [str(f) for f in trace.failures]
    assert any(e.kind == "fault" and e.data["event"]["kind"] == "master_restart" for e in trace)


def test_long_stall_gets_the_peer_kicked_and_it_rejoins() -> None:
    scenario = PcclScenario(peers=3)
    trace = run(scenario, _schedule(scenario, [FaultEvent(1.0, "stall", host="peer1", duration=4.0)]))
    assert trace.ok, [str(f) for f in trace.failures]
    left = [e for e in trace.of_kind("left") if e.source == "peer1"]
    assert left and left[0].data in ({"error": "Kicked", "reason": "TIMEOUT"}, {"error": "MasterUnreachable", "reason": None})
    assert [e for e in trace.of_kind("accepted") if e.source == "peer1" and e.t > 5.0]


def test_phase_triggered_kill_lands_in_its_phase_and_is_covered() -> None:
    scenario = PcclScenario(peers=3)
    trigger = Trigger("message", host="peer2", direction="send", message="P2PReport", nth=1)
    spawn_and_kill = [
        FaultEvent(1.0, "spawn", host="peer3", role="peer"),
        FaultEvent(1.0, "kill", host="peer3", trigger=Trigger("message", host="peer3", direction="recv",
                                                               message="ConnectToPeers")),
        FaultEvent(3.0, "kill", host="peer2", trigger=trigger),  # armed; a join at 3.5 makes a round
        FaultEvent(3.5, "spawn", host="peer4", role="peer"),
    ]
    trace = run(scenario, _schedule(scenario, spawn_and_kill))
    assert trace.ok, [str(f) for f in trace.failures]
    cells = [tuple(c) for c in trace.stats["coverage"]]
    assert ("-", cells[0][1], "spawn") == cells[0]
    assert ("ConnectToPeers", "kill") == (cells[1][0], cells[1][2])
    assert ("-", "spawn") == (cells[2][0], cells[2][2])
    assert ("P2PReport", "kill") == (cells[3][0], cells[3][2])
    assert len(trace.of_kind("triggered")) == 2
    # The round the kill interrupted was retried without peer2; everyone else got in.
    assert {e.data["world_size"] for e in trace.of_kind("step") if e.t > trace.of_kind("triggered")[1].t + 1} == {3}


@pytest.mark.parametrize("message", ["CollectiveDone", "CollectiveAbort", "Register"])
def test_master_killed_in_its_own_short_phases_and_the_run_recovers(message: str) -> None:
    # The master's phase between reading a message and answering it lasts no virtual time: only
    # a trigger on the master itself lands there.  A stall of peer1 inside its all-reduce makes
    # the master abort the op (its CollectiveAbort); a join makes it read a Register.
    scenario = PcclScenario(peers=3, phases=["compute", "all_reduce"])
    trigger = Trigger("message", host="master", direction="send" if message == "CollectiveAbort" else "recv",
                      message=message, nth=1)
    events = [FaultEvent(1.5, "master_restart", host="master", duration=1.0, trigger=trigger)]
    if message == "CollectiveAbort":
        events.append(FaultEvent(1.5, "stall", host="peer1", duration=3.0,
                                 trigger=Trigger("message", host="peer1", direction="recv", message="CollectiveCommence")))
    if message == "Register":
        events.append(FaultEvent(1.5, "spawn", host="peer3", role="peer"))
    trace = run(scenario, _schedule(scenario, events, duration=8.0))
    assert trace.ok, [str(f) for f in trace.failures]
    cells = [tuple(c) for c in trace.stats["coverage"] if c[2] == "master_restart"]
    assert [c[1] for c in cells] == [message]
    assert [e for e in trace.of_kind("triggered") if e.data["trigger"].startswith("master")]
    last = {e.source: e.data["world_size"] for e in trace.of_kind("step")}
    assert all(last[p] == len(last) for p in last) and len(last) == (4 if message == "Register" else 3), last


class _WedgeAfterFaults(Phase):
    """A step body that never returns once the faults are over: liveness must catch it."""

    name = "test-wedge"

    async def run(self, step: StepContext) -> None:
        if step.host.now >= step.host.sim.quiet_at:
            await trio.sleep_forever()
        await trio.sleep(0.1)


def test_a_loop_that_stops_stepping_is_a_liveness_failure() -> None:
    register_phase(_WedgeAfterFaults)
    try:
        scenario = PcclScenario(peers=3, phases=["test-wedge"])
        schedule = _schedule(scenario, [FaultEvent(1.0, "kill", host="peer0")], quiet=scenario.liveness_bound + 1)
        trace = run(scenario, schedule)
    finally:
        del PHASES["test-wedge"]
    assert trace.failure_kinds == ("liveness",)
    assert "no full-membership step" in trace.failures[0].message


def test_scenario_round_trips_through_the_schedule() -> None:
    scenario, schedule = pccl_schedule(4, peers=3, duration=5.0, phases=["compute"], step_time=0.1)
    again = scenario_from_json(Schedule.from_json(schedule.to_json()).scenario)
    assert isinstance(again, PcclScenario) and again.to_json() == scenario.to_json()
    assert schedule.quiet > scenario.liveness_bound > 2 * scenario.config.peer_timeout
    with pytest.raises(KeyError):
        PcclScenario(phases=["no-such-phase"])
    with pytest.raises(KeyError):
        PcclScenario(master="no-such-master")


def test_kill_during_stall_releases_the_corpses_shielded_cleanup_at_once() -> None:
    """Regression (found by a pccl campaign, shrunk to partition + stall + kill): a dead host's
    shielded cleanup parked in the stall gate stayed parked until the unstall, then ran on — a
    false zombie.  The kill must release it at the death instant."""
    from pccl_sim.engine.errors import PeerDisconnected
    from pccl_sim.engine.network import World
    from pccl_sim.engine.runner import simulate
    from pccl_sim.engine.streams import SimNetwork

    async def body(world: World) -> tuple[float, float, str]:
        a, b = world.boot("a"), world.boot("b")
        listener = await b.listen("b:9000")
        stream = await a.connect("b:9000")
        await listener.accept()
        world.stall("a")
        outcome: list[tuple[float, str]] = []

        async def shielded_goodbye(net: SimNetwork) -> None:
            with trio.CancelScope(shield=True):
                try:
                    await stream.send_all(b"bye")  # parks: the host is frozen
                    outcome.append((trio.current_time(), "sent"))
                except PeerDisconnected:
                    outcome.append((trio.current_time(), "refused"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(shielded_goodbye, a)
            await trio.sleep(0.5)
            killed = trio.current_time()
            world.kill("a")
            await trio.sleep(1.0)
            world.unstall("a")  # without the fix, only this released the corpse
        return killed, outcome[0][0], outcome[0][1]

    killed, finished, outcome = simulate(body)
    assert outcome == "refused" and finished == killed
