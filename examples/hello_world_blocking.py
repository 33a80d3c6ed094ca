"""hello_world.py's loop on pccl.blocking: no async, no Trio in sight.

Start a master, then two or more copies of this script (each blocks until accepted):

    pccl master --listen 127.0.0.1:48148
    python examples/hello_world_blocking.py --master 127.0.0.1:48148
    python examples/hello_world_blocking.py --master 127.0.0.1:48148

The communicator runs its Trio loop in a background thread, so the heartbeats go on however long
a step computes.  Kill a copy with Ctrl-C (it leaves cleanly) or SIGKILL and start it again: the
others carry on, and the newcomer downloads the weights at its first sync.

Checkpoints as in hello_world.py: ``--checkpoint PATH`` saves every ``--checkpoint-every`` steps;
after losing the master and every peer, ``--resume PATH --min-peers N`` on each peer continues the
run from the furthest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import numpy as np
import xxhash

import pccl
import pccl.blocking


def train(args: argparse.Namespace) -> None:
    steps = args.steps
    # TLS when $PCCL_TLS_CERT/KEY/CA are set (the master's --tls-* flags).
    with pccl.blocking.open_communicator(args.master, peer_group=0, config=pccl.Config().with_tls_from_env()) as comm:
        w = np.zeros(args.size, np.float32)
        m = np.zeros_like(w)
        state = pccl.SharedState({"w": w, "m": m}, revision=0)  # references, no copies
        if args.resume:  # into w and m, with the revision and lineage the run had
            pccl.checkpoint.load(args.resume, into=state)
            print(f"resumed: step {state.revision} from {args.resume}", flush=True)
        while comm.world_size < args.min_peers:  # e.g. every peer of a resumed run takes part in the first step
            time.sleep(0.1)
            comm.update_topology()  # accepts the peers that are waiting
        rng = np.random.default_rng()
        for info in comm.steps(state):  # update_topology / wait while alone / sync
            if state.revision >= steps:
                break
            grads = (rng.standard_normal(w.shape, dtype=np.float32) * 0.01 + (w - 1.0)).astype(np.float32)
            try:
                reduced = comm.all_reduce(grads, op=pccl.ReduceOp.AVG)  # in place
            except (pccl.CollectiveAborted, pccl.TooFewPeers):
                continue  # a peer left mid-op: the next step runs on the survivors
            m *= 0.9
            m += grads  # deterministic update: identical on every peer
            w -= 0.1 * m
            state.revision += 1
            print(f"step {state.revision}: world {reduced.world_size}, synced {info.rx_bytes} B, "
                  f"sent {reduced.tx_bytes} B, |w-1| = {float(np.abs(w - 1).mean()):.4f}", flush=True)
            if args.checkpoint and state.revision % args.checkpoint_every == 0:
                pccl.checkpoint.save(state, args.checkpoint)
        print(f"done: step {state.revision} weights {xxhash.xxh3_128_hexdigest(memoryview(w))}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", type=int, default=1_000_000, help="float32 parameters")
    parser.add_argument("--checkpoint", metavar="PATH", help="save the shared state here (safetensors)")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="steps between checkpoints")
    parser.add_argument("--resume", metavar="PATH", help="load this checkpoint before the first sync")
    parser.add_argument("--min-peers", type=int, default=1, metavar="N", help="wait for N peers before the first step")
    # pccl logs what a run does at INFO ("waiting for the master at ...", "peer ... is alone in
    # group 0: waiting for another peer to join", joins and departures); this shows it, timed.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    train(parser.parse_args())


if __name__ == "__main__":
    main()
