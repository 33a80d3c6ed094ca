"""The master's phase-mismatch sub-machine: end votes that can never meet (sans-IO).

Rules
=====

Phase mismatch.  When every accepted member of a group waits for the others — a topology vote
standing outside any round, a sync vote before the election, or only collective Inits that
have not commenced — and they do not all wait in the same kind of call (a call of
:mod:`pccl.protocol.phases`), none of these votes can ever complete: a peer in a topology vote
or a sync cannot also start a collective, nor the other way round.  Mixed topology votes (accept
and re-wire) are one kind: an accept vote satisfies a re-wire.

Collectives on different tags.  When every member waits only in collective Inits that have not
commenced and no tag among them has every member's vote, none of them can commence either: each
waits for a member that waits on another tag (``all_reduce(tag=1)`` on one peer and
``all_reduce(tag=2)`` on the other; or launchers that take their in-flight slots in another
order than the tags', each peer holding tags the others have not started).  Peers that start
the same tags in the same order (tags 0..9 with at most 8 in flight, ``all_reduce_many``'s
buckets) never get here: when every member waits, the lowest tag any of them waits on has every
member's vote, so it commences (a member that has not reached it yet is computing, not
waiting).  A member that computes while the others wait — with no Init of its own outstanding,
or with one running — is not waiting, and so keeps every call from being ended.

Either way, the master then withdraws all of these votes (``TopologyRejected``,
``CollectiveRejected(PHASE_MISMATCH)`` for each tag, ``SyncRejected(PHASE_MISMATCH)``), naming
who waits where (and, for collectives, on which tags); the peers raise ``PhaseMismatch``.  It
must first last ``grace`` unchanged (the same members waiting in the same calls on the same
tags; any new vote, withdrawal, join or departure starts it again): a withdrawal on its way (a
cancelled all-reduce whose peer then votes topology) or a peer's next Init on the missing tag
can still end it, and the master cannot know.  So a peer that holds one tag's Init while it
computes for longer than the grace before it sends the tag the others wait on (tags started in
a different order on different peers, with work in between) has its calls ended: start
concurrent tags in the same order on every peer.  The grace's end is one of the master's
deadlines (:meth:`PhaseMismatches.deadline`).

Checked with the master's other consensus predicates — after a collective message on that op's
group alone, so it stays cheap: the member last seen not waiting is asked first, then the
members after it in turn (who waits changes one vote at a time, so the first one asked, or the
next, usually is not waiting), and the whole group only when every member waits.  The machine
sees the master only through :class:`MismatchHost`.
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
    #: for a group as it is now: member id -> the call it waits in for the others and what
    #: gives its name as the caller knows it (asked only once every member waits), ``None``
    #: when it does not wait
    waiting_calls: Callable[[int], Callable[[int], tuple[ph.Call, Callable[[], str]] | None]]
    #: whether some collective vote of the group that has not commenced has every member's Init
    full_vote: Callable[[int], bool]
    #: withdraw every member's waiting vote with this detail
    end_waiting: Callable[[int, str], None]


class PhaseMismatches:
    """Every group's phase mismatch in its grace period (see the module docstring)."""

    def __init__(self, host: MismatchHost, *, grace: float) -> None:
        self._host = host
        self.grace = grace
        #: group -> (since when, who waits where) of a mismatch inside its grace period.
        self._since: dict[int, tuple[float, frozenset[tuple[int, str]]]] = {}
        #: group -> where in its member list the member last found not waiting stood (asked
        #: first next time, then the ones after it).
        self._not_waiting: dict[int, int] = {}

    def check(self, group: int, now: float) -> bool:
        """End ``group``'s mismatch if it has lasted the grace period; whether it did."""
        found = self._mismatch(group)
        if found is None:
            self._since.pop(group, None)
            return False
        waits, across_tags = found
        seen = frozenset(waits.items())
        since, before = self._since.get(group, (now, seen))
        if before != seen:
            since = now
        if now < since + self.grace:
            self._since[group] = (since, seen)
            return False
        del self._since[group]
        if across_tags:
            listing = "; ".join(f"peer {pid:x} waits in {call}" for pid, call in sorted(waits.items()))
            detail = (f"phase mismatch in group {group}: collectives on different tags: {listing}; no tag has "
                      "every member's vote, so none of them can commence")
        else:
            listing = "; ".join(f"peer {pid:x} in {call}" for pid, call in sorted(waits.items()))
            detail = (f"phase mismatch in group {group}: {listing}; none of these calls can complete while the "
                      "others wait elsewhere")
        detail = clip_text(detail, MAX_DETAIL)
        log.warning("group %d: %s: ending every one of these calls", group, detail)
        self._host.end_waiting(group, detail)
        return True

    def _mismatch(self, group: int) -> tuple[dict[int, str], bool] | None:
        """Who waits where in ``group`` and whether only in collectives on different tags, if
        it is in a phase mismatch."""
        members = self._host.members(group)
        n = len(members)
        if n < 2:
            return None
        waits_in = self._host.waiting_calls(group)
        start = self._not_waiting.get(group, 0) % n
        names: dict[int, Callable[[], str]] = {}
        kinds: set[ph.Call] = set()
        for i in range(start, start + n):  # from the member last found not waiting, round the list
            pid = members[i % n]
            waiting = waits_in(pid)
            if waiting is None:
                self._not_waiting[group] = i % n
                return None
            kinds.add(waiting[0])
            names[pid] = waiting[1]
        # (named only now: most checks meet a member that does not wait, and a name costs more
        # than the rest of the check)
        if len(kinds) >= 2:
            return {pid: name() for pid, name in names.items()}, False
        if kinds == {ph.Call.COLLECTIVE} and not self._host.full_vote(group):
            return {pid: name() for pid, name in names.items()}, True
        return None
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
