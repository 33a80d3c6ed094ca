"""Error messages that say what to do: a reused collective tag names the fix, a missing
gradient names its likely cause, and pccl.blocking's calls say what they do and raise."""

from __future__ import annotations

import inspect

import pytest

import pccl
import pccl.blocking
from pccl.arrays import as_array
from pccl.testing.units import PhaseRule


def test_a_tag_in_flight_says_to_pass_a_distinct_tag() -> None:
    rule = PhaseRule()
    rule.begin_collective(3)
    with pytest.raises(pccl.InvalidUsage, match=r"tag 3 is already in flight.*distinct.*tag="):
        rule.begin_collective(3)


def test_none_instead_of_an_array_names_the_missing_backward_pass() -> None:
    with pytest.raises(pccl.InvalidArgument, match=r"got NoneType.*\.grad is None until a backward pass"):
        as_array(None, name="arrays[0]")


@pytest.mark.parametrize("name", ["all_reduce", "all_reduce_many", "sync_shared_state", "update_topology",
                                  "are_peers_pending", "optimize_topology", "all_reduce_async",
                                  "all_reduce_many_async", "steps", "close"])
def test_every_blocking_call_has_a_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(pccl.blocking.Communicator, name)) or ""
    assert len(doc) > 40, f"pccl.blocking.Communicator.{name} says too little: {doc!r}"
