"""The collectives phase of the simulated pccl workload (pccl_sim.workloads.pccl.kinds): every kind,
concurrent tags launched in order, under chaos; its checker's teeth; determinism."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pytest

import pccl.testing
from pccl_sim.engine.runner import run
from pccl_sim.engine.trace import Trace
from pccl_sim.tools.campaign import CampaignSpec

PHASE = {"name": "collectives", "concurrent": 8, "in_flight": 6, "n": 3000}


def _run(seed: int, phase: dict[str, Any] = PHASE, peers: int = 5, duration: float = 20.0) -> Trace:
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=peers, duration=duration, quiet=None,
                        params=(("phases", ("compute", phase)),))
    scenario, schedule = spec.build(seed)
    return run(scenario, schedule)


def _counts(trace: Trace) -> collections.Counter[str]:
    counts: collections.Counter[str] = collections.Counter()
    for e in trace.events:
        if e.kind in ("collective", "collective_aborted"):
            counts[f"{e.kind}:{e.data['op']}"] += 1
    return counts


QUANTIZED = {**PHASE, "quantization": "uint8", "dtype": "bfloat16"}


@pytest.mark.parametrize(("phase", "seeds"), [
    # The default run: one seed of each (a different one, so both seeds still run); slow: both.
    pytest.param(PHASE, (0,), id="plain"),
    pytest.param(QUANTIZED, (1,), id="quantized"),
    pytest.param(PHASE, (0, 1), id="plain-two-seeds", marks=pytest.mark.slow),
    pytest.param(QUANTIZED, (0, 1), id="quantized-two-seeds", marks=pytest.mark.slow),
])
def test_chaos_runs_every_kind_concurrently_and_passes(phase: dict[str, Any], seeds: tuple[int, ...]) -> None:
    totals: collections.Counter[str] = collections.Counter()
    for seed in seeds:
        trace = _run(seed, phase)
        assert trace.ok, [f.message for f in trace.failures]
        totals += _counts(trace)
    for kind in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        assert totals[f"collective:{kind}"] > 50 * len(seeds), totals
    # Faults landed inside the ops: some aborted, and were checked for intact inputs.
    assert sum(v for k, v in totals.items() if k.startswith("collective_aborted")) > 0, totals


@pytest.mark.parametrize("kind", ["broadcast", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize(("peers", "duration"), [
    # The first wrong result is caught within the first steps; 3 peers over 5 s suffice (each
    # entry verified to fail so when this was bounded).  Slow: the original 5 peers over 20 s.
    pytest.param(3, 5.0, id="small"),
    pytest.param(5, 20.0, id="full", marks=pytest.mark.slow),
])
def test_the_checker_catches_a_result_that_differs(kind: str, peers: int, duration: float) -> None:
    # The kind's row (pccl.collectives.kinds) with a result one off on ring position 1.
    def off_by_one(row: Any) -> Any:
        def result(call: Any, commence: Any, rank: int, tx: int, rx: int, output: Any) -> Any:
            if rank == 1:
                out = output if output is not None else call.keep.dst  # an all-gather's output, else the buffer
                with np.errstate(invalid="ignore", over="ignore"):  # the rest of a reduce-scatter's buffer is unspecified: any bits
                    out[...] = out + 1
            return row.result(call, commence, rank, tx, rx, output)

        return dataclasses.replace(row, result=result)

    with pccl.testing.plant_kind_fault(kind, off_by_one):
        trace = _run(0, {**PHASE, "kinds": [kind], "concurrent": 2}, peers=peers, duration=duration)
    messages = [f.message for f in trace.failures]
    assert any("differs" in m for m in messages), messages


@pytest.mark.parametrize(("peers", "duration"), [
    pytest.param(3, 6.0, id="small"),
    pytest.param(4, 20.0, id="full", marks=pytest.mark.slow),
])
def test_same_seed_same_trace(peers: int, duration: float) -> None:
    assert _run(3, peers=peers, duration=duration).hash() == _run(3, peers=peers, duration=duration).hash()


def test_four_bit_blockwise_quantization_runs_every_kind_under_chaos() -> None:
    # One short run (the chaos runs above cover faults at length): 4-bit codes in blocks of an odd
    # size, f16 buffers; the checker holds every result bit-identical across the participants.
    phase = {**PHASE, "quantization": "uint4", "quant_block": 77, "dtype": "float16"}
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=4, duration=6.0, quiet=None,
                        params=(("phases", ("compute", phase)),))
    trace = run(*spec.build(0))
    assert trace.ok, [f.message for f in trace.failures]
    counts = _counts(trace)
    for kind in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        assert counts[f"collective:{kind}"] > 10, counts


SHUFFLED = {"name": "collectives", "concurrent": 6, "n": 3000, "order": "shuffled"}


@pytest.mark.parametrize("peer_commit", [False, True])
def test_peers_that_launch_their_tags_in_different_orders_cross_and_pass(peer_commit: bool) -> None:
    """Each peer starts its concurrent collectives in an order of its own (their begun ops cross
    on the links) under chaos: every call completes right or aborts intact, and the orders did
    differ between peers of one step; same seed, same trace."""
    spec = CampaignSpec(scenario="pccl", profile="chaos", peers=4, duration=8.0, quiet=None,
                        params=(("phases", ("compute", SHUFFLED)), ("fast_commit", True), ("peer_commit", peer_commit)))
    trace = run(*spec.build(5))
    assert trace.ok, [f.message for f in trace.failures]
    orders: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for e in trace.events:
        if e.kind == "collective_call":
            orders[(e.data["step"], e.data["peer_id"])].append(e.data["tag"])
    by_step: dict[int, set[tuple[int, ...]]] = collections.defaultdict(set)
    for (step, _), tags in orders.items():
        by_step[step].add(tuple(tags))
    assert sum(len(seen) > 1 for seen in by_step.values()) >= 3, by_step  # orders differed in many steps
    assert _counts(trace)["collective:all_reduce"] > 10, _counts(trace)
    assert trace.hash() == run(*spec.build(5)).hash()


def test_shuffled_order_needs_every_tag_in_flight() -> None:
    from pccl_sim.workloads.pccl.kinds import CollectivesPhase

    with pytest.raises(ValueError, match="in_flight equal to concurrent"):
        CollectivesPhase(**{**SHUFFLED, "in_flight": 2})
    with pytest.raises(ValueError, match="order must be"):
        CollectivesPhase(**{**SHUFFLED, "order": "random"})
