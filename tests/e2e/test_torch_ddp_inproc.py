"""``pccl.torch.DistributedDataParallel`` with its peers as threads of the test (one torch import,
real TCP on loopback): a peer that leaves mid-run while the others' buckets are in flight, a
newcomer that builds its DDP alone, a lone peer, and the errors ``reduced()`` reports.
The same scenario with processes and a SIGKILL is tests/e2e/test_torch_ddp.py (slow)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
from typing import Any

import pytest

import pccl
import pccl.blocking
from pccl.testing import master_in_thread

torch = pytest.importorskip("torch")
import pccl.torch  # noqa: E402  (after the importorskip: it needs torch)

CONFIG = pccl.Config(peer_timeout=3.0, heartbeat_interval=0.3)
#: A bucket cap small enough for three buckets over the model below.
BUCKET_MB = 0.0005


def _model(hidden: int = 32) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))


def _batch(generator: Any) -> tuple[Any, Any]:
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(8, 4, generator=teacher)
    x = torch.randn(16, 8, generator=generator)
    return x, torch.tanh(x @ w)


def _digest(model: Any) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


class _Peer:
    """One peer's training loop (``comm.steps`` around forward, backward, ``reduced()``, SGD)."""

    def __init__(self, address: str, steps: int, seed: int, delay: float = 0.01, leave_at: int | None = None) -> None:
        self.address, self.steps, self.seed, self.delay, self.leave_at = address, steps, seed, delay, leave_at
        self.comm: pccl.blocking.Communicator | None = None
        self.opened = threading.Event()
        self.step = 0
        self.losses: list[float] = []
        self.worlds: list[int] = []

    def run(self) -> str:
        with pccl.blocking.open_communicator(self.address, config=CONFIG) as comm:
            self.comm = comm
            self.opened.set()
            model = _model()
            ddp = pccl.torch.DistributedDataParallel(model, comm, bucket_cap_mb=BUCKET_MB)  # alone, mid-run
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
            step = torch.zeros((), dtype=torch.int64)
            state = pccl.SharedState({**{n: p.detach() for n, p in model.named_parameters()}, "step": step})
            generator = torch.Generator().manual_seed(self.seed)
            if self.leave_at is not None:
                # The first layer's gradient comes last: when it is computed, the buckets of the
                # layers after it are already with pccl, here and at the others.
                def leave(grad: Any) -> None:
                    if int(step) == self.leave_at:
                        comm.close()

                model[0].weight.register_hook(leave)
            for _ in comm.steps(state):
                if int(step) >= self.steps:
                    break
                x, y = _batch(generator)
                loss = torch.nn.functional.mse_loss(ddp(x), y)
                optimizer.zero_grad()
                loss.backward()
                try:
                    reduced = ddp.reduced()
                except pccl.CollectiveAborted:
                    continue
                optimizer.step()
                step += 1
                state.revision += 1
                self.step = int(step)
                self.losses.append(loss.item())
                self.worlds.append(reduced.world_size)
                time.sleep(self.delay)
            return _digest(model)


def _wait(condition: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_peer_leaves_mid_run_a_newcomer_joins_and_all_end_bit_identical() -> None:
    steps = 40
    with master_in_thread(CONFIG) as master, concurrent.futures.ThreadPoolExecutor(4) as pool:
        peers = [_Peer(master.address, steps, seed) for seed in range(3)]
        peers[2].leave_at = 5  # it leaves mid-backward (its buckets' ops cancelled; the others retry)
        runs = [pool.submit(p.run) for p in peers]
        with pytest.raises(pccl.InvalidUsage, match="closed"):
            runs[2].result(60)
        newcomer = _Peer(master.address, steps, 3)
        runs.append(pool.submit(newcomer.run))
        digests = [runs[i].result(60) for i in (0, 1, 3)]
    assert len(set(digests)) == 1  # survivors and newcomer: bit-identical parameters
    assert peers[0].step == peers[1].step == newcomer.step == steps
    assert 0 < len(newcomer.losses) < steps - 5  # it joined mid-run and went on from the others' step
    assert peers[2].step == 5
    assert 3 in newcomer.worlds  # it trained with both survivors
    assert sum(peers[0].losses[-5:]) < sum(peers[0].losses[:5])  # the loss falls


def test_a_lone_peer_keeps_its_own_gradients() -> None:
    with master_in_thread(CONFIG) as master, pccl.blocking.open_communicator(master.address, config=CONFIG) as comm:
        model, reference = _model(), _model()
        ddp = pccl.torch.DistributedDataParallel(model, comm, bucket_cap_mb=BUCKET_MB)
        x, y = _batch(torch.Generator().manual_seed(1))
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        assert ddp.reduced().world_size == 1
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p.grad, q.grad)
        ddp.hook_state.close()


def test_peers_whose_buckets_differ_get_invalid_usage_from_reduced_not_from_backward() -> None:
    def run(address: str, hidden: int) -> BaseException | None:
        with pccl.blocking.open_communicator(address, config=CONFIG) as comm:
            while comm.world_size < 2:  # the first peer accepts the second
                time.sleep(0.05)
                comm.update_topology()
            ddp = pccl.torch.DistributedDataParallel(_model(hidden), comm)  # one bucket, sizes differ
            x, y = _batch(torch.Generator().manual_seed(1))
            torch.nn.functional.mse_loss(ddp(x), y).backward()  # returns: the error is recorded
            try:
                ddp.reduced()
            except pccl.PCCLError as exc:
                return exc
            return None

    with master_in_thread(CONFIG) as master, concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(run, master.address, 32)
        second = pool.submit(run, master.address, 33)
        errors = [first.result(60), second.result(60)]
    assert all(isinstance(e, pccl.InvalidUsage) for e in errors), errors


def test_the_wrapper_refuses_a_process_group() -> None:
    with master_in_thread(CONFIG) as master, pccl.blocking.open_communicator(master.address, config=CONFIG) as comm:
        with pytest.raises(pccl.InvalidArgument, match="process_group"):
            pccl.torch.DistributedDataParallel(_model(), comm, process_group=object())


def test_the_helper_thread_stops_when_idle_and_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pccl.torch.ddp._IDLE", 0.1)

    def helpers() -> int:
        return sum(t.name == "pccl-ddp-hook" for t in threading.enumerate())

    with master_in_thread(CONFIG) as master, pccl.blocking.open_communicator(master.address, config=CONFIG) as comm:
        ddp = pccl.torch.DistributedDataParallel(_model(), comm, bucket_cap_mb=BUCKET_MB)
        for _ in range(2):
            x, y = _batch(torch.Generator().manual_seed(1))
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            assert ddp.reduced().world_size == 1
            _wait(lambda: helpers() == 0, "the idle helper thread to stop", timeout=10)
