"""torch 2.13's own ``DistributedTest._DistTestBase`` barrier-timeout tests, ported to
``pccl.torch.ProcessGroup``, and the timeouts of the group's collectives.

Upstream: ``torch/testing/_internal/distributed/distributed_test.py`` as the installed torch
2.13.0 wheel ships it; ``BACKEND`` is ``"gloo"`` there ("Only gloo backend supports timeouts"),
"pccl" here.  Each ``case_*`` is one upstream test with the same inputs and assertions, run as
test_distributed_test_collectives.py runs its cases: ``test_<case>[world]`` on thread worlds of
2 and 3 peers (``pccl.torch.ProcessGroup(comm)`` each), and ``test_under_init_process_group``,
processes whose default group ``init_process_group("pccl")`` made (c10d_ported_peer.py).

Ported (3 upstream tests in 3 cases): ``test_barrier_timeout_global``,
``test_barrier_timeout_full_group``, ``test_barrier_timeout_group``.  ``_test_barrier_timeout``
is upstream's: rank 0 of the group alone calls ``dist.barrier(group_id)``, which must raise an
error matching ``" (Timed out|closed|timeout) "`` no earlier than the group's timeout after the
call (``assertGreaterAlmostEqual(time.time(), expected_time, delta=0.1)``).  Beyond upstream
(where gloo's group is broken after a timeout: "Application timeout caused pair closure"), each
case then shows the pccl group goes on: the other ranks, once rank 0 timed out, call the same
barrier (torch's rule: every rank issues the group's collectives in one order), which ends on
each of them too, and every rank's next all-reduce on the group is right.  The ranks meet for
that through a store (the default group's under init_process_group; a ``HashStore`` of this
process on a thread world), as upstream's ``self._barrier()`` does.

``test_barrier_timeout_group`` (``@skip_if_small_worldsize``: 8 ranks or more upstream) builds
``new_group([1, 2], timeout=...)``, a subset of the ranks: a pccl group spans its whole peer
group, so ``new_group`` raises ``InvalidUsage`` at once on ranks 1 and 2 (rank 0 is not a member
and gets torch's ``NON_GROUP_MEMBER``) — checked on a world of 3 under init_process_group, the
only world here that has ranks 1 and 2 and a default group.

Looked at, not ported: ``test_barrier_timeout_arg`` (skipped on Linux upstream, pytorch#179691;
its per-call ``dist.barrier(timeout=...)`` is tested below,
``test_a_call_s_own_timeout_overrides_the_group_s``); test_c10d_gloo.py's
``test_set_gloo_pg_timeout`` (gloo's ``options._timeout`` and ``_set_default_timeout``: a pccl
group's timeout is its ``timeout`` property) and ``TimeoutTest`` (store timeouts); torchft's
``test_gloo_timeout`` (torchft's ``configure``).
"""

from __future__ import annotations

import datetime
import pathlib
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import _get_default_store  # noqa: E402

import pccl  # noqa: E402
import pccl.torch  # noqa: E402
from pccl_torch_world import (WORLDS, World, case_table, default, run_cases_in_processes,  # noqa: E402,F401
                              thread_world_tests, world)

CASES, ported = case_table()
#: The cases a world of 2 runs under init_process_group (test_barrier_timeout_group needs ranks 1 and 2).
WORLD2_CASES: dict[str, Any] = {}
#: A store the peers of a thread world meet in (they share this process).
THREAD_STORE = dist.HashStore()
THREAD_STORE.set_timeout(datetime.timedelta(seconds=60))
TIMED_OUT = " (Timed out|closed|timeout) "


def _store(pg: Any) -> Any:
    return _get_default_store() if default(pg) else THREAD_STORE


def _store_barrier(store: Any, key: str, count: int) -> None:
    """Upstream's ``self._barrier(wait_for=n)``: wait until ``count`` ranks reached ``key``."""
    store.add(key, 1)
    deadline = time.monotonic() + 60
    while store.add(key, 0) < count:
        assert time.monotonic() < deadline, f"only {store.add(key, 0)} of {count} ranks reached {key}"
        time.sleep(0.01)


