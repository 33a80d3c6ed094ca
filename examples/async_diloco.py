"""Async DiLoCo: the outer all-reduce overlaps the next inner steps (one-step-delayed update).

    pccl master --listen 127.0.0.1:48148
    python examples/async_diloco.py --master 127.0.0.1:48148      # in 2-4 terminals

The model, data and optimizers are ``diloco.py``'s, and so is the loop's frame: ``comm.steps()``
lets newcomers in, waits while this peer is alone, and syncs the shared state (the outer weights
θ, both optimizers, the step) at the start of every outer step, when no all-reduce is in flight.
Outer step ``t``:

1. the all-reduce of the previous pseudo-gradient Δ(t-1) starts (``all_reduce_many_async``
   returns at once);
2. the inner steps run meanwhile, from the working weights θ - Δ(t-1): the outer weights plus
   this peer's own progress that is not averaged in yet (so Δ(t) counts only new progress);
3. Δ(t) = (where the inner steps started) - (where they ended), into the second of two
   pseudo-gradient buffers;
4. ``wait()`` for Δ(t-1)'s average and apply it to θ with the outer Nesterov step: the update
   lands one step late, and the communication costs nothing as long as it took less time than
   the inner steps.  The revision advances with it.

A newcomer receives θ in its first sync and has no Δ(t-1): it contributes zeros to that round
(which damps that outer step by N/(N+1)) and receives the others' average like everyone.  The
last step runs no inner steps: it only applies the last Δ.

When a round is lost — the master restarted, or every retry on the survivors failed — its
average is not applied and the revision stays: the next step's sync makes θ the same on every
peer again (a peer that did apply it holds more progress, and most progress wins).  Alone (the
last survivor), a peer applies its own Δ(t-1) and then waits in ``steps()`` for company.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Iterable

import torch

import pccl
import pccl.blocking
from diloco import DiLoCo, _quantization, parser, report


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    diloco = DiLoCo(args)
    previous = diloco.pseudo  # Δ(t-1): this peer's progress not averaged in yet (zeros at first)
    fresh = [torch.zeros_like(d) for d in previous]  # Δ(t)
    start = [torch.zeros_like(d) for d in previous]  # where this step's inner steps began
    quant = _quantization(args)
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    diloco.resume()  # Δ(t-1) is not in a checkpoint: a resumed peer starts with none pending
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        print(f"joined: world {comm.world_size}", flush=True)
        received = 0
        for info in comm.steps(diloco.state):  # accept newcomers, wait while alone, sync
            if int(diloco.step) >= args.outer_steps:
                break
            if info.rx_bytes:  # θ came from the others (this peer is new, or it fell behind)
                received += info.rx_bytes
                for d in previous:
                    d.zero_()  # its progress was measured from weights it no longer holds
            started = time.monotonic()
            with torch.no_grad():  # working weights = θ - Δ(t-1)
                for p, o, d in zip(diloco.model.parameters(), diloco.outer, previous):
                    torch.sub(o, d, out=p)
            pending = comm.all_reduce_many_async(previous, op=pccl.ReduceOp.AVG, quantization=quant)
            last = int(diloco.step) + 1 >= args.outer_steps
            loss = float("nan")
            if not last:  # the last step only applies the last Δ
                _copy(start, diloco.model.parameters())
                loss = diloco.inner_steps()  # overlaps the all-reduce of Δ(t-1)
                with torch.no_grad():
                    for d, s, p in zip(fresh, start, diloco.model.parameters()):
                        torch.sub(s, p, out=d)
            compute = time.monotonic() - started
            sent = 0
            try:
                reduced = pending.wait()
                world, sent = reduced.world_size, reduced.tx_bytes
            except pccl.TooFewPeers:
                world = 1  # the others are gone: this peer's own Δ(t-1) is the average
            except pccl.CollectiveAborted:
                world = 0  # the round is lost (see the module docstring): apply nothing
            if world:
                diloco.outer_step(previous)
                diloco.state.revision += 1
                report(diloco, world, loss, received, started, compute, sent)
                diloco.save_checkpoint()
                received = 0
            previous, fresh = fresh, previous
            if last:
                for d in previous:
                    d.zero_()
        print(f"done: step {int(diloco.step)} weights {diloco.digest()}", flush=True)


def _copy(out: list[torch.Tensor], params: Iterable[torch.Tensor]) -> None:
    with torch.no_grad():
        for o, p in zip(out, params):
            o.copy_(p)


def main() -> None:
    # pccl logs what a run does at INFO ("waiting for the master at ...", "peer ... is alone in
    # group 0: waiting for another peer to join", joins and departures); this shows it, timed.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser(__doc__).parse_args()
    if args.solo:
        raise SystemExit("--solo: run diloco.py --solo (without peers there is nothing to overlap)")
    train(args)


if __name__ == "__main__":
    main()
