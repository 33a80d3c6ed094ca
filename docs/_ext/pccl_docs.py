"""Directives that render pages from the code, so the documentation cannot drift from it.

* ``.. pccl-messages::`` — the table of every control message (wire tag, name, fields and
  their types, what it says), from :data:`pccl.protocol.messages.ALL_MESSAGES`;
* ``.. pccl-argparse:: module:function`` — a command's reference from its :mod:`argparse`
  parser (``function()`` returns it): usage, then one ``.. option::`` per flag of the command
  and of each public sub-command, so every flag is an index entry;
* ``.. pccl-changelog::`` — ``CHANGELOG.md`` of the repository, its Markdown subset (headings,
  bullets, bold, inline code) turned into reST;
* ``.. pccl-op-lifecycle::`` — the transition table of one collective's machine, from
  ``pccl.protocol.op_lifecycle.render_table()``;
* ``.. pccl-peer-commit::`` — the table of peer-agreed completion's participant, from
  ``pccl.protocol.peer_commit.render_table()``.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

ROOT = pathlib.Path(__file__).resolve().parents[2]


class _RstDirective(SphinxDirective):
    """A directive that produces reST text, parsed in place."""

    def rst(self) -> list[str]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        container = nodes.container()
        source = self.get_source_info()[0]
        lines = StringList()
        for i, line in enumerate(self.rst()):
            lines.append(line, source, i)
        self.state.nested_parse(lines, self.content_offset, container, match_titles=True)
        return container.children


def _field_type(cls: type, name: str) -> str:
    raw = cls.__annotations__.get(name)
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            raw = klass.__annotations__[name]
            break
    text = str(raw) if not isinstance(raw, str) else raw
    return text


class MessagesDirective(_RstDirective):
    def rst(self) -> list[str]:
        from pccl.protocol import messages as m

        out = [".. list-table::", "   :header-rows: 1", "   :widths: 6 18 40 36", "",
               "   * - tag", "     - message", "     - fields (in wire order)", "     - meaning"]
        for cls in sorted(m.ALL_MESSAGES, key=lambda c: c.__struct_config__.tag):
            fields = []
            defaults = dict(zip(cls.__struct_fields__[len(cls.__struct_fields__) - len(cls.__struct_defaults__):],
                                cls.__struct_defaults__))
            for name in cls.__struct_fields__:
                kind = _field_type(cls, name)
                default = f" = {defaults[name]!r}" if name in defaults else ""
                fields.append(f"``{name}: {kind}{default}``")
            doc = " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())
            out += [f"   * - {cls.__struct_config__.tag}", f"     - ``{cls.__name__}``",
                    f"     - {', '.join(fields) or '(none)'}", f"     - {doc}"]
        return out


def _load(target: str) -> argparse.ArgumentParser:
    module, _, function = target.partition(":")
    parser = getattr(importlib.import_module(module), function)()
    assert isinstance(parser, argparse.ArgumentParser), target
    return parser


def _options(parser: argparse.ArgumentParser, program: str) -> list[str]:
    formatter = parser._get_formatter()
    out = [f".. program:: {program}", "", ".. code-block:: text", ""]
    out += ["   " + line for line in parser.format_usage().rstrip().splitlines()]
    out.append("")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        if action.option_strings:
            metavar = "" if action.nargs == 0 else " " + formatter._format_args(action, action.dest.upper())
            names = ", ".join(f"{o}{metavar}" for o in action.option_strings)
        else:
            names = action.metavar or action.dest
            if isinstance(names, tuple):
                names = " ".join(names)
        help_text = formatter._expand_help(action) if action.help else ""
        help_text = help_text.replace("*", r"\*").replace("`", r"\`").replace("|", r"\|")
        out += [f".. option:: {names}", "", f"   {help_text or '(no description)'}", ""]
    return out


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """``(name, help, parser)`` of each public sub-command (one with a help line)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps[name], sub) for name, sub in action.choices.items() if name in helps]
    return found


def command_flags(parser: argparse.ArgumentParser, program: str) -> set[str]:
    """Every flag of ``program`` and its public sub-commands, named as Sphinx's inventory names
    ``.. option::`` entries: ``"pccl-master.--listen"``."""
    flags = {f"{program.replace(' ', '-')}.{o}" for action in parser._actions
             if action.option_strings and action.help != argparse.SUPPRESS for o in action.option_strings}
    for name, _, sub in subcommands(parser):
        flags |= command_flags(sub, f"{program} {name}")
    return flags


class ArgparseDirective(_RstDirective):
    required_arguments = 1
    option_spec = {"prog": lambda x: x}

    def rst(self) -> list[str]:
        parser = _load(self.arguments[0])
        prog = self.options.get("prog", parser.prog)
        out = _options(parser, prog)
        for name, help_text, sub in subcommands(parser):  # (an internal one, pccl demo-peer, has no help)
            title = f"``{prog} {name}``"
            out += [title, "^" * len(title), "", help_text.capitalize() + ".", ""]
            out += _options(sub, f"{prog} {name}")
        return out


_INLINE_CODE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


def markdown_to_rst(text: str) -> list[str]:
    """The changelog's Markdown subset as reST (the level-1 heading is dropped: the page has one)."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("# "):
            continue
        heading = re.match(r"^(#{2,3}) (.*)$", line)
        line = _INLINE_CODE.sub(r"``\1``", line)
        if heading:
            title = _INLINE_CODE.sub(r"``\1``", heading.group(2))
            out += [title, ("-" if heading.group(1) == "##" else "~") * len(title)]
        else:
            out.append(line)
    return out


class ChangelogDirective(_RstDirective):
    def rst(self) -> list[str]:
        path = ROOT / "CHANGELOG.md"
        self.env.note_dependency(str(path))
        return markdown_to_rst(path.read_text())


class OpLifecycleDirective(_RstDirective):
    """The op machine's table, rendered by the machine's own module."""

    def rst(self) -> list[str]:
        from pccl.protocol.op_lifecycle import render_table

        return render_table("rst").splitlines()


class PeerCommitDirective(_RstDirective):
    """Peer-agreed completion's participant table, rendered by its own module."""

    def rst(self) -> list[str]:
        from pccl.protocol.peer_commit import render_table

        return render_table("rst").splitlines()


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("pccl-messages", MessagesDirective)
    app.add_directive("pccl-argparse", ArgparseDirective)
    app.add_directive("pccl-changelog", ChangelogDirective)
    app.add_directive("pccl-op-lifecycle", OpLifecycleDirective)
    app.add_directive("pccl-peer-commit", PeerCommitDirective)
    return {"parallel_read_safe": True, "version": "1"}
