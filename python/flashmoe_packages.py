"""Baselines from third-party packages, for the flashmoe worker (``flashmoe_worker.py``).

Each baseline runs only when its package is importable; otherwise the worker's hello
lists it under ``unavailable`` with the reason, and the Rust side leaves it out of the run
with a note. Every one goes through the same ``prepare`` → ``run_for_check`` (gate) →
``sample`` path as the PyTorch baselines; see ``docs/baselines.md``.

Attention (inputs (B, S, H, D), causal bottom-right aligned as in flashmoe):

* ``fa4``: FlashAttention-4, ``flash_attn.cute.flash_attn_func`` (pip ``flash-attn-4``,
  CuTe DSL; on sm_90 it runs FA3's design).
* ``fa3``: FlashAttention-3, ``flash_attn_interface.flash_attn_func`` (built from the
  ``hopper/`` folder of the flash-attention repository).
* ``xformers``: ``xformers.ops.memory_efficient_attention`` (its best forward operator).
* ``flashinfer-prefill``: FlashInfer ``BatchPrefillWithRaggedKVCacheWrapper``.

Varlen (packed q (total_q, H, D), k/v (total_k, Hkv, D), int32 cu_seqlens; o in the same
layout, lse (H, total_q)):

* ``fa4-varlen``: ``flash_attn.cute.flash_attn_varlen_func``.
* ``fa3-varlen``: ``flash_attn_interface.flash_attn_varlen_func``.
* ``flashinfer-varlen``: FlashInfer ``BatchPrefillWithRaggedKVCacheWrapper`` on the offsets.

MLA decode (q (B, Sq, Hq, 576), the latent cache (B, Sk, 576) viewed as pages of 64 with an
identity table; o (B, Sq, Hq, 512); O checked only):

* ``flashinfer-mla``: FlashInfer ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (the latent
  split into its 512-wide ``ckv`` and 64-wide ``kpe`` page tensors).
* ``flash-mla``: DeepSeek's FlashMLA ``flash_mla.flash_mla_with_kvcache`` (page 64 only).

MoE (the reference's routing, then the package's expert computation):

* ``vllm-fused-moe``: vLLM's Triton ``fused_experts``.
* ``sglang-fused-moe``: SGLang's Triton ``fused_experts``.
* ``quack-grouped-gemm``: QuACK's varlen-M grouped GEMM (``quack.gemm_interface.gemm``
  with ``cu_seqlens_m`` and a gather index) for gate/up and down.
"""

import importlib
import importlib.util
import inspect
import math
import time

# name -> (module that must be importable, pip distribution(s) whose version is reported)
PACKAGES = {
    "fa4": ("flash_attn.cute", ("flash-attn-4", "nvidia-cutlass-dsl")),
    "fa3": ("flash_attn_interface", ("flash-attn-3", "flash_attn_3", "flashattn-hopper")),
    "xformers": ("xformers.ops", ("xformers",)),
    "flashinfer-prefill": ("flashinfer", ("flashinfer-python", "flashinfer")),
    "vllm-fused-moe": ("vllm.model_executor.layers.fused_moe", ("vllm",)),
    "sglang-fused-moe": ("sglang.srt.layers.moe.fused_moe_triton", ("sglang",)),
    "quack-grouped-gemm": ("quack.gemm_interface", ("quack-kernels", "nvidia-cutlass-dsl")),
    "fa4-varlen": ("flash_attn.cute", ("flash-attn-4", "nvidia-cutlass-dsl")),
    "fa3-varlen": ("flash_attn_interface", ("flash-attn-3", "flash_attn_3", "flashattn-hopper")),
    "flashinfer-varlen": ("flashinfer", ("flashinfer-python", "flashinfer")),
    "flashinfer-mla": ("flashinfer.mla", ("flashinfer-python", "flashinfer")),
    "flash-mla": ("flash_mla", ("flash-mla", "flash_mla")),
}
ATTENTION = ["fa4", "fa3", "xformers", "flashinfer-prefill"]
MOE = ["vllm-fused-moe", "sglang-fused-moe", "quack-grouped-gemm"]
VARLEN = ["fa4-varlen", "fa3-varlen", "flashinfer-varlen"]
MLA = ["flashinfer-mla", "flash-mla"]


class Unavailable(Exception):
    """The package is missing or rejects this config (the worker reports 'n/a: reason')."""


