"""Campaigns on a Dask cluster (``--cluster``) and their results as data (``--json``, ``merge``).

The cluster runs every seed exactly as a local worker does: same pass/fail, same trace hash.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import distributed  # the test extra installs it (pyproject.toml)
import pytest

import pccl
import pccl_sim
from pccl_sim.tools.campaign import CampaignSpec, run_seed
from pccl_sim.tools.cli import main
from pccl_sim.tools.cluster import ClusterError, batch_size, parse_cluster, run_on_cluster
from pccl_sim.tools.results import FORMAT, ResultsError, load, merge

#: Short runs: 4 peers, 4 virtual seconds of chaos each, compute steps (a fraction of a wall
#: second per seed; the profile's own step bodies, concurrent collectives, cost tens of times more).
_SHORT = ["--peers", "4", "--duration", "4", "--phases", "compute"]


def _records(path: pathlib.Path) -> dict[int, tuple[bool, str]]:
    doc = load(path)
    return {r["seed"]: (r["passed"], r["trace_hash"]) for r in doc["seeds"]}


def _child_env() -> dict[str, str]:
    """The environment of a process that must import this very pccl and pccl_sim."""
    roots = [str(pathlib.Path(m.__file__).resolve().parent.parent) for m in (pccl,)]
    roots.append(str(pathlib.Path(pccl_sim.__file__).parent.parent))  # pccl_sim may be a mapped folder
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("seeds,generation", [
    # The default run: 10 short seeds of membership chaos.
    ("0..9", ["--peers", "3", "--duration", "3", "--phases", "compute"]),
    # The acceptance test of the issue: 20 seeds with the chaos profile's step bodies (every
    # collective on concurrent tags, PCCL's stress pattern).
    pytest.param("0..19", ["--peers", "4", "--duration", "4"], marks=pytest.mark.slow),
])
def test_local_cluster_and_local_workers_give_the_same_seed_results(
    seeds: str, generation: list[str], tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The seeds on ``--cluster local:2`` and on ``--workers 2``: every seed passes or fails
    alike with the same trace hash."""
    on_cluster, local = tmp_path / "cluster.json", tmp_path / "local.json"
    count = int(seeds.split("..")[1]) + 1
    rc_cluster = main(["campaign", "--seeds", seeds, "--cluster", "local:2", "--json", str(on_cluster), *generation])
    out = capsys.readouterr()
    assert "on cluster local:2" in out.out and f"{count}/{count} seeds" in out.err
    rc_local = main(["campaign", "--seeds", seeds, "--workers", "2", "--json", str(local), *generation])
    capsys.readouterr()
    assert rc_cluster == rc_local
    cluster_records, local_records = _records(on_cluster), _records(local)
    assert sorted(cluster_records) == list(range(count))
    assert cluster_records == local_records
    doc = load(on_cluster)
    assert doc["format"] == FORMAT and doc["summary"]["ran_on"] == "cluster local:2"
    assert doc["summary"]["seeds"] == count and doc["summary"]["faults"] > count
    assert doc["campaign"] == load(local)["campaign"]
    record = doc["seeds"][0]
    assert record["replay"].startswith("pccl-sim replay --seed 0 ") and "--duration" in record["replay"]
    assert record["faults"] == sum(record["faults_by_kind"].values())
    assert record["wall_seconds"] > 0 and record["phases"]


def _spec() -> CampaignSpec:
    """:data:`_SHORT` as a spec."""
    return CampaignSpec(profile="chaos", peers=4, duration=4.0, params=(("phases", ("compute",)),))


@pytest.fixture
def thread_client() -> Iterator[Any]:
    """A client of an in-process cluster (one worker thread: quick to start)."""
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            yield client


def _scheduler_tasks(client: Any) -> int:
    """Tasks the scheduler still holds, once the client's releases (sent asynchronously) landed
    (waits up to 20 s for them to reach 0)."""
    deadline = time.monotonic() + 20
    while True:
        tasks = int(client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)))
        if not tasks or time.monotonic() > deadline:
            return tasks
        time.sleep(0.05)


def test_an_interrupted_cluster_campaign_cancels_its_outstanding_tasks(thread_client: Any) -> None:
    """Ctrl-C (a KeyboardInterrupt while results stream in) cancels the tasks still queued or
    running on the scheduler and propagates."""
    seen: list[int] = []

    def interrupt(result: Any) -> None:
        seen.append(result.seed)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as interrupted:
        run_on_cluster(_spec(), range(12), "local:1", client=thread_client, batch=1, progress=interrupt)
    assert len(seen) == 1
    # Cancelled, not merely forgotten once nobody holds the futures: the caller still holds the
    # traceback (and with it the campaign's futures) here.
    assert _scheduler_tasks(thread_client) == 0
    assert interrupted.type is KeyboardInterrupt


