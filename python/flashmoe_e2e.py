#!/usr/bin/env python3
"""End-to-end benchmark of decoder-only models: inference forward, or training steps (--train).

The models are built here with random weights (no downloads): seed 003's small, medium and
large dense models and two MoE models (Mixtral-style blocks, Qwen3-30B-A3B shapes). One
forward pass over `batch x seq` prompt tokens (prefill, causal) is timed per implementation;
the implementations differ only in the attention op and the MoE op, so every other op (the
projections, RMSNorm, RoPE, the LM head) is the same PyTorch code in all of them.

Method, as in the rest of the lab: every implementation of a config is timed in the same
process, interleaved round by round (A B C A B C ...), with CUDA events on one stream. Before
timing, each implementation's logits
pass a correctness gate against an fp32 forward of the same weights (attention by explicit
softmax, MoE by a per-expert loop, routing in fp32), within 1.5x the error of PyTorch's own
bf16 forward of the model (GATE_FACTOR below). Peak memory is the growth of
`torch.cuda.max_memory_allocated` over one forward, above the weights.

With --train, flashmoe_e2e_train.py times training steps (forward, backward, AdamW) of the
same models and implementations and checks their loss curves against each other. The
models, implementations, timer and samples file both use are in flashmoe_e2e_common.py.

The script writes the raw record, OUT/e2e-samples.json (schema "flashmoe-e2e-samples/1":
every timed sample in ms, the gate's metrics and outcome, peak memory, the loss curves);
`flashmoe bench e2e` runs it and turns that file into the lab's results (statistics,
results.json / .md / .csv / report.html, `flashmoe compare`). Run directly:
    python3 python/flashmoe_e2e.py --preset seed003 --out out/e2e
    flashmoe bench e2e --from-samples out/e2e/e2e-samples.json --out out/e2e
"""
import argparse
import math
import os
import sys
import time

import torch

from flashmoe_e2e_common import (DEFAULT_IMPLS, IMPLS, MODELS, PRESETS, VOCAB, Model,
                                 NotApplicable, Timer, attention_reference, build_impl,
                                 finite_or_none, layer_forward, log, median_line, moe_reference,
                                 rms_norm, samples_header, write_samples)


# Correctness gate: relative L2 error of the logits against the fp32 forward of the same
# weights, at most GATE_FACTOR times the error of PyTorch's own bf16 forward (the eager
# implementation, computed for every config whether or not it is timed), clamped to
# [GATE_FLOOR, GATE_CAP] (the floor is for fp32 smoke runs, where eager is exact). bf16 alone
# measures 1-2e-2 on the dense models and 5-10e-2 on the MoE models (in bf16 some tokens
# pick other experts than in fp32); a wrong attention or MoE op gives O(1).
GATE_FACTOR = 1.5
GATE_CAP = 0.25
GATE_FLOOR = 1e-2


def reference_logits(model, ids):
    """The fp32 forward of the same (bf16-rounded) weights, one layer upcast at a time."""
    cos, sin = model.rope(ids.shape[1])
    dims = (model.heads, model.kv_heads, model.head_dim, model.cfg.get("top_k", 0))
    x = model.embed[ids].float()
    for lw in model.layers:
        lw32 = {k: t.float() for k, t in lw.items()}
        x = layer_forward(x, lw32, cos, sin, dims, attention_reference, moe_reference)
        del lw32
    return rms_norm(x, model.ln_f.float()) @ model.lm_head.float()