def _first_line(e):
    s = str(e).strip()
    line = s.splitlines()[0] if s else type(e).__name__
    return line if len(line) <= 200 else line[:200] + "..."


def _find(module):
    """Whether `module` can be found, without importing it (its parents are imported)."""
    try:
        return importlib.util.find_spec(module) is not None, None
    except ModuleNotFoundError:
        return False, None
    except Exception as e:  # noqa: BLE001  (a parent package failed to import)
        return False, _first_line(e)


def distribution_version(names):
    from importlib import metadata
    for n in names:
        try:
            return f"{n} {metadata.version(n)}"
        except Exception:  # noqa: BLE001
            continue
    return None


def availability():
    """({name: reason} for the baselines that cannot run here, [package versions found])."""
    missing, versions = {}, []
    for name, (module, dists) in PACKAGES.items():
        ok, why = _find(module)
        if not ok:
            pip = dists[0]
            missing[name] = f"{module} not importable" + (f" ({why})" if why else f" (pip {pip} not installed)")
            continue
        for d in dists:
            v = distribution_version((d,))
            if v and v not in versions:
                versions.append(v)
    return missing, versions


def _import(name):
    module = PACKAGES[name][0]
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001
        raise Unavailable(f"{module} failed to import: {_first_line(e)}") from e


def _note_version(p, name):
    v = distribution_version(PACKAGES[name][1])
    if v:
        p.notes.append(v)


# ---------------------------------------------------------------------- attention

class Attn:
    """The attention problem as the package builders need it."""

    def __init__(self, torch, q, k, v, b, hq, hkv, sq, sk, d, causal, scale, window=(-1, -1), softcap=0.0):
        self.torch = torch
        self.q, self.k, self.v = q, k, v  # (B, S, H, D) contiguous
        self.b, self.hq, self.hkv, self.sq, self.sk, self.d = b, hq, hkv, sq, sk, d
        self.causal, self.scale = causal, scale
        # (left, right) around the bottom-right diagonal, causal folded in (right 0); -1
        # unbounded. softcap 0 = off.
        self.window, self.softcap = tuple(window), float(softcap)

    def windowed(self):
        """A window edge besides the causal diagonal."""
        return self.window[0] >= 0 or self.window[1] > 0

    def fa_window_kwargs(self, none_for_unbounded):
        """FlashAttention's causal / window_size / softcap arguments (FA4 writes an unbounded
        side as None, FA2/FA3 as -1)."""
        kw = {"causal": self.causal}
        if self.windowed():
            un = None if none_for_unbounded else -1
            kw = {"causal": False,
                  "window_size": tuple(un if w < 0 else w for w in self.window)}
        if self.softcap > 0:
            kw["softcap"] = self.softcap
        return kw

    def expanded_kv(self):
        g = self.hq // self.hkv
        return self.k.repeat_interleave(g, dim=2), self.v.repeat_interleave(g, dim=2)


def _checked_lse(a, p, lse, lse_check, base2_ok=False):
    """The LSE as (B, Hq, Sq) natural log if it passes the spot check, else None (noted)."""
    want = a.b * a.hq * a.sq
    if lse is None or lse.numel() != want:
        p.notes.append(f"LSE not reported: the package returned {None if lse is None else tuple(lse.shape)}")
        return None
    mode = "none" if not a.causal else ("square" if a.sq == a.sk else "lower_right")
    qh, kh = a.q.transpose(1, 2), a.k.transpose(1, 2)
    lse = lse.float().reshape(a.b, a.hq, a.sq)
    extra = {"window": a.window, "softcap": a.softcap}
    ok, why = lse_check(lse, qh, kh, a.scale, mode, a.sq, a.sk, **extra)
    if ok:
        return lse
    if base2_ok:
        lse_e = lse * math.log(2.0)
        ok2, _ = lse_check(lse_e, qh, kh, a.scale, mode, a.sq, a.sk, **extra)
        if ok2:
            if not any("base-2" in n for n in p.notes):
                p.notes.append("the package's LSE is base 2: converted to natural log for the gate")
            return lse_e
    p.notes.append(f"LSE not reported: {why}")
    return None


def _timed_first_call(call):
    """Run the first call (JIT compile for the DSL packages); its time in ms."""
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e3


