"""FlashAttention-2's Python call conventions over flashmoe's ops.

``import flashmoe.flash_attn_interface as flash_attn_interface`` (or ``from
flashmoe.flash_attn_interface import flash_attn_func, ...``) in place of FlashAttention's module:
``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take FA2's
positional order, defaults and return values, and run ``flashmoe.attention``,
``flashmoe.attention_varlen`` and ``flashmoe.attention_with_kvcache`` (layouts, masks, GQA,
gradients and graph/compile behaviour are those functions'). The packed forms
(``flash_attn_qkvpacked_func``, ``flash_attn_kvpacked_func`` and their varlen versions) split
the packed tensor into views (no copy; gradients flow back into it) and call the functions
above, so they run where those take strided views (see ``flashmoe.attention``; elsewhere the
op's error asks for contiguous tensors).

Every FA argument is accepted; one flashmoe does not implement raises instead of being ignored:
``dropout_p`` other than 0 is a ValueError (flashmoe has no attention dropout);
``cache_leftpad``, the varlen ``block_table``, ALiBi
(``alibi_slopes``, until the ops take slopes) and ``return_attn_probs=True`` (FA returns the
softmax matrix; for the log-sum-exp use ``flashmoe.attention(..., return_lse=True)``) raise
NotImplementedError naming the argument. ``deterministic=True`` gives bit-identical gradients;
False (FA's default) the fastest backward unless ``torch.use_deterministic_algorithms(True)`` is
on (``flashmoe.attention``'s ``deterministic=None``); the varlen backward is always
deterministic. ``num_splits`` is a scheduling hint and is not needed (the
decode plan picks its own split).

The module imports without torch (the signatures can be inspected; a call then raises
ImportError).
"""

import importlib
import inspect
import numbers

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


# The torch layer, resolved once at import (flashmoe's __init__ has already imported torch when it
# is installed), so that the functions look up a module global: torch.compile traces them without
# an import inside the graph. None without torch.
try:
    _OPS = importlib.import_module(__package__ + "._torch")
except ImportError as _e:  # torch missing: the signatures stay usable, calls say what they need
    if "torch" not in str(_e):
        raise
    _OPS = None


def _torch_ops():
    """The torch layer (``flashmoe._torch``), or the ImportError flashmoe's torch ops give without
    PyTorch."""
    if _OPS is None:
        raise ImportError(
            "flashmoe.flash_attn_interface needs PyTorch (pip install torch); flashmoe._core works without it"
        )
    return _OPS


def _check_dropout(dropout_p):
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}")
    if dropout_p != 0.0:
        raise ValueError(
            f"dropout_p = {dropout_p!r}: flashmoe has no attention dropout (pass dropout_p=0.0, e.g. in eval "
            "mode, or apply dropout outside the attention)"
        )


def _not_implemented(fn, name, why=""):
    raise NotImplementedError(f"flashmoe.flash_attn_interface.{fn}: {name} is not implemented{why}")


def _check_probs(fn, return_attn_probs):
    if return_attn_probs:
        _not_implemented(
            fn,
            "return_attn_probs=True",
            " (FlashAttention returns (out, softmax_lse, S_dmask) with the softmax matrix, which flashmoe "
            "never forms; for the log-sum-exp use flashmoe.attention / attention_varlen with return_lse=True)",
        )


def _accepts_alibi(fn) -> bool:
    try:
        return "alibi_slopes" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


