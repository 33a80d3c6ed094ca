"""``Config.peer_commit`` (docs/protocol.rst, "Design: completion agreed among peers") with
peers as Trio tasks in this process (real TCP loopback): steady-state collectives commit on a
full known set of acks without waiting for the master's verdict, give the results the verdict
gives, and a peer that dies at an awkward moment splits nobody."""

from __future__ import annotations

import dataclasses

import msgspec
from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import Config
from pccl.communicator import internals_of, open_communicator
from pccl.master import open_master
from pccl.protocol import messages as m
from pccl.protocol.master.events import MessageReceived, Send
from pccl.testing import admit, each, hooks, open_test_cluster

TOKEN = "peer-commit"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0, fast_commit=True, peer_commit=True)
SOON = 30.0


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_steady_state_ops_commit_among_the_peers_with_the_verdicts_results(n: int) -> None:
    async with open_test_cluster(n, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ids = [c.peer_id for c in comms]
        rounds = 4
        for k in range(rounds):
            xs = [np.arange(1000, dtype=np.float32) * (i + 1 + k) for i in range(n)]
            infos = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=1))
            assert all(isinstance(info, pccl.ReduceInfo) and info.world_size == n for info in infos), infos
            want = sum(np.arange(1000, dtype=np.float32) * (i + 1 + k) for i in range(n))
            assert all(np.array_equal(x, want) for x in xs)
            ys = [np.full(7, i + 1.0, np.float32) for i in range(n)]
            await each(comms, lambda i, c: c.broadcast(ys[i], root=ids[-1], tag=2))
            assert all(np.array_equal(y, np.full(7, float(n), np.float32)) for y in ys)
        stats = [c.statistics() for c in comms]
        # No op waited for the master's verdict (none fell in doubt).  (Here the master's own
        # Complete, which follows the last Done(ok), may beat the acks; with no Complete at all
        # the acks commit every op: test_ops_commit_on_their_acks_without_any_verdict.)
        assert [s.peer_commit_doubts for s in stats] == [0] * n, stats
        assert [s.collectives_completed for s in stats] == [2 * rounds] * n


def _without_completes(master: pccl.Master) -> None:
    """Make ``master`` send no ``CollectiveComplete``: an op that still completes committed on
    its participants' acks, without any verdict of the master."""
    state = pccl.testing.master_state(master)
    real = state.handle

    def handle(event: Any, now: float) -> list[Any]:
        return [e for e in real(event, now) if not (isinstance(e, Send) and isinstance(e.msg, m.CollectiveComplete))]

    state.handle = handle  # type: ignore[method-assign]


