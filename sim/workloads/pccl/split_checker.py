"""No op ends with a result on one peer and raised on another, unless the master's words say so.

docs/protocol.rst, rules 1, 2 and 12 (*agreement among survivors*) and the peer-commit design's
*What it cannot give* (a).  :class:`~.op_checkers.OneVerdict` compares the master's final words
and :class:`~.op_checkers.OutcomeFollowsVerdict` each call's outcome with the word it read; with
``Config.peer_commit`` a call may return its op's result without any word (it committed on its
full known set), so neither sees a participant that returned the result while another raised —
the split itself.  :class:`NoSplit` compares the outcomes directly.

**What it reads** (the peers' side only, as the other op checkers): the calls' trace events
(``*_call`` binds nothing; a call is bound to the op it began — ``CollectiveBegin`` sent — or was
commenced on — ``CollectiveCommence`` read; its end event says ``result`` or raised), the final
words each peer host reads (``CollectiveComplete`` / ``CollectiveAbort``; one naming an op the
host carried into a registration, ``Register.undecided``, is that op's, as in ``one-verdict``),
each host's ``Register`` (a new master connection), and the ends of its processes (``net``
``kill`` / ``power_off`` / ``exit``, a host's ``start``).

**The ends of an op X** (``(master instance, seq)``): a host *returned* X if a call bound to X
ended with its result; a host *raised on* X if a call bound to X ended with
``CollectiveAborted``, or if it read the master's ``CollectiveAbort`` for X (a call that went on
to another attempt ended X aborted all the same).  A host's *word* for X is the final word it
read for X (for a raise: read before its call ended).

**The master's words drive a difference** between a host A that returned X and a host B that
raised on X when it is what the master said — B raised on its ``Abort`` while A, which the
master counts out, could not hear it — or what a lost master could no longer say — B raised
without any word because it lost the connection that would carry one.  On the wire: one of
them is no survivor of X — it *left* X: its process ended, or it registered again without
carrying X (``Register.undecided``; carried to the master that began X, which ignores the
report and welcomes it under a new id, X is left all the same), before it read any final word
for X — and it is the side
the documented path names:

1. B read the master's ``CollectiveAbort`` for X and A left X (*What it cannot give* (a): a
   participant cut off from the master, or dead, that collected every id commits while the
   master, which declared it dead, aborts the survivors);
2. B read no final word for X before its call raised and B left X (rule 2: a peer that lost its
   master before the verdict is no survivor and raises whatever the others do — the master
   that comes back under the same ``instance`` welcomes it under a new id, a restarted one
   hears no report of X from it).

A run's ``split_ops_allowed`` statistic counts the ops that ended so, every pair on such a path.
Any other pair is a **safety** failure (``no-split``): as soon as the side the path needs turns
out to be a survivor (it reads a final word for X), or, at the end of the run, if that side
still neither read a word for X nor left it.  A word B read after its call raised does not
drive that raise.  A pair where B read ``Complete`` and raised, or A read ``Abort`` and returned,
is not judged here: ``outcome-follows-verdict`` fails that call.

Not covered: a participant that read an earlier master's ``Complete`` and then missed the new
master's ``master_reconnect_timeout`` while the new master aborted the others (*What it cannot
give* (a), second case) is counted a survivor by its word and fails here, as it fails
``one-verdict`` — no campaign has produced one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ...engine.runner import Simulation
from ...engine.trace import TraceEvent
from .op_checkers import Call, CallChecker, Op

__all__ = ["NoSplit"]

_HOST_ENDS = frozenset({"kill", "power_off", "exit"})


@dataclasses.dataclass
class _End:
    host: str
    outcome: str  # "result" or "aborted"
    word: str | None  # the final word the host had read for the op when it ended there
    k: int  # the call (0: an Abort read between attempts)
    tag: int


class NoSplit(CallChecker):
    """One op never ends with a result on one peer and raised on another unless the master's
    words drive it (module docstring)."""

    name = "no-split"
    EXTRA = ("Register",)  # watched; handled here, not by CallChecker

    def __init__(self) -> None:
        super().__init__()
        self.ends: dict[Op, dict[str, _End]] = {}  # op -> host -> how it ended there
        self.words: dict[tuple[str, Op], str] = {}  # (host, op) -> the final word it read
        self.left: set[tuple[str, Op]] = set()  # (host, op): left before any final word
        self.open: dict[str, set[Op]] = {}  # host -> ops it is in with no word yet (this connection, or carried)
        self.carried: dict[str, dict[int, int]] = {}  # host -> seq -> instance carried into its registration
        #: The live master's instance, read off a peer's ``Welcome`` (None: not known yet, or the
        #: master restarted since): an op of it carried into a registration is left all the same.
        self.live: int | None = None

    # --- the wire -----------------------------------------------------------------------------

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        if msg is not None and host.startswith("peer"):
            if name == "Welcome" and direction == "recv":
                self.live = msg.instance
            if name == "Register" and direction == "send":
                # The master that began an op ignores its report (pccl.protocol.master.machine)
                # and welcomes the peer under a new id: carried to it, the op is left (rule 2).
                carried = {u.seq: u.instance for u in msg.undecided if u.instance != self.live}
                kept = {(instance, seq) for seq, instance in carried.items()}
                for op in self.open.pop(host, set()) - kept:
                    self._leaves(host, op)
                self.open[host] = {op for op in kept if (host, op) not in self.words}
                self.carried[host] = carried
            elif name == "CollectiveBegin" and direction == "send" or name == "CollectiveCommence" and direction == "recv":
                op = (self.instance.get(host, 0), msg.seq)
                if (host, op) not in self.words:
                    self.open.setdefault(host, set()).add(op)
            elif name in ("CollectiveComplete", "CollectiveAbort") and direction == "recv":
                instance = self.carried.get(host, {}).pop(msg.seq, None)
                op = (self.instance.get(host, 0) if instance is None else instance, msg.seq)
                word = "Complete" if name == "CollectiveComplete" else "Abort"
                self.words.setdefault((host, op), word)
                self.open.get(host, set()).discard(op)
                ends = self.ends.setdefault(op, {})
                if word == "Abort" and host not in ends:
                    ends[host] = _End(host, "aborted", "Abort", 0, msg.tag)
                self._check(op)
        if name != "Register":  # (only this checker reads it)
            super()._wire(host, direction, name, peer, msg)

    def _leaves(self, host: str, op: Op) -> None:
        if (host, op) not in self.words:
            self.left.add((host, op))
            self._check(op)

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        host = None
        if event.kind == "start" and event.source.startswith("peer"):
            host = event.source
        elif event.kind in _HOST_ENDS and event.source == "net":
            host = event.data.get("host") or ""
        if event.kind == "start" and event.source == "master":
            self.live = None  # a restarted master hears the reports of the old one's ops
        if host is not None:
            self.carried.pop(host, None)
            for op in self.open.pop(host, set()):
                self._leaves(host, op)
        super().on_event(sim, event)

    # --- the calls ----------------------------------------------------------------------------

    def ended(self, host: str, data: Mapping[str, Any], call: Call, outcome: str) -> None:
        if call.op is None or outcome == "alone":
            return
        self.ends.setdefault(call.op, {})[host] = _End(host, "result" if outcome == "result" else "aborted",
                                                      self.words.get((host, call.op)), call.k, data["tag"])
        self._check(call.op)

    def at_end(self, sim: Simulation) -> None:
        for op in list(self.ends):
            self._check(op, final=True)
        # Statistics (not hashed): ops that ended with a result on one peer and raised on
        # another, every such pair on a documented path (a campaign sums them).
        if not self.failed:
            sim.trace.stats["split_ops_allowed"] = sum(
                1 for ends in self.ends.values()
                if {e.outcome for e in ends.values()} == {"result", "aborted"})

    # --- the rule -----------------------------------------------------------------------------

    def _check(self, op: Op, *, final: bool = False) -> None:
        if self.failed:
            return
        ends = self.ends.get(op, {})
        returned = [e for e in ends.values() if e.outcome == "result"]
        raised = [e for e in ends.values() if e.outcome != "result"]
        for a in returned:
            for b in raised:
                why = self._undriven(op, a, b, final)
                if why is not None:
                    self._fail("safety", f"seq {op[1]} split: {self._show(a)} returned its result, {self._show(b)} "
                                         f"raised ({'read Abort' if b.word == 'Abort' else 'no final word read'}); "
                                         f"{why}")
                    return

    def _undriven(self, op: Op, a: _End, b: _End, final: bool) -> str | None:
        """Why the pair is a split the master's words do not drive, or ``None`` (allowed, or not
        known yet)."""
        if b.word == "Complete" or a.word == "Abort":
            return None  # outcome-follows-verdict's
        side = a if b.word == "Abort" else b  # the one that must have left the op
        word = self.words.get((side.host, op))
        if word is not None:
            return f"{side.host} is a survivor (it read {word})"
        if (side.host, op) in self.left:
            return None
        if final:
            return f"{side.host} neither read a final word for it nor left it by the end of the run"
        return None

    @staticmethod
    def _show(end: _End) -> str:
        return f"{end.host} (call #{end.k} on tag {end.tag})" if end.k else f"{end.host} (tag {end.tag})"
