"""The collectives as a communicator runs them: the master's votes around the data path.

:class:`CollectiveService` (one per :class:`~pccl.communicator.Communicator`) implements
``Communicator.all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter`` and
``all_reduce_many``.  What differs per kind (arguments, the Init, the data path, the input to
keep, the result) is the kind's :class:`~pccl._peer.collective_plans.Plan`; everything below
holds for every kind.  One call is one or more *attempts*:

1. **Vote.**  The buffers are checked first (``InvalidArgument`` before anything is sent).  The
   master's messages for ``tag`` are routed here (a tag already in flight on this peer is
   ``InvalidUsage``), the plan's ``CollectiveInit`` goes to the master and its answer decides:
   ``Commence(seq, ring)`` runs the op; ``Rejected`` with ``PARAMETER_MISMATCH`` or
   ``TAG_IN_USE`` is ``InvalidUsage``, ``TOO_FEW_PEERS`` is ``TooFewPeers`` (the buffer is
   untouched), ``ROOT_ABSENT`` (a broadcast's root is no member) ``CollectiveAborted`` naming the
   root, ``STALE_RING`` (a member left or an op aborted since the ring was wired) re-wires the
   group — once no other collective of this peer holds a tag, because the master refuses
   topology votes with collectives in flight — and votes again.  ``PHASE_MISMATCH`` (every
   other member waits in ``update_topology``, a sync, or collectives on other tags) is
   ``CollectiveAborted`` caused by ``PhaseMismatch``; ``all_reduce_many`` does not retry it.
2. **Ring.**  The plan's data path (:mod:`pccl.collectives`) runs in its own cancel scope over
   the current round's lanes, on the arguments checked before the vote; a large op on real TCP
   first waits there for its turn at the lane threads, in the order the Commences arrived (each
   is recorded in the links' ``SeqRegistry`` on arrival; :mod:`pccl.collectives.turns`).
   Meanwhile the tag's messages are intercepted synchronously by the task that reads the master
   connection (``CollectiveRoute.intercept``) — the master's ``Abort(seq)`` cancels the ring scope
   there and then — and the communicator's one watchdog task (:mod:`pccl._peer.ring_watchdog`)
   cancels it when no byte has moved on this peer's ring connections for ``config.peer_timeout``
   (a neighbour that the master still hears but this peer does not: a partition between two
   peers, a wedged process).  A stalled or dead peer is otherwise
   removed by the master's heartbeat timeout, which aborts the op.  No task is spawned per op: for
   a small all-reduce a nursery with a listener and a watchdog cost more than a tenth of the whole
   call.
3. **Settle.**  ``Done(seq, aborted)`` goes to the master, which answers every participant with
   exactly one ``Complete(seq)`` or ``Abort(seq)``.  The op's
   :class:`~pccl.collectives.backup.InputGuard` (a small in-place op's staged result, a larger
   one's input backup) is kept until then, so an ``Abort`` that arrives after this peer finished
   its ring still restores the input.

**The fast path** (``Config.fast_commit``; docs/protocol.rst, "Design: one master round trip per
collective").  An attempt that starts with no other collective of this peer in flight or
starting (calls started together all vote: :meth:`~pccl._peer.call_gate.CallGate.alone`), on ring
connections no op failed on since their round, of a kind that needs no count from the master,
skips the vote: it sends ``CollectiveBegin`` with the seq every peer derives alike (the round,
the tag, the tag's uses since the round: every attempt that got a seq counts, whichever path)
and runs the ring at once, unwatched until the master's one-way ``Commence`` says everyone
began.  Its ``Done`` and the verdict are as above, except that a ring failure waits for the
verdict too (it may be a disagreement, which the master names: ``CollectiveAbort.code``), and a
Begin the master refuses (``CollectiveRejected(STALE_RING)``) re-wires and votes again.

What each of these steps means for one attempt — which message or ring end leads where, and
what the service must do then (cancel the ring, report ``Done``, restore the input, hand the
tag to a background task) — is the sans-IO machine :mod:`pccl.protocol.op_lifecycle`; this
module feeds it events and runs its effects.

Outcome: the plan's result (``ReduceInfo``, ``CollectiveInfo``, ``Gathered``, ``Shard``) on
``Complete``; otherwise exactly one ``CollectiveAborted`` (its ``__cause__`` is the local error,
if any; the master's reason, such as a broadcast root that left, in its message) with an
in-place buffer holding its input again.  Master messages of an earlier op on the same tag are told apart
by ``seq`` and ignored; data frames of ended seqs are discarded by the links' ``SeqRegistry``.

Cancellation restores an in-place buffer and reports ``Done(aborted=True)`` (shielded, bounded by
``peer_timeout``), so the other participants abort instead of waiting.  Cancelled while the vote
is still open, the call returns at once and a background task in the communicator's nursery
sends ``CollectiveWithdraw(tag)`` and waits for the master's answer: ``Rejected(WITHDRAWN)``
frees the tag (one round trip); a ``Commence`` that crossed the withdrawal is reported as this
peer's abort.  So does a call cancelled in an op it began whose arming ``Commence`` has not come:
the master ends the op (``Abort(WITHDRAWN)``: every participant retries the tag's next use, no
re-wire; docs/protocol.rst, "Withdrawing a Begin").  Until then the tag is *abandoned*
(:mod:`pccl._peer.phase`): a new call on it, a topology vote or a sync waits instead of failing.
A cancellation that cut a frame mid-way (here, or by the master's abort of the withdrawn op on
another beginner) tore a ring connection: the peer says so (``CollectiveWithdraw.torn``) and
votes, the master marks the ring stale, and every member's next call re-wires before it runs.
Once this peer has reported success the op's fate is the master's, and a cancellation does not
decide it: the call waits for the master's final word (shielded, for at most ``peer_timeout``,
the master's own heartbeat timeout and the watchdog's bound on a stalled ring) and ends as the
others do — ``Complete``: it returns its result (the cancellation came too late; the caller's
cancel scope catches nothing), ``Abort`` or a lost master: the input is restored and the
``Cancelled`` goes on.  Only if the master says nothing within that bound (another participant's
ring still moves, or the master is unreachable without the connection having failed) does the
call give up undecided: the input restored, ``Cancelled``, while the others may still complete;
its tag then stays abandoned until the master's final word on the op (a new Init on the tag
before that would be refused as ``TAG_IN_USE``).  The fast path's begun ops follow the same rule.

Every control message to the master is sent shielded: a send cut mid-frame would break the
master connection (and with it the communicator).

``all_reduce_many`` runs rounds: each round starts every pending array's op in order, op ``j``
once op ``j - max_in_flight`` has finished here (a rule that does not depend on when this peer
learns of a failure, so every peer starts the same ops); when the round is over, the ops that
aborted or met a stale ring are retried after one re-wire of the group.

Concurrent tags and the automatic re-wire: the re-wire waits until no collective of this peer
holds a tag; a call that starts while it stands joins it (the phase rule refuses a collective
while a topology vote stands) and runs on the new ring.  Across peers, a vote of another peer
that waits for this one, while this one re-wires first, is ended by the master as
``STALE_RING`` (its voter re-wires too), so calls that cross after a failure meet on the new
ring rather than waiting on each other.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from .collective_plans import Plan, StaleRing, Withdrawn, phase_mismatch_abort, rejection
from .op_attempt import OpAttempt, await_verdict
from .agreement import Agreement
from .call_gate import CallGate
from .peer_commit_driver import PeerCommits
from .reduce_many import MANY_FIRST_TAG, reduce_many
from .host import CollectiveRoute, MasterLost, PeerHost, RouteInbox
from .ring_connections import P2PLinks
from .ring_link_cache import RingLinkCache
from .ring_watchdog import RingWatchdog
from ..errors import (
    CollectiveAborted,
    InvalidArgument,
    MasterUnreachable,
    PCCLError,
    PeerDisconnected,
    PhaseMismatch,
    ProtocolError,
)
from ..protocol import messages as m
from ..protocol.op_lifecycle import Effect, Event, OpLifecycle, State
from ..protocol.peer_commit import Phase
from ..protocol.peer_ack import ack_seq
from ..types import CollectiveInfo, Gathered, ReduceInfo, ReduceOp, Shard
from ..collectives.backup import InputGuard
from ..collectives.buffers import KernelRunner
from ..collectives.kinds import KindOps
from ..collectives.links import SeqRegistry

__all__ = ["CollectiveService", "MANY_FIRST_TAG"]

log = logging.getLogger(__name__)

#: What a collective call returns.
Result = ReduceInfo | CollectiveInfo | Gathered | Shard
#: In-place ops up to this size reduce into scratch memory and copy the result into the caller's
#: array once the master confirms the op (cheaper for small ops than the input backup, which
#: saves every slice before its first overwrite to be able to restore it).
STAGED_IN_PLACE_BYTES = 256 * 1024


class CollectiveService:
    """The all-reduce machinery of one communicator (see the module docstring)."""

    def __init__(self, host: PeerHost) -> None:
        self._host = host
        self._runner = KernelRunner(threads=host.config.kernel_threads, kernel_wait=host.network.kernel_wait())
        self._links = RingLinkCache(host.master_epoch)
        self._watchdog = RingWatchdog(host)
        self._gate = CallGate(host, self._links)  # who holds a tag, and the way to one
        #: Fast path (``Config.fast_commit``): the ring connections an op failed on (no op
        #: begins on them again), and the uses of each tag since the round of ``_uses_round``.
        self._spoiled: P2PLinks | None = None
        #: The torn ring connections the master was told of (:meth:`_tear_news`).
        self._told_torn: P2PLinks | None = None
        self._uses_links: P2PLinks | None = None
        self._uses: dict[int, int] = {}
        self._commits = PeerCommits(host, self._step)  # Config.peer_commit, and the master's queries

    @property
    def host(self) -> PeerHost:
        return self._host

    @property
    def gate(self) -> CallGate:
        """The attempts that hold a tag or are starting, and a call's way to its tag."""
        return self._gate

    @property
    def runner(self) -> KernelRunner:
        return self._runner

    @property
    def peer_commits(self) -> PeerCommits:
        """The agreements of ``Config.peer_commit`` and the answers to the master's queries."""
        return self._commits

    @property
    def registry(self) -> SeqRegistry:
        """Seqs that ended on this peer under the current master (late frames discarded)."""
        return self._links.registry

    @property
    def kept_bytes(self) -> int:
        """Payload bytes the current round's links keep in memory for ops not begun here."""
        return self._links.kept_bytes

    # --- entry points (Communicator.all_reduce, all_reduce_many) ------------------------------

    async def all_reduce(
        self, send: Any, recv: Any = None, *, op: Any = ReduceOp.SUM, tag: Any = 0, quantization: Any = None
    ) -> ReduceInfo:
        await trio.lowlevel.checkpoint_if_cancelled()
        result = await self._call(Plan.all_reduce(send, recv, op, tag, quantization))
        assert isinstance(result, ReduceInfo)
        return result

    async def broadcast(self, x: Any, *, root: Any, tag: Any = 0, quantization: Any = None) -> CollectiveInfo:
        await trio.lowlevel.checkpoint_if_cancelled()
        result = await self._call(Plan.broadcast(x, root, tag, quantization))
        assert isinstance(result, CollectiveInfo)
        return result

    async def all_gather(self, x: Any, *, tag: Any = 0, quantization: Any = None) -> Gathered:
        await trio.lowlevel.checkpoint_if_cancelled()
        result = await self._call(Plan.all_gather(x, tag, quantization))
        assert isinstance(result, Gathered)
        return result

    async def reduce_scatter(self, x: Any, *, op: Any = ReduceOp.SUM, tag: Any = 0, quantization: Any = None) -> Shard:
        await trio.lowlevel.checkpoint_if_cancelled()
        result = await self._call(Plan.reduce_scatter(x, op, tag, quantization))
        assert isinstance(result, Shard)
        return result

    async def call(self, row: KindOps, *arguments: Any) -> Any:
        """A collective of any kind: ``row``'s (:mod:`pccl.collectives.kinds`), on the caller's
        arguments in the order its ``check`` takes them; returns what the row's ``result`` makes."""
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._call(Plan.of(row, *arguments))

    async def _call(self, plan: Plan) -> Result:
        """One collective call, its arguments checked (:class:`Plan`): vote, run, settle, retry
        on a stale ring."""
        try:
            await self._host.ready()
            plan = plan.at(self._host.master_epoch)
            return await self.reduce(plan)
        except MasterLost as exc:
            raise CollectiveAborted(f"{plan.what} aborted: {exc}") from exc
        except PhaseMismatch as exc:  # the re-wire after a stale ring was ended
            raise phase_mismatch_abort(plan.what, exc) from exc

    async def all_reduce_many(self, arrays: Sequence[Any], **options: Any) -> ReduceInfo:
        """``Communicator.all_reduce_many`` (:mod:`pccl._peer.reduce_many`)."""
        await trio.lowlevel.checkpoint_if_cancelled()
        return await reduce_many(arrays, host=self._host, runner=self._runner, attempt=self._attempt,
                                 rewire=self.rewire_when_idle, **options)

    # --- one all-reduce -----------------------------------------------------------------------

    async def reduce(self, plan: Plan) -> Result:
        """Attempts of ``plan`` until one is not refused for a stale ring (re-wiring between)."""
        while True:
            try:
                return await self._attempt(plan)
            except StaleRing as exc:
                self._host.counters.retries += 1
                if exc.rewire:
                    await self.rewire_when_idle()

    async def rewire_when_idle(self) -> None:
        """Re-wire the group once no all-reduce of this peer holds a tag (the master refuses a
        topology vote while this peer has a collective in flight).  Concurrent callers share
        the one vote."""
        await self._gate.idle()
        log.info("peer %x: ring is stale, re-wiring the group before retrying", self._host.peer_id)
        await self._host.rewire()

    async def _attempt(self, plan: Plan, *, fast: bool = True) -> Result:
        """One attempt: vote, and run the op if the master commences it (or begin it at once,
        when ``fast`` and :meth:`_begin` allow).  Raises ``StaleRing`` on a stale ring (the
        caller re-wires)."""
        epoch, alone = await self._gate.enter(plan, fast=fast)  # joins a re-wire of this peer, never refused
        begin = self._begin(plan) if alone else None  # no checkpoint from here to open_route: holds a tag
        route = self._host.open_route(plan.tag)
        # Large ops (and the partner links' ops) take their turns in the order they were
        # commenced here (the same on every peer): a Commence is recorded the moment it arrives,
        # a begun op as its Begin goes out, before any later op can run (links.SeqRegistry).
        registry = self._links.registry
        # (Not a begun op's: its one-way Commence comes once it may be on its data path already,
        # and would record the seq as waiting again, holding every later large op back.)
        route.on_commence = registry.commenced if begin is None else None
        self._gate.hold()
        op = OpAttempt(plan, epoch, self._host.master_instance)
        keep_route = False
        try:
            if begin is not None:
                # The fast path: no answer to wait for (docs/protocol.rst).
                op.machine, op.fast, op.seq = OpLifecycle(State.BEGUN), True, begin.seq
                if begin.peer_commit:
                    op.agreement = Agreement.of(self._host.links.ring, self._host.peer_id, begin.round, begin.seq,
                                                plan.init)
                registry.commenced(begin.seq)
                await self._host.send_shielded(begin, epoch=epoch)
                answer = m.CollectiveCommence(plan.tag, begin.seq, self._host.links.ring)
            else:
                await self._host.send_shielded(plan.init, epoch=epoch)
                try:
                    reply = await self._await_answer(op, route.inbox)
                except trio.Cancelled:
                    # The Init stands at the master; the others may commence without us.  Leave a
                    # task behind to withdraw it (and to release the tag).
                    self._step(op, Event.CANCEL)
                    keep_route = self._abandon(op, route.inbox)
                    raise
                if isinstance(reply, m.CollectiveRejected):
                    raise rejection(plan, reply, self._host.peer_id)
                answer = reply
                self._count_use(plan.tag)
            op.seq = answer.seq
            self._commits.track(op)
            try:
                return await self._run(op, answer, route)
            except Withdrawn:
                # Another participant withdrew: the master's abort cut this peer's ring, maybe
                # mid-frame.  Torn, the ring must be re-wired before the tag's next use begins.
                if self._tear_news():
                    await self._tell_torn(plan.tag, epoch)
                raise
            except trio.Cancelled:
                if op.handoff is not None:
                    # This peer reported success and the master has not spoken: the op still
                    # runs there.  Wait for its final word in the background, so that the next
                    # call on the tag finds it free.
                    keep_route = self._abandon(op, route.inbox)
                raise
            finally:
                # The data path retired the seq when its ring ended; an op that never reached
                # it (its guard failed, say) must not hold later ops' lane threads back either.
                registry.retire(answer.seq)
                if answer.seq >> 63:
                    # A begun op's acks too, with an agreement here or not (joined by a vote,
                    # or Config.peer_commit off here while the others ack): otherwise frames
                    # sent to this peer for it are kept until the next re-wire, and once
                    # kept_limit fills, the next one parks at the head of its lane for good.
                    registry.retire(op.agreement.seq if op.agreement is not None else ack_seq(answer.seq))
                self._commits.untrack(op)
        finally:
            if not keep_route:
                self._gate.release(plan.tag)

    def _begin(self, plan: Plan) -> m.CollectiveBegin | None:
        """The Begin of ``plan``'s op if it takes the fast path (``Config.fast_commit``; this
        peer has no other collective in flight, no op failed on its ring since the round, and
        the kind needs no vote), counting the tag's use; ``None``: it votes."""
        p2p = self._host.links
        init = plan.init
        if (not self._host.config.fast_commit or self._gate.holding or self._gate.starting or p2p is self._spoiled
                or p2p.round == 0
                or len(p2p.ring) < 2 or self._host.peer_id not in p2p.ring
                or init.kind == m.CollectiveKind.ALL_GATHER
                or (init.kind == m.CollectiveKind.BROADCAST and init.root not in p2p.ring)):
            return None
        n = self._count_use(plan.tag)
        return m.CollectiveBegin(plan.tag, m.derived_seq(p2p.round, plan.tag, n), p2p.round, init.count, init.dtype,
                                 init.op, init.quant_kind, init.quant_dtype, init.layout, init.kind, init.root,
                                 init.quant_bits, init.quant_block, peer_commit=self._host.config.peer_commit)

    def _count_use(self, tag: int) -> int:
        """Count a use of ``tag`` on the current ring (an op that got a seq, whichever path):
        the number of earlier ones since the round."""
        links = self._host.links
        if links is not self._uses_links:  # a new round (round ids restart with a new master)
            self._uses_links, self._uses = links, {}
        n = self._uses.get(tag, 0)
        self._uses[tag] = n + 1
        return n

    async def _await_answer(
        self, op: OpAttempt, inbox: RouteInbox
    ) -> m.CollectiveCommence | m.CollectiveRejected:
        while True:
            try:
                msg = await inbox.receive()
            except trio.EndOfChannel:
                self._step(op, Event.MASTER_LOST)
                self._host.raise_if_failed(op.epoch)
                raise ProtocolError("the collective's message route closed unexpectedly") from None
            if isinstance(msg, m.CollectiveCommence) and not self._ended_here(msg):
                self._step(op, Event.COMMENCE)
                return msg
            if isinstance(msg, m.CollectiveRejected):
                self._step(op, Event.REJECT)
                return msg
            # The final message of an earlier op on this tag, released before it arrived.
            log.debug("ignoring %s for tag %d seq %d: not for this op", type(msg).__name__,
                      getattr(msg, "tag", -1), getattr(msg, "seq", -1))

    def _ended_here(self, commence: m.CollectiveCommence) -> bool:
        """Whether ``commence`` arms an op that already ended here: a begun op committed on its
        acks (``Config.peer_commit``) before the master, which sends the arming ``Commence`` to
        every participant once the last ``Begin`` is in, got it out.  It reaches the tag's next
        call, which must not take it for the answer to its own vote (it would run the ended op's
        seq while the others run the vote's op).  Seqs are unique in a master epoch, and a new
        master starts a new registry."""
        return self._links.registry.is_retired(commence.seq)

    # --- the machine's effects -------------------------------------------------------------------

    def _step(self, op: OpAttempt, event: Event,
              word: m.CollectiveComplete | m.CollectiveAbort | m.CollectiveRejected | None = None
              ) -> tuple[Effect, ...]:
        """Feed ``event`` to ``op``'s machine and run its synchronous effects; return all of
        them (the caller sends the reports: :meth:`_report`).  ``word`` is the master's message
        behind a ``COMPLETE`` or ``ABORT``."""
        effects = op.machine.handle(event)
        for effect in effects:
            if effect is Effect.CANCEL_RING:
                op.ring_scope.cancel()
            elif effect is Effect.SETTLE:
                op.final = word
                op.settled.set()
                if op.agreement is not None:
                    op.agreement.stop()  # the ack exchange ends: the outcome is in
            elif effect is Effect.WITHDRAW or effect is Effect.AWAIT_FINAL:
                op.handoff = effect
            elif effect is Effect.ARM_WATCHDOG and op.unwatched is not None:
                op.watch = self._watchdog.watch(op.unwatched, lambda: self._stalled(op))
        # Last: the only effect that touches the caller's memory, so that one raising cannot
        # leave a settle or a hand-off undone.
        if Effect.RESTORE_INPUT in effects and op.guard is not None:
            op.guard.restore()
        return effects

    async def _report(self, op: OpAttempt, effects: tuple[Effect, ...]) -> None:
        """Send the ``Done`` that ``effects`` ask for, if any (shielded: see the module docstring)."""
        for effect in effects:
            if effect is Effect.REPORT_DONE or effect is Effect.REPORT_ABORT:
                done = m.CollectiveDone(op.plan.tag, op.seq, aborted=effect is Effect.REPORT_ABORT)
                await self._host.send_shielded(done, epoch=op.epoch)

    def _word(self, op: OpAttempt, msg: m.Message | None) -> None:
        """The master's message ``msg`` for ``op``'s tag (``None``: the route closed) while the op
        runs; the master's word on other seqs is ignored."""
        if msg is None:
            ag = op.agreement
            if ag is not None and (ag.machine.phase is Phase.READY or (self._host.reconnecting and (
                    ag.machine.phase is Phase.IN_DOUBT
                    or (ag.machine.phase is Phase.RUNNING and op.machine.state is State.REPORTED)))):
                # Ready needs no master: the acks go on (also once its Done(ok) is out, while the
                # master is being got back: the lost one may have counted it ready).  In doubt,
                # it asks the next master.
                ag.master_lost = True
            else:
                self._step(op, Event.MASTER_LOST)
        elif isinstance(msg, m.CollectiveComplete) and msg.seq == op.seq:
            self._step(op, Event.COMPLETE, msg)  # (with peer commit it may beat the acks: as good)
        elif isinstance(msg, m.CollectiveAbort) and msg.seq == op.seq:
            self._step(op, Event.ABORT, msg)
        elif op.fast and isinstance(msg, m.CollectiveCommence) and msg.seq == op.seq:
            self._step(op, Event.COMMENCE)  # every participant began: the watchdog may watch
        elif op.fast and isinstance(msg, m.CollectiveRejected) and msg.code != m.RejectCode.WITHDRAWN:
            self._step(op, Event.REJECT, msg)  # the Begin met a stale ring
        else:
            log.debug("ignoring %s for tag %d during seq %d", type(msg).__name__, op.plan.tag, op.seq)

    def _stalled(self, op: OpAttempt) -> None:
        """The watchdog saw no byte move on ``op``'s ring connections."""
        op.stall_error = PeerDisconnected(
            f"no data moved on the ring connections for {self._host.config.peer_timeout:g} s")
        self._step(op, Event.STALL)

    def _tear_news(self) -> bool:
        """Whether this peer's ring connections are torn (``P2PLinks.torn``: a frame cut
        mid-way) and the master does not know yet; if so they are marked told (the caller sends
        ``CollectiveWithdraw.torn``) and spoiled: no op begins on them, the next one votes and
        the master answers ``STALE_RING``, so every member re-wires before the ring runs again."""
        p2p = self._host.links
        if p2p is self._told_torn or not p2p.torn:
            return False
        self._told_torn = self._spoiled = p2p
        log.info("peer %x: a cancellation left ring connections of round %d torn: the group re-wires before "
                 "its next collective", self._host.peer_id, p2p.round)
        return True

    async def _tell_torn(self, tag: int, epoch: int) -> None:
        """Tell the master this peer's ring is torn (a withdrawal with nothing to withdraw)."""
        try:
            await self._host.send_shielded(m.CollectiveWithdraw(tag, torn=True), epoch=epoch)
        except PCCLError:
            pass  # the master is gone: a new one starts a new round anyway

    # --- a cancelled call's tag -----------------------------------------------------------------

    def _abandon(self, op: OpAttempt, inbox: RouteInbox) -> bool:
        """Start the task that settles the tag of a call that was cancelled before the master's
        answer to its vote (``WITHDRAW``) or to its ``Done`` (``AWAIT_FINAL``); True if it runs
        (not when the communicator is shutting down: nobody will commence anything then)."""
        if not self._host.spawn(self._settle_abandoned, op, inbox):
            return False
        self._host.abandon_route(op.plan.tag)
        return True

    async def _settle_abandoned(self, op: OpAttempt, inbox: RouteInbox) -> None:
        """Settle a cancelled call's tag with the master, then free it.  Before the answer to
        the vote: withdraw it — ``Rejected(WITHDRAWN)`` (or another rejection that crossed the
        withdrawal) ends it, a ``Commence`` that crossed it is reported as this peer's abort.
        After this peer's ``Done``: wait for that op's ``Complete`` or ``Abort``."""
        tag = op.plan.tag
        try:
            if op.handoff is Effect.AWAIT_FINAL:
                async for msg in inbox:
                    if isinstance(msg, (m.CollectiveComplete, m.CollectiveAbort)) and msg.seq == op.seq:
                        self._step(op, Event.COMPLETE if isinstance(msg, m.CollectiveComplete) else Event.ABORT)
                        return
                    if op.fast and isinstance(msg, m.CollectiveRejected):
                        self._step(op, Event.REJECT)
                        return
                self._step(op, Event.MASTER_LOST)
                return
            try:
                await self._host.send_shielded(m.CollectiveWithdraw(tag, torn=self._tear_news()), epoch=op.epoch)
            except PCCLError:
                self._step(op, Event.FAIL)
                return  # the master is gone (the route closes) or the communicator failed
            if op.fast:
                await self._recall(op, inbox)
                return
            async for msg in inbox:
                if isinstance(msg, m.CollectiveRejected):
                    self._step(op, Event.REJECT)
                    return
                if isinstance(msg, m.CollectiveCommence) and not self._ended_here(msg):
                    log.info("peer %x: reporting the abort of cancelled collective tag %d seq %d",
                             self._host.peer_id, tag, msg.seq)
                    self._links.registry.retire(msg.seq)
                    op.seq = msg.seq
                    try:
                        await self._report(op, self._step(op, Event.COMMENCE))
                    except PCCLError:
                        pass  # the communicator failed; every caller sees that
                    return
            self._step(op, Event.MASTER_LOST)
        finally:
            self._commits.untrack(op)
            self._gate.release(tag)

    async def _recall(self, op: OpAttempt, inbox: RouteInbox) -> None:
        """A begun op's withdrawal is out: wait for the master's end of the op — its ``Abort``
        (``WITHDRAWN``: the others retry; any other: the withdrawal crossed the last Begin, or
        another participant's failure was held, and counts as this peer's abort), or the
        refusal of the Begin that crossed it."""
        for_it = (m.CollectiveAbort, m.CollectiveCommence)
        async for msg in inbox:
            if isinstance(msg, for_it) and msg.seq != op.seq:
                continue  # an earlier op's word on this tag
            if isinstance(msg, m.CollectiveCommence):
                self._step(op, Event.COMMENCE)  # armed as the withdrawal went out: its abort follows
            elif isinstance(msg, m.CollectiveAbort):
                if msg.code not in (m.RejectCode.WITHDRAWN, m.RejectCode.STALE_RING):
                    self._host.counters.collectives_aborted += 1
                    self._spoiled = self._host.links
                self._step(op, Event.ABORT)
                return
            elif isinstance(msg, m.CollectiveRejected) and msg.code != m.RejectCode.WITHDRAWN:
                self._step(op, Event.REJECT)
                return
        self._step(op, Event.MASTER_LOST)

    # --- a commenced op -----------------------------------------------------------------------

    async def _run(self, op: OpAttempt, commence: m.CollectiveCommence, route: CollectiveRoute) -> Result:
        host = self._host
        try:
            try:
                # Inside: a backup that cannot be made (MemoryError) ends the op like any failure,
                # with its Done(aborted), not with a ring the other peers wait on until their watchdogs.
                op.guard = op.plan.guard(STAGED_IN_PLACE_BYTES)
                await self._ring_and_settle(op, commence, route)
            except BaseException as exc:
                # Cancelled by the caller, or the communicator failed: the op is over for us.
                effects = self._step(op, Event.CANCEL if isinstance(exc, trio.Cancelled) else Event.FAIL)
                if Effect.WITHDRAW in effects:
                    raise  # a Begin not armed yet: withdrawn in the background (_settle_abandoned)
                self._spoiled = host.links  # the others abort: the master marks the ring stale
                try:
                    await self._report(op, effects)
                except PCCLError:
                    pass  # already failing; the caller sees the original exception
                host.counters.collectives_aborted += 1
                raise
            return self._outcome(op, commence)
        finally:
            if op.guard is not None:
                op.guard.drop()

    async def _ring_and_settle(self, op: OpAttempt, commence: m.CollectiveCommence, route: CollectiveRoute) -> None:
        """Run the ring, report Done, wait for the master's final word.

        The tag's messages are intercepted meanwhile (:meth:`_word`, run synchronously by the
        task reading the master connection): an ``Abort`` cancels the ring at once.  No task is
        spawned per op; the transfer watchdog is the communicator's shared one.
        """
        route.intercept = lambda msg: self._word(op, msg)
        try:
            # Messages that arrived between the Commence and now (an Abort already, say).
            while op.machine.state is State.RUNNING or op.machine.state is State.BEGUN:
                try:
                    msg: m.Message | None = route.inbox.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    msg = None
                self._word(op, msg)
            with op.ring_scope:
                try:
                    op.traffic = await self.run_ring(op.plan, commence, op.guard, op)
                except PCCLError as exc:
                    op.ring_error = exc
            # (A seq the master queried before this peer was ready is never ready here.)
            finished = op.traffic is not None and op.ring_error is None and not self._commits.frozen(op.seq)
            effects = self._step(op, Event.RING_DONE if finished else Event.RING_FAILED)
            await self._report(op, effects)
            if Effect.REPORT_DONE in effects and op.agreement is not None:
                await self._commits.settle(op)  # the acks (docs/protocol.rst: completion agreed among peers)
            elif Effect.REPORT_DONE in effects:
                await await_verdict(op, peer_timeout=self._host.config.peer_timeout,
                                    peer_id=self._host.peer_id)
            elif op.machine.state is State.FAILING:
                await op.settled.wait()  # a begun op's failure waits too: the master may name a mismatch
        finally:
            route.intercept = None

    def _outcome(self, op: OpAttempt, commence: m.CollectiveCommence) -> Result:
        """The op's result for the caller once the master has spoken (or this peer gave up)."""
        host, plan, guard = self._host, op.plan, op.guard
        if op.machine.state is State.COMPLETED:
            assert op.traffic is not None
            if guard is not None:
                guard.commit()
            tx, rx, output = op.traffic
            host.counters.collectives_completed += 1
            host.counters.tx_bytes += tx
            host.counters.rx_bytes += rx
            return plan.result(commence, tuple(commence.ring).index(host.peer_id), tx, rx, output)
        if guard is not None:
            guard.restore()
        final = op.final
        if isinstance(final, m.CollectiveAbort) and final.code == m.RejectCode.WITHDRAWN:
            # A participant withdrew its Begin: nothing failed, the call retries (not an abort).
            raise Withdrawn()
        self._spoiled = host.links  # an op failed on this ring: the next one votes
        if final is not None and not isinstance(final, m.CollectiveComplete) and final.code == m.RejectCode.STALE_RING:
            # The master refused the Begin, or ended the begun op before it ran everywhere, as
            # stale (a torn lane, say): as a vote refused STALE_RING, the call re-wires and
            # retries; nothing failed that the caller sees (not an abort).
            raise StaleRing()
        host.counters.collectives_aborted += 1
        if isinstance(final, m.CollectiveRejected):  # a Begin the master refused
            raise rejection(plan, final, host.peer_id)
        if isinstance(final, m.CollectiveAbort) and final.code:  # a begun op: why, as a rejection says
            raise rejection(plan, m.CollectiveRejected(final.tag, final.code, final.detail), host.peer_id)
        if op.machine.state is State.LOST:
            host.raise_if_failed(op.epoch)
            raise MasterUnreachable(f"lost the master during {plan.what}")
        local_error = op.ring_error or op.stall_error
        if isinstance(local_error, InvalidArgument):
            raise local_error  # this peer's data is unusable (NaN/Inf under quantization)
        if local_error is not None:
            why = f"{type(local_error).__name__}: {local_error}"
        elif isinstance(op.final, m.CollectiveAbort) and op.final.detail:
            why = f"the master aborted it: {op.final.detail}"
        else:
            why = "the master aborted it"
        log.info("peer %x: %s seq %d aborted: %s", host.peer_id, plan.what, op.seq, why)
        raise CollectiveAborted(f"{plan.what} (seq {op.seq}) aborted: {why}") from local_error

    async def run_ring(self, plan: Plan, commence: m.CollectiveCommence, guard: InputGuard | None,
                       op: OpAttempt) -> tuple[int, int, np.ndarray | None]:
        """One attempt's data path, once the master commenced it; returns the (sent, received)
        payload bytes and an all-gather's output.  The data path retires the seq when its ring
        ends (its frames still in flight are discarded); if the op cannot reach it, the seq is
        retired here.  Runs under the watchdog, which stops the ring (``op.ring_scope``) if its
        connections stall."""
        peer_id = self._host.peer_id
        p2p = self._host.links
        seq, ring = commence.seq, tuple(commence.ring)
        if peer_id not in ring or ring != p2p.ring:
            self._links.registry.retire(seq)
            raise ProtocolError(f"the master commenced seq {seq} on ring {[f'{p:x}' for p in ring]}, but this "
                                f"peer is wired for {[f'{p:x}' for p in p2p.ring]}")
        if op.machine.state is State.BEGUN:
            watch, op.unwatched = None, p2p  # armed by the master's Commence (every participant began)
        else:
            watch = self._watchdog.watch(p2p, lambda: self._stalled(op))
        try:
            try:
                links = op.links = await self._links.links(p2p)
            except BaseException:
                self._links.registry.retire(seq)
                raise
            return await plan.run(guard, commence, links=links, rank=ring.index(peer_id), runner=self._runner)
        finally:
            op.unwatched = None
            for w in (watch, op.watch):
                if w is not None:
                    self._watchdog.unwatch(p2p, w)
