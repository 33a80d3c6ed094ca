#!/usr/bin/env python3
"""All-reduce benchmark of this repository's pccl (pccl-trio) for ``../shared/bench``.

The same command line and JSON output as ``../shared/bench/pccl_bench.py`` (PCCL 1.0): a master
plus N peer processes on 127.0.0.1, each all-reducing float32 buffers of the given sizes in place;
per iteration the max over ranks, then the median (``anchor_common.summarize``).  ``report.py``
picks the output file up as an extra implementation.  Run it with the repository's venv:

  .venv/bin/python benchmarks/shared_bench/pccl_trio_bench.py --peers 2,3,4 --sizes-mib 1,16,64,256 \\
      --out /tmp/anchors_results/pccl_trio.json

``--out-of-place`` (an addition) reduces into a separate array, as ``pccl_bench.py`` does for PCCL
1.0; the default is in place, as Gloo's bench and the README ask.  Rows are labelled ``impl = "pccl-trio <version>"`` and ``cfg = "plain (pccl-trio)"`` /
``"minmax_u8 (pccl-trio)"``: the parenthesis keeps them out of report.py's model table, whose
PCCL column is keyed on impl names containing "pccl".  Options PCCL-specific to the reference
(``--pool``, ``--master-nodelay``) are accepted and ignored (pccl-trio always sets TCP_NODELAY).
The measuring itself is :func:`pccl.tools.bench.run_group` (``pccl bench``).
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SHARED = os.environ.get("PCCL_SHARED_BENCH", os.path.join(os.path.dirname(REPO), "shared", "bench"))
sys.path.insert(0, SHARED)
sys.path.insert(0, REPO)
from anchor_common import MiB, allreduce_table, env_info, save_json, summarize  # noqa: E402

import pccl  # noqa: E402
from pccl.tools.bench import run_group  # noqa: E402

_QUANT = {"none": "none", "minmax_u8": "u8"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default="2,3,4")
    ap.add_argument("--sizes-mib", default="1,16,64,256")
    ap.add_argument("--quant", default="none,minmax_u8", help="comma list of none,minmax_u8")
    ap.add_argument("--conc", default="1", help="comma list: concurrent all-reduces a tensor is split into")
    ap.add_argument("--pool", type=int, default=0, help="ignored (PCCL 1.0's p2p_connection_pool_size)")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--master-nodelay", action="store_true", help="ignored (pccl-trio always uses TCP_NODELAY)")
    ap.add_argument("--out-of-place", action="store_true",
                    help="reduce into a separate array, as pccl_bench.py does for PCCL 1.0 (default: in place, "
                         "which includes the input backup that makes an aborted op restorable)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--logdir", default="/tmp/anchors_results/logs")
    ap.add_argument("--out", default="/tmp/anchors_results/pccl_trio.json")
    a = ap.parse_args()
    sizes = [int(float(x) * MiB) for x in a.sizes_mib.split(",")]
    quants = a.quant.split(",")
    concs = [int(x) for x in a.conc.split(",")]
    impl = f"pccl-trio {pccl.__version__}"
    info = env_info()
    allrows = []
    for n in [int(x) for x in a.peers.split(",")]:
        group = run_group(n, sizes=sizes, quant=[_QUANT[q] for q in quants], concurrency=concs,
                          iters_scale=a.iters_scale, timeout=a.timeout, logdir=a.logdir, out_of_place=a.out_of_place)
        for r in group:
            qname = next(k for k, v in _QUANT.items() if v == r["quant"])
            cfg = ("plain" if qname == "none" else qname) + (", out of place" if a.out_of_place else "") + " (pccl-trio)"
            if r["conc"] > 1:
                cfg += f", {r['conc']} concurrent chunks"
            allrows.append({"impl": impl, "cfg": cfg, "N": n, "bytes": r["bytes"], "stats": summarize(r["times"]),
                            "max_rel_err": r["max_rel_err"], "per_rank_times": r["per_rank_times"]})
        print(f"N={n} done", file=sys.stderr, flush=True)
        save_json(a.out, {"env": info, "args": vars(a), "rows": allrows})
    where = "out of place" if a.out_of_place else "in place"
    print(allreduce_table(allrows, f"{impl} all-reduce (SUM, float32, {where})"))


if __name__ == "__main__":
    main()
