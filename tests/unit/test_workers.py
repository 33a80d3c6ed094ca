"""The bulk path's worker threads (pccl.net.workers): jobs, their outcome, reuse, retirement,
a fork, and that an op's lane threads are these workers."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import outcome
import pytest
import trio

from pccl.collectives import RingLinks, broadcast_checked, ring_all_reduce
from pccl.collectives.buffers import ReduceArgs
from pccl.config import Config
from pccl.net import workers
from pccl.types import ReduceOp

from tcp_pairs import framed_tcp_pair
from test_allreduce_ring import tcp_ring


def run(fn: object) -> tuple[outcome.Outcome[object], str]:
    """Run ``fn`` in a worker; its outcome and the name its thread had while it ran."""
    got: list[outcome.Outcome[object]] = []
    names: list[str] = []
    done = threading.Event()

    def job() -> object:
        names.append(threading.current_thread().name)
        return fn()  # type: ignore[operator]

    def deliver(result: outcome.Outcome[object]) -> None:
        got.append(result)
        done.set()

    workers.start_soon(job, deliver, name="pccl-test-job")
    assert done.wait(10), "the job never ran"
    return got[0], names[0]


def test_a_job_runs_named_and_delivers_its_value_or_its_error() -> None:
    value, name = run(lambda: 42)
    assert value == outcome.Value(42) and name == "pccl-test-job"

    def fail() -> None:
        raise ValueError("boom")

    error, _ = run(fail)
    assert isinstance(error, outcome.Error) and isinstance(error.error, ValueError)
    # The name is the job's only while it runs.
    assert not [t for t in threading.enumerate() if t.name == "pccl-test-job"]


def test_an_idle_worker_takes_the_next_job() -> None:
    first, _ = run(threading.get_ident)
    assert workers.idle_workers() >= 1
    second, _ = run(threading.get_ident)
    assert first.unwrap() == second.unwrap()


def test_idle_workers_retire(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "IDLE_TIMEOUT", 0.05)
    run(lambda: None)  # a worker waiting with the new timeout (any older ones retire too, within 10 s)
    for _ in range(1200):
        if workers.idle_workers() == 0:
            break
        threading.Event().wait(0.01)
    assert workers.idle_workers() == 0
    value, _ = run(lambda: 7)  # a new worker is started
    assert value.unwrap() == 7


def test_a_forked_child_starts_its_own_workers() -> None:
    run(lambda: None)
    assert workers.idle_workers() >= 1  # the parent's idle worker, which the child does not have
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            value, _ = run(lambda: 5)
            code = 0 if value.unwrap() == 5 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


async def test_a_ring_ops_lane_threads_are_these_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    dialed, accepted = await framed_tcp_pair(Config())
    a, b = RingLinks([dialed], [dialed]), RingLinks([accepted], [accepted])
    names: list[str] = []
    real = workers.start_soon

    def counting(fn: Any, deliver: Any, *, name: str) -> None:
        names.append(name)
        real(fn, deliver, name=name)

    monkeypatch.setattr(workers, "start_soon", counting)
    try:
        assert a.threaded and b.threaded
        inputs = [np.arange(1_000_003, dtype=np.float32) * (r + 1) for r in range(2)]
        bufs = [x.copy() for x in inputs]
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for rank, links in enumerate((a, b)):
                    nursery.start_soon(lambda rank=rank, links=links: ring_all_reduce(
                        bufs[rank], op=ReduceOp.SUM, links=links, rank=rank, world=2, seq=1))
        assert np.array_equal(bufs[0], inputs[0] + inputs[1])
        # Two peers, one lane each: a sender and a receiver per peer.
        assert names == ["pccl-ring-lane"] * 4
    finally:
        await a.aclose()
        await b.aclose()


def test_a_worker_whose_pipe_is_past_fd_setsize_still_wakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(workers, "IDLE_TIMEOUT", 0.05)
    run(lambda: None)
    for _ in range(1200):  # the idle workers retire, so the next job starts a new one
        if workers.idle_workers() == 0:
            break
        threading.Event().wait(0.01)
    assert workers.idle_workers() == 0
    monkeypatch.setattr(workers, "IDLE_TIMEOUT", 10.0)
    held = []
    try:
        while not held or held[-1] < 1100:  # a process with many connections
            held.append(os.open(os.devnull, os.O_RDONLY))
        first, _ = run(threading.get_ident)  # a new worker, its pipe past select()'s FD_SETSIZE
        second, _ = run(threading.get_ident)  # handed over through that pipe
        assert first.unwrap() == second.unwrap()
    finally:
        for fd in held:
            os.close(fd)


async def test_a_broadcasts_receivers_start_before_their_senders_past_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """A woken worker runs first, so the thread that must drain the socket from the start (on
    every peer past the root; the chain's last one sends nothing) is handed its job first."""
    links = await tcp_ring(3, 1)
    order: list[tuple[int, str]] = []
    real = workers.start_soon

    def recording(fn: Any, deliver: Any, *, name: str) -> None:
        loop = fn.args[0]  # functools.partial(LaneThreads._guarded, <the lane's loop>, lane, buffer)
        order.append((links.index(loop.__self__.op.links), loop.__name__))
        real(fn, deliver, name=name)

    monkeypatch.setattr(workers, "start_soon", recording)
    try:
        inputs = [np.arange(1_000_003, dtype=np.float32) + 1000 * r for r in range(3)]
        xs = [x.copy() for x in inputs]

        async def peer(r: int) -> None:
            args = ReduceArgs.check(xs[r], None, ReduceOp.SUM, None)
            await broadcast_checked(args, root=0, links=links[r], rank=r, world=3, seq=1, max_subchunk_bytes=1 << 20)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for r in range(3):
                    nursery.start_soon(peer, r)
        assert all(np.array_equal(x, inputs[0]) for x in xs)
        assert [loop for rank, loop in order if rank == 0] == ["_send_loop", "_receive_loop"]
        assert [loop for rank, loop in order if rank == 1] == ["_receive_loop", "_send_loop"]
        assert [loop for rank, loop in order if rank == 2] == ["_receive_loop", "_send_loop"]
    finally:
        for link in links:
            await link.aclose()
