"""The peer's one phase rule (pccl/_peer/phase.py): which calls may run together, sans-IO."""

from __future__ import annotations

import pytest

from pccl.errors import InvalidUsage
from pccl.testing.units import PhaseRule
from pccl.protocol.phases import TopologyVote


def test_idle_allows_everything() -> None:
    rule = PhaseRule()
    assert rule.describe() == "idle"
    assert rule.join_topology(TopologyVote.ACCEPT) is False
    rule.begin_collective(1)
    rule.end_collective(1)
    rule.begin_sync()
    rule.end_sync()
    assert rule.describe() == "idle"


def test_a_topology_vote_is_joined_by_its_kind_and_refuses_the_rest() -> None:
    rule = PhaseRule()
    rule.begin_topology(TopologyVote.ACCEPT)
    assert rule.describe() == "topology vote (accept)"
    assert rule.join_topology(TopologyVote.ACCEPT) is True  # a cancelled vote stands: wait for it, do not vote again
    with pytest.raises(InvalidUsage, match=r"a topology vote of another kind \(accept\) is still outstanding"):
        rule.join_topology(TopologyVote.REWIRE)
    with pytest.raises(InvalidUsage, match=r"cannot start a collective while a topology vote \(accept\) is "
                                           r"outstanding; call update_topology\(\) again"):
        rule.begin_collective(3)
    with pytest.raises(InvalidUsage, match=r"cannot synchronise the shared state while a topology vote"):
        rule.begin_sync()
    assert rule.collectives == frozenset() and not rule.syncing  # nothing was begun by the refusals
    rule.end_topology()
    assert rule.topology_vote is None and rule.join_topology(TopologyVote.REWIRE) is False


def test_collectives_run_together_by_distinct_tags_and_keep_votes_and_syncs_out() -> None:
    rule = PhaseRule()
    rule.begin_collective(1)
    rule.begin_collective(2)
    assert rule.collectives == {1, 2} and rule.describe() == "collectives [1, 2]"
    with pytest.raises(InvalidUsage, match="collective tag 2 is already in flight"):
        rule.begin_collective(2)
    with pytest.raises(InvalidUsage, match=r"cannot update the topology while collective tags \[1, 2\] are in flight"):
        rule.join_topology(TopologyVote.REWIRE)
    with pytest.raises(InvalidUsage, match=r"cannot sync shared state while collective tags \[1, 2\] are in flight"):
        rule.begin_sync()
    rule.end_collective(1)
    rule.end_collective(2)
    assert rule.join_topology(TopologyVote.REWIRE) is False


def test_a_sync_runs_alone() -> None:
    rule = PhaseRule()
    rule.begin_sync()
    assert rule.syncing and rule.describe() == "shared-state sync"
    with pytest.raises(InvalidUsage, match="a shared-state sync is already running"):
        rule.begin_sync()
    with pytest.raises(InvalidUsage, match="cannot start a collective while a shared-state sync is running"):
        rule.begin_collective(1)
    with pytest.raises(InvalidUsage, match="cannot update the topology while a shared-state sync is running"):
        rule.join_topology(TopologyVote.ACCEPT)
    rule.end_sync()
    rule.begin_collective(1)


def test_an_abandoned_collective_stays_in_flight_until_it_ends() -> None:
    """A cancelled call's tag is abandoned, not ended: its Init may still stand at the master, so
    the rule keeps refusing what that would get the peer kicked for (the session waits for the
    withdrawal before it asks)."""
    rule = PhaseRule()
    rule.begin_collective(4)
    rule.begin_collective(5)
    rule.abandon_collective(4)
    assert rule.abandoned == {4} and rule.collectives == {4, 5}
    with pytest.raises(InvalidUsage, match="collective tag 4 is already in flight"):
        rule.begin_collective(4)
    rule.end_collective(5)
    with pytest.raises(InvalidUsage, match=r"collective tags \[4\] are in flight"):
        rule.join_topology(TopologyVote.ACCEPT)
    rule.end_collective(4)
    assert rule.abandoned == frozenset() and rule.collectives == frozenset()
    rule.begin_collective(4)