def build_attention(name, p, a, sync, lse_check):
    """Set p.fn / p.check / p.outputs for the package baseline `name` on problem `a`."""
    if (a.windowed() or a.softcap > 0) and name == "xformers":
        raise Unavailable("xformers: sliding window / softcap not wired into this baseline")
    if name == "fa4":
        _fa4(p, a, sync, lse_check)
    elif name == "fa3":
        _fa3(p, a, lse_check)
    elif name == "xformers":
        _xformers(p, a)
    elif name == "flashinfer-prefill":
        _flashinfer_prefill(p, a, sync, lse_check)
    else:
        raise Unavailable(f"unknown package baseline '{name}'")
    _note_version(p, name)


def _fa4(p, a, sync, lse_check):
    cute = _import("fa4")
    f = cute.flash_attn_func
    q, k, v = a.q, a.k, a.v

    # return_lse in the timed call too: flashmoe's kernel writes the LSE as well, and one
    # compiled variant serves both calls (the LSE is B·H·S floats, noise in the traffic).
    kw = a.fa_window_kwargs(none_for_unbounded=True)

    def fn():
        return f(q, k, v, softmax_scale=a.scale, return_lse=True, **kw)

    try:
        p.compile_ms = _timed_first_call(lambda: (fn(), sync()))
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"flash_attn.cute rejected the config: {_first_line(e)}") from e

    def check():
        o, lse = fn()
        out = {"o": o}
        lse = _checked_lse(a, p, lse, lse_check)
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = fn, check, ["o", "lse"]
    # FA4 compiles once per kernel variant (dtype, head dim, causal, ...) and process.
    first = (f"JIT compile {p.compile_ms / 1e3:.1f} s" if p.compile_ms >= 100
             else "variant already compiled in this process")
    p.notes.append(f"flash_attn.cute.flash_attn_func, (B, S, H, D) inputs, GQA native; first call: {first} (not timed)")


def _fa3(p, a, lse_check):
    fa3 = _import("fa3")
    q, k, v = a.q, a.k, a.v

    kw = a.fa_window_kwargs(none_for_unbounded=False)

    def fn():
        return fa3.flash_attn_func(q, k, v, softmax_scale=a.scale, **kw)

    def check():
        r = fn()
        o, lse = (r[0], r[1] if len(r) > 1 else None) if isinstance(r, (tuple, list)) else (r, None)
        out = {"o": o}
        lse = _checked_lse(a, p, lse, lse_check) if lse is not None else None
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = fn, check, ["o", "lse"]
    p.notes.append("flash_attn_interface.flash_attn_func (FA3), (B, S, H, D) inputs, GQA native")


def _xformers(p, a):
    xops = _import("xformers")
    q = a.q
    k, v = (a.k, a.v) if a.hq == a.hkv else a.expanded_kv()
    if a.hq != a.hkv:
        p.notes.append("K/V heads expanded to Hq outside the timed region")
    bias = None
    if a.causal:
        # Bottom-right aligned, as flashmoe's causal (equal to top-left when Sq == Sk).
        bias = xops.fmha.attn_bias.LowerTriangularFromBottomRightMask()

    def fn():
        return xops.memory_efficient_attention(q, k, v, attn_bias=bias, scale=a.scale)

    p.fn, p.outputs = fn, ["o"]
    p.check = lambda: {"o": fn()}
    try:  # which operator the dispatcher picks for these inputs (a private helper: best effort)
        fmha = xops.fmha
        op = fmha._dispatch_fw(fmha.Inputs(query=q, key=k, value=v, attn_bias=bias, scale=a.scale), False)
        picked = f"dispatched to {op.NAME}"
    except Exception as e:  # noqa: BLE001
        picked = f"operator unknown ({_first_line(e)})"
    p.notes.append(f"xformers.ops.memory_efficient_attention, {picked}; LSE not reported (O checked only)")


def _flashinfer_mask(a):
    """FlashInfer's plan arguments for a's mask. Its window has a left edge only
    (`window_left`, bottom-right aligned like flashmoe's); the right side is the causal
    diagonal or unbounded. Its softcap is cap·tanh(s·scale/cap), as flashmoe's."""
    left, right = a.window
    if right > 0:
        raise Unavailable("flashinfer: a window whose right edge is past the diagonal has no "
                          "FlashInfer equivalent (window_left only)")
    kw = {"causal": a.causal or right == 0, "window_left": left}
    if a.softcap > 0:
        kw["logits_soft_cap"] = a.softcap
    return kw


