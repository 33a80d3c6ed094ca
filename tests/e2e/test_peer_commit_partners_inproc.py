"""``Config.peer_commit`` at 8 peers on real TCP loopback, where every topology round wires the
halving-doubling partner links: the acks go to both ring neighbours and over the partner links
(pccl.collectives.links.RingLinks.ack_links), an ack to the successor on a lane whose frames worker
threads send goes through the lane's thread channel, and a partner killed right after its acks
went out splits nobody."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import trio

import pccl
from pccl import Config
from pccl.protocol import messages as m
from pccl.protocol.algorithms import link_partner_positions
from pccl.protocol.master.events import MessageReceived, Send
from pccl.testing import each, hooks, open_test_cluster

TOKEN = "peer-commit-partners"
CFG = Config(peer_timeout=5.0, heartbeat_interval=0.3, connect_timeout=10.0, p2p_base_port=0,
             shared_state_base_port=0, fast_commit=True, peer_commit=True)
SOON = 60.0
N = 8


def _without_completes(master: pccl.Master) -> None:
    """No ``CollectiveComplete`` from ``master``: an op that completes committed on its acks."""
    state = pccl.testing.master_state(master)
    real = state.handle

    def handle(event: Any, now: float) -> list[Any]:
        return [e for e in real(event, now) if not (isinstance(e, Send) and isinstance(e.msg, m.CollectiveComplete))]

    state.handle = handle  # type: ignore[method-assign]


async def test_at_8_peers_every_op_commits_on_its_acks_with_the_right_results() -> None:
    async with open_test_cluster(N, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ring = comms[0].ring
        assert all(link_partner_positions(p, N, None) for p in range(N))  # every position has partners
        _without_completes(master)
        ops = 0
        for k in range(3):
            small = [np.full(1000, i + 1.0 + k, np.float32) for i in range(N)]  # recursive doubling
            await each(comms, lambda i, c: c.all_reduce(small[i], tag=1), within=SOON)
            assert all(np.array_equal(x, np.full(1000, 36.0 + 8 * k, np.float32)) for x in small)
            big = [np.full(800_000, i + 1.0, np.float32) for i in range(N)]  # the ring, worker-thread lanes
            await each(comms, lambda i, c: c.all_reduce(big[i], tag=2), within=SOON)
            assert all(np.array_equal(x, np.full(800_000, 36.0, np.float32)) for x in big)
            root = next(i for i, c in enumerate(comms) if c.peer_id == ring[3])
            ys = [np.full(7, i + 1.0, np.float32) for i in range(N)]  # a tree over the partner links
            await each(comms, lambda i, c: c.broadcast(ys[i], root=ring[3], tag=3), within=SOON)
            assert all(np.array_equal(y, np.full(7, root + 1.0, np.float32)) for y in ys)
            ops += 3
        stats = [c.statistics() for c in comms]
        assert [(s.peer_commits, s.peer_commit_doubts) for s in stats] == [(ops, 0)] * N, stats


async def test_a_partner_killed_right_after_its_acks_splits_nobody() -> None:
    # Ring position 3 dies the moment its first acks went out (to both ring neighbours and its
    # three partners), its Done(ok) lost with it: the master has no Complete to send on the
    # Dones, so each survivor commits on its acks or falls in doubt (its links to the victim
    # fail) and the master decides on the answers.  One outcome for all: a commit with the
    # victim's input in the sum if some survivor read its ack (what runs here), else an abort
    # with every input restored (the crash's reset may discard acks not read yet).
    async with open_test_cluster(N, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ring = comms[0].ring
        victim = next(c for c in comms if c.peer_id == ring[3])
        state = pccl.testing.master_state(master)
        victim_conn = state.conn_of(victim.peer_id)
        real = state.handle

        def handle(event: Any, now: float) -> list[Any]:
            if (isinstance(event, MessageReceived) and event.conn_id == victim_conn
                    and isinstance(event.msg, m.CollectiveDone)):
                return []  # lost with the crash
            return real(event, now)

        state.handle = handle  # type: ignore[method-assign]
        crashed = trio.Event()

        async def die() -> None:
            if not crashed.is_set():
                crashed.set()
                hooks.crash(victim)

        hooks.after_acks(victim, die)
        xs = [np.full(1000, i + 1.0, np.float32) for i in range(N)]
        outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=5), within=SOON)
        assert crashed.is_set()
        survivors = [i for i, c in enumerate(comms) if c is not victim]
        if isinstance(outcome[survivors[0]], pccl.ReduceInfo):
            assert all(isinstance(outcome[i], pccl.ReduceInfo) for i in survivors), outcome
            assert all(np.array_equal(xs[i], np.full(1000, 36.0, np.float32)) for i in survivors)
            # Each survivor was ready: it committed on its acks or in doubt on the verdict.
            stats = [comms[i].statistics() for i in survivors]
            assert all(s.peer_commits + s.peer_commit_doubts == 1 for s in stats), stats
        else:
            assert all(isinstance(outcome[i], pccl.CollectiveAborted) for i in survivors), outcome
            assert all(np.array_equal(xs[i], np.full(1000, i + 1.0, np.float32)) for i in survivors)


async def test_an_ack_to_the_successor_waits_for_the_lane_threads_send_lock() -> None:
    # On real TCP a lane's frames are written by worker threads under the lane's thread-side
    # send lock; an ack written with the connection's async send took another lock and could
    # land inside a frame a thread was writing.  Held as a thread would hold it, from just
    # before peer A's Done until B has had time to hear from A: B must not hear A's ack (and
    # commit) before the lock is free; then it must.
    cfg = Config(peer_timeout=30.0, heartbeat_interval=0.3, connect_timeout=10.0, p2p_base_port=0,
                 shared_state_base_port=0, fast_commit=True, peer_commit=True)
    async with open_test_cluster(2, token=TOKEN, config=cfg, soon=SOON) as (master, comms, _):
        _without_completes(master)
        a, b = comms
        held: list[int] = []
        stack = contextlib.ExitStack()

        async def before(msg: m.Message) -> None:
            if isinstance(msg, m.CollectiveDone) and not held:
                stack.enter_context(hooks.hold_lane_send_lock(a, 0))
                held.append(b.statistics().peer_commits)

        async def release() -> None:
            with trio.fail_after(SOON):
                while not held:
                    await trio.sleep(0.01)
            await trio.sleep(0.5)  # ample for an ack on loopback
            held.append(b.statistics().peer_commits)
            stack.close()

        xs = [np.full(100, i + 1.0, np.float32) for i in range(2)]
        with hooks.intercept_master_sends(a, before):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(release)
                outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=4), within=SOON)
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        assert all(np.array_equal(x, np.full(100, 3.0, np.float32)) for x in xs)
        assert held == [0, 0], held  # B had not committed while A's lane was held
        assert [c.statistics().peer_commits for c in comms] == [1, 1]
