"""Data-parallel training of a torch model with pccl.blocking: gradients all-reduced every step.

    pccl master --listen 127.0.0.1:48148
    python examples/ddp.py --master 127.0.0.1:48148      # in 2-4 terminals

Each peer draws its own mini-batches of a generated classification task (a fixed random "teacher"
network labels random points, so there is nothing to download), computes gradients, and
all-reduces them (``all_reduce_many``: the parameter list goes in a few buckets, retried on the
survivors if a peer dies mid-op).  The AdamW update is then the same on every peer, so the
shared state — the model's parameters, AdamW's moments and the step count — stays bit-identical
and later syncs move nothing.  Kill a peer at any moment and start a new one: it downloads the
state at its first sync and continues at the same step.  ``--checkpoint PATH`` saves the shared
state every ``--checkpoint-every`` steps, ``--resume PATH`` loads it before the first sync.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os

import torch

import pccl
import pccl.blocking

DIM, CLASSES = 16, 4


def teacher_batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random points labelled by a fixed random network (the same on every peer: seed 0)."""
    teacher = torch.Generator().manual_seed(0)
    w1 = torch.randn(DIM, 32, generator=teacher)
    w2 = torch.randn(32, CLASSES, generator=teacher)
    x = torch.randn(size, DIM, generator=generator)
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1234)  # every peer starts from the same weights (a sync would fix it anyway)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.AdamW) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state, created now (torch creates it lazily on the first step) so
    that the shared state can reference it."""
    entries = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        entries.update({f"adamw.{name}.{k}": v for k, v in state.items()})
    return entries


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:32]


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step = torch.zeros((), dtype=torch.int64)
    state = pccl.SharedState({**{f"model.{n}": p.detach() for n, p in model.named_parameters()},
                              **optimizer_state(model, optimizer), "step": step})
    if args.resume:  # into the model's parameters and the optimizer's state, in place
        pccl.checkpoint.load(args.resume, into=state)
        print(f"resumed: step {int(step)} from {args.resume}", flush=True)
    generator = torch.Generator().manual_seed(torch.seed())  # this peer's own batches
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        for info in comm.steps(state):
            if int(step) >= args.steps:
                break
            x, y = teacher_batch(generator, args.batch)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            try:
                reduced = comm.all_reduce_many(grads, op=pccl.ReduceOp.AVG)
            except pccl.TooFewPeers:
                continue  # alone now: steps() waits for a newcomer, then syncs
            except pccl.CollectiveAborted:
                continue  # the master restarted, or the peers' loops diverged: the next step meets
            optimizer.step()  # the same averaged gradients and state on every peer
            step += 1
            state.revision += 1
            print(f"step {int(step)}: world {reduced.world_size}, loss {loss.item():.4f}, "
                  f"synced {info.rx_bytes} B", flush=True)
            if args.checkpoint and int(step) % args.checkpoint_every == 0:
                pccl.checkpoint.save(state, args.checkpoint)
        print(f"done: step {int(step)} weights {digest(model)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (several share a host)")
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--checkpoint", metavar="PATH", help="save the shared state here (safetensors)")
    parser.add_argument("--checkpoint-every", type=int, default=25, metavar="N", help="steps between checkpoints")
    parser.add_argument("--resume", metavar="PATH", help="load this checkpoint before the first sync")
    # pccl logs what a run does at INFO ("waiting for the master at ...", "peer ... is alone in
    # group 0: waiting for another peer to join", joins and departures); this shows it, timed.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