def _test_barrier_timeout(group_id: Any, timeout: datetime.timedelta, store: Any, key: str) -> None:
    """_DistTestBase._test_barrier_timeout; then (beyond upstream) the other ranks call the same
    barrier once rank 0's timed out, and the group runs its next all-reduce."""
    local_rank = group_id.rank()  # dist.get_rank(group_id) upstream (a thread world has no default group)
    size = group_id.size()

    # Only execute barrier on rank == 0, causing it to timeout
    if local_rank == 0:
        expected_time = time.time() + timeout.total_seconds()
        with pytest.raises(Exception, match=TIMED_OUT) as raised:
            dist.barrier(group_id)
        assert time.time() >= expected_time - 0.1, "the barrier ended before its timeout"  # assertGreaterAlmostEqual
        assert isinstance(raised.value, pccl.torch.CollectiveTimeout) and isinstance(raised.value, RuntimeError)
        store.set(f"{key}/timed_out", "1")
        _store_barrier(store, f"{key}/caught_up", size)
    else:
        store.wait([f"{key}/timed_out"])
        # Rank 0 withdrew its call: this one waits for it and times out as well (or, had rank
        # 0's withdrawal not reached the master before this call, aborts: a CollectiveAborted).
        with pytest.raises(pccl.CollectiveAborted):
            dist.barrier(group_id)
        _store_barrier(store, f"{key}/caught_up", size)
    t = torch.ones(3)
    dist.all_reduce(t, group=group_id)
    torch.testing.assert_close(t, torch.full((3,), float(size)))


def _full_group(pg: Any, timeout: datetime.timedelta) -> tuple[Any, str]:
    """_DistTestBase._init_full_group_test(timeout=...): ``dist.new_group(timeout=...)`` under
    init_process_group; on a thread world (no default group) the group it would make, one more
    ``pccl.torch.ProcessGroup`` over ``pg``'s communicator with tags of its own and the
    timeout.  With a store key of that group's own."""
    if default(pg):
        return dist.new_group(timeout=timeout), "full_group"
    first_tag = pg.next_shared_first_tag()
    group = pccl.torch.ProcessGroup(pg.communicator, first_tag=first_tag, ranks=pg.given_ranks, timeout=timeout)
    return group, f"{pg.size()}:{first_tag}"


@ported
def case_barrier_timeout_full_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_barrier_timeout_full_group"""
    timeout = datetime.timedelta(seconds=1)
    group_id, key = _full_group(pg, timeout)
    assert group_id.timeout == timeout
    try:
        _test_barrier_timeout(group_id, timeout, _store(pg), key)
    finally:
        if default(pg):
            dist.destroy_process_group(group_id)
        else:
            group_id.shutdown()


@ported
def case_barrier_timeout_group(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_barrier_timeout_group
    (under init_process_group on a world of 3: see the module's docstring).  Upstream's
    ``_init_group_test(timeout=5 s)`` is ``new_group([1, 2], timeout=...)``: on pccl
    ``InvalidUsage`` at once on its members; rank 0, not a member, runs nothing upstream."""
    assert default(pg) and world >= 3
    timeout = datetime.timedelta(seconds=5)
    started = time.monotonic()
    if rank in (1, 2):
        with pytest.raises(pccl.InvalidUsage, match="spans its whole peer group"):
            dist.new_group([1, 2], timeout=timeout)
        assert time.monotonic() - started < timeout.total_seconds(), "InvalidUsage came only after the timeout"
    else:
        assert dist.new_group([1, 2], timeout=timeout) is dist.GroupMember.NON_GROUP_MEMBER


