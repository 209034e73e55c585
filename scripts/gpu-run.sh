#!/usr/bin/env bash
# Runs, ON the GPU machine (repo root, no cargo there), what scripts/gpu-build.sh built here
# into .gpu/bin/. One device call: carry [".gpu"], command `bash scripts/gpu-run.sh all`.
#
# usage: bash scripts/gpu-run.sh [MODE...]     (default: all)
#   tests     every .gpu/bin/test-* with --include-ignored --test-threads=1    -> $OUT/tests.log
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over the GPU tests whose
#             name contains $MLA_SANITIZE_FILTER (default sanitize_)             -> $OUT/sanitizer.log
#   bench     .gpu/bin/bench-decode --bench --json $OUT/bench.json $MLA_BENCH_ARGS -> $OUT/bench.log
#   ncu       ncu --clock-control none --set full on .gpu/bin/example-profile
#             --case $MLA_PROFILE_CASE --iters $MLA_PROFILE_ITERS  -> $OUT/profile.ncu-rep, $OUT/ncu.txt
#   all       tests sanitize bench
# Every step is bounded by `timeout`; a failing step does not stop the next; the exit status
# is non-zero when any step failed, timed out or was skipped. The last lines printed are a
# summary (pass/fail per step), also in $OUT/summary.txt. At most 7 files go under $OUT.
#
# env (all optional):
#   MLA_DEADLINE_S        seconds the whole run may take (default 570, inside the 600 s call)
#   MLA_TIMEOUT_TESTS     per-step caps in seconds (defaults 330 / 300 / 300 / 300), each also
#   MLA_TIMEOUT_SANITIZE  cut to what is left of the deadline
#   MLA_TIMEOUT_BENCH
#   MLA_TIMEOUT_NCU
#   MLA_TEST_ARGS         extra libtest arguments (e.g. a filter) for `tests`
#   MLA_SANITIZE_FILTER   test-name filter for `sanitize` (default sanitize_)
#   MLA_SANITIZE_TOOLS    compute-sanitizer tools (default "memcheck racecheck synccheck")
#   MLA_BENCH_ARGS        extra bench arguments (e.g. --filter sparse --check)
#   MLA_PROFILE_CASE      case for `ncu` (default sparse:t=128,h=8,k=2048,dtype=bf16)
#   MLA_PROFILE_ITERS     iterations of the profile example under ncu (default 3)
#   MLA_NCU_ARGS          extra ncu arguments (default --launch-count 12)
#   MLA_NCU_TARGET        another command line to profile instead of example-profile
#                         (e.g. ".gpu/bin/test-gpu --include-ignored dense::")
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 1
export PYTHONUNBUFFERED=1 RUST_BACKTRACE=${RUST_BACKTRACE:-1}
OUT=${OUT:-$root/.gpu/out}
mkdir -p "$OUT"
BIN=.gpu/bin
t_start=$SECONDS
deadline=${MLA_DEADLINE_S:-570}

# line-buffer tools written in C/C++ when their output goes into a pipe
unbuf() { if command -v stdbuf >/dev/null 2>&1; then stdbuf -oL -eL "$@"; else "$@"; fi; }
log() { printf '[gpu-run %4ds] %s\n' "$((SECONDS - t_start))" "$*"; }

# find_tool NAME GLOB...: PATH first, then the usual CUDA/Nsight places.
find_tool() {
    local name=$1 c
    shift
    c=$(command -v "$name" 2>/dev/null) && { echo "$c"; return 0; }
    for c in "$@"; do
        [[ -x $c ]] && { echo "$c"; return 0; }
    done
    return 1
}

# budget CAP: seconds the next step may take (cap, cut to the deadline); 0 = no time left.
budget() {
    local left=$((deadline - (SECONDS - t_start) - 10))
    ((left < 20)) && { echo 0; return; }
    ((left < $1)) && { echo "$left"; return; }
    echo "$1"
}

# run_to LOG FILTER SECS CMD...: runs CMD under timeout, appends everything to LOG and shows
# on stdout the lines matching FILTER (all lines when FILTER is empty). Returns CMD's status
# (124 on timeout).
run_to() {
    local logf=$1 filt=$2 secs=$3
    shift 3
    echo "\$ $*" >>"$logf"
    if [[ -z $filt ]]; then
        unbuf timeout --kill-after=15 "$secs" "$@" 2>&1 | tee -a "$logf"
    else
        unbuf timeout --kill-after=15 "$secs" "$@" 2>&1 | tee -a "$logf" | grep --line-buffered -E "$filt"
    fi
    return "${PIPESTATUS[0]}"
}

declare -a res_names=() res_states=() res_secs=()
record() { # NAME STATE SECS
    res_names+=("$1")
    res_states+=("$2")
    res_secs+=("$3")
    log "$1: $2 (${3}s)"
}
state_of() { # exit status -> word
    case $1 in
    0) echo pass ;;
    124 | 137) echo TIMEOUT ;;
    *) echo "FAIL (exit $1)" ;;
    esac
}

