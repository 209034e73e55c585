#!/usr/bin/env bash
# Builds, HERE, every executable the GPU machine runs (it has no Rust), into .gpu/bin/:
#   test-lib, test-<integration test>   (cargo test --release --no-run)
#   bench-<bench>                       (cargo bench --no-run)
#   example-<example>                   (cargo build --release --examples)
# stripped of debug info (symbols stay, for backtraces), plus .gpu/manifest.txt. Fails when
# nvcc is missing (binaries without kernels are useless there), when a binary carries no
# sm_90 cubin, or when .gpu/ would exceed the 56 MiB that may travel with the call.
#
# Then ONE device call runs them all (see docs/DEVELOPING.md):
#   carry [".gpu"], command: bash scripts/gpu-run.sh all
#
# usage: scripts/gpu-build.sh [--install]   (--install: pip-install CUDA 13.0 if no nvcc)
# env:   CARGO_TARGET_DIR (default target/gpu: a kernel library built for fewer architectures
#        must not be left in target/, where the resource gate reads the shipped cubins),
#        MLA_CUDA_ARCHS (must include 90 for the H200), MLA_GPU_MAX_MIB (56)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target/gpu}
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh --lib
if ! mla_cuda_env "${1:-}"; then
    echo "gpu-build: no nvcc: the binaries would carry no kernels (try: scripts/gpu-build.sh --install)" >&2
    exit 1
fi
case ",${MLA_CUDA_ARCHS:-120,90}," in
*,90,* | *,sm_90,*) ;;
*) echo "gpu-build: warning: MLA_CUDA_ARCHS=${MLA_CUDA_ARCHS} has no 90: the H200 cannot run these" >&2 ;;
esac
echo "gpu-build: nvcc $NVCC (release $(mla_nvcc_release "$NVCC")), archs ${MLA_CUDA_ARCHS:-120,90}"

py=$(command -v python3 || command -v python) || {
    echo "gpu-build: needs python3 (to read cargo's JSON messages)" >&2
    exit 1
}

work=$(mktemp -d "${TMPDIR:-/tmp}/mla-gpu-build.XXXXXX")
trap 'rm -rf "$work"' EXIT

t0=$EPOCHREALTIME
run_json() { # $1 name, rest: cargo arguments. JSON to $work/$1.json, diagnostics to stderr.
    local name=$1 t=$EPOCHREALTIME
    shift
    echo "gpu-build: cargo $*"
    cargo "$@" --message-format=json-render-diagnostics >"$work/$name.json"
    echo "gpu-build:   done in $(awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s"
}
run_json test test --release --no-run
run_json bench bench --no-run
run_json examples build --release --examples

# artifact lines -> "stable-name<TAB>path"
"$py" - "$work" >"$work/list.tsv" <<'EOF'
import json, sys, os
work = sys.argv[1]
seen = {}
def take(name, path):
    if name in seen and seen[name] != path:
        sys.exit(f"gpu-build: two executables for {name}: {seen[name]} and {path}")
    seen[name] = path
for step in ("test", "bench", "examples"):
    for line in open(os.path.join(work, step + ".json")):
        try:
            m = json.loads(line)
        except ValueError:
            continue
        if m.get("reason") != "compiler-artifact" or not m.get("executable"):
            continue
        kinds, name = m["target"]["kind"], m["target"]["name"]
        exe, is_test = m["executable"], m["profile"]["test"]
        if step == "test" and is_test:
            if "lib" in kinds or "rlib" in kinds or "cdylib" in kinds or "staticlib" in kinds:
                take("test-lib", exe)
            elif "test" in kinds:
                take("test-" + name, exe)
            # benches/examples in test mode: not run there
        elif step == "bench" and "bench" in kinds:
            take("bench-" + name, exe)
        elif step == "examples" and "example" in kinds:
            take("example-" + name, exe)
for name in sorted(seen):
    print(f"{name}\t{seen[name]}")
EOF

if [[ ! -s $work/list.tsv ]]; then
    echo "gpu-build: cargo produced no executables" >&2
    exit 1
fi

