"""The process-level chaos test: ``pccl demo --chaos`` on real TCP with real OS processes.

The driver SIGKILLs peer processes at arbitrary moments of their training loop (inside syncs,
all-reduces, topology updates — wherever the kill lands) and starts newcomers; the run must
still finish with every surviving peer holding bit-identical weights, and newcomers must have
downloaded the state at their first sync.
"""

from __future__ import annotations

import re
import subprocess
import sys


def _run_demo(*extra: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pccl", "demo", "--size", "50000", *extra],
        capture_output=True, text=True, timeout=timeout,
    )


def test_demo_without_chaos_ends_bit_identical() -> None:
    result = _run_demo("--peers", "3", "--steps", "8", "--step-time", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all surviving peers hold bit-identical weights" in result.stdout
    assert re.search(r"\[peer\d\] joined \(world \d\)", result.stdout) and "{'event'" not in result.stdout
    hashes = set(re.findall(r"weights hash ([0-9a-f]{32})", result.stdout))
    assert len(hashes) == 1
    # No one diverged, so no sync moved bytes — except a peer's first one, when its process
    # started late and the others were already training (the demo does not wait for everyone).
    per_peer: dict[str, list[int]] = {}
    for peer, rx in re.findall(r"\[(peer\d+)\] step +\d+ .*?sync rx +(\d+) B", result.stdout):
        per_peer.setdefault(peer, []).append(int(rx))
    assert len(per_peer) == 3, result.stdout
    for peer, received in per_peer.items():
        assert not any(received[1:]), f"{peer} downloaded state after its first step: {received}"


def test_demo_survives_sigkilled_peers() -> None:
    result = _run_demo("--peers", "3", "--steps", "40", "--step-time", "0.05",
                       "--chaos", "--chaos-interval", "0.6", "--seed", "3")
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    kills = re.findall(r"SIGKILL (peer\d+)", out)
    assert kills, out  # the chaos actually killed something
    assert "all surviving peers hold bit-identical weights" in out
    done = re.findall(r"\[(peer\d+)\] done at step 40, weights hash ([0-9a-f]{32})", out)
    assert len(done) >= 2 and len({h for _, h in done}) == 1
    assert not {name for name, _ in done} & set(kills)  # the killed never report
    # Newcomers fetched the popular state at their first sync.
    assert re.search(r"sync rx +[1-9]\d* B", out), out


def test_demo_refuses_bad_arguments_cleanly() -> None:
    result = _run_demo("--peers", "1", "--steps", "0", timeout=60)
    assert result.returncode == 2
    assert "--peers must be at least 2" in result.stderr and "--steps must be at least 1" in result.stderr
    assert "Traceback" not in result.stderr
