"""One peer of tests/e2e/test_master_restart.py: the loop of examples/hello_world.py, talkative.

Usage: ``restart_peer_process.py MASTER TOKEN STEPS N SEED [SLOW_SYNC_AT]``.  Prints (flushed)
``ACCEPTED``, ``SYNCING <revision>`` as a sync begins, ``SYNC <revision>`` after it,
``REDUCE <revision>`` just before every all-reduce, ``ABORTED`` when one aborts, and at the end
``DONE <revision> <digest of w and m> <all-reduces completed>``.  The master may die and come back
at any moment: the communicator reconnects (Config.master_reconnect_timeout).  With
``SLOW_SYNC_AT``, the sync at that revision starts half a second late on this peer (a slower
peer), so that the others wait inside it: the test kills the master then.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import trio

import pccl

CFG = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0,
                  shared_state_base_port=0, master_reconnect_timeout=30.0, master_reconnect_backoff=(0.05, 0.25))


def say(*words: object) -> None:
    print(*words, flush=True)


async def main(master: str, token: str, steps: int, n: int, seed: int, slow_sync_at: int) -> None:
    async with pccl.open_communicator(master, token=token, config=CFG) as comm:
        say("ACCEPTED")
        w = np.zeros(n, np.float32)
        m = np.zeros_like(w)
        state = pccl.SharedState({"w": w, "m": m}, revision=0)
        rng = np.random.default_rng(seed)
        sync = comm.sync_shared_state

        async def announced_sync(state: pccl.SharedState, *args: object) -> pccl.SyncInfo:
            say("SYNCING", state.revision)
            if state.revision == slow_sync_at:
                await trio.sleep(0.5)
            return await sync(state, *args)

        comm.sync_shared_state = announced_sync  # type: ignore[method-assign]  # steps() calls it
        async for info in comm.steps(state):
            say("SYNC", state.revision)
            if state.revision >= steps:
                break
            grads = (rng.standard_normal(n, dtype=np.float32) * 0.01 + (w - 1.0)).astype(np.float32)
            say("REDUCE", state.revision)
            try:
                await comm.all_reduce(grads, op=pccl.ReduceOp.AVG)
            except (pccl.CollectiveAborted, pccl.TooFewPeers):
                say("ABORTED")
                continue
            m *= 0.9
            m += grads
            w -= 0.1 * m
            state.revision += 1
        digest = hashlib.sha256(w.tobytes() + m.tobytes()).hexdigest()
        say("DONE", state.revision, digest, comm.statistics().collectives_completed)


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
             int(sys.argv[6]) if len(sys.argv) > 6 else -1)
