#!/usr/bin/env python3
"""A/A calibration of the lab's regression gates on this machine (issue 24, item 5).

Measures, over N pairs, how often a gate cries REGRESSION when nothing changed (false
positives) and how often it catches an injected 10% slowdown of `cpu-tiled` (detection):

* mode `files`: separate runs of `flashmoe bench attention --preset quick --cpu` compared
  with `flashmoe compare --threshold 5%` (the calibration/ENV-DRIFT verdict). Each pair
  is three runs in shuffled order: A, A' (same binary) and S (A with the test-only knob
  FLASHMOE_TEST_SLOWDOWN=cpu-tiled:10%); A/A = compare A A', slowdown = compare A S.
* mode `against`: `flashmoe bench ... --against BINARY` with the same binary as its own
  old build (A/A), and again with the knob set for the driving (new) process only.
  Sampling goes on until every change's CI resolves the threshold band, up to
  `--against-max-time` (pass it in --bench-args to change the default cap); each row
  records whether it resolved and how its config's sampling stopped.

`--gpu` runs the same calibration on the GPU path (no `--cpu`; the slowed implementation
defaults to `flashmoe-sm90`; on the GPU the knob scales that implementation's reported
CUDA-event times in this build's `serve` child, docs/regression-gate.md). Example for
one H100, mode against only:

    scripts/aa-calibration.py --gpu --pairs 20 --mode against \
        --bench-args '--no-baselines' --out results/aa-calibration-against-h100

Writes OUT.json (every pair: exit codes, per-row verdicts) and OUT.md (the rates). Uses only
the standard library. Example:

    scripts/aa-calibration.py --pairs 20 --mode files --out results/aa-calibration
"""

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time

KNOB = "FLASHMOE_TEST_SLOWDOWN"
SLOWED = "cpu-tiled"  # --slowed; flashmoe-sm90 by default with --gpu
DEVICE_ARGS = ["--cpu"]  # [] with --gpu


def run(cmd, env=None):
    t0 = time.time()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return p.returncode, time.time() - t0, p.stdout, p.stderr


BENCH_ARGS = []


def bench(binary, out, slow, extra=()):
    env = dict(os.environ)
    env.pop(KNOB, None)
    if slow:
        env[KNOB] = f"{SLOWED}:{slow}"
    cmd = [binary, "bench", "attention", "--preset", "quick", *DEVICE_ARGS, "--out", out, *BENCH_ARGS, *extra]
    rc, secs, so, se = run(cmd, env)
    if rc not in (0, 1, 3):
        sys.exit(f"bench failed ({rc}): {' '.join(cmd)}\n{se[-2000:]}")
    return rc, secs


def loadavg():
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def rows_of(report):
    return [
        {
            "config": c["config_id"],
            "impl": c["implementation"],
            "change": 1.0 / c["comparison"]["speedup"]["estimate"] - 1.0,
            "raw": c["comparison"]["verdict"],
            "corrected": (c.get("calibrated") or {}).get("corrected_verdict"),
            "verdict": c["verdict"],
            # --against only: did the CI resolve the band, and how did sampling stop.
            "resolved": c.get("resolved"),
            "stop": c.get("stop"),
        }
        for c in report["changes"]
    ]


def compare(binary, old, new, threshold, tmp):
    path = os.path.join(tmp, "compare.json")
    rc, _, so, se = run([binary, "compare", old, new, "--threshold", threshold, "--json", path])
    if rc not in (0, 1, 3):
        sys.exit(f"compare failed ({rc}):\n{se[-2000:]}")
    with open(path) as f:
        rep = json.load(f)
    rows = rows_of(rep)
    # What the gate would have said without the calibration: any raw SLOWER fails.
    raw_rc = 1 if any(r["raw"] == "SLOWER" for r in rows) else 0
    return {"exit": rc, "exit_without_calibration": raw_rc, "rows": rows}


