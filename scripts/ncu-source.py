#!/usr/bin/env python3
"""Sums an ncu source-page export per SASS opcode and per CUDA source line.

usage: scripts/ncu-source.py CSV WARP_TILES [TOP]

CSV is what `ncu -i REP --page source --csv --print-source cuda,sass` writes for one kernel
(capture with `--set full --import-source yes`; the binaries carry -lineinfo): a block per
source file, each CUDA line's row (its "Line No" filled, carrying the sum of the SASS rows that
follow it) then those SASS rows. The script counts only the SASS rows, each under the CUDA line
above it, and prints per opcode and per line the instructions executed per warp-tile
(divided by WARP_TILES: the kernel's CTA-tiles times its warps), the share of the stall samples
and the excess shared-memory wavefronts (bank conflicts). TOP: how many lines to list (40).
An instruction inlined from a helper is listed once per file of its inline chain (the helper's
line and the call site's): the total and the per-opcode sums count each SASS address once, the
per-line sums keep every attribution (so they add up to more than the total). ncu may also file
a header's lines under another header with the same name ending (fp8.cuh under append_fp8.cuh).
"""
import collections
import csv
import re
import sys

INSTR = "Instructions Executed"
STALL = "Warp Stall Sampling (All Samples)"
EXCESS = "L1 Wavefronts Shared Excessive"


def number(v):
    try:
        return float(v)
    except ValueError:
        return 0.0


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path, warp_tiles = sys.argv[1], float(sys.argv[2])
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    by_op = collections.defaultdict(lambda: [0.0, 0.0])
    by_line = collections.defaultdict(lambda: [0.0, 0.0, 0.0, ""])
    header, src_file, line = None, "", ("", "")
    seen = set()  # SASS addresses counted in the totals and per opcode
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                src_file = row[1].split("/")[-1]
                continue
            if row[0] == "Line No":
                header = row
                continue
            if header is None or row[0] == "Function Name":
                continue
            if row[0] != "":  # a CUDA line: its sums are the SASS rows' below
                line = (row[0], row[1])
                continue
            if row[2] == "...":  # an elided gap between SASS rows
                continue
            m = dict(zip(header[4:], row[4:]))
            n, st, ex = number(m.get(INSTR, "")), number(m.get(STALL, "")), number(m.get(EXCESS, ""))
            if row[2] not in seen:  # an inlined instruction is listed under each file of its inline chain
                seen.add(row[2])
                op = re.match(r"\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", row[3])
                o = by_op[op.group(1) if op else "?"]
                o[0] += n
                o[1] += st
            k = by_line[(src_file, line[0])]
            k[0] += n
            k[1] += st
            k[2] += ex
            k[3] = line[1]
    total = sum(v[0] for v in by_op.values())
    stalls = sum(v[1] for v in by_op.values()) or 1.0
    print(f"{total / warp_tiles:.1f} warp-instructions per warp-tile, {stalls:.0f} stall samples")
    print("per opcode (per warp-tile, % of stall samples):")
    for name, (n, st) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:30]:
        print(f"  {name:10s} {n / warp_tiles:8.1f} {100 * st / stalls:6.1f} %")
    print("per CUDA line (per warp-tile, % of stall samples, excess shared wavefronts):")
    for (fname, ln), (n, st, ex, text) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"  {fname}:{ln:<5s} {n / warp_tiles:8.1f} {100 * st / stalls:6.1f} % {ex:10.0f}  {text.strip()[:80]}")


if __name__ == "__main__":
    main()
