"""Timing model of the virtual network: latency, shared bandwidth, per-connection window cap,
backpressure."""

from __future__ import annotations

import math

import pytest
import trio

from pccl_sim.engine.network import LinkSpec, World
from pccl_sim.engine.runner import simulate

MiB = 1024 * 1024



async def _transfer_times(world: World, sizes: list[int]) -> list[float]:
    """Open one a→b connection per size, send them all at t0, return each completion delay."""
    a, b = world.boot("a"), world.boot("b")
    listener = await b.listen("b:9000")
    streams = []
    for _ in sizes:
        async with trio.open_nursery() as nursery:
            accepted = []

            async def accept() -> None:
                accepted.append(await listener.accept())

            nursery.start_soon(accept)
            client = await a.connect("b:9000")
        streams.append((client, accepted[0]))
    done = [math.nan] * len(sizes)
    t0 = trio.current_time()

    async def send(client, size: int) -> None:
        await client.send_all(bytes(size))

    async def receive(i: int, server, size: int) -> None:
        buf = bytearray(size)
        await server.receive_exactly_into(buf)
        done[i] = trio.current_time() - t0

    async with trio.open_nursery() as nursery:
        for i, ((client, server), size) in enumerate(zip(streams, sizes)):
            nursery.start_soon(send, client, size)
            nursery.start_soon(receive, i, server, size)
    return done


def test_transfer_takes_latency_plus_size_over_bandwidth() -> None:
    latency, bandwidth, size = 0.05, 1_000_000, 500_000
    link = LinkSpec(latency=latency, bandwidth=bandwidth, window=64 * MiB)
    (elapsed,) = simulate(lambda w: _transfer_times(w, [size]), default_link=link)
    assert elapsed == pytest.approx(latency + size / bandwidth, rel=0.01)


def test_concurrent_connections_share_bandwidth_fairly() -> None:
    latency, bandwidth, size = 0.05, 1_000_000, 400_000
    link = LinkSpec(latency=latency, bandwidth=bandwidth, window=64 * MiB)
    first, second = simulate(lambda w: _transfer_times(w, [size, size]), default_link=link)
    expected = latency + 2 * size / bandwidth  # each gets half the link
    assert first == pytest.approx(expected, rel=0.05)
    assert second == pytest.approx(expected, rel=0.05)


