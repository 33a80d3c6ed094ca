"""Which of this peer's calls may run at the same time: the one phase rule (sans-IO).

A peer is, towards the master, in at most one of these phases at a time:

======================  ==========================================================================
idle                    nothing outstanding
topology vote (kind)    ``update_topology()`` ("accept") or the all-reduce's re-wire ("rewire")
                        has voted and the round has not completed — also after the caller was
                        cancelled: the vote stands at the master until its round completes
collectives {tags}      all-reduces in flight, by tag (several at once; each tag once) — also
                        the *abandoned* ones: cancelled before the master answered their vote,
                        they wait for its answer to a withdrawal (one round trip) in the
                        background; the session waits for them before it lets a call that
                        needs their tag, or no collective in flight, go ahead
sync                    ``sync_shared_state()`` is running
======================  ==========================================================================

Rules (each refusal is ``InvalidUsage``, the caller's mistake, raised before anything is sent —
the master would otherwise kick the peer as OUT_OF_PHASE):

* a topology vote needs no collective in flight and no sync; a vote of the same kind that is
  still outstanding is joined, one of the other kind refuses;
* a collective needs no sync and no outstanding topology vote, and its tag must not be in flight;
* a sync needs no outstanding topology vote, no other sync and no collective in flight.

``are_peers_pending()`` is legal in every phase.  This module is pure state: the session and
the services tell it when a phase begins and ends, and it answers "may I start X now".
"""

from __future__ import annotations

from ..errors import InvalidUsage

__all__ = ["PhaseRule"]


class PhaseRule:
    """The phase a peer is in (see the module docstring)."""

    def __init__(self) -> None:
        self._topology: str | None = None
        self._tags: set[int] = set()
        self._abandoned: set[int] = set()  # a subset of _tags
        self._syncing = False

    # --- what is going on --------------------------------------------------------------------

    @property
    def topology_vote(self) -> str | None:
        """The kind ("accept" or "rewire") of the outstanding topology vote, or ``None``."""
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
            return f"topology vote ({self._topology})"
        if self._syncing:
            return "shared-state sync"
        if self._tags:
            return f"collectives {sorted(self._tags)}"
        return "idle"

    # --- topology votes ----------------------------------------------------------------------

    def join_topology(self, kind: str) -> bool:
        """May a topology vote of ``kind`` go ahead?  ``True``: one of that kind is outstanding,
        wait for it (do not vote again); ``False``: vote, then :meth:`begin_topology`."""
        if self._tags:
            raise InvalidUsage(f"cannot update the topology while collective tags {sorted(self._tags)} are in flight")
        if self._syncing:
            raise InvalidUsage("cannot update the topology while a shared-state sync is running")
        if self._topology is None:
            return False
        if self._topology != kind:
            raise InvalidUsage(f"a topology vote of another kind ({self._topology}) is still outstanding")
        return True

    def begin_topology(self, kind: str) -> None:
        """A topology vote of ``kind`` is outstanding from now on (also the acceptance a newly
        registered peer waits for, which is an "accept" round)."""
        assert self._topology is None, "shell bug: two topology votes at once"
        self._topology = kind

    def end_topology(self) -> None:
        self._topology = None

    # --- collectives -------------------------------------------------------------------------

    def begin_collective(self, tag: int) -> None:
        """Collective ``tag`` is in flight from now on (until :meth:`end_collective`)."""
        if tag in self._tags:
            raise InvalidUsage(f"collective tag {tag} is already in flight")
        if self._syncing:
            raise InvalidUsage("cannot start a collective while a shared-state sync is running")
        self._refuse_during_topology_vote("start a collective")
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
        self._refuse_during_topology_vote("synchronise the shared state")
        if self._syncing:
            raise InvalidUsage("a shared-state sync is already running on this communicator")
        if self._tags:
            raise InvalidUsage(f"cannot sync shared state while collective tags {sorted(self._tags)} are in flight")
        self._syncing = True

    def end_sync(self) -> None:
        self._syncing = False

    def _refuse_during_topology_vote(self, what: str) -> None:
        # A cancelled update_topology() leaves its vote standing at the master, which would kick
        # this peer (OUT_OF_PHASE) for a collective or sync vote until that round completes.
        if self._topology is not None:
            raise InvalidUsage(f"cannot {what} while a topology vote ({self._topology}) is outstanding; "
                               "call update_topology() again to finish it")
