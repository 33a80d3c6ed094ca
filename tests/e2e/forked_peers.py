"""Peer scripts run as processes forked from a server that has imported torch and pccl once.

A test that starts ``python script`` per peer paid for ``import torch`` (and torch.distributed's
packages, pccl) in every one of them: 2-4 s of CPU each, about all of the CPU some of them spend
(tests/torch's ported cases under ``init_process_group`` start 2 or 3 per world size, 40 in
all).  :func:`run_scripts` runs the same script, as ``python script *args`` would (its
``__main__``, ``sys.argv``, its directory first on ``sys.path``), in a process forked from a
``multiprocessing`` fork server that has imported :data:`PRELOAD` (one server per test process,
started by its first peer; forking a process that has only imported torch is what torch's
DataLoader workers do).  A peer imports whatever else it needs itself.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import pathlib
import runpy
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

#: What the fork server imports before it forks a peer (a module that fails to import there is
#: left to the peers).  One list for every caller: the server is one per process.
PRELOAD = ["numpy", "ml_dtypes", "torch", "torch.distributed", "torch.distributed.optim",
           "torch.distributed.algorithms", "torch.nn.parallel", "torch.testing", "pytest", "trio", "pccl",
           "pccl.blocking", "pccl.testing", "pccl.torch", "pccl.torch.backend"]


def _context() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _run_script(script: str, args: list[str], out: str, err: str) -> None:
    """In a forked peer: ``python script *args`` with its stdout and stderr written to ``out``
    and ``err`` (an exception leaving it exits 1 with its traceback on stderr; ``sys.exit(n)``
    exits ``n``)."""
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def run_scripts(script: pathlib.Path, args: Sequence[Sequence[str]], timeout: float,
                failed: Callable[[int, int, str, str], str]) -> list[tuple[str, str]]:
    """Run ``script`` once per argument list at once, wait for all and return each one's
    ``(stdout, stderr)``.  The first to exit non-zero raises ``AssertionError(failed(index,
    exit code, stdout, stderr))`` at once, and every peer still running is killed then; at
    ``timeout`` s those still running are named and killed."""
    context = _context()
    with tempfile.TemporaryDirectory(prefix="pccl-peers-") as tmp:
        files = [(os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")) for i in range(len(args))]
        procs = [context.Process(target=_run_script, args=(str(script), list(a), *f), name=f"peer{i}")
                 for i, (a, f) in enumerate(zip(args, files))]
        try:
            for proc in procs:
                proc.start()
            pending, deadline = {proc.sentinel: i for i, proc in enumerate(procs)}, time.monotonic() + timeout
            while pending:
                ended = multiprocessing.connection.wait(list(pending), max(0.0, deadline - time.monotonic()))
                if not ended:
                    raise AssertionError(f"peers {sorted(pending.values())} still running after {timeout:g} s")
                for sentinel in ended:
                    index = pending.pop(sentinel)  # type: ignore[call-overload]
                    procs[index].join()
                    if procs[index].exitcode != 0:
                        raise AssertionError(failed(index, procs[index].exitcode, *_read(files[index])))
        finally:
            for proc in procs:
                if proc.pid is not None and proc.exitcode is None:
                    proc.kill()
            for proc in procs:
                if proc.pid is not None:
                    proc.join(10)
        return [_read(f) for f in files]


def _read(files: tuple[str, str]) -> tuple[str, str]:
    out, err = (pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else "" for path in files)
    return out, err
