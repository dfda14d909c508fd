"""The torch layer: flashmoe's plans as ``torch.library`` custom ops.

The ops are defined with ``torch.library.Library`` (schema + a kernel per backend + a fake
kernel) rather than the ``@torch.library.custom_op`` decorator: same tracing and graph
behaviour, but the decorator's Python wrappers cost several µs more per call
(tools/overhead.py measures both; docs/python.md). ``attention`` (dense) is differentiable: its
autograd formula (``torch.library.register_autograd``) saves q, k, v, o and lse and calls the op
``attention_backward`` (the library's backward plan, fast or deterministic); ``attention_varlen`` likewise
through ``attention_varlen_backward`` (its autograd formula also saves the offsets). The
attention ops without a backward (the KV-cache ones) are forward-only (inference): a call whose tensors require grad while grad mode is on raises
(``_refuse_grad``) instead of returning outputs silently cut off from the autograd graph.

A call reads each tensor's address, dtype, shape and strides, allocates its outputs with
``torch.empty`` (PyTorch's caching allocator, so CUDA-graph capture puts them in the
graph's pool) and enqueues the plan on ``torch.cuda.current_stream()``: no copy, no host
synchronisation. Plans are cached per shape class; the attention kernel's zeroed workspace
per (device, stream), as the library requires (docs/library.md, "Workspace").
"""

import operator
from typing import NamedTuple, Optional, Tuple

import torch

from . import _core, _value_dim
from ._common import (  # noqa: F401  (tools/overhead.py reads some through _torch)
    _DTYPES,
    _MIN_PLAN_TOKENS,
    _desc,
    _device_index,
    _idesc,
    _cached_plan,
    _moe_plan,
    _plans,
    _plain,
    _raw_stream,
    _refuse_grad,
    _same_dtype,
)
from ._moe_autograd import moe_train as _moe_train  # the differentiable MoE path (its own ops)


def _forward_only(name: str, arg_names) -> None:
    """Register the Autograd kernel of op `name`: refuse inputs that require grad (see
    ``_refuse_grad``), else run the op below autograd. It covers calls that reach the dispatcher
    (torch.ops.flashmoe.*, torch.compile, tensor subclasses); the eager fast paths check
    themselves."""
    op = getattr(torch.ops.flashmoe, name).default

    def autograd_kernel(*args):
        _refuse_grad(name, zip(arg_names, args))
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args)

    _lib.impl(name, autograd_kernel, "Autograd")


# ---------------------------------------------------------------------------------------------
# attention

_attention_plans = {}
# (kernel family, device index, stream) -> [uint8 tensor, zeroed outside any graph capture,
# address, bytes]. Each family ("prefill", "varlen", "decode") leaves its workspace zeroed after
# every launch in its own way (the decode kernel only its tickets), so families never share one.
_workspaces = {}
# Workspaces that a larger plan replaced: never freed, since a captured graph may hold their address.
_retired_workspaces = []


# (device index, stream) -> (uint8 tensor, address, bytes): where eager launches whose caller did
# not ask for lse write it. Nobody reads it, and launches on one stream run in order, so one
# buffer per stream replaces an output allocation per call (a few µs of host time). Kept, never
# freed, when outgrown (a captured graph may hold its address).
_lse_sinks = {}


def _lse_sink(nbytes: int, index: int, stream: int) -> int:
    entry = _lse_sinks.get((index, stream))
    if entry is None or entry[2] < nbytes:
        if entry is not None:
            _retired_workspaces.append(entry[0])
        t = torch.empty(max(nbytes, 1 << 16), dtype=torch.uint8, device=torch.device("cuda", index))
        entry = (t, t.data_ptr(), t.numel())
        _lse_sinks[(index, stream)] = entry
    return entry[1]


# The dense op's plan cache. The call's key is its arguments but the lengths: (device index, dtype,
# head_dim, heads_q, heads_kv, causal, softmax_scale, window_left, window_right, softcap). The plan
# serving it is the library's router's choice (``_core.route_attention``: the prefill plan, or the
# decode plan for a decode-shaped call with a window or softcap), which also depends on the lengths;
# the router returns the ranges of seq_q and seq_k over which its choice holds. An entry is
# (seq_q lo, hi, seq_k lo, hi, plan, decode). _attention_plans: the entry the key's last call used
# (the call path checks its ranges, two comparisons); _attention_routes: every entry of (key, alibi);
# the plans themselves live in the package's one plan cache (``_common._plans``), family "route
# prefill" or "route decode", keyed by (index, dtype, head_dim, heads_q, heads_kv, plan arguments).
# The router runs only on a miss.
_attention_routes = {}


def _routed_plan(index, dtype, torch_dtype, head_dim, heads_q, heads_kv, kind, args):
    """The cached plan of a route: kind "prefill" (``AttentionPlan``, args (causal, softmax_scale,
    window, softcap)) or "decode" (``DecodePlan``, args (max_q_per_seq, window, softcap,
    softmax_scale))."""
    make = _core.AttentionPlan if kind == "prefill" else _core.DecodePlan
    return _cached_plan("route " + kind, (index, torch_dtype, head_dim, heads_q, heads_kv) + tuple(args),
                        lambda: make(index, dtype, head_dim, heads_q, heads_kv, *args))


def _attention_plan(index, dtype, torch_dtype, head_dim, heads_q, heads_kv, causal, softmax_scale,
                    window_left=-1, window_right=-1, softcap=0.0):
    """Build and cache the prefill plan of a class, without routing (tools/overhead.py times it)."""
    args = (causal, softmax_scale, (window_left, window_right), softcap)
    return _routed_plan(index, dtype, torch_dtype, head_dim, heads_q, heads_kv, "prefill", args)


