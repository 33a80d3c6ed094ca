"""Concurrent collectives of every kind in the pccl workload, and their checker.

:class:`CollectivesPhase` (phase name ``"collectives"``) makes every peer run ``concurrent``
collectives per step on tags ``tag … tag + concurrent - 1``, launched in tag order with at most
``in_flight`` at once (PCCL's stress pattern: a later tag starts when an earlier one finished),
each of the kind ``kinds[i % len(kinds)]`` — ``all_reduce``, ``broadcast``, ``all_gather``,
``reduce_scatter`` — optionally quantized, through the public API as a training loop calls
them.  With ``order: "shuffled"`` (all tags in flight at once) each peer launches its tags in an
order of its own, a deterministic shuffle per peer and step: the peers begin different ops first
and their ops cross on the links, which tag order never makes them do.  A broadcast's root is the smallest peer id of the ring the step began on (every accepted
peer of the step agrees on it).  Peer ``p``'s input of its ``k``-th call on a tag is a pure
function of ``(p, tag, k)`` (:func:`pccl_sim.workloads.pccl.collectives.phase_input`; an all-gather's
element count varies with the peer), so the checker can rebuild every participant's input.
Trace events: ``collective_call`` (``op``: the kind, ``tag``, ``k``), ``collective`` (its result's
``digest``, ``ring``, ``world_size``; a reduce-scatter's ``start``/``stop``),
``collective_aborted`` (``restored``: the input is intact), ``collective_alone``.

:class:`CollectivesAgreement` (**safety**) binds each call to the op the master commenced off the
wire (the ``CollectiveCommence`` a host reads while the call runs) and checks, for every
completed call: its ring is exactly the op's participants; broadcast, all-gather and all-reduce
results are bit-identical across the participants (quantized or not); unquantized, the result
equals numpy over exactly those participants' inputs (the root's input; their inputs in ring
order; their sum, slice by slice, with the slices covering the buffer exactly once); an aborted
call left its input intact.  Every legal call either succeeds or aborts: ``InvalidUsage`` and
any other error are failures of the run.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

import pccl
from pccl.collectives.reference import all_reduce_reference

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent
from .collectives import _shared_input, digest, quantization_of
from .frames import COLLECTIVE_PHASES
from .phases import Phase, StepContext, StepScenario, register_phase

__all__ = ["CollectivesPhase", "CollectivesAgreement", "KINDS"]

KINDS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def _count(kind: str, n: int, peer_id: int, tag: int, k: int) -> int:
    """Elements of peer ``peer_id``'s ``k``-th call on ``tag``: ``n``, an all-gather's ``n`` plus
    0-6 (0 contributions included when ``n`` is 0)."""
    if kind != "all_gather":
        return n
    return n + (peer_id * 7 + tag * 3 + k) % 7


class CollectivesPhase(Phase):
    """Concurrent collectives of mixed kinds each step (module docstring).  Parameters:
    ``kinds`` (default all four), ``concurrent`` (default 4), ``in_flight`` (default
    ``concurrent``), ``n`` (elements, default 1000), ``quantization`` (``None``, ``"uint4"``,
    ``"uint8"``, ``"uint16"``) and ``quant_block`` (as the all-reduce phase's), ``tag`` (first tag, default 100), ``dtype`` (default ``"float32"``),
    ``order`` (``"tag"``, the default, or ``"shuffled"``: each peer its own launch order, which
    needs ``in_flight`` equal to ``concurrent``: with fewer slots, peers holding different tags
    would wait for each other for ever, a program's deadlock and not pccl's)."""

    name = "collectives"
    messages = {
        "CollectiveInit": ("send",),
        "CollectiveCommence": ("recv",),
        "data:reduce-scatter": ("send", "recv"),
        "data:all-gather": ("send", "recv"),
        "data:broadcast": ("send", "recv"),
        "CollectiveDone": ("send",),
        "CollectiveComplete": ("recv",),
        "CollectiveAbort": ("recv",),
    }
    coverage_phases = COLLECTIVE_PHASES

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        kinds = params.get("kinds", KINDS)
        self.kinds = tuple(str(k) for k in (kinds if isinstance(kinds, (list, tuple)) else (kinds,)))
        if not self.kinds or any(k not in KINDS for k in self.kinds):
            raise ValueError(f"kinds must be some of {KINDS}, got {self.kinds}")
        self.concurrent = int(params.get("concurrent", 4))
        self.in_flight = int(params.get("in_flight", self.concurrent))
        if self.concurrent < 1 or self.in_flight < 1:
            raise ValueError("concurrent and in_flight must be at least 1")
        self.n = int(params.get("n", 1000))
        self.dtype = str(params.get("dtype", "float32"))
        self.quantization = quantization_of(params)
        self.tag = int(params.get("tag", 100))
        self.order = str(params.get("order", "tag"))
        if self.order not in ("tag", "shuffled"):
            raise ValueError(f'order must be "tag" or "shuffled", got {self.order!r}')
        if self.order == "shuffled" and self.in_flight < self.concurrent:
            raise ValueError("order shuffled needs in_flight equal to concurrent (fewer slots deadlock the program)")
        self._calls: dict[tuple[int, int], int] = {}

    def kind_of(self, tag: int) -> str:
        return self.kinds[(tag - self.tag) % len(self.kinds)]

    async def run(self, step: StepContext) -> None:
        ring = tuple(step.comm.ring)
        root = min(ring) if ring else step.comm.peer_id
        slots = trio.Semaphore(self.in_flight)
        tags = list(range(self.tag, self.tag + self.concurrent))
        if self.order == "shuffled":  # seeded by text: the same on every run, whatever PYTHONHASHSEED
            random.Random(f"collectives-order:{step.comm.peer_id}:{step.step}").shuffle(tags)
        async with trio.open_nursery() as nursery:
            for tag in tags:
                await slots.acquire()  # in launch order: the next tag waits for a free slot
                nursery.start_soon(self._one_in_slot, step, tag, root, slots)

    async def _one_in_slot(self, step: StepContext, tag: int, root: int, slots: trio.Semaphore) -> None:
        try:
            await self._one(step, tag, root)
        finally:
            slots.release()

    async def _one(self, step: StepContext, tag: int, root: int) -> None:
        comm = step.comm
        kind = self.kind_of(tag)
        k = self._calls.get((comm.peer_id, tag), 0) + 1
        self._calls[(comm.peer_id, tag)] = k
        original = _shared_input(comm.peer_id, tag, k, _count(kind, self.n, comm.peer_id, tag, k), self.dtype)
        x = original.copy()
        step.record("collective_call", op=kind, tag=tag, k=k, root=root)
        extra: dict[str, Any] = {}
        try:
            if kind == "all_reduce":
                info: Any = await comm.all_reduce(x, tag=tag, quantization=self.quantization)
                result = x
            elif kind == "broadcast":
                info = await comm.broadcast(x, root=root, tag=tag, quantization=self.quantization)
                result = x
            elif kind == "all_gather":
                info = await comm.all_gather(x, tag=tag, quantization=self.quantization)
                result = info.buffer
                extra["intact"] = bool(np.array_equal(x.view(np.uint8), original.view(np.uint8)))
            else:
                info = await comm.reduce_scatter(x, tag=tag, quantization=self.quantization)
                result = x[info.start:info.stop]
                extra.update(start=info.start, stop=info.stop)
        except pccl.CollectiveAborted as exc:
            step.record("collective_aborted", op=kind, tag=tag, k=k,
                        restored=bool(np.array_equal(x.view(np.uint8), original.view(np.uint8))), error=str(exc))
            return
        except pccl.TooFewPeers:
            step.record("collective_alone", op=kind, tag=tag, k=k)
            return
        step.record("collective", op=kind, tag=tag, k=k, world_size=info.world_size, ring=list(comm.ring),
                    digest=digest(result), sites=list(comm.sites), **extra)

    def checkers(self, scenario: StepScenario) -> Sequence[Checker]:
        return [CollectivesAgreement(self)]


register_phase(CollectivesPhase)


class CollectivesAgreement(Checker):
    """Every completed collective equals numpy over exactly its participants, bit-identical
    across them where all hold the same result (module docstring)."""

    name = "collectives-agreement"

    def __init__(self, phase: CollectivesPhase) -> None:
        self.phase = phase
        self.peer_of_host: dict[str, int] = {}
        self.running: dict[tuple[str, int], tuple[int, int]] = {}  # (host, tag) -> (k, root)
        self.calls: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}  # op -> {peer: (tag, k)}
        self.rings: dict[tuple[int, int], tuple[int, ...]] = {}
        self.peer_agreed: set[tuple[int, int]] = set()  # ops begun with peer_commit (Config.peer_commit)
        self.wired: dict[str, tuple[int, ...]] = {}  # host -> the ring of its last ConnectToPeers
        self.begun_on: dict[tuple[int, int], tuple[int, ...]] = {}  # peer-agreed op -> its beginner's ring
        self.roots: dict[tuple[int, int], int] = {}
        self.seq_of: dict[tuple[int, int, int], tuple[int, int]] = {}
        self.results: dict[tuple[int, int], str] = {}
        self.verified: set[tuple[int, int]] = set()
        self.epoch = 0
        self.counts = {"completed": 0, "aborted": 0}
        self.failed = False

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError("CollectivesAgreement needs the wire (Scenario.sniff)")
        sim.tap.watch(lambda *args: self._wire(*args),
                      names=("Welcome", "ConnectToPeers", "CollectiveCommence", "CollectiveBegin"))

    def _fail(self, sim: Simulation, message: str) -> None:
        if not self.failed:
            self.failed = True
            sim.fail("safety", message, self.name)

    def _wire(self, host: str, direction: str, name: str, peer: str, msg: Any) -> None:
        # A call is bound to its op by the Commence it reads, or by the Begin it sends (the fast
        # path: a participant may die before it reads the Commence that follows).
        if msg is None or direction != ("send" if name == "CollectiveBegin" else "recv"):
            return
        if name == "Welcome":
            self.peer_of_host[host] = msg.peer_id
            return
        if name == "ConnectToPeers":
            self.wired[host] = tuple(msg.ring)  # the ring its next ops begin on
            return
        running = self.running.get((host, msg.tag))
        if running is None or host not in self.peer_of_host:
            return
        pid = self.peer_of_host[host]
        op = (self.epoch, msg.seq)
        self.calls.setdefault(op, {})[pid] = (msg.tag, running[0])
        if name == "CollectiveCommence":
            self.rings[op] = tuple(msg.ring)
        elif msg.peer_commit:  # it may commit among its peers before the arming Commence comes
            self.peer_agreed.add(op)
            self.begun_on.setdefault(op, self.wired.get(host, ()))
        self.roots[op] = running[1]
        self.seq_of[(pid, msg.tag, running[0])] = op

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        kind, host, data = event.kind, event.source, event.data
        if kind == "start":
            for key in [key for key in self.running if key[0] == host]:
                del self.running[key]
            self.peer_of_host.pop(host, None)
            if host == "master":
                self.epoch += 1
        elif kind == "collective_call":
            self.running[(host, data["tag"])] = (data["k"], data["root"])
        elif kind in ("collective_aborted", "collective_alone"):
            self.running.pop((host, data["tag"]), None)
            if kind == "collective_aborted":
                self.counts["aborted"] += 1
                if not data["restored"]:
                    self._fail(sim, f"{host}: aborted {data['op']} #{data['k']} on tag {data['tag']} left its "
                                    "input modified")
        elif kind == "collective":
            self.running.pop((host, data["tag"]), None)
            self.counts["completed"] += 1
            self._check(sim, host, data)

    def _check(self, sim: Simulation, host: str, data: dict[str, Any]) -> None:
        pid, what = data["peer_id"], f"{data['op']} #{data['k']} on tag {data['tag']}"
        op = self.seq_of.get((pid, data["tag"], data["k"]))
        if op is None:
            self._fail(sim, f"{host} (peer {pid:x}) completed {what} without a Commence")
            return
        ring = self.rings.get(op)
        if ring is None and op in self.peer_agreed:  # committed among its peers: its ring is the host's
            # (that of its Begin when a later master decided it: the host's is that master's by now)
            ring = self.rings[op] = tuple(data["ring"]) if op[0] == self.epoch else self.begun_on[op]
        if ring is None:  # bound by its Begin, but the Commence that says everyone began never came
            self._fail(sim, f"{host}: seq {op[1]} completed without the Commence that arms it")
            return
        # (An op a later master decided — its participant was in doubt across a master restart —
        # ends on a host whose ring is that master's by then: its world size still counts.)
        if (tuple(data["ring"]) != ring and op[0] == self.epoch) or data["world_size"] != len(ring):
            self._fail(sim, f"{host}: {what} (seq {op[1]}) commenced on {_ids(ring)} but reports world_size "
                            f"{data['world_size']} and ring {_ids(data['ring'])}")
            return
        if data["op"] == "all_gather" and not data["intact"]:
            self._fail(sim, f"{host}: {what} modified its input")
            return
        calls = self.calls[op]
        missing = [p for p in ring if p not in calls]
        if missing:
            self._fail(sim, f"{what} (seq {op[1]}): no Commence seen for participants {_ids(missing)}")
            return
        if data["op"] == "reduce_scatter":
            self._check_shard(sim, host, what, op, ring, calls, data)
            return
        first = self.results.setdefault(op, data["digest"])
        if first != data["digest"]:
            self._fail(sim, f"{host}: {what} (seq {op[1]}) differs from another participant's result")
            return
        if self.phase.quantization is not None or op in self.verified:
            return  # checked against numpy once per op
        self.verified.add(op)
        expected = digest(self._expected(data["op"], op, ring, calls, tuple(data.get("sites", ()))))
        if expected != data["digest"]:
            self._fail(sim, f"{host}: {what} (seq {op[1]}) over {_ids(ring)} differs from the numpy reference")

    def _inputs(self, ring: Sequence[int], calls: dict[int, tuple[int, int]], kind: str) -> list[np.ndarray]:
        return [_shared_input(p, *calls[p], _count(kind, self.phase.n, p, *calls[p]), self.phase.dtype) for p in ring]

    def _expected(self, kind: str, op: tuple[int, int], ring: Sequence[int],
                  calls: dict[int, tuple[int, int]], sites: tuple[int, ...] = ()) -> np.ndarray:
        inputs = self._inputs(ring, calls, kind)
        if kind == "all_reduce":
            return all_reduce_reference(inputs, pccl.ReduceOp.SUM, sites=sites)
        if kind == "broadcast":
            return inputs[list(ring).index(self.roots[op])]
        return np.concatenate(inputs)

    def _check_shard(self, sim: Simulation, host: str, what: str, op: tuple[int, int], ring: Sequence[int],
                     calls: dict[int, tuple[int, int]], data: dict[str, Any]) -> None:
        start, stop = data["start"], data["stop"]
        n, world = self.phase.n, len(ring)
        position = list(ring).index(data["peer_id"])
        base, extra = divmod(n, world)
        want = (position * base + min(position, extra), (position + 1) * base + min(position + 1, extra))
        if (start, stop) != want:
            self._fail(sim, f"{host}: {what} owns [{start}, {stop}) at ring position {position} of {world}, "
                            f"not [{want[0]}, {want[1]})")
            return
        if self.phase.quantization is not None:
            return
        # Small integers in float32: every order of summation gives the exact sum.
        total = np.sum(np.stack([x.astype(np.float64) for x in self._inputs(ring, calls, "reduce_scatter")]), axis=0)
        expected = total[start:stop].astype(np.dtype(self.phase.dtype) if self.phase.dtype != "bfloat16"
                                            else pccl.DType.BFLOAT16.numpy_dtype())
        if digest(expected) != data["digest"]:
            self._fail(sim, f"{host}: {what} (seq {op[1]}) slice [{start}, {stop}) differs from the numpy reference")

    def at_end(self, sim: Simulation) -> None:
        sim.trace.stats["collectives_completed"] = self.counts["completed"]
        sim.trace.stats["collectives_aborted"] = self.counts["aborted"]


def _ids(peer_ids: Sequence[int]) -> list[str]:
    return [f"{p:x}" for p in peer_ids]
