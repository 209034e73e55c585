#!/usr/bin/env bash
# The resource gate: compiles every .cu file under csrc/ (csrc/cache_ops.cu,
# csrc/decode/*.cu: the set build.rs compiles) for sm_120 and sm_90 with ptxas's resource
# report, prints one row per kernel (registers, static shared memory, stack frame, spill
# stores/loads) and FAILS when
#   - nvcc or ptxas fails on any file (a tile configuration whose shared-memory arithmetic
#     exceeds sm_120's 101,376 bytes per block fails its static_assert, i.e. fails here), or
#   - any function, on any architecture, has a stack frame or spills (spills are slow
#     everywhere; a stack frame means a register array went to local memory).
# When a built static library is found (libmla_decode_kernels.a under the target dir given
# as $1, else $CARGO_TARGET_DIR or target/), it also lists its cubins with cuobjdump and
# checks that every architecture of MLA_CUDA_ARCHS (default 120,90) is in it.
#
# usage: scripts/resource-gate.sh [TARGET_DIR]
# env:   NVCC (else found like build.rs does, see scripts/cuda-env.sh)
#        MLA_GATE_ARCHS  architectures to compile and gate (default "120 90")
#        MLA_NVCC_FLAGS  extra nvcc flags, as for build.rs
#        MLA_GATE_KEEP   a folder to keep the raw ptxas reports in
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh --lib
if ! mla_cuda_env; then
    echo "resource-gate: FAIL: no nvcc (set NVCC, or: source scripts/cuda-env.sh --install)" >&2
    exit 1
fi

