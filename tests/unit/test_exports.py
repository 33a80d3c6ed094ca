"""The public face: ``pccl.__all__`` is exactly what the README's "API at a glance" table
documents, every name in it exists and has a docstring, nothing public is left out of it, and what
its members hand out names only public types (after trio's ``test_exports.py``)."""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
import types
import typing
from collections.abc import Iterator

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


# --- what public members hand out ---------------------------------------------------------------


def _types_in(annotation: object) -> Iterator[type]:
    """The classes an annotation names, through unions, generics and ``Callable``."""
    if isinstance(annotation, type) and not typing.get_args(annotation):
        yield annotation
        return
    origin = typing.get_origin(annotation)
    if isinstance(origin, type):
        yield origin
    for arg in typing.get_args(annotation):
        if isinstance(arg, list):  # Callable's parameter list
            for item in arg:
                yield from _types_in(item)
        else:
            yield from _types_in(arg)


def _is_public(cls: type) -> bool:
    """A pccl class is public when a module whose path has no private part holds or re-exports
    it (``pccl``, ``pccl.protocol.messages`` yes; only ``pccl._peer.ring_connections`` no)."""
    module = cls.__module__ or ""
    if module != "pccl" and not module.startswith("pccl."):
        return True  # the standard library's, numpy's, trio's
    parts = module.split(".")
    public = next((i for i, part in enumerate(parts) if part.startswith("_")), len(parts))
    if public == len(parts):
        return True
    for end in range(1, public + 1):
        holder = sys.modules.get(".".join(parts[:end]))
        if holder is not None and getattr(holder, cls.__name__, None) is cls:
            return True
    return False


def _public_members(obj: object) -> Iterator[tuple[str, object]]:
    for name, member in vars(obj).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            member = member.fget
        elif isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member):
            yield name, member


def _handed_out(member: object) -> dict[str, object]:
    """A function's annotations (its parameters' and its return's), resolved."""
    return typing.get_type_hints(member)


def test_public_members_hand_out_only_public_types() -> None:
    """What a user gets from the face (a property, a method's return or parameters) is a type
    the user can name: no ``pccl._peer`` object leaks out (as ``Communicator.p2p`` once did)."""
    checked = 0
    leaks = []
    for export in pccl.__all__:
        value = getattr(pccl, export)
        owners: list[tuple[str, object]] = []
        if inspect.isclass(value) and value.__module__.startswith("pccl"):
            owners = [(f"{export}.{name}", member) for name, member in _public_members(value)]
        elif inspect.isfunction(value):
            owners = [(export, value)]
        for where, member in owners:
            for part, annotation in _handed_out(member).items():
                checked += 1
                leaks += [f"{where} ({part}): {cls.__module__}.{cls.__qualname__}"
                          for cls in _types_in(annotation) if not _is_public(cls)]
    assert checked > 100, checked  # the scan sees the face
    assert leaks == []


def test_the_return_check_sees_a_private_type() -> None:
    leak = type("Links", (), {"__module__": "pccl._peer.ring_connections"})

    def leaky() -> None: ...

    leaky.__annotations__ = {"return": tuple[leak, ...] | None, "comm": pccl.Communicator}  # type: ignore[valid-type]
    found = [cls for annotation in _handed_out(leaky).values() for cls in _types_in(annotation)]
    assert leak in found and not _is_public(leak)
    assert _is_public(pccl.Communicator) and _is_public(int)
