"""Kernel work takes virtual time in the simulator (Network.kernel_wait, KernelRunner), and an
aborted op waits for it as a real peer waits for its lane threads."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives.buffers import KernelRunner
from pccl.config import Config
from pccl.net.tcp import TcpNetwork
from pccl_sim.engine.runner import run
from pccl_sim.tools.campaign import CampaignSpec
from pccl_sim.engine.network import World
from pccl_sim.engine.runner import simulate
from pccl_sim.workloads.pccl.network import KernelCost, PcclSimNetwork
from pccl_sim.workloads.pccl.scenario import PcclScenario


def test_a_real_network_adds_no_kernel_wait() -> None:
    assert TcpNetwork(Config()).kernel_wait() is None
    runner = KernelRunner(threads=False)
    assert runner.inline(1 << 20)


def test_kernel_cost_is_overhead_plus_bytes_over_rate() -> None:
    cost = KernelCost(rate=1e6, overhead=0.5)
    assert cost.seconds(0) == 0.5
    assert cost.seconds(2_000_000) == pytest.approx(2.5)
    with pytest.raises(ValueError):
        KernelCost(rate=0)


def test_a_paced_kernel_runs_once_and_waits_its_time() -> None:
    runner = KernelRunner(threads=False, kernel_wait=lambda n: trio.sleep(n / 1000))
    assert not runner.inline(1)  # every kernel goes through run(), which waits
    calls: list[int] = []

    async def main() -> None:
        start = trio.current_time()
        result = await runner.run(500, lambda x: calls.append(x) or x * 2, 21)
        assert result == 42
        assert trio.current_time() - start == pytest.approx(0.5)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert calls == [21]


def test_cancelling_a_paced_kernel_waits_for_it_as_for_a_thread() -> None:
    # The data path of an aborted op returns only once its kernel's time has passed (a real
    # peer waits for its lane threads): the window in which a concurrent call's answer arrives.
    runner = KernelRunner(threads=False, kernel_wait=lambda n: trio.sleep(1.0))
    out = np.zeros(1)

    async def main() -> None:
        start = trio.current_time()
        with trio.move_on_after(0.1) as scope:  # its deadline passes mid-kernel
            await runner.run(8, out.fill, 7.0)
            raise AssertionError("the cancellation must be raised after the kernel")
        assert scope.cancelled_caught
        assert trio.current_time() - start == pytest.approx(1.0)  # not 0.1: the kernel's second
        assert out[0] == 7.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_kernel_wait_ends_when_its_host_dies() -> None:
    # kill -9 takes the threads with the process: a dying host's kernel must not keep its task
    # running (the runner reports that as a zombie), shield or no shield.
    async def host(world: World) -> None:
        network = world.boot("peer0")
        network.kernel_cost = KernelCost(rate=1.0, overhead=0.0)  # a second per byte
        wait = network.kernel_wait()
        assert wait is not None
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_kill_later, world, 0.5)
            with trio.CancelScope(shield=True):
                await wait(10)
        assert trio.current_time() - start == pytest.approx(0.5)
        await wait(10)  # a dead incarnation's kernel takes no time
        assert trio.current_time() - start == pytest.approx(0.5)

    simulate(host, network_class=PcclSimNetwork)


async def _kill_later(world: World, delay: float) -> None:
    await trio.sleep(delay)
    world.kill("peer0")


def test_the_scenario_charges_kernels_unless_told_not_to() -> None:
    assert PcclScenario().kernel_cost == KernelCost()
    assert "kernel_rate" not in PcclScenario().to_json()  # default: old schedules read the same
    assert PcclScenario(kernel_rate=None).kernel_cost is None
    again = PcclScenario.from_json(PcclScenario(kernel_rate=2e9, kernel_overhead=0.0).to_json())
    assert again.kernel_cost == KernelCost(rate=2e9, overhead=0.0)


@pytest.mark.parametrize(("peers", "duration"), [
    pytest.param(3, 6.0, id="small"),
    pytest.param(4, 20.0, id="full", marks=pytest.mark.slow),
])
def test_kernel_time_changes_the_run_and_stays_deterministic(peers: int, duration: float) -> None:
    # The same seed with and without kernel time: different virtual timelines (kernels do take
    # time), each one the same on a second run.
    hashes = {}
    for rate in (None, 1e9):
        spec = CampaignSpec(peers=peers, duration=duration, params=(("phases", ("compute", {"name": "all_reduce", "quantization": "uint8"})),
                                    ("kernel_rate", rate)))
        first = run(*spec.build(2))
        again = run(*spec.build(2))
        assert first.ok and again.ok, [str(f) for f in first.failures + again.failures]
        assert first.hash() == again.hash()
        hashes[rate] = first.hash()
    assert hashes[None] != hashes[1e9]
