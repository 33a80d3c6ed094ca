"""Running a scenario under a fault schedule: one deterministic ``trio.run``, one :class:`Trace`.

:func:`run` is the whole simulator in one call::

    trace = run(MyScenario(peers=4), generate(seed=7, profile="chaos"))
    assert trace.ok, trace.failures
    print(trace.hash())

Inside, a single ``trio.run`` on a ``MockClock(autojump_threshold=0)``
(:func:`~pccl_sim.engine.determinism.sim_clock`) with trio's scheduler seeded from the schedule's seed
(:mod:`pccl_sim.engine.determinism`) runs:

* the :class:`~pccl_sim.engine.network.World`'s events, delivered by the clock itself whenever the
  run goes idle (before time moves on), not by a task;
* every simulated host as a task ``scenario.<role>(host)`` inside its own cancel scope, one per
  incarnation; ``host`` is a :class:`HostContext` with the host's own network (an instance of
  the scenario's ``network_class``), RNG and a ``record`` method for trace events;
* the fault injector, which applies the schedule's time-triggered events at their times and arms
  the phase-triggered ones (:mod:`pccl_sim.engine.tap`);
* the watchdog: the run always has a deadline (the schedule's horizon), so a global deadlock ends
  in a reported liveness failure, never a hang; a loop-iteration counter turns a livelock (tasks
  spinning without virtual time passing) into one too.

At the end of the fault window everything is healed (partitions, stalls), armed triggers are
dropped and ``scenario.on_quiet`` runs; the quiet window follows, then the checkers' ``at_end``.

Failures are classified: *crash* (an exception escaping a live host), *zombie* (code of a dead
incarnation running on: a network operation after the death instant, or a host task that outlived
its kill), *liveness* (watchdog, livelock, or a checker), *safety* (checkers).

Every RNG derives from the seed: trio's scheduler, link jitter (``seed:link:a->b``), each host
incarnation's ``rng`` (``seed:host:<name>:<life>``, where life counts that name's incarnations,
so removing an unrelated fault leaves the other hosts' randomness alone), and the scenario's
(``seed:scenario``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import random
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Self, TypeVar

import trio
import trio.testing

from .schedule import FaultEvent, Schedule
from .tap import FrameFormat, Tap
from .determinism import derive_rng, deterministic_trio, poll_only_when_idle, sim_clock
from .hosts import CURRENT_INCARNATION, Incarnation
from .network import World
from .topology import LinkSpec
from .streams import SimNetwork
from .trace import Trace, TraceEvent

__all__ = ["Scenario", "Checker", "HostContext", "Simulation", "RunOptions", "run", "simulate"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class Checker:
    """An invariant over the run.  Subclass; report with ``sim.fail(kind, message, source)``.

    ``on_event`` sees every trace event right after it is recorded (the invariant is checked
    after the event that could break it); ``at_end`` runs once after the quiet window.
    """

    name = "checker"

    def attach(self, sim: "Simulation") -> None:
        """Called once before any host starts, after ``sim.tap`` exists (when the run sniffs
        frames): subscribe to the wire here (``sim.tap.watch``)."""

    def on_event(self, sim: "Simulation", event: TraceEvent) -> None:
        pass

    def at_end(self, sim: "Simulation") -> None:
        pass


class Scenario:
    """What runs on the simulated hosts.  Subclass it.

    Roles are async methods named after the role: ``async def master(self, host)`` and
    ``async def peer(self, host)`` by default.  A host's role comes from its spawn event, else
    :meth:`role_of`.  The base class keeps ``params`` (plain data, stored in the schedule).

    Tools reach a scenario only through its registered ``name`` (:mod:`pccl_sim.tools.scenarios`) and
    these class methods: :meth:`from_json` rebuilds it from a schedule, :meth:`generate_schedule`
    draws a schedule for it from a seed.
    """

    name = "scenario"
    #: Parse the wire in every run (phases, ``Tap.watch``), not only when a trigger needs it.
    sniff = False
    #: The network each host gets (``host.network``): the engine's, or a workload's flavour of it
    #: that speaks the code under test's transport interface and errors.
    network_class: ClassVar[type[SimNetwork]] = SimNetwork

    def __init__(self, **params: Any) -> None:
        self.params = params

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.params}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The scenario :meth:`to_json` described (``data`` is a schedule's ``scenario``)."""
        return cls(**{k: v for k, v in data.items() if k != "name"})

    @classmethod
    def generate_schedule(
        cls, seed: int, *, profile: str, peers: int, duration: float, quiet: float | None = None, **params: Any
    ) -> tuple[Scenario, Schedule]:
        """A fault schedule drawn from ``seed`` (:func:`pccl_sim.faults.generate.generate` with this
        scenario's vocabulary), and the scenario it describes; ``quiet=None``: the scenario's
        own recovery window.  ``params`` go to the scenario."""
        raise NotImplementedError(f"scenario {cls.name!r} has no schedule generator")

    def initial_hosts(self) -> list[tuple[str, str]]:
        """``(host name, role)`` started at t = 0, in this order."""
        peers = int(self.params.get("peers", 2))
        return [("master", "master")] + [(f"peer{i}", "peer") for i in range(peers)]

    def role_of(self, host: str) -> str:
        return "master" if host == "master" else "peer"

    def configure(self, sim: "Simulation") -> None:
        """Set up the network (``sim.world.set_link`` …) before any host starts."""

    def frame_format(self) -> FrameFormat | None:
        """How to read this scenario's wire (enables message triggers and phases)."""
        return None

    def checkers(self) -> Sequence[Checker]:
        return ()

    def coverage_phases(self) -> Sequence[str]:
        """Phases the coverage table lists for fault victims even when no fault hit them."""
        return ()

    def master_coverage_phases(self) -> Sequence[str]:
        """The same for the master's phase (default: :meth:`coverage_phases`)."""
        return self.coverage_phases()

    def on_quiet(self, sim: "Simulation") -> None:
        """The fault window ended and the network is healed; e.g. restart dead hosts."""

    async def master(self, host: "HostContext") -> None:
        raise NotImplementedError

    async def peer(self, host: "HostContext") -> None:
        raise NotImplementedError


