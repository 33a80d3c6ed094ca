"""Delta debugging: synthetic oracles and a real failing toy schedule."""

from __future__ import annotations

import pathlib

import pytest

from pccl_sim.engine.runner import run
from pccl_sim.faults.generate import generate
from pccl_sim.engine.schedule import FaultEvent, Schedule
from pccl_sim.faults.shrink import NotFailing, ddmin, same_failure, shrink
from pccl_sim.tools.scenarios import scenario_from_json
from pccl_sim.workloads.toy import EchoScenario


def test_ddmin_finds_exactly_the_two_culprits() -> None:
    items = list(range(40))
    calls = []

    def fails(subset: list[int]) -> bool:
        calls.append(len(subset))
        return 7 in subset and 31 in subset

    assert ddmin(items, fails) == [7, 31]
    assert len(calls) < 60


def test_ddmin_single_culprit_empty_and_not_failing() -> None:
    assert ddmin(list("abcdefgh"), lambda s: "e" in s) == ["e"]
    assert ddmin([1, 2, 3], lambda s: True) == []
    with pytest.raises(NotFailing):
        ddmin([1, 2, 3], lambda s: False)


def test_shrink_schedule_to_the_pair_of_events_and_simplify_durations() -> None:
    base = generate(3, profile="chaos", duration=30)
    x = FaultEvent(4.0, "stall", host="master", duration=2.0)
    y = FaultEvent(9.0, "kill", host="peer1")
    schedule = base.with_events(base.events[:5] + [x] + base.events[5:] + [y])

    def fails(s: Schedule) -> bool:
        kinds = {(e.kind, e.host, e.t) for e in s.events}
        return ("stall", "master", 4.0) in kinds and ("kill", "peer1", 9.0) in kinds

    result = shrink(schedule, fails)
    assert [(e.kind, e.host, e.t) for e in result.events] == [("stall", "master", 4.0), ("kill", "peer1", 9.0)]
    assert result.events[0].duration < 0.02  # halved while it still failed
    assert result.original_events == len(schedule.events)


@pytest.mark.parametrize("kept", [
    # The default run shrinks three events (the culprit among two others): fewer toy runs.
    pytest.param(slice(2, 5), id="three-events"),
    pytest.param(slice(None), id="six-events", marks=pytest.mark.slow),
])
def test_shrink_a_real_failing_toy_run_and_replay_it(tmp_path: pathlib.Path, kept: slice) -> None:
    toy = EchoScenario(peers=2, bug="give_up")
    noise = [
        FaultEvent(1.0, "stall", host="peer0", duration=0.3),
        FaultEvent(1.5, "spawn", host="peer2", role="peer"),
        FaultEvent(2.0, "clog", host="peer1", other=("peer0",), duration=0.5),
        FaultEvent(3.0, "partition", side=("peer2",), duration=0.2),
        FaultEvent(3.5, "master_restart", host="master", duration=0.5),
        FaultEvent(4.0, "spawn", host="peer3", role="peer"),
    ][kept]
    schedule = Schedule(seed=4, events=noise, duration=6.0, quiet=12.0, scenario=toy.to_json())
    first = run(toy, schedule)
    assert first.failure_kinds == ("liveness",)
    oracle = same_failure(lambda s: scenario_from_json(s.scenario), first.failure_kinds)
    result = shrink(schedule, oracle, simplify=False)
    assert [e.kind for e in result.events] == ["master_restart"]
    path = tmp_path / "shrunk.json"
    result.schedule.save(path)
    replayed = Schedule.load(path)
    assert run(scenario_from_json(replayed.scenario), replayed).failure_kinds == ("liveness",)
