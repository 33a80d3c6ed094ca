"""Peers whose loops diverge (issue 19 item 6), on real TCP with a real master: a peer in
``all_reduce`` while another is in ``update_topology`` or ``sync_shared_state``, or in
``all_reduce`` on another tag (issue 31 point 5), used to wait for ever.  The master ends such a
phase mismatch with a clear error on every peer involved well within ``peer_timeout``, and a
loop written with ``steps()`` (or calling again on its tag) goes on afterwards."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import CollectiveAborted, Config, PhaseMismatch, ReduceOp
from pccl.testing import open_test_cluster

TOKEN = "phase-mismatch-token"
PEER_TIMEOUT = 4.0
CFG = Config(peer_timeout=PEER_TIMEOUT, heartbeat_interval=0.4, connect_timeout=5.0, p2p_base_port=0)
#: The master ends a mismatch after a quarter of peer_timeout; every call must have its error
#: before a peer_timeout has passed.
WITHIN = PEER_TIMEOUT
SOON = 30.0


def _group(world: int) -> Any:
    return open_test_cluster(world, token=TOKEN, config=CFG, soon=SOON)


async def _outcome(call: Any) -> Any:
    try:
        return await call()
    except pccl.PCCLError as exc:
        return exc


async def _race(*calls: Any) -> list[Any]:
    """Run the calls at once; each one's result or pccl error.  All must end within WITHIN."""
    out: list[Any] = [None] * len(calls)

    async def one(i: int) -> None:
        out[i] = await _outcome(calls[i])

    with trio.fail_after(WITHIN):
        async with trio.open_nursery() as nursery:
            for i in range(len(calls)):
                nursery.start_soon(one, i)
    return out


def _mismatch_of(error: Any) -> PhaseMismatch:
    """The PhaseMismatch behind a call's error (an all-reduce raises CollectiveAborted from it)."""
    if isinstance(error, CollectiveAborted):
        assert isinstance(error.__cause__, PhaseMismatch), repr(error)
        return error.__cause__
    assert isinstance(error, PhaseMismatch), repr(error)
    return error


@pytest.mark.parametrize("reduce", ["all_reduce", "all_reduce_many"])
async def test_all_reduce_against_update_topology_ends_both_then_both_go_on(reduce: str) -> None:
    async with _group(2) as (master, comms, _):
        a, b = comms
        x = np.arange(1000, dtype=np.float32)
        xa = x.copy()
        run = (lambda: a.all_reduce(xa, tag=3)) if reduce == "all_reduce" else (lambda: a.all_reduce_many([xa]))
        ea, eb = await _race(run, b.update_topology)
        ma, mb = _mismatch_of(ea), _mismatch_of(eb)
        assert str(ma) == str(mb)
        assert f"peer {a.peer_id:x} in all_reduce (tag " in str(ma) and f"peer {b.peer_id:x} in update_topology()" in str(ma)
        assert np.array_equal(xa, x)  # the aborted all-reduce left the input alone
        # Both go on to the next step and meet there.
        with trio.fail_after(SOON):
            await _race(a.update_topology, b.update_topology)
            bufs = [x.copy(), 2 * x]
            infos = await _race(lambda: a.all_reduce(bufs[0]), lambda: b.all_reduce(bufs[1]))
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert np.array_equal(bufs[0], 3 * x) and np.array_equal(bufs[1], 3 * x)


async def test_sync_against_all_reduce_and_against_update_topology() -> None:
    async with _group(2) as (master, comms, _):
        a, b = comms
        w = [np.ones(256, np.float32), np.ones(256, np.float32)]
        states = [pccl.SharedState({"w": w[i]}, revision=0) for i in range(2)]
        ea, eb = await _race(lambda: a.all_reduce(np.ones(8, np.float32)), lambda: b.sync_shared_state(states[1]))
        assert "sync_shared_state()" in str(_mismatch_of(eb)) and "all_reduce (tag 0)" in str(_mismatch_of(ea))
        ea, eb = await _race(a.update_topology, lambda: b.sync_shared_state(states[1]))
        assert "update_topology()" in str(_mismatch_of(ea)) and "sync_shared_state()" in str(_mismatch_of(eb))
        infos = await _race(lambda: a.sync_shared_state(states[0]), lambda: b.sync_shared_state(states[1]))
        assert all(isinstance(i, pccl.SyncInfo) for i in infos), infos


async def test_no_error_while_one_peer_may_still_come_then_every_peer_gets_one() -> None:
    """Two peers in all_reduce, one in update_topology, the third computing: nothing is wrong
    yet (it may join either call).  Once it calls all_reduce too, all three calls end."""
    async with _group(3) as (master, comms, _):
        a, b, c = comms
        out: dict[str, Any] = {}
        idle_over = trio.Event()

        async def record(key: str, call: Any) -> None:
            out[key] = await _outcome(call)

        async def c_computes_then_reduces() -> None:
            await trio.sleep(2 * PEER_TIMEOUT / 4 + 0.5)  # twice the master's grace period
            assert not out, out  # nobody's call ended while c was busy
            idle_over.set()
            await record("c", lambda: c.all_reduce(np.ones(8, np.float32)))

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(record, "a", lambda: a.all_reduce(np.ones(8, np.float32)))
                nursery.start_soon(record, "b", b.update_topology)
                nursery.start_soon(c_computes_then_reduces)
                await idle_over.wait()
                with trio.fail_after(WITHIN):
                    while len(out) < 3:
                        await trio.sleep(0.01)
        assert {_mismatch_of(e).args[0] for e in out.values()} == {str(_mismatch_of(out["a"]))}
        for comm in comms:
            assert f"{comm.peer_id:x}" in str(_mismatch_of(out["a"]))


