"""Hundreds of concurrent LARGE collectives on distinct tags, on real TCP in this process
(issue 31, point 5).

A large op runs one sender and one receiver thread per lane.  Started all at once, hundreds of
them used to start their threads together: 300 all-reduces of 512 KiB on two peers had 1,199
threads alive and took 34.5 s, 500 did not finish in a minute.  Now a few ops of a ring run
their threads at a time, admitted in the order the master commenced them
(:mod:`pccl.collectives.turns`).  These tests require every result correct, no abort, and that
the lane threads alive at any moment stay within that bound (sampled by a Trio task: without
the bound it sees hundreds and the test fails at once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import CollectiveAborted, Config
from pccl.collectives.turns import THREAD_OPS
from pccl.testing import open_test_cluster

TOKEN = "big-tags-token"
#: Long enough that a peer starved of CPU on a loaded 2-core machine is not taken for a dead one.
CONFIG = Config(peer_timeout=5.0, heartbeat_interval=0.5, connect_timeout=10.0, p2p_base_port=0)
#: Bound for one batch of concurrent calls on a loaded 2-core machine (a hang fails, not speed).
BOUND = 120.0
WORLD = 2
#: Lane threads that may run at once in this process: per peer, THREAD_OPS ops with a sender and
#: a receiver thread on each of its one lane.
MAX_LANE_THREADS = WORLD * THREAD_OPS * 2


class LaneThreadCeiling:
    """Samples the ring's lane threads alive in this process; fails the test as soon as there
    are more than the turns allow."""

    def __init__(self) -> None:
        self.peak = 0

    async def watch(self) -> None:
        while True:
            alive = sum(t.name == "pccl-ring-lane" for t in threading.enumerate())
            self.peak = max(self.peak, alive)
            assert alive <= MAX_LANE_THREADS, f"{alive} lane threads alive at once, at most {MAX_LANE_THREADS} expected"
            await trio.sleep(0.01)


async def _concurrently(comms: list[pccl.Communicator], calls: list[Any], ceiling: LaneThreadCeiling) -> list[list[Any]]:
    """Start ``calls[t](i, comm)`` for every tag ``t`` and peer ``i`` at once; returns each
    call's result or pccl error, per tag and peer."""
    out: list[list[Any]] = [[None] * len(comms) for _ in calls]

    async def one(t: int, i: int) -> None:
        try:
            out[t][i] = await calls[t](i, comms[i])
        except pccl.PCCLError as exc:
            out[t][i] = exc

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as watcher:
            watcher.start_soon(ceiling.watch)
            async with trio.open_nursery() as nursery:
                for t in range(len(calls)):
                    for i in range(len(comms)):
                        nursery.start_soon(one, t, i)
            watcher.cancel_scope.cancel()
    return out


def _failures(out: list[list[Any]]) -> list[tuple[int, Any]]:
    return [(t, r) for t, row in enumerate(out) for r in row if isinstance(r, pccl.PCCLError)]


@pytest.mark.parametrize(
    "tags, count",
    [
        (300, 131072),  # 512 KiB each
        pytest.param(500, 262144, marks=pytest.mark.slow),  # 1 MiB each
    ],
)
async def test_hundreds_of_concurrent_large_all_reduces_finish_with_few_lane_threads(
    tags: int, count: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    rng = np.random.default_rng(531)
    # Small integers: every summation order gives the exact sum, so numpy's is the reference.
    inputs = [[rng.integers(-1000, 1000, count).astype(np.float32) for _ in range(WORLD)] for _ in range(tags)]
    bufs = [[x.copy() for x in row] for row in inputs]
    calls = [lambda i, c, t=t: c.all_reduce(bufs[t][i], tag=t + 1) for t in range(tags)]
    ceiling = LaneThreadCeiling()
    async with open_test_cluster(WORLD, token=TOKEN, config=CONFIG, soon=30.0) as (master, comms, _):
        out = await _concurrently(comms, calls, ceiling)
        assert master.statistics().kicks == 0
    failed = _failures(out)
    assert not failed, f"{len(failed)} calls failed, first: {failed[:3]}"
    assert not any(isinstance(r, CollectiveAborted) for row in out for r in row)
    for t in range(tags):
        expected = inputs[t][0] + inputs[t][1]
        assert all(np.array_equal(b, expected) for b in bufs[t]), f"tag {t + 1} reduced wrongly"
    assert 0 < ceiling.peak <= MAX_LANE_THREADS  # large ops did run in lane threads
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) <= 5, f"{len(loud)} warnings, first: {loud[:5]}"


