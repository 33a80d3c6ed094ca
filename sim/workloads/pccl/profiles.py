"""The step bodies a fault profile exercises: :data:`PROFILE_WORKLOADS` and :func:`profile_phases`.

A profile (:data:`pccl_sim.faults.generate.PROFILES`) says which faults a schedule draws; for the
pccl scenario the ``chaos``, ``phases`` and ``stress`` profiles also say what the peers do each
step when ``--phases`` does not: each seed draws one step body of its profile's list (from its
own stream, ``derive_rng(seed, "workload")``, so the fault draws are those the body's messages
allow).  The bodies cover every collective of the library on concurrent tags — PCCL's own stress
pattern among them: 10 tags, u8-quantized, at most 8 in flight — besides the membership-only
``compute`` body, so a campaign over these profiles puts faults inside each collective's votes and
transfers.  The body a seed ran is in its schedule (scenario ``phases``) and in its campaign
record; ``--phases`` given explicitly overrides the draw, and the ``none`` and ``network``
profiles keep ``compute``.
"""

from __future__ import annotations

from typing import Any

from ...engine.determinism import derive_rng

__all__ = ["PCCL_STRESS_ALL_REDUCE", "EVERY_COLLECTIVE", "EVERY_COLLECTIVE_STRESS", "PROFILE_WORKLOADS",
           "profile_phases"]

#: PCCL's stress test: 10 all-reduces on distinct tags, uint8-quantized, at most 8 in flight,
#: launched in tag order (a later tag starts when an earlier one finished).
PCCL_STRESS_ALL_REDUCE: dict[str, Any] = {"name": "all_reduce", "concurrent": 10, "in_flight": 8,
                                          "quantization": "uint8", "n": 2000}
#: Broadcast, all-gather, reduce-scatter and all-reduce on 8 concurrent tags, at most 6 in
#: flight, unquantized: every result checked against numpy.
EVERY_COLLECTIVE: dict[str, Any] = {"name": "collectives", "concurrent": 8, "in_flight": 6, "n": 3000}
#: Every collective in PCCL's stress pattern: 10 tags, uint8, at most 8 in flight.
EVERY_COLLECTIVE_STRESS: dict[str, Any] = {"name": "collectives", "concurrent": 10, "in_flight": 8,
                                           "quantization": "uint8", "n": 2000}

_MEMBERSHIP = ("compute",)
_ALL_REDUCE = ("compute", "all_reduce")  # one exchange-sized and one ring-sized op per step

#: profile -> the step bodies its seeds draw from (uniformly).
PROFILE_WORKLOADS: dict[str, tuple[tuple[str | dict[str, Any], ...], ...]] = {
    "chaos": (_MEMBERSHIP, _ALL_REDUCE, ("compute", EVERY_COLLECTIVE), ("compute", PCCL_STRESS_ALL_REDUCE),
              ("compute", EVERY_COLLECTIVE_STRESS)),
    "phases": (_MEMBERSHIP, _ALL_REDUCE, ("compute", EVERY_COLLECTIVE), ("compute", PCCL_STRESS_ALL_REDUCE),
               ("compute", EVERY_COLLECTIVE_STRESS)),
    "stress": (("compute", PCCL_STRESS_ALL_REDUCE), ("compute", EVERY_COLLECTIVE_STRESS),
               ("compute", EVERY_COLLECTIVE)),
}


def profile_phases(profile: str, seed: int) -> list[str | dict[str, Any]] | None:
    """The step body ``seed`` of ``profile`` runs (a new list of plain data), or ``None`` for a
    profile without workloads (the scenario's default, ``compute``)."""
    bodies = PROFILE_WORKLOADS.get(profile)
    if not bodies:
        return None
    body = derive_rng(seed, "workload").choice(bodies)
    return [p if isinstance(p, str) else dict(p) for p in body]
