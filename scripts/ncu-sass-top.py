#!/usr/bin/env python3
"""Where a kernel's warps wait, per SASS instruction: reads the CSV of
`ncu -i REP --page source --csv --print-source sass` (stdin or a path) and prints the
instructions with the most warp-stall samples (with their share and the per-reason
columns ncu gives), then the samples summed by opcode. Used by device-run.sh's ncu-src-bwd."""
import csv, sys, collections

def num(s):
    try:
        return float(str(s).replace(",", ""))
    except ValueError:
        return None

def main():
    f = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 45
    lines = [l for l in f if l.strip()]
    # ncu prints a banner before the CSV header; the header is the first line with "Source".
    start = next(i for i, l in enumerate(lines) if '"Source"' in l or l.startswith("# Address"))
    rows = list(csv.DictReader(lines[start:]))
    cols = rows[0].keys() if rows else []
    allc = next(c for c in cols if "Sampling (All" in c)
    samp = [c for c in cols if ("stall" in c.lower() or "Sampling" in c) and c != allc]
    total = sum(num(r[allc]) or 0 for r in rows)
    print(f"{len(rows)} SASS lines, {total:.0f} warp-stall samples ({allc})")
    rows.sort(key=lambda r: -(num(r[allc]) or 0))
    for r in rows[:top]:
        n = num(r[allc]) or 0
        extra = " ".join(f"{c.split('(')[0].strip()[:18]}={r[c]}" for c in samp if (num(r[c]) or 0) > 0.02 * max(n, 1))
        print(f"{100 * n / max(total, 1):5.1f}%  {r.get('# Address', r.get('Address', ''))}  {r['Source'][:70]:70s} {extra}")
    byop = collections.Counter()
    for r in rows:
        op = r["Source"].split()
        op = next((t for t in op if not t.startswith("@")), "?").split(".")[0] if op else "?"
        byop[op] += num(r[allc]) or 0
    print("by opcode:", ", ".join(f"{k} {100 * v / max(total, 1):.1f}%" for k, v in byop.most_common(14)))

if __name__ == "__main__":
    main()
