"""The op machine (pccl.protocol.op_lifecycle), pair by pair: every (state, event) pair either
moves as the expected table says, with exactly its effects, or is refused without a change."""

from __future__ import annotations

import itertools

import pytest

from pccl.protocol.op_lifecycle import (
    TERMINAL_STATES,
    TRANSITIONS,
    Effect,
    Event,
    OpLifecycle,
    OpLifecycleError,
    State,
    render_table,
)

S, E, X = State, Event, Effect

LATE = (E.COMPLETE, E.ABORT, E.MASTER_LOST)
LEAVE = (E.CANCEL, E.FAIL)

#: The table written out independently of the module's loops: a change to either shows here.
EXPECTED: dict[tuple[State, Event], tuple[State, tuple[Effect, ...]]] = {
    (S.VOTING, E.COMMENCE): (S.RUNNING, ()),
    (S.VOTING, E.REJECT): (S.REFUSED, ()),
    (S.VOTING, E.MASTER_LOST): (S.LOST, ()),
    (S.VOTING, E.CANCEL): (S.WITHDRAWING, (X.WITHDRAW,)),
    (S.WITHDRAWING, E.REJECT): (S.RELEASED, ()),
    (S.WITHDRAWING, E.COMMENCE): (S.RELEASED, (X.REPORT_ABORT,)),
    (S.WITHDRAWING, E.MASTER_LOST): (S.RELEASED, ()),
    (S.WITHDRAWING, E.FAIL): (S.RELEASED, ()),
    (S.RECALLING, E.ABORT): (S.RELEASED, ()),
    (S.RECALLING, E.REJECT): (S.RELEASED, ()),
    (S.RECALLING, E.COMMENCE): (S.RECALLING, ()),
    (S.RECALLING, E.MASTER_LOST): (S.RELEASED, ()),
    (S.RECALLING, E.FAIL): (S.RELEASED, ()),
    (S.RUNNING, E.COMPLETE): (S.COMPLETING, (X.SETTLE,)),
    (S.RUNNING, E.ABORT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),
    (S.RUNNING, E.MASTER_LOST): (S.CUT_OFF, (X.CANCEL_RING, X.SETTLE)),
    (S.RUNNING, E.STALL): (S.STALLED, (X.CANCEL_RING,)),
    (S.RUNNING, E.RING_DONE): (S.REPORTED, (X.REPORT_DONE,)),
    (S.RUNNING, E.RING_FAILED): (S.GAVE_UP, (X.REPORT_ABORT,)),
    (S.RUNNING, E.CANCEL): (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT)),
    (S.RUNNING, E.FAIL): (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT)),
    (S.BEGUN, E.COMMENCE): (S.RUNNING, (X.ARM_WATCHDOG,)),
    (S.BEGUN, E.REJECT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),
    (S.BEGUN, E.ABORT): (S.ABORTING, (X.CANCEL_RING, X.SETTLE)),
    (S.BEGUN, E.MASTER_LOST): (S.CUT_OFF, (X.CANCEL_RING, X.SETTLE)),
    (S.BEGUN, E.RING_DONE): (S.REPORTED, (X.REPORT_DONE,)),
    (S.BEGUN, E.RING_FAILED): (S.FAILING, (X.REPORT_ABORT,)),
    (S.BEGUN, E.CANCEL): (S.RECALLING, (X.RESTORE_INPUT, X.WITHDRAW)),
    (S.BEGUN, E.FAIL): (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT)),
    (S.FAILING, E.ABORT): (S.ABORTED, (X.SETTLE,)),
    (S.FAILING, E.REJECT): (S.ABORTED, (X.SETTLE,)),
    (S.FAILING, E.MASTER_LOST): (S.LOST, (X.SETTLE,)),
    (S.FAILING, E.COMMENCE): (S.FAILING, ()),
    (S.STALLED, E.COMPLETE): (S.ABORTING, (X.SETTLE,)),
    (S.STALLED, E.ABORT): (S.ABORTING, (X.SETTLE,)),
    (S.STALLED, E.MASTER_LOST): (S.CUT_OFF, (X.SETTLE,)),
    (S.STALLED, E.RING_DONE): (S.GAVE_UP, (X.REPORT_ABORT,)),
    (S.STALLED, E.RING_FAILED): (S.GAVE_UP, (X.REPORT_ABORT,)),
    (S.STALLED, E.CANCEL): (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT)),
    (S.STALLED, E.FAIL): (S.LEFT, (X.RESTORE_INPUT, X.REPORT_ABORT)),
    (S.ABORTING, E.STALL): (S.ABORTING, ()),
    (S.ABORTING, E.RING_DONE): (S.ABORTED, ()),
    (S.ABORTING, E.RING_FAILED): (S.ABORTED, ()),
    (S.COMPLETING, E.STALL): (S.ABORTING, (X.CANCEL_RING,)),
    (S.COMPLETING, E.RING_DONE): (S.COMPLETED, ()),
    (S.COMPLETING, E.RING_FAILED): (S.ABORTED, ()),
    (S.CUT_OFF, E.STALL): (S.CUT_OFF, ()),
    (S.CUT_OFF, E.RING_DONE): (S.LOST, ()),
    (S.CUT_OFF, E.RING_FAILED): (S.LOST, ()),
    (S.REPORTED, E.COMPLETE): (S.COMPLETED, (X.SETTLE,)),
    (S.REPORTED, E.ABORT): (S.ABORTED, (X.SETTLE,)),
    (S.REPORTED, E.MASTER_LOST): (S.LOST, (X.SETTLE,)),
    (S.REPORTED, E.CANCEL): (S.ABANDONED, (X.RESTORE_INPUT, X.AWAIT_FINAL)),
    (S.REPORTED, E.FAIL): (S.LEFT, (X.RESTORE_INPUT,)),
    (S.REPORTED, E.COMMENCE): (S.REPORTED, ()),
    (S.REPORTED, E.REJECT): (S.ABORTED, (X.SETTLE,)),
    (S.GAVE_UP, E.COMPLETE): (S.ABORTED, ()),
    (S.GAVE_UP, E.ABORT): (S.ABORTED, ()),
    (S.GAVE_UP, E.MASTER_LOST): (S.LOST, ()),
    (S.ABANDONED, E.COMPLETE): (S.RELEASED, ()),
    (S.ABANDONED, E.ABORT): (S.RELEASED, ()),
    (S.ABANDONED, E.MASTER_LOST): (S.RELEASED, ()),
    (S.ABANDONED, E.COMMENCE): (S.ABANDONED, ()),
    (S.ABANDONED, E.REJECT): (S.RELEASED, ()),
    (S.COMPLETED, E.COMMENCE): (S.COMPLETED, ()),  # peer commit: the acks beat the Commence
}
for _s in (S.ABORTING, S.COMPLETING, S.CUT_OFF, S.COMPLETED, S.ABORTED, S.LOST):
    EXPECTED.update({(_s, e): (_s, ()) for e in LATE + (E.REJECT,)})
