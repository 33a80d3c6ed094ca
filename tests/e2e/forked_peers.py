"""Peer scripts run as processes forked from a server that has imported torch and pccl once.

A test that starts ``python script`` per peer paid for ``import torch`` (and torch.distributed's
packages, pccl) in every one of them: 2-4 s of CPU each, about all of the CPU some of them spend
(tests/torch's nine ported modules run their cases under ``init_process_group`` in 2 and 3
processes each, 45 in all).  :func:`run_scripts`, :class:`Peer` and :class:`ForkedPopen` run the
same script, as ``python script *args`` would (its ``__main__``, ``sys.argv``, its directory
first on ``sys.path``), in a process forked from a ``multiprocessing`` fork server that has
imported :data:`PRELOAD` (one server per test process, started by its first peer; forking a
process that has only imported torch is what torch's DataLoader workers do).  A peer imports
whatever else it needs itself; its output goes to files, not pipes.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pathlib
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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


def _run_script(script: str, args: list[str], out: str, err: str | None) -> None:
    """In a forked peer: ``python script *args`` with its stdout written to ``out`` and its
    stderr to ``err`` (``None``: to ``out`` as well); an exception leaving it exits 1 with its
    traceback on stderr, ``sys.exit(n)`` exits ``n``."""
    for fd, path in ((1, out), (2, err or out)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(opened, fd)
        os.close(opened)
    faulthandler.enable()  # a crash's tracebacks, as ``python -X faulthandler``
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")


def _new_file(directory: str, prefix: str, suffix: str) -> str:
    fd, path = tempfile.mkstemp(suffix, prefix, directory)
    os.close(fd)
    return path


class Peer:
    """``script *args`` in a process forked from the server, its output in new files of
    ``directory`` named after ``name`` (stderr in the stdout file with ``merged``)."""

    def __init__(self, script: pathlib.Path, args: Sequence[str], directory: str, name: str,
                 merged: bool = False) -> None:
        self.out = _new_file(directory, f"{name}-", ".out")
        self.err = self.out if merged else _new_file(directory, f"{name}-", ".err")
        self.process = _context().Process(target=_run_script, args=(str(script), list(args), self.out,
                                                                    None if merged else self.err), name=name)
        self.process.start()

    def wait(self, timeout: float) -> int | None:
        """Its exit code (minus the signal that killed it), or ``None`` if it still runs after
        ``timeout`` s."""
        self.process.join(max(0.0, timeout))
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL it if it runs, and wait for it."""
        if self.process.exitcode is None:
            self.process.kill()
        self.process.join(10)

    def output(self) -> tuple[str, str]:
        """Its stdout and stderr so far (the same text twice if merged)."""
        out, err = (pathlib.Path(path).read_text(errors="replace") if os.path.exists(path) else ""
                    for path in (self.out, self.err))
        return out, err


def run_scripts(script: pathlib.Path, args: Sequence[Sequence[str]], timeout: float,
                failed: Callable[[int, int, str, str], str]) -> list[tuple[str, str]]:
    """Run ``script`` once per argument list at once, wait for all and return each one's
    ``(stdout, stderr)``.  The first to exit non-zero raises ``AssertionError(failed(index,
    exit code, stdout, stderr))`` at once, and every peer still running is killed then; at
    ``timeout`` s those still running are named and killed."""
    with tempfile.TemporaryDirectory(prefix="pccl-peers-") as tmp:
        peers: list[Peer] = []
        try:
            for i, a in enumerate(args):
                peers.append(Peer(script, a, tmp, f"peer{i}"))
            pending, deadline = {p.process.sentinel: i for i, p in enumerate(peers)}, time.monotonic() + timeout
            while pending:
                ended = multiprocessing.connection.wait(list(pending), max(0.0, deadline - time.monotonic()))
                if not ended:
                    raise AssertionError(f"peers {sorted(pending.values())} still running after {timeout:g} s")
                for sentinel in ended:
                    index = pending.pop(sentinel)  # type: ignore[call-overload]
                    code = peers[index].wait(10)
                    if code != 0:
                        raise AssertionError(failed(index, code, *peers[index].output()))
        finally:
            for peer in peers:
                peer.kill()
        return [peer.output() for peer in peers]


class ForkedPopen:
    """The part of ``subprocess.Popen`` that child_process.py's ``Child`` and its tests use
    (``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``, ``pid``, ``stdout`` as lines
    of text, stderr merged), for ``script *args`` run as a :class:`Peer` in ``directory``.  Safe
    to use from the thread reading ``stdout`` and another (multiprocessing's exit code is not:
    two threads polling it at once can read the exit status twice and make it 255)."""

    def __init__(self, script: pathlib.Path, args: Sequence[str], directory: str, name: str) -> None:
        self._peer = Peer(script, args, directory, name, merged=True)
        self._lock = threading.Lock()
        self.pid: int = self._peer.process.pid  # type: ignore[assignment]
        self.stdout = self._lines()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._lock:
            return self._peer.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        multiprocessing.connection.wait([self._peer.process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self._peer.process.name, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _lines(self) -> Iterator[str]:
        """Its output's lines as they are written (each with its newline), to its exit."""
        with open(self._peer.out, encoding="utf-8", errors="replace", newline="") as f:
            part = ""
            while True:
                ended = self.poll() is not None  # before the read: nothing written before the exit is lost
                chunk = f.read()
                if chunk:
                    lines = (part + chunk).split("\n")
                    part = lines.pop()
                    yield from (line + "\n" for line in lines)
                elif ended:
                    if part:
                        yield part
                    return
                else:
                    time.sleep(0.01)