def against_result(out):
    path = os.path.join(out, "against.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="target/release/flashmoe")
    ap.add_argument("--pairs", type=int, default=20)
    ap.add_argument("--mode", choices=["files", "against"], default="files")
    ap.add_argument("--threshold", default="5%")
    ap.add_argument("--slowdown", default="10%")
    ap.add_argument("--seed", type=int, default=24)
    ap.add_argument("--out", default="results/aa-calibration")
    ap.add_argument("--bench-args", default="",
                    help="extra arguments for every bench run, e.g. '--max-time 12'")
    ap.add_argument("--from-json", help="re-summarise the pairs of an earlier OUT.json (no runs)")
    ap.add_argument("--resume", action="store_true",
                    help="continue OUT.json's pairs up to --pairs (for machines that cap the "
                    "time of one command)")
    ap.add_argument("--gpu", action="store_true",
                    help="the GPU path: no --cpu, slowed implementation flashmoe-sm90 by default")
    ap.add_argument("--slowed", help="implementation the knob slows (default cpu-tiled, "
                    "flashmoe-sm90 with --gpu)")
    a = ap.parse_args()
    global SLOWED
    SLOWED = a.slowed or ("flashmoe-sm90" if a.gpu else "cpu-tiled")
    if a.gpu:
        DEVICE_ARGS.clear()
    if a.from_json:
        with open(a.from_json) as f:
            old = json.load(f)
        meta = old["meta"]
        SLOWED = meta.get("slowed_impl", SLOWED)
        a.mode = meta["mode"]
        summary = summarise(old["pairs"], a)
        meta["resummarised_by"] = " ".join(sys.argv)
        meta.setdefault("pairs", len(old["pairs"]))
        meta.setdefault("partial", False)
        with open(a.out + ".json", "w") as f:
            json.dump({"meta": meta, "summary": summary, "pairs": old["pairs"]}, f, indent=1)
        with open(a.out + ".md", "w") as f:
            f.write(markdown(meta, summary))
        print(markdown(meta, summary))
        return
    binary = os.path.abspath(a.binary)
    a.binary = binary
    BENCH_ARGS.extend(a.bench_args.split())
    pairs = []
    if a.resume and os.path.exists(a.out + ".json"):
        with open(a.out + ".json") as f:
            pairs = json.load(f)["pairs"]
        print(f"resuming after {len(pairs)} pair(s) of {a.out}.json", flush=True)
    rng = random.Random(a.seed + len(pairs))
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="flashmoe-aa-") as tmp:
        for i in range(len(pairs), a.pairs):
            rec = {"pair": i, "load_before": loadavg()}
            if a.mode == "files":
                runs = {"A": None, "B": None, "S": a.slowdown}
                order = list(runs)
                rng.shuffle(order)
                rec["order"] = "".join(order)
                secs = {}
                for name in order:
                    out = os.path.join(tmp, name)
                    _, secs[name] = bench(binary, out, runs[name])
                rec["bench_seconds"] = secs
                A, B, S = (os.path.join(tmp, n, "results.json") for n in "ABS")
                rec["aa"] = compare(binary, A, B, a.threshold, tmp)
                rec["slow"] = compare(binary, A, S, a.threshold, tmp)
            else:
                order = ["aa", "slow"]
                rng.shuffle(order)
                rec["order"] = ",".join(order)
                for name in order:
                    out = os.path.join(tmp, name)
                    extra = ["--against", binary, "--threshold", a.threshold]
                    rc, secs = bench(binary, out, a.slowdown if name == "slow" else None, extra)
                    ag = against_result(out) or {}
                    rec[name] = {
                        "exit": rc,
                        "seconds": secs,
                        "rows": rows_of(ag) if ag else [],
                    }
            rec["load_after"] = loadavg()
            pairs.append(rec)
            write(pairs, a, t_start, partial=i + 1 < a.pairs)
            print(
                f"pair {i + 1}/{a.pairs}: A/A exit {rec['aa']['exit']}, "
                f"slowdown exit {rec['slow']['exit']} (load {rec['load_before']:.1f})",
                flush=True,
            )
    print(markdown(*write(pairs, a, t_start, partial=False)))


