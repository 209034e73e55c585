#!/usr/bin/env bash
# Compares the decode kernels' SASS of two source trees, here (no GPU needed): compiles
# csrc/decode/decode.cu of each for one architecture, disassembles, and prints per kernel the
# instruction counts and whether the SASS is identical. Use it to check that a change touches
# only the kernels it means to (e.g. "the 8-warp configurations' SASS is unchanged") before
# spending device time on an A/B.
#
# usage: scripts/sass-diff.sh OLD_TREE NEW_TREE [ARCH] [REGEX]
#   OLD_TREE/NEW_TREE  repository roots (e.g. a `git worktree add /tmp/old <commit>`, and .)
#   ARCH               90 (default) or 120
#   REGEX              only kernels whose mangled name matches (e.g. RowFp8, 'ILi8ELi1E')
# env: MLA_SASS_KEEP  a folder to keep the .sass listings in
# Needs nvcc (scripts/cuda-env.sh) and nvdisasm beside cuobjdump or on PATH (pip
# nvidia-cuda-nvdisasm 13.2 or newer; cuobjdump -sass calls it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
old=$(cd "${1:?usage: sass-diff.sh OLD_TREE NEW_TREE [ARCH] [REGEX]}" && pwd)
new=$(cd "${2:?usage: sass-diff.sh OLD_TREE NEW_TREE [ARCH] [REGEX]}" && pwd)
arch=${3:-90}
regex=${4:-}
# shellcheck source=scripts/cuda-env.sh
source "$root/scripts/cuda-env.sh" --lib
mla_cuda_env || { echo "sass-diff: no nvcc (source scripts/cuda-env.sh --install)" >&2; exit 1; }
cuobjdump=${MLA_CUOBJDUMP:-$(dirname "$NVCC")/cuobjdump}
for d in "$(dirname "$cuobjdump")" "${MLA_CUDA_PREFIX:-$HOME/.cache/mla-decode/cuda-13.0}/../nvdisasm/nvidia/cu13/bin"; do
    [[ -x $d/nvdisasm ]] && PATH="$d:$PATH"
done
command -v nvdisasm >/dev/null || { echo "sass-diff: no nvdisasm (pip install nvidia-cuda-nvdisasm)" >&2; exit 1; }
work=${MLA_SASS_KEEP:-$(mktemp -d)}
mkdir -p "$work"
for side in old new; do
    tree=${!side}
    (cd "$tree" && "$NVCC" -cubin -O3 -std=c++17 -lineinfo --expt-relaxed-constexpr -Icsrc \
        -gencode="arch=compute_$arch,code=sm_$arch" -o "$work/$side.cubin" csrc/decode/decode.cu) &
done
wait
for side in old new; do "$cuobjdump" -sass "$work/$side.cubin" >"$work/$side.sass"; done
python3 - "$work/old.sass" "$work/new.sass" "$regex" <<'PY'
import re, sys
def parse(fn):
    funcs, cur = {}, None
    for line in open(fn):
        m = re.match(r'\s+Function : (\S+)', line)
        if m:
            cur = m.group(1); funcs[cur] = []; continue
        m = re.match(r'\s+/\*[0-9a-f]{4,}\*/\s+(.*?);', line)
        if m and cur:
            funcs[cur].append(m.group(1))
    return funcs
a, b, rx = parse(sys.argv[1]), parse(sys.argv[2]), sys.argv[3]
same = diff = 0
print('   old    new  sass  kernel')
for k in sorted(set(a) | set(b)):
    if rx and not re.search(rx, k):
        continue
    eq = a.get(k) == b.get(k)
    same += eq; diff += not eq
    print('%6s %6s  %s  %s' % (len(a[k]) if k in a else '-', len(b[k]) if k in b else '-', 'same' if eq else 'DIFF', k))
print(f'sass-diff: {same} identical, {diff} different')
PY
