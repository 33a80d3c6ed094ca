"""The master's side of the one-round-trip design (docs/protocol.rst, "Design: one master round
trip per collective"): peers that begin an op with ``CollectiveBegin`` (a derived seq) get no
answer to wait for — only the one-way Commence that arms their watchdogs and the verdict — and
the master still aborts disagreeing, stale, orphaned and phase-conflicting ops, and lets voters
join a begun op."""

from __future__ import annotations

from pccl.errors import KickReason
from pccl.protocol import messages as m

from test_master_state import Harness, accepted_cluster, let_grace_pass

TAG = 3


def _round(h: Harness, conn: int) -> int:
    done = h.last(conn, m.TopologyComplete)
    assert isinstance(done, m.TopologyComplete)
    return done.round


def _begin(h: Harness, conn: int, *, count: int = 4, n: int = 0, kind: int = 0, round_id: int | None = None,
           seq: int | None = None) -> int:
    """``conn`` begins the ``n``-th use of TAG on its ring; returns the seq."""
    rnd = _round(h, conn) if round_id is None else round_id
    seq = m.derived_seq(rnd, TAG, n) if seq is None else seq
    h.send(conn, m.CollectiveBegin(TAG, seq, rnd, count, 10, 0, kind=kind))
    return seq


def _abort(h: Harness, conn: int) -> m.CollectiveAbort | None:
    msg = h.last(conn, m.CollectiveAbort)
    assert msg is None or isinstance(msg, m.CollectiveAbort)
    return msg


def test_derived_seqs_are_the_same_everywhere_distinct_per_use_and_apart_from_the_masters() -> None:
    seqs = {m.derived_seq(r, t, n) for r in (1, 2) for t in (0, 1, 2**64 - 1) for n in range(3)}
    assert len(seqs) == 18 and all(s >> 63 == 1 for s in seqs)
    assert m.derived_seq(7, 3, 1) == m.derived_seq(7, 3, 1)


def test_begun_ops_run_without_an_answer_and_complete_on_every_done() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    assert h.last(a, m.CollectiveCommence) is None  # nothing to wait for
    _begin(h, b)
    assert h.last(a, m.CollectiveCommence) is None
    _begin(h, c)
    for conn in (a, b, c):  # every participant began: the one-way Commence arms the watchdogs
        commence = h.last(conn, m.CollectiveCommence)
        assert isinstance(commence, m.CollectiveCommence) and commence.seq == seq
    for conn in (a, b, c):
        h.send(conn, m.CollectiveDone(TAG, seq))
    assert all(h.last(conn, m.CollectiveComplete) == m.CollectiveComplete(TAG, seq) for conn in (a, b, c))
    # The next use of the tag has the next derived seq and needs no round either.
    seq2 = _begin(h, a, n=1)
    assert seq2 != seq and h.ms.ops()[0].seq == seq2
    assert not h.kicks and h.ms.stale_groups() == frozenset()


def test_disagreeing_begins_abort_on_everyone_who_began_with_the_mismatch() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a, count=4)
    _begin(h, b, count=5)
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PARAMETER_MISMATCH
        assert "count=4" in abort.detail and "count=5" in abort.detail
    assert _abort(h, c) is None  # it had not begun: nothing to abort yet
    _begin(h, c, count=4)
    # Its Begin of the aborted op hears the same abort (refused as STALE_RING, c would re-wire
    # and vote again alone while a and b raise InvalidUsage: sim seed 37's phase mismatch).
    late = _abort(h, c)
    assert late is not None and late.seq == seq and late.code == m.RejectCode.PARAMETER_MISMATCH
    assert h.last(c, m.CollectiveRejected) is None
    assert not h.ms.ops() and not h.kicks


def test_a_voter_joins_a_begun_op_before_or_after_the_first_begin() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(b, m.CollectiveInit(TAG, 4, 10, 0))  # b had another op in flight: it votes
    assert h.last(b, m.CollectiveCommence) is None
    seq = _begin(h, a)
    joined = h.last(b, m.CollectiveCommence)
    assert isinstance(joined, m.CollectiveCommence) and joined.seq == seq  # told the derived seq
    assert h.last(a, m.CollectiveCommence) is None  # c has not begun
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))  # after the Begin
    assert h.last(c, m.CollectiveCommence).seq == seq
    assert h.last(a, m.CollectiveCommence).seq == seq  # armed: everyone is in
    assert len([x for x in h.inbox[b] if isinstance(x, m.CollectiveCommence)]) == 1
    for conn in (a, b, c):
        h.send(conn, m.CollectiveDone(TAG, seq))
    assert all(h.last(conn, m.CollectiveComplete) == m.CollectiveComplete(TAG, seq) for conn in (a, b, c))


