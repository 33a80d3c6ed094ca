"""The all-reduce end to end on real TCP (issue 6 acceptance).

Part 1 — peers as OS processes (``allreduce_peer.py``) under a ``pccl master`` process: every op x
dtype x size for N = 2, 3, 4 against numpy, bit-identical results with and without quantization,
exact payload byte counts, concurrent tags, usage errors, a peer SIGKILLed / SIGSTOPped mid-op.
Each process regenerates its inputs from a seed, reports digests of its outputs, and the test
computes the reference (:func:`pccl.collectives.reference.ring_reference`, in the ring order the
processes report) itself.

Part 2 — peers as Trio tasks in this process, where the test needs a hand inside the op:
cancellation mid-ring and during the vote, an abort that reaches peers which already finished
their ring, a ring that stalls while every peer still answers the master.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio

import pccl
import pccl.testing
from pccl import CollectiveAborted, Config, InvalidArgument, InvalidUsage, Quantization, ReduceOp, TooFewPeers
from pccl.protocol import messages as m
from pccl.collectives.reference import ring_reference
from pccl.net.base import Listener, Network, Stream
from pccl.net.tcp import TcpNetwork
from pccl.collectives.buckets import DEFAULT_BUCKET_BYTES, SEGMENTED_MIN_BYTES, plan_buckets
from pccl.protocol.ring import EXCHANGE_MAX_BYTES, uses_exchange
from pccl.testing import open_test_cluster
from allreduce_cases import digest, make_input, matrix_cases, np_dtype, reduce_op

HERE = pathlib.Path(__file__).resolve().parent
TOKEN = "allreduce-e2e-token"
#: Short enough for the SIGSTOP test, long enough that a peer starved of CPU on a loaded 2-core
#: machine is not taken for a dead one.
PEER_TIMEOUT = 3.0
HEARTBEAT = 0.3
#: Generous bound for one command on a loaded 2-core machine.
BOUND = 90.0


# =================================================================================================
# Part 1: OS processes
# =================================================================================================


class _Proc:
    """A child process whose stdout (stderr merged) is read by a thread: JSON lines are events,
    anything else is kept as log text for failure messages."""

    def __init__(self, argv: list[str], *, stderr_is_log: bool = False) -> None:
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if stderr_is_log else subprocess.STDOUT, text=True, bufsize=1,
        )
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.log: list[str] = []
        stream = self.popen.stderr if stderr_is_log else self.popen.stdout
        self._reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._reader.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            line = line.rstrip("\n")
            if line.startswith("{"):
                self.events.put(json.loads(line))
            else:
                self.log.append(line)
                del self.log[:-200]

    def send(self, obj: dict[str, Any]) -> None:
        assert self.popen.stdin is not None
        self.popen.stdin.write(json.dumps(obj) + "\n")
        self.popen.stdin.flush()

    def next(self, timeout: float = BOUND) -> dict[str, Any]:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no event from pid {self.popen.pid} within {timeout} s; log:\n"
                                 + "\n".join(self.log[-40:])) from None
        if event.get("event") == "fatal":
            raise AssertionError(f"peer process failed: {event}; log:\n" + "\n".join(self.log[-40:]))
        return event

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait()
        for pipe in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


class Cluster:
    """A ``pccl master`` process and ``world`` peer processes, all accepted into one group."""

    #: The peer program (beside this file), run as ``SCRIPT MASTER TOKEN TIMEOUT HEARTBEAT INDEX WORLD``.
    script = "allreduce_peer.py"

    def __init__(self, world: int) -> None:
        self.world = world
        self.master: _Proc | None = None
        self.peers: list[_Proc] = []
        self.peer_ids: list[int] = []
        self.ring: list[int] = []

    def start(self) -> Cluster:
        self.master = _Proc([sys.executable, "-m", "pccl", "master", "--listen", "127.0.0.1:0", "--token", TOKEN,
                             "--peer-timeout", str(PEER_TIMEOUT), "--heartbeat-interval", str(HEARTBEAT)],
                            stderr_is_log=True)
        address = self._master_address()
        for index in range(self.world):
            self.peers.append(_Proc([sys.executable, str(HERE / self.script), address, TOKEN,
                                     str(PEER_TIMEOUT), str(HEARTBEAT), str(index), str(self.world)]))
        ready = [p.next() for p in self.peers]
        self.peer_ids = [e["peer_id"] for e in ready]
        self.ring = ready[0]["ring"]
        assert all(e["ring"] == self.ring for e in ready) and sorted(self.ring) == sorted(self.peer_ids)
        return self

    def _master_address(self) -> str:
        assert self.master is not None
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            for line in list(self.master.log):
                if "master listening on" in line:
                    return line.rsplit(" ", 1)[-1]
            if self.master.popen.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError("the master did not start:\n" + "\n".join(self.master.log))

    def index_of(self, peer_id: int) -> int:
        return self.peer_ids.index(peer_id)

    def close(self) -> None:
        for p in self.peers:
            with contextlib.suppress(OSError, ValueError):  # ValueError: already stopped
                p.send({"cmd": "exit"})
        for p in self.peers:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.popen.wait(timeout=5)
            p.stop()
        if self.master is not None:
            self.master.stop()


@pytest.fixture
def cluster_factory() -> Iterator[Any]:
    clusters: list[Cluster] = []

    def make(world: int) -> Cluster:
        cluster = Cluster(world)
        clusters.append(cluster)
        return cluster.start()

    yield make
    for c in clusters:
        c.close()


def _inputs_in_ring(cluster: Cluster, ring: list[int], seed: int, n: int, dtype: str, op: str) -> list[np.ndarray]:
    return [make_input(seed, cluster.index_of(pid), n, dtype, op) for pid in ring]


def _payload_items(dtype: str) -> tuple[int, int]:
    """Bytes per element on the wire: reduce-scatter (f32 partial sums for f16/bf16), all-gather."""
    size = np_dtype(dtype).itemsize
    return (4 if dtype in ("float16", "bfloat16") else size), size


def _check_quantized(cluster: Cluster, case: dict[str, Any], outputs: list[np.ndarray], ring: list[int]) -> None:
    """Quantized results: close to the exact f64 result within the error min-max quantization
    can make (a step of ``range / levels`` per quantization, ring hops included)."""
    world = len(ring)
    inputs = [x.astype(np.float64) for x in _inputs_in_ring(cluster, ring, case["seed"], case["n"], case["dtype"],
                                                             case["op"])]
    exact = {"SUM": np.sum, "AVG": np.sum, "MAX": np.max}[case["op"]](np.stack(inputs), axis=0)
    if case["op"] == "AVG":
        exact = exact / world
    levels = 255 if case["quant"] == "uint8" else 65535
    spread = max(float(x.max() - x.min()) for x in inputs)
    tol = spread * world * (world + 1) / (2 * levels)
    if case["op"] == "AVG":
        tol /= world
    rounding = {"float16": 2**-10, "bfloat16": 2**-7}.get(case["dtype"], 0.0)
    got = outputs[0].astype(np.float64)
    err = np.abs(got - exact)
    assert np.all(err <= tol + rounding * np.abs(exact) + 1e-9), \
        f"{case['key']}: max error {err.max():.4g} > tolerance {tol:.4g}"
    assert err.mean() < tol / 2 + rounding * np.abs(exact).mean(), f"{case['key']}: mean error {err.mean():.4g}"


@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])  # 4: ~13 s, like 3
def test_every_op_and_dtype_matches_numpy(cluster_factory: Any, world: int, tmp_path: pathlib.Path) -> None:
    cluster = cluster_factory(world)
    paths = [tmp_path / f"peer{i}.npz" for i in range(world)]
    for p, path in zip(cluster.peers, paths):
        p.send({"cmd": "matrix", "out": str(path)})
    reports = [p.next() for p in cluster.peers]
    saved = [np.load(path) for path in paths]
    ring = reports[0]["ring"]
    assert ring == cluster.ring
    wrong: list[str] = []
    for case in matrix_cases():
        key = case["key"]
        results = [r["results"][key] for r in reports]
        errors = [r for r in results if "error" in r]
        if errors:
            wrong.append(f"{key}: {errors[0]}")
            continue
        assert all(r["world"] == world for r in results), key
        # Bit-identical on every peer, with and without quantization.
        if len({r["digest"] for r in results}) != 1:
            wrong.append(f"{key}: peers differ")
            continue
        tx = [r["tx"] for r in results]
        rx = [r["rx"] for r in results]
        assert sum(tx) == sum(rx), key
        if case["quant"] is None:
            rs_item, ag_item = _payload_items(case["dtype"])
            if uses_exchange(world, case["n"] * ag_item, quantized=False):
                # A small op: every input travels to every other peer once, in its own dtype.
                assert tx == rx == [(world - 1) * case["n"] * ag_item] * world, key
            else:
                # Every chunk crosses N-1 links in each phase.
                assert sum(tx) == (world - 1) * case["n"] * (rs_item + ag_item), key
                if case["n"] % world == 0:
                    assert tx == rx == [(world - 1) * case["n"] // world * (rs_item + ag_item)] * world, key
            reference = ring_reference(_inputs_in_ring(cluster, ring, case["seed"], case["n"], case["dtype"],
                                                       case["op"]), reduce_op(case["op"]))
            if digest(reference) != results[0]["digest"]:
                detail = ""
                if key in saved[0].files:  # small cases are saved whole: show the first elements
                    detail = f": got {saved[0][key].view(np_dtype(case['dtype']))[:4]}, expected {reference[:4]}"
                wrong.append(f"{key}: differs from numpy{detail}")
        else:
            outputs = [s[key].view(np_dtype(case["dtype"])) for s in saved]
            assert all(np.array_equal(o.view(np.uint8), outputs[0].view(np.uint8)) for o in outputs), key
            _check_quantized(cluster, case, outputs, ring)
    assert not wrong, f"{len(wrong)} wrong cases:\n" + "\n".join(wrong[:30])


def _spec(tag: int, seed: int, n: int, dtype: str, op: str, **extra: Any) -> dict[str, Any]:
    return {"tag": tag, "seed": seed, "n": n, "dtype": dtype, "op": op, **extra}


def _run_ops(cluster: Cluster, specs_for: Any, **cmd: Any) -> list[dict[str, Any]]:
    """Send an ``ops`` command to every peer (``specs_for(index)`` gives its specs)."""
    for i, p in enumerate(cluster.peers):
        p.send({"cmd": "ops", "ops": specs_for(i), **cmd})
    return [p.next() for p in cluster.peers]


def _expect_reference(cluster: Cluster, reports: list[dict[str, Any]], specs: list[dict[str, Any]]) -> None:
    ring = reports[0]["ring"]
    for k, spec in enumerate(specs):
        results = [r["results"][k] for r in reports]
        assert all(r.get("ok") for r in results), results
        assert len({r["digest"] for r in results}) == 1, f"tag {spec['tag']}: peers differ"
        assert all(r["world"] == len(ring) for r in results)
        if spec.get("quant") is None:
            ref = ring_reference(_inputs_in_ring(cluster, ring, spec["seed"], spec["n"], spec["dtype"], spec["op"]),
                                 reduce_op(spec["op"]))
            assert results[0]["digest"] == digest(ref), f"tag {spec['tag']} differs from numpy"


def test_concurrent_tags_and_usage_errors(cluster_factory: Any) -> None:
    cluster = cluster_factory(3)
    two = [_spec(1, 1, 100_000, "float32", "SUM"), _spec(2, 2, 1025, "int32", "MAX")]
    _expect_reference(cluster, _run_ops(cluster, lambda i: two), two)

    eight = [
        _spec(10, 10, 300_000, "float32", "AVG"),
        _spec(11, 11, 1025, "float16", "SUM"),
        _spec(12, 12, 77_777, "bfloat16", "MAX"),
        _spec(13, 13, 3, "int64", "PROD"),
        _spec(14, 14, 50_000, "uint8", "MIN", in_place=False),
        _spec(15, 15, 200_000, "float64", "SUM", quant="uint8"),
        _spec(16, 16, 1, "uint16", "SUM"),
        _spec(17, 17, 123_457, "float32", "SUM", quant="uint16", in_place=False),
    ]
    _expect_reference(cluster, _run_ops(cluster, lambda i: eight), eight)

    # A tag reused while in flight: on every peer one call runs, the other is refused.
    same = [_spec(5, 5, 50_000, "float32", "SUM"), _spec(5, 5, 50_000, "float32", "SUM")]
    reports = _run_ops(cluster, lambda i: same)
    ring = reports[0]["ring"]
    ref = digest(ring_reference(_inputs_in_ring(cluster, ring, 5, 50_000, "float32", "SUM"), ReduceOp.SUM))
    for r in reports:
        outcomes = sorted(res.get("error", "ok") for res in r["results"])
        assert outcomes == ["InvalidUsage", "ok"], r
        assert [res["digest"] for res in r["results"] if res.get("ok")] == [ref]
        assert all(res["untouched"] for res in r["results"] if "error" in res)

    # Mismatched count, dtype, op, quantization: InvalidUsage on every peer, buffers untouched.
    def mismatched(i: int) -> list[dict[str, Any]]:
        return [
            _spec(20, 20, 1000 + (i == 0), "float32", "SUM"),
            _spec(21, 21, 1000, "float64" if i == 0 else "float32", "SUM"),
            _spec(22, 22, 1000, "float32", "MAX" if i == 1 else "SUM"),
            _spec(23, 23, 1000, "float32", "SUM", quant="uint8" if i == 2 else None),
        ]

    for r in _run_ops(cluster, mismatched):
        assert [res.get("error") for res in r["results"]] == ["InvalidUsage"] * 4, r
        assert all(res["untouched"] for res in r["results"])
    # The refused tags are free again.
    again = [_spec(20, 30, 1000, "float32", "SUM")]
    _expect_reference(cluster, _run_ops(cluster, lambda i: again), again)


def _abort_and_retry(cluster_factory: Any, world: int, fault: dict[str, Any]) -> None:
    """The last peer faults mid-op; survivors abort with their input restored, then the retry
    runs over the survivors with AVG divided by their number."""
    cluster = cluster_factory(world)
    victim = cluster.peers[-1]
    spec = _spec(7, 77, 6_000_000, "float32", "AVG")  # 24 MB: the ring takes a while
    for i, p in enumerate(cluster.peers):
        p.send({"cmd": "ops", "ops": [spec], "retry": True, **({"fault": fault} if p is victim else {})})
    reports = [p.next() for p in cluster.peers[:-1]]
    victim_pid = cluster.peer_ids[-1]
    for r in reports:
        res = r["results"][0]
        # A survivor that took part in the op the victim faulted in raises with its input
        # intact; one whose call came after the group had dropped the victim (a process
        # scheduled late on a loaded box) runs only the survivors' op, once.
        if "first_error" in res:
            assert res["first_error"] == "CollectiveAborted" and res["restored"] is True, json.dumps(res)
            assert res["attempts"] >= 2, json.dumps(res)
        else:
            assert res["attempts"] == 1, json.dumps(res)
        assert res.get("ok") and res["world"] == world - 1, json.dumps(res)
        assert victim_pid not in r["ring"] and len(r["ring"]) == world - 1
    # The victim faulted with bytes of its ring predecessor in: that one was inside the op.
    predecessor = cluster.ring[(cluster.ring.index(victim_pid) - 1) % world]
    by_peer = dict(zip(cluster.peer_ids[:-1], reports))
    assert "first_error" in by_peer[predecessor]["results"][0], by_peer
    ring = reports[0]["ring"]
    ref = ring_reference(_inputs_in_ring(cluster, ring, spec["seed"], spec["n"], "float32", "AVG"), ReduceOp.AVG)
    assert {r["results"][0]["digest"] for r in reports} == {digest(ref)}
    if fault["kind"] == "kill":
        assert victim.popen.wait(timeout=BOUND) == -signal.SIGKILL
    else:
        assert victim.popen.poll() is None  # still stopped: it was aborted around, not waited for
        victim.stop()


def test_sigkilled_peer_mid_reduce_scatter(cluster_factory: Any) -> None:
    _abort_and_retry(cluster_factory, 3, {"kind": "kill", "at": 0.2})


def test_sigkilled_peer_mid_all_gather(cluster_factory: Any) -> None:
    _abort_and_retry(cluster_factory, 4, {"kind": "kill", "at": 0.7})


def test_sigstopped_peer_is_aborted_around(cluster_factory: Any) -> None:
    _abort_and_retry(cluster_factory, 3, {"kind": "stop", "at": 0.3})


def test_all_reduce_many_retries_on_the_survivors(cluster_factory: Any) -> None:
    cluster = cluster_factory(3)
    arrays = [_spec(0, 40 + k, 1_500_000, "float32", "SUM") for k in range(6)]
    for p in cluster.peers:
        fault = {"kind": "kill", "at": 0.3} if p is cluster.peers[-1] else None
        p.send({"cmd": "many", "arrays": arrays, "max_in_flight": 3, "bucket_bytes": 0, "fault": fault})
    reports = [p.next() for p in cluster.peers[:-1]]
    for r in reports:
        assert "error" not in r, r
        assert r["world"] == 2 and r["retries"] >= 1
    ring = reports[0]["ring"]
    assert reports[1]["digests"] == reports[0]["digests"]
    for k, spec in enumerate(arrays):
        over_survivors = digest(ring_reference(_inputs_in_ring(cluster, ring, spec["seed"], spec["n"], "float32",
                                                                "SUM"), ReduceOp.SUM))
        over_all = digest(ring_reference(_inputs_in_ring(cluster, cluster.ring, spec["seed"], spec["n"], "float32",
                                                          "SUM"), ReduceOp.SUM))
        assert reports[0]["digests"][k] in (over_survivors, over_all), f"array {k}"
    assert over_survivors in reports[0]["digests"]  # at least the ops in flight at the kill were retried


@pytest.mark.parametrize("kind", ["packed", "segmented"])
def test_bucketed_all_reduce_many_retries_per_bucket_on_the_survivors(cluster_factory: Any, kind: str) -> None:
    """Six arrays two per bucket (bucket_bytes fits two); a peer SIGKILLs itself inside a
    bucket's ring.  Every bucket's result is the reduction of its members over the peers it ran
    with: the survivors for the retried ones, everyone for those done before.  Arrays below
    ``SEGMENTED_MIN_BYTES`` are packed (an abort leaves them untouched); larger ones are reduced
    in place over the members (segmented: an abort restores them, else the retry would reduce
    partial sums)."""
    cluster = cluster_factory(3)
    n = {"packed": 200_000, "segmented": 300_000}[kind]
    assert (n * 4 >= SEGMENTED_MIN_BYTES) == (kind == "segmented")
    arrays = [_spec(0, 60 + k, n, "float32", "SUM") for k in range(6)]
    for p in cluster.peers:
        fault = {"kind": "kill", "at": 0.3} if p is cluster.peers[-1] else None
        p.send({"cmd": "many", "arrays": arrays, "max_in_flight": 2, "bucket_bytes": 2 * n * 4, "fault": fault})
    reports = [p.next() for p in cluster.peers[:-1]]
    for r in reports:
        assert "error" not in r, r
        assert r["world"] == 2 and r["retries"] >= 1
    assert reports[1]["digests"] == reports[0]["digests"]

    def bucket_results(ring: list[int], k: int) -> list[str]:
        # bucket k reduces arrays 2k and 2k+1 as one buffer, end to end
        ins = [np.concatenate(pair) for pair in zip(
            _inputs_in_ring(cluster, ring, arrays[2 * k]["seed"], n, "float32", "SUM"),
            _inputs_in_ring(cluster, ring, arrays[2 * k + 1]["seed"], n, "float32", "SUM"))]
        out = ring_reference(ins, ReduceOp.SUM, exchange_max_bytes=0 if kind == "segmented" else EXCHANGE_MAX_BYTES)
        return [digest(out[:n]), digest(out[n:])]

    retried = 0
    for k in range(3):
        got = reports[0]["digests"][2 * k : 2 * k + 2]
        over_survivors = bucket_results(reports[0]["ring"], k)
        assert got in (over_survivors, bucket_results(cluster.ring, k)), f"bucket {k}"
        retried += got == over_survivors
    assert retried >= 1  # the bucket in flight at the kill was retried on the survivors


# =================================================================================================
# Part 2: peers as Trio tasks in this process
# =================================================================================================

CFG = Config(peer_timeout=PEER_TIMEOUT, heartbeat_interval=HEARTBEAT, connect_timeout=5.0, p2p_base_port=0)
#: Bound for anything that should happen promptly in-process.
SOON = 20.0


class _GatedStream(Stream):
    def __init__(self, inner: Stream, network: GatedNetwork) -> None:
        self._inner = inner
        self._network = network
        self.remote_address = inner.remote_address
        self.local_address = inner.local_address

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def receive_into(self, buffer: memoryview | bytearray) -> int:
        await self._network.gate()
        n = await self._inner.receive_into(buffer)
        self._network.received += n
        return n

    async def receive_exactly_into(self, buffer: memoryview | bytearray) -> None:
        view = memoryview(buffer).cast("B")
        network = self._network
        if network.mid_frame and network.hold_after is not None and network.received < network.hold_after:
            head = view[: max(0, network.hold_after - network.received)]  # up to the hold, then stop
            await self._inner.receive_exactly_into(head)
            network.received += head.nbytes
            view = view[head.nbytes:]
        await network.gate()
        await self._inner.receive_exactly_into(view)
        network.received += view.nbytes

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def aclose(self) -> None:
        await self._inner.aclose()

    def abort(self) -> None:
        self._inner.abort()


class _GatedListener(Listener):
    def __init__(self, inner: Listener, network: GatedNetwork) -> None:
        self._inner = inner
        self._network = network
        self.address = inner.address

    async def accept(self) -> Stream:
        return _GatedStream(await self._inner.accept(), self._network)

    async def aclose(self) -> None:
        await self._inner.aclose()


class GatedNetwork(Network):
    """Real TCP whose peer-to-peer receives (not the master connection) stop once ``hold_after``
    bytes have arrived, until :meth:`release`: a peer frozen mid-ring while it still heartbeats."""

    def __init__(self, master_address: str) -> None:
        self._tcp = TcpNetwork(CFG)
        self._master = master_address
        self.received = 0
        self.hold_after: int | None = None
        self.mid_frame = False
        self.held = trio.Event()
        self._released = trio.Event()

    async def connect(self, address: str, *, timeout: float | None = None) -> Stream:
        stream = await self._tcp.connect(address, timeout=timeout)
        return stream if address == self._master else _GatedStream(stream, self)

    async def listen(self, address: str, *, port_range: int = 1) -> Listener:
        return _GatedListener(await self._tcp.listen(address, port_range=port_range), self)

    def hold_after_more(self, nbytes: int, *, mid_frame: bool = False) -> None:
        """Hold the receives once ``nbytes`` more arrived: at the next receive call, or, with
        ``mid_frame``, exactly there, inside a payload receive that spans that point."""
        self.hold_after = self.received + nbytes
        self.mid_frame = mid_frame

    async def gate(self) -> None:
        if self.hold_after is not None and self.received >= self.hold_after and not self._released.is_set():
            self.held.set()
            await self._released.wait()

    def release(self) -> None:
        self._released.set()


def _in_process_group(world: int, *, config: Config = CFG, network: dict[int, Any] | None = None) -> Any:
    """A master and ``world`` accepted communicators (peer ``i`` on ``gated[i]`` if given)."""
    return open_test_cluster(world, token=TOKEN, config=config, soon=SOON, network=network)


def _f32_inputs(world: int, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


def _in_ring_order(comms: list[pccl.Communicator], arrays: list[np.ndarray]) -> list[np.ndarray]:
    by_id = {c.peer_id: a for c, a in zip(comms, arrays)}
    return [by_id[pid] for pid in comms[0].ring]


async def _all_reduce_all(comms: list[pccl.Communicator], bufs: list[np.ndarray], *,
                          victim: trio.CancelScope | None = None,
                          meanwhile: Callable[[], Awaitable[None]] | None = None, **kw: Any) -> list[Any]:
    """Run every peer's call; return each ReduceInfo or the pccl error it raised (``None`` for a
    call cancelled by ``victim``, the scope around peer 0's call).  ``meanwhile`` runs alongside."""
    out: list[Any] = [None] * len(comms)

    async def one(i: int) -> None:
        try:
            with victim if victim is not None and i == 0 else contextlib.nullcontext():
                out[i] = await comms[i].all_reduce(bufs[i], **kw)
        except pccl.PCCLError as exc:
            out[i] = exc

    with trio.fail_after(SOON):
        async with trio.open_nursery() as nursery:
            for i in range(len(comms)):
                nursery.start_soon(one, i)
            if meanwhile is not None:
                await meanwhile()
    return out