for _s in (S.ABORTING, S.COMPLETING, S.CUT_OFF, S.GAVE_UP, S.FAILING, S.COMPLETED, S.ABORTED, S.LOST):
    EXPECTED.update({(_s, e): (S.LEFT, (X.RESTORE_INPUT,)) for e in LEAVE})

ALL_PAIRS = list(itertools.product(State, Event))
ALLOWED = [pair for pair in ALL_PAIRS if pair in EXPECTED]
REFUSED = [pair for pair in ALL_PAIRS if pair not in EXPECTED]


def _id(pair: tuple[State, Event]) -> str:
    return f"{pair[0].name}-{pair[1].name}"


def test_the_module_table_is_the_expected_one() -> None:
    assert TRANSITIONS == EXPECTED


@pytest.mark.parametrize("pair", ALLOWED, ids=_id)
def test_every_allowed_transition(pair: tuple[State, Event]) -> None:
    state, event = pair
    machine = OpLifecycle(state)
    assert machine.handle(event) == EXPECTED[pair][1]
    assert machine.state is EXPECTED[pair][0]


@pytest.mark.parametrize("pair", REFUSED, ids=_id)
def test_every_refused_transition(pair: tuple[State, Event]) -> None:
    state, event = pair
    machine = OpLifecycle(state)
    with pytest.raises(OpLifecycleError, match=f"{event.value!r} cannot happen to a collective that is {state.value}"):
        machine.handle(event)
    assert machine.state is state  # a refused event changes nothing


