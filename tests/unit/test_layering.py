"""The layering of ARCHITECTURE.md §1, computed from the source (nothing is imported to check it).

Rules:

* no import cycle between modules of ``pccl`` and ``sim`` — imports inside functions and under
  ``TYPE_CHECKING`` count (a package importing its own submodules is not a cycle: Python
  imports the package first either way) — nor between their packages (``pccl._peer``,
  ``pccl.collectives``, ``sim.engine`` …; a module directly in ``pccl`` or ``sim`` is a unit of
  its own);
* ``pccl/collectives`` (the data path) imports neither ``pccl._peer`` nor ``pccl.master``;
  ``pccl/master`` imports neither ``pccl._peer`` nor ``pccl.collectives``;
* ``pccl/tools`` imports only the public face: ``pccl``, ``pccl.blocking``, ``pccl.checkpoint``,
  ``pccl.master`` and ``pccl.relay`` (the packages' re-exports), ``pccl.errors``, ``pccl.config``, ``pccl.types``
  (whose names ``pccl`` re-exports) and its own modules;
* pccl never imports sim;
* ``pccl/protocol``, and the other sans-IO modules (the phase rule, the frame core), import no
  trio, socket, time, random, asyncio, threading, select or ssl;
* ``pccl/protocol`` imports only itself, ``pccl.errors``, ``pccl.types``, msgspec and the
  standard library (§1: protocol -> only protocol, errors, types);
* no module of ``pccl`` or ``sim`` is longer than 700 lines (the module budget of §2);
* no module of pccl imports ``pccl.communicator`` but the package itself and what sits on top
  of it (cli, demo, bench, the blocking facade, the test harness ``pccl.testing`` and its modules): the
  services reach the peer session through ``pccl._peer.host.PeerHost``;
* nowhere in ``pccl`` and ``sim/engine``, no ``x._name`` where ``x`` is not ``self``/``cls``: no
  class touches another's private members, no module another module's private names (the
  simulator's parts talk through public faces; trio's own hooks are reached by name, from the one
  table in ``sim/engine/determinism.py``);
* tests reach private members fewer than 20 times (through ``pccl.testing`` and the machines'
  views instead);
* ``sim/engine``, ``sim/faults``, ``sim/observe`` and ``sim/tools`` never import pccl (only the
  workload packages may), nor a workload.

Each rule is also run on a planted violation, so a checker that silently finds nothing fails.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from collections.abc import Iterable, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORBIDDEN_IN_SANS_IO = {"trio", "socket", "time", "random", "asyncio", "threading", "select", "ssl"}
SANS_IO = ("pccl.protocol", "pccl._peer.phase", "pccl.net._frames")
#: Who may import pccl.communicator: the package (its public re-exports) and the applications.
COMMUNICATOR_USERS = ("pccl", "pccl.tools.cli", "pccl.tools.demo", "pccl.tools.bench", "pccl.blocking", "pccl.testing")
#: Where no object touches another's private members.
NO_FOREIGN_PRIVATES = ("pccl", "sim.engine")
#: The public face the operator tools may import (besides their own modules).
PUBLIC_FACE = ("pccl", "pccl.blocking", "pccl.checkpoint", "pccl.master", "pccl.relay", "pccl.errors", "pccl.config",
               "pccl.types")
SIM_WITHOUT_PCCL = ("sim.engine", "sim.faults", "sim.observe", "sim.tools")
#: What pccl/protocol may import besides the standard library (less FORBIDDEN_IN_SANS_IO).
PROTOCOL_MAY_IMPORT = ("pccl.protocol", "pccl.errors", "pccl.types", "msgspec")
#: Lines a module of pccl or sim may have.
MAX_MODULE_LINES = 700


# --- the graph -----------------------------------------------------------------------------------


def modules(root: pathlib.Path, packages: Iterable[str]) -> dict[str, pathlib.Path]:
    """Module name -> file, for every ``.py`` file of the given top-level packages."""
    found: dict[str, pathlib.Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_package(name: str, known: dict[str, pathlib.Path]) -> bool:
    return known[name].name == "__init__.py"


def imports_of(name: str, known: dict[str, pathlib.Path]) -> Iterator[tuple[str, int]]:
    """``(imported module, line)`` for every import in module ``name``, anywhere in the file.

    ``from X import y`` counts as importing ``X.y`` when that is a module, else ``X``; modules
    outside ``known`` are reported by their top-level name (``trio``, ``numpy`` …).
    """
    tree = ast.parse(known[name].read_text(), filename=str(known[name]))
    package = name if _is_package(name, known) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _resolve(alias.name, known), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in known else _resolve(base, known)), node.lineno


def _resolve(dotted: str, known: dict[str, pathlib.Path]) -> str:
    """The longest known module prefix of ``dotted`` (``dotted``'s top level if none)."""
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return parts[0]


def graph(known: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {name: set() for name in known}
    for name in known:
        for target, _ in imports_of(name, known):
            # A package importing its own submodule is how packages re-export: not a cycle.
            if target in known and target != name and not target.startswith(name + "."):
                edges[name].add(target)
    return edges


def _within(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def unit_of(name: str, known: dict[str, pathlib.Path]) -> str:
    """The package a module belongs to for the package rule (itself if it is directly in
    ``pccl`` or ``sim``, or a package)."""
    package = name if _is_package(name, known) else name.rpartition(".")[0]
    return name if "." not in package else package


def package_graph(known: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {unit_of(name, known): set() for name in known}
    for name in known:
        here = unit_of(name, known)
        for target, _ in imports_of(name, known):
            if target not in known:
                continue
            there = unit_of(target, known)
            # A package and its own subpackages: re-exports and their parents, not a cycle.
            if there != here and not there.startswith(here + ".") and not here.startswith(there + "."):
                edges[here].add(there)
    return edges


# --- the rules (each returns its violations as text) ----------------------------------------------


def import_cycles(known: dict[str, pathlib.Path]) -> list[str]:
    """Strongly connected components of more than one module (Tarjan)."""
    return _components(graph(known))


def package_cycles(known: dict[str, pathlib.Path]) -> list[str]:
    """The same over packages (:func:`unit_of`)."""
    return _components(package_graph(known))


def _components(edges: dict[str, set[str]]) -> list[str]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[str] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(" <-> ".join(sorted(component)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def forbidden_imports(known: dict[str, pathlib.Path], where: Iterable[str], forbidden: Iterable[str]) -> list[str]:
    where, forbidden = tuple(where), tuple(forbidden)
    found = []
    for name in sorted(known):
        if not _within(name, where):
            continue
        for target, line in imports_of(name, known):
            if _within(target, forbidden):
                found.append(f"{name}:{line} imports {target}")
    return found


def protocol_imports_beyond_its_layer(known: dict[str, pathlib.Path]) -> list[str]:
    """Imports of ``pccl.protocol`` outside :data:`PROTOCOL_MAY_IMPORT` and the standard library."""
    found = []
    for name in sorted(known):
        if not _within(name, ("pccl.protocol",)):
            continue
        for target, line in imports_of(name, known):
            stdlib = target in sys.stdlib_module_names and target not in FORBIDDEN_IN_SANS_IO
            if not stdlib and not _within(target, PROTOCOL_MAY_IMPORT):
                found.append(f"{name}:{line} imports {target}")
    return found


def oversized_modules(known: dict[str, pathlib.Path], limit: int = MAX_MODULE_LINES) -> list[str]:
    found = []
    for name in sorted(known):
        lines = len(known[name].read_text().splitlines())
        if lines > limit:
            found.append(f"{name}: {lines} lines (at most {limit}: move a cohesive piece to a module of its own)")
    return found


def tools_beyond_the_public_face(known: dict[str, pathlib.Path]) -> list[str]:
    found = []
    for name in sorted(known):
        if not _within(name, ("pccl.tools",)):
            continue
        for target, line in imports_of(name, known):
            if _within(target, ("pccl",)) and target not in PUBLIC_FACE and not _within(target, ("pccl.tools",)):
                found.append(f"{name}:{line} imports {target}")
    return found


def communicator_importers(known: dict[str, pathlib.Path]) -> list[str]:
    return [violation for violation in forbidden_imports(known, ("pccl",), ("pccl.communicator",))
            if violation.partition(":")[0] not in COMMUNICATOR_USERS
            and not _within(violation.partition(":")[0], ("pccl.testing",))]


def private_accesses(known: dict[str, pathlib.Path], where: Iterable[str]) -> list[str]:
    """``x._name`` with ``x`` other than ``self``/``cls`` (dunders excepted)."""
    where = tuple(where)
    found = []
    for name in sorted(known):
        if not _within(name, where):
            continue
        tree = ast.parse(known[name].read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


# --- the rules on the real tree --------------------------------------------------------------------

KNOWN = modules(ROOT, ("pccl", "sim"))


def test_the_scan_sees_the_tree() -> None:
    assert {"pccl.communicator", "pccl._peer.host", "pccl.protocol.master.machine"} <= set(KNOWN)
    assert "pccl._peer.host" in graph(KNOWN)["pccl._peer.collective_service"]


def test_no_import_cycles() -> None:
    assert import_cycles(KNOWN) == []


def test_no_package_cycles() -> None:
    assert {"pccl._peer", "pccl.collectives", "pccl.master", "sim.engine"} <= set(package_graph(KNOWN))
    assert package_cycles(KNOWN) == []


def test_the_data_path_and_the_master_stay_apart_from_the_peer() -> None:
    assert forbidden_imports(KNOWN, ("pccl.collectives",), ("pccl._peer", "pccl.master")) == []
    assert forbidden_imports(KNOWN, ("pccl.master",), ("pccl._peer", "pccl.collectives")) == []


def test_the_tools_use_the_public_face_only() -> None:
    assert [n for n in KNOWN if _within(n, ("pccl.tools",))], "no tools found"
    assert tools_beyond_the_public_face(KNOWN) == []


def test_pccl_never_imports_sim() -> None:
    assert forbidden_imports(KNOWN, ("pccl",), ("sim", "pccl_sim")) == []


def test_sans_io_modules_import_no_io() -> None:
    assert [n for n in KNOWN if _within(n, SANS_IO)], "no sans-IO modules found"
    assert forbidden_imports(KNOWN, SANS_IO, FORBIDDEN_IN_SANS_IO) == []


def test_the_protocol_imports_only_its_own_layer() -> None:
    assert protocol_imports_beyond_its_layer(KNOWN) == []


def test_no_module_is_over_the_line_budget() -> None:
    assert [n for n in KNOWN if n.startswith("sim.")], "no sim modules found"
    assert oversized_modules(KNOWN) == []


def test_services_do_not_import_the_communicator() -> None:
    assert communicator_importers(KNOWN) == []


def test_no_object_in_pccl_touches_another_objects_private_members() -> None:
    assert private_accesses(KNOWN, NO_FOREIGN_PRIVATES) == []


def test_the_simulation_engine_never_imports_pccl_or_a_workload() -> None:
    assert [n for n in KNOWN if _within(n, SIM_WITHOUT_PCCL)], "no generic sim modules found"
    assert forbidden_imports(KNOWN, SIM_WITHOUT_PCCL, ("pccl", "sim.workloads")) == []


# --- each rule fails on a planted violation ----------------------------------------------------------


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> dict[str, pathlib.Path]:
    for relative, text in files.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(tmp_path, ("pccl", "sim"))


def test_planted_violations_are_found(tmp_path: pathlib.Path) -> None:
    known = _plant(tmp_path, {
        "pccl/__init__.py": "from .communicator import Communicator\n",
        "pccl/communicator.py": "from ._peer import collective_service\n",
        "pccl/_peer/__init__.py": "",
        # a service importing the communicator, only under TYPE_CHECKING: still a cycle
        "pccl/_peer/collective_service.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..communicator import Communicator\n"
            "def f(comm):\n    return comm._master\n"),
        "pccl/protocol/__init__.py": "",
        "pccl/protocol/state.py": "def now():\n    import time\n    return time.monotonic()\n",
        # the protocol reaching up into the runtime and out to a third-party package
        "pccl/protocol/codec.py": "import msgspec, json\nfrom .. import errors, config\nimport numpy\n",
        "pccl/errors.py": "",
        "pccl/config.py": "",
        "pccl/long.py": "x = 1\n" * 701,
        "pccl/net/_frames.py": "import trio\n",
        "pccl/sneaky.py": "import sim.engine.runner\n",
        "sim/__init__.py": "",
        "sim/engine/__init__.py": "",
        "sim/engine/runner.py": "from pccl.protocol import state\ndef f():\n    from ..workloads import pccl\n",
        "sim/workloads/__init__.py": "",
        "sim/workloads/pccl.py": "import pccl\n",  # allowed
        # the data path reaching into the peer, the master into the data path, a tool past the face
        "pccl/collectives/__init__.py": "",
        "pccl/collectives/ring.py": "from .._peer import host\n",
        "pccl/_peer/host.py": "",
        "pccl/master/__init__.py": "",
        "pccl/master/server.py": "from ..collectives import ring\n",
        "pccl/tools/__init__.py": "",
        "pccl/tools/demo.py": "import pccl\nfrom pccl import blocking\nfrom ..master import server\nfrom . import cli\n",
        "pccl/tools/cli.py": "",
        # two packages importing each other through different modules (no module cycle)
        "sim/faults/__init__.py": "",
        "sim/faults/plan.py": "from ..engine import clock\ndef f(queue):\n    return queue._heap\n",  # not checked
        "sim/engine/clock.py": "def f(queue):\n    return queue._heap\n",
        "sim/engine/wire.py": "from ..faults import plan\n",
    })
    assert import_cycles(known) == ["pccl._peer.collective_service <-> pccl.communicator"]
    assert forbidden_imports(known, ("pccl",), ("sim",)) == ["pccl.sneaky:1 imports sim.engine.runner"]
    assert forbidden_imports(known, SANS_IO, FORBIDDEN_IN_SANS_IO) == [
        "pccl.net._frames:1 imports trio", "pccl.protocol.state:2 imports time"]
    assert communicator_importers(known) == ["pccl._peer.collective_service:3 imports pccl.communicator"]
    assert private_accesses(known, NO_FOREIGN_PRIVATES) == [
        "pccl._peer.collective_service:5: comm._master", "sim.engine.clock:2: queue._heap"]
    assert import_cycles(known) == ["pccl._peer.collective_service <-> pccl.communicator"]  # modules: no new one
    assert package_cycles(known) == ["pccl._peer <-> pccl.communicator", "sim.engine <-> sim.faults"]
    assert forbidden_imports(known, ("pccl.collectives",), ("pccl._peer", "pccl.master")) == [
        "pccl.collectives.ring:1 imports pccl._peer.host"]
    assert forbidden_imports(known, ("pccl.master",), ("pccl._peer", "pccl.collectives")) == [
        "pccl.master.server:1 imports pccl.collectives.ring"]
    assert tools_beyond_the_public_face(known) == ["pccl.tools.demo:3 imports pccl.master.server"]
    assert protocol_imports_beyond_its_layer(known) == [
        "pccl.protocol.codec:2 imports pccl.config", "pccl.protocol.codec:3 imports numpy",
        "pccl.protocol.state:2 imports time"]
    assert oversized_modules(known) == ["pccl.long: 701 lines (at most 700: move a cohesive piece to a module of its own)"]
    assert forbidden_imports(known, SIM_WITHOUT_PCCL, ("pccl", "sim.workloads")) == [
        "sim.engine.runner:1 imports pccl.protocol.state", "sim.engine.runner:3 imports sim.workloads.pccl"]
