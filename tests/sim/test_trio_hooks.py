"""Guard: trio's private scheduler hooks exist, look as expected, and still make runs identical.

If this fails after a trio upgrade, the simulator's determinism is gone: pin trio back (see
pyproject.toml) until sim/engine/determinism.py is adapted.
"""

from __future__ import annotations

import math
import random

import pytest
import trio
import trio.testing
from trio._core import _run

from pccl_sim.engine.determinism import (
    TrioHooksChanged,
    check_trio_hooks,
    deterministic_trio,
    poll_only_when_idle,
    sim_clock,
)


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


def test_sim_clock_delivers_events_when_the_run_idles_at_their_exact_times() -> None:
    """The runner's clock delivers the network's events itself: due ones as soon as the run is
    idle (time does not move meanwhile), else it jumps exactly to the earlier of the next event
    and the next deadline, and events due then run before that instant's tasks."""
    log: list[tuple[str, float]] = []

    class Events:
        def __init__(self) -> None:
            self.pending = [(0.5, "a"), (0.5, "b"), (1.25, "c")]

        def add(self, when: float, name: str) -> None:
            self.pending.append((when, name))
            self.pending.sort()

        def next_time(self) -> float:
            return self.pending[0][0] if self.pending else math.inf

        def deliver(self, now: float) -> None:
            while self.pending and self.pending[0][0] <= now:
                _, name = self.pending.pop(0)
                log.append((name, trio.current_time()))
                if name == "b":
                    self.add(now, "b-now")  # added while delivering, for now: delivered too

    events = Events()

    async def main() -> None:
        await trio.sleep(1.0)
        log.append(("task", trio.current_time()))
        events.add(trio.current_time(), "x")  # due now: delivered once the task waits
        await trio.sleep(0.25)  # ties with "c"
        log.append(("task", trio.current_time()))

    trio.run(main, clock=sim_clock(events))
    assert log == [("a", 0.5), ("b", 0.5), ("b-now", 0.5), ("task", 1.0), ("x", 1.0), ("c", 1.25), ("task", 1.25)]


def test_idle_poll_asks_the_os_only_when_a_poll_could_deliver_something() -> None:
    """``poll_only_when_idle`` skips the epoll call while nothing but the wake-up socket is
    registered and ``run_sync_soon`` has queued nothing; a queued callback, or a real fd someone
    waits on, makes it poll again (and the callback runs, the fd's waiter wakes)."""
    idle: list[int] = []
    iterations = [0]

    def iteration() -> None:  # a missed poll spins the loop (no clock jump while a callback waits)
        iterations[0] += 1
        if iterations[0] > 100_000:
            raise RuntimeError("the loop spins: a poll that was needed was skipped")

    async def main() -> None:
        poll_only_when_idle(iteration)
        poller = _run.GLOBAL_RUN_CONTEXT.runner.io_manager
        for _ in range(5):
            await trio.sleep(1)  # idle: the clock jumps, nothing to poll for
        idle_polls = poller.polls
        token = trio.lowlevel.current_trio_token()
        called = trio.Event()
        token.run_sync_soon(called.set)  # as a thread would: queued, then the wake-up byte
        await trio.sleep(1)  # idle: the callback must have run before the clock moved on
        assert called.is_set() and poller.polls > idle_polls
        a, b = trio.socket.socketpair()
        with a, b:
            await b.send(b"x")
            before, now = poller.polls, trio.current_time()
            with trio.move_on_after(1):
                await trio.lowlevel.wait_readable(a)  # a real fd: polled for although idle
            assert poller.polls > before and trio.current_time() == now
        idle.append(idle_polls)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert idle == [0]
