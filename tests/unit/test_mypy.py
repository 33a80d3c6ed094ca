"""The library's annotations check clean: pccl ships py.typed, so its users' type checkers read
them.  Runs mypy as configured in pyproject.toml ([tool.mypy]: the pccl package)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_mypy_is_clean_on_the_library() -> None:
    pytest.importorskip("mypy", reason="mypy comes with the test extra")
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