def _attention_route(key, dtype, sq, sk, alibi=False):
    """The entry of a call whose key's last entry does not cover its lengths (or that has none):
    another entry of the key that does, else the router's choice and its plan. `alibi`: the
    ALiBi op's routes (``route_alibi_dense``), kept apart from the dense op's."""
    entries = _attention_routes.setdefault((key, alibi), [])
    for entry in entries:
        if entry[0] <= sq <= entry[1] and entry[2] <= sk <= entry[3]:
            return entry
    index, torch_dtype, d, hq, hkv, causal, softmax_scale, left, right, softcap = key
    major, minor = torch.cuda.get_device_capability(index)
    kind, args, ((q_lo, q_hi), (k_lo, k_hi)) = _core.route_attention(
        dtype, d, hq, hkv, sq, sk, causal, softmax_scale, (left, right), softcap, arch=10 * major + minor,
        alibi=alibi)
    plan = _routed_plan(index, dtype, torch_dtype, d, hq, hkv, kind, args)
    entry = (q_lo, q_hi, k_lo, k_hi, plan, kind == "decode")
    entries.append(entry)
    return entry


_I32_MAX = (1 << 31) - 1


def _window(window_size, causal: bool):
    """FlashAttention's ``window_size`` as the ops take it: ``(left, right)`` ints, the right side 0
    when causal (the same kernel, so one plan), a side past int32 clamped into it (a side of at
    least the key length is unbounded anyway; one below -1 stays invalid). The default (-1, -1)
    skips this (the call path's fast case). The values are checked by the plan (Rust): each side
    -1 or >= 0, else ValueError."""
    try:
        left, right = window_size
        left, right = operator.index(left), operator.index(right)
    except (TypeError, ValueError):
        msg = f"window_size must be a (left, right) pair of ints, got {window_size!r}"
        raise TypeError(msg) from None
    return _i32(left), 0 if causal else _i32(right)


def _i32(side: int) -> int:
    return -_I32_MAX - 1 if side < -_I32_MAX else min(side, _I32_MAX)


def _workspace(family: str, needed: int, index: int, stream: int):
    """The zeroed workspace of `stream` for a kernel family: its kernels leave it zeroed after
    every launch, so one allocation serves every later launch on that stream (launches on other
    streams may run at the same time and get their own)."""
    if needed == 0:
        return 0, 0
    key = (family, index, stream)
    entry = _workspaces.get(key)
    if entry is None or entry[3] < needed:
        if entry is not None:
            _retired_workspaces.append(entry[0])
        ws = torch.empty(needed, dtype=torch.uint8, device=torch.device("cuda", index))
        entry = [ws, False, ws.data_ptr(), needed]
        _workspaces[key] = entry
    if not entry[1]:
        # Zeroing inside a capture happens only when the graph replays, so it is repeated in each
        # capture until one zeroing has run eagerly.
        entry[0].zero_()
        entry[1] = not torch.cuda.is_current_stream_capturing()
    return entry[2], entry[3]


_lib = torch.library.Library("flashmoe", "DEF")
_lib.define(
    "attention(Tensor q, Tensor k, Tensor v, bool causal, float? softmax_scale, int window_left=-1, "
    "int window_right=-1, float softcap=0.0, bool deterministic=False) -> (Tensor, Tensor)"
)
_lib.define(
    "attention_alibi(Tensor q, Tensor k, Tensor v, Tensor alibi_slopes, bool causal, float? softmax_scale, "
    "int window_left=-1, int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)"
)
_lib.define(
    "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, bool causal, "
    "float? softmax_scale, int window_left=-1, int window_right=-1, float softcap=0.0, "
    "bool deterministic=False) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
    "int max_seqlen_q, int max_seqlen_k, bool causal, float? softmax_scale, int window_left=-1, "
    "int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)"
)
_lib.define(
    "attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
    "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, "
    "float? softmax_scale, int window_left=-1, int window_right=-1, float softcap=0.0) "
    "-> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "attention_kvcache(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seqused_k, "
    "Tensor? cu_seqlens_q, int max_q_per_seq, int window_left, int window_right, float softcap, "
    "float? softmax_scale, Tensor? alibi_slopes=None) -> (Tensor, Tensor)"
)
_lib.define(
    "append_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, "
    "Tensor cache_seqlens) -> ()"
)
_lib.define(
    "moe(Tensor x, Tensor router_w, Tensor w13, Tensor w2, Tensor? shared_w13, Tensor? shared_w2, "
    "int top_k, str scoring, bool renormalize) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
)


def _register(name, impl, fake):
    # CPU gets the same kernel so that a CPU tensor meets flashmoe's own error, not the
    # dispatcher's "no kernel for CPU".
    for key in ("CUDA", "CPU"):
        _lib.impl(name, impl, key)
    torch.library.register_fake(f"flashmoe::{name}", fake, lib=_lib)


# Op arguments after softmax_scale default to no window and no softcap (the dispatcher drops trailing
# arguments equal to their schema defaults before calling a Python kernel, so the kernels need the
# same defaults).
def _attention_impl(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                    deterministic=False, want_lse=True):
    # `deterministic` is the backward's (the autograd formula hands it to attention_backward).
    index = _device_index((("q", q), ("k", k), ("v", v)))
    _same_dtype((("q", q), ("k", k), ("v", v)))
    dq, dk, dv = _desc(q, "q"), _desc(k, "k"), _desc(v, "v")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:  # raises, naming the tensor
        _core.check_attention(dq, dk, dv, causal, softmax_scale, window=(window_left, window_right),
                              softcap=softcap)
    b, sq, hq, d = dq[2]
    sk = dk[2][1]
    key = (index, q.dtype, d, hq, k.shape[2], causal, softmax_scale, window_left, window_right, softcap)
    entry = _attention_plans.get(key)
    if entry is None or not (entry[0] <= sq <= entry[1] and entry[2] <= sk <= entry[3]):
        entry = _attention_plans[key] = _attention_route(key, dq[1], sq, sk)
    plan = entry[4]
    dev = q.device
    o = torch.empty((b, sq, hq, d), dtype=q.dtype, device=dev)
    stream = _raw_stream(index)
    if want_lse:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=dev)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, _lse_sink(4 * b * hq * sq, index, stream)
    if entry[5]:
        # The decode plan over the dense cache: k, v (b, sk, hkv, d) as b pages of sk keys, the
        # identity block table, every sequence sk keys long.
        table = torch.arange(b, dtype=torch.int32, device=dev).view(b, 1)
        used = torch.full((b,), sk, dtype=torch.int32, device=dev)
        ws, ws_bytes = _workspace("decode", plan.workspace_bytes(b, sk), index, stream)
        plan.forward(stream, dq, dk, dv, _idesc(table, "block_table"), _idesc(used, "cache_seqlens"), None,
                     o.data_ptr(), lse_ptr, ws, ws_bytes)
        return o, lse
    ws, ws_bytes = _workspace("prefill", plan.workspace_bytes, index, stream)
    plan.forward(stream, dq, dk, dv, o.data_ptr(), lse_ptr, ws, ws_bytes)
    return o, lse


