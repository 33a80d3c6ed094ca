"""ThreadTurns: how many large ops of one set of ring links run their lane threads at once,
and that they are admitted in commence order (pccl.collectives.turns)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pccl.collectives.links import SeqRegistry
from pccl.collectives.turns import ThreadTurns


class Ops:
    """Ops that take a turn, record when they got it, and hold it until told to finish."""

    def __init__(self, turns: ThreadTurns) -> None:
        self.turns = turns
        self.admitted: list[int] = []
        self.took: dict[int, bool] = {}
        self.finish: dict[int, trio.Event] = {}
        self.scopes: dict[int, trio.CancelScope] = {}
        self.cancelled: list[int] = []

    async def op(self, seq: int) -> None:
        self.finish[seq] = trio.Event()
        with trio.CancelScope() as self.scopes[seq]:
            took = await self.turns.take(seq)
            self.took[seq] = took
            self.admitted.append(seq)
            try:
                await self.finish[seq].wait()
            finally:
                if took:
                    self.turns.give_back(seq)
        if self.scopes[seq].cancelled_caught:
            self.cancelled.append(seq)


async def test_ops_are_admitted_in_commence_order_whatever_order_they_arrive_in() -> None:
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=2)
    ops = Ops(turns)
    for seq in range(1, 7):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        for seq in (6, 5, 4, 3):  # the later ops reach their data path first, with turns free
            nursery.start_soon(ops.op, seq)
            await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == []  # seqs 1 and 2 are still to come: nobody may run ahead of them
        nursery.start_soon(ops.op, 2)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == []
        nursery.start_soon(ops.op, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [1, 2] and turns.running == 2 and turns.waiting == 4
        ops.finish[2].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [1, 2, 3]
        for seq in (1, 3, 4, 5, 6):
            ops.finish[seq].set()
            await trio.testing.wait_all_tasks_blocked()
    assert ops.admitted == [1, 2, 3, 4, 5, 6]
    assert all(ops.took.values()) and turns.running == 0 and turns.waiting == 0


async def test_an_op_that_ends_or_takes_another_path_before_its_turn_holds_nobody_back() -> None:
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=2)
    ops = Ops(turns)
    for seq in (1, 2, 3):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.op, 3)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == []
        registry.retire(1)  # aborted before its data path (or never started here)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == []  # seq 2 is still to come
        registry.started(2)  # a small op: it runs inline, without a turn
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [3]
        ops.finish[3].set()


async def test_cancelling_an_op_while_it_waits_for_its_turn_passes_the_turn_on() -> None:
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1)
    ops = Ops(turns)
    for seq in (1, 2, 3):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        for seq in (1, 2, 3):
            nursery.start_soon(ops.op, seq)
            await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [1]
        ops.scopes[2].cancel()  # waiting behind op 1
        await trio.testing.wait_all_tasks_blocked()
        assert ops.cancelled == [2] and turns.waiting == 1
        ops.finish[1].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [1, 3]
        ops.finish[3].set()
    assert turns.running == 0


async def test_an_op_whose_seq_nobody_commenced_runs_at_once_without_a_turn() -> None:
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1)
    ops = Ops(turns)
    registry.commenced(1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.op, 7)  # the collectives called directly: no order is known
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [7] and ops.took == {7: False} and turns.running == 0
        ops.finish[7].set()


async def test_begun_ops_run_beside_each_other_past_the_slot_and_a_master_op_waits_for_them() -> None:
    # The partner links' turns (one slot): begun ops (derived seqs) run beside each other, since
    # two of them run on one peer at once only in a crossing, whose commence order differs
    # between peers (docs/protocol.rst, "Crossings"); an op the master commenced keeps the order.
    begun_x, begun_y, voted = (1 << 63) | 11, (1 << 63) | 22, 5
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1, beside=lambda seq: bool(seq >> 63))
    ops = Ops(turns)
    for seq in (begun_x, voted, begun_y):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        for seq in (begun_x, voted, begun_y):
            nursery.start_soon(ops.op, seq)
            await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x]  # the voted op comes next in commence order: it waits, so does Y
        ops.finish[begun_x].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, voted] and turns.running == 1
        ops.finish[voted].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, voted, begun_y]
        ops.finish[begun_y].set()
    assert turns.running == 0
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1, beside=lambda seq: bool(seq >> 63))
    ops = Ops(turns)
    for seq in (begun_x, begun_y, voted):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        for seq in (begun_x, begun_y, voted):
            nursery.start_soon(ops.op, seq)
            await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, begun_y] and turns.running == 2  # side by side
        ops.finish[begun_x].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, begun_y]  # the master's op waits for every begun one
        ops.finish[begun_y].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, begun_y, voted] and turns.running == 1
        ops.finish[voted].set()
    assert turns.running == 0 and turns.waiting == 0


def test_at_least_one_turn() -> None:
    with pytest.raises(ValueError):
        ThreadTurns(SeqRegistry(), slots=0)


def test_the_commence_order_forgets_the_seqs_that_left_it() -> None:
    registry = SeqRegistry()
    for seq in range(1, 1001):
        registry.commenced(seq)
    for seq in range(1000, 1, -1):
        registry.started(seq)
    assert registry.first_commenced() == 1
    registry.retire(1)
    assert registry.first_commenced() is None and not registry.is_commenced(1)
    registry.commenced(1)  # a retired seq is never commenced again
    assert registry.first_commenced() is None


async def test_turns_follow_the_order_of_commencing_not_the_seqs() -> None:
    # A begun op's derived seq (top bit set) is commenced here before the master's seq 1 of a
    # tag voted after it: every peer saw them in this order, so seq 1 waits for it.
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1)
    ops = Ops(turns)
    begun = 1 << 63 | 12345
    registry.commenced(begun)
    registry.commenced(1)
    assert registry.first_commenced() == begun
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ops.op, 1)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == []  # the begun op is still to come to its data path
        nursery.start_soon(ops.op, begun)
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun]
        ops.finish[begun].set()
        await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun, 1]
        ops.finish[1].set()


async def test_a_turn_taken_outside_the_order_and_given_back_with_a_begun_seq_leaves_beside_intact() -> None:
    # The partner links take a turn with try_take for an op outside the commence order and give
    # it back with the op's seq (links.py).  That turn was never admitted beside others, so its
    # return must not count as one: counted, the tally of ops beside went below zero and two
    # begun ops of a crossing no longer ran side by side (each waited for the watchdog).
    begun_x, begun_y, stray = (1 << 63) | 11, (1 << 63) | 22, (1 << 63) | 33
    registry = SeqRegistry()
    turns = ThreadTurns(registry, slots=1, beside=lambda seq: bool(seq >> 63))
    assert turns.try_take()
    turns.give_back(stray)
    assert turns.running == 0
    ops = Ops(turns)
    for seq in (begun_x, begun_y):
        registry.commenced(seq)
    async with trio.open_nursery() as nursery:
        for seq in (begun_x, begun_y):
            nursery.start_soon(ops.op, seq)
            await trio.testing.wait_all_tasks_blocked()
        assert ops.admitted == [begun_x, begun_y] and turns.running == 2  # side by side
        ops.finish[begun_x].set()
        ops.finish[begun_y].set()
    assert turns.running == 0 and turns.waiting == 0