async def test_alone_is_too_few_peers_and_bad_buffers_are_refused_before_the_vote() -> None:
    async with _in_process_group(1) as (master, comms, _):
        x = np.arange(10, dtype=np.float32)
        with pytest.raises(TooFewPeers):
            await comms[0].all_reduce(x)
        assert np.array_equal(x, np.arange(10, dtype=np.float32))
        assert comms[0].statistics().collectives_completed == 0
    async with _in_process_group(2) as (master, comms, _):
        good = np.ones(8, np.float32)
        read_only = np.ones(8, np.float32)
        read_only.flags.writeable = False
        bad_calls = [
            dict(send=np.ones(8, np.complex64)),
            dict(send=good, recv=np.ones(9, np.float32)),
            dict(send=good, recv=np.ones(8, np.float64)),
            dict(send=np.ones((8, 2), np.float32)[:, 0]),
            dict(send=good, recv=read_only),
            dict(send=read_only),
            dict(send=good, tag=-1),
            dict(send=good, op=17),
            dict(send=np.ones(8, np.int32), quantization=Quantization()),
            dict(send=[1.0, 2.0]),
        ]
        for kwargs in bad_calls:
            with pytest.raises(InvalidArgument):
                await comms[0].all_reduce(**kwargs)
        assert pccl.testing.master_snapshot(master).ops == ()  # nothing reached the master
        inputs = _f32_inputs(2, 1000, 1)
        bufs = [x.copy() for x in inputs]
        infos = await _all_reduce_all(comms, bufs)
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 2 for i in infos), infos
        assert np.array_equal(bufs[0], ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM))


