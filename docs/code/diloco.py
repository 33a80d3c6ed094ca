# docs-test: cluster 2 --outer-steps 3 --inner-steps 4
"""DiLoCo on pccl.blocking: H inner AdamW steps per peer, then one all-reduce of the
pseudo-gradients and an outer Nesterov step on a shared CPU copy of the weights.

The model trains on the accelerator when there is one; the shared state (the outer weights and
the outer momentum) stays in CPU memory, copied to the device before the inner steps and back
after them.
"""

import argparse
import logging
import os

import torch

import pccl
import pccl.blocking


def main(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)                                       # the same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # The outer copy: CPU tensors, the state every peer holds bit for bit.
    outer = [p.detach().to("cpu", copy=True) for p in model.parameters()]
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    for o in outer:                                            # created now, so the state can hold it
        outer_opt.state[o]["momentum_buffer"] = torch.zeros_like(o)
    state = pccl.SharedState({
        **{f"outer.{i}": o for i, o in enumerate(outer)},
        **{f"momentum.{i}": outer_opt.state[o]["momentum_buffer"] for i, o in enumerate(outer)},
    })
    pseudo = [torch.zeros_like(o) for o in outer]              # all-reduced in place
    batches = torch.Generator().manual_seed(args.data_seed)    # this peer's own data

    with pccl.blocking.open_communicator(args.master) as comm:
        for info in comm.steps(state):                         # accept newcomers, sync the state
            if state.revision >= args.outer_steps:
                break
            with torch.no_grad():                              # host -> device
                for p, o in zip(model.parameters(), outer):
                    p.copy_(o)
            for _ in range(args.inner_steps):                  # H local steps, no communication
                x = torch.randn(64, 8, generator=batches)
                loss = torch.nn.functional.mse_loss(model(x.to(device)), x.sum(1, keepdim=True).to(device))
                inner_opt.zero_grad()
                loss.backward()
                inner_opt.step()
            with torch.no_grad():                              # device -> host: the pseudo-gradient
                for d, o, p in zip(pseudo, outer, model.parameters()):
                    torch.sub(o, p.cpu(), out=d)
            try:
                reduced = comm.all_reduce_many(pseudo, op=pccl.ReduceOp.AVG)   # retried on survivors
                world = reduced.world_size
            except pccl.TooFewPeers:
                world = 1                                      # alone: its own is the average
            except pccl.CollectiveAborted:
                continue                                       # the next step's sync realigns
            for o, d in zip(outer, pseudo):
                o.grad = d
            outer_opt.step()                                   # the same input, the same result
            for o in outer:
                o.grad = None
            state.revision += 1
            print(f"outer step {state.revision}: world {world}, inner loss {loss.item():.4f}, "
                  f"synced {info.rx_bytes} B", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--outer-steps", type=int, default=20)
    parser.add_argument("--inner-steps", type=int, default=20, help="H")
    parser.add_argument("--data-seed", type=int, default=None)
    args = parser.parse_args()
    # pccl's INFO lines, timed: "waiting for the master", "alone ...: waiting for another peer"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.data_seed is None:
        args.data_seed = torch.seed()
    main(args)
