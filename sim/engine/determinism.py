"""Making trio deterministic: its private scheduler hooks, seeded per run, restored afterwards.

Trio shuffles each batch of runnable tasks with ``trio._core._run._r``.  Seeding that RNG is not
enough: timers that expire at the same virtual instant wake in ``id(cancel_scope)`` order, i.e. by
memory address.  With ``_ALLOW_DETERMINISTIC_SCHEDULING`` set, trio sorts every batch by task
creation order before the seeded shuffle, which hides the address order (the same switch
pytest-trio and Hypothesis flip).  Both names are private: :func:`check_trio_hooks` fails loudly
if they move, and ``tests/sim/test_trio_hooks.py`` proves that they still make runs identical.

Every other random choice of a run (link jitter, each host's RNG, schedule generation) draws from
a ``random.Random`` that :func:`derive_rng` derives from the seed and a purpose, so removing one
consumer leaves the others' numbers alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator

__all__ = ["TrioHooksChanged", "check_trio_hooks", "derive_rng", "deterministic_trio", "trio_seed"]


class TrioHooksChanged(RuntimeError):
    """trio's private scheduler hooks are not where the simulator expects them."""


def _run_module():  # type: ignore[no-untyped-def]
    try:
        from trio._core import _run
    except ImportError as exc:  # pragma: no cover - only on a trio that reorganised its core
        raise TrioHooksChanged(f"trio._core._run cannot be imported: {exc}") from exc
    return _run


def check_trio_hooks() -> None:
    """Raise :class:`TrioHooksChanged` unless ``_r`` is a ``random.Random`` and the flag exists."""
    run = _run_module()
    rng = getattr(run, "_r", None)
    if not isinstance(rng, random.Random):
        raise TrioHooksChanged(
            f"trio._core._run._r is {type(rng).__name__}, not random.Random: the simulator cannot "
            "seed trio's scheduler; pin trio to a tested version (see pyproject.toml)"
        )
    flag = getattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING", None)
    if not isinstance(flag, bool):
        raise TrioHooksChanged(
            "trio._core._run._ALLOW_DETERMINISTIC_SCHEDULING is missing or not a bool: trio's "
            "deterministic scheduling switch moved; pin trio to a tested version"
        )


def trio_seed(seed: int | str) -> int:
    """The integer that seeds trio's scheduler RNG for run ``seed`` (stable across processes)."""
    return int.from_bytes(hashlib.sha256(f"{seed}:trio-scheduler".encode()).digest()[:8], "big")


@contextlib.contextmanager
def deterministic_trio(seed: int | str) -> Iterator[None]:
    """Within the block, ``trio.run`` schedules tasks deterministically as a function of ``seed``.

    Call ``trio.run`` once per block (the RNG is seeded on entry).  The previous RNG state and flag
    are restored on exit, so code outside (for example a pytest-trio test) is unaffected.
    """
    check_trio_hooks()
    run = _run_module()
    saved_flag = run._ALLOW_DETERMINISTIC_SCHEDULING
    saved_state = run._r.getstate()
    run._ALLOW_DETERMINISTIC_SCHEDULING = True
    run._r.seed(trio_seed(seed))
    try:
        yield
    finally:
        run._ALLOW_DETERMINISTIC_SCHEDULING = saved_flag
        run._r.setstate(saved_state)


def derive_rng(seed: int | str, *purpose: object) -> random.Random:
    """A ``random.Random`` for one purpose, derived from the run's seed.

    A str seed is hashed with sha512 by ``random``, so this is independent of ``PYTHONHASHSEED``
    and stable across processes and Python versions.
    """
    return random.Random(":".join([str(seed), *map(str, purpose)]))
