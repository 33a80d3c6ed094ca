"""torch's own ``torch.nn.parallel.DistributedDataParallel`` over ``init_process_group("pccl")``
(issue 44's acceptance): three processes train (torch_ddp_peer.py), the one that passed rank 2
is SIGKILLed mid-backward, a new process passing rank 2 replaces it, and the two survivors and
the replacement end with bit-identical parameters.  pccl's own DDP wrapper meets the same
scenario in tests/e2e/test_torch_ddp.py (slow)."""

from __future__ import annotations

import json
import pathlib
import signal
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402

from pccl_torch_world import CFG, master_in_thread  # noqa: E402
from forked_peers import Peer  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
PEER = HERE / "torch_ddp_peer.py"
STEPS = 12
DIE_AT = 4
BOUND = 180.0  # four torch processes on a loaded 2-core runner


def _start(directory: str, master: str, port: int, rank: int, *extra: str) -> Peer:
    # forked from a server that has imported torch (forked_peers.py): the replacement joins
    # without an import of torch the survivors would wait for
    return Peer(PEER, [master, str(port), str(rank), str(STEPS), *extra], directory, f"rank{rank}", merged=True)


def _report(peer: Peer, deadline: float) -> tuple[dict[str, Any], str]:
    code = peer.wait(deadline - time.monotonic())
    out = peer.output()[0]
    assert code == 0, f"exit {code}:\n{out}"
    return json.loads(out.strip().splitlines()[-1]), out


def test_torchs_ddp_survives_a_kill_mid_backward_and_a_replacement(tmp_path: pathlib.Path) -> None:
    deadline = time.monotonic() + BOUND
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with master_in_thread(CFG) as master:
        procs = [_start(str(tmp_path), master.address, store.port, 0),
                 _start(str(tmp_path), master.address, store.port, 1),
                 _start(str(tmp_path), master.address, store.port, 2, "--die-at", str(DIE_AT))]
        replacement = None
        try:
            victim = procs[2]
            code = victim.wait(deadline - time.monotonic())
            victim_out = victim.output()[0]
            assert code == -signal.SIGKILL, f"exit {code}:\n{victim_out}"
            assert f"step {DIE_AT} world 3" in victim_out and f"step {DIE_AT + 1} " not in victim_out, victim_out
            replacement = _start(str(tmp_path), master.address, store.port, 2)
            reports = [_report(p, deadline) for p in (procs[0], procs[1], replacement)]
        finally:
            for p in [*procs, *([replacement] if replacement else [])]:
                p.kill()
    outputs = "\n\n".join(out for _, out in reports)
    assert [r["step"] for r, _ in reports] == [STEPS] * 3, outputs
    # The survivors' step DIE_AT + 1 failed with the victim (their buckets' all-reduces were
    # commenced with it), or, if the victim died before they voted for any of that step's
    # buckets, the master had dropped it by then and the step ran on the two of them.  Either
    # way both survivors saw the same (all-or-nothing), and they built their DDP anew once the
    # replacement was in, as it built its own (torch broadcasts rank 0's module then).
    failed = [f"step {DIE_AT} failed" in out for _, out in reports[:2]]
    assert failed[0] == failed[1], outputs
    if not failed[0]:
        assert all(f"step {DIE_AT + 1} world 2" in out for _, out in reports[:2]), outputs
    for report, out in reports[:2]:
        assert report["first_step"] == 1 and report["rebuilds"] == 2, outputs
    assert reports[2][0]["rebuilds"] == 1, outputs
    newcomer = reports[2][0]
    # it went on from the survivors' step
    assert newcomer["first_step"] == (DIE_AT + 1 if failed[0] else DIE_AT + 2), outputs
    # it replaced the last rank, passing it: it is rank 2 again, the survivors ranks 0 and 1
    assert [r["final_rank"] for r, _ in reports] == [0, 1, 2], outputs
    assert len({r["digest"] for r, _ in reports}) == 1, outputs  # bit-identical parameters
