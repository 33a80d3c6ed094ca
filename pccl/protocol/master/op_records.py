"""The records of the master's collective-ops sub-machine (:mod:`.collectives`): what it needs
from the master (``OpsHost``), its read-only view of an op (``OpInfo``), an op as it keeps it
(``Op``) and a begun op's abort as its participants heard it (``Aborted``), and what the
machine's views read off its ops (who is in one, which calls a peer waits in).  Sans-IO."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import NamedTuple

from .. import messages as m
from ..messages import CollectiveKind
from .events import OpEnded
from .kinds import KINDS, KindRow
from .peer_resolve import Resolution

__all__ = ["Aborted", "Op", "OpInfo", "OpsHost", "call_name", "in_op", "ops_waited_in", "resolving"]


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
    #: A peer-agreed op whose participants the master queries (a death before ``Done``, an ask),
    #: and the participants that answered so far: it decides once every live one did.
    resolving: bool = False
    answered: frozenset[int] = frozenset()


@dataclasses.dataclass(eq=False)
class Op:
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
    #: A beginner commits among the participants (``CollectiveBegin.peer_commit``): a death
    #: before ``Done`` is resolved by query (``resolution``, made on first need), not an abort.
    peer_commit: bool = False
    resolution: Resolution | None = None


@dataclasses.dataclass
class Aborted:
    """A begun op's abort, as its participants heard it."""

    seq: int
    round: int
    participants: tuple[int, ...]
    why: str
    code: int
    #: Participants never told of it (they had neither begun nor voted it): the first vote or
    #: Begin of each on the tag is that op's (see ``on_init``, ``on_begin``).
    untold: set[int]


def resolving(op: Op) -> tuple[bool, frozenset[int]]:
    """Whether ``op``'s resolution queries its participants, and who answered (or asked)."""
    res = op.resolution
    if res is None or not res.querying:
        return False, frozenset()
    return True, frozenset(res.answer_map)


def in_op(op: Op, peer_id: int) -> bool:
    """Whether ``peer_id`` voted for ``op`` or takes part in it (see ``CollectiveOps.of_peer``)."""
    if op.peer_commit and peer_id in op.done:
        return False
    return peer_id in op.inits or (not op.fast and peer_id in op.participants)


def ops_waited_in(ops: Iterable[Op], group: int, peer_id: int) -> list[Op] | None:
    """``CollectiveOps.waiting_ops`` over the open ``ops``."""
    waited = []  # (of_peer's ops, in one pass: asked after collective messages)
    for op in ops:
        # (A peer-agreed op's participant whose Done(ok) is in waits in it while it is not
        # armed: someone has not begun, so nobody can have committed.)
        if op.group == group and (peer_id in op.inits or (not op.fast and peer_id in op.participants)):
            if op.seq is not None and (op.armed or not op.fast):
                return None  # it runs one: it can still go on
            waited.append(op)
    return waited or None


def call_name(ops: list[Op]) -> str:
    """The calls ``ops`` are, as the caller knows them (``all_reduce (tag 1, 2)``)."""
    return ", ".join(f"{row.call} (tag {', '.join(str(t) for t in sorted(op.tag for op in ops if op.row is row))})"
                     for row in KINDS.values() if any(op.row is row for op in ops))
