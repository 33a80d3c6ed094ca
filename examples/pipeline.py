"""Pipeline parallelism over point to point: two stages of a two-layer model, each a process,
exchanging activations and gradients with ``comm.send`` / ``comm.recv`` (pccl.blocking, numpy).

Start a master, then one process per stage:

    pccl master --listen 127.0.0.1:48148
    python examples/pipeline.py --master 127.0.0.1:48148 --stage 0 --checkpoint-dir /tmp/pipe
    python examples/pipeline.py --master 127.0.0.1:48148 --stage 1 --checkpoint-dir /tmp/pipe

or both at once: ``pccl run --nproc 2 examples/pipeline.py`` (a copy's stage is its ``$RANK``).

Stage 0 holds the first layer (``h = tanh(x @ W0)``) and sends ``h``; stage 1 holds the second
(``out = h @ W1``), computes the loss, updates ``W1`` and sends back ``dloss/dh``, with which stage 0
updates ``W0``.  Each step's batch is a function of the step number, so the run's result does not
depend on who ran which step when: ``--local`` runs both stages in one process and prints the
weights a pipelined run must end with.

Kill a stage (SIGKILL) and start it again with the same command: the other stage's pending
``send``/``recv`` fails with ``PeerDisconnected`` (retry-safe), it waits for the newcomer
(``update_topology`` accepts it), the two tell each other the last step they committed, and they
go on.  Each stage commits a step to its checkpoint (``--checkpoint-dir``, atomically); stage 1
commits before it sends its gradient and keeps that gradient, so a stage 0 that died before
committing the step gets it again instead of the step running twice.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import time

import numpy as np
import xxhash

import pccl
import pccl.blocking
import pccl.errors

#: The tags of the stages' messages.
HELLO, ACTIVATIONS, GRADIENTS, RESENT = 1, 2, 3, 4
LR = 0.05
#: What either stage's ``send``/``recv`` raises when the other stage died.
LOST = (pccl.PeerDisconnected, pccl.errors.PeerUnreachable)


def batch(step: int, args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """Step ``step``'s inputs and targets (a fixed random linear map of the inputs)."""
    rng = np.random.default_rng(step)
    x = rng.standard_normal((args.batch, args.width), dtype=np.float32)
    truth = np.random.default_rng(12345).standard_normal((args.width, 1), dtype=np.float32)
    return x, (x @ truth).astype(np.float32)


def initial(stage: int, args: argparse.Namespace) -> np.ndarray:
    rng = np.random.default_rng(1000 + stage)
    shape = (args.width, args.hidden) if stage == 0 else (args.hidden, 1)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.1).astype(np.float32)


def forward0(w0: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.tanh(x @ w0).astype(np.float32)


def update0(w0: np.ndarray, x: np.ndarray, h: np.ndarray, grad_h: np.ndarray) -> None:
    w0 -= LR * (x.T @ (grad_h * (1 - h * h)))


def step1(w1: np.ndarray, h: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Stage 1's step: the loss, ``dloss/dh``, and ``w1`` updated in place."""
    out = h @ w1
    loss = float(np.mean((out - y) ** 2))
    grad_out = (2 * (out - y) / out.size).astype(np.float32)
    grad_h = (grad_out @ w1.T).astype(np.float32)
    w1 -= LR * (h.T @ grad_out)
    return loss, grad_h


def digest(w: np.ndarray) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(w).tobytes())


class Checkpoint:
    """A stage's committed state: its weights, the last step it committed and (stage 1) the
    gradient it sent for that step; written atomically (a temporary file, then a rename)."""

    def __init__(self, directory: str | None, stage: int) -> None:
        self.path = pathlib.Path(directory) / f"stage{stage}.npz" if directory else None

    def load(self) -> dict[str, np.ndarray] | None:
        if self.path is None or not self.path.exists():
            return None
        with np.load(self.path) as data:
            return {k: data[k] for k in data.files}

    def save(self, **arrays: np.ndarray) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub reads a name as allow_pickle
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


def meet(comm: pccl.blocking.Communicator, gone: int | None = None) -> int:
    """The other stage's peer id, once it is in the group (accepting it if it waits)."""
    while True:
        others = [p for p in comm.ring if p not in (comm.peer_id, gone)]
        if others:
            return others[0]
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.05)


def hello(comm: pccl.blocking.Communicator, partner: int, done: int) -> int:
    """Tell the other stage the last step this one committed; return its."""
    mine, theirs = np.array([done], np.int64), np.zeros(1, np.int64)
    sent = comm.send_async(mine, to=partner, tag=HELLO)  # both say hello at once: one side must not block
    comm.recv(theirs, from_=partner, tag=HELLO)
    sent.wait()
    return int(theirs[0])