async def _cancel_peer_0_once_held(comms: list[pccl.Communicator], bufs: list[np.ndarray], gate: GatedNetwork, *,
                                   tag: int, then: Callable[[], Awaitable[None]] | None = None) -> list[Any]:
    """Every peer all-reduces its buffer on ``tag``; once ``gate`` holds peer 0 (and ``then``
    returned), peer 0's call is cancelled.  Returns each peer's ReduceInfo or pccl error (for
    peer 0, which must have been cancelled, ``None``); the gate is released afterwards."""
    victim = trio.CancelScope()

    async def cancel_once_held() -> None:
        await gate.held.wait()
        if then is not None:
            await then()
        victim.cancel()

    outcome = await _all_reduce_all(comms, bufs, victim=victim, meanwhile=cancel_once_held, tag=tag)
    gate.release()
    assert outcome[0] is None and victim.cancelled_caught
    return outcome


async def test_cancelling_mid_ring_restores_the_input_and_aborts_the_others() -> None:
    async with _in_process_group(3, network={0: GatedNetwork}) as (master, comms, networks):
        gate = networks[0]
        inputs = _f32_inputs(3, 3_000_000, 2)
        bufs = [x.copy() for x in inputs]
        gate.hold_after_more(4 << 20)  # freeze peer 0 inside the reduce-scatter
        outcome = await _cancel_peer_0_once_held(comms, bufs, gate, tag=3)
        assert all(isinstance(o, CollectiveAborted) for o in outcome[1:]), outcome
        for buf, x in zip(bufs, inputs):
            assert np.array_equal(buf, x)  # every in-place buffer holds its input again
        assert comms[0].statistics().collectives_aborted == 1
        # The retry re-wires the stale ring and runs over all three.
        infos = await _all_reduce_all(comms, bufs, tag=3)
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
        expected = ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM)
        assert all(np.array_equal(b, expected) for b in bufs)
        assert all(c.statistics().retries >= 1 for c in comms)


