"""The frame sniffer reads pccl's real wire format (preamble, control frames, data frames)."""

from __future__ import annotations

from pccl.protocol import codec, handshake
from pccl.protocol.messages import Register, VoteTopology
from sim.observe import PcclFrames, _FrameParser


def _wire() -> bytes:
    data = codec.encode_data_prefix(codec.DataHeader(op_seq=1, stream=0, step=0, offset=0, nbytes=5000)) + bytes(5000)
    return (
        handshake.encode_preamble()
        + codec.encode_message(Register(peer_group=0, p2p_port=1, shared_state_port=2, benchmark_port=3))
        + data
        + codec.encode_message(VoteTopology())
    )


def test_pccl_frames_are_named_and_data_is_skipped_in_any_chunking() -> None:
    wire = _wire()
    for chunk in (1, 3, 7, 64, len(wire)):
        parser = _FrameParser(PcclFrames())
        found: list[str] = []
        for i in range(0, len(wire), chunk):
            parser.feed(wire[i : i + chunk], found)
        assert found == ["Register", "VoteTopology"], chunk


def test_undecodable_control_body_is_ignored() -> None:
    parser = _FrameParser(PcclFrames())
    found: list[str] = []
    parser.feed(handshake.encode_preamble() + b"\x00\x00\x00\x02\x01\xff\xff" + codec.encode_message(VoteTopology()), found)
    assert found == ["VoteTopology"]
