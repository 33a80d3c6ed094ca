"""The harnesses of the ported cases end a run at its first failure: a case that fails on one
rank while the others wait for it reports that rank's error at once, in a thread world
(``World.run`` aborts the other ranks' groups) and in processes (``run_peer_processes`` kills
the other processes) — not after the run's timeout."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

import pccl

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from pccl_torch_world import World, default, run_cases_in_processes, world  # noqa: E402,F401


def case_fails_on_rank_1(pg: Any, rank: int, world: int) -> None:
    """Rank 1 fails at once; the others wait for it in an all-reduce (a thread world) or
    sleep for ten minutes (a process: as if it waited for rank 1 in something that never ends)."""
    if rank == 1:
        raise AssertionError("rank 1 fails on purpose")
    if default(pg):
        time.sleep(600)
    else:
        dist.all_reduce(torch.ones(2), group=pg)


#: The cases c10d_ported_peer.py runs for test_a_failing_process_ends_the_run.
FAILING_CASES = {"fails_on_rank_1": case_fails_on_rank_1}


def test_a_failing_rank_ends_a_thread_world_run_with_its_error(world: World) -> None:
    """Rank 1's error, not a ``TimeoutError`` after the run's 60 s: the other ranks' all-reduces
    were cancelled (their groups aborted: ``CollectiveAborted``; or refused, a group shut down
    before its call began) — each call ended, none was left running past the run (which waits
    30 s for them); the world then runs the next case.  An abort while a rank's call was between
    starting its op and noting its work left that call running for good."""
    ended: dict[int, BaseException | None] = {}

    def case(pg: Any, rank: int, size: int) -> None:
        try:
            case_fails_on_rank_1(pg, rank, size)
        except BaseException as exc:
            ended[rank] = exc
            raise
        ended[rank] = None

    with pytest.raises(AssertionError, match="rank 1 fails on purpose"):
        world.run(case, timeout=60)
    waiting = [rank for rank in range(world.size) if rank != 1]
    assert sorted(set(ended) - {1}) == waiting, f"ranks {sorted(set(waiting) - set(ended))} were left running"
    for rank in waiting:
        assert isinstance(ended[rank], (pccl.CollectiveAborted, pccl.InvalidUsage)), (rank, ended[rank])

    def all_reduce(pg: Any, rank: int, size: int) -> None:
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        torch.testing.assert_close(t, torch.full((2,), float(size)))

    world.run(all_reduce)


def test_a_failing_process_ends_the_run(tmp_path: pathlib.Path) -> None:
    """Rank 1's process stops at its failed case and shows its traceback; rank 0's process,
    still busy, is killed then — not after the run's 120 s timeout ("still running")."""
    with pytest.raises(AssertionError, match=r"(?s)peer 1 failed \(exit 1\).*rank 1 fails on purpose"):
        run_cases_in_processes("test_world_fails_fast", 2, tmp_path / "store", list(FAILING_CASES), "FAILING_CASES",
                               timeout=120)
