"""Data-parallel training with torch's own DistributedDataParallel, the gradients averaged by pccl.

    pccl master --listen 127.0.0.1:48148
    python examples/ddp_torch.py --master 127.0.0.1:48148      # in 2-4 terminals
    pccl run --nproc 3 examples/ddp_torch.py                    # or: a master and 3 peers in one go

The same task and model as ``examples/ddp.py`` (a fixed random "teacher" network labels random
points), written as an ordinary DDP loop: ``ddp(x)``, ``loss.backward()``, ``optimizer.step()``.
``pccl.torch.DistributedDataParallel`` is torch's DDP over a process group of one process, with
every gradient bucket averaged over the pccl peers by a communication hook (retried on the
survivors when a peer dies mid-backward); building it runs no collective, so a newcomer builds
it alone.  ``examples/ddp.py`` does the same without torch's DDP: one explicit
``all_reduce_many`` of the gradients.

The shared state is the model's parameters, AdamW's moments and the step: the loop
``comm.steps(state)`` accepts newcomers at the top of each step and syncs the state (a newcomer
downloads it there), so every peer runs the same backward from the same weights and the
parameters stay bit-identical.  Kill a peer at any moment and start a new one: the others go on
and the newcomer continues at the same step.  ``--master`` defaults to ``$PCCL_MASTER``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

import pccl
import pccl.blocking
import pccl.torch
from ddp import digest, make_model, optimizer_state, teacher_batch  # examples/ddp.py, next to this file


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(torch.seed())  # this peer's own batches
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        model = make_model()
        # Alone, whenever: no collective of torch's runs across the peers (a newcomer gets the
        # weights at its first sync below).
        ddp = pccl.torch.DistributedDataParallel(model, comm, bucket_cap_mb=args.bucket_mb)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        step = torch.zeros((), dtype=torch.int64)
        state = pccl.SharedState({**{f"model.{n}": p.detach() for n, p in model.named_parameters()},
                                  **optimizer_state(model, optimizer), "step": step})
        print(f"joined: world {comm.world_size}", flush=True)
        for info in comm.steps(state):  # accept newcomers, wait while alone, sync the state
            if int(step) >= args.steps:
                break
            x, y = teacher_batch(generator, args.batch)
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()  # each bucket averaged over the peers (retried on the survivors)
            try:
                reduced = ddp.reduced()
            except pccl.CollectiveAborted:
                continue  # the master restarted, or the loops diverged: the next step's sync realigns
            optimizer.step()  # the same averaged gradients and state on every peer
            step += 1
            state.revision += 1
            print(f"step {int(step)}: world {reduced.world_size}, loss {loss.item():.4f}, "
                  f"synced {info.rx_bytes} B", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
        print(f"done: step {int(step)} weights {digest(model)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (several share a host)")
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="SECONDS",
                        help="pause after each step (to watch a run, or give a newcomer time to join)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
