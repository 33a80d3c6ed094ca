# docs-test: cluster 2 --steps 5
"""The same loop for synchronous code: pccl.blocking runs Trio in a background thread."""

import argparse
import logging
import os
import time

import numpy as np

import pccl
import pccl.blocking


def main(master: str, steps: int) -> None:
    with pccl.blocking.open_communicator(master) as comm:
        w = np.zeros(1000, np.float32)
        grad = np.empty_like(w)
        state = pccl.SharedState({"w": w})
        for info in comm.steps(state):                        # a plain iterator
            if state.revision >= steps:
                break
            np.subtract(w, 1.0, out=grad)
            handle = comm.all_reduce_async(grad, op=pccl.ReduceOp.AVG)   # returns at once
            time.sleep(0.01)                                  # other work overlaps it
            try:
                reduced = handle.wait()                       # ReduceInfo, or raises
            except (pccl.CollectiveAborted, pccl.TooFewPeers):
                continue
            w -= 0.1 * grad
            state.revision += 1
            print(f"step {state.revision}: world {reduced.world_size}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    # pccl's INFO lines, timed: "waiting for the master", "alone ...: waiting for another peer"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    main(args.master, args.steps)
