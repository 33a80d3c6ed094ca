# docs-test: cluster 2 --outer-steps 6 --inner-steps 4
"""Streaming DiLoCo on pccl.blocking: the model in F fragments, fragment f all-reduced every H
inner steps at offset f*H/F, 4 bits on the wire, while the next tau inner steps run.

One outer step is H/F inner steps and one fragment's sync.  No all-reduce is in flight when it
ends, so ``comm.steps()`` lets newcomers in and syncs the shared state between two of them.
"""

import argparse
import logging

import torch

import pccl
import pccl.blocking


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)                                       # the same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    params = list(model.parameters())                          # θ: this peer's working weights
    inner_opt = torch.optim.AdamW(params, lr=1e-2)
    outer = [p.detach().clone() for p in params]               # θ̄: the outer weights, the same everywhere
    outer_opt = torch.optim.SGD(outer, lr=0.7, momentum=0.9, nesterov=True)
    for o in outer:                                            # created now, so the state can hold it
        outer_opt.state[o]["momentum_buffer"] = torch.zeros_like(o)
    fragments = [[0, 1], [2, 3]]                               # F = 2: one Linear layer each
    state = pccl.SharedState({
        **{f"outer.{i}": o for i, o in enumerate(outer)},
        **{f"momentum.{i}": outer_opt.state[o]["momentum_buffer"] for i, o in enumerate(outer)},
        # per peer, never compared; a newcomer receives one peer's and carries on from there
        **{f"working.{i}": pccl.Tensor(p.detach(), allow_content_inequality=True) for i, p in enumerate(params)},
    })
    pseudo = [torch.zeros_like(o) for o in outer]              # all-reduced in place
    quant = pccl.Quantization(pccl.QuantKind.MIN_MAX, "uint4", block=128)
    batches = torch.Generator().manual_seed(args.data_seed)    # this peer's own data
    period = args.inner_steps // len(fragments)                # H/F inner steps per outer step

    def inner_steps(n: int) -> list[float]:
        losses = []
        for _ in range(n):
            x = torch.randn(64, 8, generator=batches)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            inner_opt.zero_grad()
            loss.backward()
            inner_opt.step()
            losses.append(loss.item())
        return losses

    with pccl.blocking.open_communicator(args.master) as comm:
        for info in comm.steps(state):                         # accept newcomers, sync the state
            if state.revision >= args.outer_steps:
                break
            f = state.revision % len(fragments)                # fragment f: offset f*H/F
            with torch.no_grad():
                for i in fragments[f]:
                    torch.sub(outer[i], params[i], out=pseudo[i])          # Δ_f = θ̄_f - θ_f
            delta = [pseudo[i] for i in fragments[f]]
            pending = comm.all_reduce_many_async(delta, op=pccl.ReduceOp.AVG, quantization=quant)
            losses = inner_steps(args.overlap)                 # tau steps while Δ_f travels
            try:
                world = pending.wait().world_size              # retried on the survivors
            except pccl.TooFewPeers:
                world = 1                                      # alone: its own is the average
            except pccl.CollectiveAborted:
                world = 0                                      # lost: the next step's sync realigns
            if world:
                for i, d in zip(fragments[f], delta):
                    outer[i].grad = d
                outer_opt.step()                               # only fragment f has a gradient
                for o in outer:
                    o.grad = None
                with torch.no_grad():
                    for i in fragments[f]:                     # θ_f ← α θ_f + (1 - α) θ̄_f
                        params[i].lerp_(outer[i], 1.0 - args.alpha)
                state.revision += 1
            losses += inner_steps(period - args.overlap)       # the rest of the outer step
            print(f"outer step {state.revision}: fragment {f}, world {world}, inner loss {losses[-1]:.4f}, "
                  f"synced {info.rx_bytes} B", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--master", default="127.0.0.1:48148")
    parser.add_argument("--outer-steps", type=int, default=40, help="fragment syncs")
    parser.add_argument("--inner-steps", type=int, default=20, help="H: each fragment's sync period")
    parser.add_argument("--overlap", type=int, default=1, help="tau: at most H/F")
    parser.add_argument("--alpha", type=float, default=0.5, help="mixing factor")
    parser.add_argument("--data-seed", type=int, default=None)
    args = parser.parse_args()
    # pccl's INFO lines, timed: "waiting for the master", "alone ...: waiting for another peer"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.data_seed is None:
        args.data_seed = torch.seed()
    main(args)
