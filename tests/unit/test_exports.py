"""The public face: ``pccl.__all__`` is exactly what the README's "API at a glance" table
documents, every name in it exists and has a docstring, and nothing public is left out of it
(after trio's ``test_exports.py``)."""

from __future__ import annotations

import pathlib
import re
import types

import pccl

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _documented() -> set[str]:
    text = README.read_text()
    section = text[text.index("## API at a glance"):]
    section = section[: section.index("\n## ", 1)]
    names: set[str] = set()
    for row in re.findall(r"^\| (`[^|]+`) \|", section, re.M):
        names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", row))
    return names


def test_all_is_exactly_the_documented_face() -> None:
    assert len(pccl.__all__) == len(set(pccl.__all__)), "a name twice in pccl.__all__"
    assert set(pccl.__all__) == _documented()


def test_every_exported_name_exists_and_says_what_it_is() -> None:
    for name in pccl.__all__:
        value = getattr(pccl, name)
        if name != "__version__":
            assert (value.__doc__ or "").strip(), f"pccl.{name} has no docstring"


def test_nothing_public_hides_outside_all() -> None:
    # The package's own submodules are attributes too; only those named in __all__ are public.
    public = {n for n in dir(pccl) if not n.startswith("_")}
    modules = {n for n in public if isinstance(getattr(pccl, n), types.ModuleType)}
    assert public - modules <= set(pccl.__all__), sorted(public - modules - set(pccl.__all__))
    assert {"blocking", "checkpoint"} <= modules & set(pccl.__all__)
