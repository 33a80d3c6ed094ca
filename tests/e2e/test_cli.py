"""The commands as a newcomer meets them: help texts, --version, ``pccl bench`` run from a folder
that holds a ``pccl/`` directory (and tidy afterwards), ``pccl demo``'s output."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pccl


def _run(*args: str, cwd: str | pathlib.Path | None = None, env: dict[str, str] | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=env)


def test_pccl_help_hides_the_internal_sub_command_and_has_a_version() -> None:
    out = _run("pccl", "--help").stdout
    assert "SUPPRESS" not in out and "demo-peer" not in out
    assert all(name in out for name in ("master", "demo", "bench"))
    assert _run("pccl", "--version").stdout.strip() == f"pccl {pccl.__version__}"
    demo = " ".join(_run("pccl", "demo", "--help").stdout.split())  # whatever the terminal width
    assert "seconds between kills with --chaos" in demo
    assert "choice of chaos victims" in demo


def test_pccl_sim_sub_commands_and_options_have_help() -> None:
    out = _run("pccl_sim.tools.cli", "--help").stdout
    listed = out[out.index("positional arguments:"):].splitlines()
    for name in ("run", "campaign", "replay", "shrink", "coverage", "plot"):
        line = next(line for line in listed if line.strip().startswith(name + " "))
        assert len(line.split()) > 2, line  # a help text follows the name
    run = " ".join(_run("pccl_sim.tools.cli", "run", "--help").stdout.split())
    assert "fault schedule profile" in run and "seed of the fault schedule" in run
    campaign = " ".join(_run("pccl_sim.tools.cli", "campaign", "--help").stdout.split())
    assert f"default {os.cpu_count()}" in campaign


def test_bench_runs_from_a_folder_holding_a_pccl_directory_and_cleans_up(tmp_path: pathlib.Path) -> None:
    decoy = tmp_path / "work" / "pccl"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('this is not the pccl you are looking for')\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    # the console script, as a user runs it (it does not put the current directory on sys.path;
    # the children it starts used to)
    script = os.path.join(os.path.dirname(sys.executable), "pccl")
    result = subprocess.run([script, "bench", "--peers", "2", "--sizes", "16K",
                             "--iters-scale", "0.1"], capture_output=True, text=True, timeout=180,
                            cwd=decoy.parent, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "# Avg bus bandwidth    :" in result.stdout.splitlines()[-1]
    assert not list(tmp.glob("pccl-bench-*"))  # no log folder left behind after a good run