async def test_a_segmented_bucket_cancelled_mid_ring_holds_its_inputs_and_is_reduced_again() -> None:
    """all_reduce_many of arrays reduced in place over their members (one segmented bucket):
    peer 0 is frozen inside the reduce-scatter, after its first frames overwrote members, and
    its call is cancelled.  Its arrays hold their inputs when the call has ended.  Peer 1's op
    was aborted: its call retries, and meets peer 0's next call or (its re-wire against that
    call's vote) ends with a phase mismatch — then its arrays hold their inputs too.  Once both
    calls went through, both hold the reduction of the original inputs."""
    async with _in_process_group(2, network={0: GatedNetwork}) as (master, comms, networks):
        gate = networks[0]
        n = SEGMENTED_MIN_BYTES // 4
        sizes = [3 * n, n + 5, 2 * n + 1]
        inputs = [_f32_inputs(2, size, seed) for seed, size in enumerate(sizes)]  # [array][peer]
        lists = [[inputs[k][i].copy() for k in range(len(sizes))] for i in range(2)]
        (bucket,) = plan_buckets(lists[0], DEFAULT_BUCKET_BYTES)
        assert bucket.segmented
        gate.hold_after_more(2 << 20)  # about half of peer 0's reduce-scatter input
        victim = trio.CancelScope()
        results: list[Any] = [None, None]

        async def call(i: int) -> None:
            try:
                results[i] = await comms[i].all_reduce_many(lists[i])
            except CollectiveAborted as exc:
                results[i] = exc

        async def cancelled_call() -> None:
            with victim:
                await call(0)

        def holds_inputs(i: int) -> bool:
            return all(np.array_equal(lists[i][k], inputs[k][i]) for k in range(len(sizes)))

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1)
                async with trio.open_nursery() as first:
                    first.start_soon(cancelled_call)
                    await gate.held.wait()
                    victim.cancel()
                assert victim.cancelled_caught and results[0] is None
                assert holds_inputs(0), "peer 0's arrays were not restored"
                gate.release()
                nursery.start_soon(call, 0)
            for _ in range(3):
                if all(isinstance(r, pccl.ReduceInfo) for r in results):
                    break
                assert all(isinstance(r, CollectiveAborted) for r in results), results
                assert holds_inputs(0) and holds_inputs(1), "an aborted call left partial results"
                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(call, i)
        assert all(isinstance(r, pccl.ReduceInfo) and r.world_size == 2 for r in results), results
        flat = [np.concatenate(per_peer) for per_peer in zip(*inputs)]
        expected = np.split(ring_reference(_in_ring_order(comms, flat), ReduceOp.SUM, exchange_max_bytes=0),
                            np.cumsum(sizes)[:-1])
        for i in range(2):
            for k in range(len(sizes)):
                assert np.array_equal(lists[i][k], expected[k]), (i, k)


