#!/usr/bin/env bash
# One device call's driver, ON the GPU machine (not here: it would unpack .gpu/bin beside
# .gpu/p.tgz, and the carry would no longer fit): unpacks .gpu/p.tgz (if there), then runs
# the stages listed in a stage file, in order, each while enough of the call's time is left,
# and after EVERY stage packs all logs into $OUT/logs.tgz, so that a call cut short (the device
# budget left is less than timeout_s, or a stage hangs) still brings back what ran before.
#
# usage: [DL=SECONDS] bash scripts/gpu-call.sh STAGE_FILE
#   DL          seconds this script may take in all (default 560; set it below the call's
#               timeout_s and below the budget that `status` reports, less ~20 s)
#   STAGE_FILE  one stage per line: NAME MIN_SECONDS COMMAND...
#               NAME         the stage's log folder ($OUT/r/NAME; its stdout+stderr in
#                            $OUT/r/NAME.txt); also exported to the command as $OUT
#               MIN_SECONDS  skip the stage when fewer seconds are left than this
#               COMMAND      run by bash under `timeout` (the seconds left); it sees
#                            $LEFT (those seconds) and $GPU (nvidia-smi's name)
#               Lines starting with '#' and empty lines are ignored; a line may end with
#               '\' to continue on the next. Put the stages in the order they matter.
# Example stage file (docs/DEVELOPING.md "Running on the GPU machine" has more):
#   grid      30  MLA_DEADLINE_S=$LEFT MLA_BENCH_ARGS=--check bash scripts/gpu-run.sh bench
#   plumbing  60  MLA_DEADLINE_S=$LEFT MLA_TEST_ARGS=plumbing:: bash scripts/gpu-run.sh tests
#   ab        60  [[ $GPU == *H200* ]] && MLA_AB="-|MLA_FORM=1" bash scripts/gpu-ab.sh --case sparse:t=32,h=8
#   tests    200  MLA_DEADLINE_S=$LEFT bash scripts/gpu-run.sh tests
#   sanitize  50  MLA_DEADLINE_S=$LEFT bash scripts/gpu-run.sh sanitize
# Comes back: $OUT/logs.tgz (every stage's folder and log, gpu.txt with the card, clocks and
# each stage's start, end and exit status).
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
stages=${1:?usage: DL=SECONDS bash scripts/gpu-call.sh STAGE_FILE}
[[ -r $stages ]] || { echo "gpu-call: no stage file $stages" >&2; exit 1; }
OUT=${OUT:?gpu-call: OUT is not set (the device tool sets it)}
DL=${DL:-560}
t0=$SECONDS
mkdir -p "$OUT/r"
info=$OUT/r/gpu.txt
if [[ -f .gpu/p.tgz ]]; then tar xzf .gpu/p.tgz -C .gpu || echo "gpu-call: unpacking .gpu/p.tgz failed" >>"$info"; fi
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv >>"$info" 2>&1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
export GPU
echo "gpu: ${GPU:-none}; deadline ${DL} s" | tee -a "$info"
pack() {
    tar czf "$OUT/logs.tgz.tmp" -C "$OUT/r" . && mv "$OUT/logs.tgz.tmp" "$OUT/logs.tgz"
}
pack
line=""
while IFS= read -r raw || [[ -n $raw ]]; do
    if [[ $raw == *\\ ]]; then line+="${raw%\\} "; continue; fi
    line+=$raw
    read -r name min cmd <<<"$line"
    line=""
    [[ -z ${name:-} || $name == \#* ]] && continue
    left=$((DL - (SECONDS - t0)))
    if ((left < min || left < 1)); then
        echo "[$((SECONDS - t0)) s] $name: skipped ($left s left, needs $min)" | tee -a "$info"
        continue
    fi
    echo "[$((SECONDS - t0)) s] $name: start ($left s left)" | tee -a "$info"
    mkdir -p "$OUT/r/$name"
    OUT="$OUT/r/$name" LEFT=$left timeout "$left" bash -c "$cmd" >"$OUT/r/$name.txt" 2>&1 </dev/null
    rc=$?
    echo "[$((SECONDS - t0)) s] $name: exit $rc" | tee -a "$info"
    pack
done <"$stages"
echo "[$((SECONDS - t0)) s] all stages done" | tee -a "$info"
pack
