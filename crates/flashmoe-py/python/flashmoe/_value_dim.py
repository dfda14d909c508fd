"""Head dims the kernels do not serve as they are, for ``flashmoe.attention`` and
``flashmoe.attention_varlen``: a value head dim other than the query/key one (D_v ≠ D_qk;
DeepSeek MLA's prefill is 192 / 128), a head dim that is not a multiple of 8 (59, 111: what
FlashAttention-2 serves by padding), a varlen head dim other than 64 and 128 (96 runs at 128),
and, when the call needs a backward, a head dim the backward kernels do not have (40 runs at 64).
The call runs exactly on the kernels of one head dim D, the rule of the library's router
(``flashmoe::attention::route::pad_head_dims``; flashmoe-candle uses it for D_v ≠ D_qk):
max(D_qk, D_v) rounded up to a multiple of 8, then to the next varlen head dim (varlen), or to the
next backward head dim when gradients are needed and one exists.

- v shorter than D is zero-padded; the padded columns of o (P·0 = 0) are dropped;
- q and k shorter than D are zero-padded (Q·Kᵀ is unchanged) and the scale, by default
  1/sqrt(D_qk) rather than the padded plan's 1/sqrt(D), is passed explicitly.

Scores, softmax, lse and o are those of the unpadded call. Gradients flow through the pad and the
slice (autograd drops the gradients of the padded columns, which are zero). The cost: padded,
contiguous copies of the padded tensors, the padded products' FLOPs, and a contiguous copy of o's
first D_v columns when v was padded (docs/python.md, "Value head dim").
"""

import torch
import torch.nn.functional as F

from . import _core

# Head dims the backward kernels serve (``flashmoe::attention::backward::BWD_HEAD_DIMS``) and
# the varlen forward (sm_90a, ``SM90_HEAD_DIMS``; the varlen backward serves them too).
BWD_HEAD_DIMS = (32, 64, 96, 128)
VARLEN_HEAD_DIMS = (64, 128)

# (head_dim_qk, head_dim_v, softmax_scale, target) -> (head_dim, pad_qk, pad_v, scale): the
# router's answer (``_core.pad_head_dims``), asked once per combination.
_pads = {}


@torch.compiler.assume_constant_result
def _rule(head_dim_qk: int, head_dim_v: int, softmax_scale, target: str):
    key = (head_dim_qk, head_dim_v, softmax_scale, target)
    rule = _pads.get(key)
    if rule is None:
        rule = _core.pad_head_dims(head_dim_qk, head_dim_v, softmax_scale, target)
        _pads[key] = rule
    return rule


def needs_backward(q, k, v) -> bool:
    """Whether the call records a graph for a backward (grad mode on and an input requiring grad)."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def needs_pad(q, k, v, varlen: bool = False) -> bool:
    """Whether the call must be padded to run: D_v ≠ D_qk, a head dim that is not a multiple of 8,
    or a head dim the call's kernels lack while a larger one exists — the varlen kernels' (64,
    128), or the backward kernels' when the call records a backward. (Above the largest, the op's
    own check names the head dim.)"""
    d, dv = int(k.shape[-1]), int(v.shape[-1])
    if d != dv or d % 8:
        return True
    if varlen:
        return d not in VARLEN_HEAD_DIMS and d < VARLEN_HEAD_DIMS[-1]
    return d not in BWD_HEAD_DIMS and d < BWD_HEAD_DIMS[-1] and needs_backward(q, k, v)


def pad(fn: str, q, k, v, softmax_scale, varlen: bool = False):
    """(q, k, v, softmax_scale) padded to one head dim for the call `fn` (``needs_pad``), and the
    value head dim to cut o back to (None when v was not padded). q and k must share the
    query/key head dim and v must match k but for its last dim (ValueError otherwise); the head
    dims must be 1 to 256 (NotImplementedError). With a backward to record, the head dim is the
    next the backward kernels serve when there is one (else the op's check names the head dim);
    `varlen`: the next the varlen kernels serve (64, 128)."""
    if q.dim() != k.dim() or k.dim() != v.dim() or q.shape[-1] != k.shape[-1] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"flashmoe.{fn}: q and k share the query/key head dim and v has k's shape but for its last "
            f"dim (the value head dim); got q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)}"
        )
    dqk, dv = int(q.shape[-1]), int(v.shape[-1])
    widest = -(-max(dqk, dv) // 8) * 8
    if varlen and widest <= VARLEN_HEAD_DIMS[-1]:
        target = "varlen"
    elif needs_backward(q, k, v) and widest <= BWD_HEAD_DIMS[-1]:
        target = "backward"
    else:
        target = "forward"
    _, pad_qk, pad_v, scale = _rule(dqk, dv, softmax_scale, target)
    if softmax_scale is not None:
        scale = softmax_scale  # the caller's float (the rule returns it rounded to f32): one plan key
    if pad_qk:
        q = F.pad(q, (0, pad_qk))
        k = F.pad(k, (0, pad_qk))
    if pad_v:
        v = F.pad(v, (0, pad_v))
    return q, k, v, scale, (dv if pad_v else None)


def unpad(out, head_dim_v, return_lse: bool):
    """The call's result with o cut back to its first `head_dim_v` columns (contiguous, as every
    flashmoe output), lse unchanged; `out` as is when v was not padded."""
    if head_dim_v is None:
        return out
    if return_lse:
        o, lse = out
        return o[..., :head_dim_v].contiguous(), lse
    return out[..., :head_dim_v].contiguous()
