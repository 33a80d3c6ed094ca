"""Property tests of the wire codec (pccl/protocol/codec.py) and handshake math (handshake.py).

Round trip: every message type in ``messages.ALL_MESSAGES`` — read when the tests are collected,
so messages added later are covered without touching this file — survives encode → decode,
whole and fed in arbitrary pieces.  Strategies are built from the msgspec field types; a field
type the builder does not understand fails the test rather than being skipped.

Fuzzing: garbage, truncated, mutated, deeply nested and oversized frames only ever produce
``ProtocolError`` with a message saying what was wrong (and quoting peer data only clipped), and an oversized announced length is refused from the
5-byte prefix alone, before any allocation.
"""

from __future__ import annotations

import enum
import struct
import tracemalloc
import types
import typing

import msgspec
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from pccl.errors import FrameTooLarge, InvalidArgument, ProtocolError
from pccl.protocol import codec, handshake, messages
from pccl.testing.units import END_OF_STREAM, NEED_DATA, ControlFrame, DataFrame, FrameDecoder
from pccl.protocol.codec import DATA_HEADER_SIZE, PREFIX_SIZE, DataHeader, FrameKind
from pccl.protocol.messages import HandshakeRole

MAX_FRAME = 64 * 1024
_INT_MIN, _UINT_MAX = -(2**63), 2**64 - 1

# --- strategies built from msgspec field types ---------------------------------------------------


