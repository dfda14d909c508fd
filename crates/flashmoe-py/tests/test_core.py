"""The core binding without a GPU (and without torch): shape and dtype checks, and the no-GPU
error. Tensors are descriptor tuples (data_ptr, dtype, shape, strides), as the torch layer
builds them; addresses are plausible 256-byte aligned values (nothing is dereferenced)."""

import importlib.util

import pytest

import flashmoe
from flashmoe import _core

BASE = 0x7F00_0000_0000


def contiguous(shape):
    strides, s = [], 1
    for d in reversed(shape):
        strides.insert(0, s)
        s *= d
    return tuple(strides)


def t(shape, dtype="bf16", ptr=None, strides=None, _next=[BASE]):
    """A descriptor at a fresh 256-byte aligned address."""
    if ptr is None:
        ptr = _next[0]
        _next[0] += 1 << 30
    return (ptr, dtype, tuple(shape), strides if strides is not None else contiguous(shape))


# --------------------------------------------------------------------------- attention


def qkv(b=2, sq=100, sk=130, hq=8, hkv=2, d=128, dtype="bf16"):
    return t((b, sq, hq, d), dtype), t((b, sk, hkv, d), dtype), t((b, sk, hkv, d), dtype)


def test_attention_shapes_gqa():
    q, k, v = qkv()
    assert _core.check_attention(q, k, v) == ((2, 100, 8, 128), (2, 8, 100))
    assert _core.check_attention(q, k, v, causal=True, softmax_scale=0.1) == ((2, 100, 8, 128), (2, 8, 100))


def test_attention_packed_qkv_views():
    # q, k, v as views of one (b, s, hq + 2 hkv, d) tensor: strided, inner dim contiguous.
    b, s, hq, hkv, d = 2, 64, 8, 2, 64
    row = contiguous((b, s, hq + 2 * hkv, d))
    q = t((b, s, hq, d), ptr=BASE, strides=row)
    k = t((b, s, hkv, d), ptr=BASE + 2 * hq * d, strides=row)
    v = t((b, s, hkv, d), ptr=BASE + 2 * (hq + hkv) * d, strides=row)
    assert _core.check_attention(q, k, v, causal=True)[0] == (b, s, hq, d)


def test_attention_size_one_dims_take_any_stride():
    # PyTorch may report any stride for a size-1 dimension.
    q = t((1, 1, 4, 64), strides=(7, 3, 64, 1))
    k = t((1, 9, 4, 64))
    v = t((1, 9, 4, 64))
    assert _core.check_attention(q, k, v)[1] == (1, 4, 1)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("rank", ValueError, ["q must be 4-D", "[2, 100, 1024]"]),
        ("dtype_mix", TypeError, ["k holds f16", "bf16"]),
        ("f32", TypeError, ["q has dtype f32"]),
        ("int", TypeError, ["q has dtype int32"]),
        ("unknown_dtype", TypeError, ["v has dtype f64"]),
        ("gqa", ValueError, ["q has 8 heads and k 3", "multiple"]),
        ("v_shape", ValueError, ["v has shape [2, 129, 2, 128]", "[2, 130, 2, 128]"]),
        ("batch", ValueError, ["k has shape [3, 130, 2, 128]", "[2, 130, 2, 128]"]),
        ("misaligned", ValueError, ["q at 0x", "16-byte aligned"]),
        ("null", ValueError, ["k is a null device pointer"]),
        ("inner_stride", ValueError, ["v's innermost dimension has stride 2"]),
        ("empty", ValueError, ["empty attention call"]),
        ("stride_len", ValueError, ["q: shape", "strides"]),
    ],
)
def test_attention_errors_name_tensor_and_rule(case, exc, words):
    q, k, v = qkv()
    if case == "rank":
        q = t((2, 100, 1024))
    elif case == "dtype_mix":
        k = t((2, 130, 2, 128), "f16")
    elif case == "f32":
        q, k, v = qkv(dtype="f32")
    elif case == "int":
        q = t((2, 100, 8, 128), "i32")
    elif case == "unknown_dtype":
        v = t((2, 130, 2, 128), "f64")
    elif case == "gqa":
        q, k, v = qkv(hkv=3)
    elif case == "v_shape":
        v = t((2, 129, 2, 128))
    elif case == "batch":
        k = t((3, 130, 2, 128))
    elif case == "misaligned":
        q = t((2, 100, 8, 128), ptr=BASE + 8)
    elif case == "null":
        k = t((2, 130, 2, 128), ptr=0)
    elif case == "inner_stride":
        v = t((2, 130, 2, 128), strides=(130 * 2 * 256, 2 * 256, 256, 2))
    elif case == "empty":
        q, k, v = qkv(sq=0)
    elif case == "stride_len":
        q = t((2, 100, 8, 128), strides=(1, 1, 1))
    with pytest.raises(exc) as e:
        _core.check_attention(q, k, v)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_descriptor_must_be_a_tuple_of_four():
    q, k, v = qkv()
    with pytest.raises((TypeError, ValueError), match="tuple"):
        _core.check_attention(q[:3], k, v)
    with pytest.raises((TypeError, OverflowError)):
        _core.check_attention((q[0], "bf16", q[2], (-1, 1, 1, 1)), k, v)


