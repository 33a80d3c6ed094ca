"""Every rule of a relay's rendezvous (pccl.protocol.relay), in the order its docstring lists them."""

from __future__ import annotations

import pytest

from pccl.errors import InvalidArgument
from pccl.protocol.master.paths import RELAY_KEY_SIZE
from pccl.protocol.relay import JoinLimits, JoinState, Pair, Refuse, Rendezvous, Wait

K1, K2, K3 = (bytes([i]) * RELAY_KEY_SIZE for i in (1, 2, 3))


def test_a_pair_meets_and_its_key_serves_one_connection() -> None:
    r = Rendezvous()
    first = r.join(K1, 10, 20, "1.2.3.4")
    assert isinstance(first, Wait) and first.join.state is JoinState.WAITING
    assert (r.waiting, r.pairs, r.waiting_from("1.2.3.4")) == (1, 0, 1)
    second = r.join(K1, 20, 10, "5.6.7.8")
    assert isinstance(second, Pair) and second.first is first.join
    assert first.join.state is JoinState.PAIRED and second.second.state is JoinState.PAIRED
    assert (r.waiting, r.pairs, r.waiting_from("1.2.3.4")) == (0, 1, 0)
    replay = r.join(K1, 20, 10, "5.6.7.8")
    assert isinstance(replay, Refuse) and "spliced already" in replay.reason
    r.pair_ended(second.first, second.second)
    r.pair_ended(second.first, second.second)  # idempotent
    assert r.pairs == 0 and first.join.state is JoinState.DONE


@pytest.mark.parametrize("key, peer, partner, words", [
    (b"short", 1, 2, f"a relay key is {RELAY_KEY_SIZE} bytes"),
    (K1, 7, 7, "named itself as its partner"),
])
def test_malformed_joins_are_refused(key: bytes, peer: int, partner: int, words: str) -> None:
    r = Rendezvous()
    outcome = r.join(key, peer, partner, "h")
    assert isinstance(outcome, Refuse) and words in outcome.reason and outcome.waiter is None
    assert r.waiting == 0


def test_only_the_named_partner_naming_the_first_meets_it_and_the_first_keeps_waiting() -> None:
    r = Rendezvous()
    first = r.join(K1, 10, 20, "a")
    assert isinstance(first, Wait)
    for peer, partner, words in [(10, 20, "joined this key twice"), (30, 10, "is not the partner"),
                                 (20, 30, "is not the partner")]:
        outcome = r.join(K1, peer, partner, "b")
        assert isinstance(outcome, Refuse) and words in outcome.reason, outcome
        assert outcome.waiter is None and first.join.state is JoinState.WAITING
    assert isinstance(r.join(K1, 20, 10, "b"), Pair)


def test_waiting_joins_are_bounded_in_all_and_per_source_address() -> None:
    r = Rendezvous(JoinLimits(waiting=3, waiting_per_address=2, pairs=8))
    assert isinstance(r.join(K1, 1, 2, "nat"), Wait)
    assert isinstance(r.join(K2, 3, 4, "nat"), Wait)
    per_source = r.join(K3, 5, 6, "nat")
    assert isinstance(per_source, Refuse) and "2 joins from nat wait" in per_source.reason
    assert isinstance(r.join(K3, 5, 6, "elsewhere"), Wait)
    full = r.join(bytes([9]) * RELAY_KEY_SIZE, 7, 8, "third")
    assert isinstance(full, Refuse) and "3 joins wait" in full.reason
    # A partner's arrival frees its source's room.
    assert isinstance(r.join(K1, 2, 1, "far"), Pair)
    assert r.waiting_from("nat") == 1 and isinstance(r.join(bytes([9]) * RELAY_KEY_SIZE, 7, 8, "nat"), Wait)


def test_a_full_relay_refuses_both_sides_of_a_new_pair() -> None:
    r = Rendezvous(JoinLimits(pairs=1))
    r.join(K1, 1, 2, "a")
    assert isinstance(r.join(K1, 2, 1, "b"), Pair)
    waiter = r.join(K2, 3, 4, "a")
    assert isinstance(waiter, Wait)
    outcome = r.join(K2, 4, 3, "b")
    assert isinstance(outcome, Refuse) and "1 pairs are spliced" in outcome.reason
    assert outcome.waiter is waiter.join and waiter.join.state is JoinState.DONE
    assert r.waiting == 0 and r.pairs == 1


def test_withdraw_frees_a_waiting_join_only() -> None:
    r = Rendezvous()
    waiting = r.join(K1, 1, 2, "a")
    assert isinstance(waiting, Wait)
    assert r.withdraw(waiting.join) is True and r.withdraw(waiting.join) is False
    assert r.waiting == 0 and r.waiting_from("a") == 0
    # The key is free again: a fresh first join waits.
    assert isinstance(r.join(K1, 1, 2, "a"), Wait)
    paired = r.join(K1, 2, 1, "b")
    assert isinstance(paired, Pair)
    assert r.withdraw(paired.first) is False and r.pairs == 1


def test_limits_below_one_are_refused() -> None:
    with pytest.raises(InvalidArgument):
        JoinLimits(waiting=0)