def strategy_for(tp: object) -> st.SearchStrategy[typing.Any]:
    """A Hypothesis strategy producing valid values of the msgspec field type ``tp``.

    ``TypeError`` for a type it cannot build: the round-trip test must fail loudly then.
    """
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        return _annotated(args[0], [m for m in args[1:] if isinstance(m, msgspec.Meta)])
    if tp is type(None) or tp is None:
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(_INT_MIN, _UINT_MAX)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is str:
        return st.text(max_size=40)
    if tp is bytes:
        return st.binary(max_size=64)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(list(tp))
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        fields = msgspec.structs.fields(tp)
        return st.builds(tp, **{f.name: strategy_for(f.type) for f in fields})
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0]), max_size=5).map(tuple)
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=5)
    if origin in (set, frozenset):
        return st.frozensets(strategy_for(args[0]), max_size=5).map(origin)
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=5)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(strategy_for(a) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    raise TypeError(f"no strategy for field type {tp!r}; teach tests/property/test_codec.py::strategy_for")


def _annotated(base: object, metas: list[msgspec.Meta]) -> st.SearchStrategy[typing.Any]:
    bounds: dict[str, typing.Any] = {}
    for meta in metas:
        for name in ("ge", "gt", "le", "lt", "min_length", "max_length", "pattern", "multiple_of"):
            if getattr(meta, name) is not None:
                bounds[name] = getattr(meta, name)
    if {"pattern", "multiple_of"} & bounds.keys():
        raise TypeError(f"no strategy for {base!r} with constraints {bounds}")
    if base is int:
        low = max(_INT_MIN, bounds.get("ge", _INT_MIN), bounds.get("gt", _INT_MIN - 1) + 1)
        high = min(_UINT_MAX, bounds.get("le", _UINT_MAX), bounds.get("lt", _UINT_MAX + 1) - 1)
        return st.integers(low, high)
    if base is float:
        return st.floats(
            min_value=bounds.get("ge", bounds.get("gt")),
            max_value=bounds.get("le", bounds.get("lt")),
            exclude_min="gt" in bounds,
            exclude_max="lt" in bounds,
            allow_nan=False,
        )
    if base in (str, bytes) or typing.get_origin(base) in (tuple, list):
        size = {"min_size": bounds.get("min_length", 0), "max_size": bounds.get("max_length", 40)}
        if base is str:
            return st.text(**size)
        if base is bytes:
            return st.binary(**size)
        item = strategy_for(typing.get_args(base)[0])
        lists = st.lists(item, **size)
        return lists.map(tuple) if typing.get_origin(base) is tuple else lists
    if bounds:
        raise TypeError(f"no strategy for {base!r} with constraints {bounds}")
    return strategy_for(base)


def test_strategy_builder_refuses_unknown_types() -> None:
    # Otherwise a new message with an exotic field could slip through the round trip untested.
    with pytest.raises(TypeError, match="no strategy"):
        strategy_for(complex)


# --- round trip of every message -----------------------------------------------------------------


def _tag(cls: type[messages.Message]) -> int:
    return cls.__struct_config__.tag  # type: ignore[return-value]


@pytest.mark.parametrize("message_type", messages.ALL_MESSAGES, ids=lambda cls: cls.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(message_type: type[messages.Message], data: st.DataObject) -> None:
    message = data.draw(strategy_for(message_type), label="message")
    frame = codec.encode_message(message, max_frame_size=MAX_FRAME)
    kind, length = codec.parse_prefix(frame[:PREFIX_SIZE], max_frame_size=MAX_FRAME)
    assert (kind, length) == (FrameKind.CONTROL, len(frame) - PREFIX_SIZE)
    decoded = codec.decode_message(frame[PREFIX_SIZE:])
    assert type(decoded) is message_type
    assert decoded == message

    # The same frame fed to the incremental decoder in arbitrary pieces.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(frame)), max_size=4), label="cuts"))
    decoder = FrameDecoder(max_frame_size=MAX_FRAME)
    events = []
    for start, end in zip([0, *cuts], [*cuts, len(frame)]):
        decoder.feed(frame[start:end])
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
    decoder.feed_eof()
    assert decoder.next_event() is END_OF_STREAM
    assert events == [ControlFrame(message)]


def test_message_tags_are_unique_and_in_documented_ranges() -> None:
    ranges = [range(1, 50), range(50, 80), range(80, 110), range(110, 130), range(130, 160), range(160, 170), range(200, 220)]
    tags = [_tag(cls) for cls in messages.ALL_MESSAGES]
    assert len(tags) == len(set(tags))
    assert [t for t in tags if not any(t in r for r in ranges)] == []
    assert {messages.Hello, messages.AuthProof, messages.AuthResult} <= set(messages.ALL_MESSAGES)


def test_every_message_class_is_registered_exactly_once() -> None:
    # The classes live in several modules of the messages package; ALL_MESSAGES must list each
    # once, whichever module defines it.
    def subclasses(cls: type) -> set[type]:
        return {sub for direct in cls.__subclasses__() for sub in {direct} | subclasses(direct)}

    defined = {cls for cls in subclasses(messages.Message) if cls.__module__.startswith(messages.__name__)}
    assert len(messages.ALL_MESSAGES) == len(set(messages.ALL_MESSAGES))
    assert set(messages.ALL_MESSAGES) == defined


def test_union_builder_rejects_duplicate_tags_and_non_messages() -> None:
    class Clash(messages.Message, tag=_tag(messages.Hello)):
        pass

    with pytest.raises(TypeError, match="share wire tag"):
        codec.build_message_union([messages.Hello, Clash])
    with pytest.raises(TypeError, match="not a Message subclass"):
        codec.build_message_union([messages.Hello, int])  # type: ignore[list-item]


def test_codec_picks_up_messages_added_later(monkeypatch: pytest.MonkeyPatch) -> None:
    class LateArrival(messages.Message, tag=219):
        note: str

    with pytest.raises(InvalidArgument, match="not a registered message type"):
        codec.encode_message(LateArrival("x"))
    monkeypatch.setattr(messages, "ALL_MESSAGES", (*messages.ALL_MESSAGES, LateArrival))
    frame = codec.encode_message(LateArrival("hello"))
    assert codec.decode_message(frame[PREFIX_SIZE:]) == LateArrival("hello")


def test_encoder_enforces_the_frame_limit_locally() -> None:
    with pytest.raises(InvalidArgument, match="over the 2000-byte frame limit"):
        codec.encode_message(messages.AuthResult(ok=False, reason="x" * 5000), max_frame_size=2000)


def test_the_frame_limit_holds_for_a_message_encoded_again() -> None:
    big = messages.AuthResult(ok=False, reason="x" * 5000)
    codec.encode_message(big)
    with pytest.raises(InvalidArgument, match="over the 2000-byte frame limit"):
        codec.encode_message(big, max_frame_size=2000)


def test_one_message_sent_to_many_peers_is_encoded_once() -> None:
    """The master sends one ``TopologyComplete`` object (every member's endpoint) to each member
    of a group: N encodes of N endpoints per update made it O(N²).  Every encode makes a new
    bytes object, so one frame object for all 199 sends means one encode."""
    ring = tuple(messages.PeerEndpoint(i, f"10.0.0.{i}", 48000 + i, 49000 + i) for i in range(1, 200))
    complete = messages.TopologyComplete(7, ring, messages.Membership(199, 199, 1, 199))
    frames = [codec.encode_message(complete, max_frame_size=MAX_FRAME) for _ in range(199)]
    assert all(f is frames[0] for f in frames)
    assert codec.decode_message(frames[0][PREFIX_SIZE:]) == complete
    twin = messages.TopologyComplete(7, ring, messages.Membership(199, 199, 1, 199))  # equal, not the same
    again = codec.encode_message(twin)
    assert again == frames[0] and again is not frames[0]


# --- decoding bad control bodies -----------------------------------------------------------------


def test_decode_errors_say_what_was_wrong() -> None:
    encode = msgspec.msgpack.encode
    cases = {
        encode([199, True]): "unknown message tag 199",
        encode(["Hello"]): "unknown message tag 'Hello'",
        encode([_tag(messages.Hello), 7, True, b"n"]): "invalid Hello message",
        encode([_tag(messages.AuthResult), "yes"]): "Expected `bool`, got `str`",
        encode({"t": 200}): "not a tagged message array",
        b"\xc1": "undecodable control frame",
        encode([_tag(messages.AuthResult), True, "reason"])[:-2]: "undecodable control frame .* truncated",
    }
    for body, expected in cases.items():
        with pytest.raises(ProtocolError, match=expected):
            codec.decode_message(body)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(_INT_MIN, _UINT_MAX) | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(tag=st.sampled_from([_tag(c) for c in messages.ALL_MESSAGES]) | st.integers(0, 300), fields=st.lists(_msgpack_values, max_size=6))
def test_decoding_arbitrary_tagged_arrays_is_a_message_or_protocol_error(tag: int, fields: list[object]) -> None:
    body = msgspec.msgpack.encode([tag, *fields])
    try:
        message = codec.decode_message(body)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(message, messages.Message) and _tag(type(message)) == tag


@settings(max_examples=300, deadline=None)
@given(body=st.binary(max_size=200))
def test_decoding_garbage_bodies_is_a_protocol_error(body: bytes) -> None:
    try:
        codec.decode_message(body)
    except ProtocolError as exc:
        assert str(exc)


# Deep nesting: msgspec recurses per level (also to skip an unknown trailing field of a known
# message), so these overflow the interpreter's recursion limit; a 1 KiB handshake frame suffices.
_DEEP_BODIES = {
    "untyped arrays": b"\x91" * 2000,
    "trailing field of Heartbeat": b"\x92" + bytes([5]) + b"\x91" * 2000,
    "maps": b"\x81\x00" * 2000,
    "array16 in a known message": b"\x93" + bytes([41]) + b"\x01" + b"\xdc\x00\x01" * 1000,
    "handshake-sized": b"\x91" * 1000,
}


@pytest.mark.parametrize("body", list(_DEEP_BODIES.values()), ids=list(_DEEP_BODIES))
def test_deeply_nested_bodies_are_protocol_errors_not_recursion_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError, match="nests too deeply"):
        codec.decode_message(body)
    decoder = FrameDecoder(max_frame_size=MAX_FRAME)
    decoder.feed(struct.pack(">IB", len(body), FrameKind.CONTROL) + body)
    with pytest.raises(ProtocolError, match="nests too deeply"):
        decoder.next_event()


@settings(max_examples=60, deadline=None)
@given(
    head=st.sampled_from([b"", b"\x92\x05", b"\x92\xcc\xc7", b"\x93\x28\x01"]),
    opener=st.sampled_from([b"\x91", b"\x81\x00", b"\xdc\x00\x01", b"\xdf\x00\x00\x00\x01\xa1k"]),
    depth=st.integers(1, 4000),
    tail=st.binary(max_size=8),
)
def test_nested_bodies_of_any_depth_are_a_message_or_protocol_error(head: bytes, opener: bytes, depth: int,
                                                                    tail: bytes) -> None:
    try:
        message = codec.decode_message(head + opener * depth + tail)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(message, messages.Message)


@pytest.mark.parametrize("tag", ["\x00" * (5 * 1024 * 1024), b"\xff" * (1024 * 1024), [["x" * 1000] * 100] * 10,
                                 {"k" * 100_000: b"v" * 100_000}, -(2**63)],
                         ids=["nul-string", "bytes", "nested-lists", "dict", "int"])
def test_unknown_tags_are_quoted_clipped(tag: object) -> None:
    body = msgspec.msgpack.encode([tag, 1, 2])
    with pytest.raises(ProtocolError, match="unknown message tag") as info:
        codec.decode_message(body)
    assert len(str(info.value)) < 2 * codec.MAX_QUOTE


def test_clip_text_keeps_short_text_and_says_how_long_cut_text_was() -> None:
    assert codec.clip_text("short") == "short"
    clipped = codec.clip_text("x" * 1000, 10)
    assert clipped.startswith("x" * 10) and "1000 characters" in clipped and len(clipped) < 40


def test_oversized_frames_raise_frame_too_large_and_nothing_else_does() -> None:
    with pytest.raises(FrameTooLarge):
        codec.parse_prefix(struct.pack(">IB", MAX_FRAME + 1, FrameKind.CONTROL), max_frame_size=MAX_FRAME)
    decoder = FrameDecoder(max_frame_size=MAX_FRAME, max_data_payload=10)
    decoder.feed(codec.encode_data_prefix(DataHeader(1, 0, 0, 0, 11)))
    with pytest.raises(FrameTooLarge):
        decoder.next_event()
    # Peer-chosen text that *says* "exceeds the limit" is an ordinary protocol error.
    with pytest.raises(ProtocolError, match="exceeds the limit") as info:
        codec.decode_message(msgspec.msgpack.encode(["control frame of 1 bytes exceeds the limit"]))
    assert not isinstance(info.value, FrameTooLarge)


def test_huge_announced_msgpack_containers_allocate_nothing() -> None:
    # A 5-byte body announcing a 4-billion-element array / 4 GiB bin must not be allocated.
    tracemalloc.start()
    try:
        for body in (b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\x91\xdd\xff\xff\xff\xff"):
            with pytest.raises(ProtocolError):
                codec.decode_message(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024


# --- frame prefixes and data headers -------------------------------------------------------------


def test_oversized_control_length_is_refused_from_the_prefix_alone() -> None:
    # 4 GiB announced; only the 5 prefix bytes exist.  The decoder must fail now, not wait for
    # (or allocate room for) the body.
    prefix = struct.pack(">IB", 0xFFFFFFFF, FrameKind.CONTROL)
    tracemalloc.start()
    try:
        decoder = FrameDecoder(max_frame_size=MAX_FRAME)
        decoder.feed(prefix)
        with pytest.raises(ProtocolError, match=r"control frame of 4294967295 bytes exceeds the limit of 65536"):
            decoder.next_event()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    with pytest.raises(ProtocolError, match="unusable after an earlier error"):
        decoder.next_event()


@given(length=st.integers(MAX_FRAME + 1, 0xFFFFFFFF))
def test_any_control_length_above_the_limit_is_refused(length: int) -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.parse_prefix(struct.pack(">IB", length, FrameKind.CONTROL), max_frame_size=MAX_FRAME)


@given(kind=st.integers(0, 255).filter(lambda k: k not in set(FrameKind)), length=st.integers(0, 0xFFFFFFFF))
def test_unknown_frame_kinds_are_refused(kind: int, length: int) -> None:
    with pytest.raises(ProtocolError, match=f"unknown frame kind {kind}"):
        codec.parse_prefix(struct.pack(">IB", length, kind), max_frame_size=MAX_FRAME)


def test_prefix_edge_cases() -> None:
    with pytest.raises(ProtocolError, match="empty control frame"):
        codec.parse_prefix(struct.pack(">IB", 0, FrameKind.CONTROL), max_frame_size=MAX_FRAME)
    with pytest.raises(ProtocolError, match="too short for its 28-byte header"):
        codec.parse_prefix(struct.pack(">IB", 27, FrameKind.DATA), max_frame_size=MAX_FRAME)
    with pytest.raises(ProtocolError, match="truncated frame prefix"):
        codec.parse_prefix(b"\x00\x00", max_frame_size=MAX_FRAME)
    # A data frame's size is bounded by the destination, not by max_frame_size.
    big = DATA_HEADER_SIZE + 10 * MAX_FRAME
    assert codec.parse_prefix(struct.pack(">IB", big, FrameKind.DATA), max_frame_size=MAX_FRAME) == (FrameKind.DATA, big)


_headers = st.builds(
    DataHeader,
    op_seq=st.integers(0, 2**64 - 1),
    stream=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    nbytes=st.integers(0, codec.MAX_DATA_PAYLOAD),
)


@given(header=_headers)
def test_data_headers_round_trip(header: DataHeader) -> None:
    raw = codec.encode_data_prefix(header)
    assert len(raw) == PREFIX_SIZE + DATA_HEADER_SIZE
    kind, length = codec.parse_prefix(raw[:PREFIX_SIZE], max_frame_size=MAX_FRAME)
    assert kind is FrameKind.DATA
    assert codec.parse_data_header(raw[PREFIX_SIZE:], length) == header


@given(header=_headers, delta=st.integers(-(2**20), 2**20).filter(bool))
def test_data_frame_length_must_match_its_header(header: DataHeader, delta: int) -> None:
    assume(0 <= DATA_HEADER_SIZE + header.nbytes + delta <= 0xFFFFFFFF)
    raw = codec.encode_data_prefix(header)[PREFIX_SIZE:]
    with pytest.raises(ProtocolError, match="disagrees with its header"):
        codec.parse_data_header(raw, DATA_HEADER_SIZE + header.nbytes + delta)


def test_data_header_fields_are_range_checked_on_encode() -> None:
    with pytest.raises(InvalidArgument, match="step"):
        codec.encode_data_prefix(DataHeader(0, 0, 2**32, 0, 0))
    with pytest.raises(InvalidArgument, match="split it"):
        codec.encode_data_prefix(DataHeader(0, 0, 0, 0, codec.MAX_DATA_PAYLOAD + 1))


def test_data_header_check_names_the_mismatch() -> None:
    header = DataHeader(op_seq=7, stream=1, step=3, offset=96, nbytes=64)
    header.check(op_seq=7, stream=1, step=3, buffer_nbytes=160, nbytes=64)
    with pytest.raises(ProtocolError, match="op_seq=8, expected op_seq=7"):
        DataHeader(8, 1, 3, 96, 64).check(op_seq=7)
    with pytest.raises(ProtocolError, match=r"\[96, 160\) does not fit the 128-byte destination"):
        header.check(buffer_nbytes=128)
    with pytest.raises(ProtocolError, match="nbytes=64, expected nbytes=32"):
        header.check(nbytes=32)


# --- the incremental decoder under fuzzing -------------------------------------------------------


def _drain(decoder: FrameDecoder) -> list[ControlFrame | DataFrame]:
    """Every event until END_OF_STREAM; ProtocolError propagates, anything else fails the test."""
    events: list[ControlFrame | DataFrame] = []
    while True:
        event = decoder.next_event()
        if event is END_OF_STREAM:
            return events
        assert event is not NEED_DATA, "decoder asked for data after EOF instead of failing"
        events.append(event)  # type: ignore[arg-type]


_frames = st.one_of(
    st.sampled_from(messages.ALL_MESSAGES).flatmap(strategy_for).map(ControlFrame),
    st.builds(
        lambda seq, step, offset, payload: DataFrame(DataHeader(seq, 0, step, offset, len(payload)), payload),
        st.integers(0, 2**64 - 1),
        st.integers(0, 2**32 - 1),
        st.integers(0, 2**40),
        st.binary(max_size=300),
    ),
)


def _encode(frame: ControlFrame | DataFrame) -> bytes:
    if isinstance(frame, ControlFrame):
        return codec.encode_message(frame.message)
    return codec.encode_data_prefix(frame.header) + frame.payload


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frames, max_size=6), data=st.data())
def test_valid_streams_decode_to_the_frames_sent(frames: list[ControlFrame | DataFrame], data: st.DataObject) -> None:
    wire = b"".join(_encode(f) for f in frames)
    decoder = FrameDecoder(max_frame_size=MAX_FRAME)
    position = 0
    events: list[object] = []
    while position < len(wire):
        step = data.draw(st.integers(1, max(1, len(wire) - position)), label="chunk")
        decoder.feed(wire[position : position + step])
        position += step
        while (event := decoder.next_event()) is not NEED_DATA:
            events.append(event)
    decoder.feed_eof()
    assert events + _drain(decoder) == frames


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(frames=st.lists(_frames, min_size=1, max_size=4), data=st.data())
def test_mutated_streams_fail_only_with_protocol_errors(frames: list[ControlFrame | DataFrame], data: st.DataObject) -> None:
    wire = bytearray(b"".join(_encode(f) for f in frames))
    mutation = data.draw(st.sampled_from(["flip", "truncate", "insert", "length"]), label="mutation")
    at = data.draw(st.integers(0, len(wire) - 1), label="at")
    if mutation == "flip":
        wire[at] ^= data.draw(st.integers(1, 255), label="xor")
    elif mutation == "truncate":
        del wire[at:]
    elif mutation == "insert":
        wire[at:at] = data.draw(st.binary(min_size=1, max_size=16), label="garbage")
    else:  # overwrite the first frame's length with anything
        wire[:4] = struct.pack(">I", data.draw(st.integers(0, 0xFFFFFFFF), label="length"))
    decoder = FrameDecoder(max_frame_size=MAX_FRAME, max_data_payload=4096)
    decoder.feed(wire)
    decoder.feed_eof()
    try:
        events = _drain(decoder)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert all(isinstance(e, (ControlFrame, DataFrame)) for e in events)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=400), chunk=st.integers(1, 64))
