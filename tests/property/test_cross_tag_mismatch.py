"""Peers of a group that each wait in collectives no other peer joined (issue 31, point 5): the
master's machine ends them after the phase-mismatch grace, naming who waits on which tag, and
never ends the legal concurrent patterns (tags started in the same order on every peer, with any
window of in-flight slots, peers computing in between)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pccl.protocol import messages as m
from pccl.protocol.master import collectives as co
from pccl.protocol.master.machine import MasterState, MessageReceived, PeerConnected, PeerStatus, Send

from test_master_state import TIMEOUT, Harness, accepted_cluster, mismatch_ending, let_grace_pass, peer_id_of_conn

GRACE = TIMEOUT / 4


def _init(tag: int, kind: co.CollectiveKind = co.CollectiveKind.ALL_REDUCE) -> m.CollectiveInit:
    return m.CollectiveInit(tag, 4, 10, 0, kind=int(kind))


def _rejected_tags(h: Harness, conn: int) -> dict[int, m.CollectiveRejected]:
    return {msg.tag: msg for msg in h.inbox.get(conn, []) if isinstance(msg, m.CollectiveRejected)}


def test_two_peers_on_different_tags_both_get_a_phase_mismatch_naming_each_tag_then_meet() -> None:
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    h.send(a, _init(1))
    h.send(b, _init(2))
    h.advance(GRACE * 0.9)
    assert not _rejected_tags(h, a) and not _rejected_tags(h, b)  # a peer may still send the other tag
    assert h.ms.mismatches_in_grace() == {0}
    h.advance(GRACE * 0.2)
    ra, rb = _rejected_tags(h, a), _rejected_tags(h, b)
    assert set(ra) == {1} and set(rb) == {2}
    assert ra[1].code == rb[2].code == m.RejectCode.PHASE_MISMATCH and ra[1].detail == rb[2].detail
    detail = ra[1].detail
    assert f"peer {peer_id_of_conn(h, a):x} waits in all_reduce (tag 1)" in detail, detail
    assert f"peer {peer_id_of_conn(h, b):x} waits in all_reduce (tag 2)" in detail, detail
    assert not h.ms.ops() and not h.kicks and not h.ms.mismatches_in_grace()
    # Both go on: the same tag again meets at once.
    h.send(a, _init(1))
    h.send(b, _init(1))
    seq = h.last(a, m.CollectiveCommence).seq
    assert h.last(b, m.CollectiveCommence).seq == seq
    h.check_invariants()


def test_launchers_that_hold_their_slots_in_another_order_are_ended_tag_by_tag() -> None:
    """Three peers, two slots each, taken in scheduling order rather than tag order: every tag
    lacks one peer's vote.  Each peer gets one rejection per tag it holds, all with the same
    detail listing every peer's tags."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    held = {a: (0, 1), b: (1, 2), c: (2, 0)}
    for conn, tags in held.items():
        for tag in tags:
            h.send(conn, _init(tag))
    assert all(op.seq is None for op in h.ms.ops())
    let_grace_pass(h)
    details = set()
    for conn, tags in held.items():
        got = _rejected_tags(h, conn)
        assert set(got) == set(tags)
        assert all(r.code == m.RejectCode.PHASE_MISMATCH for r in got.values())
        details |= {r.detail for r in got.values()}
    assert len(details) == 1
    detail = details.pop()
    for conn, tags in held.items():
        assert f"peer {peer_id_of_conn(h, conn):x} waits in all_reduce (tag {min(tags)}, {max(tags)})" in detail, detail
    assert not h.ms.ops() and not h.kicks


@pytest.mark.parametrize("kind", [k for k in co.CollectiveKind if k is not co.CollectiveKind.ALL_REDUCE],
                         ids=lambda k: k.name)
def test_the_detail_names_each_peers_call_as_the_caller_knows_it(kind: co.CollectiveKind) -> None:
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    h.send(a, _init(3))
    h.send(b, _init(4, kind))
    let_grace_pass(h)
    detail = _rejected_tags(h, a)[3].detail
    assert f"peer {peer_id_of_conn(h, a):x} waits in all_reduce (tag 3)" in detail
    assert f"peer {peer_id_of_conn(h, b):x} waits in {co.KINDS[kind].call} (tag 4)" in detail


def test_any_change_restarts_the_grace() -> None:
    """A new vote, a withdrawal, a member leaving: the grace starts again each time."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(a, _init(1))
    h.send(b, _init(2))
    h.send(c, _init(1))
    h.advance(GRACE * 0.75)
    h.send(a, _init(3))  # a new vote
    h.advance(GRACE * 0.75)
    h.send(a, m.CollectiveWithdraw(3))  # a withdrawal
    assert _rejected_tags(h, a) == {3: m.CollectiveRejected(3, m.RejectCode.WITHDRAWN, "withdrawn by this peer")}
    h.advance(GRACE * 0.75)
    h.kill(c)  # a member leaving
    h.advance(GRACE * 0.75)
    assert set(_rejected_tags(h, a)) == {3} and not _rejected_tags(h, b)
    h.advance(GRACE * 0.5)
    assert _rejected_tags(h, a)[1].code == m.RejectCode.PHASE_MISMATCH
    assert _rejected_tags(h, b)[2].code == m.RejectCode.PHASE_MISMATCH
    assert f"{peer_id_of_conn(h, a):x}" in _rejected_tags(h, b)[2].detail


def test_a_peer_with_an_op_running_or_none_at_all_keeps_the_others_waiting() -> None:
    """Only when every member waits: a peer computing (no vote of its own), or one whose op
    commenced (it still runs: it can go on), keeps the others' votes alive however long."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(a, _init(1))
    h.send(b, _init(2))
    h.advance(GRACE * 3)  # c computes
    assert not _rejected_tags(h, a) and not _rejected_tags(h, b)
    for conn in (a, b, c):
        h.send(conn, _init(5))
    commence = h.last(c, m.CollectiveCommence)
    assert commence is not None and commence.tag == 5
    h.advance(GRACE * 3)  # tag 5 runs on every peer
    assert not _rejected_tags(h, a) and not _rejected_tags(h, b) and not _rejected_tags(h, c)
    for conn in (a, b):
        h.send(conn, m.CollectiveDone(5, commence.seq))
    h.advance(GRACE * 3)  # c has not reported yet: its op runs
    assert not _rejected_tags(h, a) and not _rejected_tags(h, b)
    h.send(c, m.CollectiveDone(5, commence.seq))
    assert h.last(c, m.CollectiveComplete).seq == commence.seq
    for conn in (c, b):  # both go on with tag 1, which a still waits in: it meets
        h.send(conn, _init(1))
    assert h.last(a, m.CollectiveCommence).tag == 1
    assert not _rejected_tags(h, a) and not _rejected_tags(h, b) and not _rejected_tags(h, c)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 4), windows=st.lists(st.integers(1, 8), min_size=4, max_size=4),
       tags=st.integers(1, 10), seed=st.integers(0, 2**32 - 1))
