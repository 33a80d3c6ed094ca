"""A collective call cancelled after its peer reported success (``Done(ok)``) but before the
master's verdict, with peers as Trio tasks in this process (real loopback TCP).

The op's fate is the master's once the success is reported (pccl._peer.collective_service,
docs/collectives.rst "Cancellation"): the cancelled call waits for the verdict (shielded,
bounded by ``peer_timeout``) and ends as every other participant does — the result on
``Complete`` (the caller's cancel scope catches nothing), the input restored on ``Abort``.  It
used to restore its input and raise ``Cancelled`` while the others completed: the all-or-nothing
rule broken from the callers' point of view.

The moment is made exactly: peer 0's cancel scope is cancelled as its ``Done(ok)`` goes out
(``pccl.testing.intercept_master_sends``), and peer 1 holds its own ``Done`` until then, so the
master cannot have spoken before peer 0 is cancelled.  Voted and begun (``fast_commit``) ops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import Config
from pccl.collectives.buckets import DEFAULT_BUCKET_BYTES, PACKED_BUCKET_BYTES, plan_buckets
from pccl.collectives.buffers import DEFAULT_THREAD_THRESHOLD
from pccl.protocol import messages as m
from pccl.testing import admit, each, open_test_cluster

TOKEN = "cancel-after-done"
SOON = 30.0
PEER_TIMEOUT = 3.0


def _config(fast_commit: bool) -> Config:
    return Config(peer_timeout=PEER_TIMEOUT, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                  shared_state_base_port=0, fast_commit=fast_commit)


def _inputs(n: int) -> list[np.ndarray]:
    return [np.arange(n, dtype=np.float32) * (i + 1) + i for i in range(3)]


def _cancel_at_done(scope: trio.CancelScope, cancelled: trio.Event) -> Any:
    """A hook for peer 0: cancel its call's scope as its ``Done(ok)`` goes out (the send itself is
    shielded, so the Done reaches the master)."""

    async def before(msg: m.Message) -> None:
        if isinstance(msg, m.CollectiveDone) and not msg.aborted:
            scope.cancel()
            cancelled.set()

    return before


@pytest.mark.parametrize("fast_commit", [False, True], ids=["voted", "begun"])
async def test_a_call_cancelled_after_its_done_ends_with_the_result_every_peer_gets(fast_commit: bool) -> None:
    async with open_test_cluster(3, token=TOKEN, config=_config(fast_commit), soon=SOON) as (master, comms, _):
        warm = [np.ones(4, np.float32) for _ in range(3)]
        await each(comms, lambda i, c: c.all_reduce(warm[i], tag=7))  # the ring is wired (a begun op needs it)
        inputs = _inputs(200_000)
        want = sum(inputs)
        bufs = [x.copy() for x in inputs]
        scope, cancelled = trio.CancelScope(), trio.Event()

        async def hold_done(msg: m.Message) -> None:  # peer 1: its Done only once peer 0 was cancelled
            if isinstance(msg, m.CollectiveDone):
                await cancelled.wait()
                await trio.sleep(0.2)  # peer 0's task meets its cancellation meanwhile

        out: list[Any] = [None] * 3

        async def call(i: int) -> None:
            with scope if i == 0 else contextlib.nullcontext():
                out[i] = await comms[i].all_reduce(bufs[i], tag=1)

        with contextlib.ExitStack() as faults:
            faults.enter_context(pccl.testing.intercept_master_sends(comms[0], _cancel_at_done(scope, cancelled)))
            faults.enter_context(pccl.testing.intercept_master_sends(comms[1], hold_done))
            with trio.fail_after(SOON):
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(call, i)
        assert cancelled.is_set() and scope.cancel_called
        # All or nothing: the master completed the op, so peer 0's call returned its result too.
        assert not scope.cancelled_caught, "peer 0's call restored its input while the others completed"
        assert all(isinstance(o, pccl.ReduceInfo) and o.world_size == 3 for o in out), out
        assert all(np.array_equal(b, want) for b in bufs)
        # The tag is free on every peer: the next call on it runs at once.
        again = [x.copy() for x in inputs]
        infos = await each(comms, lambda i, c: c.all_reduce(again[i], tag=1))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(np.array_equal(b, want) for b in again)
        assert pccl.testing.master_snapshot(master).ops == ()


@pytest.mark.parametrize("fast_commit", [False, True], ids=["voted", "begun"])
async def test_a_call_cancelled_after_its_done_restores_its_input_when_the_op_aborts(fast_commit: bool) -> None:
    """Peer 0 is cancelled as its ``Done(ok)`` goes out; peer 2 dies instead of reporting (every
    byte moved): the master aborts the op, so peer 0's call restores its input and ends
    ``Cancelled`` (its scope catches it) while peer 1's raises ``CollectiveAborted``, its input
    restored too."""
    async with open_test_cluster(3, token=TOKEN, config=_config(fast_commit), soon=SOON) as (master, comms, _):
        warm = [np.ones(4, np.float32) for _ in range(3)]
        await each(comms, lambda i, c: c.all_reduce(warm[i], tag=7))
        inputs = _inputs(200_000)
        bufs = [x.copy() for x in inputs]
        scope, cancelled = trio.CancelScope(), trio.Event()
        finished = {comms[0].peer_id, comms[1].peer_id}

        async def crash_instead_of_done(msg: m.Message) -> None:  # peer 2
            if isinstance(msg, m.CollectiveDone) and not msg.aborted:
                while not any(op.done >= finished for op in pccl.testing.master_snapshot(master).ops):
                    await trio.sleep(0.005)
                await cancelled.wait()
                await trio.sleep(0.2)  # peer 0's task meets its cancellation meanwhile
                pccl.testing.drop_master_link(comms[2])
                await trio.sleep_forever()

        out: list[Any] = [None] * 2
        crash_scope = trio.CancelScope()

        async def call(i: int) -> None:
            with scope if i == 0 else contextlib.nullcontext():
                try:
                    out[i] = await comms[i].all_reduce(bufs[i], tag=1)
                except pccl.PCCLError as exc:
                    out[i] = exc

        async def crashing_peer() -> None:
            with crash_scope:
                await comms[2].all_reduce(bufs[2], tag=1)

        with contextlib.ExitStack() as faults:
            faults.enter_context(pccl.testing.intercept_master_sends(comms[0], _cancel_at_done(scope, cancelled)))
            faults.enter_context(pccl.testing.intercept_master_sends(comms[2], crash_instead_of_done))
            with trio.fail_after(SOON):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(crashing_peer)
                    async with trio.open_nursery() as survivors:
                        for i in range(2):
                            survivors.start_soon(call, i)
                    crash_scope.cancel()
        assert scope.cancelled_caught and out[0] is None, out
        assert isinstance(out[1], pccl.CollectiveAborted), out
        assert np.array_equal(bufs[0], inputs[0]) and np.array_equal(bufs[1], inputs[1])


def _many_inputs(size: str) -> list[list[np.ndarray]]:
    """Every peer's arrays: two small ones, or 20 of just under 1 MiB (float32) — one packed
    bucket of about 20 MiB, whose unpacking runs in a worker thread (at least
    ``DEFAULT_THREAD_THRESHOLD``, under ``PACKED_BUCKET_BYTES``)."""
    if size == "small":
        return [[np.arange(100, dtype=np.float32) * (i + 1), np.full(50, i + 1.0, np.float32)] for i in range(3)]
    n = (1 << 18) - 16
    arrays = [[np.full(n, i + 1.0 + k, np.float32) for k in range(20)] for i in range(3)]
    assert len(plan_buckets(arrays[0], DEFAULT_BUCKET_BYTES)) == 1
    assert DEFAULT_THREAD_THRESHOLD <= sum(a.nbytes for a in arrays[0]) <= PACKED_BUCKET_BYTES
    return arrays


@pytest.mark.parametrize("size", ["small", "threaded"])
async def test_an_all_reduce_many_cancelled_after_its_done_holds_the_reduction_every_peer_holds(size: str) -> None:
    """``all_reduce_many`` of one packed bucket (one op), unpacked inline or in a worker thread:
    peer 0's call is cancelled as that op's ``Done(ok)`` goes out and the master completes it, so
    peer 0's arrays take the reduction as the others' do (the unpacking of a completed op's bucket
    is not cut short), whether or not its call itself then ends ``Cancelled``."""
    async with open_test_cluster(3, token=TOKEN, config=_config(False), soon=SOON) as (master, comms, _):
        arrays = _many_inputs(size)
        want = [sum(a[k] for a in arrays) for k in range(len(arrays[0]))]
        bufs = [[a.copy() for a in peer] for peer in arrays]
        scope, cancelled = trio.CancelScope(), trio.Event()

        async def hold_done(msg: m.Message) -> None:  # peer 1
            if isinstance(msg, m.CollectiveDone):
                await cancelled.wait()
                await trio.sleep(0.2)

        async def call(i: int) -> None:
            with scope if i == 0 else contextlib.nullcontext():
                await comms[i].all_reduce_many(bufs[i])

        with contextlib.ExitStack() as faults:
            faults.enter_context(pccl.testing.intercept_master_sends(comms[0], _cancel_at_done(scope, cancelled)))
            faults.enter_context(pccl.testing.intercept_master_sends(comms[1], hold_done))
            with trio.fail_after(SOON):
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(call, i)
        assert cancelled.is_set()
        for i in range(3):
            assert all(np.array_equal(b, w) for b, w in zip(bufs[i], want)), f"peer {i}'s arrays: all or nothing"


async def test_a_communicator_closed_after_its_done_ends_the_call_at_once(caplog: pytest.LogCaptureFixture) -> None:
    """Peer 0's call runs inside the scope around its ``open_communicator`` (as the blocking
    ``Communicator`` and the torch group run theirs); that scope is cancelled as the call's
    ``Done(ok)`` goes out, which also cancels the task reading the master connection: the
    master's word can no longer arrive.  The call ends at once (its input restored: the one case
    where a call cancelled after its ``Done`` may end otherwise than the others'), not after
    ``peer_timeout`` of waiting for a word that cannot come.  Peer 1 holds its own ``Done`` until
    peer 0's communicator has closed, so no ``Complete`` can come before; waiting for one would
    log the ``peer_timeout`` warning."""
    caplog.set_level(logging.INFO, logger="pccl")
    config = _config(False)
    scope, cancelled, closed = trio.CancelScope(), trio.Event(), trio.Event()
    calls: list[trio.Nursery] = []

    @contextlib.asynccontextmanager
    async def open_peer0() -> AsyncIterator[pccl.Communicator]:
        try:
            async with pccl.open_communicator(master.address, token=TOKEN, config=config) as comm:
                async with trio.open_nursery() as nursery:  # its calls run inside its scope
                    calls.append(nursery)
                    yield comm
        finally:
            closed.set()

    async def hold_done(msg: m.Message) -> None:  # peer 1: its Done only once peer 0 has closed
        if isinstance(msg, m.CollectiveDone):
            await closed.wait()

    async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=config) as master:
        async with trio.open_nursery() as peers:
            comms: list[pccl.Communicator] = []
            comm0, scope0 = await admit(peers, master, comms, open_peer0, soon=SOON)
            comms.append(comm0)
            for _ in range(2):
                comm, _scope = await admit(peers, master, comms, lambda: pccl.open_communicator(
                    master.address, token=TOKEN, config=config), soon=SOON)
                comms.append(comm)
            inputs = _inputs(200_000)
            bufs = [x.copy() for x in inputs]
            out: list[Any] = [None] * 3

            async def call(i: int) -> None:
                try:
                    out[i] = await comms[i].all_reduce(bufs[i], tag=1)
                except pccl.PCCLError as exc:
                    out[i] = exc

            with contextlib.ExitStack() as faults:
                faults.enter_context(pccl.testing.intercept_master_sends(comms[0], _cancel_at_done(scope0, cancelled)))
                faults.enter_context(pccl.testing.intercept_master_sends(comms[1], hold_done))
                with trio.fail_after(SOON):
                    async with trio.open_nursery() as others:
                        calls[0].start_soon(call, 0)
                        for i in (1, 2):
                            others.start_soon(call, i)
                        await closed.wait()
            peers.cancel_scope.cancel()
    assert cancelled.is_set() and scope0.cancelled_caught
    assert out[0] is None, out  # peer 0's call ended Cancelled: the master's word could not come
    assert np.array_equal(bufs[0], inputs[0])
    assert all(isinstance(o, (pccl.ReduceInfo, pccl.PCCLError)) for o in out[1:]), out
    waited = [r.getMessage() for r in caplog.records if "peer_timeout" in r.getMessage()]
    assert not waited, waited
    assert any("master's word can no longer come" in r.getMessage() for r in caplog.records)
