"""pccl.blocking end to end on real TCP: synchronous callers, async handles, heartbeats while the
caller's thread computes, errors re-raised in the caller's thread, Ctrl-C in a real process."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

import pccl
import pccl.blocking
from pccl import CollectiveAborted, InvalidArgument, InvalidUsage, MasterUnreachable, ReduceOp, TooFewPeers
from pccl.testing import MasterThread, master_in_thread

torch = pytest.importorskip("torch")

HERE = pathlib.Path(__file__).resolve().parent
PEER_TIMEOUT = 1.0
CFG = pccl.Config(peer_timeout=PEER_TIMEOUT, heartbeat_interval=0.2, connect_timeout=5.0, p2p_base_port=0)


def _pair(master: MasterThread, config: pccl.Config = CFG) -> tuple[pccl.blocking.Communicator, ...]:
    first = pccl.blocking.open_communicator(master.address, config=config)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(pccl.blocking.open_communicator, master.address, config=config)
        deadline = time.monotonic() + 30
        while not first.are_peers_pending():
            assert time.monotonic() < deadline, "the second peer never registered"
            time.sleep(0.02)
        first.update_topology()
        return first, second.result(timeout=30)


@pytest.fixture
def pair() -> Iterator[tuple[MasterThread, pccl.blocking.Communicator, pccl.blocking.Communicator]]:
    with master_in_thread(CFG) as master:
        a, b = _pair(master)
        try:
            yield master, a, b
        finally:
            a.close()
            b.close()


def _both(fa, fb):  # noqa: ANN001, ANN202 - two blocking calls that must meet
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(fb)
        mine = fa()
        return mine, other.result(timeout=60)


DTYPES = [torch.uint8, torch.int8, torch.uint16, torch.int16, torch.uint32, torch.int32, torch.uint64, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def test_every_torch_dtype_blocking_and_async_in_place_and_out_of_place(pair) -> None:  # noqa: ANN001
    _, a, b = pair
    for dtype in DTYPES:
        xs = [torch.full((4, 25), i + 1).to(dtype) for i in range(2)]
        outs = [torch.zeros(4, 25, dtype=dtype) for _ in range(2)]
        ptrs = [x.data_ptr() for x in xs]
        # blocking, out of place (each peer's call blocks until both called: one in a thread)
        ia, ib = _both(lambda: a.all_reduce(xs[0], outs[0], tag=1), lambda: b.all_reduce(xs[1], outs[1], tag=1))
        assert ia.world_size == ib.world_size == 2
        for x, o, i in zip(xs, outs, (1, 2)):
            assert bool((o.double() == 3).all()) and bool((x.double() == i).all()), dtype
        # async, in place: both handles from this one thread
        handles = [a.all_reduce_async(xs[0], op=ReduceOp.MAX, tag=2), b.all_reduce_async(xs[1], op=ReduceOp.MAX, tag=2)]
        assert [h.wait(timeout=30).world_size for h in handles] == [2, 2]
        assert all(h.done() for h in handles)
        for x, p in zip(xs, ptrs):
            assert x.data_ptr() == p and bool((x.double() == 2).all()), dtype
    # all_reduce_many, blocking and async
    lists = [[torch.full((3,), float(i + 1)), torch.full((5,), i + 1, dtype=torch.bfloat16)] for i in range(2)]
    _both(lambda: a.all_reduce_many(lists[0], op=ReduceOp.AVG), lambda: b.all_reduce_many(lists[1], op=ReduceOp.AVG))
    handles = [a.all_reduce_many_async(lists[0]), b.all_reduce_many_async(lists[1])]
    for h in handles:
        h.wait(timeout=30)
    for arrays in lists:
        assert bool((arrays[0] == 3).all()) and bool((arrays[1].float() == 3).all())


def test_the_caller_computing_for_three_peer_timeouts_is_not_removed(pair) -> None:  # noqa: ANN001
    master, a, b = pair
    kicks = master.statistics().kicks
    started = time.monotonic()
    while time.monotonic() - started < 3 * PEER_TIMEOUT:  # pure Python: holds the GIL in slices
        sum(i * i for i in range(10_000))
    x, y = np.ones(8, np.float32), np.ones(8, np.float32)
    infos = [h.wait(timeout=30) for h in (a.all_reduce_async(x), b.all_reduce_async(y))]
    assert [i.world_size for i in infos] == [2, 2] and float(x[0]) == 2.0
    assert master.statistics().kicks == kicks, master.events()
    assert master.statistics().accepted_peers == 2
    assert a.world_size == b.world_size == 2


def test_a_handle_is_pending_until_every_peer_called_and_wait_can_time_out(pair) -> None:  # noqa: ANN001
    _, a, b = pair
    x, y = np.ones(8, np.float32), np.full(8, 2.0, np.float32)
    handle = a.all_reduce_async(x, tag=5)
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.3)
    assert not handle.done()
    b.all_reduce(y, tag=5)
    assert handle.wait(timeout=30).world_size == 2 and float(x[0]) == 3.0


def test_a_cancelled_handle_ends_its_call_and_frees_its_tag(pair) -> None:  # noqa: ANN001
    """``handle.cancel()`` cancels as an interrupted ``wait()`` does: the call ends with an error
    (here its vote was still open: withdrawn), the input keeps its values, and the tag can be
    used again by both peers."""
    _, a, b = pair
    x, y = np.ones(8, np.float32), np.full(8, 2.0, np.float32)
    handle = a.all_reduce_async(x, tag=5)
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.3)
    handle.cancel()
    with pytest.raises(InvalidUsage, match="cancelled"):
        handle.wait(timeout=30)
    assert handle.done() and float(x[0]) == 1.0
    handle.cancel()  # nothing once it has ended

    def again(comm, arr):  # noqa: ANN001, ANN202
        # The withdrawal goes out from a background task once the call has ended: b's call may
        # reach the master first and join the op a withdraws, which then aborts on b (the
        # documented effect of a cancellation on the others; the input comes back) and b calls
        # again, as a training loop does.  Without the retry b gave up while a waited for it.
        for _ in range(3):
            try:
                return comm.all_reduce(arr, tag=5)
            except CollectiveAborted:
                continue
        return comm.all_reduce(arr, tag=5)

    infos = _both(lambda: again(a, x), lambda: again(b, y))
    assert [i.world_size for i in infos] == [2, 2] and float(x[0]) == float(y[0]) == 3.0


def test_errors_are_the_same_pccl_types_in_the_callers_thread(pair) -> None:  # noqa: ANN001
    master, a, b = pair
    with pytest.raises(InvalidArgument, match=r"pass tensor\.contiguous\(\)"):
        a.all_reduce_async(torch.ones(4, 4).t()).wait()
    with pytest.raises(InvalidArgument, match=r"pass tensor\.detach\(\)"):
        a.all_reduce(torch.ones(4, requires_grad=True))
    first = a.all_reduce_async(np.ones(4, np.float32), tag=9)
    with pytest.raises(InvalidUsage, match="already in flight"):
        a.all_reduce(np.ones(4, np.float32), tag=9)
    b.all_reduce(np.ones(4, np.float32), tag=9)
    first.wait(timeout=30)
    b.close()
    with pytest.raises(InvalidUsage, match="closed"):
        b.all_reduce(np.ones(4, np.float32))
    deadline = time.monotonic() + 30
    while a.world_size > 1:  # b's leave removed it; the next update tells a
        assert time.monotonic() < deadline
        a.update_topology()
    with pytest.raises(TooFewPeers) as info:
        a.all_reduce(np.ones(4, np.float32))
    assert type(info.value) is TooFewPeers
    assert master.statistics().kicks == 0  # b left cleanly


def test_unreachable_master_raises_in_the_caller() -> None:
    from pccl.tools.bench import free_port

    config = pccl.Config(connect_timeout=0.5, master_wait_timeout=1.0)
    with pytest.raises(MasterUnreachable, match="waited 1 s"):
        pccl.blocking.open_communicator(f"127.0.0.1:{free_port()}", config=config)


def test_steps_is_a_plain_iterator_and_a_joiner_gets_the_state() -> None:
    with master_in_thread(CFG) as master:
        w0 = np.arange(100, dtype=np.float32)
        results: dict[str, list[int]] = {}

        def loop(name: str, comm: pccl.blocking.Communicator, w: np.ndarray, steps: int) -> None:
            state = pccl.SharedState({"w": w})
            seen = []
            for info in comm.steps(state):
                seen.append(info.rx_bytes)
                if state.revision >= steps:
                    break
                grads = np.ones_like(w)
                comm.all_reduce(grads, op=ReduceOp.AVG)
                w -= grads
                state.revision += 1
            results[name] = seen

        a, b = _pair(master)
        try:
            wb = np.zeros(100, np.float32)
            t = threading.Thread(target=loop, args=("b", b, wb, 3))
            t.start()
            loop("a", a, w0, 3)
            t.join(60)
        finally:
            a.close()
            b.close()
        assert np.array_equal(w0, wb) and float(w0[5]) == 5 - 3
        assert results["a"][0] == 0 and results["b"][0] == w0.nbytes and not any(results["b"][1:])


def test_ctrl_c_exits_promptly_and_the_master_sees_a_clean_leave(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pccl.protocol.master.machine")
    config = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.2, p2p_base_port=0)
    with master_in_thread(config) as master:
        cmd = [sys.executable, str(HERE / "blocking_peer.py"), master.address, "2.0", "0.2"]
        procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        try:
            # the first to register is accepted alone and waits in steps(); it accepts the other
            steps = {0: 0, 1: 0}

            def read(i: int) -> None:
                assert procs[i].stdout is not None
                for line in procs[i].stdout:
                    if line.startswith("{") and "step" in line:
                        steps[i] = json.loads(line)["step"]

            readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
            for r in readers:
                r.start()
            deadline = time.monotonic() + 60
            while min(steps.values()) < 3:
                assert time.monotonic() < deadline, f"no steps: {steps} {[p.poll() for p in procs]}"
                assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs if p.stderr]
                time.sleep(0.05)
            kicks = master.statistics().kicks
            procs[0].send_signal(signal.SIGINT)
            sent = time.monotonic()
            procs[0].wait(timeout=10)
            took = time.monotonic() - sent
            assert took < 5.0, took
            assert procs[0].returncode in (-signal.SIGINT, 130, 1)
            deadline = time.monotonic() + 10
            while master.statistics().accepted_peers != 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert master.statistics().kicks == kicks  # not removed for silence: it left
            assert any("left the run" in r.getMessage() for r in caplog.records), caplog.text
            # the survivor goes on (alone: it waits in steps() for a newcomer)
            assert procs[1].poll() is None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait(10)