def test_a_participant_that_dies_before_it_begins_aborts_the_op() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.kill(c)
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == 0 and "left before finishing" in abort.detail
    assert h.ms.stale_groups() == frozenset({0})


def test_a_late_begin_joins_its_op_after_a_finished_participant_left() -> None:
    # Sim seed 377: the last Begin was held up on its way while a participant that had already
    # reported success died (the group is stale).  The late Begin must join its op, which arms
    # it and completes it on everyone; refusing it as stale completed the op unarmed on the
    # others' Dones while the late peer, told STALE_RING, aborted: a split verdict.
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, b)
    _begin(h, c)
    for conn in (b, c):
        h.send(conn, m.CollectiveDone(TAG, seq))
    h.kill(c)  # it finished: it still counts, but the group is stale now
    assert h.ms.stale_groups() == frozenset({0})
    _begin(h, a)
    h.send(a, m.CollectiveDone(TAG, seq))
    assert h.last(a, m.CollectiveRejected) is None
    for conn in (a, b):
        commence = h.last(conn, m.CollectiveCommence)
        assert isinstance(commence, m.CollectiveCommence) and commence.seq == seq
        assert h.last(conn, m.CollectiveComplete) == m.CollectiveComplete(TAG, seq) and _abort(h, conn) is None
    assert not h.ms.ops() and not h.kicks


