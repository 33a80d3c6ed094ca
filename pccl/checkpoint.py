"""Checkpoints: a :class:`~pccl.SharedState` on disk, so a run survives losing every process.

``save(state, path)`` writes the state's tensors in the `safetensors
<https://huggingface.co/docs/safetensors>`_ format (any safetensors reader opens the file), with
pccl's record in the file's ``__metadata__``: the revision, the lineage (:class:`~pccl.Lineage`),
every tensor's xxh3-128 digest and its ``allow_content_inequality`` flag.  ``load(path)`` returns
a new :class:`~pccl.SharedState`; ``load(path, into=state)`` writes the tensors into an existing
state's arrays (a model's parameters, by reference) and sets its revision and lineage.

Restarting a whole run from checkpoints: every peer loads its latest checkpoint and syncs.  The
loaded states hold the run's lineage, so the group continues from the peers whose checkpoint
went furthest in that lineage, bit for bit; the others receive it.  A peer that loads an old
checkpoint into a running group of the same run receives the group's state; it never rolls the
group back.

Writing is atomic: the file is written under a temporary name in the same directory, flushed to
disk (``fsync``), renamed over ``path``, and the directory is flushed, so a crash leaves either
the previous checkpoint or the new one, never a torn file.  Loading verifies the structure and
every tensor's digest before it writes anything into ``into``: a truncated or altered file
raises :class:`~pccl.CheckpointError` naming the file and the tensor, and leaves the target
untouched.

Both calls block (disk I/O and hashing).  From Trio code, run them in a thread while no task
changes the state, e.g. ``await trio.to_thread.run_sync(pccl.checkpoint.save, state, path)``.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
from collections.abc import Mapping
from io import BufferedReader

import numpy as np
import xxhash

from .errors import CheckpointError, InvalidArgument
from .shared_state import SharedState, Tensor, hash_array, state_bytes
from .types import DType, Lineage

__all__ = ["save", "load", "FORMAT_VERSION"]

log = logging.getLogger("pccl.checkpoint")

#: Version of pccl's metadata record; ``load`` refuses a file that names a later one.
FORMAT_VERSION = 1

_FORMAT_KEY = "pccl.format"
_FORMAT_NAME = "pccl-shared-state"
_VERSION_KEY = "pccl.format_version"
_REVISION_KEY = "pccl.revision"
_LINEAGE_KEY = "pccl.lineage"
_HASHES_KEY = "pccl.xxh3_128"
_UNEQUAL_KEY = "pccl.allow_content_inequality"

#: safetensors dtype names.
_ST_NAME = {
    DType.UINT8: "U8", DType.INT8: "I8", DType.UINT16: "U16", DType.INT16: "I16",
    DType.UINT32: "U32", DType.INT32: "I32", DType.UINT64: "U64", DType.INT64: "I64",
    DType.FLOAT16: "F16", DType.BFLOAT16: "BF16", DType.FLOAT32: "F32", DType.FLOAT64: "F64",
}
_BY_ST_NAME = {name: dtype for dtype, name in _ST_NAME.items()}

#: A header larger than this is refused before it is read (safetensors' own limit).
_MAX_HEADER = 100 * 1024 * 1024
#: Bytes read or hashed at a time.
_CHUNK = 16 * 1024 * 1024


# --- save --------------------------------------------------------------------------------------


def save(state: SharedState, path: str | os.PathLike[str]) -> None:
    """Write ``state`` to ``path`` atomically (see the module docstring).

    ``InvalidArgument`` if ``state`` is not a :class:`~pccl.SharedState`; ``CheckpointError``
    (naming the file) if the file cannot be written — the previous file at ``path``, if any, is
    then unchanged.
    """
    if not isinstance(state, SharedState):
        raise InvalidArgument(f"checkpoint.save needs a pccl.SharedState, got {type(state).__name__}")
    path = _path(path)
    tensors = state.tensors()
    header: dict[str, object] = {"__metadata__": _metadata(state, tensors)}
    offset = 0
    for key, t in tensors.items():
        header[key] = {"dtype": _ST_NAME[t.dtype], "shape": list(t.array.shape),
                       "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in tensors.values():
                view = state_bytes(t.array).data
                for start in range(0, view.nbytes, _CHUNK):
                    f.write(view[start : start + _CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint {path}: {exc.strerror or exc}") from exc
        raise
    _fsync_directory(directory)
    log.info("saved checkpoint %s: revision %d, %d tensors, %d B%s", path, state.revision, len(tensors),
             offset, "" if state.lineage is None else f", {state.lineage}")


def _path(path: object) -> str:
    try:
        text = os.fspath(path)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidArgument(f"a checkpoint path is a str or os.PathLike, got {type(path).__name__}") from None
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"a checkpoint path is a non-empty str, got {text!r}")
    return text


def _metadata(state: SharedState, tensors: Mapping[str, Tensor]) -> dict[str, str]:
    lineage = state.lineage
    record = None if lineage is None else {"id": lineage.id.hex(), "revision": lineage.revision,
                                           "digest": lineage.digest.hex()}
    return {
        _FORMAT_KEY: _FORMAT_NAME,
        _VERSION_KEY: str(FORMAT_VERSION),
        _REVISION_KEY: str(state.revision),
        _LINEAGE_KEY: json.dumps(record),
        _HASHES_KEY: json.dumps({key: hash_array(t.array).hex()
                                 for key, t in tensors.items()}),
        _UNEQUAL_KEY: json.dumps([key for key, t in tensors.items() if t.allow_content_inequality]),
    }


def _fsync_directory(directory: str) -> None:
    """Make the rename durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- load --------------------------------------------------------------------------------------


