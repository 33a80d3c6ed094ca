"""The shared-state election (pccl/protocol/master/election.py) under Hypothesis, plus the sync votes
of the master's machine: deterministic whatever the arrival order, plans cover exactly the
dirty tensors, striping uses every up-to-date source, RECEIVE_ONLY never sends, revision rules,
re-planning after a source fails, and the machine completes a sync through disconnects."""

from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
from hypothesis import given, settings

from pccl.errors import KickReason
from pccl.protocol.master import election
from pccl.protocol import messages as m
from pccl.protocol.master.machine import PeerDisconnected
from pccl.types import DType, SyncStrategy

from test_master_state import Harness

ENFORCE, SEND_ONLY, RECEIVE_ONLY = SyncStrategy.ENFORCE_POPULAR, SyncStrategy.SEND_ONLY, SyncStrategy.RECEIVE_ONLY
MIN_STRIPE = 64
KEYS = ("a", "b", "c", "d")
SIZES = {"a": 4, "b": 1000, "c": 64, "d": 4096}  # bytes; float32 → multiples of 4


def digest(n: int) -> bytes:
    return n.to_bytes(election.HASH_SIZE, "little")


def entries(contents: tuple[int, ...], *, unequal: frozenset[str] = frozenset(),
            keys: tuple[str, ...] = KEYS) -> tuple[m.SharedStateEntry, ...]:
    return tuple(m.SharedStateEntry(k, DType.FLOAT32, SIZES[k], digest(c), k in unequal)
                 for k, c in zip(keys, contents))


LINEAGES = (b"L" * 16, b"X" * 16)  # the group's lineage and another run's


def lineage(which: int, revision: int) -> m.Lineage:
    return m.Lineage(LINEAGES[which], revision, bytes(16))


content_st = st.tuples(*[st.integers(0, 2) for _ in KEYS])
lineage_st = st.none() | st.builds(lineage, st.integers(0, 1), st.integers(0, 4))
vote_st = st.builds(
    lambda rev, strat, content, unequal, lin: m.SyncVote(rev, strat, entries(content, unequal=unequal), lin),
    st.integers(0, 4),
    st.sampled_from([ENFORCE, ENFORCE, ENFORCE, SEND_ONLY, RECEIVE_ONLY]),
    content_st,
    st.just(frozenset()) | st.just(frozenset({"c"})),
    lineage_st,
)
votes_st = st.dictionaries(st.integers(1, 2**63), vote_st, min_size=1, max_size=7)


def history_st(votes: dict) -> st.SearchStrategy[election.History | None]:
    """What the master remembers of the group's last sync: its lineage and schema, and which
    voters took part in it."""
    schemas = sorted({election.structure_of(v.entries) for v in votes.values()})
    return st.none() | st.builds(
        lambda last, schema, continuing: election.History(lineage(0, last), schema, continuing),
        st.integers(0, 4), st.sampled_from(schemas), st.frozensets(st.sampled_from(sorted(votes))))


def history(last: int, continuing=frozenset(), schema=None) -> election.History:
    return election.History(lineage(0, last), schema or election.structure_of(entries((0, 0, 0, 0))),
                            frozenset(continuing))


def outcome_key(e: election.Election) -> tuple:
    return (e.revision, sorted(e.kicks.items()), sorted(e.rejects.items()), e.sources, e.participants,
            sorted((p, plan.pieces, sorted(plan.expected.items())) for p, plan in e.plans.items()), e.popular,
            e.lineage_id, sorted(e.reasons.items()), e.winner, e.basis)


@given(votes_st, st.randoms(use_true_random=False), st.data())
def test_deterministic_whatever_the_arrival_order(votes: dict, rnd: random.Random, data: st.DataObject) -> None:
    hist = data.draw(history_st(votes), label="history")
    items = list(votes.items())
    rnd.shuffle(items)
    a = election.elect(votes, hist, min_stripe=MIN_STRIPE)
    b = election.elect(dict(items), hist, min_stripe=MIN_STRIPE)
    assert outcome_key(a) == outcome_key(b)


def _holds(vote: m.SyncVote, lineage_id: bytes | None) -> bool:
    return lineage_id is not None and vote.lineage is not None and vote.lineage.id == lineage_id