rm -rf .gpu/bin
mkdir -p .gpu/bin
while IFS=$'\t' read -r name path; do
    cp "$path" ".gpu/bin/$name"
    strip --strip-debug ".gpu/bin/$name"
done <"$work/list.tsv"

limit_mib=${MLA_GPU_MAX_MIB:-56}
total_bytes() { du -cb .gpu | tail -n 1 | cut -f1; }
if (($(total_bytes) > limit_mib * 1024 * 1024)); then
    echo "gpu-build: over ${limit_mib} MiB with symbols; stripping them too"
    strip --strip-all .gpu/bin/*
fi

# The kernels library must carry device code with an sm_90 cubin (the H200): a stub build
# (no nvcc seen by build.rs, MLA_NO_KERNELS) would waste a whole device call.
fail=0
out_dir=$("$py" - "$work/test.json" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "build-script-executed" and "mla-decode" in m.get("package_id", "") \
            and m.get("out_dir"):
        print(m["out_dir"])
EOF
)
lib=${out_dir:+$out_dir/libmla_decode_kernels.a}
if [[ -z $lib || ! -f $lib ]]; then
    echo "gpu-build: FAIL: cannot find the kernels library (build-script out_dir '${out_dir}')" >&2
    fail=1
elif ! elf=$(readelf -S -W "$lib" 2>/dev/null) || ! grep -q 'nv_fatbin' <<<"$elf"; then
    echo "gpu-build: FAIL: $lib has no device code: build.rs built the stubs (NVCC? MLA_NO_KERNELS?)" >&2
    fail=1
elif [[ -n ${MLA_CUOBJDUMP:-} ]]; then
    listing=$("$MLA_CUOBJDUMP" --list-elf "$lib" 2>/dev/null || true)
    if ! grep -q 'sm_90\.' <<<"$listing"; then
        echo "gpu-build: FAIL: no sm_90 cubin in $lib (MLA_CUDA_ARCHS=${MLA_CUDA_ARCHS:-120,90})" >&2
        fail=1
    fi
    echo "gpu-build: cubins in the kernels library:"
    sed 's/^/    /' <<<"$listing"
fi

# Which binaries carry the kernels (the linker drops them from binaries that never call in).
kernels_of() {
    local e
    e=$(readelf -S -W "$1" 2>/dev/null || true)
    if grep -q '\.nv_fatbin' <<<"$e"; then echo kernels; else echo "no device code"; fi
}

{
    echo "built:  $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
    echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD 2>/dev/null || echo ' (+ uncommitted changes)')"
    echo "nvcc:   $(mla_nvcc_release "$NVCC") ($NVCC)"
    echo "archs:  ${MLA_CUDA_ARCHS:-120,90}"
    echo "rustc:  $(rustc --version)"
    echo "glibc:  $(ldd --version 2>/dev/null | head -n 1)"
    echo "binaries:"
    for f in .gpu/bin/*; do
        printf '  %-28s %10s bytes  %s  %s\n' "$(basename "$f")" "$(stat -c %s "$f")" \
            "$(sha256sum "$f" | cut -c1-16)" "$(kernels_of "$f")"
    done
} >.gpu/manifest.txt

echo
cat .gpu/manifest.txt
total=$(total_bytes)
printf 'gpu-build: .gpu is %.1f MiB (limit %s MiB) after %ss\n' "$(awk -v b="$total" 'BEGIN { print b / 1048576 }')" \
    "$limit_mib" "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
if ((total > limit_mib * 1024 * 1024)); then
    echo "gpu-build: FAIL: .gpu is over ${limit_mib} MiB: it would not travel (64 MiB with the tree)." >&2
    echo "  Each binary that calls the kernels carries all their cubins; the H200 needs sm_90 only:" >&2
    echo "  CARGO_TARGET_DIR=target/gpu MLA_CUDA_ARCHS=90 scripts/gpu-build.sh" >&2
    fail=1
fi
if ((fail)); then
    exit 1
fi
echo 'gpu-build: ready. One device call: carry [".gpu"], command "bash scripts/gpu-run.sh all"'
