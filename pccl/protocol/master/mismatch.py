"""The master's phase-mismatch sub-machine: end votes that can never meet (sans-IO).

Rules
=====

Phase mismatch.  When every accepted member of a group waits for the others — a topology vote
standing outside any round, a sync vote before the election, or only collective Inits that
have not commenced — and they do not all wait in the same kind of call (a call of
:mod:`pccl.protocol.phases`), none of these votes can ever complete: a peer in a topology vote
or a sync cannot also start a collective, nor the other way round.  The master then withdraws
all of them (``TopologyRejected``, ``CollectiveRejected(PHASE_MISMATCH)`` for each tag,
``SyncRejected(PHASE_MISMATCH)``), naming who waits where; the peers raise ``PhaseMismatch``.
It must first last ``grace`` unchanged (the same members waiting in the same calls): a
withdrawal on its way (a cancelled all-reduce whose peer then votes topology) can still end
it, and the master cannot know.  The grace's end is one of the master's deadlines
(:meth:`PhaseMismatches.deadline`).  Mixed topology votes (accept and re-wire) are one kind,
and so are collectives on different tags: those can still meet (an accept vote satisfies a
re-wire; a peer with tag 0 pending may still send tag 1).

Checked with the master's other consensus predicates — after a collective message on that op's
group alone, so it stays cheap: collectives alone never mismatch, and the member last seen not
waiting is asked first.  The machine sees the master only through :class:`MismatchHost`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from .. import phases as ph
from ..codec import MAX_DETAIL, clip_text

__all__ = ["PhaseMismatches", "MismatchHost"]

log = logging.getLogger("pccl.protocol.master.machine")


@dataclasses.dataclass(frozen=True)
class MismatchHost:
    """What the phase-mismatch machine needs from the master, as callables."""

    #: the accepted peers of a group
    members: Callable[[int], list[int]]
    #: whether some member of the group has a topology or sync vote waiting (with neither, collectives alone: no mismatch is possible)
    may_wait: Callable[[int], bool]
    #: for a group as it is now: member id -> the call it waits in for the others and its name as the caller knows it, ``None`` when it does not wait
    waiting_calls: Callable[[int], Callable[[int], tuple[ph.Call, str] | None]]
    #: withdraw every member's waiting vote with this detail
    end_waiting: Callable[[int, str], None]


class PhaseMismatches:
    """Every group's phase mismatch in its grace period (see the module docstring)."""

    def __init__(self, host: MismatchHost, *, grace: float) -> None:
        self._host = host
        self.grace = grace
        #: group -> (since when, who waits where) of a mismatch inside its grace period.
        self._since: dict[int, tuple[float, frozenset[tuple[int, str]]]] = {}
        #: group -> the member last found not waiting (asked first next time).
        self._not_waiting: dict[int, int] = {}

    def check(self, group: int, now: float) -> bool:
        """End ``group``'s mismatch if it has lasted the grace period; whether it did."""
        waits = self._mismatch(group)
        if waits is None:
            self._since.pop(group, None)
            return False
        seen = frozenset(waits.items())
        since, before = self._since.get(group, (now, seen))
        if before != seen:
            since = now
        if now < since + self.grace:
            self._since[group] = (since, seen)
            return False
        del self._since[group]
        listing = "; ".join(f"peer {pid:x} in {call}" for pid, call in sorted(waits.items()))
        detail = clip_text(f"phase mismatch in group {group}: {listing}; none of these calls can complete "
                           "while the others wait elsewhere", MAX_DETAIL)
        log.warning("group %d: %s: ending every one of these calls", group, detail)
        self._host.end_waiting(group, detail)
        return True

    def _mismatch(self, group: int) -> dict[int, str] | None:
        """Who waits where in ``group`` if it is in a phase mismatch."""
        members = self._host.members(group)
        if len(members) < 2 or not self._host.may_wait(group):
            return None  # collectives alone never mismatch (the cheap common case, per Init)
        waits_in = self._host.waiting_calls(group)
        hint = self._not_waiting.get(group)
        if hint is not None and hint in members and waits_in(hint) is None:
            return None
        waits: dict[int, str] = {}
        kinds: set[ph.Call] = set()
        for pid in members:
            waiting = waits_in(pid)
            if waiting is None:
                self._not_waiting[group] = pid
                return None
            kinds.add(waiting[0])
            waits[pid] = waiting[1]
        return waits if len(kinds) >= 2 else None

    def keep_only(self, groups: set[int]) -> None:
        """Forget the groups that have no accepted member any more."""
        for table in (self._since, self._not_waiting):
            if table and not groups.issuperset(table):
                for group in [g for g in table if g not in groups]:
                    del table[group]

    def deadline(self) -> float | None:
        """When the earliest grace period ends (``None``: no mismatch waits)."""
        if not self._since:
            return None
        return min(since for since, _ in self._since.values()) + self.grace

    def in_grace(self) -> frozenset[int]:
        return frozenset(self._since)
