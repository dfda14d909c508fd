#!/usr/bin/env python3
"""End-to-end benchmark of decoder-only models: inference forward, or training steps (--train).

The models are built here with random weights (no downloads): seed 003's small, medium and
large dense models and two MoE models (Mixtral-style blocks, Qwen3-30B-A3B shapes). One
forward pass over `batch x seq` prompt tokens (prefill, causal) is timed per implementation;
the implementations differ only in the attention op and the MoE op, so every other op (the
projections, RMSNorm, RoPE, the LM head) is the same PyTorch code in all of them.

Method, as in the rest of the lab: every implementation of a config is timed in the same
process, interleaved round by round (A B C A B C ...), with CUDA events on one stream; the
figure is the median with a 95% bootstrap CI. Before timing, each implementation's logits
pass a correctness gate against an fp32 forward of the same weights (attention by explicit
softmax, MoE by a per-expert loop, routing in fp32), within 1.5x the error of PyTorch's own
bf16 forward of the model (GATE_FACTOR below). Peak memory is the growth of
`torch.cuda.max_memory_allocated` over one forward, above the weights.

With --train, flashmoe_e2e_train.py times training steps (forward, backward, AdamW) of the
same models and implementations and checks their loss curves against each other.

`flashmoe bench e2e` runs this script; it can also be run directly:
    python3 python/flashmoe_e2e.py --preset seed003 --out out/e2e
"""
import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# Dense models: seed 003's three sizes (layers, hidden, heads); the MLP is SwiGLU with
# LLaMA's ratios (the large model's 11008 is the GEMM seed 003 names), vocab 32000.
# MoE models keep the real models' per-layer shapes with fewer layers, so the weights fit
# one GPU next to the fp32 reference; tokens/s is of the stack as built (layers recorded).
MODELS = {
    "small": dict(layers=12, hidden=768, heads=12, kv_heads=12, ffn=2048),
    "medium": dict(layers=24, hidden=2048, heads=16, kv_heads=16, ffn=5632),
    "large": dict(layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008),
    # Mixtral 8x7B blocks: GQA 32/8, 8 experts of intermediate 14336, top-2 (of 32 layers).
    "mixtral-style": dict(layers=8, hidden=4096, heads=32, kv_heads=8, experts=8, top_k=2,
                          moe_ffn=14336),
    # Qwen3-30B-A3B: hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, top-8
    # (of 48 layers).
    "qwen3-30b-a3b": dict(layers=12, hidden=2048, heads=32, kv_heads=4, head_dim=128,
                          experts=128, top_k=8, moe_ffn=768),
    # Tiny shapes for a smoke run on any device.
    "tiny": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256),
    "tiny-moe": dict(layers=2, hidden=128, heads=4, kv_heads=2, experts=8, top_k=2, moe_ffn=64),
}
VOCAB = 32000

# Seed 003's batch x sequence tables, per model; the MoE models use the large model's.
PRESETS = {
    "seed003": [("small", 1, 128), ("small", 4, 512), ("small", 16, 2048),
                ("medium", 1, 128), ("medium", 4, 512), ("medium", 8, 1024),
                ("large", 1, 128), ("large", 4, 512), ("large", 8, 2048)],
    "moe": [("mixtral-style", 1, 128), ("mixtral-style", 4, 512), ("mixtral-style", 8, 2048),
            ("qwen3-30b-a3b", 1, 128), ("qwen3-30b-a3b", 4, 512), ("qwen3-30b-a3b", 8, 2048)],
    "smoke": [("tiny", 2, 64), ("tiny-moe", 2, 64)],
}
PRESETS["all"] = PRESETS["seed003"] + PRESETS["moe"]

# Implementations: (attention op, MoE op, compiled). "eager" is what a PyTorch user writes
# by hand (HF's eager attention: explicit scores and an fp32 softmax; a per-expert loop as in
# HF's Mixtral block); it is the "PyTorch native" of seed 003's speedup column.
IMPLS = {
    "eager": ("math", "loop", False),
    "sdpa-flash": ("sdpa-flash", "grouped-mm", False),
    "sdpa-cudnn": ("sdpa-cudnn", "grouped-mm", False),
    "flashmoe": ("flashmoe", "flashmoe", False),
    # flashmoe's attention with the PyTorch MoE: the training comparison while an MoE op
    # has no backward, and the attention op's share of a step.
    "flashmoe-attn": ("flashmoe", "grouped-mm", False),
    "sdpa-cudnn+compile": ("sdpa-cudnn", "grouped-mm", True),
    "flashmoe+compile": ("flashmoe", "flashmoe", True),
}
BASELINES = [n for n in IMPLS if not n.startswith("flashmoe")]
DEFAULT_IMPLS = ["eager", "sdpa-flash", "sdpa-cudnn", "flashmoe"]

