from __future__ import annotations

import pytest

from pccl_sim.engine.trace import Failure, Trace


def _trace(*kinds: str) -> Trace:
    trace = Trace()
    for i, kind in enumerate(kinds):
        trace.record("h", kind, t=float(i), n=i, nested={"b": [1, 2.5, None], "a": "x"})
    return trace


def test_hash_is_stable_and_order_sensitive() -> None:
    assert _trace("a", "b").hash() == _trace("a", "b").hash()
    assert _trace("a", "b").hash() != _trace("b", "a").hash()
    assert len(_trace("a").hash()) == 64


def test_dict_key_order_does_not_matter() -> None:
    one, two = Trace(), Trace()
    one.record("h", "k", t=0.0, x=1, y=2)
    two.record("h", "k", t=0.0, y=2, x=1)
    assert one.hash() == two.hash()


def test_objects_with_addresses_are_rejected() -> None:
    with pytest.raises(TypeError, match="plain data"):
        Trace().record("h", "k", t=0.0, thing=object())
    with pytest.raises(TypeError, match="key"):
        Trace().record("h", "k", t=0.0, mapping={1: "x"})
    with pytest.raises(TypeError, match=r"k\.ring\[2\] has type object"):
        Trace().record("h", "k", t=0.0, ring=[1, 2, object()])


def test_first_divergence_names_the_event() -> None:
    a, b = _trace("x", "y", "z"), _trace("x", "q", "z")
    divergence = a.first_divergence(b)
    assert divergence is not None and divergence.index == 1
    assert divergence.ours.kind == "y" and divergence.theirs.kind == "q"
    assert a.first_divergence(_trace("x", "y", "z")) is None
    assert a.first_divergence(_trace("x", "y")).index == 2


def test_failures_are_hashed_and_round_trip() -> None:
    trace = _trace("a")
    before = trace.hash()
    trace.fail("safety", "checker", "boom", t=1.0)
    assert trace.hash() != before and not trace.ok and trace.failure_kinds == ("safety",)
    again = Trace.from_json(trace.to_json())
    assert again.hash() == trace.hash() and again.failures == [Failure("safety", 1.0, "checker", "boom")]
    with pytest.raises(ValueError):
        Failure("weird", 0.0, "x", "y")