@dataclasses.dataclass
class HostContext:
    """What a host's code gets: its identity, its network, its RNG."""

    name: str
    role: str
    incarnation: int  # globally unique, monotonic
    life: int  # 1 for the first incarnation of this name, 2 after one restart, …
    network: SimNetwork
    rng: random.Random
    sim: "Simulation"

    def record(self, kind: str, **data: Any) -> TraceEvent:
        """Append a trace event from this host (plain data only)."""
        return self.sim.trace.record(self.name, kind, **data)

    @property
    def now(self) -> float:
        return trio.current_time()

    async def sleep(self, seconds: float) -> None:
        """``trio.sleep(seconds)`` for the host's simulated work, cheaper; ordered as
        :meth:`~pccl_sim.engine.clock.EventQueue.sleep_until` says.  ``ValueError`` for a negative or
        NaN duration, as trio's."""
        if not seconds >= 0:
            raise ValueError(f"sleep: seconds must be >= 0, got {seconds!r}")
        await self.sim.world.sleep_until(trio.current_time() + seconds)


@dataclasses.dataclass
class _HostRecord:
    context: HostContext
    inc: Incarnation
    scope: trio.CancelScope
    exited_at: float | None = None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Knobs of a run that are not part of the schedule."""

    default_link: LinkSpec = LinkSpec()
    send_buffer: int = 256 * 1024
    #: Loop iterations at one virtual instant before the run is declared livelocked.
    livelock_iterations: int = 200_000
    #: Count trio task steps (costs a few % of speed; for benchmarks).
    count_task_steps: bool = False
    #: Parse frames even when no trigger needs it (phases for coverage).
    sniff: bool = False


#: The collector's young-generation threshold during a run (see :func:`run`).
_GC_YOUNG_THRESHOLD = 20_000


class _LoopInstrument(trio.abc.Instrument):
    """The livelock watchdog (:meth:`iteration`, called once per scheduler loop iteration) and,
    for benchmarks, a task step counter (an instrument hook, installed only when asked for)."""

    def __init__(self, sim: "Simulation", clock: trio.testing.MockClock, limit: int, steps: bool) -> None:
        self.sim = sim
        self.clock = clock
        self.limit = limit
        self.iterations = 0
        self.task_steps = 0
        self._instant = -math.inf
        self._same = 0
        if steps:
            self.before_task_step = self._step  # type: ignore[method-assign]

    def _step(self, task: Any) -> None:
        self.task_steps += 1

    def iteration(self) -> None:
        """Once per scheduler loop iteration (see :func:`~pccl_sim.engine.determinism.poll_only_when_idle`)."""
        self.iterations += 1
        now = self.clock.current_time()
        if now == self._instant:
            self._same += 1
            if self._same == self.limit:
                self.sim.livelock(now, self._same)
        else:
            self._instant = now
            self._same = 0


class Simulation:
    """The live state of one run; scenarios, checkers and the fault injector act through it."""

    def __init__(self, scenario: Scenario, schedule: Schedule, options: RunOptions) -> None:
        self.scenario = scenario
        self.schedule = schedule
        self.options = options
        self.seed = schedule.seed
        self.trace = Trace()
        self.world = World(
            seed=schedule.seed, network_class=scenario.network_class, trace=self.trace,
            default_link=options.default_link, send_buffer=options.send_buffer,
        )
        self.world.on_zombie = self._zombie
        self.rng = derive_rng(schedule.seed, "scenario")
        self.hosts: dict[str, _HostRecord] = {}
        self.dead: list[_HostRecord] = []
        self.checkers = list(scenario.checkers())
        self.tap: Tap | None = None
        self.quiet_at = schedule.duration
        self.in_quiet = False
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._finished = trio.Event()
        self._lives: dict[str, int] = {}
        self._zombies: set[int] = set()
        self.trace.listeners.append(self._dispatch)

    # -- queries --

    @property
    def now(self) -> float:
        return trio.current_time()

    def alive(self, role: str | None = None) -> list[str]:
        """Names of live hosts (in spawn order), optionally of one role."""
        return [n for n, r in self.hosts.items() if role is None or r.context.role == role]

    def context(self, name: str) -> HostContext | None:
        record = self.hosts.get(name)
        return None if record is None else record.context

    # -- verdicts --

    def fail(self, kind: str, message: str, source: str = "runner") -> None:
        self.trace.fail(kind, source, message)

    def finish(self) -> None:
        """End the run now (after the checkers' ``at_end``)."""
        self._finished.set()

    def _dispatch(self, event: TraceEvent) -> None:
        if event.kind == "failure":
            return
        for checker in self.checkers:
            checker.on_event(self, event)

    def _zombie(self, inc: Incarnation, operation: str) -> None:
        if inc.number in self._zombies:
            return  # one verdict per incarnation, not one per operation
        self._zombies.add(inc.number)
        self.fail(
            "zombie",
            f"{operation} by {inc.name}#{inc.number}, which died ({inc.death}) at t={inc.died_at}",
            inc.name,
        )

    def livelock(self, now: float, iterations: int) -> None:
        """The watchdog's verdict: ``iterations`` scheduler loop iterations at virtual time ``now``
        without it moving on.  Fails the run and ends it."""
        self.fail("liveness", f"livelock: {iterations} scheduler iterations without virtual time passing at t={now}")
        self._finished.set()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # -- host lifecycle --

    def spawn(self, name: str, role: str | None = None) -> HostContext | None:
        """Start a new incarnation of ``name`` (``None`` if one is alive already)."""
        if name in self.hosts:
            self.trace.record("faults", "skipped", reason="alive", host=name, action="spawn")
            return None
        assert self._nursery is not None
        role = role or self.scenario.role_of(name)
        network = self.world.boot(name)
        inc = network.incarnation
        life = self._lives[name] = self._lives.get(name, 0) + 1
        ctx = HostContext(name, role, inc.number, life, network, derive_rng(self.seed, "host", name, life), self)
        record = _HostRecord(ctx, inc, trio.CancelScope())
        self.hosts[name] = record
        self._nursery.start_soon(self._host_main, record, name=f"host:{name}#{inc.number}")
        return ctx

    def kill(self, name: str, *, power_off: bool = False) -> bool:
        """Kill (or power off) ``name``: cut its network first, then cancel its tasks."""
        record = self.hosts.pop(name, None)
        if record is None:
            if power_off:
                self.world.power_off(name)  # a machine with no process can still be switched off
            self.trace.record("faults", "skipped", reason="dead", host=name, action="power_off" if power_off else "kill")
            return False
        if power_off:
            self.world.power_off(name)
        else:
            self.world.kill(name)
        record.scope.cancel()
        self.dead.append(record)
        return True

    async def _host_main(self, record: _HostRecord) -> None:
        CURRENT_INCARNATION.set(record.inc)
        ctx = record.context
        main: Callable[[HostContext], Awaitable[None]] = getattr(self.scenario, ctx.role)
        self.trace.record(ctx.name, "start", role=ctx.role, incarnation=ctx.incarnation, life=ctx.life)
        try:
            with record.scope:
                await main(ctx)
            if record.inc.alive:
                self.trace.record(ctx.name, "exit")
        except BaseException as exc:  # noqa: BLE001 - classify everything a host raises
            self._classify(record, exc)
        finally:
            record.exited_at = trio.current_time()
            inc = record.inc
            if not inc.alive and inc.died_at is not None and record.exited_at > inc.died_at:
                self.fail(
                    "zombie",
                    f"{ctx.name}#{inc.number} kept running {record.exited_at - inc.died_at:.6f} s after its {inc.death}",
                    ctx.name,
                )
            if inc.alive:  # returned or crashed: the process exits, its kernel closes its sockets
                self.hosts.pop(ctx.name, None)
                self.world.hosts.end(ctx.name, "exit")

    def _classify(self, record: _HostRecord, exc: BaseException) -> None:
        leaves = [e for e in _leaves(exc) if not isinstance(e, trio.Cancelled)]
        ctx = record.context
        if not leaves:
            return  # cancelled: killed, or the run is shutting down
        first = leaves[0]
        text = _ADDRESS.sub(" at 0x?", f"{type(first).__name__}: {first}")
        if not record.inc.alive or self.shutting_down:
            # Kill races: a corpse may see a reset before its Cancelled lands; not a crash.
            self.trace.record(ctx.name, "corpse_error", error=text)
            return
        logger.debug("host %s crashed", ctx.name, exc_info=exc)
        self.fail("crash", f"{text}" + (f" (+{len(leaves) - 1} more)" if len(leaves) > 1 else ""), ctx.name)

    # -- faults --

    def apply(self, event: FaultEvent) -> None:
        """Apply one fault now (synchronously; timed undo parts are scheduled)."""
        self.trace.record("faults", "fault", event=event.to_json())
        kind = event.kind
        if kind == "spawn":
            assert event.host is not None
            self.spawn(event.host, event.role)
        elif kind in ("kill", "power_off"):
            assert event.host is not None
            self.kill(event.host, power_off=kind == "power_off")
        elif kind in ("restart", "master_restart"):
            name = event.victim
            assert name is not None
            role = self.hosts[name].context.role if name in self.hosts else None
            self.kill(name)
            self._later(event.duration, lambda: self.spawn(name, role))
        elif kind == "stall":
            assert event.host is not None
            host = event.host
            self.world.stall(host)
            self._later(event.duration, lambda: self.world.unstall(host))
        elif kind in ("partition", "clog"):
            if kind == "partition":
                pid = self.world.partition(event.side, event.other, both_ways=event.both_ways)
            else:
                assert event.host is not None and event.other is not None
                pid = self.world.partition([event.host], event.other, both_ways=False)
            self._later(event.duration, lambda: self.world.heal(pid))
        else:  # pragma: no cover - FaultEvent validates kinds
            raise ValueError(kind)

    def start_task(self, fn: Callable[..., Awaitable[object]], *args: Any, name: str) -> None:
        """Run ``fn(*args)`` as a simulator task (not a host: no fault reaches it; it is
        cancelled when the run ends).  For scenario monitors that probe state periodically."""
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args, name=name)

    def _later(self, delay: float, action: Callable[[], object]) -> None:
        async def after() -> None:
            await self.world.sleep_until(trio.current_time() + delay)
            action()  # after heal_all an unstall or heal is a no-op; a restart still happens

        assert self._nursery is not None
        if delay <= 0:
            action()
        else:
            self._nursery.start_soon(after)

    async def _inject(self) -> None:
        for _, event in self.schedule.sorted_events():
            if event.t >= self.schedule.duration:
                break
            await self.world.sleep_until(event.t)
            if event.trigger is not None:
                assert self.tap is not None
                self.trace.record("faults", "armed", event=event.to_json())
                self.tap.arm(event)
            else:
                self.apply(event)

    def _fire(self, event: FaultEvent) -> None:
        self.trace.record("faults", "triggered", trigger=event.trigger.describe() if event.trigger else "")
        self.apply(event)

    def _begin_quiet(self) -> None:
        self.in_quiet = True
        if self.tap is not None:
            for event in self.tap.disarm_all():
                self.trace.record("faults", "expired", event=event.to_json())
        self.world.heal_all()
        self.trace.record("runner", "quiet")
        self.scenario.on_quiet(self)

    # -- the run --

    async def main(self) -> None:
        schedule = self.schedule
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            # (no delivery task: the clock delivers the network's events, see run())
            needs_tap = (
                self.options.sniff or self.scenario.sniff or any(e.trigger is not None for e in schedule.events)
            )
            if needs_tap:
                self.tap = Tap(self.scenario.frame_format(), self._fire)  # phases live in the tap
                self.world.tap = self.tap
            self.scenario.configure(self)
            for checker in self.checkers:
                checker.attach(self)
            self.trace.record("runner", "begin", seed=self.seed, scenario=self.scenario.to_json(), events=len(schedule.events))
            for name, role in self.scenario.initial_hosts():
                self.spawn(name, role)
            nursery.start_soon(self._inject, name="sim:faults")
            # The watchdog: this deadline is always armed, so autojump always has somewhere to go.
            with trio.move_on_at(schedule.duration):
                await self._finished.wait()
            if not self._finished.is_set():
                self._begin_quiet()
                with trio.move_on_at(schedule.horizon):
                    await self._finished.wait()
            if not nursery.cancel_scope.cancel_called:
                self.trace.record("runner", "end")
                for checker in self.checkers:
                    checker.at_end(self)
            self.shutting_down = True
            nursery.cancel_scope.cancel()
        for record in self.dead:
            if record.exited_at is None:
                self.fail("zombie", f"{record.context.name}#{record.inc.number} never finished after its {record.inc.death}")


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for inner in exc.exceptions:
            out.extend(_leaves(inner))
        return out
    return [exc]