def test_garbage_streams_fail_only_with_protocol_errors(garbage: bytes, chunk: int) -> None:
    decoder = FrameDecoder(max_frame_size=MAX_FRAME, max_data_payload=4096)
    try:
        for i in range(0, len(garbage), chunk):
            decoder.feed(garbage[i : i + chunk])
            while decoder.next_event() is not NEED_DATA:
                pass
        decoder.feed_eof()
        _drain(decoder)
    except ProtocolError as exc:
        assert str(exc)
    assert decoder.buffered <= len(garbage)


def test_truncated_frame_at_eof_is_a_protocol_error() -> None:
    frame = codec.encode_message(messages.AuthResult(ok=True))
    decoder = FrameDecoder(max_frame_size=MAX_FRAME)
    decoder.feed(frame[:-1])
    assert decoder.next_event() is NEED_DATA
    decoder.feed_eof()
    with pytest.raises(ProtocolError, match=f"truncated frame at end of stream: {len(frame) - 1} of {len(frame)} bytes"):
        decoder.next_event()


def test_decoder_refuses_data_frames_it_would_have_to_buffer_beyond_its_limit() -> None:
    decoder = FrameDecoder(max_frame_size=MAX_FRAME, max_data_payload=1000)
    decoder.feed(codec.encode_data_prefix(DataHeader(1, 0, 0, 0, 2**31)))
    with pytest.raises(ProtocolError, match="exceeds this decoder's limit of 1000"):
        decoder.next_event()


