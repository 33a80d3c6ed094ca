"""What each kind of collective is on a peer: one row per kind, beside the master's.

The master runs every kind from one row of :data:`pccl.protocol.master.kinds.KINDS` (what
the voters must send alike, how the votes are checked, who runs the op in which order).  A peer
runs every kind the same way too — check the arguments, vote, run the op once the master
commenced it, settle, retry on a stale ring — and reads what differs from the kind's row here
(:class:`KindOps`, the table :data:`KIND_OPS`), keyed by the same :class:`CollectiveKind`:

==================  ===============================  ==========================  =====================
kind                check (before the vote)          make op (on ``Commence``)   result
==================  ===============================  ==========================  =====================
``ALL_REDUCE``      op, tag, ``ReduceArgs``          ring all-reduce             ``ReduceInfo``
``BROADCAST``       root (a peer id), tag, buffer    chain or tree from root     ``CollectiveInfo``
``ALL_GATHER``      tag, ``GatherArgs``              all-gather over the         ``Gathered``
                                                     Commence's counts
``REDUCE_SCATTER``  op, tag, ``ReduceArgs``          first half of the ring      ``Shard``
==================  ===============================  ==========================  =====================

Each row also builds the kind's ``CollectiveInit`` (:attr:`KindOps.init`): the fields its master
row compares.  The parts every kind shares — the ring check, the input kept for an abort, the
kernel runner, the release of scratch memory, the retire of the seq — are not in any row:
:func:`~pccl.collectives.execute.execute` does them once for all.

Adding a kind
-------------
A kind is one row and one op module.  The op module makes the kind's
:class:`~pccl.collectives.lane_op.LaneOp` from a :class:`~pccl.collectives.execute.Place` (an
existing op class on its own schedule, as :mod:`.broadcast` uses
:class:`~pccl.collectives.chain_op.ChainOp`); the row says how its arguments are checked and
announced and what its caller gets back.  The row's ``kind`` names the master row its votes are
checked by: a kind whose votes the master must tell apart from every other kind's (so a tag
voted as two different kinds is refused) adds its value to :class:`CollectiveKind` and a row to
the master's ``KINDS`` as well.  ``tests/e2e/test_kind_rows_inproc.py`` adds a toy kind this way.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..arrays import like_input
from ..errors import InvalidArgument, ProtocolError
from ..protocol import messages as m
from ..protocol.algorithms import BroadcastAlgorithm
from ..protocol.messages import CollectiveKind
from ..types import CollectiveInfo, Gathered, QuantKind, ReduceInfo, ReduceOp, Shard
from .all_gather import GatherArgs, all_gather_op
from .allreduce import all_reduce_op
from .broadcast import broadcast_op
from .buffers import ReduceArgs, check_op
from .chain_op import ChainOp
from .execute import AnyOp, Place
from .lane_op import LaneOp
from .reduce_scatter import reduce_scatter_op, shard_bounds
from .segments import Segments
from .wire_quant import WireQuant

__all__ = ["Call", "KindOps", "KIND_OPS", "TAG_LIMIT", "check_tag", "quant_fields", "with_broadcast_algorithm"]

TAG_LIMIT = 1 << 64


def check_tag(tag: Any) -> int:
    """``tag`` if it is a collective tag (an integer in ``[0, 2**64)``), else ``InvalidArgument``."""
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < TAG_LIMIT:
        raise InvalidArgument(f"tag must be an integer in [0, 2**64), got {tag!r}")
    return tag


def quant_fields(quant: WireQuant | None) -> dict[str, int]:
    """The ``CollectiveInit`` fields that say how an op's frames are quantized (every voter must
    send the same)."""
    if quant is None:
        return {"quant_kind": int(QuantKind.NONE), "quant_dtype": 0}
    return {
        "quant_kind": int(QuantKind.MIN_MAX),
        "quant_dtype": int(quant.code_dtype),
        "quant_bits": 4 if quant.bits == 4 else 0,
        "quant_block": quant.block or 0,
    }


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a kind, its arguments checked before its vote (what a row's ``check`` returns)."""

    tag: int
    #: The caller's buffer the op may overwrite, as the data path takes it: what an
    #: :class:`~pccl.collectives.backup.InputGuard` keeps until the master's final word (``None``:
    #: the op writes nothing of the caller's).  The op is made with the guard's stand-in for it.
    keep: ReduceArgs | None
    #: The kind's own checked arguments (a broadcast's root, an all-gather's contribution...).
    own: Any = None