@ported
def case_barrier_timeout_global(pg: Any, rank: int, world: int) -> None:
    """torch/testing/_internal/distributed/distributed_test.py::_DistTestBase.test_barrier_timeout_global.
    Upstream destroys the default group, meets the other ranks in the store and initialises
    it again with ``timeout=1 s``; so does the port under init_process_group (in the same
    store, under a prefix of its own: upstream's ``file://`` init method).  It must run last
    of the cases of a process (the default group is a new one after it).  On a thread world
    the group is one more ``ProcessGroup`` over the communicator with that timeout."""
    timeout = datetime.timedelta(seconds=1)
    if default(pg):
        store = _get_default_store()
        dist.destroy_process_group()
        # Explicitly pass world size to the barrier because we've
        # just destroyed any state in torch.distributed.
        _store_barrier(store, "global/destroyed", world)
        # Reinitialize global process group
        dist.init_process_group("pccl", store=dist.PrefixStore("global", store), world_size=world, rank=rank,
                                timeout=timeout)
        assert dist.group.WORLD.timeout == timeout
        _test_barrier_timeout(dist.group.WORLD, timeout, _get_default_store(), "global")
        return
    group_id, key = _full_group(pg, timeout)
    try:
        _test_barrier_timeout(group_id, timeout, THREAD_STORE, key)
    finally:
        group_id.shutdown()


WORLD2_CASES.update((name, case) for name, case in CASES.items() if name != "barrier_timeout_group")
globals().update(thread_world_tests(CASES, leave_out={"barrier_timeout_group"}))


@pytest.mark.parametrize("world_size", WORLDS)
def test_under_init_process_group(tmp_path: pathlib.Path, world_size: int) -> None:
    """Every case, in order, in ``world_size`` processes whose default group
    ``init_process_group("pccl")`` made (c10d_ported_peer.py); test_barrier_timeout_group on
    the world of 3 only."""
    cases = CASES if world_size >= 3 else WORLD2_CASES
    run_cases_in_processes("test_distributed_test_timeouts", world_size, tmp_path / "store", list(cases),
                           *([] if world_size >= 3 else ["WORLD2_CASES"]))


# --- the timeouts of the group's collectives (pccl's own tests) ----------------------------------------


def test_a_collective_past_its_timeout_is_cancelled_and_its_input_holds_its_values(world: World) -> None:
    """An all-reduce whose options set a timeout and that rank 0 alone calls: its work fails with
    ``pccl.torch.CollectiveTimeout`` (a ``RuntimeError`` saying "Timed out", and a retry-safe
    ``CollectiveAborted``) after that timeout, the in-place tensor holds its input, and
    ``exception()`` and the future say so too; the other ranks then call it (and end as well),
    and the group's next collective runs."""

    def case(pg: Any, rank: int, size: int) -> None:
        key = f"allreduce:{size}:{pg.next_shared_first_tag()}"  # the same at every rank, new at every run
        if rank == 0:
            t = torch.arange(4, dtype=torch.float32)
            opts = dist.AllreduceOptions()
            opts.timeout = datetime.timedelta(seconds=0.5)
            started = time.monotonic()
            work = pg.allreduce([t], opts)
            with pytest.raises(pccl.torch.CollectiveTimeout, match="Timed out waiting 500ms") as raised:
                work.wait()
            assert time.monotonic() - started >= 0.5
            assert isinstance(raised.value, RuntimeError) and isinstance(raised.value, pccl.CollectiveAborted)
            assert isinstance(raised.value.__cause__, pccl.PCCLError)
            torch.testing.assert_close(t, torch.arange(4, dtype=torch.float32))
            assert work.is_completed() and not work.is_success() and work.exception() is raised.value
            with pytest.raises(RuntimeError, match="CollectiveTimeout: pccl allreduce: Timed out"):
                work.get_future().wait()
            THREAD_STORE.set(f"{key}/timed_out", "1")
        else:
            THREAD_STORE.wait([f"{key}/timed_out"])
            opts = dist.AllreduceOptions()
            opts.timeout = datetime.timedelta(seconds=0.5)
            with pytest.raises(pccl.CollectiveAborted):
                pg.allreduce([torch.ones(4)], opts).wait()
        _store_barrier(THREAD_STORE, f"{key}/caught_up", size)
        t = torch.ones(2)
        dist.all_reduce(t, group=pg)
        torch.testing.assert_close(t, torch.full((2,), float(size)))

    world.run(case)


