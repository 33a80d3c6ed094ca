"""InputBackup: the in-place all-reduce's save-before-overwrite, fused into the reduce-scatter.

The fused path (:meth:`InputBackup.overwrite` with ``kernels.reduce_into_saving``) must keep the
invariants of the plain one: every slice saved exactly once before its first write, a restore
that gives back the input bit for bit, and a concurrent :meth:`InputBackup.save` of a slice that
waits for the fused copy instead of copying the half-reduced bytes.  InputGuard, which owns the
backup (or stages a small op's result instead), restores, commits and drops it.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import trio
from test_allreduce_ring import make_inputs, ring_reference

from pccl.testing import memory_ring

from pccl import kernels as K
from pccl.collectives import InputBackup, InputGuard, ReduceArgs, ring_all_reduce
from pccl.collectives.buffers import ScratchArena
from pccl.types import Quantization, QuantKind, ReduceOp


def test_overwrite_saves_in_the_kernel_once_then_runs_the_plain_kernel() -> None:
    buf = np.arange(10, dtype=np.float32)
    original = buf.copy()
    backup = InputBackup(buf, arena=ScratchArena())
    calls: list[str] = []
    wire = np.full(4, 100, np.float32)

    def fused(saved: np.ndarray) -> None:
        calls.append("fused")
        K.reduce_into_saving(buf[2:6], wire, saved)

    def plain() -> None:
        calls.append("plain")
        K.reduce_into(buf[2:6], wire)

    backup.overwrite(2, 6, fused, plain)
    backup.overwrite(2, 6, fused, plain)  # already saved: no second copy
    backup.save(2, 6)  # a no-op too: the copy must still be the original
    assert calls == ["fused", "plain"]
    assert backup.is_saved(2) and backup.saved_elements == 4
    np.testing.assert_array_equal(buf[2:6], original[2:6] + 200)
    backup.restore()
    np.testing.assert_array_equal(buf, original)


def test_a_failed_fused_kernel_leaves_the_slice_unsaved() -> None:
    buf = np.arange(8, dtype=np.int32)
    backup = InputBackup(buf, arena=ScratchArena())

    def fused(saved: np.ndarray) -> None:  # rejects its arguments before writing anything
        K.reduce_into_saving(buf[0:4], np.zeros(3, np.int32), saved)

    with pytest.raises(ValueError, match="4 elements but src has 3"):
        backup.overwrite(0, 4, fused, lambda: None)
    assert not backup.is_saved(0) and backup.saved_elements == 0
    backup.save(0, 4)  # the slice can still be saved normally
    assert backup.saved_elements == 4


def test_a_concurrent_save_waits_for_the_fused_copy() -> None:
    buf = np.arange(1000, dtype=np.float64)
    original = buf.copy()
    backup = InputBackup(buf, arena=ScratchArena())
    inside = threading.Event()
    release = threading.Event()

    def fused(saved: np.ndarray) -> None:
        inside.set()
        assert release.wait(10)
        K.reduce_into_saving(buf[0:500], np.ones(500), saved)

    worker = threading.Thread(target=backup.overwrite, args=(0, 500, fused, lambda: None))
    worker.start()
    assert inside.wait(10)
    saver = threading.Thread(target=backup.save, args=(0, 500))
    saver.start()
    saver.join(0.05)
    assert saver.is_alive()  # blocked on the slice being copied by the fused kernel
    release.set()
    worker.join(10)
    saver.join(10)
    assert not saver.is_alive()
    assert backup.saved_elements == 500  # saved once, by the fused kernel
    backup.restore()
    np.testing.assert_array_equal(buf, original)


@pytest.mark.parametrize("quantized", [False, True])
async def test_in_place_ring_saves_reduce_scatter_slices_in_the_reduction(
        monkeypatch: pytest.MonkeyPatch, quantized: bool) -> None:
    # Every slice is saved once; those first overwritten by a reduce-scatter reduction (all but
    # the chunk this peer sends at step 0) are saved by the fused kernel, not by a copy pass.
    world, n = 3, 9_000
    fused_elements = [0]
    copied_elements = [0]
    real_rs, real_dq, real_save = K.reduce_into_saving, K.dequantize_reduce_saving, InputBackup.save

    def counting_rs(dst: np.ndarray, src: np.ndarray, backup: np.ndarray, op: ReduceOp) -> None:
        fused_elements[0] += dst.size
        real_rs(dst, src, backup, op)

    def counting_dq(acc: np.ndarray, q: np.ndarray, params: K.QuantParams, backup: np.ndarray, op: ReduceOp) -> None:
        fused_elements[0] += acc.size
        real_dq(acc, q, params, backup, op)

    def counting_save(self: InputBackup, start: int, stop: int) -> None:
        if not self.is_saved(start):
            copied_elements[0] += stop - start
        real_save(self, start, stop)

    monkeypatch.setattr(K, "reduce_into_saving", counting_rs)
    monkeypatch.setattr(K, "dequantize_reduce_saving", counting_dq)
    monkeypatch.setattr(InputBackup, "save", counting_save)
    links, _ = memory_ring(world)
    inputs = make_inputs(world, n, np.float32, ReduceOp.SUM, seed=3)
    bufs = [x.copy() for x in inputs]
    backups = [InputBackup(b) for b in bufs]
    quant = Quantization(QuantKind.MIN_MAX, np.uint16) if quantized else None

    async def peer(r: int) -> None:
        await ring_all_reduce(bufs[r], op=ReduceOp.SUM, links=links[r], rank=r, world=world, seq=5,
                              quantization=quant, backup=backups[r], max_subchunk_bytes=4096,
                              exchange_max_bytes=0)  # the ring, not the exchange of small ops

    async with trio.open_nursery() as nursery:
        for r in range(world):
            nursery.start_soon(peer, r)
    if not quantized:
        np.testing.assert_array_equal(bufs[0], ring_reference(inputs, ReduceOp.SUM, exchange_max_bytes=0))
    assert fused_elements[0] == world * n * (world - 1) // world
    assert copied_elements[0] == world * n // world
    for r in range(world):
        assert backups[r].saved_elements == n
        backups[r].restore()
        np.testing.assert_array_equal(bufs[r], inputs[r])


def test_staged_args_keep_every_argument_but_the_output() -> None:
    # ReduceArgs.into builds the staged op's arguments field by field: none may be lost.
    buf = np.linspace(-1, 1, 64, dtype=np.float32)
    args = ReduceArgs.check(buf, None, ReduceOp.MAX, Quantization(QuantKind.MIN_MAX, "uint8"))
    out = np.empty_like(buf)
    assert args.into(out) == dataclasses.replace(args, dst=out, in_place=False)


def test_guard_stages_a_small_in_place_op_and_backs_up_the_others() -> None:
    # Staged: the ring writes scratch memory, the caller's array only on commit.
    arena = ScratchArena()
    buf = np.arange(6, dtype=np.float32)
    guard = InputGuard(ReduceArgs.check(buf, None, ReduceOp.SUM, None), stage_up_to=buf.nbytes, arena=arena)
    assert guard.backup is None and not guard.args.in_place and not np.shares_memory(guard.args.dst, buf)
    guard.args.dst[...] = 7
    guard.restore()  # nothing to undo
    assert np.array_equal(buf, np.arange(6))
    guard.commit()
    assert np.all(buf == 7)
    guard.drop()
    assert arena.retained_bytes >= buf.nbytes
    # Larger than stage_up_to (or segmented): the ring writes the caller's buffer, saving it first.
    buf = np.arange(6, dtype=np.float32)
    guard = InputGuard(ReduceArgs.check(buf, None, ReduceOp.SUM, None), stage_up_to=buf.nbytes - 1, arena=arena)
    assert guard.backup is not None and np.shares_memory(guard.args.dst, buf)
    guard.backup.save(0, 6)
    buf[...] = 7
    guard.commit()  # the result is there already
    assert np.all(buf == 7)
    guard.restore()
    assert np.array_equal(buf, np.arange(6))
    guard.drop()
    # Out of place: nothing is kept.
    recv = np.zeros(6, np.float32)
    guard = InputGuard(ReduceArgs.check(buf, recv, ReduceOp.SUM, None), stage_up_to=1 << 20)
    assert guard.backup is None and np.shares_memory(guard.args.dst, recv)
    guard.drop()