@pytest.mark.parametrize("n", [2, 3])
async def test_ops_commit_on_their_acks_without_any_verdict(n: int) -> None:
    async with open_test_cluster(n, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        _without_completes(master)
        for k in range(3):
            xs = [np.full(5000, i + 1.0 + k, np.float32) for i in range(n)]
            await each(comms, lambda i, c: c.all_reduce(xs[i], tag=7))
            assert all(np.array_equal(x, sum(np.full(5000, i + 1.0 + k, np.float32) for i in range(n))) for x in xs)
        stats = [c.statistics() for c in comms]
        assert [(s.peer_commits, s.peer_commit_doubts) for s in stats] == [(3, 0)] * n, stats


async def test_a_peer_that_dies_after_its_ack_with_its_done_lost_splits_nobody() -> None:
    # The last ring position's Done never reaches the master (lost with the crash), and it dies
    # right after its ack went out.  Its successor may have heard its readiness and a survivor
    # may have committed: fast commit's master aborted the op at once on the death (a split);
    # this one asks the survivors, whose answers decide for both.
    async with open_test_cluster(3, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        ring = comms[0].ring
        by_id = {c.peer_id: c for c in comms}
        victim = by_id[ring[2]]
        state = pccl.testing.master_state(master)
        victim_conn = state.conn_of(victim.peer_id)
        real = state.handle

        def handle(event: Any, now: float) -> list[Any]:
            if (isinstance(event, MessageReceived) and event.conn_id == victim_conn
                    and isinstance(event.msg, m.CollectiveDone)):
                return []  # lost with the crash
            return real(event, now)

        state.handle = handle  # type: ignore[method-assign]

        async def die() -> None:
            # The worst moment: once a survivor committed on its set (the victim's id reached
            # it through the victim's successor), while the successor still waits for the id
            # that would have come round through the victim.
            with trio.fail_after(SOON):
                while not any(c.statistics().peer_commits for c in comms if c is not victim):
                    await trio.sleep(0.001)
            hooks.crash(victim)

        hooks.after_acks(victim, die)
        inputs = [np.full(3000, i + 1.0, np.float32) for i in range(3)]
        xs = [x.copy() for x in inputs]
        survivors = [i for i, c in enumerate(comms) if c is not victim]

        outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=9))
        # One survivor committed: the other must commit too, on its acks or, in doubt, on the
        # master's answers.  (The victim acks both ring neighbours, so the other often holds its
        # id before the crash and is in doubt only if the master's query, on the death, comes
        # first.)
        assert all(isinstance(outcome[i], pccl.ReduceInfo) for i in survivors), outcome
        assert all(np.array_equal(xs[i], np.full(3000, 6.0, np.float32)) for i in survivors)
        assert sorted(comms[i].statistics().peer_commit_doubts for i in survivors) in ([0, 0], [0, 1])


async def test_a_call_cancelled_once_ready_still_commits_with_the_others() -> None:
    # Ready is a vote: a caller cancelled after its ack went out does not abort on its own (the
    # others may commit on it); it waits, shielded, and returns the committed result.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        _without_completes(master)
        scope = trio.CancelScope()
        first = comms[0]

        async def cancel() -> None:
            scope.cancel()

        hooks.after_acks(first, cancel)
        xs = [np.full(100, i + 1.0, np.float32) for i in range(2)]

        async def call(i: int, comm: pccl.Communicator) -> Any:
            if comm is first:
                with scope:
                    return await comm.all_reduce(xs[i], tag=3)
                return "cancelled"
            return await comm.all_reduce(xs[i], tag=3)

        outcome = await each(comms, call)
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        assert all(np.array_equal(x, np.full(100, 3.0, np.float32)) for x in xs)


async def test_a_query_before_this_peer_began_freezes_it_out_of_the_op() -> None:
    # The master's query reaches a participant that has not begun the op: it answers aborted and
    # must never become ready for that seq (the master may abort the others on its answer).
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        session = internals_of(comms[0]).session
        seq = m.derived_seq(session.links.round, 4, 0)
        assert session.on_query is not None
        session.on_query(m.CollectiveQuery(4, seq), session.master_epoch)
        xs = [np.full(10, i + 1.0, np.float32) for i in range(2)]
        outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=4))
        assert all(isinstance(o, pccl.CollectiveAborted) for o in outcome), outcome
        assert all(np.array_equal(x, np.full(10, i + 1.0, np.float32)) for i, x in enumerate(xs))  # restored
        again = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=4))  # the next use runs
        assert all(isinstance(o, pccl.ReduceInfo) for o in again), again


def _mute(master: Any, mute: pccl.Communicator) -> list[int]:
    """``mute`` sends no acks (they are lost: no one hears of it from it) and the master never
    reads its ``CollectiveDone`` (held up): the connections the master reads a
    ``CollectiveAsk`` from are listed in what this returns."""
    state = pccl.testing.master_state(master)
    mute_conn = state.conn_of(mute.peer_id)
    real = state.handle
    asked: list[int] = []

    def handle(event: Any, now: float) -> list[Any]:
        if isinstance(event, MessageReceived) and isinstance(event.msg, m.CollectiveAsk):
            asked.append(event.conn_id)
        if (isinstance(event, MessageReceived) and event.conn_id == mute_conn
                and isinstance(event.msg, m.CollectiveDone)):
            return []  # held up
        return real(event, now)

    state.handle = handle  # type: ignore[method-assign]

    async def no_ack(*args: Any) -> None:
        pass

    internals_of(mute).all_reduce.peer_commits.send_ack = no_ack  # type: ignore[method-assign,assignment]
    return asked


