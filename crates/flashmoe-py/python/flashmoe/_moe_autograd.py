"""Autograd for ``flashmoe.moe``: the MoE layer's backward (``_core.MoeBackwardPlan``).

Two ops in a fragment of the ``flashmoe`` library (the inference op ``moe`` lives in
``_torch.py``):

- ``flashmoe::moe_train``: the forward of ``moe`` that also returns ``saved``, a uint8 copy of
  the first ``MoeBackwardPlan.saved_bytes(T)`` bytes of its workspace (router logits, expert
  offsets, row tables: the routing the backward reads; T·E + T·k words, small), and with
  ``save_gate_up`` the routed rows' gate/up pre-activations ``gate_up`` [T·k, 2I] of x's dtype
  (written by the forward's GEMM; the backward then skips recomputing them: measured on an
  H200 1.9 ms of a 12.0 ms forward + backward at seed 003's 2048 tokens, and a smaller
  backward workspace; docs/design/moe.md, "Save or recompute"). Registered with
  ``torch.library.register_autograd``: differentiable in x, router_w, w13, w2 and the shared
  expert's weights.
- ``flashmoe::moe_backward``: the gradients, given d(out) and d(losses) (aux, z). Its own
  Autograd kernel refuses inputs that require grad (no double backward).

Conventions (those of ``crates/flashmoe/src/reference/moe_backward.rs``, PyTorch's autograd on
the same formulas): the top-k ids are constants; the routing weights are differentiated through
the renormalisation and the softmax / sigmoid; in the aux loss the token fractions are
constants. ``topk_ids``, ``topk_weights`` and ``counts`` are not differentiable outputs: a
gradient flowing into ``topk_weights`` from outside the layer is ignored (use ``out`` and the
two losses). Gradients come out in the weights' dtype (fp32 accumulation, one rounding); the
backward is deterministic (bit-identical run to run).

``flashmoe.moe`` takes this path when grad mode is on and an input requires grad, eagerly and
under ``torch.compile`` alike; otherwise the inference op runs.
"""

import torch

from . import _core
from ._common import _DTYPES, _desc, _device_index, _grown_plan, _moe_plan, _raw_stream, _same_dtype

_lib = torch.library.Library("flashmoe", "FRAGMENT")
_lib.define(
    "moe_train(Tensor x, Tensor router_w, Tensor w13, Tensor w2, Tensor? shared_w13, Tensor? shared_w2, "
    "int top_k, str scoring, bool renormalize, bool save_gate_up) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_lib.define(
    "moe_backward(Tensor d_out, Tensor? d_losses, Tensor x, Tensor router_w, Tensor w13, Tensor w2, "
    "Tensor? shared_w13, Tensor? shared_w2, Tensor topk_ids, Tensor topk_weights, Tensor counts, "
    "Tensor saved, Tensor? gate_up, int top_k, str scoring, bool renormalize) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)

def _bwd_plan(index, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared, tokens):
    key = (index, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared)
    return _grown_plan("moe_backward", _core.MoeBackwardPlan, key, tokens)


def _saved_bytes(t, e, k):
    """The forward workspace's routing prefix for T = t (mirror of the Rust WorkspaceLayout, which
    carves logits, probs [T, E] f32, lse [T], prob_sum [E], lse_sq_sum [1], offsets [E + 1],
    row_token, row_slot, slot_row [T·k] u32 in that order, each 256-byte aligned). Works on
    symbolic sizes (the fake kernel); the real kernel checks it against the plan's own."""
    end = 0
    for n in (t * e, t * e, t, e, 1, e + 1, t * k, t * k, t * k):
        start = (end + 255) // 256 * 256
        end = start + 4 * n
    return end


def _named(x, router_w, w13, w2, shared_w13, shared_w2):
    named = [("x", x), ("router_w", router_w), ("w13", w13), ("w2", w2)]
    if (shared_w13 is None) != (shared_w2 is None):
        raise ValueError("shared must be (shared_w13, shared_w2): both weights or neither")
    if shared_w13 is not None:
        named += [("shared_w13", shared_w13), ("shared_w2", shared_w2)]
    return named


def _moe_train_impl(x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize, save_gate_up):
    named = _named(x, router_w, w13, w2, shared_w13, shared_w2)
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
    bplan = _bwd_plan(index, descs[0][1], h, i, e, top_k, scoring, renormalize, shared is not None, t)
    keep = bplan.saved_bytes(t)
    if keep != _saved_bytes(t, e, top_k):  # the fake kernel's mirror of the layout
        raise RuntimeError(f"flashmoe: saved-routing size mismatch ({keep} vs {_saved_bytes(t, e, top_k)})")
    dev = x.device
    out = torch.empty((t, h), dtype=x.dtype, device=dev)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=dev)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=dev)
    counts = torch.empty((e,), dtype=torch.int32, device=dev)
    losses = torch.empty((2,), dtype=torch.float32, device=dev)
    ws_bytes = plan.workspace_bytes(t)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dev)
    gate_up = torch.empty((t * top_k, 2 * i) if save_gate_up else (0,), dtype=x.dtype, device=dev)
    plan.forward(_raw_stream(index), descs[0], descs[1], descs[2], descs[3], shared, out.data_ptr(),
                 ids.data_ptr(), weights.data_ptr(), counts.data_ptr(), losses.data_ptr(), ws.data_ptr(),
                 ws_bytes, gate_up=gate_up.data_ptr() if save_gate_up else 0)
    # Stream-ordered copy of the routing prefix; the rest of the workspace (h, y) is released.
    saved = ws[:keep].clone()
    return out, ids, weights, counts, losses, saved, gate_up


