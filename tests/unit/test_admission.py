"""The admission rule of internet-facing listeners (pccl.net.admission), without sockets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pccl.errors import InvalidArgument
from pccl.net.admission import Admission, AdmissionLimits, Drop, Start, Ticket, TicketState, address_key


def started(effects: list) -> list[Ticket]:
    return [e.ticket for e in effects if isinstance(e, Start)]


def dropped(effects: list) -> list[Ticket]:
    return [e.ticket for e in effects if isinstance(e, Drop)]


def test_one_address_gets_its_share_and_another_is_served_at_once() -> None:
    admission = Admission(AdmissionLimits(pending=8, per_address=2, waiting=100), wait_timeout=10.0)
    flood = [admission.arrive("10.0.0.9", 0.0) for _ in range(50)]
    assert [bool(started(effects)) for _, effects in flood] == [True, True] + [False] * 48
    assert admission.pending_from("10.0.0.9") == 2 and admission.waiting_from("10.0.0.9") == 48
    ticket, effects = admission.arrive("10.0.0.1", 0.1)
    assert started(effects) == [ticket]


def test_a_freed_slot_goes_to_the_address_with_the_fewest_and_its_newest_waiter() -> None:
    admission = Admission(AdmissionLimits(pending=2, per_address=2, waiting=100), wait_timeout=10.0)
    a1, _ = admission.arrive("a", 0.0)
    a2, _ = admission.arrive("a", 0.1)
    a3, _ = admission.arrive("a", 0.2)  # waits: the address holds its share
    b1, _ = admission.arrive("b", 0.3)  # waits: every slot is taken
    a4, _ = admission.arrive("a", 0.4)
    assert (a3.state, b1.state, a4.state) == (TicketState.WAITING,) * 3
    assert started(admission.release(a1, 1.0)) == [b1]  # b holds none, a holds one
    assert started(admission.release(b1, 1.1)) == [a4]  # newest first: a3 is older
    assert started(admission.release(a2, 1.2)) == [a3]


def test_a_full_waiting_room_drops_the_oldest_waiter_of_the_busiest_address() -> None:
    admission = Admission(AdmissionLimits(pending=1, per_address=1, waiting=3), wait_timeout=10.0)
    admission.arrive("a", 0.0)
    a_waiters = [admission.arrive("a", 0.1 * i)[0] for i in range(1, 3)]
    b1, _ = admission.arrive("b", 0.5)
    b2, effects = admission.arrive("b", 0.6)  # full: "a" has the most (three), its oldest waiter goes
    assert dropped(effects) == [a_waiters[0]] and a_waiters[0].state is TicketState.DONE
    assert "waiting room is full" in effects[0].reason
    assert b1.state is b2.state is TicketState.WAITING


def test_without_a_waiting_room_the_newcomer_is_refused() -> None:
    admission = Admission(AdmissionLimits(pending=1, per_address=1, waiting=0), wait_timeout=10.0)
    admission.arrive("a", 0.0)
    ticket, effects = admission.arrive("a", 0.1)
    assert dropped(effects) == [ticket] and "holds 1 handshake slots" in effects[0].reason


def test_waiters_give_up_after_the_wait_timeout() -> None:
    admission = Admission(AdmissionLimits(pending=1, per_address=1, waiting=10), wait_timeout=5.0)
    first, _ = admission.arrive("a", 0.0)
    old, _ = admission.arrive("a", 1.0)
    young, _ = admission.arrive("a", 3.0)
    assert admission.next_deadline == 6.0
    assert admission.expire(5.9) == []
    effects = admission.expire(6.0)
    assert dropped(effects) == [old] and "within 5 s" in effects[0].reason
    assert admission.next_deadline == 8.0
    assert started(admission.release(first, 7.0)) == [young]
    assert admission.next_deadline is None


def test_release_is_idempotent_and_forgets_a_waiter() -> None:
    admission = Admission(AdmissionLimits(pending=1, per_address=1, waiting=10), wait_timeout=5.0)
    first, _ = admission.arrive("a", 0.0)
    waiter, _ = admission.arrive("a", 0.0)
    assert admission.release(waiter, 0.1) == [] and admission.waiting == 0
    admission.release(first, 0.2)
    admission.release(first, 0.3)
    assert admission.pending == 0


def test_limits_shrink_to_the_descriptor_budget() -> None:
    limits = AdmissionLimits(pending=512, per_address=64, waiting=4096)
    assert limits.within(100_000) == limits
    assert limits.within(256) == AdmissionLimits(128, 64, 128)
    assert limits.within(40) == AdmissionLimits(20, 20, 20)
    assert limits.within(1) == AdmissionLimits(1, 1, 0)
    assert AdmissionLimits(8, 2, 100).within(20) == AdmissionLimits(8, 2, 12)
    with pytest.raises(InvalidArgument):
        AdmissionLimits(pending=0, per_address=1, waiting=0)
    with pytest.raises(InvalidArgument):
        Admission(limits, wait_timeout=0)


@pytest.mark.parametrize(("address", "key"), [
    ("203.0.113.5:4000", "203.0.113.5"),
    ("[2001:db8:1:2:3:4:5:6]:4000", "2001:db8:1:2::/64"),
    ("[2001:db8:1:2:ffff::1]:9", "2001:db8:1:2::/64"),  # one host's /64 is one source
    ("[::ffff:198.51.100.7]:1", "198.51.100.7"),
    ("[fe80::1%eth0]:1", "fe80::/64"),
    ("peer3:7000", "peer3"),  # the simulator's host names
    ("garbage", "garbage"),
])
def test_address_key(address: str, key: str) -> None:
    assert address_key(address) == key


operations = st.lists(st.tuples(st.sampled_from(["arrive", "release", "tick"]), st.integers(0, 3),
                                st.integers(0, 50)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops=operations, pending=st.integers(1, 5), per_address=st.integers(1, 5), waiting=st.integers(0, 6))
def test_invariants_under_any_sequence(ops: list[tuple[str, int, int]], pending: int, per_address: int,
                                       waiting: int) -> None:
    limits = AdmissionLimits(pending, min(per_address, pending), waiting)
    admission = Admission(limits, wait_timeout=3.0)
    now = 0.0
    live: list[Ticket] = []  # started and not yet released
    outcome: dict[Ticket, str] = {}  # keeps every ticket alive, so identities stay distinct

    def apply(effects: list) -> None:
        for effect in effects:
            assert effect.ticket not in outcome, "a connection was started or dropped twice"
            if isinstance(effect, Start):
                outcome[effect.ticket] = "started"
                live.append(effect.ticket)
            else:
                outcome[effect.ticket] = "dropped"

    for op, address, index in ops:
        now += 0.5
        if op == "arrive":
            ticket, effects = admission.arrive(f"10.0.0.{address}", now)
            apply(effects)
        elif op == "release" and live:
            ticket = live.pop(index % len(live))
            apply(admission.release(ticket, now))
        else:
            apply(admission.expire(now))
        # Invariants after every step.
        assert admission.pending == len(live) <= limits.pending
        assert admission.waiting <= limits.waiting
        for key in {t.key for t in live}:
            assert admission.pending_from(key) == sum(t.key == key for t in live) <= limits.per_address
        # No slot stays free while a waiter could take it.
        if admission.pending < limits.pending:
            for a in range(4):
                key = f"10.0.0.{a}"
                assert not (admission.waiting_from(key) and admission.pending_from(key) < limits.per_address)
        # Nobody waits past the timeout once time was handed in.
        deadline = admission.next_deadline
        assert deadline is None or deadline > now - 0.5
