"""The tree broadcast with peers as OS processes (``kinds_peer.py``) under a ``pccl master``
process, on real TCP: 8 peers (partner links wired) and a 160 KB buffer, which
:func:`~pccl.protocol.algorithms.choose_broadcast` sends down the binomial tree.

A process SIGKILLs itself inside the op at an awkward moment — the root after its first child
has the buffer and before the others do; the root's first child (the largest subtree's root)
once the buffer is in, before it forwards it — and every survivor's call raises
``CollectiveAborted`` with its input intact (a survivor whose call comes after the group
dropped the victim runs only the retry); the retry runs on the 7 survivors and everyone ends
with the (new) root's bytes.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest

from pccl.protocol.algorithms import BroadcastAlgorithm, broadcast_tree, choose_broadcast
from allreduce_cases import digest, make_input
from test_allreduce import BOUND
from test_collective_kinds_processes import KindsCluster, kinds_cluster  # noqa: F401 (the fixture)

WORLD = 8
N = 40_000  # float32: 160 KB, one segment


def test_the_buffer_takes_the_tree() -> None:
    # What the processes below run (partner links are wired at 8 peers): the tree, not the chain.
    assert choose_broadcast(N * 4, WORLD, quantized=False, segmented=False,
                            partner_links=True) is BroadcastAlgorithm.TREE
    assert choose_broadcast(N * 4, WORLD - 1, quantized=False, segmented=False,
                            partner_links=True) is BroadcastAlgorithm.CHAIN  # the retry's 7: the chain


@pytest.mark.parametrize("kill", ["root", "inner"])
def test_a_peer_sigkilled_inside_the_tree_broadcast(kinds_cluster: Any, kill: str) -> None:
    cluster = kinds_cluster(WORLD)
    root = min(cluster.peer_ids)
    root_pos = cluster.ring.index(root)
    first_child = broadcast_tree(root_pos, WORLD, root_pos)[1][0][0]
    victim_id = root if kill == "root" else cluster.ring[first_child]
    victim = cluster.peers[cluster.index_of(victim_id)]
    survivors = [p for p in cluster.peers if p is not victim]
    spec = {"kind": "broadcast", "tag": 31, "seed": 31, "n": N, "dtype": "float32", "op": "SUM", "quant": None}
    # The root sends the buffer to 3 children: past a third of it, it dies once the first has it
    # (before its commit; the others may have it too, from the socket buffers).
    at = 0.34 if kill == "root" else 1.0
    for p in cluster.peers:
        p.send({"cmd": "ops", "ops": [spec], "retry": True,
                **({"fault": {"kind": "kill", "on": "broadcast", "at": at}} if p is victim else {})})
    results = [p.next(timeout=BOUND)["results"][0] for p in survivors]
    for res in results:
        # A survivor inside the op the victim died in raises with its input intact; one whose
        # call came after the group had dropped the victim (a process scheduled late on a
        # loaded box) runs only the survivors' op, once.
        if "first_error" in res:
            assert res["first_error"] == "CollectiveAborted", f"{res}"
            assert res["restored"] is True, "the input is intact after the abort"
        else:
            assert res["attempts"] == 1, res
        assert res.get("ok") and res["world"] == WORLD - 1 and victim_id not in res["peers"], res
    # The victim's peer on the tree's first edge was inside the op: it sent the buffer to the
    # victim (an inner victim), or received a third of it (a root victim).
    feeder = root if kill == "inner" else cluster.ring[first_child]
    assert "first_error" in next(res for res in results if res["peer_id"] == feeder), results
    new_root = min(pid for pid in cluster.peer_ids if pid != victim_id)
    assert {res["root"] for res in results} == {new_root}
    expected = make_input(spec["seed"], cluster.index_of(new_root), N, "float32", "SUM")
    assert {res["digest"] for res in results} == {digest(expected)}
    assert victim.popen.wait(timeout=BOUND) == -signal.SIGKILL