def test_the_last_begin_that_leaves_everyone_waiting_starts_the_grace() -> None:
    """The phase mismatch arises at a Begin (the member in update_topology() voted first): the
    own-op path's mismatch check of that group must see it then, or the grace never starts
    (no later event re-checks the group: the peers only heartbeat)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(c, m.VoteTopology(True))  # c waits in update_topology(), for a and b
    seq = _begin(h, a)
    assert not h.ms.mismatches_in_grace()  # b computes: nobody waits for it yet
    _begin(h, b)
    assert h.ms.mismatches_in_grace() == {0}
    let_grace_pass(h)
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PHASE_MISMATCH
    assert isinstance(h.last(c, m.TopologyRejected), m.TopologyRejected)
    assert not h.ms.ops() and not h.kicks


def test_a_begin_on_a_stale_ring_or_an_old_round_is_rejected_at_once() -> None:
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    _begin(h, a, round_id=_round(h, a) + 1)
    stale = h.last(a, m.CollectiveRejected)
    assert isinstance(stale, m.CollectiveRejected) and stale.code == m.RejectCode.STALE_RING and "re-wire" in stale.detail
    assert not h.ms.ops() and not h.kicks


def test_a_phase_conflict_aborts_the_begun_op_and_rejects_the_topology_vote() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.send(c, m.VoteTopology(True))  # c will never begin: it waits in update_topology()
    assert _abort(h, a) is None
    let_grace_pass(h)
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PHASE_MISMATCH
        assert "update_topology()" in abort.detail
    assert isinstance(h.last(c, m.TopologyRejected), m.TopologyRejected)
    assert not h.ms.ops() and not h.kicks


def test_a_participant_computing_while_the_others_began_is_no_phase_mismatch() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    _begin(h, a)
    _begin(h, b)
    let_grace_pass(h)
    let_grace_pass(h)
    assert _abort(h, a) is None and _abort(h, b) is None and len(h.ms.ops()) == 1


def test_begins_the_master_cannot_take_are_protocol_errors() -> None:
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    _begin(h, a, kind=int(m.CollectiveKind.ALL_GATHER))  # needs every count before it runs
    assert h.kicks == {a: KickReason.PROTOCOL_ERROR}
    _begin(h, b, seq=5)  # not a derived seq
    assert h.kicks[b] == KickReason.PROTOCOL_ERROR


def test_begins_of_different_uses_of_a_tag_abort_and_re_wire_instead_of_a_kick() -> None:
    # (A peer that lost its master counted on; a new round restarts every count.)
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    seq = _begin(h, a, n=0)
    _begin(h, b, n=1)
    abort = _abort(h, a)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.STALE_RING
    refused = h.last(b, m.CollectiveRejected)
    assert isinstance(refused, m.CollectiveRejected) and refused.code == m.RejectCode.STALE_RING
    assert not h.kicks and not h.ms.ops() and h.ms.stale_groups() == frozenset({0})
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    _begin(h, a)
    _begin(h, a)  # the same op twice: a broken peer
    assert h.kicks == {a: KickReason.OUT_OF_PHASE}


def test_failures_reported_before_everyone_began_wait_for_the_last_begin() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.send(a, m.CollectiveDone(TAG, seq, aborted=True))
    h.send(b, m.CollectiveDone(TAG, seq, aborted=True))  # both rings failed: two reports, no kick
    assert _abort(h, a) is None and not h.kicks  # c may still show a disagreement
    _begin(h, c)
    for conn in (a, b, c):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == 0 and "reported failure" in abort.detail
    h.send(a, m.CollectiveDone(TAG, seq, aborted=True))  # a late one for the ended op: ignored
    assert not h.kicks


def test_a_begin_that_disagrees_with_held_votes_aborts_once_and_rejects_every_voter() -> None:
    """Two votes held for a tag (their voters had other ops in flight) disagree with the Begin
    that opens it: the op aborts on its beginner, and each voter, never told a seq, is rejected
    with the same mismatch, as at consensus — not joined to the aborted op (the master crashed
    with a KeyError there: tests/e2e's kind disagreement with fast commit on)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(b, m.CollectiveInit(TAG, 5, 10, 0))
    h.send(c, m.CollectiveInit(TAG, 5, 10, 0))
    seq = _begin(h, a, count=4)
    abort = _abort(h, a)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PARAMETER_MISMATCH
    for conn in (b, c):
        rejected = h.last(conn, m.CollectiveRejected)
        assert isinstance(rejected, m.CollectiveRejected) and rejected.code == m.RejectCode.PARAMETER_MISMATCH
        assert "count=4" in rejected.detail and "count=5" in rejected.detail
        assert h.last(conn, m.CollectiveCommence) is None and _abort(h, conn) is None
    assert not h.ms.ops() and not h.kicks


def test_a_vote_that_disagrees_with_a_begun_op_is_rejected_and_aborts_it_on_the_beginner() -> None:
    """A voter (another op in flight, or an all-gather, which always votes) that disagrees with
    the op its peers began waits for an answer to its vote: it is rejected with the mismatch,
    while the beginner's op aborts with it (an Abort alone left the voter waiting forever:
    tests/e2e's disagreement[kind], a reduce-scatter begun against an all-gather voted)."""
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    seq = _begin(h, a, count=4)
    h.send(b, m.CollectiveInit(TAG, 5, 10, 0))
    abort = _abort(h, a)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PARAMETER_MISMATCH
    rejected = h.last(b, m.CollectiveRejected)
    assert isinstance(rejected, m.CollectiveRejected) and rejected.code == m.RejectCode.PARAMETER_MISMATCH
    assert "count=4" in rejected.detail and "count=5" in rejected.detail
    assert h.last(b, m.CollectiveCommence) is None and _abort(h, b) is None
    assert not h.ms.ops() and not h.kicks


def test_a_vote_for_a_begun_op_aborted_before_it_came_ends_as_the_others_did() -> None:
    """A participant that votes (it had another op in flight) for the use of a tag its peers
    began and aborted before its vote arrived hears that op's Commence and its Abort, so it
    ends as they did (refused as stale, it re-wired and retried alone while they raised
    CollectiveAborted: sim seed 37's phase mismatch); its next vote on the tag is a new use."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a, count=4)
    _begin(h, b, count=5)  # a disagreement: aborted on a and b
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))
    commence = h.last(c, m.CollectiveCommence)
    assert isinstance(commence, m.CollectiveCommence) and commence.seq == seq
    abort = _abort(h, c)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.PARAMETER_MISMATCH
    assert h.last(c, m.CollectiveRejected) is None and not h.ms.ops() and not h.kicks
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))  # the next use: an ordinary vote, held
    assert len([x for x in h.inbox[c] if isinstance(x, m.CollectiveAbort)]) == 1
    assert [op.tag for op in h.ms.ops()] == [TAG]


def test_a_voter_rejected_for_a_disagreement_is_not_answered_the_old_op_on_its_next_call() -> None:
    """A voter rejected with the mismatch (it disagreed with the op its peers began) was told:
    its next call on the tag — a vote with mended arguments, or a Begin of the seq it derives
    again (a rejected vote counts no use) — is a new use that finds the group stale, not the
    aborted op's Commence and Abort (which named a mismatch its arguments no longer have)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    rnd = _round(h, c)
    seq = _begin(h, a, count=4)
    _begin(h, b, count=4)
    h.send(c, m.CollectiveInit(TAG, 5, 10, 0))  # disagrees: rejected, the op aborts on a and b
    rejected = h.last(c, m.CollectiveRejected)
    assert isinstance(rejected, m.CollectiveRejected) and rejected.code == m.RejectCode.PARAMETER_MISMATCH
    h.inbox[c].clear()
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))  # mended, same round
    assert h.last(c, m.CollectiveCommence) is None and _abort(h, c) is None
    h.inbox[c].clear()
    h.send(c, m.CollectiveWithdraw(TAG))
    h.inbox[c].clear()
    _begin(h, c, count=4, round_id=rnd, seq=seq)  # or it begins, with the seq it derives again
    assert _abort(h, c) is None
    again = h.last(c, m.CollectiveRejected)
    assert isinstance(again, m.CollectiveRejected) and again.code == m.RejectCode.STALE_RING
    assert not h.kicks


