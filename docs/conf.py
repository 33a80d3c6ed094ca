"""Sphinx configuration of pccl's documentation (``sphinx-build -W docs OUT``).

Intersphinx works offline: each project's inventory is looked up first in a small local
inventory built here from :data:`LOCAL_TARGETS` (the external names these pages link to), so a
build without network access is complete and warning-free.  ``PCCL_DOCS_ONLINE=1`` makes the
build try the projects' published inventories first and fall back to the local ones, which is
then only an informational message, never a warning.
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import zlib

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "_ext"))
if str(ROOT) not in sys.path:  # the source tree's pccl, also when it is not installed
    sys.path.insert(0, str(ROOT))

import pccl  # noqa: E402

project = "pccl"
author = "the pccl authors"
copyright = "the pccl authors"
release = version = pccl.__version__

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "pccl_docs",
]
exclude_patterns = ["_build"]
html_theme = "furo"
html_title = f"pccl {release}"
templates_path: list[str] = []
pygments_style = "sphinx"

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_default_options = {"members": True, "show-inheritance": True}
# Names the reference mentions that no inventory holds are plain text, not warnings
# (nitpicky stays off); the tests check that the pages themselves cover the public face.

#: The external objects these pages (and pccl's docstrings) link to, by project:
#: (name, role, uri relative to the project's root).
LOCAL_TARGETS: dict[str, list[tuple[str, str, str]]] = {
    "python": [
        ("concurrent.futures.Future", "py:class", "library/concurrent.futures.html#concurrent.futures.Future"),
        ("ssl.SSLContext", "py:class", "library/ssl.html#ssl.SSLContext"),
        ("random.Random", "py:class", "library/random.html#random.Random"),
        ("TimeoutError", "py:exception", "library/exceptions.html#TimeoutError"),
        ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
        ("Exception", "py:exception", "library/exceptions.html#Exception"),
        ("KeyboardInterrupt", "py:exception", "library/exceptions.html#KeyboardInterrupt"),
        ("ExceptionGroup", "py:exception", "library/exceptions.html#ExceptionGroup"),
        ("enum.IntEnum", "py:class", "library/enum.html#enum.IntEnum"),
        ("argparse", "py:module", "library/argparse.html#module-argparse"),
        ("dataclasses.replace", "py:function", "library/dataclasses.html#dataclasses.replace"),
    ],
    "trio": [
        ("trio", "py:module", "reference-core.html#module-trio"),
        ("trio.run", "py:function", "reference-core.html#trio.run"),
        ("trio.Nursery", "py:class", "reference-core.html#trio.Nursery"),
        ("trio.Nursery.start", "py:method", "reference-core.html#trio.Nursery.start"),
        ("trio.CancelScope", "py:class", "reference-core.html#trio.CancelScope"),
        ("trio.Cancelled", "py:exception", "reference-core.html#trio.Cancelled"),
        ("trio.to_thread.run_sync", "py:function", "reference-core.html#trio.to_thread.run_sync"),
        ("trio.testing.MockClock", "py:class", "reference-testing.html#trio.testing.MockClock"),
        ("trio.TaskStatus", "py:class", "reference-core.html#trio.TaskStatus"),
    ],
    "numpy": [
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#numpy.ndarray"),
        ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html#numpy.dtype"),
        ("numpy.ascontiguousarray", "py:function",
         "reference/generated/numpy.ascontiguousarray.html#numpy.ascontiguousarray"),
    ],
    "torch": [
        ("torch.Tensor", "py:class", "tensors.html#torch.Tensor"),
        ("torch.Tensor.cpu", "py:method", "generated/torch.Tensor.cpu.html#torch.Tensor.cpu"),
        ("torch.Tensor.copy_", "py:method", "generated/torch.Tensor.copy_.html#torch.Tensor.copy_"),
        ("torch.Tensor.pin_memory", "py:method", "generated/torch.Tensor.pin_memory.html#torch.Tensor.pin_memory"),
        ("torch.nn.Module", "py:class", "generated/torch.nn.Module.html#torch.nn.Module"),
    ],
}
#: Where each project's documentation lives (the links of the local inventories point there).
PROJECTS = {
    "python": "https://docs.python.org/3/",
    "trio": "https://trio.readthedocs.io/en/stable/",
    "numpy": "https://numpy.org/doc/stable/",
    "torch": "https://docs.pytorch.org/docs/stable/",
}


def write_inventory(path: pathlib.Path, name: str, entries: list[tuple[str, str, str]]) -> None:
    """A Sphinx objects.inv (format 2) holding ``entries``."""
    header = f"# Sphinx inventory version 2\n# Project: {name}\n# Version: \n# The remainder of this file is compressed using zlib.\n"
    body = "".join(f"{obj} {role} 1 {uri} -\n" for obj, role, uri in entries)
    path.write_bytes(header.encode() + zlib.compress(body.encode()))


_INVENTORIES = pathlib.Path(tempfile.mkdtemp(prefix="pccl-docs-inv-"))
intersphinx_mapping = {}
for _name, _url in PROJECTS.items():
    _local = _INVENTORIES / f"{_name}.inv"
    write_inventory(_local, _name, LOCAL_TARGETS[_name])
    _locations = (None, str(_local)) if os.environ.get("PCCL_DOCS_ONLINE") == "1" else (str(_local),)
    intersphinx_mapping[_name] = (_url, _locations)
intersphinx_timeout = 10
