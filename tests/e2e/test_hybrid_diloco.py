"""``examples/hybrid_diloco.py``: two sites of two processes (each site one ``pccl run --nproc 2``,
gloo inside it), pccl across them, one peer group per local rank.

One process of site A is SIGKILLed once both sites train together: the other process of site A
sees its gloo collective fail and leaves the run (``site lost``), and site B finishes every outer
step, its two processes all-gathering bit-identical weights.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

import pccl
from child_process import Child
from pccl.testing import master_in_thread

pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hybrid_diloco.py"
CONFIG = pccl.Config(peer_timeout=3.0, heartbeat_interval=0.3)
BOUND = 200.0  # a loaded 2-core runner takes tens of seconds to start four torch processes


class _Site(Child):
    """One site: a ``pccl run --nproc 2`` launcher; its copies' lines are prefixed ``[rank] ``."""

    def __init__(self, name: str, cmd: list[str]) -> None:
        self.pids: dict[int, int] = {}
        self.steps: dict[int, int] = {0: 0, 1: 0}
        super().__init__(name, cmd)

    def on_line(self, line: str) -> None:
        found = re.match(r"\[(\d)\] local rank \d of \d: pid (\d+)", line)
        if found:
            self.pids[int(found.group(1))] = int(found.group(2))
        found = re.match(r"\[(\d)\] outer step (\d+): twins (\d)", line)
        if found and found.group(3) == "2":
            self.steps[int(found.group(1))] = int(found.group(2))

    def done(self) -> dict[int, tuple[int, str]]:
        finals = {}
        for line in self.lines:
            found = re.match(r"\[(\d)\] done: step (\d+) weights ([0-9a-f]+)", line)
            if found:
                finals[int(found.group(1))] = (int(found.group(2)), found.group(3))
        return finals


# Four processes import torch and set up gloo (about 30 s of CPU, more than a 2-core runner
# gives a default-run test).
@pytest.mark.slow
def test_a_killed_process_takes_its_site_out_and_the_other_site_finishes() -> None:
    steps = 60
    with master_in_thread(CONFIG) as master:
        cmd = [sys.executable, "-m", "pccl", "run", "--nproc", "2", "--master", master.address, str(EXAMPLE),
               "--outer-steps", str(steps), "--inner-steps", "3", "--peer-timeout", str(CONFIG.peer_timeout),
               "--site-timeout", "30"]
        sites = [_Site("site A", cmd), _Site("site B", cmd)]
        a, b = sites
        report = lambda: "\n".join(s.output(60) for s in sites)  # noqa: E731
        try:
            deadline = time.monotonic() + BOUND
            # both sites train together (twins 2 in every group)
            while min(min(s.steps.values()) for s in sites) < 2:
                assert time.monotonic() < deadline, report()
                assert all(s.popen.poll() is None for s in sites), report()
                time.sleep(0.02)
            assert max(max(s.steps.values()) for s in sites) < steps, "the run ended before the kill: more steps"
            os.kill(a.pids[1], signal.SIGKILL)
            for site in sites:
                try:
                    site.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{site.name} did not finish in time\n{report()}") from None
                site.thread.join(10)
            finals = b.done()
            assert b.popen.returncode == 0, report()
            assert set(finals) == {0, 1} and {f[0] for f in finals.values()} == {steps}, report()
            assert len({f[1] for f in finals.values()}) == 1, report()  # the site's ranks agree bit for bit
            assert any(line.startswith("[0] site lost:") for line in a.lines), report()
            assert a.popen.returncode != 0 and not a.done(), report()  # killed (137) or left (1)
        finally:
            for site in sites:
                if site.popen.poll() is None:
                    site.popen.send_signal(signal.SIGTERM)  # the launcher stops its copies
                    try:
                        site.popen.wait(15)
                    except subprocess.TimeoutExpired:
                        site.popen.kill()
                        site.popen.wait(10)
