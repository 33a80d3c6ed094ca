# docs-test: cluster 2 --steps 3
"""torch.distributed's calls over a pccl peer group: pccl.torch.ProcessGroup."""

import argparse

import torch
import torch.distributed as dist

import pccl
import pccl.blocking
import pccl.torch


def main(master: str, steps: int) -> None:
    with pccl.blocking.open_communicator(master) as comm:
        pg = pccl.torch.ProcessGroup(comm)
        w = torch.zeros(1000)
        state = pccl.SharedState({"w": w})
        for info in comm.steps(state):                     # admits newcomers, syncs w
            if state.revision >= steps:
                break
            grad = w - 1.0
            try:
                dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=pg)   # over the peers there now
            except pccl.CollectiveAborted:                  # a peer died mid-op: next step
                continue
            w -= 0.1 * grad
            state.revision += 1
            # every peer's step number, gathered in ring order (rank() = ring position)
            mine = torch.tensor([state.revision, pg.rank()])
            everyone = torch.empty(2 * pg.size(), dtype=torch.int64)
            dist.all_gather_into_tensor(everyone, mine, group=pg)
            print(f"step {state.revision}: rank {pg.rank()} of {pg.size()}, "
                  f"gathered {everyone.tolist()}", flush=True)
        pg.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default="127.0.0.1:48148")
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    main(args.master, args.steps)