def write(pairs, a, t_start, partial):
    """Write OUT.json and OUT.md for the pairs so far (after every pair)."""
    summary = summarise(pairs, a)
    meta = {
        "mode": a.mode,
        "pairs": len(pairs),
        "pairs_planned": a.pairs,
        "partial": partial,
        "threshold": a.threshold,
        "bench_args": a.bench_args,
        "slowdown": f"{SLOWED} {a.slowdown} ({KNOB})",
        "slowed_impl": SLOWED,
        "device": "gpu" if a.gpu else "cpu",
        "binary": os.path.basename(a.binary),
        "command": " ".join(sys.argv),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "wall_seconds": round(time.time() - t_start),
        "finished_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".json", "w") as f:
        json.dump({"meta": meta, "summary": summary, "pairs": pairs}, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write(markdown(meta, summary))
    return meta, summary


def rule_exit(rec):
    """The exit the committed `--against` rule gives for this run's rows: 1 for a SLOWER
    row whose CI resolved the band (or stopped for another reason than a cap), 3 for a
    SLOWER row still unresolved at the cap, else 0. Sampling does not depend on the exit
    mapping, so this re-reads runs made by a binary that exited 1 on any SLOWER."""
    rows = rec.get("rows") or []
    if not rows or all(r.get("resolved") is None for r in rows):
        return rec["exit"]
    slower = [r for r in rows if r["verdict"].upper() == "SLOWER"]
    capped = lambda r: r.get("resolved") is False and r.get("stop") in ("time-cap", "sample-cap")
    if any(not capped(r) for r in slower):
        return 1
    return 3 if slower else 0


def rate(k, n):
    return {"count": k, "of": n, "pct": round(100.0 * k / n, 1) if n else None}


def summarise(pairs, a):
    n = len(pairs)
    aa = [p["aa"] for p in pairs]
    sl = [p["slow"] for p in pairs]
    s = {
        "aa_regression_rule": rate(sum(rule_exit(x) == 1 for x in aa), n),
        "aa_unresolved_rule": rate(sum(rule_exit(x) == 3 for x in aa), n),
        "slow_detected_rule": rate(sum(rule_exit(x) == 1 for x in sl), n),
        "slow_unresolved_rule": rate(sum(rule_exit(x) == 3 for x in sl), n),
        "aa_regression": rate(sum(x["exit"] == 1 for x in aa), n),
        "aa_env_drift": rate(sum(x["exit"] == 3 for x in aa), n),
        "aa_pass": rate(sum(x["exit"] == 0 for x in aa), n),
        "slow_detected": rate(sum(x["exit"] == 1 for x in sl), n),
        "slow_env_drift": rate(sum(x["exit"] == 3 for x in sl), n),
        "slow_missed": rate(sum(x["exit"] == 0 for x in sl), n),
    }
    loads = [p["load_before"] for p in pairs if p.get("load_before") is not None]
    s["mean_load_1min"] = round(sum(loads) / len(loads), 1) if loads else None
    s["load_1min_range"] = f"{min(loads):.1f}–{max(loads):.1f}" if loads else None
    aa_rows = [r for x in aa for r in x["rows"]]
    def v(r):  # "slower" / "env-drift" (compare's JSON) → "SLOWER" / "ENV-DRIFT"
        return r["verdict"].upper()

    s["aa_rows_slower"] = rate(sum(v(r) == "SLOWER" for r in aa_rows), len(aa_rows))
    s["aa_rows_env_drift"] = rate(sum(v(r) == "ENV-DRIFT" for r in aa_rows), len(aa_rows))
    s["aa_rows_not_same"] = rate(sum(v(r) != "SAME" for r in aa_rows), len(aa_rows))
    slowed = [r for x in sl for r in x["rows"] if r["impl"] == SLOWED]
    s["slow_rows_slower"] = rate(sum(v(r) == "SLOWER" for r in slowed), len(slowed))
    s["slow_rows_env_drift"] = rate(sum(v(r) == "ENV-DRIFT" for r in slowed), len(slowed))
    s["slow_detected_on_slowed_impl"] = rate(
        sum(any(v(r) == "SLOWER" and r["impl"] == SLOWED for r in x["rows"]) for x in sl), n
    )
    if any(r.get("resolved") is not None for x in aa + sl for r in x["rows"]):
        s["aa_rows_unresolved"] = rate(
            sum(r.get("resolved") is False for r in aa_rows), len(aa_rows))
        s["slow_rows_unresolved"] = rate(
            sum(r.get("resolved") is False for r in slowed), len(slowed))
    secs = [x["seconds"] for x in aa + sl if "seconds" in x]
    if secs:
        s["bench_seconds_median"] = round(sorted(secs)[len(secs) // 2], 1)
        s["bench_seconds_max"] = round(max(secs), 1)
    changes = sorted(r["change"] for r in slowed)
    if changes:
        s["slow_rows_median_change_pct"] = round(100 * changes[len(changes) // 2], 1)
    if a.mode == "files":
        s["aa_regression_without_calibration"] = rate(
            sum(x["exit_without_calibration"] == 1 for x in aa), n
        )
        s["slow_detected_without_calibration"] = rate(
            sum(x["exit_without_calibration"] == 1 for x in sl), n
        )
    return s


def markdown(meta, s):
    def r(key):
        v = s.get(key)
        return "—" if v is None else f"{v['count']}/{v['of']} ({v['pct']}%)"

    lines = [
        f"# A/A calibration of the regression gate: mode `{meta['mode']}`",
        "",
        f"`bench attention --preset quick {'' if meta.get('device') == 'gpu' else '--cpu '}"
        f"{meta.get('bench_args', '')}`".replace(" `", "`")
        + f": {meta['pairs']} pairs{' (PARTIAL: run stopped early)' if meta.get('partial') else ''} "
        f"on {meta['machine']}, threshold {meta['threshold']}, "
        f"injected slowdown {meta['slowdown']}; mean 1-minute load average before each pair "
        f"{s['mean_load_1min']} (range {s.get('load_1min_range')}); finished {meta['finished_utc']} UTC after "
        f"{meta['wall_seconds']} s. Produced by `{meta['command']}`; every pair's exit codes "
        "and per-row verdicts are in the JSON next to this file.",
        "",
        "| | pairs | goal |",
        "|---|---|---|",
        *([
            f"| A/A exit 1 under the committed rule (SLOWER with a resolved CI) = false positive | {r('aa_regression_rule')} | ≤ 5% |",
            f"| A/A exit 3 under the committed rule (a SLOWER unresolved at the cap: rerun) | {r('aa_unresolved_rule')} | |",
            f"| slowdown exit 1 under the committed rule = detected | {r('slow_detected_rule')} | ≥ 90% |",
            f"| slowdown exit 3 under the committed rule (unresolved at the cap) | {r('slow_unresolved_rule')} | |",
        ] if meta["mode"] == "against" else []),
        f"| A/A exit 1 as run (REGRESSION) = false positive | {r('aa_regression')} | ≤ 5% |",
        f"| A/A exit 3 as run (ENV-DRIFT / UNRESOLVED) | {r('aa_env_drift')} | |",
        f"| A/A exit 0 as run (pass) | {r('aa_pass')} | |",
        f"| slowdown exit 1 as run (REGRESSION) | {r('slow_detected')} | |",
        f"| slowdown: a `{SLOWED}` row SLOWER = detected | {r('slow_detected_on_slowed_impl')} | ≥ 90% |",
        f"| slowdown exit 3 as run (ENV-DRIFT / UNRESOLVED) | {r('slow_env_drift')} | |",
        f"| slowdown exit 0 as run (missed) | {r('slow_missed')} | |",
        "",
        "| rows | |",
        "|---|---|",
        f"| A/A rows SLOWER | {r('aa_rows_slower')} |",
        f"| A/A rows ENV-DRIFT | {r('aa_rows_env_drift')} |",
        f"| A/A rows not SAME | {r('aa_rows_not_same')} |",
        f"| slowed `{SLOWED}` rows SLOWER | {r('slow_rows_slower')} |",
        f"| slowed `{SLOWED}` rows ENV-DRIFT | {r('slow_rows_env_drift')} |",
        f"| slowed `{SLOWED}` rows: median raw change | {s.get('slow_rows_median_change_pct')}% |",
    ]
    if "aa_rows_unresolved" in s:
        lines += [
            f"| A/A rows unresolved at the cap | {r('aa_rows_unresolved')} |",
            f"| slowed `{SLOWED}` rows unresolved at the cap | {r('slow_rows_unresolved')} |",
        ]
    if "bench_seconds_median" in s:
        lines.append(
            f"| seconds per bench run: median / max | {s['bench_seconds_median']} / "
            f"{s['bench_seconds_max']} |"
        )
    if "aa_regression_without_calibration" in s:
        lines += [
            f"| without the calibration (raw verdicts): A/A exit 1 | "
            f"{r('aa_regression_without_calibration')} |",
            f"| without the calibration: slowdown exit 1 | "
            f"{r('slow_detected_without_calibration')} |",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
