"""What one collective guarantees, checked on the wire and on the callers' outcomes.

The rules are stated in ``docs/protocol.rst`` ("One collective: the guarantees as messages");
each checker here is one of them.  They read the messages a *peer* host sends to and reads from
its master (never the master's side: behind a NAT the master sees addresses, not hosts), so an
op is named by ``(instance, seq)`` with ``instance`` from the last ``Welcome`` the peer read (a
restarted master numbers its ops from 1 again, and a peer stalled across the restart may still
read the old one's last messages).  A peer's view starts afresh when the host starts and when
it registers again (its ops ended with the old master connection).

* **safety** — :class:`OneVerdict`: each peer reads at most one final word per op, only for an
  op it was commenced on, a ``Complete`` only after its own ``Done(aborted=False)``; and no op
  completes on one peer and aborts on another.
* **safety** — :class:`AgreedParameters`: every participant of a commenced op voted the same
  kind with the same agreed fields (the kind's row of
  :data:`pccl.protocol.master.kinds.KINDS`).
* **safety** — :class:`PhaseRule`: no peer is commenced while its topology vote or round, or its
  sync, is outstanding, and none is drawn into a topology round or a sync plan with an op that
  has no final word (a peer-agreed op's call that returned its result has one: its commit).
* **safety** — :class:`OutcomeFollowsVerdict`: a call that read ``Complete`` returns its result,
  one that read ``Abort`` raises ``CollectiveAborted``, and a call that returns a result read
  its op's ``Complete`` — or, begun with ``peer_commit`` (``Config.peer_commit``), committed
  on a full known set, which needs every participant of its ring to have reported ready
  (``Done(aborted=False)`` on the wire); and no op commits among its peers on one peer while
  another reads its ``Abort``, unless the committer is no survivor (the master removed it: the
  split docs/protocol.rst, "What it cannot give" (a), allows).
* **liveness** — :class:`NoHungCall`: no collective call runs longer than ``bound`` (the
  scenario's liveness bound; a master restart starts every call's clock again: calls wait for
  it by design; so does the end of a restarted master's wait, ``master_reconnect_timeout`` from
  the first report, for the absent participants of a peer-agreed op a peer reported to it: the
  reporters' calls wait for its verdict, and the calls of the reporters' rings for them —
  :mod:`~pccl_sim.workloads.pccl.orphan_waits`).  A host's calls end with its process; a call its corpse begins at its death
  instant (before its next checkpoint, e.g. after a kill triggered by its own send) is none.
* statistics — :class:`MasterRoundTrips`: the master's answers each successful call read about
  its op while it ran (``master_round_trips_<n>``: calls that waited for ``n``); with ``limit``
  set, a call that waited for more is a **liveness** failure.

The call-level checkers read the phases' trace events: ``all_reduce_call`` / ``collective_call``
(``tag``, ``k``) begin a call; ``all_reduce`` / ``collective`` end it with a result,
``*_aborted`` with ``CollectiveAborted``, ``*_alone`` with ``TooFewPeers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from pccl.protocol.master.kinds import KINDS
from pccl.protocol.messages import CollectiveKind

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent
from .orphan_waits import OrphanWaits

__all__ = ["OneVerdict", "AgreedParameters", "PhaseRule", "OutcomeFollowsVerdict", "NoHungCall",
           "MasterRoundTrips", "op_checkers", "CALL_STARTS", "CALL_ENDS", "Op", "Call", "CallChecker"]

#: Trace events that begin a collective call.
CALL_STARTS = frozenset({"all_reduce_call", "collective_call"})
#: Trace events that end one, and how it ended.
CALL_ENDS = {"all_reduce": "result", "collective": "result", "all_reduce_aborted": "aborted",
             "collective_aborted": "aborted", "all_reduce_alone": "alone", "collective_alone": "alone"}
#: A host's process ended (``net`` events naming it in ``host``).
_HOST_ENDS = frozenset({"kill", "power_off", "exit"})

Op = tuple[int, int]  # (master instance, seq)


def _is_peer(host: str) -> bool:
    return host.startswith("peer")


class _PeerWire(Checker):
    """Follows each peer host's master connection; subclasses say which messages and what to
    remember per host (``_fresh``), and fail through :meth:`_fail` (the first failure only)."""

    name = "peer-wire"
    #: Messages the subclass reads (``Welcome`` and ``Register`` are always followed).
    NAMES: frozenset[str] = frozenset()
    #: Whether what it remembers of a host outlives a registration that carries ops of an
    #: earlier master over (``Register.undecided``); otherwise a registration starts afresh (a
    #: carried op only waits for its verdict: no data path, no phase).
    KEEPS_CARRIED = False
    kind = "safety"

    def __init__(self) -> None:
        self.instance: dict[str, int] = {}
        #: Per host, the ops of an earlier master it reported undecided as it registered again
        #: (``Register.undecided``: seq -> that master's instance): the new master's verdict on
        #: one of them is that op's.
        self.carried: dict[str, dict[int, int]] = {}
        self.hosts: dict[str, Any] = {}
        self.failed = False
        self.sim: Simulation | None = None

    def _fresh(self) -> Any:
        raise NotImplementedError

    def state(self, host: str) -> Any:
        state = self.hosts.get(host)
        if state is None:
            state = self.hosts[host] = self._fresh()
        return state

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError(f"{type(self).__name__} needs the wire (Scenario.sniff)")
        self.sim = sim
        sim.tap.watch(self._wire, names=self.NAMES | {"Welcome", "Register"})

    def _fail(self, message: str) -> None:
        if not self.failed and self.sim is not None:
            self.failed = True  # the first violation is the story; the rest is its echo
            self.sim.fail(self.kind, message, self.name)

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is None or not _is_peer(host):
            return
        if name == "Welcome":
            if direction == "recv":
                self.instance[host] = msg.instance
            return
        if name == "Register":
            if direction == "send":
                carried = {u.seq: u.instance for u in msg.undecided}
                if not (carried and self.KEEPS_CARRIED):
                    self.hosts.pop(host, None)
                if carried:
                    self.carried[host] = carried
                else:
                    self.carried.pop(host, None)
            return
        seq = getattr(msg, "seq", 0)
        instance = self.instance.get(host, 0)
        if name in ("CollectiveComplete", "CollectiveAbort") and seq in self.carried.get(host, {}):
            # (once: the next master's own later ops may reuse the seq, its round ids restart)
            instance = self.carried[host].pop(seq)
        self.message(host, direction, name, msg, (instance, seq))

    def message(self, host: str, direction: str, name: str, msg: Any, op: Op) -> None:
        raise NotImplementedError

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "start":
            self.hosts.pop(event.source, None)
            self.instance.pop(event.source, None)
            self.carried.pop(event.source, None)


# --- rule 1: one verdict --------------------------------------------------------------------------


@dataclasses.dataclass
class _Verdicts:
    commenced: set[Op] = dataclasses.field(default_factory=set)
    reported_success: set[Op] = dataclasses.field(default_factory=set)
    read: dict[Op, str] = dataclasses.field(default_factory=dict)


class OneVerdict(_PeerWire):
    """One final word per op and participant, the same for all, ``Complete`` only after the
    participant's own successful ``Done`` (module docstring)."""

    name = "one-verdict"
    NAMES = frozenset({"CollectiveCommence", "CollectiveBegin", "CollectiveDone", "CollectiveComplete",
                       "CollectiveAbort"})
    KEEPS_CARRIED = True  # a carried op's verdict comes from the next master

    def __init__(self) -> None:
        super().__init__()
        self.verdicts: dict[Op, tuple[str, str]] = {}  # op -> (the first verdict read, by whom)

    def _fresh(self) -> _Verdicts:
        return _Verdicts()

    def message(self, host: str, direction: str, name: str, msg: Any, op: Op) -> None:
        state = self.state(host)
        if name in ("CollectiveCommence", "CollectiveBegin"):
            if direction == ("recv" if name == "CollectiveCommence" else "send"):
                state.commenced.add(op)
            return
        if name == "CollectiveDone":
            if direction == "send" and not msg.aborted:
                state.reported_success.add(op)
            return
        if direction != "recv":
            return
        verdict = "Complete" if name == "CollectiveComplete" else "Abort"
        what = f"tag {msg.tag} seq {msg.seq}"
        if op not in state.commenced:
            self._fail(f"{host} read {verdict} for {what}, an op it was never commenced on")
        elif op in state.read:
            self._fail(f"{host} read a second final word for {what}: {state.read[op]}, then {verdict}")
        elif verdict == "Complete" and op not in state.reported_success:
            self._fail(f"{host} read Complete for {what} before it reported its own success")
        state.read[op] = verdict
        first = self.verdicts.setdefault(op, (verdict, host))
        if first[0] != verdict:
            self._fail(f"{what} split: {first[1]} read {first[0]}, {host} read {verdict}")


