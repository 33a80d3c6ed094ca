"""``pccl demo --chaos`` kills only peers still training, never twice without a step of the group
in between, and stops once the run is ending: a newcomer started then would find every other peer
finished and wait alone."""

from __future__ import annotations

import argparse
import random

import pytest
import trio

from pccl.tools import demo


class _FakeProcess:
    def __init__(self) -> None:
        self.returncode: int | None = None
        self.signals: list[int] = []

    def send_signal(self, signum: int) -> None:
        self.signals.append(signum)


def _finish(cluster: demo.Cluster) -> None:
    cluster.finals["peer0"] = {"event": "done", "step": 30, "hash": "0"}
    cluster.first_done.set()


def _near_the_end(cluster: demo.Cluster) -> None:
    cluster.last_step = 25


@pytest.mark.parametrize("ending", [_finish, _near_the_end], ids=["a-peer-finished", "past-two-thirds"])
async def test_chaos_stops_when_the_run_ends_during_its_sleep(autojump_clock: trio.testing.MockClock,
                                                             ending) -> None:
    cluster = demo.Cluster("127.0.0.1:1", argparse.Namespace(steps=30, chaos_interval=2.0))
    procs = {f"peer{i}": _FakeProcess() for i in range(3)}
    cluster.procs.update(procs)  # type: ignore[arg-type]
    spawned: list[str] = []

    async def spawn(cluster: demo.Cluster, nursery: trio.Nursery) -> None:
        spawned.append("newcomer")


    async def end_soon() -> None:
        await trio.sleep(1.0)  # while the chaos loop sleeps its interval
        ending(cluster)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(end_soon)
        with trio.fail_after(60):
            await demo.run_chaos(cluster, nursery, random.Random(0), spawn)
    assert [p.signals for p in procs.values()] == [[], [], []]
    assert spawned == []
    assert cluster.killed == []


async def test_chaos_never_picks_a_peer_that_reported_done(autojump_clock: trio.testing.MockClock) -> None:
    # peer0 printed "done" but has not exited yet; only peer1 and peer2 may be killed, and with
    # peer0 done the chaos is over anyway — but a victim drawn among all three could be peer0.
    cluster = demo.Cluster("127.0.0.1:1", argparse.Namespace(steps=300, chaos_interval=1.0))
    procs = {f"peer{i}": _FakeProcess() for i in range(3)}
    cluster.procs.update(procs)  # type: ignore[arg-type]
    cluster.finals["peer0"] = {"event": "done", "step": 1, "hash": "0"}
    rounds = 0

    async def spawn(cluster: demo.Cluster, nursery: trio.Nursery) -> None:
        nonlocal rounds
        rounds += 1
        cluster.last_step += 1  # the group steps between kills
        if rounds == 20:
            cluster.first_done.set()

    async with trio.open_nursery() as nursery:
        with trio.fail_after(600):
            await demo.run_chaos(cluster, nursery, random.Random(1), spawn)
    assert procs["peer0"].signals == []
    assert len(cluster.killed) == 20


async def test_no_kill_until_the_group_steps_again(autojump_clock: trio.testing.MockClock) -> None:
    # On a loaded machine newcomers may start slower than --chaos-interval: kills at a fixed pace
    # then took every peer before the group stepped again, and the demo never ended.
    cluster = demo.Cluster("127.0.0.1:1", argparse.Namespace(steps=300, chaos_interval=1.0))
    procs = {f"peer{i}": _FakeProcess() for i in range(3)}
    cluster.procs.update(procs)  # type: ignore[arg-type]

    async def spawn(cluster: demo.Cluster, nursery: trio.Nursery) -> None:
        pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(demo.run_chaos, cluster, nursery, random.Random(2), spawn)
        await trio.sleep(30.5)  # thirty intervals without a step: the first kill only
        assert len(cluster.killed) == 1
        cluster.last_step = 1
        await trio.sleep(1.0)
        assert len(cluster.killed) == 2
        await trio.sleep(10.0)
        assert len(cluster.killed) == 2
        cluster.first_done.set()