def _flashinfer_ragged(p, a, qo_indptr, kv_indptr, q, k, v, sync):
    """A planned BatchPrefillWithRaggedKVCacheWrapper over packed (tokens, H, D) q/k/v.
    The plan and the first call (where FlashInfer JIT-compiles its module on a new
    machine) run here, untimed. Returns the call giving (o, lse)."""
    flashinfer = _import(p.impl)
    torch = a.torch
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    mask = _flashinfer_mask(a)

    def fn():
        return w.run(q, k, v, return_lse=True)

    def plan_and_first_call():
        w.plan(qo_indptr, kv_indptr, a.hq, a.hkv, a.d, sm_scale=a.scale, q_data_type=q.dtype,
               kv_data_type=k.dtype, **mask)
        fn()
        sync()

    try:
        p.compile_ms = _timed_first_call(plan_and_first_call)
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"flashinfer rejected the config: {_first_line(e)}") from e
    p.notes.append(f"FlashInfer BatchPrefillWithRaggedKVCacheWrapper: plan and first call (JIT compile "
                   f"on a new machine) {p.compile_ms / 1e3:.1f} s, outside the timing")
    return fn


def _flashinfer_prefill(p, a, sync, lse_check):
    torch = a.torch
    dev = a.q.device
    qo = torch.arange(a.b + 1, dtype=torch.int32, device=dev) * a.sq
    kv = torch.arange(a.b + 1, dtype=torch.int32, device=dev) * a.sk
    q = a.q.reshape(a.b * a.sq, a.hq, a.d)
    k = a.k.reshape(a.b * a.sk, a.hkv, a.d)
    v = a.v.reshape(a.b * a.sk, a.hkv, a.d)
    fn = _flashinfer_ragged(p, a, qo, kv, q, k, v, sync)

    def check():
        o, lse = fn()
        out = {"o": o.reshape(a.b, a.sq, a.hq, a.d)}
        # (B·Sq, Hq) → (B, Hq, Sq)
        lse = lse.reshape(a.b, a.sq, a.hq).transpose(1, 2)
        lse = _checked_lse(a, p, lse, lse_check, base2_ok=True)
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = fn, check, ["o", "lse"]


# ------------------------------------------------------------------------- varlen

class Varlen(Attn):
    """A varlen problem for the package builders: packed q (total_q, Hq, D), k and v
    (total_k, Hkv, D); ``lens`` the (sq, sk) of each sequence; ``cu`` = (cu_q, cu_k as
    host lists, the same as int32 device tensors). The Attn fields b / sq / sk hold the
    sequence count and the totals."""

    def __init__(self, torch, q, k, v, lens, cu, hq, hkv, d, causal, scale, window=(-1, -1), softcap=0.0):
        cu_q, cu_k, cu_q_dev, cu_k_dev = cu
        super().__init__(torch, q, k, v, len(lens), hq, hkv, cu_q[-1], cu_k[-1], d, causal, scale, window,
                         softcap)
        self.lens = list(lens)
        self.cu_q_host, self.cu_k_host = list(cu_q), list(cu_k)
        self.cu_q, self.cu_k = cu_q_dev, cu_k_dev
        self.total_q, self.total_k = cu_q[-1], cu_k[-1]
        self.max_q = max(1, max(sq for sq, _ in self.lens))
        self.max_k = max(1, max(sk for _, sk in self.lens))
        self.explicit_scale = False


def split_out_lse(r):
    """(o, lse or None) of a call that returns o alone or a tuple starting (o, lse)."""
    if isinstance(r, (tuple, list)):
        return r[0], (r[1] if len(r) > 1 else None)
    return r, None


def _note_once(p, text):
    """Add a note unless it is there already (p.check runs more than once)."""
    if text not in p.notes:
        p.notes.append(text)


