"""The examples, run as a user runs them: a master and three processes of the example on real TCP.

Each run SIGKILLs one process once it and the others are training (wherever in its step the kill
lands), and checks that the survivors finish every step with bit-identical weights (each example
prints ``done: step N weights HASH`` at the end).  The DiLoCo examples also survive their master:
a ``pccl master`` process SIGKILLed mid-run and started again on the same port; every peer
finishes.  Streaming DiLoCo also takes in a fresh process mid-run, which must finish in
lockstep with the same weights.  The longest runs are marked slow.  Step counts are small; the
examples' defaults train for real.
"""

from __future__ import annotations

import pathlib
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

import pccl
from child_process import Child
from pccl.testing import master_in_thread
from pccl.tools.bench import free_port

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
CONFIG = pccl.Config(peer_timeout=3.0, heartbeat_interval=0.3)
BOUND = 150.0
#: Outer steps of the master-restart runs: the steps after the restart must outlast the longest
#: reconnection backoff (Config.master_reconnect_backoff: up to 2 s, jittered to 3 s), or a peer
#: whose retry comes late finds the others finished and waits alone for ever.
RESTART_STEPS = 60


class _Proc(Child):
    def __init__(self, name: str, cmd: list[str]) -> None:
        self.step = 0
        super().__init__(name, cmd)

    def on_line(self, line: str) -> None:
        found = re.match(r"(?:outer )?step (\d+)", line)
        if found:
            self.step = max(self.step, int(found.group(1)))

    def done(self) -> tuple[int, str] | None:
        for line in self.lines:
            found = re.match(r"done: step (\d+) weights ([0-9a-f]+)", line)
            if found:
                return int(found.group(1)), found.group(2)
        return None


def _wait_until(procs: list[_Proc], ready: Callable[[], bool], deadline: float) -> None:
    """Poll the processes' output until ``ready()``; fail if one exits or time runs out."""
    while not ready():
        assert time.monotonic() < deadline, "\n".join(p.output() for p in procs)
        assert all(p.popen.poll() is None for p in procs), "\n".join(p.output() for p in procs)
        time.sleep(0.02)


def _finish(finishers: list[_Proc], procs: list[_Proc], steps: int, deadline: float) -> str:
    """Wait for ``finishers`` to exit; each must have finished every step, all with the same
    weights.  Returns the report of every process (for further assertions)."""
    for p in finishers:
        try:
            p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{p.name} did not finish in time\n" + "\n".join(q.output() for q in procs)) from None
        p.thread.join(10)
    report = "\n".join(p.output() for p in procs)
    finals = [p.done() for p in finishers]
    assert all(p.popen.returncode == 0 for p in finishers), report
    assert all(f is not None and f[0] == steps for f in finals), report
    assert len({f[1] for f in finals if f is not None}) == 1, report  # bit-identical weights
    return report


def _kill_all(procs: list[_Proc]) -> None:
    for p in procs:
        if p.popen.poll() is None:
            p.popen.kill()
        p.popen.wait(10)


def _run(script: str, steps: int, *args: str, peers: int = 3, kill_at: int = 2,
         warm: pathlib.Path | None = None) -> list[_Proc]:
    """``warm``: a file path; each peer imports torch first (``warm_start.py``) and all start
    the script together once every one has (a peer still importing torch under load joined
    two that had run every step meanwhile: the kill came after the end)."""
    with master_in_thread(CONFIG) as master:
        cmd = [sys.executable, str(EXAMPLES / script), "--master", master.address, *args]
        if warm is not None:
            cmd[1:1] = [str(pathlib.Path(__file__).with_name("warm_start.py")), str(warm)]
        procs = [_Proc(f"peer{i}", cmd) for i in range(peers)]
        try:
            deadline = time.monotonic() + BOUND
            if warm is not None:
                _wait_until(procs, lambda: all("warm" in p.lines for p in procs), deadline)
                warm.touch()
            # every process is in and training (or the first has gone past kill_at with the others in)
            _wait_until(procs, lambda: all(p.step >= 1 for p in procs) and max(p.step for p in procs) >= kill_at,
                        deadline)
            victim = max(procs, key=lambda p: p.step)
            assert victim.step < steps, "the run finished before the kill: raise the step count"
            victim.popen.send_signal(signal.SIGKILL)
            report = _finish([p for p in procs if p is not victim], procs, steps, deadline)
            assert victim.popen.wait(10) == -signal.SIGKILL
            assert victim.done() is None, report
            return procs
        finally:
            _kill_all(procs)


