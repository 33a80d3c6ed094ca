"""``pccl run``: the environment and output of its copies, a copy that dies, Ctrl-C and SIGTERM,
and a real example run through it (its peers find the master through ``$PCCL_MASTER``)."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest


HERE = pathlib.Path(__file__).resolve().parent
CHILD = str(HERE / "run_child.py")
EXAMPLES = HERE.parents[1] / "examples"


def _pccl_run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pccl", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_copies_get_the_master_token_and_rank_and_their_output_is_prefixed() -> None:
    env = {**os.environ, "PCCL_TOKEN": "run-token"}
    done = _pccl_run("--nproc", "3", CHILD, "--sleep", "0.1", env=env)
    assert done.returncode == 0, done.stderr
    started = re.search(r"master listening on (127\.0\.0\.1:\d+)", done.stderr)
    assert started, done.stderr
    for rank in range(3):
        assert f"[{rank}] env {started.group(1)} run-token {rank} 3" in done.stdout.splitlines(), done.stdout
        assert f"[{rank}] bye" in done.stdout.splitlines(), done.stdout
        assert f"[{rank}] stderr line" in done.stderr.splitlines(), done.stderr


def test_a_given_master_is_used_and_none_started() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PCCL_TOKEN"}
    done = _pccl_run("--nproc", "2", "--master", "10.1.2.3:4567", CHILD, env=env)
    assert done.returncode == 0, done.stderr
    assert "master listening" not in done.stderr
    assert {"[0] env 10.1.2.3:4567 - 0 2", "[1] env 10.1.2.3:4567 - 1 2"} <= set(done.stdout.splitlines())


def test_a_copy_that_dies_does_not_stop_the_others_and_sets_the_status() -> None:
    done = _pccl_run("--nproc", "3", CHILD, "--fail-rank", "1", "--sleep", "1.0")
    assert done.returncode == 3, done.stderr
    assert "copy 1 exited with status 3" in done.stderr
    lines = done.stdout.splitlines()
    assert "[0] bye" in lines and "[2] bye" in lines and "[1] bye" not in lines, done.stdout


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_launcher_stops_every_copy(tmp_path: pathlib.Path, signum: signal.Signals) -> None:
    launcher = subprocess.Popen([sys.executable, "-m", "pccl", "run", "--nproc", "3", CHILD, "--sleep", "120",
                                 "--pid-dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("[0-9]"))) < 3:
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        pids = [int(p.read_text()) for p in tmp_path.glob("[0-9]")]
        launcher.send_signal(signum)  # to the launcher alone, as `kill` does (Ctrl-C reaches all)
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signum, err
        for pid in pids:  # every copy was stopped and reaped
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)


def test_an_example_runs_under_pccl_run() -> None:
    # hello_world_blocking.py finds the master through $PCCL_MASTER (no --master).
    done = _pccl_run("--nproc", "2", str(EXAMPLES / "hello_world_blocking.py"), "--steps", "5", "--size", "1000",
                     timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    finals = re.findall(r"^\[(\d)\] done: step (\d+) weights ([0-9a-f]+)", done.stdout, re.M)
    assert sorted(r for r, _, _ in finals) == ["0", "1"], done.stdout
    assert len({(s, w) for _, s, w in finals}) == 1, done.stdout


def test_ctrl_c_in_a_terminal_lets_the_copies_exit_on_their_own() -> None:
    # A terminal's Ctrl-C reaches the whole process group: the copies get their own SIGINT (a
    # pccl peer leaves its run cleanly on it), and the launcher waits for that before SIGTERM.
    launcher = subprocess.Popen([sys.executable, "-m", "pccl", "run", "--nproc", "2", CHILD, "--sleep", "120"],
                                start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert launcher.stdout is not None
        started = 0
        while started < 2:
            line = launcher.stdout.readline()
            assert line, "the launcher ended early"
            started += " env " in line
        os.killpg(launcher.pid, signal.SIGINT)
        out, _ = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGINT, out
        lines = out.splitlines()
        assert "[0] KeyboardInterrupt" in lines and "[1] KeyboardInterrupt" in lines, out  # not cut by SIGTERM
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