async def test_a_steps_loop_goes_on_after_a_peer_skipped_its_all_reduce(caplog: pytest.LogCaptureFixture) -> None:
    """Peer 1's loop skips its all-reduce in step 2 (a bug, or a condition only it saw), so it
    reaches update_topology while peer 0 waits in all_reduce.  Both loops, written as the docs
    recommend (an aborted all-reduce goes on to the next step), carry on in lockstep."""
    steps = 6
    async with _group(2) as (master, comms, _):
        weights = [np.zeros(512, np.float32) for _ in comms]
        states = [pccl.SharedState({"w": w}, revision=0) for w in weights]
        done: dict[int, list[int]] = {0: [], 1: []}
        aborted: list[BaseException] = []

        async def loop(i: int) -> None:
            comm, w, state = comms[i], weights[i], states[i]
            step = 0
            async for _info in comm.steps(state):
                step += 1
                if step > steps:
                    break
                if i == 1 and step == 2:
                    continue  # diverges: straight on to the next step's update_topology
                grads = np.random.default_rng(step * 10 + i).standard_normal(512).astype(np.float32)
                try:
                    await comm.all_reduce(grads, op=ReduceOp.AVG)
                except CollectiveAborted as exc:
                    aborted.append(exc)
                    continue
                w += grads
                state.revision += 1
                done[i].append(step)

        with caplog.at_level(logging.INFO, logger="pccl"), trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop, 0)
                nursery.start_soon(loop, 1)
        assert len(aborted) == 1 and isinstance(aborted[0].__cause__, PhaseMismatch), aborted
        assert done[0] == done[1] == [1, *range(3, steps + 1)]
        assert np.array_equal(weights[0], weights[1]) and states[0].revision == states[1].revision == steps - 1
        assert any("starting the step again" in r.getMessage() for r in caplog.records)


# --- collectives on different tags (issue 31, point 5) ----------------------------------------------

#: the master's grace before it ends a mismatch (a quarter of peer_timeout by default)
GRACE = PEER_TIMEOUT / 4


async def test_all_reduces_on_different_tags_end_on_both_peers_naming_each_tag() -> None:
    """``all_reduce(tag=1)`` on one peer and ``all_reduce(tag=2)`` on the other used to wait for
    ever: both end with a PhaseMismatch naming who waits on which tag, after the grace (and well
    before a peer_timeout), the inputs untouched; the same tag then meets."""
    async with _group(2) as (master, comms, _):
        a, b = comms
        x = np.arange(1000, dtype=np.float32)
        xa, xb = x.copy(), 2 * x
        start = trio.current_time()
        ea, eb = await _race(lambda: a.all_reduce(xa, tag=1), lambda: b.all_reduce(xb, tag=2))
        elapsed = trio.current_time() - start
        ma, mb = _mismatch_of(ea), _mismatch_of(eb)
        assert str(ma) == str(mb)
        assert f"peer {a.peer_id:x} waits in all_reduce (tag 1)" in str(ma), str(ma)
        assert f"peer {b.peer_id:x} waits in all_reduce (tag 2)" in str(ma), str(ma)
        assert GRACE <= elapsed < PEER_TIMEOUT, elapsed
        assert np.array_equal(xa, x) and np.array_equal(xb, 2 * x)
        infos = await _race(lambda: a.all_reduce(xa, tag=1), lambda: b.all_reduce(xb, tag=1))
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert np.array_equal(xa, 3 * x) and np.array_equal(xb, 3 * x)


async def test_loops_that_diverge_on_a_tag_call_again_on_the_same_tag_and_go_on() -> None:
    """Each step all-reduces on tag 1; in step 2 peer 1's loop uses tag 2 (a bug, or a tag
    computed from state only it saw).  Both calls end with a PhaseMismatch; each loop calls
    again on tag 1 and the step succeeds, as do the steps after it, in lockstep."""
    steps = 4
    async with _group(2) as (master, comms, _):
        grads = [[np.full(256, 10 * step + i, np.float32) for step in range(steps)] for i in range(2)]
        results: dict[int, list[np.ndarray]] = {0: [], 1: []}
        mismatches: dict[int, list[PhaseMismatch]] = {0: [], 1: []}

        async def loop(i: int) -> None:
            comm = comms[i]
            for step in range(steps):
                buf = grads[i][step].copy()
                tag = 2 if (i == 1 and step == 2) else 1
                while True:
                    try:
                        await comm.all_reduce(buf, tag=tag)
                        break
                    except CollectiveAborted as exc:
                        mismatches[i].append(_mismatch_of(exc))
                        assert np.array_equal(buf, grads[i][step])  # the input, restored
                        tag = 1  # call again, on the step's tag
                results[i].append(buf)

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(loop, 0)
                nursery.start_soon(loop, 1)
        assert len(mismatches[0]) == len(mismatches[1]) == 1
        assert str(mismatches[0][0]) == str(mismatches[1][0])
        assert "all_reduce (tag 1)" in str(mismatches[0][0]) and "all_reduce (tag 2)" in str(mismatches[0][0])
        for step in range(steps):
            want = grads[0][step] + grads[1][step]
            assert np.array_equal(results[0][step], want) and np.array_equal(results[1][step], want)
