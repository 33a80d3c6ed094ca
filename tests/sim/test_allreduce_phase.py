"""The all-reduce step of the simulated pccl workload (pccl_sim.workloads.pccl.collectives) and its
checker's teeth."""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
import pytest

import pccl.testing
from pccl.collectives.backup import InputBackup
from pccl_sim.engine.runner import run
from pccl_sim.engine.trace import Trace
from pccl_sim.engine.schedule import FaultEvent, Trigger
from pccl_sim.tools.campaign import CampaignSpec


def _run(seed: int, phase: dict[str, Any] | str = "all_reduce") -> Trace:
    # The chaos profile's faults without its NAT draw (``relays=0``: every peer public, the very
    # schedules these seeds had before NAT): these tests count ops and aim mutants at aborts
    # inside the ring, and a seed whose peers all sit behind NAT with one dying relay (seed 1)
    # spends its window negotiating paths.  NAT under chaos: tests/sim/test_nat_relay_workload.py.
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=4, duration=20.0, quiet=None,
                        params=(("phases", ("compute", phase)), ("relays", 0)))
    scenario, schedule = spec.build(seed)
    return run(scenario, schedule)


def _kinds(trace: Trace) -> collections.Counter[str]:
    return collections.Counter(e.kind for e in trace.events)


@pytest.mark.parametrize("phase", [
    "all_reduce",
    {"name": "all_reduce", "concurrent": 3, "n": 1000, "op": "SUM", "dtype": "float16"},
    {"name": "all_reduce", "quantization": "uint8", "op": "MAX"},
])
def test_chaos_runs_all_reduce_every_step_and_pass(phase: Any) -> None:
    totals: collections.Counter[str] = collections.Counter()
    # Four seeds: whether a fault lands inside an op (rather than between ops) depends on the
    # schedule's timing, which any change to the op's message pattern shifts.
    for seed in (0, 1, 2, 3):
        trace = _run(seed, phase)
        assert trace.ok, [f.message for f in trace.failures]
        kinds = _kinds(trace)
        assert kinds["all_reduce"] > 50
        totals += kinds
    # Faults landed inside all-reduces: some aborted (and were checked for restored inputs).
    assert totals["all_reduce_aborted"] > 0


def test_checker_catches_a_result_that_differs() -> None:
    def off_by_one(real: Any) -> Any:  # every kind's data path: only all-reduces run in this phase
        async def entry(make_op: Any, *, rank: int, keep: Any, **kw: Any) -> Any:
            op = await real(make_op, rank=rank, keep=keep, **kw)
            if rank == 0:
                keep.dst[0] += 1
            return op

        return entry

    with pccl.testing.plant_execute_fault(off_by_one):
        trace = _run(0)
    assert [f.kind for f in trace.failures] == ["safety"]
    assert "differs" in trace.failures[0].message


@pytest.mark.parametrize("mutant", ["backup-never-restored", "staged-op-touches-the-input"])
def test_checker_catches_an_abort_that_leaves_the_buffer_modified(monkeypatch: pytest.MonkeyPatch,
                                                                    mutant: str) -> None:
    phase: dict[str, Any] | str = "all_reduce"
    if mutant == "backup-never-restored":
        # Large in-place ops save their input in an InputBackup and restore it on abort.
        fault = pccl.testing.plant_staging_fault(0)
        monkeypatch.setattr(InputBackup, "restore", lambda self: None)
    else:
        # Small ones reduce into scratch memory and touch the caller's array only on success.
        phase = {"name": "all_reduce", "n": 33}  # only small ops: large ones are not staged

        def touch(plan: Any) -> None:  # as if the output were the caller's array: success overwrites it anyway
            plan.args.dst.view(np.uint8)[:1] ^= 0xFF

        fault = pccl.testing.plant_attempt_fault(touch)
    with fault:
        for seed in range(8):
            trace = _run(seed, phase)
            if _kinds(trace)["all_reduce_aborted"]:
                break
        else:
            pytest.fail("no seed in 0..7 aborted an all-reduce")
    messages = [f.message for f in trace.failures]
    assert any("left the in-place buffer modified" in m for m in messages), messages


