# shellcheck shell=bash
# Finds a CUDA compiler for mla-decode and, on request, installs CUDA 13.0 from PyPI.
#
#   source scripts/cuda-env.sh             # find nvcc; export NVCC (+ MLA_CUOBJDUMP) if found
#   source scripts/cuda-env.sh --install   # ... and pip-install CUDA 13.0 when none is found
#   source scripts/cuda-env.sh --lib       # only define the functions (for scripts)
#   eval "$(bash scripts/cuda-env.sh [--install])"   # the same for your shell
#
# Search order (the first nvcc of release >= 12.8, the first with sm_120):
#   $NVCC, $CUDA_HOME/bin, $CUDA_PATH/bin, PATH, /usr/local/cuda/bin,
#   $MLA_CUDA_PREFIX/nvidia/cu13/bin (default prefix: ~/.cache/mla-decode/cuda-13.0),
#   ~/.cache/mla-cuda/site/nvidia/cu13/bin (an older cache location).
# The install puts the nvidia-* 13.0 wheels (nvcc, cudart, crt, nvvm, cccl) plus
# cuobjdump (>= 13.2, which reads 13.0 output) under $MLA_CUDA_PREFIX, outside the repo.
# 13.0 is pinned on purpose: the runtime is linked statically, and a binary built with a
# newer toolkit than the GPU machine's driver (CUDA 13.0) would not load there.

MLA_CUDA_PREFIX="${MLA_CUDA_PREFIX:-${HOME:-/root}/.cache/mla-decode/cuda-13.0}"

# Prints "MAJOR.MINOR" of an nvcc, or nothing.
mla_nvcc_release() {
    "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | head -n 1
}

