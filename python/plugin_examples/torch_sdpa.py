"""A GPU plug-in for `flashmoe bench attention --impl py:python/plugin_examples/torch_sdpa.py:forward`:
PyTorch's scaled_dot_product_attention on the lab's tensors (docs/plugins.md).

The lab passes q [B, Sq, Hq, D], k / v [B, Sk, Hkv, D] (CUDA tensors of the problem's dtype)
and expects o [B, Sq, Hq, D]; SDPA wants heads before the sequence, so the views are
transposed (no copy) and the result transposed back. Causal masking in the lab is
bottom-right aligned, SDPA's `is_causal` top-left: for Sq != Sk the lower-right causal
bias says so explicitly.
"""
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def forward(q, k, v, *, causal, softmax_scale):
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    sq, sk = qh.shape[2], kh.shape[2]
    gqa = qh.shape[1] != kh.shape[1]
    if causal and sq != sk:
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=causal_lower_right(sq, sk), scale=softmax_scale, enable_gqa=gqa
        )
    else:
        o = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=causal, scale=softmax_scale, enable_gqa=gqa
        )
    return o.transpose(1, 2)


def top_left(q, k, v, *, causal, softmax_scale):
    """Broken on purpose where Sq != Sk: SDPA's top-left causal mask. The gate must reject it there."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=softmax_scale, enable_gqa=qh.shape[1] != kh.shape[1]
    )
    return o.transpose(1, 2)
