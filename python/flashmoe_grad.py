"""Gradient baselines of the flashmoe worker (``flashmoe bench --pass bwd|fwd+bwd``).

Problems of kind "grad": ``{"pass": "bwd" | "fwd+bwd", "layer": {the forward problem}}``
with the inputs of the layer plus ``d_out`` (the upstream gradient of its output, in the
output's layout). The timed call is ``torch.autograd.grad`` of the output against d_out:

* pass ``bwd``: over a forward graph built once in ``prepare`` and retained
  (``retain_graph=True``): the backward alone, as FlashAttention's and cuDNN's backward
  benchmarks time it;
* pass ``fwd+bwd``: the forward, then the backward.

Outputs (check run): the gradients in flashmoe's layouts — dq, dk, dv (B, S, H, D) for
attention; dx, d_router, dw13, dw2 (+ d_shared_w13, d_shared_w2) for MoE.

Baselines: ``sdpa-flash``, ``sdpa-cudnn``, ``sdpa-efficient`` (SDPA with the backend forced;
no window or softcap), ``flex`` (FlexAttention's backward, compiled; windows and softcap
through its mask and score mods; CUDA only: torch has no FlexAttention backward on the CPU),
``fa4`` (FlashAttention-4's ``flash_attn.cute.flash_attn_func`` autograd: its sm90 / sm100
backward; windows and softcap; when the package imports), ``fa4-det`` (the same with
``deterministic=True``: its bit-identical backward),
``moe-grouped-mm`` (the ``torch._grouped_mm`` path's autograd) and
``moe-naive-loop`` (the per-expert loop's autograd). The routing (top-k ids) is an integer
decision, outside the derivative, as in the reference (``reference/moe_backward.rs``);
the routing weights are differentiated through the renormalisation and the scores.
"""

import contextlib

ATTENTION = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "flex", "fa4", "fa4-det")
MOE = ("moe-grouped-mm", "moe-naive-loop")


def build(w, p, torch, F, not_applicable):
    """Fill ``p.fn`` / ``p.check`` / ``p.outputs`` for a gradient problem. ``w``: the worker
    (device, sync, attention layouts); ``not_applicable``: the worker's exception class."""
    pr = p.problem
    layer = pr["layer"]
    kind = layer.get("kind")
    fwd_too = pr.get("pass") == "fwd+bwd"
    if pr.get("pass") not in ("bwd", "fwd+bwd"):
        raise not_applicable(f"pass {pr.get('pass')!r}: expected bwd or fwd+bwd")
    # The worker runs with autograd off (forward baselines); the graph is built and every
    # call made with it on.
    with torch.enable_grad():
        if kind == "attention" and p.impl == "flex":
            _flex(w, p, layer, fwd_too, torch, not_applicable)
        elif kind == "attention" and p.impl in ("fa4", "fa4-det"):
            _fa4(w, p, layer, fwd_too, torch, not_applicable, deterministic=p.impl == "fa4-det")
        elif kind == "attention" and p.impl in ATTENTION:
            _attention(w, p, layer, fwd_too, torch, F, not_applicable)
        elif kind == "moe" and p.impl in MOE:
            if pr.get("d_aux") or pr.get("d_z") or pr.get("router", "random") != "random":
                raise not_applicable("the PyTorch MoE baselines train no aux / z-loss and take "
                                     "the generated router")
            _moe(w, p, layer, fwd_too, torch, F, not_applicable)
        else:
            raise not_applicable(f"{p.impl} has no backward for {kind} problems")
    inner = p.context

    def context():
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad())
        if inner is not None:
            stack.enter_context(inner())
        return stack

    p.context = context


def _grad_call(torch, forward, leaves, d_out, fwd_too):
    """The timed call: (forward +) autograd.grad of the output against d_out."""
    if fwd_too:
        def fn():
            return torch.autograd.grad(forward(), leaves, d_out)
        return fn
    out = forward()

    def fn():
        return torch.autograd.grad(out, leaves, d_out, retain_graph=True)
    return fn


