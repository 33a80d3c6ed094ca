"""Faults planted in the data path, for the tests that check the checkers have teeth (a
result off by one must be caught, an abort that leaves the caller's buffer modified must be
caught) and for peer processes that die part-way through a ring.

Each ``plant_*`` function installs its fault at once and returns a :class:`PlantedFault`:
``remove()`` it, or use it as a context manager (``with plant_kind_fault(...):``).  A peer
process that dies with its fault never removes it.  :func:`force_broadcast_algorithm` plants a
choice the same way: every broadcast of the process runs the algorithm it names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._peer import collective_plans as _plans
from .._peer import collective_service as _service
from .._peer import sync as _sync
from ..collectives.kinds import KIND_OPS, KindOps, with_broadcast_algorithm
from ..errors import InvalidArgument
from ..protocol.algorithms import BroadcastAlgorithm
from ..protocol.messages import CollectiveKind

__all__ = ["PlantedFault", "plant_kind_fault", "plant_execute_fault", "plant_backup_fault", "plant_staging_fault", "plant_attempt_fault",
           "plant_serving_fault", "force_broadcast_algorithm"]

RingEntry = Callable[..., Any]


class PlantedFault:
    """One installed fault; :meth:`remove` restores what it replaced (idempotent)."""

    def __init__(self, owner: Any, name: Any, replacement: Any) -> None:
        """Replace ``owner``'s attribute ``name`` (an item, if ``owner`` is a dict)."""
        self.owner, self.name = owner, name
        self.original = owner[name] if isinstance(owner, dict) else getattr(owner, name)
        self._set(replacement)
        self.removed = False

    def _set(self, value: Any) -> None:
        if isinstance(self.owner, dict):
            self.owner[self.name] = value
        else:
            setattr(self.owner, self.name, value)

    def remove(self) -> None:
        if not self.removed:
            self._set(self.original)
            self.removed = True

    def __enter__(self) -> PlantedFault:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def plant_kind_fault(kind: str, change: Callable[[KindOps], KindOps]) -> PlantedFault:
    """Every collective of ``kind`` (``"all_reduce"``, ``"broadcast"``, ``"all_gather"``,
    ``"reduce_scatter"``) in this process runs from ``change(row)`` instead of its row of
    :data:`pccl.collectives.kinds.KIND_OPS` (say, ``dataclasses.replace(row, result=...)``: a
    result off by one, or ``make_op=...``: an op that kills the process part-way through)."""
    try:
        key = CollectiveKind[kind.upper()]
    except KeyError:
        raise InvalidArgument(f"no collective kind {kind!r}; kinds: {sorted(k.name.lower() for k in KIND_OPS)}") from None
    row = KIND_OPS[key]
    changed = change(row)
    if not isinstance(changed, KindOps) or changed.kind != row.kind:
        raise InvalidArgument(f"change must return a row of kind {row.kind.name} (dataclasses.replace(row, ...))")
    return PlantedFault(KIND_OPS, key, changed)


def force_broadcast_algorithm(algorithm: BroadcastAlgorithm | str) -> PlantedFault:
    """Every broadcast in this process runs ``algorithm`` (a :class:`BroadcastAlgorithm` or its
    value) where it can run (:func:`~pccl.protocol.algorithms.choose_broadcast`'s ``forced``:
    quantized ones and rings without partner links keep the chain).  Every peer of a run must
    force the same one, as with ``Config.all_reduce_algorithm``; partner links are wired from 8
    peers, or at any world with a forced ``Config.all_reduce_algorithm`` other than
    ``"ring"``."""
    try:
        forced = BroadcastAlgorithm(algorithm)
    except ValueError:
        names = ", ".join(repr(a.value) for a in BroadcastAlgorithm)
        raise InvalidArgument(f"broadcast algorithm must be one of {names}, got {algorithm!r}") from None
    return plant_kind_fault("broadcast", lambda row: with_broadcast_algorithm(row, forced))


def plant_execute_fault(wrap: Callable[[RingEntry], RingEntry]) -> PlantedFault:
    """Every collective's data path in this process runs ``wrap(real)`` instead of
    :func:`pccl.collectives.execute.execute` as its plan calls it; ``wrap``'s function takes the
    same arguments (``make_op, *, links=, rank=, world=, seq=, keep=, …``) and may change the
    result, stall or kill the process."""
    return PlantedFault(_plans, "execute", wrap(_plans.execute))


def plant_staging_fault(in_place_bytes: int) -> PlantedFault:
    """In-place collectives of more than ``in_place_bytes`` back their input up and reduce into
    it (the others reduce into scratch memory and touch the caller's array only on success);
    0: every in-place op of any data backs up."""
    return PlantedFault(_service, "STAGED_IN_PLACE_BYTES", in_place_bytes)


def plant_backup_fault(error: Callable[[], BaseException | None]) -> PlantedFault:
    """Before a collective in this process keeps its caller's input for an abort (an in-place
    one, once the master commenced it), call ``error()``: an exception it returns (a
    ``MemoryError``, say) is raised where the input would have been kept; ``None`` keeps it."""
    real = _plans.Plan.guard

    def guard(self: Any, stage_up_to: int) -> Any:
        if self.call.keep is not None:
            exc = error()
            if exc is not None:
                raise exc
        return real(self, stage_up_to)

    return PlantedFault(_plans.Plan, "guard", guard)


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
