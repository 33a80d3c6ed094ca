"""``open_communicator`` waits for a master that is not up yet (``Config.master_wait_timeout``),
so a run's processes can start in any order: it says so once, stays cancellable, gives up when
the wait runs out (at once with 0), and draws its jitter from the injected rng alone."""

from __future__ import annotations

import logging
import random

import pytest
import trio
import trio.testing

import pccl
from pccl import Config
from pccl.net.base import Stream

from pccl.testing import MemoryNetwork

CFG = Config(peer_timeout=30.0, connect_timeout=2.0, master_wait_timeout=20.0)
MASTER = "10.0.0.9:7000"


class _CountingNetwork(MemoryNetwork):
    """Counts and timestamps the dials of the master's address."""

    def __init__(self) -> None:
        super().__init__()
        self.dials: list[float] = []

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        if address == MASTER:
            self.dials.append(trio.current_time())
        return await super().connect(address, timeout=timeout)


async def test_a_peer_started_before_its_master_joins_once_it_is_up(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl")
    network = _CountingNetwork()
    joined: list[int] = []

    async def peer() -> None:
        async with pccl.open_communicator(MASTER, config=CFG, network=network, rng=random.Random(3)) as comm:
            joined.append(comm.world_size)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(peer)
        await trio.sleep(8.0)  # the master comes up late
        assert not joined
        async with pccl.open_master(MASTER, config=CFG, network=network):
            with trio.fail_after(10):
                while not joined:
                    await trio.sleep(0.1)
    assert joined == [1]
    assert len(network.dials) > 3  # it dialled again and again ...
    waiting = [r.getMessage() for r in caplog.records if "waiting for the master" in r.getMessage()]
    assert len(waiting) == 1 and waiting[0].startswith(f"waiting for the master at {MASTER} ")  # ... and said so once
    assert caplog.records[[r.getMessage() for r in caplog.records].index(waiting[0])].levelno == logging.INFO


async def test_the_wait_is_cancellable(autojump_clock: trio.testing.MockClock) -> None:
    network = _CountingNetwork()
    with trio.move_on_after(5.0) as scope:
        async with pccl.open_communicator(MASTER, config=CFG, network=network):
            raise AssertionError("no master: never joins")
    assert scope.cancelled_caught and len(network.dials) > 1
    assert not [a for a in network.listeners if a != MASTER]  # its p2p and state listeners are closed


async def test_the_wait_is_bounded(autojump_clock: trio.testing.MockClock) -> None:
    network = _CountingNetwork()
    start = trio.current_time()
    with pytest.raises(pccl.MasterUnreachable, match=r"cannot reach the master at 10\.0\.0\.9:7000 \(waited 20 s"):
        async with pccl.open_communicator(MASTER, config=CFG, network=network):
            pass
    assert CFG.master_wait_timeout <= trio.current_time() - start < CFG.master_wait_timeout + 1


async def test_zero_fails_at_once(autojump_clock: trio.testing.MockClock) -> None:
    network = _CountingNetwork()
    start = trio.current_time()
    with pytest.raises(pccl.MasterUnreachable, match="cannot reach the master at 10.0.0.9:7000: nothing listens"):
        async with pccl.open_communicator(MASTER, config=Config(master_wait_timeout=0), network=network):
            pass
    assert trio.current_time() == start and len(network.dials) == 1


def test_the_jitter_comes_from_the_injected_rng() -> None:
    global_seeds = iter(range(100, 200))

    def dial_times(seed: int) -> list[float]:
        network = _CountingNetwork()

        async def run() -> None:
            with trio.move_on_after(15.0):
                async with pccl.open_communicator(MASTER, config=CFG, network=network, rng=random.Random(seed)):
                    pass

        random.seed(next(global_seeds))  # the global generator differs even between runs of one seed
        trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
        return network.dials

    assert dial_times(1) == dial_times(1)
    assert dial_times(1) != dial_times(2)


def test_a_negative_wait_is_refused() -> None:
    with pytest.raises(pccl.InvalidArgument, match="master_wait_timeout"):
        Config(master_wait_timeout=-1)