async def test_a_silent_neighbour_puts_the_others_in_doubt_and_the_master_decides() -> None:
    # One peer sends no acks (its successor never hears of it) and its Done is held up on the
    # way to the master (no Complete either): the others fall in doubt after peer_timeout and
    # ask; the master queries the silent one, which committed, and completes the op everywhere.
    cfg = Config(peer_timeout=1.0, heartbeat_interval=0.2, connect_timeout=5.0, p2p_base_port=0,
                 shared_state_base_port=0, fast_commit=True, peer_commit=True)
    async with open_test_cluster(3, token=TOKEN, config=cfg, soon=SOON) as (master, comms, _):
        mute = comms[2]
        asked = _mute(master, mute)
        xs = [np.full(10, i + 1.0, np.float32) for i in range(3)]
        outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=6))
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        assert all(np.array_equal(x, np.full(10, 6.0, np.float32)) for x in xs)
        assert asked and sum(c.statistics().peer_commit_doubts for c in comms) >= 1
        assert mute.statistics().peer_commits == 1  # it heard everyone: it committed on its own


async def test_two_peers_read_their_one_ack_link_in_the_calls_own_task() -> None:
    # Two participants have one ack link each: the call reads it itself, with no reader task
    # (and no nursery) per op, and every op still commits on its acks.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        _without_completes(master)
        await each(comms, lambda i, c: c.all_reduce(np.ones(10, np.float32), tag=5))  # a round: ops may begin
        spawned: list[str] = []

        class Spawns(trio.abc.Instrument):
            def task_spawned(self, task: trio.lowlevel.Task) -> None:
                spawned.append(task.name)

        instrument = Spawns()
        trio.lowlevel.add_instrument(instrument)
        try:
            for k in range(5):
                xs = [np.full(100, i + 1.0 + k, np.float32) for i in range(2)]
                await each(comms, lambda i, c: c.all_reduce(xs[i], tag=5))
                assert all(np.array_equal(x, np.full(100, 3.0 + 2 * k, np.float32)) for x in xs)
        finally:
            trio.lowlevel.remove_instrument(instrument)
        assert not [name for name in spawned if "_read_acks" in name], spawned
        assert [c.statistics().peer_commits for c in comms] == [6, 6]


async def test_a_silent_peer_puts_its_only_partner_in_doubt_and_the_master_decides() -> None:
    # Two peers: the one ack link read in the call's own task.  Its partner's acks are lost and
    # that partner's Done is held up: after peer_timeout of silence the reader asks the master,
    # which queries the silent one (committed: it heard the reader's ack) and completes both.
    cfg = dataclasses.replace(CFG, peer_timeout=1.0, heartbeat_interval=0.2)
    async with open_test_cluster(2, token=TOKEN, config=cfg, soon=SOON) as (master, comms, _):
        await each(comms, lambda i, c: c.all_reduce(np.ones(10, np.float32), tag=6))  # a round: ops may begin
        mute = comms[1]
        state = pccl.testing.master_state(master)
        asked = _mute(master, mute)
        doubts = [c.statistics().peer_commit_doubts for c in comms]
        xs = [np.full(10, i + 1.0, np.float32) for i in range(2)]
        with trio.fail_after(SOON):
            outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=6))
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        assert all(np.array_equal(x, np.full(10, 3.0, np.float32)) for x in xs)
        assert asked == [state.conn_of(comms[0].peer_id)]
        assert comms[0].statistics().peer_commit_doubts == doubts[0] + 1