@given(votes_st, st.data())
def test_rules_hold(votes: dict, data: st.DataObject) -> None:
    hist = data.draw(history_st(votes), label="history")
    out = election.elect(votes, hist, min_stripe=MIN_STRIPE)
    everyone = set(votes)
    assert set(out.kicks) | set(out.rejects) | set(out.participants) == everyone
    assert not set(out.kicks) & set(out.rejects) and not set(out.kicks) & set(out.participants)
    strategies = {p: SyncStrategy(v.strategy) for p, v in votes.items()}
    enforce = ENFORCE in strategies.values()
    for p, (code, _) in out.rejects.items():
        if code is m.SyncRejectCode.STRATEGY_MIX:
            assert enforce and strategies[p] is not ENFORCE
    if enforce:  # mixing: exactly the non-enforcing peers are rejected
        assert {p for p, s in strategies.items() if s is not ENFORCE} <= set(out.rejects)
    candidates = [p for p in votes if p not in out.rejects and strategies[p] is not RECEIVE_ONLY]
    if not candidates:
        assert out.revision is None and not out.participants
        return
    # Only a continuing peer is held to last + 1 (at most: a given-up step leaves it behind);
    # nobody else is kicked for its revision.
    continuing = hist.continuing if hist is not None else frozenset()
    violators = {p for p in votes if p not in out.rejects and hist is not None and p in continuing
                 and votes[p].revision > hist.revision + 1}
    assert {p for p, (r, _) in out.kicks.items() if r is KickReason.REVISION_VIOLATION} == violators
    remaining = [p for p in candidates if p not in violators]
    if not remaining:
        assert out.revision is None and not out.participants
        return
    assert out.sources  # someone holds the popular state
    popular = {e.key: e for e in out.popular}
    for s in out.sources:  # never RECEIVE_ONLY, never kicked, at the adopted revision, popular content
        assert strategies[s] is not RECEIVE_ONLY and s in out.participants
        assert votes[s].revision == out.revision
        assert all(e.allow_content_inequality or e.hash == popular[e.key].hash for e in votes[s].entries)
    # Who wins: the continuing peers, else the holders of a lineage, else everyone (see the rules).
    cont = [p for p in remaining if p in continuing]
    holders = [p for p in remaining if votes[p].lineage is not None]
    if cont:
        assert out.basis == "continuing" and out.lineage_id == hist.lineage.id  # type: ignore[union-attr]
        pool = cont
    elif holders:
        assert out.basis == "lineage"
        own = [p for p in holders if hist is not None and _holds(votes[p], hist.lineage.id)]
        ids = {votes[p].lineage.id for p in own or holders}
        assert out.lineage_id in ids
        if own:
            assert out.lineage_id == hist.lineage.id  # type: ignore[union-attr]
        else:  # the id held by most
            counts = Counter(votes[p].lineage.id for p in holders)
            assert counts[out.lineage_id] == max(counts.values())
        members = [p for p in holders if votes[p].lineage.id == out.lineage_id]
        furthest = max(votes[p].lineage.revision for p in members)
        pool = [p for p in members if votes[p].lineage.revision == furthest]
    else:
        assert out.basis == "open" and out.lineage_id is None
        pool = remaining
    assert set(out.sources) <= set(pool)  # no newcomer ever overwrites the pool's state
    # schema by the number of pool members offering it, never by revision
    schema = election.structure_of(out.popular)
    shapes = Counter(election.structure_of(votes[p].entries) for p in pool)
    assert shapes[schema] == max(shapes.values())
    for p in everyone - set(out.rejects) - violators:
        mismatched = election.structure_of(votes[p].entries) != schema
        assert mismatched == (out.kicks.get(p, (None,))[0] is KickReason.SHARED_STATE_MISMATCH)
    kept = [p for p in pool if p in out.participants or p in out.kicks and
            out.kicks[p][0] is KickReason.STRATEGY_VIOLATION]
    assert out.revision == max(votes[p].revision for p in kept)  # most progress, within the pool
    # popularity: no content at the adopted revision has more votes than the winner's
    def content(v: m.SyncVote) -> tuple:
        return tuple((e.key, e.allow_content_inequality, b"" if e.allow_content_inequality else e.hash)
                     for e in v.entries)
    at = [p for p in kept if votes[p].revision == out.revision]
    counts = {content(votes[p]): sum(content(votes[q]) == content(votes[p]) for q in at) for p in at}
    assert counts[content(votes[out.sources[0]])] == max(counts.values())
    # SEND_ONLY peers that remain are sources
    for p in out.participants:
        if strategies[p] is SEND_ONLY:
            assert p in out.sources
    # every participant is told how it stood; NEWCOMER exactly for those outside the lineage
    assert set(out.reasons) == set(out.participants)
    for p in out.participants:
        reason = out.reasons[p]
        if p in out.sources:
            assert reason is m.SyncReason.UP_TO_DATE
        elif out.lineage_id is None:
            assert reason in (m.SyncReason.OUTVOTED, m.SyncReason.UP_TO_DATE)
        else:
            outside = p not in pool and not _holds(votes[p], out.lineage_id)
            assert (reason is m.SyncReason.NEWCOMER) == outside
        if reason is m.SyncReason.UP_TO_DATE:
            assert p not in out.plans or all(popular[piece.key].allow_content_inequality
                                             for piece in out.plans[p].pieces)