def test_per_connection_window_caps_throughput_and_parallel_connections_help() -> None:
    latency, window, total = 0.05, 64 * 1024, 2 * MiB
    link = LinkSpec(latency=latency, window=window)  # unlimited bandwidth: only the window binds
    (single,) = simulate(lambda w: _transfer_times(w, [total]), default_link=link)
    rtt = 2 * latency
    assert single == pytest.approx(total / window * rtt, rel=0.15)  # window / RTT throughput
    parallel = simulate(lambda w: _transfer_times(w, [total // 4] * 4), default_link=link)
    assert max(parallel) == pytest.approx(single / 4, rel=0.2)


def test_sender_blocks_when_peer_does_not_read() -> None:
    window, send_buffer = 256 * 1024, 128 * 1024

    async def body(world: World) -> tuple[bool, int]:
        a, b = world.boot("a"), world.boot("b")
        listener = await b.listen("b:9000")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(listener.accept)
            client = await a.connect("b:9000")
        with trio.move_on_after(30) as scope:
            await client.send_all(bytes(8 * MiB))
        pipe = client.outbound
        return scope.cancelled_caught, pipe.transmitted + pipe.queued

    blocked, accepted = simulate(body, default_link=LinkSpec(window=window), send_buffer=send_buffer)
    assert blocked, "a send the peer never reads must block (or virtual time cannot advance)"
    assert accepted <= window + send_buffer


def test_latency_applies_per_direction_and_connect_takes_one_rtt() -> None:
    async def body(world: World) -> tuple[float, float]:
        a, b = world.boot("a"), world.boot("b")
        listener = await b.listen("b:9000")
        accepted = []
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _accept_into(listener, accepted))
            client = await a.connect("b:9000")
        connect_time = trio.current_time() - t0
        t1 = trio.current_time()
        await client.send_all(b"ping")
        await accepted[0].receive_exactly(4)
        await accepted[0].send_all(b"pong")
        await client.receive_exactly(4)
        return connect_time, trio.current_time() - t1

    world_link = LinkSpec(latency=0.1)

    async def run(world: World):
        world.set_link("a", "b", LinkSpec(latency=0.02), both_ways=False)
        world.set_link("b", "a", LinkSpec(latency=0.07), both_ways=False)
        return await body(world)

    connect_time, round_trip = simulate(run, default_link=world_link)
    assert connect_time == pytest.approx(0.09)
    assert round_trip == pytest.approx(0.09)


async def _accept_into(listener, out: list) -> None:
    out.append(await listener.accept())


async def _pair(world: World):
    a, b = world.boot("a"), world.boot("b")
    listener = await b.listen("b:9000")
    accepted = []
    async with trio.open_nursery() as nursery:

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        client = await a.connect("b:9000")
    return client, accepted[0]


def test_send_nowait_takes_what_fits_in_the_send_buffer_and_nothing_when_it_cannot_send() -> None:
    """The non-blocking send the master's control path uses on real TCP: what fits, at once;
    0 while the buffer is full, the host stalled, or the stream closed; the bytes arrive in order
    behind everything sent before."""

    async def body(world: World) -> None:
        client, server = await _pair(world)
        world.stall("a")
        assert client.send_nowait(b"frozen") == 0  # a stopped process sends nothing
        world.unstall("a")
        assert client.send_nowait(b"first") == 5
        world.partition(["a"], ["b"])  # hold the link so the buffer fills up
        assert client.send_nowait(bytes(200_000)) == 200_000
        taken = client.send_nowait(bytes(100_000))
        assert 0 < taken == 256 * 1024 - 200_000  # partly, as a kernel takes part of a write ("first" left)
        assert client.send_nowait(b"more") == 0
        world.heal()
        got = bytearray(5 + 200_000 + taken)
        await server.receive_exactly_into(got)
        assert got[:5] == b"first" and not any(got[5:])
        await client.aclose()
        assert client.send_nowait(b"late") == 0

    simulate(body)


def test_stream_operations_are_one_schedule_point_each_as_on_a_socket() -> None:
    """A receive that has to wait runs again once, when the data came (no extra yield on the way
    in, as trio's and pccl's sockets); one that finds data, and a send, yield exactly once."""

    class Steps(trio.abc.Instrument):
        def __init__(self) -> None:
            self.task: object = None
            self.count = 0

        def before_task_step(self, task: object) -> None:
            if task is self.task:
                self.count += 1

    steps = Steps()

    async def body(world: World) -> None:
        client, server = await _pair(world)
        trio.lowlevel.add_instrument(steps)
        buf = bytearray(4)

        async def counted(coro_fn) -> int:
            done: list[int] = []

            async def task() -> None:
                steps.task = trio.lowlevel.current_task()
                steps.count = 0
                await coro_fn()
                done.append(steps.count)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(task)
            return done[0]

        async def receive_waiting() -> None:
            assert await server.receive_into(buf) == 4

        async def send_later() -> None:
            await trio.sleep(1)
            await client.send_all(b"abcd")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_later)
            # (steps counted after the task's first): it parks, and runs once more when data came
            assert await counted(receive_waiting) == 1
        await client.send_all(b"efgh")
        await trio.sleep(1)
        assert await counted(receive_waiting) == 1  # data there: one yield before it returns
        assert await counted(lambda: client.send_all(b"ijkl")) == 1
        trio.lowlevel.remove_instrument(steps)

    simulate(body)


def test_world_sleep_until_wakes_at_its_instant_and_can_be_cancelled() -> None:
    async def body(world: World) -> list[tuple[str, float]]:
        woke: list[tuple[str, float]] = []

        async def sleeper(name: str, when: float) -> None:
            await world.sleep_until(when)
            woke.append((name, trio.current_time()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeper, "late", 2.5)
            nursery.start_soon(sleeper, "a", 1.25)
            nursery.start_soon(sleeper, "b", 1.25)
            with trio.move_on_after(0.5) as scope:
                await world.sleep_until(2.0)  # cancelled: its event later wakes nobody
            woke.append(("cancelled", trio.current_time()))
            assert scope.cancelled_caught
            await trio.sleep(1.0)
            await world.sleep_until(0.25)  # already past: returns at once, at this instant
            woke.append(("past", trio.current_time()))
            with pytest.raises(ValueError, match="NaN"):
                await world.sleep_until(math.nan)
        woke.append(("end", trio.current_time()))
        return woke

    woke = simulate(body)
    # (a and b wake in one scheduler batch: their order is the seeded scheduler's)
    assert sorted(woke[1:3]) == [("a", 1.25), ("b", 1.25)]
    assert [woke[0], *woke[3:]] == [("cancelled", 0.5), ("past", 1.5), ("late", 2.5), ("end", 2.5)]


def test_simulate_delivers_the_worlds_events_before_the_tasks_of_their_instant() -> None:
    """simulate() runs the loop of a scenario's run: the clock delivers the network's events when
    the run goes idle, before the tasks whose deadlines fall at the same instant."""

    async def body(world: World) -> list[str]:
        order: list[str] = []
        for name in ("first", "second"):
            world.queue.at(1.0, order.append, name)
        async with trio.open_nursery() as nursery:
            for name in [f"task {i}" for i in range(8)]:
                async def sleeper(name: str = name) -> None:
                    await trio.sleep(1.0)
                    order.append(name)

                nursery.start_soon(sleeper)
        return order

    order = simulate(body)
    assert order[:2] == ["first", "second"] and sorted(order[2:]) == [f"task {i}" for i in range(8)]


def test_simulate_is_deterministic_with_jitter_and_concurrent_transfers() -> None:
    """The same seed gives the same trace and timings twice; the link jitter draws from it."""
    link = LinkSpec(latency=0.01, bandwidth=10 * MiB, window=256 * 1024, jitter=0.004)

    def once(seed: int) -> tuple[str, list[float]]:
        from pccl_sim.engine.trace import Trace

        trace = Trace()
        times = simulate(lambda w: _transfer_times(w, [3 * MiB, 200_000, 5000, 1 * MiB]), seed=seed,
                         default_link=link, trace=trace)
        return trace.hash(), times

    first, again, other = once(3), once(3), once(4)
    assert first == again
    assert first[1] != other[1]  # another seed, other jitter
