"""Shared-state election and transfer planning: pure functions, no I/O.

The master's sync machine (:mod:`pccl.protocol.master.sync`) calls :func:`elect` once every
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

Lineage.  A group's state belongs to a *lineage*: an id the master mints at the first sync
of a run, plus the revision and content digest (:func:`content_digest`) of the group's last
completed sync.  Every participant of a sync receives the group's lineage with
``SyncComplete`` and votes it at its next sync; a checkpoint stores it.  The master remembers
the last sync of each group (:class:`History`: lineage, schema, the peers that took part) until
it restarts; after a restart the lineages that the votes carry are all it knows.

Who wins.  The *pool* is the set of candidates whose state the group may adopt:

1. with a history, the *continuing* candidates (those that took part in the group's last
   completed sync): they hold the lineage as the master knows it;
2. otherwise (a master restart, or every continuing peer is gone) the candidates that vote a
   lineage — those voting the history's lineage id if any does; among several ids, the id
   with the most holders, then the holder furthest in its lineage (revision), then the most
   progress offered, then the smallest id — and of those, the ones furthest in the lineage
   (highest lineage revision);
3. otherwise (the run's first sync; every holder lost) every candidate.

A candidate outside the pool (a joiner, a peer of another run, a holder that fell behind) is
never a source: it receives the pool's state *whatever revision it offers*, so no newcomer can
overwrite a running group.  Within the pool the **highest revision offered** wins (most
progress: the first sync of a run, a master restart and resuming from checkpoints follow one
rule).  A continuing candidate must offer ``last + 1`` (it stepped once) or less (a step that
was given up leaves the revision where it was); one that offers more jumped without syncing and
is kicked (``REVISION_VIOLATION``).  Nobody else is kicked for its revision.  The group's
lineage after the sync is the pool's (case 3: a newly minted id, :attr:`Election.lineage_id` is
``None``) at the adopted revision.

Schema.  The *structure* — (key, dtype, nbytes, flag) per entry — is elected by the number of
pool members offering it, never by revision; a tie goes to the history's schema, then to the
structure of the smallest peer id.  Every voter whose structure differs is kicked
(``SHARED_STATE_MISMATCH``, naming the key and both sizes): a newcomer of another shape never
costs the group a running peer, not even a lone one.  Keys are compared as sets (entries are
sorted by key), not positionally by insertion order.

Popularity.  Among pool members at the adopted revision with the elected structure, votes are
grouped by *content*: the sequence of (key, dtype, nbytes, flag, digest), with the digest left
out for ``allow_content_inequality`` entries.  The content with the most votes wins; a tie goes
to the content that sorts first (a function of the bytes, not of who voted or when).

Reasons.  Every participant learns how its state stood (``SyncReason``): UP_TO_DATE (a source,
or nothing of its state differs), DIVERGED (in the pool at the adopted revision, other bytes),
BEHIND (it holds the group's lineage but is outside the pool, or offered less than the
adopted revision), NEWCOMER (it holds none of this
group's lineage), OUTVOTED (case 3: nobody held a lineage and its state lost).  *Outdated*
receivers — BEHIND, NEWCOMER, or OUTVOTED at a lower revision — are joiners in effect.

Sources and receivers.  Sources are the pool members at the adopted revision whose content
equals the winner.  A SEND_ONLY voter that is not a source is kicked (``STRATEGY_VIOLATION``: it would
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
import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence

from ...errors import KickReason
from ...types import DType, SyncStrategy
from .. import messages as m

__all__ = [
    "HASH_SIZE",
    "DEFAULT_MIN_STRIPE",
    "Piece",
    "ReceiverPlan",
    "Election",
    "History",
    "Structure",
    "LINEAGE_ID_SIZE",
    "content_digest",
    "structure_of",
    "validate_vote",
    "elect",
    "replan",
    "stripe",
]

#: xxh3-128 digests are 16 bytes.
HASH_SIZE = 16
#: Stripes smaller than this are not worth an extra connection.
DEFAULT_MIN_STRIPE = 256 * 1024
#: Lineage ids are 16 random bytes; lineage digests are 16 bytes too (:func:`content_digest`).
LINEAGE_ID_SIZE = 16

#: A state's structure: (key, dtype, nbytes, allow_content_inequality) per entry, by key.
Structure = tuple[tuple[str, int, int, bool], ...]


def structure_of(entries: Sequence[m.SharedStateEntry]) -> Structure:
    """The schema of a vote's entries (what the election compares shapes by)."""
    return tuple((e.key, e.dtype, e.nbytes, e.allow_content_inequality) for e in entries)