# --- rule 3: mismatches never run ---------------------------------------------------------------------


class AgreedParameters(_PeerWire):
    """Every participant of a commenced op voted the same kind and agreed fields (module
    docstring)."""

    name = "agreed-parameters"
    NAMES = frozenset({"CollectiveInit", "CollectiveCommence", "CollectiveBegin"})

    def __init__(self) -> None:
        super().__init__()
        self.votes: dict[Op, tuple[str, Any, str]] = {}  # op -> (first participant, its vote, shown)

    def _fresh(self) -> dict[int, Any]:
        return {}  # tag -> the last CollectiveInit the host sent on it

    def message(self, host: str, direction: str, name: str, msg: Any, op: Op) -> None:
        inits = self.state(host)
        if name == "CollectiveInit":
            if direction == "send":
                inits[msg.tag] = msg
            return
        if name == "CollectiveBegin":  # a vote and a commence in one (the fast path)
            if direction != "send":
                return
            inits[msg.tag] = msg.as_init()
        elif direction != "recv":
            return
        init = inits.get(msg.tag)
        if init is None:
            self._fail(f"{host} was commenced on tag {msg.tag} seq {msg.seq} without having voted it")
            return
        try:
            row = KINDS[CollectiveKind(init.kind)]
        except ValueError:
            self._fail(f"{host} was commenced on tag {msg.tag} seq {msg.seq} for an unknown kind {init.kind}")
            return
        vote = (row.kind, row.key(init))
        first = self.votes.setdefault(op, (host, vote, f"{row.call} {row.describe(init)}"))
        if first[1] != vote:
            self._fail(f"tag {msg.tag} seq {msg.seq} commenced on votes that disagree: {first[0]} voted {first[2]}, "
                       f"{host} voted {row.call} {row.describe(init)}")


