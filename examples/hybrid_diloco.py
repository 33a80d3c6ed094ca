"""Hybrid DiLoCo: torch's gloo inside each site, pccl across sites, one peer group per local rank.

    pccl master --listen 0.0.0.0:48148                                       # anywhere
    pccl run --nproc 2 --master HOST:48148 examples/hybrid_diloco.py         # site A (one machine)
    pccl run --nproc 2 --master HOST:48148 examples/hybrid_diloco.py         # site B (another one)

The shape large runs over the internet use (INTELLECT-1): a fast local backend inside a
datacenter, pccl between datacenters.  Each *site* is ``W`` processes (``pccl run --nproc W``
gives them ``RANK``/``WORLD_SIZE`` and a rendezvous for ``init_process_group("gloo")``):

* inner steps: the site trains a replica of the model with torch's own DDP over its gloo group
  (the gradients averaged inside the site), ``--inner-steps`` AdamW steps per outer step;
* the outer state — the shared weights and the outer Nesterov momentum — is sharded inside the
  site: local rank ``r`` owns the ``r``-th of ``W`` slices of the flat parameter vector;
* across sites, local rank ``r`` joins pccl **peer group** ``r``: its slice's pseudo-gradient
  (outer weights minus where the inner steps ended) is all-reduced (AVG) with its twins, the
  processes of the same local rank in the other sites, and each applies the outer step to its
  slice; the site then all-gathers the slices (gloo) into the next outer weights.

Each peer group's shared state is its slice (weights, momentum) and the step: every process of
rank ``r`` holds the same slice, bit for bit, after every outer step, and a process's site
all-gathers the same weights as every other site.

Faults.  A process that dies takes its site with it: the others of the site see their gloo
collective fail and leave the run (they print ``site lost: ...`` and exit with status 1), and
the remaining sites go on — each peer group averages over the twins left (alone, a slice's own
pseudo-gradient is the average).  The run starts once ``--min-peers`` processes (every site's)
are in, so that all the sites begin together; a site that arrives after that waits there too
and is not accepted into a running run by this example (its processes would have to be
accepted in one vote, as a site all-gathers at once).  ``--master`` defaults to ``$PCCL_MASTER``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import pccl
import pccl.blocking
from ddp import make_model, teacher_batch  # examples/ddp.py, next to this file


class SiteLost(Exception):
    """A collective of the site's gloo group failed: another process of the site died."""


def site_call(what: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a gloo collective of the site; a failure (a process of the site died: gloo says
    "Connection closed by peer") is ``SiteLost``."""
    try:
        return fn(*args)
    except RuntimeError as exc:
        raise SiteLost(f"{what}: {exc}") from exc


class Shard:
    """This process's slice of the flat parameter vector: the outer weights and momentum it
    owns, the shared state of its peer group."""

    def __init__(self, model: torch.nn.Module, rank: int, world: int) -> None:
        self.params = list(model.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.size = -(-self.numel // world)  # the last slice is padded with zeros
        self.start = rank * self.size
        self.world = world
        full = self.flat()
        self.weights = full[self.start : self.start + self.size].clone()
        self.momentum = torch.zeros_like(self.weights)
        self.pseudo = torch.zeros_like(self.weights)
        self.outer = torch.zeros(self.size * world)  # every slice, all-gathered
        self.step = torch.zeros((), dtype=torch.int64)
        self.state = pccl.SharedState({"outer.weights": self.weights, "outer.momentum": self.momentum,
                                       "step": self.step})

    def flat(self) -> torch.Tensor:
        """The model's parameters as one padded vector."""
        full = torch.zeros(self.size * self.world)
        torch.cat([p.detach().reshape(-1) for p in self.params], out=full[: self.numel])
        return full

    def gather(self) -> None:
        """All-gather every rank's slice of the outer weights (gloo) and load them into the model."""
        slices = list(self.outer.chunk(self.world))
        site_call("all_gather", dist.all_gather, slices, self.weights)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.outer[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def pseudo_gradient(self) -> torch.Tensor:
        """This slice of (outer weights - where the inner steps ended)."""
        torch.sub(self.weights, self.flat()[self.start : self.start + self.size], out=self.pseudo)
        return self.pseudo

    def outer_step(self, lr: float) -> None:
        """Nesterov SGD (momentum 0.9) on the slice: the same averaged input, the same result on
        every twin."""
        self.momentum.mul_(0.9).add_(self.pseudo)
        self.weights.sub_(self.pseudo + 0.9 * self.momentum, alpha=lr)
        self.step += 1

    def digest(self) -> str:
        return hashlib.sha256(self.outer[: self.numel].numpy().tobytes()).hexdigest()[:32]


def inner_steps(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, generator: torch.Generator,
                args: argparse.Namespace) -> float:
    loss = torch.zeros(())
    for _ in range(args.inner_steps):
        x, y = teacher_batch(generator, args.batch)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        optimizer.zero_grad()
        site_call("the site's DDP backward", loss.backward)  # gradients averaged inside the site (gloo)
        optimizer.step()
    return float(loss)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    print(f"local rank {rank} of {world}: pid {os.getpid()}", flush=True)
    # The site: torch's own gloo group (pccl run's MASTER_ADDR/MASTER_PORT rendezvous).
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.site_timeout))
    model = make_model()
    shard = Shard(model, rank, world)
    ddp = torch.nn.parallel.DistributedDataParallel(model)  # inside the site
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    generator = torch.Generator().manual_seed(torch.seed())  # this process's own batches
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()
    try:
        # Peer group = local rank: each slice is averaged with its twins in the other sites.
        with pccl.blocking.open_communicator(args.master, peer_group=rank, config=config) as comm:
            outer_loop(comm, shard, ddp, optimizer, generator, args)
    except SiteLost as exc:
        print(f"site lost: {exc}; leaving the run", flush=True)
        raise SystemExit(1) from None
    finally:
        dist.destroy_process_group()


