"""Shared pytest configuration.

This directory holds no ``__init__.py``; pytest's default import mode puts it on ``sys.path``
because of this file, so test modules import the shared helpers beside them directly (the
harness itself is :mod:`pccl.testing`).
"""

from hypothesis import HealthCheck, settings

# Tests never assert on wall-clock speed: hypothesis' per-example deadline and its "too slow"
# health checks are exactly that, and fail on a loaded 2-core machine.  Tests keep their own
# max_examples; only the timing checks are off for every property test.
settings.register_profile(
    "pccl", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("pccl")


def pytest_configure(config) -> None:  # type: ignore[no-untyped-def]
    """Byte-compile the library and the simulator once, before any test runs.

    The tests start hundreds of Python processes (peers, masters, examples).  Where
    ``PYTHONDONTWRITEBYTECODE`` is set (it is on the machines this project is tested on), an
    editable install has no ``__pycache__`` and every one of them compiled every pccl module
    again (~0.3 s of CPU each).  compileall writes regardless of that variable and skips files
    already up to date."""
    import compileall
    import pathlib

    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller has done it
        return
    root = pathlib.Path(__file__).resolve().parents[1]
    for package in ("pccl", "sim", "examples", "tests"):
        compileall.compile_dir(str(root / package), quiet=1)
