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

Rules:

* trio's private names are reached only here, by the names in the table below (with ``getattr``
  and ``setattr``, never as ``x._name``: the rest of the engine touches no foreign private
  member, and the layering test holds this module to that too), and :func:`check_trio_hooks`
  checks each of them before a run relies on it;
* whatever is changed in trio for a run is restored afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import random
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import trio.testing

__all__ = [
    "TrioHooksChanged", "check_trio_hooks", "derive_rng", "deterministic_trio", "trio_seed", "poll_only_when_idle",
    "sim_clock", "IdleEvents",
]


#: trio's private names the simulator relies on (see the rules above).
_SCHEDULER_RNG = "_r"  # trio._core._run: the RNG that shuffles each batch of runnable tasks
_DETERMINISTIC_FLAG = "_ALLOW_DETERMINISTIC_SCHEDULING"  # trio._core._run: sort batches first
_AUTOJUMP = "_autojump"  # MockClock: what the run loop calls when the run is idle
_IO_WAITERS = "_registered"  # the epoll I/O manager: fd -> its waiters


class TrioHooksChanged(RuntimeError):
    """trio's private scheduler hooks are not where the simulator expects them."""


def _run_module():  # type: ignore[no-untyped-def]
    try:
        from trio._core import _run
    except ImportError as exc:  # pragma: no cover - only on a trio that reorganised its core
        raise TrioHooksChanged(f"trio._core._run cannot be imported: {exc}") from exc
    return _run


def check_trio_hooks() -> None:
    """Raise :class:`TrioHooksChanged` unless ``_r`` is a ``random.Random``, the flag exists and
    ``MockClock`` still has the autojump hook :func:`sim_clock` replaces."""
    run = _run_module()
    rng = getattr(run, _SCHEDULER_RNG, None)
    if not isinstance(rng, random.Random):
        raise TrioHooksChanged(
            f"trio._core._run._r is {type(rng).__name__}, not random.Random: the simulator cannot "
            "seed trio's scheduler; pin trio to a tested version (see pyproject.toml)"
        )
    if not callable(getattr(trio.testing.MockClock(), _AUTOJUMP, None)):
        raise TrioHooksChanged(
            "trio.testing.MockClock has no _autojump: sim_clock needs adapting; pin trio to a tested version"
        )
    flag = getattr(run, _DETERMINISTIC_FLAG, None)
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
    rng: random.Random = getattr(run, _SCHEDULER_RNG)
    saved_flag = getattr(run, _DETERMINISTIC_FLAG)
    saved_state = rng.getstate()
    setattr(run, _DETERMINISTIC_FLAG, True)
    rng.seed(trio_seed(seed))
    try:
        yield
    finally:
        setattr(run, _DETERMINISTIC_FLAG, saved_flag)
        rng.setstate(saved_state)


class _IdlePoller:
    """Stands in for the run's I/O manager (forwarding everything else to it): each loop
    iteration calls ``on_iteration()``, and asks the OS for I/O events only when no task is
    runnable, or after :data:`_POLL_EVERY` iterations without a poll.  A simulated run does no
    real I/O, yet trio polls epoll once per iteration; the only fd that can fire is the wake-up
    socket of ``run_sync_soon`` (``trio.to_thread`` and ``trio.from_thread`` results, signals),
    whose callbacks therefore still run before the clock may jump (it jumps only when idle), and
    within a few iterations while tasks spin waiting for them.

    Nor is the OS asked when nothing it could report would matter: ``run_sync_soon`` queues its
    callback before it writes the wake-up byte, so with the entry queue empty and no fd but the
    wake-up socket registered, a poll could only drain a stale byte (left for a later poll).  That
    spares a system call per idle iteration, 1-2% of a run's wall time."""

    __slots__ = ("_real", "_runq", "_on_iteration", "_process_events", "_skipped", "_entries", "_registered",
                 "_wakeup_fd", "polls")

    def __init__(self, real: Any, runq: Any, on_iteration: Callable[[], None], entries: Any) -> None:
        self._real = real
        self._runq = runq
        self._on_iteration = on_iteration
        self._process_events = real.process_events
        self._skipped = 0
        self._entries = entries  # trio's EntryQueue: .queue (deque), .idempotent_queue (dict)
        self._registered = getattr(real, _IO_WAITERS)  # fd -> waiters (EpollIOManager)
        self._wakeup_fd = entries.wakeup.wakeup_sock.fileno()
        #: How many times the OS was asked (tests read it).
        self.polls = 0

    def get_events(self, timeout: float) -> Any:
        self._on_iteration()
        if self._runq and self._skipped < _POLL_EVERY:  # trio's timeout is 0: the poll is only a look
            self._skipped += 1
            return ()
        self._skipped = 0
        registered = self._registered
        if (
            timeout <= 0  # (a blocking wait, wait_all_tasks_blocked's cushion say, still waits)
            and not self._entries.queue
            and not self._entries.idempotent_queue
            and (not registered or (len(registered) == 1 and self._wakeup_fd in registered))
        ):
            return ()
        self.polls += 1
        return self._real.get_events(timeout)

    def process_events(self, events: Any) -> None:
        if events:
            self._process_events(events)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class IdleEvents(Protocol):
    """Timed events that :func:`sim_clock` delivers itself (the simulated network's)."""

    def next_time(self) -> float:
        """When the earliest pending event is due (``inf``: none)."""
        ...

    def deliver(self, now: float) -> None:
        """Run every event due at or before ``now``."""
        ...


