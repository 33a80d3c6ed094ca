"""The public lineage record (pccl.Lineage) and SharedState.lineage: bad values are clear pccl
errors, and a malformed lineage from the master is the master's fault (ProtocolError)."""

from __future__ import annotations

import numpy as np
import pytest

import pccl
from pccl.protocol import messages as m
from pccl.shared_state import lineage_from_wire, lineage_to_wire


def test_a_lineage_round_trips_through_the_wire_record() -> None:
    lin = pccl.Lineage(b"i" * 16, 7, b"d" * 16)
    assert lineage_from_wire(lineage_to_wire(lin)) == lin  # type: ignore[arg-type]
    assert lineage_to_wire(None) is None
    assert "at revision 7" in str(lin)


@pytest.mark.parametrize("kwargs", [dict(id=b"short"), dict(digest=b"x"), dict(revision=-1), dict(revision=True),
                                    dict(id="not bytes")])
def test_a_malformed_lineage_is_invalid_argument(kwargs: dict) -> None:
    fields = dict(id=b"i" * 16, revision=0, digest=b"d" * 16) | kwargs
    with pytest.raises(pccl.InvalidArgument, match="lineage"):
        pccl.Lineage(**fields)


def test_a_malformed_lineage_from_the_master_is_a_protocol_error() -> None:
    with pytest.raises(pccl.ProtocolError, match="malformed lineage"):
        lineage_from_wire(m.Lineage(b"short", 3, b"d" * 16))


def test_shared_state_lineage_takes_a_lineage_or_none() -> None:
    state = pccl.SharedState({"w": np.zeros(4, np.float32)})
    assert state.lineage is None
    lin = pccl.Lineage(b"i" * 16, 0, b"d" * 16)
    state.lineage = lin
    assert state.lineage is lin and "lineage" in repr(state)
    with pytest.raises(pccl.InvalidArgument, match="pccl.Lineage"):
        state.lineage = "abc"  # type: ignore[assignment]
    assert pccl.SharedState({"w": np.zeros(4, np.float32)}, lineage=lin).lineage is lin
