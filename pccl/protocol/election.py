"""Shared-state election and transfer planning: pure functions, no I/O.

The master's sync machine (:mod:`pccl.protocol.sync_state`) calls :func:`elect` once every
accepted peer of a group has voted ``SyncVote`` and :func:`replan` when a receiver reports a
failed source.  Both are deterministic functions of their arguments: arrival order, dict order
and peer-id order of the input mapping never matter (every iteration below is over sorted peer
ids or sorted keys).

Rules
=====

Votes.  A vote carries a revision, a strategy and its entries sorted by key (unique keys), each
with dtype, size in bytes, xxh3-128 digest and the ``allow_content_inequality`` flag.
:func:`validate_vote` rejects malformed votes (the master kicks their sender, PROTOCOL_ERROR).

Strategies.  If any voter uses ENFORCE_POPULAR, every voter using SEND_ONLY or RECEIVE_ONLY is
*rejected* (``STRATEGY_MIX`` → ``InvalidUsage`` for that caller, which stays in the run) and the
sync goes on without it.  *Candidates* are the voters that are not RECEIVE_ONLY: only they take
part in the election and only they can be sources.  No candidate → every voter is rejected with
``NO_SOURCE``.

Revisions (the lineage rule, SPEC §3).  ``last_revision`` is the revision the group adopted at
its previous sync (``None`` before the first sync of the run, and after a master restart).
*Continuing* voters — those that took part in the group's last completed sync — offer
``last_revision + 1`` (they stepped once) or less (a step that was given up, after an aborted
all-reduce, leaves the revision where it was); one that offers more jumped without syncing and
is kicked (``REVISION_VIOLATION``).  Every other voter (a joiner, a peer back after being
removed, every peer after a master restart) is never kicked for its revision.  The group adopts the **highest revision offered** by a
candidate, whoever offers it: most progress wins, so the first sync of a run (resuming from a
checkpoint), the first sync after a master restart and a returning peer with more progress follow
one rule.  Voters below the adopted revision are *outdated* and receive like joiners.

Popularity.  Among candidates at the adopted revision, votes are grouped by *content*: the
sequence of (key, dtype, nbytes, flag, digest), with the digest left out for
``allow_content_inequality`` entries.  The content with the most votes wins; a tie goes to the
content that sorts first (a function of the bytes, not of who voted or when).

Mask.  Every voter whose *structure* — (key, dtype, nbytes, flag) per entry — differs from the
winner's is kicked (``SHARED_STATE_MISMATCH``).  Keys are compared as sets (entries are sorted
by key), not positionally by insertion order.

Sources and receivers.  Sources are the candidates at the adopted revision whose content equals
the winner.  A SEND_ONLY voter that is not a source is kicked (``STRATEGY_VIOLATION``: it would
have to receive).  Every other remaining voter is a receiver: it fetches its *dirty* tensors —
those whose digest differs from the winner's — and, if it is outdated (a joiner),
additionally every ``allow_content_inequality`` tensor whose digest differs from the source
assigned to it.  Up-to-date peers never exchange ``allow_content_inequality`` tensors.

Striping.  A receiver's dirty tensors are laid end to end as one byte range, which is cut into
``n`` near-equal stripes, ``n = min(#sources, ceil(total / min_stripe))`` (at least one): with
enough bytes *every* source sends an equal share, whatever the mix of few large or many small
tensors (a stripe covers whole small tensors and cuts large ones).  Stripe ``k`` of the
receiver with rank ``r`` (its index among the sorted receivers) comes from source
``sources[(r + k) % #sources]``, so several receivers with small states spread over the sources.
``allow_content_inequality`` tensors cannot be striped (sources may differ): each comes whole
from one source, round-robin in the same rotation, and is verified against *that* source's digest.

Re-planning.  When a receiver reports failed sources, only the pieces of its latest attempt that
were assigned to them move: equal-content pieces are striped again over the sources still
available to it; whole (inequality) tensors go whole to the next available source, with that
source's digest as the new expectation.  No source left → ``None`` (the receiver fails).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from ..errors import KickReason
from ..types import DType, SyncStrategy
from . import messages as m

__all__ = [
    "HASH_SIZE",
    "DEFAULT_MIN_STRIPE",
    "Piece",
    "ReceiverPlan",
    "Election",
    "validate_vote",
    "elect",
    "replan",
    "stripe",
]

#: xxh3-128 digests are 16 bytes.
HASH_SIZE = 16
#: Stripes smaller than this are not worth an extra connection.
DEFAULT_MIN_STRIPE = 256 * 1024


@dataclasses.dataclass(frozen=True, order=True)
class Piece:
    """Bytes ``[offset, offset + nbytes)`` of tensor ``key``, fetched from ``source``."""

    source: int
    key: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ReceiverPlan:
    """What one receiver fetches in one attempt.

    ``pieces`` (sorted by source, key, offset) are this attempt's fetches; ``expected`` maps every
    tensor the receiver gets in this sync (all attempts) to the digest it must have afterwards.
    """

    peer_id: int
    rank: int
    pieces: tuple[Piece, ...]
    expected: Mapping[str, bytes]

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(sorted({p.source for p in self.pieces}))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


@dataclasses.dataclass(frozen=True)
class Election:
    """The outcome of one group's sync vote (see the module rules)."""

    #: Revision every participant adopts (None when every voter was rejected).
    revision: int | None
    kicks: Mapping[int, tuple[KickReason, str]]
    rejects: Mapping[int, tuple[m.SyncRejectCode, str]]
    #: Up-to-date peers holding the popular content, sorted.
    sources: tuple[int, ...]
    #: Every voter that is neither kicked nor rejected, sorted (they all get SyncComplete).
    participants: tuple[int, ...]
    #: Receivers that must fetch something, by peer id.
    plans: Mapping[int, ReceiverPlan]
    #: The winning entries (what every participant holds afterwards, digests of equal-content
    #: tensors included).
    popular: tuple[m.SharedStateEntry, ...]