def _attention_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                    deterministic=False):
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, seq, heads, head_dim) but has shape {list(q.shape)}")
    b, sq, hq, d = q.shape
    return q.new_empty((b, sq, hq, d)), q.new_empty((b, hq, sq), dtype=torch.float32)


_register("attention", _attention_impl, _attention_fake)
_attention_op = torch.ops.flashmoe.attention.default

# ALiBi: routed by the library (flashmoe::attention::route::route_alibi_dense): the portable
# prefill kernel on any GPU, decode-shaped calls on the decode kernels; plans built with alibi=True.
_alibi_plans = {}  # the ALiBi op's last entry per key, as _attention_plans


def _attention_alibi_impl(q, k, v, alibi_slopes, causal, softmax_scale, window_left=-1, window_right=-1,
                          softcap=0.0, want_lse=True):
    named = (("q", q), ("k", k), ("v", v))
    index = _device_index(named + (("alibi_slopes", alibi_slopes),))
    _same_dtype(named)
    if alibi_slopes.dtype is not torch.float32:
        raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; flashmoe takes torch.float32 slopes "
                        "(FlashAttention's convention), shape (heads_q,) or (batch, heads_q)")
    dq, dk, dv = _desc(q, "q"), _desc(k, "k"), _desc(v, "v")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:  # raises, naming the tensor
        _core.check_attention(dq, dk, dv, causal, softmax_scale, window=(window_left, window_right),
                              softcap=softcap)
    b, sq, hq, d = dq[2]
    sk = dk[2][1]
    key = (index, q.dtype, d, hq, k.shape[2], causal, softmax_scale, window_left, window_right, softcap)
    entry = _alibi_plans.get(key)
    if entry is None or not (entry[0] <= sq <= entry[1] and entry[2] <= sk <= entry[3]):
        entry = _alibi_plans[key] = _attention_route(key, dq[1], sq, sk, alibi=True)
    plan = entry[4]
    dev = q.device
    dsl = _desc(alibi_slopes, "alibi_slopes")
    o = torch.empty((b, sq, hq, d), dtype=q.dtype, device=dev)
    stream = _raw_stream(index)
    if want_lse:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=dev)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, _lse_sink(4 * b * hq * sq, index, stream)
    if entry[5]:  # the decode plan over the dense cache (as in _attention_impl)
        table = torch.arange(b, dtype=torch.int32, device=dev).view(b, 1)
        used = torch.full((b,), sk, dtype=torch.int32, device=dev)
        ws, ws_bytes = _workspace("decode", plan.workspace_bytes(b, sk), index, stream)
        plan.forward(stream, dq, dk, dv, _idesc(table, "block_table"), _idesc(used, "cache_seqlens"), None,
                     o.data_ptr(), lse_ptr, ws, ws_bytes, dsl)
        return o, lse
    ws, ws_bytes = _workspace("prefill", plan.workspace_bytes, index, stream)
    plan.forward(stream, dq, dk, dv, o.data_ptr(), lse_ptr, ws, ws_bytes, dsl)
    return o, lse


def _attention_alibi_fake(q, k, v, alibi_slopes, causal, softmax_scale, window_left=-1, window_right=-1,
                          softcap=0.0):
    return _attention_fake(q, k, v, causal, softmax_scale)


_register("attention_alibi", _attention_alibi_impl, _attention_alibi_fake)
_forward_only("attention_alibi", ("q", "k", "v", "alibi_slopes"))
_attention_alibi_op = torch.ops.flashmoe.attention_alibi.default

# Head dims the backward plan serves (``flashmoe::attention::backward::BWD_HEAD_DIMS``).
_BWD_HEAD_DIMS = _value_dim.BWD_HEAD_DIMS
# The backward plans: (device index, dtype, head_dim, heads_q, heads_kv, causal, softmax_scale,
# window_left, window_right, softcap, deterministic) -> _core.AttentionBackwardPlan.


def _attention_backward_impl(dout, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, deterministic=False):
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("o", o))
    index = _device_index(named + (("lse", lse),))
    _same_dtype(named)
    # The kernels take contiguous tensors: a gradient may arrive expanded or strided, q, k, v
    # may be views of a packed QKV tensor (copies only where needed).
    dout, q, k, v, o, lse = (t.contiguous() for t in (dout, q, k, v, o, lse))
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (batch, seq, heads, head_dim), got {list(q.shape)} and {list(k.shape)}")
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    key = (index, q.dtype, d, hq, hkv, causal, softmax_scale, window_left, window_right, softcap, deterministic)
    plan = _cached_plan("backward", key, lambda: _core.AttentionBackwardPlan(
        index, _DTYPES[q.dtype], d, hq, hkv, causal, softmax_scale, (window_left, window_right), softcap,
        deterministic))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # Any contents: the launch writes it before reading it (a fresh block from the caching
    # allocator, the graph's pool under capture).
    ws = torch.empty(plan.workspace_bytes(b, sq), dtype=torch.uint8, device=q.device)
    plan.backward(_raw_stream(index), _desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(o, "o"),
                  _desc(dout, "dout"), _desc(lse, "lse"), _desc(dq, "dq"), _desc(dk, "dk"), _desc(dv, "dv"),
                  ws.data_ptr(), ws.numel())
    return dq, dk, dv


