"""One phase table for both roles: every (activity, call) pair of pccl.protocol.phases, walked on
the master's machine and on the peer's rule.  Where the table refuses, the master kicks the
sender OUT_OF_PHASE and the peer raises InvalidUsage before sending (or joins the outstanding
call); where it allows, the master takes the vote and the peer lets the call go ahead."""

from __future__ import annotations

import pytest

from pccl.errors import InvalidUsage, KickReason
from pccl.testing.units import TRACKED, PhaseRule
from pccl.protocol import messages as m
from pccl.protocol import phases as ph
from pccl.types import SyncStrategy

from test_election import sync_group, entries
from test_master_state import Harness

PAIRS = [(a, c) for a in ph.Activity for c in ph.Call]


def _vote_of(call: ph.Call) -> m.Message:
    return {
        ph.Call.TOPOLOGY_VOTE: m.VoteTopology(True),
        ph.Call.OPTIMIZE_VOTE: m.VoteOptimize(),
        ph.Call.PENDING_QUERY: m.VotePeersPending(),
        ph.Call.COLLECTIVE: m.CollectiveInit(2, 100, 10, 0),  # another tag than the one in flight
        ph.Call.SYNC: m.SyncVote(0, SyncStrategy.ENFORCE_POPULAR, entries((0, 0, 0, 0))),
    }[call]


_ENTER = {  # what puts a peer into each activity while the other peer of its group does nothing
    ph.Activity.TOPOLOGY: m.VoteTopology(True),
    ph.Activity.COLLECTIVE: m.CollectiveInit(1, 100, 10, 0),
    ph.Activity.SYNC: m.SyncVote(0, SyncStrategy.ENFORCE_POPULAR, entries((0, 0, 0, 0))),
    ph.Activity.PENDING_QUERY: m.VotePeersPending(),
}


def test_every_vote_message_is_a_call_and_every_call_has_a_row() -> None:
    assert set(ph.CALL_OF_MESSAGE.values()) == set(ph.Call) == set(ph.RULES)
    assert set(_ENTER) == set(ph.Activity)


@pytest.mark.parametrize(("activity", "call"), PAIRS, ids=[f"{a.name}-{c.name}" for a, c in PAIRS])
def test_the_master_refuses_exactly_what_the_table_refuses(activity: ph.Activity, call: ph.Call) -> None:
    h = Harness(7)
    a, b = sync_group(h, 2)
    h.send(a, _ENTER[activity])
    assert a not in h.kicks and b not in h.kicks
    h.send(a, _vote_of(call))
    refused = activity in ph.RULES[call].refused_while
    if refused:
        assert h.kicks.get(a) is KickReason.OUT_OF_PHASE, (activity, call, h.kicks)
    else:
        assert a not in h.kicks, (activity, call, h.kicks)
    assert b not in h.kicks


def _enter(rule: PhaseRule, activity: ph.Activity, kind: ph.TopologyVote) -> None:
    if activity is ph.Activity.TOPOLOGY:
        rule.begin_topology(kind)
    elif activity is ph.Activity.COLLECTIVE:
        rule.begin_collective(1)
    else:
        rule.begin_sync()


@pytest.mark.parametrize("activity", TRACKED, ids=[a.name for a in TRACKED])
@pytest.mark.parametrize("call", list(ph.Call), ids=[c.name for c in ph.Call])
def test_the_peer_refuses_or_joins_exactly_what_the_table_says(activity: ph.Activity, call: ph.Call) -> None:
    row = ph.RULES[call]
    kind = ph.TopologyVote.OPTIMIZE if call is ph.Call.OPTIMIZE_VOTE else ph.TopologyVote.ACCEPT
    for outstanding in (ph.TopologyVote.ACCEPT, ph.TopologyVote.OPTIMIZE):  # the kind of the outstanding topology vote
        if activity is not ph.Activity.TOPOLOGY and outstanding is not ph.TopologyVote.ACCEPT:
            continue
        rule = PhaseRule()
        _enter(rule, activity, outstanding)
        if activity not in row.refused_while:
            assert rule.check(call, kind=kind) is False  # goes ahead: votes
        elif activity is row.joins and outstanding is kind:
            assert rule.check(call, kind=kind) is True  # waits for the outstanding vote instead
        else:
            with pytest.raises(InvalidUsage):
                rule.check(call, kind=kind)
    if call is ph.Call.COLLECTIVE and activity is ph.Activity.COLLECTIVE:  # the same tag, by tag
        rule = PhaseRule()
        rule.begin_collective(1)
        with pytest.raises(InvalidUsage, match="collective tag 1 is already in flight"):
            rule.begin_collective(1)