async def test_segmented_buckets_cut_differently_are_refused_by_the_master(caplog: pytest.LogCaptureFixture) -> None:
    """Same dtype, same total count, different arrays: the master compares the buckets' layout
    digest per tag and refuses the op on both peers (InvalidUsage, arrays untouched), instead
    of frames that do not line up or a reduction of misaligned arrays."""
    async with _in_process_group(2) as (master, comms, _):
        n = SEGMENTED_MIN_BYTES // 4
        lists = [[np.full(3 * n, 1.0, np.float32), np.full(2 * n, 2.0, np.float32)],
                 [np.full(2 * n, 3.0, np.float32), np.full(3 * n, 4.0, np.float32)]]
        originals = [[a.copy() for a in arrays] for arrays in lists]
        outcome: list[Any] = [None, None]

        async def call(i: int) -> None:
            try:
                outcome[i] = await comms[i].all_reduce_many(lists[i])
            except pccl.PCCLError as exc:
                outcome[i] = exc

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(call, i)
        assert all(isinstance(o, InvalidUsage) and "layout" in str(o) for o in outcome), outcome
        for arrays, before in zip(lists, originals):
            assert all(np.array_equal(a, b) for a, b in zip(arrays, before))
        assert any("disagree" in r.getMessage() and "layout" in r.getMessage() for r in caplog.records)
        # the same cut on both: it goes through
        lists[1] = [np.full(3 * n, 3.0, np.float32), np.full(2 * n, 4.0, np.float32)]
        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(call, i)
        assert all(isinstance(o, pccl.ReduceInfo) for o in outcome), outcome
        assert np.all(lists[0][0] == 4.0) and np.all(lists[1][1] == 6.0)