def test_held_votes_rejected_when_the_opening_begin_aborts_are_not_answered_the_old_op() -> None:
    """Votes held for a tag, one agreeing with the Begin that opens it and one not: the op
    aborts, both voters are rejected, and the agreeing one's next vote on the tag is a new use
    (it was answered the old op's Commence and Abort)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(b, m.CollectiveInit(TAG, 4, 10, 0))
    h.send(c, m.CollectiveInit(TAG, 5, 10, 0))
    _begin(h, a, count=4)
    for conn in (b, c):
        assert isinstance(h.last(conn, m.CollectiveRejected), m.CollectiveRejected)
        h.inbox[conn].clear()
    h.send(b, m.CollectiveInit(TAG, 4, 10, 0))
    assert h.last(b, m.CollectiveCommence) is None and _abort(h, b) is None
    assert not h.kicks


def test_a_vote_that_aborts_a_begun_op_re_checks_the_other_votes_of_its_group() -> None:
    """A vote can abort a begun op (it disagrees), which makes the group stale: another tag's
    vote waiting on a member whose topology vote stands is then rejected STALE_RING at once,
    in the same event (the harness asserts after every event that a full re-check finds
    nothing more to do; a vote was re-checked as touching its own op only)."""
    h = Harness()
    a, b, c, d = accepted_cluster(h, [0, 0, 0, 0])
    h.send(d, m.VoteTopology(True))
    h.send(c, m.CollectiveInit(TAG + 1, 4, 10, 0))  # held: a, b and d have not voted it
    assert h.last(c, m.CollectiveRejected) is None
    _begin(h, a, count=4)
    h.send(b, m.CollectiveInit(TAG, 5, 10, 0))  # disagrees: the begun op aborts, the group is stale
    assert isinstance(_abort(h, a), m.CollectiveAbort)
    rejected = h.last(c, m.CollectiveRejected)
    assert isinstance(rejected, m.CollectiveRejected) and rejected.tag == TAG + 1
    assert rejected.code == m.RejectCode.STALE_RING


def test_a_member_told_a_phase_mismatch_is_not_answered_the_aborted_op_on_its_next_call() -> None:
    """The phase mismatch told c (in update_topology) its own mismatch while a and b began: c's
    next call on the tag is a new use.  Answered the aborted op's Commence and Abort, c raised
    a second PhaseMismatch (tests/e2e/test_phase_mismatch.py's diverging loops, fast commit)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    _begin(h, a)
    _begin(h, b)
    h.send(c, m.VoteTopology(True))
    let_grace_pass(h)
    assert isinstance(h.last(c, m.TopologyRejected), m.TopologyRejected)
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))
    assert h.last(c, m.CollectiveCommence) is None and _abort(h, c) is None
    assert not h.kicks


