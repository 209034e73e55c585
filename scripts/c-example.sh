#!/usr/bin/env bash
# Builds examples/c/dense_decode.c (the C ABI from plain C, no Rust) against the static
# library cargo built, and runs it: on a machine without a GPU it must report
# MLA_STATUS_NO_DEVICE and exit 0; on a GPU it checks a decode against its own reference.
#
# usage: scripts/c-example.sh [OUT]    (OUT: where the executable goes; default target/c-example)
# env:   CARGO_TARGET_DIR (where cargo built the library), MLA_C_EXAMPLE_NO_RUN=1 (build only)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh --lib
mla_cuda_env || { echo "c-example: no nvcc (its headers and libcudart_static.a are needed)" >&2; exit 1; }
cuda=$(cd "$(dirname "$NVCC")/.." && pwd)
libdir="$cuda/lib"
[[ -f $libdir/libcudart_static.a ]] || libdir="$cuda/lib64"
[[ -f $libdir/libcudart_static.a ]] || libdir="$cuda/targets/x86_64-linux/lib"
target=${CARGO_TARGET_DIR:-$root/target}
lib=$(ls -t "$target"/release/build/mla-decode-*/out/libmla_decode_kernels.a 2>/dev/null | head -n 1 || true)
if [[ -z $lib ]]; then
    echo "c-example: no libmla_decode_kernels.a under $target/release/build (run cargo build --release first)" >&2
    exit 1
fi
out=${1:-$target/c-example}
cc=${CC:-cc}
"$cc" -std=c99 -Wall -Wextra -Werror -O2 -Icsrc -I"$cuda/include" examples/c/dense_decode.c \
    -L"$(dirname "$lib")" -lmla_decode_kernels -L"$libdir" -lcudart_static -lstdc++ -lpthread -ldl -lrt -lm \
    -o "$out"
echo "c-example: built $out (library $lib)"
[[ ${MLA_C_EXAMPLE_NO_RUN:-0} == 1 ]] && exit 0
"$out"