def test_counts_and_terminal_states() -> None:
    assert len(ALLOWED) + len(REFUSED) == len(State) * len(Event)
    assert len(ALLOWED) == 105
    assert TERMINAL_STATES == {S.REFUSED, S.LEFT, S.RELEASED}


def test_every_state_is_reachable_from_a_start() -> None:
    # The two ways a call starts: a vote, or a Begin on the fast path.
    seen, frontier = {S.VOTING, S.BEGUN}, [S.VOTING, S.BEGUN]
    while frontier:
        state = frontier.pop()
        for (s, _), (nxt, _) in TRANSITIONS.items():
            if s is state and nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    assert seen == set(State)


def _done_reports(effects: tuple[Effect, ...]) -> int:
    return sum(e in (X.REPORT_DONE, X.REPORT_ABORT) for e in effects)


def test_at_most_one_done_on_every_path() -> None:
    # The rule at the top of the module: the master hears at most one Done per op from this
    # peer, whichever way the op goes.  Walk every path of up to 6 events from the commence.
    def walk(state: State, reports: int, depth: int) -> None:
        assert reports <= 1, state
        if depth == 0:
            return
        for event in Event:
            if (state, event) in TRANSITIONS:
                nxt, effects = TRANSITIONS[(state, event)]
                walk(nxt, reports + _done_reports(effects), depth - 1)

    walk(S.RUNNING, 0, 6)
    walk(S.VOTING, 0, 6)
    walk(S.BEGUN, 0, 6)


def test_a_done_is_owed_until_the_master_spoke() -> None:
    # Leaving the call before any Done while the master waits reports the abort (a cancelled
    # begun op not armed yet withdraws its Begin instead); after the master's final word (or
    # its loss) nothing is sent.
    for state in (S.RUNNING, S.STALLED):
        assert X.REPORT_ABORT in TRANSITIONS[(state, E.CANCEL)][1]
    assert X.REPORT_ABORT in TRANSITIONS[(S.BEGUN, E.FAIL)][1]
    assert TRANSITIONS[(S.BEGUN, E.CANCEL)] == (S.RECALLING, (X.RESTORE_INPUT, X.WITHDRAW))
    for state in (S.ABORTING, S.COMPLETING, S.CUT_OFF, S.REPORTED, S.GAVE_UP, S.FAILING, S.COMPLETED, S.ABORTED,
                  S.LOST):
        for event in LEAVE:
            assert _done_reports(TRANSITIONS[(state, event)][1]) == 0
            assert X.RESTORE_INPUT in TRANSITIONS[(state, event)][1]


def test_a_typical_life_and_an_abort() -> None:
    machine = OpLifecycle()
    assert machine.state is S.VOTING
    assert [machine.handle(e) for e in (E.COMMENCE, E.RING_DONE, E.COMPLETE)] == [(), (X.REPORT_DONE,), (X.SETTLE,)]
    assert machine.state is S.COMPLETED
    machine = OpLifecycle()
    machine.handle(E.COMMENCE)
    assert machine.handle(E.ABORT) == (X.CANCEL_RING, X.SETTLE)
    assert machine.handle(E.RING_FAILED) == ()
    assert machine.state is S.ABORTED
    assert repr(machine) == "OpLifecycle(ABORTED)"


