# docs-test: cluster 2 --steps 5
"""The tutorial's first peer: numpy weights, an averaged gradient every step."""

import argparse
import logging
import os

import numpy as np
import trio

import pccl


async def main(master: str, steps: int) -> None:
    async with pccl.open_communicator(master) as comm:        # returns once accepted
        print(f"accepted as peer {comm.peer_id:x}, world {comm.world_size}", flush=True)
        w = np.zeros(1000, np.float32)                        # the model
        state = pccl.SharedState({"w": w})                    # shares w's memory
        rng = np.random.default_rng()
        async for info in comm.steps(state):                  # accept newcomers, sync
            if state.revision >= steps:
                break
            grad = (w - 1.0) + 0.01 * rng.standard_normal(w.shape, dtype=np.float32)
            try:
                reduced = await comm.all_reduce(grad, op=pccl.ReduceOp.AVG)   # in place
            except (pccl.CollectiveAborted, pccl.TooFewPeers):
                continue                                      # a peer left: next step
            w -= 0.1 * grad                                   # the same on every peer
            state.revision += 1                               # one step, one revision
            print(f"step {state.revision}: world {reduced.world_size}, "
                  f"received {info.rx_bytes} B at the sync", flush=True)
        print(f"done at step {state.revision}: mean weight {float(w.mean()):.4f}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    # pccl's INFO lines, timed: "waiting for the master", "alone ...: waiting for another peer"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    trio.run(main, args.master, args.steps)