class _Entry:
    __slots__ = ("key", "dtype", "shape", "begin", "end", "digest")

    def __init__(self, key: str, dtype: DType, shape: tuple[int, ...], begin: int, end: int,
                 digest: bytes | None) -> None:
        self.key, self.dtype, self.shape, self.begin, self.end, self.digest = key, dtype, shape, begin, end, digest


def load(path: str | os.PathLike[str], *, into: SharedState | None = None, verify: bool = True) -> SharedState:
    """Read a checkpoint; return a new state, or write it into ``into`` and return ``into``.

    The new state's arrays are numpy arrays of the stored dtypes and shapes, its revision and
    lineage the stored ones.  With ``into``, the file must hold exactly ``into``'s keys with the
    same dtypes and shapes (``CheckpointError`` naming the first difference otherwise); the bytes
    are written into ``into``'s arrays in place, then its revision and lineage are set.

    Every tensor's digest is checked against the one recorded at ``save`` before anything is
    written into ``into``.  ``verify=False`` also accepts a plain safetensors file without pccl's
    record (revision 0, no lineage, nothing to verify against); by default such a file is
    refused, so that a damaged record cannot pass as an unverifiable file.
    """
    if into is not None and not isinstance(into, SharedState):
        raise InvalidArgument(f"checkpoint.load(into=...) needs a pccl.SharedState, got {type(into).__name__}")
    path = _path(path)
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    with f:
        try:
            size = os.fstat(f.fileno()).st_size
            entries, revision, lineage, unequal, data_start = _read_header(f, path, size, verify)
            if into is not None:
                _check_fits(path, entries, into)
            if into is None:
                # Fresh arrays: read, then check what was read (one pass over the file).
                arrays = {e.key: np.empty(e.shape, e.dtype.numpy_dtype()) for e in entries}
                for e in entries:
                    _read_into(f, path, data_start, e, state_bytes(arrays[e.key]))
                    if e.digest is not None and hash_array(arrays[e.key]) != e.digest:
                        raise _altered(path, e)
            else:
                # The caller's arrays: check the whole file first, so a refused file changes nothing.
                for e in entries:
                    if e.digest is not None:
                        _verify(f, path, data_start, e)
                targets = into.tensors()
                for e in entries:
                    _read_into(f, path, data_start, e, state_bytes(targets[e.key].array))
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror or exc}") from exc
    if into is None:
        state = SharedState({key: Tensor(a, key in unequal, name=f"checkpoint entry {key!r}")
                             for key, a in arrays.items()}, revision, lineage=lineage)
    else:
        state = into
        state.revision = revision
        state.lineage = lineage
    log.info("loaded checkpoint %s: revision %d, %d tensors%s", path, revision, len(entries),
             "" if lineage is None else f", {lineage}")
    return state


def _read_header(f: BufferedReader, path: str, size: int, verify: bool
                 ) -> tuple[list[_Entry], int, Lineage | None, set[str], int]:
    first = f.read(8)
    if len(first) < 8:
        raise CheckpointError(f"checkpoint {path} is truncated: {size} B, not even a header length")
    (length,) = struct.unpack("<Q", first)
    if length > _MAX_HEADER:
        raise CheckpointError(f"checkpoint {path} is not a safetensors file: it announces a {length} B header")
    if 8 + length > size:
        raise CheckpointError(f"checkpoint {path} is truncated: its header needs {8 + length} B, the file has {size}")
    try:
        header = json.loads(f.read(length))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} has a damaged header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {path} has a damaged header: not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(f"checkpoint {path} has a damaged header: __metadata__ is not a map of strings")
    ours = meta.get(_FORMAT_KEY) == _FORMAT_NAME
    if not ours and verify:
        raise CheckpointError(f"{path} is not a pccl checkpoint (no {_FORMAT_KEY!r} record in its metadata); "
                              "pass verify=False to load a plain safetensors file unverified")
    revision, lineage, hashes, unequal = _read_record(path, meta) if ours else (0, None, {}, set())
    data_start = 8 + length
    entries = []
    for key, info in header.items():
        entries.append(_entry(path, key, info, hashes.get(key) if ours else None))
        if ours and key not in hashes:
            raise CheckpointError(f"checkpoint {path} has no digest for tensor {key!r}")
    if ours and (missing := sorted(set(hashes) - set(header))):
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]!r} its record names")
    entries.sort(key=lambda e: (e.begin, e.end))
    at = 0
    for e in entries:
        if e.begin != at:
            raise CheckpointError(f"checkpoint {path} has a damaged header: tensor {e.key!r} starts at "
                                  f"{e.begin}, expected {at}")
        at = e.end
    if data_start + at > size:
        short = next(e for e in entries if data_start + e.end > size)
        raise CheckpointError(f"checkpoint {path} is truncated: tensor {short.key!r} ends at byte "
                              f"{data_start + short.end}, the file has {size}")
    if data_start + at < size:
        raise CheckpointError(f"checkpoint {path} has {size - data_start - at} B after its last tensor")
    return entries, revision, lineage, unequal, data_start