# --- handshake preamble and proofs ---------------------------------------------------------------


def test_preamble_round_trip_and_version_mismatch_names_both_versions() -> None:
    assert handshake.parse_preamble(handshake.encode_preamble()) == handshake.PROTOCOL_VERSION
    with pytest.raises(ProtocolError, match="this side speaks version 1, the peer speaks version 10"):
        handshake.parse_preamble(handshake.encode_preamble(10), local_version=1)
    with pytest.raises(ProtocolError, match="not a pccl peer"):
        handshake.parse_preamble(b"GET / HTTP/1")


@given(raw=st.binary(min_size=0, max_size=20))
def test_any_other_preamble_is_a_protocol_error(raw: bytes) -> None:
    assume(raw != handshake.encode_preamble())
    with pytest.raises(ProtocolError):
        handshake.parse_preamble(raw)


_nonces = st.binary(min_size=handshake.NONCE_SIZE, max_size=handshake.NONCE_SIZE)
_tokens = st.binary(min_size=1, max_size=64)


@given(token=_tokens, other=_tokens, a=_nonces, b=_nonces)
# HMAC pads short keys with zeros: used as the key itself, b"\0" and b"\0\0" proved each other.
@example(token=b"\x00", other=b"\x00\x00", a=bytes(handshake.NONCE_SIZE), b=bytes(handshake.NONCE_SIZE))
@example(token=b"run-token", other=b"run-token\x00", a=bytes(handshake.NONCE_SIZE), b=bytes(handshake.NONCE_SIZE))
def test_proofs_bind_token_role_and_both_nonces(token: bytes, other: bytes, a: bytes, b: bytes) -> None:
    proof = handshake.auth_proof(token, prover=HandshakeRole.CLIENT, prover_nonce=a, verifier_nonce=b)
    kwargs = dict(prover=HandshakeRole.CLIENT, prover_nonce=a, verifier_nonce=b)
    assert handshake.verify_proof(token, proof, **kwargs)  # type: ignore[arg-type]
    if other != token:
        assert not handshake.verify_proof(other, proof, **kwargs)  # type: ignore[arg-type]
    # A proof is never valid for the other role — this is what defeats reflection.
    assert not handshake.verify_proof(token, proof, prover=HandshakeRole.SERVER, prover_nonce=a, verifier_nonce=b)
    if a != b:
        assert not handshake.verify_proof(token, proof, prover=HandshakeRole.CLIENT, prover_nonce=b, verifier_nonce=a)


def test_token_normalisation() -> None:
    assert handshake.normalize_token("sécret") == "sécret".encode()
    assert handshake.normalize_token(None) is None
    with pytest.raises(InvalidArgument, match="must not be empty"):
        handshake.normalize_token("")


def test_hello_checks_role_and_nonce() -> None:
    nonce = bytes(handshake.NONCE_SIZE)
    handshake.check_hello(messages.Hello(HandshakeRole.SERVER, False, nonce), local_role=HandshakeRole.CLIENT)
    with pytest.raises(ProtocolError, match="role conflict"):
        handshake.check_hello(messages.Hello(HandshakeRole.CLIENT, False, nonce), local_role=HandshakeRole.CLIENT)
    with pytest.raises(ProtocolError, match="nonce has 3 bytes"):
        handshake.check_hello(messages.Hello(HandshakeRole.SERVER, False, b"abc"), local_role=HandshakeRole.CLIENT)
