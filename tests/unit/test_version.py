"""One version string: ``pccl.__version__`` is what the package metadata and ``pccl --version``
say, and pyproject.toml reads it from there instead of holding a copy."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

import pytest

import pccl
from pccl.tools import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", pccl.__version__), pccl.__version__


def test_pyproject_reads_the_version_from_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "a second copy of the version in pyproject.toml"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pccl.__version__"}


def test_the_installed_metadata_has_the_same_version() -> None:
    installed = importlib.metadata.version("pccl-trio")
    assert installed == pccl.__version__, (
        f"the installed metadata says {installed}, pccl.__version__ {pccl.__version__}: reinstall (pip install -e .)")


def test_pccl_version_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"pccl {pccl.__version__}"


def test_the_changelog_has_an_entry_for_this_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(pccl.__version__)}\b", changelog, re.M), \
        f"CHANGELOG.md has no '## {pccl.__version__}' section"