async def test_two_peer_exchange_aborted_after_one_peer_finished_restores_both_inputs() -> None:
    """A small op of two peers is one exchange: peer 1 gets peer 0's frame and finishes, while
    peer 0 is frozen before receiving and then cancelled.  Both inputs must be intact."""
    async with _in_process_group(2, network={0: GatedNetwork}) as (master, comms, networks):
        gate = networks[0]
        inputs = _f32_inputs(2, 4096, 5)
        bufs = [x.copy() for x in inputs]
        gate.hold_after_more(0)  # peer 0 sends its whole input, then receives nothing

        async def peer_1_reported_success() -> None:  # it reduced peer 0's input into its result
            while not any(comms[1].peer_id in op.done for op in pccl.testing.master_snapshot(master).ops):
                await trio.sleep(0.005)

        outcome = await _cancel_peer_0_once_held(comms, bufs, gate, tag=4, then=peer_1_reported_success)
        assert isinstance(outcome[1], CollectiveAborted), outcome
        assert np.array_equal(bufs[0], inputs[0]) and np.array_equal(bufs[1], inputs[1])
        infos = await _all_reduce_all(comms, bufs, tag=4)
        assert all(isinstance(i, pccl.ReduceInfo) and i.tx_bytes == 4096 * 4 for i in infos), infos
        expected = ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM)
        assert np.array_equal(bufs[0], expected) and np.array_equal(bufs[1], expected)


async def test_concurrent_tags_in_different_orders_with_a_sequential_peer() -> None:
    """Peer 0 runs tags 1 and 2 at once; peer 1 runs 2, then 1.  Tag 1's frames must never hold
    up tag 2 on peer 1's lane (a design that starts a ring before its Commence did that)."""
    async with _in_process_group(2) as (master, comms, _):
        x = [np.full(1000, i + 1, np.float32) for i in range(2)]
        assert all(isinstance(r, pccl.ReduceInfo) for r in await _all_reduce_all(comms, [a.copy() for a in x], tag=1))
        out: dict[str, Any] = {}

        async def record(key: str, call: Any) -> None:
            try:
                out[key] = await call()
            except pccl.PCCLError as exc:
                out[key] = exc

        async def first() -> None:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(record, "0:1", lambda: comms[0].all_reduce(x[0].copy(), tag=1))
                await trio.sleep(0.05)
                nursery.start_soon(record, "0:2", lambda: comms[0].all_reduce(x[0].copy(), tag=2))

        async def second() -> None:
            await trio.sleep(0.02)
            await record("1:2", lambda: comms[1].all_reduce(x[1].copy(), tag=2))
            await record("1:1", lambda: comms[1].all_reduce(x[1].copy(), tag=1))

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(first)
                nursery.start_soon(second)
        assert all(isinstance(v, pccl.ReduceInfo) for v in out.values()), out


async def test_a_tag_reused_right_after_a_cancelled_call_still_reduces_correctly() -> None:
    """Peer 0 gives up on tag 1 after its Done went out and the master said nothing within
    ``peer_timeout`` (peer 1 reports later still: the documented case where a call cancelled after
    its success was reported ends undecided), and calls tag 1 again at once: the new call waits
    for the master's final word on the old op (the tag is still in flight there) instead of being
    refused, then both go on with tag 1 normally."""
    async with _in_process_group(2) as (master, comms, _):
        x = [np.full(1000, i + 1, np.float32) for i in range(2)]
        expect = np.full(1000, 3, np.float32)
        faults = contextlib.ExitStack()

        async def late_done(msg: m.Message) -> None:
            if isinstance(msg, m.CollectiveDone):
                await trio.sleep(PEER_TIMEOUT + 1.0)  # beyond peer 0's wait for the verdict

        bufs = [a.copy() for a in x]
        await _all_reduce_all(comms, bufs, tag=1)
        assert all(np.array_equal(b, expect) for b in bufs)
        faults.enter_context(pccl.testing.intercept_master_sends(comms[1], late_done))
        again: dict[int, Any] = {}
        try:
            async def p0() -> None:
                with trio.move_on_after(0.25) as gave_up:
                    await comms[0].all_reduce(x[0].copy(), tag=1)
                assert gave_up.cancelled_caught
                buf = x[0].copy()
                again[0] = await comms[0].all_reduce(buf, tag=1)
                assert np.array_equal(buf, expect)

            async def p1() -> None:
                buf = x[1].copy()
                await comms[1].all_reduce(buf, tag=1)  # completes: peer 0's success counts
                assert np.array_equal(buf, expect)
                buf = x[1].copy()
                again[1] = await comms[1].all_reduce(buf, tag=1)
                assert np.array_equal(buf, expect)

            with trio.fail_after(SOON):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(p0)
                    nursery.start_soon(p1)
        finally:
            faults.close()
        assert all(isinstance(i, pccl.ReduceInfo) for i in again.values()) and len(again) == 2, again
        for _ in range(2):
            bufs = [a.copy() for a in x]
            infos = await _all_reduce_all(comms, bufs, tag=1)
            assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
            assert all(np.array_equal(b, expect) for b in bufs)


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await trio.sleep(0.005)


async def test_a_call_cancelled_during_the_vote_is_withdrawn_and_frees_its_tag() -> None:
    """Issue 19 item 7: a lone all_reduce(tag=0) cancelled before the others vote withdraws its
    vote; the next tag-0 call works on both peers (it used to be refused here and aborted there)."""
    async with _in_process_group(2) as (master, comms, _):
        inputs = _f32_inputs(2, 100_000, 3)
        bufs = [x.copy() for x in inputs]
        with trio.fail_after(SOON):
            with trio.move_on_after(0.3) as waited:
                await comms[0].all_reduce(bufs[0], tag=0)  # nobody else calls yet: the vote stays open
            assert waited.cancelled_caught
            await _until(lambda: not pccl.testing.master_snapshot(master).ops)  # withdrawn at the master
            infos = await _all_reduce_all(comms, bufs, tag=0)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        expected = ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM)
        assert np.array_equal(bufs[0], expected) and np.array_equal(bufs[1], expected)
        assert comms[0].statistics().collectives_aborted == comms[1].statistics().collectives_aborted == 0