def rel_l2(a, b):
    a, b = a.double(), b.double()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def logits_error(out, ref, chunk_rows=1024):
    """The logits against the reference: the gate's rel L2 and the lab's other metrics
    (crates/flashmoe/src/accuracy.rs), a row being one token's logits. In row chunks: the
    logits of a large batch are ~10^9 values, and fp64 copies of them all would not fit
    beside the model."""
    o_all = out.reshape(-1, out.shape[-1])
    r_all = ref.reshape(-1, ref.shape[-1])
    rows = o_all.shape[0]
    ref_max, row_ref = 0.0, []
    for i in range(0, rows, chunk_rows):
        r = r_all[i:i + chunk_rows].double()
        ref_max = max(ref_max, float(r.abs().max()))
        row_ref.append(torch.linalg.vector_norm(r, dim=-1))
    row_ref = torch.cat(row_ref)
    ref_l2 = float(torch.linalg.vector_norm(row_ref))
    row_floor = max(float(torch.sqrt((row_ref ** 2).mean())) / 16, 1e-30)
    el_floor = max(1e-3 * ref_max, 1e-30)
    non_finite, n_finite, sum_abs, sum_sq, max_abs, max_rel = 0, 0, 0.0, 0.0, 0.0, 0.0
    worst, worst_err = 0, -1.0
    for i in range(0, rows, chunk_rows):
        o, r = o_all[i:i + chunk_rows].double(), r_all[i:i + chunk_rows].double()
        finite = torch.isfinite(o)
        non_finite += int((~finite).sum())
        n_finite += int(finite.sum())
        d = torch.where(finite, (o - r).abs(), torch.zeros((), dtype=o.dtype, device=o.device))
        sum_abs += float(d.sum())
        sum_sq += float((d * d).sum())
        max_abs = max(max_abs, float(d.max()))
        max_rel = max(max_rel, float((d / torch.clamp(r.abs(), min=el_floor)).max()))
        row_err = torch.linalg.vector_norm(d, dim=-1) / torch.clamp(row_ref[i:i + chunk_rows],
                                                                   min=row_floor)
        k = int(torch.argmax(row_err))
        if float(row_err[k]) > worst_err:
            worst, worst_err = i + k, float(row_err[k])
    err = math.sqrt(sum_sq) / ref_l2 if non_finite == 0 and ref_l2 > 0 else float("nan")
    return dict(rel_l2=finite_or_none(err), max_abs=max_abs,
                mean_abs=sum_abs / max(n_finite, 1), max_rel=max_rel, non_finite=non_finite,
                max_row_rel_l2=worst_err, worst_row=worst)


def peak_extra_bytes(device, fn):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return int(peak)