def test_a_withdrawn_begin_ends_the_op_at_once_and_everyone_retries_the_next_use() -> None:
    """a, cancelled before c began, withdraws its Begin: the op ends WITHDRAWN on a and b at
    once, the ring stays fresh, c's Begin of that use hears the same once, and the next use
    runs on the same ring."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.send(a, m.CollectiveWithdraw(TAG))
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    assert not h.ms.ops() and h.ms.stale_groups() == frozenset() and not h.kicks
    _begin(h, c)
    abort = _abort(h, c)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    assert not h.ms.ops()
    seq2 = _begin(h, b, n=1)  # b's retry first, then a's next call and c's retry
    _begin(h, a, n=1)
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))  # (or a vote: it joins)
    for conn in (a, b, c):
        commence = h.last(conn, m.CollectiveCommence)
        assert isinstance(commence, m.CollectiveCommence) and commence.seq == seq2
    assert len([x for x in h.inbox[c] if isinstance(x, m.CollectiveAbort)]) == 1
    assert not h.kicks


def test_a_torn_withdrawal_makes_the_ring_stale_and_ends_the_begun_ops_not_armed() -> None:
    """a withdraws its Begin with ``torn`` (its cancellation cut a frame): the op still ends
    WITHDRAWN on a and b, but the group is stale, so the next use re-wires: c's Begin of the
    withdrawn use hears the withdrawal, a Begin of the next use is refused STALE_RING, and votes
    are refused STALE_RING at consensus."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.send(a, m.CollectiveWithdraw(TAG, torn=True))
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    assert not h.ms.ops() and h.ms.stale_groups() == frozenset({0}) and not h.kicks
    _begin(h, c)
    abort = _abort(h, c)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    _begin(h, b, n=1)
    stale = h.last(b, m.CollectiveRejected)
    assert isinstance(stale, m.CollectiveRejected) and stale.code == m.RejectCode.STALE_RING
    # b votes first: a vote of the tag while b, refused, has not voted it again is refused at
    # once (test_held_votes_of_a_tag_whose_begin_was_refused_stale_are_refused_at_once).
    for conn in (b, a, c):
        h.send(conn, m.CollectiveInit(TAG, 4, 10, 0))
    for conn in (a, c):
        stale = h.last(conn, m.CollectiveRejected)
        assert isinstance(stale, m.CollectiveRejected) and stale.code == m.RejectCode.STALE_RING
    assert not h.ms.ops() and not h.kicks


