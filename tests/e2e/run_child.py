"""A copy started by ``pccl run`` in tests/e2e/test_pccl_run.py: reports its environment and pid,
then behaves as its arguments say.

    run_child.py [--fail-rank R] [--sleep SECONDS] [--pid-dir DIR]

It prints ``env PCCL_MASTER PCCL_TOKEN RANK WORLD_SIZE`` to stdout and ``stderr line`` to stderr;
copy ``R`` exits with status 3 at once; the others sleep, then print ``bye``.  With
``--pid-dir``, each copy writes its pid to ``DIR/RANK`` first (through a rename, so a reader never
sees the file empty).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=-1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--pid-dir")
args = parser.parse_args()
rank = int(os.environ["RANK"])
if args.pid_dir:
    partial = pathlib.Path(args.pid_dir, f".{rank}.partial")
    partial.write_text(str(os.getpid()))
    partial.rename(pathlib.Path(args.pid_dir, str(rank)))
print("env", *(os.environ.get(k, "-") for k in ("PCCL_MASTER", "PCCL_TOKEN", "RANK", "WORLD_SIZE")), flush=True)
print("stderr line", file=sys.stderr, flush=True)
if rank == args.fail_rank:
    sys.exit(3)
time.sleep(args.sleep)
print("bye", flush=True)