def checked_varlen_lse(a, p, lse, lse_check, base2_ok=False):
    """The LSE as (Hq, total_q) natural log if it passes the spot check, else None (noted).
    A (total_q, Hq) LSE is transposed first."""
    if lse is None:
        _note_once(p, "LSE not reported by the package (O checked only)")
        return None
    shape = tuple(lse.shape)
    if shape == (a.hq, a.total_q):
        pass
    elif shape == (a.total_q, a.hq):
        lse = lse.transpose(0, 1)
    else:
        _note_once(p, f"LSE not reported: the package returned shape {shape}, not (Hq, total_q) = "
                      f"{(a.hq, a.total_q)}")
        return None
    lse = lse.float().contiguous()
    ok, why = lse_check(lse)
    if ok:
        return lse
    if base2_ok:
        lse_e = lse * math.log(2.0)
        if lse_check(lse_e)[0]:
            _note_once(p, "the package's LSE is base 2: converted to natural log for the gate")
            return lse_e
    _note_once(p, f"LSE not reported: {why}")
    return None


def build_varlen(name, p, a, sync, lse_check):
    """Set p.fn / p.check / p.outputs for the varlen package baseline `name` on problem `a`
    (a :class:`Varlen`); `lse_check(lse)` spot-checks an (Hq, total_q) LSE."""
    if name == "fa4-varlen":
        _fa4_varlen(p, a, sync, lse_check)
    elif name == "fa3-varlen":
        _fa3_varlen(p, a, lse_check)
    elif name == "flashinfer-varlen":
        _flashinfer_varlen(p, a, sync, lse_check)
    else:
        raise Unavailable(f"unknown varlen package baseline '{name}'")
    _note_version(p, name)


def _varlen_func(name):
    f = getattr(_import(name), "flash_attn_varlen_func", None)
    if f is None:
        raise Unavailable(f"{PACKAGES[name][0]} has no flash_attn_varlen_func")
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        params = {}
    return f, params


def _fa4_varlen(p, a, sync, lse_check):
    f, params = _varlen_func("fa4-varlen")
    kw = a.fa_window_kwargs(none_for_unbounded=True)
    kw["softmax_scale"] = a.scale
    # Older releases take no max_seqlen (they derive it) and always return (o, lse).
    for key, value in (("max_seqlen_q", a.max_q), ("max_seqlen_k", a.max_k)):
        if key in params:
            kw[key] = value
    if "return_lse" in params:
        # In the timed call too: flashmoe's kernel writes the LSE as well.
        kw["return_lse"] = True

    def fn():
        return f(a.q, a.k, a.v, cu_seqlens_q=a.cu_q, cu_seqlens_k=a.cu_k, **kw)

    try:
        p.compile_ms = _timed_first_call(lambda: (fn(), sync()))
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"flash_attn.cute rejected the config: {_first_line(e)}") from e

    def check():
        o, lse = split_out_lse(fn())
        out = {"o": o}
        lse = checked_varlen_lse(a, p, lse, lse_check)
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = fn, check, ["o", "lse"]
    first = (f"JIT compile {p.compile_ms / 1e3:.1f} s" if p.compile_ms >= 100
             else "variant already compiled in this process")
    p.notes.append("flash_attn.cute.flash_attn_varlen_func, packed inputs, GQA native; first call: "
                   f"{first} (not timed)")


def _fa3_varlen(p, a, lse_check):
    f, params = _varlen_func("fa3-varlen")
    kw = a.fa_window_kwargs(none_for_unbounded=False)
    lse_kw = {"return_attn_probs": True} if "return_attn_probs" in params else {}

    def call(**extra):
        return f(a.q, a.k, a.v, a.cu_q, a.cu_k, a.max_q, a.max_k, softmax_scale=a.scale, **kw, **extra)

    def check():
        o, lse = split_out_lse(call(**lse_kw))
        out = {"o": o}
        lse = checked_varlen_lse(a, p, lse, lse_check)
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = call, check, ["o", "lse"]
    p.notes.append("flash_attn_interface.flash_attn_varlen_func (FA3), packed inputs, GQA native")


def _flashinfer_varlen(p, a, sync, lse_check):
    # FlashInfer's causal mask is bottom-right aligned per sequence, as flashmoe's.
    fn = _flashinfer_ragged(p, a, a.cu_q, a.cu_k, a.q, a.k, a.v, sync)

    def check():
        o, lse = fn()
        out = {"o": o}
        # (total_q, Hq), possibly base 2 → (Hq, total_q) natural log.
        lse = checked_varlen_lse(a, p, lse, lse_check, base2_ok=True)
        if lse is not None:
            out["lse"] = lse
        return out

    p.fn, p.check, p.outputs = fn, check, ["o", "lse"]

