"""The halving-doubling all-reduce with peers as OS processes (``allreduce_peer.py``, the
algorithm forced through ``$PCCL_TEST_ALL_REDUCE_ALGORITHM``): a peer SIGKILLs itself inside
the op; the survivors' calls raise ``CollectiveAborted`` with their input restored (a survivor
whose call comes after the group dropped the victim runs only the retry), and the retry
runs over the survivors, bit-identical and equal to the algorithm's model."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from pccl import ReduceOp
from pccl.collectives.reference import all_reduce_reference
from pccl.protocol.algorithms import AllReduceAlgorithm, partner_positions
from allreduce_cases import digest, make_input
from allreduce_peer import ALGORITHM_ENV
from test_allreduce import BOUND, Cluster


@pytest.fixture
def forced_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    clusters: list[Cluster] = []

    def make(world: int, algorithm: AllReduceAlgorithm) -> Cluster:
        monkeypatch.setenv(ALGORITHM_ENV, algorithm.value)  # the peer processes inherit it
        cluster = Cluster(world)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for c in clusters:
        c.close()


@pytest.mark.parametrize(("world", "algorithm", "at"), [
    (4, AllReduceAlgorithm.RECURSIVE_DOUBLING, 0.2),  # inside the first doubling step
    (5, AllReduceAlgorithm.HALVING_DOUBLING, 0.6),  # past the fold, inside the halving
], ids=["doubling-4", "halving-5"])
def test_a_peer_sigkilled_inside_the_op(forced_cluster: Any, world: int, algorithm: AllReduceAlgorithm,
                                        at: float) -> None:
    cluster = forced_cluster(world, algorithm)
    # The last ring position: never one that folds its input in first and only receives the
    # result at the end (positions 0, 2, ..), where a kill "inside" the op could come after
    # every survivor had its result.
    victim_pid = cluster.ring[-1]
    victim = cluster.peers[cluster.peer_ids.index(victim_pid)]
    spec = {"tag": 7, "seed": 78, "n": 3_000_000, "dtype": "float32", "op": "AVG"}  # 12 MB
    for p in cluster.peers:
        p.send({"cmd": "ops", "ops": [spec], "retry": True,
                **({"fault": {"kind": "kill", "at": at}} if p is victim else {})})
    survivors = [pid for pid in cluster.peer_ids if pid != victim_pid]
    by_peer = dict(zip(survivors, (p.next() for p in cluster.peers if p is not victim)))
    reports = list(by_peer.values())
    for r in reports:
        res = r["results"][0]
        # A survivor that took part in the op the victim died in raises with its input intact;
        # one whose call came after the group had dropped the victim (a process scheduled late
        # on a loaded box) runs only the survivors' op, once.
        if "first_error" in res:
            assert res["first_error"] == "CollectiveAborted" and res["restored"] is True, json.dumps(res)
        else:
            assert res["attempts"] == 1, json.dumps(res)
        assert res.get("ok") and res["world"] == world - 1, json.dumps(res)
        assert victim_pid not in r["ring"] and len(r["ring"]) == world - 1
    # The victim died with bytes of its partners in: at least one of them was inside the op.
    partners = [cluster.ring[p] for p in partner_positions(world - 1, world)]
    assert any("first_error" in by_peer[pid]["results"][0] for pid in partners), by_peer
    ring = reports[0]["ring"]
    inputs = [make_input(spec["seed"], cluster.index_of(pid), spec["n"], "float32", "AVG") for pid in ring]
    expected = all_reduce_reference(inputs, ReduceOp.AVG, algorithm=algorithm)
    assert {r["results"][0]["digest"] for r in reports} == {digest(expected)}
    assert victim.popen.wait(timeout=BOUND) == -signal.SIGKILL