# Correctness gate: relative L2 error of the logits against the fp32 forward of the same
# weights, at most GATE_FACTOR times the error of PyTorch's own bf16 forward (the eager
# implementation, computed for every config whether or not it is timed), clamped to
# [GATE_FLOOR, GATE_CAP] (the floor is for fp32 smoke runs, where eager is exact). bf16 alone
# measures 1-2e-2 on the dense models and 5-10e-2 on the MoE models (in bf16 some tokens
# pick other experts than in fp32); a wrong attention or MoE op gives O(1).
GATE_FACTOR = 1.5
GATE_CAP = 0.25
GATE_FLOOR = 1e-2


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class NotApplicable(Exception):
    pass


# ---------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------

class Model:
    """Random weights of one decoder-only model, in the layouts flashmoe's ops take:
    linear weights [in, out]; MoE router [H, E], w13 [E, H, 2I] (gate | up), w2 [E, I, H]."""

    def __init__(self, name, cfg, dtype, device, seed):
        self.name, self.cfg, self.dtype, self.device = name, cfg, dtype, device
        self.hidden = cfg["hidden"]
        self.heads, self.kv_heads = cfg["heads"], cfg["kv_heads"]
        self.head_dim = cfg.get("head_dim", self.hidden // self.heads)
        self.moe = "experts" in cfg
        g = torch.Generator(device=device)
        g.manual_seed(seed)

        def w(*shape, fan_in):
            t = torch.empty(*shape, dtype=dtype, device=device)
            return t.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=g)

        h, d = self.hidden, self.head_dim
        qkv_out = (self.heads + 2 * self.kv_heads) * d
        self.embed = w(VOCAB, h, fan_in=1)
        self.layers = []
        for _ in range(cfg["layers"]):
            lw = dict(ln1=torch.ones(h, dtype=dtype, device=device),
                      ln2=torch.ones(h, dtype=dtype, device=device),
                      wqkv=w(h, qkv_out, fan_in=h),
                      wo=w(self.heads * d, h, fan_in=self.heads * d))
            if self.moe:
                e, i = cfg["experts"], cfg["moe_ffn"]
                lw.update(router=w(h, e, fan_in=h), w13=w(e, h, 2 * i, fan_in=h),
                          w2=w(e, i, h, fan_in=i))
            else:
                lw.update(w13=w(h, 2 * cfg["ffn"], fan_in=h), w2=w(cfg["ffn"], h, fan_in=cfg["ffn"]))
            self.layers.append(lw)
        self.ln_f = torch.ones(h, dtype=dtype, device=device)
        self.lm_head = w(h, VOCAB, fan_in=h)

    def weight_bytes(self):
        n = self.embed.numel() + self.ln_f.numel() + self.lm_head.numel()
        n += sum(t.numel() for lw in self.layers for t in lw.values())
        return n * self.embed.element_size()

    def rope(self, seq):
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.head_dim, 2, device=self.device,
                                               dtype=torch.float32) / self.head_dim))
        ang = torch.outer(torch.arange(seq, device=self.device, dtype=torch.float32), inv)
        return torch.cos(ang), torch.sin(ang)


