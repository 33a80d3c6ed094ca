"""A training peer as its own OS process: a torch MLP and its AdamW state in the shared state,
``pccl.blocking``'s step loop, real TCP (for ``test_lineage_processes.py``).

Usage: ``python lineage_peer_process.py MASTER [--hidden H] [--revision R] [--seed S]
[--steps N] [--delay SECONDS] [--checkpoint PATH] [--resume PATH] [--go-file PATH]``.  With ``--go-file`` it builds its state, prints ``READY`` and
connects once that file exists (a warm start at a moment the test chooses).

Output, one line each:

- ``SYNC revision=R received=0|1 reason=NAME rx=BYTES step=K digest=HEX`` after every sync
  (``digest``: the shared state's bytes, ``step``: the step counter in the state);
- ``STEP revision=R world=W digest=HEX`` after every applied step (and ``--checkpoint`` saved);
- ``DONE revision=R digest=HEX`` at ``--steps``; ``KICKED reason=NAME`` (exit 3) when kicked, ``ERROR NAME`` (exit 4) on another pccl error.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time

import torch

import pccl
import pccl.blocking


def digest(state: pccl.SharedState) -> str:
    h = hashlib.sha256()
    for key in state:
        if not state.tensors()[key].allow_content_inequality:
            h.update(key.encode() + state[key].tobytes())
    return h.hexdigest()[:24]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("master")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--revision", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=10**9)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--checkpoint")
    p.add_argument("--resume")
    p.add_argument("--go-file")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, args.hidden), torch.nn.Tanh(), torch.nn.Linear(args.hidden, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    entries: dict[str, object] = {}
    for name, param in model.named_parameters():
        optimizer.state[param].update(step=torch.zeros(()), exp_avg=torch.zeros_like(param),
                                      exp_avg_sq=torch.zeros_like(param))
        entries[f"model.{name}"] = param.detach()
        entries[f"adam.{name}.m"] = optimizer.state[param]["exp_avg"]
        entries[f"adam.{name}.v"] = optimizer.state[param]["exp_avg_sq"]
        entries[f"adam.{name}.step"] = optimizer.state[param]["step"]
    step = torch.zeros((), dtype=torch.int64)
    entries["step"] = step
    state = pccl.SharedState(entries, revision=args.revision)
    if args.resume:
        pccl.checkpoint.load(args.resume, into=state)
        print(f"RESUMED revision={state.revision} digest={digest(state)}", flush=True)
    data = torch.Generator().manual_seed(args.seed + 1000)
    config = pccl.Config(peer_timeout=2.0, heartbeat_interval=0.25, connect_timeout=2.0, p2p_base_port=0,
                         shared_state_base_port=0)
    if args.go_file:
        print("READY", flush=True)
        while not os.path.exists(args.go_file):
            time.sleep(0.005)
    try:
        with pccl.blocking.open_communicator(args.master, token="lineage", config=config) as comm:
            for info in comm.steps(state):
                print(f"SYNC revision={state.revision} received={int(info.received)} reason={info.reason.name} "
                      f"rx={info.rx_bytes} step={int(step)} digest={digest(state)}", flush=True)
                if state.revision >= args.steps:
                    break
                x = torch.randn(16, 8, generator=data)
                loss = (model(x) - x[:, :4]).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                grads = [p.grad for p in model.parameters()]
                try:
                    reduced = comm.all_reduce_many(grads, op=pccl.ReduceOp.AVG)
                except (pccl.TooFewPeers, pccl.CollectiveAborted):
                    continue
                optimizer.step()
                step += 1
                state.revision += 1
                if args.checkpoint:
                    pccl.checkpoint.save(state, args.checkpoint)
                print(f"STEP revision={state.revision} world={reduced.world_size} digest={digest(state)}", flush=True)
                time.sleep(args.delay)
            print(f"DONE revision={state.revision} digest={digest(state)}", flush=True)
    except pccl.Kicked as exc:
        print(f"KICKED reason={exc.reason.name} {exc}", flush=True)
        return 3
    except pccl.PCCLError as exc:
        print(f"ERROR {type(exc).__name__} {exc}", flush=True)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