read -r -a gate_archs <<<"${MLA_GATE_ARCHS:-120 90}"
# every .cu under csrc/, as build.rs finds them (it compiles them as one translation unit;
# here each is compiled alone, which also checks that each stands on its own)
mapfile -t sources < <(find csrc -name '*.cu' -type f | LC_ALL=C sort)
if ((${#sources[@]} == 0)); then
    echo "resource-gate: FAIL: no .cu file under csrc/" >&2
    exit 1
fi
# work-file name of a source: its path under csrc/, '/' -> '_', without .cu
stem() { local f=${1#csrc/}; f=${f%.cu}; echo "${f//\//_}"; }

work=$(mktemp -d "${TMPDIR:-/tmp}/mla-gate.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Same device flags as build.rs (-O3, -lineinfo, C++17, relaxed constexpr); -cubin does the
# device pass only (the front end still sees host code, so host-side static_asserts count).
read -r -a extra <<<"${MLA_NVCC_FLAGS:-}"
flags=(-O3 -std=c++17 -Icsrc --expt-relaxed-constexpr -lineinfo -Xptxas -v --resource-usage "${extra[@]}")

echo "resource-gate: $NVCC (release $(mla_nvcc_release "$NVCC")), archs ${gate_archs[*]}, ${#sources[@]} file(s)"
t0=$EPOCHREALTIME

# One background job per architecture (each compiles the files in turn): 2 cores, 2 jobs.
for arch in "${gate_archs[@]}"; do
    mkdir -p "$work/$arch"
    (
        for src in "${sources[@]}"; do
            base=$(stem "$src")
            rc=0
            "$NVCC" -cubin -gencode "arch=compute_$arch,code=sm_$arch" "${flags[@]}" \
                -o "$work/$arch/$base.cubin" "$src" >"$work/$arch/$base.log" 2>&1 || rc=$?
            echo "$rc" >"$work/$arch/$base.rc"
        done
    ) &
done
wait

# Parse ptxas's report. Rows: arch file kind regs smem stack spill_st spill_ld name.
parse() { # $1 arch, $2 file label, $3 log
    awk -v arch="$1" -v file="$2" '
    function num(s, re,   m) { return match(s, re) ? substr(s, RSTART, RLENGTH) + 0 : 0 }
    /Compiling entry function/ {
        split($0, q, "\047"); cur = q[2]
        if (!(cur in seen)) { seen[cur] = 1; order[++n] = cur }
        entry[cur] = 1; next
    }
    /Function properties for / {
        p = $0; sub(/.*Function properties for /, "", p); sub(/[ \t]+$/, "", p); props = p
        if (!(p in seen)) { seen[p] = 1; order[++n] = p }
        next
    }
    /bytes stack frame/ {
        s = $0
        stack[props] = num(s, "[0-9]+ bytes stack frame")
        sst[props] = num(s, "[0-9]+ bytes spill stores")
        sld[props] = num(s, "[0-9]+ bytes spill loads")
        next
    }
    /Used [0-9]+ registers/ {
        s = $0; regs[cur] = 0
        if (match(s, /Used [0-9]+ registers/)) regs[cur] = substr(s, RSTART + 5, RLENGTH - 5) + 0
        smem[cur] = num(s, "[0-9]+ bytes smem")
        next
    }
    END {
        for (i = 1; i <= n; i++) {
            f = order[i]
            printf "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\n", arch, file, (f in entry) ? "kernel" : "func",
                (f in regs) ? regs[f] : "-", (f in smem) ? smem[f] : "-", stack[f], sst[f], sld[f], f
        }
    }' "$3"
}

fail=0
rows=$work/rows.tsv
: >"$rows"
for arch in "${gate_archs[@]}"; do
    for src in "${sources[@]}"; do
        base=$(stem "$src")
        log=$work/$arch/$base.log
        rc=$(cat "$work/$arch/$base.rc")
        if [[ $rc != 0 ]]; then
            echo
            echo "resource-gate: FAIL: nvcc exited $rc on $src for sm_$arch:"
            grep -v '^ptxas info' "$log" | head -n 60 || true
            fail=1
            continue
        fi
        # Compiler warnings (front end and ptxas) are shown, not gated on.
        if grep -q -i 'warning' "$log"; then
            echo "resource-gate: warnings for $src (sm_$arch):"
            grep -i -A2 'warning' "$log" | grep -v -e '^ptxas info' -e '^--$' | head -n 40 | sed 's/^/    /'
        fi
        parse "$arch" "${src#csrc/}" "$log" >>"$rows"
    done
done

demangle() { if command -v c++filt >/dev/null 2>&1; then c++filt; else cat; fi; }

echo
printf '%-7s %-20s %-6s %5s %7s %6s %8s %8s  %-4s  %s\n' \
    arch file kind regs smem stack spill-st spill-ld ok name
while IFS=$'\t' read -r arch file kind regs smem stack sst sld name; do
    ok=ok
    ((stack > 0 || sst > 0 || sld > 0)) && ok=FAIL
    # 255 is the most a thread can have: at the cap, the next change may spill
    [[ $ok == ok && $regs == 255 ]] && ok=cap
    printf '%-7s %-20s %-6s %5s %7s %6s %8s %8s  %-4s  %s\n' \
        "sm_$arch" "$file" "$kind" "$regs" "$smem" "$stack" "$sst" "$sld" "$ok" "$name"
done <"$rows" | demangle
bad=$(awk -F'\t' '$6 > 0 || $7 > 0 || $8 > 0' "$rows" | wc -l)
kernels=$(awk -F'\t' '$3 == "kernel"' "$rows" | wc -l)
echo "(ok=cap: 255 registers, the most a thread may have: no spill yet, but no headroom either)"
echo "(smem = static shared memory only; dynamic shared memory is each tile configuration's"
echo " own static_assert against 101376 bytes, which a failing compile above would show)"
if ((kernels == 0)); then
    echo "resource-gate: warning: no kernel under csrc/ yet"
fi
if ((bad > 0)); then
    echo "resource-gate: FAIL: $bad function(s) with a stack frame or spills (see FAIL rows)"
    fail=1
fi

if [[ -n ${MLA_GATE_KEEP:-} ]]; then
    mkdir -p "$MLA_GATE_KEEP"
    for arch in "${gate_archs[@]}"; do
        for log in "$work/$arch"/*.log; do cp "$log" "$MLA_GATE_KEEP/sm_${arch}_$(basename "$log")"; done
    done
    cp "$rows" "$MLA_GATE_KEEP/resources.tsv"
fi

# ---- the built library, if any: which cubins does it carry? -----------------------------
# (not target/gpu/ nor target/no-kernels/: scripts/gpu-build.sh's device builds carry fewer
# architectures, the kernel-less check builds none)
tdir=${1:-${CARGO_TARGET_DIR:-target}}
lib=$(find "$tdir" \( -path "${tdir%/}/gpu" -o -path "${tdir%/}/no-kernels" \) -prune -o \
    -path '*/build/mla-decode-*/out/libmla_decode_kernels.a' \
    -printf '%T@ %p\n' 2>/dev/null | sort -rn | head -n 1 | cut -d' ' -f2- || true)
echo
if [[ -z $lib ]]; then
    echo "resource-gate: no built libmla_decode_kernels.a under $tdir (build first to list its cubins)"
elif [[ -z ${MLA_CUOBJDUMP:-} ]]; then
    echo "resource-gate: $lib found, but no cuobjdump to list it"
else
    echo "resource-gate: cubins in $lib:"
    if listing=$("$MLA_CUOBJDUMP" --list-elf "$lib" 2>&1) && [[ -n $listing ]]; then
        sed 's/^/    /' <<<"$listing"
        IFS=', ;' read -r -a want <<<"${MLA_CUDA_ARCHS:-120,90}"
        for a in "${want[@]}"; do
            [[ -z $a ]] && continue
            a=${a#sm_}
            if ! grep -q "sm_$a\b" <<<"$listing"; then
                echo "resource-gate: FAIL: no sm_$a cubin in $lib (MLA_CUDA_ARCHS=${MLA_CUDA_ARCHS:-120,90})"
                fail=1
            fi
        done
        "$MLA_CUOBJDUMP" --list-ptx "$lib" 2>/dev/null | sed 's/^/    /' || true
        # What ships: the resource usage recorded in the library's own cubins. With
        # relocatable device code (nvcc --device-c, what cc does for more than one .cu) the
        # device-linked image (the *_dlink.o member, listed last) is what runs: last wins.
        usage=$("$MLA_CUOBJDUMP" --dump-resource-usage "$lib" 2>/dev/null || true)
        if grep -q -- '--compile-only' <<<"$usage"; then
            echo "resource-gate: note: $lib holds relocatable device code (-rdc / --device-c);"
            echo "    its registers can differ from the whole-program compile above"
        fi
        awk '
            /^arch = sm_/ { arch = $3 }
            /^ Function .*:$/ { name = $2; sub(/:$/, "", name); next }
            /^  REG:/ && name != "" {
                for (i = 1; i <= NF; i++) { split($i, kv, ":"); v[kv[1]] = kv[2] }
                key = arch SUBSEP name
                if (!(key in seen)) { seen[key] = 1; order[++n] = key }
                row[key] = sprintf("%s\t%s\t%s\t%s\t%s", v["REG"], v["SHARED"], v["STACK"], v["LOCAL"], name)
                name = ""
            }
            END { for (i = 1; i <= n; i++) { split(order[i], k, SUBSEP); print k[1] "\t" row[order[i]] } }
        ' <<<"$usage" | grep -v $'\t__cuda_' | sort -s -t$'\t' -k1,1 | sed -E 's/__nv_static_[0-9]+__[0-9a-f]+_[0-9]+_[A-Za-z0-9_]+_cu_[0-9a-f]+_(_Z)/\1/' >"$work/shipped.tsv"
        if [[ -s $work/shipped.tsv ]]; then
            echo
            echo "resource-gate: resource usage of the shipped cubins (cuobjdump --dump-resource-usage):"
            printf '%-7s %5s %7s %6s %6s  %-4s  %s\n' arch regs smem stack local ok name
            while IFS=$'\t' read -r arch regs smem stack lmem name; do
                ok=ok
                ((stack > 0 || lmem > 0)) && ok=FAIL
                [[ $ok == ok && $regs == 255 ]] && ok=cap
                printf '%-7s %5s %7s %6s %6s  %-4s  %s\n' "$arch" "$regs" "$smem" "$stack" "$lmem" "$ok" "$name"
            done <"$work/shipped.tsv" | demangle
            nbad=$(awk -F'\t' '$4 > 0 || $5 > 0' "$work/shipped.tsv" | wc -l)
            if ((nbad > 0)); then
                echo "resource-gate: FAIL: $nbad shipped function(s) with a stack frame or local memory"
                fail=1
            fi
        fi
    else
        echo "    (no device code: this library was built without kernels, MLA_NO_KERNELS or no nvcc)"
        sed 's/^/    /' <<<"$listing" | head -n 3
    fi
fi

secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
if ((fail)); then
    echo "resource-gate: FAILED (${secs}s)"
    exit 1
fi
echo "resource-gate: passed: $kernels kernel(s) on ${gate_archs[*]}, no stack frame, no spills (${secs}s)"