def rms_norm(x, w, eps=1e-6):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def apply_rope(x, cos, sin):
    # x (B, S, H, D), rotate-half convention; cos/sin (S, D/2) in fp32.
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def swiglu(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def layer_forward(x, lw, cos, sin, dims, attention, moe):
    """One pre-norm decoder block; x (B, S, H)."""
    b, s, _ = x.shape
    hq, hkv, d, top_k = dims
    h = rms_norm(x, lw["ln1"])
    qkv = (h @ lw["wqkv"]).view(b, s, hq + 2 * hkv, d)
    q = apply_rope(qkv[:, :, :hq], cos, sin)
    k = apply_rope(qkv[:, :, hq:hq + hkv], cos, sin)
    v = qkv[:, :, hq + hkv:]  # a strided view into the projection's output
    o = attention(q, k, v)
    x = x + o.reshape(b, s, hq * d) @ lw["wo"]
    h = rms_norm(x, lw["ln2"])
    if "router" in lw:
        y = moe(h.view(b * s, -1), lw["router"], lw["w13"], lw["w2"], top_k).view(b, s, -1)
    else:
        y = swiglu(h @ lw["w13"]) @ lw["w2"]
    return x + y


def model_forward(m, ids, attention, moe, layer_fn=layer_forward):
    cos, sin = m.rope(ids.shape[1])
    dims = (m.heads, m.kv_heads, m.head_dim, m.cfg.get("top_k", 0))
    x = m.embed[ids]
    for lw in m.layers:
        x = layer_fn(x, lw, cos, sin, dims, attention, moe)
    return rms_norm(x, m.ln_f) @ m.lm_head


# ---------------------------------------------------------------------------------------
# Attention ops: (B, S, H, D) in, (B, S, Hq, D) out, causal
# ---------------------------------------------------------------------------------------

def attention_math(q, k, v):
    """HF eager attention: explicit scores, additive causal mask, softmax in fp32."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt = kt.repeat_interleave(rep, dim=1)
    vt = vt.repeat_interleave(rep, dim=1)
    scores = (qt @ kt.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    mask = torch.full((s, s), float("-inf"), device=q.device, dtype=scores.dtype).triu(1)
    p = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ vt).transpose(1, 2)


def attention_sdpa(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen = {"sdpa-flash": SDPBackend.FLASH_ATTENTION,
              "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
              "sdpa-math": SDPBackend.MATH}[backend]

    def attn(q, k, v):
        with sdpa_kernel([chosen]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True,
                                               enable_gqa=k.shape[2] != q.shape[2])
        return o.transpose(1, 2)
    return attn


def attention_flashmoe(fm):
    def attn(q, k, v):
        return fm.attention(q, k, v, causal=True)
    return attn


def attention_reference(q, k, v):
    """fp32 attention for the reference forward (inputs already fp32)."""
    return attention_math(q, k, v)


# ---------------------------------------------------------------------------------------
# MoE ops: x (T, H) -> (T, H); softmax scoring, top-k, renormalised weights
# ---------------------------------------------------------------------------------------

def route(x, router, top_k):
    scores = torch.softmax(x.float() @ router.float(), dim=-1)
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    w, ids = vals[:, :top_k], idx[:, :top_k]
    return w / w.sum(dim=-1, keepdim=True), ids


def moe_loop(x, router, w13, w2, top_k):
    """HF Mixtral-style block: a Python loop over the experts (host syncs included)."""
    w, ids = route(x, router, top_k)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        y = swiglu(x[tok] @ w13[e]) @ w2[e]
        out.index_add_(0, tok, y.float() * w[tok, slot].unsqueeze(1))
    return out.to(x.dtype)


def moe_grouped_mm(x, router, w13, w2, top_k):
    """Tokens sorted by expert, torch._grouped_mm for gate/up and down (the lab's baseline)."""
    w, ids = route(x, router, top_k)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0, dtype=torch.int32)
    xs = x.index_select(0, torch.div(order, top_k, rounding_mode="floor"))
    ys = torch._grouped_mm(swiglu(torch._grouped_mm(xs, w13, offs=offs)), w2, offs=offs)
    y = torch.empty_like(ys)
    y[order] = ys
    return (y.view(x.shape[0], top_k, -1).float() * w.unsqueeze(-1)).sum(dim=1).to(x.dtype)


def moe_flashmoe(fm):
    def moe(x, router, w13, w2, top_k):
        out = fm.moe(x, router, w13, w2, top_k=top_k, scoring="softmax", renormalize=True)
        return out[0] if isinstance(out, (tuple, list)) else out
    return moe


def moe_reference(x, router, w13, w2, top_k):
    """fp32 reference: the loop, in fp32 (inputs already fp32)."""
    return moe_loop(x, router, w13, w2, top_k)


# ---------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------

def import_flashmoe():
    try:
        import flashmoe as fm
    except ImportError as e:
        raise NotApplicable(f"the flashmoe Python package is not importable ({e})") from e
    if not hasattr(fm, "attention") or not hasattr(fm, "moe"):
        raise NotApplicable("the flashmoe package has no attention/moe ops")
    return fm


def build_impl(name, model):
    """Returns forward(ids) -> logits for one implementation, or raises NotApplicable."""
    attn_name, moe_name, compiled = IMPLS[name]
    if attn_name == "math":
        attention = attention_math
    elif attn_name.startswith("sdpa"):
        if model.device.type != "cuda" and attn_name != "sdpa-math":
            raise NotApplicable(f"{attn_name} needs a CUDA device")
        attention = attention_sdpa(attn_name)
    else:
        attention = attention_flashmoe(import_flashmoe())
    if moe_name == "loop":
        moe = moe_loop
    elif moe_name == "grouped-mm":
        if not hasattr(torch, "_grouped_mm"):
            raise NotApplicable(f"torch._grouped_mm not in torch {torch.__version__}")
        moe = moe_grouped_mm
    else:
        moe = moe_flashmoe(import_flashmoe())
    layer_fn = layer_forward
    if compiled:
        # One compiled block serves every layer: the weights are arguments, not constants.
        layer_fn = torch.compile(layer_forward, dynamic=False)
    return lambda ids: model_forward(model, ids, attention, moe, layer_fn)


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


# ---------------------------------------------------------------------------------------
# Timing and statistics
# ---------------------------------------------------------------------------------------

class Timer:
    """Elapsed time of one call: CUDA events on the current stream, else the host clock."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e-3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def bootstrap_median_ci(x, rng, reps=2000, level=0.95):
    x = np.asarray(x)
    meds = np.median(rng.choice(x, size=(reps, len(x)), replace=True), axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(np.median(x)), float(lo), float(hi)


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


def run_config(model, batch, seq, impls, args, rng):
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
        row = rows[name] = dict(impl=name, status="ok", notes=[])
        try:
            fwd = build_impl(name, model)
            with torch.no_grad():
                t1 = time.perf_counter()
                logits = fwd(ids)  # first call: compiles where compiled
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - t1
                finite = bool(torch.isfinite(logits).all())
                err = rel_l2(logits, ref) if finite else float("nan")
                del logits
            row["rel_l2"] = err
            if not finite or not err <= gate:
                row["status"] = "failed-gate"
                row["notes"].append(f"logits rel L2 {err:.3g} vs fp32 forward (gate {gate:.3g})"
                                    if finite else "non-finite logits")
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
    timer, samples = Timer(device), {n: [] for n in live}
    t_start = time.perf_counter()
    rounds = 0
    with torch.no_grad():
        while live and rounds < args.max_rounds and (
                rounds < args.min_rounds or time.perf_counter() - t_start < args.max_time):
            for name, fwd in live.items():
                samples[name].append(timer(lambda: fwd(ids)))
            rounds += 1
    tokens = batch * seq
    for name, xs in samples.items():
        med, lo, hi = bootstrap_median_ci(xs, rng)
        rows[name].update(samples=len(xs), median_s=med, ci_lo_s=lo, ci_hi_s=hi,
                          tokens_per_s=tokens / med, tokens_per_s_ci=[tokens / hi, tokens / lo])
    derive(rows)
    return dict(model=model.name, layers=model.cfg["layers"], batch=batch, seq=seq,
                tokens=tokens, reference_s=ref_s, rounds=rounds, bf16_rel_l2=bf16_err,
                gate_rel_l2=gate,
                implementations=[rows[n] for n in impls])


def derive(rows):
    """Seed 003's columns: speedup vs PyTorch native (eager), % of the best baseline."""
    timed = {n: r for n, r in rows.items() if "median_s" in r}
    eager = timed.get("eager")
    base = [r for n, r in timed.items() if n in BASELINES]
    best = min(base, key=lambda r: r["median_s"]) if base else None
    for r in timed.values():
        if eager:
            r["speedup_vs_eager"] = eager["median_s"] / r["median_s"]
        if best:
            r["reference"] = best["impl"]
            r["pct_of_reference"] = 100.0 * best["median_s"] / r["median_s"]


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------

def fmt_ms(s):
    return f"{s * 1e3:.2f}"


def markdown(result):
    out = [f"# End-to-end inference ({result['preset']})", "",
           f"Device: {result['device']}; torch {result['torch']}; dtype {result['dtype']}; "
           f"one prefill forward of batch x seq tokens, logits of every token; median of interleaved "
           f"rounds with a 95% bootstrap CI; gate: logits rel L2 vs an fp32 forward of the same weights "
           f"at most {GATE_FACTOR}x that of PyTorch's eager bf16 forward (and <= {GATE_CAP}).",
           ""]
    for c in result["configs"]:
        out.append(f"## {c['model']} ({c['layers']} layers), batch {c['batch']} x seq {c['seq']}")
        out.append("")
        out.append(f"Gate: rel L2 <= {c['gate_rel_l2']:.3g} (eager bf16: {c['bf16_rel_l2']:.3g}).")
        out.append("")
        out.append("| implementation | ms (95% CI) | tokens/s | vs eager | % of ref | logits rel L2 "
                   "| peak extra MiB | status |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in c["implementations"]:
            if "median_s" in r:
                ms = f"{fmt_ms(r['median_s'])} ({fmt_ms(r['ci_lo_s'])}–{fmt_ms(r['ci_hi_s'])})"
                tps = f"{r['tokens_per_s']:,.0f}"
                sp = f"{r['speedup_vs_eager']:.2f}×" if "speedup_vs_eager" in r else "–"
                pct = f"{r['pct_of_reference']:.0f}% ({r['reference']})" if "reference" in r else "–"
            else:
                ms = tps = sp = pct = "–"
            err = f"{r['rel_l2']:.2e}" if "rel_l2" in r else "–"
            mem = (f"{r['peak_extra_bytes'] / 2**20:,.0f}"
                   if r.get("peak_extra_bytes") is not None else "–")
            status = r["status"] + ("" if not r["notes"] else ": " + "; ".join(r["notes"]))
            out.append(f"| {r['impl']} | {ms} | {tps} | {sp} | {pct} | {err} | {mem} | {status} |")
        out.append("")
    return "\n".join(out)


def html(result, md):
    """A Markdown report `md` of `result` as one self-contained HTML page (tables only)."""
    import html as h
    body, table = [], None
    for line in md.split("\n"):
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= set("-: ") for c in cells):
                continue
            tag = "th" if table is None else "td"
            if table is None:
                table = []
            table.append("<tr>" + "".join(f"<{tag}>{h.escape(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if table is not None:
            body.append("<table>" + "".join(table) + "</table>")
            table = None
        if line.startswith("## "):
            body.append(f"<h2>{h.escape(line[3:])}</h2>")
        elif line.startswith("# "):
            body.append(f"<h1>{h.escape(line[2:])}</h1>")
        elif line:
            body.append(f"<p>{h.escape(line)}</p>")
    if table is not None:
        body.append("<table>" + "".join(table) + "</table>")
    style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right}td:first-child,th:first-child{text-align:left}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>flashmoe e2e "
            f"({h.escape(result['preset'])})</title><style>{style}</style></head><body>"
            + "\n".join(body) + "</body></html>\n")


def write_reports(result, out, to_markdown=markdown):
    md = to_markdown(result)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(out, "report.html"), "w") as f:
        f.write(html(result, md))


