"""Watching the wire: frame sniffing, phase triggers and per-host phases — no hooks in the code
under test.

The network calls a :class:`Tap` with the bytes each host sends (as they enter its send buffer),
reads (as its application consumes them) and each link carries.  The tap parses the byte streams
with the scenario's :class:`FrameFormat` (e.g. :class:`LengthKindFrames`: an optional preamble,
then ``length:u32 | kind:u8 | body`` frames, control bodies decoded to message names, data
payloads skipped without copying) and

* fires armed phase triggers (:class:`pccl_sim.engine.schedule.Trigger`): "after H sends/reads message
  M for the n-th time", "after a→b carried x bytes", possibly chained with ``after``;
* keeps each host's *phase*: the last control message it sent or read, or the part its last data
  frame belonged to when the format names data frames (:class:`DataParts`); the coverage matrix
  of where faults land is built from it.

A trigger fires synchronously, inside the network call that completed the condition: a kill
"after H sends M" therefore puts M on the wire and then cuts H before it does anything else.
"""
from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any, Protocol

from .schedule import FaultEvent, Trigger

if TYPE_CHECKING:
    from .sockets import Socket

__all__ = ["FrameFormat", "DataParts", "LengthKindFrames", "Tap"]


class FrameFormat(Protocol):
    """How to cut a connection's byte stream into frames and name its control messages.

    Optional members the tap uses when present: ``decode(body)`` (the decoded control message
    handed to :meth:`Tap.watch` callbacks), ``decode_data(raw)`` (a data frame's header, for
    :meth:`Tap.watch_data`), ``data_parts`` (a factory of the run's :class:`DataParts`) and
    ``restart_after`` (names of control messages after which that direction of the stream
    starts over with a preamble: a relay's splice, where the two ends' own connection begins
    inside the one to the relay).
    """

    #: Bytes at the start of every connection that are not frames (skipped).
    preamble_size: int
    #: Bytes of the fixed frame prefix.
    prefix_size: int
    #: Control bodies longer than this are not decoded (their frame is skipped).
    max_decoded_body: int

    def parse_prefix(self, prefix: bytes) -> tuple[int, bool]:
        """``(body_length, is_control)`` of the frame starting with ``prefix``."""

    def message_name(self, body: bytes) -> str | None:
        """The control message's name, or ``None`` if it cannot be decoded."""

    def data_header(self, prefix: bytes) -> int:
        """Bytes of header after ``prefix`` to hand (with the prefix) to data watchers; 0 for
        frames that are not data frames."""


class DataParts(Protocol):
    """Names data frames by the part of a larger operation they belong to (e.g. the steps of a
    collective), read off the wire.  The tap feeds it the control messages named in ``MESSAGES``
    (decoded) and every data frame's header; the part it names becomes the host's phase and can
    fire message triggers like a control message."""

    #: The control messages it follows.
    MESSAGES: AbstractSet[str]

    def on_message(self, host: str, incarnation: int, direction: str, name: str, message: Any) -> None:
        """``host`` (incarnation ``incarnation``) sent or read the control message ``name``."""

    def on_data(self, host: str, incarnation: int, header: Any) -> str | None:
        """The part the data frame with ``header`` belongs to, or ``None``."""

    def in_flight(self, host: str) -> int:
        """Operations in flight on ``host`` (the coverage matrix notes when there are several)."""


class LengthKindFrames:
    """``length:u32 | kind:u8 | body`` frames (big-endian); ``control_kind`` bodies are named by
    ``namer``, ``data_kind`` frames start with a ``data_header_size``-byte header."""

    prefix_size = 5
    _prefix = struct.Struct(">IB")

    def __init__(
        self,
        namer: Callable[[bytes], str | None],
        *,
        control_kind: int = 1,
        preamble_size: int = 0,
        max_decoded_body: int = 64 * 1024,
        data_kind: int | None = None,
        data_header_size: int = 0,
    ) -> None:
        self._namer = namer
        self.control_kind = control_kind
        self.preamble_size = preamble_size
        self.max_decoded_body = max_decoded_body
        self.data_kind = data_kind
        self.data_header_size = data_header_size

    def parse_prefix(self, prefix: bytes) -> tuple[int, bool]:
        length, kind = self._prefix.unpack(prefix)
        return length, kind == self.control_kind

    def data_header(self, prefix: bytes) -> int:
        """Bytes of data header at the start of this frame's body worth handing to data
        watchers (:meth:`Tap.watch_data`); 0 for frames that are not data frames."""
        length, kind = self._prefix.unpack(prefix)
        if kind != self.data_kind or length < self.data_header_size:
            return 0
        return self.data_header_size

    def message_name(self, body: bytes) -> str | None:
        return self._namer(body)