def content_digest(entries: Sequence[m.SharedStateEntry]) -> bytes:
    """16-byte digest of the entries peers must agree on: every entry's key, dtype, size, flag
    and (unless ``allow_content_inequality``) xxh3-128 digest, in key order.  A lineage names its
    state by it; the peer computes the same from its own vote entries."""
    h = hashlib.blake2b(digest_size=16, person=b"pccl-lineage")
    for e in sorted(entries, key=lambda e: e.key):
        key = e.key.encode()
        h.update(len(key).to_bytes(4, "little") + key)
        h.update(e.dtype.to_bytes(4, "little") + e.nbytes.to_bytes(8, "little"))
        h.update(b"\x00" if e.allow_content_inequality else b"\x01" + e.hash)
    return h.digest()


@dataclasses.dataclass(frozen=True)
class History:
    """What the master remembers of a group's last completed sync (none after a restart)."""

    #: The group's lineage after that sync (its revision is the sync's revision).
    lineage: m.Lineage
    #: The structure elected at that sync.
    schema: Structure
    #: The peers that took part in it (the rules' *continuing* peers).
    continuing: frozenset[int]

    @property
    def revision(self) -> int:
        return self.lineage.revision


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
    #: The lineage id the group continues, or ``None``: nobody in the pool held one (mint one).
    lineage_id: bytes | None = None
    #: How each participant's state stood to the elected one.
    reasons: Mapping[int, m.SyncReason] = dataclasses.field(default_factory=dict)
    #: The pool member whose vote won (smallest id of those holding the winning content).
    winner: int | None = None
    #: Which rule formed the pool: "continuing", "lineage" (holders' votes) or "open" (nobody
    #: held a lineage: most progress among all candidates).
    basis: str = ""


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
    lineage = vote.lineage
    if lineage is not None and (len(lineage.id) != LINEAGE_ID_SIZE or len(lineage.digest) != LINEAGE_ID_SIZE):
        return (f"lineage id and digest must be {LINEAGE_ID_SIZE} bytes each, got {len(lineage.id)} and "
                f"{len(lineage.digest)}")
    return None


# --- the election ----------------------------------------------------------------------------


def _structure(vote: m.SyncVote) -> Structure:
    return structure_of(vote.entries)


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


def _pool(votes: Mapping[int, m.SyncVote], candidates: Sequence[int],
          history: History | None) -> tuple[list[int], bytes | None, str]:
    """The candidates whose state the group may adopt, the lineage id they continue (None: mint
    one) and which rule chose them (the module's "Who wins")."""
    if history is not None:
        continuing = [p for p in candidates if p in history.continuing]
        if continuing:
            return continuing, history.lineage.id, "continuing"
    held = {p: lin for p in candidates if (lin := votes[p].lineage) is not None}
    if history is not None:
        own = {p: lin for p, lin in held.items() if lin.id == history.lineage.id}
        held = own or held
    if not held:
        return list(candidates), None, "open"
    by_id: dict[bytes, list[int]] = {}
    for p, lin in held.items():
        by_id.setdefault(lin.id, []).append(p)

    def rank(lineage_id: bytes) -> tuple[int, int, int, bytes]:
        ps = by_id[lineage_id]
        return (-len(ps), -max(held[p].revision for p in ps), -max(votes[p].revision for p in ps), lineage_id)

    chosen = min(by_id, key=rank)
    members = by_id[chosen]
    furthest = max(held[p].revision for p in members)
    return [p for p in members if held[p].revision == furthest], chosen, "lineage"


