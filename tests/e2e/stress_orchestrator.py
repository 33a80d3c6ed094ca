"""The process-level stress test's orchestrator, modelled on PCCL's own: a ``pccl master``
process and ``stress_peer.py`` processes spawned and SIGKILLed at random.

Every 0.5-2 s (a seeded RNG) it either SIGKILLs a random live peer or spawns a new one, keeping
between ``min_peers`` (2) and ``max_peers`` (10) live.  After ``seconds`` it stops the churn,
lets the survivors run ``settle_steps`` more steps, stops them cleanly (the stop file: every
peer leaves at the same step boundary), then checks, from the peers' JSON-lines results files:

* no refused legal call (``InvalidUsage``), no wrong result, no wrong state, no other error
  (``failure`` records, and a non-zero exit of a peer that was not SIGKILLed);
* no divergence: every peer that held revision R holds the same state hash for R;
* no stall: during the churn, no live peer goes ``stall_seconds`` without a new step record
  (from its start, or its last step) while another peer progressed in that time, and the run
  as a whole never goes ``stall_seconds`` without any step; every survivor makes its settle
  steps within ``stall_seconds``.

Figures: duration, kills, joins (spawns), steps, aborted steps, retries, max revision.

Usage from a test: ``run_stress(StressConfig(seconds=25, seed=1), workdir)`` returns a
:class:`StressReport`.  From a shell (the repository root on ``PYTHONPATH``)::

    python tests/e2e/stress_orchestrator.py --seconds 600 --seed 7

prints the figures and the problems and exits 1 when there are problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
PEER = HERE / "stress_peer.py"


def free_port() -> int:
    # pccl.tools.bench.free_port, without importing pccl into the orchestrator's process.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class StressConfig:
    seconds: float = 25.0
    seed: int = 0
    initial_peers: int = 5
    min_peers: int = 2
    max_peers: int = 10
    interval: tuple[float, float] = (0.5, 2.0)
    settle_steps: int = 3
    #: Generous: a loaded 2-core machine runs a master and up to 10 peers.
    stall_seconds: float = 45.0
    #: A newcomer's first step may wait for a running step to end, plus interpreter start-up.
    join_grace: float = 45.0
    kinds: str = "all_reduce,broadcast,all_gather,reduce_scatter"
    peer_timeout: float = 10.0
    heartbeat: float = 0.5
    verbose: bool = False


@dataclasses.dataclass
class StressReport:
    seed: int
    duration: float = 0.0
    kills: int = 0
    joins: int = 0
    steps: int = 0
    aborted_steps: int = 0
    retries: int = 0
    max_revision: int = -1
    max_world: int = 0
    survivors: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)

    def figures(self) -> str:
        return (f"seed {self.seed}: {self.duration:.1f} s, {self.kills} kills, {self.joins} joins, "
                f"{self.steps} peer-steps ({self.aborted_steps} with aborted ops, {self.retries} retries), "
                f"max revision {self.max_revision}, max world {self.max_world}, {self.survivors} survivors")


class _Peer:
    def __init__(self, name: str, cmd: list[str], results: pathlib.Path, env: dict[str, str],
                 log: pathlib.Path) -> None:
        self.name = name
        self.results = results
        self.log = log
        self.started = time.monotonic()
        self.killed = False
        self.reaped = False  # killed by the final shutdown (a newcomer never accepted, a stall)
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        self._offset = 0
        self._partial = b""
        self.records: list[dict[str, Any]] = []
        self.last_progress = self.started  # monotonic time of its last new step record
        self.steps = 0

    def alive(self) -> bool:
        return self.popen.poll() is None

    def poll_records(self) -> list[dict[str, Any]]:
        """Read the records appended since the last call (a SIGKILL may leave a partial line)."""
        try:
            with open(self.results, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        new = []
        for line in lines:
            try:
                new.append(json.loads(line))
            except ValueError:
                new.append({"event": "garbled", "line": line.decode(errors="replace")})
        now = time.monotonic()
        for r in new:
            if r.get("event") == "step":
                self.steps += 1
                self.last_progress = now
        self.records += new
        return new

    def tail(self, n: int = 15) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-n:]
        except OSError:
            text = []
        recs = [json.dumps(r) for r in self.records[-n:]]
        return (f"--- {self.name} (pid {self.popen.pid}, exit {self.popen.poll()}, killed {self.killed}) ---\n"
                + "\n".join(recs) + ("\n[log]\n" + "\n".join(text) if text else ""))


class _Run:
    def __init__(self, config: StressConfig, workdir: pathlib.Path) -> None:
        self.config = config
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.address = f"127.0.0.1:{free_port()}"
        self.stop_file = workdir / "stop.json"
        self.peers: list[_Peer] = []
        self.report = StressReport(seed=config.seed)
        self.env = dict(os.environ)
        # The children import the pccl this process would import (the repository's).
        root = str(HERE.parents[1])
        self.env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [self.env.get("PYTHONPATH")])])
        self.master: subprocess.Popen[bytes] | None = None
        self.master_log = workdir / "master.log"

    def log(self, msg: str) -> None:
        if self.config.verbose:
            print(f"[stress {time.monotonic() - self.t0:7.1f}] {msg}", flush=True)

    # --- processes ---

    def start_master(self) -> None:
        cmd = [sys.executable, "-m", "pccl", "--log-level", "WARNING", "master", "--listen", self.address,
               "--peer-timeout", str(self.config.peer_timeout), "--heartbeat-interval", str(self.config.heartbeat)]
        with open(self.master_log, "wb") as out:
            self.master = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 60
        host, port = self.address.rsplit(":", 1)
        while True:  # a peer's first connect is not retried: wait until the master listens
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                if self.master.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the master did not start:\n{self.master_log.read_text()}") from None
                time.sleep(0.05)

    def spawn(self) -> _Peer:
        name = f"peer{len(self.peers)}"
        results = self.workdir / f"{name}.jsonl"
        cmd = [sys.executable, str(PEER), "--master", self.address, "--name", name, "--results", str(results),
               "--stop", str(self.stop_file), "--kinds", self.config.kinds,
               "--peer-timeout", str(self.config.peer_timeout), "--heartbeat", str(self.config.heartbeat)]
        peer = _Peer(name, cmd, results, self.env, self.workdir / f"{name}.log")
        self.peers.append(peer)
        self.report.joins += 1
        self.log(f"spawned {name} (pid {peer.popen.pid})")
        return peer

    def live(self) -> list[_Peer]:
        return [p for p in self.peers if p.alive() and not p.killed]

    def kill(self, peer: _Peer) -> None:
        peer.killed = True
        peer.popen.send_signal(signal.SIGKILL)
        peer.popen.wait()
        self.report.kills += 1
        self.log(f"SIGKILL {peer.name} after {peer.steps} steps")

    # --- monitoring ---

    def poll(self) -> None:
        for p in self.peers:
            for r in p.poll_records():
                if r.get("event") == "failure":
                    self.problem(f"{p.name}: failure {json.dumps(r)}")
        for p in self.peers:
            if not (p.killed or p.reaped) and p.popen.poll() not in (None, 0):
                self.problem(f"{p.name} exited with status {p.popen.returncode}")

    def problem(self, msg: str) -> None:
        if msg not in self.report.problems:
            self.report.problems.append(msg)
            self.log("PROBLEM " + msg)

    def check_stall(self) -> None:
        now = time.monotonic()
        stall = self.config.stall_seconds
        last_any = max([p.last_progress for p in self.peers if p.steps] + [self.churn_start])
        if now - last_any > stall:
            self.problem(f"stall: no peer made a step for {now - last_any:.0f} s")
            return
        for p in self.live():
            grace = stall if p.steps else self.config.join_grace
            if now - p.last_progress > grace and last_any > p.last_progress:
                self.problem(f"stall: {p.name} made no step for {now - p.last_progress:.0f} s "
                             f"(after {p.steps} steps) while others progressed")

    # --- the run ---

    def run(self) -> StressReport:
        cfg = self.config
        self.t0 = time.monotonic()
        try:
            self.start_master()
            for _ in range(cfg.initial_peers):
                self.spawn()
            self.churn_start = time.monotonic()
            end = self.churn_start + cfg.seconds
            next_event = self.churn_start + self.rng.uniform(*cfg.interval)
            while time.monotonic() < end and not self.report.problems:
                time.sleep(0.1)
                self.poll()
                self.check_stall()
                if time.monotonic() < next_event:
                    continue
                next_event = time.monotonic() + self.rng.uniform(*cfg.interval)
                live = self.live()
                if len(live) <= cfg.min_peers:
                    action = "spawn"
                elif len(live) >= cfg.max_peers:
                    action = "kill"
                else:
                    action = self.rng.choice(["kill", "spawn"])
                if action == "spawn":
                    self.spawn()
                else:
                    self.kill(self.rng.choice(live))
            if not self.report.problems:
                self.settle()
        finally:
            self.report.duration = time.monotonic() - self.t0
            self.shutdown()
        self.poll()
        self.check_results()
        return self.report

    def settle(self) -> None:
        """No more churn: the survivors run a few more steps, then stop at one step boundary."""
        cfg = self.config
        survivors = self.live()
        base = {p.name: p.steps for p in survivors}
        deadline = time.monotonic() + cfg.stall_seconds + cfg.join_grace
        while time.monotonic() < deadline:
            self.poll()
            if self.report.problems:
                return
            # Who got in (a late newcomer may still be pending; it must get in too).
            if all(p.steps >= base[p.name] + cfg.settle_steps for p in survivors if p.alive()):
                break
            time.sleep(0.1)
        else:
            slow = [f"{p.name} ({p.steps - base[p.name]} of {cfg.settle_steps})" for p in survivors
                    if p.steps < base[p.name] + cfg.settle_steps]
            self.problem(f"stall: after the churn, survivors did not make their settle steps: {', '.join(slow)}")
            return
        revisions = [self.last_revision(p) for p in survivors]
        target = max(revisions) + 2
        self.stop_file.write_text(json.dumps({"revision": target}))
        self.log(f"stop at revision {target}")
        deadline = time.monotonic() + cfg.stall_seconds
        while time.monotonic() < deadline and any(p.alive() for p in self.peers if not p.killed):
            self.poll()
            time.sleep(0.1)
        self.poll()
        self.report.survivors = sum(1 for p in survivors if p.popen.poll() == 0)
        for p in survivors:
            if p.alive():
                self.problem(f"stall: {p.name} did not stop within {cfg.stall_seconds:.0f} s of the stop request "
                             f"(revision {self.last_revision(p)}, target {target})")
        for p in self.peers:  # a newcomer still waiting to be accepted when the others left
            if p.alive() and p not in survivors and not p.steps:
                self.log(f"{p.name} never got in before the stop; killed")

    @staticmethod
    def last_revision(p: _Peer) -> int:
        revs = [r["revision"] for r in p.records if r.get("event") in ("sync", "step")]
        return max(revs) if revs else -1

    def shutdown(self) -> None:
        for p in self.peers:
            if p.alive():
                p.reaped = True
                p.popen.kill()
            p.popen.wait()
        if self.master is not None:
            self.master.terminate()
            try:
                self.master.wait(10)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait()

    def check_results(self) -> None:
        rep = self.report
        hashes: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
        for p in self.peers:
            for r in p.records:
                ev = r.get("event")
                if ev in ("sync", "step"):
                    hashes[r["revision"]][r["hash"]].append(p.name)
                    rep.max_revision = max(rep.max_revision, r["revision"])
                    rep.max_world = max(rep.max_world, r.get("world", 0))
                if ev == "step":
                    rep.steps += 1
                    rep.aborted_steps += bool(r["aborted"])
                elif ev == "retry":
                    rep.retries += 1
                elif ev == "garbled" and not p.killed:
                    self.problem(f"{p.name}: garbled record {r['line']!r}")
        for revision, by_hash in sorted(hashes.items()):
            if len(by_hash) > 1:
                self.problem(f"divergence at revision {revision}: " +
                             "; ".join(f"{h}: {sorted(set(names))}" for h, names in by_hash.items()))
        if rep.steps == 0:
            self.problem("no peer made any step")

    def details(self) -> str:
        out = [p.tail() for p in self.peers if not p.killed or any(r.get("event") == "failure" for r in p.records)]
        try:
            out.append("--- master ---\n" + "\n".join(self.master_log.read_text(errors="replace").splitlines()[-30:]))
        except OSError:
            pass
        return "\n".join(out)


def run_stress(config: StressConfig, workdir: pathlib.Path) -> tuple[StressReport, str]:
    """Run one stress campaign in ``workdir``; the report and, for a failure message, the tails
    of the surviving (and failed) peers' records and logs and of the master's log."""
    run = _Run(config, workdir)
    report = run.run()
    return report, (run.details() if report.problems else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="PCCL-style process-level stress test (master + churned peers)")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of churn (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", type=int, default=5, help="peers at the start (default %(default)s)")
    p.add_argument("--max-peers", type=int, default=10)
    p.add_argument("--kinds", default="all_reduce,broadcast,all_gather,reduce_scatter")
    p.add_argument("--stall-seconds", type=float, default=StressConfig.stall_seconds)
    p.add_argument("--workdir", help="keep the results files here (default: a temporary directory)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    config = StressConfig(seconds=args.seconds, seed=args.seed, initial_peers=args.peers, max_peers=args.max_peers,
                          kinds=args.kinds, stall_seconds=args.stall_seconds, verbose=not args.quiet)
    if args.workdir:
        workdir = pathlib.Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        report, details = run_stress(config, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="pccl-stress-") as tmp:
            report, details = run_stress(config, pathlib.Path(tmp))
    print(report.figures())
    for problem in report.problems:
        print("PROBLEM:", problem)
    if details:
        print(details)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