# --------------------------------------------------------------------------- MoE


def moe_tensors(tokens=10, h=256, i=128, e=8, k=2, dtype="bf16", shared=False):
    d = dict(
        x=t((tokens, h), dtype),
        router_w=t((h, e), dtype),
        w13=t((e, h, 2 * i), dtype),
        w2=t((e, i, h), dtype),
        shared=(t((h, 2 * i), dtype), t((i, h), dtype)) if shared else None,
        out=t((tokens, h), dtype),
        topk_ids=t((tokens, k), "i32"),
        topk_w=t((tokens, k), "f32"),
        counts=t((e,), "i32"),
        losses=t((2,), "f32"),
    )
    return d


def check_moe(d, top_k=2, **kw):
    return _core.check_moe(
        d["x"], d["router_w"], d["w13"], d["w2"], d["shared"], d["out"],
        d["topk_ids"], d["topk_w"], d["counts"], d["losses"], top_k=top_k, **kw,
    )


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_moe_valid(shared, scoring):
    assert check_moe(moe_tensors(shared=shared), scoring=scoring) == (10, 256, 128, 8)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("x_rank", ValueError, ["x must be 2-D"]),
        ("w13", ValueError, ["w13 has shape [8, 256, 128]", "[8, 256, 256]"]),
        ("router_dtype", TypeError, ["router_w holds f16", "bf16"]),
        ("ids_dtype", TypeError, ["topk_ids has dtype f32", "int32"]),
        ("ids_len", ValueError, ["topk_ids must be a contiguous array of 20"]),
        ("weights_dtype", ValueError, ["topk_w holds bf16", "f32"]),
        ("weights_int", TypeError, ["topk_w has dtype int32"]),
        ("top_k", ValueError, ["top_k (9) must not exceed experts (8)"]),
        ("scoring", ValueError, ["scoring", "tanh"]),
        ("strided_x", ValueError, ["x must be contiguous"]),
        ("shared_shape", ValueError, ["shared_w2 has shape"]),
        ("x_f32", TypeError, ["x has dtype f32"]),
    ],
)
def test_moe_errors_name_tensor_and_rule(case, exc, words):
    d = moe_tensors(shared=case == "shared_shape")
    kw = {}
    if case == "x_rank":
        d["x"] = t((2, 5, 256))
    elif case == "w13":
        d["w13"] = t((8, 256, 128))
    elif case == "router_dtype":
        d["router_w"] = t((256, 8), "f16")
    elif case == "ids_dtype":
        d["topk_ids"] = t((10, 2), "f32")
    elif case == "ids_len":
        d["topk_ids"] = t((10, 3), "i32")
    elif case == "weights_dtype":
        d["topk_w"] = t((10, 2), "bf16")
    elif case == "weights_int":
        d["topk_w"] = t((10, 2), "i32")
    elif case == "top_k":
        kw["top_k"] = 9
        d = moe_tensors(k=9)
    elif case == "scoring":
        kw["scoring"] = "tanh"
    elif case == "strided_x":
        d["x"] = t((10, 256), strides=(512, 1))
    elif case == "shared_shape":
        d["shared"] = (d["shared"][0], t((256, 256)))
    elif case == "x_f32":
        d = moe_tensors(dtype="f32")
    with pytest.raises(exc) as e:
        check_moe(d, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# --------------------------------------------------------------------------- no GPU


def _has_gpu():
    try:
        return _core.device_count() > 0
    except RuntimeError:
        return False


@pytest.mark.skipif(_has_gpu(), reason="a GPU is present")
def test_no_gpu_raises_runtime_error():
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.device_count()
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.AttentionPlan(0, "bf16", 128, 8, 2, True)
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.MoePlan(0, "bf16", 256, 128, 8, 2, "softmax", True, False, 64)


def test_plan_arguments_checked_before_the_gpu():
    with pytest.raises(TypeError, match="bf16 or f16"):
        _core.AttentionPlan(0, "f32", 128, 8, 2, True)
    with pytest.raises(ValueError, match="scoring"):
        _core.MoePlan(0, "bf16", 256, 128, 8, 2, "tanh", True, False, 64)
    with pytest.raises(ValueError, match="top_k"):
        _core.MoePlan(0, "bf16", 256, 128, 8, 9, "softmax", True, False, 64)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_torch_ops_say_they_need_torch():
    with pytest.raises(ImportError, match="need PyTorch"):
        flashmoe.attention(None, None, None)