def test_cluster_results_stream_per_batch_in_seed_order(thread_client: Any) -> None:
    """Results come back sorted; a worker thread in this process leaves pccl's logging as it was."""
    levels = [logging.getLogger(name).level for name in ("pccl", "pccl_sim")]
    order: list[int] = []
    results = run_on_cluster(_spec(), [5, 3, 9, 1, 7], "local:1", client=thread_client, batch=2,
                             progress=lambda r: order.append(r.seed))
    assert [r.seed for r in results] == [1, 3, 5, 7, 9]
    assert sorted(order) == [1, 3, 5, 7, 9]
    assert _scheduler_tasks(thread_client) == 0  # nothing left behind
    assert [logging.getLogger(name).level for name in ("pccl", "pccl_sim")] == levels


def test_a_scheduler_and_a_worker_started_as_processes(tmp_path: pathlib.Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``dask scheduler`` and ``dask worker`` on loopback (free ports), a small campaign through
    ``--cluster tcp://...``; the same hashes as in this process; the processes are stopped."""
    scheduler_file = tmp_path / "scheduler.json"
    env = _child_env()
    logs = [open(tmp_path / name, "w") for name in ("scheduler.log", "worker.log")]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
             "--scheduler-file", str(scheduler_file)], env=env, stdout=logs[0], stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.1)
        address = json.loads(scheduler_file.read_text())["address"]
        assert address.startswith("tcp://127.0.0.1:")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "dask", "worker", address, "--nthreads", "1", "--nworkers", "1",
             "--host", "127.0.0.1", "--no-dashboard"], env=env, stdout=logs[1], stderr=subprocess.STDOUT))
        out_file = tmp_path / "tcp.json"
        assert main(["campaign", "--seeds", "0..3", "--cluster", address, "--json", str(out_file), *_SHORT]) == 0
        assert f"on cluster {address}" in capsys.readouterr().out
        records = _records(out_file)
        here = {r.seed: (r.ok, r.hash) for r in
                (run_seed(_spec(), seed) for seed in range(4))}
        assert records == here
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # pragma: no cover - a stuck dask process
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    assert all(proc.poll() is not None for proc in procs)


def test_cluster_option_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_cluster("local:3").local == 3
    assert parse_cluster("tcp://10.0.0.1:8786").address == "tcp://10.0.0.1:8786"
    for bad in ("local:0", "local:x", "tcp://nohost", "10.0.0.1:8786"):
        with pytest.raises(ClusterError):
            parse_cluster(bad)
    with pytest.raises(SystemExit):
        main(["campaign", "--seeds", "0", "--cluster", "local:0"])
    assert "local:N needs N >= 1" in capsys.readouterr().err
    # Without dask.distributed: a clear error naming the extra, exit status 2.
    monkeypatch.setitem(sys.modules, "distributed", None)
    assert main(["campaign", "--seeds", "0", "--cluster", "local:1"]) == 2
    assert "pip install 'pccl-trio[cluster]'" in capsys.readouterr().err


def test_batches_keep_every_worker_busy_to_the_end() -> None:
    assert batch_size(40, 2) == 1
    assert batch_size(2000, 2) == 8
    assert batch_size(400, 4) == 6
    assert batch_size(3, 8) == 1


def test_the_simulator_imports_dask_only_for_a_cluster_campaign() -> None:
    """``pccl`` and ``pccl-sim`` work without dask: neither imports it unless ``--cluster`` asks."""
    code = ("import sys, pccl, pccl_sim.tools.cli, pccl_sim.tools.cluster; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed')))")
    out = subprocess.run([sys.executable, "-c", code], env=_child_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_json_results_of_a_campaign_split_in_two_merge_into_the_whole(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two machines run halves of a campaign; ``pccl-sim merge`` gives the whole campaign's
    records and summary.  Coverage writes the same format."""
    whole, a, b, merged = (tmp_path / f"{n}.json" for n in ("whole", "a", "b", "merged"))
    assert main(["coverage", "--seeds", "0..3", "--workers", "1", "--json", str(whole), *_SHORT]) == 0
    assert main(["campaign", "--seeds", "0..1", "--workers", "1", "--json", str(a), *_SHORT]) == 0
    assert main(["campaign", "--seeds", "2,3", "--workers", "1", "--json", str(b), *_SHORT]) == 0
    assert main(["merge", str(b), str(a), str(a), "--json", str(merged)]) == 0
    assert "merged 3 files: 4 seeds" in capsys.readouterr().out
    whole_doc, merged_doc = load(whole), load(merged)
    assert [r["trace_hash"] for r in merged_doc["seeds"]] == [r["trace_hash"] for r in whole_doc["seeds"]]
    assert [r["coverage"] for r in merged_doc["seeds"]] == [r["coverage"] for r in whole_doc["seeds"]]
    for key in ("seeds", "passed", "faults", "faults_by_kind", "recovery_seconds", "counters"):
        assert merged_doc["summary"][key] == whole_doc["summary"][key], key
    # A seed with two different hashes (another commit, or non-determinism) does not merge.
    forged = load(a)
    forged["seeds"][0]["trace_hash"] = "0" * 64
    with pytest.raises(ResultsError, match="two trace hashes"):
        merge([load(a), forged])
    other = load(a)
    other["campaign"]["duration"] = 5.0
    with pytest.raises(ResultsError, match="different campaigns"):
        merge([load(a), other])
    (tmp_path / "junk.json").write_text("{}")
    assert main(["merge", str(a), str(tmp_path / "junk.json")]) == 2
