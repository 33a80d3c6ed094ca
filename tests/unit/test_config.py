"""Config refuses values it cannot use, with a clear InvalidArgument."""

from __future__ import annotations

import pytest

from pccl.config import MIN_SOCKET_BUFFER_SIZE, Config
from pccl.errors import InvalidArgument


@pytest.mark.parametrize("kwargs", [
    dict(socket_buffer_size=-1),
    dict(local_socket_buffer_size=-1),
    dict(local_socket_buffer_size=4096),  # below loopback's 64 KiB segments: transfers crawl
    dict(socket_buffer_size=65535),
    dict(local_socket_buffer_size=262144.0),  # setsockopt would fail later, at connect
    dict(socket_buffer_size=True),
    dict(p2p_lanes=0),
    dict(p2p_lanes=65),
    dict(p2p_lanes="Auto"),
    dict(p2p_lanes="4"),
    dict(p2p_lanes=2.0),
    dict(p2p_lanes=True),
    dict(p2p_lane_window=1024),
    dict(probe_seconds=0),
    dict(probe_seconds=120.0),
    dict(probe_streams=0),
    dict(probe_streams=65),
    dict(p2p_lane_window=float(4 << 20)),
    dict(peer_timeout=0),
    dict(heartbeat_interval=20.0),
    dict(max_frame_size=10),
    dict(p2p_base_port=70000),
])
def test_bad_values_are_refused(kwargs: dict) -> None:
    with pytest.raises(InvalidArgument):
        Config(**kwargs)


def test_socket_buffer_size_zero_keeps_the_os_default() -> None:
    assert Config().socket_buffer_size == 0
    assert Config(socket_buffer_size=1 << 20).socket_buffer_size == 1 << 20


def test_socket_buffer_sizes_from_the_minimum_up_are_accepted() -> None:
    assert Config(local_socket_buffer_size=0).local_socket_buffer_size == 0
    smallest = Config(socket_buffer_size=MIN_SOCKET_BUFFER_SIZE, local_socket_buffer_size=MIN_SOCKET_BUFFER_SIZE)
    assert smallest.socket_buffer_size == smallest.local_socket_buffer_size == MIN_SOCKET_BUFFER_SIZE


def test_bad_lanes_name_the_accepted_values() -> None:
    with pytest.raises(InvalidArgument, match=r'between 1 and 64 or "auto", got \'many\''):
        Config(p2p_lanes="many")


def test_fixed_lanes_ignore_measurements() -> None:
    assert Config(p2p_lanes=8).lanes_for(1.25e9, 0.1) == 8
    assert Config(p2p_lanes=3).lanes_for() == 3


def test_auto_lanes_follow_the_bandwidth_delay_product() -> None:
    auto = Config(p2p_lanes="auto", p2p_lane_window=4 << 20, probe_streams=64)
    assert auto.lanes_for() == 1                       # not measured yet
    assert auto.lanes_for(0.0, 0.1) == 1               # a failed probe: not measured
    assert auto.lanes_for(1.25e9, 0.0002) == 1         # LAN: one window covers it
    # 10 Gbit/s at 100 ms: 125 MB in flight, 4 MiB windows: 30 exactly, 38 with headroom.
    assert auto.lanes_for(1.25e9, 0.1) == 38
    assert auto.lanes_for(1.25e10, 0.1) == 64          # clamped
    wider = Config(p2p_lanes="auto", p2p_lane_window=16 << 20, probe_streams=64)
    assert wider.lanes_for(1.25e9, 0.1) == 10


def test_auto_lanes_take_a_probe_at_its_own_cap_as_a_lower_bound() -> None:
    # 8 probe streams of 4 MiB windows at 100 ms show at most ~335 MB/s, whatever the link.
    auto = Config(p2p_lanes="auto", p2p_lane_window=4 << 20, probe_streams=8)
    assert auto.lanes_for(8 * (4 << 20) / 0.1, 0.1) == 64
    assert auto.lanes_for(100e6, 0.1) == 3


def test_ring_lanes_are_what_the_neediest_edge_needs() -> None:
    auto = Config(p2p_lanes="auto", probe_streams=64)
    assert auto.ring_lanes([]) == 1
    assert auto.ring_lanes([(1.25e9, 0.0002), (1.25e8, 0.08), (0.0, 0.0)]) == 3
    assert Config(p2p_lanes=5).ring_lanes([(1.25e9, 0.1)]) == 5