@given(votes_st, st.data())
def test_plans_cover_exactly_the_dirty_tensors(votes: dict, data: st.DataObject) -> None:
    out = election.elect(votes, data.draw(history_st(votes), label="history"), min_stripe=MIN_STRIPE)
    popular = {e.key: e for e in out.popular}
    for p in out.participants:
        plan = out.plans.get(p)
        vote = votes[p]
        outdated = out.revision is not None and (vote.revision < out.revision or out.reasons[p] in (
            m.SyncReason.BEHIND, m.SyncReason.NEWCOMER))
        dirty = {e.key for e in vote.entries if not e.allow_content_inequality and e.hash != popular[e.key].hash}
        if p in out.sources:
            assert plan is None and not dirty
            continue
        got = _coverage(plan.pieces if plan else ())
        for key in dirty:
            assert got.get(key) == [(0, SIZES[key])], (key, got)
        extra = set(got) - dirty
        for key in extra:  # only allow_content_inequality entries of outdated peers, whole
            assert outdated and popular[key].allow_content_inequality and got[key] == [(0, SIZES[key])]
        for piece in plan.pieces if plan else ():
            assert piece.source in out.sources
            assert votes[piece.source].strategy != RECEIVE_ONLY
        if plan:
            assert set(plan.expected) == set(got)
            for key in dirty:
                assert plan.expected[key] == popular[key].hash


