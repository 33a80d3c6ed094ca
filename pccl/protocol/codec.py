"""Frames on the wire, encoded and decoded without any I/O.

Wire format (every integer big-endian)::

    frame   = length:u32 | kind:u8 | body[length]

``length`` counts the body only — neither the four length bytes nor the kind byte — so the fixed
5-byte prefix is read first and validated (kind known, length within limits) before a single
byte of the body is read or allocated.

``kind`` 1, CONTROL
    ``body`` is one :class:`~pccl.protocol.messages.Message` as msgpack (the tagged union;
    ``array_like``, so ``[tag, field, …]``).  ``length`` must not exceed the receiver's
    ``Config.max_frame_size``; a larger announced length is a :class:`ProtocolError` before any
    allocation.

``kind`` 2, DATA
    ``body = header[28] | payload[nbytes]`` with
    ``header = op_seq:u64 | stream:u32 | step:u32 | offset:u64 | nbytes:u32``.
    ``length`` must equal ``28 + nbytes``.  ``offset`` is a **byte** offset into the destination
    buffer that ``(op_seq, stream)`` designates — bytes rather than elements so that it can be
    checked against ``buffer.nbytes`` without knowing the dtype.  The payload is never buffered
    here: a connection reads the header, validates it against the destination, and then receives
    the payload straight into the destination memory (:mod:`pccl.net.framed`).  One data frame
    carries at most :data:`MAX_DATA_PAYLOAD` bytes (just under 4 GiB); senders split larger
    transfers.

Every malformed input raises :class:`~pccl.errors.ProtocolError` with a message that says what
was wrong (:class:`~pccl.errors.FrameTooLarge` for an oversized announced length); no msgspec,
struct, index or recursion error escapes this module.  Error texts quote peer-supplied values
only clipped (:func:`clip_text`), so a hostile frame cannot turn into a huge log line or an
unsendable ``KickNotice``.

The msgpack encoder/decoder is built over ``messages.ALL_MESSAGES`` as it is when first used and
rebuilt whenever that tuple is replaced, so messages that later modules add are always included.
"""

from __future__ import annotations

import enum
import reprlib
import struct
import typing
from collections.abc import Iterable
from typing import NamedTuple, Union

import msgspec

from ..errors import FrameTooLarge, InvalidArgument, ProtocolError
from . import messages
from .messages import Message

__all__ = [
    "FrameKind",
    "PREFIX_SIZE",
    "DATA_HEADER_SIZE",
    "MAX_DATA_PAYLOAD",
    "DataHeader",
    "build_message_union",
    "encode_message",
    "decode_message",
    "parse_prefix",
    "encode_data_prefix",
    "parse_data_header",
    "clip_text",
    "MAX_QUOTE",
    "MAX_DETAIL",
]

_PREFIX = struct.Struct(">IB")
_DATA_HEADER = struct.Struct(">QIIQI")

#: Bytes before a frame's body: ``length:u32 | kind:u8``.
PREFIX_SIZE = _PREFIX.size
#: Bytes of a data frame's fixed header (the first part of its body).
DATA_HEADER_SIZE = _DATA_HEADER.size
#: Largest payload one data frame can carry (the u32 length also covers the data header).
MAX_DATA_PAYLOAD = 0xFFFFFFFF - DATA_HEADER_SIZE

_U32_MAX = 0xFFFFFFFF
_U64_MAX = 0xFFFFFFFFFFFFFFFF

#: Characters of a peer-supplied value (or of a library error describing one) quoted in an error.
MAX_QUOTE = 200
#: Characters of free text a master puts into a ``KickNotice``/``*Rejected`` detail: small enough
#: that the notice always encodes far below any frame limit.
MAX_DETAIL = 1024


