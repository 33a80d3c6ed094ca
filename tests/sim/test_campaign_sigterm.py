"""``pccl-sim campaign`` on worker processes stopped by SIGTERM (``kill``, a batch scheduler's
time limit) ends as Ctrl-C does: the outstanding seeds cancelled, the finished ones' results
written, exit 143."""

from __future__ import annotations

import json
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time

PROGRAM = "import sys; from pccl_sim.tools.cli import main; sys.exit(main(sys.argv[1:]))"


def test_sigterm_stops_a_campaign_and_keeps_the_finished_seeds(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "campaign.json"
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, "campaign", "--seeds", "0..49", "--workers", "2",
                             "--scenario", "toy-echo", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # the progress bar (no terminal: a line each tenth or quiet minute) shows seeds finished
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if "/50 seeds" in line:
                break
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)  # every line up to the end of stderr is queued
    err = "".join(lines.queue)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "terminated (SIGTERM)" in err and "the others cancelled" in err, err
    document = json.loads(out.read_text())
    assert document["summary"]["complete"] is False
    finished = [r["seed"] for r in document["seeds"]]
    assert 1 <= len(finished) < 50 and all(r["passed"] for r in document["seeds"])


def test_a_campaign_killed_outright_keeps_the_seeds_saved_while_it_ran(tmp_path: pathlib.Path) -> None:
    """``--save-every``: the JSON is rewritten while the campaign runs, so SIGKILL (nothing of the
    campaign runs after it) of a campaign in this process (``--workers 1``, where SIGTERM keeps its
    default action too) leaves the seeds finished before the last save, marked incomplete."""
    out = tmp_path / "campaign.json"
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, "campaign", "--seeds", "0..199", "--workers", "1",
                             "--scenario", "toy-echo", "--json", str(out), "--save-every", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not out.exists():
            assert proc.poll() is None, "the campaign ended before it saved"
            assert time.monotonic() < deadline, "no results saved while the campaign ran"
            time.sleep(0.05)
        proc.kill()
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    document = json.loads(out.read_text())
    assert document["summary"]["complete"] is False
    finished = [r["seed"] for r in document["seeds"]]
    assert 1 <= len(finished) < 200 and finished == sorted(finished) and all(r["passed"] for r in document["seeds"])
