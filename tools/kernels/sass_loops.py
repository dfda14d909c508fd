#!/usr/bin/env python3
"""Per-loop instruction counts of an nvdisasm listing: for every backward branch whose body
holds HGMMA, the body's size and its R2UR / IMAD / MUFU counts (docs/design/attention-prefill-sm90.md).
With --order, also the loop's event sequence, runs collapsed:
H = HGMMA, W1 / W0 = WARPGROUP.DEPBAR.LE gsb0 1 / 0 (wgmma waits), e = MUFU.EX2,
p = F2FP (pack), * = FMUL, b = SYNCS (mbarrier wait / arrive). In the attention kernel's
steady loop every e must come before W0, or the softmax does not overlap P V.

  nvdisasm -c kernel.cubin > k.sass      # nvdisasm: CUDA toolkit or pip nvidia-cuda-nvdisasm
  python3 tools/kernels/sass_loops.py [--order] k.sass [more.sass ...]

Cubins of the sm_90a attention kernel: tools/kernels/nvrtc_check.py (Nvrtc.compile).
"""
import re
import sys

RE_INS = re.compile(r"\s*/\*([0-9a-f]+)\*/\s*(.*?);")
RE_LABEL = re.compile(r"\.L_x_(\d+):")
RE_BRANCH = re.compile(r"BRA.*\.L_x_(\d+)")


def parse(path):
    """(instructions [(address, text)], labels {name: address of the next instruction})."""
    ins, labels, pending = [], {}, None
    for line in open(path):
        m = RE_LABEL.match(line.strip())
        if m:
            pending = m.group(1)
            continue
        m = RE_INS.match(line)
        if m:
            addr = int(m.group(1), 16)
            ins.append((addr, m.group(2)))
            if pending is not None:
                labels[pending] = addr
                pending = None
    return ins, labels


EVENTS = [("HGMMA", "H"), ("WARPGROUP.DEPBAR", None), ("MUFU.EX2", "e"), ("F2FP", "p"), ("FMUL", "*"), ("SYNCS", "b")]


def event_order(body):
    """The loop body as a run-length string of the EVENTS above."""
    seq = []
    for t in body:
        op = t.split()[0] if not t.startswith("@") else t.split()[1]
        key = None
        for name, k in EVENTS:
            if op.startswith(name):
                key = k if k else "W" + t.rstrip().split()[-1][-1]
                break
        if key is None:
            continue
        if seq and seq[-1][0] == key:
            seq[-1][1] += 1
        else:
            seq.append([key, 1])
    return " ".join(k if n == 1 else f"{k}{n}" for k, n in seq)


def main():
    order = "--order" in sys.argv[1:]
    for path in [a for a in sys.argv[1:] if a != "--order"]:
        ins, labels = parse(path)
        for addr, text in ins:
            m = RE_BRANCH.search(text)
            if not m or labels.get(m.group(1), addr) >= addr:
                continue
            lo = labels[m.group(1)]
            body = [t for a, t in ins if lo <= a <= addr]
            count = lambda op: sum(op in " " + t for t in body)
            if count("HGMMA"):
                print(f"{path} {lo:#x}..{addr:#x} n={len(body)} HGMMA={count('HGMMA')} "
                      f"R2UR={count('R2UR')} IMAD={count(' IMAD')} MUFU={count('MUFU')}")
                if order:
                    print("   ", event_order(body))


if __name__ == "__main__":
    main()
