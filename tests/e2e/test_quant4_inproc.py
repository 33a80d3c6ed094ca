"""4-bit and blockwise MIN_MAX quantization through real communicators (Trio tasks in this
process, real TCP): every collective ends bit-identical on every peer, the wire carries at most
0.15x the bytes of float32, ``all_reduce_many``'s buckets quantize too, and two peers that ask
for different quantization on a tag get InvalidUsage."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
import trio

import pccl
from pccl import Config, InvalidUsage, Quantization, ReduceOp
from pccl.testing import each, open_test_cluster

TOKEN = "quant4-inproc"
CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0)
SOON = 30.0
Q4 = Quantization(dtype="uint4", block=128)



def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def _inputs(world: int, n: int, dtype: Any, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * (1 + p)).astype(dtype) for p in range(world)]


@pytest.mark.parametrize("world", [2, 3])
async def test_every_collective_is_bit_identical_at_four_bits(world: int) -> None:
    async with open_test_cluster(world, token=TOKEN, config=CFG, soon=SOON) as (_, comms, _):
        ids = [c.peer_id for c in comms]
        for dtype in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
            for quant in (Q4, Quantization(dtype="uint4"), Quantization(dtype=np.uint16, block=257)):
                xs = _inputs(world, 10_001, dtype, seed=world)  # odd: a frame ends mid-byte
                got = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=1, op=ReduceOp.AVG, quantization=quant))
                assert all(isinstance(g, pccl.ReduceInfo) for g in got), got
                assert len({_bits(x) for x in xs}) == 1, (dtype, quant)
                exact = np.mean([x.astype(np.float64) for x in _inputs(world, 10_001, dtype, seed=world)], axis=0)
                bound = _bound(_inputs(world, 10_001, dtype, seed=world), quant, world, exact * world) / world
                assert np.all(np.abs(xs[0].astype(np.float64) - exact) <= bound)

                ys = _inputs(world, 5_003, dtype, seed=7)
                got = await each(comms, lambda i, c: c.broadcast(ys[i], root=ids[1], tag=2, quantization=quant))
                assert all(isinstance(g, pccl.CollectiveInfo) for g in got), got
                assert len({_bits(y) for y in ys}) == 1  # the root's own buffer included

                zs = [z[: 3001 + 17 * i] for i, z in enumerate(_inputs(world, 4000, dtype, seed=8))]
                gathered = await each(comms, lambda i, c: c.all_gather(zs[i], tag=3, quantization=quant))
                assert len({_bits(g.buffer) for g in gathered}) == 1

                ws = _inputs(world, 6_007, dtype, seed=9)
                shards = await each(comms, lambda i, c: c.reduce_scatter(ws[i], tag=4, quantization=quant))
                exact = np.sum([w.astype(np.float64) for w in _inputs(world, 6_007, dtype, seed=9)], axis=0)
                assert sorted(s.index for s in shards) == list(range(world))
                for s, w in zip(shards, ws):
                    err = np.abs(w[s.start : s.stop].astype(np.float64) - exact[s.start : s.stop])
                    assert np.all(err <= _bound(_inputs(world, 6_007, dtype, seed=9), quant, world, exact)[s.start : s.stop])


def _bound(inputs: list[np.ndarray], quant: Quantization, hops: int, exact: np.ndarray) -> np.ndarray:
    """The documented end-to-end bound with every block's range taken as the whole input's (an
    upper bound), plus the final rounding of 16-bit floats."""
    r = sum(float(np.ptp(x.astype(np.float64))) for x in inputs)
    qmax = 2**quant.bits - 1
    half = 2.0**-8 if inputs[0].dtype.itemsize == 2 else 0.0
    return r / 2 * ((1 + 1 / qmax) ** hops - 1) + 1e-4 + half * np.abs(exact)


async def test_four_bit_blockwise_all_reduce_sends_at_most_015x_of_float32() -> None:
    n = 1 << 20  # 4 MiB of float32: the ring (not the small-op exchange) either way
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (_, comms, _):
        plain = await each(comms, lambda i, c: c.all_reduce(np.ones(n, np.float32) * i, tag=1))
        xs = _inputs(2, n, np.float32, seed=1)
        quantized = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=1, quantization=Q4))
        for p, q in zip(plain, quantized):
            assert p.tx_bytes >= 4 * n // 2  # half the buffer each way, as float32
            assert q.tx_bytes <= 0.15 * p.tx_bytes, (q.tx_bytes, p.tx_bytes)
            assert q.rx_bytes <= 0.15 * p.rx_bytes


async def test_all_reduce_many_quantizes_its_buckets_at_four_bits() -> None:
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (_, comms, _):
        # Small arrays packed into a bucket, and two of 1 MiB or more reduced in place over both.
        arrays = [_inputs(2, n, np.float32, seed=n) for n in (1, 300, 262_145, 5, 300_001)]
        mine = [[a[i].copy() for a in arrays] for i in range(2)]
        got = await each(comms, lambda i, c: c.all_reduce_many(mine[i], quantization=Q4, bucket_bytes=4 << 20))
        assert all(not isinstance(g, Exception) for g in got), got
        # A packed bucket's blocks span its arrays: bound by the range of everything a peer sent.
        r = sum(float(np.ptp(np.concatenate([a[p] for a in arrays]))) for p in range(2))
        bound = r / 2 * ((1 + 1 / 15) ** 2 - 1) + 1e-5  # the documented end-to-end bound, 2 peers
        for a, b, pair in zip(mine[0], mine[1], arrays):
            assert _bits(a) == _bits(b)
            assert np.abs(a - (pair[0] + pair[1])).max() <= bound
        assert not any(np.array_equal(a, p[0]) for a, p in zip(mine[0], arrays) if a.size > 1)


@pytest.mark.parametrize("theirs", [Quantization(dtype=np.uint8), Quantization(dtype="uint4", block=256)],
                         ids=["8-bit", "other-block"])
async def test_mismatched_quantization_is_invalid_usage_on_every_peer(theirs: Quantization) -> None:
    async with open_test_cluster(2, token=TOKEN, config=CFG, soon=SOON) as (_, comms, _):
        xs = _inputs(2, 1000, np.float32, seed=3)
        before = [x.copy() for x in xs]
        got = await each(comms, lambda i, c: c.all_reduce(xs[i], tag=9, quantization=Q4 if i else theirs))
        assert all(isinstance(g, InvalidUsage) for g in got), got
        assert "quant=min_max/uint4 block=128" in str(got[0]) and "disagree" in str(got[0])
        assert all(np.array_equal(x, b) for x, b in zip(xs, before))
