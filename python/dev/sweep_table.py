"""Markdown table of one `flashmoe bench` results.json: the candidate's TFLOP/s and % of
the run's measured GEMM ceiling, then every other implementation's TFLOP/s and the
candidate's speedup over it with the 95 % bootstrap CI (as BENCHMARKS.md shows them).

    python3 python/dev/sweep_table.py results/attention-sweep-bf16-sm90-h100.json
"""
import json
import statistics
import sys


def main(path):
    d = json.load(open(path))
    ceiling = d["ceilings"]["gemm_tflops"]
    cand = d["candidate"]
    others = []
    for c in d["configs"]:
        for i in c["implementations"]:
            if i["name"] != cand and i["name"] not in others:
                others.append(i["name"])
    print(f"| config | {cand} TF/s | % GEMM ceiling | " + " | ".join(f"{o} TF/s | vs {o} [95% CI]" for o in others) + " |")
    print("|---" * (3 + 2 * len(others)) + "|")
    for c in d["configs"]:
        tf = {}
        for i in c["implementations"]:
            if i.get("samples_ms"):
                tf[i["name"]] = c["flops"] / statistics.median(i["samples_ms"]) / 1e9
        sp = {x["baseline"]: x["comparison"]["speedup"] for x in c["comparisons"] if x.get("comparison")}
        p = c["problem"]
        label = f"D={p['head_dim']} S={p['seqlen_q']}" + (" causal" if p["causal"] else "")
        if p["seqlen_k"] != p["seqlen_q"] or p["heads_kv"] != p["heads_q"]:
            label = c["label"]
        row = [label, f"{tf.get(cand, 0):.0f}", f"{100 * tf.get(cand, 0) / ceiling:.1f} %"]
        for o in others:
            row.append(f"{tf[o]:.0f}" if o in tf else "n/a")
            s = sp.get(o)
            row.append(f"{s['estimate']:.3f} [{s['low']:.3f}, {s['high']:.3f}]" if s else "n/a")
        print("| " + " | ".join(row) + " |")
    print(f"\nGEMM ceiling of this run: {ceiling:.0f} TFLOP/s ({d['ceilings']['gemm_desc']}).")


if __name__ == "__main__":
    main(sys.argv[1])