def _read_record(path: str, meta: dict[str, str]) -> tuple[int, Lineage | None, dict[str, bytes], set[str]]:
    try:
        version = int(meta[_VERSION_KEY])
        if version > FORMAT_VERSION:
            raise CheckpointError(f"checkpoint {path} has format version {version}; this pccl reads up to "
                                  f"{FORMAT_VERSION}")
        revision = int(meta[_REVISION_KEY])
        record = json.loads(meta[_LINEAGE_KEY])
        lineage = None if record is None else Lineage(bytes.fromhex(record["id"]), int(record["revision"]),
                                                      bytes.fromhex(record["digest"]))
        hashes = {str(k): bytes.fromhex(v) for k, v in json.loads(meta[_HASHES_KEY]).items()}
        unequal = {str(k) for k in json.loads(meta[_UNEQUAL_KEY])}
        if not 0 <= revision < 2**64 or any(len(d) != 16 for d in hashes.values()):
            raise ValueError("revision or digest out of range")
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, InvalidArgument) as exc:
        raise CheckpointError(f"checkpoint {path} has a damaged pccl record: {exc}") from None
    return revision, lineage, hashes, unequal


def _entry(path: str, key: str, info: object, digest: bytes | None) -> _Entry:
    try:
        assert isinstance(info, dict)
        dtype = _BY_ST_NAME[info["dtype"]]
        shape = tuple(int(n) for n in info["shape"])
        begin, end = (int(n) for n in info["data_offsets"])
        count = 1
        for n in shape:
            if n < 0:
                raise ValueError("negative dimension")
            count *= n
        if begin < 0 or end - begin != count * dtype.itemsize:
            raise ValueError(f"data_offsets {[begin, end]} do not fit shape {list(shape)}")
    except KeyError as exc:
        raise CheckpointError(f"checkpoint {path}: tensor {key!r} has a damaged entry (no {exc} or an unsupported "
                              f"dtype {info.get('dtype') if isinstance(info, dict) else None!r})") from None
    except (AssertionError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: tensor {key!r} has a damaged entry ({exc or 'not an object'})"
                              ) from None
    return _Entry(key, dtype, shape, begin, end, digest)


def _check_fits(path: str, entries: list[_Entry], into: SharedState) -> None:
    have = {e.key: e for e in entries}
    tensors = into.tensors()
    for key in sorted(set(have) | set(tensors)):
        if key not in tensors:
            raise CheckpointError(f"checkpoint {path} holds tensor {key!r}, which the state to load into lacks")
        if key not in have:
            raise CheckpointError(f"checkpoint {path} lacks tensor {key!r} of the state to load into")
        e, t = have[key], tensors[key]
        if e.dtype != t.dtype or e.shape != tuple(t.array.shape):
            raise CheckpointError(f"checkpoint {path}: tensor {key!r} is {e.dtype.name.lower()}{list(e.shape)}, "
                                  f"the state's is {t.dtype.name.lower()}{list(t.array.shape)}")


def _verify(f: BufferedReader, path: str, data_start: int, e: _Entry) -> None:
    h = xxhash.xxh3_128()
    f.seek(data_start + e.begin)
    left = e.end - e.begin
    while left:
        chunk = f.read(min(left, _CHUNK))
        if not chunk:
            raise CheckpointError(f"checkpoint {path} is truncated inside tensor {e.key!r}")
        h.update(chunk)
        left -= len(chunk)
    if h.digest() != e.digest:
        raise _altered(path, e)


def _altered(path: str, e: _Entry) -> CheckpointError:
    return CheckpointError(f"checkpoint {path}: tensor {e.key!r} does not match its recorded digest "
                           "(the file was altered or damaged)")


def _read_into(f: BufferedReader, path: str, data_start: int, e: _Entry, target: np.ndarray) -> None:
    f.seek(data_start + e.begin)
    view = target.data
    at = 0
    while at < len(view):
        n = f.readinto(view[at : at + _CHUNK])
        if not n:
            raise CheckpointError(f"checkpoint {path} is truncated inside tensor {e.key!r}")
        at += n
