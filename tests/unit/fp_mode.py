"""Test-only helper: run code with the calling thread's SSE flush-to-zero and
denormals-are-zero modes on, as user code can (``torch.set_flush_denormal(True)`` does).

Linux/glibc on x86-64 only: the MXCSR register is reached through ``fegetenv``/``fesetenv``,
where it is the 32-bit field at byte 28 of ``fenv_t``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import platform
import struct
import sys
from collections.abc import Iterator

import pytest

_FTZ_DAZ = 0x8040
_MXCSR_OFFSET = 28

AVAILABLE = sys.platform == "linux" and platform.machine() == "x86_64" and struct.calcsize("P") == 8
needs_sse_modes = pytest.mark.skipif(not AVAILABLE, reason="MXCSR modes are set through glibc on x86-64 Linux")


def _libm() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")


def mxcsr() -> int:
    env = ctypes.create_string_buffer(64)
    assert _libm().fegetenv(env) == 0
    return struct.unpack_from("I", env.raw, _MXCSR_OFFSET)[0]


@contextlib.contextmanager
def flush_denormals() -> Iterator[None]:
    """FTZ and DAZ on in this thread for the block (restored afterwards)."""
    libm = _libm()
    saved = ctypes.create_string_buffer(64)
    assert libm.fegetenv(saved) == 0
    raw = bytearray(saved.raw)
    struct.pack_into("I", raw, _MXCSR_OFFSET, struct.unpack_from("I", raw, _MXCSR_OFFSET)[0] | _FTZ_DAZ)
    assert libm.fesetenv(ctypes.create_string_buffer(bytes(raw), 64)) == 0
    try:
        yield
    finally:
        assert libm.fesetenv(saved) == 0
