"""A relay replays bit for bit in the simulator: ``serve_relay(rng=...)`` draws its reconnect
backoff's jitter (and its handshake nonces) from the RNG it is given, as the master and the
communicator do.  Before, the jitter came from an unseeded ``random.Random()``: a relay that lost
its master re-registered at times no seed determined, and two runs of one seed diverged."""

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
