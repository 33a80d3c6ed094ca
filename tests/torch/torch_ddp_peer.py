"""One process of test_torch_ddp_kill.py: torch's own ``DistributedDataParallel`` over the
default group ``init_process_group("pccl")`` made, trained for STEPS steps by three processes.

    python torch_ddp_peer.py MASTER STORE_PORT RANK STEPS [--die-at K]

Each step starts with ``update_topology()`` (the vote that lets a newcomer in; a newcomer's
``init_process_group`` returns where the others' vote does, at the line after it).  While the
group has fewer than three peers the process waits there.  Whenever the group is not the one
its DDP was built for — a peer left, a newcomer came, or a backward failed (a peer died
mid-backward: the buckets' all-reduces end with ``CollectiveAborted``; the process waits for
all of them to end, ``pg.wait_for_pending_works()``) — every peer builds a
new DDP over a fresh copy of the module: torch broadcasts the module from rank 0 as it builds
it, and rank 0 broadcasts the step count, so a newcomer starts from the survivors' weights and
step.  Plain SGD keeps no other state.

``--die-at K``: SIGKILL this process mid-backward of step K, from a gradient hook of the first
layer (whose gradient comes last: the later layers' buckets are on the wire then).

Prints ``step N world W`` per step and, last, one JSON line: ``{"rank", "step", "digest",
"first_step", "rebuilds", "final_rank"}``.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.nn.parallel import DistributedDataParallel

import pccl
import pccl.torch

WORLD = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)  # every process builds the same module; DDP broadcasts rank 0's anyway
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 4))


def digest(module: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    master, store_port, rank, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    die_at = int(sys.argv[sys.argv.index("--die-at") + 1]) if "--die-at" in sys.argv else -1
    torch.set_num_threads(1)
    os.environ["PCCL_MASTER"] = master
    pccl.torch.register()
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("pccl", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    pg = _get_default_group()
    comm = pg.communicator
    module = make_model()
    ddp: Any = None
    built_for: tuple[int, ...] = ()
    step = 0
    first_step = None
    rebuilds = 0
    first = True
    while True:
        try:
            if not first:
                comm.update_topology()
            first = False
            while comm.world_size < WORLD:  # wait for a newcomer, voting it in
                time.sleep(0.1)
                comm.update_topology()
            if comm.ring != built_for:
                module = copy.deepcopy(module)  # a module no reducer has hooked
                ddp = DistributedDataParallel(module, process_group=pg, bucket_cap_mb=0.0005)
                built_for = comm.ring
                rebuilds += 1
                counter = torch.tensor([step], dtype=torch.int64)
                dist.broadcast(counter, src=0)
                step = int(counter)
            if step >= steps:
                break
            generator = torch.Generator().manual_seed(1000 * step + pg.rank())
            x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)
            if step == die_at:
                module[0].weight.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            ddp.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in module.parameters():
                    p -= 0.05 * p.grad
        except (pccl.CollectiveAborted, pccl.PhaseMismatch, pccl.PeerDisconnected, RuntimeError) as exc:
            print(f"step {step} failed: {type(exc).__name__}: {exc}", flush=True)
            pg.wait_for_pending_works()  # the later buckets' all-reduces end too, before the next vote
            built_for = ()  # the backward's buckets may have been half averaged: build anew, from rank 0
            continue
        step += 1
        first_step = step if first_step is None else first_step
        print(f"step {step} world {comm.world_size} rank {pg.rank()}", flush=True)
    report = {"rank": rank, "step": step, "digest": digest(module), "first_step": first_step, "rebuilds": rebuilds,
              "final_rank": dist.get_rank()}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
