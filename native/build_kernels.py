"""cffi API-mode build of ``pccl._kernels`` (abi3).  Run by setuptools via ``cffi_modules``.

A failed compilation fails the build (setuptools' build_ext raises): there is no pure-Python
fallback, so a wheel without the compiled module cannot be produced.

Compiler flags, and why:
  -O3                  vectorise the element loops;
  -std=c99             the sources are plain C99;
  -fno-math-errno      lets the compiler treat math.h calls as pure (no errno writes);
  -fno-trapping-math   lets it if-convert selects into compare+blend (results unchanged: we
                       never read the FP exception flags);
  -fno-strict-aliasing the scans read float arrays through unsigned-integer pointers;
  -ffp-contract=off    NO fused multiply-add contraction: dequantization must give identical
                       bits on machines with and without FMA.
No -ffast-math / -ffinite-math-only: they would delete the NaN/Inf checks and change NaN
semantics of MIN/MAX.  No -march=native: the module must run on any x86-64 (or other) CPU it
is copied to; the loops are written to vectorise on the baseline ISA.
"""

from __future__ import annotations

import os
import pathlib
import sys

from cffi import FFI

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = ["reduce.c", "quant.c"]


def _rel(path: pathlib.Path) -> str:
    # setuptools refuses absolute source paths; make them relative to the build's cwd.
    return os.path.relpath(path, os.getcwd())


if sys.platform == "win32":
    COMPILE_ARGS = ["/O2", "/fp:precise"]
else:
    COMPILE_ARGS = [
        "-O3",
        "-std=c99",
        "-fno-math-errno",
        "-fno-trapping-math",
        "-ffp-contract=off",
        "-fno-strict-aliasing",
    ]

ffibuilder = FFI()
ffibuilder.cdef((HERE / "kernels.h").read_text())
ffibuilder.set_source(
    "pccl._kernels",
    "#include <stddef.h>\n#include <stdint.h>\n#include \"kernels.h\"\n",
    sources=[_rel(HERE / s) for s in SOURCES],
    include_dirs=[_rel(HERE)],
    depends=[_rel(HERE / "kernels.h"), _rel(HERE / "kernels_internal.h")],
    extra_compile_args=COMPILE_ARGS,
    py_limited_api=True,
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