# --- validation ------------------------------------------------------------------------------


def validate_vote(vote: m.SyncVote) -> str | None:
    """Why ``vote`` is malformed, or ``None`` if it is well-formed."""
    try:
        SyncStrategy(vote.strategy)
    except ValueError:
        return f"unknown sync strategy {vote.strategy}"
    previous: str | None = None
    for e in vote.entries:
        if previous is not None and e.key <= previous:
            return f"entries not sorted by unique key ({previous!r} then {e.key!r})"
        previous = e.key
        try:
            dtype = DType(e.dtype)
        except ValueError:
            return f"entry {e.key!r} has unknown dtype {e.dtype}"
        if e.nbytes % dtype.itemsize:
            return f"entry {e.key!r}: {e.nbytes} bytes is not a whole number of {dtype.name.lower()} elements"
        if len(e.hash) != HASH_SIZE:
            return f"entry {e.key!r} has a {len(e.hash)}-byte digest; xxh3-128 digests are {HASH_SIZE} bytes"
    return None


# --- the election ----------------------------------------------------------------------------


def _structure(vote: m.SyncVote) -> tuple[tuple[str, int, int, bool], ...]:
    return tuple((e.key, e.dtype, e.nbytes, e.allow_content_inequality) for e in vote.entries)


def _content(vote: m.SyncVote) -> tuple[tuple[str, int, int, bool, bytes], ...]:
    return tuple((e.key, e.dtype, e.nbytes, e.allow_content_inequality,
                  b"" if e.allow_content_inequality else e.hash) for e in vote.entries)


def _first_difference(a: m.SyncVote, b: m.SyncVote) -> str:
    mine = {e.key: e for e in a.entries}
    theirs = {e.key: e for e in b.entries}
    for key in sorted(set(mine) | set(theirs)):
        if key not in theirs:
            return f"key {key!r} is not in the popular state"
        if key not in mine:
            return f"key {key!r} of the popular state is missing"
        x, y = mine[key], theirs[key]
        if x.dtype != y.dtype:
            return f"key {key!r} has dtype {DType(x.dtype).name.lower()}, the popular state {DType(y.dtype).name.lower()}"
        if x.nbytes != y.nbytes:
            return f"key {key!r} has {x.nbytes} bytes, the popular state {y.nbytes}"
        if x.allow_content_inequality != y.allow_content_inequality:
            return f"key {key!r} differs in allow_content_inequality from the popular state"
    return "entries differ"


