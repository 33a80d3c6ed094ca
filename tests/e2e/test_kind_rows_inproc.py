"""Adding a kind of collective is one row and one op module: a toy kind, written here only, runs
over an in-process group (peers as Trio tasks, real TCP) as the built-in kinds do.

The toy is a *max-index* all-reduce: element ``i`` of the result is the ring position of the
peer whose input holds the largest value there (ties: the first in ring order).  Its op module
gathers every input in ring order (an existing op class, :class:`~pccl.collectives.chain_op.ChainOp`,
on the all-gather's schedule); its row checks the arguments, announces the vote, makes the op
and turns the gathered buffer into the result.  Everything else — the vote, the master's
agreement, the ring check, the retire, the release, settling and aborts — is what every kind
shares.  It votes under the master's all-reduce row (the voters agree on count, dtype and op).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import pytest

from pccl import Config, InvalidArgument, ReduceOp
from pccl.collectives.all_gather import GatherArgs, all_gather_op
from pccl.collectives.chain_op import ChainOp
from pccl.collectives.execute import Place
from pccl.collectives.kinds import KIND_OPS, Call, KindOps, check_tag, quant_fields
from pccl.collectives.lane_op import LaneOp
from pccl.protocol import messages as m
from pccl.protocol.master.kinds import KINDS
from pccl.protocol.messages import CollectiveKind
from pccl.testing import each, open_test_cluster, run_kind

CFG = Config(peer_timeout=3.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0,
             shared_state_base_port=0)


# --- the op module ------------------------------------------------------------------------------


def max_index_op(args: GatherArgs, place: Place) -> ChainOp:
    """Every participant's input, gathered in ring order into one ``world × count`` buffer."""
    count = args.src.size
    return all_gather_op(args, np.empty(count * place.world, args.src.dtype), place, counts=(count,) * place.world)


# --- the row ------------------------------------------------------------------------------------


class MaxIndex(NamedTuple):
    peers: tuple[int, ...]  # the ring, in the order the positions count
    positions: np.ndarray  # per element, the ring position holding the max


def _gathered(op: LaneOp) -> np.ndarray | None:
    assert isinstance(op, ChainOp) and isinstance(op.out, np.ndarray)
    return op.out


MAX_INDEX = KindOps(
    CollectiveKind.ALL_REDUCE, "max-index",
    check=lambda x, tag: Call(check_tag(tag), None, own=GatherArgs.check(x, None)),
    init=lambda call: m.CollectiveInit(tag=call.tag, count=int(call.own.src.size), dtype=int(call.own.dtype),
                                       op=int(ReduceOp.MAX), **quant_fields(None)),
    make_op=lambda call, commence, place: max_index_op(call.own, place),
    result=lambda call, commence, rank, tx, rx, output: MaxIndex(
        tuple(commence.ring), output.reshape(len(commence.ring), -1).argmax(axis=0)),
    output=_gathered,
)


# --- the tests ----------------------------------------------------------------------------------


async def test_a_toy_kind_of_one_row_and_one_op_module_runs_on_every_peer() -> None:
    async with open_test_cluster(3, token="kind-rows", config=CFG) as (_, comms, _nets):
        ids = [c.peer_id for c in comms]
        rng = np.random.default_rng(45)
        inputs = {pid: rng.standard_normal(1000).astype(np.float32) for pid in ids}

        async def call(i: int, comm: Any) -> Any:
            return await run_kind(comm, MAX_INDEX, inputs[ids[i]], 7)

        results = await each(comms, call)
        ring = results[0].peers
        assert sorted(ring) == sorted(ids)
        expected = np.stack([inputs[pid] for pid in ring]).argmax(axis=0)
        for result in results:
            assert isinstance(result, MaxIndex), result
            assert result.peers == ring
            assert np.array_equal(result.positions, expected)
        assert set(expected.tolist()) == {0, 1, 2}  # every peer holds some maximum

        # A built-in kind runs after it on the same ring, as always.
        sums = await each(comms, lambda i, comm: comm.all_reduce(inputs[ids[i]].copy(), tag=8))
        assert all(info.world_size == 3 for info in sums)


async def test_the_toy_kinds_bad_arguments_are_refused_before_the_vote() -> None:
    async with open_test_cluster(2, token="kind-rows", config=CFG) as (_, comms, _nets):
        with pytest.raises(InvalidArgument):
            await run_kind(comms[0], MAX_INDEX, np.ones(4, np.float32), -1)
        with pytest.raises(InvalidArgument):
            await run_kind(comms[0], MAX_INDEX, np.ones(3, np.complex64), 1)
        # No vote went out: tag 1 is free (a standing vote of peer 0 would make this TAG_IN_USE).
        x = [np.array([1, 5], np.int32), np.array([2, 4], np.int32)]
        results = await each(comms, lambda i, comm: run_kind(comm, MAX_INDEX, x[i], 1))
        ring = results[0].peers
        expected = [ring.index(comms[1].peer_id), ring.index(comms[0].peer_id)]
        assert all(r.positions.tolist() == expected for r in results), results


def test_every_kind_has_a_master_row_and_a_peer_row_that_name_it_alike() -> None:
    assert set(KIND_OPS) == set(KINDS) == set(CollectiveKind)
    for kind, row in KIND_OPS.items():
        assert row.kind is kind
        assert row.name == KINDS[kind].call.replace("_", "-")  # all_reduce: "all-reduce tag 3"