def _run_with_master_restart(script: str, steps: int, *args: str, peers: int = 3, kill_at: int = 2) -> None:
    address = f"127.0.0.1:{free_port()}"
    masters: list[_Proc] = []

    def start_master() -> _Proc:
        master = _Proc("master", [sys.executable, "-m", "pccl", "master", "--listen", address, "--peer-timeout",
                                  str(CONFIG.peer_timeout), "--heartbeat-interval", str(CONFIG.heartbeat_interval)])
        masters.append(master)
        # The peers would wait for it (Config.master_wait_timeout), but this run is about a restart.
        _wait_until([master], lambda: any("master listening on" in line for line in master.lines),
                    time.monotonic() + 30)
        return master

    procs: list[_Proc] = []
    try:
        master = start_master()
        cmd = [sys.executable, str(EXAMPLES / script), "--master", address, *args]
        procs = [_Proc(f"peer{i}", cmd) for i in range(peers)]
        deadline = time.monotonic() + BOUND
        _wait_until(procs, lambda: all(p.step >= kill_at for p in procs), deadline)
        assert max(p.step for p in procs) < steps, "the run finished before the kill: raise the step count"
        master.popen.send_signal(signal.SIGKILL)
        master.popen.wait(10)
        time.sleep(1.0)  # the peers notice and retry meanwhile
        start_master()
        report = _finish(procs, procs + masters, steps, deadline)
        assert all(any("lost the connection to the master" in line for line in p.lines) for p in procs), report
    finally:
        _kill_all(procs + masters)


def test_hello_world() -> None:
    _run("hello_world.py", 60, "--steps", "60", "--size", "200000")


def test_hello_world_blocking() -> None:
    _run("hello_world_blocking.py", 60, "--steps", "60", "--size", "200000")


