"""The frame sniffer reads pccl's real wire format (preamble, control frames, data frames)."""

from __future__ import annotations

import pytest

from pccl.protocol import codec, handshake
from pccl.protocol.messages import (
    CollectiveAbort,
    CollectiveCommence,
    CollectiveComplete,
    CollectiveDone,
    CollectiveInit,
    Register,
    VoteTopology,
)
from pccl.types import DType, QuantKind
from pccl_sim.engine.tap import _FrameParser
from pccl_sim.workloads.pccl.frames import AllReduceParts, PcclFrames


def _wire() -> bytes:
    data = codec.encode_data_prefix(codec.DataHeader(op_seq=1, stream=0, step=0, offset=0, nbytes=5000)) + bytes(5000)
    return (
        handshake.encode_preamble()
        + codec.encode_message(Register(peer_group=0, p2p_port=1, shared_state_port=2))
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


def test_data_headers_are_read_in_any_chunking_and_the_payload_still_skipped() -> None:
    wire = _wire() + codec.encode_data_prefix(codec.DataHeader(op_seq=7, stream=2, step=3, offset=8, nbytes=0))
    frames = PcclFrames()
    for chunk in (1, 3, 7, 64, len(wire)):
        parser = _FrameParser(frames)
        found: list[str] = []
        headers: list[bytes] = []
        for i in range(0, len(wire), chunk):
            parser.feed(wire[i : i + chunk], found, None, headers)
        assert found == ["Register", "VoteTopology"], chunk
        assert [frames.decode_data(h) for h in headers] == [  # type: ignore[attr-defined]
            codec.DataHeader(op_seq=1, stream=0, step=0, offset=0, nbytes=5000),
            codec.DataHeader(op_seq=7, stream=2, step=3, offset=8, nbytes=0),
        ], chunk


@pytest.mark.parametrize(("count", "world", "quant", "expected"), [
    (33, 4, QuantKind.NONE, ["data:exchange"] * 4),  # small: the exchange, whatever the step
    (40_000, 4, QuantKind.NONE, ["data:reduce-scatter"] * 3 + ["data:all-gather"] * 3),
    (40_000, 2, QuantKind.NONE, ["data:exchange"] * 2),  # 160 KB at two peers: an exchange
    (33, 3, QuantKind.MIN_MAX, ["data:reduce-scatter"] * 2 + ["data:all-gather"] * 2),  # quantized: the ring
])
def test_all_reduce_parts_follow_the_op_of_each_data_frame(count: int, world: int, quant: QuantKind,
                                                          expected: list[str]) -> None:
    parts = AllReduceParts()
    init = CollectiveInit(tag=5, count=count, dtype=int(DType.FLOAT32), op=0, quant_kind=int(quant),
                          quant_dtype=int(DType.UINT8) if quant else 0)

    def frame(seq: int, step: int) -> codec.DataHeader:
        return codec.DataHeader(op_seq=seq, stream=0, step=step, offset=0, nbytes=4)

    assert parts.on_data("p", 0, frame(9, 0)) is None  # no op in flight: no part
    parts.on_message("p", 0, "send", "CollectiveInit", init)
    parts.on_message("p", 0, "recv", "CollectiveCommence", CollectiveCommence(tag=5, seq=9, ring=tuple(range(world))))
    steps = range(len(expected))
    assert [parts.on_data("p", 0, frame(9, s)) for s in steps] == expected
    assert parts.on_data("p", 0, frame(8, 0)) is None  # another seq (a shared-state transfer, say)
    assert parts.on_data("q", 0, frame(9, 0)) is None  # another host
    assert parts.in_flight("p") == 1
    parts.on_message("p", 0, "send", "CollectiveDone", CollectiveDone(tag=5, seq=9))
    assert parts.on_data("p", 0, frame(9, 0)) is None and parts.in_flight("p") == 0
    for final in (CollectiveComplete(tag=5, seq=10), CollectiveAbort(tag=5, seq=10)):
        parts.on_message("p", 0, "recv", "CollectiveCommence", CollectiveCommence(tag=5, seq=10, ring=(1, 2)))
        assert parts.on_data("p", 0, frame(10, 0)) is not None
        parts.on_message("p", 0, "recv", type(final).__name__, final)
        assert parts.on_data("p", 0, frame(10, 0)) is None
    # Losing the master mid-op: no Done or final word crosses the wire.  Registering again
    # (with a restarted master, which numbers ops from 1 again) ends every op in flight.
    parts.on_message("p", 0, "recv", "CollectiveCommence", CollectiveCommence(tag=5, seq=12, ring=(1, 2)))
    assert parts.in_flight("p") == 1
    parts.on_message("p", 0, "send", "Register", Register(peer_group=0, p2p_port=1, shared_state_port=2))
    assert parts.in_flight("p") == 0 and parts.on_data("p", 0, frame(12, 0)) is None
    parts.on_message("p", 0, "recv", "CollectiveCommence", CollectiveCommence(tag=5, seq=12, ring=(1, 2)))
    assert parts.on_data("p", 0, frame(12, 0)) is None  # its Init went to the old master
    # A restarted host (a new incarnation) starts afresh.
    parts.on_message("p", 0, "recv", "CollectiveCommence", CollectiveCommence(tag=5, seq=11, ring=(1, 2)))
    assert parts.on_data("p", 1, frame(11, 0)) is None


def test_undecodable_control_body_is_ignored() -> None:
    parser = _FrameParser(PcclFrames())
    found: list[str] = []
    parser.feed(handshake.encode_preamble() + b"\x00\x00\x00\x02\x01\xff\xff" + codec.encode_message(VoteTopology()), found)
    assert found == ["VoteTopology"]
