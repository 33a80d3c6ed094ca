"""Shared-state sync end to end on real TCP (reference/pccl.md §7 scenarios 15–26, 30, 31).

Master and peers run as Trio tasks in this process, except the distributor that is SIGKILLed
mid-transfer, which is an OS process (tests/e2e/state_peer_process.py).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import Config, SharedState, SyncStrategy, Tensor
from pccl.errors import InvalidArgument, InvalidUsage, Kicked, KickReason, RevisionViolation, SharedStateSyncFailed

TOKEN = "state-run-token"
CFG = Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0,
             shared_state_base_port=0)
HERE = pathlib.Path(__file__).resolve().parent
BOUND = 20.0

ENFORCE, SEND_ONLY, RECEIVE_ONLY = SyncStrategy.ENFORCE_POPULAR, SyncStrategy.SEND_ONLY, SyncStrategy.RECEIVE_ONLY


class Cluster:
    """A master plus peers kept open by background tasks; ``join`` adds a peer the way a
    training loop does (existing peers call update_topology while the newcomer connects)."""

    def __init__(self, master: pccl.Master, nursery: trio.Nursery) -> None:
        self.master = master
        self.nursery = nursery
        self.comms: list[pccl.Communicator] = []
        self._stop = trio.Event()

    async def _peer(self, group: int, task_status: trio.TaskStatus[pccl.Communicator]) -> None:
        async with pccl.open_communicator(self.master.address, peer_group=group, token=TOKEN, config=CFG) as comm:
            task_status.started(comm)
            await self._stop.wait()

    async def join(self, group: int = 0) -> pccl.Communicator:
        live = [c for c in self.comms if pccl.testing.failure_of(c) is None]
        if not live:
            comm = await self.nursery.start(self._peer, group)
        else:
            joined: list[pccl.Communicator] = []
            async with trio.open_nursery() as voters:
                voters.start_soon(_start_into, self.nursery, self._peer, group, joined)
                await wait_registered(self.master)  # vote only once there is someone to accept
                for c in live:
                    voters.start_soon(c.update_topology)
            comm = joined[0]
        self.comms.append(comm)
        return comm

    def stop(self) -> None:
        self._stop.set()


async def _start_into(nursery: trio.Nursery, fn, group: int, out: list) -> None:  # type: ignore[no-untyped-def]
    out.append(await nursery.start(fn, group))


async def wait_registered(master: pccl.Master) -> None:
    from pccl.protocol.master.machine import PeerStatus

    while not any(p.status is PeerStatus.REGISTERED for p in pccl.testing.master_snapshot(master).peers):
        await trio.sleep(0.01)


@asynccontextmanager
async def cluster(n: int, groups: Sequence[int] | None = None) -> AsyncIterator[Cluster]:
    with trio.fail_after(BOUND * 3):
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            async with trio.open_nursery() as nursery:
                c = Cluster(master, nursery)
                for i in range(n):
                    await c.join(groups[i] if groups else 0)
                try:
                    yield c
                finally:
                    c.stop()


async def sync_all(comms: Sequence[pccl.Communicator], states: Sequence[SharedState],
                   strategies: Sequence[SyncStrategy] | None = None,
                   order: Sequence[int] | None = None) -> list[pccl.SyncInfo | pccl.PCCLError]:
    """Run every peer's sync concurrently (votes sent in ``order``); results or errors."""
    results: list[pccl.SyncInfo | pccl.PCCLError | None] = [None] * len(comms)
    strategies = strategies or [ENFORCE] * len(comms)

    async def one(i: int) -> None:
        try:
            results[i] = await comms[i].sync_shared_state(states[i], strategies[i])
        except pccl.PCCLError as exc:
            results[i] = exc

    with trio.fail_after(BOUND):
        async with trio.open_nursery() as nursery:
            for i in order or range(len(comms)):
                nursery.start_soon(one, i)
                await trio.sleep(0.05 if order else 0)  # make the vote order real when asked
    return results  # type: ignore[return-value]


