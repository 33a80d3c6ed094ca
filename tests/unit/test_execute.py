"""pccl.collectives.execute: what every kind's op shares, done once whatever the outcome — the
ring check, the kept input, the release of the op's scratch memory, the retire of its seq."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from pccl.collectives import ReduceArgs
from pccl.collectives.allreduce import all_reduce_op
from pccl.collectives.execute import Place, execute
from pccl.collectives.links import RingLinks
from pccl.errors import InvalidArgument
from pccl.types import ReduceOp

from test_allreduce_ring import memory_ring


class Counted:
    """A ring's links and its ops' releases, counted."""

    def __init__(self, links: RingLinks) -> None:
        self.links = links
        self.retired: list[int] = []
        self.released = 0
        real_retire = links.retire

        def retire(seq: int) -> None:
            self.retired.append(seq)
            real_retire(seq)

        links.retire = retire  # type: ignore[method-assign]

    def make(self, args: ReduceArgs) -> Any:
        def make_op(place: Place) -> Any:
            op = all_reduce_op(args, place)
            real_release = op.release

            def release() -> None:
                self.released += 1
                real_release()

            op.release = release  # type: ignore[method-assign]
            return op
        return make_op


async def test_a_completed_op_is_released_and_retired_once_on_every_peer() -> None:
    links, _ = memory_ring(2)
    counted = [Counted(link) for link in links]
    xs = [np.full(4096, r + 1, np.float32) for r in range(2)]
    async with trio.open_nursery() as nursery:
        for r in range(2):
            args = ReduceArgs.check(xs[r], None, ReduceOp.SUM, None)
            nursery.start_soon(lambda r=r, args=args: execute(counted[r].make(args), links=links[r], rank=r,
                                                              world=2, seq=3, keep=args))
    for r in range(2):
        assert np.array_equal(xs[r], np.full(4096, 3, np.float32))
        assert (counted[r].released, counted[r].retired) == (1, [3])


async def test_a_cancelled_op_is_released_and_retired_once_and_its_input_restored() -> None:
    links, _ = memory_ring(2)
    counted = Counted(links[0])
    x = np.arange(1 << 16, dtype=np.float32)
    before = x.copy()
    args = ReduceArgs.check(x, None, ReduceOp.SUM, None)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:  # peer 1 never runs: peer 0 waits for its frames
            nursery.start_soon(lambda: execute(counted.make(args), links=links[0], rank=0, world=2, seq=9, keep=args))
            await trio.testing.wait_all_tasks_blocked()
            scope.cancel()
    assert scope.cancelled_caught
    assert (counted.released, counted.retired) == (1, [9])
    assert np.array_equal(x, before)


@pytest.mark.parametrize(("rank", "world"), [(2, 2), (-1, 2), (0, 1)])
async def test_a_bad_ring_position_is_refused_before_the_op_is_made_and_retires_the_seq(rank: int, world: int) -> None:
    links, _ = memory_ring(2)
    counted = Counted(links[0])
    made: list[Place] = []
    with pytest.raises(InvalidArgument, match="a ring needs 2\\+ peers"):
        await execute(made.append, links=links[0], rank=rank, world=world, seq=4)  # type: ignore[arg-type]
    assert (made, counted.released, counted.retired) == ([], 0, [4])


async def test_a_kinds_own_check_failing_in_make_op_retires_the_seq_and_keeps_the_input() -> None:
    links, _ = memory_ring(2)
    counted = Counted(links[0])
    x = np.ones(8, np.float32)
    args = ReduceArgs.check(x, None, ReduceOp.SUM, None)
    places: list[Place] = []

    def refuse(place: Place) -> Any:
        places.append(place)
        raise InvalidArgument("the kind's own check")

    with pytest.raises(InvalidArgument, match="own check"):
        await execute(refuse, links=links[0], rank=1, world=2, seq=5, keep=args)
    assert counted.retired == [5]
    (place,) = places
    assert (place.rank, place.world, place.seq) == (1, 2, 5)
    assert place.backup is not None  # in place and no backup of the caller's: the call keeps the input
    assert np.array_equal(x, np.ones(8, np.float32))


def test_a_commence_that_does_not_fit_the_call_is_a_protocol_error() -> None:
    """A (lying or buggy) master's Commence whose ring lacks the broadcast's root, or whose
    all-gather counts disagree with this peer's input, is refused as the master's fault."""
    from pccl.collectives.kinds import KIND_OPS
    from pccl.errors import ProtocolError
    from pccl.protocol import messages as m
    from pccl.protocol.messages import CollectiveKind

    links, _ = memory_ring(2)
    place = Place(links=links[0], rank=0, world=2, seq=1, runner=None, backup=None)  # type: ignore[arg-type]
    row = KIND_OPS[CollectiveKind.BROADCAST]
    call = row.check(np.ones(8, np.float32), 7, 1, None)
    with pytest.raises(ProtocolError, match="from root 7 on ring \\[3, 4\\]"):
        row.make_op(call, m.CollectiveCommence(tag=1, seq=1, ring=(3, 4)), place)
    gather = KIND_OPS[CollectiveKind.ALL_GATHER]
    call = gather.check(np.ones(8, np.float32), 1, None)
    with pytest.raises(ProtocolError, match="with counts \\[9, 9\\]"):
        gather.make_op(call, m.CollectiveCommence(tag=1, seq=1, ring=(3, 4), counts=(9, 9)), place)
