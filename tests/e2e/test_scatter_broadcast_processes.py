"""The scatter + all-gather broadcast with peers as OS processes (``kinds_peer.py``) under a
``pccl master`` process, on real TCP: 9 peers (partner links wired; a fold), the algorithm
forced in every process (``PCCL_TEST_BROADCAST_ALGORITHM``), a 2.4 MB buffer (moves of two and
three 1 MiB frames); the bytes each survivor sent in the retry say which algorithm ran.

A process SIGKILLs itself inside the op at an awkward moment — the root once the first frame of
its first move has gone (its first scatter half, or a folded root's whole buffer to its fold
partner); the peer that move goes to, once the first half of the buffer is in and before it
forwards any — and every survivor's call raises ``CollectiveAborted`` with its input intact (a
survivor whose call comes after the group dropped the victim runs only the retry); the retry
runs the scatter + all-gather on the 8 survivors and everyone ends with the (new) root's bytes.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from pccl.protocol.algorithms import BroadcastAlgorithm
from pccl.protocol.scatter_gather import scatter_all_gather_plan
from allreduce_cases import digest, make_input
from kinds_peer import BROADCAST_ALGORITHM_ENV
from test_allreduce import BOUND
from test_collective_kinds_processes import KindsCluster, kinds_cluster  # noqa: F401 (the fixture)

WORLD = 9
N = 600_000  # float32: 2.4 MB


@pytest.mark.parametrize("kill", ["root", "inner"])
def test_a_peer_sigkilled_inside_the_scatter_all_gather_broadcast(kinds_cluster: Any, kill: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BROADCAST_ALGORITHM_ENV, BroadcastAlgorithm.SCATTER_ALL_GATHER.value)  # inherited
    cluster = kinds_cluster(WORLD)
    root = min(cluster.peer_ids)
    root_pos = cluster.ring.index(root)
    first = scatter_all_gather_plan(root_pos, WORLD, root_pos)[0]
    assert first.send and first.stop - first.first >= 2, first  # half the blocks or more: 2+ frames
    victim_id = root if kill == "root" else cluster.ring[first.partner]
    victim = cluster.peers[cluster.index_of(victim_id)]
    survivors = [p for p in cluster.peers if p is not victim]
    spec = {"kind": "broadcast", "tag": 41, "seed": 41, "n": N, "dtype": "float32", "op": "SUM", "quant": None}
    # The root's first frame is 1 MiB (0.44 of the buffer); the inner victim's move brings it half
    # of the buffer (or, from a folded root, all of it) in 1 MiB frames: past half, it dies.
    at = 0.34 if kill == "root" else 0.5
    for p in cluster.peers:
        p.send({"cmd": "ops", "ops": [spec], "retry": True,
                **({"fault": {"kind": "kill", "on": "broadcast", "at": at}} if p is victim else {})})
    results = [p.next(timeout=BOUND)["results"][0] for p in survivors]
    for res in results:
        if "first_error" in res:
            assert res["first_error"] == "CollectiveAborted", f"{res}"
            assert res["restored"] is True, "the input is intact after the abort"
        else:
            assert res["attempts"] == 1, res
        assert res.get("ok") and res["world"] == WORLD - 1 and victim_id not in res["peers"], res
    # The other end of the root's first move was inside the op: it was receiving from a root
    # victim, or it is the victim and the root had sent it its move.
    feeder = root if kill == "inner" else cluster.ring[first.partner]
    assert "first_error" in next(res for res in results if res["peer_id"] == feeder), results
    new_root = min(pid for pid in cluster.peer_ids if pid != victim_id)
    assert {res["root"] for res in results} == {new_root}
    expected = make_input(spec["seed"], cluster.index_of(new_root), N, "float32", "SUM")
    assert {res["digest"] for res in results} == {digest(expected)}
    # The retry ran the scatter + all-gather on the 8 survivors: each sent its plan's blocks.
    ring = results[0]["peers"]
    new_root_pos = ring.index(new_root)
    for res in results:
        position = ring.index(res["peer_id"])
        sent = sum(m.stop - m.first for m in scatter_all_gather_plan(position, WORLD - 1, new_root_pos) if m.send)
        assert res["tx_bytes"] == sent * 4 * N // (WORLD - 1), (position, res)
        assert res["rx_bytes"] == (0 if position == new_root_pos else 4 * N)
    assert victim.popen.wait(timeout=BOUND) == -signal.SIGKILL