class _FrameParser:
    """Incremental, copy-light frame splitter for one direction of one stream (and who is at
    its ends, for the tap's reports)."""

    __slots__ = ("fmt", "skip", "head", "body_left", "body", "decode", "data_head", "data_left", "payload_left",
                 "_split", "inc", "host", "peer", "_restart")

    def __init__(self, fmt: FrameFormat, inc: Any = None, peer: str = "") -> None:
        self.fmt = fmt
        self.skip = fmt.preamble_size  # bytes to ignore (preamble, skipped bodies)
        self.head = bytearray()
        self.body_left = 0
        self.body: bytearray | None = None
        self.decode = False
        self.data_head: bytearray | None = None  # a data frame's header being collected
        self.data_left = 0  # its header bytes still to come
        self.payload_left = 0  # and the payload after it (skipped)
        #: (control kind, data kind, data header size, max decoded body) when ``fmt`` cuts frames
        #: as :class:`LengthKindFrames` does: prefixes are then read in place (no method calls,
        #: no prefix copy), which is most of the tap's cost per frame.
        self._split: tuple[int, int | None, int, int] | None = None
        cls = type(fmt)
        if (isinstance(fmt, LengthKindFrames) and cls.parse_prefix is LengthKindFrames.parse_prefix
                and cls.data_header is LengthKindFrames.data_header and fmt.prefix_size == 5):
            self._split = (fmt.control_kind, fmt.data_kind, fmt.data_header_size, fmt.max_decoded_body)
        self.inc = inc
        self.host: str = inc.name if inc is not None else ""
        self.peer = peer
        #: Control messages after which a new preamble follows (``FrameFormat.restart_after``).
        self._restart: frozenset[str] = frozenset(getattr(fmt, "restart_after", ()))

    def feed(self, data: memoryview | bytes, found: list[str], bodies: list[bytes] | None = None,
             data_headers: list[bytes] | None = None) -> None:
        """Parse ``data``; append the names of completed control messages to ``found`` (and,
        if given, their bodies to ``bodies``, index for index) and, if ``data_headers`` is
        given, the header bytes of every data frame (``FrameFormat.data_header``)."""
        end = len(data)
        if self.skip >= end:  # inside a skipped payload (or nothing to read)
            self.skip -= end
            return
        view = memoryview(data)
        pos = 0
        fmt = self.fmt
        prefix_size = fmt.prefix_size
        split = self._split
        while pos < end:
            if self.skip:
                k = min(self.skip, end - pos)
                self.skip -= k
                pos += k
                continue
            if self.data_head is not None:
                k = min(self.data_left, end - pos)
                self.data_head += view[pos : pos + k]
                self.data_left -= k
                pos += k
                if self.data_left == 0:
                    if data_headers is not None:
                        data_headers.append(bytes(self.data_head))  # prefix + header
                    self.data_head = None
                    self.skip = self.payload_left
                continue
            if self.body is not None:
                whole: bytes | None = None
                if not self.body and self.body_left <= end - pos:
                    # The whole body is here (the common case): one copy, no accumulation.
                    k = self.body_left
                    whole = bytes(view[pos : pos + k])
                else:
                    k = min(self.body_left, end - pos)
                    self.body += view[pos : pos + k]
                self.body_left -= k
                pos += k
                if self.body_left == 0:
                    self._control(whole if whole is not None else bytes(self.body), found, bodies)
                    self.body = None
                continue
            if split is not None and not self.head and end - pos >= 5:
                # A whole prefix is here: the common case, read in place.
                length, kind = _PREFIX.unpack_from(view, pos)
                start = pos
                pos += 5
                control_kind, data_kind, header_size, max_body = split
                if kind == control_kind:
                    if length > max_body:
                        self.skip = length
                    elif length <= end - pos:  # and its whole body
                        self._control(bytes(view[pos : pos + length]), found, bodies)
                        pos += length
                    else:
                        self.body = bytearray()
                        self.body_left = length
                    continue
                if data_headers is None or kind != data_kind or length < header_size or not header_size:
                    self.skip = length
                elif end - pos >= header_size:  # the whole data header is here
                    data_headers.append(bytes(view[start : pos + header_size]))
                    pos += header_size
                    self.skip = length - header_size
                else:
                    self.data_head = bytearray(view[start:pos])
                    self.data_left = header_size
                    self.payload_left = length - header_size
                continue
            if not self.head and end - pos >= prefix_size:
                prefix = bytes(view[pos : pos + prefix_size])  # the whole prefix is here
                pos += prefix_size
            else:
                k = min(prefix_size - len(self.head), end - pos)
                self.head += view[pos : pos + k]
                pos += k
                if len(self.head) < prefix_size:
                    continue
                prefix = bytes(self.head)
                self.head.clear()
            length, control = fmt.parse_prefix(prefix)
            if control and length <= fmt.max_decoded_body:
                if length == 0:
                    self._control(b"", found, bodies)
                else:
                    self.body = bytearray()
                    self.body_left = length
                continue
            header = fmt.data_header(prefix) if data_headers is not None and not control else 0
            if not header:
                self.skip = length
            elif end - pos >= header:  # the whole data header is here
                assert data_headers is not None
                data_headers.append(prefix + bytes(view[pos : pos + header]))
                pos += header
                self.skip = length - header
            else:
                self.data_head = bytearray(prefix)
                self.data_left = header
                self.payload_left = length - header

    def _control(self, body: bytes, found: list[str], bodies: list[bytes] | None) -> None:
        name = self.fmt.message_name(body)
        if name is not None:
            found.append(name)
            if bodies is not None:
                bodies.append(body)
            if name in self._restart:
                self.skip = self.fmt.preamble_size