def _no_output(op: AnyOp) -> np.ndarray | None:
    return None


def _no_detail(call: Call) -> str:
    return ""


@dataclasses.dataclass(frozen=True)
class KindOps:
    """How a peer runs one kind of collective (see the module docstring)."""

    #: the master's row its votes are checked by (``KINDS[kind]``)
    kind: CollectiveKind
    #: how errors and logs name it (``all-reduce``)
    name: str
    #: the caller's arguments, in the order of its call, checked: a :class:`Call`, or
    #: ``InvalidArgument`` (nothing is sent then)
    check: Callable[..., Call]
    #: the vote announcing a checked call
    init: Callable[[Call], m.CollectiveInit]
    #: the op, once the master commenced it (``ProtocolError`` if the Commence does not fit the call)
    make_op: Callable[[Call, m.CollectiveCommence, Place], AnyOp]
    #: what the caller gets once the master completed the op: from the call, the Commence, this
    #: peer's ring position, the payload bytes sent and received and the op's :attr:`output`
    result: Callable[[Call, m.CollectiveCommence, int, int, int, np.ndarray | None], Any]
    #: the array an op made its result in (``None``: the caller's own buffer holds it)
    output: Callable[[AnyOp], np.ndarray | None] = _no_output
    #: what errors add to ``<name> tag <tag>`` to name one call (a broadcast's root)
    detail: Callable[[Call], str] = _no_detail

    def what(self, call: Call) -> str:
        """One call as errors name it: ``all-reduce tag 3``, ``broadcast tag 3 from root 1a2b``."""
        return f"{self.name} tag {call.tag}{self.detail(call)}"


def _keep(call: Call) -> ReduceArgs:
    assert call.keep is not None  # a kind that writes the caller's buffer
    return call.keep


def _ring_init(call: Call, kind: CollectiveKind, **fields: Any) -> m.CollectiveInit:
    args = _keep(call)
    return m.CollectiveInit(tag=call.tag, count=int(args.src.size), dtype=int(args.dtype),
                            **quant_fields(args.quant), kind=kind, **fields)


# --- all-reduce ----------------------------------------------------------------------------------


def _check_all_reduce(send: Any, recv: Any, op: Any, tag: Any, quantization: Any) -> Call:
    op = check_op(op)  # the op first, then the tag, then the buffers: the errors in argument order
    tag = check_tag(tag)
    return Call(tag, ReduceArgs.check(send, recv, op, quantization))


def _init_all_reduce(call: Call) -> m.CollectiveInit:
    args = _keep(call)
    return _ring_init(call, CollectiveKind.ALL_REDUCE, op=int(args.op),
                      layout=args.src.layout if isinstance(args.src, Segments) else 0)


def _reduce_info(call: Call, commence: m.CollectiveCommence, rank: int, tx: int, rx: int,
                 output: np.ndarray | None) -> ReduceInfo:
    return ReduceInfo(world_size=len(commence.ring), tx_bytes=tx, rx_bytes=rx)


# --- broadcast -----------------------------------------------------------------------------------


def _check_broadcast(x: Any, root: Any, tag: Any, quantization: Any) -> Call:
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < TAG_LIMIT:
        raise InvalidArgument(f"root must be a peer id (an integer in [0, 2**64)), got {root!r}")
    tag = check_tag(tag)
    return Call(tag, ReduceArgs.check(x, None, ReduceOp.SUM, quantization), own=root)


def _broadcast_op(call: Call, commence: m.CollectiveCommence, place: Place,
                  algorithm: BroadcastAlgorithm | None = None) -> AnyOp:
    """``algorithm``: forced where it can run (``None``: the automatic choice; a test forces one
    with :func:`pccl.testing.force_broadcast_algorithm`)."""
    ring = tuple(commence.ring)
    if call.own not in ring:
        raise ProtocolError(f"the master commenced broadcast tag {call.tag} from root {call.own} on ring "
                            f"{list(ring)}, which does not hold it")
    return broadcast_op(_keep(call), place, root=ring.index(call.own), algorithm=algorithm)


def with_broadcast_algorithm(row: KindOps, algorithm: BroadcastAlgorithm) -> KindOps:
    """The broadcast's ``row`` with every op forcing ``algorithm`` where it can run
    (:func:`pccl.testing.force_broadcast_algorithm` plants it)."""
    return dataclasses.replace(row, make_op=functools.partial(_broadcast_op, algorithm=algorithm))