# --- rule 5: the phase rule ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Phases:
    topology: bool = False
    sync: bool = False
    open_ops: dict[Op, int] = dataclasses.field(default_factory=dict)  # commenced, no final word read -> tag
    peer_agreed: set[Op] = dataclasses.field(default_factory=set)  # begun with peer_commit
    begun: dict[Op, int] = dataclasses.field(default_factory=dict)  # began here, no arming Commence or final word read -> tag


class PhaseRule(_PeerWire):
    """A peer's collectives never overlap its topology votes and rounds or its syncs (module
    docstring)."""

    name = "phase-rule"
    NAMES = frozenset({"VoteTopology", "VoteOptimize", "ConnectToPeers", "TopologyComplete", "TopologyRejected",
                       "SyncVote", "SyncPlan", "SyncComplete", "SyncRejected",
                       "CollectiveCommence", "CollectiveBegin", "CollectiveComplete", "CollectiveAbort",
                       "CollectiveRejected"})

    def _fresh(self) -> _Phases:
        return _Phases()

    def message(self, host: str, direction: str, name: str, msg: Any, op: Op) -> None:
        state = self.state(host)
        sent = direction == "send"
        if name in ("VoteTopology", "VoteOptimize"):
            if sent:
                state.topology = True
        elif name == "SyncVote":
            if sent:
                state.sync = True
        elif name == "CollectiveBegin":
            if sent:
                self._commenced(host, state, msg, op, "began")
                state.begun[op] = msg.tag
                if msg.peer_commit:
                    state.peer_agreed.add(op)
        elif sent:
            return
        elif name in ("TopologyComplete", "TopologyRejected"):
            state.topology = False
        elif name in ("SyncComplete", "SyncRejected"):
            state.sync = False
        elif name in ("ConnectToPeers", "SyncPlan"):
            if state.open_ops:
                ops = ", ".join(f"tag {tag} seq {seq}" for (_, seq), tag in sorted(state.open_ops.items()))
                what = "a topology round" if name == "ConnectToPeers" else "a sync plan"
                self._fail(f"{host} was drawn into {what} ({name}) while its collectives ran: {ops}")
            if name == "ConnectToPeers":
                state.topology = True
        elif name == "CollectiveCommence":
            # A begun op's one-way Commence only says everyone began (it arms the watchdog): its
            # Begin was the commencement, checked as it went out.  It may come after the call
            # committed the op on its acks (peer commit) and its host went on to vote a topology.
            if state.begun.pop(op, None) is None and op not in state.open_ops:
                self._commenced(host, state, msg, op, "was commenced on")
        elif name == "CollectiveRejected":  # (a Begin the master refused: that op never ran)
            for ops in (state.open_ops, state.begun):
                for key in [key for key, tag in ops.items() if tag == msg.tag]:
                    del ops[key]
        else:  # CollectiveComplete / CollectiveAbort
            state.open_ops.pop(op, None)
            state.begun.pop(op, None)

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        super().on_event(sim, event)
        if CALL_ENDS.get(event.kind) == "result" and event.source in self.hosts:
            state = self.hosts[event.source]  # a peer-agreed op's call that returned committed it
            for op in [op for op, tag in state.open_ops.items() if tag == event.data["tag"] and op in state.peer_agreed]:
                del state.open_ops[op]
                state.peer_agreed.discard(op)

    def _commenced(self, host: str, state: _Phases, msg: Any, op: Op, verb: str) -> None:
        if state.topology or state.sync:
            why = "topology vote or round" if state.topology else "shared-state sync"
            self._fail(f"{host} {verb} tag {msg.tag} seq {msg.seq} while its {why} was outstanding")
        state.open_ops[op] = msg.tag


