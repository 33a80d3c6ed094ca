"""Several arrays reduced by one all-reduce in place, without packing them: a segmented buffer.

``all_reduce_many`` reduces a bucket of small same-dtype arrays as one op.  Packing them into one
flat buffer costs a copy in and a copy out, each as large as the bucket; on a CPU-bound loopback
ring those two passes are most of the difference between a bucketed list and one flat
all-reduce of the same bytes.  :class:`Segments` instead presents the arrays as one virtual
flat buffer: the op's schedule cuts its frames at the arrays' boundaries
(:class:`~pccl.protocol.ring.RingSchedule`'s ``breaks``), so every slice the data path takes —
``buffer[a:b]`` for a frame's ``[a, b)`` — lies in one array and is a plain numpy view of it.

Only what the data path uses is offered: ``size``, ``nbytes``, ``dtype``, ``itemsize``,
``reshape(-1)`` (itself), ``view(dtype)`` (the same segmentation over reinterpreted members, a
uint8 view for the in-place backup's byte slices) and slicing.  A slice across a boundary is a
``ValueError``: it would mean the schedule and the buffer disagree.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Segments"]


class Segments:
    """Same-dtype C-contiguous arrays seen as one flat buffer (see the module docstring)."""

    __slots__ = ("members", "starts", "dtype", "itemsize", "size", "nbytes")

    def __init__(self, members: Sequence[np.ndarray]) -> None:
        if not members:
            raise ValueError("a segmented buffer needs at least one array")
        dtype = members[0].dtype
        flat: list[np.ndarray] = []
        for a in members:
            if a.dtype != dtype or not a.flags.c_contiguous:
                raise ValueError("segments must be C-contiguous arrays of one dtype")
            flat.append(a.reshape(-1))  # a view: contiguous
        self.members: tuple[np.ndarray, ...] = tuple(flat)
        starts = [0]
        for a in flat:
            starts.append(starts[-1] + int(a.size))
        #: Element offset of each member, then the total.
        self.starts: tuple[int, ...] = tuple(starts)
        self.dtype = dtype
        self.itemsize = int(dtype.itemsize)
        self.size = starts[-1]
        self.nbytes = self.size * self.itemsize

    @property
    def breaks(self) -> tuple[int, ...]:
        """The offsets inside the buffer where one non-empty member ends and the next begins:
        what :class:`~pccl.protocol.ring.RingSchedule` cuts frames at."""
        return tuple(sorted({s for s in self.starts[1:-1] if 0 < s < self.size}))

    @property
    def layout(self) -> int:
        """A non-zero 64-bit digest of the member sizes: peers whose lists were cut differently
        disagree on it (the master compares it per tag, as it compares the element count)."""
        sizes = np.asarray([a.size for a in self.members], dtype="<u8").tobytes()
        digest = int.from_bytes(hashlib.blake2b(sizes, digest_size=8).digest(), "big")
        return digest or 1

    def __len__(self) -> int:
        return self.size

    def reshape(self, shape: Any) -> Segments:
        if shape not in (-1, (-1,), self.size, (self.size,)):
            raise ValueError("a segmented buffer is flat")
        return self

    def view(self, dtype: Any) -> Segments:
        """The same members reinterpreted as ``dtype`` (a uint8 view: byte offsets)."""
        return Segments([a.view(dtype) for a in self.members])

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a segmented buffer takes contiguous slices [a:b] only")
        start, stop, _ = key.indices(self.size)
        stop = max(stop, start)
        i = min(bisect.bisect_right(self.starts, start) - 1, len(self.members) - 1)
        base = self.starts[i]
        if stop > self.starts[i + 1]:
            raise ValueError(f"[{start}:{stop}] straddles the end of segment {i} at {self.starts[i + 1]}")
        return self.members[i][start - base : stop - base]

    def __repr__(self) -> str:
        return f"Segments({len(self.members)} arrays, {self.size} x {self.dtype})"
