"""The scenario registry: the one place that maps a scenario's short name to its class.

A schedule names its scenario (``schedule.scenario["name"]``, e.g. ``"pccl"``), and so do the
CLI's ``--scenario`` and a campaign's :class:`~pccl_sim.tools.campaign.CampaignSpec`.  Everything
that needs per-scenario knowledge asks the class this registry yields: ``from_json`` to rebuild
the scenario a saved schedule describes, ``generate_schedule`` to draw one from a seed,
``coverage_phases`` for the coverage table.  Targets are ``"module:Class"`` strings imported on
first use, so the tools never import a workload (nor the code under test) themselves.

The names are part of the saved-schedule format: a name, once used, keeps meaning its scenario.
More scenarios are added with :func:`register` (in-process only: a campaign's worker processes
start fresh and see only the built-in entries).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..engine.runner import Scenario

__all__ = ["SCENARIOS", "register", "scenario_names", "scenario_class", "scenario_from_json"]

#: name -> "module:Class" of a :class:`~pccl_sim.engine.runner.Scenario` subclass.
SCENARIOS: dict[str, str] = {
    # The simulator's own toy: an echo service (sim/workloads/toy.py).
    "toy-echo": "pccl_sim.workloads.toy:EchoScenario",
    # pccl itself: master + peers running the recommended training loop.
    "pccl": "pccl_sim.workloads.pccl.scenario:PcclScenario",
}


def register(name: str, target: str) -> None:
    """Make ``target`` (``"module:Class"``) the scenario called ``name``."""
    SCENARIOS[name] = target


def scenario_names() -> list[str]:
    """The registered scenario names, sorted."""
    return sorted(SCENARIOS)


def scenario_class(name: str) -> type[Scenario]:
    """The class registered as ``name``.  ``KeyError`` for an unknown name."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {scenario_names()}")
    module_name, _, attr = SCENARIOS[name].partition(":")
    cls: type[Scenario] = getattr(importlib.import_module(module_name), attr)
    return cls


def scenario_from_json(data: Mapping[str, Any]) -> Scenario:
    """Rebuild the scenario a schedule describes.  ``KeyError`` for an unknown name."""
    return scenario_class(data.get("name")).from_json(dict(data))  # type: ignore[arg-type]
