"""One attempt of a collective as :class:`~pccl._peer.collective_service.CollectiveService` runs
it: the op's machine (:mod:`pccl.protocol.op_lifecycle`) and what its effects act on, and the
wait for the master's final word on an op this peer reported a success for."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import trio

from .agreement import Agreement
from .collective_plans import Plan
from .ring_connections import P2PLinks
from ..collectives.backup import InputGuard
from ..collectives.links import RingLinks
from ..errors import PCCLError, PeerDisconnected
from ..protocol import messages as m
from ..protocol.op_lifecycle import Effect, OpLifecycle, State

__all__ = ["OpAttempt", "await_verdict"]

#: The service's logger: these lines are the collective path's, wherever the code sits.
log = logging.getLogger("pccl._peer.collective_service")


@dataclasses.dataclass(eq=False)
class OpAttempt:
    """One attempt of a collective: its machine, and what the machine's effects act on."""

    plan: Plan
    epoch: int
    #: The ``Welcome.instance`` of the master it began under: a restarted master resolves it
    #: as that master's op (docs/protocol.rst, "A master restart while peers are in doubt").
    instance: int = 0
    machine: OpLifecycle = dataclasses.field(default_factory=OpLifecycle)
    seq: int = 0
    #: A small in-place op's staged result or a larger one's input backup, kept until the
    #: master's final word (an abort may come after this peer's ring ended).
    guard: InputGuard | None = None
    ring_scope: trio.CancelScope = dataclasses.field(default_factory=trio.CancelScope)
    #: Set by the machine's ``SETTLE``: the master's final word (or its loss) is in.
    settled: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: The master's final word (its detail goes into the caller's error); a begun op's may be
    #: the rejection of its Begin.
    final: m.CollectiveComplete | m.CollectiveAbort | m.CollectiveRejected | None = None
    #: Begun without a vote (``Config.fast_commit``): its ring is watched once armed.
    fast: bool = False
    #: A begun op's ring connections while its ring runs unwatched, and its watch once armed.
    unwatched: P2PLinks | None = None
    watch: Any = None
    #: (tx, rx) payload bytes and an all-gather's output once this peer's ring finished.
    traffic: tuple[int, int, np.ndarray | None] | None = None
    ring_error: PCCLError | None = None
    stall_error: PeerDisconnected | None = None
    #: ``WITHDRAW`` or ``AWAIT_FINAL`` once the machine hands the tag to a background task.
    handoff: Effect | None = None
    #: Begun with ``Config.peer_commit``: its agreement with the other participants
    #: (:mod:`pccl._peer.peer_commit_driver`), on the links its ring ran on.
    agreement: Agreement | None = None
    links: RingLinks | None = None


async def await_verdict(op: OpAttempt, *, peer_timeout: float, peer_id: int) -> None:
    """Wait for the master's final word on ``op``, which this peer reported a success for.

    Cancelled meanwhile, the call still waits for that word (shielded, for at most
    ``peer_timeout``): the op's fate is the master's now, and the others end as it says.
    ``Complete``: returns (the call returns its result; the cancellation, too late, is not
    raised here).  ``Abort`` or a lost master: the ``Cancelled`` goes on (the input is
    restored).  No word within the bound: the ``Cancelled`` goes on with the op undecided, and a
    background task awaits the word (``ABANDONED``) — the one case where this call may end
    otherwise than the others' (:mod:`pccl._peer.collective_service`).
    """
    try:
        await op.settled.wait()
    except trio.Cancelled:
        with trio.move_on_after(peer_timeout) as waited:
            waited.shield = True
            await op.settled.wait()
        if op.machine.state is State.COMPLETED:
            log.info("peer %x: %s seq %d was cancelled after its success was reported; the master "
                     "completed it, so the call returns its result", peer_id, op.plan.what, op.seq)
            return
        if op.machine.state is State.LOST and not waited.cancelled_caught:
            log.info("peer %x: %s seq %d was cancelled after its success was reported and the master's word "
                     "can no longer come (the communicator is closing, or the master is lost): its input is "
                     "restored, whatever the master decides", peer_id, op.plan.what, op.seq)
        elif waited.cancelled_caught:
            log.warning("peer %x: %s seq %d was cancelled after its success was reported and the master "
                        "said nothing within %g s (peer_timeout): giving up on it undecided",
                        peer_id, op.plan.what, op.seq, peer_timeout)
        raise
