"""A peer as an OS process for the e2e tests of broadcast, all-gather and reduce-scatter.

Usage: ``python kinds_peer.py MASTER TOKEN PEER_TIMEOUT HEARTBEAT INDEX WORLD`` (as
``allreduce_peer.py``: joins, admits peers until the group has ``WORLD``, prints ``ready``).
Then one JSON command per stdin line:

* ``{"cmd": "ops", "ops": [spec…], "retry": bool, "fault": {"kind": "kill", "at": f, "on": KIND}}``
  — runs every spec concurrently.  A spec is ``{kind, tag, seed, n, dtype, op, quant}``; an
  all-gather's input has ``n + 7 * INDEX`` elements (``n`` 0 and INDEX 0: an empty one), a
  broadcast's root is the smallest peer id of the ring as this peer sees it when it calls.  On
  ``CollectiveAborted`` it records whether ``x`` holds its input again and, with ``retry``, calls
  again (a broadcast whose error names its root as gone picks the new smallest id).  ``fault``
  makes this process SIGKILL itself once a fraction ``f`` of the bytes its part of the next
  ``KIND`` op moves have arrived (a broadcast root: have been sent).  Prints ``{"event": "ops",
  "results": [...], "ring": [...]}`` with per kind: broadcast ``digest`` of ``x``, ``root`` and
  the last call's ``tx_bytes``/``rx_bytes``;
  all-gather ``peers`` and the ``digests`` of ``arrays``; reduce-scatter ``start``, ``stop`` and
  the ``digest`` of ``x[start:stop]``.
* ``{"cmd": "exit"}``.

``PCCL_TEST_ALL_REDUCE_ALGORITHM`` sets ``Config.all_reduce_algorithm`` (which partner links are
wired) and ``PCCL_TEST_BROADCAST_ALGORITHM`` forces the broadcasts' algorithm.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from typing import Any

import numpy as np
import trio

import pccl
import pccl.testing
from pccl.collectives.scatter_broadcast import ScatterAllGatherOp
from pccl.collectives.tree_broadcast import TreeBroadcastOp
from allreduce_cases import digest, make_input, quantization, reduce_op
from allreduce_peer import ALGORITHM_ENV, admit, emit

#: The environment variable that forces every broadcast's algorithm in this process
#: (:func:`pccl.testing.force_broadcast_algorithm`; unset: the automatic choice).
BROADCAST_ALGORITHM_ENV = "PCCL_TEST_BROADCAST_ALGORITHM"


def install_fault(kind: str, at: float) -> None:
    """SIGKILL this process part-way through each ``kind`` op from now on.

    The kill is synchronous with the data path: the frame that takes the bytes this peer has
    received (a broadcast root: sent) past ``at`` of the op's total kills the process before it
    is processed.  A watcher task or thread could be starved until the op had finished (the
    data path may keep the Trio thread busy, the machine may be loaded) and miss it.  Planted in
    the kind's row (:mod:`pccl.collectives.kinds`): its ops are made counting."""

    def counting_ops(row: Any) -> Any:
        return dataclasses.replace(row, make_op=lambda call, commence, place: counting_op(row, call, commence, place))

    def counting_op(row: Any, call: Any, commence: Any, place: Any) -> Any:
        op = row.make_op(call, commence, place)
        world, rank = place.world, place.rank
        sender = kind == "broadcast" and commence.ring[rank] == call.own
        if kind == "all_gather":
            src = call.own.args.src
            expected = sum(commence.counts) * src.itemsize - src.nbytes
        elif kind == "reduce_scatter":
            expected = call.keep.src.nbytes * (world - 1) / world
        else:
            expected = call.keep.src.nbytes
        moved = [0]
        if isinstance(op, (TreeBroadcastOp, ScatterAllGatherOp)):  # counted per frame: sent (the root), or in
            tree_method = "sent" if sender else "arrived"
            tree_original = getattr(op, tree_method)

            def tree_counting(k: int, nbytes: int) -> None:
                moved[0] += nbytes
                if moved[0] >= at * expected:
                    os.kill(os.getpid(), signal.SIGKILL)
                tree_original(k, nbytes)

            setattr(op, tree_method, tree_counting)  # this op only
            return op
        method = "prepare_payload" if sender else "received"
        original = getattr(op, method)

        def counting(frame: Any, buffer: Any) -> Any:
            moved[0] += op.frame_nbytes(frame)
            if moved[0] >= at * expected:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(frame, buffer)

        setattr(op, method, counting)  # this op only
        return op

    pccl.testing.plant_kind_fault(kind, counting_ops)