test_bins() {
    shopt -s nullglob
    local f
    for f in "$BIN"/test-*; do [[ -x $f ]] && echo "$f"; done
    shopt -u nullglob
}

# ---- steps ------------------------------------------------------------------------------
step_tests() {
    local logf=$OUT/tests.log t0=$SECONDS rc=0 r b secs
    local -a bins extra
    mapfile -t bins < <(test_bins)
    read -r -a extra <<<"${MLA_TEST_ARGS:-}"
    ((${#bins[@]})) || { log "tests: no $BIN/test-*"; record tests "FAIL (no test binaries)" 0; return; }
    : >"$logf"
    for b in "${bins[@]}"; do
        secs=$(budget $((${MLA_TIMEOUT_TESTS:-330} - (SECONDS - t0))))
        if ((secs == 0)); then
            log "tests: no time left for $b"
            rc=124
            break
        fi
        log "tests: $b (timeout ${secs}s)"
        r=0
        run_to "$logf" '^test result|FAILED|panicked|^failures:|^    [A-Za-z_:0-9]+$|[Ee]rror: |SKIPPED' "$secs" \
            "$b" --include-ignored --test-threads=1 "${extra[@]}" || r=$?
        ((r != 0)) && { log "tests: $b: $(state_of "$r")"; ((rc == 0)) && rc=$r; }
    done
    record tests "$(state_of "$rc")" $((SECONDS - t0))
}

step_sanitize() {
    local logf=$OUT/sanitizer.log t0=$SECONDS rc=0 r b tool secs cs n filter
    local -a bins tools
    filter=${MLA_SANITIZE_FILTER:-sanitize_}
    read -r -a tools <<<"${MLA_SANITIZE_TOOLS:-memcheck racecheck synccheck}"
    : >"$logf"
    if ! cs=$(find_tool compute-sanitizer /usr/local/cuda/bin/compute-sanitizer \
        /usr/local/cuda/compute-sanitizer/compute-sanitizer /opt/nvidia/compute-sanitizer/compute-sanitizer); then
        log "sanitize: no compute-sanitizer"
        record sanitize "FAIL (no compute-sanitizer)" 0
        return
    fi
    mapfile -t bins < <(test_bins)
    local ran=0
    for tool in "${tools[@]}"; do
        for b in "${bins[@]}"; do
            n=$("$b" --list --include-ignored "$filter" 2>/dev/null | grep -c ': test$')
            ((n > 0)) || continue
            secs=$(budget $((${MLA_TIMEOUT_SANITIZE:-300} - (SECONDS - t0))))
            if ((secs == 0)); then
                log "sanitize: no time left for $tool on $b"
                rc=124
                break 2
            fi
            log "sanitize: $tool on $b, $n test(s) matching '$filter' (timeout ${secs}s)"
            r=0
            run_to "$logf" '^test result|FAILED|panicked|ERROR SUMMARY|RACECHECK SUMMARY|SYNCCHECK SUMMARY|Invalid|Race|Error' "$secs" \
                "$cs" --tool "$tool" --error-exitcode 86 --print-limit 20 \
                "$b" --include-ignored --test-threads=1 "$filter" || r=$?
            ran=$((ran + 1))
            ((r != 0)) && { log "sanitize: $tool on $b: $(state_of "$r")"; ((rc == 0)) && rc=$r; }
        done
    done
    # belt and braces: any reported error counts, whatever the exit status said
    if grep -Eq 'ERROR SUMMARY: [1-9]|(RACECHECK|SYNCCHECK) SUMMARY: .*[1-9][0-9]* error' "$logf" && ((rc == 0)); then
        rc=86
    fi
    if ((ran == 0)); then
        log "sanitize: no test name contains '$filter'"
        record sanitize "FAIL (no test matched '$filter')" $((SECONDS - t0))
        return
    fi
    record sanitize "$(state_of "$rc")" $((SECONDS - t0))
}

step_bench() {
    local logf=$OUT/bench.log t0=$SECONDS rc=0 secs
    local -a extra
    read -r -a extra <<<"${MLA_BENCH_ARGS:-}"
    : >"$logf"
    [[ -x $BIN/bench-decode ]] || { log "bench: no $BIN/bench-decode"; record bench "FAIL (no binary)" 0; return; }
    secs=$(budget "${MLA_TIMEOUT_BENCH:-300}")
    ((secs > 0)) || { record bench "SKIPPED (no time left)" 0; return; }
    log "bench: timeout ${secs}s"
    rm -f "$OUT/bench.json"
    run_to "$logf" '' "$secs" "$BIN/bench-decode" --bench --json "$OUT/bench.json" "${extra[@]}" || rc=$?
    if ((rc == 0)) && [[ ! -s $OUT/bench.json ]]; then
        log "bench: exited 0 but wrote no bench.json"
        record bench "FAIL (no bench.json)" $((SECONDS - t0))
        return
    fi
    record bench "$(state_of "$rc")" $((SECONDS - t0))
}

step_ncu() {
    local t0=$SECONDS rc=0 secs ncu spec iters
    local -a extra
    spec=${MLA_PROFILE_CASE:-sparse:t=128,h=8,k=2048,dtype=bf16}
    iters=${MLA_PROFILE_ITERS:-3}
    read -r -a extra <<<"${MLA_NCU_ARGS:---launch-count 12}"
    local -a target=("$BIN/example-profile" --case "$spec" --iters "$iters")
    [[ -n ${MLA_NCU_TARGET:-} ]] && read -r -a target <<<"$MLA_NCU_TARGET"
    [[ -x ${target[0]} ]] || { log "ncu: no ${target[0]}"; record ncu "FAIL (no binary)" 0; return; }
    if ! ncu=$(find_tool ncu /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/NVIDIA-Nsight-Compute*/ncu); then
        log "ncu: no ncu"
        record ncu "FAIL (no ncu)" 0
        return
    fi
    secs=$(budget "${MLA_TIMEOUT_NCU:-300}")
    ((secs > 0)) || { record ncu "SKIPPED (no time left)" 0; return; }
    log "ncu: $ncu on ${target[*]} (timeout ${secs}s)"
    # the cubins' line info names this tree as it was where it was built: point ncu at csrc/ here
    run_to "$OUT/ncu.txt" '' "$secs" "$ncu" --clock-control none --set full --import-source yes \
        --source-folders "$root/csrc" -f -o "$OUT/profile" "${extra[@]}" \
        "${target[@]}" || rc=$?
    if [[ -f $OUT/profile.ncu-rep ]]; then
        {
            echo "==== details (open profile.ncu-rep in Nsight Compute for source and SASS) ===="
            "$ncu" -i "$OUT/profile.ncu-rep" --page details --print-units base 2>&1
        } >>"$OUT/ncu.txt"
        echo "==== speed of light, per kernel ===="
        "$ncu" -i "$OUT/profile.ncu-rep" --page details --section SpeedOfLight --print-units base 2>&1 | head -n 150
        local sz
        sz=$(stat -c %s "$OUT/profile.ncu-rep")
        ((sz > 16 * 1024 * 1024)) && log "ncu: profile.ncu-rep is $sz bytes: over 16 MiB, it will not come back (lower --launch-count)"
    elif ((rc == 0)); then
        rc=1
    fi
    record ncu "$(state_of "$rc")" $((SECONDS - t0))
}

# ---- main -------------------------------------------------------------------------------
modes=("$@")
((${#modes[@]})) || modes=(all)
declare -a plan=()
for m in "${modes[@]}"; do
    case $m in
    all) plan+=(tests sanitize bench) ;;
    tests | sanitize | bench | ncu) plan+=("$m") ;;
    *)
        echo "gpu-run: unknown mode '$m' (tests, sanitize, bench, ncu, all)" >&2
        exit 2
        ;;
    esac
done

log "modes: ${plan[*]}; deadline ${deadline}s; OUT=$OUT"
nvidia-smi -L 2>&1 || log "nvidia-smi failed"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv,noheader 2>/dev/null || true
if [[ ! -d $BIN ]]; then
    log "no $BIN: run scripts/gpu-build.sh on the build machine and carry [\".gpu\"]"
    exit 1
fi
[[ -f .gpu/manifest.txt ]] && sed 's/^/  /' .gpu/manifest.txt
missing=$(for f in "$BIN"/*; do ldd "$f" 2>/dev/null | grep 'not found'; done | sort -u)
[[ -n $missing ]] && log "missing shared libraries: $missing"

for s in "${plan[@]}"; do
    echo
    log "==== $s ===="
    "step_$s"
done

nfiles=$(find "$OUT" -type f | wc -l)
fails=0
for st in "${res_states[@]}"; do [[ $st == pass ]] || fails=$((fails + 1)); done
echo
{
    echo "==== gpu-run summary ($((SECONDS - t_start))s) ===="
    nvidia-smi -L 2>/dev/null | head -n 8
    for i in "${!res_names[@]}"; do
        printf '  %-9s %-30s %5ss\n' "${res_names[$i]}" "${res_states[$i]}" "${res_secs[$i]}"
    done
    ((nfiles > 7)) && echo "  warning: $((nfiles + 1)) files under \$OUT: only 8 come back"
    echo "  files: $(cd "$OUT" && find . -type f ! -name summary.txt -printf '%P(%s) ') summary.txt"
    if ((fails)); then echo "gpu-run: $fails step(s) did not pass"; else echo "gpu-run: all passed"; fi
} | tee "$OUT/summary.txt"
((fails == 0))