#: Elements of an all-reduce whose first data frame to a peer that does not read cannot fit in
#: the loopback socket buffers (``Config.local_socket_buffer_size``, 256 KiB each side): a
#: cancellation of that send always cuts the frame mid-way, so the lane is torn (its receiver is
#: left with part of a frame) instead of only sometimes, as with the 100 000 elements above.
TEARING = 4_000_000


def _in_order(comms: list[pccl.Communicator]) -> list[pccl.Communicator]:
    by_id = {c.peer_id: c for c in comms}
    return [by_id[pid] for pid in comms[0].ring]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fast_commit", [True, False])
async def test_a_lone_call_cancelled_mid_frame_does_not_abort_the_next_call(fast_commit: bool, world: int) -> None:
    """The test above with a buffer so large that the cut is certain: peer 0's lone call (fast
    commit: it began, and its first frame to its successor waits in the socket buffers) is
    cancelled mid-frame, which tears that lane.  The next call on the tag, on every peer, must
    find the ring re-wired before it runs: it returns a ReduceInfo and nothing counts as aborted
    (the torn lane made the next call abort on every peer).  Without fast commit the lone call
    only voted: nothing moved, nothing tore, and the same holds."""
    config = dataclasses.replace(CFG, fast_commit=fast_commit)
    async with _in_process_group(world, config=config) as (master, comms, _):
        inputs = _f32_inputs(world, TEARING, 6)
        bufs = [x.copy() for x in inputs]
        with trio.fail_after(SOON):
            with trio.move_on_after(0.3) as waited:
                await comms[0].all_reduce(bufs[0], tag=0)
            assert waited.cancelled_caught and np.array_equal(bufs[0], inputs[0])
            assert (pccl.testing.ring_lanes(comms[0]).torn > 0) is fast_commit  # the cut happened
            await _until(lambda: not pccl.testing.master_snapshot(master).ops)  # withdrawn at the master
            infos = await _all_reduce_all(comms, bufs, tag=0)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        expected = ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM)
        assert all(np.array_equal(b, expected) for b in bufs)
        assert [c.statistics().collectives_aborted for c in comms] == [0] * world
        assert all(pccl.testing.ring_lanes(c).torn == 0 for c in comms)  # on a re-wired ring


async def test_a_withdrawal_that_cuts_another_beginners_frame_does_not_abort_the_next_call() -> None:
    """Ring a -> b -> c.  a and b begin tag 0 (c does not call yet); b's first frame to c waits in
    the socket buffers.  a is cancelled and withdraws: the master ends the op (WITHDRAWN) and its
    abort cancels b's ring mid-frame, tearing b's lane to c, while a's own lanes may be whole.
    b retries the tag's next use at once; once a and c call too, all three return (the torn lane
    made every one of these calls abort) and nothing counts as aborted."""
    async with _in_process_group(3) as (master, comms, _):
        a, b, c = _in_order(comms)
        inputs = _f32_inputs(3, TEARING, 7)
        bufs = [x.copy() for x in inputs]  # in ring order
        infos: list[Any] = [None] * 3

        async def call(i: int) -> None:
            try:
                infos[i] = await (a, b, c)[i].all_reduce(bufs[i], tag=0)
            except pccl.PCCLError as exc:
                infos[i] = exc

        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 1)
                with trio.move_on_after(0.3) as waited:
                    await a.all_reduce(bufs[0], tag=0)
                assert waited.cancelled_caught and np.array_equal(bufs[0], inputs[0])
                await _until(lambda: b.statistics().retries > 0)  # withdrawn: b retries
                assert pccl.testing.ring_lanes(b).torn > 0  # the cut happened
                nursery.start_soon(call, 0)
                nursery.start_soon(call, 2)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        expected = ring_reference(inputs, ReduceOp.SUM)
        assert all(np.array_equal(x, expected) for x in bufs)
        assert [comm.statistics().collectives_aborted for comm in (a, b, c)] == [0, 0, 0]


@pytest.mark.parametrize("fast_commit", [True, False])
async def test_a_receiver_cancelled_mid_payload_does_not_abort_the_next_call(fast_commit: bool) -> None:
    """Ring a -> b -> c; b's receives stop part-way through a's first frame (its network holds
    them, inside the payload) and b's call is cancelled there: its payload receive is cut, which
    tears its lane from a (and its op's end aborts its lane to c, whose frame was under way).
    Fast commit: a and b began, c does not call, and b withdraws (a retries the tag's next
    use, then b and c call).  Without it every peer called: the op had commenced, so a and c
    raise CollectiveAborted, as any cancellation mid-ring makes them, and all three call again.
    Either way those next calls return on every peer, and none of them counts as aborted."""
    config = dataclasses.replace(CFG, fast_commit=fast_commit)
    async with _in_process_group(3, config=config, network=dict.fromkeys(range(3), GatedNetwork)) as (
            master, comms, networks):
        a, b, c = _in_order(comms)
        gate = networks[comms.index(b)]
        inputs = _f32_inputs(3, TEARING, 8)
        bufs = [x.copy() for x in inputs]  # in ring order
        infos: list[Any] = [None] * 3
        victim = trio.CancelScope()

        async def call(i: int, scope: trio.CancelScope | None = None) -> None:
            try:
                with scope if scope is not None else contextlib.nullcontext():
                    infos[i] = await (a, b, c)[i].all_reduce(bufs[i], tag=0)
            except pccl.PCCLError as exc:
                infos[i] = exc

        gate.hold_after_more(1 << 20, mid_frame=True)  # inside a's first frame (megabytes)
        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, 0)
                if not fast_commit:
                    nursery.start_soon(call, 2)
                async with trio.open_nursery() as cancelled:
                    cancelled.start_soon(call, 1, victim)
                    await gate.held.wait()
                    victim.cancel()
                assert victim.cancelled_caught and infos[1] is None and np.array_equal(bufs[1], inputs[1])
                assert pccl.testing.ring_lanes(b).torn > 0  # the cut happened
                gate.release()
                if fast_commit:
                    await _until(lambda: a.statistics().retries > 0)  # withdrawn: a retries
                    nursery.start_soon(call, 1)
                    nursery.start_soon(call, 2)
            if not fast_commit:
                assert all(isinstance(infos[i], CollectiveAborted) for i in (0, 2)), infos
                assert all(np.array_equal(x, want) for x, want in zip(bufs, inputs))
                async with trio.open_nursery() as nursery:
                    for i in range(3):
                        nursery.start_soon(call, i)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        expected = ring_reference(inputs, ReduceOp.SUM)
        assert all(np.array_equal(x, expected) for x in bufs)
        cancelled = 0 if fast_commit else 1  # a commenced op cancelled mid-ring aborts (b counts its own)
        assert [comm.statistics().collectives_aborted for comm in (a, b, c)] == [cancelled] * 3


