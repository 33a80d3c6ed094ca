"""The point-to-point sender's frame sizes (``frame_bytes``): about ``FRAME_SECONDS`` of the rate
the link showed on its frame before, so another message on the same connection never waits long
behind one frame, within ``[MIN_FRAME, CHUNK]``."""

from __future__ import annotations

import pytest

from pccl.testing.units import CHUNK, FIRST_FRAME, FRAME_SECONDS, MIN_FRAME, frame_bytes

MIB = 1 << 20


def test_a_fast_link_gets_the_largest_frames() -> None:
    assert frame_bytes(FIRST_FRAME, 0.005) == CHUNK  # loopback, ~3 GB/s
    assert frame_bytes(CHUNK, 0.0) == CHUNK  # an instant hand-off (a big send buffer)


@pytest.mark.parametrize("gbit", [1.0, 0.1, 0.01])
def test_a_slower_link_gets_frames_of_a_quarter_second(gbit: float) -> None:
    rate = gbit * 1e9 / 8
    size = frame_bytes(FIRST_FRAME, FIRST_FRAME / rate)
    assert MIN_FRAME <= size <= CHUNK
    if MIN_FRAME < size < CHUNK:
        assert size / rate == pytest.approx(FRAME_SECONDS, rel=1e-6)
    assert size / rate <= max(FRAME_SECONDS, MIN_FRAME / rate) * (1 + 1e-9)


def test_a_crawling_link_keeps_the_smallest_frame() -> None:
    assert frame_bytes(MIN_FRAME, 100.0) == MIN_FRAME
