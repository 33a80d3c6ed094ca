# docs-test: run
"""A scenario of its own and a checker, run in the simulator under a seeded fault schedule."""

import trio

from pccl_sim.engine.errors import SimNetworkError
from pccl_sim.engine.runner import Checker, HostContext, Scenario, Simulation, run
from pccl_sim.engine.trace import TraceEvent
from pccl_sim.faults.generate import generate

PORT = 7100


class Doubler(Scenario):
    """The master doubles every number a peer sends; peers reconnect after any failure."""

    name = "doubler"

    async def master(self, host: HostContext) -> None:
        listener = await host.network.listen(f"{host.name}:{PORT}")

        async def serve(stream) -> None:
            try:
                async with stream:
                    while True:
                        n = int.from_bytes(await stream.receive_exactly(4), "big")
                        await stream.send_all((2 * n % 2**32).to_bytes(4, "big"))
            except SimNetworkError:
                pass                                            # the peer died or was cut off

        async with trio.open_nursery() as nursery:
            while True:
                nursery.start_soon(serve, await listener.accept())

    async def peer(self, host: HostContext) -> None:
        while True:
            try:
                stream = await host.network.connect(f"master:{PORT}", timeout=2.0)
                async with stream:
                    while True:
                        n = host.rng.randrange(2**31)           # the host's seeded RNG
                        await stream.send_all(n.to_bytes(4, "big"))
                        with trio.fail_after(1.0):
                            answer = int.from_bytes(await stream.receive_exactly(4), "big")
                        host.record("answer", sent=n, got=answer)   # a trace event
                        await trio.sleep(0.1)
            except (SimNetworkError, trio.TooSlowError):
                await trio.sleep(0.5)                           # back off, then dial again

    def checkers(self) -> list[Checker]:
        return [Doubled()]


class Doubled(Checker):
    """Safety: every answer is twice the question."""

    name = "doubled"

    def on_event(self, sim: Simulation, event: TraceEvent) -> None:
        if event.kind == "answer" and event.data["got"] != 2 * event.data["sent"]:
            sim.fail("safety", f"{event.source} sent {event.data['sent']}, got {event.data['got']}", self.name)


scenario = Doubler(peers=3)
schedule = generate(7, profile="chaos", peers=3, duration=10.0, quiet=5.0, scenario=scenario.to_json())
trace = run(scenario, schedule)
again = run(Doubler(peers=3), schedule)
print(f"{len(schedule.events)} faults, {len(trace.of_kind('answer'))} answers, ok={trace.ok}, hash {trace.hash()}")
assert trace.ok, trace.failures
assert again.hash() == trace.hash()                            # the same seed, the same run