async def test_a_call_cancelled_during_the_vote_does_not_block_the_next_step() -> None:
    """Right after cancelling a lone all-reduce, update_topology and a reuse of the tag work at
    once: each waits for the withdrawal (one round trip) instead of being refused."""
    async with _in_process_group(2) as (master, comms, _):
        inputs = _f32_inputs(2, 1000, 4)
        with trio.fail_after(SOON):
            with trio.move_on_after(0.2):
                await comms[0].all_reduce(inputs[0].copy(), tag=5)
            async with trio.open_nursery() as nursery:
                for comm in comms:
                    nursery.start_soon(comm.update_topology)
            bufs = [x.copy() for x in inputs]
            infos = await _all_reduce_all(comms, bufs, tag=5)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert np.array_equal(bufs[0], bufs[1])


@pytest.mark.parametrize("fast_commit", [False, True])
async def test_a_withdrawal_that_crosses_the_commence_aborts_the_others_once(fast_commit: bool) -> None:
    """Peer 0 is cancelled during the vote (or, with fast commit, in the op it began alone),
    but peer 1's vote (its Begin) reaches the master before the withdrawal: the op commenced
    (every participant began), so peer 0's withdrawal is its abort and peer 1 sees
    CollectiveAborted (input intact); both then reuse the tag normally."""
    async with _in_process_group(2, config=dataclasses.replace(CFG, fast_commit=fast_commit)) as (master, comms, _):
        inputs = _f32_inputs(2, 10_000, 5)
        bufs = [x.copy() for x in inputs]
        faults = contextlib.ExitStack()

        def crossed() -> bool:
            return any(op.seq is not None and comms[1].peer_id in op.voters
                       for op in pccl.testing.master_snapshot(master).ops)

        async def withdraw_late(msg: m.Message) -> None:
            if isinstance(msg, m.CollectiveWithdraw):
                await _until(crossed)

        faults.enter_context(pccl.testing.intercept_master_sends(comms[0], withdraw_late))
        try:
            with trio.fail_after(SOON):
                with trio.move_on_after(0.2):
                    await comms[0].all_reduce(bufs[0], tag=2)
                with pytest.raises(CollectiveAborted):
                    await comms[1].all_reduce(bufs[1], tag=2)
        finally:
            faults.close()
        assert np.array_equal(bufs[0], inputs[0]) and np.array_equal(bufs[1], inputs[1])
        infos = await _all_reduce_all(comms, bufs, tag=2)
        assert all(isinstance(i, pccl.ReduceInfo) for i in infos), infos
        assert np.array_equal(bufs[0], ring_reference(_in_ring_order(comms, inputs), ReduceOp.SUM))


async def test_abort_after_local_completion_restores_the_input() -> None:
    from pccl.protocol import messages as m

    async with _in_process_group(3) as (master, comms, _):
        inputs = _f32_inputs(3, 500_000, 4)
        bufs = [x.copy() for x in inputs]
        finished = {comms[0].peer_id, comms[1].peer_id}

        async def crash_instead_of_done(msg: m.Message) -> None:
            if isinstance(msg, m.CollectiveDone) and not msg.aborted:
                # Every byte has moved; the others report success; this peer dies before it does.
                while not any(op.done >= finished for op in pccl.testing.master_snapshot(master).ops):
                    await trio.sleep(0.005)
                pccl.testing.drop_master_link(comms[2])
                await trio.sleep_forever()

        faults = contextlib.ExitStack()
        faults.enter_context(pccl.testing.intercept_master_sends(comms[2], crash_instead_of_done))
        survivors = comms[:2]
        outcome: list[Any] = [None] * 2
        with trio.fail_after(SOON):
            async with trio.open_nursery() as nursery:
                crash_scope = trio.CancelScope()

                async def crashing_peer() -> None:
                    with crash_scope:
                        await comms[2].all_reduce(bufs[2])

                nursery.start_soon(crashing_peer)
                outcome = await _all_reduce_all(survivors, bufs[:2])
                crash_scope.cancel()
        faults.close()
        assert all(isinstance(o, CollectiveAborted) for o in outcome), outcome
        assert np.array_equal(bufs[0], inputs[0]) and np.array_equal(bufs[1], inputs[1])
        # Retry over the two survivors (the stale ring is re-wired automatically).
        infos = await _all_reduce_all(survivors, bufs[:2], op=ReduceOp.AVG)
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 2 for i in infos), infos
        expected = ring_reference(_in_ring_order(survivors, inputs[:2]), ReduceOp.AVG)
        assert np.array_equal(bufs[0], expected) and np.array_equal(bufs[1], expected)


async def test_a_ring_that_stalls_is_aborted_though_every_peer_answers_the_master() -> None:
    config = Config(peer_timeout=1.0, heartbeat_interval=0.2, connect_timeout=5.0, p2p_base_port=0)
    async with _in_process_group(3, config=config, network={1: GatedNetwork}) as (master, comms, networks):
        gate = networks[1]
        inputs = _f32_inputs(3, 2_000_000, 5)
        bufs = [x.copy() for x in inputs]
        gate.hold_after_more(2 << 20)  # peer 1 stops reading mid-ring but keeps heartbeating
        started = trio.current_time()
        outcome = await _all_reduce_all(comms, bufs)
        assert all(isinstance(o, CollectiveAborted) for o in outcome), outcome
        assert trio.current_time() - started >= config.peer_timeout
        assert master.statistics().kicks == 0  # nobody was removed: the transfer watchdog fired
        for buf, x in zip(bufs, inputs):
            assert np.array_equal(buf, x)
        gate.release()
        infos = await _all_reduce_all(comms, bufs)
        assert all(isinstance(i, pccl.ReduceInfo) and i.world_size == 3 for i in infos), infos
