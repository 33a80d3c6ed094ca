#!/usr/bin/env bash
# Side-by-side all-reduce run: PCCL 1.0, Gloo and this repository's pccl, in one run of
# ../shared/bench's harness (its setup, its quiet-machine waits, its report).  Results and
# tables land in $RESULTS (default /tmp/anchors_results_pccl).
#   bash benchmarks/shared_bench/run_with_pccl.sh                     # N=2,3,4; 16K..256M; ~15 min
#   PEERS=2 SIZES=0.015625,64 QUANT=none bash benchmarks/shared_bench/run_with_pccl.sh   # quicker
#   ROUNDS=2 ...   repeat the interleaved steps; each row keeps its best median (foreign load on a
#                  shared machine only ever slows a step down, so best-of-rounds is the fairest)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
SHARED="${PCCL_SHARED_BENCH:-$(cd "$REPO/../shared/bench" && pwd)}"
R=${RESULTS:-/tmp/anchors_results_pccl}
PEERS=${PEERS:-2,3,4}
SIZES=${SIZES:-0.015625,1,16,64,256}
QUANT=${QUANT:-none,minmax_u8}
SC=${SC:-1.0}
ROUNDS=${ROUNDS:-1}   # >1: every step is repeated; each row keeps its best (smallest) median
PY=${PCCL_PYTHON:-$REPO/.venv/bin/python}
mkdir -p "$R/logs"
cd /tmp  # setup_envs.sh finds PCCL 1.0 by importing "pccl": not from a directory holding ours
bash "$SHARED/setup_envs.sh"
FAILED=""
step() {  # step NAME OUTFILE_MD CMD...   (as in run_all.sh: wait for a quiet machine, keep going on failure)
  local name=$1 md=$2; shift 2
  echo "== $name"
  python3 "$SHARED/cpu_monitor.py" wait-quiet --root-pid $$ --quiet-s 3 --max-wait "${QUIET_MAX:-120}" || true
  if ! "$@" | tee "$md"; then FAILED="$FAILED [$name]"; echo "!! step failed: $name"; fi
}
echo "== load before start: $(cat /proc/loadavg)" | tee "$R/loadavg.txt"
# The three implementations interleaved per group size, so that each N is measured by all three
# under the same machine conditions.
for r in $(seq 1 "$ROUNDS"); do
for n in ${PEERS//,/ }; do
  step "gloo N=$n round $r" "$R/gloo_N${n}_r$r.md" /tmp/torch311/bin/python "$SHARED/gloo_bench.py" --peers "$n" \
    --sizes-mib "$SIZES" --conc 1 --iters-scale "$SC" --logdir "$R/logs" --out "$R/gloo_N${n}_r$r.json"
  step "pccl N=$n round $r" "$R/pccl_N${n}_r$r.md" /tmp/pccl312/bin/python "$SHARED/pccl_bench.py" --peers "$n" \
    --sizes-mib "$SIZES" --quant "$QUANT" --conc 1 --iters-scale "$SC" --logdir "$R/logs" --out "$R/pccl_N${n}_r$r.json"
  step "pccl-trio N=$n round $r" "$R/pccl_trio_N${n}_r$r.md" "$PY" "$HERE/pccl_trio_bench.py" --peers "$n" \
    --sizes-mib "$SIZES" --quant "$QUANT" --conc 1 --iters-scale "$SC" --logdir "$R/logs" --out "$R/pccl_trio_N${n}_r$r.json"
  step "pccl-trio out of place N=$n round $r" "$R/pccl_trio_oop_N${n}_r$r.md" "$PY" "$HERE/pccl_trio_bench.py" --peers "$n" \
    --sizes-mib "$SIZES" --quant "$QUANT" --conc 1 --iters-scale "$SC" --logdir "$R/logs" --out-of-place \
    --out "$R/pccl_trio_oop_N${n}_r$r.json"
done
done
echo "== load at end: $(cat /proc/loadavg)" | tee -a "$R/loadavg.txt"
# report.py reads pccl.json / gloo.json by name: merge the per-N (and per-round) files into
# those, keeping per configuration the round with the smallest median.
python3 - "$R" <<'PY'
import glob, json, os, sys
d = sys.argv[1]
for stem in ("gloo", "pccl", "pccl_trio", "pccl_trio_oop"):
    merged, best = None, {}
    for p in sorted(glob.glob(os.path.join(d, f"{stem}_N*_r*.json"))):
        e = json.load(open(p))
        merged = merged or e
        for row in e["rows"]:
            key = (row["impl"], row["cfg"], row["N"], row["bytes"])
            if key not in best or row["stats"]["median"] < best[key]["stats"]["median"]:
                best[key] = row
        os.rename(p, p + ".part")
    if merged is not None:
        merged["rows"] = list(best.values())
        json.dump(merged, open(os.path.join(d, f"{stem}.json"), "w"), indent=1)
PY
python3 "$SHARED/report.py" --dir "$R" > "$R/tables.md" || FAILED="$FAILED [report]"
python3 - "$R" <<'PY'
# Side-by-side busbw table: pccl-trio vs the better of PCCL 1.0 and Gloo.
import json, os, sys
d = sys.argv[1]
rows = []
for name in ("pccl.json", "gloo.json", "pccl_trio.json", "pccl_trio_oop.json"):
    p = os.path.join(d, name)
    if os.path.exists(p):
        rows += json.load(open(p))["rows"]
def kind(r):
    if "pccl-trio" in r["impl"]:
        return "ours_oop" if "out of place" in r["cfg"] else "ours"
    return "gloo" if "gloo" in r["impl"].lower() else "pccl"
table = {}
for r in rows:
    q = "u8" if "minmax" in r["cfg"] else "plain"
    if "concurrent" in r["cfg"] or "diagnostic" in r["cfg"]:
        continue
    t = r["stats"]["median"]
    bus = r["bytes"] / t * 2 * (r["N"] - 1) / r["N"] / 1e9
    table[(q, r["N"], r["bytes"], kind(r))] = (t, bus)
print("busbw GB/s (median over iterations of the slowest rank; best round).  PCCL 1.0's bench is out of place,")
print("Gloo's in place (without restorability); pccl-trio is shown both ways.\n")
print("| quant | N | size | PCCL 1.0 | Gloo | pccl-trio in place | / best | pccl-trio out of place | / best | PCCL ms | Gloo ms | in place ms | out of place ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for q, n, b in sorted({k[:3] for k in table}):
    g = lambda k: table.get((q, n, b, k))
    cells = [g("pccl"), g("gloo"), g("ours"), g("ours_oop")]
    best = max((c[1] for c in cells[:2] if c), default=None)
    ratio = [f"{c[1] / best:.2f}" if c and best else "-" for c in cells[2:]]
    size = f"{b / 2**20:g} MiB" if b >= 2**20 else f"{b / 1024:g} KiB"
    bw = ["-" if c is None else f"{c[1]:.3g}" for c in cells]
    ms = ["-" if c is None else f"{c[0] * 1e3:.3g}" for c in cells]
    print(f"| {q} | {n} | {size} | {bw[0]} | {bw[1]} | {bw[2]} | {ratio[0]} | {bw[3]} | {ratio[1]} | "
          f"{ms[0]} | {ms[1]} | {ms[2]} | {ms[3]} |")
PY
echo "tables: $R/tables.md"
if [ -n "$FAILED" ]; then echo "FAILED steps:$FAILED"; exit 1; fi