# --- the calls: rule 2, rule 6 and the round trips ----------------------------------------------------


@dataclasses.dataclass
class Call:
    k: int
    started: float
    op: Op | None = None  # bound by the Commence it read
    verdict: str | None = None  # the final word it read for its op
    answers: int = 0  # the master's answers about its op it read
    peer_commit: bool = False  # its op was begun with peer_commit
    ring: tuple[int, ...] = ()  # its host's ring (peer ids) when it began its op


class CallChecker(Checker):
    """Follows every collective call (by host and tag, from its ``*_call`` event to its end) and
    what its host read from the master meanwhile about the call's op; :meth:`ended` is told how
    each ended."""

    name = "calls"

    #: Messages read besides the calls' own (subclasses add theirs).
    EXTRA: tuple[str, ...] = ()

    def __init__(self) -> None:
        self.instance: dict[str, int] = {}
        self.calls: dict[tuple[str, int], Call] = {}
        self.failed = False
        self.sim: Simulation | None = None
        self.rings: dict[str, tuple[int, ...]] = {}  # host -> its ring's peer ids (its last TopologyComplete)
        #: Hosts whose process ended and has not started again: code of a killed incarnation still runs
        #: at its death instant (until its next checkpoint) and may record a call start; nobody waits for it.
        self.dead: set[str] = set()

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError(f"{type(self).__name__} needs the wire (Scenario.sniff)")
        self.sim = sim
        sim.tap.watch(self._wire, names=("Welcome", "CollectiveCommence", "CollectiveBegin", "CollectiveRejected",
                                         "CollectiveComplete", "CollectiveAbort", "TopologyComplete", *self.EXTRA))

    def _fail(self, kind: str, message: str) -> None:
        if not self.failed and self.sim is not None:
            self.failed = True
            self.sim.fail(kind, message, self.name)

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is None or direction != ("send" if name in ("CollectiveBegin", "CollectiveDone") else "recv"):
            return
        if name == "Welcome":
            self.instance[host] = msg.instance
            return
        if name == "TopologyComplete":
            self.rings[host] = tuple(endpoint.peer_id for endpoint in msg.ring)
            return
        if name in self.EXTRA:
            self.read(host, name, msg, (self.instance.get(host, 0), getattr(msg, "seq", 0)))
        call = self.calls.get((host, msg.tag))
        if call is None or name == "CollectiveDone":
            return
        if name == "CollectiveBegin":  # began without waiting for an answer
            call.op, call.verdict = (self.instance.get(host, 0), msg.seq), None
            call.peer_commit, call.ring = msg.peer_commit, self.rings.get(host, ())
            return
        if name == "CollectiveRejected":
            call.answers += 1
            return
        op = (self.instance.get(host, 0), msg.seq)
        if name == "CollectiveCommence":
            if op == call.op and call.verdict is None:
                return  # a begun op's Commence: every participant began; nobody waited for it
            call.op, call.verdict = op, None  # a new attempt
            call.answers += 1
        elif op == call.op and call.verdict is None:
            call.verdict = "Complete" if name == "CollectiveComplete" else "Abort"
            call.answers += 1

    def _forget_host(self, host: str) -> None:
        for key in [key for key in self.calls if key[0] == host]:
            del self.calls[key]

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        kind = event.kind
        if kind in CALL_STARTS:
            if event.source in self.dead:
                return  # a corpse's call, begun at its death instant: it hangs nobody
            self.calls[(event.source, event.data["tag"])] = Call(event.data["k"], event.t)
        elif kind in CALL_ENDS:
            call = self.calls.pop((event.source, event.data["tag"]), None)
            if call is not None:
                self.ended(event.source, event.data, call, CALL_ENDS[kind])
        elif kind == "start":
            self._forget_host(event.source)
            self.dead.discard(event.source)
            self.instance.pop(event.source, None)
            if event.source == "master":
                self.master_started(event.t)
        elif kind in _HOST_ENDS and event.source == "net":
            self._forget_host(event.data.get("host") or "")
            self.dead.add(event.data.get("host") or "")
        elif kind == "probe" and event.source == "monitor":
            self.tick(event.t)

    def ended(self, host: str, data: Mapping[str, Any], call: Call, outcome: str) -> None:
        """A call ended: ``outcome`` is ``result``, ``aborted`` or ``alone``."""

    def read(self, host: str, name: str, msg: Any, op: Op) -> None:
        """A message of :attr:`EXTRA` on ``host``'s master connection (sent or read)."""

    def master_started(self, t: float) -> None:
        """A master (re)started at ``t``."""

    def tick(self, t: float) -> None:
        """The scenario's periodic probe (a quiet cluster has no other events)."""