_PREFIX = struct.Struct(">IB")


@dataclasses.dataclass
class _Armed:
    event: FaultEvent
    stages: list[Trigger]  # innermost ``after`` first, the event's own trigger last
    stage: int = 0
    count: int = 0


def _stages(trigger: Trigger) -> list[Trigger]:
    chain = []
    node: Trigger | None = trigger
    while node is not None:
        chain.append(node)
        node = node.after
    return chain[::-1]


class Tap:
    """Observer installed as ``World.tap`` (see the module docstring).

    ``fire(event)`` is called when an armed event's trigger completes; ``on_message(host,
    direction, name, peer)`` for every control message seen (the runner traces phases with it).
    """

    def __init__(
        self,
        fmt: FrameFormat | None,
        fire: Callable[[FaultEvent], None],
        on_message: Callable[[str, str, str, str], None] | None = None,
    ) -> None:
        self.fmt = fmt
        self._fire = fire
        self._on_message = on_message
        self._parsers: dict[tuple[int, str], _FrameParser] = {}
        self._armed: list[_Armed] = []
        self._watchers: list[tuple[Callable[[str, str, str, str, Any], None], frozenset[str] | None, bool]] = []
        self._data_watchers: list[Callable[[str, str, Any, str, str | None], None]] = []
        #: Names data frames (the format's ``data_parts``): like control messages, a named data
        #: frame sets its host's phase and can fire message triggers.
        parts = getattr(fmt, "data_parts", None)
        self.parts: DataParts | None = parts() if parts is not None else None
        #: Last control message each host sent or read: its protocol phase.
        self.phase: dict[str, str] = {}
        self.messages_seen = 0
        self._decode: Callable[[bytes], Any] | None = getattr(fmt, "decode", None)
        self._decode_data: Callable[[bytes], Any] | None = getattr(fmt, "decode_data", None)
        #: message name -> the watchers it goes to ((callback, wants decoded), in registration
        #: order), built on first sight of the name; reset by :meth:`watch`.
        self._watchers_of: dict[str, list[tuple[Callable[[str, str, str, str, Any], None], bool]]] = {}

    def watch(
        self,
        callback: Callable[[str, str, str, str, Any], None],
        names: Iterable[str] | None = None,
        *,
        decode: bool = True,
    ) -> None:
        """Call ``callback(host, direction, name, peer, message)`` for every control message
        (or only those named in ``names``), synchronously inside the network call that moved it.
        ``message`` is the decoded object when ``decode`` is set and the frame format has a
        ``decode(body)`` method, else ``None``.  Checkers use it to read what the wire carries
        (e.g. a round id inside a message)."""
        self._watchers.append((callback, None if names is None else frozenset(names), decode))
        self._watchers_of = {}  # a new dict: a delivery in progress keeps the lists it had

    def watch_data(self, callback: Callable[[str, str, Any, str, str | None], None]) -> None:
        """Call ``callback(host, direction, header, peer, part)`` for every data frame a host
        sends or reads, once its header has passed (``header``: the format's
        ``decode_data(raw)`` of the frame's prefix and header bytes, or those raw bytes if it has
        none; ``part``: its name from the format's :class:`DataParts`, or ``None``).  The payload
        is still skipped, never copied."""
        self._data_watchers = [*self._data_watchers, callback]  # a delivery in progress keeps its list

    # -- arming --

    def arm(self, event: FaultEvent) -> None:
        assert event.trigger is not None
        stages = _stages(event.trigger)
        if self.fmt is None and any(s.type == "message" for s in stages):
            raise ValueError(f"message trigger in {event.describe()}, but the scenario has no frame format")
        self._armed.append(_Armed(event, stages))

    def disarm_all(self) -> list[FaultEvent]:
        left = [a.event for a in self._armed]
        self._armed.clear()
        return left

    @property
    def armed(self) -> int:
        return len(self._armed)

    # -- network callbacks --

    def on_sent(self, socket: Socket, chunk: bytes) -> None:
        self._parse(socket, "send", chunk)

    def on_read(self, socket: Socket, view: memoryview) -> None:
        self._parse(socket, "recv", view)

    def on_carried(self, src: str, dst: str, n: int) -> None:
        if not self._armed:
            return
        for armed in list(self._armed):
            stage = armed.stages[armed.stage]
            if stage.type == "bytes" and stage.src == src and stage.dst == dst:
                armed.count += n
                if armed.count >= stage.bytes:
                    self._advance(armed)

    def _parse(self, socket: Socket, direction: str, data: Any) -> None:
        fmt = self.fmt
        if fmt is None:
            return
        key = (socket.id, direction)
        parser = self._parsers.get(key)
        if parser is None:
            parser = self._parsers[key] = _FrameParser(fmt, socket.inc, socket.remote.rsplit(":", 1)[0])
        if parser.skip >= len(data):  # inside a payload the tap skips: nothing to report
            parser.skip -= len(data)
            return
        found: list[str] = []
        parts = self.parts
        bodies: list[bytes] | None = [] if self._watchers or parts is not None else None
        data_headers: list[bytes] | None = [] if self._data_watchers or parts is not None else None
        parser.feed(data, found, bodies, data_headers)
        if found:
            self._report_messages(parser, direction, found, bodies)
        if data_headers:
            self._report_data(parser, direction, data_headers)

    def _report_messages(self, parser: _FrameParser, direction: str, found: list[str],
                         bodies: list[bytes] | None) -> None:
        host, peer = parser.host, parser.peer
        parts = self.parts
        decode = self._decode
        on_message = self._on_message
        for i, name in enumerate(found):
            self.messages_seen += 1
            self.phase[host] = name
            if on_message is not None:
                on_message(host, direction, name, peer)
            if bodies is not None:
                message = None
                if parts is not None and name in parts.MESSAGES and decode is not None:
                    message = decode(bodies[i])
                    parts.on_message(host, parser.inc.number, direction, name, message)
                watchers = self._watchers_of.get(name)
                if watchers is None:
                    watchers = self._watchers_of[name] = [
                        (callback, wants) for callback, names, wants in self._watchers if names is None or name in names
                    ]
                for callback, wants in watchers:
                    if wants and message is None and decode is not None:
                        message = decode(bodies[i])
                    callback(host, direction, name, peer, message if wants else None)
            if self._armed:
                self._match(host, direction, name)

    def _report_data(self, parser: _FrameParser, direction: str, data_headers: list[bytes]) -> None:
        host, peer = parser.host, parser.peer
        parts = self.parts
        decode_data = self._decode_data
        for raw in data_headers:
            header = decode_data(raw) if decode_data is not None else raw
            part = parts.on_data(host, parser.inc.number, header) if parts is not None else None
            if part is not None:
                self.phase[host] = part
            for data_callback in self._data_watchers:
                data_callback(host, direction, header, peer, part)
            if part is not None and self._armed:
                self._match(host, direction, part)

    def _match(self, host: str, direction: str, name: str) -> None:
        """Advance the armed triggers waiting for ``host`` to send/read ``name``."""
        for armed in list(self._armed):
            stage = armed.stages[armed.stage]
            if (
                stage.type == "message"
                and stage.host == host
                and stage.message == name
                and stage.direction in (direction, "any")
            ):
                armed.count += 1
                if armed.count >= stage.nth:
                    self._advance(armed)

    def _advance(self, armed: _Armed) -> None:
        armed.stage += 1
        armed.count = 0
        if armed.stage == len(armed.stages):
            self._armed.remove(armed)
            self._fire(armed.event)
        elif armed.stages[armed.stage].type == "bytes" and armed.stages[armed.stage].bytes == 0:
            self._advance(armed)
