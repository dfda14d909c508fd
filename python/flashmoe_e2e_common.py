#!/usr/bin/env python3
"""What the end-to-end drivers share: the decoder models (seed 003's dense sizes and the
MoE stacks) with random weights, the implementations that differ only in their attention
and MoE ops (`build_impl`), the fp32 reference ops, the timer and the samples file
(OUT/e2e-samples.json, schema "flashmoe-e2e-samples/1").

Imported by flashmoe_e2e.py (the command line and the inference forward) and
flashmoe_e2e_train.py (training steps and loss curves); it imports neither.
"""
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
    # A deliberately wrong backward (the attention's dK dropped, as a kernel that never
    # writes it): the training gate must fail it. Never a baseline.
    "planted-wrong-dk": ("planted-wrong-dk", "grouped-mm", False),
}
PLANTED = "planted-wrong-dk"
BASELINES = [n for n in IMPLS if not n.startswith("flashmoe") and n != PLANTED]
DEFAULT_IMPLS = ["eager", "sdpa-flash", "sdpa-cudnn", "flashmoe"]


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


class _DropGrad(torch.autograd.Function):
    """Identity forward; the backward returns a zero gradient (the planted bug)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(g)


def attention_planted_wrong_dk(q, k, v):
    """The math attention with dK dropped: right forward, wrong backward."""
    return attention_math(q, _DropGrad.apply(k), v)


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

# While a list (`record_routing`), every MoE op appends its top-k ids [T, k], layer by layer:
# the training gate's gradient probe compares routings between implementations.
_routing_log = None


class record_routing:
    """Context manager: the MoE ops' top-k ids of the forwards run inside it, in order."""

    def __enter__(self):
        global _routing_log
        _routing_log = []
        return _routing_log

    def __exit__(self, *exc):
        global _routing_log
        _routing_log = None


def _log_routing(ids):
    if _routing_log is not None:
        _routing_log.append(ids.detach())


def route(x, router, top_k):
    scores = torch.softmax(x.float() @ router.float(), dim=-1)
    vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
    w, ids = vals[:, :top_k], idx[:, :top_k]
    _log_routing(ids)
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
        if isinstance(out, (tuple, list)):
            _log_routing(out.topk_ids)
            return out[0]
        return out
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
    elif attn_name == PLANTED:
        attention = attention_planted_wrong_dk
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