async def test_a_partner_that_dies_right_after_its_ack_leaves_its_only_partner_committed() -> None:
    # Two peers: the victim's Done(ok) is out and it dies right after its ack left, while the
    # survivor reads its one ack link in the call's own task.  The survivor commits on that ack
    # or, the link failing first, falls in doubt and the master (both Done(ok) in) completes
    # the op: it never aborts an op the victim may have committed.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        await each(comms, lambda i, c: c.all_reduce(np.ones(10, np.float32), tag=8))  # a round: ops may begin
        victim, survivor = comms[1], comms[0]

        async def die() -> None:
            hooks.crash(victim)

        hooks.after_acks(victim, die)
        xs = [np.full(500, i + 1.0, np.float32) for i in range(2)]
        with trio.fail_after(SOON):
            outcome = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=8))
        assert isinstance(outcome[0], pccl.ReduceInfo), outcome
        assert np.array_equal(xs[0], np.full(500, 3.0, np.float32))
        assert survivor.statistics().collectives_aborted == 0


async def test_a_peer_without_peer_commit_keeps_none_of_the_acks_the_others_send_it() -> None:
    # Peers may differ: the third runs with peer_commit off, so it makes no agreement and reads
    # no acks, but its neighbours ack every op to it.  A later op's reader reads those frames
    # off its lanes into memory; once its call ended it must discard them (the acks' seq is
    # retired there too), not keep them until a re-wire (they pile up to kept_limit, then
    # park at the head of a lane and stall every op until the watchdog).
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _), \
            trio.open_nursery() as nursery:
        quiet, scope = await admit(nursery, master, comms, lambda: open_communicator(
            master.address, token=TOKEN, config=dataclasses.replace(CFG, peer_commit=False)), soon=SOON)
        everyone = [*comms, quiet]
        for k in range(6):
            xs = [np.full(3000, i + 1.0 + k, np.float32) for i in range(3)]
            await each(everyone, lambda i, c: c.all_reduce(xs[i], tag=3))
            assert all(np.array_equal(x, np.full(3000, 6.0 + 3 * k, np.float32)) for x in xs)
        assert quiet.statistics().peer_commits == 0 and quiet.statistics().collectives_completed == 6
        assert [hooks.kept_bytes(c) for c in everyone] == [0, 0, 0]
        scope.cancel()


async def test_a_master_that_cannot_resolve_peer_agreed_ops_is_refused_at_registration() -> None:
    async with open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        state = pccl.testing.master_state(master)
        real = state.handle

        def handle(event: Any, now: float) -> list[Any]:  # an older master: no peer_commit in Welcome
            return [Send(e.conn_id, msgspec.structs.replace(e.msg, peer_commit=False))
                    if isinstance(e, Send) and isinstance(e.msg, m.Welcome) else e for e in real(event, now)]

        state.handle = handle  # type: ignore[method-assign]
        with pytest.raises(pccl.ProtocolError, match="peer_commit"):
            with trio.fail_after(SOON):
                async with open_communicator(master.address, token=TOKEN, config=CFG):
                    pass


def test_peer_commit_needs_fast_commit() -> None:
    with pytest.raises(pccl.InvalidArgument, match="fast_commit"):
        Config(fast_commit=False, peer_commit=True)



def _hold_armed_commences(master: pccl.Master, peer: pccl.Communicator, tag: int,
                          release: type[m.Message]) -> tuple[list[Send], list[int]]:
    """Hold back the Commences of begun ops on ``tag`` that ``master`` sends to ``peer``, until it
    handles ``peer``'s next ``release`` message on the tag; then send them ahead of whatever that
    message makes it send.  Returns (the held Sends, the seqs released)."""
    state = pccl.testing.master_state(master)
    conn = state.conn_of(peer.peer_id)
    real = state.handle
    held: list[Send] = []
    released: list[int] = []

    def handle(event: Any, now: float) -> list[Any]:
        out = real(event, now)
        if not released:
            late = [e for e in out if isinstance(e, Send) and e.conn_id == conn
                    and isinstance(e.msg, m.CollectiveCommence) and e.msg.tag == tag and e.msg.seq >> 63]
            held.extend(late)
            out = [e for e in out if e not in late]
            if (held and isinstance(event, MessageReceived) and event.conn_id == conn
                    and isinstance(event.msg, release) and getattr(event.msg, "tag", None) == tag):
                released.extend(e.msg.seq for e in held)
                out = held + out  # ahead of the master's own answer, if it is out already
        return out

    state.handle = handle  # type: ignore[method-assign]
    return held, released


