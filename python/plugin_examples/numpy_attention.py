"""Example plug-in for `flashmoe bench attention --impl py:MODULE:FUNCTION` (docs/plugins.md).

    flashmoe bench attention --cpu --impl cpu-tiled,cpu-reference,\
py:python/plugin_examples/numpy_attention.py:attention

Standard (materialised) attention in numpy: inputs q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D]
float32 (on --device cpu), returns (o [B, Sq, Hq, D], lse [B, Hq, Sq]).
"""

import numpy as np


def attention(q, k, v, *, causal, softmax_scale):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    # [B, H, S, D], K/V heads repeated for grouped-query attention.
    qh = q.transpose(0, 2, 1, 3).astype(np.float32)
    kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1).astype(np.float32)
    vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1).astype(np.float32)
    s = np.matmul(qh, kh.transpose(0, 1, 3, 2)) * np.float32(softmax_scale)
    if causal:
        # Bottom-right aligned: query i sees keys j <= i + Sk - Sq.
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        s = np.where(j <= i + (sk - sq), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    o = np.matmul(p / l, vh)
    lse = (m + np.log(l))[..., 0]
    return o.transpose(0, 2, 1, 3), lse


def wrong(q, k, v, *, causal, softmax_scale):
    """A broken plug-in (ignores the softmax): the correctness gate must reject it."""
    o, lse = attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return o * 1.5, lse