class OutcomeFollowsVerdict(CallChecker):
    """A call ends as the master's final word it read says, or as its peers agreed (module
    docstring)."""

    name = "outcome-follows-verdict"
    EXTRA = ("CollectiveDone",)

    def __init__(self, master_state: Callable[[Simulation], Any] | None = None) -> None:
        super().__init__()
        self.master_state = master_state
        self.ready: dict[Op, set[int]] = {}  # op -> peer ids that reported it done (the wire)
        self.committed: dict[Op, tuple[str, int]] = {}  # op -> a host that committed it among peers, its id
        self.aborts: dict[Op, str] = {}  # op -> a host whose call read its Abort
        self.ids: dict[str, int] = {}  # host -> its peer id (its last Welcome)

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is not None and name == "Welcome" and direction == "recv":
            self.ids[host] = msg.peer_id
        super()._wire(host, direction, name, peer, msg)

    def read(self, host: str, name: str, msg: Any, op: Op) -> None:
        if not msg.aborted and host in self.ids:
            self.ready.setdefault(op, set()).add(self.ids[host])

    def ended(self, host: str, data: Mapping[str, Any], call: Call, outcome: str) -> None:
        what = f"{host}: call #{call.k} on tag {data['tag']}"
        if call.op is not None:
            what += f" (seq {call.op[1]})"
        if outcome == "result" and call.verdict is None and call.peer_commit and call.op is not None:
            reported = self.ready.get(call.op, set())
            missing = sorted(pid for pid in call.ring if pid not in reported)
            if missing or not call.ring:
                self._fail("safety", f"{what} committed among its peers, but {', '.join(f'{p:x}' for p in missing)} "
                                     "never reported ready")
                return
            self.committed.setdefault(call.op, (host, self.ids.get(host, 0)))
            self._split(call.op)
        elif outcome == "result" and call.verdict != "Complete":
            read = "no final word" if call.verdict is None else call.verdict
            self._fail("safety", f"{what} returned a result after reading {read} for its op")
        elif outcome != "result" and call.verdict == "Complete":
            self._fail("safety", f"{what} read Complete for its op but ended {outcome}: "
                                 f"{data.get('error', '')}".rstrip(": "))
        elif call.verdict == "Abort" and call.op is not None:
            self.aborts.setdefault(call.op, host)
            self._split(call.op)

    def _split(self, op: Op) -> None:
        if op not in self.committed or op not in self.aborts:
            return
        host, pid = self.committed[op]
        state = self.master_state(self.sim) if self.master_state is not None and self.sim is not None else None
        if state is not None and state.conn_of(pid) is None:
            return  # the committer is no survivor: the master removed it (docs/protocol.rst, (a))
        self._fail("safety", f"seq {op[1]} split: {host} committed it among its peers, {self.aborts[op]} read Abort")


