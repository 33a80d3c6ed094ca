"""The scratch arena hands out the smallest retained buffer that fits (at most twice the size
asked for), the oldest of equal ones, and keeps at most ``retain_bytes``: a buffer given to a full
arena evicts the oldest kept ones until it fits."""

from __future__ import annotations

import random

import numpy as np

from pccl.collectives.buffers import ScratchArena


class _LinearArena:
    """The rule written as a scan over every free buffer (the model the arena must follow)."""

    def __init__(self, retain_bytes: int) -> None:
        self.retain_bytes = retain_bytes
        self.free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray | None:
        nbytes = max(nbytes, 1)
        best = None
        for i, buf in enumerate(self.free):
            if nbytes <= buf.size <= 2 * nbytes and (best is None or buf.size < self.free[best].size):
                best = i
        return None if best is None else self.free.pop(best)

    def give(self, buffer: np.ndarray) -> None:
        if buffer.size > self.retain_bytes:
            return
        while sum(b.size for b in self.free) + buffer.size > self.retain_bytes:
            self.free.pop(0)  # the oldest given
        self.free.append(buffer)


def test_take_and_give_follow_the_linear_rule() -> None:
    rng = random.Random(7)
    arena = ScratchArena(retain_bytes=40_000)
    model = _LinearArena(retain_bytes=40_000)
    held: list[np.ndarray] = []
    for _ in range(3000):
        if held and rng.random() < 0.5:
            buffer = held.pop(rng.randrange(len(held)))
            arena.give(buffer)
            model.give(buffer)
        else:
            nbytes = rng.choice([0, 1, 7, 100, 130, 200, 256, 1000, 1500, 4096])
            expected = model.take(nbytes)
            got = arena.take(nbytes)
            if expected is None:
                assert got.size == max(nbytes, 1) and all(got is not b for b in model.free)
            else:
                assert got is expected
            held.append(got)
        assert arena.retained_bytes == sum(b.size for b in model.free) <= 40_000


def test_equal_sizes_come_back_oldest_first_and_the_limit_holds() -> None:
    arena = ScratchArena(retain_bytes=300)
    first, second, third = (np.empty(100, np.uint8) for _ in range(3))
    for buffer in (first, second, third):
        arena.give(buffer)
    assert arena.retained_bytes == 300
    assert arena.take(60) is first and arena.take(100) is second
    assert arena.take(49).size == 49  # 100 is more than twice 49: a fresh buffer
    assert arena.retained_bytes == 100
    arena.give(np.empty(301, np.uint8))  # larger than the whole limit: not kept, nothing evicted
    assert arena.retained_bytes == 100


def test_a_full_arena_makes_room_for_the_sizes_in_use_now() -> None:
    """A loop whose sizes changed (another model, other buckets) must not allocate on every
    call because the arena is full of sizes nobody takes any more."""
    arena = ScratchArena(retain_bytes=300)
    old = [np.empty(100, np.uint8) for _ in range(3)]
    for buffer in old:
        arena.give(buffer)
    new = np.empty(201, np.uint8)
    arena.give(new)  # evicts the three oldest 100-byte buffers (two would leave 301)
    assert arena.retained_bytes == 201
    assert arena.take(150) is new  # warm: no fresh allocation for the size in use
    arena.give(new)
    arena.give(old[0])  # 301 > 300: the oldest kept, ``new``, makes room
    assert arena.take(150).size == 150 and arena.retained_bytes == 100
