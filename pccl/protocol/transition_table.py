"""A sans-IO machine's transition table (``(state, event) -> (next state, effects)``) rendered
for the docs: one rst ``list-table`` or markdown table, rows in the order the states and events
are declared (:mod:`pccl.protocol.op_lifecycle`, :mod:`pccl.protocol.peer_commit`)."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

__all__ = ["render"]

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


def render(transitions: Mapping[tuple[S, E], tuple[enum.Enum, Iterable[enum.Enum]]],
           states: Iterable[S], events: Iterable[E], header: Sequence[str], fmt: str = "rst") -> str:
    """``transitions`` as a table with the four columns ``header`` names (state, event, next
    state, effects); ``fmt`` is ``"rst"`` or ``"markdown"``, anything else a ``ValueError``."""
    if fmt not in ("rst", "markdown"):
        raise ValueError(f"render_table: fmt must be 'rst' or 'markdown', got {fmt!r}")
    event_list = list(events)
    order = {pair: i for i, pair in enumerate((s, e) for s in states for e in event_list)}
    cells = [(s.name, e.name, nxt.name, ", ".join(x.name for x in effects))
             for (s, e), (nxt, effects) in sorted(transitions.items(), key=lambda item: order[item[0]])]
    if fmt == "markdown":
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(f"`{c}`" if c else "-" for c in row) + " |" for row in cells]
    else:
        lines = [".. list-table::", "   :header-rows: 1", ""]
        for row in (tuple(header), *((f"``{c}``" if c else "-" for c in r) for r in cells)):
            first, *rest = row
            lines.append(f"   * - {first}")
            lines += [f"     - {c}" for c in rest]
    return "\n".join(lines) + "\n"
