"""Scenario registry: a schedule names its scenario (``schedule.scenario["name"]``) and this maps
the name to the class that rebuilds it from the schedule's parameters (``from_json``).

Workloads register here (``"pccl"`` -> ``sim.workloads.pccl.scenario:PcclScenario``; more with ``register``), so
``pccl-sim replay FILE`` can rebuild any scenario from the file alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..engine.runner import Scenario

__all__ = ["SCENARIOS", "register", "scenario_from_json"]

#: name -> "module:Class"; the class has ``from_json(params: dict) -> Scenario``.
SCENARIOS: dict[str, str] = {
    "toy-echo": "sim.workloads.toy:EchoScenario",
    # pccl itself: master + peers running the recommended training loop.
    "pccl": "sim.workloads.pccl.scenario:PcclScenario",
}


def register(name: str, target: str) -> None:
    SCENARIOS[name] = target


def scenario_from_json(data: Mapping[str, Any]) -> Scenario:
    """Rebuild the scenario a schedule describes.  ``KeyError`` for an unknown name."""
    name = data.get("name")
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {sorted(SCENARIOS)}")
    module_name, _, attr = SCENARIOS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return cls.from_json(dict(data))
