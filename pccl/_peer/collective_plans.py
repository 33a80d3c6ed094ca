"""What each kind of collective is on this peer: its checked arguments, its vote, its data path
and its result.

:class:`~pccl._peer.collective_service.CollectiveService` runs every kind the same way — vote,
ring, settle, abort and retry (its module docstring) — and asks the kind's :class:`Plan` only
for what differs, which the Plan reads from the kind's row (:class:`~pccl.collectives.kinds.KindOps`,
the table :data:`~pccl.collectives.kinds.KIND_OPS`):

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
import logging
from typing import Any

import numpy as np

from ..collectives.backup import InputGuard
from ..collectives.buffers import KernelRunner, ReduceArgs
from ..collectives.execute import execute
from ..collectives.kinds import KIND_OPS, TAG_LIMIT, Call, KindOps, check_tag
from ..collectives.links import RingLinks
from ..errors import CollectiveAborted, InvalidUsage, PhaseMismatch, ProtocolError, TooFewPeers
from ..protocol import messages as m
from ..protocol.messages import CollectiveKind

__all__ = ["Plan", "TAG_LIMIT", "check_tag", "StaleRing", "Withdrawn", "phase_mismatch_abort", "rejection"]

#: The service's logger: these lines are the collective path's, wherever the code sits.
log = logging.getLogger("pccl._peer.collective_service")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One collective call's kind (its row), checked arguments and the Init that announces them."""

    row: KindOps
    call: Call
    init: m.CollectiveInit
    #: The master epoch the call began in (set once the session is ready).
    epoch: int = 0

    @classmethod
    def of(cls, row: KindOps, *arguments: Any) -> Plan:
        """A call of ``row``'s kind: the caller's arguments in the order of its call, checked
        (``InvalidArgument`` before anything is sent)."""
        call = row.check(*arguments)
        return cls(row, call, row.init(call))

    @classmethod
    def all_reduce(cls, send: Any, recv: Any, op: Any, tag: Any, quantization: Any) -> Plan:
        return cls.of(KIND_OPS[CollectiveKind.ALL_REDUCE], send, recv, op, tag, quantization)

    @classmethod
    def broadcast(cls, x: Any, root: Any, tag: Any, quantization: Any) -> Plan:
        return cls.of(KIND_OPS[CollectiveKind.BROADCAST], x, root, tag, quantization)

    @classmethod
    def all_gather(cls, x: Any, tag: Any, quantization: Any) -> Plan:
        return cls.of(KIND_OPS[CollectiveKind.ALL_GATHER], x, tag, quantization)

    @classmethod
    def reduce_scatter(cls, x: Any, op: Any, tag: Any, quantization: Any) -> Plan:
        return cls.of(KIND_OPS[CollectiveKind.REDUCE_SCATTER], x, op, tag, quantization)

    def at(self, epoch: int) -> Plan:
        """This call as begun in master epoch ``epoch`` (built directly: every call makes one,
        and ``dataclasses.replace`` costs several times more)."""
        return Plan(self.row, self.call, self.init, epoch)

    @property
    def kind(self) -> CollectiveKind:
        return self.row.kind

    @property
    def tag(self) -> int:
        return self.call.tag

    @property
    def args(self) -> ReduceArgs | None:
        """The buffer the op may overwrite, as the data path takes it (``None``: none of the caller's)."""
        return self.call.keep

    @property
    def what(self) -> str:
        """The call as errors name it: ``all-reduce tag 3``, ``broadcast tag 3 from root 1a2b``."""
        return self.row.what(self.call)

    # --- running one --------------------------------------------------------------------------

    def guard(self, stage_up_to: int) -> InputGuard | None:
        """What keeps the input restorable until the master's final word (``None``: nothing to keep)."""
        if self.call.keep is None:
            return None
        return InputGuard(self.call.keep, stage_up_to=stage_up_to)

    async def run(self, guard: InputGuard | None, commence: m.CollectiveCommence, *, links: RingLinks,
                  rank: int, runner: KernelRunner) -> tuple[int, int, np.ndarray | None]:
        """This peer's part of the data path once the master commenced it: ``(tx, rx, output)``
        (``output``: the array the op made its result in, if not the caller's).  The data path
        retires the seq on every way out (:func:`~pccl.collectives.execute.execute`)."""
        call = self.call if guard is None else Call(self.call.tag, guard.args, self.call.own)  # (not replace(): per op)
        op = await execute(lambda place: self.row.make_op(call, commence, place), links=links, rank=rank,
                           world=len(commence.ring), seq=commence.seq, keep=call.keep,
                           backup=guard.backup if guard is not None else None, runner=runner)
        return op.tx_bytes, op.rx_bytes, self.row.output(op)

    def result(self, commence: m.CollectiveCommence, rank: int, tx: int, rx: int, output: np.ndarray | None) -> Any:
        """The caller's result once the master completed the op."""
        return self.row.result(self.call, commence, rank, tx, rx, output)


class StaleRing(Exception):
    """The master answered STALE_RING; re-wire and vote again."""

    #: whether the ring must be re-wired before the retry
    rewire = True


class Withdrawn(StaleRing):
    """A participant withdrew the begun op before every participant began (its caller was
    cancelled): the ring is sound, retry the tag's next use at once."""

    rewire = False


def phase_mismatch_abort(what: str, mismatch: PhaseMismatch) -> CollectiveAborted:
    """The all-reduce's error for a phase mismatch: ``CollectiveAborted`` (the loop goes on to
    its next step, where the peers meet) caused by the ``PhaseMismatch``."""
    error = CollectiveAborted(f"{what} ended: {mismatch}")
    error.__cause__ = mismatch
    return error


def rejection(plan: Plan, answer: m.CollectiveRejected, peer_id: int) -> Exception:
    """What the caller of ``plan`` (on peer ``peer_id``) gets for the master's refusal ``answer``
    (of its vote, or of its Begin): ``StaleRing`` to re-wire and retry, else its error."""
    try:
        code = m.RejectCode(answer.code)
    except ValueError:
        return ProtocolError(f"the master rejected tag {plan.tag} with unknown code {answer.code}")
    detail = f" ({answer.detail})" if answer.detail else ""
    if code is m.RejectCode.STALE_RING:
        return StaleRing()
    if code is m.RejectCode.TOO_FEW_PEERS:
        return TooFewPeers(f"{plan.what} needs at least two peers in the group{detail}")
    if code is m.RejectCode.TAG_IN_USE:
        return InvalidUsage(f"{plan.what} is already in flight{detail}")
    if code is m.RejectCode.PHASE_MISMATCH:
        log.warning("peer %x: the master ended %s: %s", peer_id, plan.what, answer.detail)
        return phase_mismatch_abort(plan.what, PhaseMismatch(answer.detail or "phase mismatch"))
    if code is m.RejectCode.WITHDRAWN:
        return ProtocolError(f"the master answered {plan.what} with a withdrawal it never got")
    if code is m.RejectCode.ROOT_ABSENT:
        # Retry-safe: the root may be a newcomer the next topology round accepts.
        return CollectiveAborted(f"{plan.what} did not start: {answer.detail or 'its root is not a member'}")
    return InvalidUsage(f"the peers' parameters for {plan.what} disagree{detail}")
