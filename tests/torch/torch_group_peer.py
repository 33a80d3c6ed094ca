"""One process of test_pccl_torch_api.py's backend cases: ``init_process_group("pccl")``, then
``new_group`` over every rank and over rank 0 alone.

    python torch_group_peer.py MASTER WORLD RANK STORE_FILE

Prints one JSON line of what it saw.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import pccl.torch


def main() -> None:
    master, world, rank, store_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ["PCCL_MASTER"] = master
    pccl.torch.register()
    dist.init_process_group("pccl", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=20))
    out: dict[str, Any] = {"rank": dist.get_rank()}
    started = time.monotonic()
    group = dist.new_group()  # every rank: a group over the same communicator
    out["new_group_seconds"] = time.monotonic() - started
    out["new_group_name"] = group.group_name
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t, group=group)
    u = torch.full((4,), 10.0)
    dist.all_reduce(u)  # the default group goes on beside it
    out["sums"] = [t.tolist(), u.tolist()]
    started = time.monotonic()
    try:
        sub = dist.new_group([0])  # a subgroup: refused at once at rank 0, not a member elsewhere
        out["subgroup"] = "member" if sub is not dist.GroupMember.NON_GROUP_MEMBER else "non-member"
    except Exception as exc:  # noqa: BLE001 - reported
        out["subgroup"] = f"{type(exc).__name__}: {exc}"
    out["subgroup_seconds"] = time.monotonic() - started
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