def _input(spec: dict[str, Any], index: int) -> np.ndarray:
    n = spec["n"] + 7 * index if spec["kind"] == "all_gather" else spec["n"]
    return make_input(spec["seed"], index, n, spec["dtype"], spec.get("op", "SUM"))


async def run_one(comm: pccl.Communicator, spec: dict[str, Any], index: int, retry: bool) -> dict[str, Any]:
    x = _input(spec, index)
    original = x.copy()
    kind = spec["kind"]
    quant = quantization(spec.get("quant"))
    out: dict[str, Any] = {"tag": spec["tag"], "kind": kind, "attempts": 0, "errors": [], "peer_id": comm.peer_id}
    while True:
        out["attempts"] += 1
        root = min(comm.ring)
        try:
            if kind == "broadcast":
                info = await comm.broadcast(x, root=root, tag=spec["tag"], quantization=quant)
                out.update(ok=True, root=root, world=info.world_size, peers=list(info.peers), digest=digest(x),
                           tx_bytes=info.tx_bytes, rx_bytes=info.rx_bytes)
            elif kind == "all_gather":
                gathered = await comm.all_gather(x, tag=spec["tag"], quantization=quant)
                out.update(ok=True, world=gathered.world_size, peers=list(gathered.peers),
                           digests=[digest(a) for a in gathered.arrays], counts=[int(a.size) for a in gathered.arrays],
                           untouched=bool(np.array_equal(x.view(np.uint8), original.view(np.uint8))))
            else:
                shard = await comm.reduce_scatter(x, op=reduce_op(spec["op"]), tag=spec["tag"], quantization=quant)
                out.update(ok=True, world=shard.world_size, peers=list(shard.peers), start=shard.start,
                           stop=shard.stop, index=shard.index, digest=digest(x[shard.start:shard.stop]),
                           values=x[shard.start:shard.stop].astype(np.float64).tolist() if x.dtype.kind == "f" else None)
            return out
        except pccl.CollectiveAborted as exc:
            out["errors"].append(str(exc))
            out.setdefault("first_error", type(exc).__name__)
            out.setdefault("restored", bool(np.array_equal(x.view(np.uint8), original.view(np.uint8))))
            if not retry or out["attempts"] > 20:
                out["error"] = type(exc).__name__
                return out
        except pccl.PCCLError as exc:
            out["error"] = type(exc).__name__
            out["message"] = str(exc)
            out["untouched"] = bool(np.array_equal(x.view(np.uint8), original.view(np.uint8)))
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


async def main(master: str, token: str, peer_timeout: float, heartbeat: float, index: int, world: int) -> None:
    config = pccl.Config(peer_timeout=peer_timeout, heartbeat_interval=heartbeat, connect_timeout=5.0,
                         p2p_base_port=0, all_reduce_algorithm=os.environ.get(ALGORITHM_ENV, "auto"))
    if os.environ.get(BROADCAST_ALGORITHM_ENV):
        pccl.testing.force_broadcast_algorithm(os.environ[BROADCAST_ALGORITHM_ENV])
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
                install_fault(cmd["fault"]["on"], cmd["fault"]["at"])
            if cmd["cmd"] == "ops":
                await run_ops(comm, cmd, index)
            elif cmd["cmd"] == "exit":
                return


if __name__ == "__main__":
    address, token_arg, timeout_arg, heartbeat_arg, index_arg, world_arg = sys.argv[1:7]
    try:
        trio.run(main, address, token_arg, float(timeout_arg), float(heartbeat_arg), int(index_arg), int(world_arg))
    except pccl.PCCLError as error:
        emit({"event": "fatal", "error": type(error).__name__, "message": str(error)})
        sys.exit(1)
