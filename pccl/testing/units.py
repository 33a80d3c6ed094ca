"""The runtime's pure parts, for their own unit tests: machines and codecs that live beside the
code that runs them (not in :mod:`pccl.protocol`) but need no connection to test.

- the peer's phase rule (``PhaseRule``; ``TRACKED``: the calls it tracks);
- the frame core and decoder of :mod:`pccl.net.framed` and its memory budget;
- the heartbeat loop (``run_heartbeat``, over any ``HeartbeatSubject``);
- the point-to-point link's matching (``PeerLink`` with its ``Incoming``/``Outgoing``) and its
  receiver's piece-size rule (``next_piece`` with ``PIECE``, ``LARGE_PIECE``, ``HEADROOM``) and
  the sender's frame-size rule (``frame_bytes``).
"""

from __future__ import annotations

from .._peer.heartbeat import HeartbeatSubject, run_heartbeat
from .._peer.phase import TRACKED, PhaseRule
from .._peer.point import CHUNK, FIRST_FRAME, FRAME_SECONDS, LARGE_PIECE, MIN_FRAME, PIECE, Incoming, Outgoing, PeerLink, frame_bytes
from .._peer.point_data import HEADROOM, next_piece
from ..net._frames import (
    END_OF_STREAM,
    NEED_DATA,
    PROCESS_BUDGET,
    READ_AHEAD,
    ControlFrame,
    DataFrame,
    FrameCore,
    FrameDecoder,
    IncompleteFrameBudget,
)

__all__ = [
    "TRACKED", "PhaseRule", "HeartbeatSubject", "run_heartbeat", "Incoming", "Outgoing", "PeerLink",
    "PIECE", "LARGE_PIECE", "HEADROOM", "next_piece", "CHUNK", "FIRST_FRAME", "MIN_FRAME", "FRAME_SECONDS",
    "frame_bytes",
    "END_OF_STREAM", "NEED_DATA", "PROCESS_BUDGET", "READ_AHEAD", "ControlFrame", "DataFrame", "FrameCore",
    "FrameDecoder", "IncompleteFrameBudget",
]
