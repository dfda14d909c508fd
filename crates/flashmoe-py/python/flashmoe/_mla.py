"""``flashmoe.mla_decode``: DeepSeek Multi-head Latent Attention paged decode as a torch op.

The op ``torch.ops.flashmoe.mla_decode`` is defined in a fragment of the ``flashmoe`` library
(the other ops live in ``_torch.py``) with a CUDA/CPU kernel, a fake kernel (``torch.compile``
traces it) and an Autograd kernel that refuses inputs requiring grad: the op is
inference-only. Outputs and the split workspace come from PyTorch's caching allocator on the
current stream (CUDA-graph capture puts them in the graph's pool); nothing is copied and the
host never synchronises.
"""

import torch

from . import _core
from ._common import _DTYPES, _cached_plan, _desc, _device_index, _idesc, _plain, _raw_stream, _refuse_grad, _same_dtype

_D_QK, _D_V = 576, 512
_MAX_Q = _core.MAX_Q_PER_SEQ
# Rows per sequence a plan is built for: Sq rounded up to a power of two, so a few plans serve
# every call (the split heuristic and workspace bound follow the class's rows).
_Q_BUCKETS = [1, 1, 2, 4, 4] + [8] * 4 + [16] * 8

def _mla_plan(index, dtype, heads_q, page_size, max_q, softmax_scale):
    key = (index, dtype, heads_q, page_size, max_q, softmax_scale)
    return _cached_plan("mla", key, lambda: _core.MlaDecodePlan(index, _DTYPES[dtype], heads_q, page_size,
                                                                 max_q, softmax_scale))


def _mla_decode_impl(q, kv_cache, block_table, cache_seqlens, softmax_scale):
    named = (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("cache_seqlens", cache_seqlens))
    index = _device_index(named)
    _same_dtype(named[:2])
    if q.dim() != 4 or q.shape[-1] != _D_QK:
        raise ValueError(f"q must be (batch, seqlen_q, heads_q, {_D_QK}) but has shape {list(q.shape)}")
    if kv_cache.dim() not in (3, 4) or kv_cache.shape[-1] != _D_QK:
        raise ValueError(
            f"kv_cache must be (num_blocks, page_size, {_D_QK}) or (num_blocks, page_size, 1, {_D_QK}) "
            f"but has shape {list(kv_cache.shape)}"
        )
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be (batch, max_blocks) but has shape {list(block_table.shape)}")
    b, sq, hq, _ = q.shape
    if not 1 <= sq <= _MAX_Q:
        raise ValueError(f"q has {sq} rows per sequence; mla_decode takes 1..{_MAX_Q}")
    page = kv_cache.shape[1]
    plan = _mla_plan(index, q.dtype, hq, page, _Q_BUCKETS[sq], float(softmax_scale))
    o = torch.empty((b, sq, hq, _D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, sq, hq), dtype=torch.float32, device=q.device)
    stream = _raw_stream(index)
    max_sk = block_table.shape[1] * page  # the table's capacity: a host-side bound
    need = plan.workspace_bytes(b, max_sk)
    # Freed right after the enqueue: the caching allocator hands it out again only in stream order.
    ws = torch.empty(need, dtype=torch.uint8, device=q.device) if need else None
    plan.forward(
        stream,
        _desc(q, "q"),
        _desc(kv_cache, "kv_cache"),
        _idesc(block_table, "block_table"),
        _idesc(cache_seqlens, "cache_seqlens"),
        o.data_ptr(),
        lse.data_ptr(),
        0 if ws is None else ws.data_ptr(),
        need,
        max_sk,
    )
    return o, lse


def _mla_decode_fake(q, kv_cache, block_table, cache_seqlens, softmax_scale):
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, seqlen_q, heads_q, {_D_QK}) but has shape {list(q.shape)}")
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, _D_V)), q.new_empty((b, sq, hq), dtype=torch.float32)


_lib = torch.library.Library("flashmoe", "FRAGMENT")
_lib.define(
    "mla_decode(Tensor q, Tensor kv_cache, Tensor block_table, Tensor cache_seqlens, float softmax_scale) "
    "-> (Tensor, Tensor)"
)
for _key in ("CUDA", "CPU"):  # CPU too: a CPU tensor meets flashmoe's own error
    _lib.impl("mla_decode", _mla_decode_impl, _key)
torch.library.register_fake("flashmoe::mla_decode", _mla_decode_fake, lib=_lib)
_mla_decode_op = torch.ops.flashmoe.mla_decode.default


def _mla_autograd(q, kv_cache, block_table, cache_seqlens, softmax_scale):
    _refuse_grad("mla_decode", (("q", q), ("kv_cache", kv_cache)))
    with torch._C._AutoDispatchBelowAutograd():
        return _mla_decode_op(q, kv_cache, block_table, cache_seqlens, softmax_scale)


_lib.impl("mla_decode", _mla_autograd, "Autograd")


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    *,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    softmax_scale: float,
    return_lse: bool = False,
):
    """DeepSeek-V2/V3 MLA decode over a paged latent cache (weight-absorbed queries).

    q (batch, seqlen_q, heads_q, 576): seqlen_q 1..16 new rows per sequence (decode, or
    speculative rows), causal among themselves and bottom-right aligned to the cache.
    kv_cache (num_blocks, page_size, 576) or (num_blocks, page_size, 1, 576): per token the
    512-wide latent then the 64-wide rotary part; the key is the whole row, the value its first
    512 columns. int32 ``block_table`` (batch, max_blocks) of block ids (page_size a multiple of
    16; DeepSeek: 64); int32 ``cache_seqlens`` [batch]: keys per sequence (the new rows' keys
    already in the cache). ``softmax_scale`` multiplies q·k (DeepSeek: 1/sqrt(192) times its yarn
    factor). Returns o (batch, seqlen_q, heads_q, 512) and with ``return_lse`` also lse
    (batch, seqlen_q, heads_q), f32, natural log. bf16/f16, sm_80 or newer. Inference only: a
    tensor that requires grad under grad mode raises RuntimeError.
    """
    _refuse_grad("mla_decode", (("q", q), ("kv_cache", kv_cache)))
    if _plain(q, kv_cache, block_table, cache_seqlens):
        o, lse = _mla_decode_impl(q, kv_cache, block_table, cache_seqlens, float(softmax_scale))
    else:
        o, lse = _mla_decode_op(q, kv_cache, block_table, cache_seqlens, float(softmax_scale))
    return (o, lse) if return_lse else o
