"""Guard: trio's private scheduler hooks exist, look as expected, and still make runs identical.

If this fails after a trio upgrade, the simulator's determinism is gone: pin trio back (see
pyproject.toml) until sim/engine/determinism.py is adapted.
"""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing
from trio._core import _run

from sim.engine.determinism import TrioHooksChanged, check_trio_hooks, deterministic_trio, sim_clock


def test_private_hooks_have_expected_names_and_types() -> None:
    assert isinstance(_run._r, random.Random)
    assert isinstance(_run._ALLOW_DETERMINISTIC_SCHEDULING, bool)
    # The tie-breaker the deterministic switch compensates for, and the batch sort key.
    assert hasattr(_run, "Deadlines") and hasattr(_run.Deadlines, "add")
    assert hasattr(_run.Task, "_counter")
    check_trio_hooks()


def test_guard_fails_loudly_when_a_hook_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_run, "_r", object())
    with pytest.raises(TrioHooksChanged, match="_r"):
        check_trio_hooks()
    monkeypatch.undo()
    monkeypatch.delattr(_run, "_ALLOW_DETERMINISTIC_SCHEDULING")
    with pytest.raises(TrioHooksChanged, match="DETERMINISTIC"):
        check_trio_hooks()


def _racy_program(clock: trio.abc.Clock | None = None) -> list[tuple[str, int, float]]:
    """Ten tasks whose wake-ups tie at the same virtual instants (sleeps and equal deadlines)."""
    order: list[tuple[str, int, float]] = []

    async def worker(name: str) -> None:
        for step in range(40):
            with trio.move_on_after(0.002):  # equal deadlines across tasks: id()-ordered heap ties
                await trio.sleep(0.001 * (step % 3) + 0.01)
            order.append((name, step, trio.current_time()))
            await trio.sleep(0)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(worker, f"w{i}")

    trio.run(main, clock=clock or trio.testing.MockClock(autojump_threshold=0))
    return order


def _deterministic(seed: int, clock: trio.abc.Clock | None = None) -> list[tuple[str, int, float]]:
    with deterministic_trio(seed):
        return _racy_program(clock)


def test_hooks_make_racy_program_repeatable_and_seed_sensitive() -> None:
    first, second = _deterministic(3), _deterministic(3)
    assert first == second, "same seed, different interleavings: trio's deterministic mode is broken"
    assert _deterministic(4) != first, "different seeds gave one interleaving: the shuffle is dead"


def test_sim_clock_keeps_mock_clock_times_and_jumps() -> None:
    assert _deterministic(3, sim_clock()) == _deterministic(3)


def test_hooks_are_restored_after_a_run() -> None:
    flag = _run._ALLOW_DETERMINISTIC_SCHEDULING
    state = _run._r.getstate()
    _deterministic(5)
    assert _run._ALLOW_DETERMINISTIC_SCHEDULING == flag
    assert _run._r.getstate() == state
