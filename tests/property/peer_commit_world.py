"""An exhaustive model of peer-agreed completion (pccl.protocol.peer_commit) for 2-4 participants.

A *world* is every participant's (phase, known set, health), the messages in flight and the
master's resolution.  :func:`explore` walks every interleaving the adversary can choose within a
fault budget — a known set or a nack delivered late (in any order) or, from a participant that
crashed or was cut off, never; a participant's data path finishing or failing; a crash, a
partition (from everyone, or from the master alone), a cancelled caller, a master restart or a
master query out of the blue (the phase rule's) at every step; a participant in doubt may also
ask the others — and checks the invariants in every world it reaches:

* ``agreement``: no two survivors (alive, not cut off) with different outcomes;
* ``validity``: nobody committed unless every participant held its full result;
* ``liveness``: in a world where nothing can happen any more, every survivor decided;
* ``no-error``: no transition the rules exclude, no split the master's rule sees.

Survivors and the rest: a crashed or cut-off participant, or one that lost the master for good,
is no survivor (the master declares it dead and fences it); what it decided binds nobody, and
:func:`explore` counts the final worlds where a non-survivor decided otherwise than the
survivors (``non_survivor_splits``).

The master may declare dead any participant that crashed or was cut off, also after a restart
(every peer reports its undecided ops when it registers again, ``Register.undecided``: a ready
one's report reaches the new master as its ``Done(ok)``, an in-doubt one's as its ask, and the
master declares dead whoever has not registered within ``master_reconnect_timeout``:
:mod:`pccl.protocol.master.orphans`); partitions never heal here, so a fence that must survive
a master restart is not walked.

The master is :class:`pccl.protocol.master.peer_resolve.Resolution` (a new one per master
epoch), fed fast commit's one-way ``Done`` reports as well as asks, answers and deaths: a
participant sends ``Done(ok)`` as it becomes ready (in the same step as its first known set, the
two delivered in any order) and ``Done(aborted)`` as it nacks; a ``Done`` from a participant that
crashed or was cut off may be lost, and none arrives after the master declared its sender dead.
The master's verdict on every ``Done(ok)`` races the known sets: :class:`Rules` lets a ready
participant read it or ignore it.

Known sets travel all-to-all (each participant floods its set when it grows); the dissemination
pattern is a subset of these deliveries, so the safety shown here holds for it too.  One
reduction keeps the walk small: a channel carries only the newest set its sender sent (sets only
grow, and a FIFO connection delivers the older first; reading both at once is one of the orders).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from pccl.protocol.master.peer_resolve import Resolution, Send, Word
from pccl.protocol.peer_commit import (DECIDED, TRANSITIONS, Answer, Effect, Event, Phase, Verdict,
                                       learned_from_peer, merge, resolve, step)

P, E, X = Phase, Event, Effect
Table = Mapping[tuple[Phase, Event], tuple[Phase, tuple[Effect, ...]]]
Resolver = Callable[..., "Verdict | None"]


@dataclass(frozen=True)
class Part:
    phase: Phase
    known: frozenset[int]
    alive: bool = True
    cut: bool = False  # alive, but partitioned from everyone (the master too)
    masterless: bool = False  # alive, talks to its peers, but has lost the master for good
    asked_peers: bool = False  # in doubt, it asked the other participants
    held: bool = False  # it held its full result at some point
    waited: bool = False  # it waited for the master (it was in doubt)


@dataclass(frozen=True)
class Master:
    """The master of one epoch: its :class:`Resolution` of the op (a new master starts a new one)."""

    res: Resolution
    epoch: int = 0

    @property
    def dead(self) -> frozenset[int]:
        return self.res.dead

    @property
    def resolving(self) -> bool:
        return self.res.querying


# messages: ("known", src, dst, bits) ("nack", src, dst) ("lost", dst, about)
#           ("ask"|"answer", src, epoch, answer) ("query", dst, epoch) ("verdict", dst, epoch, v)
#           ("done", src, epoch, ok): fast commit's one-way Done, sent as its sender becomes ready
#           (ok) or nacks (not ok); no master word (nobody waits for an answer to it)
Msg = tuple
MASTER_WORDS = ("ask", "answer", "query", "verdict", "done")
PEER_WORDS = ("known", "nack", "pquery", "preply")  # ("pquery", src, dst) ("preply", src, dst, answer)


@dataclass(frozen=True)
class World:
    parts: tuple[Part, ...]
    msgs: frozenset[Msg]
    master: Master
    budget: int
    master_words: bool = False  # a message to or from the master was ever sent (besides retire)

    @property
    def group(self) -> frozenset[int]:
        return frozenset(range(len(self.parts)))

    def survivor(self, i: int) -> bool:
        part = self.parts[i]
        return part.alive and not part.cut and not part.masterless

    def reachable(self, i: int) -> bool:
        """Its peers can reach it."""
        part = self.parts[i]
        return part.alive and not part.cut


def start(n: int, budget: int, rules: Rules | None = None) -> World:
    res = Resolution.open(range(n), rule=(rules or Rules()).resolver)
    return World(tuple(Part(P.RUNNING, frozenset()) for _ in range(n)), frozenset(), Master(res), budget)


@dataclass
class Rules:
    table: Table = field(default_factory=lambda: TRANSITIONS)
    resolver: Resolver = resolve
    learn: Callable[[Answer], "Verdict | None"] = learned_from_peer
    #: A participant that is ready (asked nothing) acts on the master's verdict; False: it ignores
    #: it (the verdict that every ``Done(ok)`` decides races its acks) and commits on its set.
    ready_reads_verdict: bool = True
    #: The master aborts an op at once when a participant dies before its ``Done`` (fast
    #: commit's rule today; a wrong one once participants commit on their own).
    abort_on_death: bool = False
    #: Participants send fast commit's one-way ``Done`` (False: the master hears only asks and
    #: answers, a walk about ten times smaller, for the longest walks).
    done_reports: bool = True


class Violation(AssertionError):
    def __init__(self, what: str, trace: list[str]) -> None:
        super().__init__(f"{what} after: " + " ; ".join(trace))
        self.what = what
        self.trace = trace


def _canon(world: World) -> World:
    """Drop what can never be delivered: messages to a crashed or cut-off participant, and a
    master's words to or from an epoch that is over."""
    keep = []
    for m in world.msgs:
        kind = m[0]
        if kind in PEER_WORDS:
            if not world.reachable(m[2]):
                continue
        elif kind in ("lost", "query", "verdict"):
            if not world.survivor(m[1]):
                continue
        elif kind == "done" and m[1] in world.master.dead:
            continue  # the master closed its connection when it declared it dead
        if kind in MASTER_WORDS and m[2] != world.master.epoch:
            continue
        keep.append(m)
    return replace(world, msgs=frozenset(keep))


