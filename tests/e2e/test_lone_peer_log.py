"""The tutorial's scripts and the examples show pccl's INFO lines with their time, so a peer
started before its master says it waits for it, and a lone peer says it waits for another one
(issue 33: both used to sit there silently).  Run as a user runs them, on real TCP, the peer
first and the master a moment later."""

from __future__ import annotations

import pathlib
import re
import sys
import time

import pytest

from child_process import Child
from pccl.tools.bench import free_port

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIGHT = ["examples/hello_world.py", "examples/hello_world_blocking.py", "docs/code/first_run.py",
         "docs/code/blocking_loop.py"]
#: Scripts that import torch (slow to start): only checked to configure logging the same way.
HEAVY = ["examples/ddp.py", "examples/ddp_torch.py", "examples/diloco.py", "examples/async_diloco.py",
         "examples/streaming_diloco.py", "examples/hybrid_diloco.py", "docs/code/diloco.py",
         "docs/code/streaming_diloco.py"]
STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
LOGGING_LINE = 'logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")'


def _wait_for(procs: list[Child], pattern: str, deadline: float) -> None:
    peer = procs[0]
    while not any(re.fullmatch(pattern, line) for line in peer.lines):
        report = "\n".join(p.output() for p in procs)
        assert time.monotonic() < deadline, f"no line matching {pattern!r}\n{report}"
        assert all(p.popen.poll() is None for p in procs), report
        time.sleep(0.05)


@pytest.mark.parametrize("script", LIGHT)
def test_a_peer_started_first_says_it_waits_for_the_master_then_for_a_partner(script: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    peer = Child("peer", [sys.executable, "-P", str(ROOT / script), "--master", address, "--steps", "3"])
    procs = [peer]
    try:
        deadline = time.monotonic() + 60
        _wait_for(procs, rf"{STAMP} INFO pccl\._peer\.reconnect: waiting for the master at {re.escape(address)} .*",
                  deadline)
        time.sleep(0.5)  # a few more attempts: still one line
        procs.append(Child("master", [sys.executable, "-P", "-m", "pccl", "master", "--listen", address]))
        _wait_for(procs, rf"{STAMP} INFO pccl\.communicator: peer [0-9a-f]+ is alone in group 0: waiting for "
                         r"another peer to join", deadline)
        assert sum("waiting for the master" in line for line in peer.lines) == 1, peer.output()
    finally:
        for p in procs:
            p.popen.kill()
            p.popen.wait(10)


@pytest.mark.parametrize("script", LIGHT + HEAVY)
def test_every_training_script_shows_the_info_lines_with_their_time(script: str) -> None:
    assert LOGGING_LINE in (ROOT / script).read_text()
