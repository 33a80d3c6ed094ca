"""The master's resolution of one op under completion agreed among peers
(pccl.protocol.master.peer_resolve): its rules one by one, then as the master of the model's
every interleaving (tests/property/peer_commit_world.py runs it), with fast commit's one-way
``Done`` reports in the model — and fast commit's abort on a death before ``Done``, shown wrong
once participants commit among themselves."""

from __future__ import annotations

import random

import pytest

from pccl.errors import ProtocolError
from pccl.protocol.master.peer_resolve import Resolution, Send, Word
from pccl.protocol.peer_commit import Answer, Phase, Verdict, resolve

from peer_commit_world import Rules, Violation, explore, walk

P = Phase
ALL = frozenset({0, 1, 2})


def _a(phase: Phase, *known: int) -> Answer:
    return Answer(phase, frozenset(known))


def _verdict(to: set[int], verdict: Verdict, fenced: set[int] | None = None) -> Send:
    return Send(Word.VERDICT, frozenset(to), verdict, frozenset(fenced or ()))


def test_every_done_ok_commits_and_a_done_aborted_aborts_without_a_query() -> None:
    res = Resolution.open([0, 1, 2])
    for peer in (0, 1):
        res, sends = res.done(peer, ok=True)
        assert sends == () and res.verdict is None
    res, sends = res.done(2, ok=True)
    assert sends == (_verdict({0, 1, 2}, Verdict.COMMIT),) and not res.querying
    failed, sends = Resolution.open([0, 1, 2]).done(1, ok=False)  # a nack: nobody can commit
    assert sends == (_verdict({0, 1, 2}, Verdict.ABORT),) and not failed.querying


def test_a_death_before_done_queries_the_live_ones_instead_of_aborting() -> None:
    res, _ = Resolution.open([0, 1, 2]).done(0, ok=True)
    res, sends = res.death(2)  # it may have acked to 0 or 1 before it died
    assert sends == (Send(Word.QUERY, frozenset({0, 1})),) and res.verdict is None
    res, sends = res.answer(0, _a(P.IN_DOUBT, 0, 2))
    assert sends == ()  # 1 has not answered: it may hold every id and commit
    res, sends = res.answer(1, _a(P.IN_DOUBT, 1))
    assert sends == (_verdict({0, 1}, Verdict.COMMIT, {2}),)  # 2's readiness was heard by 0
    res, sends = res.ask(1, _a(P.IN_DOUBT, 1))  # a late ask hears the verdict again
    assert sends == (_verdict({1}, Verdict.COMMIT, {2}),)


def test_a_death_nobody_heard_ready_aborts_once_every_live_one_answered() -> None:
    res, sends = Resolution.open([0, 1, 2]).death(2)
    assert sends == (Send(Word.QUERY, frozenset({0, 1})),)
    res, _ = res.answer(0, _a(P.IN_DOUBT, 0, 1))
    res, sends = res.answer(1, _a(P.IN_DOUBT, 0, 1))
    assert sends == (_verdict({0, 1}, Verdict.ABORT, {2}),)


def test_done_ok_ids_count_as_known_and_a_death_after_done_needs_no_query() -> None:
    res, _ = Resolution.open([0, 1, 2]).done(2, ok=True)
    res, sends = res.death(2)
    assert sends == () and not res.querying  # 2 was ready: the live ones report their own Done
    res, sends = res.ask(0, _a(P.IN_DOUBT, 0))  # 0 waits for 1's and 2's ids, 2 is gone
    assert sends == (Send(Word.QUERY, frozenset({1})),)
    res, sends = res.answer(1, _a(P.IN_DOUBT, 1))
    assert sends == (_verdict({0, 1}, Verdict.COMMIT, {2}),)  # 0, 1 answered; 2 reported Done(ok)
    assert resolve(ALL, {0: _a(P.IN_DOUBT, 0), 1: _a(P.IN_DOUBT, 1)}, dead=[2]) is Verdict.ABORT
    assert resolve(ALL, {0: _a(P.IN_DOUBT, 0), 1: _a(P.IN_DOUBT, 1)}, dead=[2], ready=[2]) is Verdict.COMMIT


def test_an_answer_committed_or_aborted_decides_at_once() -> None:
    res, _ = Resolution.open([0, 1, 2]).query_all()  # the phase rule asks
    committed, sends = res.answer(1, _a(P.COMMITTED, 0, 1, 2))
    assert sends == (_verdict({0, 1, 2}, Verdict.COMMIT),)
    assert committed.query_all() == (committed, ())  # decided: nothing more to ask
    aborted, sends = res.answer(1, _a(P.ABORTED))
    assert sends == (_verdict({0, 1, 2}, Verdict.ABORT),)


def test_bad_input_is_a_protocol_error_and_changes_nothing() -> None:
    res, _ = Resolution.open([0, 1]).done(0, ok=True)
    with pytest.raises(ProtocolError, match="second Done from peer 0"):
        res.done(0, ok=False)
    with pytest.raises(ProtocolError, match="peer 5 is not a participant"):
        res.ask(5, _a(P.IN_DOUBT, 5))
    with pytest.raises(ProtocolError, match=r"names \[7\], not participants"):
        res.answer(1, _a(P.IN_DOUBT, 1, 7))
    with pytest.raises(ProtocolError, match="distinct"):
        Resolution.open([1, 1])
    with pytest.raises(ProtocolError, match="peer 1 answers a query it was never sent"):
        res.answer(1, _a(P.ABORTED))  # not frozen: what it says may not decide
    with pytest.raises(ProtocolError, match="peer 1 asks as committed"):
        res.ask(1, _a(P.COMMITTED, 0, 1))  # a participant asks only in doubt
    assert res.ready == {0} and not res.querying and res.answers == frozenset()


# --- as the model's master ------------------------------------------------------------------

@pytest.mark.parametrize("reads", [True, False])
def test_the_model_with_done_reports_keeps_every_invariant(reads: bool) -> None:
    """Done(ok) sent as a participant becomes ready, before its acks, and the master's verdict
    on every Done(ok) racing the acks (read by a ready participant, or ignored: both hold)."""
    rules = Rules(ready_reads_verdict=reads)
    steady = explore(3, 0, rules=rules)
    assert steady.master_words == 0  # nobody asked and nobody was queried
    faulty = explore(2, 1, rules=rules)
    assert faulty.worlds >= 3_000 and faulty.master_words > 0
    rng = random.Random(47)
    for _ in range(300):
        walk(rng.choice((3, 4)), rng.choice((1, 2)), rng.randrange, rules=rules)


def test_fast_commits_abort_on_a_death_before_done_splits_the_survivors() -> None:
    """Today's fast path aborts an op the moment a participant dies before its Done.  Once
    participants commit on a full known set that is wrong: the dead one may have acked."""
    found = None
    try:
        explore(2, 1, rules=Rules(abort_on_death=True))
    except Violation as violation:
        found = violation
    rng = random.Random(46)
    for _ in range(20_000 if found is None else 0):
        try:
            walk(3, rng.choice((1, 2)), rng.randrange, rules=Rules(abort_on_death=True))
        except Violation as violation:
            found = violation
            break
    assert found is not None and found.what.startswith(("agreement", "PeerCommitError")), found