def run_config(model, batch, seq, impls, args):
    device = model.device
    g = torch.Generator(device=device)
    g.manual_seed(args.seed + 7919 * batch + seq)
    ids = torch.randint(0, VOCAB, (batch, seq), device=device, generator=g)
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = reference_logits(model, ids)
        bf16_err = rel_l2(build_impl("eager", model)(ids), ref)
    ref_s = time.perf_counter() - t0
    gate = min(GATE_CAP, max(GATE_FLOOR, GATE_FACTOR * bf16_err)) if math.isfinite(bf16_err) else GATE_CAP
    rows, live = {}, {}
    for name in impls:
        row = rows[name] = dict(name=name, status="ok", notes=[], samples_ms=[])
        try:
            fwd = build_impl(name, model)
            with torch.no_grad():
                t1 = time.perf_counter()
                logits = fwd(ids)  # first call: compiles where compiled
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row["first_call_ms"] = (time.perf_counter() - t1) * 1e3
                row["logits"] = logits_error(logits, ref)
                del logits
            err = row["logits"]["rel_l2"]
            if err is None or not err <= gate:
                row["status"] = "failed-gate"
                row["notes"].append(f"logits rel L2 {err:.3g} vs fp32 forward (gate {gate:.3g})"
                                    if err is not None else "non-finite logits")
                continue
            with torch.no_grad():
                for _ in range(args.warmup):
                    fwd(ids)
                row["peak_extra_bytes"] = peak_extra_bytes(device, lambda: fwd(ids))
            live[name] = fwd
        except NotApplicable as e:
            row.update(status="n/a", notes=[str(e)])
        except torch.cuda.OutOfMemoryError as e:
            row.update(status="oom", notes=[str(e).splitlines()[0]])
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - reported per implementation, the run goes on
            row.update(status="error", notes=[f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"])
    # Interleaved rounds until the time budget or the round cap.
    timer = Timer(device)
    t_start = time.perf_counter()
    rounds = 0
    with torch.no_grad():
        while live and rounds < args.max_rounds and (
                rounds < args.min_rounds or time.perf_counter() - t_start < args.max_time):
            for name, fwd in live.items():
                rows[name]["samples_ms"].append(timer(lambda: fwd(ids)) * 1e3)
            rounds += 1
    return dict(model=model.name, shape=model.shape(), batch=batch, seq=seq,
                weight_bytes=model.weight_bytes(), reference_s=ref_s, rounds=rounds,
                sampling_s=time.perf_counter() - t_start,
                bf16_rel_l2=finite_or_none(bf16_err), gate_rel_l2=gate,
                implementations=[rows[n] for n in impls])


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="seed003", choices=sorted(PRESETS))
    ap.add_argument("--models", help="comma-separated model names: only these of the preset")
    ap.add_argument("--only", help="comma-separated MODEL:BATCHxSEQ: only these configs of the preset")
    ap.add_argument("--impl", default=",".join(DEFAULT_IMPLS),
                    help=f"comma-separated, of: {', '.join(IMPLS)}")
    ap.add_argument("--out", default="out/e2e")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--min-rounds", type=int, default=5)
    ap.add_argument("--max-rounds", type=int, default=30)
    ap.add_argument("--max-time", type=float, default=3.0, help="seconds of timed rounds per config")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU (smoke runs)")
    ap.add_argument("--train", action="store_true",
                    help="time training steps (forward, backward, AdamW) and check the loss "
                         "curves (flashmoe_e2e_train.py) instead of the inference forward")
    ap.add_argument("--steps", type=int, default=100,
                    help="--train: steps per implementation (the loss curve's length)")
    ap.add_argument("--lr", type=float, default=None,
                    help="--train: AdamW's peak learning rate (default: flashmoe_e2e_train's "
                         "LEARNING_RATE)")
    args = ap.parse_args(argv)
    impls = [s for s in args.impl.split(",") if s]
    for n in impls:
        if n not in IMPLS:
            ap.error(f"unknown implementation '{n}' (known: {', '.join(IMPLS)})")
    if not args.cpu and not torch.cuda.is_available():
        ap.error("no CUDA device visible to PyTorch: pass --cpu for a smoke run")
    device = torch.device("cpu" if args.cpu else "cuda")
    dtype = torch.float32 if args.cpu else torch.bfloat16
    configs = PRESETS[args.preset]
    if args.models:
        keep = set(args.models.split(","))
        configs = [c for c in configs if c[0] in keep]
    if args.only:
        keep = set(args.only.split(","))
        configs = [c for c in configs if f"{c[0]}:{c[1]}x{c[2]}" in keep]
    if not configs:
        ap.error("no config of the preset matches --models/--only")
    os.makedirs(args.out, exist_ok=True)
    if args.lr is not None and not (args.train and math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr {args.lr}: a learning rate above 0, for --train only")
    if args.train:
        if args.steps <= args.warmup:
            ap.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
        import flashmoe_e2e_train
        return flashmoe_e2e_train.run(args, configs, device, dtype, impls, args.out)
    result = samples_header("inference", args, device, dtype, dict(
        warmup=args.warmup, min_rounds=args.min_rounds, max_rounds=args.max_rounds,
        max_time_s=args.max_time, gate_factor=GATE_FACTOR, gate_floor=GATE_FLOOR,
        gate_cap=GATE_CAP))
    model = None
    for name, batch, seq in configs:
        if model is None or model.name != name:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = Model(name, MODELS[name], dtype, device, args.seed)
            log(f"model {name}: {model.weight_bytes() / 2**30:.2f} GiB of weights")
        c = run_config(model, batch, seq, impls, args)
        result["configs"].append(c)
        for r in c["implementations"]:
            log(f"  {name} b{batch} s{seq} {r['name']:>20}: {median_line(r)} {'; '.join(r['notes'])}")
        write_samples(result, args.out)
    log(f"wrote {write_samples(result, args.out)}")
    failed = [(c["model"], r["name"]) for c in result["configs"] for r in c["implementations"]
              if r["status"] in ("failed-gate", "error")]
    if failed:
        log(f"FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
