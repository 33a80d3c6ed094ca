"""The master's membership votes: accept, re-wire, and the pending query (sans-IO).

Rules
=====

Topology votes.  ``VoteTopology(accept_new_peers=True)`` is a *global* vote: when every accepted
peer of every group has cast it (and no round runs), a **global round** starts over all accepted
peers plus all registered ones.  If nobody is registered and no group's ring is stale, the vote
completes at once without touching p2p connections.  If no peer is accepted at all, registered
peers need nobody's vote: a global round starts for them at once (the first peer is accepted
alone this way).  ``VoteTopology(accept_new_peers=False)`` is a *re-wire* of the voter's group
only: when every accepted peer of the group has cast it (and no round touches the group), a
**group round** starts over them — other groups keep running collectives meanwhile (PCCL makes
re-wiring global, which can deadlock groups against each other).  A peer's vote stays standing
until its round ends.  An accept vote satisfies a pending re-wire of its own group: once every
accepted peer has voted, accept or re-wire, and every group has at least one accept vote, the
global round starts (it re-wires every group), so a peer in ``update_topology`` and one
re-wiring after a stale ring never wait for each other.  A group whose members all re-wire is
mid-step and keeps its own group round: newcomers join it only at a step boundary.

Pending query.  ``VotePeersPending`` from every accepted peer → ``PeersPendingResult(any peer
registered)`` to all of them.  Independent of every other vote, legal while collectives run.
The answer tells a voter whether ``update_topology`` has something to do, so it also comes as
soon as every accepted peer that has not asked waits in an accept vote: ``True`` (the voters'
update completes that vote).  Both votes are global; without this a lone peer of one group
asking, while the other groups wait in ``update_topology`` for it, would wait for ever.

The votes are fields of the master's peer records (:class:`~pccl.protocol.master.peers.PeerRecord`);
this machine reads and clears them through :class:`VotesHost`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .. import messages as m
from .peers import GLOBAL_SCOPE, PeerRecord, PeerStatus, TopologyVote
from .rounds import Rounds

__all__ = ["TopologyVotes", "VotesHost"]

_A = PeerStatus.ACCEPTED


@dataclasses.dataclass(frozen=True)
class VotesHost:
    """What the votes machine needs from the master, as callables."""

    #: the accepted peers (of a group, or all with ``None``), in arrival order; shared, do not modify
    accepted: Callable[[int | None], list[PeerRecord]]
    #: the registered peers, waiting to be accepted
    registered: Callable[[], list[PeerRecord]]
    #: whether the record is still the master's (the connection was not removed)
    is_current: Callable[[PeerRecord], bool]
    #: the groups whose ring lost a member or an op since it was installed
    stale_groups: Callable[[], set[int]]
    #: a group's ``TopologyComplete`` for the given round id
    topology_complete: Callable[[int, int], m.TopologyComplete]
    #: queue a message for a live peer
    send: Callable[[PeerRecord, m.Message], None]


class TopologyVotes:
    """The accept, re-wire and pending-query consensus (see the module docstring)."""

    def __init__(self, host: VotesHost, rounds: Rounds) -> None:
        self._host = host
        self._rounds = rounds
        #: The accepted peer last found without an accept vote (checked first next time).
        self._accept_blocker: PeerRecord | None = None
        self._pending_asked = False

    def asked_pending(self, peer: PeerRecord) -> None:
        peer.pending_vote = True
        self._pending_asked = True

    def check_accept(self) -> bool:
        if self._rounds:
            return False
        blocker = self._accept_blocker
        if (blocker is not None and blocker.status is _A and self._host.is_current(blocker)
                and (blocker.topology_vote is None or blocker.topology_vote is TopologyVote.OPTIMIZE)):
            return False
        accepted = self._host.accepted(None)
        for p in accepted:
            if p.topology_vote is None or p.topology_vote is TopologyVote.OPTIMIZE:
                self._accept_blocker = p
                return False
        registered = self._host.registered()
        groups = {p.group for p in accepted}
        if groups - {p.group for p in accepted if p.topology_vote is TopologyVote.ACCEPT}:
            return False  # a group that only re-wires stays mid-step: its own round (check_rewire)
        if not accepted and not registered:
            return False
        if not registered and not (self._host.stale_groups() & groups):
            # Nothing changed since the rings were built: answer without a p2p round.
            round_id = self._rounds.take_id()
            completes: dict[int, m.TopologyComplete] = {}  # one per group: they are the same
            for p in accepted:
                p.topology_vote = None
                if p.group not in completes:
                    completes[p.group] = self._host.topology_complete(round_id, p.group)
                self._host.send(p, completes[p.group])
            return True
        self._rounds.start(GLOBAL_SCOPE, [p.peer_id for p in accepted + registered])
        return True

    def check_rewire(self, group: int) -> bool:
        if GLOBAL_SCOPE in self._rounds or group in self._rounds:
            return False
        members = self._host.accepted(group)
        if not members or any(p.topology_vote is not TopologyVote.REWIRE for p in members):
            return False
        self._rounds.start(group, [p.peer_id for p in members])
        return True

    def optimize_voters(self, group: int) -> list[int] | None:
        """``group``'s members if every one has an optimise vote standing and no round touches
        the group (the optimise machine's consensus), else ``None``."""
        if GLOBAL_SCOPE in self._rounds or group in self._rounds:
            return None
        members = self._host.accepted(group)
        if not members or any(p.topology_vote is not TopologyVote.OPTIMIZE for p in members):
            return None
        return [p.peer_id for p in members]

    def check_pending(self) -> bool:
        if not self._pending_asked:
            return False
        accepted = self._host.accepted(None)
        voters = [p for p in accepted if p.pending_vote]
        if not voters:
            self._pending_asked = False
            return False
        # The others (if any) wait in an accept vote: they will not ask, and the voters'
        # update_topology is what their vote waits for (module docstring).
        in_accept_vote = len(voters) < len(accepted)
        if in_accept_vote and not all(p.pending_vote or p.topology_vote is TopologyVote.ACCEPT for p in accepted):
            return False
        pending = in_accept_vote or bool(self._host.registered())
        for p in voters:
            p.pending_vote = False
            self._host.send(p, m.PeersPendingResult(pending))
        return True
