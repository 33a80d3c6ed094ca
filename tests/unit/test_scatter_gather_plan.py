"""pccl.protocol.scatter_gather: the scatter + all-gather broadcast's schedule, checked by playing
every peer's plan together for every world 2..40 and every root.

Every receive meets the matching send on the other end of the same partner link at the same step
(so each link's frames come in the order they are sent), a peer only sends blocks it holds and
never receives one it holds already, the root receives nothing, and at the end every peer holds
every block."""

from __future__ import annotations

import pytest

from pccl.protocol.algorithms import fold_partner, partner_positions, power_of_two_below
from pccl.protocol.scatter_gather import BlockMove, fold_out_step, scatter_all_gather_plan


def play(world: int, root: int) -> list[set[int]]:
    """Run every peer's plan step by step; returns what each peer holds at the end."""
    size = power_of_two_below(world)
    plans = [scatter_all_gather_plan(p, world, root) for p in range(world)]
    held: list[set[int]] = [set() for _ in range(world)]
    held[root] = set(range(size))
    last = fold_out_step(world)
    for p, plan in enumerate(plans):
        assert [m.step for m in plan] == sorted(m.step for m in plan), "in step order"
        assert all(0 <= m.step <= last and 0 <= m.first < m.stop <= size for m in plan), plan
        assert all(m.partner in partner_positions(p, world) for m in plan), "partner links only"
        for step in {m.step for m in plan}:
            at = [m for m in plan if m.step == step]
            assert len({m.partner for m in at}) == 1 and sorted(m.send for m in at) in ([False], [True], [False, True])
    for step in range(last + 1):
        sends = {(p, m.partner, m.first, m.stop) for p, plan in enumerate(plans) for m in plan
                 if m.step == step and m.send}
        receives = {(m.partner, p, m.first, m.stop) for p, plan in enumerate(plans) for m in plan
                    if m.step == step and not m.send}
        assert sends == receives, (world, root, step, sends ^ receives)
        for sender, receiver, first, stop in sends:
            blocks = set(range(first, stop))
            assert blocks <= held[sender], (world, root, step, sender, "sends what it does not hold")
            assert not blocks & held[receiver], (world, root, step, receiver, "receives what it holds")
        for sender, receiver, first, stop in sends:
            held[receiver] |= set(range(first, stop))
    return held


@pytest.mark.parametrize("world", range(2, 41))
def test_every_peer_ends_with_every_block_from_any_root(world: int) -> None:
    size = power_of_two_below(world)
    for root in range(world):
        held = play(world, root)
        assert held == [set(range(size))] * world, (world, root)
        assert not any(not m.send for m in scatter_all_gather_plan(root, world, root)), "the root receives nothing"


@pytest.mark.parametrize("world", [2, 3, 8, 12, 16, 37, 64, 256])
def test_each_peer_receives_the_buffer_once_and_sends_at_most_twice_in_2_log_p_steps(world: int) -> None:
    size = power_of_two_below(world)
    steps = size.bit_length() - 1
    for root in {0, 1, world // 2, world - 1}:
        acting = fold_partner(root, world) if root < 2 * (world - size) and root % 2 == 0 else root
        for p in range(world):
            plan = scatter_all_gather_plan(p, world, root)
            received = sum(m.stop - m.first for m in plan if not m.send)
            assert received == (0 if p == root else size), (world, root, p)  # every block once
            sent = sum(m.stop - m.first for m in plan if m.send and (m.first, m.stop) != (0, size))
            assert sent <= 2 * (size - 1), (world, root, p)  # the fold's whole buffers aside
            assert len({m.step for m in plan}) <= 2 * steps + 2
        scatter = [m for m in scatter_all_gather_plan(acting, world, root) if m.send and 1 <= m.step <= steps]
        assert [m.stop - m.first for m in scatter] == [size >> s for s in range(1, steps + 1)]  # halves


def test_the_plan_at_four_peers_from_root_1() -> None:
    # rel = v XOR 1.  Scatter: 1 sends blocks 2-3 to 3 (distance 2), then block 0 to 0 while 3
    # sends block 2 to 2 (distance 1).  All-gather: at distance 1, 1 sends block 1 to 0 (and
    # 3 block 3 to 2), nothing back (each sent the other its block in the scatter); at
    # distance 2, 1 sends blocks 0-1 to 3 and 0 and 2 swap theirs.
    assert scatter_all_gather_plan(1, 4, 1) == (
        BlockMove(1, 3, True, 2, 4), BlockMove(2, 0, True, 0, 1), BlockMove(3, 0, True, 1, 2),
        BlockMove(4, 3, True, 0, 2))
    assert scatter_all_gather_plan(0, 4, 1) == (
        BlockMove(2, 1, False, 0, 1), BlockMove(3, 1, False, 1, 2),
        BlockMove(4, 2, True, 0, 2), BlockMove(4, 2, False, 2, 4))
    # A folded root (position 0 of 5) hands the whole buffer to its partner first.
    assert scatter_all_gather_plan(0, 5, 0) == (BlockMove(0, 1, True, 0, 4),)
    assert scatter_all_gather_plan(1, 5, 0)[0] == BlockMove(0, 0, False, 0, 4)
    assert scatter_all_gather_plan(0, 5, 2)[-1] == BlockMove(5, 1, False, 0, 4)
    with pytest.raises(ValueError):
        scatter_all_gather_plan(5, 5, 0)
