"""pccl's wire as the simulator's tap reads it: frame decoding (:class:`PcclFrames`), which part
of an all-reduce each data frame belongs to (:class:`AllReduceParts`), and the phase names the
coverage table uses for pccl.

:class:`PcclFrames` is the :class:`~pccl_sim.engine.tap.FrameFormat` of the pccl scenario, built on
:mod:`pccl.protocol.codec`: the preamble of :mod:`pccl.protocol.handshake`, then
``length:u32 | kind:u8 | body`` frames; control bodies are decoded to message names (the
``Message`` class names, e.g. ``VoteTopology``) and data payloads skipped without copying.
"""

from __future__ import annotations

from typing import Any

from pccl.errors import ProtocolError
from pccl.protocol import codec, handshake
from pccl.protocol.ring import uses_exchange
from pccl.types import DType, QuantKind

from ...engine.tap import LengthKindFrames

__all__ = ["PcclFrames", "AllReduceParts", "ALL_REDUCE_PHASES", "COLLECTIVE_PHASES", "IDLE_MESSAGES"]

#: Control messages that say nothing about the protocol's state: they do not change a host's
#: phase in the coverage matrix.
IDLE_MESSAGES = frozenset({"Heartbeat"})

#: The phases of an all-reduce, in order: the coverage table lists them even when no fault hit
#: them (an empty row is the finding).
ALL_REDUCE_PHASES = ("CollectiveInit", "CollectiveCommence", "data:exchange", "data:reduce-scatter",
                     "data:all-gather", "CollectiveDone", "CollectiveComplete", "CollectiveAbort")
#: The phases of the other collectives (broadcast's chain is a part of its own).
COLLECTIVE_PHASES = ("CollectiveInit", "CollectiveCommence", "data:reduce-scatter", "data:all-gather",
                     "data:broadcast", "CollectiveDone", "CollectiveComplete", "CollectiveAbort")


#: CollectiveInit.kind -> the part every data frame of such an op is (all-reduce: by step).
_KIND_PARTS = {1: "data:broadcast", 2: "data:all-gather", 3: "data:reduce-scatter"}


class AllReduceParts:
    """Which part of a pccl all-reduce each data frame belongs to, read off the wire.

    A peer's ``CollectiveInit`` (sent) gives an op's size, dtype and quantization, its
    ``CollectiveCommence`` (read) the op's seq and ring; from then until it sends
    ``CollectiveDone`` or reads the master's ``CollectiveComplete`` / ``CollectiveAbort``, its
    data frames of that seq are ``data:exchange`` (the small-op plan,
    :func:`pccl.protocol.ring.uses_exchange`), ``data:reduce-scatter`` (step < N - 1) or
    ``data:all-gather``; those of the other kinds (``CollectiveInit.kind``) are their kind's:
    ``data:broadcast``, ``data:all-gather``, ``data:reduce-scatter``.  Other data frames (shared-state transfers) have no part.  State is
    kept per incarnation: a restarted host starts afresh, and so does a peer that registers with
    a master again (its ops ended with the old master connection, whether or not a Done or the
    master's final word crossed the wire; a restarted master numbers ops from 1 again).
    """

    #: The parts it names (each one a phase of the tap and a message trigger can name).
    PARTS = ("data:exchange", "data:reduce-scatter", "data:all-gather", "data:broadcast")
    #: The control messages it follows (decoded).
    MESSAGES = frozenset({"CollectiveInit", "CollectiveBegin", "CollectiveCommence", "CollectiveDone",
                          "CollectiveComplete", "CollectiveAbort", "Register"})

    def __init__(self) -> None:
        self._incarnation: dict[str, int] = {}
        self._inits: dict[str, dict[int, Any]] = {}  # host -> tag -> its last CollectiveInit
        self._ops: dict[str, dict[int, tuple[int, bool | str]]] = {}  # host -> seq -> (world, exchange or part)

    def _host(self, host: str, incarnation: int) -> None:
        if self._incarnation.get(host) != incarnation:
            self._incarnation[host] = incarnation
            self._inits[host] = {}
            self._ops[host] = {}

    def on_message(self, host: str, incarnation: int, direction: str, name: str, message: Any) -> None:
        self._host(host, incarnation)
        if message is None:
            return
        if name == "Register" and direction == "send":
            # (Re)joining a master: every op it had in flight ended with the old connection,
            # whether or not a Done / Complete / Abort crossed the wire.
            self._inits[host].clear()
            self._ops[host].clear()
        elif name == "CollectiveInit" and direction == "send":
            self._inits[host][message.tag] = message
        elif name == "CollectiveBegin" and direction == "send":
            # Begun without a vote: its frames are named once the Commence gives the ring.
            self._inits[host][message.tag] = message.as_init()
        elif name == "CollectiveCommence" and direction == "recv":
            init = self._inits[host].get(message.tag)
            if init is None:
                return
            world = len(message.ring)
            part = _KIND_PARTS.get(getattr(init, "kind", 0))
            if part is not None:
                self._ops[host][message.seq] = (world, part)
                return
            try:
                nbytes = init.count * DType(init.dtype).itemsize
                quantized = QuantKind(init.quant_kind) is not QuantKind.NONE
            except ValueError:
                return  # not an op the master would commence
            self._ops[host][message.seq] = (world, uses_exchange(world, nbytes, quantized=quantized))
        elif name in ("CollectiveDone", "CollectiveComplete", "CollectiveAbort"):
            self._ops[host].pop(message.seq, None)

    def on_data(self, host: str, incarnation: int, header: Any) -> str | None:
        """The part ``header``'s frame belongs to, or ``None``."""
        self._host(host, incarnation)
        op = self._ops[host].get(header.op_seq) if header is not None else None
        if op is None:
            return None
        world, exchange = op
        if isinstance(exchange, str):  # a kind other than all-reduce: its part
            return exchange
        if exchange:
            return "data:exchange"
        return "data:reduce-scatter" if header.step < world - 1 else "data:all-gather"

    def in_flight(self, host: str) -> int:
        """All-reduces in flight on ``host`` (commenced, not yet done)."""
        return len(self._ops.get(host, ()))


