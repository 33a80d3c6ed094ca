"""The collective kinds as data: one row per kind of what the master's collective-ops machine
(:mod:`pccl.protocol.master.collectives`) does differently for it (sans-IO).

Kinds.  What an op computes is its kind (:class:`CollectiveKind`, ``CollectiveInit.kind``: a
trailing field, so an Init without it is an all-reduce; an unknown value is a PROTOCOL_ERROR);
everything the handlers do differently per kind is one row of :data:`KINDS` (:class:`KindRow`):
the call its voters wait in, the ``CollectiveInit`` fields every voter must send alike and how
each is shown when they do not (as the caller named them: ``dtype=float32 op=sum``), how the
votes are checked, the fewest voters it runs with, the order its participants run it in (sent in
``CollectiveCommence``), whether the Commence carries every participant's element count, and the
data path's schedules (:mod:`pccl.protocol.ring`) each participant derives from the agreed
fields.  The rules above hold for every kind: a new kind is a row and a schedule, not new
handlers.  Every voter of a tag must ask for the same kind (checked at consensus over the voters
then present; PARAMETER_MISMATCH listing each one's otherwise), and the op runs as that kind's
row says.  The peers run each kind from their own row of it, keyed by the same
:class:`CollectiveKind` (``pccl.collectives.kinds.KIND_OPS``: the arguments' check, the vote, the
op, the result).

The table as it reads:

* ``ALL_REDUCE``: call ``all_reduce``; agreed: ``count dtype op quant_* layout``;
  runs on the group's ring, in its order; schedule ``RingSchedule``, or ``ExchangeSchedule`` for
  a small unquantized op (``uses_exchange``).
* ``BROADCAST``: call ``broadcast``; agreed: ``count dtype quant_* root``; the root
  (a peer id) must be one of the voters, else ROOT_ABSENT naming it — checked after STALE_RING,
  so voters whose ring lost the root re-wire first and then learn it is gone (the peers' error
  is retry-safe: the root may be accepted by the next topology round); an abort because the root
  left says so in ``CollectiveAbort.detail``; the group's ring, a chain from the root along it
  (``BroadcastSchedule``).
* ``ALL_GATHER``: call ``all_gather``; agreed: ``dtype quant_*`` (element counts
  may differ, 0 included); the Commence carries each participant's count in ring order, so every
  participant knows the layout of the result before a byte moves; the group's ring
  (``AllGatherSchedule``).
* ``REDUCE_SCATTER``: call ``reduce_scatter``; agreed: ``count dtype op quant_*``;
  the group's ring (ring position ``i`` owns the ``i``-th slice; ``ReduceScatterSchedule``).

``quant_*`` is ``quant_kind quant_dtype quant_bits quant_block``: how the frames are quantized
(shown together, ``quant=min_max/uint4 block=128``).  Every row needs at least 2 voters.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import KickReason
from ...types import DType, QuantKind, ReduceOp
from .. import messages as m
from ..messages import CollectiveKind
from ..ring import AllGatherSchedule, BroadcastSchedule, ExchangeSchedule, ReduceScatterSchedule, RingSchedule
from .events import PeerFault

__all__ = ["CollectiveKind", "KindRow", "KINDS", "kind_of", "agreed_alike", "root_among_voters"]


# --- the kinds ---------------------------------------------------------------------------------


#: kind value -> kind (a dict lookup: the enum's own call costs a few of them, and the master
#: reads the kind of every vote and Begin).
_KIND_OF_VALUE: dict[int, CollectiveKind] = {k.value: k for k in CollectiveKind}


def kind_of(init: m.CollectiveInit) -> CollectiveKind:
    """The kind a vote asks for (the one place that reads the kind off the wire).  An Init
    without the trailing field is an all-reduce; an unknown kind is the peer's protocol error."""
    kind = _KIND_OF_VALUE.get(init.kind)
    if kind is None:
        raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {init.tag} asks for unknown kind {init.kind}")
    return kind


def _name_of(enum_type: Any, value: int) -> str:
    try:
        return str(enum_type(value).name.lower())
    except ValueError:
        return f"?{value}"


#: How a PARAMETER_MISMATCH detail shows each agreeable field's value (the names a caller passed).
_SHOW: Mapping[str, Callable[[int], str]] = {
    "count": str,
    "dtype": lambda v: _name_of(DType, v),
    "op": lambda v: _name_of(ReduceOp, v),
    "quant_kind": lambda v: _name_of(QuantKind, v),
    "quant_dtype": lambda v: _name_of(DType, v),
    "quant_bits": lambda v: f"uint{v}" if v else "",
    "quant_block": lambda v: f" block={v}" if v else "",
    "layout": lambda v: f"{v:x}",
    "root": lambda v: f"{v:x}",
}