def device_name(device):
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"


def report_renderer(result):
    """The Markdown renderer of a results.json: inference or training steps."""
    if result.get("mode") == "train":
        import flashmoe_e2e_train
        return flashmoe_e2e_train.markdown
    return markdown


def main(argv):
    if argv[:1] == ["--render"]:
        # Re-render a results.json's Markdown and HTML next to it: NAME.md, NAME.html.
        for path in argv[1:]:
            with open(path) as f:
                result = json.load(f)
            stem = path[:-5] if path.endswith(".json") else path
            md = report_renderer(result)(result)
            with open(stem + ".md", "w") as f:
                f.write(md + "\n")
            with open(stem + ".html", "w") as f:
                f.write(html(result, md))
            log(f"wrote {stem}.md, {stem}.html")
        return 0
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
    if args.train:
        if args.steps <= args.warmup:
            ap.error(f"--steps {args.steps} leaves no timed step after --warmup {args.warmup}")
        import flashmoe_e2e_train
        return flashmoe_e2e_train.run(args, configs, device, dtype, impls, args.out)
    rng = np.random.default_rng(args.seed)
    result = dict(schema="flashmoe-e2e/1", preset=args.preset,
                  device=device_name(device),
                  torch=torch.__version__, dtype=str(dtype).replace("torch.", ""),
                  gate_factor=GATE_FACTOR, gate_cap=GATE_CAP, configs=[])
    model = None
    for name, batch, seq in configs:
        if model is None or model.name != name:
            model = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
            model = Model(name, MODELS[name], dtype, device, args.seed)
            log(f"model {name}: {model.weight_bytes() / 2**30:.2f} GiB of weights")
        c = run_config(model, batch, seq, impls, args, rng)
        c["weight_bytes"] = model.weight_bytes()
        result["configs"].append(c)
        for r in c["implementations"]:
            t = f"{fmt_ms(r['median_s'])} ms" if "median_s" in r else r["status"]
            log(f"  {name} b{batch} s{seq} {r['impl']:>20}: {t} {'; '.join(r['notes'])}")
        write_reports(result, args.out)
    write_reports(result, args.out)
    print(markdown(result))
    failed = [(c["model"], r["impl"]) for c in result["configs"] for r in c["implementations"]
              if r["status"] in ("failed-gate", "error")]
    if failed:
        log(f"FAILED: {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
