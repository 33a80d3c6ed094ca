"""Which calls a peer may have outstanding together: the one phase table both roles read (sans-IO).

Towards the master a peer is, at any moment, in the middle of some *activities*:

==================  ==============================================================================
``TOPOLOGY``        a topology vote stands (``update_topology()``, the all-reduce's re-wire,
                    ``optimize_topology()``) or a topology round runs with this peer in it
``COLLECTIVE``      a collective was voted (``CollectiveInit``) or runs; several tags at once
``SYNC``            a shared-state sync was voted or runs
``PENDING_QUERY``   an ``are_peers_pending()`` vote waits for its answer
==================  ==============================================================================

A *call* starts with one vote message.  :data:`RULES` says, per call, which activities refuse
it and which one it *joins*:

=====================  ===============================  ============================================
call (message)         refused while                    joins
=====================  ===============================  ============================================
``TOPOLOGY_VOTE``      TOPOLOGY, COLLECTIVE, SYNC        TOPOLOGY (an outstanding vote of its kind)
(``VoteTopology``)
``OPTIMIZE_VOTE``      TOPOLOGY, COLLECTIVE, SYNC        TOPOLOGY (an outstanding optimise vote)
(``VoteOptimize``)
``PENDING_QUERY``      PENDING_QUERY                     PENDING_QUERY
(``VotePeersPending``)
``COLLECTIVE``         TOPOLOGY, SYNC                    —  (each tag once: checked by tag)
(``CollectiveInit``)
``SYNC``               TOPOLOGY, COLLECTIVE, SYNC        —
(``SyncVote``)
=====================  ===============================  ============================================

The master enforces the table (:mod:`pccl.protocol.master.machine`): a vote sent while the sender
is in a refusing activity is OUT_OF_PHASE, and the sender is kicked.  The peer consults the same
rows before it sends (:mod:`pccl._peer.phase`): a call refused by the table is ``InvalidUsage``,
raised before anything is sent; a call whose *joined* activity is outstanding (a cancelled
``update_topology()`` whose vote still stands, an unanswered ``are_peers_pending()``) waits for
that one instead of voting again — the second vote the master would refuse is never sent.  A
collective in flight does not refuse another collective; a reused tag is refused by tag on both
sides (``TAG_IN_USE`` at the master, ``InvalidUsage`` at the peer).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from . import messages as m

__all__ = ["Activity", "Call", "Rule", "RULES", "CALL_OF_MESSAGE", "TopologyVote"]


class Activity(enum.Enum):
    TOPOLOGY = "topology"
    COLLECTIVE = "collective"
    SYNC = "sync"
    PENDING_QUERY = "pending-query"


class TopologyVote(enum.Enum):
    """The kind of a topology vote (both roles: the master's rounds, the peer's phase rule)."""

    ACCEPT = "accept"  # update_topology(): global
    REWIRE = "rewire"  # re-wire own group only
    OPTIMIZE = "optimize"  # optimize_topology(): probe, solve, re-wire own group


class Call(enum.Enum):
    TOPOLOGY_VOTE = "topology vote"
    OPTIMIZE_VOTE = "optimise vote"
    PENDING_QUERY = "are_peers_pending vote"
    COLLECTIVE = "collective"
    SYNC = "shared-state sync"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of :data:`RULES`: the activities that refuse a call (in the order they are
    checked) and the one it joins instead of being refused (``None``: none)."""

    refused_while: tuple[Activity, ...]
    joins: Activity | None = None

    def __post_init__(self) -> None:
        assert self.joins is None or self.joins in self.refused_while, "a call joins only what refuses a second vote"


_T, _C, _S, _Q = Activity.TOPOLOGY, Activity.COLLECTIVE, Activity.SYNC, Activity.PENDING_QUERY

#: The phase table (see the module docstring).
RULES: Mapping[Call, Rule] = {
    Call.TOPOLOGY_VOTE: Rule((_T, _C, _S), joins=_T),
    Call.OPTIMIZE_VOTE: Rule((_T, _C, _S), joins=_T),
    Call.PENDING_QUERY: Rule((_Q,), joins=_Q),
    Call.COLLECTIVE: Rule((_T, _S)),
    Call.SYNC: Rule((_T, _C, _S)),
}

#: The vote message that starts each call.
CALL_OF_MESSAGE: Mapping[type[m.Message], Call] = {
    m.VoteTopology: Call.TOPOLOGY_VOTE,
    m.VoteOptimize: Call.OPTIMIZE_VOTE,
    m.VotePeersPending: Call.PENDING_QUERY,
    m.CollectiveInit: Call.COLLECTIVE,
    m.CollectiveBegin: Call.COLLECTIVE,
    m.SyncVote: Call.SYNC,
}
