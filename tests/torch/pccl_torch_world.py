"""A master and ``n`` accepted peers in this process (communicators on real TCP, loopback), and
a way to run one function on every peer at once, each in its own thread with a fresh
:class:`pccl.torch.ProcessGroup` — the shape of torch's ``MultiThreadedTestCase``.

Every run's groups start at a tag of their own, so a run that failed half-way (some peers'
collectives left waiting) cannot meet the next run's collectives.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import pathlib
import os
import sys
import threading
from collections.abc import Callable, Collection, Iterator
from typing import Any

import pytest

import pccl
import pccl.blocking

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "e2e"))
from pccl.testing import MasterThread, master_in_thread  # noqa: E402
from forked_peers import run_scripts  # noqa: E402

import pccl.torch  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.distributed_c10d import _get_default_group  # noqa: E402
from pccl.torch.backend import wait_for_peers  # noqa: E402
from pccl.torch.process_group import FIRST_TAG  # noqa: E402

CFG = pccl.Config(peer_timeout=5.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
#: Each run's groups count their tags from a range of their own.
RUN_TAGS = 1 << 40


class World:
    """``n`` accepted communicators of one peer group."""

    def __init__(self, master: MasterThread, comms: list[pccl.blocking.Communicator]) -> None:
        self.master = master
        self.comms = comms
        self._runs = 0

    @property
    def size(self) -> int:
        return len(self.comms)

    def run(self, fn: Callable[[Any, int, int], Any], timeout: float = 60.0,
            ranks: tuple[int, ...] | None = None) -> list[Any]:
        """``fn(pg, rank, world_size)`` on every peer at once; the results in rank order.  The
        first peer to raise ends the run: the others' groups are aborted (their collectives
        still running fail, so a peer waiting for the failed one ends too) and that first error
        is raised (the lowest rank's, if several failed at once).  ``ranks``: the peer ids of
        ranks 0, 1, ... as ``init_process_group`` would give them (ring positions by default)."""
        self._runs += 1
        first_tag = FIRST_TAG + self._runs * RUN_TAGS
        pgs = [pccl.torch.ProcessGroup(c, first_tag=first_tag, ranks=ranks) for c in self.comms]
        pool = concurrent.futures.ThreadPoolExecutor(len(pgs))
        ended = True
        try:
            futures = [pool.submit(fn, pg, pg.rank(), pg.size()) for pg in pgs]
            by_rank = [f for _, f in sorted(zip((pg.rank() for pg in pgs), futures), key=lambda x: x[0])]
            done, _ = concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_EXCEPTION)
            failed = [f for f in by_rank if f in done and f.exception() is not None]
            if failed or len(done) < len(futures):
                for pg in pgs:
                    pg.abort()
                _, left = concurrent.futures.wait(futures, 30)
                ended = not left
                if failed:
                    raise failed[0].exception()  # type: ignore[misc]
                raise TimeoutError(f"ranks {[r for r, f in enumerate(by_rank) if f not in done]} were still "
                                   f"running after {timeout:g} s")
            return [f.result() for f in by_rank]
        finally:
            pool.shutdown(wait=ended)
            for pg in pgs:
                pg.shutdown()


@contextlib.contextmanager
def pccl_world(n: int) -> Iterator[World]:
    """A master in a thread and ``n`` communicators it accepted into peer group 0."""
    with master_in_thread(CFG) as master:
        def join() -> pccl.blocking.Communicator:
            comm = pccl.blocking.open_communicator(master.address, config=CFG)
            try:
                wait_for_peers(comm, n, 30)
            except BaseException:
                comm.close()
                raise
            return comm

        first = pccl.blocking.open_communicator(master.address, config=CFG)
        comms = [first]
        try:
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                others = [pool.submit(join) for _ in range(n - 1)]
                wait_for_peers(first, n, 30)
                comms += [f.result(60) for f in others]
            yield World(master, comms)
        finally:
            for c in comms:
                c.close()


def run_peer_processes(script: pathlib.Path, args: list[list[str]], timeout: float) -> list[dict[str, Any]]:
    """Run ``script`` once per argument list (as ``python script *args[i]``, forked from a server
    that has imported torch: forked_peers.py), wait for all, and return each one's last stdout
    line as JSON.  The first peer to fail (exit non-zero) fails the test at once with its output
    (a JSON report on its last stdout line: the tracebacks of its failed cases) and its stderr;
    the others are killed then, and at ``timeout``."""
    outputs = run_scripts(script, args, timeout,
                          lambda index, code, out, err: f"peer {index} failed (exit {code}):\n{_failure(out, err)}")
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def _failure(out: str, err: str) -> str:
    """A failed peer's output: the failed cases of its JSON report (if it printed one), else its
    stdout; then its stderr's end."""
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1])
        shown = "\n".join(f"{name}:\n{outcome}" for name, outcome in report["cases"].items() if outcome != "ok")
    except (IndexError, ValueError, KeyError, TypeError):
        shown = out
    return f"{shown}\n--- stderr ---\n{err[-4000:]}"


# --- ported upstream cases: the two ways every case module runs them ------------------------------

