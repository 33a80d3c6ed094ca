"""How long a restarted master may keep a peer-agreed op of the master before it open, by its
documented rule — so that the liveness checkers do not call that wait a hang.

docs/protocol.rst, "A master restart while peers are in doubt" (and docs/concepts.rst on a
master restart): a participant ready for a peer-agreed op, or in doubt about it, that loses its
master keeps the op, reports it as it registers again (``Register.undecided``) and waits for the
new master's verdict; the new master (:mod:`pccl.protocol.master.orphans`) declares dead a
participant that has not registered within ``Config.master_reconnect_timeout`` of the op's
*first report* — 60 s by default, far longer than the other timeouts the liveness bound is made
of.  A participant that died across the restart (or came back as a new process, under a new id)
is one the master has to wait for that long: until then the reporting peer's call, and so its
next step, waits by design — and so do the calls of the other members of its ring in the new
master's rounds (a reporter registers, is accepted, and is drawn into the next op while its
call still waits for the old op's verdict: ``tests/sim/schedules/orphan_wait_seed16_shrunk.json``).

:class:`OrphanWaits` reads that off the wire (the peers' side, like the op checkers: a peer
host's ``Register`` it sends, the ``CollectiveComplete``/``CollectiveAbort`` it reads about a
carried op) and tells

* :meth:`OrphanWaits.waited_until` — the last time any such wait ended (the earlier of its
  deadline — first report to the live master + ``master_reconnect_timeout`` — and the moment no
  reporter waits for the op any more: each read its verdict, died, or registered again without
  it), or ends, if one is running (its deadline).  :class:`~.op_checkers.NoHungCall` starts the
  clock of a call that ran meanwhile there (any call, not only the reporters' and their rings':
  a hang elsewhere is found up to ``master_reconnect_timeout`` later, not missed), and
  :class:`~.checkers.FullMembershipLiveness` its own if that is after the quiet window began.

An op of the live master (its ``instance``, read off a peer's ``Welcome``) that a peer whose
connection broke reports as it registers again is no such wait: that master ignores the report
(:mod:`pccl.protocol.master.machine`) and waits for nobody.  A master restart starts the clocks
afresh: the next master's deadline counts from the first report *to it*.  The waits are the
master's rule, read from the config the scenario gives its hosts, not a bound of the checker: a
master that waits longer than its rule (the mutant ``orphan-wait-tenfold``,
:mod:`pccl_sim.workloads.pccl.mutants`) still fails the run.
"""

from __future__ import annotations

from typing import Any

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent

__all__ = ["OrphanWaits"]

Op = tuple[int, int]  # (the reporting master's instance, seq)


class OrphanWaits(Checker):
    """Ops reported undecided to a restarted master and the documented wait for them (module
    docstring).  Reports nothing itself; the liveness checkers ask it."""

    name = "orphan-waits"

    def __init__(self, reconnect_timeout: float) -> None:
        self.timeout = reconnect_timeout
        self.sim: Simulation | None = None
        #: op -> when it was first reported to the live master
        self.first: dict[Op, float] = {}
        #: op -> hosts that reported it and still wait for its verdict
        self.waiting: dict[Op, set[str]] = {}
        #: op -> when its wait ended (deadline reached or nobody waits any more), once it has
        self.ended: dict[Op, float] = {}
        #: host -> seq -> instance of the ops it carried into its last registration
        self.carried: dict[str, dict[int, int]] = {}
        #: The live master's instance, once a peer read its Welcome (None: not known yet, or
        #: the master restarted since).  It waits for no report of its own ops (a peer whose
        #: connection broke reports them as it registers again; the master ignores them).
        self.live: int | None = None

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError("OrphanWaits needs the wire (Scenario.sniff)")
        self.sim = sim
        sim.tap.watch(self._wire, names=("Register", "Welcome", "CollectiveComplete", "CollectiveAbort"))

    # --- what the liveness checkers ask -------------------------------------------------------

    def waited_until(self) -> float:
        """The latest end of a documented wait that has ended or is running (a running one ends
        at its deadline); ``-inf`` if there was none."""
        latest = float("-inf")
        for op, first in self.first.items():
            latest = max(latest, self.ended.get(op, first + self.timeout))
        for op, at in self.ended.items():
            latest = max(latest, at)
        return latest

    # --- the wire and the hosts ---------------------------------------------------------------

    def _now(self) -> float:
        return self.sim.now if self.sim is not None else 0.0

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is None or not host.startswith("peer"):
            return
        if name == "Welcome":
            if direction == "recv":
                self.live = msg.instance
            return
        if name == "Register":
            if direction != "send":
                return
            now = self._now()
            # (An op of the live master is no orphan: it waits for nobody, pccl.protocol.master.machine.)
            carried = {u.seq: u.instance for u in msg.undecided if u.instance != self.live}
            for op, hosts in list(self.waiting.items()):
                if host in hosts and carried.get(op[1]) != op[0]:
                    self._stops(op, host, now)  # registered again without it: it no longer waits
            self.carried[host] = carried
            for seq, instance in carried.items():
                op = (instance, seq)
                if op not in self.first:
                    self.first[op] = now
                    self.ended.pop(op, None)
                self.waiting.setdefault(op, set()).add(host)
            return
        if direction != "recv":
            return
        instance = self.carried.get(host, {}).pop(msg.seq, None)
        if instance is not None:
            self._stops((instance, msg.seq), host, self._now())

    def _stops(self, op: Op, host: str, now: float) -> None:
        hosts = self.waiting.get(op)
        if hosts is None:
            return
        hosts.discard(host)
        if not hosts:
            del self.waiting[op]
            first = self.first.get(op)
            if first is not None:
                self.ended[op] = min(now, first + self.timeout)

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "start":
            if event.source == "master":
                # A new master knows no op: its deadlines count from the first report to it.
                # The waits of the old one ended now (or at their deadlines, if earlier).
                for op, first in self.first.items():
                    self.ended[op] = min(self.ended.get(op, event.t), first + self.timeout, event.t)
                self.first.clear()
                self.waiting.clear()
                self.live = None
            else:
                self.carried.pop(event.source, None)
                for op, hosts in list(self.waiting.items()):
                    if event.source in hosts:
                        self._stops(op, event.source, event.t)
        elif event.kind in ("kill", "power_off", "exit") and event.source == "net":
            host = event.data.get("host") or ""
            self.carried.pop(host, None)
            for op, hosts in list(self.waiting.items()):
                if host in hosts:
                    self._stops(op, host, event.t)
