"""``pccl bench`` from two checkouts of pccl, side by side in one run: is a change a regression?

    python benchmarks/ab_revisions.py --base ../base-checkout --new . --rounds 3 --each-size 16K 64M 256M -- \\
        --peers 2 3 --collective all_reduce broadcast all_gather reduce_scatter

Each checkout is a directory holding pccl's source with its own ``.venv`` (``python -m venv .venv
&& .venv/bin/pip install -e .``: the kernel is built per checkout).  Every round runs the same
``pccl bench`` arguments once in each checkout, the order alternating from round to round, so the
machine's drift (this is a shared, noisy machine) hits both alike; ``--each-size`` runs one size
at a time (``--sizes S``), alternating checkouts size by size, so that a burst of load meets
both sides within a minute rather than one side's whole run.  The table pools the rounds'
iterations per row (collective, N, size, quant, concurrency): median and minimum per checkout and
the ratio base/new of each (above 1: the new checkout is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from pccl.tools.bench import COLLECTIVES, format_size

Key = tuple[str, int, int, str, int]


def run_bench(checkout: str, bench_args: list[str], out: str) -> list[dict[str, Any]]:
    python = os.path.join(checkout, ".venv", "bin", "python")
    if not os.path.exists(python):
        raise SystemExit(f"{checkout}: no .venv/bin/python (python -m venv .venv && .venv/bin/pip install -e .)")
    command = [python, "-m", "pccl", "bench", *bench_args, "--json", out]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(command)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    with open(out) as f:
        rows: list[dict[str, Any]] = json.load(f)
    return rows


def key_of(row: dict[str, Any]) -> Key:
    return (row.get("collective", "all_reduce"), row["N"], row["bytes"], row["quant"], row["conc"])


def format_table(pooled: dict[str, dict[Key, list[float]]]) -> str:
    lines = [f"{'collective':>14} {'N':>3} {'size':>8} {'quant':>5} {'conc':>4} {'base med ms':>12} "
             f"{'new med ms':>11} {'base min ms':>12} {'new min ms':>11} {'med b/n':>8} {'min b/n':>8}"]
    order = {c: i for i, c in enumerate(COLLECTIVES)}
    for key in sorted(pooled["base"], key=lambda k: (k[1], order.get(k[0], len(order)), k[2], k[3], k[4])):
        base, new = pooled["base"][key], pooled["new"].get(key)
        if not new:
            continue
        collective, n, nbytes, quant, conc = key
        bm, nm = statistics.median(base), statistics.median(new)
        lines.append(f"{collective:>14} {n:>3} {format_size(nbytes):>8} {quant:>5} {conc:>4} {bm * 1e3:>12.3f} "
                     f"{nm * 1e3:>11.3f} {min(base) * 1e3:>12.3f} {min(new) * 1e3:>11.3f} "
                     f"{bm / nm:>8.3f} {min(base) / min(new):>8.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the checkout to compare against")
    parser.add_argument("--new", required=True, help="the checkout under test")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--each-size", nargs="+", default=[None],
                        help="run each of these sizes on its own (pccl bench --sizes S), alternating checkouts")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then pccl bench's arguments")
    args = parser.parse_args(argv)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    checkouts = {"base": os.path.abspath(args.base), "new": os.path.abspath(args.new)}
    pooled: dict[str, dict[Key, list[float]]] = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory(prefix="pccl-ab-") as tmp:
        for r in range(args.rounds):
            for k, size in enumerate(args.each_size):
                order = ["base", "new"] if (r + k) % 2 == 0 else ["new", "base"]
                sized = bench_args if size is None else [*bench_args, "--sizes", size]
                for which in order:
                    rows = run_bench(checkouts[which], sized, os.path.join(tmp, f"{which}-{r}-{k}.json"))
                    for row in rows:
                        pooled[which].setdefault(key_of(row), []).extend(row["times"])
                print(f"# round {r + 1}/{args.rounds}, size {size or 'all'}: done", file=sys.stderr, flush=True)
    sizes = "" if args.each_size == [None] else f" --sizes {{{','.join(args.each_size)}}} one at a time"
    print(f"# pccl bench {' '.join(bench_args)}{sizes}; {args.rounds} rounds, alternating; base {checkouts['base']}, "
          f"new {checkouts['new']}")
    print(format_table(pooled))
    return 0


if __name__ == "__main__":
    sys.exit(main())
