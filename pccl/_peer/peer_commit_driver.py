"""Completion agreed among peers, as a peer runs it (``Config.peer_commit``).

The design is docs/protocol.rst, "Design: completion agreed among peers"; the participant's
machine is :class:`pccl.protocol.peer_commit.PeerCommit`, the acks' wire form and digest
:mod:`pccl.protocol.peer_ack`, the master's side :mod:`pccl.protocol.master.peer_resolve` (run
by :mod:`pccl.protocol.master.collectives` for ops begun with ``CollectiveBegin.peer_commit``).
The collective service (:mod:`pccl._peer.collective_service`) hands an op begun on the fast path
to :meth:`PeerCommits.settle` once its ring ended with the result and its ``Done(ok)`` went out
(so the master has it before anything this peer says of the op later), in place of the wait for
the master's verdict.

Acks ride the ring lanes and the partner links
=============================================

An ack is a data frame of the op's :func:`~pccl.protocol.peer_ack.ack_seq`: ``(seq, digest,
known)`` with the known set as a bitset over ring positions.  A participant sends its set,
once ready and whenever it grows, to every ack target it has a link to
(:func:`~pccl.protocol.peer_ack.ack_targets`: its ring neighbours both ways and the round's
partner links), skipping a target known to hold all of it (it was told, or its own ack named
it), and reads acks from all of them, one reader task per link; what came meanwhile is merged
before one relay.  With one ack link (two participants) the call's own task reads it, with no
reader task, channel or nursery per op (:meth:`PeerCommits._agree_one`: the same rules).  Each
pair uses one connection both ends pick alike
(:meth:`~pccl.collectives.links.RingLinks.ack_links`): the successor lane 0, a partner its
partner link, the predecessor (unless a partner) lane 0 back the other way; ``step`` counts
the acks on that connection.  So every id reaches everyone in
:func:`~pccl.protocol.peer_ack.ack_hops` hops after the last participant is ready: ``log2 N``
or less with the partner links a round wires from 8 peers up (4 at 32, 5 at 64), ``N // 2``
over the ring alone.  A frame that comes before its reader is kept by the inbox (its seq is a
derived one that never counts as begun, so it is read into memory, within the inbox's bound,
rather than parked in front of the link's later frames), and the seq retires when the op ends here, so later acks are
discarded.  On a lane whose frames worker threads send (real TCP), an ack goes through the
lane's thread channel, whose lock keeps frames whole.

The rules as run here
=====================

* Ready (the machine's ``RESULT_HELD``) only after ``Done(ok)`` went out, and never for a seq
  the master queried before (:meth:`PeerCommits.frozen`): such a participant answered that it
  will never be ready — or, queried once its ``Done(ok)`` was out but before :meth:`settle`
  fed ``RESULT_HELD``, that it is in doubt — and waits for the verdict.
* A full known set commits: the call returns its result without any master message (the
  master's own ``CollectiveComplete`` follows once every ``Done(ok)`` is in, and is ignored).
  The op completes once the ack readers stopped, with nothing left to yield on before the call
  returns (while the op runs, the master's word on it reaches it as it comes).
* Doubt: an ack with another digest, a known set that breaks the rules, a failed ack link, or
  no ack from any link for ``peer_timeout`` (a neighbour lost or stalled) asks the master
  (``CollectiveAsk`` with the known set) and waits for its verdict; so does a participant the
  master queries (``CollectiveAnswer``).  A participant in doubt relays nothing more: those
  that would hear only through it fall in doubt too, and the master decides for all.
* A failure before ready is reported to the master (``Done(aborted)``), whose ``Abort`` ends the
  op on the others: no peer nack (a fault costs one master round trip).
* A ready participant never aborts on its own: the master's ``Abort`` ends it, as does a
  master lost for good once it is in doubt (``MasterUnreachable``, input restored).  While the
  session gets a lost master back, it keeps the op (:meth:`PeerCommits.undecided` reports it
  as the peer registers again, :meth:`PeerCommits.rejoined` asks about one that fell in doubt
  after its report) and the new master's verdict ends it (docs/protocol.rst, "A master restart
  while peers are in doubt").  Cancelled while ready, the call still waits,
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
import math
from collections.abc import Callable

import trio

from .._groups import single_exception
from .agreement import Agreement
from .host import PeerHost
from .op_attempt import OpAttempt
from ..collectives.links import Inbox, RingLinks
from ..errors import PCCLError, ProtocolError
from ..net.framed import FramedConnection
from ..net.thread_io import ThreadCancel
from ..protocol import messages as m
from ..protocol.codec import DataHeader
from ..protocol.op_lifecycle import Event, State
from ..protocol.peer_ack import Ack, Acceptance, accept, ack_size, decode_ack, encode_ack
from ..protocol.peer_commit import Effect as X
from ..protocol.peer_commit import Event as E
from ..protocol.peer_commit import Phase

__all__ = ["Agreement", "PeerCommits"]

log = logging.getLogger("pccl._peer.collective_service")

#: The acks the readers of an op's ack links read: ``(source position, ack)``; ``None``: that
#: link failed, or sent a malformed ack.
_Acks = tuple[trio.MemorySendChannel[tuple[int, "Ack | None"]], trio.MemoryReceiveChannel[tuple[int, "Ack | None"]]]
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
        #: Outcomes by (the op's master instance, seq): a restarted master asks about its
        #: predecessor's ops, whose seqs this peer's later ops may reuse (round ids restart).
        self._decided: collections.OrderedDict[tuple[int, int], tuple[m.CommitPhase, tuple[int, ...]]] = \
            collections.OrderedDict()
        self._frozen: collections.OrderedDict[int, None] = collections.OrderedDict()
        host.on_query = self.on_query
        host.on_register = self.undecided
        host.on_rejoined = self.rejoined

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
        key = (op.instance, op.seq)
        if ag is not None and ag.machine.decided:
            self._remember(key, _WIRE[ag.machine.phase], ag.ids(ag.machine.known))
        elif op.machine.state is State.COMPLETED:
            self._remember(key, m.CommitPhase.COMMITTED, ())
        elif op.machine.state not in _REPORTED:
            self._remember(key, m.CommitPhase.ABORTED, ())

    def frozen(self, seq: int) -> bool:
        """Whether the master queried ``seq`` here before :meth:`settle` made it ready: never
        ready now (it answered aborted), or in doubt if its ``Done(ok)`` was out (it answered in
        doubt); either way only the master's verdict ends it."""
        return seq in self._frozen

    def _remember(self, key: tuple[int, int], phase: m.CommitPhase, known: tuple[int, ...]) -> None:
        self._decided[key] = (phase, known)
        while len(self._decided) > _MEMORY:
            self._decided.popitem(last=False)

    def _freeze(self, seq: int) -> None:
        self._frozen[seq] = None
        while len(self._frozen) > _MEMORY:
            self._frozen.popitem(last=False)

    # --- the master's query -------------------------------------------------------------------

    def on_query(self, msg: m.CollectiveQuery, epoch: int) -> None:
        """Answer the master's query on op ``msg.seq`` (synchronous: the master's reader); one
        naming an earlier master (``msg.instance``: a restarted master resolves its op) is
        answered on that master's op."""
        instance = msg.instance or self._host.master_instance
        op = self._ops.get(msg.seq)
        if op is not None and op.instance != instance:
            op = None  # another master's op of the same seq (round ids restart with a master)
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
            if ag is not None:  # ready and in doubt, its known set its own id (nothing sent)
                ag.machine.handle(E.RESULT_HELD)
                ag.doubt(E.QUERY, self._host.counters)
            answer = (m.CommitPhase.IN_DOUBT, (self._host.peer_id,))
        elif op is not None and op.machine.state in (State.COMPLETED, State.ABORTED):
            answer = ((m.CommitPhase.COMMITTED if op.machine.state is State.COMPLETED else m.CommitPhase.ABORTED), ())
        elif (instance, msg.seq) in self._decided:
            answer = self._decided[(instance, msg.seq)]
        elif msg.instance and msg.instance != self._host.master_instance:
            # An earlier master's op this peer has no outcome of: it never became ready for it
            # here (a ready one is tracked until it decides), and never will (that master's
            # rounds are over).
            answer = (m.CommitPhase.ABORTED, ())
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
        self._host.spawn(self._send, m.CollectiveAnswer(msg.tag, msg.seq, answer[0], answer[1], msg.instance), epoch)

    # --- a lost master (docs/protocol.rst, "A master restart while peers are in doubt") -----------

    def _waiting(self) -> list[tuple[OpAttempt, Agreement]]:
        """The ops this peer is ready for (or in doubt about) with no outcome yet, also one whose
        ``Done(ok)`` is out but that :meth:`settle` has not made ready yet."""
        return [(op, ag) for op in self._ops.values() if (ag := op.agreement) is not None and not op.settled.is_set()
                and (ag.machine.phase in (Phase.READY, Phase.IN_DOUBT)
                     or (ag.machine.phase is Phase.RUNNING and op.machine.state is State.REPORTED))]

    def undecided(self) -> tuple[m.UndecidedOp, ...]:
        """What this peer reports as it registers again (``Register.undecided``): every op it is
        ready for and has no outcome of, with its phase (in doubt: the report is its ask; one
        whose ``Done(ok)`` is out is ready, its known set its own id)."""
        reports = []
        for op, ag in self._waiting():
            phase = Phase.READY if ag.machine.phase is Phase.RUNNING else ag.machine.phase
            known = ag.machine.known or frozenset({ag.position})
            ag.reported = phase
            reports.append(m.UndecidedOp(op.instance, op.plan.tag, op.seq, ag.ring, _WIRE[phase], ag.ids(known)))
        return tuple(reports)

    def rejoined(self) -> None:
        """Registered again.  With a restarted master, an op that fell in doubt after its report
        went out asks it now (the others were reported in doubt: that was their ask).  With the
        same master (only this peer's connection broke), the master declared this peer dead in
        its ops: they end here as a lost master's (``MasterUnreachable``, input restored)."""
        for op, ag in self._waiting():
            if not ag.master_lost:
                continue
            if op.instance == self._host.master_instance:
                if ag.machine.phase is Phase.IN_DOUBT:
                    self._step(op, Event.MASTER_LOST)  # (a ready one's acks go on, as before)
                continue
            ag.master_lost = False
            if ag.machine.phase is Phase.IN_DOUBT and ag.reported is not Phase.IN_DOUBT:
                self._host.spawn(self._ask, op, ag)

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
        sources = links.ack_links(ag.position, len(ag.ring))
        # One ack link (two participants): the call's task reads it itself (_agree_one).
        acks: _Acks | None = (trio.open_memory_channel[tuple[int, Ack | None]](math.inf)
                              if len(sources) != 1 else None)
        try:
            if self.frozen(op.seq) or op.settled.is_set():
                await op.settled.wait()  # queried before it was ready here: the verdict decides
                return
            try:
                await self._exchange(op, ag, links, sources, acks)
            except trio.Cancelled:
                with trio.move_on_after(timeout) as waited:
                    waited.shield = True
                    await self._exchange(op, ag, links, sources, acks, cancelled=True)
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
            if acks is not None:
                acks[0].close()
            links.retire(ag.seq)

    async def _exchange(self, op: OpAttempt, ag: Agreement, links: RingLinks,
                        sources: dict[int, tuple[FramedConnection, Inbox]], acks: _Acks | None, *,
                        cancelled: bool = False) -> None:
        """Acks until a full set, the master's word or a doubt; then, in doubt, the verdict.
        ``sources``: the op's ack links (:meth:`~pccl.collectives.links.RingLinks.ack_links`);
        ``acks``: the channel into which the readers of every ack link (one task each, here) put
        what they read; it outlives a cancelled call of this (the shielded retry reads on, and
        does not wait for a lost master to come back: ``cancelled``).  ``None`` for an op with
        one ack link, which this task reads itself (:meth:`_agree_one`)."""
        if ag.machine.phase is Phase.RUNNING:
            await self._effects(op, ag, links, ag.machine.handle(E.RESULT_HELD))
        if ag.machine.phase is Phase.READY and not op.settled.is_set() and acks is None:
            ((source, (_, inbox)),) = sources.items()
            await self._agree_one(op, ag, links, source, inbox)
        elif ag.machine.phase is Phase.READY and not op.settled.is_set():
            assert acks is not None
            try:
                async with trio.open_nursery() as nursery:
                    for source, (_, inbox) in sources.items():
                        nursery.start_soon(self._read_acks, op, ag, source, inbox, acks[0].clone())
                    try:
                        await self._agree(op, ag, links, acks[1])
                    finally:
                        nursery.cancel_scope.cancel()  # loses nothing (another op's frame: frame_finish)
            except BaseExceptionGroup as group:
                raise single_exception(group) from None  # a Cancelled stays one (settle catches it)
        if ag.machine.phase is Phase.COMMITTED:
            if ag.result_due:  # no checkpoint from here to the call's return: the op's last word
                ag.result_due = False
                self._host.counters.peer_commits += 1
                self._step(op, Event.COMPLETE, m.CollectiveComplete(op.plan.tag, op.seq))
            return
        if ag.master_lost and not op.settled.is_set() and (cancelled or not self._host.reconnecting):
            self._step(op, Event.MASTER_LOST)  # in doubt, and no master to ask
        # (Reconnecting: the next master hears of it at registration, :meth:`undecided`.)
        if not op.settled.is_set():  # (the master's word that ended the acks settled it: no pass)
            await op.settled.wait()
        if ag.machine.phase is Phase.READY or ag.machine.phase is Phase.IN_DOUBT:
            ag.machine.handle(E.COMMIT if op.machine.state is State.COMPLETED else E.ABORT)

    async def _agree(self, op: OpAttempt, ag: Agreement, links: RingLinks,
                     acks: trio.MemoryReceiveChannel[tuple[int, Ack | None]]) -> None:
        timeout = self._host.config.peer_timeout
        while ag.machine.phase is Phase.READY and not op.settled.is_set():
            # One scope per wait: its deadline is the silence bound, ``stop`` cancels it too.
            scope = ag.scope = trio.CancelScope(deadline=trio.current_time() + timeout)
            got: tuple[int, Ack | None] | None = None
            with scope:
                got = await acks.receive()
            ag.scope = None
            silent = scope.cancelled_caught and not ag.stopped  # the master's word is no silence
            source, ack = got if got is not None else (-1, None)
            if ack is not None:
                effects = self._merge(op, ag, source, ack)
                while ag.machine.phase is Phase.READY:  # what else came: one relay for all of it
                    try:
                        source, ack = acks.receive_nowait()
                    except trio.WouldBlock:
                        break
                    effects += self._merge(op, ag, source, ack) if ack is not None else ag.doubt(
                        E.PEER_LOST, self._host.counters)
                await self._relay(op, ag, links, effects)
            elif (got is not None or silent) and not op.settled.is_set():
                await self._silence(op, ag, links, read=got is not None)

    async def _agree_one(self, op: OpAttempt, ag: Agreement, links: RingLinks, source: int, inbox: Inbox) -> None:
        """:meth:`_agree` for an op with one ack link (two participants), which this task reads
        itself: no reader task, no channel and no nursery per op (their run-loop passes were
        more than a third of a small all-reduce's at two peers).  The same rules: each wait for
        an ack is ``ag.scope``, bounded by ``peer_timeout`` (silence: in doubt) and cancelled by
        the master's word (:meth:`Agreement.stop`), cut where :meth:`_exchange` cancels its
        readers; a failed link or a malformed ack puts it in doubt; once a query put it in doubt
        nothing read counts.  An ack read is merged before anything yields."""
        timeout = self._host.config.peer_timeout
        while ag.machine.phase is Phase.READY and not op.settled.is_set():
            scope = ag.scope = trio.CancelScope(deadline=trio.current_time() + timeout)
            read = False
            ack: Ack | None = None
            with scope:
                # No schedule point after an ack read ahead whole: its merge (a commit, say)
                # follows at once, and the call's next yield comes soon.
                ack = await self._read_ack(op, ag, source, inbox, schedule_point=False)
                read = True
            ag.scope = None
            silent = scope.cancelled_caught and not ag.stopped  # the master's word is no silence
            if ag.machine.phase is not Phase.READY:
                continue  # a query (ag.stop) put it in doubt meanwhile: as in _agree, nothing read counts
            if ack is not None:
                await self._relay(op, ag, links, self._merge(op, ag, source, ack))
            elif (read or silent) and not op.settled.is_set():
                await self._silence(op, ag, links, read=read)

    async def _relay(self, op: OpAttempt, ag: Agreement, links: RingLinks, effects: tuple[X, ...]) -> None:
        """Run what merging acks asked for: one relay of the known set for all of them, first."""
        relay = X.SEND_KNOWN in effects and ag.machine.phase in (Phase.READY, Phase.COMMITTED)
        await self._effects(op, ag, links, ((X.SEND_KNOWN,) if relay else ())
                            + tuple(x for x in effects if x is not X.SEND_KNOWN))

    async def _silence(self, op: OpAttempt, ag: Agreement, links: RingLinks, *, read: bool) -> None:
        """No ack for ``peer_timeout`` (``read`` false) or a failed ack link: in doubt."""
        if not read:
            log.info("peer %x: no ack of %s seq %d for %g s: asking the master", self._host.peer_id,
                     op.plan.what, op.seq, self._host.config.peer_timeout)
        await self._effects(op, ag, links, ag.doubt(E.PEER_LOST, self._host.counters))

    def _merge(self, op: OpAttempt, ag: Agreement, source: int, ack: Ack) -> tuple[X, ...]:
        acceptance = accept(ack, op.seq, ag.digest)
        if acceptance == Acceptance.MERGE:
            try:
                effects = ag.machine.receive_known(ack.known)
                ag.tell(source, ack.known)  # it knows what it acked: never sent back to it
                return effects
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
                ag.result_due = True  # once the ack readers stopped (_exchange)
            elif effect is X.ASK_MASTER:
                await self._ask(op, ag)
            # RETIRE: nothing (the master completes the op on the last Done(ok) anyway).

    async def _ask(self, op: OpAttempt, ag: Agreement) -> None:
        if ag.machine.phase is Phase.READY:
            ag.doubt(E.PEER_LOST, self._host.counters)
        if ag.master_lost:
            return  # reported (in doubt) to the next master as this peer registers
        # The op of a master before a restart: asked of the one now, naming its master.
        earlier = op.instance != self._host.master_instance
        ask = m.CollectiveAsk(op.plan.tag, op.seq, _WIRE[ag.machine.phase], ag.ids(ag.machine.known),
                              op.instance if earlier else 0)
        try:
            await self._host.send_shielded(ask, epoch=self._host.master_epoch if earlier else op.epoch)
        except PCCLError:
            ag.master_lost = True

    async def send_ack(self, op: OpAttempt, ag: Agreement, links: RingLinks) -> None:
        """Send ``ag``'s known set to every ack target that may not know all of it yet
        (:meth:`~pccl.collectives.links.RingLinks.ack_links`).  (Public for :func:`pccl.testing.hooks.after_acks`, which plants a
        fault right after it.)"""
        n = len(ag.ring)
        with trio.CancelScope(shield=True):  # a frame cut midway would break the link
            for target, (connection, _) in links.ack_links(ag.position, len(ag.ring)).items():
                if not ag.news(target):
                    continue
                known = ag.machine.known
                payload = encode_ack(Ack(op.seq, ag.digest, known), n)
                step = ag.sent.get(target, 0)
                ag.sent[target] = step + 1
                ag.tell(target, known)
                try:
                    await _send(links, connection, DataHeader(ag.seq, 0, step, 0, len(payload)), payload)
                except PCCLError as exc:
                    log.info("peer %x: could not send an ack of %s seq %d to ring position %d: %s",
                             self._host.peer_id, op.plan.what, op.seq, target, exc)

    async def _read_acks(self, op: OpAttempt, ag: Agreement, source: int, inbox: Inbox,
                         out: trio.MemorySendChannel[tuple[int, Ack | None]]) -> None:
        """Read ``source``'s acks from ``inbox`` into ``out`` until cancelled; ``(source, None)``
        and stop when the link fails or delivers a malformed ack."""
        with out:
            while True:
                ack = await self._read_ack(op, ag, source, inbox)
                out.send_nowait((source, ack))
                if ack is None:
                    return

    async def _read_ack(self, op: OpAttempt, ag: Agreement, source: int, inbox: Inbox, *,
                        schedule_point: bool = True) -> Ack | None:
        """``source``'s next ack from ``inbox``; ``None`` (logged) when the link fails or
        delivers a malformed ack.  ``schedule_point``: as for :meth:`Inbox.receive_into`."""
        n = len(ag.ring)
        buffer = bytearray(ack_size(n))
        try:
            await inbox.receive_into(seq=ag.seq, stream=0, step=ag.received.get(source, 0),
                                     offset=0, destination=memoryview(buffer), schedule_point=schedule_point)
        except PCCLError as exc:
            log.info("peer %x: the ack link of %s seq %d from ring position %d failed: %s",
                     self._host.peer_id, op.plan.what, op.seq, source, exc)
            return None
        ag.received[source] = ag.received.get(source, 0) + 1
        try:
            return decode_ack(bytes(buffer), n)
        except ProtocolError as exc:
            log.warning("peer %x: %s seq %d: %s", self._host.peer_id, op.plan.what, op.seq, exc)
            return None



async def _send(links: RingLinks, connection: FramedConnection, header: DataHeader, payload: bytes) -> None:
    """One ack frame out on ``connection``: through lane 0's thread channel when worker threads
    send on that lane (a connection's async sends and its thread sends do not share a lock), else
    with the async send."""
    channels = links.send_channels
    if channels is None or connection is not links.to_next[0]:
        await connection.send_data(header, payload)
        return
    cancel = ThreadCancel()
    try:
        job = channels[0].send_data_soon(header, memoryview(payload), cancel)
        if job is not None:
            await trio.to_thread.run_sync(job)
    finally:
        cancel.close()