@contextlib.contextmanager
def _rare_collection(*, collect_first: bool = True) -> Iterator[None]:
    """The cyclic collector, rarely, for the length of a run.  It cost ~3% of a run: with the
    default threshold (700) a young pass ran every few hundred scheduler steps (trio allocates
    and frees many containers per step, few survive), and full passes walked the whole heap.
    During the run: young passes per 20,000 net allocations, and what is alive now (modules, the
    caller's earlier results; it outlives the run) is frozen out of full passes.  Restored
    afterwards.  ``collect_first`` collects before freezing (a full pass: tens of milliseconds
    in a large process, too much for the many short runs of :func:`simulate` in a test run)."""
    if collect_first:
        gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def run(scenario: Scenario, schedule: Schedule, *, options: RunOptions | None = None) -> Trace:
    """Run ``scenario`` under ``schedule`` deterministically; return the trace (``trace.ok``,
    ``trace.failures``, ``trace.hash()``, ``trace.stats``).

    Exceptions escaping the simulator itself (not a host) propagate: that is a simulator bug.
    """
    options = options or RunOptions()
    sim = Simulation(scenario, schedule, options)
    clock = sim_clock(sim.world.queue)  # delivers the network's events when the run goes idle
    instrument = _LoopInstrument(sim, clock, options.livelock_iterations, options.count_task_steps)

    async def main() -> None:
        poll_only_when_idle(instrument.iteration)
        await sim.main()

    with _rare_collection():
        wall = time.perf_counter()  # outside the simulated run: statistics only, never hashed
        with deterministic_trio(schedule.seed):
            trio.run(main, clock=clock, instruments=[instrument] if options.count_task_steps else [])
    elapsed = time.perf_counter() - wall
    trace = sim.trace
    trace.stats.update(
        wall_seconds=elapsed,
        virtual_seconds=clock.current_time(),
        loop_iterations=instrument.iterations,
        network=sim.world.statistics(),
        messages_seen=sim.tap.messages_seen if sim.tap is not None else 0,
    )
    if options.count_task_steps:
        trace.stats["task_steps"] = instrument.task_steps
    return trace