def sim_clock(events: IdleEvents | None = None) -> trio.testing.MockClock:
    """A ``MockClock(autojump_threshold=0)`` that keeps virtual time itself and jumps more cheaply
    (the class is final, so the instance gets its own methods): time is a number it sets, so no
    real clock is read (trio reads the time a few times per loop iteration, the simulation at
    every network operation), and an autojump goes to the runner's next deadline without
    building ``trio.lowlevel.current_statistics()`` first.  Its ``rate`` stays 0: virtual time
    moves only by jumps (``jump`` too works as ``MockClock.jump``).

    With ``events``, the clock also delivers them, where trio would otherwise wake a task for
    each: when the run goes idle (no task runnable, nothing to poll), events already due run
    at once; else time jumps to whichever comes first, the next event or the next deadline
    (exactly to it: a sum may miss it by an ulp), and the events due then run before the tasks
    of that instant do.  The callbacks run in the scheduler (no task): they may reschedule and
    cancel tasks, start tasks in a nursery and read the time, never await."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    run = _run_module()  # (once: an import statement per jump showed in profiles)
    now = [clock.current_time()]

    def current_time() -> float:
        return now[0]

    def jump(seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time can't go backwards")
        now[0] += seconds

    def autojump() -> None:
        at = now[0]
        due = math.inf
        if events is not None:
            due = events.next_time()
            if due <= at:
                events.deliver(at)
                return
        target = min(run.GLOBAL_RUN_CONTEXT.runner.deadlines.next_deadline(), due)
        if at < target < math.inf:
            now[0] = target
            if events is not None and due <= target:
                events.deliver(target)

    clock.current_time = current_time  # type: ignore[method-assign]
    clock.jump = jump  # type: ignore[method-assign]
    setattr(clock, _AUTOJUMP, autojump)
    return clock


#: Busy loop iterations between two polls (bounds the latency of ``run_sync_soon`` callbacks).
_POLL_EVERY = 32


def poll_only_when_idle(on_iteration: Callable[[], None]) -> None:
    """Inside ``trio.run``: call ``on_iteration()`` once per scheduler loop iteration (where
    trio would call an instrument's ``before_io_wait``) and poll for I/O only when no task is
    runnable (:class:`_IdlePoller`).  For runs on a ``MockClock`` with ``autojump_threshold=0``,
    whose I/O wait timeout is always 0."""
    run = _run_module()
    runner = getattr(run.GLOBAL_RUN_CONTEXT, "runner", None)
    io_manager = getattr(runner, "io_manager", None)
    entries = getattr(runner, "entry_queue", None)
    if (
        runner is None
        or not hasattr(io_manager, "get_events")
        or not isinstance(getattr(io_manager, _IO_WAITERS, None), dict)
        or not hasattr(runner, "runq")
        or not hasattr(entries, "queue")
        or not hasattr(entries, "idempotent_queue")
        or not hasattr(getattr(getattr(entries, "wakeup", None), "wakeup_sock", None), "fileno")
    ):
        raise TrioHooksChanged(
            "trio's runner has no io_manager.get_events / _registered, runq or entry_queue (queue, "
            "idempotent_queue, wakeup.wakeup_sock): pin trio to a tested version"
        )
    runner.io_manager = _IdlePoller(io_manager, runner.runq, on_iteration, entries)


def derive_rng(seed: int | str, *purpose: object) -> random.Random:
    """A ``random.Random`` for one purpose, derived from the run's seed.

    A str seed is hashed with sha512 by ``random``, so this is independent of ``PYTHONHASHSEED``
    and stable across processes and Python versions.
    """
    return random.Random(":".join([str(seed), *map(str, purpose)]))