def _attention_backward_fake(dout, q, k, v, o, lse, causal, softmax_scale, window_left=-1, window_right=-1,
                             softcap=0.0, deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_register("attention_backward", _attention_backward_impl, _attention_backward_fake)
_forward_only("attention_backward", ("dout", "q", "k", "v", "o", "lse"))
_attention_backward_op = torch.ops.flashmoe.attention_backward.default

# The schema's arguments after q, k, v and their defaults (the dispatcher may drop trailing
# defaults before the autograd kernel sees the call).
_ATTENTION_SCALARS = (False, None, -1, -1, 0.0, False)


def _attention_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    d = q.shape[-1]
    if d not in _BWD_HEAD_DIMS:
        name = next((n for n, t in zip("qkv", (q, k, v)) if t.requires_grad), "q")
        raise RuntimeError(
            f"flashmoe.attention has no backward pass for head_dim {d} (head dims with a backward: "
            f"{', '.join(map(str, _BWD_HEAD_DIMS))}), but {name} requires grad: its outputs would carry no "
            "gradient to the tensors upstream. Call it under torch.no_grad() or torch.inference_mode() (or "
            "on detached tensors) for inference; for training use a head dim with a backward or "
            "torch.nn.functional.scaled_dot_product_attention."
        )
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.scalars = tuple(inputs[3:]) + _ATTENTION_SCALARS[len(inputs) - 3:]
    ctx.n_inputs = len(inputs)


def _attention_backward(ctx, do, dlse):
    # lse is not differentiated through (its gradient is ignored); o's gradient drives dq, dk, dv.
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _attention_backward_op(do, q, k, v, o, lse, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


torch.library.register_autograd("flashmoe::attention", _attention_backward,
                                setup_context=_attention_setup_context, lib=_lib)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: Optional[bool] = None,
):
    """Exact attention in FlashAttention's layout (``flash_attn_func``).

    q (batch, seqlen_q, heads_q, head_dim); k, v (batch, seqlen_k, heads_kv, head_dim) with
    heads_q a multiple of heads_kv (GQA/MQA); bf16 or f16 on one CUDA device. Returns o like q
    (contiguous), and with ``return_lse`` also lse (batch, heads_q, seqlen_q) f32 (natural log).
    ``causal`` is bottom-right aligned; ``softmax_scale`` defaults to 1/sqrt(head_dim).
    ``window_size`` (left, right) is a sliding window around each query row's bottom-right
    diagonal d = i + seqlen_k - seqlen_q: row i sees keys d - left ..= d + right, -1 leaves a side
    unbounded, and ``causal`` sets the right side to 0. ``softcap`` > 0 turns the scores s
    (scaled) into softcap·tanh(s / softcap) before the softmax (Gemma-2); 0 is off. Windows and
    softcap run on the sm_90a kernel (H100/H200, head dims 64 and 128), on the portable kernel
    (head dims that are multiples of 8 up to 256; above 128 on H100/H200 only) and, for calls of
    at most 16 query rows, on the decode kernels on any GPU (head dims 64, 128, 256; the library's
    call router, ``flashmoe.route_attention``, decides); other calls raise NotImplementedError. A
    window side below -1 or a negative or non-finite softcap is a ValueError. A query row that sees no key gives o = 0 and lse = -inf.
    q, k, v may be strided views (e.g. of one packed QKV tensor) on the prefill kernels when the
    last dimension is contiguous and every other stride is a multiple of 8 elements.

    Eager calls on plain tensors run the kernel function directly (no dispatcher: a few µs less
    host time); under torch.compile, fake tensors or dispatch modes the call goes through
    ``torch.ops.flashmoe.attention``.

    ``alibi_slopes`` f32 (heads_q,) or (batch, heads_q) adds FlashAttention's ALiBi bias
    -slope·|i + seqlen_k - seqlen_q - j| to the scores (after the softcap), with every mask above, on
    any GPU (the portable prefill kernel, head dims that are multiples of 8 up to 256; calls of at
    most 16 query rows with head dims 64/128/256 on the decode kernels). ALiBi has no backward: a
    call whose q, k or v requires grad (grad mode on) raises RuntimeError.

    Differentiable: with grad mode on and q, k or v requiring grad, the call goes through the op,
    whose autograd formula saves q, k, v, o and lse and computes dq, dk, dv with the library's
    backward (``torch.ops.flashmoe.attention_backward``: head dims 32, 64, 96, 128, every mask,
    window and softcap above; other head dims up to 128 run zero-padded to the next of those, as
    below). lse is not differentiated through. A head dim without a backward (above 128) raises a
    RuntimeError at the forward call (never a silent detach).

    ``deterministic`` (FlashAttention's switch): True gives bit-identical gradients run to run;
    False the fastest backward, which on Hopper sums dq with f32 reductions in the order they land
    (dq may differ in its last bits between runs; dk and dv do not). None (the default) follows
    ``torch.are_deterministic_algorithms_enabled()`` at the forward call.

    v may have a value head dim of its own (D_v ≠ D_qk, e.g. DeepSeek MLA's 192 / 128), and head dims
    need not be multiples of 8 (1 to 256, e.g. 59 or 111 as FlashAttention-2 serves them): o is then
    (batch, seqlen_q, heads_q, D_v) and the call runs exactly at D = max(D_qk, D_v) rounded up to a
    multiple of 8 (with a backward to record: to the next backward head dim) on zero-padded copies,
    ``softmax_scale`` defaulting to 1/sqrt(D_qk) (``_value_dim``; docs/python.md, "Value head dim").
    """
    if _value_dim.needs_pad(q, k, v):  # D_v != D_qk, D not a multiple of 8, ...: padded (_value_dim)
        q, k, v, softmax_scale, dv = _value_dim.pad("attention", q, k, v, softmax_scale)
        out = attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                        softcap=softcap, return_lse=return_lse, alibi_slopes=alibi_slopes,
                        deterministic=deterministic)
        return _value_dim.unpad(out, dv, return_lse)
    left, right = (-1, -1) if window_size == (-1, -1) else _window(window_size, causal)
    softcap = float(softcap)
    if alibi_slopes is not None:
        _refuse_grad("attention with alibi_slopes (the backward kernels have no ALiBi)",
                     (("q", q), ("k", k), ("v", v), ("alibi_slopes", alibi_slopes)))
        if _plain(q, k, v, alibi_slopes):
            o, lse = _attention_alibi_impl(q, k, v, alibi_slopes, causal, softmax_scale, left, right, softcap,
                                           return_lse)
        else:
            o, lse = _attention_alibi_op(q, k, v, alibi_slopes, causal, softmax_scale, left, right, softcap)
        return (o, lse) if return_lse else o
    if _plain(q, k, v) and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                              or v.requires_grad)):
        o, lse = _attention_impl(q, k, v, causal, softmax_scale, left, right, softcap, want_lse=return_lse)
    else:
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        o, lse = _attention_op(q, k, v, causal, softmax_scale, left, right, softcap, bool(deterministic))
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# varlen prefill and paged-KV-cache attention