def _alibi_kwargs(fn_name, op, alibi_slopes):
    """``{"alibi_slopes": slopes}`` when the op takes ALiBi slopes, ``{}`` without slopes, else
    NotImplementedError."""
    if alibi_slopes is None:
        return {}
    if not _accepts_alibi(op):
        _not_implemented(fn_name, "alibi_slopes", " (ALiBi is not in flashmoe's attention ops yet)")
    return {"alibi_slopes": alibi_slopes}


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_func`` on ``flashmoe.attention``.

    q (batch, seqlen_q, nheads, headdim); k, v (batch, seqlen_k, nheads_k, headdim), nheads a
    multiple of nheads_k (MQA/GQA). ``causal`` is bottom-right aligned; ``window_size`` (left,
    right) around that diagonal, -1 unbounded; ``softcap`` > 0 turns on softcapping;
    ``softmax_scale`` defaults to 1/sqrt(headdim). Returns out (batch, seqlen_q, nheads, headdim).
    v may have a head dim of its own (headdim_v ≠ headdim, as FA3 allows; out then has headdim_v):
    see ``flashmoe.attention``.
    Differentiable (dq, dk, dv by flashmoe's backward; ``deterministic`` as in the module's
    docstring). ``dropout_p`` must be 0; ``return_attn_probs=True`` and (for now)
    ``alibi_slopes`` raise NotImplementedError.
    """
    name = "flash_attn_func"
    _check_dropout(dropout_p)
    _check_probs(name, return_attn_probs)
    ops = _torch_ops()
    extra = _alibi_kwargs(name, ops.attention, alibi_slopes)
    return ops.attention(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         softcap=softcap, deterministic=True if deterministic else None, **extra)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """``flash_attn.flash_attn_varlen_func`` on ``flashmoe.attention_varlen``.

    q (total_q, nheads, headdim); k, v (total_k, nheads_k, headdim); int32 ``cu_seqlens_q`` /
    ``cu_seqlens_k`` (batch + 1,); ``max_seqlen_q`` / ``max_seqlen_k`` host ints. Masks per
    sequence as in ``flash_attn_func``. Returns out (total_q, nheads, headdim). Differentiable.
    v may have a head dim of its own, as in ``flash_attn_func``.
    ``dropout_p`` must be 0; ``return_attn_probs=True``, a paged ``block_table`` and (for now)
    ``alibi_slopes`` raise NotImplementedError.
    """
    name = "flash_attn_varlen_func"
    del deterministic  # either way: flashmoe's varlen backward is always deterministic
    _check_dropout(dropout_p)
    _check_probs(name, return_attn_probs)
    if block_table is not None:
        _not_implemented(name, "block_table (a paged KV cache in the varlen call)",
                         " (paged caches: flash_attn_with_kvcache)")
    ops = _torch_ops()
    extra = _alibi_kwargs(name, ops.attention_varlen, alibi_slopes)
    return ops.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                                softmax_scale=softmax_scale, window_size=window_size, softcap=softcap, **extra)


def _apply_rotary(torch, x, cos, sin, offsets, interleaved, same_position):
    """FlashAttention-2's rotary embedding of x (batch, seqlen, nheads, headdim) in float32,
    returned in x's dtype: token i of sequence b at position offsets[b] + i (offsets[b] for every
    token when `same_position`), its first rotary_dim = 2·cos.shape[1] dims rotated — pairs
    (2j, 2j + 1) when `interleaved` (GPT-J), else (j, j + rotary_dim / 2) (GPT-NeoX) — by the
    angle whose cos / sin are row `position` of cos / sin; the other dims unchanged."""
    b, s = x.shape[0], x.shape[1]
    ro = 2 * cos.shape[1]
    steps = torch.zeros(s, dtype=torch.int64, device=x.device) if same_position else torch.arange(
        s, device=x.device)
    pos = offsets.to(torch.int64).view(b, 1) + steps.view(1, s)  # (b, s)
    c = cos.float()[pos].unsqueeze(2)  # (b, s, 1, ro / 2)
    sn = sin.float()[pos].unsqueeze(2)
    xf = x.float()
    head, tail = xf[..., :ro], xf[..., ro:]
    if interleaved:
        x0, x1 = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((x0 * c - x1 * sn, x0 * sn + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = head[..., : ro // 2], head[..., ro // 2:]
        rot = torch.cat((x0 * c - x1 * sn, x0 * sn + x1 * c), dim=-1)
    return torch.cat((rot, tail), dim=-1).to(x.dtype)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """``flash_attn.flash_attn_with_kvcache`` on ``flashmoe.attention_with_kvcache``.

    q (batch, seqlen_q, nheads, headdim), seqlen_q at most 16 (flashmoe's decode kernels; longer
    prefills: flash_attn_varlen_func). The cache is either contiguous, k_cache / v_cache
    (batch_cache, seqlen_cache, nheads_k, headdim) with ``block_table`` None (``cache_batch_idx``
    (batch,) int32 picks each sequence's cache row, default 0..batch-1), or paged, (num_blocks,
    page_size, nheads_k, headdim) with int32 ``block_table`` (batch, max_blocks). ``cache_seqlens``
    is an int or an int32 (batch,) tensor; None means the whole cache row (or table). With ``k``,
    ``v`` (batch, seqlen_new, nheads_k, headdim) the new rows are written into the caches in place
    at cache_seqlens.. first, and attention runs over cache_seqlens + seqlen_new keys. ``causal``
    defaults to False as in FA. Returns out, and with ``return_softmax_lse`` (out, softmax_lse
    (batch, nheads, seqlen_q)). No gradient (as FA: a cache takes none): inputs that require grad
    raise.

    ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2), with ``k`` and ``v``: FA2's rotary
    embedding, applied here (float32, then q's dtype) before the call: the new keys at positions
    cache_seqlens, cache_seqlens + 1, ...; q at those positions when ``causal`` or a window is on,
    else every query row at position cache_seqlens; ``rotary_interleaved`` pairs dims (0, 1),
    (2, 3), ... (GPT-J), else (j, j + rotary_dim / 2) (GPT-NeoX). ``cache_leftpad`` and (for now)
    ``alibi_slopes`` raise NotImplementedError.
    """
    name = "flash_attn_with_kvcache"
    if cache_leftpad is not None:
        _not_implemented(name, "cache_leftpad")
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    ops = _torch_ops()
    torch = ops.torch
    extra = _alibi_kwargs(name, ops.attention_with_kvcache, alibi_slopes)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (batch, seqlen_q, nheads, headdim) but has shape {list(q.shape)}")
    batch = q.shape[0]
    if block_table is None:
        # A contiguous cache is a paged one with one page per cache row: row b of the table is
        # [cache_batch_idx[b]] (the identity without cache_batch_idx).
        if k_cache.dim() != 4:
            raise ValueError(
                "k_cache must be 4-D (batch_cache, seqlen_cache, nheads_k, headdim) but has shape "
                f"{list(k_cache.shape)}"
            )
        if cache_batch_idx is None:
            table = torch.arange(batch, dtype=torch.int32, device=q.device).view(batch, 1)
        else:
            if cache_batch_idx.dim() != 1 or cache_batch_idx.shape[0] != batch:
                raise ValueError(
                    f"cache_batch_idx must be (batch,) = ({batch},) int32 but has shape {list(cache_batch_idx.shape)}"
                )
            table = cache_batch_idx.view(batch, 1)
        capacity = k_cache.shape[1]
    else:
        if cache_batch_idx is not None:
            _not_implemented(name, "cache_batch_idx with a block_table", " (index the block_table's rows instead)")
        table = block_table
        capacity = block_table.shape[1] * k_cache.shape[1] if block_table.dim() == 2 else 0
    if cache_seqlens is None:
        cache_seqlens = capacity
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{name}: rotary_cos and rotary_sin go together (one of them is None)")
    if rotary_cos is not None:
        if k is None or v is None:
            raise ValueError(f"{name}: rotary_cos / rotary_sin apply with k and v (the new keys), as in "
                             "FlashAttention-2; without them, rotate q before the call")
        d = q.shape[-1]
        if (rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape
                or not 0 < 2 * rotary_cos.shape[1] <= d):
            raise ValueError(
                f"{name}: rotary_cos and rotary_sin must both be (seqlen_ro, rotary_dim / 2) with rotary_dim "
                f"<= headdim ({d}), got {list(rotary_cos.shape)} and {list(rotary_sin.shape)}")
        if rotary_cos.shape[0] < capacity:
            raise ValueError(f"{name}: rotary_cos / rotary_sin have {rotary_cos.shape[0]} positions, fewer "
                             f"than the cache's {capacity} (FlashAttention-2's seqlen_ro >= seqlen_k)")
        local = causal or tuple(window_size) != (-1, -1)
        k = _apply_rotary(torch, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, False)
        q = _apply_rotary(torch, q, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, not local)
    out = ops.attention_with_kvcache(q, k_cache, v_cache, block_table=table, cache_seqlens=cache_seqlens, k=k, v=v,
                                     causal=causal, window_size=window_size, softcap=softcap,
                                     softmax_scale=softmax_scale, return_lse=bool(return_softmax_lse), **extra)
    return out


def _split(name, packed, n):
    """The `n` views of a tensor packed along dim -3 (FA's (…, n, heads, headdim) layout)."""
    if packed.dim() < 3 or packed.shape[-3] != n:
        raise ValueError(f"{name} must have {n} packed tensors in dim -3 (…, {n}, nheads, headdim) but has shape "
                         f"{list(packed.shape)}")
    return packed.unbind(dim=-3)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_qkvpacked_func``: qkv (batch, seqlen, 3, nheads, headdim) as
    ``flash_attn_func(q, k, v, …)`` on its views."""
    q, k, v = _split("qkv", qkv, 3)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_kvpacked_func``: kv (batch, seqlen_k, 2, nheads_k, headdim) as
    ``flash_attn_func(q, k, v, …)`` on its views."""
    k, v = _split("kv", kv, 2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: qkv (total, 3, nheads, headdim) as
    ``flash_attn_varlen_func`` with the same offsets for queries and keys."""
    q, k, v = _split("qkv", qkv, 3)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
                                  causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: kv (total_k, 2, nheads_k, headdim) as
    ``flash_attn_varlen_func(q, k, v, …)`` on its views."""
    k, v = _split("kv", kv, 2)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                  softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                  return_attn_probs)
