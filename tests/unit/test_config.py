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
