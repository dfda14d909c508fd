#!/usr/bin/env python3
"""Per-loop instruction counts of an nvdisasm listing: for every backward branch whose body
holds HGMMA, the body's size and its R2UR / IMAD / MUFU counts (docs/perf-notes.md §7.5b).

  nvdisasm -c kernel.cubin > k.sass      # nvdisasm: CUDA toolkit or pip nvidia-cuda-nvdisasm
  python3 python/dev/sass_loops.py k.sass [more.sass ...]

Cubins of the sm_90a attention kernel: python/dev/nvrtc_check.py (Nvrtc.compile).
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


def main():
    for path in sys.argv[1:]:
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


if __name__ == "__main__":
    main()
