"""A value head dim other than the query/key head dim (D_v ≠ D_qk; DeepSeek MLA's prefill is
192 / 128) for ``flashmoe.attention`` and ``flashmoe.attention_varlen``: the call runs exactly on
the kernels of one head dim D = max(D_qk, D_v), the rule of the library's router
(``flashmoe::attention::route::pad_value_head_dim``, the same one flashmoe-candle uses):

- D_v < D_qk: v is zero-padded to D_qk, the padded columns of o (P·0 = 0) are dropped;
- D_v > D_qk: q and k are zero-padded to D_v (Q·Kᵀ is unchanged) and the scale, by default
  1/sqrt(D_qk) rather than the padded plan's 1/sqrt(D_v), is passed explicitly.

Scores, softmax, lse and o are those of the unpadded call. Gradients flow through the pad and the
slice (autograd drops the gradients of the padded columns, which are zero). The cost: a padded,
contiguous copy of v (or of q and k), the padded product's FLOPs, and a contiguous copy of o's
first D_v columns when v was padded (docs/python.md, "Value head dim").
"""

import torch
import torch.nn.functional as F

from . import _core

# (head_dim_qk, head_dim_v, softmax_scale) -> (head_dim, pad_qk, pad_v, scale): the router's answer
# (``_core.pad_value_head_dim``), asked once per combination.
_pads = {}


@torch.compiler.assume_constant_result
def _rule(head_dim_qk: int, head_dim_v: int, softmax_scale):
    key = (head_dim_qk, head_dim_v, softmax_scale)
    rule = _pads.get(key)
    if rule is None:
        rule = _core.pad_value_head_dim(head_dim_qk, head_dim_v, softmax_scale)
        _pads[key] = rule
    return rule


def pad(fn: str, q, k, v, softmax_scale):
    """(q, k, v, softmax_scale) padded to one head dim for the call `fn`, and the value head dim
    to cut o back to (None when v was not padded). q and k must share the query/key head dim and
    v must match k but for its last dim (ValueError otherwise); the head dims must be multiples of
    8 up to 256 (NotImplementedError)."""
    if q.dim() != k.dim() or k.dim() != v.dim() or q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"flashmoe.{fn}: q and k share the query/key head dim and v has k's shape but for its last "
            f"dim (the value head dim); got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    _, pad_qk, pad_v, scale = _rule(int(q.shape[-1]), int(v.shape[-1]), softmax_scale)
    if softmax_scale is not None:
        scale = softmax_scale  # the caller's float (the rule returns it rounded to f32): one plan key
    if pad_qk:
        q = F.pad(q, (0, pad_qk))
        k = F.pad(k, (0, pad_qk))
        return q, k, v, scale, None
    return q, k, F.pad(v, (0, pad_v)), scale, int(v.shape[-1])


def unpad(out, head_dim_v, return_lse: bool):
    """The call's result with o cut back to its first `head_dim_v` columns (contiguous, as every
    flashmoe output), lse unchanged; `out` as is when v was not padded."""
    if head_dim_v is None:
        return out
    if return_lse:
        o, lse = out
        return o[..., :head_dim_v].contiguous(), lse
    return out[..., :head_dim_v].contiguous()
