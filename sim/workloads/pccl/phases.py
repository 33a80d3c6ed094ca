"""The step body of the pccl workload: :class:`Phase`, what a phase gets (:class:`StepContext`),
the phase registry, and the simplest phase (:class:`ComputePhase`).

The step body is a list of :class:`Phase` objects built from the scenario parameter ``phases``
(plain data: names, or ``{"name": ..., **params}``).  A phase is added by subclassing
:class:`Phase` and calling :func:`register_phase`::

    class AllReducePhase(Phase):
        name = "all_reduce"
        async def run(self, step: StepContext) -> None:
            info = await step.comm.all_reduce(x, op=pccl.ReduceOp.SUM, tag=0)
            step.record("all_reduce", seq=..., world_size=info.world_size, digest=...)
        def checkers(self, scenario):
            return [AllReduceAgreement()]       # pccl_sim.engine.runner.Checker subclasses

    register_phase(AllReducePhase)

and adding its module to :data:`PHASE_MODULES` (so fresh processes find it); then
``PcclScenario(phases=["compute", "all_reduce"])`` runs it (CLI: ``--phases compute,all_reduce``).
A phase raising one of its expected errors (``CollectiveAborted``) should record it and return;
``Kicked`` / ``MasterUnreachable`` propagate to the scenario's reconnect logic.  A phase's
checkers are added to the membership checkers of :mod:`pccl_sim.workloads.pccl.checkers`
automatically."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

import pccl

from ...engine.runner import Checker, HostContext

__all__ = [
    "Phase",
    "ComputePhase",
    "StepContext",
    "StepScenario",
    "PHASES",
    "PHASE_MODULES",
    "register_phase",
    "build_phase",
]


class StepScenario(Protocol):
    """What a phase reads of the scenario running it (a
    :class:`~pccl_sim.workloads.pccl.scenario.PcclScenario`)."""

    #: Seconds of simulated compute per step.
    step_time: float


@dataclasses.dataclass
class StepContext:
    """What a phase of the step body gets: the communicator, the host, the step number."""

    host: HostContext
    comm: pccl.Communicator
    step: int
    scenario: StepScenario

    def record(self, kind: str, **data: Any) -> None:
        """A trace event from this peer, tagged with the step number and peer id."""
        self.host.record(kind, step=self.step, peer_id=self.comm.peer_id, **data)


class Phase:
    """One part of the step body.  Subclass, set ``name``, implement :meth:`run`; register with
    :func:`register_phase`.  Parameters come from the scenario's ``phases`` entry."""

    name: ClassVar[str] = "phase"
    #: Control messages of this phase, with the directions a peer sees them in: phase-triggered
    #: faults aim at them too ("kill peer2 after it sends its 3rd CollectiveInit"), so faults
    #: land inside the phase's votes and transfers, not only in membership phases.
    messages: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    #: Phases the coverage table lists even when no fault hit them.
    coverage_phases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **params: Any) -> None:
        self.params = params

    async def run(self, step: StepContext) -> None:
        raise NotImplementedError

    def checkers(self, scenario: StepScenario) -> Sequence[Checker]:
        """Invariants this phase needs (instantiated per run)."""
        return ()


class ComputePhase(Phase):
    """Simulated local compute: sleep ``scenario.step_time`` × uniform(0.5, 1.5) (the peer's RNG)."""

    name = "compute"

    async def run(self, step: StepContext) -> None:
        scale = float(self.params.get("scale", 1.0))
        await step.host.sleep(step.scenario.step_time * scale * (0.5 + step.host.rng.random()))


#: name -> Phase subclass.
PHASES: dict[str, type[Phase]] = {"compute": ComputePhase}
#: name -> module that registers it when imported: a schedule file (or a campaign worker, a fresh
#: process) naming the phase rebuilds it without the caller importing the module first.
PHASE_MODULES: dict[str, str] = {
    "all_reduce": "pccl_sim.workloads.pccl.collectives",
    "collectives": "pccl_sim.workloads.pccl.kinds",
    "sync": "pccl_sim.workloads.pccl.shared_state",
    "optimize": "pccl_sim.workloads.pccl.optimize",
}


def register_phase(cls: type[Phase]) -> type[Phase]:
    """Make ``cls`` available to ``PcclScenario(phases=[cls.name, ...])`` (usable as a decorator)."""
    PHASES[cls.name] = cls
    return cls


def build_phase(spec: str | Mapping[str, Any]) -> Phase:
    """The phase a scenario's ``phases`` entry names (a name, or ``{"name": ..., **params}``);
    ``KeyError`` for an unknown name."""
    if isinstance(spec, str):
        name, params = spec, {}
    else:
        params = {k: v for k, v in spec.items() if k != "name"}
        name = spec["name"]
    if name not in PHASES and name in PHASE_MODULES:
        importlib.import_module(PHASE_MODULES[name])
    if name not in PHASES:
        raise KeyError(f"unknown phase {name!r}; known: {sorted(set(PHASES) | set(PHASE_MODULES))}")
    return PHASES[name](**params)