def _attention_varlen_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left=-1, window_right=-1, softcap=0.0, want_lse=True):
    named = (("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    index = _device_index(named)
    _same_dtype(named[:3])
    dq, dk, dv = _desc(q, "q"), _desc(k, "k"), _desc(v, "v")
    cq, ck = _idesc(cu_seqlens_q, "cu_seqlens_q"), _idesc(cu_seqlens_k, "cu_seqlens_k")
    if q.dim() != 3 or k.dim() != 3:
        _core.check_attention_varlen(dq, dk, dv, cq, ck, max_seqlen_q, max_seqlen_k)  # raises, naming it
    tq, hq, d = q.shape
    key = (index, q.dtype, d, hq, k.shape[1], causal, softmax_scale, window_left, window_right, softcap)
    plan = _cached_plan("varlen", key, lambda: _core.VarlenPlan(
        index, dq[1], d, hq, k.shape[1], causal, softmax_scale, (window_left, window_right), softcap))
    o = torch.empty((tq, hq, d), dtype=q.dtype, device=q.device)
    stream = _raw_stream(index)
    if want_lse:
        lse = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, _lse_sink(4 * hq * tq, index, stream)
    ws, ws_bytes = _workspace("varlen", plan.workspace_bytes, index, stream)
    plan.forward(stream, dq, dk, dv, cq, ck, max_seqlen_q, max_seqlen_k, o.data_ptr(), lse_ptr, ws, ws_bytes)
    return o, lse


def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left=-1, window_right=-1, softcap=0.0):
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (total_q, heads_q, head_dim) but has shape {list(q.shape)}")
    tq, hq, d = q.shape
    return q.new_empty((tq, hq, d)), q.new_empty((hq, tq), dtype=torch.float32)


_register("attention_varlen", _attention_varlen_impl, _attention_varlen_fake)
_attention_varlen_op = torch.ops.flashmoe.attention_varlen.default



def _attention_varlen_backward_impl(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, window_left=-1, window_right=-1,
                                    softcap=0.0):
    named = (("dout", dout), ("q", q), ("k", k), ("v", v), ("o", o))
    index = _device_index(named + (("lse", lse), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    _same_dtype(named)
    # The kernels take contiguous tensors (copies only where needed, as in attention_backward).
    dout, q, k, v, o, lse = (t.contiguous() for t in (dout, q, k, v, o, lse))
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(
            f"q and k must be 3-D (total_tokens, heads, head_dim), got {list(q.shape)} and {list(k.shape)}")
    tq, hq, d = q.shape
    hkv = k.shape[1]
    key = (index, q.dtype, d, hq, hkv, causal, softmax_scale, window_left, window_right, softcap)
    plan = _cached_plan("varlen_backward", key, lambda: _core.VarlenBackwardPlan(
        index, _DTYPES[q.dtype], d, hq, hkv, causal, softmax_scale, (window_left, window_right), softcap))
    # Zeroed: the kernels write the rows inside a sequence only, and rows past cu_seqlens[-1]
    # (padding the caller packed) then get a zero gradient instead of stale memory.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    ws = torch.empty(plan.workspace_bytes(tq), dtype=torch.uint8, device=q.device)
    plan.backward(_raw_stream(index), _desc(q, "q"), _desc(k, "k"), _desc(v, "v"), _desc(o, "o"),
                  _desc(dout, "dout"), _desc(lse, "lse"), _desc(dq, "dq"), _desc(dk, "dk"), _desc(dv, "dv"),
                  _idesc(cu_seqlens_q, "cu_seqlens_q"), _idesc(cu_seqlens_k, "cu_seqlens_k"), max_seqlen_q,
                  max_seqlen_k, ws.data_ptr(), ws.numel())
    return dq, dk, dv


def _attention_varlen_backward_fake(dout, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_register("attention_varlen_backward", _attention_varlen_backward_impl, _attention_varlen_backward_fake)
_forward_only("attention_varlen_backward", ("dout", "q", "k", "v", "o", "lse"))
_attention_varlen_backward_op = torch.ops.flashmoe.attention_varlen_backward.default


def _attention_varlen_setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    d = q.shape[-1]
    if d not in _BWD_HEAD_DIMS:
        name = next((n for n, t in zip("qkv", (q, k, v)) if t.requires_grad), "q")
        raise RuntimeError(
            f"flashmoe.attention_varlen has no backward pass for head_dim {d} (head dims with a backward: "
            f"{', '.join(map(str, _BWD_HEAD_DIMS))}), but {name} requires grad: its outputs would carry no "
            "gradient to the tensors upstream. Call it under torch.no_grad() or torch.inference_mode() (or "
            "on detached tensors) for inference."
        )
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, inputs[3], inputs[4])
    # max_seqlen_q, max_seqlen_k, causal, softmax_scale, then the trailing defaults the dispatcher
    # may have dropped (window_left, window_right, softcap).
    ctx.scalars = tuple(inputs[5:]) + _ATTENTION_SCALARS[2:5][len(inputs) - 9:]
    ctx.n_inputs = len(inputs)


def _attention_varlen_backward(ctx, do, dlse):
    # As for attention: lse is not differentiated through; no gradient for the offsets.
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(o)
    dq, dk, dv = _attention_varlen_backward_op(do, q, k, v, o, lse, cu_q, cu_k, *ctx.scalars)
    return (dq, dk, dv) + (None,) * (ctx.n_inputs - 3)


torch.library.register_autograd("flashmoe::attention_varlen", _attention_varlen_backward,
                                setup_context=_attention_varlen_setup_context, lib=_lib)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
):
    """Attention over a packed batch of sequences of unequal lengths (``flash_attn_varlen_func``).

    q (total_q, heads_q, head_dim); k, v (total_k, heads_kv, head_dim), heads_q a multiple of
    heads_kv; int32 ``cu_seqlens_q`` / ``cu_seqlens_k`` [batch + 1] on the same device (sequence b
    is rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k, v).
    ``max_seqlen_q`` sizes the grid and must be at least the longest query sequence; both maxima
    are host ints (nothing is read back from the device). Returns o (total_q, heads_q, head_dim)
    and with ``return_lse`` also lse (heads_q, total_q) f32. Causal is bottom-right per sequence,
    and so are ``window_size`` (left, right; -1 unbounded; causal sets right to 0) and ``softcap``,
    as in ``attention``: in a sequence of lengths (sq, sk), row i sees keys d - left ..= d + right
    of d = i + sk - sq. sm_90a (H100/H200) only, head dims 64 and 128; q, k, v may be strided views
    as in ``attention``. Rows of o outside every sequence are not written.

    Differentiable as ``attention`` is: with grad mode on and q, k or v requiring grad, the call
    goes through the op, whose autograd formula saves q, k, v, o, lse and the offsets and computes
    dq, dk, dv with the library's deterministic varlen backward
    (``torch.ops.flashmoe.attention_varlen_backward``: head dims 32, 64, 96, 128, every mask above,
    any GPU of compute capability 8.0 or newer; rows outside every sequence get zero gradients).

    v may have a value head dim of its own, and head dims other than the varlen kernels' 64 and 128
    run zero-padded to the next of those (up to 128: 40 and 59 at 64, 96 and 111 at 128), as in ``attention``
    (o is then (total_q, heads_q, D_v)).
    """
    if _value_dim.needs_pad(q, k, v, varlen=True):  # D_v != D_qk, D not 64/128, ...: padded (_value_dim)
        q, k, v, softmax_scale, dv = _value_dim.pad("attention_varlen", q, k, v, softmax_scale, varlen=True)
        out = attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                               softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                               return_lse=return_lse)
        return _value_dim.unpad(out, dv, return_lse)
    left, right = (-1, -1) if window_size == (-1, -1) else _window(window_size, causal)
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, left, right,
            float(softcap))
    if _plain(q, k, v, cu_seqlens_q, cu_seqlens_k) and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        o, lse = _attention_varlen_impl(*args, return_lse)
    else:
        o, lse = _attention_varlen_op(*args)
    return (o, lse) if return_lse else o