async def _commit_x_with_its_commence_held(master: pccl.Master, comms: list[pccl.Communicator],
                                          until: type[m.Message]) -> tuple[list[Send], list[int]]:
    """A round, then op X (tag 3) begun on both peers and committed on its acks, with the
    master's arming Commence to ``comms[0]`` held until it reads ``until`` on tag 3."""
    await each(comms, lambda i, c: c.all_reduce(np.ones(100, np.float32), tag=3))  # a round: X may begin
    held, released = _hold_armed_commences(master, comms[0], 3, until)
    xs = [np.full(1000, i + 1.0, np.float32) for i in range(2)]
    infos = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=3), within=SOON)
    assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
    assert len(held) == 1, held  # X began on both and P's Commence was held
    return held, released


async def test_a_late_commence_of_an_op_committed_on_its_acks_is_not_taken_by_the_next_vote() -> None:
    # The master sends the Commence that arms a begun op to every participant, also to one whose
    # Done(ok) it already has; with peer commit that peer can commit on its acks, end the call
    # and vote on the same tag before that Commence arrives.  Held back here until the master
    # has the peer's next vote (an all-gather always votes), it reaches the vote's route first:
    # taken as the vote's answer, the peer ran the ended op's seq and the others' real op
    # stalled until the watchdog.  It must wait for its own Commence.
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        _, released = await _commit_x_with_its_commence_held(master, comms, m.CollectiveInit)
        gathered = await each(comms, lambda i, c: c.all_gather(np.full(10, i + 1.0, np.float32), tag=3),
                              within=SOON)
        assert released, "the held Commence was never sent"
        assert all(isinstance(g, pccl.Gathered) for g in gathered), gathered
        for g in gathered:
            assert [float(a[0]) for a in g.arrays] == [float(comms.index(
                next(c for c in comms if c.peer_id == pid)) + 1) for pid in g.peers]
        assert [c.statistics().collectives_aborted for c in comms] == [0, 0]


async def test_a_late_commence_of_an_op_committed_on_its_acks_is_not_taken_for_a_withdrawn_votes() -> None:
    # As above, but the peer's next call on the tag is cancelled during its vote: the task that
    # withdraws the vote took the ended op's Commence for the vote's, and reported the abort of
    # the op it had completed (a master still waiting for another participant's Done kicks it
    # for a second Done).
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (master, comms, _):
        p = comms[0]
        _, released = await _commit_x_with_its_commence_held(master, comms, m.CollectiveWithdraw)
        dones: list[m.CollectiveDone] = []

        async def record(msg: m.Message) -> None:
            if isinstance(msg, m.CollectiveDone):
                dones.append(msg)

        with hooks.intercept_master_sends(p, record):
            with trio.move_on_after(0.2):  # the vote waits for the other peer, which never calls
                await p.all_gather(np.ones(10, np.float32), tag=3)
            with trio.fail_after(SOON):
                while not released:
                    await trio.sleep(0.01)
                while 3 in hooks.phase_of(p).collectives:  # the withdrawal settled: the tag is free
                    await trio.sleep(0.01)
        assert dones == [], dones  # no abort reported for the op P completed
        # The withdrawal settled (the tag is free again) and P is still a member: the tag's
        # next op runs on both.
        ys = [np.full(1000, i + 1.0, np.float32) for i in range(2)]
        infos = await each(comms, lambda i, c: c.all_reduce(ys[i], tag=3), within=SOON)
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(np.array_equal(y, np.full(1000, 3.0, np.float32)) for y in ys)