def _moe_train_fake(x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize, save_gate_up):
    t, h = x.shape
    e, i = router_w.shape[1], w2.shape[1]
    return (
        x.new_empty((t, h)),
        x.new_empty((t, top_k), dtype=torch.int32),
        x.new_empty((t, top_k), dtype=torch.float32),
        x.new_empty((e,), dtype=torch.int32),
        x.new_empty((2,), dtype=torch.float32),
        x.new_empty((_saved_bytes(t, e, top_k),), dtype=torch.uint8),
        x.new_empty((t * top_k, 2 * i) if save_gate_up else (0,)),
    )


def _moe_backward_impl(d_out, d_losses, x, router_w, w13, w2, shared_w13, shared_w2, topk_ids, topk_weights,
                       counts, saved, gate_up, top_k, scoring, renormalize):
    named = _named(x, router_w, w13, w2, shared_w13, shared_w2)
    index = _device_index(named + [("d_out", d_out), ("topk_ids", topk_ids), ("saved", saved)])
    _same_dtype(named + [("d_out", d_out)])
    t, h = x.shape
    e, i = router_w.shape[1], w2.shape[1]
    shared = shared_w13 is not None
    plan = _bwd_plan(index, _DTYPES[x.dtype], h, i, e, top_k, scoring, renormalize, shared, t)
    # A gradient may arrive expanded or strided (copies only where needed).
    d_out = d_out.contiguous()
    dl = d_losses.to(torch.float32).contiguous() if d_losses is not None else None
    topk_ids, topk_weights, counts = (z.contiguous() for z in (topk_ids, topk_weights, counts))
    if topk_ids.dtype != torch.int32 or counts.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise TypeError("topk_ids and counts must be int32 and topk_weights float32 (moe_train's outputs)")
    dev = x.device
    empty = lambda like: torch.empty(like.shape, dtype=like.dtype, device=dev)  # noqa: E731
    dx, d_router, dw13, dw2 = empty(x), empty(router_w), empty(w13), empty(w2)
    if shared:
        ds13, ds2 = empty(shared_w13), empty(shared_w2)
        shared_descs = (_desc(shared_w13, "shared_w13"), _desc(shared_w2, "shared_w2"))
        d_shared = (ds13.data_ptr(), ds2.data_ptr())
    else:
        ds13 = ds2 = x.new_empty((0,))
        shared_descs = d_shared = None
    if gate_up is not None and (gate_up.dtype != x.dtype or gate_up.shape != (t * top_k, 2 * i)
                                or not gate_up.is_contiguous()):
        raise ValueError(f"gate_up must be a contiguous [{t * top_k}, {2 * i}] tensor of x's dtype "
                         f"(moe_train's output); got {list(gate_up.shape)} {gate_up.dtype}")
    # Any contents: every region is written before it is read.
    ws = torch.empty(plan.workspace_bytes(t, gate_up is not None), dtype=torch.uint8, device=dev)
    plan.backward(
        _raw_stream(index), _desc(x, "x"), _desc(router_w, "router_w"), _desc(w13, "w13"), _desc(w2, "w2"),
        shared_descs, topk_ids.data_ptr(), topk_weights.data_ptr(), counts.data_ptr(), saved.data_ptr(),
        saved.numel(), _desc(d_out, "d_out"), dl.data_ptr() if dl is not None else 0, dx.data_ptr(),
        d_router.data_ptr(), dw13.data_ptr(), dw2.data_ptr(), d_shared, ws.data_ptr(), ws.numel(),
        gate_up=gate_up.data_ptr() if gate_up is not None else 0,
    )
    return dx, d_router, dw13, dw2, ds13, ds2


