#!/usr/bin/env python3
"""Compare two bench JSON files (`cargo bench --bench decode -- --json ...`) row by row.

usage: python3 scripts/grid-diff.py OLD.json NEW.json [--min PCT] [--match TEXT]

Prints, for each row name in both files: µs (graph replay where the row has one, as the
tables judge small steps), % of copy and TFLOP/s, old -> new, and the change in %. --min hides
rows that moved less than PCT %; --match keeps rows whose name contains TEXT. Rows in only one
file are listed at the end. Reads only the JSON: no device, no build.
"""
import json
import sys


def rows(path):
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict):
        data = data.get("rows", [])
    return {r["name"]: r for r in data if isinstance(r, dict) and "name" in r}


def time_of(r):
    return r["graph_us"] if r.get("graph_us") else r["us"]


def main(argv):
    args = list(argv[1:])
    min_pct, match = 0.0, ""
    if "--min" in args:
        i = args.index("--min")
        min_pct = float(args[i + 1])
        del args[i : i + 2]
    if "--match" in args:
        i = args.index("--match")
        match = args[i + 1]
        del args[i : i + 2]
    if len(args) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    old, new = rows(args[0]), rows(args[1])
    print(f"{'row':<62} {'old µs':>9} {'new µs':>9} {'Δ %':>7} {'% copy':>15} {'TFLOP/s':>15}")
    for name, n in new.items():
        if name not in old or match not in name:
            continue
        o = old[name]
        to, tn = time_of(o), time_of(n)
        d = 100.0 * (tn - to) / to
        if abs(d) < min_pct:
            continue
        g = " g" if n.get("graph_us") else "  "
        pc = f"{o['pct_of_copy']:.1f}→{n['pct_of_copy']:.1f}"
        tf = f"{o['tflops']:.1f}→{n['tflops']:.1f}"
        print(f"{name[:62]:<62} {to:>9.2f} {tn:>9.2f}{g}{d:>+6.1f} {pc:>15} {tf:>15}")
    only = sorted(set(old) ^ set(new))
    for name in only:
        print(f"only in {'old' if name in old else 'new'}: {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
