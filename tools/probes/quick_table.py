"""Side-by-side TFLOP/s of one implementation across several `flashmoe bench` results.json
files (an A/B between kernel versions measured in one device call), with cuDNN's figure
from the first file that has it.

    python3 tools/probes/quick_table.py --impl flashmoe-sm90 label=path.json ...
"""
import argparse
import json
import statistics


def medians(path, impl):
    """config label -> (median ms, TFLOP/s) of `impl` in one results.json."""
    out = {}
    for c in json.load(open(path))["configs"]:
        for i in c["implementations"]:
            if i["name"] == impl and i.get("samples_ms"):
                ms = statistics.median(i["samples_ms"])
                out[c["label"]] = (ms, c["flops"] / ms / 1e9)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--impl", default="flashmoe-sm90")
    ap.add_argument("--baseline", default="sdpa-cudnn")
    ap.add_argument("runs", nargs="+", help="label=results.json")
    a = ap.parse_args()
    runs = [r.split("=", 1) for r in a.runs]
    cols = [(lab, medians(p, a.impl)) for lab, p in runs]
    base = {}
    for _, p in runs:
        for k, v in medians(p, a.baseline).items():
            base.setdefault(k, v)
    labels = sorted({k for _, m in cols for k in m}, key=lambda k: list(base).index(k) if k in base else 999)
    print("config | " + " | ".join(f"{lab} TF" for lab, _ in cols) + f" | {a.baseline} TF | ratios vs {a.baseline}")
    for k in labels:
        tf = [m.get(k, (None, None))[1] for _, m in cols]
        b = base.get(k, (None, None))[1]
        ratio = [f"{t / b:.3f}" if t and b else "-" for t in tf]
        print(f"{k} | " + " | ".join(f"{t:.0f}" if t else "-" for t in tf) + f" | {b:.0f} | " + " ".join(ratio) if b else "")


if __name__ == "__main__":
    main()