_MAX_Q = _core.MAX_Q_PER_SEQ  # most query rows per sequence of a decode call (16)
# Rows per sequence a decode plan is built for: Sq rounded up to a power of two (≤ 16), so a few
# plans serve every call.
_Q_BUCKETS = [1, 1, 2, 4, 4] + [8] * 4 + [16] * 8


def _decode_plan(index, dtype, d, hq, hkv, max_q, window_left, window_right, softcap, softmax_scale,
                 alibi=False):
    key = (index, dtype, d, hq, hkv, max_q, window_left, window_right, softcap, softmax_scale, alibi)
    return _cached_plan("decode", key, lambda: _core.DecodePlan(
        index, _DTYPES[dtype], d, hq, hkv, max_q, (window_left, window_right), softcap, softmax_scale, alibi))


def _cache_named(q, k_cache, v_cache, block_table, seqlens, seqlens_name, cu_seqlens_q):
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_table", block_table),
             (seqlens_name, seqlens)]
    if cu_seqlens_q is not None:
        named.append(("cu_seqlens_q", cu_seqlens_q))
    return named


def _attention_kvcache_impl(q, k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, max_q_per_seq,
                            window_left, window_right, softcap, softmax_scale, alibi_slopes=None, want_lse=True):
    named = _cache_named(q, k_cache, v_cache, block_table, seqused_k, "cache_seqlens", cu_seqlens_q)
    index = _device_index(named if alibi_slopes is None else named + [("alibi_slopes", alibi_slopes)])
    if alibi_slopes is not None and alibi_slopes.dtype is not torch.float32:
        raise TypeError(f"alibi_slopes has dtype {alibi_slopes.dtype}; flashmoe takes torch.float32 slopes "
                        "(FlashAttention's convention), shape (heads_q,) or (batch, heads_q)")
    _same_dtype(named[:3])
    dq, dkc, dvc = _desc(q, "q"), _desc(k_cache, "k_cache"), _desc(v_cache, "v_cache")
    dbt, dsu = _idesc(block_table, "block_table"), _idesc(seqused_k, "cache_seqlens")
    dcu = _idesc(cu_seqlens_q, "cu_seqlens_q") if cu_seqlens_q is not None else None
    if k_cache.dim() != 4 or block_table.dim() != 2 or q.dim() != (3 if dcu else 4):
        _core.check_attention_kvcache(dq, dkc, dvc, dbt, dsu, None, None, dcu, max_q_per_seq=max_q_per_seq,
                                      window=(window_left, window_right), softcap=softcap,
                                      softmax_scale=softmax_scale)  # raises, naming the tensor
    hq, d = q.shape[-2], q.shape[-1]
    plan = _decode_plan(index, q.dtype, d, hq, k_cache.shape[2], max_q_per_seq, window_left, window_right,
                        softcap, softmax_scale, alibi_slopes is not None)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    stream = _raw_stream(index)
    if want_lse:
        lse_shape = (hq, q.shape[0]) if dcu else (q.shape[0], hq, q.shape[1])
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
        lse_ptr = lse.data_ptr()
    else:
        lse, lse_ptr = None, _lse_sink(4 * (q.numel() // d), index, stream)  # one f32 per (row, head)
    # The split count (and so the workspace) follows the table's capacity, a host-side shape.
    need = plan.workspace_bytes(block_table.shape[0], block_table.shape[1] * k_cache.shape[1])
    ws, ws_bytes = _workspace("decode", need, index, stream)
    dsl = None if alibi_slopes is None else _desc(alibi_slopes, "alibi_slopes")
    plan.forward(stream, dq, dkc, dvc, dbt, dsu, dcu, o.data_ptr(), lse_ptr, ws, ws_bytes, dsl)
    return o, lse


def _attention_kvcache_fake(q, k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, max_q_per_seq,
                            window_left, window_right, softcap, softmax_scale, alibi_slopes=None):
    hq = q.shape[-2]
    if cu_seqlens_q is not None:
        lse_shape = (hq, q.shape[0])
    elif q.dim() == 4:
        lse_shape = (q.shape[0], hq, q.shape[1])
    else:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, heads_q, head_dim) but has shape {list(q.shape)}")
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _append_kv_impl(k, v, k_cache, v_cache, block_table, cache_seqlens):
    named = _cache_named(k, k_cache, v_cache, block_table, cache_seqlens, "cache_seqlens", None)
    named[0] = ("k", k)
    named.append(("v", v))
    index = _device_index(named)
    _same_dtype([named[0], named[-1], named[1], named[2]])
    dk, dv = _desc(k, "k"), _desc(v, "v")
    dkc, dvc = _desc(k_cache, "k_cache"), _desc(v_cache, "v_cache")
    dbt, dcs = _idesc(block_table, "block_table"), _idesc(cache_seqlens, "cache_seqlens")
    if k.dim() != 4:
        raise ValueError(f"k must be 4-D (batch, s_new, heads_kv, head_dim) but has shape {list(k.shape)}")
    # The append kernel depends only on the KV heads and head dim: a one-row causal class.
    hkv, d = k.shape[2], k.shape[3]
    plan = _decode_plan(index, k.dtype, d, hkv, hkv, 1, -1, 0, 0.0, None)
    plan.append_kv(_raw_stream(index), dk, dv, dkc, dvc, dbt, dcs)


def _append_kv_fake(k, v, k_cache, v_cache, block_table, cache_seqlens):
    return None


_register("attention_kvcache", _attention_kvcache_impl, _attention_kvcache_fake)
_register("append_kv", _append_kv_impl, _append_kv_fake)
_forward_only("attention_kvcache", ("q", "k_cache", "v_cache"))
_attention_kvcache_op = torch.ops.flashmoe.attention_kvcache.default
_append_kv_op = torch.ops.flashmoe.append_kv.default


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    max_seqlen_q: Optional[int] = None,
    causal: bool = True,
    window_size: Tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
    alibi_slopes: Optional[torch.Tensor] = None,
):
    """Attention of new query rows over a paged KV cache (``flash_attn_with_kvcache``).

    q (batch, seqlen_q, heads_q, head_dim), seqlen_q ≤ 16; or with int32 ``cu_seqlens_q``
    [batch + 1] a packed (total_q, heads_q, head_dim) of sequences of 0..``max_seqlen_q`` rows
    each (default 16; decode, speculative and chunked-prefill rows in one call). k_cache, v_cache
    (num_blocks, page_size, heads_kv, head_dim); int32 ``block_table`` (batch, max_blocks) of
    block ids; int32 ``cache_seqlens`` [batch]: the keys in the cache per sequence. With ``k``,
    ``v`` (batch, s_new, heads_kv, head_dim) the new rows are first written into the caches at
    positions cache_seqlens[b].. (the pages must exist in the table) and attention runs over
    cache_seqlens + s_new keys; ``cache_seqlens`` itself is not changed (advance it yourself).
    ``causal`` is bottom-right aligned and sets window_size[1] to 0; ``window_size`` (left, right)
    with -1 unbounded; ``softcap`` > 0 applies softcap·tanh(s/softcap). Returns o like q and with
    ``return_lse`` also lse (batch, heads_q, seqlen_q), or (heads_q, total_q) with cu_seqlens_q.
    ``alibi_slopes`` f32 (heads_q,) or (batch, heads_q): FlashAttention's ALiBi bias
    -slope·|d_i - j| (d_i the row's diagonal) after the softcap. No backward (inputs that require
    grad raise). bf16/f16, head dims 64, 128, 256, sm_80 or newer.
    """
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: give both or neither")
    if v_cache.shape[-1] != k_cache.shape[-1]:
        raise NotImplementedError(
            f"flashmoe.attention_with_kvcache: v_cache has head dim {v_cache.shape[-1]} but k_cache has "
            f"{k_cache.shape[-1]}; the decode kernels take one head dim, and padding a value cache would copy "
            "the whole cache at every step. DeepSeek MLA decode (one latent cache whose first columns are the "
            "value): flashmoe.mla_decode; prefill with a value head dim of its own: flashmoe.attention / "
            "attention_varlen"
        )
    # every path, the op path included: append_kv mutates the caches and has no autograd kernel
    _refuse_grad("attention_with_kvcache",
                 (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v),
                  ("alibi_slopes", alibi_slopes)))
    if cu_seqlens_q is None:
        if q.dim() != 4:
            raise ValueError(f"q must be 4-D (batch, seqlen_q, heads_q, head_dim) but has shape {list(q.shape)}")
        rows, what = q.shape[1], f"q has {q.shape[1]} rows per sequence"
    else:
        rows = _MAX_Q if max_seqlen_q is None else max_seqlen_q
        what = f"max_seqlen_q is {rows}"
    if rows > _MAX_Q:
        raise ValueError(
            f"{what} but attention_with_kvcache takes at most {_MAX_Q} "
            "(longer prefills: attention_varlen)"
        )
    max_q = _Q_BUCKETS[max(rows, 1)]  # rows = 0: the call itself is rejected as empty
    left, right = window_size
    if causal:
        right = 0
    plain = _plain(q, k_cache, v_cache, block_table, cache_seqlens) and (k is None or _plain(k, v)) and (
        cu_seqlens_q is None or type(cu_seqlens_q) is torch.Tensor
    ) and (alibi_slopes is None or type(alibi_slopes) is torch.Tensor)
    seqused = cache_seqlens
    if k is not None:
        (_append_kv_impl if plain else _append_kv_op)(k, v, k_cache, v_cache, block_table, cache_seqlens)
        seqused = cache_seqlens + k.shape[1]
    args = (q, k_cache, v_cache, block_table, seqused, cu_seqlens_q, max_q, left, right, float(softcap), softmax_scale,
            alibi_slopes)
    if plain:
        o, lse = _attention_kvcache_impl(*args, return_lse)
    else:
        o, lse = _attention_kvcache_op(*args)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# MoE