def _moe_backward_fake(d_out, d_losses, x, router_w, w13, w2, shared_w13, shared_w2, topk_ids, topk_weights,
                       counts, saved, gate_up, top_k, scoring, renormalize):
    shared = shared_w13 is not None
    return (
        torch.empty_like(x),
        torch.empty_like(router_w),
        torch.empty_like(w13),
        torch.empty_like(w2),
        torch.empty_like(shared_w13) if shared else x.new_empty((0,)),
        torch.empty_like(shared_w2) if shared else x.new_empty((0,)),
    )


for _name, _impl, _fake in (("moe_train", _moe_train_impl, _moe_train_fake),
                            ("moe_backward", _moe_backward_impl, _moe_backward_fake)):
    for _key in ("CUDA", "CPU"):
        _lib.impl(_name, _impl, _key)
    torch.library.register_fake(f"flashmoe::{_name}", _fake, lib=_lib)

_moe_train_op = torch.ops.flashmoe.moe_train.default
_moe_backward_op = torch.ops.flashmoe.moe_backward.default


def _moe_backward_autograd(*args):
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        raise RuntimeError(
            "flashmoe.moe has no double backward: torch.ops.flashmoe.moe_backward got an input that "
            "requires grad (create_graph=True?)"
        )
    with torch._C._AutoDispatchBelowAutograd():
        return _moe_backward_op(*args)


_lib.impl("moe_backward", _moe_backward_autograd, "Autograd")


def _setup_context(ctx, inputs, output):
    x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize, save_gate_up = inputs
    _out, ids, weights, counts, _losses, saved, gate_up = output
    ctx.save_for_backward(x, router_w, w13, w2, shared_w13, shared_w2, ids, weights, counts, saved,
                          gate_up if save_gate_up else None)
    ctx.cfg = (top_k, scoring, renormalize)


def _backward(ctx, d_out, _d_ids, _d_weights, _d_counts, d_losses, _d_saved, _d_gate_up):
    x, router_w, w13, w2, shared_w13, shared_w2, ids, weights, counts, saved, gate_up = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(x)
    dx, d_router, dw13, dw2, ds13, ds2 = _moe_backward_op(
        d_out, d_losses, x, router_w, w13, w2, shared_w13, shared_w2, ids, weights, counts, saved, gate_up,
        *ctx.cfg
    )
    shared = shared_w13 is not None
    return dx, d_router, dw13, dw2, ds13 if shared else None, ds2 if shared else None, None, None, None, None


torch.library.register_autograd("flashmoe::moe_train", _backward, setup_context=_setup_context, lib=_lib)


def moe_train(x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize, save_gate_up=True):
    """The differentiable forward: (out, topk_ids, topk_weights, counts, losses[2]).
    ``save_gate_up``: keep the gate/up pre-activations for the backward (else recomputed)."""
    out, ids, weights, counts, losses, _saved, _gate_up = _moe_train_op(
        x, router_w, w13, w2, shared_w13, shared_w2, top_k, scoring, renormalize, save_gate_up
    )
    return out, ids, weights, counts, losses