def clip_text(text: str, limit: int = MAX_QUOTE) -> str:
    """``text`` cut to at most about ``limit`` characters, saying how long it was when cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text)} characters]"


# Bounded repr of decoded msgpack values (unknown tags): nested containers are elided by depth
# and length; strings and bytes are sliced *before* repr so a 16 MiB string is never copied whole.
class _QuoteRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()  # (keyword arguments need Python 3.12)
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = 6
        self.maxlong = self.maxstring = self.maxother = 60

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[: self.maxstring]) + ("…" if len(x) > self.maxstring else "")


_quote_repr = _QuoteRepr()


def _quote(value: object) -> str:
    if isinstance(value, (str, bytes)):
        text = repr(value[:MAX_QUOTE])
        if len(value) <= MAX_QUOTE and len(text) <= MAX_QUOTE:
            return text
        return f"{text[:MAX_QUOTE]}… [{len(value)} long]"
    return clip_text(_quote_repr.repr(value))


class FrameKind(enum.IntEnum):
    """The kind byte of a frame.  Values are stable on the wire."""

    CONTROL = 1
    DATA = 2


_FRAME_KINDS: dict[int, FrameKind] = {kind.value: kind for kind in FrameKind}


# --- data frame header ---------------------------------------------------------------------------


class DataHeader(NamedTuple):
    """The fixed header of a data frame: which operation, which step, where the payload goes.

    ``op_seq`` is the operation's sequence number (a collective's ``seq`` from the master, a
    transfer id for shared state), ``stream`` distinguishes concurrent streams within it (a tensor
    index, a sub-chunk lane), ``step`` the schedule step, ``offset`` the **byte** offset of the
    payload within the destination buffer and ``nbytes`` the payload length in bytes.
    """

    op_seq: int
    stream: int
    step: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        """Byte offset just past this payload within the destination buffer."""
        return self.offset + self.nbytes

    def check(
        self,
        *,
        op_seq: int | None = None,
        stream: int | None = None,
        step: int | None = None,
        buffer_nbytes: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        """Raise :class:`ProtocolError` unless the header matches what the receiver expects.

        Every argument left ``None`` is not checked.  ``buffer_nbytes`` is the size of the
        destination buffer: the payload must fit at ``offset``.  ``nbytes`` is the exact payload
        size the receiver's schedule expects.
        """
        for name, expected in (("op_seq", op_seq), ("stream", stream), ("step", step), ("nbytes", nbytes)):
            if expected is not None and getattr(self, name) != expected:
                raise ProtocolError(
                    f"data frame has {name}={getattr(self, name)}, expected {name}={expected} ({self.describe()})"
                )
        if buffer_nbytes is not None and self.end > buffer_nbytes:
            raise ProtocolError(
                f"data frame payload [{self.offset}, {self.end}) does not fit the {buffer_nbytes}-byte "
                f"destination buffer ({self.describe()})"
            )

    def describe(self) -> str:
        """The fields as ``name=value`` text, for error messages and logs."""
        return (
            f"op_seq={self.op_seq} stream={self.stream} step={self.step} "
            f"offset={self.offset} nbytes={self.nbytes}"
        )


def encode_data_prefix(header: DataHeader) -> bytes:
    """The frame prefix plus the data header: everything that precedes the payload (33 bytes).

    :class:`InvalidArgument` if a field is out of range for its wire width.
    """
    limits = (("op_seq", _U64_MAX), ("stream", _U32_MAX), ("step", _U32_MAX), ("offset", _U64_MAX))
    for name, limit in limits:
        value = getattr(header, name)
        if not isinstance(value, int) or not 0 <= value <= limit:
            raise InvalidArgument(f"data header field {name}={value!r} is outside [0, {limit}]")
    if not isinstance(header.nbytes, int) or not 0 <= header.nbytes <= MAX_DATA_PAYLOAD:
        raise InvalidArgument(
            f"data frame payload of {header.nbytes!r} bytes is outside [0, {MAX_DATA_PAYLOAD}]; split it"
        )
    return _PREFIX.pack(DATA_HEADER_SIZE + header.nbytes, FrameKind.DATA) + _DATA_HEADER.pack(*header)


def parse_data_header(raw: bytes | bytearray | memoryview, frame_length: int) -> DataHeader:
    """Decode the 28-byte data header of a data frame whose prefix announced ``frame_length``.

    :class:`ProtocolError` if ``raw`` is not exactly one header or the announced frame length
    disagrees with the header's payload size.
    """
    if len(raw) != DATA_HEADER_SIZE:
        raise ProtocolError(f"truncated data header: {len(raw)} of {DATA_HEADER_SIZE} bytes")
    header = DataHeader(*_DATA_HEADER.unpack(raw))
    if frame_length != DATA_HEADER_SIZE + header.nbytes:
        raise ProtocolError(
            f"data frame length {frame_length} disagrees with its header: {DATA_HEADER_SIZE} header bytes "
            f"+ {header.nbytes} payload bytes"
        )
    return header


# --- frame prefix --------------------------------------------------------------------------------


def parse_prefix(raw: bytes | bytearray | memoryview, *, max_frame_size: int) -> tuple[FrameKind, int]:
    """Decode and validate a 5-byte frame prefix; return ``(kind, body_length)``.

    Checks happen here, before the caller reads or allocates the body: an unknown kind, a control
    frame longer than ``max_frame_size`` or a data frame too short to hold its header is a
    :class:`ProtocolError`.
    """
    if len(raw) != PREFIX_SIZE:
        raise ProtocolError(f"truncated frame prefix: {len(raw)} of {PREFIX_SIZE} bytes")
    length, kind_byte = _PREFIX.unpack(raw)
    kind = _FRAME_KINDS.get(kind_byte)  # (a dict lookup: the enum's own call costs more per frame)
    if kind is None:
        known = ", ".join(f"{k.value} ({k.name})" for k in FrameKind)
        raise ProtocolError(f"unknown frame kind {kind_byte}; expected one of {known}")
    if kind is FrameKind.CONTROL:
        if length > max_frame_size:
            raise FrameTooLarge(
                f"control frame of {length} bytes exceeds the limit of {max_frame_size} bytes "
                "(Config.max_frame_size)"
            )
        if length == 0:
            raise ProtocolError("empty control frame: a control frame carries one message")
    elif length < DATA_HEADER_SIZE:
        raise ProtocolError(f"data frame of {length} bytes is too short for its {DATA_HEADER_SIZE}-byte header")
    return kind, length


# --- control messages ----------------------------------------------------------------------------


def build_message_union(message_types: Iterable[type[Message]] | None = None) -> object:
    """The ``Union`` of every message type (default: ``messages.ALL_MESSAGES``), validated.

    :class:`TypeError` (a programming error, raised at import/first use, never on the wire) if a
    type is not a tagged :class:`Message` subclass, is listed twice, or two types share a tag.
    """
    types = tuple(messages.ALL_MESSAGES if message_types is None else message_types)
    if not types:
        raise TypeError("no message types registered in messages.ALL_MESSAGES")
    by_tag: dict[object, type[Message]] = {}
    for cls in types:
        if not (isinstance(cls, type) and issubclass(cls, Message)) or cls is Message:
            raise TypeError(f"{cls!r} is not a Message subclass")
        tag = cls.__struct_config__.tag
        if not isinstance(tag, int) or isinstance(tag, bool):
            raise TypeError(f"message type {cls.__name__} needs an integer tag (class {cls.__name__}(Message, tag=N))")
        if tag in by_tag:
            raise TypeError(f"message types {by_tag[tag].__name__} and {cls.__name__} share wire tag {tag}")
        by_tag[tag] = cls
    return Union[types]  # type: ignore[valid-type]


class _MessageCodec:
    """msgspec encoder and decoder over one snapshot of ``ALL_MESSAGES``."""

    def __init__(self, message_types: tuple[type[Message], ...]) -> None:
        self.message_types = message_types
        self.tags = frozenset(t.__struct_config__.tag for t in message_types)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(
            build_message_union(message_types)  # type: ignore[arg-type]
        )
        # Used only to explain a failed decode (which tag was it?); never on the fast path.
        self.raw_decoder = msgspec.msgpack.Decoder()


_codec: _MessageCodec | None = None


def _current_codec() -> _MessageCodec:
    global _codec
    current = messages.ALL_MESSAGES
    if _codec is None or _codec.message_types is not current:
        _codec = _MessageCodec(current)
    return _codec


#: The last message encoded, with its codec and frame.  The master sends one message object to
#: many peers (the same ``TopologyComplete``, carrying every member's endpoint, to each member of
#: a group): encoding it once per peer made a topology update O(N²) in the master's CPU (about
#: 50 ms per update at 1,000 peers).  Messages are immutable (frozen structs of scalars and
#: tuples), so the same object always has the same frame.
_last_encoded: tuple[Message, _MessageCodec, bytes] | None = None


def encode_message(message: Message, *, max_frame_size: int | None = None) -> bytes:
    """One complete control frame (prefix + msgpack body) for ``message``.

    :class:`InvalidArgument` if ``message`` is not a registered message type or its encoding
    exceeds ``max_frame_size`` (the peer would refuse it).  Encoding the message object encoded
    last returns the same frame without encoding it again.
    """
    global _last_encoded
    codec = _current_codec()
    last = _last_encoded
    if last is not None and last[0] is message and last[1] is codec:
        frame = last[2]
    else:
        if type(message) not in codec.message_types:
            raise InvalidArgument(
                f"{type(message).__name__} is not a registered message type (add it to messages.ALL_MESSAGES)"
            )
        try:
            body = codec.encoder.encode(message)
        except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as exc:
            raise InvalidArgument(f"cannot encode {type(message).__name__}: {exc}") from exc
        frame = _PREFIX.pack(len(body), FrameKind.CONTROL) + body
        _last_encoded = (message, codec, frame)
    if max_frame_size is not None and len(frame) - _PREFIX.size > max_frame_size:
        raise InvalidArgument(
            f"{type(message).__name__} encodes to {len(frame) - _PREFIX.size} bytes, over the {max_frame_size}-byte "
            "frame limit"
        )
    return frame


def decode_message(body: bytes | bytearray | memoryview) -> Message:
    """Decode the body of a control frame; :class:`ProtocolError` says what was wrong with it.

    Deeply nested msgpack (msgspec recurses, even to skip an unknown trailing field) is a
    ``ProtocolError`` too, never a ``RecursionError``: a 1 KiB handshake frame can nest that deep.
    """
    codec = _current_codec()
    try:
        return codec.decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise ProtocolError(_explain_invalid(codec, body, exc)) from exc
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable control frame ({len(body)} bytes): {clip_text(str(exc))}") from exc
    except RecursionError:
        raise ProtocolError(_too_deep(body)) from None


def _too_deep(body: bytes | bytearray | memoryview) -> str:
    return f"control frame of {len(body)} bytes nests too deeply to decode"


def _explain_invalid(codec: _MessageCodec, body: bytes | bytearray | memoryview, exc: Exception) -> str:
    """Turn a msgspec validation error into a message naming the message type and the field."""
    reason = clip_text(str(exc))
    try:
        raw = codec.raw_decoder.decode(body)
    except msgspec.DecodeError:
        return f"malformed control frame ({len(body)} bytes): {reason}"
    except RecursionError:
        return _too_deep(body)
    if not isinstance(raw, list) or not raw:
        return f"control frame is not a tagged message array: {reason}"
    tag = raw[0]
    if not isinstance(tag, int) or isinstance(tag, bool) or tag not in codec.tags:
        return f"unknown message tag {_quote(tag)} in control frame"
    cls = next(t for t in codec.message_types if t.__struct_config__.tag == tag)
    return f"invalid {cls.__name__} message (tag {tag}): {reason} — fields are {_field_names(cls)}"


def _field_names(cls: type[Message]) -> str:
    hints = typing.get_type_hints(cls)
    return ", ".join(f"{name}: {getattr(hints.get(name), '__name__', hints.get(name))}" for name in cls.__struct_fields__)
