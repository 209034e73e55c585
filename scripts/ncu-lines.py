#!/usr/bin/env python3
"""Instructions executed and stall samples per source line of one kernel (docs/DEVELOPING.md,
"Which source lines a kernel's instructions come from").

ncu's source page exported as CSV (`ncu -i P.ncu-rep --page source --csv --print-source sass`,
run on the device) lists the kernel's SASS in order with "Instructions Executed" and the stall
samples per instruction, but not the CUDA line. `nvdisasm --print-line-info` of the same
kernel, compiled here with the same flags, lists the same instructions in the same order with
their lines. This joins the two by position (it checks that the opcodes agree) and prints the
lines and the opcodes with the most instructions executed.

usage: scripts/ncu-lines.py LISTING MANGLED_KERNEL CSV [--per N] [--top K]
  LISTING  nvdisasm --print-line-info output of a cubin holding the kernel
  MANGLED  the kernel's mangled name (as in the listing's .text.<name> section)
  CSV      the ncu source-page CSV of one launch of that kernel
  --per N  divide the counts by N (e.g. warps x tiles: per warp and tile)
"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def listing(path, kernel):
    """[(file:line, instruction)] of the kernel's section, in order."""
    out, inside, loc = [], False, "?"
    with open(path) as f:
        for line in f:
            if line.startswith(".text."):
                if inside:
                    break
                inside = line.startswith(".text." + kernel + ":")
                continue
            if not inside:
                continue
            m = re.search(r'//## File "([^"]+)", line (\d+)', line)
            if m:
                loc = m.group(1).split("/")[-1] + ":" + m.group(2)
                continue
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
            if m:
                out.append((loc, m.group(2).strip()))
    return out


def opcode(text):
    words = text.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("listing")
    ap.add_argument("kernel")
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1.0)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()

    ins = listing(a.listing, a.kernel)
    rows = list(csv.reader(open(a.csv)))
    # the first row names the kernel, the second is the header
    hdr, data = rows[1], rows[2:]
    col_n = hdr.index("Instructions Executed")
    col_s = hdr.index("Warp Stall Sampling (All Samples)")
    col_src = hdr.index("Source")
    stalls = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    if len(ins) != len(data):
        sys.exit(f"ncu-lines: {len(ins)} instructions in the listing, {len(data)} in the CSV: not the same build")
    bad = sum(1 for (_, t), r in zip(ins, data) if opcode(t) != opcode(r[col_src]))
    if bad:
        sys.exit(f"ncu-lines: {bad} opcodes differ between the listing and the CSV: not the same build")

    per_line = defaultdict(lambda: [0, 0, defaultdict(int)])
    per_op = defaultdict(int)
    total_n = total_s = 0
    for (loc, text), r in zip(ins, data):
        n, s = int(r[col_n] or 0), int(r[col_s] or 0)
        e = per_line[loc]
        e[0] += n
        e[1] += s
        for c in stalls:
            if r[c] and int(r[c]):
                e[2][hdr[c][len("stall_"):]] += int(r[c])
        per_op[opcode(text)] += n
        total_n += n
        total_s += s
    print(f"{len(ins)} instructions; executed {total_n} ({total_n / a.per:.1f} per unit), {total_s} stall samples")
    print(f"{'line':<28} {'per unit':>9} {'share':>6} {'samples':>8}  top stalls")
    for loc, (n, s, st) in sorted(per_line.items(), key=lambda kv: -kv[1][0])[: a.top]:
        top = " ".join(f"{k}:{v}" for k, v in sorted(st.items(), key=lambda kv: -kv[1])[:3])
        print(f"{loc:<28} {n / a.per:9.1f} {100 * n / total_n:5.1f}% {100 * s / max(total_s, 1):7.1f}%  {top}")
    print(f"{'opcode':<28} {'per unit':>9} {'share':>6}")
    for op, n in sorted(per_op.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{op:<28} {n / a.per:9.1f} {100 * n / total_n:5.1f}%")


if __name__ == "__main__":
    main()