def outer_loop(comm: pccl.blocking.Communicator, shard: Shard, ddp: torch.nn.Module,
               optimizer: torch.optim.Optimizer, generator: torch.Generator, args: argparse.Namespace) -> None:
    """``comm.steps()``'s loop, except that it never waits for a newcomer once the run started:
    a site left alone goes on alone.  Every process of every site makes the same pccl calls in
    the same order, and the only wait — for ``--min-peers`` at the start — reads
    ``global_world_size``, which every peer sees alike after each vote (a gloo collective in
    that wait would deadlock against the global accept vote)."""
    first = True
    started = False
    while True:
        try:
            if not first:
                comm.update_topology()  # accept newcomers (a global vote: every group's peers)
            first = False
            while not started and comm.global_world_size < args.min_peers:
                time.sleep(0.1)
                comm.update_topology()
            started = True
            info = comm.sync_shared_state(shard.state)  # this rank's slice, with its twins
        except pccl.PhaseMismatch:
            continue  # the peers' loops met elsewhere: start the step over, as comm.steps() does
        shard.gather()
        if int(shard.step) >= args.outer_steps:
            break
        begun = time.monotonic()
        loss = inner_steps(ddp, optimizer, generator, args)
        pseudo = shard.pseudo_gradient()
        try:
            world = comm.all_reduce_many([pseudo], op=pccl.ReduceOp.AVG).world_size  # with the twins
        except pccl.TooFewPeers:
            world = 1  # no twin left: this slice's own pseudo-gradient is the average
        except pccl.CollectiveAborted:
            continue  # the master restarted or the loops diverged: the next step's sync realigns
        shard.outer_step(args.outer_lr)
        shard.state.revision += 1
        print(f"outer step {int(shard.step)}: twins {world}, peers {comm.global_world_size}, "
              f"inner loss {loss:.4f}, synced {info.rx_bytes} B, {time.monotonic() - begun:.2f} s", flush=True)
    print(f"done: step {int(shard.step)} weights {shard.digest()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--min-peers", type=int, default=4,
                        help="processes of every site that must be in before the run starts (default: 2 sites x 2)")
    parser.add_argument("--outer-steps", type=int, default=30)
    parser.add_argument("--inner-steps", type=int, default=10, help="H: AdamW steps between the sites' all-reduces")
    parser.add_argument("--inner-lr", type=float, default=3e-3)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (several share a host)")
    parser.add_argument("--peer-timeout", type=float, default=10.0)
    parser.add_argument("--site-timeout", type=float, default=60.0, help="gloo's timeout inside a site (seconds)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
