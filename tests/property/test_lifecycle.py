"""The peer lifecycle machine (pccl.protocol.lifecycle): its table, walked, and its invariants
over random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl.protocol.lifecycle import TRANSITIONS, Event, Lifecycle, LifecycleError, State

S, E = State, Event


def _reachable() -> set[State]:
    seen, todo = {S.CONNECTING}, [S.CONNECTING]
    while todo:
        state = todo.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is state and target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_every_state_is_reachable_and_every_live_state_can_fail() -> None:
    assert _reachable() == set(State)
    for state in State:
        assert TRANSITIONS[(state, E.FAIL)] is S.FAILED


def test_failed_is_final_and_closing_ends_only_in_failed() -> None:
    for event in Event:
        assert TRANSITIONS[(S.FAILED, event)] is S.FAILED
        assert TRANSITIONS[(S.CLOSING, event)] is (S.FAILED if event is E.FAIL else S.CLOSING)


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_a_pair_missing_from_the_table_is_refused_not_guessed(state: State, event: Event) -> None:
    machine = Lifecycle()
    machine.state = state
    if (state, event) in TRANSITIONS:
        machine.handle(event, now=1.0)
        assert machine.state is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(LifecycleError, match=state.value):
            machine.handle(event, now=1.0)
        assert machine.state is state


def test_a_restarted_masters_acceptance_is_not_a_step_boundary() -> None:
    machine = Lifecycle()
    for event in (E.WELCOMED, E.ACCEPTANCE, E.REALIGNED):
        machine.handle(event)
    assert machine.aligned and machine.epoch == 1
    machine.handle(E.MASTER_LOST, now=5.0)
    assert machine.reconnecting and machine.lost_at == 5.0 and not machine.accepted
    machine.handle(E.WELCOMED)
    assert machine.rejoined and not machine.reconnecting and machine.epoch == 2
    machine.handle(E.ACCEPTANCE)
    assert machine.accepted and not machine.aligned  # calls stop waiting, collectives still abort
    machine.handle(E.ACCEPTANCE)  # a further topology update changes nothing
    assert machine.state is S.REALIGNING
    machine.handle(E.REALIGNED)
    assert machine.aligned and not machine.rejoined


def test_closing_while_reconnecting_remembers_the_master_is_gone() -> None:
    machine = Lifecycle()
    for event in (E.WELCOMED, E.ACCEPTANCE):
        machine.handle(event)
    machine.handle(E.MASTER_LOST, now=2.0)
    machine.handle(E.CLOSE)
    assert machine.closing and machine.reconnecting  # no Leave to send
    machine.handle(E.WELCOMED)  # a reconnection finishing during the close changes nothing
    assert machine.closing and machine.epoch == 1
    machine.handle(E.FAIL)
    assert machine.state is S.FAILED and not machine.reconnecting


@given(st.lists(st.sampled_from(list(Event)), max_size=40))
def test_invariants_hold_over_any_legal_sequence(events: list[Event]) -> None:
    machine = Lifecycle()
    welcomes = 0
    for i, event in enumerate(events):
        if (machine.state, event) not in TRANSITIONS:
            continue
        before = machine.state
        machine.handle(event, now=float(i))
        if event is E.WELCOMED and before in (S.CONNECTING, S.RECONNECTING):
            welcomes += 1
        assert machine.epoch == welcomes
        assert not machine.aligned or machine.accepted
        assert not machine.accepted or machine.holds_master
        assert (machine.state is S.RECONNECTING) <= machine.reconnecting
        assert not machine.reconnecting or machine.state in (S.RECONNECTING, S.CLOSING)
        assert not machine.rejoined or machine.epoch >= 2
        if before is S.REJOINED and event is E.ACCEPTANCE:
            assert not machine.aligned
        if before is S.FAILED:
            assert machine.state is S.FAILED