def elect(votes: Mapping[int, m.SyncVote], last_revision: int | None, *,
          continuing: Collection[int] = frozenset(), min_stripe: int = DEFAULT_MIN_STRIPE) -> Election:
    """Decide one group's sync: kicks, rejections, the adopted revision and every receiver's
    first plan.  ``votes`` maps peer id → its (validated) vote; must not be empty.
    ``continuing``: the peers that took part in the group's last completed sync (see the rules;
    ignored while ``last_revision`` is ``None``)."""
    if not votes:
        raise ValueError("elect() needs at least one vote")
    if min_stripe < 1:
        raise ValueError("min_stripe must be positive")
    ids = sorted(votes)
    kicks: dict[int, tuple[KickReason, str]] = {}
    rejects: dict[int, tuple[m.SyncRejectCode, str]] = {}

    def strategy(pid: int) -> SyncStrategy:
        return SyncStrategy(votes[pid].strategy)

    if any(strategy(p) is SyncStrategy.ENFORCE_POPULAR for p in ids):
        for p in ids:
            if strategy(p) is not SyncStrategy.ENFORCE_POPULAR:
                rejects[p] = (m.SyncRejectCode.STRATEGY_MIX,
                              f"{strategy(p).name} cannot be mixed with ENFORCE_POPULAR in one sync")
    live = [p for p in ids if p not in rejects]
    candidates = [p for p in live if strategy(p) is not SyncStrategy.RECEIVE_ONLY]
    if not candidates:
        for p in live:
            rejects[p] = (m.SyncRejectCode.NO_SOURCE, "every peer of the group syncs RECEIVE_ONLY: nobody can send")
        return Election(None, kicks, rejects, (), (), {}, ())

    if last_revision is not None:
        expected = last_revision + 1
        for p in live:
            if p in continuing and votes[p].revision > expected:
                kicks[p] = (KickReason.REVISION_VIOLATION,
                            f"revision {votes[p].revision} but the group expects {expected} (a peer that "
                            "took part in the group's last sync must increase the revision by exactly one)")
    live = [p for p in live if p not in kicks]
    candidates = [p for p in candidates if p not in kicks]
    if not candidates:
        for p in live:
            rejects[p] = (m.SyncRejectCode.NO_SOURCE, "every peer that could send was kicked for its revision")
        return Election(None, kicks, rejects, (), (), {}, ())
    revision = max(votes[p].revision for p in candidates)  # most progress wins
    pool = [p for p in candidates if votes[p].revision == revision]

    tally = Counter(_content(votes[p]) for p in pool)
    winner_content = min(tally, key=lambda c: (-tally[c], c))
    winner = next(votes[p] for p in pool if _content(votes[p]) == winner_content)
    mask = _structure(winner)
    for p in live:
        if _structure(votes[p]) != mask:
            kicks[p] = (KickReason.SHARED_STATE_MISMATCH, _first_difference(votes[p], winner))
    live = [p for p in live if p not in kicks]

    sources = tuple(p for p in pool if p in live and _content(votes[p]) == winner_content)
    for p in live:
        if strategy(p) is SyncStrategy.SEND_ONLY and p not in sources:
            kicks[p] = (KickReason.STRATEGY_VIOLATION,
                        "SEND_ONLY but this peer does not hold the popular state (it would have to receive)")
    live = [p for p in live if p not in kicks]
    receivers = [p for p in live if p not in sources]

    popular_hash = {e.key: e.hash for e in winner.entries}
    plans: dict[int, ReceiverPlan] = {}
    for rank, r in enumerate(receivers):
        vote = votes[r]
        outdated = vote.revision < revision
        ranges: list[tuple[str, int, int]] = []
        whole: list[str] = []
        for e in vote.entries:
            if not e.allow_content_inequality:
                if e.hash != popular_hash[e.key]:
                    ranges.append((e.key, 0, e.nbytes))
            elif outdated and e.nbytes:
                whole.append(e.key)
        pieces = stripe(ranges, sources, rank=rank, min_stripe=min_stripe)
        expected_hash = {key: popular_hash[key] for key, _, _ in ranges}
        mine = {e.key: e for e in vote.entries}
        for i, key in enumerate(whole):
            src = sources[(rank + i) % len(sources)]
            src_entry = _entry(votes[src], key)
            if src_entry.hash != mine[key].hash:
                pieces.append(Piece(src, key, 0, src_entry.nbytes))
                expected_hash[key] = src_entry.hash
        if pieces:
            plans[r] = ReceiverPlan(r, rank, tuple(sorted(pieces)), expected_hash)
    popular = tuple(winner.entries)
    return Election(revision, kicks, rejects, sources, tuple(live), plans, popular)


