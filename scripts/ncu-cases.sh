#!/usr/bin/env bash
# ON the GPU machine: profiles one decode-kernel launch per case with Nsight Compute (source
# counters, instruction stats, warp states, speed of light) and exports, per case, the
# per-instruction source table (cuda + sass, for scripts/ncu-source.py) and the details page,
# all packed into $OUT/ncu-cases.tar.gz (one file back from $OUT).
#
# usage: bash scripts/ncu-cases.sh CASE...   (bench case grammar, e.g.
#        sparse:t=128,h=16,k=2048,dtype=bf16,kv=fp8_ds_mla,pool=131072)
# env:   MLA_NCU_KERNEL (regex, default decode_kernel), MLA_NCU_PROFILE (default
#        .gpu/bin/example-profile), MLA_NCU_EXTRA (more ncu arguments, e.g. --sm120-occupancy
#        goes to the profile example through MLA_NCU_PROFILE_ARGS)
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
OUT=${OUT:-$root/.gpu/out}
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
[[ -x $ncu ]] || { echo "ncu-cases: no ncu" >&2; exit 1; }
work=$(mktemp -d)
i=0
for c in "$@"; do
    i=$((i + 1))
    echo "== case $i: $c" | tee -a "$work/cases.txt"
    "$ncu" --clock-control none --import-source yes \
        --section SourceCounters --section InstructionStats --section WarpStateStats \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
        -k "regex:${MLA_NCU_KERNEL:-decode_kernel}" --launch-skip 1 --launch-count 1 -f -o "$work/p$i" \
        "${MLA_NCU_PROFILE:-.gpu/bin/example-profile}" --case "$c" --iters 3 ${MLA_NCU_PROFILE_ARGS:-} \
        >"$work/p$i.log" 2>&1 || echo "ncu-cases: case $i failed (p$i.log)" | tee -a "$work/cases.txt"
    if [[ -f $work/p$i.ncu-rep ]]; then
        "$ncu" -i "$work/p$i.ncu-rep" --page source --csv --print-source cuda,sass >"$work/p$i.csv" 2>&1
        "$ncu" -i "$work/p$i.ncu-rep" --page details --print-units base >"$work/p$i.details.txt" 2>&1
        rm -f "$work/p$i.ncu-rep"
    fi
done
tar -C "$work" -czf "$OUT/ncu-cases.tar.gz" .
ls -la "$work"
rm -rf "$work"