class MoeOutput(NamedTuple):
    """What ``flashmoe.moe`` returns."""

    out: torch.Tensor  # [T, H], x's dtype
    topk_ids: torch.Tensor  # [T, k] int32, descending score (ties: lower expert index)
    topk_weights: torch.Tensor  # [T, k] f32 combine weights
    counts: torch.Tensor  # [E] int32 tokens routed to each expert (sums to T·k)
    aux_loss: torch.Tensor  # 0-d f32 load-balancing loss
    z_loss: torch.Tensor  # 0-d f32 router z-loss


def _moe_impl(x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize):
    named = [("x", x), ("router_w", router_w), ("w13", w13), ("w2", w2)]
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared must be (shared_w13, shared_w2): both weights or neither")
    if shared_w13 is not None:
        named += [("shared_w13", shared_w13), ("shared_w2", shared_w2)]
    index = _device_index(named)
    _same_dtype(named)
    descs = [_desc(t, n) for n, t in named]
    if x.dim() != 2 or router_w.dim() != 2 or w2.dim() != 3:
        raise ValueError(
            "x must be [tokens, hidden], router_w [hidden, experts], w13 [experts, hidden, "
            f"2*intermediate] and w2 [experts, intermediate, hidden]; got {list(x.shape)}, "
            f"{list(router_w.shape)}, {list(w13.shape)} and {list(w2.shape)}"
        )
    t, h = x.shape
    e, i = router_w.shape[1], w2.shape[1]
    shared = (descs[4], descs[5]) if shared_w13 is not None else None
    plan = _moe_plan(index, descs[0][1], h, i, e, top_k, scoring, renormalize, shared is not None, t)
    dev = x.device
    out = torch.empty((t, h), dtype=x.dtype, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    counts = torch.empty((e,), dtype=torch.int32, device=dev)
    losses = torch.empty((2,), dtype=torch.float32, device=dev)
    # No zeroing needed: every intermediate is written before it is read, so a fresh
    # stream-ordered allocation from the caching allocator is the per-call workspace.
    ws_bytes = plan.workspace_bytes(t)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    plan.forward(
        _raw_stream(index),
        descs[0],
        descs[1],
        descs[2],
        descs[3],
        shared,
        out.data_ptr(),
        ids.data_ptr(),
        weights.data_ptr(),
        counts.data_ptr(),
        losses.data_ptr(),
        ws.data_ptr(),
        ws_bytes,
    )
    return out, ids, weights, counts, losses


def _moe_fake(x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize):
    if x.dim() != 2 or router_w.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden] and router_w [hidden, experts]; got {list(x.shape)}")
    t, h = x.shape
    e = router_w.shape[1]
    return (
        x.new_empty((t, h)),
        x.new_empty((t, top_k), dtype=torch.int32),
        x.new_empty((t, top_k), dtype=torch.float32),
        x.new_empty((e,), dtype=torch.int32),
        x.new_empty((2,), dtype=torch.float32),
    )


