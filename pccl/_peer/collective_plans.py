"""What each kind of collective is on this peer: its checked arguments, its vote, its data path
and its result.

:class:`~pccl._peer.collective_service.CollectiveService` runs every kind the same way — vote,
ring, settle, abort and retry (its module docstring) — and asks the kind's :class:`Plan` only
for what differs:

* **arguments**, checked before the vote (a bad buffer never reaches the master), and the
  ``CollectiveInit`` that announces them (its ``kind``, and what the master compares: the
  element count except for an all-gather, dtype, op, quantization, a broadcast's root);
* **the input to keep**: ``Plan.args`` is what an
  :class:`~pccl.collectives.backup.InputGuard` restores after an abort — the in-place buffer of
  an all-reduce, a reduce-scatter (all of ``x``) and a broadcast (a receiver's ``x``; a quantized
  root's too, which ends holding the dequantized values); an all-gather writes only a buffer of
  its own and keeps nothing;
* **the data path** (:mod:`pccl.collectives`) run on the master's ``Commence``: the ring
  all-reduce, the first half of the ring (reduce-scatter), the second half over the
  participants' counts the Commence carries (all-gather), or a pipelined chain from the root's
  ring position (broadcast);
* **the result**: ``ReduceInfo``, ``CollectiveInfo``, ``Gathered`` or ``Shard``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..arrays import as_array, like_input
from ..collectives.allreduce import reduce_checked
from ..collectives.backup import InputGuard
from ..collectives.buffers import KernelRunner, ReduceArgs, check_op
from ..collectives.all_gather import GatherArgs, all_gather_checked
from ..collectives.broadcast import broadcast_checked
from ..collectives.reduce_scatter import reduce_scatter_checked, shard_bounds
from ..collectives.links import RingLinks
from ..collectives.segments import Segments
from ..collectives.wire_quant import WireQuant
from ..errors import CollectiveAborted, InvalidArgument, PhaseMismatch, ProtocolError
from ..protocol import messages as m
from ..protocol.messages import CollectiveKind
from ..types import CollectiveInfo, Gathered, QuantKind, ReduceInfo, ReduceOp, Shard

__all__ = ["Plan", "TAG_LIMIT", "check_tag", "StaleRing", "phase_mismatch_abort"]

TAG_LIMIT = 1 << 64

#: How errors and logs name each kind.
_NAMES = {
    CollectiveKind.ALL_REDUCE: "all-reduce",
    CollectiveKind.BROADCAST: "broadcast",
    CollectiveKind.ALL_GATHER: "all-gather",
    CollectiveKind.REDUCE_SCATTER: "reduce-scatter",
}


def check_tag(tag: Any) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < TAG_LIMIT:
        raise InvalidArgument(f"tag must be an integer in [0, 2**64), got {tag!r}")
    return tag


def _quant_fields(quant: WireQuant | None) -> dict[str, int]:
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
class Plan:
    """One collective call's checked arguments and the Init that announces them."""

    kind: CollectiveKind
    tag: int
    init: m.CollectiveInit
    #: The buffer the op may overwrite, as the data path takes it (``None``: an all-gather).
    args: ReduceArgs | None
    #: An all-gather's contribution.
    gather: GatherArgs | None = None
    #: An all-gather's input as the caller passed it (its result arrays follow its type).
    template: Any = None
    #: The master epoch the call began in (set once the session is ready).
    epoch: int = 0

    @property
    def what(self) -> str:
        """The call as errors name it: ``all-reduce tag 3``, ``broadcast tag 3 from root 1a2b``."""
        if self.kind is CollectiveKind.BROADCAST:
            return f"broadcast tag {self.tag} from root {self.init.root:x}"
        return f"{_NAMES[self.kind]} tag {self.tag}"

    # --- making one ---------------------------------------------------------------------------

    @classmethod
    def all_reduce(cls, send: Any, recv: Any, op: Any, tag: Any, quantization: Any) -> Plan:
        op = check_op(op)  # the op first, then the tag, then the buffers: the errors in argument order
        tag = check_tag(tag)
        args = ReduceArgs.check(send, recv, op, quantization)
        init = m.CollectiveInit(
            tag=tag, count=int(args.src.size), dtype=int(args.dtype), op=int(op), **_quant_fields(args.quant),
            layout=args.src.layout if isinstance(args.src, Segments) else 0,
        )
        return cls(CollectiveKind.ALL_REDUCE, tag, init, args)

    @classmethod
    def broadcast(cls, x: Any, root: Any, tag: Any, quantization: Any) -> Plan:
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < TAG_LIMIT:
            raise InvalidArgument(f"root must be a peer id (an integer in [0, 2**64)), got {root!r}")
        tag = check_tag(tag)
        args = ReduceArgs.check(x, None, ReduceOp.SUM, quantization)
        init = m.CollectiveInit(tag=tag, count=int(args.src.size), dtype=int(args.dtype), op=0,
                                **_quant_fields(args.quant), kind=CollectiveKind.BROADCAST, root=root)
        return cls(CollectiveKind.BROADCAST, tag, init, args)

    @classmethod
    def all_gather(cls, x: Any, tag: Any, quantization: Any) -> Plan:
        tag = check_tag(tag)
        gather = GatherArgs.check(x, quantization)
        init = m.CollectiveInit(tag=tag, count=int(gather.src.size), dtype=int(gather.dtype), op=0,
                                **_quant_fields(gather.quant), kind=CollectiveKind.ALL_GATHER)
        return cls(CollectiveKind.ALL_GATHER, tag, init, None, gather, template=x)

    @classmethod
    def reduce_scatter(cls, x: Any, op: Any, tag: Any, quantization: Any) -> Plan:
        op = check_op(op)
        tag = check_tag(tag)
        args = ReduceArgs.check(x, None, op, quantization)
        init = m.CollectiveInit(tag=tag, count=int(args.src.size), dtype=int(args.dtype), op=int(op),
                                **_quant_fields(args.quant), kind=CollectiveKind.REDUCE_SCATTER)
        return cls(CollectiveKind.REDUCE_SCATTER, tag, init, args)

    # --- running one --------------------------------------------------------------------------

    def guard(self, stage_up_to: int) -> InputGuard | None:
        """What keeps the input restorable until the master's final word (``None``: nothing to keep)."""
        if self.args is None:
            return None
        return InputGuard(self.args, stage_up_to=stage_up_to)

    async def run(self, guard: InputGuard | None, commence: m.CollectiveCommence, *, links: RingLinks,
                  rank: int, runner: KernelRunner) -> tuple[int, int, np.ndarray | None]:
        """This peer's part of the data path once the master commenced it: ``(tx, rx, output)``
        (``output``: an all-gather's buffer).  The data path retires the seq on every way out."""
        ring, seq = tuple(commence.ring), commence.seq
        world = len(ring)
        if self.kind is CollectiveKind.ALL_GATHER:
            assert self.gather is not None
            counts = tuple(commence.counts)
            if len(counts) != world or counts[rank] != self.gather.src.size:
                links.retire(seq)
                raise ProtocolError(f"the master commenced {self.what} with counts {list(counts)} for ring "
                                    f"{[f'{p:x}' for p in ring]}, but this peer contributes {self.gather.src.size}")
            out = np.empty(sum(counts), self.gather.src.dtype)
            tx, rx = await all_gather_checked(self.gather, out, counts=counts, links=links, rank=rank, world=world,
                                              seq=seq, runner=runner)
            return tx, rx, out
        assert guard is not None
        if self.kind is CollectiveKind.ALL_REDUCE:
            tx, rx = await reduce_checked(guard.args, links=links, rank=rank, world=world, seq=seq,
                                          backup=guard.backup, runner=runner)
        elif self.kind is CollectiveKind.REDUCE_SCATTER:
            tx, rx = await reduce_scatter_checked(guard.args, links=links, rank=rank, world=world, seq=seq,
                                                  backup=guard.backup, runner=runner)
        else:
            tx, rx = await broadcast_checked(guard.args, root=ring.index(self.init.root), links=links, rank=rank,
                                             world=world, seq=seq, backup=guard.backup, runner=runner)
        return tx, rx, None

    def result(self, commence: m.CollectiveCommence, rank: int, tx: int, rx: int,
               output: np.ndarray | None) -> ReduceInfo | CollectiveInfo | Gathered | Shard:
        """The caller's result once the master completed the op."""
        ring = tuple(commence.ring)
        world = len(ring)
        if self.kind is CollectiveKind.ALL_REDUCE:
            return ReduceInfo(world_size=world, tx_bytes=tx, rx_bytes=rx)
        if self.kind is CollectiveKind.BROADCAST:
            return CollectiveInfo(world_size=world, peers=ring, tx_bytes=tx, rx_bytes=rx)
        if self.kind is CollectiveKind.REDUCE_SCATTER:
            assert self.args is not None
            start, stop = shard_bounds(int(self.args.src.size), world, rank)
            return Shard(start, stop, rank, world, ring, tx, rx)
        assert output is not None
        arrays = _split(output, commence.counts)
        return Gathered(peers=ring, arrays=tuple(like_input(a, self.template) for a in arrays),
                        buffer=like_input(output, self.template), world_size=world, tx_bytes=tx, rx_bytes=rx)


def _split(buffer: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    out, at = [], 0
    for count in counts:
        out.append(buffer[at : at + count])
        at += count
    return out


class StaleRing(Exception):
    """The master answered STALE_RING; re-wire and vote again."""


def phase_mismatch_abort(what: str, mismatch: PhaseMismatch) -> CollectiveAborted:
    """The all-reduce's error for a phase mismatch: ``CollectiveAborted`` (the loop goes on to
    its next step, where the peers meet) caused by the ``PhaseMismatch``."""
    error = CollectiveAborted(f"{what} ended: {mismatch}")
    error.__cause__ = mismatch
    return error