def test_a_begun_op_is_armed_by_the_commence_and_its_failure_waits_for_the_verdict() -> None:
    machine = OpLifecycle(S.BEGUN)
    assert [machine.handle(e) for e in (E.COMMENCE, E.RING_DONE, E.COMPLETE)] == [
        (X.ARM_WATCHDOG,), (X.REPORT_DONE,), (X.SETTLE,)]
    assert machine.state is S.COMPLETED
    machine = OpLifecycle(S.BEGUN)
    assert machine.handle(E.RING_FAILED) == (X.REPORT_ABORT,)
    assert machine.state is S.FAILING  # not GAVE_UP: the master may name a disagreement
    assert machine.handle(E.ABORT) == (X.SETTLE,)
    assert machine.state is S.ABORTED
    machine = OpLifecycle(S.BEGUN)
    assert machine.handle(E.REJECT) == (X.CANCEL_RING, X.SETTLE)  # a Begin on a stale ring
    with pytest.raises(OpLifecycleError):
        OpLifecycle(S.BEGUN).handle(E.STALL)  # unwatched until armed


@pytest.mark.parametrize("fmt", ["rst", "markdown"])
def test_render_table_has_one_row_per_pair(fmt: str) -> None:
    text = render_table(fmt)
    if fmt == "markdown":
        rows = [line for line in text.splitlines() if line.startswith("| `")]
        assert "| `RUNNING` | `ABORT` | `ABORTING` | `CANCEL_RING, SETTLE` |" in rows
        assert "| `VOTING` | `COMMENCE` | `RUNNING` | - |" == rows[0]
    else:
        assert text.startswith(".. list-table::\n   :header-rows: 1\n")
        rows = [line for line in text.splitlines() if line.startswith("   * - ``")]
        assert "   * - ``RUNNING``\n     - ``ABORT``\n     - ``ABORTING``\n     - ``CANCEL_RING, SETTLE``" in text
    assert len(rows) == len(TRANSITIONS)


def test_render_table_refuses_an_unknown_format() -> None:
    with pytest.raises(ValueError, match="fmt must be 'rst' or 'markdown', got 'html'"):
        render_table("html")


def test_a_commence_after_a_peer_commit_changes_nothing() -> None:
    # Config.peer_commit: a begun op (BEGUN -> RING_DONE -> REPORTED) commits on its acks
    # (COMPLETE from the driver) before the master's Commence, which it sends once every Begin
    # is in, reaches this peer.  The Commence then comes to a completed op: ignored, not an
    # OpLifecycleError out of the task reading the master connection (which ended the
    # communicator: benchmarks/latency.py --peers 3 --peer-commit, most runs).
    machine = OpLifecycle(S.BEGUN)
    assert machine.handle(E.RING_DONE) == (X.REPORT_DONE,)
    assert machine.handle(E.COMPLETE) == (X.SETTLE,)
    assert machine.handle(E.COMMENCE) == () and machine.state is S.COMPLETED


def test_a_rejection_after_the_op_ended_changes_nothing() -> None:
    # A Rejected carries no seq: the refusal of an earlier begun op's Begin (STALE_RING) that
    # every peer still committed on its acks reaches the tag's next begun op and aborts it;
    # that op's own refusal then comes while it unwinds (or after).  An OpLifecycleError there
    # ended the communicator.
    machine = OpLifecycle(S.BEGUN)
    assert machine.handle(E.REJECT) == (X.CANCEL_RING, X.SETTLE)
    assert machine.handle(E.REJECT) == () and machine.state is S.ABORTING
    assert machine.handle(E.RING_FAILED) == ()
    assert machine.handle(E.REJECT) == () and machine.state is S.ABORTED
    for state in (S.COMPLETING, S.CUT_OFF, S.COMPLETED, S.LOST):
        assert OpLifecycle(state).handle(E.REJECT) == ()