_register("moe", _moe_impl, _moe_fake)
_forward_only("moe", ("x", "router_w", "w13", "w2", "shared_w13", "shared_w2"))
_moe_op = torch.ops.flashmoe.moe.default


def moe(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    shared: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    recompute_gate_up: bool = False,
) -> MoeOutput:
    """One MoE layer: router -> top-k -> grouped SwiGLU experts (+ shared expert) -> weighted sum.

    x [T, H]; router_w [H, E]; w13 [E, H, 2I] (columns [0, I) gate, [I, 2I) up:
    h = silu(x @ gate) * (x @ up)); w2 [E, I, H]; ``shared`` = (shared_w13 [H, 2I], shared_w2
    [I, H]), a dense SwiGLU expert added to every token with weight 1. All contiguous, one dtype
    (bf16 or f16), one CUDA device. ``scoring`` "softmax" or "sigmoid"; ``renormalize`` makes the
    k weights sum to 1. PyTorch Linear weights ([out, in]) are the transposes of these.
    Eager calls skip the dispatcher as ``attention`` does. Differentiable: with grad mode on and
    an input requiring grad, the call runs ``torch.ops.flashmoe.moe_train`` (``_moe_autograd.py``),
    whose backward gives x, router_w, w13, w2 and the shared weights their gradients from ``out``
    and the two losses (deterministic; the top-k ids are constants). Such a call keeps the routed
    rows' gate/up pre-activations (T·k × 2I elements of x's dtype) for the backward;
    ``recompute_gate_up=True`` recomputes them there instead (less memory held between forward
    and backward, one more GEMM; only for calls that train).
    """
    s13, s2 = shared if shared is not None else (None, None)
    # (plain boolean expressions: torch.compile(fullgraph=True) traces this branch)
    if torch.is_grad_enabled() and (
        x.requires_grad or router_w.requires_grad or w13.requires_grad or w2.requires_grad
        or (s13 is not None and s13.requires_grad) or (s2 is not None and s2.requires_grad)
    ):
        out, ids, weights, counts, losses = _moe_train(x, router_w, w13, w2, s13, s2, top_k, scoring, renormalize,
                                                       not recompute_gate_up)
        return MoeOutput(out, ids, weights, counts, losses[0], losses[1])
    if recompute_gate_up:
        raise ValueError("flashmoe.moe: recompute_gate_up=True is for calls that train (grad mode on and an "
                         "input requiring grad); this call runs the inference forward")
    if _plain(x, router_w, w13, w2):
        _refuse_grad("moe", (("x", x), ("router_w", router_w), ("w13", w13), ("w2", w2), ("shared_w13", s13),
                             ("shared_w2", s2)))
        run = _moe_impl
    else:
        run = _moe_op
    out, ids, weights, counts, losses = run(x, router_w, w13, w2, s13, s2, top_k, scoring, renormalize)
    return MoeOutput(out, ids, weights, counts, losses[0], losses[1])