def _entry(vote: m.SyncVote, key: str) -> m.SharedStateEntry:
    for e in vote.entries:
        if e.key == key:
            return e
    raise KeyError(key)


def stripe(ranges: Sequence[tuple[str, int, int]], sources: Sequence[int], *, rank: int = 0,
           min_stripe: int = DEFAULT_MIN_STRIPE) -> list[Piece]:
    """Cut the byte ranges ``(key, offset, nbytes)`` — laid end to end in the given order — into
    near-equal stripes over ``sources`` (see the module rules).  Empty ranges are skipped."""
    ranges = [r for r in ranges if r[2] > 0]
    total = sum(n for _, _, n in ranges)
    if not total:
        return []
    if not sources:
        raise ValueError("no source to stripe over")
    count = max(1, min(len(sources), -(-total // min_stripe)))
    bounds = [total * k // count for k in range(count + 1)]
    pieces: list[Piece] = []
    position = 0  # start of the current range within the concatenation
    k = 0
    for key, offset, nbytes in ranges:
        start, end = position, position + nbytes
        while start < end:
            while bounds[k + 1] <= start:
                k += 1
            cut = min(end, bounds[k + 1])
            src = sources[(rank + k) % len(sources)]
            pieces.append(Piece(src, key, offset + (start - position), cut - start))
            start = cut
        position = end
    return pieces


def replan(votes: Mapping[int, m.SyncVote], plan: ReceiverPlan, failed: Sequence[int],
           available: Sequence[int], *, min_stripe: int = DEFAULT_MIN_STRIPE) -> ReceiverPlan | None:
    """The next attempt of ``plan`` after ``failed`` sources failed: their pieces move to the
    ``available`` sources (sorted ids of live up-to-date peers this receiver has not seen fail).
    ``None`` if pieces must move and no source is available."""
    failed_set = set(failed)
    moving = [p for p in plan.pieces if p.source in failed_set]
    sources = sorted(set(available) - failed_set)
    if not moving:
        return ReceiverPlan(plan.peer_id, plan.rank, (), plan.expected)
    if not sources:
        return None
    receiver = {e.key: e for e in votes[plan.peer_id].entries}
    expected = dict(plan.expected)
    ranges: list[tuple[str, int, int]] = []
    pieces: list[Piece] = []
    whole_index = 0
    for p in moving:
        if receiver[p.key].allow_content_inequality:
            src = sources[(plan.rank + whole_index) % len(sources)]
            whole_index += 1
            entry = _entry(votes[src], p.key)
            pieces.append(Piece(src, p.key, 0, entry.nbytes))
            expected[p.key] = entry.hash
        else:
            ranges.append((p.key, p.offset, p.nbytes))
    pieces += stripe(ranges, sources, rank=plan.rank, min_stripe=min_stripe)
    return ReceiverPlan(plan.peer_id, plan.rank, tuple(sorted(pieces)), expected)