def _apply(world: World, i: int, event: Event, rules: Rules, bits: frozenset[int] | None = None,
           reply_to: int | None = None) -> World:
    part = world.parts[i]
    group = world.group
    if bits is None:
        phase, known, effects = step(part.phase, part.known, i, group, event, table=rules.table)
    else:
        phase, known, effects = merge(part.phase, part.known, i, group, bits, table=rules.table)
    held = part.held or (event is E.RESULT_HELD and part.phase is P.RUNNING)
    waited = part.waited or (phase is P.IN_DOUBT)
    parts = list(world.parts)
    parts[i] = replace(part, phase=phase, known=known, held=held, waited=waited)
    world = replace(world, parts=tuple(parts))
    msgs = set(world.msgs)
    epoch = world.master.epoch
    words = world.master_words
    for effect in effects:
        if part.cut:
            continue  # nothing it sends gets anywhere
        if (rules.done_reports and effect in (X.SEND_KNOWN, X.SEND_NACK) and part.phase is P.RUNNING
                and not part.masterless):
            msgs.add(("done", i, epoch, effect is X.SEND_KNOWN))  # before its acks (any order here)
        if effect is X.SEND_KNOWN:  # a newer set replaces the undelivered one on its channel
            msgs.difference_update(m for m in world.msgs if m[0] == "known" and m[1] == i)
            msgs.update(("known", i, j, known) for j in group if j != i)
        elif effect is X.SEND_NACK:
            msgs.update(("nack", i, j) for j in group if j != i)
        elif effect is X.ANSWER and reply_to is not None:
            msgs.add(("preply", i, reply_to, Answer(phase, known)))
        elif effect in (X.ASK_MASTER, X.ANSWER) and not part.masterless:
            msgs.add(("ask" if effect is X.ASK_MASTER else "answer", i, epoch, Answer(phase, known)))
            words = True
    return replace(world, msgs=frozenset(msgs), master_words=words)


def _master_sends(world: World, res: Resolution, sends: tuple[Send, ...]) -> World:
    """The master's :class:`Resolution` moved to ``res``; its messages go out."""
    m = world.master
    msgs = set(world.msgs)
    words = world.master_words
    for send in sends:
        if send.word is Word.QUERY:
            msgs.update(("query", j, m.epoch) for j in send.to)
            words = True
        else:
            msgs.update(("verdict", j, m.epoch, send.verdict) for j in send.to)
    return replace(world, master=replace(m, res=res), msgs=frozenset(msgs), master_words=words)