def _coverage(pieces) -> dict[str, list[tuple[int, int]]]:
    """Merged [start, end) intervals per key; asserts pieces never overlap."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    for p in sorted(pieces, key=lambda p: (p.key, p.offset)):
        spans = by_key.setdefault(p.key, [])
        assert p.nbytes > 0
        if spans and spans[-1][1] == p.offset:
            spans[-1] = (spans[-1][0], p.offset + p.nbytes)
        else:
            assert not spans or spans[-1][1] < p.offset, "overlapping pieces"
            spans.append((p.offset, p.offset + p.nbytes))
    return by_key


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=6), st.integers(1, 6), st.integers(0, 9),
       st.integers(1, 512))
def test_striping_uses_every_source_when_worth_it(sizes: list[int], n_sources: int, rank: int, min_stripe: int) -> None:
    ranges = [(f"k{i}", 0, n) for i, n in enumerate(sizes)]
    sources = list(range(100, 100 + n_sources))
    pieces = election.stripe(ranges, sources, rank=rank, min_stripe=min_stripe)
    total = sum(sizes)
    cov = _coverage(pieces)
    assert cov == {k: [(0, n)] for k, _, n in ranges if n}
    per_source: dict[int, int] = {}
    for p in pieces:
        per_source[p.source] = per_source.get(p.source, 0) + p.nbytes
    if total >= n_sources * min_stripe:
        assert set(per_source) == set(sources)
        assert max(per_source.values()) - min(per_source.values()) <= 1  # near-equal shares
    elif total:
        assert len(per_source) == max(1, min(n_sources, -(-total // min_stripe)))


def test_striping_splits_one_large_tensor_across_all_sources() -> None:
    votes = {1: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0))), 2: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0))),
             3: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0))), 9: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 1)))}
    out = election.elect(votes, None, min_stripe=MIN_STRIPE)
    plan = out.plans[9]
    assert {p.key for p in plan.pieces} == {"d"} and plan.sources == (1, 2, 3)
    assert sorted(p.nbytes for p in plan.pieces) == [1365, 1365, 1366]


def test_tie_break_is_by_content_not_by_peer_or_order() -> None:
    for ids in ((1, 2), (2, 1), (7, 3)):
        votes = {ids[0]: m.SyncVote(0, ENFORCE, entries((1, 1, 1, 1))),
                 ids[1]: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0)))}
        out = election.elect(votes, None)
        assert out.sources == (ids[1],)  # content (0,0,0,0) sorts first, whoever holds it


def test_unequal_entries_go_whole_to_outdated_peers_only() -> None:
    uq = frozenset({"c"})
    votes = {1: m.SyncVote(5, ENFORCE, entries((0, 0, 1, 0), unequal=uq)),
             2: m.SyncVote(5, ENFORCE, entries((0, 0, 2, 0), unequal=uq)),  # up to date: c may differ
             3: m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0), unequal=uq))}  # joiner
    out = election.elect(votes, history(4, {1, 2, 3}))
    assert out.revision == 5 and out.sources == (1, 2) and set(out.plans) == {3}
    plan = out.plans[3]
    (c_piece,) = [p for p in plan.pieces if p.key == "c"]
    assert (c_piece.offset, c_piece.nbytes) == (0, SIZES["c"])
    assert plan.expected["c"] == digest(1 if c_piece.source == 1 else 2)  # that source's digest


@given(votes_st, st.data())
def test_replan_moves_only_failed_pieces(votes: dict, data: st.DataObject) -> None:
    out = election.elect(votes, data.draw(history_st(votes), label="history"), min_stripe=MIN_STRIPE)
    for pid, plan in out.plans.items():
        failed = data.draw(st.sets(st.sampled_from(plan.sources)))
        alive = data.draw(st.sets(st.sampled_from(out.sources)))
        new = election.replan(votes, plan, sorted(failed), sorted(alive), min_stripe=MIN_STRIPE)
        moving = [p for p in plan.pieces if p.source in failed]
        available = set(alive) - failed
        if moving and not available:
            assert new is None
            continue
        assert new is not None
        kept = [p for p in plan.pieces if p.source not in failed]
        assert all(p.source in available for p in new.pieces)
        assert _coverage(kept + list(new.pieces)) == _coverage(plan.pieces) or any(
            votes[pid].entries[KEYS.index(p.key)].allow_content_inequality for p in moving)
        for p in new.pieces:  # whole tensors are verified against their (new) source
            entry = {e.key: e for e in votes[p.source].entries}[p.key]
            if entry.allow_content_inequality:
                assert new.expected[p.key] == entry.hash


# --- the master's sync votes -----------------------------------------------------------------


def sync_group(h: Harness, n: int) -> list[int]:
    conns = [h.join()]
    h.settle_rounds()
    for _ in range(n - 1):
        c = h.join()
        for a in h.accepted():
            h.send(a, m.VoteTopology(True))
        h.settle_rounds()
        conns.append(c)
    assert h.accepted() == sorted(conns)
    return conns


def _vote(h: Harness, conn: int, revision: int, content: tuple[int, ...], strategy=ENFORCE) -> None:
    h.send(conn, m.SyncVote(revision, strategy, entries(content)))


def test_machine_sync_identical_completes_at_once() -> None:
    h = Harness(1)
    conns = sync_group(h, 3)
    for c in conns:
        _vote(h, c, 7, (0, 0, 0, 0))
    for c in conns:
        done = h.last(c, m.SyncComplete)
        assert done is not None and done.revision == 7
        assert h.last(c, m.SyncPlan) is None
    assert h.ms.revision_of(0) == 7 and not h.ms.syncs()
    h.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.lists(st.sampled_from(["kill_source", "kill_receiver", "fail_report"]), max_size=3))
def test_machine_sync_survives_source_and_receiver_deaths(seed: int, faults: list[str]) -> None:
    """Two joiners fetch from three sources; sources die, receivers die, reports blame sources:
    every live receiver ends with SyncComplete or SyncRejected(NO_SOURCE), and the sync ends."""
    rnd = random.Random(seed)
    h = Harness(seed)
    conns = sync_group(h, 5)
    sources, receivers = conns[:3], conns[3:]
    for c in sources:
        _vote(h, c, 3, (0, 0, 0, 0))
    for c in receivers:
        _vote(h, c, 0, (1, 1, 1, 1))
    assert all(h.last(r, m.SyncPlan) is not None for r in receivers)
    id_of = {c: h.ms.peer_id_of(c) for c in conns}
    for fault in faults:
        live_sources = [c for c in sources if c not in h.gone]
        live_receivers = [c for c in receivers if c not in h.gone and h.last(c, m.SyncComplete) is None
                          and h.last(c, m.SyncRejected) is None]
        if fault == "kill_source" and live_sources:
            h.kill(rnd.choice(live_sources))
        elif fault == "kill_receiver" and live_receivers:
            h.kill(rnd.choice(live_receivers))
        elif fault == "fail_report" and live_receivers:
            r = rnd.choice(live_receivers)
            plan = h.last(r, m.SyncPlan)
            blamed = rnd.choice([f.source.peer_id for f in plan.fetches])
            h.send(r, m.SyncReport(plan.sync_id, plan.attempt, False, (blamed,)))
            new = h.last(r, m.SyncPlan)
            if new is not plan and new is not None:
                assert all(f.source.peer_id != blamed for f in new.fetches)
                assert new.attempt == plan.attempt + 1
        h.check_invariants()
    # every receiver still fetching reports its sources that died, then success
    for _ in range(10):
        pending = [c for c in receivers if c not in h.gone and h.last(c, m.SyncComplete) is None
                   and h.last(c, m.SyncRejected) is None]
        for r in pending:
            plan = h.last(r, m.SyncPlan)
            dead = tuple(f.source.peer_id for f in plan.fetches if h.ms.conn_of(f.source.peer_id) is None)
            h.send(r, m.SyncReport(plan.sync_id, plan.attempt, not dead, dead))
    for c in conns:
        if c in h.gone:
            continue
        done, rejected = h.last(c, m.SyncComplete), h.last(c, m.SyncRejected)
        assert (done is None) != (rejected is None), c
        if rejected is not None:
            assert c in receivers and rejected.code == m.SyncRejectCode.NO_SOURCE
        else:
            assert done.revision == 3
    assert not h.ms.syncs()
    assert all(id_of[c] not in {pid for s in h.ms.syncs() for pid in s.participants} for c in conns)
    h.check_invariants()


def test_machine_phase_rules() -> None:
    h = Harness(3)
    a, b = sync_group(h, 2)
    _vote(h, a, 0, (0, 0, 0, 0))
    h.send(a, m.VoteTopology(True))  # topology vote during its sync
    assert h.kicks.get(a) is KickReason.OUT_OF_PHASE
    # b's sync completes alone (a's vote was dropped with it)
    _vote(h, b, 0, (0, 0, 0, 0))
    assert h.last(b, m.SyncComplete) is not None
    # malformed vote: unsorted keys
    h.send(b, m.SyncVote(1, ENFORCE, tuple(reversed(entries((0, 0, 0, 0))))))
    assert h.kicks.get(b) is KickReason.PROTOCOL_ERROR


def test_machine_rejected_peer_votes_for_the_next_sync() -> None:
    h = Harness(4)
    a, b, c = sync_group(h, 3)
    _vote(h, a, 0, (0, 0, 0, 0))
    _vote(h, b, 0, (1, 1, 1, 1))
    _vote(h, c, 0, (1, 1, 1, 1), strategy=RECEIVE_ONLY)  # mixed with ENFORCE: rejected
    rej = h.last(c, m.SyncRejected)
    assert rej is not None and rej.code == m.SyncRejectCode.STRATEGY_MIX
    assert h.last(a, m.SyncPlan) is not None or h.last(b, m.SyncPlan) is not None  # a tie: one receives
    _vote(h, c, 0, (1, 1, 1, 1))  # retries while the others still transfer: queued, not kicked
    assert c not in h.kicks
    receiver = a if h.last(a, m.SyncPlan) is not None else b
    plan = h.last(receiver, m.SyncPlan)
    h.send(receiver, m.SyncReport(plan.sync_id, plan.attempt, True))
    assert h.last(a, m.SyncComplete) is not None and h.last(b, m.SyncComplete) is not None
    (queued,) = h.ms.syncs()
    assert queued.voters == frozenset({h.ms.peer_id_of(c)}) and queued.sync_id is None
    h.feed(PeerDisconnected(a))
    h.gone.add(a)
    h.check_invariants()


# --- the lineage rule, case by case ---------------------------------------------------------------

BIG = ("a", "b", "c", "d", "e")  # a state of another shape: one key more


def test_a_newcomer_offering_a_higher_revision_receives_the_running_groups_state() -> None:
    # Two peers ran to revision 15 (the group expects 16); a fresh process offers 1000.
    votes = {1: m.SyncVote(16, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 15)),
             2: m.SyncVote(16, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 15)),
             3: m.SyncVote(1000, ENFORCE, entries((0, 0, 0, 0)))}
    out = election.elect(votes, history(15, {1, 2}))
    assert out.revision == 16 and out.sources == (1, 2) and not out.kicks
    assert set(out.plans) == {3} and out.reasons[3] is m.SyncReason.NEWCOMER
    assert out.lineage_id == LINEAGES[0] and out.basis == "continuing"
    # A peer of another run (lineage X, further on) does no better.
    votes[3] = m.SyncVote(1000, ENFORCE, entries((0, 0, 0, 0)), lineage(1, 999))
    out = election.elect(votes, history(15, {1, 2}))
    assert out.revision == 16 and out.sources == (1, 2) and out.reasons[3] is m.SyncReason.NEWCOMER


def _other_shape(revision: int) -> m.SyncVote:
    wide = tuple(m.SharedStateEntry(k, DType.FLOAT32, 8 if k == "e" else SIZES[k], digest(0)) for k in BIG)
    return m.SyncVote(revision, ENFORCE, wide)


def test_a_wrong_shaped_newcomer_is_the_one_kicked_with_two_running_peers_and_with_one() -> None:
    for running in ({1: None, 2: None}, {1: None}):
        votes = {p: m.SyncVote(5, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 4)) for p in running}
        votes[9] = _other_shape(1000)
        out = election.elect(votes, history(4, set(running)))
        assert set(out.kicks) == {9}
        reason, detail = out.kicks[9]
        assert reason is KickReason.SHARED_STATE_MISMATCH and "'e'" in detail
        assert out.sources == tuple(sorted(running)) and out.revision == 5


def test_the_schema_is_elected_by_count_and_a_size_mismatch_names_both_sizes() -> None:
    # The first sync: nobody holds a lineage; two peers of one shape, one of another with more
    # progress.  The majority's shape stays, then most progress wins among it.
    small = tuple(m.SharedStateEntry(k, DType.FLOAT32, 64 if k == "b" else SIZES[k], digest(0)) for k in KEYS)
    votes = {1: m.SyncVote(3, ENFORCE, entries((0, 0, 0, 0))), 2: m.SyncVote(7, ENFORCE, entries((1, 1, 1, 1))),
             3: m.SyncVote(50, ENFORCE, small)}
    out = election.elect(votes, None)
    assert out.kicks == {3: (KickReason.SHARED_STATE_MISMATCH, "key 'b' has 64 bytes, the popular state 1000")}
    assert out.revision == 7 and out.sources == (2,) and out.basis == "open" and out.lineage_id is None
    assert out.reasons[1] is m.SyncReason.OUTVOTED
    # A tie between shapes goes to the one the group held, not to revision or id order.
    votes = {1: m.SyncVote(5, ENFORCE, small, lineage(0, 4)), 2: m.SyncVote(5, ENFORCE, entries((0, 0, 0, 0)),
                                                                           lineage(0, 4))}
    out = election.elect(votes, history(4, {1, 2}))
    assert set(out.kicks) == {1}


def test_after_a_restart_lineage_holders_win_and_among_them_most_progress() -> None:
    votes = {1: m.SyncVote(16, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 15)),
             2: m.SyncVote(17, ENFORCE, entries((2, 2, 2, 2)), lineage(0, 16)),  # saw one more sync
             3: m.SyncVote(1000, ENFORCE, entries((0, 0, 0, 0)))}  # a joiner during the restart
    out = election.elect(votes, None)
    assert out.revision == 17 and out.sources == (2,) and out.basis == "lineage"
    assert out.reasons == {1: m.SyncReason.BEHIND, 2: m.SyncReason.UP_TO_DATE, 3: m.SyncReason.NEWCOMER}
    # Two lineages: the one with more holders wins, whatever the other offers.
    votes[3] = m.SyncVote(1000, ENFORCE, entries((0, 0, 0, 0)), lineage(1, 999))
    out = election.elect(votes, None)
    assert out.lineage_id == LINEAGES[0] and out.revision == 17
    # Every peer resumed from its checkpoint: the furthest checkpoint wins.
    votes = {1: m.SyncVote(40, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 39)),
             2: m.SyncVote(30, ENFORCE, entries((2, 2, 2, 2)), lineage(0, 29))}
    out = election.elect(votes, None)
    assert out.revision == 40 and out.sources == (1,) and out.reasons[2] is m.SyncReason.BEHIND


def test_a_holder_that_fell_behind_cannot_jump_the_group() -> None:
    # Peer 3 held the lineage, was removed, and comes back offering a revision far ahead.
    votes = {1: m.SyncVote(21, ENFORCE, entries((1, 1, 1, 1)), lineage(0, 20)),
             3: m.SyncVote(400, ENFORCE, entries((0, 0, 0, 0)), lineage(0, 10))}
    out = election.elect(votes, history(20, {1}))
    assert out.revision == 21 and out.sources == (1,) and out.reasons[3] is m.SyncReason.BEHIND
    # Every continuing peer is gone: the holders that remain carry on (their lineage, not a new one).
    votes[4] = m.SyncVote(900, ENFORCE, entries((2, 2, 2, 2)))
    del votes[1]
    out = election.elect(votes, history(20, {1}))
    assert out.revision == 400 and out.sources == (3,) and out.lineage_id == LINEAGES[0]
    assert out.reasons[4] is m.SyncReason.NEWCOMER


def test_machine_mints_a_lineage_keeps_it_and_says_why_each_peer_received() -> None:
    h = Harness(5)
    a, b = sync_group(h, 2)
    _vote(h, a, 3, (0, 0, 0, 0))
    _vote(h, b, 9, (1, 1, 1, 1))  # the first sync: most progress wins
    plan = h.last(a, m.SyncPlan)
    h.send(a, m.SyncReport(plan.sync_id, plan.attempt, True))
    done_a, done_b = h.last(a, m.SyncComplete), h.last(b, m.SyncComplete)
    assert done_a.revision == done_b.revision == 9 and done_a.lineage == done_b.lineage
    lin = done_a.lineage
    assert len(lin.id) == 16 and lin.revision == 9 and lin.digest == election.content_digest(entries((1, 1, 1, 1)))
    assert (done_a.reason, done_b.reason) == (m.SyncReason.OUTVOTED, m.SyncReason.UP_TO_DATE)
    assert h.ms.lineage_of(0) == lin
    # The next sync continues the same lineage; a joiner offering 1000 receives.
    c = h.join()
    for x in (a, b):
        h.send(x, m.VoteTopology(True))
    h.settle_rounds()
    for x in (a, b):
        h.send(x, m.SyncVote(10, ENFORCE, entries((2, 2, 2, 2)), lin))
    h.send(c, m.SyncVote(1000, ENFORCE, entries((0, 0, 0, 0))))
    plan = h.last(c, m.SyncPlan)
    assert plan is not None and plan.revision == 10
    h.send(c, m.SyncReport(plan.sync_id, plan.attempt, True))
    done = h.last(c, m.SyncComplete)
    assert done.revision == 10 and done.lineage.id == lin.id and done.reason == m.SyncReason.NEWCOMER
    # A restarted master knows nothing but the votes: the holders' lineage carries on.
    h2 = Harness(6)
    x, y = sync_group(h2, 2)
    h2.send(x, m.SyncVote(11, ENFORCE, entries((3, 3, 3, 3)), done.lineage))
    h2.send(y, m.SyncVote(500, ENFORCE, entries((0, 0, 0, 0))))
    plan = h2.last(y, m.SyncPlan)
    h2.send(y, m.SyncReport(plan.sync_id, plan.attempt, True))
    assert h2.last(y, m.SyncComplete).revision == 11 and h2.ms.lineage_of(0).id == lin.id


def test_a_malformed_lineage_is_a_protocol_error() -> None:
    bad = m.SyncVote(0, ENFORCE, entries((0, 0, 0, 0)), m.Lineage(b"short", 0, bytes(16)))
    assert "lineage" in (election.validate_vote(bad) or "")
