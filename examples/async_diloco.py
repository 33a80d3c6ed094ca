"""Async DiLoCo: the outer all-reduce overlaps the next inner steps (one-step-delayed update).

    pccl master --listen 127.0.0.1:48148
    python examples/async_diloco.py --master 127.0.0.1:48148      # in 2-4 terminals

The model, data and optimizers are ``diloco.py``'s.  Outer step ``t``:

1. the inner steps run while the all-reduce of the previous pseudo-gradient Δ(t-1) is still on
   the wire (``all_reduce_many_async`` returned at once);
2. Δ(t) = (where the inner steps started) - (where they ended): this step's own progress, into
   the second of two pseudo-gradient buffers;
3. ``wait()`` for Δ(t-1)'s average and apply it to the outer weights θ with the outer Nesterov
   step: the update lands one step late, and the communication costs nothing as long as it took
   less time than the inner steps;
4. newcomers are let in here, when ``are_peers_pending()`` says one waits: the peers
   ``update_topology()``, then sync with SEND_ONLY while the newcomer syncs with RECEIVE_ONLY —
   it receives θ (with Δ(t-1) applied), both optimizers and the step ("eavesdropping" on the
   result it missed, as PCCL's async DiLoCo does).  The revision advances once per such sync;
5. the working weights become θ - Δ(t): the new outer weights plus this peer's own progress that
   is not averaged in yet (so the next Δ counts only new progress), and Δ(t)'s all-reduce starts.
   A newcomer has no Δ(t): it starts from θ and contributes zeros to that one round (which damps
   that outer step by N/(N+1)), then runs the same loop.

Alone (the first peer, or the last survivor), a peer applies its own pseudo-gradient at once.
A peer that dies mid-all-reduce is retried around inside ``all_reduce_many``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable

import torch

import pccl
import pccl.blocking
from diloco import DiLoCo, _quantization, parser, report


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    diloco = DiLoCo(args)
    buffers = [diloco.pseudo, [torch.zeros_like(d) for d in diloco.pseudo]]
    start = [torch.zeros_like(d) for d in diloco.pseudo]  # where this step's inner steps began
    quant = _quantization(args)
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        print(f"joined: world {comm.world_size}", flush=True)
        pending: pccl.blocking.ReduceHandle | None = None
        in_flight: list[torch.Tensor] = buffers[0]
        synced, world = 0, comm.world_size
        diloco.begin_outer_step()  # working weights = θ
        if comm.world_size > 1:  # accepted by peers already training: receive their state
            synced = comm.sync_shared_state(diloco.state, pccl.SyncStrategy.RECEIVE_ONLY).rx_bytes
            diloco.begin_outer_step()
            for d in in_flight:
                d.zero_()  # nothing to contribute to the round in flight
            pending = comm.all_reduce_many_async(in_flight, op=pccl.ReduceOp.AVG, quantization=quant)
        while int(diloco.step) + (pending is not None) < args.outer_steps:
            started = time.monotonic()
            _copy(start, diloco.model.parameters())
            loss = diloco.inner_steps()  # overlaps the all-reduce of the previous step
            compute = time.monotonic() - started
            fresh = buffers[1] if in_flight is buffers[0] else buffers[0]
            with torch.no_grad():
                for d, s, p in zip(fresh, start, diloco.model.parameters()):
                    torch.sub(s, p, out=d)
            applied = pending is not None
            if pending is not None:
                world = _apply(diloco, pending, in_flight)
                pending = None
            if comm.are_peers_pending():
                comm.update_topology()
                diloco.state.revision += 1
                synced = comm.sync_shared_state(diloco.state, pccl.SyncStrategy.SEND_ONLY).rx_bytes
            if comm.world_size > 1:
                with torch.no_grad():  # working weights = θ - Δ(t): θ plus the progress in flight
                    for p, o, d in zip(diloco.model.parameters(), diloco.outer, fresh):
                        torch.sub(o, d, out=p)
                pending = comm.all_reduce_many_async(fresh, op=pccl.ReduceOp.AVG, quantization=quant)
                in_flight = fresh
            else:
                diloco.outer_step(fresh)  # alone: its own pseudo-gradient is the average
                diloco.begin_outer_step()
                applied, world = True, 1
            if applied:
                report(diloco, world, loss, synced, started, compute)
            synced = 0
        if pending is not None:
            world = _apply(diloco, pending, in_flight)
            report(diloco, world, float("nan"), 0, time.monotonic(), 0.0)
        print(f"done: step {int(diloco.step)} weights {diloco.digest()}", flush=True)


def _copy(out: list[torch.Tensor], params: Iterable[torch.Tensor]) -> None:
    with torch.no_grad():
        for o, p in zip(out, params):
            o.copy_(p)


def _apply(diloco: DiLoCo, pending: pccl.blocking.ReduceHandle, reduced: list[torch.Tensor]) -> int:
    """Wait for the previous round's average and apply it; returns the world it ran over."""
    try:
        world = pending.wait().world_size
    except pccl.TooFewPeers:
        world = 1  # everyone else left: what the buffers hold now is applied as is
    diloco.outer_step(reduced)
    return world


def main() -> None:
    args = parser(__doc__).parse_args()
    if args.solo:
        raise SystemExit("--solo: run diloco.py --solo (without peers there is nothing to overlap)")
    train(args)


if __name__ == "__main__":
    main()
