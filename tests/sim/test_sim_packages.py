"""The simulator's package rules (ARCHITECTURE.md §1, §2): only ``sim/workloads`` imports pccl,
no workload is imported by the generic packages, no import cycle between ``sim`` modules, and
package ``__init__`` files are docstrings only.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import pathlib

import sim

SIM_DIR = pathlib.Path(sim.__file__).resolve().parent
GENERIC_PACKAGES = ("engine", "faults", "observe", "tools")


def _module_name(path: pathlib.Path) -> str:
    parts = ("sim", *path.relative_to(SIM_DIR).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in sorted(SIM_DIR.rglob("*.py"))}


def _imports(path: pathlib.Path, package: str | None = None) -> set[str]:
    """Absolute names of everything ``path`` (in ``package``, by default its own) imports;
    ``from a import b`` yields ``a`` and ``a.b``."""
    if package is None:
        package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            # An import of a.b.c also runs a and a.b: count each package on the way.
            parts = imported.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)
        targets.discard(name)
        graph[name] = targets
    return graph


def test_generic_packages_never_import_pccl_or_a_workload() -> None:
    offenders = {}
    for name, path in _modules().items():
        if name.split(".")[1:2] and name.split(".")[1] in GENERIC_PACKAGES:
            bad = sorted(m for m in _imports(path) if m == "pccl" or m.startswith(("pccl.", "sim.workloads")))
            if bad:
                offenders[name] = bad
    assert offenders == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


def test_package_inits_are_docstrings_only() -> None:
    for path in sorted(SIM_DIR.rglob("__init__.py")):
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), path


def test_the_checks_see_what_they_check(tmp_path: pathlib.Path) -> None:
    # The tests above pass vacuously if the scan is broken: prove it sees every form of import.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import pccl.net\n"
        "def f():\n    from ..workloads.pccl import scenario\n"
    )
    assert _imports(probe, "sim.engine") >= {"pccl.net", "sim.workloads.pccl", "sim.workloads.pccl.scenario"}
    assert "sim.engine.streams" in _graph()["sim.engine.runner"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]


def test_registry_names_are_the_scenarios_own_names() -> None:
    # Saved schedules name their scenario by Scenario.name; the registry must resolve each name
    # to the class that writes it, and keep the names schedules were saved under.
    from sim.tools.scenarios import SCENARIOS, scenario_class, scenario_from_json

    assert {"pccl", "toy-echo"} <= set(SCENARIOS)
    for name in SCENARIOS:
        cls = scenario_class(name)
        assert cls.name == name
        assert type(scenario_from_json({"name": name})) is cls
