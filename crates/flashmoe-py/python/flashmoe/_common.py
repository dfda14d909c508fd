"""Helpers every module of the torch layer shares (``_torch``, ``_mla``, ``_moe_autograd``):
tensor descriptors for the core binding, the one-device / one-dtype checks, the refusal of
inputs that require grad on a path without a backward, the dispatcher-skipping test, the
current raw CUDA stream, and the one plan cache of every family (the MoE inference op and
the training op share its MoE plans). It imports no other module of the package but ``_core``, so the modules
above it import it without a circle.
"""

import torch

from . import _core

_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.float32: "f32",
    torch.int32: "i32",
}


def _desc(t: torch.Tensor, name: str):
    """The core binding's tensor descriptor ``(data_ptr, dtype, shape, strides)``."""
    dt = _DTYPES.get(t.dtype)
    if dt is None:
        raise TypeError(f"{name} has dtype {t.dtype}; flashmoe takes torch.bfloat16 or torch.float16")
    return (t.data_ptr(), dt, t.shape, t.stride())


def _device_index(named) -> int:
    """The index of the one CUDA device every (name, tensor) pair lives on, or a ValueError naming
    the first tensor that breaks the rule."""
    first, t0 = named[0]
    if not t0.is_cuda:
        raise ValueError(f"{first} is on {t0.device}; flashmoe takes CUDA tensors")
    index = t0.get_device()
    for name, t in named[1:]:
        if t.get_device() != index:
            raise ValueError(f"{name} is on {t.device} but {first} is on {t0.device}: one device is required")
    return index


def _same_dtype(named):
    """TypeError unless every (name, tensor) pair has the first one's dtype."""
    first, t0 = named[0]
    for name, t in named[1:]:
        if t.dtype is not t0.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {first} has {t0.dtype}: one dtype is required")


def _refuse_grad(fn: str, named) -> None:
    """RuntimeError if grad mode is on and a (name, tensor) pair requires grad: `fn` has no
    backward, so its outputs would be detached from the graph and everything upstream would stop
    training without a word. Inference under torch.no_grad() / torch.inference_mode(), or on
    detached tensors, is unaffected."""
    if not torch.is_grad_enabled():
        return
    for name, t in named:
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"flashmoe.{fn} has no backward pass yet, but {name} requires grad: its outputs would "
                "carry no gradient to the tensors upstream. Call it under torch.no_grad() or "
                "torch.inference_mode() (or on detached tensors) for inference; for training use a "
                "differentiable path (e.g. torch.nn.functional.scaled_dot_product_attention)."
            )


def _plain(*tensors) -> bool:
    """Whether a call may skip the dispatcher: eager, plain tensors, no dispatch or function mode
    (anything else, torch.compile and fake tensors included, goes through torch.ops)."""
    for t in tensors:
        if type(t) is not torch.Tensor:
            return False
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack()
        or torch._C._is_torch_function_mode_enabled()
    )


try:  # the raw CUstream of the current stream without building a Stream object (what inductor uses)
    _raw_stream = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older or future torch

    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _idesc(t: torch.Tensor, name: str):
    """The descriptor of an int32 index tensor (offsets, lengths, block table)."""
    if t.dtype is not torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype} but torch.int32 is required")
    return (t.data_ptr(), "i32", t.shape, t.stride())


# Every plan the package builds, in one cache: (family, class key) -> plan. A family is a
# plan type ("prefill", "decode", "varlen", "backward", "varlen_backward", "mla", "moe",
# "moe_backward"); its class key is what the plan's constructor takes, device index first.
# Plans are kept for the process's life: a captured CUDA graph may hold their kernels.
_plans = {}
_MIN_PLAN_TOKENS = 256


def _cached_plan(family, key, build):
    """The cached plan of `family` for class `key`; `build()` makes it on the first call."""
    plan = _plans.get((family, key))
    if plan is None:
        plan = build()
        _plans[(family, key)] = plan
    return plan


def _grown_plan(family, plan_type, key, tokens):
    """The cached `plan_type` plan of the MoE class `key` (device index, dtype, hidden,
    intermediate, experts, top_k, scoring, renormalize, shared), rebuilt with room for twice
    as many tokens when a call outgrows it (its tables are sized by max_tokens)."""
    plan = _plans.get((family, key))
    if plan is None or plan.max_tokens < tokens:
        max_tokens = _MIN_PLAN_TOKENS
        while max_tokens < tokens:
            max_tokens *= 2
        plan = plan_type(*key, max_tokens)
        _plans[(family, key)] = plan
    return plan


def _moe_plan(index, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared, tokens):
    """The forward plan of the class (``_core.MoePlan``), see ``_grown_plan``."""
    key = (index, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared)
    return _grown_plan("moe", _core.MoePlan, key, tokens)