def _attention(w, p, pr, fwd_too, torch, F, not_applicable):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION}[p.impl]
    b, hq, hkv = pr["batch"], pr["heads_q"], pr["heads_kv"]
    sq, sk, d = pr["seqlen_q"], pr["seqlen_k"], pr["head_dim"]
    causal = bool(pr["causal"])
    window = tuple(pr.get("window") or (-1, -1))
    if window[0] >= 0 or (not causal and window[1] > 0) or float(pr.get("softcap") or 0.0) > 0:
        raise not_applicable("no sliding-window or softcap option in SDPA")
    scale = pr.get("softmax_scale")
    scale = float(scale) if scale is not None else d ** -0.5
    # (B, S, H, D) → (B, H, S, D) leaves that require grad (copies outside the timed call).
    q, k, v, d_out = _bhsd_leaves(p)
    gqa = hq != hkv
    kw = {"scale": scale}
    if causal and sq == sk:
        kw["is_causal"] = True
    elif causal:
        # Bottom-right aligned (SDPA's is_causal is top-left when Sq != Sk).
        i = torch.arange(sq, device=q.device).unsqueeze(1)
        j = torch.arange(sk, device=q.device).unsqueeze(0)
        kw["attn_mask"] = j <= i + (sk - sq)
    state = {"expand": False}

    def forward():
        kk, vv = k, v
        if gqa and state["expand"]:
            g = hq // hkv
            kk, vv = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        extra = {"enable_gqa": True} if gqa and not state["expand"] else {}
        return F.scaled_dot_product_attention(q, kk, vv, **kw, **extra)

    p.context = lambda: sdpa_kernel([backend])
    with sdpa_kernel([backend]):
        try:
            fn = _grad_call(torch, forward, (q, k, v), d_out, fwd_too)
            fn()
            w.sync()
        except Exception as e:  # noqa: BLE001
            if not gqa or "out of memory" in str(e):
                raise
            state["expand"] = True
            p.notes.append(f"backend rejected enable_gqa ({str(e).splitlines()[0][:120]}): K/V "
                           "heads expanded with repeat_interleave inside the graph")
            fn = _grad_call(torch, forward, (q, k, v), d_out, fwd_too)
    p.fn = fn
    p.outputs = ["dq", "dk", "dv"]

    p.check = _bshd_check(fn)
    p.notes.append("autograd.grad of SDPA (" + ("forward + backward" if fwd_too else
                   "backward over a retained forward graph") + ")")


def _bshd_check(fn):
    """The check of a (B, H, S, D) attention call: dq, dk, dv in flashmoe's (B, S, H, D)."""
    def check():
        dq, dk, dv = fn()
        return {"dq": dq.transpose(1, 2), "dk": dk.transpose(1, 2), "dv": dv.transpose(1, 2)}
    return check


def _bhsd_leaves(p):
    """q, k, v as (B, H, S, D) leaves that require grad, and d_out (B, H, S, D)."""
    t = p.inputs.tensors
    q, k, v = (t[n].transpose(1, 2).contiguous().requires_grad_(True) for n in ("q", "k", "v"))
    return q, k, v, t["d_out"].transpose(1, 2).contiguous()