class NoHungCall(CallChecker):
    """No collective call runs longer than ``bound`` seconds (module docstring)."""

    name = "no-hung-call"

    def __init__(self, bound: float, waits: OrphanWaits | None = None) -> None:
        super().__init__()
        self.bound = bound
        self.waits = waits

    def master_started(self, t: float) -> None:
        for call in self.calls.values():  # they waited for the master, as they should
            call.started = max(call.started, t)

    def _clock(self, call: Call) -> float:
        """When ``call``'s clock started: its start, or the end of a restarted master's
        documented wait for a reported op that ran meanwhile (its deadline while it runs;
        :mod:`~pccl_sim.workloads.pccl.orphan_waits`)."""
        return call.started if self.waits is None else max(call.started, self.waits.waited_until())

    def tick(self, t: float) -> None:
        if self.failed or not self.calls:
            return
        (host, tag), call = min(self.calls.items(), key=lambda item: self._clock(item[1]))
        began = self._clock(call)
        if t - began > self.bound:
            state = "without a Commence" if call.op is None else f"in seq {call.op[1]}, final word {call.verdict}"
            since = "it began" if began == call.started else "a restarted master's wait for a reported op ended"
            self._fail("liveness", f"{host}: call #{call.k} on tag {tag} still runs {t - began:.1f} s after {since} "
                                   f"(bound {self.bound:.1f} s; {state})")

    def at_end(self, sim: Simulation) -> None:
        self.tick(sim.now)


class MasterRoundTrips(CallChecker):
    """Counts the master's answers each successful call waited for (module docstring)."""

    name = "master-round-trips"

    def __init__(self, limit: int | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.histogram: dict[int, int] = {}

    def ended(self, host: str, data: Mapping[str, Any], call: Call, outcome: str) -> None:
        if outcome != "result":
            return
        n = call.answers
        self.histogram[n] = self.histogram.get(n, 0) + 1
        if self.limit is not None and n > self.limit:
            self._fail("liveness", f"{host}: call #{call.k} on tag {data['tag']} waited for {n} master round trips "
                                   f"(at most {self.limit})")

    def at_end(self, sim: Simulation) -> None:
        for n, calls in sorted(self.histogram.items()):
            sim.trace.stats[f"master_round_trips_{n}"] = calls


def op_checkers(liveness_bound: float, *, max_round_trips: int | None = None,
                master_state: Callable[[Simulation], Any] | None = None,
                waits: OrphanWaits | None = None) -> list[Checker]:
    """The checkers of one collective's guarantees, for one run (``master_state``: the live
    master's machine, or ``None`` while it is down; ``waits``: a restarted master's documented
    waits for reported ops, which :class:`NoHungCall` does not count)."""
    return [OneVerdict(), AgreedParameters(), PhaseRule(), OutcomeFollowsVerdict(master_state),
            NoHungCall(liveness_bound, waits), MasterRoundTrips(max_round_trips)]
