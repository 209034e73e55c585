#!/usr/bin/env bash
# A/B of schedule knobs ON the GPU machine, in one device call: runs .gpu/bin/bench-decode
# once per (repetition, setting), settings interleaved so that drift hits them alike (their
# order rotated per repetition), and prints one table: median µs per case and setting, each
# repetition's value beside it.
#
# usage: MLA_AB="MLA_WARPS=4|MLA_WARPS=8" [MLA_AB_REPS=2] bash scripts/gpu-ab.sh BENCH_ARGS...
#   MLA_AB       settings separated by '|'; each is a space-separated list of VAR=VALUE
#                exported for that run ('-' alone: no variable); MLA_AB_BIN=PATH runs
#                another bench build (e.g. the previous commit's, copied under .gpu/).
#                The bench turns MLA_WARPS, MLA_BLOCK_M, MLA_PDL, MLA_COMBINE_SLICES,
#                MLA_MIN_CHUNK, MLA_SPLIT, MLA_PATH and MLA_FORM into the plan's Tuning (benches/common/gpu.rs); the library
#                itself reads no environment variable.
#   BENCH_ARGS   passed to bench-decode, e.g. --case dense:b=1,h=8,l=4096 --sm120-occupancy off
# Writes $OUT/ab.log (every run's output) and $OUT/ab.txt (the table, then the rows where setting
# [0] is more than MLA_AB_GAP % (default 3) slower than the best setting or than its own
# sm120-occupancy twin: a knob sweep's schedule gaps).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
OUT=${OUT:-$root/.gpu/out}
mkdir -p "$OUT"
IFS='|' read -r -a settings <<<"${MLA_AB:?set MLA_AB, e.g. MLA_AB=\"MLA_WARPS=4|MLA_WARPS=8\"}"
reps=${MLA_AB_REPS:-2}
tmp=$(mktemp -d)
: >"$OUT/ab.log"
n=${#settings[@]}
for ((r = 0; r < reps; ++r)); do
    # rotate the order per repetition (setting r mod n first): on small steps the same kernels
    # measured up to 0.3 us apart by their position in the repetition (log #118)
    for ((k = 0; k < n; ++k)); do
        i=$(((k + r) % n))
        s=${settings[$i]}
        read -r -a vars <<<"$s"
        [[ ${vars[0]:-} == - ]] && vars=()
        echo "==== rep $r setting [$s] ====" | tee -a "$OUT/ab.log"
        bin=.gpu/bin/bench-decode
        for v in "${vars[@]}"; do [[ $v == MLA_AB_BIN=* ]] && bin=${v#MLA_AB_BIN=}; done
        env "${vars[@]}" timeout 300 "$bin" --bench --json "$tmp/$r-$i.json" "$@" \
            >>"$OUT/ab.log" 2>&1 || echo "  exit $? (see ab.log)" | tee -a "$OUT/ab.log"
    done
done
python3 - "$tmp" "$reps" "${settings[@]}" <<'EOF' | tee "$OUT/ab.txt"
import json, os, statistics, sys
tmp, reps, settings = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}  # name -> setting index -> [us per rep]
copy = []
for r in range(reps):
    for i in range(len(settings)):
        p = os.path.join(tmp, f"{r}-{i}.json")
        if not os.path.exists(p):
            continue
        d = json.load(open(p))
        copy.append(d["copy_gbps"])
        for row in d["rows"]:
            rows.setdefault(row["name"], {}).setdefault(i, []).append(row["us"])
            if row.get("graph_us"):
                rows.setdefault(row["name"] + " (graph)", {}).setdefault(i, []).append(row["graph_us"])
print(f"copy GB/s over runs: {min(copy):.0f}-{max(copy):.0f}" if copy else "no runs")
for i, s in enumerate(settings):
    print(f"  [{i}] {s}")
w = max([len(n) for n in rows] + [4])
print(f"{'case':<{w}} " + " ".join(f"{'[' + str(i) + '] us':>22}" for i in range(len(settings))))
for n, per in rows.items():
    cells = []
    for i in range(len(settings)):
        v = per.get(i, [])
        cells.append(f"{statistics.median(v):8.2f} ({'/'.join(f'{x:.1f}' for x in v)})" if v else "-")
    print(f"{n:<{w}} " + " ".join(f"{c:>22}" for c in cells))
# Gaps: rows where setting [0] (the default, in a knob sweep) is slower than the best setting by
# more than MLA_AB_GAP percent (default 3), and rows whose [0] is slower than its own
# sm120-occupancy twin's [0] by as much (the twin runs the default's configuration at one CTA per
# SM): where the schedule leaves time on the table (docs/wip/device-sessions.md, "Session 20").
gap = float(os.environ.get("MLA_AB_GAP", "3"))
med = {n: {i: statistics.median(v) for i, v in per.items() if v} for n, per in rows.items()}
lines = []
for n, m in med.items():
    if 0 not in m or len(m) < 2:
        continue
    best = min(m, key=m.get)
    if m[0] > m[best] * (1 + gap / 100):
        lines.append(f"  {n}: [0] {m[0]:.2f} us, [{best}] {m[best]:.2f} us ({100 * (m[best] / m[0] - 1):+.1f} %)")
for n, m in med.items():
    twin = n.replace(" (graph)", "")
    twin = twin + " [sm120-occ]" + (" (graph)" if n.endswith(" (graph)") else "")
    if "[sm120-occ]" in n or twin not in med or 0 not in m or 0 not in med[twin]:
        continue
    if m[0] > med[twin][0] * (1 + gap / 100):
        lines.append(f"  {n}: [0] {m[0]:.2f} us, its sm120-occupancy twin {med[twin][0]:.2f} us")
print(f"gaps over {gap:g} %:" + ("" if lines else " none"))
for line in lines:
    print(line)
EOF
rm -rf "$tmp"
