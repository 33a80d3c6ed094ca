"""Point-to-point ``send`` / ``recv`` end to end on real TCP (issue 44, the core part).

Two blocking communicators in this process under a master thread: correctness over dtypes and
sizes, in-order matching per tag, shape mismatches failing both calls, peers outside the group,
timeouts and the refusal of quantization.  Then a peer as an OS process that streams large
messages (or receives them) and is SIGKILLed: the pending call on this side ends with the
retry-safe ``PeerDisconnected`` within the grace, in both directions, and a receiver's buffer
holds its old values.
"""

from __future__ import annotations

import concurrent.futures
import json
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pccl
import pccl.blocking
from pccl import InvalidArgument, PeerDisconnected, TransferTimeout
from pccl.testing import MasterThread, master_in_thread

HERE = pathlib.Path(__file__).resolve().parent
CFG = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.3, connect_timeout=5.0, p2p_base_port=0)
#: How long a dead peer may take to end the call on this side: its connections are reset by its
#: kernel at once; the rest is a loaded 2-core machine's slack.
GRACE = 10.0


def _pair(master: MasterThread) -> tuple[pccl.blocking.Communicator, pccl.blocking.Communicator]:
    first = pccl.blocking.open_communicator(master.address, config=CFG)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        second = pool.submit(pccl.blocking.open_communicator, master.address, config=CFG)
        deadline = time.monotonic() + 30
        while not first.are_peers_pending():
            assert time.monotonic() < deadline, "the second peer never registered"
            time.sleep(0.02)
        first.update_topology()
        return first, second.result(timeout=30)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[pccl.blocking.Communicator, pccl.blocking.Communicator]]:
    with master_in_thread(CFG) as master:
        a, b = _pair(master)
        try:
            yield a, b
        finally:
            a.close()
            b.close()