@dataclasses.dataclass(frozen=True)
class KindRow:
    """How the master runs one kind of collective (see "Kinds" in the module docstring)."""

    kind: CollectiveKind
    #: the peer's call that votes it (named where the master says who waits where)
    call: str
    #: the ``CollectiveInit`` fields every voter must send for the op to commence
    agreed: tuple[str, ...]
    #: one voter's agreed fields in a PARAMETER_MISMATCH detail (a format naming each of them;
    #: the values are filled in as the caller named them: ``dtype=float32 op=sum``)
    shown: str
    #: whether the voters can run it: ``None``, or the rejection's code and detail (given the
    #: row, the tag and every voter's Init)
    check: Callable[[KindRow, int, Mapping[int, m.CollectiveInit]], tuple[m.RejectCode, str] | None]
    #: who runs the op, in which order (``CollectiveCommence.ring``), from the group's ring
    #: (whose members are exactly the voters) and the votes
    order: Callable[[tuple[int, ...], Mapping[int, m.CollectiveInit]], tuple[int, ...]]
    #: the data path's plans (:mod:`pccl.protocol.ring`): every participant picks one from the
    #: agreed fields and the order alone, so all pick the same
    schedules: tuple[type[Any], ...]
    #: fewest voters it commences with (TOO_FEW_PEERS below)
    min_voters: int = 2
    #: ``CollectiveCommence.counts`` carries every participant's element count (in ring order)
    sends_counts: bool = False
    #: the agreed fields of an Init as one tuple (built from ``agreed``)
    key: Callable[[m.CollectiveInit], Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        getter = operator.attrgetter(*self.agreed)
        key = getter if len(self.agreed) > 1 else (lambda init: (getter(init),))
        object.__setattr__(self, "key", key)

    def describe(self, init: m.CollectiveInit) -> str:
        """``init``'s agreed fields as a PARAMETER_MISMATCH detail shows them."""
        shown = {f: _SHOW.get(f, str)(v) for f, v in zip(self.agreed, self.key(init))}
        if "quant_dtype" in shown and not init.quant_kind:
            shown["quant_dtype"] = "-"  # unquantized: no wire type
        if shown.get("quant_bits"):  # 4 bits: shown as the target the caller named (uint4), not its storage
            shown["quant_dtype"], shown["quant_bits"] = shown["quant_bits"], ""
        return self.shown.format(**shown)


def agreed_alike(row: KindRow, tag: int, inits: Mapping[int, m.CollectiveInit]) -> tuple[m.RejectCode, str] | None:
    """The voters agree when every one sent the same value of each of ``row.agreed``; otherwise
    PARAMETER_MISMATCH, its detail listing every voter's."""
    key = row.key
    first = None
    for init in inits.values():
        value = key(init)
        if first is None:
            first = value
        elif value != first:
            listing = "; ".join(f"peer {pid:x}: {row.describe(i)}" for pid, i in sorted(inits.items()))
            return m.RejectCode.PARAMETER_MISMATCH, f"peers disagree on {row.call} tag {tag}: {listing}"
    return None


def root_among_voters(row: KindRow, tag: int, inits: Mapping[int, m.CollectiveInit]) -> tuple[m.RejectCode, str] | None:
    """A broadcast: the voters agree (:func:`agreed_alike`), and the root they name is one of
    them (else ROOT_ABSENT, naming it)."""
    disagreement = agreed_alike(row, tag, inits)
    if disagreement is not None:
        return disagreement
    root = next(iter(inits.values())).root
    if root not in inits:
        members = ", ".join(f"{pid:x}" for pid in sorted(inits))
        return m.RejectCode.ROOT_ABSENT, (f"broadcast tag {tag}: root {root:x} is not an accepted member of the "
                                          f"group (members: {members})")
    return None


def _group_ring(ring_order: tuple[int, ...], inits: Mapping[int, m.CollectiveInit]) -> tuple[int, ...]:
    return ring_order


_QUANT = ("quant_kind", "quant_dtype", "quant_bits", "quant_block")
_QUANT_SHOWN = "quant={quant_kind}/{quant_dtype}{quant_bits}{quant_block}"

#: Every kind's row (the module docstring shows the table as it reads).
KINDS: Mapping[CollectiveKind, KindRow] = {
    CollectiveKind.ALL_REDUCE: KindRow(
        CollectiveKind.ALL_REDUCE,
        call="all_reduce",
        agreed=("count", "dtype", "op", *_QUANT, "layout"),
        shown="count={count} dtype={dtype} op={op} " + _QUANT_SHOWN + " layout={layout}",
        check=agreed_alike,
        order=_group_ring,
        schedules=(RingSchedule, ExchangeSchedule),
    ),
    CollectiveKind.BROADCAST: KindRow(
        CollectiveKind.BROADCAST,
        call="broadcast",
        agreed=("count", "dtype", *_QUANT, "root"),
        shown="count={count} dtype={dtype} " + _QUANT_SHOWN + " root={root}",
        check=root_among_voters,
        order=_group_ring,
        schedules=(BroadcastSchedule,),
    ),
    CollectiveKind.ALL_GATHER: KindRow(
        CollectiveKind.ALL_GATHER,
        call="all_gather",
        agreed=("dtype", *_QUANT),
        shown="dtype={dtype} " + _QUANT_SHOWN,
        check=agreed_alike,
        order=_group_ring,
        schedules=(AllGatherSchedule,),
        sends_counts=True,
    ),
    CollectiveKind.REDUCE_SCATTER: KindRow(
        CollectiveKind.REDUCE_SCATTER,
        call="reduce_scatter",
        agreed=("count", "dtype", "op", *_QUANT),
        shown="count={count} dtype={dtype} op={op} " + _QUANT_SHOWN,
        check=agreed_alike,
        order=_group_ring,
        schedules=(ReduceScatterSchedule,),
    ),
}
