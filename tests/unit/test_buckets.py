"""all_reduce_many's bucket plan: which arrays share an op, and packing round trips."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from pccl.collectives.buckets import plan_buckets
from pccl.collectives.buffers import ScratchArena


def _members(buckets) -> list[list[int]]:  # noqa: ANN001
    return [b.indices for b in buckets]


def test_small_same_dtype_arrays_share_buckets_up_to_the_cap_and_large_ones_go_alone() -> None:
    f32 = [np.zeros(n, np.float32) for n in (10, 20, 1000, 30, 5)]  # 40, 80, 4000, 120, 20 bytes
    i64 = np.zeros(4, np.int64)  # 32 bytes: another dtype, another bucket
    arrays = [f32[0], i64, f32[1], f32[2], f32[3], f32[4]]
    assert _members(plan_buckets(arrays, 300)) == [[0, 2, 4, 5], [1], [3]]
    assert _members(plan_buckets(arrays, 200)) == [[0, 2], [1], [3], [4, 5]]
    assert _members(plan_buckets(arrays, 130)) == [[0, 2], [1], [3], [4], [5]]
    assert _members(plan_buckets(arrays, 0)) == [[0], [1], [2], [3], [4], [5]]
    # the same list always gives the same plan (every peer forms the same buckets)
    assert _members(plan_buckets(arrays, 130)) == _members(plan_buckets(list(arrays), 130))


def test_a_packed_bucket_round_trips_and_only_unpack_writes_the_members() -> None:
    arena = ScratchArena()
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.float32) + 10]
    originals = [a.copy() for a in arrays]
    (bucket,) = plan_buckets(arrays, 1 << 20)
    send, recv = bucket.buffers(arena)
    assert recv is not None and not np.shares_memory(send, recv)
    np.testing.assert_array_equal(send, np.concatenate([a.reshape(-1) for a in originals]))
    recv[...] = send * 2  # what an op would write
    for a, o in zip(arrays, originals):  # an aborted op: the members are untouched
        np.testing.assert_array_equal(a, o)
    bucket.unpack(recv)
    for a, o in zip(arrays, originals):
        np.testing.assert_array_equal(a, o * 2)
    bucket.release(arena)
    assert arena.retained_bytes >= 2 * bucket.nbytes


def test_a_lone_array_is_reduced_in_place_without_scratch() -> None:
    x = np.zeros(3, ml_dtypes.bfloat16)
    (bucket,) = plan_buckets([x], 1 << 20)
    send, recv = bucket.buffers(ScratchArena())
    assert send is x and recv is None
