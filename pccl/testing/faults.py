"""Faults planted in the data path, for the tests that check the checkers have teeth (a
result off by one must be caught, an abort that leaves the caller's buffer modified must be
caught) and for peer processes that die part-way through a ring.

Each ``plant_*`` function installs its fault at once and returns a :class:`PlantedFault`:
``remove()`` it, or use it as a context manager (``with plant_ring_fault(...):``).  A peer
process that dies with its fault never removes it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._peer import collective_plans as _plans
from .._peer import collective_service as _service
from .._peer import sync as _sync
from ..errors import InvalidArgument

__all__ = ["PlantedFault", "RING_KINDS", "plant_ring_fault", "plant_staging_fault", "plant_attempt_fault",
           "plant_serving_fault"]

#: Collective kind -> the data-path entry its plan calls (``reduce_checked`` and its siblings).
RING_KINDS = {
    "all_reduce": "reduce_checked",
    "broadcast": "broadcast_checked",
    "all_gather": "all_gather_checked",
    "reduce_scatter": "reduce_scatter_checked",
}

RingEntry = Callable[..., Any]


class PlantedFault:
    """One installed fault; :meth:`remove` restores what it replaced (idempotent)."""

    def __init__(self, owner: Any, name: str, replacement: Any) -> None:
        self.owner, self.name = owner, name
        self.original = getattr(owner, name)
        setattr(owner, name, replacement)
        self.removed = False

    def remove(self) -> None:
        if not self.removed:
            setattr(self.owner, self.name, self.original)
            self.removed = True

    def __enter__(self) -> PlantedFault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def plant_ring_fault(kind: str, wrap: Callable[[RingEntry], RingEntry]) -> PlantedFault:
    """Every collective of ``kind`` (a key of :data:`RING_KINDS`) in this process runs
    ``wrap(real)`` instead of the real data-path entry ``real``; ``wrap``'s function takes the
    same arguments (``args, *rest, links=, rank=, world=, …``) and may change the result, stall
    or kill the process."""
    if kind not in RING_KINDS:
        raise InvalidArgument(f"no ring entry for kind {kind!r}; kinds: {sorted(RING_KINDS)}")
    name = RING_KINDS[kind]
    return PlantedFault(_plans, name, wrap(getattr(_plans, name)))


def plant_staging_fault(in_place_bytes: int) -> PlantedFault:
    """In-place collectives of at least ``in_place_bytes`` back their input up and reduce into
    it (smaller ones reduce into scratch memory and touch the caller's array only on success);
    0: every in-place op backs up."""
    return PlantedFault(_service, "STAGED_IN_PLACE_BYTES", in_place_bytes)


def plant_attempt_fault(after: Callable[[Any], None]) -> PlantedFault:
    """After every attempt of a collective's data path in this process (success or not), call
    ``after(plan)``: ``plan.args.dst`` is the caller's output buffer — a fault that touches it
    is one the abort checker must catch."""
    real = _service.CollectiveService.run_ring

    async def run_ring(self: Any, plan: Any, *args: Any) -> Any:
        try:
            return await real(self, plan, *args)
        finally:
            after(plan)

    return PlantedFault(_service.CollectiveService, "run_ring", run_ring)


def plant_serving_fault(before: Callable[[Mapping[str, Any]], None]) -> PlantedFault:
    """Before this process serves each shared-state request, call ``before(arrays)`` with the
    arrays it serves, by key (writable): a source whose buffers change after it voted — the
    fault the receiver's hash check must catch."""
    real = _sync.check_request

    def check_request(serving: Any, request: Any) -> Any:
        if serving is not None:
            before(serving.arrays)
        return real(serving, request)

    return PlantedFault(_sync, "check_request", check_request)
