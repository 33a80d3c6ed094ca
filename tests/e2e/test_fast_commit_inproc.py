"""``Config.fast_commit`` (docs/protocol.rst, "Design: one master round trip per collective")
with peers as Trio tasks in this process (real TCP): calls begin without the master's vote, give
the results the vote gives, and a disagreement still raises ``InvalidUsage`` on every peer with
the input restored — the master checks the Begins while the rings run — after which the same
tag, agreed, runs again (on a re-wired ring)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import Config, InvalidUsage, Quantization, ReduceOp
from pccl.testing import each, open_test_cluster

TOKEN = "fast-commit"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0, fast_commit=True)
SOON = 30.0


async def test_begun_calls_give_the_voted_results_one_after_the_other() -> None:
    async with open_test_cluster(3, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ids = [c.peer_id for c in comms]
        for k in range(4):  # the same tags again: each use of a tag is a new derived seq
            xs = [np.arange(1000, dtype=np.float32) * (i + 1 + k) for i in range(3)]
            infos = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=1))
            assert all(isinstance(info, pccl.ReduceInfo) and info.world_size == 3 for info in infos), infos
            want = np.arange(1000, dtype=np.float32) * (6 + 3 * k)
            assert all(np.array_equal(x, want) for x in xs)
            ys = [np.full(7, i + 1.0, np.float32) for i in range(3)]
            await each(comms, lambda i, c: c.broadcast(ys[i], root=ids[2], tag=2))
            assert all(np.array_equal(y, np.full(7, 3.0, np.float32)) for y in ys)
            zs = [np.arange(9, dtype=np.float32) + i for i in range(3)]
            shards = await each(comms, lambda i, c: c.reduce_scatter(zs[i], tag=3))
            total = sum(np.arange(9, dtype=np.float32) + i for i in range(3))
            assert sorted((s.start, s.stop) for s in shards) == [(0, 3), (3, 6), (6, 9)]
            assert all(np.array_equal(zs[i][s.start:s.stop], total[s.start:s.stop]) for i, s in enumerate(shards))
        assert pccl.testing.master_snapshot(master).ops == ()


@pytest.mark.parametrize("case", ["dtype", "op", "count", "bits", "root"])
async def test_a_disagreement_is_invalid_usage_on_every_peer_with_the_input_restored(case: str) -> None:
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ids = [c.peer_id for c in comms]
        inputs = [np.arange(11 if case == "count" and i else 10, dtype=np.float64 if case == "dtype" and i
                            else np.float32) * (i + 2) for i in range(2)]
        xs = [x.copy() for x in inputs]

        async def call(i: int, comm: pccl.Communicator) -> Any:
            x = xs[i]
            if case == "op":
                return await comm.all_reduce(x, op=ReduceOp.MAX if i else ReduceOp.SUM, tag=5)
            if case == "bits":
                return await comm.all_reduce(x, tag=5, quantization=Quantization(dtype="uint4" if i else np.uint8))
            if case == "root":
                return await comm.broadcast(x, root=ids[i], tag=5)
            return await comm.all_reduce(x, tag=5)

        outcome = await each(comms, call)
        assert all(isinstance(o, InvalidUsage) for o in outcome), outcome
        text = str(outcome[0])
        assert "disagree" in text and f"peer {ids[0]:x}" in text and f"peer {ids[1]:x}" in text, text
        assert all(np.array_equal(x, want) for x, want in zip(xs, inputs))  # restored
        agreed = [np.arange(10, dtype=np.float32) * (i + 2) for i in range(2)]
        infos = await each(comms, lambda i, c: c.all_reduce(agreed[i], tag=5))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(np.array_equal(a, np.arange(10, dtype=np.float32) * 5) for a in agreed)


async def test_ring_calls_in_different_orders_on_each_peer_all_complete() -> None:
    # Each peer's first call begins (nothing else in flight) and its second votes, joining the
    # op the other peer began: peer 0 begins tag 1's op, peer 1 tag 2's, and each runs the two
    # in the other's order.  Large ring ops waited for each other until the watchdog aborted
    # both (a begun op's own arming Commence recorded its seq as waiting again, holding the
    # later op's lane threads back).  (Over the partner links:
    # tests/e2e/test_partner_crossing_inproc.py.)
    algorithm = "ring"

    config = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                    shared_state_base_port=0, fast_commit=True, all_reduce_algorithm=algorithm)
    async with open_test_cluster(2, token=TOKEN, config=config, soon=SOON) as (master, comms, _):
        for size in (1000, 600_000):  # small (inline), and large (lane threads)
            xs = {(i, tag): np.full(size, float(i + 1) * tag, np.float32) for i in range(2) for tag in (1, 2)}
            infos: list[Any] = []

            async def call(i: int, comm: pccl.Communicator) -> None:
                async with trio.open_nursery() as nursery:
                    for tag in ((1, 2) if i == 0 else (2, 1)):
                        nursery.start_soon(lambda t=tag: _reduce(comm, xs[(i, t)], t, infos))
                        await trio.sleep(0.05)

            with trio.fail_after(20):
                await each(comms, call)
            assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
            for (i, tag), x in xs.items():
                assert np.array_equal(x, np.full(size, 3.0 * tag, np.float32)), (i, tag)
        assert pccl.testing.master_snapshot(master).ops == ()


async def _reduce(comm: pccl.Communicator, x: np.ndarray, tag: int, infos: list[Any]) -> None:
    try:
        infos.append(await comm.all_reduce(x, tag=tag))
    except pccl.PCCLError as exc:
        infos.append(exc)


@pytest.mark.parametrize("size", [1000, 300_000])  # small (inline), and large (lane threads)
async def test_calls_started_together_all_complete(size: int) -> None:
    # Every peer starts the same tags at once (one nursery; Trio runs them in an order of its
    # own on each peer).  Had each peer's first-run call begun, two peers would begin different
    # tags and run the rest in different orders (large ops waited for each other's lane turns
    # until the watchdog aborted them); calls started together all see each other and vote.
    tags = 40
    xs = {(i, tag): np.full(size, float(i + 1) * tag, np.float32) for i in range(2) for tag in range(1, tags + 1)}
    infos: list[Any] = []
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for tag in range(1, tags + 1):
                    for i in range(2):
                        nursery.start_soon(_reduce, comms[i], xs[(i, tag)], tag, infos)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), [i for i in infos if not isinstance(i, pccl.ReduceInfo)][:3]
        for (i, tag), x in xs.items():
            assert np.array_equal(x, np.full(size, 3.0 * tag, np.float32)), (i, tag)
        assert pccl.testing.master_snapshot(master).ops == ()


async def _until_no_ops(master: Any) -> None:
    while pccl.testing.master_snapshot(master).ops:
        await trio.sleep(0.005)


async def test_a_lone_begun_call_cancelled_before_the_others_began_is_withdrawn() -> None:
    # Peer 0 begins tag 4 alone and is cancelled: it withdraws its Begin as a voter withdraws
    # its vote.  Reported as a failure instead, the op stayed open until peer 1's Begin (the
    # failure is held for a disagreement that may still show), and peer 0's update_topology()
    # was refused OUT_OF_PHASE meanwhile.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        x = np.full(1000, 1.0, np.float32)
        with trio.fail_after(SOON):
            with trio.move_on_after(0.3) as waited:
                await comms[0].all_reduce(x, tag=4)
            assert waited.cancelled_caught and np.array_equal(x, np.full(1000, 1.0, np.float32))
            await _until_no_ops(master)  # the op is over at the master at once
            await each(comms, lambda i, c: c.update_topology())
            xs = [np.full(1000, i + 1.0, np.float32) for i in range(2)]
            infos = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=4))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(np.array_equal(x, np.full(1000, 3.0, np.float32)) for x in xs)
        assert [c.statistics().collectives_aborted for c in comms] == [0, 0]


async def test_a_withdrawn_begin_makes_the_others_retry_the_next_use_of_the_tag() -> None:
    # Peers 0 and 1 begin tag 4; peer 0 is cancelled before peer 2 began: the op ends
    # WITHDRAWN, peer 1's call retries the tag's next use at once (no re-wire) and completes
    # once the others call again; peer 2's Begin of the withdrawn use hears the withdrawal and
    # retries too.
    async with open_test_cluster(3, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        round_before = comms[0].statistics().p2p_rounds
        xs = [np.full(1000, i + 1.0, np.float32) for i in range(3)]
        infos: dict[int, Any] = {}

        async def call(i: int) -> None:
            infos[i] = await comms[i].all_reduce(xs[i], tag=4)

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1)
                with trio.move_on_after(0.3):
                    await comms[0].all_reduce(xs[0], tag=4)
                while comms[1].statistics().retries == 0:  # withdrawn: peer 1 retries (a new op)
                    await trio.sleep(0.005)
                nursery.start_soon(call, 0)
                nursery.start_soon(call, 2)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos.values()) and len(infos) == 3, infos
        assert all(np.array_equal(x, np.full(1000, 6.0, np.float32)) for x in xs)
        assert [c.statistics().collectives_aborted for c in comms] == [0, 0, 0]
        assert comms[1].statistics().retries == 1 and comms[2].statistics().retries == 1
        assert comms[0].statistics().p2p_rounds == round_before  # the ring stayed fresh


@pytest.mark.parametrize("size", [1000, 300_000])  # small (inline), and large (lane threads)
async def test_a_peer_that_began_another_tag_first_does_not_block_the_link(size: int) -> None:
    # Peer 0 begins tag 1 alone, then calls tag 2 (it votes: tag 1 is in flight); peer 1,
    # sequential, begins tag 2 alone and calls tag 1 only after it.  Tag 1's frames reach
    # peer 1 first: parked at the head of its link they blocked tag 2's behind them, which
    # peer 1 waits for before it calls tag 1 (a crossing), until the watchdog aborted both.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        xs = {(i, tag): np.full(size, float(i + 1) * tag, np.float32) for i in range(2) for tag in (1, 2)}
        infos: list[Any] = []

        async def first() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_reduce, comms[0], xs[(0, 1)], 1, infos)
                await trio.sleep(0.05)
                nursery.start_soon(_reduce, comms[0], xs[(0, 2)], 2, infos)

        async def second() -> None:
            await trio.sleep(0.02)
            await _reduce(comms[1], xs[(1, 2)], 2, infos)
            await _reduce(comms[1], xs[(1, 1)], 1, infos)

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                nursery.start_soon(second)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos) and len(infos) == 4, infos
        for (i, tag), x in xs.items():
            assert np.array_equal(x, np.full(size, 3.0 * tag, np.float32)), (i, tag)
        assert [c.statistics().collectives_aborted for c in comms] == [0, 0]
