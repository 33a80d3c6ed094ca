"""CPU torch tensors wherever pccl takes an array: all_reduce, all_reduce_many, SharedState.

Peers are Trio tasks in this process on real TCP.  Every dtype pccl supports, in place and out of
place; results land in the tensors' own memory (the data pointer does not move and holds the
result), no buffer of the tensor's size is allocated on the call path once the scratch arena is
warm, and tensors pccl cannot use without a copy are refused with a message that says what to do.
"""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import trio

torch = pytest.importorskip("torch")  # the test extra pins it; a base install has no torch

import pccl  # noqa: E402
from pccl import Config, InvalidArgument, ReduceOp  # noqa: E402
from pccl.testing import open_test_cluster  # noqa: E402

CFG = Config(peer_timeout=5.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
SOON = 30.0

DTYPES = [torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32, torch.int32, torch.uint64, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _numpy(t: object) -> np.ndarray:
    """The tensor's values as numpy (bf16 as ml_dtypes.bfloat16), copied, for reference sums."""
    assert isinstance(t, torch.Tensor)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _inputs(dtype: object, world: int, n: int) -> list[object]:
    # Small integers: exact in every dtype (bf16 included) and no overflow in a sum of three.
    return [torch.arange(n, dtype=torch.int64).remainder(7).add(i + 1).to(dtype).reshape(2, n // 2)
            for i in range(world)]


async def _each(comms: list[pccl.Communicator], fn) -> list[object]:
    out: list[object] = [None] * len(comms)

    async def one(i: int) -> None:
        out[i] = await fn(i, comms[i])

    with trio.fail_after(SOON):
        async with trio.open_nursery() as nursery:
            for i in range(len(comms)):
                nursery.start_soon(one, i)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
async def test_every_dtype_in_place_and_out_of_place(dtype: object) -> None:
    world, n = 3, 1000
    async with open_test_cluster(world, token=None, config=CFG, soon=SOON) as (_, comms, _):
        tensors = _inputs(dtype, world, n)
        expect = sum(_numpy(t).astype(np.float64) for t in tensors)
        pointers = [t.data_ptr() for t in tensors]
        outs = [torch.full_like(t, 99) for t in tensors]
        out_pointers = [o.data_ptr() for o in outs]
        # out of place first: the inputs must stay as they are
        infos = await _each(comms, lambda i, c: c.all_reduce(tensors[i], outs[i], op=ReduceOp.SUM, tag=1))
        for t, o, p, op_ in zip(tensors, outs, pointers, out_pointers):
            assert o.data_ptr() == op_ and t.data_ptr() == p
            assert o.dtype == dtype and o.shape == (2, n // 2)
            np.testing.assert_array_equal(_numpy(o).astype(np.float64), expect)
        assert all(info.world_size == world for info in infos)
        originals = [_numpy(t) for t in tensors]
        for t, original in zip(tensors, originals):
            np.testing.assert_array_equal(_numpy(t), original)
        # in place: the result lands in each tensor's own memory
        await _each(comms, lambda i, c: c.all_reduce(tensors[i], op=ReduceOp.SUM, tag=2))
        for t, p in zip(tensors, pointers):
            assert t.data_ptr() == p
            np.testing.assert_array_equal(_numpy(t).astype(np.float64), expect)


async def test_all_reduce_many_with_mixed_torch_and_numpy() -> None:
    async with open_test_cluster(2, token=None, config=CFG, soon=SOON) as (_, comms, _):
        lists = [[torch.full((3, 5), float(i + 1)), torch.full((7,), i + 1, dtype=torch.bfloat16),
                  np.full(11, i + 1, np.int32), torch.full((4,), i + 1, dtype=torch.float16)] for i in range(2)]
        pointers = [[a.data_ptr() for a in arrays if isinstance(a, torch.Tensor)] for arrays in lists]
        await _each(comms, lambda i, c: c.all_reduce_many(lists[i], op=ReduceOp.AVG))
        for arrays, ptrs in zip(lists, pointers):
            assert [a.data_ptr() for a in arrays if isinstance(a, torch.Tensor)] == ptrs
            for a in arrays:
                np.testing.assert_array_equal(_numpy(a) if isinstance(a, torch.Tensor) else a,
                                              np.full(a.shape, 1.5 if a.dtype != np.int32 else 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_zero_copy_no_allocation_of_the_tensor_size_once_warm(dtype: object) -> None:
    """In place, past the small-op staging threshold: the input backup comes from the scratch
    arena, warm after the first call, so the call itself allocates nothing of the tensor's size
    (tracemalloc sees every numpy allocation); the result is in the tensor's memory."""
    n = 1 << 20
    async with open_test_cluster(2, token=None, config=CFG, soon=SOON) as (_, comms, _):
        tensors = [torch.full((n,), float(i + 1), dtype=dtype) for i in range(2)]
        pointers = [t.data_ptr() for t in tensors]
        nbytes = tensors[0].numel() * tensors[0].element_size()
        await _each(comms, lambda i, c: c.all_reduce(tensors[i], op=ReduceOp.SUM))  # warms the arena
        for t in tensors:
            t.fill_(1.0)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            await _each(comms, lambda i, c: c.all_reduce(tensors[i], op=ReduceOp.SUM))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak - before < nbytes // 4, f"the call allocated {peak - before} bytes for a {nbytes}-byte tensor"
        for t, p in zip(tensors, pointers):
            assert t.data_ptr() == p
            assert bool((t == 2.0).all())


@pytest.mark.parametrize("segmented", [True, False], ids=["segmented", "packed"])
async def test_all_reduce_many_of_large_tensors_copies_nothing_once_warm(segmented: bool,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors of at least SEGMENTED_MIN_BYTES share a bucket reduced in place over the tensors
    themselves: once the arena is warm the call allocates nothing of the bucket's size
    (tracemalloc), and the only scratch of the bucket's size it takes is each peer's input
    backup.  Packed (the threshold raised), the same bucket takes two such buffers per peer
    (packed input and result) and copies every tensor in and out: the counts tell them apart."""
    from pccl.collectives import buckets
    from pccl.collectives.buffers import SCRATCH

    if not segmented:
        monkeypatch.setattr(buckets, "SEGMENTED_MIN_BYTES", 1 << 62)
    n = buckets.SEGMENTED_MIN_BYTES // 4 if segmented else 1 << 18
    shapes = [(n,), (2, n // 2 + 3), (n + 1,)]
    async with open_test_cluster(2, token=None, config=CFG, soon=SOON) as (_, comms, _):
        lists = [[torch.full(shape, float(i + 1)) for shape in shapes] for i in range(2)]
        nbytes = sum(t.numel() * 4 for t in lists[0])
        (bucket,) = buckets.plan_buckets([t.numpy() for t in lists[0]], buckets.DEFAULT_BUCKET_BYTES)
        assert bucket.segmented == segmented and bucket.packed != segmented
        await _each(comms, lambda i, c: c.all_reduce_many(lists[i]))  # warms the arena
        for ts in lists:
            for t in ts:
                t.fill_(1.0)
        taken: list[int] = []
        real_take = SCRATCH.take

        def counting_take(size: int) -> np.ndarray:
            taken.append(size)
            return real_take(size)

        monkeypatch.setattr(SCRATCH, "take", counting_take)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            await _each(comms, lambda i, c: c.all_reduce_many(lists[i]))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak - before < nbytes // 4, f"the call allocated {peak - before} bytes for a {nbytes}-byte bucket"
        assert len([size for size in taken if size >= nbytes]) == (2 if segmented else 4), taken
        for ts in lists:
            assert all(bool((t == 2.0).all()) for t in ts)


async def test_a_numpy_copy_would_be_seen() -> None:
    """The allocation check above has teeth: an all-reduce of a copy allocates the tensor's size."""
    n = 1 << 20
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        copy = np.ascontiguousarray(torch.ones(n).numpy()[::-1])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak - before >= copy.nbytes


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
async def test_shared_state_of_torch_tensors_every_dtype(dtype: object) -> None:
    async with open_test_cluster(2, token=None, config=CFG, soon=SOON) as (_, comms, _):
        owner = {"w": torch.arange(64).remainder(13).to(dtype).reshape(8, 8), "s": torch.ones(3, dtype=dtype)}
        joiner = {"w": torch.zeros(8, 8, dtype=dtype), "s": torch.zeros(3, dtype=dtype)}
        pointers = {k: t.data_ptr() for k, t in joiner.items()}
        states = [pccl.SharedState(owner, revision=5), pccl.SharedState(joiner, revision=0)]
        infos = await _each(comms, lambda i, c: c.sync_shared_state(states[i]))
        assert infos[1].rx_bytes == sum(t.numel() * t.element_size() for t in owner.values())
        for key in owner:
            assert joiner[key].data_ptr() == pointers[key]
            assert torch.equal(joiner[key], owner[key])
        assert states[1].revision == 5


def _refusals() -> list[tuple[object, str]]:
    grad = torch.ones(4, requires_grad=True)
    return [
        (torch.empty(4, device="meta"), r"on meta; .* pass \w+\.cpu\(\)"),
        (torch.ones(4, 4).t(), r"not contiguous: pass \w+\.contiguous\(\)"),
        (torch.ones(8)[::2], r"not contiguous"),
        (grad, r"requires grad; pass \w+\.detach\(\)"),
        (torch.ones(4, dtype=torch.bool), r"unsupported dtype bool"),
        (torch.ones(4, dtype=torch.complex64), r"unsupported dtype complex64"),
        ([1.0, 2.0], r"must be a numpy array or a CPU torch tensor, got list"),
    ]


@pytest.mark.parametrize("case", range(7))
async def test_unusable_tensors_are_refused_with_what_to_do(case: int) -> None:
    bad, pattern = _refusals()[case]
    async with open_test_cluster(1, token=None, config=CFG, soon=SOON) as (_, comms, _):
        comm = comms[0]
        with pytest.raises(InvalidArgument, match=pattern):
            await comm.all_reduce(bad)
        with pytest.raises(InvalidArgument, match=pattern):
            await comm.all_reduce(torch.ones(4) if case != 4 else torch.ones(4, dtype=torch.int8), bad)
        with pytest.raises(InvalidArgument, match=pattern):
            await comm.all_reduce_many([torch.ones(4), bad])
    with pytest.raises(InvalidArgument, match=pattern):
        pccl.SharedState({"w": bad})


def test_detached_parameters_share_memory_with_the_model() -> None:
    model = torch.nn.Linear(4, 3)
    state = pccl.SharedState({name: p.detach() for name, p in model.named_parameters()})
    state["weight"][...] = 7
    assert bool((model.weight == 7).all())
