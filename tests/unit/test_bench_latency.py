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


def test_floor_adds_a_third_all_reduce_and_its_columns(latency: ModuleType) -> None:
    assert latency.parse_args(["--floor"])[2][-2:] == ["floor:all_reduce", "floor-acks:all_reduce"]
    assert "floor:all_reduce" not in latency.parse_args(["--floor", "--collectives", "broadcast"])[2]
    rows = [{"N": 2, "bytes": 16 << 10, "cfg": "gloo:all_reduce", "median": 0.002, "min": 0.001},
            {"N": 2, "bytes": 16 << 10, "cfg": "pccl:all_reduce", "median": 0.001, "min": 0.002},
            {"N": 2, "bytes": 16 << 10, "cfg": "floor:all_reduce", "median": 0.0005, "min": 0.00025},
            {"N": 2, "bytes": 16 << 10, "cfg": "floor-acks:all_reduce", "median": 0.0004, "min": 0.0002}]
    header, line = latency.format_rows(rows).splitlines()
    assert header.split()[-8:] == ["floor", "med", "floor", "min", "acks", "med", "acks", "min"]
    assert line.split()[-4:] == ["0.500", "0.250", "0.400", "0.200"]


def test_the_floor_sums_in_rank_order_on_real_sockets(latency: ModuleType) -> None:
    """The floor's protocol shape runs (rendezvous, one-way Begin, data, Done, Complete) and every
    peer holds the same sum: it is a reference for latency, so it must at least be right."""
    import functools
    import threading

    import numpy as np
    import trio

    from pccl.tools.bench import free_port

    floor = sys.modules["small_op_floor"]
    world, port = 3, free_port()
    ready = threading.Event()
    master = threading.Thread(target=floor.run_master, args=(port, world, ready), daemon=True)
    master.start()
    assert ready.wait(10)
    inputs = [np.random.default_rng(r).standard_normal(4096, dtype=np.float32) for r in range(world)]
    bufs = [x.copy() for x in inputs]

    async def main() -> None:
        peers: list[object] = [None] * world

        async def join(rank: int) -> None:
            peers[rank] = await floor.FloorPeer.connect(rank, world, port)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(join, rank)
            for acks in (False, True, False):  # fast commit's shape, peer commit's, and back
                async with trio.open_nursery() as nursery:
                    for peer, buf in zip(peers, bufs):
                        nursery.start_soon(functools.partial(peer.all_reduce, buf, acks=acks))  # type: ignore[attr-defined]
        for peer in peers:
            peer.close()  # type: ignore[attr-defined]

    trio.run(main)
    master.join(10)
    assert not master.is_alive()  # the master ends when its peers hang up
    # Each round sums the peers' current buffers in rank order; after round one all are equal.
    step = inputs[0] + inputs[1] + inputs[2]
    for _ in range(2):
        step = step + step + step
    assert all(np.array_equal(b, step) for b in bufs)