async def test_large_and_small_ops_of_every_kind_run_concurrently() -> None:
    """All-reduce, broadcast, all-gather and reduce-scatter, small (inline) and large (lane
    threads) interleaved, 240 tags at once: every result is exact."""
    kinds = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
    sizes = (4096, 196608)  # 16 KiB (run inline) and 768 KiB (lane threads) of float32
    tags = 240
    rng = np.random.default_rng(77)
    plans = [(kinds[t % 4], sizes[(t // 4) % 2]) for t in range(tags)]
    inputs = [[rng.integers(-1000, 1000, n).astype(np.float32) for _ in range(WORLD)] for _, n in plans]
    bufs = [[x.copy() for x in row] for row in inputs]
    ceiling = LaneThreadCeiling()
    async with open_test_cluster(WORLD, token=TOKEN, config=CONFIG, soon=30.0) as (master, comms, _):
        root = comms[1].peer_id
        ids = [c.peer_id for c in comms]

        def call(t: int) -> Any:
            kind = plans[t][0]
            if kind == "all_reduce":
                return lambda i, c: c.all_reduce(bufs[t][i], tag=t + 1)
            if kind == "broadcast":
                return lambda i, c: c.broadcast(bufs[t][i], root=root, tag=t + 1)
            if kind == "all_gather":
                return lambda i, c: c.all_gather(bufs[t][i], tag=t + 1)
            return lambda i, c: c.reduce_scatter(bufs[t][i], tag=t + 1)

        out = await _concurrently(comms, [call(t) for t in range(tags)], ceiling)
        assert master.statistics().kicks == 0
    failed = _failures(out)
    assert not failed, f"{len(failed)} calls failed, first: {failed[:3]}"
    for t, (kind, _n) in enumerate(plans):
        total = inputs[t][0] + inputs[t][1]
        for i in range(WORLD):
            got = out[t][i]
            if kind == "all_reduce":
                assert np.array_equal(bufs[t][i], total), f"tag {t + 1} ({kind}) wrong on peer {i}"
            elif kind == "broadcast":
                assert np.array_equal(bufs[t][i], inputs[t][1]), f"tag {t + 1} ({kind}) wrong on peer {i}"
            elif kind == "all_gather":
                assert isinstance(got, pccl.Gathered), got
                by_peer = dict(zip(got.peers, got.arrays))
                for j in range(WORLD):
                    assert np.array_equal(by_peer[ids[j]], inputs[t][j]), f"tag {t + 1} ({kind}) wrong on peer {i}"
            else:
                assert isinstance(got, pccl.Shard), got
                assert np.array_equal(bufs[t][i][got.start:got.stop], total[got.start:got.stop]), (
                    f"tag {t + 1} ({kind}) wrong on peer {i}")
    assert 0 < ceiling.peak <= MAX_LANE_THREADS


async def test_a_large_op_cancelled_while_it_waits_for_its_turn_aborts_alone() -> None:
    """40 all-reduces of 1 MiB at once; once three have finished, peer 0 cancels its call on
    the tag the master commenced last of those peer 0 has not finished (waiting for its turn
    behind the others: turns go in commence order, which need not be tag order).  That call
    raises Cancelled with its input restored, peer 1's ends CollectiveAborted, every other
    tag is reduced exactly, and no turn is lost (the others all finish)."""
    tags, count = 40, 262144
    rng = np.random.default_rng(40)
    inputs = [[rng.integers(-1000, 1000, count).astype(np.float32) for _ in range(WORLD)] for _ in range(tags)]
    bufs = [[x.copy() for x in row] for row in inputs]
    out: list[list[Any]] = [[None] * WORLD for _ in range(tags)]
    finished = [0]
    scopes = [trio.CancelScope() for _ in range(tags)]  # peer 0's calls
    chosen: list[int] = []
    async with open_test_cluster(WORLD, token=TOKEN, config=CONFIG, soon=30.0) as (master, comms, _):

        async def one(t: int, i: int) -> None:
            scope = scopes[t] if i == 0 else trio.CancelScope()
            with scope:
                try:
                    out[t][i] = await comms[i].all_reduce(bufs[t][i], tag=t + 1)
                    finished[0] += 1
                except pccl.PCCLError as exc:
                    out[t][i] = exc
            if scope.cancelled_caught:
                out[t][i] = "cancelled"

        async def cancel_victim() -> None:
            while True:
                if finished[0] >= 3:
                    # the last commenced (largest seq) of peer 0's unfinished ops: the one that
                    # waits longest for its turn (turns go in commence order; the largest *tag*
                    # may have commenced early and be moving data when it is cancelled)
                    waiting = [(op.seq, op.tag - 1) for op in pccl.testing.master_snapshot(master).ops
                               if op.seq is not None and 0 < op.tag <= tags and out[op.tag - 1][0] is None]
                    if waiting:
                        chosen.append(max(waiting)[1])
                        scopes[chosen[0]].cancel()
                        return
                await trio.sleep(0.001)

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(cancel_victim)
                for t in range(tags):
                    for i in range(WORLD):
                        nursery.start_soon(one, t, i)
        assert master.statistics().kicks == 0
    victim = chosen[0]
    assert out[victim][0] == "cancelled", out[victim]
    assert np.array_equal(bufs[victim][0], inputs[victim][0])  # restored
    assert isinstance(out[victim][1], CollectiveAborted), out[victim]
    for t in range(tags):
        if t != victim:
            expected = inputs[t][0] + inputs[t][1]
            assert all(isinstance(r, pccl.ReduceInfo) for r in out[t]), out[t]
            assert all(np.array_equal(b, expected) for b in bufs[t]), f"tag {t + 1} reduced wrongly"
