"""A peer as an OS process for the all-reduce e2e tests, driven by JSON lines on stdin.

Usage: ``python allreduce_peer.py MASTER TOKEN PEER_TIMEOUT HEARTBEAT INDEX WORLD``.

Joins the run, then takes part in ``are_peers_pending()``/``update_topology()`` votes until the
group has ``WORLD`` peers, and prints ``{"event": "ready", "peer_id", "ring"}``.  Then it executes
one JSON command per stdin line and prints one JSON line per command:

* ``{"cmd": "matrix", "out": PATH}`` — every case of :func:`allreduce_cases.matrix_cases`,
  sequentially, on inputs ``make_input(seed, INDEX, …)``; prints ``{"event": "matrix",
  "results": {key: {digest, world, tx, rx} | {error}}}`` and saves the outputs of small and
  quantized cases to ``PATH`` (``.npz``).
* ``{"cmd": "ops", "ops": [spec…], "retry": bool, "fault": {"kind": "kill"|"stop", "at": f}}``
  — runs every spec ``{tag, seed, n, dtype, op, quant, in_place, index?}`` concurrently; on
  ``CollectiveAborted`` records whether the in-place buffer equals its input again and, with
  ``retry``, calls again until it succeeds or fails otherwise.  ``fault`` makes *this* process
  SIGKILL/SIGSTOP itself once a fraction ``f`` of its ring's receive bytes has arrived (so the
  fault lands inside the reduce-scatter for ``f < 0.5``, inside the all-gather above; partner
  links' bytes count too, when ``$PCCL_TEST_ALL_REDUCE_ALGORITHM`` forces halving-doubling).
  Prints ``{"event": "ops", "results": [...], "ring": [...]}``.
* ``{"cmd": "many", "arrays": [spec…], "max_in_flight": k, "bucket_bytes": b, "fault": …}`` — ``all_reduce_many``
  over in-place arrays (bucket_bytes 0 unless given: one op per array); prints the ReduceInfo and
  every array's digest.
* ``{"cmd": "exit"}``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import numpy as np
import trio

import pccl
import pccl.testing
from allreduce_cases import digest, make_input, matrix_cases, quantization, reduce_op

#: The environment variable that sets ``Config.all_reduce_algorithm`` (default ``"auto"``).
ALGORITHM_ENV = "PCCL_TEST_ALL_REDUCE_ALGORITHM"
#: Cases whose whole output the matrix saves (the others only report a digest).
_SAVE_UP_TO = 1025


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


async def admit(comm: pccl.Communicator, world: int) -> None:
    """Vote newcomers in until the group has ``world`` peers (every accepted peer runs this in
    lockstep: both calls are votes of all accepted peers)."""
    while comm.world_size < world:
        if await comm.are_peers_pending():
            await comm.update_topology()
        else:
            await trio.sleep(0.05)


def install_fault(kind: str, at: float) -> None:
    """Make the next ring of this process kill or stop the process part-way through."""
    sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP

    def wrap(real: Any) -> Any:
        async def faulty(make_op: Any, *, keep: Any, links: Any, world: int, **kw: Any) -> Any:
            args = keep
            conns = [inbox.connection for inbox in (*links.inboxes, *links.partners.values())]
            base = sum(c.statistics().data_bytes_received for c in conns)
            expected = args.src.nbytes * 2 * (world - 1) / world

            async def trigger() -> None:
                while sum(c.statistics().data_bytes_received for c in conns) - base < at * expected:
                    await trio.sleep(0.0005)
                os.kill(os.getpid(), sig)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trigger)
                try:
                    return await real(make_op, keep=keep, links=links, world=world, **kw)
                finally:
                    nursery.cancel_scope.cancel()

        return faulty

    pccl.testing.plant_execute_fault(wrap)  # every kind's data path: only all-reduces run here


async def run_matrix(comm: pccl.Communicator, index: int, out: str) -> None:
    results: dict[str, Any] = {}
    saved: dict[str, np.ndarray] = {}
    for case in matrix_cases():
        x = make_input(case["seed"], index, case["n"], case["dtype"], case["op"])
        try:
            info = await comm.all_reduce(x, op=reduce_op(case["op"]), quantization=quantization(case["quant"]))
        except pccl.PCCLError as exc:
            results[case["key"]] = {"error": type(exc).__name__, "message": str(exc)}
            continue
        results[case["key"]] = {"digest": digest(x), "world": info.world_size, "tx": info.tx_bytes,
                                "rx": info.rx_bytes}
        if case["n"] <= _SAVE_UP_TO or case["quant"] is not None:
            saved[case["key"]] = x.view(np.uint8)
    np.savez(out, **saved)
    emit({"event": "matrix", "results": results, "ring": list(comm.ring)})


async def run_one(comm: pccl.Communicator, spec: dict[str, Any], index: int, retry: bool) -> dict[str, Any]:
    x = make_input(spec["seed"], spec.get("index", index), spec["n"], spec["dtype"], spec["op"])
    original = x.copy()
    in_place = spec.get("in_place", True)
    recv = None if in_place else np.zeros_like(x)
    out: dict[str, Any] = {"tag": spec["tag"], "attempts": 0}
    while True:
        out["attempts"] += 1
        try:
            info = await comm.all_reduce(x, recv, op=reduce_op(spec["op"]), tag=spec["tag"],
                                         quantization=quantization(spec.get("quant")))
        except pccl.CollectiveAborted as exc:
            out.setdefault("first_error", type(exc).__name__)
            out.setdefault("restored", bool(np.array_equal(x.view(np.uint8), original.view(np.uint8))))
            if retry:
                continue
            out["error"] = type(exc).__name__
            return out
        except pccl.PCCLError as exc:
            out.setdefault("first_error", type(exc).__name__)
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
            out["untouched"] = bool(np.array_equal(x.view(np.uint8), original.view(np.uint8)))
            return out
        result = x if in_place else recv
        out.update(ok=True, world=info.world_size, tx=info.tx_bytes, rx=info.rx_bytes, digest=digest(result))
        return out


async def run_ops(comm: pccl.Communicator, cmd: dict[str, Any], index: int) -> None:
    specs = cmd["ops"]
    results: list[dict[str, Any] | None] = [None] * len(specs)

    async def one(i: int) -> None:
        results[i] = await run_one(comm, specs[i], index, cmd.get("retry", False))

    async with trio.open_nursery() as nursery:
        for i in range(len(specs)):
            nursery.start_soon(one, i)
    emit({"event": "ops", "results": results, "ring": list(comm.ring)})


async def run_many(comm: pccl.Communicator, cmd: dict[str, Any], index: int) -> None:
    specs = cmd["arrays"]
    arrays = [make_input(s["seed"], index, s["n"], s["dtype"], s["op"]) for s in specs]
    try:
        info = await comm.all_reduce_many(arrays, op=reduce_op(specs[0]["op"]),
                                          max_in_flight=cmd.get("max_in_flight", 4),
                                          bucket_bytes=cmd.get("bucket_bytes", 0))
    except pccl.PCCLError as exc:
        emit({"event": "many", "error": type(exc).__name__, "message": str(exc)})
        return
    stats = comm.statistics()
    emit({"event": "many", "world": info.world_size, "tx": info.tx_bytes, "rx": info.rx_bytes,
          "digests": [digest(a) for a in arrays], "ring": list(comm.ring), "retries": stats.retries})


async def main(master: str, token: str, peer_timeout: float, heartbeat: float, index: int, world: int) -> None:
    config = pccl.Config(peer_timeout=peer_timeout, heartbeat_interval=heartbeat, connect_timeout=5.0,
                         p2p_base_port=0, all_reduce_algorithm=os.environ.get(ALGORITHM_ENV, "auto"))
    stdin = trio.wrap_file(sys.stdin)
    async with pccl.open_communicator(master, token=token or None, config=config) as comm:
        await admit(comm, world)
        emit({"event": "ready", "peer_id": comm.peer_id, "ring": list(comm.ring)})
        while True:
            line = (await stdin.readline()).strip()
            if not line:
                return
            cmd = json.loads(line)
            if cmd.get("fault"):
                install_fault(cmd["fault"]["kind"], cmd["fault"]["at"])
            if cmd["cmd"] == "matrix":
                await run_matrix(comm, index, cmd["out"])
            elif cmd["cmd"] == "ops":
                await run_ops(comm, cmd, index)
            elif cmd["cmd"] == "many":
                await run_many(comm, cmd, index)
            elif cmd["cmd"] == "exit":
                return


if __name__ == "__main__":
    address, token_arg, timeout_arg, heartbeat_arg, index_arg, world_arg = sys.argv[1:7]
    try:
        trio.run(main, address, token_arg, float(timeout_arg), float(heartbeat_arg), int(index_arg), int(world_arg))
    except pccl.PCCLError as error:
        emit({"event": "fatal", "error": type(error).__name__, "message": str(error)})
        sys.exit(1)
