"""A peer that leaves is logged by the master once ("left the run"), not twice."""

from __future__ import annotations

import logging
import random

import pytest

from pccl.protocol import messages as m
from pccl.protocol.master import machine as ms


def test_a_departure_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    state = ms.MasterState(rng=random.Random(1), peer_timeout=10.0)
    state.handle(ms.PeerConnected(1, "10.0.0.1"), 0.0)
    state.handle(ms.MessageReceived(1, m.Register(0, 9000, 9001)), 0.0)
    (peer_id,) = [p.peer_id for p in state.peers()]
    caplog.set_level(logging.DEBUG, logger="pccl")
    effects = state.handle(ms.MessageReceived(1, m.Leave()), 0.1)
    assert any(isinstance(e, ms.Close) for e in effects)
    about_it = [r.getMessage() for r in caplog.records if f"{peer_id:x}" in r.getMessage()]
    assert about_it == [f"peer {peer_id:x} (group 0, connection 1) left the run"]
