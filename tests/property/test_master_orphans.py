"""A restarted master resolves the peer-agreed ops of the master before it
(:mod:`pccl.protocol.master.orphans`; docs/protocol.rst, "A master restart while peers are in
doubt"): from the reports in ``Register.undecided``, the queries it sends the participants as
they register, their answers, and the deaths of those that do not register in time."""

from __future__ import annotations

from pccl.errors import KickReason
from pccl.protocol import messages as m

from test_master_state import Harness

OLD = 0x5EED  # the instance of the master before the restart
TAG, SEQ = 5, (1 << 63) | 77
P_ID, Q_ID, R_ID = 0x11, 0x22, 0x33
P = m.CommitPhase


def _register(h: Harness, peer_id: int, *undecided: m.UndecidedOp) -> int:
    conn = h.connect()
    h.send(conn, m.Register(0, 4000 + conn, 5000 + conn, previous_peer_id=peer_id, undecided=undecided))
    welcome = h.last(conn, m.Welcome)
    assert isinstance(welcome, m.Welcome) and welcome.peer_id == peer_id
    return conn


def _op(phase: P, known: tuple[int, ...], participants: tuple[int, ...] = (P_ID, Q_ID)) -> m.UndecidedOp:
    return m.UndecidedOp(OLD, TAG, SEQ, participants, phase, known)


def _said(h: Harness, conn: int, kind: type) -> list[m.Message]:
    return [x for x in h.inbox.get(conn, []) if isinstance(x, kind) and getattr(x, "seq", None) == SEQ]


def test_a_participant_in_doubt_is_resolved_by_the_others_answer_as_it_registers() -> None:
    h = Harness()
    p = _register(h, P_ID, _op(P.IN_DOUBT, (P_ID,)))
    assert not _said(h, p, m.CollectiveComplete) and not _said(h, p, m.CollectiveAbort)
    q = _register(h, Q_ID)  # committed on its set: nothing undecided to report
    assert _said(h, q, m.CollectiveQuery) == [m.CollectiveQuery(TAG, SEQ, OLD)]
    h.send(q, m.CollectiveAnswer(TAG, SEQ, P.COMMITTED, (P_ID, Q_ID), OLD))
    assert _said(h, p, m.CollectiveComplete) == [m.CollectiveComplete(TAG, SEQ)]
    assert not _said(h, q, m.CollectiveComplete)  # it decided: the verdict goes to the undecided only
    # A late ask of it (one that crossed the verdict) hears nothing more; nobody was kicked.
    h.send(p, m.CollectiveAsk(TAG, SEQ, P.IN_DOUBT, (P_ID,), OLD))
    assert len(_said(h, p, m.CollectiveComplete)) == 1 and not h.kicks


def test_a_participant_that_does_not_register_in_time_is_dead_and_the_op_aborts_without_its_id() -> None:
    h = Harness()
    h.ms = type(h.ms)(rng=__import__("random").Random(0), peer_timeout=10.0, reconnect_timeout=30.0)
    p = _register(h, P_ID, _op(P.IN_DOUBT, (P_ID,)))
    h.advance(29.0)
    assert not _said(h, p, m.CollectiveAbort)  # Q may still come back
    h.advance(2.0)
    aborts = _said(h, p, m.CollectiveAbort)
    assert len(aborts) == 1 and f"{Q_ID:x}" in aborts[0].detail, aborts
    q = _register(h, Q_ID, _op(P.IN_DOUBT, (Q_ID,)))  # too late: it hears the verdict
    assert _said(h, q, m.CollectiveAbort) == aborts


def test_a_dead_participant_whose_readiness_a_survivor_knew_does_not_stop_the_commit() -> None:
    h = Harness()
    h.ms = type(h.ms)(rng=__import__("random").Random(0), peer_timeout=10.0, reconnect_timeout=30.0)
    p = _register(h, P_ID, _op(P.IN_DOUBT, (P_ID, Q_ID), (P_ID, Q_ID, R_ID)))
    r = _register(h, R_ID)
    h.send(r, m.CollectiveAnswer(TAG, SEQ, P.IN_DOUBT, (R_ID,), OLD))  # frozen: waits too
    h.advance(31.0)  # Q never came back: dead; the answers' sets cover everyone
    assert _said(h, p, m.CollectiveComplete) and _said(h, r, m.CollectiveComplete)


def test_ready_reports_from_every_participant_commit_without_a_query() -> None:
    h = Harness()
    p = _register(h, P_ID, _op(P.READY, (P_ID,)))
    q = _register(h, Q_ID, _op(P.READY, (Q_ID,)))
    assert _said(h, p, m.CollectiveComplete) and _said(h, q, m.CollectiveComplete)
    assert not _said(h, p, m.CollectiveQuery) and not _said(h, q, m.CollectiveQuery)


def test_a_report_that_contradicts_an_earlier_one_is_a_protocol_error() -> None:
    h = Harness()
    _register(h, P_ID, _op(P.IN_DOUBT, (P_ID,)))
    conn = h.connect()
    h.send(conn, m.Register(0, 4000, 5000, previous_peer_id=Q_ID,
                            undecided=(_op(P.READY, (Q_ID,), (P_ID, Q_ID, R_ID)),)))
    assert h.kicks.get(conn) is KickReason.PROTOCOL_ERROR


def test_an_ask_of_this_masters_own_op_from_a_peer_not_yet_accepted_is_out_of_phase() -> None:
    h = Harness()
    h.join()  # accepted alone
    c = h.connect()
    h.send(c, m.Register(0, 4000, 5000))
    h.send(c, m.CollectiveAsk(TAG, SEQ, P.IN_DOUBT, ()))
    assert h.kicks.get(c) is KickReason.OUT_OF_PHASE
