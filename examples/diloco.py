"""DiLoCo with pccl.blocking: a character-level transformer trained by peers that talk rarely.

    pccl master --listen 127.0.0.1:48148
    python examples/diloco.py --master 127.0.0.1:48148      # in 2-4 terminals
    python examples/diloco.py --solo                         # the same training in one process

Each outer step, every peer runs ``--inner-steps`` AdamW steps on its own batches, starting from
the shared (outer) weights.  The pseudo-gradient — outer weights minus where the inner steps
ended — is averaged over the peers with one ``all_reduce_many`` (``--quant u8``: MIN_MAX
quantized to 8 bits on the wire), and an outer Nesterov SGD step applies it to the outer
weights, identically on every peer.  The shared state is the outer model, both optimizers and
the step: the outer model and the outer momentum are the same everywhere (a sync moves nothing),
the inner AdamW moments differ per peer (``allow_content_inequality``: never compared, but a
newcomer receives one peer's).  Kill a peer and start a new one at any time: the others go on,
and the newcomer downloads the state at its next sync.  ``--checkpoint PATH`` saves the shared
state every ``--checkpoint-every`` outer steps; after losing the master and every peer, start
them again with ``--resume PATH`` and the run continues from the furthest checkpoint.

The text is Python's own standard library source (a few modules that ship with every Python),
read as bytes: nothing is downloaded.  The last tenth of it is held out for the evaluation loss
printed after every outer step.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import logging
import os
import pathlib
import time

import numpy as np
import torch

import pccl
import pccl.blocking

#: Standard-library modules whose source is the corpus (about 600 KB).
CORPUS_MODULES = ("argparse", "textwrap", "json.decoder", "json.encoder", "string", "difflib", "pprint",
                  "fractions", "heapq", "bisect", "calendar", "dataclasses")


def corpus() -> torch.Tensor:
    import importlib

    text = b"".join(pathlib.Path(importlib.import_module(m).__file__ or "").read_bytes() for m in CORPUS_MODULES)
    return torch.from_numpy(np.frombuffer(text, dtype=np.uint8).astype(np.int64))


class CharTransformer(torch.nn.Module):
    """A small causal transformer over bytes."""

    def __init__(self, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.context = context
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.position[:n]
        x = self.blocks(x, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


class DiLoCo:
    """One peer's model, optimizers, data and the DiLoCo steps; ``state`` is what peers share."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.init_seed)  # the same initial weights everywhere
        self.args = args
        self.model = CharTransformer(args.width, args.layers, args.heads, args.context)
        names = [n for n, _ in self.model.named_parameters()]
        params = list(self.model.parameters())
        self.outer = [p.detach().clone() for p in params]  # the shared weights
        self.pseudo = [torch.zeros_like(p) for p in params]
        self.inner_opt = torch.optim.AdamW(params, lr=args.inner_lr, weight_decay=0.1)
        self.outer_opt = torch.optim.SGD(self.outer, lr=args.outer_lr, momentum=0.9, nesterov=True)
        self.step = torch.zeros((), dtype=torch.int64)
        entries: dict[str, object] = {"step": self.step}
        for name, p, o in zip(names, params, self.outer):
            # Created now (torch creates optimizer state lazily) so the shared state can hold it.
            inner = self.inner_opt.state[p]
            inner.update(step=torch.zeros(()), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            self.outer_opt.state[o]["momentum_buffer"] = torch.zeros_like(o)
            entries[f"model.{name}"] = o
            entries[f"outer_sgd.{name}.momentum"] = self.outer_opt.state[o]["momentum_buffer"]
            for key, value in inner.items():
                entries[f"inner_adamw.{name}.{key}"] = pccl.Tensor(value, allow_content_inequality=True)
        self.state = pccl.SharedState(entries)
        data = corpus()
        split = len(data) * 9 // 10
        self.train_data, self.eval_data = data[:split], data[split:]
        self.eval_model: CharTransformer | None = None
        self.batches = torch.Generator().manual_seed(args.data_seed if args.data_seed is not None else torch.seed())

    def _batch(self, data: torch.Tensor, generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.args.context
        starts = torch.randint(0, len(data) - n - 1, (size,), generator=generator)
        window = torch.stack([data[s : s + n + 1] for s in starts.tolist()])
        return window[:, :-1], window[:, 1:]

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(x).reshape(-1, 256), y.reshape(-1))

    def resume(self) -> None:
        """``--resume``: load the checkpoint into the shared tensors (weights, optimizer state, step)."""
        if self.args.resume:
            pccl.checkpoint.load(self.args.resume, into=self.state)
            print(f"resumed: outer step {int(self.step)} from {self.args.resume}", flush=True)

    def save_checkpoint(self) -> None:
        """``--checkpoint``: every ``--checkpoint-every`` outer steps, save the shared state."""
        if self.args.checkpoint and int(self.step) % self.args.checkpoint_every == 0:
            pccl.checkpoint.save(self.state, self.args.checkpoint)

    def begin_outer_step(self) -> None:
        """Start the inner steps from the shared weights."""
        with torch.no_grad():
            for p, o in zip(self.model.parameters(), self.outer):
                p.copy_(o)

    def inner_steps(self) -> float:
        loss = 0.0
        for _ in range(self.args.inner_steps):
            batch_loss = self._loss(*self._batch(self.train_data, self.batches, self.args.batch))
            self.inner_opt.zero_grad()
            batch_loss.backward()
            self.inner_opt.step()
            loss = batch_loss.item()
        return loss

    def pseudo_gradients(self, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Where the inner steps started (the outer weights) minus where they ended, into
        tensors kept across steps (``out``, default ``self.pseudo``; all-reduced in place)."""
        out = self.pseudo if out is None else out
        with torch.no_grad():
            for d, o, p in zip(out, self.outer, self.model.parameters()):
                torch.sub(o, p, out=d)
        return out

    def outer_step(self, pseudo: list[torch.Tensor]) -> None:
        for o, d in zip(self.outer, pseudo):
            o.grad = d
        self.outer_opt.step()  # Nesterov SGD: the same averaged input, the same result everywhere
        for o in self.outer:
            o.grad = None
        self.step += 1

    @torch.no_grad()
    def eval_loss(self) -> float:
        """Loss of the outer weights on fixed held-out windows (on a copy of the model: the
        working weights may be mid-training)."""
        if self.eval_model is None:
            self.eval_model = copy.deepcopy(self.model)
        for p, o in zip(self.eval_model.parameters(), self.outer):
            p.copy_(o)
        generator = torch.Generator().manual_seed(0)
        losses = []
        for _ in range(self.args.eval_batches):
            x, y = self._batch(self.eval_data, generator, 32)
            losses.append(float(torch.nn.functional.cross_entropy(self.eval_model(x).reshape(-1, 256), y.reshape(-1))))
        return sum(losses) / len(losses)

    def digest(self) -> str:
        h = hashlib.sha256()
        for o in self.outer:
            h.update(o.numpy().tobytes())
        return h.hexdigest()[:32]


def _quantization(args: argparse.Namespace) -> pccl.Quantization | None:
    """``--quant``/``--quant-block`` as a pccl.Quantization (None: float32 on the wire)."""
    if args.quant == "none":
        return None
    return pccl.Quantization(pccl.QuantKind.MIN_MAX, args.quant.replace("u", "uint"), block=args.quant_block or None)


def report(diloco: DiLoCo, world: int, inner_loss: float, synced: int, started: float, compute: float,
           sent: int = 0) -> None:
    """One line per outer step: ``synced`` the bytes the state sync received, ``sent`` the bytes
    the all-reduce sent; ``compute`` is the inner steps' time, the last figure the whole step's
    (both in seconds)."""
    print(f"outer step {int(diloco.step)}: world {world}, inner loss {inner_loss:.4f}, "
          f"eval loss {diloco.eval_loss():.4f}, synced {synced} B, sent {sent} B, inner steps {compute:.2f} s, "
          f"step {time.monotonic() - started:.2f} s", flush=True)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    diloco = DiLoCo(args)
    diloco.resume()
    if args.solo:  # the baseline: one process, no communicator
        while int(diloco.step) < args.outer_steps:
            started = time.monotonic()
            diloco.begin_outer_step()
            loss = diloco.inner_steps()
            compute = time.monotonic() - started
            diloco.outer_step(diloco.pseudo_gradients())
            report(diloco, 1, loss, 0, started, compute)
            diloco.save_checkpoint()
        print(f"done: step {int(diloco.step)} weights {diloco.digest()}", flush=True)
        return
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()  # TLS if $PCCL_TLS_* are set
    with pccl.blocking.open_communicator(args.master, config=config) as comm:
        print(f"joined: world {comm.world_size}", flush=True)
        for info in comm.steps(diloco.state):  # accept newcomers, wait while alone, sync
            if int(diloco.step) >= args.outer_steps:
                break
            started = time.monotonic()
            diloco.begin_outer_step()
            loss = diloco.inner_steps()
            compute = time.monotonic() - started
            pseudo = diloco.pseudo_gradients()
            try:
                # Retried on the survivors if a peer dies mid-op; AVG over whoever took part.
                reduced = comm.all_reduce_many(pseudo, op=pccl.ReduceOp.AVG, quantization=_quantization(args))
                world, sent = reduced.world_size, reduced.tx_bytes
            except pccl.TooFewPeers:
                world, sent = 1, 0  # the others are gone: this peer's own pseudo-gradient is the average
            except pccl.CollectiveAborted:
                continue  # the master restarted, or the loops diverged: the next step's sync realigns
            diloco.outer_step(pseudo)
            diloco.state.revision += 1
            report(diloco, world, loss, info.rx_bytes, started, compute, sent)
            diloco.save_checkpoint()
        print(f"done: step {int(diloco.step)} weights {diloco.digest()}", flush=True)


def parser(description: str | None = __doc__) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                   help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    p.add_argument("--outer-steps", type=int, default=50)
    p.add_argument("--inner-steps", type=int, default=30, help="H: AdamW steps between all-reduces")
    p.add_argument("--inner-lr", type=float, default=3e-3)
    p.add_argument("--outer-lr", type=float, default=0.7)
    p.add_argument("--quant", choices=("none", "u4", "u8", "u16"), default="none",
                   help="MIN_MAX quantization of the pseudo-gradients on the wire")
    p.add_argument("--quant-block", type=int, default=0, metavar="K",
                   help="with --quant: every K values get their own min/max (0: one pair per chunk)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--init-seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=None, help="this peer's batch order (default: random)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (several share a host)")
    p.add_argument("--peer-timeout", type=float, default=10.0)
    p.add_argument("--solo", action="store_true", help="train alone, without a master (the baseline)")
    p.add_argument("--checkpoint", metavar="PATH", help="save the shared state here (safetensors)")
    p.add_argument("--checkpoint-every", type=int, default=5, metavar="N", help="outer steps between checkpoints")
    p.add_argument("--resume", metavar="PATH", help="load this checkpoint before the first sync")
    return p


def main() -> None:
    # pccl logs what a run does at INFO ("waiting for the master at ...", "peer ... is alone in
    # group 0: waiting for another peer to join", joins and departures); this shows it, timed.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(parser().parse_args())


if __name__ == "__main__":
    main()
