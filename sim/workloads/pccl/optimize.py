"""The optimise step of the pccl workload: ``optimize_topology()`` as a step phase.

:class:`OptimizePhase` (phase name ``"optimize"``) makes every peer call
``comm.optimize_topology()`` every ``every``-th step (default: every step), so that faults land
inside the vote, the probes (the p2p probe connections and the reports) and the install round.
It records ``optimize`` (``ring``, ``world_size``, ``sites``) when the call returns.  The membership
checkers already hold the install round to the rules of every topology round (one ring per
round, attributes that agree); the all-reduce checker, run after it, holds the next op to the
ring the master installed.
"""

from __future__ import annotations

from typing import Any

from .phases import Phase, StepContext, register_phase

__all__ = ["OptimizePhase"]


@register_phase
class OptimizePhase(Phase):
    name = "optimize"
    messages = {
        "VoteOptimize": ("send",),
        "ProbeRequest": ("recv",),
        "ProbeHello": ("send", "recv"),
        "ProbeAck": ("send", "recv"),
        "ProbeEnd": ("send", "recv"),
        "ProbeEndAck": ("send", "recv"),
        "ProbeReport": ("send",),
    }
    coverage_phases = tuple(messages)

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.every = int(params.get("every", 1))
        if self.every < 1:
            raise ValueError("every must be at least 1")

    async def run(self, step: StepContext) -> None:
        if step.step % self.every:
            return
        await step.comm.optimize_topology()
        step.record("optimize", ring=list(step.comm.ring), world_size=step.comm.world_size,
                    sites=list(step.comm.sites))
