"""A relay process in the simulator: it replays bit for bit (``serve_relay(rng=...)`` draws its
reconnect backoff's jitter and handshake nonces from the RNG it is given, as the master and the
communicator do), and it outlives its master (a reset or silent master connection makes it
register again, with the next master)."""

from __future__ import annotations

import random

import trio

import pccl
from pccl.relay import serve_relay
from pccl_sim.engine.network import LinkSpec, World
from pccl_sim.engine.runner import simulate
from pccl_sim.engine.trace import Trace
from pccl_sim.workloads.pccl.network import PcclSimNetwork

CONFIG = pccl.Config(peer_timeout=1.0, heartbeat_interval=0.25, connect_timeout=1.0,
                     master_reconnect_backoff=(0.1, 2.0))


def _run(seed: int) -> tuple[str, list[float]]:
    """A relay dialling a master that is down for a while; the trace hash and the times of its
    connects to the master."""
    trace = Trace()

    async def body(world: World) -> list[float]:
        relay_net = world.boot("relay0", config=CONFIG)
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(lambda task_status: serve_relay(
                "master:48148", "0.0.0.0:48147", config=CONFIG, network=relay_net, rng=random.Random(seed),
                task_status=task_status))
            await trio.sleep(5.0)  # the master is down: the relay backs off, jittered
            master_net = world.boot("master", config=CONFIG)
            async with pccl.open_master("0.0.0.0:48148", network=master_net,
                                        config=CONFIG):
                with trio.fail_after(10.0):
                    await relay.wait_registered()
            nursery.cancel_scope.cancel()
        return [e.t for e in trace.events if e.source == "relay0" and e.kind in ("connect", "connect_failed")
                and str(e.data.get("address", e.data.get("remote", ""))).startswith("master:")]

    connects = simulate(body, seed=seed, default_link=LinkSpec(latency=0.005), trace=trace,
                        network_class=PcclSimNetwork)
    return trace.hash(), connects


def test_a_relay_that_lost_its_master_replays_its_backoff() -> None:
    first, connects = _run(3)
    assert len(connects) >= 3, connects  # it retried, jittered, before the master came
    assert _run(3) == (first, connects)


def test_a_relay_registers_again_after_its_master_died() -> None:
    """The master's connection is reset (kill -9) or falls silent while the relay is registered:
    the relay registers with the next master.  (The loss surfaced from the registration's
    nursery as an ExceptionGroup, which the retry loop did not catch: the relay process died.)"""

    async def body(world: World) -> list[int]:
        relay_net = world.boot("relay0", config=CONFIG)
        ids: list[int] = []
        async with trio.open_nursery() as nursery:
            relay = await nursery.start(lambda task_status: serve_relay(
                "master:48148", "0.0.0.0:48147", config=CONFIG, network=relay_net, rng=random.Random(1),
                task_status=task_status))
            for life, death in enumerate(("kill", "stall")):
                master_net = world.boot("master", config=CONFIG)
                try:
                    async with pccl.open_master("0.0.0.0:48148", network=master_net, rng=random.Random(life),
                                                config=CONFIG):
                        with trio.fail_after(10.0):
                            ids.append(await relay.wait_registered())
                        if death == "stall":
                            world.stall("master")  # silent: the relay gives up after peer_timeout
                            await trio.sleep(2 * CONFIG.peer_timeout)
                            assert relay.relay_id is None
                        world.kill("master")  # its connections reset, its listener closed
                        world.unstall("master")
                        await trio.sleep(0)
                except pccl.PCCLError:
                    pass  # the dead master's own listener failing: the corpse's business
                await trio.sleep(0.5)
            master_net = world.boot("master", config=CONFIG)
            async with pccl.open_master("0.0.0.0:48148", network=master_net, rng=random.Random(9), config=CONFIG):
                with trio.fail_after(10.0):
                    ids.append(await relay.wait_registered())
                assert relay.statistics().registrations == 3
            nursery.cancel_scope.cancel()
        return ids

    ids = simulate(body, seed=1, default_link=LinkSpec(latency=0.005), network_class=PcclSimNetwork)
    assert len(ids) == 3
