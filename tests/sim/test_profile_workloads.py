"""The fault profiles' workloads: chaos, phases and stress seeds run every collective on
concurrent tags (PCCL's stress pattern among them); a legal call refused is a failure."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

import pccl
from pccl_sim.engine.runner import run
from pccl_sim.tools.campaign import CampaignSpec
from pccl_sim.workloads.pccl.collectives import AllReducePhase
from pccl_sim.workloads.pccl.kinds import KINDS, CollectivesPhase
from pccl_sim.workloads.pccl.profiles import PROFILE_WORKLOADS, profile_phases
from pccl_sim.workloads.pccl.scenario import pccl_schedule


def _pccl_stress(phase: Any) -> bool:
    """PCCL's stress pattern: 10 tags, uint8-quantized, at most 8 in flight."""
    return (phase.concurrent, phase.in_flight) == (10, 8) and phase.quantization is not None \
        and phase.quantization.dtype == "uint8"


@pytest.mark.parametrize("profile", ["chaos", "phases", "stress"])
def test_the_profiles_run_every_collective_on_concurrent_tags(profile: str) -> None:
    seen: Counter[str] = Counter()
    aimed: set[str] = set()
    for seed in range(60):
        scenario, schedule = pccl_schedule(seed, profile=profile, peers=4, duration=20.0)
        assert schedule.scenario["phases"] == profile_phases(profile, seed)
        for phase in scenario.phases:
            if isinstance(phase, CollectivesPhase):
                seen.update(f"kind:{k}" for k in phase.kinds)
                seen["collectives stress" if _pccl_stress(phase) else "collectives exact"] += 1
            elif isinstance(phase, AllReducePhase):
                seen["all_reduce stress" if _pccl_stress(phase) else "all_reduce"] += 1
        aimed.update(e.trigger.message for e in schedule.events if e.trigger is not None and e.trigger.message)
    for kind in KINDS:
        assert seen[f"kind:{kind}"] >= 10, seen
    assert seen["all_reduce stress"] >= 5 and seen["collectives stress"] >= 5, seen
    if profile != "stress":  # PCCL's stress profile: time-drawn spawns and kills, few triggers
        assert seen["collectives exact"] and seen["all_reduce"], seen
        # Phase-triggered faults aim inside the new collectives' transfers too.
        assert {"data:broadcast", "data:all-gather", "data:reduce-scatter"} <= aimed, aimed


def test_the_draw_is_the_seeds_and_phases_given_override_it() -> None:
    assert {str(b) for b in PROFILE_WORKLOADS["chaos"]} >= {str(b) for b in PROFILE_WORKLOADS["stress"]}
    spec = CampaignSpec(profile="stress", peers=4, duration=5.0)
    first, again = spec.build(7)[0], spec.build(7)[0]
    assert first.params["phases"] == again.params["phases"] != ["compute"]
    assert spec.command(7) == "pccl-sim replay --seed 7 --profile stress --duration 5"  # the draw replays
    given = CampaignSpec(profile="stress", peers=4, duration=5.0, params=(("phases", ("compute",)),))
    assert given.build(7)[0].params["phases"] == ["compute"]
    for profile in ("none", "network"):
        assert profile_phases(profile, 7) is None
        assert pccl_schedule(7, profile=profile, peers=4, duration=5.0)[0].params["phases"] == ["compute"]


@pytest.mark.parametrize("call,phase", [
    ("broadcast", {"name": "collectives", "kinds": ["broadcast", "all_gather"], "concurrent": 4}),
    ("all_reduce", {"name": "all_reduce", "concurrent": 10, "in_flight": 8, "quantization": "uint8", "n": 500}),
])
def test_a_legal_call_refused_with_invalid_usage_fails_the_run(monkeypatch: pytest.MonkeyPatch, call: str,
                                                               phase: dict[str, Any]) -> None:
    """A peer's legal collective refused with ``InvalidUsage`` (as PCCL's stress pattern once
    was, see test_rewire_refusal.py) is a *crash* failure naming the refusal: the phases catch
    only ``CollectiveAborted`` and ``TooFewPeers``."""
    real = getattr(pccl.Communicator, call)
    calls = Counter[str]()

    async def refuse_the_third(self: pccl.Communicator, *args: Any, **kwargs: Any) -> Any:
        calls[call] += 1
        if calls[call] == 3:
            raise pccl.InvalidUsage("cannot start a collective while a topology vote (rewire) is outstanding")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(pccl.Communicator, call, refuse_the_third)
    spec = CampaignSpec(profile="none", peers=3, duration=2.0, params=(("phases", ("compute", phase)),))
    trace = run(*spec.build(0))
    assert not trace.ok
    assert "crash" in trace.failure_kinds
    assert any("InvalidUsage" in str(f) and "topology vote (rewire)" in str(f) for f in trace.failures), \
        [str(f) for f in trace.failures]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("profile", ["chaos", "phases", "stress"])
def test_a_campaign_of_each_profile_with_its_step_bodies_passes(profile: str) -> None:
    from pccl_sim.tools.campaign import run_campaign

    results = run_campaign(CampaignSpec(profile=profile, peers=4, duration=10.0), range(20), workers=2)
    assert not [(r.seed, r.failures) for r in results if not r.ok]
    totals: Counter[str] = Counter()
    for r in results:
        totals.update(r.counters)
    assert totals["collectives_completed"] > 1000 and totals["all_reduce_completed"] > 1000, totals
    assert totals["collectives_aborted"] + totals["all_reduce_aborted"] > 0, totals  # faults landed inside ops