def test_tags_started_in_the_same_order_are_never_ended(n: int, windows: list[int], tags: int, seed: int) -> None:
    """Every peer starts tags 0..tags-1 in order, tag j once its tag j - window has finished
    here (the peer's own window of in-flight slots, as all_reduce_many's buckets and
    concurrent launchers do), reports each commenced op done when it likes, and computes
    between its steps for up to three graces: no vote is ever rejected and every tag
    completes on every peer."""
    rnd = random.Random(seed)
    h = Harness(seed % 1000)
    conns = accepted_cluster(h, [0] * n)
    started = {c: 0 for c in conns}  # next tag to start
    finished = {c: set() for c in conns}  # tags whose final message came
    reported: set[tuple[int, int]] = set()

    def final_tags(c: int) -> set[int]:
        return {msg.tag for msg in h.inbox.get(c, []) if isinstance(msg, m.CollectiveComplete)}

    for _ in range(100 * tags * n):
        for c in conns:
            finished[c] = final_tags(c)
        if all(len(finished[c]) == tags for c in conns):
            break
        moves = []
        for i, c in enumerate(conns):
            j = started[c]
            if j < tags and (j < windows[i] or (j - windows[i]) in finished[c]):
                moves.append(("start", c))
            for msg in h.inbox.get(c, []):
                if isinstance(msg, m.CollectiveCommence) and (c, msg.seq) not in reported:
                    moves.append(("done", c, msg))
        moves.append(("compute",))
        move = rnd.choice(moves)
        if move[0] == "start":
            c = move[1]
            h.send(c, _init(started[c]))
            started[c] += 1
        elif move[0] == "done":
            _, c, msg = move
            h.send(c, m.CollectiveDone(msg.tag, msg.seq))
            reported.add((c, msg.seq))
        else:
            h.advance(rnd.choice([0.01, GRACE / 2, GRACE * 1.5, GRACE * 3]))
        assert not any(_rejected_tags(h, c) for c in conns), [_rejected_tags(h, c) for c in conns]
        assert not h.kicks
    assert all(len(finished[c]) == tags for c in conns), (finished, started)
    assert not any(mismatch_ending(h, c) for c in conns)


def test_the_check_after_an_init_asks_about_few_peers_at_any_group_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mismatch check runs after every Init; it asks the member last found not waiting
    first, then the next ones round the group, so a collective's N Inits (in arrival order or
    shuffled) ask a bounded number of members per Init, not all of them."""
    n = 200
    ms = MasterState(rng=random.Random(5), peer_timeout=1e9)
    now = 0.0

    def feed(conn: int, msg: m.Message) -> list[object]:
        nonlocal now
        now += 0.001
        return ms.handle(MessageReceived(conn, msg), now)

    def answer(effects: list[object]) -> None:
        todo = [e for e in effects if isinstance(e, Send) and isinstance(e.msg, m.ConnectToPeers)]
        while todo:
            e = todo.pop()
            more = feed(e.conn_id, m.P2PReport(e.msg.round, True))
            todo += [x for x in more if isinstance(x, Send) and isinstance(x.msg, m.ConnectToPeers)]

    for c in range(1, n + 1):
        now += 0.001
        ms.handle(PeerConnected(c, "10.0.0.1"), now)
        answer(feed(c, m.Register(0, 4000, 5000)))
    answer(feed(1, m.VoteTopology(True)))  # the first peer's vote accepts the others
    assert all(p.status is PeerStatus.ACCEPTED and p.topology_vote is None for p in ms.peers())
    asked = 0
    waiting_ops = co.CollectiveOps.waiting_ops

    def counting(self: co.CollectiveOps, group: int, peer_id: int) -> list[co.Op] | None:
        nonlocal asked
        asked += 1
        return waiting_ops(self, group, peer_id)

    monkeypatch.setattr(co.CollectiveOps, "waiting_ops", counting)
    order = list(range(1, n + 1))
    for tag, shuffle in enumerate((False, True, True)):
        if shuffle:
            random.Random(tag).shuffle(order)
        asked = 0
        commenced = 0
        for c in order:
            out = feed(c, _init(tag))
            commenced += sum(isinstance(e, Send) and isinstance(e.msg, m.CollectiveCommence) for e in out)
        assert commenced == n
        assert asked <= 3 * n, (shuffle, asked)  # (measured: 2n in arrival order, n shuffled)