def _broadcast_info(call: Call, commence: m.CollectiveCommence, rank: int, tx: int, rx: int,
                    output: np.ndarray | None) -> CollectiveInfo:
    ring = tuple(commence.ring)
    return CollectiveInfo(world_size=len(ring), peers=ring, tx_bytes=tx, rx_bytes=rx)


# --- all-gather ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Contribution:
    args: GatherArgs
    #: the caller's input as passed (the result's arrays follow its type)
    template: Any


def _check_all_gather(x: Any, tag: Any, quantization: Any) -> Call:
    tag = check_tag(tag)
    return Call(tag, None, own=_Contribution(GatherArgs.check(x, quantization), template=x))


def _init_all_gather(call: Call) -> m.CollectiveInit:
    gather: GatherArgs = call.own.args
    return m.CollectiveInit(tag=call.tag, count=int(gather.src.size), dtype=int(gather.dtype), op=0,
                            **quant_fields(gather.quant), kind=CollectiveKind.ALL_GATHER)


def _all_gather_op(call: Call, commence: m.CollectiveCommence, place: Place) -> LaneOp:
    gather: GatherArgs = call.own.args
    ring, counts = tuple(commence.ring), tuple(commence.counts)
    if len(counts) != place.world or counts[place.rank] != gather.src.size:
        raise ProtocolError(f"the master commenced all-gather tag {call.tag} with counts {list(counts)} for ring "
                            f"{[f'{p:x}' for p in ring]}, but this peer contributes {gather.src.size}")
    return all_gather_op(gather, np.empty(sum(counts), gather.src.dtype), place, counts=counts)


def _gathered_output(op: AnyOp) -> np.ndarray | None:
    assert isinstance(op, ChainOp) and isinstance(op.out, np.ndarray)
    return op.out


def _gathered(call: Call, commence: m.CollectiveCommence, rank: int, tx: int, rx: int,
              output: np.ndarray | None) -> Gathered:
    assert output is not None
    template = call.own.template
    ring = tuple(commence.ring)
    arrays = tuple(like_input(a, template) for a in _split(output, commence.counts))
    return Gathered(peers=ring, arrays=arrays, buffer=like_input(output, template), world_size=len(ring),
                    tx_bytes=tx, rx_bytes=rx)


def _split(buffer: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    out, at = [], 0
    for count in counts:
        out.append(buffer[at : at + count])
        at += count
    return out


# --- reduce-scatter ------------------------------------------------------------------------------


def _check_reduce_scatter(x: Any, op: Any, tag: Any, quantization: Any) -> Call:
    op = check_op(op)
    tag = check_tag(tag)
    return Call(tag, ReduceArgs.check(x, None, op, quantization))


def _shard(call: Call, commence: m.CollectiveCommence, rank: int, tx: int, rx: int,
           output: np.ndarray | None) -> Shard:
    ring = tuple(commence.ring)
    start, stop = shard_bounds(int(_keep(call).src.size), len(ring), rank)
    return Shard(start, stop, rank, len(ring), ring, tx, rx)


#: Every built-in kind's row (the module docstring shows the table as it reads).
KIND_OPS: Mapping[CollectiveKind, KindOps] = {
    CollectiveKind.ALL_REDUCE: KindOps(
        CollectiveKind.ALL_REDUCE, "all-reduce",
        check=_check_all_reduce,
        init=_init_all_reduce,
        make_op=lambda call, commence, place: all_reduce_op(_keep(call), place),
        result=_reduce_info,
    ),
    CollectiveKind.BROADCAST: KindOps(
        CollectiveKind.BROADCAST, "broadcast",
        check=_check_broadcast,
        init=lambda call: _ring_init(call, CollectiveKind.BROADCAST, op=0, root=call.own),
        make_op=_broadcast_op,
        result=_broadcast_info,
        detail=lambda call: f" from root {call.own:x}",
    ),
    CollectiveKind.ALL_GATHER: KindOps(
        CollectiveKind.ALL_GATHER, "all-gather",
        check=_check_all_gather,
        init=_init_all_gather,
        make_op=_all_gather_op,
        result=_gathered,
        output=_gathered_output,
    ),
    CollectiveKind.REDUCE_SCATTER: KindOps(
        CollectiveKind.REDUCE_SCATTER, "reduce-scatter",
        check=_check_reduce_scatter,
        init=lambda call: _ring_init(call, CollectiveKind.REDUCE_SCATTER, op=int(_keep(call).op)),
        make_op=lambda call, commence, place: reduce_scatter_op(_keep(call), place),
        result=_shard,
    ),
}