def _flex(w, p, pr, fwd_too, torch, not_applicable):
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # noqa: BLE001
        raise not_applicable(f"FlexAttention not available in torch {torch.__version__} ({e})")
    if not w.cuda:
        raise not_applicable("torch has no FlexAttention backward on the CPU")
    hq, hkv, sq, sk, d = pr["heads_q"], pr["heads_kv"], pr["seqlen_q"], pr["seqlen_k"], pr["head_dim"]
    causal = bool(pr["causal"])
    left, right = (int(x) for x in (pr.get("window") or (-1, -1)))
    right = 0 if causal else right
    softcap = float(pr.get("softcap") or 0.0)
    scale = pr.get("softmax_scale")
    scale = float(scale) if scale is not None else d ** -0.5
    q, k, v, d_out = _bhsd_leaves(p)
    kw = {"scale": scale}
    if left >= 0 or right >= 0:
        offset = sk - sq

        def mask_mod(b_, h_, q_idx, kv_idx):
            # Bottom-right aligned: row i's diagonal is key i + sk - sq.
            diag = q_idx + offset
            keep = kv_idx >= 0
            if right >= 0:
                keep = keep & (kv_idx <= diag + right)
            if left >= 0:
                keep = keep & (kv_idx >= diag - left)
            return keep

        kw["block_mask"] = create_block_mask(mask_mod, None, None, sq, sk, device=q.device)
    if softcap > 0:
        def score_mod(score, b_, h_, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

        kw["score_mod"] = score_mod
    if hq != hkv:
        kw["enable_gqa"] = True
    torch._dynamo.reset()
    call = torch.compile(flex_attention, dynamic=False)
    p.notes.append("FlexAttention compiled (torch.compile), backward through autograd")
    fn = _grad_call(torch, lambda: call(q, k, v, **kw), (q, k, v), d_out, fwd_too)
    fn()
    w.sync()
    p.fn = fn
    p.outputs = ["dq", "dk", "dv"]

    p.check = _bshd_check(fn)


def _fa4(w, p, pr, fwd_too, torch, not_applicable, deterministic=False):
    import flashmoe_packages as pk
    if not w.cuda:
        raise not_applicable("fa4 needs CUDA")
    try:
        f = pk._import("fa4").flash_attn_func
    except pk.Unavailable as e:
        raise not_applicable(str(e)) from None
    b, hq, hkv = pr["batch"], pr["heads_q"], pr["heads_kv"]
    sq, sk, d = pr["seqlen_q"], pr["seqlen_k"], pr["head_dim"]
    causal = bool(pr["causal"])
    left, right = (int(x) for x in (pr.get("window") or (-1, -1)))
    scale = pr.get("softmax_scale")
    scale = float(scale) if scale is not None else d ** -0.5
    t = p.inputs.tensors
    # FlashAttention's own (B, S, H, D) layout: leaves without a transpose.
    q, k, v = (t[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    a = pk.Attn(torch, q, k, v, b, hq, hkv, sq, sk, d, causal, scale,
                (left, 0 if causal else right), float(pr.get("softcap") or 0.0))
    kw = a.fa_window_kwargs(none_for_unbounded=True)

    # deterministic: FA4's bit-identical backward (a keyword its older builds lack: the
    # first call below then reports the config as not applicable).
    det = {"deterministic": True} if deterministic else {}

    def forward():
        return f(q, k, v, softmax_scale=scale, return_lse=True, **kw, **det)[0]

    fn = _grad_call(torch, forward, (q, k, v), t["d_out"], fwd_too)
    try:
        fn()
        w.sync()
    except Exception as e:  # noqa: BLE001
        if "out of memory" in str(e).lower():
            raise
        raise not_applicable(f"flash_attn.cute rejected the config: {str(e).splitlines()[0][:200]}")
    p.fn = fn
    p.outputs = ["dq", "dk", "dv"]
    p.check = lambda: dict(zip(("dq", "dk", "dv"), fn()))
    p.notes.append("flash_attn.cute.flash_attn_func autograd, (B, S, H, D), GQA native"
                   + (", deterministic=True" if deterministic else "")
                   + "; the first call (JIT compile) not timed")


def _moe(w, p, pr, fwd_too, torch, F, not_applicable):
    t_, h_, i_, e_, k_ = pr["tokens"], pr["hidden"], pr["intermediate"], pr["experts"], pr["top_k"]
    scoring, renorm = pr["scoring"], bool(pr["renormalize"])
    shared = bool(pr.get("shared_expert"))
    dt = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[pr["dtype"]]
    t = p.inputs.tensors
    leaves = {n: t[n].clone().requires_grad_(True) for n in ("x", "router", "w13", "w2")}
    if shared:
        leaves["shared_w13"] = t["shared_w13"].clone().requires_grad_(True)
        leaves["shared_w2"] = t["shared_w2"].clone().requires_grad_(True)
    x, router, w13, w2 = (leaves[n] for n in ("x", "router", "w13", "w2"))
    d_out = t["d_out"]

    def swiglu(h):
        return F.silu(h[:, :i_]) * h[:, i_:]

    def route():
        logits = torch.matmul(x.float(), router.float())
        scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        # The ids are integers (no gradient); the weights gather the differentiable scores.
        ids = torch.sort(scores.detach(), dim=-1, descending=True, stable=True)[1][:, :k_]
        wts = scores.gather(1, ids)
        if renorm:
            wts = wts / wts.sum(dim=-1, keepdim=True)
        return wts, ids

    def shared_out():
        return torch.matmul(swiglu(torch.matmul(x, leaves["shared_w13"])), leaves["shared_w2"]).float()

    if p.impl == "moe-grouped-mm":
        if not hasattr(torch, "_grouped_mm"):
            raise not_applicable(f"torch._grouped_mm not in torch {torch.__version__}")

        def forward():
            wts, ids = route()
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=e_), 0, dtype=torch.int32)
            tok = torch.div(order, k_, rounding_mode="floor")
            xs = x.index_select(0, tok)
            ys = torch._grouped_mm(swiglu(torch._grouped_mm(xs, w13, offs=offs)), w2, offs=offs)
            y = torch.empty_like(ys).index_copy(0, order, ys)
            out = (y.view(t_, k_, h_).float() * wts.unsqueeze(-1)).sum(dim=1)
            if shared:
                out = out + shared_out()
            return out.to(dt)
        p.notes.append("torch._grouped_mm autograd (tokens sorted by expert)")
    else:
        def forward():
            wts, ids = route()
            out = torch.zeros(t_, h_, dtype=torch.float32, device=x.device)
            for e in range(e_):
                tok, slot = torch.where(ids == e)
                if tok.numel() == 0:
                    continue
                y = torch.matmul(swiglu(torch.matmul(x[tok], w13[e])), w2[e])
                out = out.index_add(0, tok, y.float() * wts[tok, slot].unsqueeze(1))
            if shared:
                out = out + shared_out()
            return out.to(dt)
        p.notes.append("per-expert Python loop's autograd (host syncs included)")

    names = list(leaves)
    fn = _grad_call(torch, forward, tuple(leaves.values()), d_out, fwd_too)
    p.fn = fn
    out_names = {"x": "dx", "router": "d_router", "w13": "dw13", "w2": "dw2",
                 "shared_w13": "d_shared_w13", "shared_w2": "d_shared_w2"}
    p.outputs = [out_names[n] for n in names]
    p.check = lambda: {out_names[n]: g for n, g in zip(names, fn())}
