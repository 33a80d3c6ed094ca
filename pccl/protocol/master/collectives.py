"""The master's collective-ops sub-machine: votes, commence, completion, abort (sans-IO).

Rules
=====

Collectives (per group, per tag).  Every accepted peer of the group sends ``CollectiveInit``;
at consensus: the voters disagree on the op's kind or on what its row says must agree →
``PARAMETER_MISMATCH``; fewer voters than the row's minimum → ``TOO_FEW_PEERS``; stale ring →
``STALE_RING`` (each a ``CollectiveRejected`` to every voter) — also before consensus, to the
voters so far, once a member that has not voted has a topology vote standing in a stale group,
or had its Begin of the tag refused ``STALE_RING`` in this round (it votes again only on the
re-wired ring, and the voters' held tags would keep them from that round: the cross-tag wait of
concurrent calls after a failure; a phase mismatch ended it for the voters alone); otherwise
``CollectiveCommence(tag, seq, ring)`` with a new global ``seq`` and the participants in the
row's order.  A peer that reuses
a tag it already voted (or that is running) gets ``TAG_IN_USE`` alone.  Each participant then
sends ``CollectiveDone(tag, seq, aborted)``.  Exactly one final message per (op, live
participant): ``CollectiveAbort`` (its ``detail`` says why) as soon as one reports ``aborted`` or a participant that has
not reported leaves; ``CollectiveComplete`` once every live participant reported success (a
peer that dies after reporting success still counts: its bytes have moved).  Late ``Done`` for
a finished ``seq`` is ignored; ``Done`` for a ``seq`` never commenced is a PROTOCOL_ERROR, a
second ``Done`` OUT_OF_PHASE.  An abort makes the group's ring stale (the next topology vote
re-wires it).  An op that ends with a live participant to tell is reported once (the fact
``OpEnded``, right before its final messages).

Withdrawal.  ``CollectiveWithdraw(tag)`` (the caller gave up before the answer) removes the
peer's Init of an op that has not commenced and answers ``CollectiveRejected(WITHDRAWN)``; for
a commenced op, or one already answered, it is ignored (that answer is on its way).  A phase
mismatch withdraws a peer's Inits the same way, answering ``PHASE_MISMATCH`` — also when every
member waits only in Inits and no tag has every member's vote (different tags, :mod:`.mismatch`).
A beginner's withdrawal (its caller was cancelled before the arming Commence reached it) ends a
begun op: as that peer's abort once every participant began, with a held failure if there is
one, otherwise ``CollectiveAbort(code=WITHDRAWN)`` to everyone who began it (and, remembered,
to the others' Begin or vote of it), the ring left fresh: everyone retries the tag's next use.
A withdrawal with ``torn`` (the peer's ring connections were cut mid-frame; also sent with
nothing to withdraw) makes the group stale and ends each begun op of the group not armed yet
with ``STALE_RING`` (docs/protocol.rst, "A withdrawal that tears a lane").

Begins.  A peer may begin an op without a vote (docs/protocol.rst, "Design: one master round
trip per collective"): ``CollectiveBegin(tag, seq, round, <the Init's fields>)`` with a derived
``seq`` (:func:`~pccl.protocol.messages.derived_seq`, top bit set; an all-gather, which needs
every count first, or another seq is a PROTOCOL_ERROR).  On a stale group, or for another round
than the group's ring's, it is answered ``CollectiveRejected(STALE_RING)``; otherwise the first
Begin opens the op on the group's ring, and each Begin — and each member's ``CollectiveInit``
for the tag, held or arriving later, which is answered ``CollectiveCommence`` with the derived
seq — is checked against the others (kind, agreed fields, a broadcast's root in the ring):
a disagreement aborts it (``CollectiveAbort.code`` PARAMETER_MISMATCH or ROOT_ABSENT) on
everyone who began it.  Once every participant is in, the beginners get a one-way
``CollectiveCommence`` (it arms their watchdogs; nobody waits for it).  Done, Complete and
Abort are as above, except that an abort reaches those who began the op at once and the
other participants when their Begin of it arrives (the same ``CollectiveAbort``, remembered
for the group's round: refused as stale, a late beginner would re-wire and vote again alone
while the others returned ``CollectiveAborted``); a Begin of the open op itself joins it even on a stale group: a
participant that left after its Done made it stale, and the op still completes), a Begin of
another use of a tag whose op is open aborts that op with STALE_RING and is refused as stale
(the peers' counts differ: a new round restarts them),
a failure reported before every participant began aborts the op only once the last one has
(its Begin may show a disagreement: that is what everyone hears then, since a ring run on
disagreeing parameters fails for that reason), a second Begin is OUT_OF_PHASE, and a begun op that waits for members who wait elsewhere is a wait in a collective
for the phase-mismatch machine, aborted with PHASE_MISMATCH at the end of the grace.

Peer-agreed completion (docs/protocol.rst, "Design: completion agreed among peers").  An op
begun with ``CollectiveBegin.peer_commit`` may commit among its participants without the
verdict, so three rules above change for it.  A death before ``Done`` (or a held failure's) does
not abort it: the op's :class:`~.peer_resolve.Resolution` (made on first need from the
``Done(ok)`` reports) queries every live participant (``CollectiveQuery``), takes their
``CollectiveAnswer`` and any participant's ``CollectiveAsk``, and its verdict is the usual
``CollectiveComplete`` / ``CollectiveAbort``; an ask or answer for an op that ended hears its
verdict again.  A held failure is a nack: a death then aborts at once.  A Begin of the tag's
next use from a participant whose ``Done(ok)`` is in (it committed and went on) leaves the open
op open, apart, for the others' reports instead of aborting it ``STALE_RING``; so does its vote
of that use, instead of being refused ``TAG_IN_USE``.  And a
participant whose ``Done(ok)`` is in is out of the op for the phase rules (it may vote
``update_topology()`` or sync), though it still waits in an op that is not armed for the
phase-mismatch machine (someone has not begun: nobody can have committed).

Kinds.  What an op computes is its kind; everything the handlers here do differently per kind is
one row of :data:`~pccl.protocol.master.kinds.KINDS` (:mod:`pccl.protocol.master.kinds`).

The machine sees the master only through :class:`OpsHost` (peers named by peer id); the
master's dispatch has checked the phase rules before a handler here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...errors import KickReason, ProtocolError
from .. import messages as m
from ..messages import CollectiveKind
from .events import OpEnded, PeerFault
from .kinds import KINDS, agreed_alike, kind_of
from .op_records import Aborted, Op, OpInfo, OpsHost, call_name, in_op, ops_waited_in, resolving
from .peer_resolve import PHASES, Resolution, Send, Word, why_aborted
from ..peer_commit import Answer, PeerCommitError, Verdict

__all__ = ["CollectiveOps", "OpsHost", "OpInfo"]

log = logging.getLogger("pccl.protocol.master.machine")


# --- the machine -------------------------------------------------------------------------------


class CollectiveOps:
    """Every group's collective ops (see the module docstring)."""

    def __init__(self, host: OpsHost) -> None:
        self._host = host
        self._ops: dict[tuple[int, int], Op] = {}  # (group, tag)
        self._next_seq = 1
        #: The begun ops aborted in their group's current round, by (group, tag): a participant
        #: whose Begin arrives after the abort hears the same abort (see ``on_begin``).
        self._aborted: dict[tuple[int, int], Aborted] = {}
        #: Peers removed so far (``forget``): a peer stops being live only there.
        self.departures = 0
        #: Ops aborted so far (an abort makes its group stale: the master re-checks every vote).
        self.aborts = 0
        #: Peer-agreed ops still open after a participant that reported ``Done(ok)`` began the
        #: tag's next use (it committed; see "Peer-agreed completion"), by (group, tag), then seq.
        self._lingering: dict[tuple[int, int], dict[int, Op]] = {}
        #: The seq of each (group, tag)'s last peer-agreed op that completed: a late ask hears it.
        self._committed: dict[tuple[int, int], int] = {}
        #: group -> a round and the (tag, member) whose Begin was refused STALE_RING in it: that
        #: member re-wires before it votes the tag again (``_check_vote``).
        self._refused: dict[int, tuple[int | None, set[tuple[int, int]]]] = {}

    # --- messages -----------------------------------------------------------------------------

    def on_init(self, group: int, peer_id: int, msg: m.CollectiveInit) -> None:
        self._refused.get(group, (None, set()))[1].discard((msg.tag, peer_id))  # it votes the tag again
        op = self._ops.get((group, msg.tag))
        aborted = self._aborted.get((group, msg.tag))
        if ((op is None or (aborted is not None and aborted.code == m.RejectCode.WITHDRAWN))
                and aborted is not None and peer_id in aborted.untold
                and aborted.round == self._host.round_of(group)):
            # The vote of a participant that had another op in flight, for the use of the tag
            # its peers began and aborted before it voted: it ends as theirs did (refused as
            # stale, it re-wired and retried alone while they raised CollectiveAborted: a phase
            # mismatch, sim seed 37 with calls started together voting).  A withdrawn op leaves
            # the ring fresh: its beginners' retries may have opened the tag's next use already,
            # which this vote is not (it hears the withdrawal, counts the use and retries).
            aborted.untold.discard(peer_id)
            if aborted.code == m.RejectCode.STALE_RING:  # theirs is a retry: so is this one
                self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.STALE_RING, aborted.why))
            else:
                self._host.send(peer_id, m.CollectiveCommence(msg.tag, aborted.seq, aborted.participants))
                self._host.send(peer_id, m.CollectiveAbort(msg.tag, aborted.seq, aborted.why, code=aborted.code))
            return
        if op is not None and op.fast and peer_id in op.participants and peer_id not in op.began:
            self._join(op, peer_id, msg, begun=False)  # the others began this use of the tag
            return
        if op is not None and op.seq is not None and op.peer_commit and peer_id in op.done:
            # It committed the open op among its peers and votes the tag's next use before the
            # others' Done reached the master: the open op stays open for them, apart (as for a
            # Begin; refused TAG_IN_USE, the caller got InvalidUsage).
            self._linger(op)
            op = None
        if op is not None and (op.seq is not None or peer_id in op.inits):
            self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.TAG_IN_USE,
                                                          f"tag {msg.tag} is already in flight for this peer"))
            return
        if op is None:
            op = self._ops[(group, msg.tag)] = Op(group, msg.tag, KINDS[kind_of(msg)])
        elif kind_of(msg) is not op.row.kind:
            op.other_kind = True
        op.inits[peer_id] = msg

    def on_begin(self, group: int, peer_id: int, msg: m.CollectiveBegin) -> None:
        """A peer began an op on the fast path (see "Begins")."""
        init = msg.as_init()
        row = KINDS[kind_of(init)]
        if row.sends_counts:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {msg.tag}: {row.call} cannot begin without a vote")
        if not msg.seq >> 63:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {msg.tag} begun with seq {msg.seq}, not a derived one")
        key = (group, msg.tag)
        op = self._ops.get(key)
        ring = self._host.ring(group)
        held = self._lingering[key].get(msg.seq) if key in self._lingering else None
        if held is not None and msg.round == held.round and peer_id in held.participants:
            if peer_id in held.began:
                raise PeerFault(KickReason.OUT_OF_PHASE, f"collective tag {msg.tag} begun twice")
            self._join(held, peer_id, init, begun=True)  # a late Begin of an op others went past
            return
        if (op is not None and op.seq is not None and op.seq != msg.seq and op.peer_commit and msg.peer_commit
                and peer_id in op.done):
            # It committed the open op among its peers and began the tag's next use before the
            # others' Done reached the master: the open op stays open for them, apart.
            self._linger(op)
            op = None
        if op is not None and peer_id in op.began:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"collective tag {msg.tag} begun twice")
        aborted = self._aborted.get(key)
        if (aborted is not None and aborted.seq == msg.seq and aborted.round == msg.round
                and peer_id in aborted.untold and (op is None or aborted.code == m.RejectCode.WITHDRAWN)):
            # The op this Begin names was aborted before this participant began it (a
            # participant died as the others began): the others heard the abort and return
            # CollectiveAborted, so this peer must too.  Refused as STALE_RING it would re-wire
            # and vote again, alone: its loop would wait in this tag while theirs went on (a
            # phase mismatch; sim seed 37, fast commit, 8 peers in two sites).  Or it was
            # withdrawn: the others may have begun the tag's next use already; this peer too
            # retries it.
            aborted.untold.discard(peer_id)
            self._host.send(peer_id, m.CollectiveAbort(msg.tag, msg.seq, aborted.why, code=aborted.code))
            return
        if op is not None and op.seq is not None and op.seq != msg.seq:
            # The peers count this tag's uses differently (a peer that lost its master may
            # have counted on): no use of it can run together on this ring.  Re-wire: a new
            # round starts every count afresh.
            self._abort(op, f"peers began different uses of tag {msg.tag}; re-wire before retrying",
                        code=m.RejectCode.STALE_RING)
        # A Begin of the open begun op joins it whatever happened to the group since it opened:
        # the op's own checks decide its fate (a participant that left after its Done still
        # counts).  Refusing it would leave the op to complete on the others' Dones unarmed
        # while this peer, told STALE_RING, aborts: a split verdict (sim seed 377).
        joining = (op is not None and op.fast and op.seq == msg.seq and op.round == msg.round
                   and peer_id in op.participants)
        if not joining and (self._host.is_stale(group) or ring is None or msg.round != self._host.round_of(group)):
            # Its ring is not the group's (any more): the op cannot run.  (A Begin of another
            # use of the tag after an abort lands here too: an abort makes the group stale.)
            refused = self._refused.get(group)
            if refused is None or refused[0] != self._host.round_of(group):
                refused = self._refused[group] = (self._host.round_of(group), set())
            refused[1].add((msg.tag, peer_id))
            self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.STALE_RING,
                                                          f"group {group} lost a member or an op since round "
                                                          f"{msg.round}; re-wire before retrying"))
            return
        if op is None:
            op = self._ops[key] = Op(group, msg.tag, row)
        op.peer_commit = op.peer_commit or msg.peer_commit
        if not joining:
            assert ring is not None
            op.seq, op.fast, op.round = msg.seq, True, msg.round
            op.participants = op.row.order(ring, op.inits)
        self._join(op, peer_id, init, begun=True)
        if joining:
            # Nothing is held: once the op is open, a participant's vote joins it on arrival
            # (``on_init``).  So only the opening Begin looks (once per op, not per Begin).
            return
        for pid, vote in list(op.inits.items()):  # votes held for this use of the tag join it
            if pid in op.began or op.seq is None:
                continue
            if self._ops.get(key) is op:
                self._join(op, pid, vote, begun=False)
            else:
                # A vote joined before it (or this Begin) aborted the op: the votes still held
                # hear the abort's reason as a rejection (they know no seq), as at consensus.
                ended = self._aborted.get(key)
                code, why = (ended.code, ended.why) if ended is not None else (m.RejectCode.STALE_RING, "aborted")
                self._rejected_after_abort(op, pid)
                self._host.send(pid, m.CollectiveRejected(op.tag, code, why))

    def _join(self, op: Op, peer_id: int, init: m.CollectiveInit, *, begun: bool) -> None:
        """``peer_id`` began ``op`` (or voted it, ``begun=False``: it is told the seq now);
        disagreeing votes abort it; once everyone is in, the beginners' watchdogs are armed."""
        assert op.seq is not None
        op.inits[peer_id] = init
        op.began.add(peer_id)
        if begun:
            op.beginners.add(peer_id)
        if peer_id not in op.participants:
            self._abort(op, f"peer {peer_id:x} is not in the ring of group {op.group}", code=m.RejectCode.STALE_RING)
            return
        # A vote that agrees with one every other vote agreed with changes no verdict (the
        # kinds, the agreed fields and so a broadcast's root are as they were): compared with
        # that one alone, each Begin costs O(1), not O(participants).
        if op.agreed is None or kind_of(init) is not kind_of(op.agreed) or op.row.key(init) != op.row.key(op.agreed):
            refusal = self._fast_refusal(op)
            if refusal is not None:
                if refusal[0] is m.RejectCode.PARAMETER_MISMATCH:
                    log.warning("refusing collective: %s", refusal[1])  # as at consensus
                if not begun:
                    # A voter not told the seq yet waits for an answer to its vote, not for a
                    # verdict: it hears the abort's reason as a rejection, as at consensus.
                    op.began.discard(peer_id)
                self._abort(op, refusal[1], code=refusal[0])
                if not begun:
                    self._rejected_after_abort(op, peer_id)
                    self._host.send(peer_id, m.CollectiveRejected(op.tag, refusal[0], refusal[1]))
                return
            op.agreed = init
        commence = None if begun else m.CollectiveCommence(op.tag, op.seq, op.participants)
        if commence is not None:
            self._host.send(peer_id, commence)
        # (the count first: the last joiner alone compares the sets, not every one)
        if not op.armed and len(op.began) >= len(op.participants) and op.began.issuperset(op.participants):
            if op.failure is not None:
                self._abort(op, op.failure)
                return
            op.armed = True
            commence = commence or m.CollectiveCommence(op.tag, op.seq, op.participants)
            for pid in op.participants:
                # (the voters' Commence was their start; one that left after its Done hears nothing)
                if pid in op.beginners and self._host.is_live(pid):
                    self._host.send(pid, commence)

    def _rejected_after_abort(self, op: Op, peer_id: int) -> None:
        """A voter of ``op`` is told the abort as a rejection of its vote: the abort is not kept
        for it (its next call on the tag is a new use: a vote or a Begin that finds the group
        stale, not the old op's Commence and Abort)."""
        aborted = self._aborted.get((op.group, op.tag))
        if aborted is not None and aborted.seq == op.seq:
            aborted.untold.discard(peer_id)

    def _fast_refusal(self, op: Op) -> tuple[m.RejectCode, str] | None:
        """Why the votes and Begins of a begun op cannot run together, if they cannot."""
        kinds = {kind_of(i) for i in op.inits.values()}
        if len(kinds) > 1:
            listing = "; ".join(f"peer {pid:x}: {kind_of(i).name.lower()}" for pid, i in sorted(op.inits.items()))
            return m.RejectCode.PARAMETER_MISMATCH, f"peers disagree on the kind of tag {op.tag}: {listing}"
        refusal = agreed_alike(op.row, op.tag, op.inits)
        if refusal is None and op.row.kind is CollectiveKind.BROADCAST:
            root = next(iter(op.inits.values())).root
            if root not in op.participants:
                return m.RejectCode.ROOT_ABSENT, f"broadcast tag {op.tag}: root {root:x} is not a member of the ring"
        return refusal

    def on_done(self, group: int, peer_id: int, msg: m.CollectiveDone) -> None:
        if not msg.seq >> 63 and msg.seq >= self._next_seq:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective done for seq {msg.seq}, never commenced")
        op = self._find(group, msg.tag, msg.seq)
        if op is None or peer_id not in op.participants:
            log.debug("ignoring late done of peer %x for tag %d seq %d", peer_id, msg.tag, msg.seq)
            return
        if peer_id in op.done or peer_id in op.failed:
            raise PeerFault(KickReason.OUT_OF_PHASE, f"second done for collective tag {msg.tag}")
        if msg.aborted and op.fast and not op.armed:
            op.failed.add(peer_id)
            op.failure = op.failure or f"peer {peer_id:x} reported failure"
        elif msg.aborted:
            self._abort(op, f"peer {peer_id:x} reported failure")
        else:
            op.done.add(peer_id)
            if op.resolution is not None:
                self._act(op, *self._fold(op, lambda res: res.done(peer_id, True)))

    def on_withdraw(self, group: int, peer_id: int, msg: m.CollectiveWithdraw) -> None:
        op = self._ops.get((group, msg.tag))
        if op is not None and op.fast and peer_id in op.beginners and peer_id not in op.done | op.failed:
            self._withdraw_begun(op, peer_id)
        elif op is None or op.seq is not None or peer_id not in op.inits:
            # Commenced (the Commence on its way is the answer: the peer reports an abort), or
            # already answered (a rejection crossed the withdrawal): nothing to withdraw.
            log.debug("ignoring withdrawal of tag %d by peer %x: no vote of it waits", msg.tag, peer_id)
        else:
            del op.inits[peer_id]
            self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.WITHDRAWN, "withdrawn by this peer"))
        if msg.torn:
            self._torn(group, peer_id)

    def _torn(self, group: int, peer_id: int) -> None:
        """``peer_id``'s ring connections were left torn (a frame cut mid-way: docs/protocol.rst,
        "A withdrawal that tears a lane"): the group's ring is stale, and each begun op of the
        group that not every participant has begun yet, which would run on the torn lane, ends
        STALE_RING (its beginners re-wire and retry; one that begins it later hears the same)."""
        self._host.mark_stale(group)
        why = f"peer {peer_id:x}'s ring connections were torn by a cancellation; re-wire before retrying"
        for op in [op for op in self._ops.values() if op.group == group and op.fast and not op.armed]:
            self._abort(op, why, code=m.RejectCode.STALE_RING)

    def _withdraw_begun(self, op: Op, peer_id: int) -> None:
        """``peer_id``, cancelled, withdraws its Begin of ``op`` (see "Withdrawing a Begin"):
        armed (the withdrawal crossed the last Begin), it is that peer's abort; with a failure
        held, that failure ends the op; otherwise the op ends WITHDRAWN, without making the ring
        stale — everyone who began it, and every other participant when its Begin or vote of
        it arrives, retries the tag's next use at once."""
        if op.armed:
            self._abort(op, f"peer {peer_id:x} reported failure")
            return
        if op.failure is not None:
            self._abort(op, op.failure)
            return
        assert op.seq is not None
        why = f"peer {peer_id:x} withdrew its begin of tag {op.tag} before every participant began"
        del self._ops[(op.group, op.tag)]
        self._remember(op, why, m.RejectCode.WITHDRAWN)
        log.debug("withdrawn collective tag %d seq %d: %s", op.tag, op.seq, why)
        live = [pid for pid in op.participants if self._host.is_live(pid) and pid in op.began]
        self._host.report(OpEnded(op.group, op.tag, op.seq, True, live[0] if live else peer_id))
        for pid in live:
            self._host.send(pid, m.CollectiveAbort(op.tag, op.seq, why, code=m.RejectCode.WITHDRAWN))

    def _remember(self, op: Op, why: str, code: int) -> None:
        """Keep a begun op's end for the participants not told of it (``on_init``, ``on_begin``)."""
        assert op.seq is not None
        for key in [k for k, a in self._aborted.items() if k[0] == op.group and a.round != op.round]:
            del self._aborted[key]  # an earlier round's: no Begin can name it any more
        # A phase mismatch told every member that had not begun the op its own mismatch (each
        # waits elsewhere): the next call of each on the tag is a new use, after the re-wire.
        untold = set() if code == m.RejectCode.PHASE_MISMATCH else set(op.participants) - op.began
        self._aborted[(op.group, op.tag)] = Aborted(op.seq, op.round, tuple(op.participants), why, code, untold)

    def forget(self, group: int, peer_id: int) -> None:
        """A peer of ``group`` was removed: its votes go (its running ops abort at the next check)."""
        self.departures += 1
        for op in self._ops.values():
            if op.group == group:
                op.inits.pop(peer_id, None)

    def withdraw_all(self, group: int, peer_id: int, code: m.RejectCode, detail: str) -> None:
        """End every vote of the peer that has not commenced, answering ``code`` (a phase mismatch);
        an op it began that waits for the others to begin aborts with ``code``."""
        for op in self.of_peer(group, peer_id):
            if op.seq is not None:
                if op.fast and not op.armed and (op.group, op.tag) in self._ops:
                    self._abort(op, detail, code=code)
                continue
            del op.inits[peer_id]
            if not op.inits:
                del self._ops[(op.group, op.tag)]
            self._host.send(peer_id, m.CollectiveRejected(op.tag, code, detail))

    # --- peer-agreed completion (docs/protocol.rst, "Design: completion agreed among peers") ----

    def on_ask(self, group: int, peer_id: int, msg: m.CollectiveAsk) -> None:
        """A ready participant in doubt asks for the verdict (see "Peer-agreed completion")."""
        self._answered(group, peer_id, msg, asked=True)

    def on_answer(self, group: int, peer_id: int, msg: m.CollectiveAnswer) -> None:
        """A participant's answer to ``CollectiveQuery``."""
        self._answered(group, peer_id, msg, asked=False)

    def _answered(self, group: int, peer_id: int, msg: m.CollectiveAsk | m.CollectiveAnswer, *, asked: bool) -> None:
        try:
            answer = Answer(PHASES[m.CommitPhase(msg.phase)], frozenset(msg.known))
        except ValueError:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {msg.tag}: no phase {msg.phase}") from None
        op = self._find(group, msg.tag, msg.seq)
        if op is None or not op.peer_commit:
            self._retell(group, peer_id, msg.tag, msg.seq)
            return
        if peer_id in op.participants and self._deaths(op) and self._find(group, msg.tag, msg.seq) is not op:
            return  # the participants that left before (counted when nobody asked) decided it
        try:  # (bad input changes nothing: its sender is kicked, and counted dead next)
            res, sends = self._fold(op, lambda res: res.ask(peer_id, answer) if asked else res.answer(peer_id, answer))
        except ProtocolError as exc:
            raise PeerFault(KickReason.PROTOCOL_ERROR, f"collective tag {msg.tag}: {exc}") from None
        self._act(op, res, sends)

    def _retell(self, group: int, peer_id: int, tag: int, seq: int) -> None:
        """An ask or answer for an op that ended here needs nothing: every participant that
        began it was told the verdict (its ask or answer crossed it), and one that had not
        begun it hears the abort when its Begin of it arrives (``on_begin``), as the others did."""
        ended = self._aborted.get((group, tag))
        if (ended is None or ended.seq != seq) and self._committed.get((group, tag)) != seq:
            # (an op of a master before a restart: its resolution is not wired)
            log.warning("peer %x asks about collective tag %d seq %d, which this master does not know",
                        peer_id, tag, seq)

    def _resolution(self, op: Op) -> Resolution:
        """``op``'s resolution, made on first need from the ``Done(ok)`` reports so far."""
        if op.resolution is None:
            res = Resolution.open(op.participants)
            for pid in sorted(op.done):
                res, sends = res.done(pid, True)
                assert not sends  # (every Done(ok) in: the op completed before anyone asked)
            op.resolution = res
        return op.resolution

    def _fold(self, op: Op, step: Callable[[Resolution], tuple[Resolution, tuple[Send, ...]]],
              ) -> tuple[Resolution, tuple[Send, ...]]:
        """Feed ``op``'s resolution one input.  A split it meets (:class:`PeerCommitError`: its
        checks leave that to a pccl bug) aborts the op, logged, instead of failing the master."""
        try:
            res, sends = step(self._resolution(op))
        except PeerCommitError as exc:
            log.error("collective tag %d seq %s: %s: aborting it", op.tag, op.seq, exc)
            self._abort(op, f"the participants' answers disagree ({exc})")
            return self._resolution(op), ()
        op.resolution = res
        return res, sends

    def _deaths(self, op: Op) -> bool:
        """Participants of a peer-agreed op that left: a held failure (a nack) aborts it, each
        other death goes to its resolution (before its Done: the others are queried)."""
        if op.failure is not None:
            self._abort(op, op.failure)
            return True
        changed = False
        for pid in op.participants:
            if not self._host.is_live(pid) and pid not in self._resolution(op).dead:
                changed = True
                self._act(op, *self._fold(op, lambda res: res.death(pid)))
                if self._find(op.group, op.tag, op.seq or 0) is not op:
                    break  # decided
        return changed

    def _act(self, op: Op, res: Resolution, sends: tuple[Send, ...]) -> None:
        """Send a resolution's queries; its verdict ends the op (Complete, or Abort)."""
        assert op.seq is not None
        for send in sends:
            if send.word is Word.QUERY:
                query = m.CollectiveQuery(op.tag, op.seq)
                for pid in sorted(send.to):
                    if self._host.is_live(pid):  # (one that left too is counted dead next)
                        self._host.send(pid, query)
        # (Decided with nobody left to tell — every participant dead — it ends all the same.)
        if res.verdict is Verdict.COMMIT and self._find(op.group, op.tag, op.seq) is op:
            self._complete(op, [pid for pid in op.participants if self._host.is_live(pid)])
        elif res.verdict is Verdict.ABORT and self._find(op.group, op.tag, op.seq) is op:
            self._abort(op, why_aborted(res))

    def is_open(self, key: tuple[int, int], seq: int) -> bool:
        """Whether op ``seq`` of ``key`` (group, tag) is open (not completed or aborted)."""
        return self._find(*key, seq) is not None

    def _find(self, group: int, tag: int, seq: int) -> Op | None:
        op = self._ops.get((group, tag))
        if op is not None and op.seq == seq:
            return op
        return self._lingering.get((group, tag), {}).get(seq)

    def _linger(self, op: Op) -> None:
        assert op.seq is not None
        del self._ops[(op.group, op.tag)]
        self._lingering.setdefault((op.group, op.tag), {})[op.seq] = op

    def _drop(self, op: Op) -> None:
        key = (op.group, op.tag)
        if self._ops.get(key) is op:
            del self._ops[key]
            return
        held = self._lingering[key]
        del held[op.seq or 0]
        if not held:
            del self._lingering[key]

    def _open(self) -> list[Op]:
        return [*self._ops.values(), *(op for held in self._lingering.values() for op in held.values())]

    # --- consensus ----------------------------------------------------------------------------

    def settle(self) -> bool:
        """Check every op once; whether anything changed."""
        progressed = False
        for key in [*self._ops, *(k for k in self._lingering if k not in self._ops)]:
            progressed |= self.check(key)
        return progressed

    def check(self, key: tuple[int, int]) -> bool:
        """Check the ops of ``key`` (group, tag), if there are any; whether anything changed."""
        progressed = False
        if self._lingering:  # (none in the steady state: no list built per message)
            for held in list(self._lingering.get(key, {}).values()):
                progressed |= self._check_op(held)
        op = self._ops.get(key)
        return self._check_op(op) or progressed if op is not None else progressed

    def _check_op(self, op: Op) -> bool:
        key = (op.group, op.tag)
        if op.seq is None:
            return self._check_vote(op)
        live = op.live
        if live is None or op.departures != self.departures:
            # Someone left since the last count (or this is the first): count again.  Otherwise
            # only ``done`` grew, and each Done costs O(1) below, not O(participants).
            live = [pid for pid in op.participants if self._host.is_live(pid)]
            gone_early = [pid for pid in op.participants if not self._host.is_live(pid) and pid not in op.done]
            if op.peer_commit and op.fast and (gone_early or op.resolution is not None):
                op.live, op.departures = live, self.departures
                return self._deaths(op)
            if gone_early:
                root = next(iter(op.inits.values())).root if op.row.kind is CollectiveKind.BROADCAST and op.inits else None
                if root in gone_early:
                    self._abort(op, f"the root {root:x} left before finishing")
                else:
                    self._abort(op, f"participant {gone_early[0]:x} left before finishing")
                return True
            op.live, op.departures = live, self.departures
        if op.resolution is None and len(op.done) >= len(live) and all(pid in op.done for pid in live):
            self._complete(op, live)
            return True
        return False

    def _complete(self, op: Op, live: list[int]) -> None:
        assert op.seq is not None
        self._drop(op)
        if op.peer_commit:
            self._committed[(op.group, op.tag)] = op.seq
        if live:
            self._host.report(OpEnded(op.group, op.tag, op.seq, False, live[0]))
        complete = m.CollectiveComplete(op.tag, op.seq)  # one message: the shell encodes it once
        for pid in live:
            self._host.send(pid, complete)

    def _check_vote(self, op: Op) -> bool:
        key = (op.group, op.tag)
        if not op.inits:
            del self._ops[key]
            return True
        voters = self._host.members(op.group)
        if len(op.inits) < len(voters) or not all(pid in op.inits for pid in voters):
            if not self._host.is_stale(op.group):
                return False
            rnd, refused = self._refused.get(op.group, (None, set()))
            absent = [pid for pid in voters if pid not in op.inits and (self._host.in_topology_vote(pid) or (
                rnd == self._host.round_of(op.group) and (op.tag, pid) in refused))]
            if not absent:
                return False
            # A member re-wires its stale group before it votes again: this op cannot reach
            # consensus on the old ring, and its voters hold their tags, which keeps them from
            # joining that re-wire.  End it now; they re-wire and vote again on the new ring.
            del self._ops[key]
            detail = (f"group {op.group} lost a member and peer {absent[0]:x} re-wires it; re-wire before "
                      "retrying")
            for pid in op.inits:
                self._host.send(pid, m.CollectiveRejected(op.tag, m.RejectCode.STALE_RING, detail))
            return True
        del self._ops[key]
        code, detail = self._reject_reason(op)
        if code is not None:
            if code is m.RejectCode.PARAMETER_MISMATCH:
                log.warning("refusing collective: %s", detail)
            for pid in voters:
                self._host.send(pid, m.CollectiveRejected(op.tag, code, detail))
            return True
        ring = self._host.ring(op.group)
        assert ring is not None  # _reject_reason refused a group without one
        op.seq = self._next_seq
        self._next_seq += 1
        op.participants = op.row.order(ring, op.inits)
        self._ops[key] = op
        counts = tuple(op.inits[pid].count for pid in op.participants) if op.row.sends_counts else ()
        commence = m.CollectiveCommence(op.tag, op.seq, op.participants, counts)  # encoded once
        for pid in op.participants:
            self._host.send(pid, commence)
        return True

    def _reject_reason(self, op: Op) -> tuple[m.RejectCode | None, str]:
        if op.other_kind:  # (the voter that asked for it may have gone since)
            kinds = {kind_of(i) for i in op.inits.values()}
            if len(kinds) > 1:
                listing = "; ".join(f"peer {pid:x}: {kind_of(i).name.lower()}" for pid, i in sorted(op.inits.items()))
                return m.RejectCode.PARAMETER_MISMATCH, f"peers disagree on the kind of tag {op.tag}: {listing}"
            op.row = KINDS[kinds.pop()]
        row = op.row
        refusal = row.check(row, op.tag, op.inits)
        if refusal is not None and refusal[0] is m.RejectCode.PARAMETER_MISMATCH:
            return refusal  # the callers' bug: whatever the ring
        if len(op.inits) < row.min_voters:
            return m.RejectCode.TOO_FEW_PEERS, f"only {len(op.inits)} peer(s) in group {op.group}"
        ring = self._host.ring(op.group)
        if self._host.is_stale(op.group) or ring is None or set(ring) != set(op.inits):
            # Before a missing root: the voters re-wire first, and then see the group as it is
            # (a root that died is gone from their ring; one that joined is in it).
            return m.RejectCode.STALE_RING, f"group {op.group} lost a member; re-wire before retrying"
        if refusal is not None:
            return refusal
        return None, ""

    def _abort(self, op: Op, why: str, code: int = 0) -> None:
        self.aborts += 1
        self._drop(op)
        self._host.mark_stale(op.group)  # the ring failed once: the next topology vote re-wires it
        if op.fast and op.seq is not None:
            self._remember(op, why, code)
        log.debug("aborting collective tag %d seq %s: %s", op.tag, op.seq, why)
        # A begun op's participants that have not begun it hear nothing: their Begin will find
        # the group stale.
        live = [pid for pid in op.participants if self._host.is_live(pid) and (not op.fast or pid in op.began)]
        if live:
            self._host.report(OpEnded(op.group, op.tag, op.seq or 0, True, live[0]))
        for pid in live:
            self._host.send(pid, m.CollectiveAbort(op.tag, op.seq or 0, why, code=code))

    # --- views --------------------------------------------------------------------------------

    def of_peer(self, group: int, peer_id: int) -> list[Op]:
        """The ops of ``group`` the peer voted for or takes part in."""
        # (A begun op's participant is in it once it began, and out of a peer-agreed one once
        # its Done(ok) is in: it may have committed, and every other participant was ready.)
        return [op for op in self._open() if op.group == group and in_op(op, peer_id)]

    def waiting_call(self, group: int, peer_id: int) -> str | None:
        """The calls the peer waits in for the others of ``group``, as the caller knows them
        (``all_reduce (tag 1, 2)``), when every op it is in still votes; ``None`` when it is in
        none, or in one that runs (it can still go on)."""
        ops = self.waiting_ops(group, peer_id)
        return None if ops is None else call_name(ops)

    def waiting_ops(self, group: int, peer_id: int) -> list[Op] | None:
        """The ops of :meth:`waiting_call`, unnamed (named only for a phase mismatch)."""
        return ops_waited_in(self._open() if self._lingering else self._ops.values(), group, peer_id)

    def full_vote(self, group: int) -> bool:
        """Whether some vote of ``group`` that has not commenced has every member's Init (it
        can still commence: no phase mismatch across tags)."""
        members = self._host.members(group)
        return any(op.group == group and op.seq is None and all(pid in op.inits for pid in members)
                   for op in self._ops.values())

    def views(self) -> list[OpInfo]:
        return [OpInfo(o.group, o.tag, frozenset(o.inits), o.seq, o.participants, frozenset(o.done), o.row.kind,
                       *resolving(o)) for o in self._open()]
