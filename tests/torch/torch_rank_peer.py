"""One process of test_torch_ranks.py: ``init_process_group("pccl", rank=RANK)``, then what
``get_rank()`` and an all-gather of the ranks say.

    python torch_rank_peer.py MASTER WORLD RANK STORE_FILE

Prints one JSON line.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group

import pccl.torch


def main() -> None:
    master, world, rank, store_file = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ["PCCL_MASTER"] = master
    pccl.torch.register()
    dist.init_process_group("pccl", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    pg = _get_default_group()
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(dist.get_rank())]))
    report = {"rank": dist.get_rank(), "peer": pg.communicator.peer_id, "all_gather": [t.item() for t in gathered],
              "peers_by_rank": list(pg.peers_by_rank()), "ring": list(pg.communicator.ring)}
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
