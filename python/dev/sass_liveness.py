#!/usr/bin/env python3
"""Rough register-liveness profile of a SASS listing (nvdisasm -c output): backward
dataflow over the control-flow graph, with per-opcode operand widths for the instructions
flash_attn_fwd uses. Prints the peak and what is live there. A dev aid for register
pressure; approximate (unknown opcodes count 1 register per operand)."""
import re
import sys
from collections import defaultdict

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")
REG = re.compile(r"\bR(\d+)(\.64)?\b")


def widths(op, n_ops):
    """(dst_width, [src widths]) for register operands in order; None = default 1."""
    if op.startswith("HMMA.16816"):
        return 4, [4, 2, 4]
    if op.startswith("HMMA.1688"):
        return 4, [2, 1, 4]
    if op.startswith("LDSM") and op.endswith(".4"):
        return 4, []
    if op.startswith("LDSM") and op.endswith(".2"):
        return 2, []
    if op.startswith(("LDS.128", "LDG.E.128", "LD.E.128", "LDL.128")):
        return 4, []
    if op.startswith(("LDS.64", "LDG.E.64", "LDL.64")):
        return 2, []
    if op.startswith(("STS.128", "STG.E.128", "STL.128", "ST.E.128")):
        return 0, [1, 4]
    if op.startswith(("STS.64", "STG.E.64", "STL.64")):
        return 0, [1, 2]
    if op.startswith("IMAD.WIDE"):
        return 2, [1, 1, 2]
    if op.startswith("CS2R"):
        return 2, []
    return 1, []


def parse(lines):
    ins = []
    labels = {}
    for raw in lines:
        s = raw.strip()
        if s.startswith(".L_"):
            labels[s.rstrip(":")] = len(ins)
            continue
        m = LINE.search(raw)
        if not m:
            continue
        pred, op, rest = m.group(2), m.group(3), m.group(4)
        target = None
        t = re.search(r"`\((\.L_\w+)\)", rest)
        if t:
            target = t.group(1)
        regs = [(int(r.group(1)), 2 if r.group(2) else None) for r in REG.finditer(rest)]
        ins.append(dict(op=op, pred=bool(pred), regs=regs, target=target, text=raw.strip()))
    return ins, labels


def defs_uses(i):
    op, regs = i["op"], i["regs"]
    if not regs:
        return set(), set()
    store_like = op.startswith(("ST", "RED", "ATOM", "LDGSTS", "BAR", "BRA", "EXIT", "ISETP", "FSETP",
                                "SHFL.BFLY PT", "WARPSYNC", "DEPBAR", "CALL", "RET"))
    dw, sw = widths(op, len(regs))
    d, u = set(), set()
    ops = list(regs)
    if not store_like and dw:
        r, w = ops[0]
        for k in range(w or dw):
            d.add(r + k)
        ops = ops[1:]
    for idx, (r, w) in enumerate(ops):
        ww = w or (sw[idx] if idx < len(sw) else 1)
        for k in range(ww):
            u.add(r + k)
    if i["pred"]:  # predicated def: old value may survive
        u |= d
    d.discard(255)
    u.discard(255)
    return d, u


def main():
    ins, labels = parse(open(sys.argv[1]).read().splitlines())
    n = len(ins)
    du = [defs_uses(x) for x in ins]
    succ = []
    for k, x in enumerate(ins):
        s = []
        if x["target"] and x["target"] in labels:
            s.append(labels[x["target"]])
        if not (x["op"].startswith(("BRA", "EXIT", "RET")) and not x["pred"]):
            if k + 1 < n:
                s.append(k + 1)
        succ.append(s)
    live_in = [set() for _ in range(n)]
    changed = True
    while changed:
        changed = False
        for k in range(n - 1, -1, -1):
            out = set()
            for s in succ[k]:
                out |= live_in[s]
            d, u = du[k]
            new = (out - d) | u
            if new != live_in[k]:
                live_in[k] = new
                changed = True
    peak = max(range(n), key=lambda k: len(live_in[k]))
    print(f"instructions {n}, peak live {len(live_in[peak])} at {ins[peak]['text'][:90]}")
    hist = defaultdict(int)
    for k in range(n):
        hist[len(live_in[k]) // 10 * 10] += 1
    print("live-count histogram:", dict(sorted(hist.items())))
    if len(sys.argv) > 2:
        lo, hi = int(sys.argv[2]), int(sys.argv[3])
        for k in range(lo, min(hi, n)):
            print(f"{len(live_in[k]):4d} {ins[k]['text'][:110]}")


if __name__ == "__main__":
    main()
