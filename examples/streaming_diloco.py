"""Streaming DiLoCo: the model in fragments, one fragment's all-reduce at a time, overlapping compute.

    pccl master --listen 127.0.0.1:48148
    python examples/streaming_diloco.py --master 127.0.0.1:48148      # in 2-4 terminals

Without ``--master`` the master address comes from ``$PCCL_MASTER`` (``pccl run`` sets it).

Plain DiLoCo (``diloco.py``) all-reduces the whole model's pseudo-gradient every ``H`` inner
steps: the network idles, then carries the whole model at once.  Streaming DiLoCo (Douillard et
al., 2025) cuts the model into ``F`` fragments (``--fragments``: consecutive parameters, about
the same size each) and syncs fragment ``f`` every ``H`` inner steps at offset ``f*H/F``, so one
``F``-th of the model is on the wire every ``H/F`` inner steps.  The peak traffic is an ``F``-th,
and low-bit quantization on the wire divides it again: by default ``--quant u4 --quant-block
128``, MIN_MAX to 4 bits per value with one (min, max) pair per block of 128 values (an outlier
spends the range of its block only), about an eighth of float32; the all-reduce still adds in
float32 and ends bit-identical on every peer.  Each fragment's sync:

1. Δ_f = θ̄_f - θ_f, the pseudo-gradient: the fragment's outer (shared) weights θ̄_f minus this
   peer's working weights θ_f;
2. the average of Δ_f over the peers starts (``all_reduce_many_async`` returns at once) and the
   next ``tau`` inner steps (``--overlap``) run meanwhile;
3. ``wait()``; the outer Nesterov step makes θ̄_f ← OuterSGD(θ̄_f, avg Δ_f), identically on every
   peer;
4. the working weights take it in with the mixing factor α (``--alpha``):
   θ_f ← α θ_f + (1 - α) θ̄_f.  α = 0 overwrites them (DiLoCo's reset), losing the ``tau``
   steps this peer took meanwhile; α = 0.5 keeps half of them.

In pccl's loop one *outer step* here is one fragment's sync: ``H/F`` inner steps, of which the
first ``tau`` overlap the all-reduce (so ``tau`` ≤ ``H/F``), and ``--outer-steps`` counts them
(``F`` of them make one of plain DiLoCo's outer steps: the same inner steps, run ``--outer-steps
F*N`` to compare with ``diloco.py --outer-steps N``).  No all-reduce is in flight when an outer
step ends, so ``comm.steps()`` can let newcomers in and sync the shared state between two of
them, as in ``diloco.py``.

The shared state is ``diloco.py``'s — the outer weights θ̄ and the outer momentum, the same
everywhere, the step, and the inner AdamW moments — plus the working weights θ: they differ per
peer (``allow_content_inequality``: never compared), and a newcomer, or a peer that fell behind,
receives one peer's θ with the AdamW moments that go with them and carries on from there.  Kill
a peer and start a new one at any time: the others go on, and the newcomer syncs and continues
in lockstep.  The first ``F`` outer steps sync fragments that have trained fewer than ``H``
steps (fragment 0 none at all): the offsets need ``F`` outer steps to fill.

When a sync is lost — the master restarted, or every retry on the survivors failed — its
average is not applied and the step does not advance: the next outer step syncs the same
fragment again, and ``comm.steps()`` makes θ̄ the same on every peer.  Alone (the last
survivor), a peer applies its own Δ_f and then waits in ``steps()`` for company.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

import pccl
import pccl.blocking
from diloco import DiLoCo, _quantization, parser


class StreamingDiLoCo(DiLoCo):
    """``diloco.py``'s peer, with the model's parameters split into fragments synced in turn."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        params = list(self.model.parameters())
        self.fragments = split(params, args.fragments)  # indices into params, one list per fragment
        # The working weights join the shared state, per peer (a newcomer receives one peer's).
        names = [n for n, _ in self.model.named_parameters()]
        working = {f"working.{n}": pccl.Tensor(p.detach(), allow_content_inequality=True) for n, p in zip(names, params)}
        self.state = pccl.SharedState({**self.state.tensors(), **working})

    def fragment_pseudo_gradient(self, f: int) -> list[torch.Tensor]:
        """Δ_f = θ̄_f - θ_f into kept buffers (all-reduced in place)."""
        params = list(self.model.parameters())
        with torch.no_grad():
            for i in self.fragments[f]:
                torch.sub(self.outer[i], params[i], out=self.pseudo[i])
        return [self.pseudo[i] for i in self.fragments[f]]

    def run_inner_steps(self, n: int) -> list[float]:
        """``n`` AdamW steps on this peer's batches; their losses."""
        losses = []
        for _ in range(n):
            batch_loss = self._loss(*self._batch(self.train_data, self.batches, self.args.batch))
            self.inner_opt.zero_grad()
            batch_loss.backward()
            self.inner_opt.step()
            losses.append(batch_loss.item())
        return losses

    def fragment_outer_step(self, f: int, averaged: list[torch.Tensor]) -> None:
        """θ̄_f ← OuterSGD(θ̄_f, avg Δ_f), then θ_f ← α θ_f + (1 - α) θ̄_f."""
        fragment = [self.outer[i] for i in self.fragments[f]]
        for o, d in zip(fragment, averaged):
            o.grad = d
        self.outer_opt.step()  # SGD skips parameters without a gradient: the other fragments
        for o in fragment:
            o.grad = None
        params = list(self.model.parameters())
        with torch.no_grad():
            for i in self.fragments[f]:
                params[i].mul_(self.args.alpha).add_(self.outer[i], alpha=1.0 - self.args.alpha)
        self.step += 1


