"""How a MIN_MAX-quantized frame travels: its layout, and the kernels that write and read it.

One :class:`WireQuant` describes every quantized payload of an op (every peer derives it from
the agreed parameters: the buffer's dtype and the :class:`~pccl.types.Quantization`).  A frame
of ``count`` elements is quantized by one peer, as one unit, so blocks never straddle frames:

* ``block=None`` — one ``(lo, scale)`` pair for the frame: the :data:`QUANT_META` header (two
  little-endian float64) followed by the codes;
* ``block=k`` — every ``k`` elements of the frame (counted from its first; the last block may be
  shorter) have their own pair: ``lo[nb]`` then ``scale[nb]`` (``nb = ceil(count / k)``) in the
  accumulator type (little-endian float32 for float16/bfloat16/float32 buffers, float64 for
  float64; both exact images of the values the quantizer computed), followed by the codes.

Codes: uint16 for 16 bits, uint8 for 8, and for 4 bits two per byte (element ``2j`` in the low
nibble of byte ``j``, an odd count leaving the last high nibble 0; see :mod:`pccl.blockquant`).
Decoding is a fixed sequence of IEEE operations on these bytes, so every peer that applies it
gets the same bits.  The methods run kernels only (no awaits); their errors (``InvalidArgument``
for NaN/Inf in a quantized input) escape.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from .. import blockquant, kernels
from ..types import DType, Quantization, QuantKind, ReduceOp

__all__ = ["QUANT_META", "pack_meta", "unpack_meta", "WireQuant"]

#: Quantization parameters that precede every payload quantized with ``block=None``: ``lo`` and
#: ``scale`` as little-endian IEEE doubles (explicit byte order: PCCL sent host order).
QUANT_META = struct.Struct("<dd")


def pack_meta(into: memoryview, params: kernels.QuantParams) -> None:
    """Write a quantized payload's :data:`QUANT_META` header."""
    QUANT_META.pack_into(into, 0, params.lo, params.scale)


def unpack_meta(raw: memoryview) -> kernels.QuantParams:
    """Read a quantized payload's :data:`QUANT_META` header."""
    lo, scale = QUANT_META.unpack_from(raw, 0)
    return kernels.QuantParams(lo, scale)


@dataclasses.dataclass(frozen=True)
class WireQuant:
    """The wire format of an op's quantized frames (see the module docstring)."""

    #: bits per value: 4, 8 or 16
    bits: int
    #: elements per ``(lo, scale)`` pair; ``None``: one pair per frame
    block: int | None
    #: the accumulator type (FLOAT32 or FLOAT64) the values are decoded in
    acc: DType

    @classmethod
    def of(cls, dtype: DType, quantization: Quantization | None) -> WireQuant | None:
        """The format a buffer of (float) ``dtype`` travels in under ``quantization``; ``None``
        when unquantized.  The caller has checked that ``dtype`` is a float type."""
        if quantization is None or quantization.kind is QuantKind.NONE:
            return None
        return cls(quantization.bits, quantization.block, kernels.accumulator_dtype(dtype))

    @property
    def code_dtype(self) -> DType:
        """What the codes are stored in (UINT8 for 4 and 8 bits, UINT16 for 16)."""
        return DType.UINT16 if self.bits == 16 else DType.UINT8

    def _meta_nbytes(self, count: int) -> int:
        if self.block is None:
            return QUANT_META.size
        return 2 * blockquant.num_blocks(count, self.block) * self.acc.itemsize

    def nbytes(self, count: int) -> int:
        """Payload bytes of a frame of ``count`` elements."""
        return self._meta_nbytes(count) + blockquant.code_nbytes(count, self.bits)

    def _codes(self, payload: np.ndarray, count: int) -> np.ndarray:
        start = self._meta_nbytes(count)
        return payload[start : start + blockquant.code_nbytes(count, self.bits)].view(self.code_dtype.numpy_dtype())

    def _block(self, count: int) -> int:
        return self.block if self.block is not None else max(count, 1)

    def _params(self, payload: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Views of the ``lo`` and ``scale`` arrays of a blocked payload."""
        nb = blockquant.num_blocks(count, self._block(count))
        size = nb * self.acc.itemsize
        acc = self.acc.numpy_dtype()
        return payload[:size].view(acc), payload[size : 2 * size].view(acc)

    def _header_params(self, payload: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The one ``(lo, scale)`` pair of a ``block=None`` payload, as accumulator arrays (the
        doubles are exact images of accumulator values, so this conversion is exact)."""
        params = unpack_meta(payload.data[: QUANT_META.size])
        acc = self.acc.numpy_dtype()
        return np.array([params.lo], acc), np.array([params.scale], acc)

    def quantize(self, source: np.ndarray, payload: np.ndarray, *, dtype: DType | None = None) -> None:
        """Quantize the float array ``source`` into ``payload`` (uint8, :meth:`nbytes` long)."""
        count = source.size
        q = self._codes(payload, count)
        if self.block is None and self.bits != 4:
            pack_meta(payload.data[: QUANT_META.size], kernels.quantize(source, q, dtype=dtype))
            return
        if self.block is None:
            acc = self.acc.numpy_dtype()
            lo, scale = np.zeros(1, acc), np.zeros(1, acc)
            blockquant.quantize_blocks(source, q, lo, scale, bits=4, block=max(count, 1), dtype=dtype)
            pack_meta(payload.data[: QUANT_META.size], kernels.QuantParams(float(lo[0]), float(scale[0])))
            return
        lo, scale = self._params(payload, count)
        blockquant.quantize_blocks(source, q, lo, scale, bits=self.bits, block=self.block, dtype=dtype)

    def _decode_params(self, payload: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
        return self._header_params(payload) if self.block is None else self._params(payload, count)

    def dequantize(self, payload: np.ndarray, out: np.ndarray) -> None:
        """``out[:] =`` the values ``payload`` encodes (``out``: the accumulator type)."""
        count = out.size
        q = self._codes(payload, count)
        if self.block is None and self.bits != 4:
            kernels.dequantize(q, unpack_meta(payload.data[: QUANT_META.size]), out)
            return
        lo, scale = self._decode_params(payload, count)
        blockquant.dequantize_blocks(q, lo, scale, out, bits=self.bits, block=self._block(count))

    def dequantize_reduce(self, acc: np.ndarray, payload: np.ndarray, op: ReduceOp) -> None:
        """``acc op=`` the values ``payload`` encodes, in one pass."""
        count = acc.size
        q = self._codes(payload, count)
        if self.block is None and self.bits != 4:
            kernels.dequantize_reduce(acc, q, unpack_meta(payload.data[: QUANT_META.size]), op)
            return
        lo, scale = self._decode_params(payload, count)
        blockquant.dequantize_reduce_blocks(acc, q, lo, scale, op, bits=self.bits, block=self._block(count))

    def dequantize_reduce_saving(self, acc: np.ndarray, payload: np.ndarray, backup: np.ndarray, op: ReduceOp) -> None:
        """:meth:`dequantize_reduce` that first saves acc's values into ``backup``, in one pass."""
        count = acc.size
        q = self._codes(payload, count)
        if self.block is None and self.bits != 4:
            kernels.dequantize_reduce_saving(acc, q, unpack_meta(payload.data[: QUANT_META.size]), backup, op)
            return
        lo, scale = self._decode_params(payload, count)
        blockquant.dequantize_reduce_blocks_saving(acc, q, lo, scale, backup, op, bits=self.bits,
                                                   block=self._block(count))
