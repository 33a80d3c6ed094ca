"""``pccl run``: start N copies of a training script on this machine, torchrun-like.

::

    pccl run --nproc 3 examples/ddp_torch.py --steps 100
    pccl run --nproc 2 --master 10.0.0.5:48148 train.py      # join an existing run

Without ``--master``, a master is started on loopback (a free port) in the launcher's own
process and lives until the last copy has exited.  Each copy is ``python SCRIPT ARGS...`` (this
interpreter) with, in its environment, ``PCCL_MASTER`` (the master's ``HOST:PORT``), the
launcher's ``PCCL_TOKEN`` when it is set (the master started here uses it too), and torchrun's
variables for a ``torch.distributed`` group of the N copies (``RANK`` = ``LOCAL_RANK`` = the
copy's index, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = N, ``MASTER_ADDR``/``MASTER_PORT``: a free
loopback port for ``init_process_group("gloo")``'s rendezvous — torch's, not pccl's master).
Every line a copy writes to stdout or stderr is written to the launcher's stdout or stderr with
the prefix ``[i] ``.

No copy is restarted: a copy that exits or dies is the run's business (pccl's peers go on
without it).  The launcher returns when every copy has exited; its exit status is 0 when all
exited with 0, otherwise the first failure's status (a copy killed by a signal counts as
``128 + signal``).  SIGINT (Ctrl-C) or SIGTERM to the launcher stops every copy — after SIGINT
the copies first get two seconds to exit on their own (Ctrl-C in a terminal reached them too),
then SIGTERM, then SIGKILL after ``--grace`` seconds — and then the master; the status is then
``128 + signal``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import IO, Any

import trio

from ..config import Config
from ..master import open_master

__all__ = ["add_parser", "run_launcher"]

log = logging.getLogger(__name__)

#: How often the launcher looks at its children (seconds).
_POLL = 0.05
#: After SIGINT, how long the copies may take to exit on their own before they get SIGTERM
#: (seconds): a Ctrl-C in a terminal reached them too, and a peer's clean leave takes up to one.
_OWN_EXIT = 2.0


def add_parser(commands: Any) -> None:
    """Add ``run`` to the ``pccl`` command's sub-parsers."""
    run = commands.add_parser("run", help="start N copies of a training script on this machine (torchrun-like)")
    run.add_argument("--nproc", type=int, required=True, metavar="N", help="copies of the script to start")
    run.add_argument("--master", metavar="HOST:PORT",
                     help="the run's master (default: start one on loopback, on a free port)")
    run.add_argument("--grace", type=float, default=5.0, metavar="SECONDS",
                     help="after SIGTERM, seconds before the copies still running get SIGKILL (default %(default)s)")
    run.add_argument("script", metavar="SCRIPT", help="the Python script each copy runs")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")


class _Stopped(Exception):
    """The launcher got SIGTERM (SIGINT arrives as KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _loopback_master(token: str | None) -> Iterator[str]:
    """A master on 127.0.0.1 (a free port) on a Trio loop in a background thread; yields its
    address and stops it on exit."""
    started: concurrent.futures.Future[tuple[str, trio.lowlevel.TrioToken]] = concurrent.futures.Future()
    stop = trio.CancelScope()

    async def serve() -> None:
        try:
            with stop:
                async with open_master("127.0.0.1:0", token=token, config=Config()) as master:
                    started.set_result((master.address, trio.lowlevel.current_trio_token()))
                    await trio.sleep_forever()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            else:
                raise

    thread = threading.Thread(target=trio.run, args=(serve,), name="pccl-run-master", daemon=True)
    thread.start()
    address, trio_token = started.result()
    try:
        yield address
    finally:
        try:
            trio.from_thread.run_sync(stop.cancel, trio_token=trio_token)
        except trio.RunFinishedError:
            pass
        thread.join(10)


class _Copy:
    """One copy of the script, its output relayed with its prefix."""

    def __init__(self, index: int, cmd: list[str], env: dict[str, str], lock: threading.Lock) -> None:
        self.index = index
        self.popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE)
        self.reported = False
        prefix = f"[{index}] ".encode()
        assert self.popen.stdout is not None and self.popen.stderr is not None
        self.relays = [threading.Thread(target=_relay, args=(source, sink, prefix, lock), daemon=True)
                       for source, sink in ((self.popen.stdout, sys.stdout), (self.popen.stderr, sys.stderr))]
        for relay in self.relays:
            relay.start()

    def status(self) -> int:
        """The exit status as a shell reports it (``128 + signal`` when killed by one)."""
        code = self.popen.returncode
        assert code is not None
        return 128 - code if code < 0 else code


def _relay(source: IO[bytes], sink: IO[str], prefix: bytes, lock: threading.Lock) -> None:
    """Copy ``source``'s lines to ``sink`` with ``prefix`` (whole lines, under ``lock``)."""
    out = sink.buffer if hasattr(sink, "buffer") else None
    for line in source:
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            if out is not None:
                sink.flush()
                out.write(prefix + line)
                out.flush()
            else:  # a text-only stream (a test's capture)
                sink.write((prefix + line).decode(errors="replace"))
                sink.flush()
    source.close()


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped(signum)