@pytest.mark.parametrize(("part", "direction", "peers", "concurrent", "kind"), [
    ("CollectiveInit", "send", 4, 1, "kill"),  # the vote: the others commence without the victim
    ("data:exchange", "send", 3, 1, "kill"),
    ("data:reduce-scatter", "send", 4, 1, "kill"),
    ("data:all-gather", "send", 4, 1, "kill"),
    ("data:all-gather", "send", 3, 1, "power_off"),
    ("data:reduce-scatter", "send", 4, 2, "kill"),  # two ops in flight on the victim
    ("CollectiveDone", "send", 4, 1, "kill"),  # finished its part, waiting for the others
    ("CollectiveComplete", "recv", 4, 1, "kill"),  # the master's final word just read
])
def test_a_peer_killed_inside_each_part_of_an_all_reduce(part: str, direction: str, peers: int, concurrent: int,
                                                         kind: str) -> None:
    # The kill fires right after the victim sends (reads) its 3rd message of that part; the wire
    # names data frames by the op they belong to (pccl_sim.workloads.pccl.frames.AllReduceParts).
    # Every checker agrees (results equal the reference over exactly the completing peers, aborted
    # ops left their inputs restored), and the later ops run over the survivors.
    phase = {"name": "all_reduce", "concurrent": concurrent}
    spec = CampaignSpec(scenario="pccl", profile="none", peers=peers, duration=8.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    scenario, schedule = spec.build(0)
    trigger = Trigger("message", host="peer1", direction=direction, message=part, nth=3)
    schedule = schedule.with_events([*schedule.events, FaultEvent(1.0, kind, host="peer1", trigger=trigger)])
    trace = run(scenario, schedule)
    assert trace.ok, [f.message for f in trace.failures]
    assert [e.data["trigger"] for e in trace.of_kind("triggered")] == [trigger.describe()]
    cells = [tuple(c) for c in trace.stats["coverage"]]
    label = part + (f" [{concurrent} ops]" if concurrent > 1 else "")
    assert (label, kind) in {(victim, k) for victim, _, k in cells}, cells
    kinds = _kinds(trace)
    if part.startswith("data:"):
        assert kinds["all_reduce_aborted"] > 0  # inside the transfer: the survivors' op aborted
    after = trace.of_kind("triggered")[0].t
    worlds = {e.data["world_size"] for e in trace.of_kind("all_reduce") if e.t > after + 1}
    assert worlds == {peers - 1}


def test_in_flight_launches_tags_in_order_with_a_bounded_number_running() -> None:
    # PCCL's stress pattern: ten tags per step, at most eight at once, a later tag starting when
    # an earlier one finished (so later calls start while an earlier call may be re-wiring).
    phase = {"name": "all_reduce", "concurrent": 10, "in_flight": 8, "quantization": "uint8", "n": 2000}
    trace = _run(1, phase)
    assert trace.ok, [f.message for f in trace.failures]
    running: dict[str, set[int]] = collections.defaultdict(set)
    started: dict[tuple[int, int], list[int]] = collections.defaultdict(list)  # (peer id, step) -> tags
    widest = 0
    for event in trace.events:
        host, data = event.source, event.data
        if event.kind == "start":
            running.pop(host, None)
        elif event.kind == "all_reduce_call":
            running[host].add(data["tag"])
            started[(data["peer_id"], data["step"])].append(data["tag"])
            widest = max(widest, len(running[host]))
        elif event.kind in ("all_reduce", "all_reduce_aborted", "all_reduce_alone"):
            running[host].discard(data["tag"])
    assert widest == 8  # the bound is reached and never passed
    assert started and all(tags == sorted(tags) for tags in started.values())
    assert any(len(tags) == 10 for tags in started.values())


def test_four_bit_blockwise_all_reduce_under_chaos() -> None:
    # One short run: 4-bit codes in blocks of 128, bf16 buffers, both plan sizes; the checker
    # holds every result bit-identical across the participants and inputs restored on aborts.
    phase = {"name": "all_reduce", "quantization": "uint4", "quant_block": 128, "op": "SUM", "dtype": "bfloat16"}
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=3, duration=6.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    trace = run(*spec.build(1))
    assert trace.ok, [f.message for f in trace.failures]
    assert _kinds(trace)["all_reduce"] > 10
