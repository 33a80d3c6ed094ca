"""The master's collective-ops sub-machine: votes, commence, completion, abort (sans-IO).

Rules
=====

Collectives (per group, per tag).  Every accepted peer of the group sends ``CollectiveInit``;
at consensus: the voters disagree on the op's kind or on what its row says must agree →
``PARAMETER_MISMATCH``; fewer voters than the row's minimum → ``TOO_FEW_PEERS``; stale ring →
``STALE_RING`` (each a ``CollectiveRejected`` to every voter) — also before consensus, to the
voters so far, once a member that has not voted has a topology vote standing in a stale group
(it votes again only on the re-wired ring, and the voters' held tags would keep them from that
round: the cross-tag wait of concurrent calls after a failure); otherwise
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

Kinds.  What an op computes is its kind; everything the handlers here do differently per kind is
one row of :data:`~pccl.protocol.master.kinds.KINDS` (:mod:`pccl.protocol.master.kinds`).

The machine sees the master only through :class:`OpsHost` (peers named by peer id); the
master's dispatch has checked the phase rules before a handler here runs.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import NamedTuple

from ...errors import KickReason
from .. import messages as m
from ..messages import CollectiveKind
from .events import OpEnded, PeerFault
from .kinds import KINDS, KindRow, agreed_alike, kind_of

__all__ = ["CollectiveOps", "OpsHost", "OpInfo"]

log = logging.getLogger("pccl.protocol.master.machine")


# --- the machine -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OpsHost:
    """What the collective-ops machine needs from the master, as callables (peers named by id)."""

    #: the accepted peers of a group, in arrival order
    members: Callable[[int], list[int]]
    #: a group's installed ring (``None`` before its first round)
    ring: Callable[[int], tuple[int, ...] | None]
    #: whether a group's ring lost a member or an op since it was installed
    is_stale: Callable[[int], bool]
    #: an op of the group aborted: its ring must be re-wired before the next op
    mark_stale: Callable[[int], None]
    #: the peer still has a connection (it was not removed)
    is_live: Callable[[int], bool]
    #: queue a message for a live peer
    send: Callable[[int, m.Message], None]
    #: tell the shell that an op ended (a fact, before the op's final messages)
    report: Callable[[OpEnded], None]
    #: the peer has a topology vote standing (it votes no collective before that round)
    in_topology_vote: Callable[[int], bool]
    #: the id of the topology round that installed a group's ring (``None`` before its first)
    round_of: Callable[[int], int | None] = lambda group: None


class OpInfo(NamedTuple):
    """Read-only view of one collective op (a named tuple: the simulator's checkers build one
    per op after every change of the master's state)."""

    group: int
    tag: int
    voters: frozenset[int]
    seq: int | None
    participants: tuple[int, ...]
    done: frozenset[int]
    kind: CollectiveKind = CollectiveKind.ALL_REDUCE


@dataclasses.dataclass(eq=False)
class _Op:
    group: int
    tag: int
    row: KindRow  # the kind its first voter asked for
    #: a voter asked for another kind (checked again at consensus: that voter may have gone)
    other_kind: bool = False
    inits: dict[int, m.CollectiveInit] = dataclasses.field(default_factory=dict)  # voting phase
    seq: int | None = None  # set once commenced
    participants: tuple[int, ...] = ()
    done: set[int] = dataclasses.field(default_factory=set)
    #: begun on the fast path (a derived seq, see "Begins"): who began it or joined it by a
    #: vote, and whether every participant has (the one-way Commence that arms the watchdogs)
    fast: bool = False
    round: int = 0  # the topology round a begun op's Begins named
    began: set[int] = dataclasses.field(default_factory=set)
    beginners: set[int] = dataclasses.field(default_factory=set)  # began by a Begin (not a vote)
    armed: bool = False
    #: a participant's failure reported before everyone began: the abort waits for the last
    #: Begin, which may show a disagreement (the cause to report: the same error everywhere)
    failure: str | None = None
    failed: set[int] = dataclasses.field(default_factory=set)  # who reported it
    #: A begun op's vote every other one was found to agree with (a later one that agrees with
    #: it too changes no verdict: see ``_join``).
    agreed: m.CollectiveInit | None = None
    #: A commenced op's live participants as last counted, and ``CollectiveOps.departures`` then
    #: (no participant can have gone while it is unchanged: see ``check``).
    live: list[int] | None = None
    departures: int = -1


@dataclasses.dataclass
class _Aborted:
    """A begun op's abort, as its participants heard it."""

    seq: int
    round: int
    participants: tuple[int, ...]
    why: str
    code: int
    #: Participants never told of it (they had neither begun nor voted it): the first vote or
    #: Begin of each on the tag is that op's (see ``on_init``, ``on_begin``).
    untold: set[int]


class CollectiveOps:
    """Every group's collective ops (see the module docstring)."""

    def __init__(self, host: OpsHost) -> None:
        self._host = host
        self._ops: dict[tuple[int, int], _Op] = {}  # (group, tag)
        self._next_seq = 1
        #: The begun ops aborted in their group's current round, by (group, tag): a participant
        #: whose Begin arrives after the abort hears the same abort (see ``on_begin``).
        self._aborted: dict[tuple[int, int], _Aborted] = {}
        #: Peers removed so far (``forget``): a peer stops being live only there.
        self.departures = 0
        #: Ops aborted so far (an abort makes its group stale: the master re-checks every vote).
        self.aborts = 0

    # --- messages -----------------------------------------------------------------------------

    def on_init(self, group: int, peer_id: int, msg: m.CollectiveInit) -> None:
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
        if op is not None and (op.seq is not None or peer_id in op.inits):
            self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.TAG_IN_USE,
                                                          f"tag {msg.tag} is already in flight for this peer"))
            return
        if op is None:
            op = self._ops[(group, msg.tag)] = _Op(group, msg.tag, KINDS[kind_of(msg)])
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
            self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.STALE_RING,
                                                          f"group {group} lost a member or an op since round "
                                                          f"{msg.round}; re-wire before retrying"))
            return
        if op is None:
            op = self._ops[key] = _Op(group, msg.tag, row)
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

    def _join(self, op: _Op, peer_id: int, init: m.CollectiveInit, *, begun: bool) -> None:
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

    def _rejected_after_abort(self, op: _Op, peer_id: int) -> None:
        """A voter of ``op`` is told the abort as a rejection of its vote: the abort is not kept
        for it (its next call on the tag is a new use: a vote or a Begin that finds the group
        stale, not the old op's Commence and Abort)."""
        aborted = self._aborted.get((op.group, op.tag))
        if aborted is not None and aborted.seq == op.seq:
            aborted.untold.discard(peer_id)

    def _fast_refusal(self, op: _Op) -> tuple[m.RejectCode, str] | None:
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
        op = self._ops.get((group, msg.tag))
        if op is None or op.seq != msg.seq or peer_id not in op.participants:
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

    def on_withdraw(self, group: int, peer_id: int, msg: m.CollectiveWithdraw) -> None:
        op = self._ops.get((group, msg.tag))
        if op is not None and op.fast and peer_id in op.beginners and peer_id not in op.done | op.failed:
            self._withdraw_begun(op, peer_id)
            return
        if op is None or op.seq is not None or peer_id not in op.inits:
            # Commenced (the Commence on its way is the answer: the peer reports an abort), or
            # already answered (a rejection crossed the withdrawal): nothing to withdraw.
            log.debug("ignoring withdrawal of tag %d by peer %x: no vote of it waits", msg.tag, peer_id)
            return
        del op.inits[peer_id]
        self._host.send(peer_id, m.CollectiveRejected(msg.tag, m.RejectCode.WITHDRAWN, "withdrawn by this peer"))

    def _withdraw_begun(self, op: _Op, peer_id: int) -> None:
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

    def _remember(self, op: _Op, why: str, code: int) -> None:
        """Keep a begun op's end for the participants not told of it (``on_init``, ``on_begin``)."""
        assert op.seq is not None
        for key in [k for k, a in self._aborted.items() if k[0] == op.group and a.round != op.round]:
            del self._aborted[key]  # an earlier round's: no Begin can name it any more
        # A phase mismatch told every member that had not begun the op its own mismatch (each
        # waits elsewhere): the next call of each on the tag is a new use, after the re-wire.
        untold = set() if code == m.RejectCode.PHASE_MISMATCH else set(op.participants) - op.began
        self._aborted[(op.group, op.tag)] = _Aborted(op.seq, op.round, tuple(op.participants), why, code, untold)

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

    # --- consensus ----------------------------------------------------------------------------

    def settle(self) -> bool:
        """Check every op once; whether anything changed."""
        progressed = False
        for key in list(self._ops):
            progressed |= self.check(key)
        return progressed

    def check(self, key: tuple[int, int]) -> bool:
        """Check the op of ``key`` (group, tag), if there is one; whether anything changed."""
        op = self._ops.get(key)
        if op is None:
            return False
        if op.seq is None:
            return self._check_vote(op)
        live = op.live
        if live is None or op.departures != self.departures:
            # Someone left since the last count (or this is the first): count again.  Otherwise
            # only ``done`` grew, and each Done costs O(1) below, not O(participants).
            live = [pid for pid in op.participants if self._host.is_live(pid)]
            gone_early = [pid for pid in op.participants if not self._host.is_live(pid) and pid not in op.done]
            if gone_early:
                root = next(iter(op.inits.values())).root if op.row.kind is CollectiveKind.BROADCAST and op.inits else None
                if root in gone_early:
                    self._abort(op, f"the root {root:x} left before finishing")
                else:
                    self._abort(op, f"participant {gone_early[0]:x} left before finishing")
                return True
            op.live, op.departures = live, self.departures
        if len(op.done) >= len(live) and all(pid in op.done for pid in live):
            del self._ops[key]
            if live:
                self._host.report(OpEnded(op.group, op.tag, op.seq, False, live[0]))
            complete = m.CollectiveComplete(op.tag, op.seq)  # one message: the shell encodes it once
            for pid in live:
                self._host.send(pid, complete)
            return True
        return False

    def _check_vote(self, op: _Op) -> bool:
        key = (op.group, op.tag)
        if not op.inits:
            del self._ops[key]
            return True
        voters = self._host.members(op.group)
        if len(op.inits) < len(voters) or not all(pid in op.inits for pid in voters):
            if not self._host.is_stale(op.group):
                return False
            absent = [pid for pid in voters if pid not in op.inits and self._host.in_topology_vote(pid)]
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

    def _reject_reason(self, op: _Op) -> tuple[m.RejectCode | None, str]:
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

    def _abort(self, op: _Op, why: str, code: int = 0) -> None:
        self.aborts += 1
        del self._ops[(op.group, op.tag)]
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

    def of_peer(self, group: int, peer_id: int) -> list[_Op]:
        """The ops of ``group`` the peer voted for or takes part in."""
        return [op for op in self._ops.values()  # (a begun op's participant is in it once it began)
                if op.group == group and (peer_id in op.inits or (not op.fast and peer_id in op.participants))]

    def waiting_call(self, group: int, peer_id: int) -> str | None:
        """The calls the peer waits in for the others of ``group``, as the caller knows them
        (``all_reduce (tag 1, 2)``), when every op it is in still votes; ``None`` when it is in
        none, or in one that runs (it can still go on)."""
        ops = []  # (of_peer's ops, in one pass: asked after every collective message)
        for op in self._ops.values():
            if op.group == group and (peer_id in op.inits or (not op.fast and peer_id in op.participants)):
                if op.seq is not None and (op.armed or not op.fast):
                    return None  # it runs one: it can still go on
                ops.append(op)
        if not ops:
            return None
        return ", ".join(f"{row.call} (tag {', '.join(str(t) for t in sorted(op.tag for op in ops if op.row is row))})"
                         for row in KINDS.values() if any(op.row is row for op in ops))

    def full_vote(self, group: int) -> bool:
        """Whether some vote of ``group`` that has not commenced has every member's Init (it
        can still commence: no phase mismatch across tags)."""
        members = self._host.members(group)
        return any(op.group == group and op.seq is None and all(pid in op.inits for pid in members)
                   for op in self._ops.values())

    def views(self) -> list[OpInfo]:
        return [OpInfo(o.group, o.tag, frozenset(o.inits), o.seq, o.participants, frozenset(o.done), o.row.kind)
                for o in self._ops.values()]
