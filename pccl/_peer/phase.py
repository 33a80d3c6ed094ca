"""Which of this peer's calls may run at the same time: the one phase rule (sans-IO).

A peer is, towards the master, in at most one of these phases at a time:

======================  ==========================================================================
idle                    nothing outstanding
topology vote (kind)    ``update_topology()`` (``ACCEPT``), the all-reduce's re-wire (``REWIRE``) or
                        ``optimize_topology()`` (``OPTIMIZE``) has voted and the round has not
                        completed — also after the caller was
                        cancelled: the vote stands at the master until its round completes
collectives {tags}      all-reduces in flight, by tag (several at once; each tag once) — also
                        the *abandoned* ones: cancelled before the master answered their vote,
                        they wait for its answer to a withdrawal (one round trip) in the
                        background; the session waits for them before it lets a call that
                        needs their tag, or no collective in flight, go ahead
sync                    ``sync_shared_state()`` is running
======================  ==========================================================================

Rules: the phase table of :mod:`pccl.protocol.phases` — the rows the master enforces — read
from this side.  Each refusal is ``InvalidUsage``, the caller's mistake, raised before anything
is sent (the master would otherwise kick the peer as OUT_OF_PHASE):

* a topology vote needs no collective in flight and no sync; a vote of the same kind that is
  still outstanding is joined, one of the other kind refuses;
* a collective needs no sync and no outstanding topology vote, and its tag must not be in flight;
* a sync needs no outstanding topology vote, no other sync and no collective in flight.

``are_peers_pending()`` is legal in every phase (no activity of this rule refuses it); the
session joins its own unanswered query (the ``PENDING_QUERY`` row).  This module is pure state:
the session and the services tell it when a phase begins and ends, and it answers "may I start
X now" (:meth:`PhaseRule.check`).
"""

from __future__ import annotations

from ..errors import InvalidUsage
from ..protocol.phases import RULES, Activity, Call, TopologyVote

__all__ = ["PhaseRule"]

#: The refusal for every (call, activity) pair of the phase table that this rule tracks
#: (formatted with ``tags``, the collectives in flight, and ``kind``, the outstanding topology
#: vote's).  A topology vote refused by one of its own kind is joined instead.
_REFUSAL: dict[tuple[Call, Activity], str] = {
    (Call.TOPOLOGY_VOTE, Activity.TOPOLOGY): "a topology vote of another kind ({kind}) is still outstanding",
    (Call.TOPOLOGY_VOTE, Activity.COLLECTIVE): "cannot update the topology while collective tags {tags} are in flight",
    (Call.TOPOLOGY_VOTE, Activity.SYNC): "cannot update the topology while a shared-state sync is running",
    (Call.OPTIMIZE_VOTE, Activity.TOPOLOGY): "a topology vote of another kind ({kind}) is still outstanding",
    (Call.OPTIMIZE_VOTE, Activity.COLLECTIVE): "cannot optimise the topology while collective tags {tags} are in "
                                               "flight",
    (Call.OPTIMIZE_VOTE, Activity.SYNC): "cannot optimise the topology while a shared-state sync is running",
    (Call.COLLECTIVE, Activity.TOPOLOGY): "cannot start a collective while a topology vote ({kind}) is outstanding; "
                                          "call update_topology() again to finish it",
    (Call.COLLECTIVE, Activity.SYNC): "cannot start a collective while a shared-state sync is running",
    (Call.SYNC, Activity.TOPOLOGY): "cannot synchronise the shared state while a topology vote ({kind}) is "
                                    "outstanding; call update_topology() again to finish it",
    (Call.SYNC, Activity.COLLECTIVE): "cannot sync shared state while collective tags {tags} are in flight",
    (Call.SYNC, Activity.SYNC): "a shared-state sync is already running on this communicator",
}

#: The activities this rule tracks (PENDING_QUERY is the session's one waiter).
TRACKED = (Activity.TOPOLOGY, Activity.COLLECTIVE, Activity.SYNC)


