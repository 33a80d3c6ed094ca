"""``pccl-sim`` on the pccl scenario: run, determinism check, replay, shrink, campaign, coverage, plot."""

from __future__ import annotations

import builtins
import json
import pathlib
import re
from typing import Any

import pytest

from pccl_sim.engine.schedule import Schedule
from pccl_sim.tools.campaign import CampaignSpec
from pccl_sim.tools.cli import main


def test_run_save_check_determinism_and_replay_file(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    assert main(["run", "--seed", "3", "--peers", "3", "--duration", "6", "--save", str(path),
                 "--check-determinism"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "deterministic: a second run has the same trace hash" in out
    digest = out.split("hash ")[1].split()[0]
    schedule = Schedule.load(path)
    assert schedule.scenario["name"] == "pccl" and schedule.seed == 3
    assert main(["replay", str(path), "--expect", digest]) == 0
    assert capsys.readouterr().out.strip() == digest
    assert main(["replay", "--seed", "3", "--peers", "3", "--duration", "6"]) == 0
    assert capsys.readouterr().out.strip() == digest
    assert main(["replay", str(path), "--expect", "0" * 64]) == 1


def test_campaign_lists_failing_seeds_with_replay_commands_and_shrink_reduces_one(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ["--peers", "3", "--duration", "10", "--master", "no-recheck-on-disconnect", "--phases", "compute"]
    assert main(["campaign", "--seeds", "1..3", "--workers", "2", "--save-failing", str(tmp_path), *common]) == 1
    captured = capsys.readouterr()
    out = captured.out
    assert "3/3 seeds" in captured.err  # the progress bar
    assert "failing seed(s):" in out and "seeds / minute / core" in out
    replay = "pccl-sim replay --seed 1 --peers 3 --duration 10 --master no-recheck-on-disconnect --phases compute"
    assert replay in out
    saved = sorted(tmp_path.glob("seed-*.json"))
    assert saved
    shrunk = tmp_path / "min.json"
    assert main(["shrink", str(saved[0]), "--out", str(shrunk)]) == 1
    out = capsys.readouterr().out
    assert "events in" in out and "FAIL safety" in out
    assert len(Schedule.load(shrunk).events) <= 3


def test_coverage_prints_the_phase_matrix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["coverage", "--seeds", "0..1", "--workers", "1", "--peers", "4", "--duration", "8",
                 "--profile", "phases", "--phases", "compute"]) == 0
    out = capsys.readouterr().out
    assert "victim phase" in out and "master phase" in out
    assert "distinct (victim phase, master phase, fault kind) cells" in out
    for phase in ("Register", "VoteTopology", "ConnectToPeers", "P2PReport", "TopologyComplete", "P2PHello"):
        assert phase in out


def test_plot_writes_a_png(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.png"
    assert main(["plot", "--seed", "2", "--peers", "3", "--duration", "5", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert "wrote" in capsys.readouterr().out


def test_plot_without_matplotlib_is_a_clear_error(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert main(["plot", "--seed", "2", "--peers", "2", "--duration", "2", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib is not installed" in err and "pccl-trio[plot]" in err
    assert not (tmp_path / "x.png").exists()


def test_trace_out_is_plain_json(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.json"
    assert main(["run", "--seed", "1", "--peers", "2", "--duration", "3", "--trace-out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["hash"] in capsys.readouterr().out
    assert {e["kind"] for e in data["events"]} >= {"accepted", "step", "probe"}


def test_run_prints_the_master_round_trips_and_fast_commit_halves_them(capsys: pytest.CaptureFixture[str]) -> None:
    common = ["run", "--seed", "1", "--profile", "none", "--peers", "3", "--duration", "2", "--phases",
              "compute,all_reduce"]
    assert main(common) == 0
    assert "master round trips per successful collective call: 2: " in capsys.readouterr().out
    assert main([*common, "--fast-commit"]) == 0
    lines = [line.strip() for line in capsys.readouterr().out.splitlines() if "master round trips" in line]
    assert len(lines) == 1 and re.fullmatch(r"master round trips per successful collective call: 1: \d+ calls", lines[0])
    spec = CampaignSpec(params=(("fast_commit", True),))
    assert spec.command(4) == "pccl-sim replay --seed 4 --fast-commit"


def test_sites_reach_the_scenario_and_the_replay_command(capsys: pytest.CaptureFixture[str]) -> None:
    """``--sites`` puts the peers in datacenters (the hierarchical all-reduce's ground): a run
    with it passes, its seeds replay with it, and a malformed value is an argument error."""
    sites = '{"count": 2, "uplink": 125e6}'
    common = ["--seed", "2", "--profile", "none", "--peers", "4", "--duration", "2", "--sites", sites,
              "--phases", "optimize,all_reduce"]
    assert main(["run", *common]) == 0
    assert "PASS" in capsys.readouterr().out
    spec = CampaignSpec(params=(("sites", {"count": 2, "uplink": 125e6}),))
    command = spec.command(2)
    assert command == """pccl-sim replay --seed 2 --sites '{"count":2,"uplink":125000000.0}'"""
    scenario, _ = spec.build(2)
    assert scenario.sites is not None and scenario.sites.count == 2  # type: ignore[attr-defined]
    for bad in ("[2]", '{"count": 2}', "sites"):
        with pytest.raises(SystemExit):
            main(["run", "--seed", "1", "--sites", bad])
    assert "--sites" in capsys.readouterr().err