def run_stage(comm: pccl.blocking.Communicator, args: argparse.Namespace) -> None:
    ckpt = Checkpoint(args.checkpoint_dir, args.stage)
    saved = ckpt.load()
    w = saved["w"] if saved is not None else initial(args.stage, args)
    done = int(saved["step"][0]) if saved is not None else 0
    grad_kept = saved["grad_h"] if saved is not None and "grad_h" in saved else np.zeros((args.batch, args.hidden),
                                                                                          np.float32)
    if saved is not None:
        print(f"stage {args.stage}: resumed at step {done} from {ckpt.path}", flush=True)
    partner = meet(comm)
    while True:
        try:
            theirs = hello(comm, partner, done)
            if args.stage == 0 and theirs == done + 1:  # stage 1 committed a step whose gradient we lost
                x, _ = batch(theirs, args)
                grad_h = np.empty((args.batch, args.hidden), np.float32)
                comm.recv(grad_h, from_=partner, tag=RESENT)
                update0(w, x, forward0(w, x), grad_h)
                done = theirs
                ckpt.save(w=w, step=np.array([done]))
                print(f"step {done}: stage 0 took the gradient again", flush=True)
            elif args.stage == 1 and theirs == done - 1:
                comm.send(grad_kept, to=partner, tag=RESENT)
            elif theirs != done:
                raise SystemExit(f"stage {args.stage} committed step {done}, the other stage {theirs}: "
                                 "their checkpoints are not of one run")
            while done < args.steps:
                step = done + 1
                x, y = batch(step, args)
                if args.stage == 0:
                    time.sleep(args.delay)  # stage 0's compute, while stage 1 waits in recv
                    h = forward0(w, x)
                    comm.send(h, to=partner, tag=ACTIVATIONS)
                    grad_h = np.empty_like(h)
                    comm.recv(grad_h, from_=partner, tag=GRADIENTS)
                    update0(w, x, h, grad_h)
                    done = step
                    ckpt.save(w=w, step=np.array([done]))
                    print(f"step {done}: stage 0", flush=True)
                else:
                    h = np.empty((args.batch, args.hidden), np.float32)
                    comm.recv(h, from_=partner, tag=ACTIVATIONS)
                    time.sleep(args.delay)  # stage 1's compute, while stage 0 waits in recv
                    loss, grad_kept = step1(w, h, y)
                    done = step
                    ckpt.save(w=w, step=np.array([done]), grad_h=grad_kept)  # committed before it is sent
                    comm.send(grad_kept, to=partner, tag=GRADIENTS)
                    print(f"step {done}: stage 1 loss {loss:.5f}", flush=True)
            break
        except LOST as exc:
            print(f"stage {args.stage}: lost the other stage after step {done} ({type(exc).__name__}): "
                  "waiting for it to come back", flush=True)
            partner = meet(comm, gone=partner)
    # Leave together, through a collective: the master settles it on both stages, so a stage that
    # exits at once cannot take away an acknowledgement the other still waits for (a point-to-
    # point hello as the last word could be: closing a connection with unread bytes resets it).
    comm.all_reduce(np.array([done], np.int64), op=pccl.ReduceOp.MIN)
    print(f"done: step {done} stage {args.stage} weights {digest(w)}", flush=True)


def run_local(args: argparse.Namespace) -> None:
    """Both stages in this process: the weights a pipelined run ends with."""
    w0, w1 = initial(0, args), initial(1, args)
    for step in range(1, args.steps + 1):
        x, y = batch(step, args)
        h = forward0(w0, x)
        loss, grad_h = step1(w1, h, y)
        update0(w0, x, h, grad_h)
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss {loss:.5f}", flush=True)
    print(f"done: step {args.steps} stage 0 weights {digest(w0)}", flush=True)
    print(f"done: step {args.steps} stage 1 weights {digest(w1)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default=os.environ.get("PCCL_MASTER", "127.0.0.1:48148"),
                        help="the master's HOST:PORT (default: $PCCL_MASTER, else %(default)s)")
    stage = os.environ.get("RANK")  # pccl run --nproc 2 numbers its copies
    parser.add_argument("--stage", type=int, choices=(0, 1), default=int(stage) if stage in ("0", "1") else None,
                        help="which stage this process runs (default: $RANK, which pccl run --nproc 2 sets)")
    parser.add_argument("--local", action="store_true", help="run both stages here, without pccl")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=16, help="input features")
    parser.add_argument("--hidden", type=int, default=64, help="the activations' width")
    parser.add_argument("--delay", type=float, default=0.0, metavar="S", help="seconds of 'compute' per step and stage")
    parser.add_argument("--checkpoint-dir", metavar="DIR", help="each stage commits its steps here")
    parser.add_argument("--peer-timeout", type=float, default=pccl.Config().peer_timeout, metavar="S")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.local:
        run_local(args)
        return
    if args.stage is None:
        parser.error("--stage 0 or --stage 1 (or --local)")
    config = pccl.Config(peer_timeout=args.peer_timeout).with_tls_from_env()
    with pccl.blocking.open_communicator(args.master, peer_group=0, config=config) as comm:
        run_stage(comm, args)


if __name__ == "__main__":
    main()
