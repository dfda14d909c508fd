#!/usr/bin/env python3
"""Probe the baseline worker on a GPU: does its timing agree with triton's do_bench?

Starts python/flashmoe_worker.py exactly as the Rust side does (JSON lines over a pipe),
prepares every attention baseline for D=128, B=4, H=16, S=4096, non-causal and causal
(bf16 by default), takes 30 samples of each through the worker, then times the same SDPA
calls in this process with ``triton.testing.do_bench`` (median) and prints a table with
the difference. The worker's figures should agree with do_bench within 5%.

    python3 tools/probes/worker_gpu_probe.py                  # on the H100
    python3 tools/probes/worker_gpu_probe.py --samples 100 --dtype f16
    python3 tools/probes/worker_gpu_probe.py --device cpu --small   # protocol smoke test, no GPU

Exit status: 0 when every SDPA row that both sides timed agrees within --tolerance,
1 otherwise, 2 when the worker could not start.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.join(os.path.dirname(os.path.dirname(HERE)), "python")
WORKER = os.path.join(PYDIR, "flashmoe_worker.py")
ATTENTION_IMPLS = ["sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "flex", "torch-naive"]


class WorkerClient:
    """Minimal Python client of the worker protocol (the Rust side is runner/python.rs)."""

    def __init__(self, python=sys.executable, device=None):
        env = dict(os.environ)
        if device:
            env["FLASHMOE_WORKER_DEVICE"] = device
        self.proc = subprocess.Popen([python, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=None, env=env, text=True, bufsize=1)
        self.next_id = 1
        self.hello = json.loads(self.proc.stdout.readline() or "null")

    def request(self, op, **kw):
        rid = self.next_id
        self.next_id += 1
        self.proc.stdin.write(json.dumps(dict(kw, id=rid, op=op)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited during '{op}' (status {self.proc.wait()})")
        reply = json.loads(line)
        if reply.get("id") != rid:
            raise RuntimeError(f"reply id {reply.get('id')} for request {rid}")
        return reply

    def close(self):
        try:
            self.request("quit")
        except Exception:  # noqa: BLE001
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def attention_problem(b, h, s, d, causal, dtype):
    return {"kind": "attention", "batch": b, "heads_q": h, "heads_kv": h, "seqlen_q": s, "seqlen_k": s,
            "head_dim": d, "causal": causal, "dtype": dtype, "softmax_scale": None}


def flops(p):
    pairs = p["seqlen_q"] * p["seqlen_k"]
    if p["causal"]:
        pairs = sum(min(p["seqlen_k"], max(0, i + p["seqlen_k"] - p["seqlen_q"] + 1)) for i in range(p["seqlen_q"]))
    return 4.0 * p["batch"] * p["heads_q"] * pairs * p["head_dim"]


def do_bench_sdpa(problem, seed, impls):
    """Median ms of the same SDPA calls, timed by triton.testing.do_bench in this process."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    sys.path.insert(0, PYDIR)
    import flashmoe_inputs as fi

    tensors, checksum = fi.generate_problem(problem, seed)
    dt = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[problem["dtype"]]

    def dev(a):
        if problem["dtype"] == "bf16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
        return torch.from_numpy(a).cuda()

    q, k, v = (dev(tensors[n]).transpose(1, 2).contiguous() for n in ("q", "k", "v"))
    assert q.dtype == dt
    scale = float(np.float32(1.0) / np.sqrt(np.float32(problem["head_dim"])))
    backends = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa-math": SDPBackend.MATH}
    out = {}
    for name in impls:
        if name not in backends:
            continue
        try:
            with sdpa_kernel([backends[name]]):
                fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=problem["causal"], scale=scale)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                single = do_bench(fn, warmup=100, rep=1000, return_mode="median")

                # Ten back-to-back calls per timed region: after the first launch the GPU
                # queue stays full, so host dispatch latency is amortised (not counted).
                def fn10():
                    for _ in range(10):
                        fn()

                amortised = do_bench(fn10, warmup=100, rep=1000, return_mode="median") / 10
                out[name] = (single, amortised)
        except Exception as e:  # noqa: BLE001
            out[name] = f"n/a: {str(e).splitlines()[0][:60]}"
        torch.cuda.empty_cache()
    del q, k, v
    torch.cuda.empty_cache()
    return out, checksum


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=30)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--seed", type=int, default=0x5EED)
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--device", default=None, help="worker device (cpu = protocol smoke test)")
    ap.add_argument("--small", action="store_true", help="B=1 H=2 S=128 D=64 (quick smoke test)")
    ap.add_argument("--impls", default=",".join(ATTENTION_IMPLS))
    ap.add_argument("--no-do-bench", action="store_true")
    args = ap.parse_args()
    impls = [x for x in args.impls.split(",") if x]

    client = WorkerClient(device=args.device)
    h = client.hello
    if not h or not h.get("ok"):
        print("worker cannot run:", (h or {}).get("reason", "no hello"))
        return 2
    v = h["versions"]
    print(f"worker: protocol {h['protocol']}, python {v['python']}, torch {v['torch']}, CUDA {v['cuda']}, "
          f"cuDNN {v['cudnn']}, triton {v['triton']}, GPU {h['gpu']['name']}, timer {h['timer']}, "
          f"flush {h['flush_bytes']} bytes")
    b, hh, s, d = (1, 2, 128, 64) if args.small else (4, 16, 4096, 128)
    rows = []
    tmp = tempfile.mkdtemp(prefix="flashmoe-probe-")
    for causal in (False, True):
        problem = attention_problem(b, hh, s, d, causal, args.dtype)
        worker_ms, notes, checksums = {}, {}, set()
        for name in impls:
            t0 = time.perf_counter()
            r = client.request("prepare", impl=name, problem=problem, seed=args.seed)
            if not r["ok"]:
                worker_ms[name] = f"{r['kind']}: {r['error'][:70]}"
                continue
            checksums.add(r["input_checksum"])
            c = client.request("run_for_check", handle=r["handle"], dir=tmp)
            if not c["ok"]:
                worker_ms[name] = f"check {c['kind']}: {c['error'][:60]}"
            else:
                for f in c["files"].values():
                    os.unlink(f["path"])
                client.request("sample", handle=r["handle"], n=max(3, args.samples // 3))  # warm-up
                sm = client.request("sample", handle=r["handle"], n=args.samples)
                worker_ms[name] = statistics.median(sm["ms"]) if sm["ok"] else f"{sm['kind']}: {sm['error'][:60]}"
                notes[name] = "; ".join(c.get("notes") or r.get("notes") or [])
            client.request("release", handle=r["handle"])
            print(f"  {name:15s} causal={causal!s:5s} prepared+timed in {time.perf_counter() - t0:.1f} s"
                  + (f" [spin {r['spin_us']:.0f} us, dispatch {r['dispatch_us']:.0f} us]" if r["ok"] else ""),
                  file=sys.stderr)
        bench, cs = ({}, None)
        if not args.no_do_bench and h["device"] == "cuda":
            bench, cs = do_bench_sdpa(problem, args.seed, impls)
            if cs not in checksums:
                print(f"warning: checksum of the probe's inputs {cs} differs from the worker's {checksums}")
        for name in impls:
            rows.append((name, causal, worker_ms.get(name), bench.get(name), notes.get(name, ""), flops(problem)))
    client.close()

    print()
    print(f"B={b} H={hh} S={s} D={d} {args.dtype}, {args.samples} worker samples, do_bench median")
    print(f"{'implementation':15s} {'causal':6s} {'worker ms':>10s} {'TFLOP/s':>8s} {'do_bench ms':>11s} "
          f"{'diff':>7s} {'do_bench x10/10':>15s} {'diff':>7s}  verdict")
    bad = 0
    for name, causal, wm, bm, note, fl in rows:
        wtxt = f"{wm:10.4f}" if isinstance(wm, float) else f"{'-':>10s}"
        tf = f"{fl / (wm * 1e-3) / 1e12:8.1f}" if isinstance(wm, float) else f"{'-':>8s}"
        bm, bm10 = bm if isinstance(bm, tuple) else (bm, None)
        btxt = f"{bm:11.4f}" if isinstance(bm, float) else f"{'-':>11s}"
        b10txt = f"{bm10:15.4f}" if isinstance(bm10, float) else f"{'-':>15s}"
        if isinstance(wm, float) and isinstance(bm, float):
            diff = (wm - bm) / bm
            diff10 = (wm - bm10) / bm10 if isinstance(bm10, float) else float("nan")
            if abs(diff) <= args.tolerance:
                verdict = "agrees"
            elif abs(diff10) <= args.tolerance:
                verdict = (f"agrees once launch latency is amortised: do_bench counts "
                           f"{(bm - bm10) * 1e3:.0f} us of host dispatch")
            else:
                verdict = f"DISAGREES (> {args.tolerance:.0%})"
                bad += 1
            dtxt = f"{diff:+7.1%}"
            d10txt = f"{diff10:+7.1%}"
        else:
            dtxt = d10txt = f"{'':>7s}"
            verdict = wm if isinstance(wm, str) else (bm if isinstance(bm, str) else "")
        print(f"{name:15s} {str(causal):6s} {wtxt} {tf} {btxt} {dtxt} {b10txt} {d10txt}  {verdict}")
        if note:
            print(f"{'':15s} note: {note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