def _master_hears(world: World, i: int, answer: Answer, asked: bool, rules: Rules) -> World:
    res = world.master.res
    world = replace(world, master_words=True)
    return _master_sends(world, *(res.ask(i, answer) if asked else res.answer(i, answer)))


def _master_declares_dead(world: World, i: int, rules: Rules) -> World:
    res = world.master.res
    if rules.abort_on_death and res.verdict is None and i not in res.ready | res.nacked:
        res = replace(res, nacked=res.nacked | {i})  # as if it had reported a failure
    return _master_sends(world, *res.death(i))


def successors(world: World, rules: Rules) -> Iterator[tuple[str, World]]:
    """Every step the adversary (or the system) can take from ``world``, named for a trace."""
    n = len(world.parts)
    faulty = any(not world.reachable(j) for j in range(n))
    for i, part in enumerate(world.parts):
        if not part.alive:
            continue
        if part.phase is P.RUNNING and not part.held:
            yield f"{i} holds its result", _apply(world, i, E.RESULT_HELD, rules)
            if faulty:  # a ring that loses a participant fails (no budget: the fault was paid)
                yield f"{i}'s ring fails", _apply(world, i, E.RING_FAILED, rules)
        if world.budget <= 0:
            continue
        spent = replace(world, budget=world.budget - 1)
        if part.phase is P.RUNNING and not part.held and not faulty:
            yield f"{i}'s ring fails", _apply(spent, i, E.RING_FAILED, rules)
        if part.phase not in DECIDED:
            yield f"{i} is cancelled", _apply(spent, i, E.CANCEL, rules)
        parts = list(spent.parts)
        parts[i] = replace(part, alive=False)
        yield f"{i} crashes", _canon(replace(spent, parts=tuple(parts)))
        if not part.cut:
            parts[i] = replace(part, cut=True)
            cut = _canon(replace(spent, parts=tuple(parts)))
            cut = _apply(cut, i, E.MASTER_LOST, rules)
            yield f"{i} is cut off", _apply(cut, i, E.PEER_LOST, rules)
            if not part.masterless:
                parts[i] = replace(part, masterless=True)
                alone = _canon(replace(spent, parts=tuple(parts)))
                yield f"{i} loses the master for good", _apply(alone, i, E.MASTER_LOST, rules)
    if world.budget > 0:
        spent = replace(world, budget=world.budget - 1)
        fresh = Resolution.open(range(n), rule=rules.resolver)
        restarted = _canon(replace(spent, master=Master(fresh, epoch=world.master.epoch + 1)))
        for i in range(n):
            if restarted.survivor(i):
                # It registers again with its undecided op (Register.undecided): in doubt, that
                # report is its ask (MASTER_LOST's ASK_MASTER); ready, its Done(ok).
                if rules.done_reports and restarted.parts[i].phase is P.READY:
                    restarted = replace(restarted, msgs=restarted.msgs | {("done", i, world.master.epoch + 1, True)})
                restarted = _apply(restarted, i, E.MASTER_LOST, rules)
        yield "the master restarts", restarted
        if not world.master.resolving and world.master.res.verdict is None:
            yield "the master queries (phase rule)", _canon(
                _master_sends(spent, *spent.master.res.query_all()))
    for i, part in enumerate(world.parts):
        if world.reachable(i) and part.phase is P.IN_DOUBT and not part.asked_peers:
            parts = list(world.parts)
            parts[i] = replace(part, asked_peers=True)
            msgs = set(world.msgs) | {("pquery", i, j) for j in range(n) if j != i}
            yield f"{i} asks the others", _canon(replace(world, parts=tuple(parts), msgs=frozenset(msgs)))
    for i in range(n):
        if not world.survivor(i) and i not in world.master.dead:
            msgs = set(world.msgs) | {("lost", j, i) for j in range(n) if j != i}
            declared = replace(world, msgs=frozenset(msgs))
            yield f"the master declares {i} dead", _canon(_master_declares_dead(declared, i, rules))
    for msg in sorted(world.msgs, key=repr):
        rest = replace(world, msgs=world.msgs - {msg})
        kind = msg[0]
        if (kind in PEER_WORDS or kind == "done") and not world.reachable(msg[1]):
            yield f"{msg[:3]} is lost", rest
        if kind == "known":
            yield (f"{msg[2]} gets {sorted(msg[3])} from {msg[1]}",
                   _apply(rest, msg[2], E.ALL_KNOWN, rules, msg[3]))
        elif kind == "nack":
            yield f"{msg[2]} gets a nack from {msg[1]}", _apply(rest, msg[2], E.NACK, rules)
        elif kind == "lost":
            yield f"{msg[1]} hears {msg[2]} is dead", _apply(rest, msg[1], E.PEER_LOST, rules)
        elif kind == "query":
            yield f"{msg[1]} is queried", _apply(rest, msg[1], E.QUERY, rules)
        elif kind == "verdict":
            event = E.COMMIT if msg[3] is Verdict.COMMIT else E.ABORT
            if world.parts[msg[1]].phase is P.READY and not rules.ready_reads_verdict:
                yield f"{msg[1]} ignores {msg[3].value}", rest
            else:
                yield f"{msg[1]} hears {msg[3].value}", _apply(rest, msg[1], event, rules)
        elif kind == "done":
            res, sends = world.master.res.done(msg[1], msg[3])
            yield f"the master hears {msg[1]}'s Done({'ok' if msg[3] else 'aborted'})", _master_sends(
                rest, res, sends)
        elif kind == "pquery":
            yield f"{msg[2]} is asked by {msg[1]}", _apply(rest, msg[2], E.PEER_QUERY, rules, reply_to=msg[1])
        elif kind == "preply":
            learned = rules.learn(msg[3])
            label = f"{msg[2]} hears from {msg[1]} that it is {msg[3].phase.value}"
            if learned is None or world.parts[msg[2]].phase in DECIDED:  # nothing, or stale
                yield label, rest
            else:
                yield label, _apply(rest, msg[2], E.COMMIT if learned is Verdict.COMMIT else E.ABORT, rules)
        elif kind in ("ask", "answer"):
            yield f"the master hears {msg[1]} {msg[3].phase.value}", _master_hears(
                rest, msg[1], msg[3], kind == "ask", rules)


