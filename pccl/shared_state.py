"""Shared state: the tensors every peer of a group holds bit for bit.

:class:`SharedState` maps names to arrays (numpy arrays, or CPU torch tensors through their
zero-copy numpy view) *by reference*: pccl reads them to hash and to serve, and writes received
bytes straight into them.  Nothing is copied.  Each tensor is compared by its xxh3-128 digest
(:func:`hash_array`).  The synchronisation itself (``Communicator.sync_shared_state``) is
:mod:`pccl._peer.sync`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
import numpy as np
import trio
import xxhash

from .arrays import as_array
from .errors import InvalidArgument, ProtocolError
from .protocol import messages as m
from .types import Lineage, dtype_of

__all__ = ["Tensor", "SharedState", "hash_array", "hash_array_async", "state_bytes", "vote_entries",
           "lineage_from_wire", "lineage_to_wire"]

#: Bytes hashed between two checkpoints.
_HASH_STEP = 64 * 1024 * 1024


# --- tensors -----------------------------------------------------------------------------------


def state_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (no copy; the array is C-contiguous)."""
    return array.reshape(-1).view(np.uint8)


def hash_array(array: np.ndarray) -> bytes:
    """xxh3-128 digest (16 bytes) of a C-contiguous array's raw bytes, without copying."""
    return xxhash.xxh3_128(state_bytes(array).data).digest()


async def hash_array_async(array: np.ndarray) -> bytes:
    """:func:`hash_array` with a checkpoint every 64 MiB (same digest: xxh3 streams)."""
    view = state_bytes(array).data
    if view.nbytes <= _HASH_STEP:
        await trio.lowlevel.checkpoint()
        return xxhash.xxh3_128(view).digest()
    state = xxhash.xxh3_128()
    for start in range(0, view.nbytes, _HASH_STEP):
        state.update(view[start : start + _HASH_STEP])
        await trio.lowlevel.checkpoint()
    return state.digest()


class Tensor:
    """One shared-state entry: an array (numpy, or a CPU torch tensor) referenced without a copy.

    ``allow_content_inequality=True`` means peers may legitimately differ in this tensor (e.g.
    a per-peer RNG state): it is never compared among up-to-date peers, but an outdated peer (a
    joiner) receives it from one up-to-date peer.  ``InvalidArgument`` unless the array is
    C-contiguous, writable and of a supported dtype, and (a torch tensor) on the CPU and not
    requiring grad (:func:`pccl.arrays.as_array`).
    """

    __slots__ = ("array", "allow_content_inequality", "dtype")

    def __init__(self, array: object, allow_content_inequality: bool = False, *, name: str = "Tensor(array)") -> None:
        arr = as_array(array, name=name)
        self.dtype = dtype_of(arr.dtype)
        self.array = arr
        self.allow_content_inequality = bool(allow_content_inequality)

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)

    def __repr__(self) -> str:
        flag = ", allow_content_inequality=True" if self.allow_content_inequality else ""
        return f"Tensor({self.dtype.name.lower()}{list(self.array.shape)}{flag})"


class SharedState:
    """Named tensors plus a revision and a lineage (``SharedState({"w": w, "m": m}, revision=0)``).

    Values are arrays (wrapped as ``Tensor(array)``) or :class:`Tensor` instances.  Keys are
    non-empty strings; their order does not matter (entries are compared by name).  The
    revision must increase by exactly one between syncs; ``sync_shared_state`` writes the
    group's revision back into it.  ``state[key]`` returns the array.

    ``lineage`` (a :class:`~pccl.Lineage`, ``None`` for a fresh state) names the run history
    this state belongs to.  Every successful sync sets it to the group's; a checkpoint stores it
    and :func:`pccl.checkpoint.load` restores it.  It decides who wins a sync: while any peer of
    the group holds the group's lineage, the group keeps the holders' state, and a peer without
    it (a newcomer, a fresh state, a state of another run) receives the group's state whatever
    revision it offers — so a newcomer never overwrites a running group.  Only when nobody holds
    a lineage (the run's first sync, or every holder is gone) does the highest revision win;
    after a master restart, among the holders, too.  Keep using the same ``SharedState`` object
    from step to step: a new object starts without a lineage.
    """

    def __init__(self, mapping: Mapping[str, object], revision: int = 0, *, lineage: Lineage | None = None) -> None:
        if not isinstance(mapping, Mapping):
            raise InvalidArgument(f"SharedState needs a mapping of names to arrays, got {type(mapping).__name__}")
        tensors: dict[str, Tensor] = {}
        for key, value in mapping.items():
            if not isinstance(key, str) or not key:
                raise InvalidArgument(f"shared state keys must be non-empty strings, got {key!r}")
            tensors[key] = value if isinstance(value, Tensor) else Tensor(value, name=f"shared state entry {key!r}")
        self._tensors = dict(sorted(tensors.items()))
        self._revision = 0
        self.revision = revision
        self._lineage: Lineage | None = None
        self.lineage = lineage

    @property
    def revision(self) -> int:
        return self._revision

    @revision.setter
    def revision(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise InvalidArgument(f"revision must be an integer in [0, 2**64), got {value!r}")
        self._revision = int(value)

    @property
    def lineage(self) -> Lineage | None:
        return self._lineage

    @lineage.setter
    def lineage(self, value: Lineage | None) -> None:
        if value is not None and not isinstance(value, Lineage):
            raise InvalidArgument(f"lineage must be a pccl.Lineage or None, got {type(value).__name__}")
        self._lineage = value

    def tensors(self) -> Mapping[str, Tensor]:
        """The entries by name (sorted)."""
        return dict(self._tensors)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._tensors[key].array

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors.values())

    def hashes(self) -> dict[str, bytes]:
        """xxh3-128 digest of every tensor (what a sync compares)."""
        return {key: hash_array(t.array) for key, t in self._tensors.items()}

    def __repr__(self) -> str:
        lineage = "" if self._lineage is None else f", {self._lineage}"
        return f"SharedState({list(self._tensors.values())!r}, revision={self._revision}{lineage})"


def lineage_to_wire(lineage: Lineage | None) -> m.Lineage | None:
    return None if lineage is None else m.Lineage(lineage.id, lineage.revision, lineage.digest)


def lineage_from_wire(lineage: m.Lineage) -> Lineage:
    """The public record of a lineage the master sent; ``ProtocolError`` if it is malformed."""
    try:
        return Lineage(bytes(lineage.id), lineage.revision, bytes(lineage.digest))
    except InvalidArgument as exc:
        raise ProtocolError(f"the master sent a malformed lineage: {exc}") from None


async def vote_entries(state: SharedState) -> tuple[m.SharedStateEntry, ...]:
    """What a sync vote says of ``state``: every tensor's key, dtype, size and digest (hashed
    with a checkpoint every 64 MiB)."""
    entries = []
    for key, t in state.tensors().items():
        digest = await hash_array_async(t.array)
        entries.append(m.SharedStateEntry(key, int(t.dtype), t.nbytes, digest, t.allow_content_inequality))
    return tuple(entries)
