"""torch's DDP through ``pccl.torch.DistributedDataParallel``, as ``examples/ddp_torch.py`` runs it.

Three processes train (a master on a thread of the test, real TCP, three buckets per backward);
one is SIGKILLed mid-run — wherever in its step the kill lands, mid-backward included — and a
fresh process joins, building its DDP alone while the others train.  The two survivors and the
newcomer finish every step with bit-identical parameters, and the loss falls.
"""

from __future__ import annotations

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

HERE = pathlib.Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "ddp_torch.py"
CONFIG = pccl.Config(peer_timeout=3.0, heartbeat_interval=0.3)
BOUND = 200.0  # a loaded 2-core runner takes tens of seconds to start four torch processes


class _Peer(Child):
    def __init__(self, name: str, cmd: list[str]) -> None:
        self.step = 0
        super().__init__(name, cmd)

    def on_line(self, line: str) -> None:
        found = re.match(r"step (\d+)", line)
        if found:
            self.step = max(self.step, int(found.group(1)))

    def losses(self) -> list[float]:
        return [float(x) for x in re.findall(r"^step \d+: .* loss ([0-9.]+)", "\n".join(self.lines), re.M)]

    def done(self) -> tuple[int, str] | None:
        for line in self.lines:
            found = re.match(r"done: step (\d+) weights ([0-9a-f]+)", line)
            if found:
                return int(found.group(1)), found.group(2)
        return None


def _report(peers: list[_Peer]) -> str:
    return "\n".join(p.output() for p in peers)


def _wait_for(peers: list[_Peer], ready: object, deadline: float) -> None:
    assert callable(ready)
    while not ready():
        assert time.monotonic() < deadline, _report(peers)
        assert all(p.popen.poll() is None for p in peers), _report(peers)
        time.sleep(0.02)


# Four processes import torch (about 30 s of CPU on a 2-core runner): slow; the default run has
# the in-process tests of tests/e2e/test_torch_ddp_inproc.py.
@pytest.mark.slow
def test_ddp_survives_a_kill_and_takes_a_newcomer(tmp_path: pathlib.Path) -> None:
    steps = 150
    go = tmp_path / "go"
    with master_in_thread(CONFIG) as master:
        # --step-delay paces the run so that the newcomer joins long before the others reach the
        # last step; --bucket-mb makes three buckets.
        cmd = [sys.executable, str(EXAMPLE), "--master", master.address, "--steps", str(steps), "--step-delay",
               "0.04", "--bucket-mb", "0.001", "--peer-timeout", str(CONFIG.peer_timeout)]
        peers = [_Peer(f"peer{i}", cmd) for i in range(3)]
        # A fresh process, its torch imported meanwhile; it opens its communicator after the kill.
        newcomer = _Peer("newcomer", [sys.executable, str(HERE / "late_joiner.py"), str(go), *cmd[1:]])
        try:
            deadline = time.monotonic() + BOUND
            _wait_for(peers + [newcomer], lambda: all(p.step >= 1 for p in peers) and max(p.step for p in peers) >= 5
                      and "late joiner: ready" in newcomer.lines, deadline)
            victim = max(peers, key=lambda p: p.step)
            killed_at = victim.step
            assert killed_at < steps // 2, "the newcomer was ready late: raise the step count"
            victim.popen.send_signal(signal.SIGKILL)
            go.touch()
            peers.append(newcomer)
            finishers = [p for p in peers if p is not victim]
            for p in finishers:
                try:
                    p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise AssertionError(f"{p.name} did not finish in time\n{_report(peers)}") from None
                p.thread.join(10)
            report = _report(peers)
            assert victim.popen.wait(10) == -signal.SIGKILL
            assert all(p.popen.returncode == 0 for p in finishers), report
            finals = [p.done() for p in finishers]
            assert all(f is not None and f[0] == steps for f in finals), report
            assert len({f[1] for f in finals if f is not None}) == 1, report  # bit-identical parameters
            # The newcomer trained with the others from a step after the kill, not from the start.
            first = newcomer.losses()
            assert first and len(first) < steps - killed_at, report
            assert any(re.match(r"step \d+: world 3", line) for line in newcomer.lines), report
            for p in finishers[:2]:
                losses = p.losses()
                assert sum(losses[-10:]) / 10 < sum(losses[:10]) / 10, report  # it learns
        finally:
            for p in {id(p): p for p in [*peers, newcomer]}.values():
                if p.popen.poll() is None:
                    p.popen.kill()
                p.popen.wait(10)