def check(world: World) -> str | None:
    """The invariant ``world`` breaks, or ``None``."""
    n = len(world.parts)
    outcomes = {world.parts[i].phase for i in range(n) if world.survivor(i)} & DECIDED
    if len(outcomes) > 1:
        return "agreement"
    if any(p.phase is P.COMMITTED for p in world.parts) and not all(p.held for p in world.parts):
        return "validity"
    return None


@dataclass
class Report:
    worlds: int = 0
    terminal: int = 0
    non_survivor_splits: int = 0
    master_words: int = 0  # terminal worlds where the master was asked or answered


def explore(n: int, budget: int, rules: Rules | None = None, limit: int = 2_000_000) -> Report:
    """Walk every world reachable from :func:`start`; raise :class:`Violation` (with a trace) at
    the first broken invariant, an excluded transition, or a live survivor left undecided."""
    rules = rules or Rules()
    report = Report()
    first = start(n, budget, rules)
    seen: dict[World, tuple[World | None, str]] = {first: (None, "start")}
    todo = [first]

    def trace(world: World) -> list[str]:
        steps = []
        at: World | None = world
        while at is not None:
            parent, label = seen[at]
            steps.append(label)
            at = parent
        return steps[::-1]

    while todo:
        world = todo.pop()
        report.worlds += 1
        if report.worlds > limit:
            raise RuntimeError(f"more than {limit} worlds: lower the budget")
        broken = check(world)
        if broken:
            raise Violation(broken, trace(world))
        nexts = 0
        try:
            for label, nxt in successors(world, rules):
                nxt = _canon(nxt)
                nexts += 1
                if nxt not in seen:
                    seen[nxt] = (world, label)
                    todo.append(nxt)
        except Exception as exc:  # an excluded transition, or a split the master saw
            raise Violation(f"{type(exc).__name__}: {exc}", trace(world)) from exc
        if nexts == 0:
            report.terminal += 1
            if any(world.survivor(i) and world.parts[i].phase not in DECIDED for i in range(n)):
                raise Violation("liveness", trace(world))
            survivors = {world.parts[i].phase for i in range(n) if world.survivor(i)}
            others = {p.phase for i, p in enumerate(world.parts) if not world.survivor(i)} & DECIDED
            if survivors and others - survivors:
                report.non_survivor_splits += 1
            report.master_words += world.master_words
    return report


def walk(n: int, budget: int, choose: Callable[[int], int], rules: Rules | None = None,
         max_steps: int = 400) -> World:
    """One interleaving, each step picked by ``choose(number of choices)`` (Hypothesis draws it
    for 4 participants, where :func:`explore` would take too long); checks as :func:`explore` does
    and returns the world it ended in."""
    rules = rules or Rules()
    world = start(n, budget, rules)
    trace = ["start"]
    for _ in range(max_steps):
        broken = check(world)
        if broken:
            raise Violation(broken, trace)
        options = [(label, _canon(nxt)) for label, nxt in successors(world, rules)]
        if not options:
            if any(world.survivor(i) and world.parts[i].phase not in DECIDED for i in range(n)):
                raise Violation("liveness", trace)
            return world
        label, world = options[choose(len(options))]
        trace.append(label)
    raise Violation("no end within max_steps", trace)