# ---------------------------------------------------------------------------- MLA

class Mla:
    """The MLA decode problem as the package builders need it."""

    def __init__(self, torch, q, kv, b, hq, sq, sk, seqlens, scale, page):
        self.torch = torch
        self.q, self.kv = q, kv  # (B, Sq, Hq, 576), (B, Sk, 576)
        self.b, self.hq, self.sq, self.sk = b, hq, sq, sk
        self.seqlens, self.scale, self.page = list(seqlens), scale, page

    def pages(self):
        """(pages per sequence, the latent as (B · pages, page, 576) with the last page of
        each sequence zero-padded, int32 (B, pages) identity table, int32 cache lengths)."""
        torch = self.torch
        n = -(-self.sk // self.page)
        kv = self.kv
        if n * self.page != self.sk:
            kv = torch.nn.functional.pad(kv, (0, 0, 0, n * self.page - self.sk))
        dev = kv.device
        table = torch.arange(self.b * n, dtype=torch.int32, device=dev).reshape(self.b, n)
        lens = torch.tensor(self.seqlens, dtype=torch.int32, device=dev)
        return n, kv.reshape(self.b * n, self.page, kv.shape[-1]), table, lens


def build_mla(name, p, a, sync):
    """Set p.fn / p.check / p.outputs for the MLA package baseline `name` (O only)."""
    if name == "flashinfer-mla":
        fn = _flashinfer_mla(p, a, sync)
    elif name == "flash-mla":
        fn = _flash_mla(p, a, sync)
    else:
        raise Unavailable(f"unknown package baseline '{name}'")
    p.fn, p.outputs = fn, ["o"]
    p.check = lambda: {"o": fn().reshape(a.b, a.sq, a.hq, 512)}
    p.notes.append("latent viewed as pages of 64 with an identity table; LSE not reported (O checked only)")
    _note_version(p, name)


def _flashinfer_mla(p, a, sync):
    mla = _import("flashinfer-mla")
    torch = a.torch
    n, pages, _table, lens = a.pages()
    dev = pages.device
    # FlashInfer takes the latent and the rotary part as two page tensors.
    ckv, kpe = pages[..., :512].contiguous(), pages[..., 512:].contiguous()
    q = a.q.reshape(a.b * a.sq, a.hq, 576)
    q_nope, q_pe = q[..., :512].contiguous(), q[..., 512:].contiguous()
    qo_indptr = torch.arange(a.b + 1, dtype=torch.int32, device=dev) * a.sq
    kv_indptr = torch.arange(a.b + 1, dtype=torch.int32, device=dev) * n
    kv_indices = torch.arange(a.b * n, dtype=torch.int32, device=dev)
    ws = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
    try:
        w = mla.BatchMLAPagedAttentionWrapper(ws)
        # causal: bottom-right per sequence (FlashInfer's append semantics), as flashmoe's.
        w.plan(qo_indptr, kv_indptr, kv_indices, lens, a.hq, 512, 64, a.page, a.sq > 1,
               a.scale, a.q.dtype, a.kv.dtype)

        def fn():
            return w.run(q_nope, q_pe, ckv, kpe)

        p.compile_ms = _timed_first_call(lambda: (fn(), sync()))
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"flashinfer MLA rejected the config: {_first_line(e)}") from e
    p.notes.append(f"FlashInfer plan and first call (JIT on a new machine) {p.compile_ms / 1e3:.1f} s, "
                   "outside the timing")
    return fn


def _flash_mla(p, a, sync):
    fm = _import("flash-mla")
    if a.page != 64:
        raise Unavailable(f"FlashMLA pages hold 64 keys, the config has {a.page}")
    _n, pages, table, lens = a.pages()
    blocked = pages.unsqueeze(2)  # (blocks, 64, 1, 576)
    try:
        meta, splits = fm.get_mla_metadata(lens, a.sq * a.hq, 1)[:2]

        def fn():
            return fm.flash_mla_with_kvcache(a.q, blocked, table, lens, 512, meta, splits,
                                             softmax_scale=a.scale, causal=a.sq > 1)[0]

        p.compile_ms = _timed_first_call(lambda: (fn(), sync()))
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"FlashMLA rejected the config: {_first_line(e)}") from e
    return fn


# ---------------------------------------------------------------------------- MoE

