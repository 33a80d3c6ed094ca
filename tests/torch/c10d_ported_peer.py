"""One process of test_c10d_ported.py's ``init_process_group`` runs: every ported case but the
``*_stress`` ones (test_c10d_ported.py runs those with ``group=pg``), in order, with the default
group ``torch.distributed.init_process_group("pccl")`` made.

    python c10d_ported_peer.py MASTER WORLD RANK STORE_FILE PEER_GROUP [MODULE [CASES]]

MODULE: the test module whose ``CASES`` run (test_c10d_ported by default; test_c10d_ported_p2p);
CASES: the name of another dict of that module to run instead (``WORLD1_CASES``).

Prints one JSON line: ``{"rank", "world", "backend", "cases": {name: "ok" or the traceback}}``;
at the first case that fails, prints the cases so far and exits with status 1.
"""

from __future__ import annotations

import datetime
import importlib
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group

import pccl.torch


def main() -> None:
    warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced & co. are deprecated names
    # The peers of a world share the machine's cores: torch's intra-op pool in every process
    # oversubscribed them (3 peers on 2 loaded cores: a (6, 2) Linear's forward took 22 ms, and
    # distributed_test's post-localSGD parity 21 s instead of 2.5, on gloo as on pccl).
    torch.set_num_threads(1)
    master, world, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    store_file, peer_group = sys.argv[4], sys.argv[5]
    module = importlib.import_module(sys.argv[6] if len(sys.argv) > 6 else "test_c10d_ported")
    cases = getattr(module, sys.argv[7] if len(sys.argv) > 7 else "CASES")
    os.environ["PCCL_MASTER"], os.environ["PCCL_PEER_GROUP"] = master, peer_group
    pccl.torch.register()
    dist.init_process_group("pccl", store=dist.FileStore(store_file, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    pg = _get_default_group()
    report = {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": dist.get_backend(), "cases": {}}
    for name, case in cases.items():
        if name.endswith("_stress"):
            continue  # run with group=pg only (test_c10d_ported.py): the same calls, seconds more
        try:
            case(pg, pg.rank(), pg.size())
            report["cases"][name] = "ok"
        except BaseException:  # noqa: BLE001 - reported to the test
            report["cases"][name] = traceback.format_exc()
            # The others may wait for this process in a collective of the failed case: stop
            # here (run_peer_processes then kills them and shows this report).
            print(json.dumps(report), flush=True)
            sys.stderr.flush()
            os._exit(1)
    dist.destroy_process_group()
    # test_c10d_common.py::PythonProcessGroupExtensionTest.test_shutdown: destroy_process_group
    # shuts the group down
    report["closed_after_destroy"] = pg.closed
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