def simulate(
    fn: Callable[[World], Awaitable[T]],
    *,
    seed: int = 0,
    default_link: LinkSpec | None = None,
    send_buffer: int = 256 * 1024,
    trace: Trace | None = None,
    deadline: float = 3600.0,
    network_class: type[SimNetwork] = SimNetwork,
) -> T:
    """Run ``await fn(world)`` in a deterministic simulated ``trio.run`` over a fresh
    :class:`World`; return its result.  For tests and tools that drive hosts themselves
    (``world.boot(name)`` gives a host's network, a ``network_class``).  ``trio.TooSlowError``
    if ``fn`` has not finished by virtual time ``deadline`` (a deadlock never hangs).

    The loop is :func:`run`'s: the clock delivers the world's events when the run goes idle
    (no task wakes for them), I/O is polled only then, and the cyclic collector runs rarely."""
    world = World(seed=seed, network_class=network_class, trace=trace, default_link=default_link,
                  send_buffer=send_buffer)

    async def main() -> T:
        poll_only_when_idle(_no_watchdog)
        with trio.fail_at(deadline):
            return await fn(world)

    with _rare_collection(collect_first=False), deterministic_trio(seed):
        return trio.run(main, clock=sim_clock(world.queue))


def _no_watchdog() -> None:
    """:func:`simulate`'s per-iteration hook: its deadline is the only watchdog."""