class Moe:
    """The MoE problem and the worker's routing pieces, for the package builders."""

    def __init__(self, torch, x, w13, w2, t, h, i, e, k, dt, route, swiglu, shared_out):
        self.torch = torch
        self.x, self.w13, self.w2 = x, w13, w2  # w13 (E, H, 2I) gate | up, w2 (E, I, H)
        self.t, self.h, self.i, self.e, self.k, self.dt = t, h, i, e, k, dt
        self.route, self.swiglu, self.shared_out = route, swiglu, shared_out


def build_moe(name, p, m, derived):
    """Set p.fn / p.check for the MoE package baseline `name`; `derived` caches weight copies."""
    if name in ("vllm-fused-moe", "sglang-fused-moe"):
        _fused_moe(name, p, m, derived)
    elif name == "quack-grouped-gemm":
        _quack(p, m)
    else:
        raise Unavailable(f"unknown package baseline '{name}'")
    p.outputs = ["out", "topk_ids"]
    p.check = lambda: dict(zip(("out", "topk_ids"), p.fn()))
    _note_version(p, name)


def _nk_weights(m, derived):
    """vLLM/SGLang layouts: w1 (E, 2I, H) with gate rows first, w2 (E, H, I); made once."""
    got = derived.get("moe_nk")
    if got is None:
        got = (m.w13.transpose(1, 2).contiguous(), m.w2.transpose(1, 2).contiguous())
        derived["moe_nk"] = got
    return got


def _fused_moe(name, p, m, derived):
    mod = _import(name)
    fused_experts = getattr(mod, "fused_experts", None)
    if fused_experts is None:
        if name == "sglang-fused-moe":
            try:
                fused_experts = importlib.import_module(PACKAGES[name][0] + ".fused_moe").fused_experts
            except Exception as e:  # noqa: BLE001
                raise Unavailable(f"sglang fused_experts not found: {_first_line(e)}") from e
        else:
            raise Unavailable(f"{PACKAGES[name][0]} has no fused_experts")
    w1, w2 = _nk_weights(m, derived)
    torch = m.torch

    def layer():
        w, ids = m.route()
        # silu(h[:, :I]) * h[:, I:], the activation both packages apply to w1's output.
        y = fused_experts(m.x, w1, w2, w.float(), ids.to(torch.int32), inplace=False)
        out = y.float()
        if m.shared_out is not None:
            out = out + m.shared_out()
        return out.to(m.dt), ids

    try:
        layer()
    except TypeError as e:
        raise Unavailable(f"{name}: fused_experts has another signature in this version ({_first_line(e)})") from e
    p.fn = layer
    p.notes.append(f"{PACKAGES[name][0]}.fused_experts (Triton), weights transposed to (E, N, K) "
                   "outside the timed region; routing as the reference")


def _quack(p, m):
    qg = _import("quack-grouped-gemm")
    torch = m.torch
    e_, k_ = m.e, m.k

    def layer():
        w, ids = m.route()
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e_)
        cu = torch.zeros(e_ + 1, dtype=torch.int32, device=m.x.device)
        cu[1:] = torch.cumsum(counts, 0)
        tok = torch.div(order, k_, rounding_mode="floor").to(torch.int32)
        # Varlen-M grouped GEMM with the token gather fused (A_idx): rows of expert e are
        # cu[e]..cu[e+1]; B is (E, K, N).
        hs = qg.gemm(m.x, m.w13, cu_seqlens_m=cu, A_idx=tok)
        ys = qg.gemm(m.swiglu(hs), m.w2, cu_seqlens_m=cu)
        y = torch.empty_like(ys)
        y[order] = ys
        out = (y.view(m.t, k_, m.h).float() * w.unsqueeze(-1)).sum(dim=1)
        if m.shared_out is not None:
            out = out + m.shared_out()
        return out.to(m.dt), ids

    t0 = time.perf_counter()
    try:
        layer()
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise Unavailable(f"quack gemm rejected the config: {_first_line(e)}") from e
    p.compile_ms = (time.perf_counter() - t0) * 1e3
    p.fn = layer
    p.notes.append("quack.gemm_interface.gemm varlen-M (cu_seqlens_m, gathered A) for gate/up and down, "
                   f"deterministic weighted combine; JIT compile and tuning {p.compile_ms / 1e3:.1f} s (not timed)")