def test_ddp(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    # warm: under load one peer still importing torch saw the other two run all 80 steps and leave.
    procs = _run("ddp.py", 80, "--steps", "80", "--peer-timeout", "3", warm=tmp_path / "go")
    losses = [float(x) for p in procs for x in re.findall(r"loss ([0-9.]+)", "\n".join(p.lines))]
    assert losses and min(losses[-5:]) < losses[0]  # it learns


def test_diloco(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("torch")
    _run("diloco.py", 6, "--outer-steps", "6", "--inner-steps", "4", "--peer-timeout", "3", "--quant", "u8",
         warm=tmp_path / "go")


# Slow (~15 s): diloco.py's run above has the same loop shape with a SIGKILLed peer.
@pytest.mark.slow
def test_async_diloco() -> None:
    pytest.importorskip("torch")
    # 12 outer steps: peers in lockstep pass 2 -> 6 within a few polls of the test on a fast run
    _run("async_diloco.py", 12, "--outer-steps", "12", "--inner-steps", "4", "--peer-timeout", "3")


# Slow: 60 outer steps of three torch processes (~45 s), as the async variant below.
@pytest.mark.slow
def test_diloco_survives_a_master_restart() -> None:
    pytest.importorskip("torch")
    _run_with_master_restart("diloco.py", RESTART_STEPS, "--outer-steps", str(RESTART_STEPS), "--inner-steps", "4",
                             "--peer-timeout", "3")


# Slow: 60 outer steps of three torch processes (~40-70 s).  The default run's master restarts
# with real processes are tests/e2e/test_master_restart.py's and the lineage tests'.
@pytest.mark.slow
def test_async_diloco_survives_a_master_restart() -> None:
    # Before the loop was built on comm.steps(): after the restart every peer went on alone
    # (world 1, three different weights) and one was kicked (STRATEGY_VIOLATION).
    pytest.importorskip("torch")
    _run_with_master_restart("async_diloco.py", RESTART_STEPS, "--outer-steps", str(RESTART_STEPS), "--inner-steps", "4",
                             "--peer-timeout", "3")


#: A small Streaming DiLoCo: 2 fragments of a one-layer model, each outer step one inner step
#: overlapping the fragment's all-reduce.
STREAMING = ["--inner-steps", "2", "--fragments", "2", "--overlap", "1", "--width", "32", "--layers", "1",
             "--context", "32", "--batch", "8", "--eval-batches", "1", "--peer-timeout", "3"]


def _eval_losses(proc: _Proc) -> list[float]:
    return [float(x) for x in re.findall(r"eval loss ([0-9.]+)", "\n".join(proc.lines))]


def _streaming_with_a_newcomer(steps: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three peers of streaming_diloco.py and a fresh fourth one joining at outer step 2; once it
    trains with them, one of the three is SIGKILLed: the two survivors and the newcomer finish
    every step with the same weights, the newcomer received the state and trained in lockstep,
    and the evaluation loss fell.

    The newcomer's interpreter is started with the others and imports torch meanwhile
    (``warm_start.py``).  The kill waits for the newcomer to be in: killing first let the
    survivors, at a few hundredths of a second per step, finish all their steps under load before
    the newcomer had registered (it then waited alone)."""
    go = tmp_path / "go"
    script = str(EXAMPLES / "streaming_diloco.py")
    args = ["--outer-steps", str(steps), *STREAMING]
    with master_in_thread(CONFIG) as master:
        monkeypatch.setenv("PCCL_MASTER", master.address)  # no --master: the example reads it
        procs = [_Proc(f"peer{i}", [sys.executable, script, *args]) for i in range(3)]
        newcomer = _Proc("newcomer", [sys.executable, str(pathlib.Path(__file__).with_name("warm_start.py")), str(go),
                                      script, *args])
        everyone = [*procs, newcomer]
        try:
            deadline = time.monotonic() + BOUND
            _wait_until(everyone, lambda: all(p.step >= 1 for p in procs) and max(p.step for p in procs) >= 2,
                        deadline)
            go.touch()
            _wait_until(everyone, lambda: newcomer.step >= 1, deadline)
            victim = max(procs, key=lambda p: p.step)
            # 30 steps after the kill at least: the newcomer trains on with the survivors
            assert victim.step <= steps - 30, ("the run went too far before the kill: raise the step count\n"
                                               + "\n".join(p.output() for p in everyone))
            victim.popen.send_signal(signal.SIGKILL)
            survivors = [p for p in procs if p is not victim]
            report = _finish([*survivors, newcomer], everyone, steps, deadline)
            assert victim.popen.wait(10) == -signal.SIGKILL and victim.done() is None, report
            # the newcomer received the state in its first sync and took part in the steps after it
            first = next(line for line in newcomer.lines if line.startswith("outer step"))
            assert int(re.search(r"synced (\d+) B", first).group(1)) > 0, report  # type: ignore[union-attr]
            assert re.search(r"world 3,", newcomer.lines[-2]), report
            for p in [*survivors, newcomer]:
                losses = _eval_losses(p)
                assert losses[-1] < losses[0], report
        finally:
            _kill_all(everyone)


# Slow: four torch processes take ~16 s or more on a 2-core box (over the default run's budget).
@pytest.mark.slow
def test_streaming_diloco_goes_on_after_a_kill_and_takes_a_newcomer(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    # 150 steps of a few hundredths of a second: a newcomer that takes seconds to start under load
    # still joins with dozens of steps to go.
    _streaming_with_a_newcomer(150, tmp_path, monkeypatch)


def _pipeline_run(tmp_path: pathlib.Path, victim_stage: int) -> None:
    """pipeline.py's two stages; once both train, stage ``victim_stage`` is SIGKILLed in the
    middle of its compute (its ``--delay`` is long, the other's short, and the kill comes a
    little after it printed a step), while the other stage waits in a receive from it; the
    victim is then started again with the same command.  The waiting receive fails with
    PeerDisconnected, the survivor waits for the newcomer, and both finish every step with the
    weights the one-process ``--local`` run computes."""
    steps = 40
    args = ["--steps", str(steps), "--checkpoint-dir", str(tmp_path), "--peer-timeout", "3"]
    local = subprocess.run([sys.executable, str(EXAMPLES / "pipeline.py"), "--local", *args], capture_output=True,
                           text=True, timeout=60, check=True)
    expected = sorted(line for line in local.stdout.splitlines() if line.startswith("done:"))
    with master_in_thread(CONFIG) as master:
        def start(stage: int, name: str) -> _Proc:
            delay = "0.2" if stage == victim_stage else "0.01"
            return _Proc(name, [sys.executable, str(EXAMPLES / "pipeline.py"), "--master", master.address,
                                "--stage", str(stage), "--delay", delay, *args])

        procs = [start(0, "stage0"), start(1, "stage1")]
        everyone = list(procs)
        try:
            deadline = time.monotonic() + BOUND
            _wait_until(procs, lambda: all(p.step >= 3 for p in procs), deadline)
            victim, survivor = procs[victim_stage], procs[1 - victim_stage]
            time.sleep(0.05)  # into the victim's compute of its next step
            assert victim.step < steps - 10, "the run went too far before the kill: raise the step count"
            victim.popen.send_signal(signal.SIGKILL)
            assert victim.popen.wait(10) == -signal.SIGKILL
            restarted = start(victim_stage, f"stage{victim_stage}-restarted")
            everyone.append(restarted)
            finishers = [survivor, restarted]
            for p in finishers:
                p.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
                p.thread.join(10)
            report = "\n".join(p.output() for p in everyone)
            assert all(p.popen.returncode == 0 for p in finishers), report
            lost = [line for line in survivor.lines if "lost the other stage" in line]
            assert len(lost) == 1 and "(PeerDisconnected)" in lost[0], report + f"\n{lost}"
            assert any("resumed at step" in line for line in restarted.lines), report
            finals = sorted(line for p in finishers for line in p.lines if line.startswith("done:"))
            assert finals == expected, report
        finally:
            _kill_all(everyone)


@pytest.mark.parametrize("victim_stage", [0, 1])
def test_pipeline_survives_a_restarted_stage(tmp_path: pathlib.Path, victim_stage: int) -> None:
    _pipeline_run(tmp_path, victim_stage)