def _stop(copies: list[_Copy], grace: float, *, own_exit: float = 0.0) -> None:
    """Give the copies ``own_exit`` seconds to exit by themselves (after a Ctrl-C in a terminal
    they got the SIGINT too, and a pccl peer leaves its run cleanly on it), then SIGTERM every
    copy still running and SIGKILL those left after ``grace`` seconds."""
    deadline = time.monotonic() + own_exit
    while time.monotonic() < deadline and any(copy.popen.poll() is None for copy in copies):
        time.sleep(_POLL)
    for copy in copies:
        if copy.popen.poll() is None:
            copy.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for copy in copies:
        try:
            copy.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("pccl run: copy %d did not stop within %g s of SIGTERM: killing it", copy.index, grace)
            copy.popen.kill()
            copy.popen.wait()


def _supervise(copies: list[_Copy], received: list[int]) -> int:
    """Wait for every copy to exit (reporting each); return the run's status.  A signal the
    handlers recorded in ``received`` is raised here, at a safe point (KeyboardInterrupt for
    SIGINT, :class:`_Stopped` for SIGTERM), never in the middle of a ``Popen.poll()``."""
    failed: int | None = None
    while True:
        if received:
            if received[0] == signal.SIGINT:
                raise KeyboardInterrupt
            raise _Stopped(received[0])
        running = 0
        for copy in copies:
            if copy.popen.poll() is None:
                running += 1
            elif not copy.reported:
                copy.reported = True
                status = copy.status()
                if status:
                    code = copy.popen.returncode
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                    log.warning("pccl run: copy %d %s; the others go on", copy.index, how)
                    failed = status if failed is None else failed
        if not running:
            return failed or 0
        time.sleep(_POLL)


def _launch(args: argparse.Namespace, master: str) -> int:
    env = dict(os.environ)
    env.update(PCCL_MASTER=master, WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    lock = threading.Lock()
    copies: list[_Copy] = []
    # While copies run, SIGINT and SIGTERM are only recorded, and acted on by _supervise: an
    # exception raised by a handler could land inside Popen.poll() while it holds the Popen's
    # wait lock, after which that copy never looks exited (the launcher then hung on SIGINT).
    received: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: received.append(signum))
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(args.nproc):
            cmd = [sys.executable, args.script, *args.args]
            copies.append(_Copy(i, cmd, {**env, "RANK": str(i), "LOCAL_RANK": str(i)}, lock))
        status = _supervise(copies, received)
    except KeyboardInterrupt:
        log.info("pccl run: interrupted; stopping %d copies", sum(c.popen.poll() is None for c in copies))
        _stop(copies, args.grace, own_exit=min(args.grace, _OWN_EXIT))
        status = 128 + signal.SIGINT
    except _Stopped as stopped:
        log.info("pccl run: %s; stopping %d copies", stopped, sum(c.popen.poll() is None for c in copies))
        _stop(copies, args.grace)
        status = 128 + stopped.signum
    finally:
        _stop(copies, args.grace)  # nothing left running, whatever happened
        for copy in copies:
            for relay in copy.relays:
                relay.join(5)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status


def run_launcher(args: argparse.Namespace) -> int:
    """``pccl run``: returns the exit status (2 for bad arguments).  Call from the main thread:
    SIGTERM is handled there for the duration of the call."""
    if args.nproc < 1:
        log.error("pccl run: --nproc must be at least 1, got %d", args.nproc)
        return 2
    if not os.path.isfile(args.script):
        log.error("pccl run: no such script: %s", args.script)
        return 2
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        if args.master:
            return _launch(args, args.master)
        with _loopback_master(os.environ.get("PCCL_TOKEN") or None) as master:
            log.info("pccl run: starting %d copies of %s (master %s)", args.nproc, args.script, master)
            return _launch(args, master)
    except _Stopped as stopped:  # before any copy started
        return 128 + stopped.signum
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        signal.signal(signal.SIGTERM, previous)