def make_state(seed: int, revision: int = 0, n: int = 1000) -> SharedState:
    rng = np.random.default_rng(seed)
    return SharedState({"w": rng.standard_normal(n).astype(np.float32),
                        "m": rng.standard_normal(n // 2),
                        "step": np.array([seed], np.int64)}, revision=revision)


def copy_state(state: SharedState, revision: int | None = None) -> SharedState:
    tensors = {k: Tensor(t.array.copy(), t.allow_content_inequality) for k, t in state.tensors().items()}
    return SharedState(tensors, state.revision if revision is None else revision)


def assert_same(a: SharedState, b: SharedState) -> None:
    assert a.hashes() == b.hashes()
    for key in a:
        assert a[key].tobytes() == b[key].tobytes()


# --- the API -------------------------------------------------------------------------------------


def test_shared_state_references_arrays_without_copies_and_validates() -> None:
    w = np.zeros(8, np.float32)
    state = SharedState({"w": w, "b": Tensor(np.zeros(3, np.int16), allow_content_inequality=True)}, revision=4)
    assert state["w"] is w and np.shares_memory(state["w"], w)
    assert list(state) == ["b", "w"] and state.revision == 4
    assert state.tensors()["b"].allow_content_inequality
    state.revision += 1
    assert state.revision == 5
    with pytest.raises(InvalidArgument):
        SharedState({"w": np.zeros((4, 4), np.float32)[:, ::2]})  # not contiguous
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(InvalidArgument):
        SharedState({"w": ro})
    with pytest.raises(InvalidArgument):
        SharedState({"w": np.zeros(4, np.complex64)})
    with pytest.raises(InvalidArgument):
        SharedState({"w": [1.0, 2.0]})
    with pytest.raises(InvalidArgument):
        SharedState({"": np.zeros(2)})
    with pytest.raises(InvalidArgument):
        state.revision = -1
    # hashing sees the bytes: one flipped bit changes the digest
    before = state.hashes()["w"]
    w.view(np.uint32)[3] ^= 1
    assert state.hashes()["w"] != before


# --- sync scenarios ------------------------------------------------------------------------------


async def test_identical_states_move_zero_bytes() -> None:
    async with cluster(3) as c:
        base = make_state(1)
        states = [copy_state(base) for _ in range(3)]
        for step in range(2):
            infos = await sync_all(c.comms, states)
            assert all(isinstance(i, pccl.SyncInfo) for i in infos), infos
            assert [(i.revision, i.tx_bytes, i.rx_bytes) for i in infos] == [(step, 0, 0)] * 3
            for s in states:
                s.revision += 1


async def test_two_peers_tie_one_receives_exactly_the_state() -> None:
    async with cluster(2) as c:
        states = [make_state(1), make_state(2)]
        infos = await sync_all(c.comms, states)
        assert_same(states[0], states[1])
        nbytes = states[0].nbytes - 0  # every tensor differs
        assert sorted((i.tx_bytes, i.rx_bytes) for i in infos) == [(0, nbytes), (nbytes, 0)]


@pytest.mark.parametrize("odd_first", [True, False])
async def test_popularity_beats_arrival_order(odd_first: bool) -> None:
    async with cluster(3) as c:
        popular = make_state(7, n=200_000)
        odd = make_state(8, n=200_000)
        states = [copy_state(popular), copy_state(popular), odd]
        order = [2, 0, 1] if odd_first else [0, 1, 2]
        infos = await sync_all(c.comms, states, order=order)
        assert_same(odd, popular)
        assert infos[2].rx_bytes == popular.nbytes and infos[2].tx_bytes == 0
        # striped over both up-to-date peers
        assert infos[0].tx_bytes > 0 and infos[1].tx_bytes > 0
        assert infos[0].tx_bytes + infos[1].tx_bytes == popular.nbytes


async def test_only_dirty_tensors_move() -> None:
    async with cluster(3) as c:
        base = make_state(3)
        states = [copy_state(base) for _ in range(3)]
        states[1]["m"][5] += 1.0  # one dirty tensor on one peer
        infos = await sync_all(c.comms, states)
        assert_same(states[1], base)
        assert infos[1].rx_bytes == base["m"].nbytes
        assert sum(i.tx_bytes for i in infos) == base["m"].nbytes
        assert infos[0].rx_bytes == infos[2].rx_bytes == 0


async def test_joiner_gets_popular_state_and_revision_then_moves_nothing() -> None:
    async with cluster(2) as c:
        base = make_state(5, revision=12)
        states = [copy_state(base), copy_state(base)]
        infos = await sync_all(c.comms, states)  # first sync of the run: resumes at 12
        assert [i.revision for i in infos] == [12, 12]
        for s in states:
            s.revision += 1
        await c.join()
        joiner = make_state(99, revision=0)
        states.append(joiner)
        infos = await sync_all(c.comms, states)
        assert joiner.revision == 13 and infos[2].revision == 13
        assert_same(joiner, base)
        assert infos[2].rx_bytes == base.nbytes
        for s in states:
            s.revision += 1
            s["w"][:] += np.float32(0.5)  # the same deterministic update everywhere
        infos = await sync_all(c.comms, states)
        assert [(i.revision, i.rx_bytes, i.tx_bytes) for i in infos] == [(14, 0, 0)] * 3


async def test_first_sync_takes_highest_revision_whatever_the_order() -> None:
    async with cluster(3) as c:
        base = make_state(4)
        # two outdated peers agree with each other; the single peer at 9 still wins
        states = [make_state(8, revision=3), copy_state(base, revision=9), make_state(8, revision=0)]
        infos = await sync_all(c.comms, states, order=[0, 2, 1])
        assert [i.revision for i in infos] == [9, 9, 9]
        assert [s.revision for s in states] == [9, 9, 9]
        assert infos[1].tx_bytes == 2 * base.nbytes  # the only peer at 9 sends to both
        assert infos[0].rx_bytes == infos[2].rx_bytes == base.nbytes
        assert_same(states[0], base)
        # an outdated peer whose content already matches moves nothing but adopts the revision
        for s in states[:2]:
            s.revision += 1
        states[2].revision = 4
        infos = await sync_all(c.comms, states)
        assert [(i.revision, i.rx_bytes, i.tx_bytes) for i in infos] == [(10, 0, 0)] * 3


async def test_plus_one_rule_kicks_a_jump_and_the_others_go_on() -> None:
    async with cluster(3) as c:
        base = make_state(6)
        states = [copy_state(base) for _ in range(3)]
        await sync_all(c.comms, states)
        states[0].revision += 1
        states[1].revision += 1
        states[2].revision += 2  # violation
        infos = await sync_all(c.comms, states)
        assert isinstance(infos[2], RevisionViolation)
        assert [(i.revision, i.rx_bytes) for i in infos[:2]] == [(1, 0), (1, 0)]
        with pytest.raises(Kicked) as kicked:
            await c.comms[2].update_topology()
        assert kicked.value.reason is KickReason.REVISION_VIOLATION
        # a drag-along peer (never increments) is outdated: it receives and adopts the revision
        states[0].revision += 1
        states[0]["w"][0] += 1.0
        infos = await sync_all(c.comms[:2], states[:2])
        assert [i.revision for i in infos] == [2, 2]
        assert infos[1].rx_bytes == base["w"].nbytes and states[1].revision == 2


@pytest.mark.parametrize("change", ["extra key", "missing key", "dtype", "size"])
async def test_mask_mismatch_is_kicked_others_sync(change: str) -> None:
    async with cluster(3) as c:
        base = make_state(2)
        tensors = dict(base.tensors())
        if change == "extra key":
            tensors["extra"] = Tensor(np.zeros(3))
        elif change == "missing key":
            del tensors["m"]
        elif change == "dtype":
            tensors["step"] = Tensor(np.array([2], np.int32))
        else:
            tensors["w"] = Tensor(np.zeros(1001, np.float32))
        odd = SharedState({k: Tensor(t.array.copy(), t.allow_content_inequality) for k, t in tensors.items()})
        states = [odd, copy_state(base), copy_state(base)]
        infos = await sync_all(c.comms, states)
        assert isinstance(infos[0], Kicked) and infos[0].reason is KickReason.SHARED_STATE_MISMATCH, infos
        assert [i.rx_bytes for i in infos[1:]] == [0, 0]
        # the others keep syncing without it
        for s in states[1:]:
            s.revision += 1
        infos = await sync_all(c.comms[1:], states[1:])
        assert [i.revision for i in infos] == [1, 1]


async def test_strategy_rules() -> None:
    async with cluster(3) as c:
        base = make_state(11)
        states = [copy_state(base), copy_state(base), make_state(12)]
        # mixing ENFORCE_POPULAR with another strategy: InvalidUsage for the non-enforcing peers
        infos = await sync_all(c.comms, states, [ENFORCE, ENFORCE, RECEIVE_ONLY])
        assert isinstance(infos[2], InvalidUsage) and not isinstance(infos[2], Kicked)
        assert [i.revision for i in infos[:2]] == [0, 0]
        assert states[2].hashes() != base.hashes()  # it did not receive
        # SEND_ONLY holders + RECEIVE_ONLY joiner: the joiner receives; RECEIVE_ONLY never sends
        infos = await sync_all(c.comms, states, [SEND_ONLY, SEND_ONLY, RECEIVE_ONLY])
        assert_same(states[2], base)
        assert infos[2].tx_bytes == 0 and infos[2].rx_bytes == base.nbytes
        # all RECEIVE_ONLY: nobody can send, every sync fails
        infos = await sync_all(c.comms, states, [RECEIVE_ONLY] * 3)
        assert all(isinstance(i, SharedStateSyncFailed) for i in infos), infos
        # SEND_ONLY without the popular state is kicked
        for s in states:
            s.revision += 1
        states[1]["w"][0] += 1
        infos = await sync_all(c.comms, states, [SEND_ONLY] * 3)
        assert isinstance(infos[1], Kicked) and infos[1].reason is KickReason.STRATEGY_VIOLATION
        assert [i.rx_bytes for i in (infos[0], infos[2])] == [0, 0]


async def test_content_inequality_goes_to_joiners_only() -> None:
    async with cluster(2) as c:
        def state(seed: int, rng_state: int, revision: int = 0) -> SharedState:
            s = make_state(seed, revision)
            return SharedState({**s.tensors(), "rng": Tensor(np.full(64, rng_state, np.uint64), True)},
                               revision=revision)
        states = [state(1, 100), state(1, 200)]
        infos = await sync_all(c.comms, states)
        assert [(i.tx_bytes, i.rx_bytes) for i in infos] == [(0, 0), (0, 0)]
        assert states[0]["rng"][0] == 100 and states[1]["rng"][0] == 200  # not compared
        for s in states:
            s.revision += 1
        await c.join()
        joiner = state(50, 0)
        infos = await sync_all(c.comms, [*states, joiner])
        assert joiner["rng"][0] in (100, 200)  # delivered whole from one source
        assert joiner.hashes()["w"] == states[0].hashes()["w"]
        assert infos[2].rx_bytes == states[0].nbytes
        # statistics() keeps the running totals of every sync.
        stats = [comm.statistics() for comm in c.comms]
        assert [s.syncs_completed for s in stats] == [2, 2, 1]
        assert stats[2].sync_rx_bytes == infos[2].rx_bytes and stats[2].sync_tx_bytes == 0
        assert stats[0].sync_tx_bytes + stats[1].sync_tx_bytes == infos[2].rx_bytes
        assert stats[0].sync_rx_bytes == stats[1].sync_rx_bytes == 0
        assert [s.sync_replans for s in stats] == [0, 0, 0]


async def test_corrupted_bytes_fail_the_receiver_never_accepted_silently() -> None:
    def corrupt(arrays: Mapping[str, Any]) -> None:  # the sources' buffers change after they voted (a user bug)
        for view in arrays.values():
            view[0] ^= 0xFF

    async with cluster(3) as c:
        base = make_state(21)
        states = [copy_state(base), copy_state(base), make_state(22)]
        with pccl.testing.plant_serving_fault(corrupt):
            infos = await sync_all(c.comms, states)
        assert isinstance(infos[2], SharedStateSyncFailed) and "hash mismatch" in str(infos[2])
        assert [i.revision for i in infos[:2]] == [0, 0]
        # the failed peer is still a member; its next sync repairs it (it is outdated now)
        for s in states[:2]:
            s.revision += 1
        infos = await sync_all(c.comms, states)
        assert_same(states[2], states[0]) and infos[2].revision == 1


async def test_peer_groups_sync_independently() -> None:
    async with cluster(4, groups=[0, 0, 1, 1]) as c:
        g0 = make_state(1)
        g1 = SharedState({"x": np.arange(10, dtype=np.int16), "w": np.ones(3, np.float64)}, revision=40)
        states = [copy_state(g0), make_state(2), copy_state(g1, revision=40), copy_state(g1, revision=39)]
        states[3]["x"][0] = 7
        infos = await sync_all(c.comms, states)
        assert [i.revision for i in infos] == [0, 0, 40, 40]
        assert_same(states[0], states[1])
        assert_same(states[2], g1) and assert_same(states[3], g1)  # type: ignore[func-returns-value]
        assert infos[3].rx_bytes == g1["x"].nbytes and infos[2].tx_bytes == g1["x"].nbytes


async def test_sync_while_collective_in_flight_is_invalid_usage() -> None:
    async with cluster(1) as c:
        comm = c.comms[0]
        pccl.testing.open_route(comm, 7)
        with pytest.raises(InvalidUsage):
            await comm.sync_shared_state(make_state(1))
        pccl.testing.close_route(comm, 7)
        info = await comm.sync_shared_state(make_state(1, revision=5))
        assert info == pccl.SyncInfo(5, 0, 0)


def _all_dtypes_state(seed: int) -> SharedState:
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for dtype in pccl.DType:
        npd = dtype.numpy_dtype()
        raw = rng.integers(0, 256, size=4099 * npd.itemsize, dtype=np.uint8)
        arrays[dtype.name.lower()] = raw.view(npd)  # every bit pattern, NaNs included
    assert arrays["bfloat16"].dtype == ml_dtypes.bfloat16
    return SharedState(arrays)


async def test_every_dtype_round_trips_bit_exactly() -> None:
    async with cluster(2) as c:
        a, b = _all_dtypes_state(1), _all_dtypes_state(2)
        infos = await sync_all(c.comms, [a, b])
        for key in a:
            assert a[key].tobytes() == b[key].tobytes(), key
        assert sorted(i.rx_bytes for i in infos) == [0, a.nbytes]


async def test_steps_iterator_runs_the_loop_with_a_joiner() -> None:
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        results: dict[str, list[tuple[int, int]]] = {"a": [], "b": []}
        final: dict[str, SharedState] = {}

        async def trainer(name: str, seed: int, steps: int) -> None:
            async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as comm:
                state = make_state(seed, revision=5 if name == "a" else 0, n=64)
                done = 0
                async for info in comm.steps(state):
                    results[name].append((info.revision, info.rx_bytes))
                    state["w"][:] *= np.float32(0.5)  # deterministic update
                    state.revision += 1
                    done += 1
                    if done == steps:
                        break
                final[name] = state

        with trio.fail_after(BOUND):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trainer, "a", 1, 4)
                await trio.sleep(0.3)  # a waits alone
                assert results["a"] == []
                nursery.start_soon(trainer, "b", 2, 4)
        assert results["a"] == [(5, 0), (6, 0), (7, 0), (8, 0)]
        assert results["b"][0][1] > 0 and [r for r, _ in results["b"]] == [5, 6, 7, 8]
        assert [rx for _, rx in results["b"][1:]] == [0, 0, 0]
        assert_same(final["a"], final["b"])


