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


def test_a_slice_saved_piece_by_piece_right_before_each_write_restores_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    # A receiver saves each piece of its slice right before writing it (the first frame a lane
    # receives in place); no piece is copied twice, nor one already written.
    buf = np.arange(100, dtype=np.float32)
    original = buf.copy()
    copies: list[int] = []
    real = K.save_copy

    def counted(dst: np.ndarray, src: np.ndarray) -> None:
        copies.append(src.nbytes // 4)
        real(dst, src)

    backup = InputBackup(buf, arena=ScratchArena())
    monkeypatch.setattr(K, "save_copy", counted)
    backup.save_upto(10, 50, 20)  # the receiver's first piece
    assert backup.is_begun(10) and not backup.is_saved(10)
    buf[10:20] = -1  # ... lands
    backup.save_upto(10, 50, 30)
    backup.save_upto(10, 50, 25)  # saved already: nothing to copy
    buf[20:30] = -2
    assert backup.saved_elements == 20
    backup.save(10, 50)  # a whole save finishes what is left (not what was written meanwhile)
    assert backup.is_saved(10) and backup.saved_elements == 40
    backup.save_upto(10, 50, 50)  # saved: nothing more to copy
    buf[30:50] = -3
    assert copies == [10, 10, 20]
    backup.restore()
    np.testing.assert_array_equal(buf, original)


def test_a_save_does_not_hold_the_lock_while_it_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    # A sender saving a slice ahead must not make the receiver wait to save (a piece of) another
    # slice: the copy runs outside the lock, only a save of the same slice waits for it.
    buf = np.arange(64, dtype=np.float32)
    original = buf.copy()
    backup = InputBackup(buf, arena=ScratchArena())
    real = K.save_copy
    copying, release = threading.Event(), threading.Event()

    def slow(dst: np.ndarray, src: np.ndarray) -> None:
        if src.nbytes == 32 * 4:  # the sender's whole slice [32, 64)
            copying.set()
            assert release.wait(10)
        real(dst, src)

    monkeypatch.setattr(K, "save_copy", slow)
    sender = threading.Thread(target=backup.save, args=(32, 64))
    sender.start()
    try:
        assert copying.wait(10)
        backup.save_upto(0, 32, 8)  # would wait for the sender's copy if the lock were held
        assert backup.is_begun(0) and not backup.is_saved(32)
    finally:
        release.set()
        sender.join(10)
    assert backup.is_saved(32)
    buf[:8] = 0
    buf[32:] = 0
    backup.restore()
    np.testing.assert_array_equal(buf, original)


def test_a_slice_begun_piece_by_piece_restores_what_was_saved_and_the_fused_kernel_takes_the_rest() -> None:
    buf = np.arange(64, dtype=np.float64)
    original = buf.copy()
    backup = InputBackup(buf, arena=ScratchArena())
    backup.save_upto(0, 32, 8)
    buf[0:8] = 0  # the receiver was torn after its first piece
    backup.save_upto(32, 64, 40)
    wire = np.ones(32)
    # A reduction overwriting a begun slice saves all of it in its own pass (nothing of it was
    # written yet by anyone else: whoever writes a begun slice saves each piece first).
    backup.overwrite(32, 64, lambda saved: K.reduce_into_saving(buf[32:64], wire, saved),
                     lambda: K.reduce_into(buf[32:64], wire))
    assert backup.is_saved(32) and backup.saved_elements == 8 + 32
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
