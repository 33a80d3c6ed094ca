"""The simulator's own package rules: package ``__init__`` files are docstrings only, and the one
scenario registry resolves the names saved schedules use.  (The import rules — only
``sim/workloads`` imports pccl, the generic packages import no workload, no import cycle — are
checked with pccl's in ``tests/unit/test_layering.py``.)
"""

from __future__ import annotations

import ast
import pathlib

import pccl_sim

SIM_DIR = pathlib.Path(pccl_sim.__file__).resolve().parent  # the repository's sim/ folder


def test_package_inits_are_docstrings_only() -> None:
    for path in sorted(SIM_DIR.rglob("__init__.py")):
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), path


def test_registry_names_are_the_scenarios_own_names() -> None:
    # Saved schedules name their scenario by Scenario.name; the registry must resolve each name
    # to the class that writes it, and keep the names schedules were saved under.
    from pccl_sim.tools.scenarios import SCENARIOS, scenario_class, scenario_from_json

    assert {"pccl", "toy-echo"} <= set(SCENARIOS)
    for name in SCENARIOS:
        cls = scenario_class(name)
        assert cls.name == name
        assert type(scenario_from_json({"name": name})) is cls