# --- a distributor dies mid-transfer ------------------------------------------------------------


STATE_MIB = 64


async def test_distributor_sigkilled_mid_transfer_sync_completes() -> None:
    """Two up-to-date distributors (one an OS process) stream 64 MiB to a joiner; the process is
    SIGKILLed once bytes flow; the joiner is re-planned onto the survivor and ends bit-identical."""
    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "state_peer_process.py"), master.address, TOKEN, str(STATE_MIB)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
            assert line.startswith("ACCEPTED"), line
            base = _big_state(STATE_MIB)
            mine = copy_state(base)
            async with trio.open_nursery() as nursery:
                stop = trio.Event()
                comms: list[pccl.Communicator] = []

                async def peer(group: int, task_status: trio.TaskStatus[pccl.Communicator]) -> None:
                    async with pccl.open_communicator(master.address, token=TOKEN, config=CFG) as comm:
                        task_status.started(comm)
                        await stop.wait()

                async def update_remote() -> None:
                    proc.stdin.write("update\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                    reply = await trio.to_thread.run_sync(proc.stdout.readline)  # type: ignore[union-attr]
                    assert reply.startswith("UPDATED"), reply

                async with trio.open_nursery() as n2:
                    n2.start_soon(_start_into, nursery, peer, 0, comms)
                    await wait_registered(master)
                    n2.start_soon(update_remote)
                async with trio.open_nursery() as n2:
                    n2.start_soon(_start_into, nursery, peer, 0, comms)
                    await wait_registered(master)
                    n2.start_soon(update_remote)
                    n2.start_soon(comms[0].update_topology)
                joiner = SharedState({k: np.zeros_like(v.array) for k, v in base.tensors().items()})
                proc.stdin.write("sync\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                killed = trio.Event()

                async def kill_when_flowing() -> None:
                    # The remote serves half the bytes; kill it once the joiner received some.
                    while not pccl.testing.phase_of(comms[1]).syncing or _received(comms[1]) < 1:
                        await trio.sleep(0.001)
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.set()

                infos: list[pccl.SyncInfo] = []

                async def sync(comm: pccl.Communicator, state: SharedState) -> None:
                    infos.append(await comm.sync_shared_state(state))

                with trio.fail_after(BOUND * 2):
                    async with trio.open_nursery() as n2:
                        n2.start_soon(kill_when_flowing)
                        n2.start_soon(sync, comms[0], mine)
                        n2.start_soon(sync, comms[1], joiner)
                assert killed.is_set()
                assert comms[1].statistics().sync_replans >= 1, "the kill did not land mid-transfer"
                assert_same(joiner, base)
                assert joiner.revision == 0
                stop.set()
        finally:
            proc.kill()
            proc.wait()


def _big_state(mib: int) -> SharedState:
    n = mib * 1024 * 1024 // 4
    return SharedState({"a": np.arange(n // 2, dtype=np.float32), "b": np.arange(n // 2, dtype=np.int32) * 3})


def _received(comm: pccl.Communicator) -> int:
    return comm.statistics().sync_rx_bytes


async def test_lineage_holders_win_and_a_newcomer_receives_whatever_revision_it_offers() -> None:
    # A peer without the group's lineage (a fresh state offering revision 40) is never kicked for
    # its revision and never overwrites the group: it receives the group's state at its revision.
    async with cluster(2) as c:
        group = make_state(30)
        states = [copy_state(group, revision=4), copy_state(group, revision=4)]
        first = await sync_all(c.comms, states)
        assert [i.reason for i in first] == [pccl.SyncReason.UP_TO_DATE] * 2
        assert states[0].lineage is not None and states[0].lineage == states[1].lineage
        for s in states:
            s.revision += 1  # 5: what the group expects of its continuing peers
        await c.join()
        ahead = make_state(31, revision=40)
        infos = await sync_all(c.comms, [*states, ahead])
        assert [i.revision for i in infos] == [5, 5, 5]
        assert_same(ahead, states[0])
        assert ahead.revision == 5 and ahead.lineage == states[0].lineage
        assert infos[2].received and infos[2].reason is pccl.SyncReason.NEWCOMER
        assert infos[2].rx_bytes == ahead.nbytes and not infos[0].received
        # Now all three continue from 5; a newcomer far behind just receives, kicked for nothing.
        for s in (*states, ahead):
            s.revision += 1
        await c.join()
        behind = make_state(32, revision=3)
        infos = await sync_all(c.comms, [*states, ahead, behind])
        assert [i.revision for i in infos] == [6] * 4
        assert_same(behind, ahead)


async def test_a_sync_cancelled_after_its_vote_goes_on_and_the_next_call_resumes_it() -> None:
    # Cancelling after the vote went out used to drop this peer from the run (the vote cannot be
    # taken back).  Now the sync completes in the background; the next call returns its outcome.
    async with cluster(3) as c:
        base = make_state(40)
        states = [copy_state(base), copy_state(base), make_state(41)]  # peer 2 must receive
        late = c.comms[2]
        with trio.move_on_after(BOUND) as timed_out:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(late.sync_shared_state, states[2])
                while not any(late.peer_id in s.voters for s in pccl.testing.master_snapshot(c.master).syncs):
                    await trio.sleep(0.005)
                nursery.cancel_scope.cancel()  # peer 2's call, after its vote
        assert not timed_out.cancelled_caught
        with pytest.raises(InvalidUsage, match="resume"):
            await late.sync_shared_state(make_state(41))  # another state: not this sync
        with pytest.raises(InvalidUsage, match="sync is running"):
            await late.all_reduce(np.ones(4, np.float32))
        infos = await sync_all(c.comms, states)  # peers 0 and 1 vote; peer 2 resumes
        assert [i.revision for i in infos] == [0, 0, 0]
        assert infos[2].rx_bytes == base.nbytes and infos[0].tx_bytes + infos[1].tx_bytes == base.nbytes
        assert_same(states[2], base)
        assert late.statistics().syncs_completed == 1
        for s in states:  # the communicator goes on as usual
            s.revision += 1
        infos = await sync_all(c.comms, states)
        assert [(i.revision, i.rx_bytes) for i in infos] == [(1, 0)] * 3