def _schema(votes: Mapping[int, m.SyncVote], pool: Sequence[int], history: History | None) -> Structure:
    """The structure most pool members offer (ties: the history's, then the smallest peer id's)."""
    tally = Counter(_structure(votes[p]) for p in pool)
    best = max(tally.values())
    tied = [s for s in tally if tally[s] == best]
    if history is not None and history.schema in tied:
        return history.schema
    return next(_structure(votes[p]) for p in sorted(pool) if _structure(votes[p]) in tied)


def elect(votes: Mapping[int, m.SyncVote], history: History | None, *,
          min_stripe: int = DEFAULT_MIN_STRIPE) -> Election:
    """Decide one group's sync: kicks, rejections, the adopted revision and every receiver's
    first plan.  ``votes`` maps peer id → its (validated) vote; must not be empty.
    ``history``: the group's last completed sync as the master remembers it (``None`` before
    the first sync of the run and after a master restart)."""
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

    if history is not None:
        expected = history.revision + 1
        for p in live:
            if p in history.continuing and votes[p].revision > expected:
                kicks[p] = (KickReason.REVISION_VIOLATION,
                            f"revision {votes[p].revision} but the group expects {expected} (a peer that "
                            "took part in the group's last sync must increase the revision by exactly one)")
    live = [p for p in live if p not in kicks]
    candidates = [p for p in candidates if p not in kicks]
    if not candidates:
        for p in live:
            rejects[p] = (m.SyncRejectCode.NO_SOURCE, "every peer that could send was kicked for its revision")
        return Election(None, kicks, rejects, (), (), {}, ())

    pool, lineage_id, basis = _pool(votes, candidates, history)
    schema = _schema(votes, pool, history)
    reference = next(votes[p] for p in sorted(pool) if _structure(votes[p]) == schema)
    for p in live:
        if _structure(votes[p]) != schema:
            kicks[p] = (KickReason.SHARED_STATE_MISMATCH, _first_difference(votes[p], reference))
    live = [p for p in live if p not in kicks]
    pool = [p for p in pool if p not in kicks]  # never empty: some member offers the schema

    revision = max(votes[p].revision for p in pool)  # most progress wins, within the pool
    at_revision = [p for p in pool if votes[p].revision == revision]
    tally = Counter(_content(votes[p]) for p in at_revision)
    winner_content = min(tally, key=lambda c: (-tally[c], c))
    winner_id = next(p for p in at_revision if _content(votes[p]) == winner_content)
    winner = votes[winner_id]

    sources = tuple(p for p in at_revision if _content(votes[p]) == winner_content)
    for p in live:
        if strategy(p) is SyncStrategy.SEND_ONLY and p not in sources:
            kicks[p] = (KickReason.STRATEGY_VIOLATION,
                        "SEND_ONLY but this peer does not hold the popular state (it would have to receive)")
    live = [p for p in live if p not in kicks]
    receivers = [p for p in live if p not in sources]

    in_pool = set(pool)
    popular_hash = {e.key: e.hash for e in winner.entries}
    reasons: dict[int, m.SyncReason] = {p: m.SyncReason.UP_TO_DATE for p in sources}
    plans: dict[int, ReceiverPlan] = {}
    for rank, r in enumerate(receivers):
        vote = votes[r]
        dirty = any(not e.allow_content_inequality and e.hash != popular_hash[e.key] for e in vote.entries)
        if lineage_id is None:
            reason = m.SyncReason.OUTVOTED if dirty or vote.revision != revision else m.SyncReason.UP_TO_DATE
        elif r in in_pool or (vote.lineage is not None and vote.lineage.id == lineage_id):
            if r not in in_pool or vote.revision < revision:  # a holder that missed syncs, or a given-up step
                reason = m.SyncReason.BEHIND
            else:
                reason = m.SyncReason.DIVERGED if dirty or vote.revision != revision else m.SyncReason.UP_TO_DATE
        else:
            reason = m.SyncReason.NEWCOMER
        reasons[r] = reason
        outdated = reason in (m.SyncReason.BEHIND, m.SyncReason.NEWCOMER) or vote.revision < revision
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
    return Election(revision, kicks, rejects, sources, tuple(live), plans, popular, lineage_id, reasons,
                    winner_id, basis)


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