#: Decoded bodies :class:`PcclFrames` remembers (then it starts afresh).
_DECODED_MAX = 4096


class PcclFrames(LengthKindFrames):
    """pccl's wire format (preamble + codec frames); message names are the Message class names."""

    #: Names the data frames of all-reduces for the tap (it makes one per run).
    data_parts = AllReduceParts
    #: A relay's splice: after a peer's ``RelayJoin`` (its direction) and the relay's
    #: ``RelayReady`` (the other), the two peers' own connection begins, preamble first.
    restart_after = frozenset({"RelayJoin", "RelayReady"})

    def __init__(self) -> None:
        assert codec.PREFIX_SIZE == LengthKindFrames.prefix_size
        super().__init__(self._message_name, control_kind=int(codec.FrameKind.CONTROL),
                         preamble_size=handshake.PREAMBLE_SIZE, data_kind=int(codec.FrameKind.DATA),
                         data_header_size=codec.DATA_HEADER_SIZE)
        # Decoded messages by body: the tap names a body and then hands it to its watchers, and
        # most bodies recur (each frame is read as well as sent; heartbeats, votes and a round's
        # TopologyComplete repeat byte for byte).  Messages are frozen structs: safe to share.
        self._decoded: dict[bytes, object | None] = {}

    def _message_name(self, body: bytes) -> str | None:
        message = self.decode(body)
        return None if message is None else type(message).__name__

    def decode(self, body: bytes) -> object | None:
        """The decoded control message (for :meth:`~pccl_sim.engine.tap.Tap.watch`), or ``None``."""
        decoded = self._decoded
        if type(body) is not bytes:
            body = bytes(body)  # (a dict key)
        try:
            return decoded[body]
        except KeyError:
            pass
        try:
            message = codec.decode_message(body)
        except ProtocolError:
            message = None
        if len(decoded) >= _DECODED_MAX:
            decoded.clear()
        decoded[body] = message
        return message

    def decode_data(self, raw: bytes) -> object | None:
        """The :class:`~pccl.protocol.codec.DataHeader` of a data frame's prefix and header bytes
        (for :meth:`~pccl_sim.engine.tap.Tap.watch_data`), or ``None``."""
        prefix = raw[: codec.PREFIX_SIZE]
        try:
            _kind, length = codec.parse_prefix(prefix, max_frame_size=0)
            return codec.parse_data_header(raw[codec.PREFIX_SIZE :], length)
        except ProtocolError:
            return None
