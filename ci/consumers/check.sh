#!/usr/bin/env bash
# Builds mla-decode the way applications depend on it (issue #11): small crates outside the
# workspace, each with its own cudarc feature set, which cargo unifies with mla-decode's.
#
#   bash ci/consumers/check.sh [TARGET_DIR]
#
# TARGET_DIR (default: $CARGO_TARGET_DIR/no-kernels, else target/no-kernels) is the stub
# build's, which CI's `no-kernels` step fills just before: the consumers reuse its build
# dependencies (bindgen & co.), so that they cost seconds, not a minute.
#
#   candle-like    cudarc as candle-core 0.11 asks for it (`dynamic-linking`,
#                  `cuda-version-from-build-system`, cublas, curand, nvrtc, f8): cargo check,
#                  twice: with the nvcc found (cudarc takes its version), and as on a machine
#                  without a toolkit (an `nvcc` first on PATH that fails, no NVCC/CUDA_*
#                  variables): cudarc then falls back to its newest bindings (mla-decode asks
#                  for `fallback-latest`), where without it its build script stops.
#                  Not linked: dynamic linking needs libcuda, libcublas, libcurand and libnvrtc
#                  at link time (-lcuda ...), which a machine without the toolkit's libraries
#                  and the driver does not have, and the binary could not start without
#                  libcuda.so.1 anyway.
#   pinned         its own linking mode and an explicit `cuda-12080`: cargo check, once with
#                  `dynamic-loading`, once with `static-linking` (cudarc bundles the toolkit's
#                  libcudart_static.a and libstdc++.a into its rlib even for a check: both are
#                  looked up next to $NVCC and through the C++ compiler, and the check is
#                  skipped, saying so, when either is missing).
#   defaults       mla-decode alone: built and run. cudarc then loads libcuda at run time;
#                  `cuda_available()` must answer without panicking: false without libcuda,
#                  false with a (fake) driver that has no device, true with one that has.
#
# All with MLA_NO_KERNELS=1 (the stub build: no nvcc run, seconds not minutes); what is
# checked is the Rust side's feature interplay with cudarc, not the kernels.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
target_dir=${1:-${CARGO_TARGET_DIR:-$root/target}/no-kernels}
export CARGO_TARGET_DIR=$target_dir MLA_NO_KERNELS=1
# cudarc's build script runs `nvcc` from PATH: put $NVCC's folder there, as CI's setup does.
if [[ -n ${NVCC:-} ]] && ! command -v nvcc >/dev/null; then
    PATH=$(dirname "$NVCC"):$PATH
fi

for c in candle-like pinned defaults; do
    cargo fmt --manifest-path "$here/$c/Cargo.toml" -- --check --color never
done

# A machine without a toolkit: no NVCC/CUDA_* variables, and an `nvcc` first on PATH that
# fails as a missing one would (taking folders off PATH could take the linker with them).
# CUDA_ROOT, which cudarc's build script watches, makes it run again after a run with nvcc.
shim=$target_dir/no-nvcc
mkdir -p "$shim"
printf '#!/bin/sh\necho "nvcc: not installed (ci/consumers/check.sh)" >&2\nexit 127\n' >"$shim/nvcc"
chmod +x "$shim/nvcc"
no_toolkit() {
    env -u NVCC -u CUDA_HOME -u CUDA_PATH -u CUDA_TOOLKIT_ROOT_DIR CUDA_ROOT="$shim" \
        PATH="$shim:$PATH" "$@"
}

echo "consumers: candle-like (cargo check, nvcc: $(command -v nvcc || echo none))"
env -u CUDA_ROOT cargo check --manifest-path "$here/candle-like/Cargo.toml"
echo "consumers: candle-like (cargo check, as without a toolkit)"
no_toolkit cargo check --manifest-path "$here/candle-like/Cargo.toml"

echo "consumers: pinned, dynamic-loading (cargo check)"
cargo check --manifest-path "$here/pinned/Cargo.toml" --features dynamic-loading

# Static linking: a CUDA_HOME of links to the two archives cudarc's build script asks for.
cudart=
nvcc=${NVCC:-$(command -v nvcc || true)}
if [[ -n $nvcc ]]; then
    for d in lib lib64 targets/x86_64-linux/lib; do
        [[ -f $(dirname "$nvcc")/../$d/libcudart_static.a ]] && cudart=$(dirname "$nvcc")/../$d/libcudart_static.a && break
    done
fi
stdcxx=$(${CXX:-g++} -print-file-name=libstdc++.a 2>/dev/null || true)
if [[ -n $cudart && $stdcxx == /* && -f $stdcxx ]]; then
    static_home=$target_dir/static-cuda-home
    mkdir -p "$static_home/lib"
    ln -sf "$(realpath "$cudart")" "$static_home/lib/libcudart_static.a"
    ln -sf "$(realpath "$stdcxx")" "$static_home/lib/libstdc++.a"
    echo "consumers: pinned, static-linking (cargo check)"
    CUDA_HOME=$static_home cargo check --manifest-path "$here/pinned/Cargo.toml" --features static-linking
else
    echo "consumers: pinned, static-linking SKIPPED: no libcudart_static.a next to nvcc (${nvcc:-none}) or no libstdc++.a (${stdcxx:-none})"
fi

# defaults: cudarc loads libcuda at run time; cuda_available() is asked three times, and
# LD_LIBRARY_PATH (searched before the system's) decides which libcuda.so.1 it finds:
#   none           (skipped where the system has one)                       -> false
#   a fake driver  whose cuInit says CUDA_ERROR_NO_DEVICE (what a machine
#                  with the driver but no GPU, or a toolkit stub, answers)   -> false
#   a fake driver  whose cuInit succeeds and that counts one device         -> true
# (The fakes define only those two functions; cudarc looks symbols up when first called.)
echo "consumers: defaults (cargo build, then run)"
cargo build --manifest-path "$here/defaults/Cargo.toml"
bin=$target_dir/debug/consumer-defaults
fake=$target_dir/fake-libcuda
mkdir -p "$fake/no-device" "$fake/one-device"
printf 'int cuInit(unsigned f) { (void)f; return 100; }\nint cuDeviceGetCount(int *n) { *n = 0; return 0; }\n' |
    ${CC:-cc} -shared -fPIC -x c -o "$fake/no-device/libcuda.so.1" -
printf 'int cuInit(unsigned f) { (void)f; return 0; }\nint cuDeviceGetCount(int *n) { *n = 1; return 0; }\n' |
    ${CC:-cc} -shared -fPIC -x c -o "$fake/one-device/libcuda.so.1" -
if { command -v ldconfig >/dev/null && ldconfig -p 2>/dev/null | grep -q 'libcuda\.so\.1 '; }; then
    echo "consumers: defaults, no libcuda: skipped (this machine has one)"
else
    echo "consumers: defaults, no libcuda"
    "$bin" --expect=false
fi
echo "consumers: defaults, a libcuda without a device"
LD_LIBRARY_PATH=$fake/no-device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin" --expect=false
echo "consumers: defaults, a libcuda with one device"
LD_LIBRARY_PATH=$fake/one-device${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$bin" --expect=true