# True when $1 is an nvcc of release >= 12.8 (the first that knows sm_120).
mla_nvcc_usable() {
    local rel major minor
    [[ -f $1 && -x $1 ]] || return 1
    rel=$(mla_nvcc_release "$1")
    [[ -n $rel ]] || return 1
    major=${rel%%.*}
    minor=${rel#*.}
    ((major > 12 || (major == 12 && minor >= 8)))
}

# Prints the path of the first usable nvcc; returns 1 when there is none.
mla_find_nvcc() {
    local c v
    local -a cands=()
    [[ -n ${NVCC:-} ]] && cands+=("$NVCC")
    for v in CUDA_HOME CUDA_PATH; do
        [[ -n ${!v:-} ]] && cands+=("${!v}/bin/nvcc")
    done
    c=$(command -v nvcc 2>/dev/null) && cands+=("$c")
    cands+=(/usr/local/cuda/bin/nvcc
        "$MLA_CUDA_PREFIX/nvidia/cu13/bin/nvcc"
        "${HOME:-/root}/.cache/mla-cuda/site/nvidia/cu13/bin/nvcc")
    for c in "${cands[@]}"; do
        if mla_nvcc_usable "$c"; then
            printf '%s\n' "$c"
            return 0
        fi
        if [[ -e $c ]]; then
            echo "cuda-env: skipping $c (release $(mla_nvcc_release "$c")): sm_120 needs CUDA >= 12.8" >&2
        fi
    done
    return 1
}

# Prints the path of a cuobjdump (next to nvcc first), or returns 1.
mla_find_cuobjdump() {
    local c
    local -a cands=()
    [[ -n ${MLA_CUOBJDUMP:-} ]] && cands+=("$MLA_CUOBJDUMP")
    [[ -n ${NVCC:-} ]] && cands+=("$(dirname "$NVCC")/cuobjdump")
    c=$(command -v cuobjdump 2>/dev/null) && cands+=("$c")
    cands+=("$MLA_CUDA_PREFIX/nvidia/cu13/bin/cuobjdump" /usr/local/cuda/bin/cuobjdump)
    for c in "${cands[@]}"; do
        if [[ -f $c && -x $c ]] && "$c" --version >/dev/null 2>&1; then
            printf '%s\n' "$c"
            return 0
        fi
    done
    return 1
}

# Runs a command as root (directly, or through sudo).
mla_as_root() {
    if [[ $(id -u) -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        echo "cuda-env: need root for: $*" >&2
        return 1
    fi
}

# pip-installs CUDA 13.0 under $MLA_CUDA_PREFIX (atomically: a failed install leaves nothing).
mla_install_cuda() {
    local py prefix=$MLA_CUDA_PREFIX tmp
    local -a pkgs=("nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*"
        "nvidia-nvvm==13.0.*" "nvidia-cuda-cccl==13.0.*")
    py=$(command -v python3 || command -v python || true)
    if [[ -z $py ]] || ! "$py" -m pip --version >/dev/null 2>&1; then
        echo "cuda-env: no python3 with pip; installing python3-pip with apt-get" >&2
        mla_as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
            mla_as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null ||
            return 1
        py=$(command -v python3)
    fi
    mkdir -p "$(dirname "$prefix")"
    tmp="$prefix.tmp.$$"
    rm -rf "$tmp"
    echo "cuda-env: pip-installing CUDA 13.0 into $prefix" >&2
    # One pip command for every wheel: they share the nvidia/ folder, and a second
    # `pip install --target` into the same folder would skip it.
    # (--target also bypasses PEP 668's externally-managed check, as it should here.)
    if ! "$py" -m pip install --disable-pip-version-check --root-user-action=ignore --no-input -q --target "$tmp" \
        "${pkgs[@]}" "nvidia-cuda-cuobjdump>=13.2"; then
        echo "cuda-env: retrying without cuobjdump" >&2
        rm -rf "$tmp"
        "$py" -m pip install --disable-pip-version-check --root-user-action=ignore --no-input -q --target "$tmp" "${pkgs[@]}" || {
            rm -rf "$tmp"
            return 1
        }
    fi
    rm -rf "$prefix"
    mv "$tmp" "$prefix"
    [[ -x $prefix/nvidia/cu13/bin/nvcc ]]
}

# Sets NVCC (exported), puts its folder first on PATH, sets MLA_CUOBJDUMP when found.
# With --install, installs CUDA 13.0 when no nvcc is found. Returns 1 without nvcc.
mla_cuda_env() {
    local nvcc
    if ! nvcc=$(mla_find_nvcc); then
        if [[ ${1:-} == --install ]]; then
            mla_install_cuda || {
                echo "cuda-env: installing CUDA 13.0 from PyPI failed" >&2
                return 1
            }
            nvcc=$(mla_find_nvcc) || return 1
        else
            echo "cuda-env: no nvcc >= 12.8 found (run with --install to pip-install CUDA 13.0)" >&2
            return 1
        fi
    fi
    export NVCC=$nvcc
    case ":$PATH:" in
    *":$(dirname "$nvcc"):"*) ;;
    *) PATH="$(dirname "$nvcc"):$PATH" && export PATH ;;
    esac
    MLA_CUOBJDUMP=$(mla_find_cuobjdump) || MLA_CUOBJDUMP=
    export MLA_CUOBJDUMP
    return 0
}

if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    # Executed, not sourced: print the environment for `eval "$(bash scripts/cuda-env.sh)"`.
    set -euo pipefail
    mla_cuda_env "${1:-}"
    printf 'export NVCC=%q\n' "$NVCC"
    # nvcc on PATH too: cudarc's cuda-version-from-build-system asks the nvcc on PATH
    printf 'export PATH=%q:"$PATH"\n' "$(dirname "$NVCC")"
    [[ -n $MLA_CUOBJDUMP ]] && printf 'export MLA_CUOBJDUMP=%q\n' "$MLA_CUOBJDUMP"
    printf '# nvcc release %s\n' "$(mla_nvcc_release "$NVCC")"
elif [[ ${1:-} != --lib ]]; then
    mla_cuda_env "${1:-}" || true
fi
