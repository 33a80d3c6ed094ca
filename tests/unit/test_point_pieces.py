"""The point-to-point receiver's piece sizes (pccl._peer.point_data.next_piece): large pieces
only while the last piece's rate brings a large one well within the stall timeout, so a stalled
or slow sender is still noticed within ``peer_timeout``."""

from __future__ import annotations

from pccl.testing.units import HEADROOM, LARGE_PIECE, PIECE, next_piece

MIB = 1 << 20


def test_a_fast_piece_is_followed_by_a_large_one() -> None:
    # 1 MiB in 1 ms (1 GB/s): 4 MiB would take 4 ms, far below 10 s / 16.
    assert next_piece(MIB, 0.001, piece=PIECE, large_piece=LARGE_PIECE, timeout=10.0) == LARGE_PIECE
    assert next_piece(LARGE_PIECE, 0.004, piece=PIECE, large_piece=LARGE_PIECE, timeout=10.0) == LARGE_PIECE


def test_a_slow_piece_is_followed_by_a_small_one() -> None:
    # 1 MiB in 1 s: 4 MiB would take 4 s, more than 10 s / 16.
    assert next_piece(MIB, 1.0, piece=PIECE, large_piece=LARGE_PIECE, timeout=10.0) == PIECE
    # A short timeout needs a faster sender for the same step up.
    assert next_piece(MIB, 0.01, piece=PIECE, large_piece=LARGE_PIECE, timeout=0.5) == PIECE
    assert next_piece(MIB, 0.001, piece=PIECE, large_piece=LARGE_PIECE, timeout=0.5) == LARGE_PIECE


def test_the_boundary_is_a_large_piece_within_timeout_over_headroom() -> None:
    timeout = 8.0
    seconds = timeout / HEADROOM * MIB / LARGE_PIECE  # a large piece would take exactly timeout / HEADROOM
    assert next_piece(MIB, seconds * 0.99, piece=PIECE, large_piece=LARGE_PIECE, timeout=timeout) == LARGE_PIECE
    assert next_piece(MIB, seconds * 1.01, piece=PIECE, large_piece=LARGE_PIECE, timeout=timeout) == PIECE


def test_equal_sizes_keep_the_piece() -> None:
    assert next_piece(MIB, 0.0, piece=PIECE, large_piece=PIECE, timeout=10.0) == PIECE
