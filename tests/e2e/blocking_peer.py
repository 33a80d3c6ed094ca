"""A training loop on pccl.blocking, run as a process by test_blocking.py.

    python blocking_peer.py MASTER PEER_TIMEOUT HEARTBEAT

Each step overlaps its all-reduce (``all_reduce_async``) with a burst of pure-Python compute and
prints ``{"step": n, "world": w}``; it runs until interrupted (SIGINT: Ctrl-C).
"""

from __future__ import annotations

import json
import signal
import sys
import time

import numpy as np

import pccl
import pccl.blocking


def main() -> None:
    # Ctrl-C is what this peer is tested with.  A process started from a background job of a
    # shell without job control inherits SIGINT ignored, and Python then installs no handler:
    # the test's SIGINT did nothing in such runs.  Take Python's own handler back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    master, peer_timeout, heartbeat = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    config = pccl.Config(peer_timeout=peer_timeout, heartbeat_interval=heartbeat, p2p_base_port=0)
    w = np.zeros(1000, np.float32)
    state = pccl.SharedState({"w": w})
    with pccl.blocking.open_communicator(master, config=config) as comm:
        print(json.dumps({"joined": comm.world_size}), flush=True)
        for _ in comm.steps(state):
            grads = np.ones_like(w)
            handle = comm.all_reduce_async(grads, op=pccl.ReduceOp.AVG)
            deadline = time.monotonic() + 0.1
            while time.monotonic() < deadline:  # the "inner steps" the all-reduce overlaps
                sum(range(1000))
            try:
                info = handle.wait()
            except (pccl.CollectiveAborted, pccl.TooFewPeers):
                continue
            w -= 0.1 * grads
            state.revision += 1
            print(json.dumps({"step": state.revision, "world": info.world_size}), flush=True)


if __name__ == "__main__":
    main()
