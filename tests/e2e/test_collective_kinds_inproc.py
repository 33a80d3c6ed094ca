"""Broadcast, all-gather and reduce-scatter with peers as Trio tasks in this process (real TCP),
where the test needs a hand on the calls: argument checks before the vote, the master's per-tag
agreement (kind, dtype, op, quantization, root, count) refused on every peer naming both sides,
a root that is not a member, cancellation mid-op, torch tensors, the blocking twins."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

import pccl
from pccl import CollectiveAborted, Config, InvalidArgument, InvalidUsage, Quantization, ReduceOp, TooFewPeers
from pccl.testing import each, open_test_cluster, plant_backup_fault

TOKEN = "kinds-inproc"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0)
SOON = 30.0


def _group(world: int) -> Any:
    return open_test_cluster(world, token=TOKEN, config=CFG, soon=SOON)



async def test_bad_arguments_are_refused_before_the_vote_and_alone_is_too_few_peers() -> None:
    async with _group(1) as (master, comms, _):
        x = np.arange(6, dtype=np.float32)
        for call in (lambda: comms[0].broadcast(x, root=comms[0].peer_id), lambda: comms[0].all_gather(x),
                     lambda: comms[0].reduce_scatter(x)):
            with pytest.raises(TooFewPeers):
                await call()
        assert np.array_equal(x, np.arange(6, dtype=np.float32))
        read_only = np.ones(4, np.float32)
        read_only.flags.writeable = False
        bad = [
            lambda: comms[0].broadcast(x, root=-1),
            lambda: comms[0].broadcast(x, root="a"),
            lambda: comms[0].broadcast(read_only, root=1),
            lambda: comms[0].broadcast(x, root=1, tag=-3),
            lambda: comms[0].all_gather(np.ones(3, np.complex64)),
            lambda: comms[0].all_gather(np.ones(3, np.int32), quantization=Quantization()),
            lambda: comms[0].all_gather([1, 2]),
            lambda: comms[0].reduce_scatter(x, op=42),
            lambda: comms[0].reduce_scatter(read_only),
            lambda: comms[0].reduce_scatter(np.ones((4, 2), np.float32)[:, 0]),
        ]
        for call in bad:
            with pytest.raises(InvalidArgument):
                await call()
        assert pccl.testing.master_snapshot(master).ops == ()


@pytest.mark.parametrize("case", ["kind", "dtype", "op", "quantization", "bits", "block", "root", "count"])
async def test_disagreement_on_a_tag_is_invalid_usage_on_every_peer_naming_both_sides(case: str) -> None:
    async with _group(2) as (master, comms, _):
        ids = [c.peer_id for c in comms]

        async def call(i: int, comm: pccl.Communicator) -> Any:
            x = np.arange(10, dtype=np.float64 if case == "dtype" and i else np.float32)
            if case == "count" and i:
                x = np.arange(11, dtype=np.float32)
            if case == "kind":
                return await (comm.all_gather(x, tag=5) if i else comm.reduce_scatter(x, tag=5))
            if case == "op":
                return await comm.reduce_scatter(x, op=ReduceOp.MAX if i else ReduceOp.SUM, tag=5)
            if case == "quantization":
                return await comm.all_gather(x, tag=5, quantization=Quantization(dtype=np.uint8) if i else None)
            if case == "bits":  # 4 bits against 8: both travel in uint8 bytes, yet they differ
                return await comm.all_reduce(x, tag=5, quantization=Quantization(dtype="uint4" if i else np.uint8))
            if case == "block":
                return await comm.reduce_scatter(x, tag=5, quantization=Quantization(dtype="uint4", block=128 if i else None))
            root = ids[i] if case == "root" else ids[0]
            return await comm.broadcast(x, root=root, tag=5)

        before = [np.arange(10, dtype=np.float32)]
        outcome = await each(comms, call)
        assert all(isinstance(o, InvalidUsage) for o in outcome), outcome
        text = str(outcome[0])
        assert f"peer {ids[0]:x}" in text and f"peer {ids[1]:x}" in text, text
        shown = {"kind": ("all_gather", "reduce_scatter"), "dtype": ("float32", "float64"), "op": ("op=sum", "op=max"),
                 "quantization": ("quant=none", "quant=min_max/uint8"),
                 "bits": ("quant=min_max/uint8 layout", "quant=min_max/uint4 layout"),
                 "block": ("count=10 dtype=float32 op=sum quant=min_max/uint4", "quant=min_max/uint4 block=128"),
                 "root": (f"root={ids[0]:x}", f"root={ids[1]:x}"),
                 "count": ("count=10", "count=11")}[case]
        assert all(s in text for s in shown), text
        if case == "block":
            assert text.count("block=") == 1, text  # one side names a block, the other none
        assert before  # the tag is free again: the same call, agreed, runs
        x = np.arange(4, dtype=np.float32) * (1 + np.arange(2)[:, None])
        got = await each(comms, lambda i, c: c.all_gather(x[i], tag=5))
        assert all(isinstance(g, pccl.Gathered) for g in got), got


async def test_a_root_that_is_not_a_member_ends_the_broadcast_on_every_peer_naming_it() -> None:
    async with _group(2) as (master, comms, _):
        stranger = max(c.peer_id for c in comms) + 12345
        bufs = [np.full(8, float(i), np.float32) for i in range(2)]
        outcome = await each(comms, lambda i, c: c.broadcast(bufs[i], root=stranger, tag=3))
        assert all(isinstance(o, CollectiveAborted) and f"root {stranger:x}" in str(o) for o in outcome), outcome
        assert all(np.all(bufs[i] == i) for i in range(2)), "nothing was written"
        root = comms[1].peer_id
        infos = await each(comms, lambda i, c: c.broadcast(bufs[i], root=root, tag=3))
        assert all(isinstance(info, pccl.CollectiveInfo) and info.peers == tuple(comms[0].ring) for info in infos)
        assert all(np.all(b == 1.0) for b in bufs)


async def test_cancelling_a_reduce_scatter_mid_ring_restores_the_input_everywhere() -> None:
    async with _group(3) as (master, comms, _):
        rng = np.random.default_rng(4)
        inputs = [rng.standard_normal(4_000_000).astype(np.float32) for _ in comms]
        bufs = [x.copy() for x in inputs]
        victim = trio.CancelScope()

        async def call(i: int, comm: pccl.Communicator) -> Any:
            if i == 0:
                with victim:
                    return await comm.reduce_scatter(bufs[i], tag=9)
                return "cancelled"
            return await comm.reduce_scatter(bufs[i], tag=9)

        async def cancel_mid_ring() -> None:
            while comms[0].statistics().rx_bytes == 0 and not any(
                    np.any(b[:100] != x[:100]) for b, x in zip(bufs, inputs)):
                await trio.sleep(0.0005)
            victim.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel_mid_ring)
            outcome = await each(comms, call)
            nursery.cancel_scope.cancel()
        assert outcome[0] == "cancelled" or isinstance(outcome[0], pccl.Shard), outcome
        if outcome[0] == "cancelled":
            assert all(isinstance(o, CollectiveAborted) for o in outcome[1:]), outcome
            assert all(np.array_equal(b, x) for b, x in zip(bufs, inputs)), "every x holds its input again"
        # The tag is free and the group goes on (re-wired after the abort).
        bufs = [x.copy() for x in inputs]
        shards = await each(comms, lambda i, c: c.reduce_scatter(bufs[i], tag=9))
        exact = np.sum(np.stack([x.astype(np.float64) for x in inputs]), axis=0)
        for b, s in zip(bufs, shards):
            assert isinstance(s, pccl.Shard), shards
            assert np.allclose(b[s.start:s.stop], exact[s.start:s.stop], rtol=1e-4, atol=1e-4)


async def test_a_peer_that_cannot_back_its_input_up_aborts_the_op_at_once() -> None:
    """A peer whose input backup fails once the op commenced (a MemoryError) reports the abort
    itself: the others' calls end with the master's abort, not after their watchdogs'
    ``peer_timeout`` (a minute here; the test's bound is a hang guard), and every input is
    intact."""
    config = Config(peer_timeout=60.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
                    shared_state_base_port=0)
    async with open_test_cluster(3, token=TOKEN, config=config, soon=SOON) as (master, comms, _):
        inputs = [np.full(1_000_000, float(i + 1), np.float32) for i in range(3)]
        bufs = [x.copy() for x in inputs]
        failures = iter([MemoryError("no room for the backup (planted)")])

        async def call(i: int, comm: pccl.Communicator) -> Any:
            try:
                return await comm.all_reduce(bufs[i], tag=5)
            except MemoryError as exc:
                return exc

        with plant_backup_fault(lambda: next(failures, None)):
            outcome = await each(comms, call, within=30)
        assert sum(isinstance(o, MemoryError) for o in outcome) == 1, outcome
        assert all(isinstance(o, (MemoryError, CollectiveAborted)) for o in outcome), outcome
        assert all(np.array_equal(b, x) for b, x in zip(bufs, inputs)), "every input is intact"
        # The tag is free and the group goes on.
        infos = await each(comms, lambda i, c: c.all_reduce(bufs[i], tag=5))
        assert all(isinstance(info, pccl.ReduceInfo) for info in infos), infos
        assert all(np.all(b == 6.0) for b in bufs)


async def test_torch_tensors_go_in_and_come_out_as_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    async with _group(2) as (master, comms, _):
        xs = [torch.arange(3 + i, dtype=torch.bfloat16) + 10 * i for i in range(2)]
        got = await each(comms, lambda i, c: c.all_gather(xs[i]))
        assert all(isinstance(g, pccl.Gathered) for g in got), got  # (an error, shown as it is)
        order = [next(i for i, c in enumerate(comms) if c.peer_id == pid) for pid in got[0].peers]
        for g in got:
            assert isinstance(g, pccl.Gathered) and isinstance(g.buffer, torch.Tensor), g
            assert all(isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 for a in g.arrays)
            assert all(torch.equal(a, xs[j]) for a, j in zip(g.arrays, order))
        ys = [torch.full((5,), float(i + 1)) for i in range(2)]
        shards = await each(comms, lambda i, c: c.reduce_scatter(ys[i], op=ReduceOp.AVG))
        for y, s in zip(ys, shards):
            assert torch.all(y[s.start:s.stop] == 1.5)


def test_the_blocking_twins_and_their_handles() -> None:
    import threading

    async def serve(ready: Any, stop: trio.Event) -> None:
        async with pccl.open_master("127.0.0.1:0", token=TOKEN, config=CFG) as master:
            ready.append(master.address)
            await stop.wait()

    address: list[str] = []
    stop_holder: list[Any] = []

    def master_thread() -> None:
        async def main() -> None:
            stop = trio.Event()
            stop_holder.append((trio.lowlevel.current_trio_token(), stop))
            await serve(address, stop)
        trio.run(main)

    thread = threading.Thread(target=master_thread, daemon=True)
    thread.start()
    while not address:
        threading.Event().wait(0.01)
    results: dict[int, Any] = {}

    def peer(i: int) -> None:
        with pccl.blocking.open_communicator(address[0], token=TOKEN, config=CFG) as comm:
            while comm.world_size < 2:
                if comm.are_peers_pending():
                    comm.update_topology()
                else:
                    threading.Event().wait(0.02)
            x = np.full(6, float(i), np.float32)
            root = min(comm.ring)
            info = comm.broadcast(x, root=root)
            handle = comm.all_gather_async(np.arange(i + 1, dtype=np.int64))
            gathered = handle.wait(timeout=SOON)
            assert handle.done()
            y = np.full(5, float(i + 1), np.float32)
            shard = comm.reduce_scatter_async(y, op=ReduceOp.SUM).wait(timeout=SOON)
            results[i] = (comm.peer_id, root, info, x.copy(), gathered, shard, y.copy())

    threads = [threading.Thread(target=peer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SOON * 2)
    token, stop = stop_holder[0]
    token.run_sync_soon(stop.set)
    thread.join(SOON)
    assert len(results) == 2
    values = {pid: i for i, (pid, *_rest) in results.items()}
    for i, (pid, root, info, x, gathered, shard, y) in results.items():
        assert isinstance(info, pccl.CollectiveInfo) and np.all(x == values[root])
        assert [a.tolist() for a in gathered.arrays] == [list(range(values[p] + 1)) for p in gathered.peers]
        assert isinstance(shard, pccl.Shard) and np.all(y[shard.start:shard.stop] == 3.0)