class PhaseRule:
    """The phase a peer is in (see the module docstring)."""

    def __init__(self) -> None:
        self._topology: TopologyVote | None = None
        self._tags: set[int] = set()
        self._abandoned: set[int] = set()  # a subset of _tags
        self._syncing = False

    # --- what is going on --------------------------------------------------------------------

    @property
    def topology_vote(self) -> TopologyVote | None:
        """The kind of the outstanding topology vote, or ``None``."""
        return self._topology

    @property
    def collectives(self) -> frozenset[int]:
        """Tags of the collectives in flight."""
        return frozenset(self._tags)

    @property
    def abandoned(self) -> frozenset[int]:
        """Tags of the collectives in flight whose caller is gone (see the module docstring)."""
        return frozenset(self._abandoned)

    @property
    def syncing(self) -> bool:
        return self._syncing

    def describe(self) -> str:
        """The current phase in words (for logs and errors)."""
        if self._topology is not None:
            return f"topology vote ({self._topology.value})"
        if self._syncing:
            return "shared-state sync"
        if self._tags:
            return f"collectives {sorted(self._tags)}"
        return "idle"

    def active(self, activity: Activity) -> bool:
        """Whether this peer is in the middle of ``activity`` (``PENDING_QUERY``: never, here)."""
        if activity is Activity.TOPOLOGY:
            return self._topology is not None
        if activity is Activity.COLLECTIVE:
            return bool(self._tags)
        if activity is Activity.SYNC:
            return self._syncing
        return False

    def check(self, call: Call, *, kind: TopologyVote | None = None) -> bool:
        """May ``call`` go ahead now, by the phase table?  ``False``: yes, vote; ``True``: an
        outstanding one it joins is there (a topology vote of the same ``kind``): wait for that
        one, do not vote again.  ``InvalidUsage`` if an activity refuses it."""
        rule = RULES[call]
        for activity in rule.refused_while:
            if not self.active(activity):
                continue
            if activity is rule.joins and activity is Activity.TOPOLOGY and self._topology == kind:
                return True
            kind_text = self._topology.value if self._topology is not None else None
            raise InvalidUsage(_REFUSAL[call, activity].format(tags=sorted(self._tags), kind=kind_text))
        return False

    # --- topology votes ----------------------------------------------------------------------

    def join_topology(self, kind: TopologyVote) -> bool:
        """May a topology vote of ``kind`` go ahead?
        ``True``: one of that kind is outstanding, wait for it (do not vote again); ``False``:
        vote, then :meth:`begin_topology`."""
        return self.check(Call.OPTIMIZE_VOTE if kind is TopologyVote.OPTIMIZE else Call.TOPOLOGY_VOTE, kind=kind)

    def begin_topology(self, kind: TopologyVote) -> None:
        """A topology vote of ``kind`` is outstanding from now on (also the acceptance a newly
        registered peer waits for, which is an ``ACCEPT`` round)."""
        assert self._topology is None, "shell bug: two topology votes at once"
        self._topology = kind

    def end_topology(self) -> None:
        self._topology = None

    # --- collectives -------------------------------------------------------------------------

    def begin_collective(self, tag: int) -> None:
        """Collective ``tag`` is in flight from now on (until :meth:`end_collective`)."""
        if tag in self._tags:
            raise InvalidUsage(f"collective tag {tag} is already in flight; concurrent collectives need distinct "
                               f"tags: pass tag= a number no other call in flight uses")
        self.check(Call.COLLECTIVE)
        self._tags.add(tag)

    def abandon_collective(self, tag: int) -> None:
        """Collective ``tag``'s caller is gone; it stays in flight until :meth:`end_collective`."""
        assert tag in self._tags, "shell bug: abandoning a collective that is not in flight"
        self._abandoned.add(tag)

    def end_collective(self, tag: int) -> None:
        self._tags.discard(tag)
        self._abandoned.discard(tag)

    # --- shared-state sync -------------------------------------------------------------------

    def begin_sync(self) -> None:
        """A sync runs from now on (until :meth:`end_sync`)."""
        self.check(Call.SYNC)
        self._syncing = True

    def end_sync(self) -> None:
        self._syncing = False
