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
same models and implementations and checks their loss curves against each other.

The script writes the raw record, OUT/e2e-samples.json (schema "flashmoe-e2e-samples/1":
every timed sample in ms, the gate's metrics and outcome, peak memory, the loss curves);
`flashmoe bench e2e` runs it and turns that file into the lab's results (statistics,
results.json / .md / .csv / report.html, `flashmoe compare`). Run directly:
    python3 python/flashmoe_e2e.py --preset seed003 --out out/e2e
    flashmoe bench e2e --from-samples out/e2e/e2e-samples.json --out out/e2e
"""
import argparse
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
    # SDPA's math backend: runs on any device (a CPU smoke run's second implementation).
    "sdpa-math": ("sdpa-math", "grouped-mm", False),
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

    def shape(self):
        """The shape as the samples file records it (crates/flashmoe-bench/src/e2e.rs)."""
        c = self.cfg
        return dict(layers=c["layers"], hidden=self.hidden, heads=self.heads,
                    kv_heads=self.kv_heads, head_dim=self.head_dim, ffn=c.get("ffn"),
                    experts=c.get("experts"), top_k=c.get("top_k"), moe_ffn=c.get("moe_ffn"),
                    vocab=VOCAB)

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


def finite_or_none(x):
    """JSON has no NaN: a non-finite measurement is written as null."""
    return x if x is not None and math.isfinite(x) else None


# ---------------------------------------------------------------------------------------
# Timing
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


# ---------------------------------------------------------------------------------------
# The samples file
# ---------------------------------------------------------------------------------------

SAMPLES_SCHEMA = "flashmoe-e2e-samples/1"
SAMPLES_FILE = "e2e-samples.json"


def samples_header(mode, args, device, dtype, settings):
    """The run's part of the samples file: what the Rust side needs besides the configs."""
    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken: not recorded
            return ""
    cuda = device.type == "cuda"
    return dict(schema=SAMPLES_SCHEMA, mode=mode, preset=args.preset, seed=args.seed,
                dtype=str(dtype).replace("torch.", ""),
                timer="cuda events (torch.cuda.Event) on one stream" if cuda
                else "host clock (time.perf_counter)",
                python=dict(python=platform.python_version(), torch=torch.__version__,
                            cuda=torch.version.cuda or "",
                            cudnn=str(torch.backends.cudnn.version() or "") if cuda else "",
                            triton=version("triton") if cuda else "",
                            device=device_name(device)),
                settings=settings, configs=[])


def jsonable(x):
    """`x` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(x, float):
        return finite_or_none(x)
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def write_samples(result, out):
    """OUT/e2e-samples.json, replaced atomically (a config at a time)."""
    path = os.path.join(out, SAMPLES_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(jsonable(result), f, indent=1, allow_nan=False)
    os.replace(tmp, path)
    return path


def device_name(device):
    return torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"


def median_line(r, unit="ms"):
    return f"{float(np.median(r['samples_ms'])):.2f} {unit}" if r["samples_ms"] else r["status"]


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