def test_a_torn_notice_ends_the_begun_ops_not_armed_as_stale_and_leaves_an_armed_one() -> None:
    """b's ring was cut by another op's end (it withdraws nothing, ``torn``): c's begun op of
    the next use, which b has not begun, ends STALE_RING (b's Begin of it hears the same), and
    an op every participant began runs on."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, c, n=1)
    h.send(b, m.CollectiveWithdraw(TAG, torn=True))
    abort = _abort(h, c)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.STALE_RING
    assert not h.ms.ops() and h.ms.stale_groups() == frozenset({0}) and not h.kicks
    _begin(h, b, n=1)
    abort = _abort(h, b)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.STALE_RING
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    seq = _begin(h, a)
    _begin(h, b)  # armed
    h.send(b, m.CollectiveWithdraw(TAG + 1, torn=True))  # nothing to withdraw on that tag
    assert _abort(h, a) is None and [op.seq for op in h.ms.ops()] == [seq]
    assert h.ms.stale_groups() == frozenset({0}) and not h.kicks


def test_a_torn_notice_re_checks_the_other_votes_of_its_group() -> None:
    """The notice makes the group stale without aborting anything: another tag's vote waiting
    on a member whose topology vote stands is rejected STALE_RING in the same event (the
    harness asserts after every event that a full re-check finds nothing more to do)."""
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    h.send(c, m.VoteTopology(True))
    h.send(b, m.CollectiveInit(TAG + 1, 4, 10, 0))  # held: a and c have not voted it
    assert h.last(b, m.CollectiveRejected) is None
    h.send(a, m.CollectiveWithdraw(TAG, torn=True))
    rejected = h.last(b, m.CollectiveRejected)
    assert isinstance(rejected, m.CollectiveRejected) and rejected.tag == TAG + 1
    assert rejected.code == m.RejectCode.STALE_RING and not h.kicks


def test_a_vote_for_a_withdrawn_use_hears_the_withdrawal_even_with_the_next_use_open() -> None:
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    h.send(a, m.CollectiveWithdraw(TAG))
    seq2 = _begin(h, a, n=1)  # a's next call, before b and c called the withdrawn use
    h.send(b, m.CollectiveInit(TAG, 4, 10, 0))
    commence = h.last(b, m.CollectiveCommence)
    abort = _abort(h, b)
    assert isinstance(commence, m.CollectiveCommence) and commence.seq == seq
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    _begin(h, c)
    abort = _abort(h, c)
    assert abort is not None and abort.seq == seq and abort.code == m.RejectCode.WITHDRAWN
    assert [op.seq for op in h.ms.ops()] == [seq2] and not h.kicks


def test_a_withdrawal_after_everyone_began_or_a_held_failure_is_an_abort() -> None:
    h = Harness()
    a, b = accepted_cluster(h, [0, 0])
    seq = _begin(h, a)
    _begin(h, b)  # armed: a's withdrawal crossed b's Begin
    h.send(a, m.CollectiveWithdraw(TAG))
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == 0 and "reported failure" in abort.detail
    assert h.ms.stale_groups() == frozenset({0})
    h = Harness()
    a, b, c = accepted_cluster(h, [0, 0, 0])
    seq = _begin(h, a)
    _begin(h, b)
    h.send(b, m.CollectiveDone(TAG, seq, aborted=True))  # held for c's Begin
    h.send(a, m.CollectiveWithdraw(TAG))
    for conn in (a, b):
        abort = _abort(h, conn)
        assert abort is not None and abort.seq == seq and abort.code == 0 and "reported failure" in abort.detail
    assert not h.ms.ops() and h.ms.stale_groups() == frozenset({0}) and not h.kicks


def test_held_votes_of_a_tag_whose_begin_was_refused_stale_are_refused_at_once() -> None:
    # Sim seed 117 (order shuffled, fast and peer commit, a peer killed as it began): on the
    # stale group b's Begin of TAG is refused STALE_RING, so b re-wires before it votes TAG
    # again, and it waits for its own held vote of another tag first.  Held, a's vote of TAG
    # could never meet b's: every member waited in votes of different tags, and the phase
    # mismatch that ended them ended the voters' calls alone, while b's call re-wired and
    # retried TAG alone (a second mismatch raised PhaseMismatch in update_topology()).
    h = Harness()
    a, b, c, d = accepted_cluster(h, [0, 0, 0, 0])
    rnd = _round(h, a)
    h.send(a, m.CollectiveInit(TAG, 4, 10, 0))  # a had another op in flight: it votes
    h.kill(d)  # the group is stale
    assert h.last(a, m.CollectiveRejected) is None
    _begin(h, b, round_id=rnd)  # b began TAG: refused, it re-wires first
    for conn in (a, b):
        refused = h.last(conn, m.CollectiveRejected)
        assert isinstance(refused, m.CollectiveRejected) and refused.tag == TAG
        assert refused.code == m.RejectCode.STALE_RING, refused
    assert not h.ms.ops()
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))  # a vote after the refusal: refused at once too
    refused = h.last(c, m.CollectiveRejected)
    assert isinstance(refused, m.CollectiveRejected) and refused.code == m.RejectCode.STALE_RING
    # Another tag's votes wait for b's vote as before (b never began that one).
    h.send(a, m.CollectiveInit(TAG + 1, 4, 10, 0))
    assert h.last(a, m.CollectiveRejected).tag == TAG and len(h.ms.ops()) == 1
    # The re-wire ends the refusal's effect: the new round's votes of TAG wait for b's.
    h.send(a, m.CollectiveWithdraw(TAG + 1))
    for conn in (a, b, c):
        h.send(conn, m.VoteTopology(False))
    h.settle_rounds()
    assert _round(h, a) != rnd and h.ms.stale_groups() == frozenset()
    before = len(h.inbox[a])
    h.send(a, m.CollectiveInit(TAG, 4, 10, 0))
    assert len(h.inbox[a]) == before and len(h.ms.ops()) == 1  # held: b votes TAG on the new ring
    h.send(b, m.CollectiveInit(TAG, 4, 10, 0))
    h.send(c, m.CollectiveInit(TAG, 4, 10, 0))
    commence = h.last(a, m.CollectiveCommence)
    assert isinstance(commence, m.CollectiveCommence) and commence.tag == TAG
    assert not h.kicks
