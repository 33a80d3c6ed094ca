"""lanes_for_link: enough connections that one connection's window does not cap the edge."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pccl.protocol.topology import MAX_LANES, lanes_for_link

WINDOW = 4 << 20


@given(st.floats(1e3, 1e11), st.floats(0.0, 1.0), st.integers(64 << 10, 64 << 20))
def test_lanes_cover_the_link_unless_clamped(bandwidth, rtt, window):
    lanes = lanes_for_link(bandwidth, rtt, window)
    assert 1 <= lanes <= MAX_LANES
    if lanes < MAX_LANES and rtt > 0:
        # lanes full windows per round trip carry at least the link's bandwidth
        assert lanes * window / rtt >= bandwidth
    if lanes > 1:
        # and one lane fewer would not, even without the headroom's quarter
        assert (lanes - 1) * window / rtt < 1.25 * bandwidth * (1 + 1e-9)


@given(st.floats(1e3, 1e11), st.floats(1e-4, 1.0), st.floats(1e3, 1e11))
def test_monotone_in_bandwidth(bandwidth, rtt, other):
    low, high = sorted((bandwidth, other))
    assert lanes_for_link(low, rtt, WINDOW) <= lanes_for_link(high, rtt, WINDOW)


def test_a_probe_at_its_own_window_cap_says_at_least_that_fast():
    rtt = 0.1
    capped = 16 * WINDOW / rtt                      # what 16 probe streams can show at most
    assert lanes_for_link(capped, rtt, WINDOW, probe_streams=16) == MAX_LANES
    assert lanes_for_link(capped / 2, rtt, WINDOW, probe_streams=16) == math.ceil(1.25 * 8)


@pytest.mark.parametrize("args", [(0.0, 0.1, WINDOW), (float("inf"), 0.1, WINDOW), (1e9, -1.0, WINDOW),
                                  (1e9, float("nan"), WINDOW), (1e9, 0.1, 0)])
def test_bad_input(args):
    with pytest.raises(ValueError):
        lanes_for_link(*args)
