"""ARCHITECTURE.md §1: pccl.protocol is sans-IO, and pccl never imports sim."""

from __future__ import annotations

import ast
import pathlib

import pccl

PCCL_DIR = pathlib.Path(pccl.__file__).resolve().parent
FORBIDDEN_IN_PROTOCOL = {"trio", "socket", "time", "random", "asyncio", "threading", "select", "ssl"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_protocol_package_is_sans_io() -> None:
    files = sorted((PCCL_DIR / "protocol").rglob("*.py"))
    assert files, "pccl/protocol has no modules"
    offenders = {
        str(f.relative_to(PCCL_DIR)): sorted(_imported_modules(f) & FORBIDDEN_IN_PROTOCOL) for f in files
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_pccl_never_imports_sim() -> None:
    offenders = [str(f.relative_to(PCCL_DIR)) for f in PCCL_DIR.rglob("*.py") if "sim" in _imported_modules(f)]
    assert offenders == []


def test_checker_sees_forbidden_imports(tmp_path: pathlib.Path) -> None:
    # The checks above pass vacuously if the import scan is broken; prove it detects imports.
    probe = tmp_path / "probe.py"
    probe.write_text("import trio\nfrom time import monotonic\nimport sim.network\n")
    assert _imported_modules(probe) == {"trio", "time", "sim"}