def split(params: list[torch.Tensor], count: int) -> list[list[int]]:
    """Parameter indices in ``count`` runs of consecutive parameters, each about a ``count``-th
    of the elements: a new run starts where a parameter's middle crosses the next boundary (or
    when every remaining parameter is needed to fill the remaining runs)."""
    if not 1 <= count <= len(params):
        raise SystemExit(f"--fragments must be between 1 and the model's {len(params)} parameters")
    total = sum(p.numel() for p in params)
    fragments: list[list[int]] = [[]]
    seen = 0
    for i, p in enumerate(params):
        past_boundary = (seen + p.numel() / 2) * count > total * len(fragments)
        needed = len(params) - i == count - len(fragments)
        if fragments[-1] and len(fragments) < count and (past_boundary or needed):
            fragments.append([])
        fragments[-1].append(i)
        seen += p.numel()
    return fragments


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    sd = StreamingDiLoCo(args)
    period = args.inner_steps // args.fragments  # inner steps per outer step: H/F
    quant = _quantization(args)
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    sd.resume()
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        print(f"joined: world {comm.world_size}", flush=True)
        for info in comm.steps(sd.state):  # accept newcomers, wait while alone, sync
            if int(sd.step) >= args.outer_steps:
                break
            started = time.monotonic()
            f = int(sd.step) % args.fragments  # fragment f syncs at inner steps f*H/F + k*H
            pseudo = sd.fragment_pseudo_gradient(f)
            pending = comm.all_reduce_many_async(pseudo, op=pccl.ReduceOp.AVG, quantization=quant)
            losses = sd.run_inner_steps(args.overlap)  # overlaps the all-reduce
            compute = time.monotonic() - started
            sent = 0
            try:
                reduced = pending.wait()
                world, sent = reduced.world_size, reduced.tx_bytes
            except pccl.TooFewPeers:
                world = 1  # the others are gone: this peer's own Δ_f is the average
            except pccl.CollectiveAborted:
                world = 0  # the sync is lost (see the module docstring): apply nothing
            if world:
                sd.fragment_outer_step(f, pseudo)
                sd.state.revision += 1
            resumed = time.monotonic()
            losses += sd.run_inner_steps(period - args.overlap)
            compute += time.monotonic() - resumed
            if world:
                step = int(sd.step)
                # once every fragment has synced (every H inner steps, as diloco.py) and at the end
                evaluated = step % args.fragments == 0 or step >= args.outer_steps
                evaluation = f"eval loss {sd.eval_loss():.4f}, " if evaluated else ""
                print(f"outer step {step}: world {world}, fragment {f}, inner loss {losses[-1]:.4f}, {evaluation}"
                      f"synced {info.rx_bytes} B, sent {sent} B, inner steps {compute:.2f} s, "
                      f"step {time.monotonic() - started:.2f} s", flush=True)
                sd.save_checkpoint()
        print(f"done: step {int(sd.step)} weights {sd.digest()}", flush=True)


def main() -> None:
    # pccl logs what a run does at INFO ("waiting for the master at ...", "peer ... is alone in
    # group 0: waiting for another peer to join", joins and departures); this shows it, timed.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = parser(__doc__)
    p.add_argument("--fragments", type=int, default=3, help="F: fragments synced in turn")
    p.add_argument("--overlap", type=int, default=2, help="tau: inner steps overlapping a fragment's all-reduce")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="mixing factor: working weights = alpha * working + (1 - alpha) * outer")
    p.set_defaults(master=None, outer_steps=150, quant="u4", quant_block=128)
    args = p.parse_args()
    args.master = args.master or os.environ.get("PCCL_MASTER") or "127.0.0.1:48148"
    if args.solo:
        raise SystemExit("--solo: run diloco.py --solo (without peers there is nothing to stream)")
    if args.inner_steps % args.fragments or not 0 <= args.overlap <= args.inner_steps // args.fragments:
        raise SystemExit("--inner-steps must be a multiple of --fragments, and --overlap at most their ratio")
    train(args)


if __name__ == "__main__":
    main()