def test_a_call_s_own_timeout_overrides_the_group_s(world: World) -> None:
    """``dist.barrier(group=pg, timeout=...)`` (``BarrierOptions.timeout``) bounds that call on a
    group whose own timeout is longer (``ProcessGroup(comm, timeout=...)``, ``set_timeout``) (upstream's ``test_barrier_timeout_arg``, skipped on Linux
    there, asks the same of gloo); a collective that every rank calls in time is untouched by its
    timeout."""

    def case(pg: Any, rank: int, size: int) -> None:
        first_tag = pg.next_shared_first_tag()
        group = pccl.torch.ProcessGroup(pg.communicator, first_tag=first_tag, timeout=300.0)
        key = f"arg:{size}:{first_tag}"
        try:
            group.set_timeout(datetime.timedelta(seconds=200))  # torch's ProcessGroup.set_timeout
            assert group.timeout == datetime.timedelta(seconds=200)
            t = torch.full((3,), float(rank))
            dist.all_reduce(t, group=group)  # well within its timeout: the result, nothing cancelled
            torch.testing.assert_close(t, torch.full((3,), float(sum(range(size)))))
            if rank == 0:
                started = time.monotonic()
                with pytest.raises(RuntimeError, match="Timed out waiting 300ms"):
                    dist.barrier(group=group, timeout=datetime.timedelta(seconds=0.3))
                assert 0.3 <= time.monotonic() - started < 300
                THREAD_STORE.set(f"{key}/timed_out", "1")
            else:
                THREAD_STORE.wait([f"{key}/timed_out"])
                with pytest.raises(pccl.CollectiveAborted):
                    dist.barrier(group=group, timeout=datetime.timedelta(seconds=0.3))
            _store_barrier(THREAD_STORE, f"{key}/caught_up", size)
            dist.barrier(group=group)
        finally:
            group.shutdown()

    world.run(case)


def test_a_timeout_mid_transfer_aborts_the_collective_on_every_peer(world: World) -> None:
    """Every rank calls a 64 MiB all-reduce whose timeout is half the time the same all-reduce
    took just before (measured on every rank, the smallest taken), so that the timeouts cancel
    it while its data moves.  All or nothing: it aborts on every peer (a peer whose own timeout
    had not passed yet gets ``CollectiveAborted`` from the others' cancellation) and each tensor
    holds its input again, bit for bit — or, had it been quicker this time, it completed on
    every peer, right (a peer whose timeout passed after it reported its part done waits for
    the master's verdict and succeeds with the others: once, before that wait, it restored its
    input while they completed); then the timeout is halved and it runs again (at most 5 times).  After an
    abort the group's next all-reduce, without a timeout, is right."""

    def case(pg: Any, rank: int, size: int) -> list[str]:
        x = torch.full((16 << 20,), float(rank + 1))
        x[::4097] = torch.arange(x[::4097].numel(), dtype=torch.float32) * (rank + 1)
        total = sum(range(1, size + 1))
        started = time.monotonic()
        dist.all_reduce(x, group=pg)
        took = torch.tensor([time.monotonic() - started], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MIN, group=pg)
        x.div_(total).mul_(rank + 1)  # this rank's input again
        outcomes = []
        for attempt in range(5):
            before = x.clone()
            opts = dist.AllreduceOptions()
            opts.timeout = datetime.timedelta(seconds=float(took) / 2 ** (attempt + 1))
            try:
                pg.allreduce([x], opts).wait()
            except pccl.CollectiveAborted as exc:
                outcomes.append(type(exc).__name__)
                assert torch.equal(x, before), "the aborted all-reduce's input was not restored"
            else:
                outcomes.append("ok")
                torch.testing.assert_close(x, before / (rank + 1) * total)
                x.div_(total).mul_(rank + 1)
            aborted = torch.tensor([outcomes[-1] != "ok"], dtype=torch.uint8)
            both = torch.cat([aborted, 1 - aborted])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=pg)
            assert int(both.sum()) == 1, f"the all-reduce aborted on some peers only: {outcomes}"  # all or nothing
            if outcomes[-1] != "ok":
                break
        dist.all_reduce(x, group=pg)
        torch.testing.assert_close(x, before / (rank + 1) * total)
        return outcomes

    outcomes = world.run(case, timeout=120)
    assert "CollectiveTimeout" in {o[-1] for o in outcomes}, outcomes