#: The world sizes every ported case runs on.
WORLDS = (2, 3)
#: One ported upstream case: ``case(pg, rank, world_size)``.
Case = Callable[[Any, int, int], None]
HERE = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="module", params=WORLDS, ids=[f"world{n}" for n in WORLDS])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    """A :func:`pccl_world` of each size of :data:`WORLDS`, shared by a module's cases (a case
    module imports this fixture)."""
    with pccl_world(request.param) as w:
        yield w


def case_table() -> tuple[dict[str, Case], Callable[[Case], Case]]:
    """A case module's ``CASES`` and its ``@ported`` decorator, which enters a ``case_<name>``
    function into them as ``<name>``."""
    cases: dict[str, Case] = {}

    def ported(fn: Case) -> Case:
        cases[fn.__name__.removeprefix("case_")] = fn
        return fn

    return cases, ported


def assert_equal(expected: Any, actual: Any, msg: str | None = None) -> None:
    """torch's ``TestCase.assertEqual`` for tensors and (nested) lists of them: the same dtype,
    shape and values (to the dtype's default tolerance)."""
    torch.testing.assert_close(actual, expected, msg=msg)


def default(pg: Any) -> bool:
    """Whether ``pg`` is torch's default group (the runs under ``init_process_group``)."""
    return dist.is_initialized() and _get_default_group() is pg


def group_kw(pg: Any) -> dict[str, Any]:
    """Upstream leaves the group out (the default group); ``group=pg`` on a group of ours."""
    return {} if default(pg) else {"group": pg}


def ddp_kw(pg: Any) -> dict[str, Any]:
    """Upstream builds DDP on the default group; ``process_group=pg`` on a group of ours."""
    return {} if default(pg) else {"process_group": pg}


#: torch.testing._internal.common_utils.SEED: what upstream's ``setUp`` seeds every process with.
SEED = 1234

#: torch's global random generator is one per process: the thread-world peers draw their
#: models and inputs under this lock, each after seeding, as upstream's processes do.
RNG = threading.Lock()


@contextlib.contextmanager
def seeded(seed: int = SEED) -> Iterator[None]:
    """Draws as from a process seeded with ``seed`` (upstream's ``setUp``), under :data:`RNG`."""
    with RNG:
        torch.manual_seed(seed)
        yield


_DEBUG_ENV = threading.Lock()
_DEBUG_ENV_USERS: list[Any] = []  # (env, level) before the first user, once per user


def with_dist_debug_levels(pg: Any, levels: list[str], fn: Callable[[], None]) -> None:
    """torch/testing/_internal/common_distributed.py::with_dist_debug_levels: ``fn`` once per
    debug level, a barrier after each.  The level is one per process: the thread-world peers set
    the same one at the same step, and the last one out puts the level before back."""
    with _DEBUG_ENV:
        _DEBUG_ENV_USERS.append((os.environ.get("TORCH_DISTRIBUTED_DEBUG"), dist.get_debug_level()))
    try:
        for level in levels:
            with _DEBUG_ENV:
                os.environ["TORCH_DISTRIBUTED_DEBUG"] = level
                dist.set_debug_level_from_env()
            fn()
            dist.barrier(**group_kw(pg))
    finally:
        with _DEBUG_ENV:
            old_env, old_level = _DEBUG_ENV_USERS.pop()
            if not _DEBUG_ENV_USERS:
                if old_env is None:
                    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
                else:
                    os.environ["TORCH_DISTRIBUTED_DEBUG"] = old_env
                dist.set_debug_level(old_level)


def thread_world_tests(cases: dict[str, Case], *, leave_out: Collection[str] = ()) -> dict[str, Callable[..., None]]:
    """``test_<name>`` for each case (but those in ``leave_out``): the case on the test module's
    ``world`` fixture (a :func:`pccl_world` of threads).  A module adds them with
    ``globals().update(thread_world_tests(CASES))``."""
    tests: dict[str, Callable[..., None]] = {}
    for name, case in cases.items():
        if name in leave_out:
            continue

        def test(world: World, case: Case = case) -> None:
            world.run(case)

        test.__name__ = test.__qualname__ = f"test_{name}"
        test.__doc__ = case.__doc__
        tests[test.__name__] = test
    return tests


def run_cases_in_processes(module: str, world_size: int, store: pathlib.Path, expected: list[str],
                           *extra: str, timeout: float = 150) -> list[dict[str, Any]]:
    """Every case of test module ``module``, in order, in ``world_size`` processes whose default
    group ``init_process_group("pccl")`` made (c10d_ported_peer.py, ``extra``: its further
    arguments); fails unless each process reports the ``expected`` cases, all ``"ok"``.  The
    processes' reports, in rank order."""
    with master_in_thread(CFG) as master:
        reports = run_peer_processes(HERE / "c10d_ported_peer.py", [
            [master.address, str(world_size), str(rank), str(store), "0", module, *extra]
            for rank in range(world_size)], timeout=timeout)
    assert sorted(r["rank"] for r in reports) == list(range(world_size))
    failed = {}
    for report in reports:
        assert report["backend"] == "pccl" and report["world"] == world_size
        assert list(report["cases"]) == expected
        failed.update({f"{name} (rank {report['rank']})": outcome for name, outcome in report["cases"].items()
                       if outcome != "ok"})
    assert not failed, "\n".join(f"{name}:\n{outcome}" for name, outcome in failed.items())
    return sorted(reports, key=lambda r: r["rank"])
