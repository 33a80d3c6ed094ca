"""Enums and info records of the public API.  Wire values of the enums are stable."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from .errors import InvalidArgument

__all__ = [
    "ReduceOp",
    "DType",
    "QuantKind",
    "Quantization",
    "MAX_QUANT_BLOCK",
    "SyncStrategy",
    "ReduceInfo",
    "SyncInfo",
    "SyncReason",
    "Lineage",
    "dtype_of",
]


class ReduceOp(enum.IntEnum):
    """How an all-reduce combines the peers' arrays, element by element (AVG: the sum divided
    by the number of peers that took part)."""

    SUM = 0
    AVG = 1
    PROD = 2
    MIN = 3
    MAX = 4


class DType(enum.IntEnum):
    """Element types pccl moves and reduces.  The values travel on the wire."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    UINT64 = 6
    INT64 = 7
    FLOAT16 = 8
    BFLOAT16 = 9
    FLOAT32 = 10
    FLOAT64 = 11

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self >= DType.FLOAT16

    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype (BFLOAT16: ``ml_dtypes.bfloat16``)."""
        if self is DType.BFLOAT16:
            import ml_dtypes  # a dependency; imported on first use (it is slow to import)

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(_NUMPY_NAME[self])


_ITEMSIZE = {
    DType.UINT8: 1, DType.INT8: 1, DType.UINT16: 2, DType.INT16: 2,
    DType.UINT32: 4, DType.INT32: 4, DType.UINT64: 8, DType.INT64: 8,
    DType.FLOAT16: 2, DType.BFLOAT16: 2, DType.FLOAT32: 4, DType.FLOAT64: 8,
}
_NUMPY_NAME = {
    DType.UINT8: "uint8", DType.INT8: "int8", DType.UINT16: "uint16", DType.INT16: "int16",
    DType.UINT32: "uint32", DType.INT32: "int32", DType.UINT64: "uint64", DType.INT64: "int64",
    DType.FLOAT16: "float16", DType.FLOAT32: "float32", DType.FLOAT64: "float64",
}
_BY_NUMPY = {np.dtype(name): dt for dt, name in _NUMPY_NAME.items()}


def dtype_of(dtype: object) -> DType:
    """Map a :class:`DType`, a torch dtype or a numpy dtype (or anything ``np.dtype`` accepts)
    to :class:`DType`.

    Raises :class:`InvalidArgument` for unsupported dtypes.  ``ml_dtypes.bfloat16`` and torch's
    dtypes are recognised by name, so that checking a dtype imports neither ml_dtypes nor torch.
    """
    if isinstance(dtype, DType):
        return dtype
    if isinstance(dtype, np.dtype):  # the common case (an array's dtype): one lookup
        found = _BY_NUMPY.get(dtype)  # a native-order dtype equals its key; others go on below
        if found is not None:
            return found
    kind = type(dtype)
    if kind.__module__ == "torch" and kind.__name__ == "dtype":  # torch.float32 is "torch.float32"
        name = str(dtype).removeprefix("torch.")
        if name == "bfloat16":
            return DType.BFLOAT16
        dtype = name
    try:
        npd = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise InvalidArgument(f"not a dtype: {dtype!r} (pass a numpy dtype, a torch dtype or a pccl.DType)") from exc
    if npd.byteorder == ">" or (npd.byteorder == "=" and np.little_endian is False):
        raise InvalidArgument(f"big-endian dtype {npd} is not supported")
    found = _BY_NUMPY.get(npd.newbyteorder("=")) if npd.kind in "uif" else None
    if found is not None:
        return found
    if npd.name == "bfloat16" and npd.itemsize == 2:
        return DType.BFLOAT16
    raise InvalidArgument(f"unsupported dtype {npd}; pccl supports {', '.join(d.name.lower() for d in DType)}")


class QuantKind(enum.IntEnum):
    """How a :class:`Quantization` encodes values on the wire (MIN_MAX: an affine map of each
    chunk's range onto the quantized dtype)."""

    NONE = 0
    MIN_MAX = 1


#: Widest block a :class:`Quantization` takes (the block travels as a 32-bit field).
MAX_QUANT_BLOCK = 2**31


def _quant_bits(dtype: object) -> int:
    """The code width a MIN_MAX target names: 4 for ``"uint4"`` (``ml_dtypes.uint4``, a torch
    ``uint4``), 8 for uint8, 16 for uint16; :class:`InvalidArgument` for anything else."""
    name = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", None)
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        name = str(dtype).removeprefix("torch.")
    elif not isinstance(dtype, (str, DType)) and name != "uint4":
        try:  # np.dtype(ml_dtypes.uint4) and other dtype instances, recognised by name
            name = np.dtype(dtype).name  # type: ignore[call-overload]
        except TypeError:
            name = None
    if name in ("uint4", "u4"):
        return 4
    try:
        target = dtype_of(dtype)
    except InvalidArgument:
        target = None
    if target is DType.UINT8:
        return 8
    if target is DType.UINT16:
        return 16
    raise InvalidArgument(f"MIN_MAX quantization needs dtype \"uint4\", uint8 or uint16, got {dtype!r}")


@dataclasses.dataclass(frozen=True)
class Quantization:
    """Quantization of a collective's wire traffic: MIN_MAX to 4, 8 or 16 bits per value.

    ``dtype`` is the target: ``"uint4"`` (or ``ml_dtypes.uint4``: two values per byte), uint8 or
    uint16, as a numpy dtype, a torch dtype or a :class:`DType` (``np.uint8``, ``torch.uint8``
    and ``DType.UINT8`` are the same).  ``block``: ``None`` gives every frame on the wire one
    ``(min, max)`` pair; an integer ``k`` gives every ``k`` consecutive elements of a frame their
    own (the last block of a frame may be shorter), so that one outlier spends the range of its
    block only.  Blocks never straddle frames, and a frame is quantized by one peer only, so
    results stay bit-identical on every peer.  Each value travels as ``rint((x - lo) / scale)``
    with ``lo`` its block's minimum and ``scale = (max - min) / QMAX`` (QMAX = 15, 255 or
    65535); a constant block is exact; NaN or Inf in a quantized input is
    :class:`InvalidArgument`.

    Error bound.  ``QMAX`` = 15, 255 or 65535; ``u`` the unit roundoff of the accumulator type
    (``2**-24`` for float32, float16 and bfloat16 buffers, ``2**-53`` for float64).  Per hop: one
    quantization of a block whose values span ``R = max - min`` and whose largest magnitude is
    ``M`` moves each value by at most

        ``e(R, M) = R / (2 QMAX) + 8 u (R + M)``

    (while the block's scale is a normal number, i.e. ``R > QMAX * 2**-126`` in float32;
    below that the error is bounded by ``R`` itself).  End to end: a SUM all-reduce over ``N``
    peers quantizes each element ``N`` times (``N - 1`` partial sums in the reduce-scatter, the
    final value once, by its owner, in the all-gather), and each error widens the range the
    next hop quantizes by at most twice itself.  With ``r`` the sum over the peers of each one's
    range over the elements that share a block with the element (the whole frame without
    ``block``; never more than the sum of the peers' global ranges) and ``m`` the sum of their
    largest magnitudes there, every peer's result ``y`` satisfies

        ``|y - sum_i x_i| <= (r / 2 + 9 u QMAX (r + m)) ((1 + 1/QMAX + 32 u)**N - 1)``

    which is about ``N r / (2 QMAX)`` while ``N`` is small against QMAX (4 bits, 4 peers:
    ``0.15 r``).  AVG: that plus ``u m``, divided by ``N``.  float16/bfloat16 results are
    rounded to 16 bits once more at the end (half an ulp of the result: ``2**-25`` for a
    float16 result below the normal range, whatever its size).  A broadcast or an
    all-gather quantizes once (``e(R, M)`` of the sender's block); a reduce-scatter ``N - 1``
    times (the recursion above without the last hop).

    Validation: an unknown kind, a target other than those above, a ``block`` that is not an
    integer in ``[1, 2**31]``, or a ``block`` without MIN_MAX are :class:`InvalidArgument`.
    """

    kind: QuantKind = QuantKind.MIN_MAX
    dtype: object = np.uint8
    block: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = QuantKind(self.kind)
        except ValueError:
            raise InvalidArgument(f"quantization kind must be a QuantKind, got {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        block = self.block
        if block is not None:
            if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or not 1 <= block <= MAX_QUANT_BLOCK:
                raise InvalidArgument(f"quantization block must be None or an integer in [1, 2**31], got {block!r}")
            if kind is not QuantKind.MIN_MAX:
                raise InvalidArgument("a quantization block needs kind MIN_MAX")
            object.__setattr__(self, "block", int(block))
        if kind is QuantKind.MIN_MAX:
            _quant_bits(self.dtype)

    @property
    def bits(self) -> int:
        """Bits per value on the wire: 4, 8 or 16 (0 for kind NONE)."""
        return _quant_bits(self.dtype) if self.kind is QuantKind.MIN_MAX else 0

    @property
    def code_dtype(self) -> DType | None:
        """The dtype the codes are stored in: UINT8 for 4 and 8 bits (4 bits: two per byte),
        UINT16 for 16; ``None`` for kind NONE."""
        bits = self.bits
        return None if bits == 0 else DType.UINT16 if bits == 16 else DType.UINT8


class SyncStrategy(enum.IntEnum):
    """A peer's part in a shared-state sync: ENFORCE_POPULAR (receive the elected state if
    different, serve it otherwise), SEND_ONLY (serve, never receive), RECEIVE_ONLY (receive,
    never serve); one sync cannot mix ENFORCE_POPULAR with the others."""

    ENFORCE_POPULAR = 0
    SEND_ONLY = 1
    RECEIVE_ONLY = 2


@dataclasses.dataclass(frozen=True)
class ReduceInfo:
    """Result of an all-reduce: the number of peers it ran over and payload bytes moved."""

    world_size: int
    tx_bytes: int
    rx_bytes: int


@dataclasses.dataclass(frozen=True)
class CollectiveInfo:
    """Result of a broadcast: the participants' peer ids in ring order (the same on every
    participant) and the payload bytes this peer moved."""

    world_size: int
    peers: tuple[int, ...]
    tx_bytes: int
    rx_bytes: int


@dataclasses.dataclass(frozen=True)
class Gathered:
    """Result of an all-gather.  ``peers``: the participants' peer ids in ring order (the same
    on every participant); ``arrays[i]``: the flat contribution of ``peers[i]`` (a view into
    ``buffer``, which holds them all in that order; torch tensors when the input was one)."""

    peers: tuple[int, ...]
    arrays: tuple[Any, ...]
    buffer: Any
    world_size: int
    tx_bytes: int
    rx_bytes: int


@dataclasses.dataclass(frozen=True)
class Shard:
    """Result of a reduce-scatter: ``x[start:stop]`` (of the flat buffer) holds the reduction of
    that slice over the participants; this peer is ``index`` of ``world_size`` in ring order
    (``peers``) and owns the ``index``-th of ``world_size`` contiguous slices (the first
    ``len % world_size`` one element longer)."""

    start: int
    stop: int
    index: int
    world_size: int
    peers: tuple[int, ...]
    tx_bytes: int
    rx_bytes: int


class SyncReason(enum.IntEnum):
    """How this peer's state stood to the one its group adopted at a sync (``SyncInfo.reason``)."""

    #: It held the adopted state: it received nothing (or only what it may hold differently).
    UP_TO_DATE = 0
    #: It held the group's lineage at the adopted revision but other bytes: an update that is not
    #: deterministic on every peer.  It received the tensors that differed.
    DIVERGED = 1
    #: It held the group's lineage at an older revision (it missed syncs): it caught up.
    BEHIND = 2
    #: It held none of the group's lineage (a newcomer, a fresh state, a peer of another run): it
    #: received the group's state, whatever revision it offered.
    NEWCOMER = 3
    #: Nobody held a lineage (the run's first sync, or every holder was lost): the most progress
    #: (then the most popular content) won, and this peer's state lost.
    OUTVOTED = 4


@dataclasses.dataclass(frozen=True)
class Lineage:
    """The history a shared state belongs to (``SharedState.lineage``).

    ``id``: 16 bytes drawn by the master at the first sync of a run, kept by every peer that
    syncs, across master restarts and in checkpoints; ``revision`` and ``digest``: the revision
    and the 16-byte content digest of the last sync this state completed (or that the
    checkpoint it came from recorded).  A state with the group's lineage id is a *lineage
    holder*: a holder's state is never replaced by that of a peer without it.
    """

    id: bytes
    revision: int
    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.id, bytes) or len(self.id) != 16:
            raise InvalidArgument(f"a lineage id is 16 bytes, got {self.id!r}")
        if not isinstance(self.digest, bytes) or len(self.digest) != 16:
            raise InvalidArgument(f"a lineage digest is 16 bytes, got {self.digest!r}")
        if isinstance(self.revision, bool) or not isinstance(self.revision, int) or not 0 <= self.revision < 2**64:
            raise InvalidArgument(f"a lineage revision is an integer in [0, 2**64), got {self.revision!r}")

    def __str__(self) -> str:
        return f"lineage {self.id.hex()[:12]} at revision {self.revision}"


@dataclasses.dataclass(frozen=True)
class SyncInfo:
    """Result of a shared-state sync: the adopted revision and payload bytes moved, whether
    this peer received any tensor, and why (:class:`SyncReason`)."""

    revision: int
    tx_bytes: int
    rx_bytes: int
    #: Whether this peer fetched tensors from others in this sync (``rx_bytes`` may still be 0
    #: for empty tensors).
    received: bool = False
    reason: SyncReason = SyncReason.UP_TO_DATE
