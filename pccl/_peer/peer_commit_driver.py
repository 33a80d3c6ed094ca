"""Completion agreed among peers, as a peer runs it (``Config.peer_commit``).

The design is docs/protocol.rst, "Design: completion agreed among peers"; the participant's
machine is :class:`pccl.protocol.peer_commit.PeerCommit`, the acks' wire form and digest
:mod:`pccl.protocol.peer_ack`, the master's side :mod:`pccl.protocol.master.peer_resolve` (run
by :mod:`pccl.protocol.master.collectives` for ops begun with ``CollectiveBegin.peer_commit``).
The collective service (:mod:`pccl._peer.collective_service`) hands an op begun on the fast path
to :meth:`PeerCommits.settle` once its ring ended with the result and its ``Done(ok)`` went out
(so the master has it before anything this peer says of the op later), in place of the wait for
the master's verdict.

Acks ride the ring lanes
========================

An ack is a data frame of the op's :func:`~pccl.protocol.peer_ack.ack_seq` on lane 0 to the ring
successor, ``step`` counting the sender's acks of the op: ``(seq, digest, known)`` with the known
set as a bitset over ring positions.  So acks travel one way round the ring, each participant
relaying its set whenever it grows: every id reaches everyone in at most ``N - 1`` hops, with no
links besides the ring's (the design's shorter ack graphs over the partner links are not wired).
A frame that comes before its reader is kept by the inbox (its seq is a derived one), and the
seq retires when the op ends here, so later acks are discarded.

The rules as run here
=====================

* Ready (the machine's ``RESULT_HELD``) only after ``Done(ok)`` went out, and never for a seq
  the master queried before (:meth:`PeerCommits.frozen`): such a participant answered that it
  will never be ready — or, queried once its ``Done(ok)`` was out but before :meth:`settle`
  fed ``RESULT_HELD``, that it is in doubt — and waits for the verdict.
* A full known set commits: the call returns its result without any master message (the
  master's own ``CollectiveComplete`` follows once every ``Done(ok)`` is in, and is ignored).
* Doubt: an ack with another digest, a known set that breaks the rules, or no ack for
  ``peer_timeout`` (a neighbour lost or stalled) asks the master (``CollectiveAsk`` with the
  known set) and waits for its verdict; so does a participant the master queries
  (``CollectiveAnswer``).  A participant in doubt relays nothing more: its successor's doubt
  follows, and the master decides for all.
* A failure before ready is reported to the master (``Done(aborted)``), whose ``Abort`` ends the
  op on the others: no peer nack (a fault costs one master round trip).
* A ready participant never aborts on its own: the master's ``Abort`` ends it, as does a lost
  master once it is in doubt (the master restart of the design is not wired: such a call ends
  ``MasterUnreachable``, input restored).  Cancelled while ready, the call still waits,
  shielded, for at most ``peer_timeout``, for its set or the verdict; then it asks the master
  and hands the op to the background wait for the verdict (``ABANDONED``, as after a cancelled
  ``Done(ok)``).
* Queries (:meth:`PeerCommits.on_query`) are answered whether or not the op still runs here: a
  ready or decided op with its state, one whose ``Done(ok)`` is out but not yet ready here as in
  doubt (frozen: the rule above), a running one — or one never begun — is frozen into aborted
  (its ring stopped) and answers so.  Outcomes are remembered for a while for that.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import trio

from .agreement import Agreement
from .host import PeerHost
from .op_attempt import OpAttempt
from ..collectives.links import RingLinks
from ..errors import PCCLError, ProtocolError
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.op_lifecycle import Event, State
from ..protocol.peer_ack import Ack, Acceptance, accept, ack_size, decode_ack, encode_ack
from ..protocol.peer_commit import Effect as X
from ..protocol.peer_commit import Event as E
from ..protocol.peer_commit import Phase

__all__ = ["Agreement", "PeerCommits"]

log = logging.getLogger("pccl._peer.collective_service")

#: Outcomes (and frozen seqs) remembered for the master's late queries.
_MEMORY = 4096
#: The lifecycle's states of an op whose Done(ok) is out and whose outcome is not known here.
_REPORTED = (State.REPORTED, State.ABANDONED)
_WIRE = {Phase.RUNNING: m.CommitPhase.RUNNING, Phase.READY: m.CommitPhase.READY,
         Phase.IN_DOUBT: m.CommitPhase.IN_DOUBT, Phase.COMMITTED: m.CommitPhase.COMMITTED,
         Phase.ABORTED: m.CommitPhase.ABORTED}


class PeerCommits:
    """The agreements of one collective service, and its answers to the master's queries."""

    def __init__(self, host: PeerHost, step: Callable[..., object]) -> None:
        self._host = host
        self._step = step  # CollectiveService._step
        self._ops: dict[int, OpAttempt] = {}  # seq -> op with a seq, while it is this service's
        self._decided: collections.OrderedDict[int, tuple[m.CommitPhase, tuple[int, ...]]] = collections.OrderedDict()
        self._frozen: collections.OrderedDict[int, None] = collections.OrderedDict()
        host.on_query = self.on_query

    # --- bookkeeping (the service calls these) ----------------------------------------------------

    def track(self, op: OpAttempt) -> None:
        self._ops[op.seq] = op

    def untrack(self, op: OpAttempt) -> None:
        """``op`` left the service: remember its outcome for a late query.  An op whose outcome
        a background task still awaits (cancelled after its ``Done(ok)``) stays until that task
        ends."""
        if self._ops.get(op.seq) is not op or op.machine.state in _REPORTED:
            return
        del self._ops[op.seq]
        ag = op.agreement
        if ag is not None and ag.machine.decided:
            self._remember(op.seq, _WIRE[ag.machine.phase], ag.ids(ag.machine.known))
        elif op.machine.state is State.COMPLETED:
            self._remember(op.seq, m.CommitPhase.COMMITTED, ())
        elif op.machine.state not in _REPORTED:
            self._remember(op.seq, m.CommitPhase.ABORTED, ())

    def frozen(self, seq: int) -> bool:
        """Whether the master queried ``seq`` here before :meth:`settle` made it ready: never
        ready now (it answered aborted), or in doubt if its ``Done(ok)`` was out (it answered in
        doubt); either way only the master's verdict ends it."""
        return seq in self._frozen

    def _remember(self, seq: int, phase: m.CommitPhase, known: tuple[int, ...]) -> None:
        self._decided[seq] = (phase, known)
        while len(self._decided) > _MEMORY:
            self._decided.popitem(last=False)

    def _freeze(self, seq: int) -> None:
        self._frozen[seq] = None
        while len(self._frozen) > _MEMORY:
            self._frozen.popitem(last=False)

    # --- the master's query -------------------------------------------------------------------

    def on_query(self, msg: m.CollectiveQuery, epoch: int) -> None:
        """Answer the master's query on op ``msg.seq`` (synchronous: the master's reader)."""
        op = self._ops.get(msg.seq)
        ag = op.agreement if op is not None else None
        if ag is not None and ag.machine.phase is not Phase.RUNNING:
            ag.doubt(E.QUERY, self._host.counters)  # ready: in doubt now (frozen); decided: as it is
            ag.stop()
            answer = (_WIRE[ag.machine.phase], ag.ids(ag.machine.known))
        elif op is not None and op.machine.state in _REPORTED:
            # Its Done(ok) is (going) out but settle() has not made it ready yet: ready, and in
            # doubt from now, as if ready (never committing on a full set: the master may decide
            # on this answer without the ids it would learn); settle() waits for the verdict.
            self._freeze(msg.seq)
            answer = (m.CommitPhase.IN_DOUBT, (self._host.peer_id,))
        elif op is not None and op.machine.state in (State.COMPLETED, State.ABORTED):
            answer = ((m.CommitPhase.COMMITTED if op.machine.state is State.COMPLETED else m.CommitPhase.ABORTED), ())
        elif msg.seq in self._decided:
            answer = self._decided[msg.seq]
        else:
            # Running, or never begun here: the query freezes it into aborted (never ready).
            self._freeze(msg.seq)
            if op is not None:
                if ag is not None:
                    ag.machine.handle(E.QUERY)
                op.ring_scope.cancel()
            answer = (m.CommitPhase.ABORTED, ())
        log.debug("peer %x: the master queried tag %d seq %d: answering %s", self._host.peer_id, msg.tag, msg.seq,
                  answer[0].name)
        self._host.spawn(self._send, m.CollectiveAnswer(msg.tag, msg.seq, answer[0], answer[1]), epoch)

    async def _send(self, msg: m.Message, epoch: int) -> None:
        try:
            await self._host.send_shielded(msg, epoch=epoch)
        except PCCLError:
            pass  # the master is gone (the op ends LOST) or the communicator failed

    # --- one op's agreement -------------------------------------------------------------------

    async def settle(self, op: OpAttempt) -> None:
        """``op``'s ring ended with the result and its ``Done(ok)`` is out: agree with the other
        participants (or, in doubt, wait for the master's verdict).  Returns once the op's
        machine settled (``COMPLETED`` on a full known set); cancelled, see the module docstring."""
        ag = op.agreement
        assert ag is not None and op.links is not None
        links, timeout = op.links, self._host.config.peer_timeout
        try:
            if self.frozen(op.seq) or op.settled.is_set():
                await op.settled.wait()  # queried before it was ready here: the verdict decides
                return
            try:
                await self._exchange(op, ag, links)
            except trio.Cancelled:
                with trio.move_on_after(timeout) as waited:
                    waited.shield = True
                    await self._exchange(op, ag, links)
                if op.machine.state is State.COMPLETED:
                    log.info("peer %x: %s seq %d was cancelled after it was ready; it committed, so the call "
                             "returns its result", self._host.peer_id, op.plan.what, op.seq)
                    return
                if waited.cancelled_caught and not op.settled.is_set():
                    await self._ask(op, ag)  # the verdict comes to the background wait
                    log.warning("peer %x: %s seq %d was cancelled after it was ready and nothing decided it "
                                "within %g s (peer_timeout): the master decides it in the background",
                                self._host.peer_id, op.plan.what, op.seq, timeout)
                raise
        finally:
            links.retire(ag.seq)

    async def _exchange(self, op: OpAttempt, ag: Agreement, links: RingLinks) -> None:
        """Acks until a full set, the master's word or a doubt; then, in doubt, the verdict."""
        if ag.machine.phase is Phase.RUNNING:
            await self._effects(op, ag, links, ag.machine.handle(E.RESULT_HELD))
        timeout = self._host.config.peer_timeout
        while ag.machine.phase is Phase.READY and not op.settled.is_set():
            # One scope per read: its deadline is the silence bound, ``stop`` cancels it too.
            scope = ag.scope = trio.CancelScope(deadline=trio.current_time() + timeout)
            ack: Ack | None = None
            lost = False
            with scope:
                ack = await self._read_ack(op, ag, links)
                lost = ack is None  # the link failed, or sent a malformed ack
            ag.scope = None
            silent = scope.cancelled_caught and not ag.stopped
            if ack is not None:
                await self._effects(op, ag, links, self._merge(op, ag, ack))
            elif (lost or silent) and not op.settled.is_set():
                if not lost:
                    log.info("peer %x: no ack of %s seq %d for %g s: asking the master", self._host.peer_id,
                             op.plan.what, op.seq, timeout)
                await self._effects(op, ag, links, ag.doubt(E.PEER_LOST, self._host.counters))
        if ag.machine.phase is Phase.COMMITTED:
            return
        if ag.master_lost and not op.settled.is_set():
            self._step(op, Event.MASTER_LOST)  # in doubt, and no master to ask
        await op.settled.wait()
        if ag.machine.phase is Phase.READY or ag.machine.phase is Phase.IN_DOUBT:
            ag.machine.handle(E.COMMIT if op.machine.state is State.COMPLETED else E.ABORT)

    def _merge(self, op: OpAttempt, ag: Agreement, ack: Ack) -> tuple[X, ...]:
        acceptance = accept(ack, op.seq, ag.digest)
        if acceptance == Acceptance.MERGE:
            try:
                return ag.machine.receive_known(ack.known)
            except ProtocolError as exc:
                log.warning("peer %x: %s seq %d: %s; asking the master", self._host.peer_id, op.plan.what, op.seq,
                            exc)
        else:
            log.warning("peer %x: %s seq %d: an ack with another digest (the peers' parameters differ); "
                        "asking the master", self._host.peer_id, op.plan.what, op.seq)
        return ag.doubt(E.PEER_LOST, self._host.counters)

    async def _effects(self, op: OpAttempt, ag: Agreement, links: RingLinks, effects: tuple[X, ...]) -> None:
        for effect in effects:
            if effect is X.SEND_KNOWN:
                await self.send_ack(op, ag, links)
            elif effect is X.RETURN_RESULT:
                self._host.counters.peer_commits += 1
                self._step(op, Event.COMPLETE, m.CollectiveComplete(op.plan.tag, op.seq))
            elif effect is X.ASK_MASTER:
                await self._ask(op, ag)
            # RETIRE: nothing (the master completes the op on the last Done(ok) anyway).

    async def _ask(self, op: OpAttempt, ag: Agreement) -> None:
        if ag.machine.phase is Phase.READY:
            ag.doubt(E.PEER_LOST, self._host.counters)
        if ag.master_lost:
            return
        ask = m.CollectiveAsk(op.plan.tag, op.seq, _WIRE[ag.machine.phase], ag.ids(ag.machine.known))
        try:
            await self._host.send_shielded(ask, epoch=op.epoch)
        except PCCLError:
            ag.master_lost = True

    async def send_ack(self, op: OpAttempt, ag: Agreement, links: RingLinks) -> None:
        """Send ``ag``'s known set to the ring successor (lane 0).  (Public for
        :func:`pccl.testing.hooks.after_acks`, which plants a fault right after it.)"""
        if not ag.news():
            return
        n = len(ag.ring)
        ag.told = ag.machine.known
        payload = encode_ack(Ack(op.seq, ag.digest, ag.machine.known), n)
        header = DataHeader(ag.seq, 0, ag.sent, 0, len(payload))
        ag.sent += 1
        with trio.CancelScope(shield=True):  # a frame cut midway would break the lane
            try:
                await links.to_next[0].send_data(header, payload)
            except PCCLError as exc:
                log.info("peer %x: could not send an ack of %s seq %d: %s", self._host.peer_id, op.plan.what,
                         op.seq, exc)

    async def _read_ack(self, op: OpAttempt, ag: Agreement, links: RingLinks) -> Ack | None:
        n = len(ag.ring)
        buffer = bytearray(ack_size(n))
        try:
            await links.inboxes[0].receive_into(seq=ag.seq, stream=0, step=ag.received, offset=0,
                                                destination=memoryview(buffer))
        except PCCLError as exc:
            log.info("peer %x: the ack link of %s seq %d failed: %s", self._host.peer_id, op.plan.what, op.seq, exc)
            return None
        ag.received += 1
        try:
            return decode_ack(bytes(buffer), n)
        except ProtocolError as exc:
            log.warning("peer %x: %s seq %d: %s", self._host.peer_id, op.plan.what, op.seq, exc)
            return None
