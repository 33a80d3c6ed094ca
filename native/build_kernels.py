"""cffi API-mode build of ``pccl._kernels`` (abi3).  Run by setuptools via ``cffi_modules``."""

from __future__ import annotations

import os
import pathlib

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ["reduce.c"]


def _rel(path: pathlib.Path) -> str:
    # setuptools refuses absolute source paths; make them relative to the build's cwd.
    return os.path.relpath(path, os.getcwd())

ffibuilder = FFI()
ffibuilder.cdef((HERE / "kernels.h").read_text())
ffibuilder.set_source(
    "pccl._kernels",
    '#include "kernels.h"',
    sources=[_rel(HERE / s) for s in SOURCES],
    include_dirs=[_rel(HERE)],
    extra_compile_args=["-O3", "-std=c99"],
    py_limited_api=True,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