def _both(fa: Callable[[], Any], fb: Callable[[], Any]) -> tuple[Any, Any]:
    """Two blocking calls that must meet, each raising into its own slot."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(fb)
        try:
            mine: Any = fa()
        except pccl.PCCLError as exc:
            mine = exc
        try:
            theirs: Any = other.result(timeout=60)
        except pccl.PCCLError as exc:
            theirs = exc
        return mine, theirs


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.uint8]
SIZES = [0, 1, 1001, (8 << 20) // 4]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_send_recv_every_dtype_and_size(pair, dtype) -> None:  # noqa: ANN001
    a, b = pair
    rng = np.random.default_rng(7)
    for size in SIZES:
        x = (rng.standard_normal(size) * 100).astype(dtype)
        y = np.zeros(size, dtype)
        # b -> a as well as a -> b: each direction has its own connection
        for src, dst, s_arr, d_arr in ((a, b, x, y), (b, a, x, y.copy())):
            d_arr[...] = 0
            _both(lambda: src.send(s_arr, to=dst.peer_id, tag=3), lambda: dst.recv(d_arr, from_=src.peer_id, tag=3))
            assert d_arr.tobytes() == s_arr.tobytes(), (np.dtype(dtype).name, size)


def test_a_message_of_several_frames_of_different_sizes_arrives_whole(pair) -> None:  # noqa: ANN001
    """A link's first data frame is 16 MiB and the next ones follow its measured rate (up to
    64 MiB): 100 MiB messages in both directions cross frame boundaries that move from one
    message to the next, and every byte lands where it belongs."""
    a, b = pair
    rng = np.random.default_rng(11)
    for _ in range(2):
        x = rng.integers(0, 1 << 32, (100 << 20) // 4, dtype=np.uint32)
        for src, dst in ((a, b), (b, a)):
            y = np.zeros_like(x)
            _both(lambda: src.send(x, to=dst.peer_id, tag=4), lambda: dst.recv(y, from_=src.peer_id, tag=4))
            assert np.array_equal(y, x)


def test_shapes_may_differ_and_torch_tensors_work(pair) -> None:  # noqa: ANN001
    torch = pytest.importorskip("torch")
    a, b = pair
    x = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    y = torch.zeros(12, dtype=torch.bfloat16)
    _both(lambda: a.send(x, to=b.peer_id), lambda: b.recv(y, from_=a.peer_id))
    assert torch.equal(y, x.reshape(-1))


def test_messages_match_in_order_per_tag(pair) -> None:  # noqa: ANN001
    a, b = pair
    sends = [a.send_async(np.full(100, i, np.int64), to=b.peer_id, tag=i % 2) for i in range(6)]
    outs = [np.zeros(100, np.int64) for _ in range(6)]
    # tag 1 first: the sends on tag 0 wait for their receives meanwhile, without blocking tag 1
    recvs = [b.recv_async(outs[i], from_=a.peer_id, tag=1) for i in (1, 3, 5)]
    recvs += [b.recv_async(outs[i], from_=a.peer_id, tag=0) for i in (0, 2, 4)]
    for handle in sends + recvs:
        handle.wait(timeout=60)
    assert [int(o[0]) for o in outs] == list(range(6))
    assert all(bool((o == o[0]).all()) for o in outs)


def test_mismatch_fails_both_calls_and_leaves_the_receiver_untouched(pair) -> None:  # noqa: ANN001
    a, b = pair
    y = np.full(10, 7, np.float32)
    got_a, got_b = _both(lambda: a.send(np.ones(12, np.float32), to=b.peer_id, tag=9),
                         lambda: b.recv(y, from_=a.peer_id, tag=9))
    assert isinstance(got_a, InvalidArgument) and isinstance(got_b, InvalidArgument), (got_a, got_b)
    for exc in (got_a, got_b):
        assert "12 float32 elements" in str(exc) and "10 float32 elements" in str(exc), exc
    assert bool((y == 7).all())
    got_a, got_b = _both(lambda: a.send(np.ones(10, np.float16), to=b.peer_id, tag=9),
                         lambda: b.recv(y, from_=a.peer_id, tag=9))
    assert isinstance(got_a, InvalidArgument) and isinstance(got_b, InvalidArgument), (got_a, got_b)
    assert "float16" in str(got_b) and "float32" in str(got_b)
    assert bool((y == 7).all())
    # the pair's connections carry on
    _both(lambda: a.send(np.ones(10, np.float32), to=b.peer_id, tag=9), lambda: b.recv(y, from_=a.peer_id, tag=9))
    assert bool((y == 1).all())


def test_bad_peers_timeouts_and_quantization_are_refused(pair) -> None:  # noqa: ANN001
    a, b = pair
    x = np.zeros(4, np.float32)
    stranger = max(a.ring) + 12345
    with pytest.raises(InvalidArgument, match=f"{stranger:x} is not an accepted member"):
        a.send(x, to=stranger)
    with pytest.raises(InvalidArgument, match=f"{stranger:x} is not an accepted member"):
        a.recv(x, from_=stranger)
    with pytest.raises(InvalidArgument, match="own id"):
        a.send(x, to=a.peer_id)
    with pytest.raises(InvalidArgument, match="quantization"):
        a.send(x, to=b.peer_id, quantization=pccl.Quantization("uint8"))
    with pytest.raises(InvalidArgument, match="read-only"):
        x.flags.writeable = False
        a.recv(x, from_=b.peer_id)
    # nobody sends: the receive times out, withdrawn, and the next message is matched as usual
    y = np.full(4, 5, np.float32)
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        a.recv(y, from_=b.peer_id, tag=4, timeout=0.5)
    assert time.monotonic() - started < 5 and bool((y == 5).all())
    _both(lambda: b.send(np.ones(4, np.float32), to=a.peer_id, tag=4), lambda: a.recv(y, from_=b.peer_id, tag=4))
    assert bool((y == 1).all())


# --- a peer process SIGKILLed mid-stream -------------------------------------------------------------


class _Child:
    def __init__(self, master: str, mode: str, nbytes: int) -> None:
        self.popen = subprocess.Popen([sys.executable, str(HERE / "point_peer.py"), master, mode, str(nbytes)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            if line.startswith("{"):
                self.events.put(json.loads(line))
            else:
                self.log.append(line.rstrip("\n"))

    def event(self, timeout: float = 60) -> dict[str, Any]:
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("the peer process said nothing:\n" + "\n".join(self.log[-30:])) from None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
        if sig == signal.SIGKILL:
            self.popen.wait(10)


NBYTES = 256 << 20


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
@pytest.mark.parametrize("child_mode", ["send", "recv"])
def test_a_peer_killed_or_stalled_mid_stream_ends_the_call_here(child_mode: str, sig: int) -> None:
    """SIGKILL: its kernel resets the connections at once.  SIGSTOP: it falls silent (no
    keepalives, no data) and is detected within ``Config.peer_timeout``."""
    with master_in_thread(CFG) as master:
        comm = pccl.blocking.open_communicator(master.address, config=CFG)
        child = _Child(master.address, child_mode, NBYTES)
        try:
            deadline = time.monotonic() + 60
            while not comm.are_peers_pending():
                assert time.monotonic() < deadline, "the peer process never registered:\n" + "\n".join(child.log)
                time.sleep(0.05)
            comm.update_topology()
            hello = child.event()
            assert hello["other"] == comm.peer_id
            other = hello["peer_id"]
            buffer = np.zeros(NBYTES, np.uint8)
            # a few whole messages first, then kill the child while the next ones stream
            for i in range(3):
                if child_mode == "send":
                    comm.recv(buffer, from_=other)
                    assert int(buffer[0]) == int(buffer[-1]) == i % 200 + 1
                else:
                    buffer.fill(i % 200 + 1)
                    comm.send(buffer, to=other)
            buffer.fill(0)
            handle = (comm.recv_async(buffer, from_=other) if child_mode == "send"
                      else comm.send_async(buffer, to=other))
            time.sleep(0.05)  # the message is under way: 256 MiB take longer than that even on loopback
            child.kill(sig)
            killed = time.monotonic()
            with pytest.raises(PeerDisconnected, match=f"{other:x}") as failed:
                handle.wait(timeout=GRACE)
            print(f"{child_mode}: {failed.value} after {time.monotonic() - killed:.3f} s")
            assert time.monotonic() - killed < GRACE
            if sig == signal.SIGSTOP:
                assert "silent" in str(failed.value) or "timed out" in str(failed.value), failed.value
            if child_mode == "send":
                assert not buffer.any(), "a failed recv wrote into the receiver's buffer"
            # retry-safe: the communicator itself is fine (alone now, it still answers)
            assert comm.peer_id != other
        finally:
            child.kill()
            comm.close()
