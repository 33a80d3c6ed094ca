"""Acceptance: a pccl chaos seed gives the same trace hash in two fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys

from pccl_sim.engine.runner import run
from pccl_sim.workloads.pccl.scenario import pccl_schedule

_PROGRAM = """
import logging
logging.disable(logging.CRITICAL)
from pccl_sim.engine.runner import run
from pccl_sim.workloads.pccl.scenario import pccl_schedule
scenario, schedule = pccl_schedule({seed}, profile="phases", peers=4, duration=4.0)
trace = run(scenario, schedule)
print(trace.hash(), len(trace), trace.ok)
"""


def _fresh_process(seed: int, hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM.format(seed=seed)], env=env, capture_output=True, text=True, timeout=120,
        check=True,
    )
    return out.stdout.strip()


def test_pccl_seed_same_hash_in_two_fresh_processes_and_here() -> None:
    first = _fresh_process(36, "0")
    second = _fresh_process(36, "4242")  # str hashing must not leak into the run
    assert first == second
    digest, events, ok = first.split()
    assert ok == "True" and int(events) > 500
    scenario, schedule = pccl_schedule(36, profile="phases", peers=4, duration=4.0)
    assert len(schedule.events) >= 3 and any(e.trigger is not None for e in schedule.events)
    assert any(e.kind == "master_restart" for e in schedule.events)  # a master restart in the mix
    trace = run(scenario, schedule)
    assert trace.hash() == digest  # and in this long-lived pytest process too
    other_scenario, other = pccl_schedule(37, profile="phases", peers=4, duration=4.0)
    assert run(other_scenario, other).hash() != digest
