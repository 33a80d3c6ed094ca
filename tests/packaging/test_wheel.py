"""``python -m build`` makes an sdist and, from it, a wheel with the compiled kernel; the wheel,
installed into a fresh virtualenv in a temporary folder away from the source tree, runs
``pccl --version``, imports the kernel and runs ``pccl demo``.

Slow (a build and an install, about half a minute; pip fetches the dependencies from the
package index): ``.ci/run`` runs it after the default test run.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time
import venv
import zipfile

import pytest

import pccl

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _run(cmd: list[str], *, cwd: pathlib.Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


def _clean_env() -> dict[str, str]:
    """The environment without anything that would make Python find the source tree."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_the_wheel_installs_into_a_fresh_virtualenv_and_runs_the_demo(tmp_path: pathlib.Path) -> None:
    dist = tmp_path / "dist"
    started = time.monotonic()
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)], cwd=tmp_path)
    built = time.monotonic()
    sdists = sorted(dist.glob("*.tar.gz"))
    wheels = sorted(dist.glob("*.whl"))
    assert len(sdists) == 1 and len(wheels) == 1, sorted(p.name for p in dist.iterdir())
    wheel = wheels[0]
    assert wheel.name.startswith(f"pccl_trio-{pccl.__version__}-") and "-abi3-" in wheel.name, wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("pccl/_kernels") and n.endswith((".so", ".pyd")) for n in names), names
    assert "pccl_sim/__init__.py" in names and "pccl/py.typed" in names
    assert not [n for n in names if n.startswith("sim/")], "the simulator installs as pccl_sim, never as sim"

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / "python"
    env = _clean_env()
    _run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
         cwd=tmp_path, env=env)
    installed = time.monotonic()
    print(f"wheel {wheel.name}: {wheel.stat().st_size / 1024:.0f} KiB; build {built - started:.1f} s, "
          f"virtualenv and install {installed - built:.1f} s")

    away = tmp_path / "elsewhere"  # no pccl/ or sim/ next to the interpreter's working directory
    away.mkdir()
    version = _run([str(bin_dir / "pccl"), "--version"], cwd=away, env=env).stdout.strip()
    assert version == f"pccl {pccl.__version__}"
    probe = _run([str(python), "-c",
                  "import importlib.metadata, importlib.util, pccl, pccl._kernels, pccl.kernels, pccl_sim, numpy as np\n"
                  "assert importlib.util.find_spec('sim') is None  # no top-level sim to shadow a user's\n"
                  "x = np.ones(8, np.float32); pccl.kernels.reduce_into(x, np.ones(8, np.float32), pccl.ReduceOp.SUM)\n"
                  "assert (x == 2).all()\n"
                  "print(pccl.__file__); print(pccl._kernels.__file__); print(pccl_sim.__file__)\n"
                  "print(importlib.metadata.version('pccl-trio'))"], cwd=away, env=env).stdout.split()
    for path in probe[:3]:
        assert pathlib.Path(path).resolve().is_relative_to(env_dir.resolve()), f"{path} is not the installed copy"
    assert probe[3] == pccl.__version__
    assert "torch" not in _run([str(python), "-m", "pip", "list"], cwd=away, env=env).stdout.lower()
    demo = _run([str(bin_dir / "pccl"), "--log-level", "WARNING", "demo", "--peers", "2", "--steps", "5",
                 "--size", "1000", "--timeout", "120"], cwd=away, env=env, timeout=180)
    assert "all surviving peers hold bit-identical weights" in demo.stdout, demo.stdout
    _run([str(bin_dir / "pccl-sim"), "--help"], cwd=away, env=env)
