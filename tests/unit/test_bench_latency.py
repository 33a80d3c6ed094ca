"""benchmarks/latency.py: its options, its timing rule and its table, without starting processes
(the benchmark itself is no test: its figures depend on the machine)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "latency.py"


@pytest.fixture(scope="module")
def latency() -> ModuleType:
    spec = importlib.util.spec_from_file_location("latency_benchmark", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path = sys.path[:]
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path  # the script puts benchmarks/ on the path for its siblings
    return module


def test_the_defaults_are_the_issues_sizes_and_groups(latency: ModuleType) -> None:
    args, sizes, configs = latency.parse_args([])
    assert args.peers == [2, 3, 4] and args.clock == "group"
    assert sizes == [4, 64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    assert configs == ["gloo:all_reduce", "pccl:all_reduce", "gloo:broadcast", "pccl:broadcast"]
    assert not args.peer_commit
    assert latency.parse_args(["--peer-commit"])[0].peer_commit


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "6"], "sizes must be positive multiples of 4 bytes"),
    (["--sizes", "0"], "sizes must be positive multiples of 4 bytes"),
    (["--peers", "1"], "every --peers at least 2"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--collectives", "all_gather"], "invalid choice: 'all_gather'"),
    (["--clock", "wall"], "invalid choice: 'wall'"),
    (["--sizes", "lots"], "invalid literal"),
    (["--peer-commit", "--no-fast-commit"], "--peer-commit needs fast commit"),
])
def test_bad_options_are_usage_errors(latency: ModuleType, argv: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        latency.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_a_call_is_timed_from_the_last_start_to_the_last_end(latency: ModuleType) -> None:
    # Two ranks, two iterations: rank 1 arrives 5 late in the first, rank 0 ends last in the second.
    rank0 = [(0.0, 7.0), (20.0, 29.0)]
    rank1 = [(5.0, 8.0), (21.0, 24.0)]
    assert latency.group_times([rank0, rank1]) == [3.0, 8.0]
    assert latency.slowest_times([rank0, rank1]) == [7.0, 9.0]  # --clock slowest: each rank's own call


def test_the_table_puts_gloo_beside_pccl(latency: ModuleType) -> None:
    rows = [{"N": 2, "bytes": 16 << 10, "cfg": "gloo:all_reduce", "median": 0.002, "min": 0.001},
            {"N": 2, "bytes": 16 << 10, "cfg": "pccl:all_reduce", "median": 0.001, "min": 0.002}]
    header, line = latency.format_rows(rows).splitlines()
    assert header.split()[:3] == ["N", "size", "collective"]
    assert line.split() == ["2", "16K", "all_reduce", "2.000", "1.000", "1.000", "2.000", "2.00", "0.50"]


def test_fast_commit_follows_the_library_default_unless_told(latency: ModuleType) -> None:
    import pccl

    assert latency.parse_args([])[0].fast_commit is pccl.Config().fast_commit is True
    assert latency.parse_args(["--fast-commit"])[0].fast_commit is True
    assert latency.parse_args(["--no-fast-commit"])[0].fast_commit is False
