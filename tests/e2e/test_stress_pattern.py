"""The process-level stress test modelled on PCCL's orchestrator: a ``pccl master`` process and
2-10 ``stress_peer.py`` processes, one SIGKILLed or spawned every 0.5-2 s (seeded); each step
syncs the shared state, then runs 10 concurrent uint8-quantized collectives on tags 0..9
(launched in tag order, at most 8 in flight) and checks every result.

The run fails on any refused legal call (``InvalidUsage`` — the pattern once got
``cannot start a collective while a topology vote (rewire) is outstanding``), wrong result,
wrong or divergent state, unexpected error, or stall (``stress_orchestrator.py`` says exactly
what it checks).  The default run churns for ~20 s; ``-m slow`` runs a long campaign of
``$PCCL_STRESS_SECONDS`` (default 300) seconds, seed ``$PCCL_STRESS_SEED`` (default 7).

From a shell: ``python tests/e2e/stress_orchestrator.py --seconds 600 --seed 7``.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from stress_orchestrator import StressConfig, run_stress


def _check(config: StressConfig, tmp_path: pathlib.Path) -> None:
    report, details = run_stress(config, tmp_path)
    print(report.figures())
    assert not report.problems, "\n".join([report.figures(), *report.problems, details])
    assert report.kills and report.joins > config.initial_peers, report.figures()  # the churn happened
    assert report.steps and report.max_revision > 0, report.figures()
    assert report.survivors >= config.min_peers, report.figures()


@pytest.mark.timeout(150)
def test_stress_pattern_under_churn(tmp_path: pathlib.Path) -> None:
    _check(StressConfig(seconds=20.0, seed=1), tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(int(float(os.environ.get("PCCL_STRESS_SECONDS", "300"))) + 600)
def test_stress_pattern_long(tmp_path: pathlib.Path) -> None:
    seconds = float(os.environ.get("PCCL_STRESS_SECONDS", "300"))
    _check(StressConfig(seconds=seconds, seed=int(os.environ.get("PCCL_STRESS_SEED", "7"))), tmp_path)
