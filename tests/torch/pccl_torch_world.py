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
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pccl
import pccl.blocking

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "e2e"))
from pccl.testing import MasterThread, master_in_thread  # noqa: E402

import pccl.torch  # noqa: E402
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
        first peer's exception (in rank order) is raised once all have finished.  ``ranks``: the
        peer ids of ranks 0, 1, ... as ``init_process_group`` would give them (ring positions
        by default)."""
        self._runs += 1
        first_tag = FIRST_TAG + self._runs * RUN_TAGS
        pgs = [pccl.torch.ProcessGroup(c, first_tag=first_tag, ranks=ranks) for c in self.comms]
        try:
            with concurrent.futures.ThreadPoolExecutor(len(pgs)) as pool:
                futures = [pool.submit(fn, pg, pg.rank(), pg.size()) for pg in pgs]
                concurrent.futures.wait(futures, timeout)
                by_rank = sorted(zip((pg.rank() for pg in pgs), futures), key=lambda x: x[0])
                for _, f in by_rank:
                    if not f.done():
                        raise TimeoutError(f"a peer is still running after {timeout:g} s")
                    f.result()
                return [f.result() for _, f in by_rank]
        finally:
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
    """Start ``script`` once per argument list (``python script *args[i]``), wait for all, and
    return each one's last stdout line as JSON; a peer that fails fails the test with its
    output.  Peers still running when this fails are killed."""
    procs = [subprocess.Popen([sys.executable, str(script), *a], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for a in args]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"a peer failed:\n{out}\n{err}"
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return reports
