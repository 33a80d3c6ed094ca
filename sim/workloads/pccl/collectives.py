"""The all-reduce step of the pccl workload, and its checker.

:class:`AllReducePhase` (phase name ``"all_reduce"``) makes every peer all-reduce arrays
(a small one and a ring-sized one, by default) each step, through the public API, exactly as a training loop does: ``comm.all_reduce(x, op=…)``
in place.  Peer ``p``'s input of its ``k``-th call is :func:`phase_input` ``(p, k)`` — a pure
function, so the checker can rebuild every participant's input.  Trace events (plain data):

* ``all_reduce_call`` (``k``): right before the call (so before the peer's ``CollectiveInit``);
* ``all_reduce`` (``k``, ``world_size``, ``ring``, ``digest`` of the result, ``tx``/``rx``);
* ``all_reduce_aborted`` (``k``, ``restored``: the in-place buffer equals its input again);
* ``all_reduce_alone`` (``k``): ``TooFewPeers`` (the group shrank to one since the step began).

:class:`AllReduceAgreement` (**safety**) reads which op each call became off the wire: the
``CollectiveCommence(tag, seq, ring)`` a host receives while its call ``k`` runs binds
``(peer, k)`` to ``seq`` (causally: the master commences only after every participant's Init,
which follows its ``all_reduce_call``).  Then, for every peer that completed an op:

* its ``ring`` and ``world_size`` are exactly the op's participants (the Commence ring);
* its result is bit-identical to every other completer's of the same ``seq`` (with and without
  quantization);
* unquantized, it equals :func:`pccl.collectives.reference.all_reduce_reference` over the inputs of
  exactly those participants, in ring order (AVG divided by their number) — a participant that
  died after every byte moved still counts, one that never commenced never does;
* an aborted call left its in-place buffer holding its input.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio
import xxhash

import pccl
from pccl.collectives.reference import all_reduce_reference
from pccl.protocol.ring import EXCHANGE_MAX_BYTES

from ...engine.runner import Checker, Simulation
from ...engine.trace import TraceEvent
from .frames import ALL_REDUCE_PHASES
from .phases import Phase, StepContext, StepScenario, register_phase

__all__ = ["AllReducePhase", "AllReduceAgreement", "phase_input", "digest"]


def phase_input(peer_id: int, tag: int, k: int, n: int, dtype: str) -> np.ndarray:
    """Peer ``peer_id``'s input for its ``k``-th all-reduce on ``tag``: small integers as
    ``dtype`` (exact in every dtype, so sums of a few peers stay representable and any mix-up
    shows).  A new writable array."""
    return _shared_input(peer_id, tag, k, n, dtype).copy()


@functools.lru_cache(maxsize=64)
def _shared_input(peer_id: int, tag: int, k: int, n: int, dtype: str) -> np.ndarray:
    """:func:`phase_input`, read-only and remembered (the checker rebuilds every participant's
    input right after the participants made it).  A window of one fixed table of random small
    integers, at an offset hashed from ``(peer_id, tag, k)``: as good a test input as fresh random
    numbers (each call's values differ, so do neighbouring positions) at a fraction of the cost of
    drawing them per call, which was a large share of a simulated all-reduce step."""
    if n > _TABLE_SPAN:  # larger than any window of the table: drawn afresh
        rng = np.random.default_rng([peer_id & 0xFFFFFFFF, peer_id >> 32, tag, k])
        array = rng.integers(-50, 50, n, endpoint=True).astype(_np_dtype(dtype))
    else:
        offset = xxhash.xxh64_intdigest(f"{peer_id}:{tag}:{k}".encode()) % _TABLE_SPAN
        array = _INPUT_TABLE[offset : offset + n].astype(_np_dtype(dtype))
    array.flags.writeable = False
    return array


#: Offsets (and window lengths) of :func:`_shared_input`'s table.
_TABLE_SPAN = 1 << 18
_INPUT_TABLE = np.random.default_rng(0x5EED_1A7E).integers(-50, 50, 2 * _TABLE_SPAN, endpoint=True).astype(np.int8)
_INPUT_TABLE.flags.writeable = False


def digest(array: np.ndarray) -> str:
    """A 128-bit fingerprint (32 hex digits, xxh3) of the array's bytes: the checker compares
    results for bit-identity, it needs no cryptographic hash (and sha256 of a 256 KiB result
    cost more than the rest of the check)."""
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        return pccl.DType.BFLOAT16.numpy_dtype()
    return np.dtype(name)


def quantization_of(params: dict[str, Any]) -> pccl.Quantization | None:
    """A phase's ``quantization`` (``None``, ``"uint4"``, ``"uint8"`` or ``"uint16"``) and
    ``quant_block`` (``None``: one (min, max) per frame; ``k``: one per ``k`` elements)
    parameters as a :class:`pccl.Quantization`."""
    quant = params.get("quantization")
    block = params.get("quant_block")
    if quant is None:
        if block is not None:
            raise ValueError("quant_block needs a quantization")
        return None
    return pccl.Quantization(dtype=str(quant), block=None if block is None else int(block))


class AllReducePhase(Phase):
    """In-place all-reduces each step.  Parameters: ``n`` (elements: one size or a list of
    sizes, default ``[33, EXCHANGE_MAX_BYTES // itemsize + 1]``), ``dtype`` (default ``"float32"``), ``op`` (a ReduceOp name,
    default ``"AVG"``), ``quantization`` (``None``, ``"uint4"``, ``"uint8"`` or ``"uint16"``) and
    ``quant_block`` (see :func:`quantization_of`), ``tag``
    (default 0), ``concurrent`` (how many run per size; default 1), ``in_flight`` (at most this
    many of them at once, launched in tag order as PCCL's stress test does: a later tag starts
    when an earlier one finished; default ``concurrent``, all at once).

    Each step all-reduces once per size, one size after the other; size ``i`` uses tags
    ``tag + i * concurrent`` … ``tag + (i + 1) * concurrent - 1``.  The default sizes cover both
    plans of :func:`pccl.protocol.ring.uses_exchange` at every world size: 33 elements run as an
    exchange, one element more than 256 KiB as reduce-scatter + all-gather."""

    name = "all_reduce"
    messages = {
        "CollectiveInit": ("send",),
        "CollectiveCommence": ("recv",),
        # Data frames named by the part of the op they belong to (frames.AllReduceParts): phase
        # triggers land inside the transfers too.
        "data:exchange": ("send", "recv"),
        "data:reduce-scatter": ("send", "recv"),
        "data:all-gather": ("send", "recv"),
        "CollectiveDone": ("send",),
        "CollectiveComplete": ("recv",),
        "CollectiveAbort": ("recv",),
    }
    coverage_phases = ALL_REDUCE_PHASES

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        self.dtype = str(params.get("dtype", "float32"))
        # Default: a small op (an exchange at any world size) and the smallest ring op at any.
        sizes = params.get("n", (33, EXCHANGE_MAX_BYTES // _np_dtype(self.dtype).itemsize + 1))
        self.sizes = tuple(int(x) for x in (sizes if isinstance(sizes, (list, tuple)) else (sizes,)))
        if not self.sizes or min(self.sizes) < 0:
            raise ValueError("n must be a non-negative size or a non-empty list of them")
        self.op = pccl.ReduceOp[str(params.get("op", "AVG"))]
        self.quantization = quantization_of(params)
        self.tag = int(params.get("tag", 0))
        self.concurrent = int(params.get("concurrent", 1))
        if self.concurrent < 1:
            raise ValueError("concurrent must be at least 1")
        self.in_flight = int(params.get("in_flight", self.concurrent))
        if self.in_flight < 1:
            raise ValueError("in_flight must be at least 1")
        # Calls per (peer id, tag) (peer ids are never reused within a run).
        self._calls: dict[tuple[int, int], int] = {}

    @property
    def tags(self) -> range:
        return range(self.tag, self.tag + self.concurrent * len(self.sizes))

    def size_of(self, tag: int) -> int:
        """Elements of every all-reduce on ``tag`` (one of :attr:`tags`)."""
        return self.sizes[(tag - self.tag) // self.concurrent]

    async def run(self, step: StepContext) -> None:
        for i in range(len(self.sizes)):
            first = self.tag + i * self.concurrent
            if self.concurrent == 1:
                await self._one(step, first)
                continue
            async with trio.open_nursery() as nursery:
                if self.in_flight >= self.concurrent:
                    for tag in range(first, first + self.concurrent):
                        nursery.start_soon(self._one, step, tag)
                    continue
                slots = trio.Semaphore(self.in_flight)
                for tag in range(first, first + self.concurrent):
                    await slots.acquire()  # in tag order: the next tag waits for a free slot
                    nursery.start_soon(self._one_in_slot, step, tag, slots)

    async def _one_in_slot(self, step: StepContext, tag: int, slots: trio.Semaphore) -> None:
        try:
            await self._one(step, tag)
        finally:
            slots.release()

    async def _one(self, step: StepContext, tag: int) -> None:
        comm = step.comm
        k = self._calls.get((comm.peer_id, tag), 0) + 1
        self._calls[(comm.peer_id, tag)] = k
        original = _shared_input(comm.peer_id, tag, k, self.size_of(tag), self.dtype)
        x = original.copy()
        step.record("all_reduce_call", k=k, tag=tag)
        try:
            info = await comm.all_reduce(x, op=self.op, tag=tag, quantization=self.quantization)
        except pccl.CollectiveAborted as exc:
            step.record("all_reduce_aborted", k=k, tag=tag, restored=bool(np.array_equal(x.view(np.uint8),
                                                                                 original.view(np.uint8))),
                        error=str(exc))
            return
        except pccl.TooFewPeers:
            step.record("all_reduce_alone", k=k, tag=tag)
            return
        step.record("all_reduce", k=k, tag=tag, world_size=info.world_size, ring=list(comm.ring), digest=digest(x),
                    tx=info.tx_bytes, rx=info.rx_bytes, sites=list(comm.sites))

    def checkers(self, scenario: StepScenario) -> Sequence[Checker]:
        return [AllReduceAgreement(self)]


register_phase(AllReducePhase)


class AllReduceAgreement(Checker):
    """Every completed all-reduce equals the numpy reference over exactly its participants and
    is bit-identical across them (module docstring)."""

    name = "all-reduce-agreement"

    def __init__(self, phase: AllReducePhase) -> None:
        self.phase = phase
        self.peer_of_host: dict[str, int] = {}  # host -> peer id of its current incarnation
        self.running: dict[tuple[str, int], int] = {}  # (host, tag) -> k of the call in progress
        self.calls: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}  # (epoch, seq) -> {peer: (tag, k)}
        self.rings: dict[tuple[int, int], tuple[int, ...]] = {}  # (epoch, seq) -> participants, ring order
        self.peer_agreed: set[tuple[int, int]] = set()  # ops begun with peer_commit (Config.peer_commit)
        self.wired: dict[str, tuple[int, ...]] = {}  # host -> the ring of its last ConnectToPeers
        self.begun_on: dict[tuple[int, int], tuple[int, ...]] = {}  # peer-agreed op -> its beginner's ring
        self.seq_of: dict[tuple[int, int, int], tuple[int, int]] = {}  # (peer id, tag, k) -> (epoch, seq)
        self.results: dict[tuple[int, int], str] = {}  # (epoch, seq) -> digest of the first completer
        # A restarted master numbers ops from 1 again: seqs are keyed by the master's epoch.
        self.epoch = 0
        self.verified: set[tuple[int, int]] = set()
        self.completed = 0
        self.aborted = 0
        self.failed = False

    def attach(self, sim: Simulation) -> None:
        if sim.tap is None:  # pragma: no cover - PcclScenario always sniffs
            raise RuntimeError("AllReduceAgreement needs the wire (Scenario.sniff)")
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
        k = self.running.get((host, msg.tag))
        if k is None or host not in self.peer_of_host:
            return
        pid = self.peer_of_host[host]
        op = (self.epoch, msg.seq)
        self.calls.setdefault(op, {})[pid] = (msg.tag, k)
        if name == "CollectiveCommence":
            self.rings[op] = tuple(msg.ring)
        elif msg.peer_commit:  # it may commit among its peers before the arming Commence comes
            self.peer_agreed.add(op)
            self.begun_on.setdefault(op, self.wired.get(host, ()))
        self.seq_of[(pid, msg.tag, k)] = op

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        kind, host, data = event.kind, event.source, event.data
        if kind == "start":
            for key in [key for key in self.running if key[0] == host]:
                del self.running[key]
            self.peer_of_host.pop(host, None)
            if host == "master":
                self.epoch += 1
        elif kind == "all_reduce_call":
            self.running[(host, data["tag"])] = data["k"]
        elif kind == "all_reduce_aborted":
            self.running.pop((host, data["tag"]), None)
            self.aborted += 1
            if not data["restored"]:
                self._fail(sim, f"{host}: aborted all-reduce #{data['k']} left the in-place buffer modified")
        elif kind == "all_reduce_alone":
            self.running.pop((host, data["tag"]), None)
        elif kind == "all_reduce":
            self.running.pop((host, data["tag"]), None)
            self.completed += 1
            self._check_result(sim, host, data)

    def _check_result(self, sim: Simulation, host: str, data: dict[str, Any]) -> None:
        pid = data["peer_id"]
        op = self.seq_of.get((pid, data["tag"], data["k"]))
        if op is None:
            self._fail(sim, f"{host} (peer {pid:x}) completed all-reduce #{data['k']} without a Commence")
            return
        seq = op[1]
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
            self._fail(sim, f"{host}: all-reduce seq {seq} commenced on {len(ring)} peers {_ids(ring)} but reports "
                            f"world_size {data['world_size']} and ring {_ids(data['ring'])}")
            return
        first = self.results.setdefault(op, data["digest"])
        if first != data["digest"]:
            self._fail(sim, f"{host}: all-reduce seq {seq} result differs from another participant's")
            return
        if self.phase.quantization is not None or op in self.verified:
            return
        calls = self.calls[op]
        missing = [p for p in ring if p not in calls]
        if missing:
            self._fail(sim, f"all-reduce seq {seq}: no Commence seen for participants {_ids(missing)}")
            return
        tag = calls[ring[0]][0]
        inputs = [_shared_input(p, *calls[p], self.phase.size_of(tag), self.phase.dtype) for p in ring]
        expected = digest(all_reduce_reference(inputs, self.phase.op, sites=tuple(data.get("sites", ()))))
        if expected != data["digest"]:
            self._fail(sim, f"{host}: all-reduce seq {seq} over {_ids(ring)} differs from the numpy reference")
            return
        self.verified.add(op)

    def at_end(self, sim: Simulation) -> None:
        sim.trace.stats["all_reduce_completed"] = self.completed
        sim.trace.stats["all_reduce_aborted"] = self.aborted


def _ids(peer_ids: Sequence[int]) -> list[str]:
    return [f"{p:x}" for p in peer_ids]
