"""One peer of the process-level stress test (``stress_orchestrator.py``), modelled on PCCL's
own stress pattern: a real OS process that the orchestrator SIGKILLs at random.

Usage: ``python stress_peer.py --master HOST:PORT --results PATH --stop PATH [--kinds all_reduce]``.

Each step of its loop:

1. ``update_topology()`` when ``are_peers_pending()`` (a newcomer skips this on its first step:
   its ``open_communicator`` returned exactly when the others' update did); while alone, wait
   for a newcomer (``update_topology()`` every heartbeat, as ``Communicator.steps`` does);
2. ``sync_shared_state`` of a few float32 arrays whose content is a pure function of the
   revision (:func:`state_content`): the peer checks, bit for bit, that what it holds after the
   sync is right for the revision it adopted;
3. ``OPS`` (10) concurrent collectives on tags ``0..OPS-1``, launched in tag order with at most
   ``MAX_IN_FLIGHT`` (8) in flight (a ``trio.Semaphore`` acquired in tag order), each quantized
   uint8 MIN_MAX.  Every peer contributes the same vector ``op_input(revision, tag)``, so the
   expected result does not depend on who took part: SUM = ``world_size * v``, AVG = MAX = ``v``,
   each within the documented quantization error bound (docs/concepts.rst, "Quantization and
   its error bounds") for ``ReduceInfo.world_size`` peers.  An aborted op's in-place buffer must
   hold its input again; a ``TooFewPeers`` op's must be untouched.
4. When some ops aborted (``CollectiveAborted``/``TooFewPeers``): once every op of the batch
   settled, ``update_topology()`` (wait while alone), then retry the step's remaining ops — or,
   when that update accepted a newcomer (it syncs next), go back to the sync and run every op of
   the step again, which is what the newcomer does.  ``PhaseMismatch`` from a vote or a sync
   starts the step again (as ``steps()`` does).
5. Once every op succeeded: ``state.revision += 1`` and the content for the new revision.

Records, one JSON line each, appended to ``--results`` (flushed at once, so a SIGKILL loses at
most a partial last line): ``start``, ``joined``, ``sync`` (revision, hash, received, reason),
``step`` (step count, revision the ops ran at, the state hash at that revision, ops done,
aborted attempts, world sizes), ``retry`` (why), ``stopped`` and ``failure`` (a refused legal
call — ``InvalidUsage`` —, a wrong result, a wrong state, or any other exception; the process
then exits with status 3).

The peer stops cleanly at a step boundary once the file ``--stop`` exists and holds a revision
(JSON ``{"revision": R}``) its state has reached — every peer of the group reaches it at the same
step — or when it is alone and the file exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
import xxhash

import pccl

#: PCCL's pattern: 10 concurrent ops on distinct tags, at most 8 in flight, launched in tag order.
OPS = 10
MAX_IN_FLIGHT = 8
QUANT = pccl.Quantization(dtype=np.uint8)  # MIN_MAX by default
QMAX = 255
#: Inputs are OFFSET + uniform[0, 1): a SUM that misses or doubles a contribution is off by at
#: least OFFSET per element, far beyond the quantization bound for up to 10 peers (~0.2).
OFFSET = 1.0
STATE_SIZES = {"w": 4096, "m": 1000, "b": 17}


def state_content(revision: int, key: str) -> np.ndarray:
    """The exact content of state tensor ``key`` at ``revision`` (a pure function of both)."""
    return np.random.default_rng([0x5EED, revision, sorted(STATE_SIZES).index(key)]).standard_normal(
        STATE_SIZES[key], dtype=np.float32)


def state_hash(state: pccl.SharedState) -> str:
    h = xxhash.xxh3_128()
    for key in sorted(STATE_SIZES):
        h.update(np.ascontiguousarray(state[key]).data)
    return h.hexdigest()


def op_size(tag: int) -> int:
    return 1000 + 997 * tag


def op_input(revision: int, tag: int) -> np.ndarray:
    """What every peer contributes to tag ``tag`` at ``revision`` (the same on every peer)."""
    rng = np.random.default_rng([0xA11, revision, tag])
    return (OFFSET + rng.random(op_size(tag), dtype=np.float32)).astype(np.float32)


def reduce_op(revision: int, tag: int) -> pccl.ReduceOp:
    return (pccl.ReduceOp.SUM, pccl.ReduceOp.AVG, pccl.ReduceOp.MAX)[(revision + tag) % 3]


class WrongResult(Exception):
    """A collective completed with a result outside its bound (or a broken abort guarantee)."""


class StepFailure(Exception):
    """A failure the peer records and exits on."""

    def __init__(self, kind: str, **detail: Any) -> None:
        super().__init__(kind)
        self.kind = kind
        self.detail = detail


# --- the kinds of collective ----------------------------------------------------------------


@dataclass(frozen=True)
class OpKind:
    """One kind of collective the launcher can mix in: ``run(comm, revision, tag)`` performs it and
    checks its result (raising :class:`WrongResult`), returning the world size it ran over."""

    name: str
    run: Callable[[pccl.Communicator, int, int, int], Awaitable[int]]


def _check_close(what: str, got: np.ndarray, expected: np.ndarray, bound: float) -> None:
    error = float(np.abs(got.astype(np.float64) - expected).max(initial=0.0))
    # Slack for the float32 accumulation and decode (lo + q*scale) on top of the bound.
    if not np.isfinite(error) or error > bound * (1 + 1e-3) + 1e-5 * float(np.abs(expected).max(initial=1.0)):
        raise WrongResult(f"{what} is off by {error:.6g} > bound {bound:.6g}")


def _check_intact(tag: int, exc: Exception, x: np.ndarray, v: np.ndarray) -> None:
    """CollectiveAborted: "an in-place buffer holds its input again"; TooFewPeers: untouched."""
    if not np.array_equal(x.view(np.uint32), v.view(np.uint32)):
        raise WrongResult(f"tag {tag}: {type(exc).__name__} left the buffer changed "
                          f"(max diff {float(np.abs(x - v).max())})") from exc


def _check_world(tag: int, n: int) -> None:
    if not 2 <= n <= 64:
        raise WrongResult(f"tag {tag}: world_size {n}")


async def run_broadcast(comm: pccl.Communicator, revision: int, tag: int, root: int) -> int:
    """Every peer holds ``v``, so the result is ``v`` quantized once (by the root)."""
    v = op_input(revision, tag)
    x = v.copy()
    try:
        info = await comm.broadcast(x, root=root, tag=tag, quantization=QUANT)
    except (pccl.CollectiveAborted, pccl.TooFewPeers) as exc:
        _check_intact(tag, exc, x, v)
        raise
    _check_world(tag, info.world_size)
    if root not in info.peers:
        raise WrongResult(f"tag {tag}: broadcast from {root:x} ran over {info.peers} without it")
    spread = float(v.max() - v.min())
    _check_close(f"tag {tag}: broadcast", x, v.astype(np.float64), spread / (2 * QMAX))
    return info.world_size


async def run_all_gather(comm: pccl.Communicator, revision: int, tag: int, root: int) -> int:
    """Every peer contributes ``v``: ``world_size`` copies of ``v``, each quantized once, and
    ``x`` untouched."""
    v = op_input(revision, tag)
    x = v.copy()
    try:
        got = await comm.all_gather(x, tag=tag, quantization=QUANT)
    except (pccl.CollectiveAborted, pccl.TooFewPeers) as exc:
        _check_intact(tag, exc, x, v)
        raise
    _check_intact(tag, ValueError("all-gather"), x, v)
    _check_world(tag, got.world_size)
    if len(got.arrays) != got.world_size or comm.peer_id not in got.peers:
        raise WrongResult(f"tag {tag}: all-gather of {got.world_size} peers returned {len(got.arrays)} arrays")
    spread = float(v.max() - v.min())
    for pid, array in zip(got.peers, got.arrays):
        if array.size != v.size:
            raise WrongResult(f"tag {tag}: peer {pid:x}'s gathered array has {array.size} elements, not {v.size}")
        _check_close(f"tag {tag}: all-gather of peer {pid:x}", array, v.astype(np.float64), spread / (2 * QMAX))
    return got.world_size


async def run_reduce_scatter(comm: pccl.Communicator, revision: int, tag: int, root: int) -> int:
    """This peer's slice of the all-reduce's result (the same bounds)."""
    v = op_input(revision, tag)
    x = v.copy()
    op = reduce_op(revision, tag)
    try:
        shard = await comm.reduce_scatter(x, op=op, tag=tag, quantization=QUANT)
    except (pccl.CollectiveAborted, pccl.TooFewPeers) as exc:
        _check_intact(tag, exc, x, v)
        raise
    n = shard.world_size
    _check_world(tag, n)
    base, extra = divmod(v.size, n)
    want = (shard.index * base + min(shard.index, extra), (shard.index + 1) * base + min(shard.index + 1, extra))
    if (shard.start, shard.stop) != want or shard.peers[shard.index] != comm.peer_id:
        raise WrongResult(f"tag {tag}: shard {shard} is not slice {shard.index} of {n} of {v.size} elements")
    v64 = v.astype(np.float64)[shard.start:shard.stop]
    spread = float(v.max() - v.min())
    expected, bound = (n * v64, n * (n * spread) / (2 * QMAX)) if op is pccl.ReduceOp.SUM else (
        v64, n * spread / (2 * QMAX))
    _check_close(f"tag {tag}: reduce-scatter {op.name} over {n} peers", x[shard.start:shard.stop], expected, bound)
    return n


async def run_all_reduce(comm: pccl.Communicator, revision: int, tag: int, root: int) -> int:
    v = op_input(revision, tag)
    x = v.copy()
    op = reduce_op(revision, tag)
    try:
        info = await comm.all_reduce(x, op=op, tag=tag, quantization=QUANT)
    except (pccl.CollectiveAborted, pccl.TooFewPeers) as exc:
        # CollectiveAborted: "an in-place buffer holds its input again"; TooFewPeers: untouched.
        if not np.array_equal(x.view(np.uint32), v.view(np.uint32)):
            raise WrongResult(f"tag {tag}: {type(exc).__name__} left the in-place buffer changed "
                              f"(max diff {float(np.abs(x - v).max())})") from exc
        raise
    n = info.world_size
    if not 2 <= n <= 64:
        raise WrongResult(f"tag {tag}: ReduceInfo.world_size {n}")
    v64 = v.astype(np.float64)
    spread = float(v64.max() - v64.min())  # every peer's input spans this
    if op is pccl.ReduceOp.SUM:
        expected = n * v64
        bound = n * (n * spread) / (2 * QMAX)        # N quantizations of frames spanning <= N*spread
    else:  # AVG and MAX of identical inputs are the input
        expected = v64
        bound = n * spread / (2 * QMAX)  # AVG: R / (2 QMAX) with R = n * spread; MAX: n quantizations
    error = float(np.abs(x.astype(np.float64) - expected).max())
    # Slack for the float32 accumulation and decode (lo + q*scale) on top of the bound.
    if not np.isfinite(error) or error > bound * (1 + 1e-3) + 1e-5 * float(np.abs(expected).max()):
        raise WrongResult(f"tag {tag}: {op.name} over {n} peers is off by {error:.6g} > bound {bound:.6g}")
    return n


#: The kinds ``--kinds`` may name.  Every peer contributes ``op_input(revision, tag)``, so no
#: expectation needs to know who took part.  A broadcast's root is ``min(comm.ring)`` read when
#: the batch starts (after the step's topology update and sync: every participant agrees); a
#: root that died meanwhile aborts the call (retry-safe), as it must.
KINDS: dict[str, OpKind] = {
    "all_reduce": OpKind("all_reduce", run_all_reduce),
    "broadcast": OpKind("broadcast", run_broadcast),
    "all_gather": OpKind("all_gather", run_all_gather),
    "reduce_scatter": OpKind("reduce_scatter", run_reduce_scatter),
}


def op_kind(kinds: list[OpKind], revision: int, tag: int) -> OpKind:
    """The kind of tag ``tag`` at ``revision``: the same on every peer, mixed across tags."""
    return kinds[(revision + tag) % len(kinds)]


# --- the loop -----------------------------------------------------------------------------------


class Peer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.kinds = [KINDS[k] for k in args.kinds]
        self.out = open(args.results, "a", buffering=1)
        self.state = pccl.SharedState({k: state_content(0, k) for k in STATE_SIZES}, revision=0)
        self.steps = 0

    def record(self, event: str, **fields: Any) -> None:
        self.out.write(json.dumps({"event": event, "t": round(time.time(), 3), "pid": os.getpid(), **fields}) + "\n")
        self.out.flush()

    def stop_requested(self, alone: bool) -> bool:
        try:
            with open(self.args.stop) as f:
                target = json.load(f).get("revision", 0)
        except (OSError, ValueError):
            return False
        return alone or self.state.revision >= target

    async def wait_while_alone(self, comm: pccl.Communicator) -> bool:
        """Vote newcomers in until the group has two peers; ``False``: stop requested meanwhile."""
        while comm.world_size < 2:
            if self.stop_requested(alone=True):
                return False
            await trio.sleep(self.args.heartbeat)
            await comm.update_topology()
        return True

    async def sync(self, comm: pccl.Communicator) -> None:
        info = await comm.sync_shared_state(self.state)
        digest = state_hash(self.state)
        self.record("sync", revision=info.revision, hash=digest, received=info.received, reason=info.reason.name,
                    rx=info.rx_bytes, world=comm.world_size)
        for key in STATE_SIZES:
            if not np.array_equal(self.state[key].view(np.uint32), state_content(info.revision, key).view(np.uint32)):
                raise StepFailure("wrong_state", revision=info.revision, key=key, hash=digest,
                                  reason=info.reason.name)

    async def run_batch(self, comm: pccl.Communicator, tags: list[int]) -> tuple[set[int], list[int], list[str]]:
        """Run ``tags`` concurrently (tag order, at most MAX_IN_FLIGHT at once); the tags done,
        the world sizes they ran over and the retry-safe errors of the others."""
        revision = self.state.revision
        root = min(comm.ring)  # every participant of this batch reads the same ring here
        done: set[int] = set()
        worlds: list[int] = []
        errors: list[str] = []
        failures: list[StepFailure] = []
        sem = trio.Semaphore(MAX_IN_FLIGHT)

        async def one(tag: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            kind = op_kind(self.kinds, revision, tag)
            try:
                # started() is no checkpoint: the op runs on up to its first one (its vote sent)
                # before the launcher acquires the next tag's slot.
                task_status.started()
                worlds.append(await kind.run(comm, revision, tag, root))
                done.add(tag)
            except (pccl.CollectiveAborted, pccl.TooFewPeers) as exc:
                cause = exc.__cause__
                errors.append(type(exc).__name__ + (f"<{type(cause).__name__}" if cause is not None else ""))
            except pccl.InvalidUsage as exc:
                failures.append(StepFailure("refused_legal_call", call=kind.name, tag=tag, revision=revision,
                                            error=type(exc).__name__, message=str(exc)))
            except WrongResult as exc:
                failures.append(StepFailure("wrong_result", call=kind.name, tag=tag, revision=revision,
                                            message=str(exc)))
            except pccl.PCCLError as exc:
                failures.append(StepFailure("unexpected_error", call=kind.name, tag=tag, revision=revision,
                                            error=type(exc).__name__, message=str(exc)))
            finally:
                sem.release()

        async with trio.open_nursery() as nursery:
            for tag in tags:  # acquired in tag order: tag k starts before tag k+1
                await sem.acquire()
                await nursery.start(one, tag)
        if failures:
            raise failures[0]
        return done, worlds, errors

    async def step(self, comm: pccl.Communicator, first: bool) -> bool:
        """One step; ``False`` once the peer should stop."""
        if not first:
            if self.stop_requested(alone=False):
                return False
            if await comm.are_peers_pending():
                await comm.update_topology()
        if not await self.wait_while_alone(comm):
            return False
        aborted = 0
        worlds: list[int] = []
        while True:  # until every op of the step succeeded: sync, then the ops
            await self.sync(comm)
            remaining = list(range(OPS))
            restart = False
            while remaining:
                done, batch_worlds, errors = await self.run_batch(comm, remaining)
                worlds += batch_worlds
                remaining = [t for t in remaining if t not in done]
                if not remaining:
                    break
                aborted += 1
                ring_before = set(comm.ring)
                self.record("retry", revision=self.state.revision, remaining=remaining, errors=sorted(set(errors)),
                            world=comm.world_size)
                await comm.update_topology()
                if not await self.wait_while_alone(comm):
                    return False
                if set(comm.ring) - ring_before:
                    # A newcomer was accepted: it syncs next and then runs every op of the step.
                    self.record("retry", revision=self.state.revision, remaining=list(range(OPS)),
                                errors=["newcomer accepted: sync again"], world=comm.world_size)
                    restart = True
                    break
            if not restart:
                break
        self.steps += 1
        self.record("step", step=self.steps, revision=self.state.revision, hash=state_hash(self.state), ops=OPS,
                    aborted=aborted, worlds=sorted(set(worlds)), world=comm.world_size)
        self.state.revision += 1
        for key in STATE_SIZES:
            self.state[key][...] = state_content(self.state.revision, key)
        return True

    async def run(self) -> None:
        config = pccl.Config(peer_timeout=self.args.peer_timeout, heartbeat_interval=self.args.heartbeat,
                             connect_timeout=10.0, p2p_base_port=0, shared_state_base_port=0)
        self.record("start", name=self.args.name)
        async with pccl.open_communicator(self.args.master, config=config) as comm:
            self.record("joined", peer_id=comm.peer_id, world=comm.world_size)
            first = True
            while True:
                try:
                    if not await self.step(comm, first):
                        break
                except pccl.PhaseMismatch as exc:
                    # The group's other peers waited elsewhere: meet them at update_topology.
                    self.record("retry", revision=self.state.revision, errors=[f"PhaseMismatch: {exc}"])
                first = False
            self.record("stopped", steps=self.steps, revision=self.state.revision)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--master", required=True)
    p.add_argument("--name", default="peer")
    p.add_argument("--results", required=True, help="JSON-lines file this peer appends its records to")
    p.add_argument("--stop", required=True, help="stop file (see the module docstring)")
    p.add_argument("--kinds", default="all_reduce,broadcast,all_gather,reduce_scatter", type=lambda s: s.split(","),
                   help=f"comma-separated collective kinds to mix (available: {', '.join(KINDS)})")
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--heartbeat", type=float, default=0.5)
    args = p.parse_args(argv)
    unknown = [k for k in args.kinds if k not in KINDS]
    if unknown:
        p.error(f"--kinds: not available in the stress peer yet: {', '.join(unknown)}")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    peer = Peer(args)
    try:
        trio.run(peer.run)
    except StepFailure as exc:
        peer.record("failure", kind=exc.kind, **exc.detail)
        return 3
    except pccl.InvalidUsage as exc:  # a vote or a sync refused
        peer.record("failure", kind="refused_legal_call", error=type(exc).__name__, message=str(exc),
                    revision=peer.state.revision, traceback=traceback.format_exc(limit=8))
        return 3
    except Exception as exc:  # noqa: BLE001 - anything else is a failure of the run, recorded
        peer.record("failure", kind="unexpected_error", error=type(exc).__name__, message=str(exc),
                    revision=peer.state.revision, traceback=traceback.format_exc(limit=8))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
