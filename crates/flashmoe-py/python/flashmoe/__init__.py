"""flashmoe: FlashAttention and Mixture-of-Experts kernels as PyTorch ops.

``flashmoe.attention``, ``attention_varlen``, ``attention_with_kvcache`` and ``moe`` run
flashmoe's plans on PyTorch tensors, on the current CUDA stream, without copies
(docs/python.md). They are registered as ``torch.ops.flashmoe.*`` custom ops with fake
implementations, so ``torch.compile`` traces them and CUDA graphs capture them.

The extension module ``flashmoe._core`` imports without torch: it describes tensors as
``(data_ptr, dtype, shape, strides)`` tuples and holds the shape checks
(``check_attention``, ``check_attention_varlen``, ``check_attention_kvcache``, ``check_moe``),
the router that picks a dense call's plan (``route_attention``) and the plans (``AttentionPlan``, ``AttentionBackwardPlan``, ``VarlenPlan``, ``DecodePlan``, ``MoePlan``).
"""

from ._core import (  # noqa: F401
    AttentionBackwardPlan,
    AttentionPlan,
    DecodePlan,
    MoePlan,
    VarlenPlan,
    check_attention,
    check_attention_kvcache,
    check_attention_varlen,
    check_moe,
    device_count,
    device_name,
    route_attention,
)

try:
    import torch as _torch  # noqa: F401
except ImportError:  # the core binding stays usable; the torch ops say what they need
    _torch = None

if _torch is not None:
    from ._torch import MoeOutput, attention, attention_varlen, attention_with_kvcache, moe  # noqa: F401
    from ._mla import mla_decode  # noqa: F401
else:

    def _needs_torch(*_args, **_kwargs):
        raise ImportError(
            "flashmoe.attention, attention_varlen, attention_with_kvcache and moe need "
            "PyTorch (pip install torch); "
            "flashmoe._core works without it"
        )

    attention = attention_varlen = attention_with_kvcache = moe = mla_decode = _needs_torch

__all__ = [
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "moe",
    "mla_decode",
    "MoeOutput",
    "AttentionPlan",
    "VarlenPlan",
    "DecodePlan",
    "MoePlan",
    "check_attention",
    "check_attention_varlen",
    "check_attention_kvcache",
    "check_moe",
    "device_count",
    "device_name",
    "route_attention",
]
