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


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(
    "causal, window, softcap",
    [(False, (64, 64), 0.0), (True, (100, -1), 0.0), (False, (-1, 16), 30.0), (True, (-1, -1), 50.0),
     (False, (0, 0), 0.0), (True, (2**30, 5), 1e-3)],
)
def test_attention_window_and_softcap_shapes(d, causal, window, softcap):
    q, k, v = qkv(sq=77, sk=300, d=d)  # seqlen_q != seqlen_k: the window sits on the bottom-right diagonal
    kw = dict(window=window, softcap=softcap)
    assert _core.check_attention(q, k, v, causal, None, **kw) == ((2, 77, 8, d), (2, 8, 77))
    assert _core.check_attention(q, k, v, causal=causal, softmax_scale=0.2, **kw)[1] == (2, 8, 77)


def test_attention_no_window_at_any_head_dim():
    # The defaults (and a window that hides nothing but the causal side) keep every head dim.
    for d in (32, 96, 256):
        q, k, v = qkv(d=d)
        assert _core.check_attention(q, k, v, True, window=(-1, -1), softcap=0.0)[0] == (2, 100, 8, d)
        assert _core.check_attention(q, k, v, True, window=(-1, 0))[0] == (2, 100, 8, d)


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


def test_attention_windows_and_softcap_pass_the_check_at_portable_head_dims():
    # the portable prefill kernel runs windows and softcap at every multiple of 8 up to 256
    q, k, v = qkv(d=96)
    assert _core.check_attention(q, k, v, window=(16, 0))[0][3] == 96
    q, k, v = qkv(d=256)
    assert _core.check_attention(q, k, v, softcap=30.0)[0][3] == 256


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
        ("window_left", ValueError, ["window (-2, 0)", "-1 (unbounded) or >= 0"]),
        ("window_right", ValueError, ["window (16, -5)"]),
        ("softcap_negative", ValueError, ["softcap -1 must be finite and >= 0"]),
        ("softcap_nan", ValueError, ["softcap NaN must be finite"]),
        ("softcap_inf", ValueError, ["softcap inf must be finite"]),
        ("window_type", TypeError, []),
    ],
)
def test_attention_errors_name_tensor_and_rule(case, exc, words):
    q, k, v = qkv()
    kw = {}
    if case == "window_left":
        kw["window"] = (-2, 0)
    elif case == "window_right":
        kw["window"] = (16, -5)
    elif case == "softcap_negative":
        kw["softcap"] = -1.0
    elif case == "softcap_nan":
        kw["softcap"] = float("nan")
    elif case == "softcap_inf":
        kw["softcap"] = float("inf")
    elif case == "window_type":
        kw["window"] = 5
    elif case == "rank":
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
        _core.check_attention(q, k, v, **kw)
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


# --------------------------------------------------------------------------- varlen


def varlen_tensors(tq=300, tk=400, hq=8, hkv=2, d=128, batch=3, dtype="bf16"):
    return dict(
        q=t((tq, hq, d), dtype), k=t((tk, hkv, d), dtype), v=t((tk, hkv, d), dtype),
        cu_seqlens_q=t((batch + 1,), "i32"), cu_seqlens_k=t((batch + 1,), "i32"),
    )


def check_varlen(d, max_seqlen_q=200, max_seqlen_k=300, **kw):
    return _core.check_attention_varlen(
        d["q"], d["k"], d["v"], d["cu_seqlens_q"], d["cu_seqlens_k"], max_seqlen_q, max_seqlen_k, **kw
    )


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_shapes(d, causal):
    assert check_varlen(varlen_tensors(d=d), causal=causal) == ((300, 8, d), (8, 300))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal, window, softcap", [(True, (64, -1), 0.0), (False, (50, 20), 30.0),
                                                     (False, (-1, 10), 0.0), (True, (-1, -1), 25.0)])
def test_varlen_window_and_softcap_shapes(d, causal, window, softcap):
    shapes = check_varlen(varlen_tensors(d=d), causal=causal, window=window, softcap=softcap)
    assert shapes == ((300, 8, d), (8, 300))


def test_varlen_packed_qkv_views():
    # q, k, v as views of one (total, hq + 2 hkv, d) tensor.
    tot, hq, hkv, d = 97, 8, 2, 64
    row = contiguous((tot, hq + 2 * hkv, d))
    dd = varlen_tensors(tq=tot, tk=tot, hq=hq, hkv=hkv, d=d)
    dd["q"] = t((tot, hq, d), ptr=BASE, strides=row)
    dd["k"] = t((tot, hkv, d), ptr=BASE + 2 * hq * d, strides=row)
    dd["v"] = t((tot, hkv, d), ptr=BASE + 2 * (hq + hkv) * d, strides=row)
    assert check_varlen(dd, max_seqlen_q=50, max_seqlen_k=50, causal=True)[0] == (tot, hq, d)


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("rank", ValueError, ["q must be 3-D (total_tokens, heads, head_dim)", "[2, 300, 8, 128]"]),
        ("cu_dtype", TypeError, ["cu_seqlens_q has dtype bf16 but int32 is required"]),
        ("cu_k_len", ValueError, ["cu_seqlens_k must be a contiguous 1-D int32 tensor of 4 elements", "[5]"]),
        ("cu_stride", ValueError, ["cu_seqlens_q must be a contiguous", "strides [2]"]),
        ("cu_one", ValueError, ["cu_seqlens_q has 1 elements but batch + 1 >= 2"]),
        ("head_dim", NotImplementedError, ["head dim 96", "sm_90a"]),
        ("gqa", ValueError, ["q has 8 heads and k 3"]),
        ("v_shape", ValueError, ["v has shape [399, 2, 128]", "[400, 2, 128]"]),
        ("dtype_mix", TypeError, ["k holds f16", "bf16"]),
        ("max_q", ValueError, ["max_seqlen_q = 301 must be in 1..=300"]),
        ("max_k_zero", ValueError, ["max_seqlen_k = 0"]),
        ("seq_stride", ValueError, ["q", "16 bytes"]),
        ("window", ValueError, ["window (-1, -3)", "-1 (unbounded) or >= 0"]),
        ("softcap", ValueError, ["softcap -0.5 must be finite and >= 0"]),
        ("softcap_inf", ValueError, ["softcap inf"]),
        ("window_head_dim", NotImplementedError, ["head dim 96", "sm_90a"]),
    ],
)
def test_varlen_errors_name_tensor_and_rule(case, exc, words):
    d = varlen_tensors()
    kw = {}
    if case == "rank":
        d["q"] = t((2, 300, 8, 128))
    elif case == "cu_dtype":
        d["cu_seqlens_q"] = t((4,), "bf16")
    elif case == "cu_k_len":
        d["cu_seqlens_k"] = t((5,), "i32")
    elif case == "cu_stride":
        d["cu_seqlens_q"] = t((4,), "i32", strides=(2,))
    elif case == "cu_one":
        d["cu_seqlens_q"], d["cu_seqlens_k"] = t((1,), "i32"), t((1,), "i32")
    elif case == "head_dim":
        d = varlen_tensors(d=96)
    elif case == "gqa":
        d = varlen_tensors(hkv=3)
    elif case == "v_shape":
        d["v"] = t((399, 2, 128))
    elif case == "dtype_mix":
        d["k"] = t((400, 2, 128), "f16")
    elif case == "max_q":
        kw["max_seqlen_q"] = 301
    elif case == "max_k_zero":
        kw["max_seqlen_k"] = 0
    elif case == "seq_stride":
        d["q"] = t((300, 8, 128), strides=(8 * 128 + 4, 128, 1))
    elif case == "window":
        kw["window"] = (-1, -3)
    elif case == "softcap":
        kw["softcap"] = -0.5
    elif case == "softcap_inf":
        kw["softcap"] = float("inf")
    elif case == "window_head_dim":
        d, kw["window"] = varlen_tensors(d=96), (8, 8)
    with pytest.raises(exc) as e:
        check_varlen(d, **kw)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


# --------------------------------------------------------------------------- KV cache


def cache_tensors(b=3, sq=1, hq=8, hkv=2, d=128, nb=20, ps=16, mb=5, dtype="bf16"):
    return dict(
        q=t((b, sq, hq, d), dtype), k_cache=t((nb, ps, hkv, d), dtype), v_cache=t((nb, ps, hkv, d), dtype),
        block_table=t((b, mb), "i32"), cache_seqlens=t((b,), "i32"),
    )


def check_cache(d, max_q_per_seq=1, **kw):
    return _core.check_attention_kvcache(
        d["q"], d["k_cache"], d["v_cache"], d["block_table"], d["cache_seqlens"], d.get("k"), d.get("v"),
        d.get("cu_seqlens_q"), max_q_per_seq=max_q_per_seq, **kw,
    )


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kvcache_shapes(d):
    assert check_cache(cache_tensors(d=d)) == ([3, 1, 8, d], [3, 8, 1])
    assert check_cache(cache_tensors(sq=4, d=d), max_q_per_seq=4, window=(10, 0), softcap=30.0) == (
        [3, 4, 8, d], [3, 8, 4])


def test_kvcache_mixed_batch_and_append():
    d = cache_tensors()
    d["q"], d["cu_seqlens_q"] = t((7, 8, 128)), t((4,), "i32")
    assert check_cache(d, max_q_per_seq=4) == ([7, 8, 128], [8, 7])
    d = cache_tensors()
    d["k"], d["v"] = t((3, 2, 2, 128)), t((3, 2, 2, 128))
    assert check_cache(d) == ([3, 1, 8, 128], [3, 8, 1])
    # a dense cache: one page of any length per sequence
    d = cache_tensors(nb=3, ps=100, mb=1)
    assert check_cache(d) == ([3, 1, 8, 128], [3, 8, 1])


def test_kvcache_strided_block_table_rows():
    d = cache_tensors()
    d["block_table"] = t((3, 5), "i32", strides=(8, 1))  # a view of a wider table
    assert check_cache(d)[0] == [3, 1, 8, 128]


@pytest.mark.parametrize(
    "case, exc, words",
    [
        ("rows", ValueError, ["q has 4 rows per sequence", "max_q_per_seq = 2"]),
        ("seqlens_len", ValueError, ["cache_seqlens must be a contiguous 1-D int32 tensor of 3 elements", "[2]"]),
        ("seqlens_dtype", TypeError, ["cache_seqlens has dtype f32 but int32 is required"]),
        ("table_dtype", TypeError, ["block_table has dtype bf16 but int32 is required"]),
        ("table_rows", ValueError, ["block_table is int32 [2, 5] but [3, max_blocks >= 1] is required"]),
        ("table_inner", ValueError, ["block_table must be a 2-D int32 tensor", "strides [10, 2]"]),
        ("page_size", ValueError, ["page_size 24 is not a multiple of 16", "5 columns"]),
        ("head_dim", ValueError, ["decode head_dim 96"]),
        ("heads", ValueError, ["heads_q 8 must be a positive multiple of heads_kv 3"]),
        ("v_cache", ValueError, ["v_cache has shape [20, 16, 2, 64] but [20, 16, 2, 128] is required"]),
        ("cache_dtype", TypeError, ["k_cache holds f16 elements but bf16 (q's dtype) is required"]),
        ("cache_rank", ValueError, ["k_cache must be 4-D (num_blocks, page_size, heads_kv, head_dim)"]),
        ("window", ValueError, ["window (-2, 0)"]),
        ("softcap", ValueError, ["softcap -1 must be finite and >= 0"]),
        ("k_only", ValueError, ["k and v are appended together"]),
        ("k_batch", ValueError, ["k holds new rows of 2 sequences but block_table has 3 rows"]),
        ("k_dtype", TypeError, ["k holds f16 elements but bf16 (q's dtype) is required"]),
        ("k_heads", ValueError, ["k_new has shape [3, 2, 4, 128] but [3, 2, 2, 128] is required"]),
        ("q4_with_cu", ValueError, ["q must be 3-D (total_q, heads_q, head_dim) with cu_seqlens_q"]),
        ("cu_len", ValueError, ["cu_seqlens_q must be a contiguous 1-D int32 tensor of 4 elements"]),
        ("cu_total", ValueError, ["q holds 13 rows but 3 sequences of at most max_q_per_seq = 4"]),
        ("q_stride", ValueError, ["q's stride 1028 (dimension 1) is not a multiple of 8 elements"]),
        ("max_q", ValueError, ["max_q_per_seq 17 must be in 1..=16"]),
        ("misaligned", ValueError, ["k_cache at 0x", "16-byte aligned"]),
        ("empty", ValueError, ["empty decode call"]),
    ],
)
def test_kvcache_errors_name_tensor_and_rule(case, exc, words):
    d = cache_tensors()
    kw = {}
    if case == "rows":
        d, kw["max_q_per_seq"] = cache_tensors(sq=4), 2
    elif case == "seqlens_len":
        d["cache_seqlens"] = t((2,), "i32")
    elif case == "seqlens_dtype":
        d["cache_seqlens"] = t((3,), "f32")
    elif case == "table_dtype":
        d["block_table"] = t((3, 5), "bf16")
    elif case == "table_rows":
        d["block_table"], d["cache_seqlens"] = t((2, 5), "i32"), t((2,), "i32")
    elif case == "table_inner":
        d["block_table"] = t((3, 5), "i32", strides=(10, 2))
    elif case == "page_size":
        d = cache_tensors(ps=24)
    elif case == "head_dim":
        d = cache_tensors(d=96)
    elif case == "heads":
        d = cache_tensors(hkv=3)
    elif case == "v_cache":
        d["v_cache"] = t((20, 16, 2, 64))
    elif case == "cache_dtype":
        d["k_cache"], d["v_cache"] = t((20, 16, 2, 128), "f16"), t((20, 16, 2, 128), "f16")
    elif case == "cache_rank":
        d["k_cache"] = t((20, 16, 256))
    elif case == "window":
        kw["window"] = (-2, 0)
    elif case == "softcap":
        kw["softcap"] = -1.0
    elif case == "k_only":
        d["k"] = t((3, 2, 2, 128))
    elif case == "k_batch":
        d["k"], d["v"] = t((2, 2, 2, 128)), t((2, 2, 2, 128))
    elif case == "k_dtype":
        d["k"], d["v"] = t((3, 2, 2, 128), "f16"), t((3, 2, 2, 128), "f16")
    elif case == "k_heads":
        d["k"], d["v"] = t((3, 2, 4, 128)), t((3, 2, 4, 128))
    elif case == "q4_with_cu":
        d["cu_seqlens_q"] = t((4,), "i32")
    elif case == "cu_len":
        d["q"], d["cu_seqlens_q"], kw["max_q_per_seq"] = t((7, 8, 128)), t((3,), "i32"), 4
    elif case == "cu_total":
        d["q"], d["cu_seqlens_q"], kw["max_q_per_seq"] = t((13, 8, 128)), t((4,), "i32"), 4
    elif case == "q_stride":
        d, kw["max_q_per_seq"] = cache_tensors(sq=2), 2
        d["q"] = t((3, 2, 8, 128), strides=(2056, 1028, 128, 1))
    elif case == "max_q":
        kw["max_q_per_seq"] = 17
    elif case == "misaligned":
        d["k_cache"] = t((20, 16, 2, 128), ptr=BASE + 4)
    elif case == "empty":
        d = cache_tensors(sq=0)
    with pytest.raises(exc) as e:
        check_cache(d, **kw)
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
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.VarlenPlan(0, "bf16", 128, 8, 2, True)
    # valid windows and softcaps get as far as the device
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.AttentionPlan(0, "bf16", 128, 8, 2, True, None, (64, 0), 30.0)
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.VarlenPlan(0, "f16", 64, 8, 8, False, 0.125, window=(16, 16), softcap=20.0)
    with pytest.raises(RuntimeError, match="no GPU available"):
        _core.DecodePlan(0, "bf16", 128, 8, 2, 1, (-1, 0), 0.0)


def test_plan_arguments_checked_before_the_gpu():
    with pytest.raises(TypeError, match="bf16 or f16"):
        _core.AttentionPlan(0, "f32", 128, 8, 2, True)
    with pytest.raises(ValueError, match="scoring"):
        _core.MoePlan(0, "bf16", 256, 128, 8, 2, "tanh", True, False, 64)
    with pytest.raises(ValueError, match="top_k"):
        _core.MoePlan(0, "bf16", 256, 128, 8, 9, "softmax", True, False, 64)
    with pytest.raises(TypeError, match="a varlen plan takes bf16 or f16"):
        _core.VarlenPlan(0, "f32", 128, 8, 2, True)
    with pytest.raises(ValueError, match="max_q_per_seq 0"):
        _core.DecodePlan(0, "bf16", 128, 8, 2, 0, (-1, 0), 0.0)
    with pytest.raises(ValueError, match="softcap"):
        _core.DecodePlan(0, "bf16", 128, 8, 2, 1, (-1, 0), float("nan"))
    with pytest.raises(ValueError, match=r"window \(-2, 0\)"):
        _core.AttentionPlan(0, "bf16", 128, 8, 2, False, None, (-2, 0))
    with pytest.raises(ValueError, match="softcap -1 must be finite and >= 0"):
        _core.AttentionPlan(0, "bf16", 128, 8, 2, True, softcap=-1.0)
    with pytest.raises(ValueError, match=r"window \(5, -7\)"):
        _core.VarlenPlan(0, "bf16", 128, 8, 2, False, window=(5, -7))
    with pytest.raises(ValueError, match="softcap inf"):
        _core.VarlenPlan(0, "bf16", 128, 8, 2, False, softcap=float("inf"))


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_torch_ops_say_they_need_torch():
    for fn in (flashmoe.attention, flashmoe.attention_varlen, flashmoe.attention_with_kvcache, flashmoe.moe):
        with pytest.raises(ImportError, match="need PyTorch"):
            fn(None, None, None)


# --------------------------------------------------------------------------- the router

USIZE_MAX = 2**64 - 1
H100, A100 = 90, 80


def route(sq, sk, d=128, causal=False, window=(-1, -1), softcap=0.0, arch=H100, scale=0.125, dtype="bf16"):
    return _core.route_attention(dtype, d, 8, 2, sq, sk, causal, scale, window, softcap, arch=arch)


def test_route_without_window_or_softcap_is_the_prefill_plan_for_every_length():
    for arch in (H100, A100):
        assert route(100, 300, arch=arch) == ("prefill", (False, 0.125, (-1, -1), 0.0),
                                              ((1, USIZE_MAX), (1, USIZE_MAX)))
        # causal: one route for every length of two rows or more; a single row sees every key
        assert route(100, 300, causal=True, arch=arch) == ("prefill", (True, 0.125, (-1, -1), 0.0),
                                                           ((2, USIZE_MAX), (1, USIZE_MAX)))
        assert route(1, 300, causal=True, arch=arch) == ("prefill", (False, 0.125, (-1, -1), 0.0),
                                                         ((1, 1), (1, USIZE_MAX)))
    # the default scale is the plans' own 1/sqrt(head_dim), as an f32
    kind, (causal, scale, window, softcap), _ = route(100, 300, d=64, scale=None)
    assert kind == "prefill" and abs(scale - 0.125) < 1e-7


def test_route_windows_are_normalised_per_call():
    # a window covering every key is no window: the prefill plan on any GPU
    assert route(100, 300, window=(4096, 4096), arch=A100)[:2] == ("prefill", (False, 0.125, (-1, -1), 0.0))
    assert route(100, 300, causal=True, window=(4096, 5), arch=A100)[:2] == (
        "prefill", (True, 0.125, (-1, -1), 0.0))
    # a sliding window on Hopper: the sm_90a prefill kernel (causal bounds the right side)
    kind, args, (sq_range, sk_range) = route(100, 300, causal=True, window=(64, -1))
    assert (kind, args) == ("prefill", (True, 0.125, (64, -1), 0.0))
    assert sq_range[0] <= 100 <= sq_range[1] and sk_range[0] <= 300 <= sk_range[1]
    assert route(300, 300, window=(16, 16), softcap=30.0)[:2] == ("prefill", (False, 0.125, (16, 16), 30.0))


@pytest.mark.parametrize("d, arch", [(256, H100), (128, A100), (128, H100), (64, A100)])
def test_route_decode_shaped_windows_and_softcap_take_the_decode_plan(d, arch):
    kind, args, (sq_range, _) = route(3, 300, d=d, causal=True, softcap=30.0, arch=arch)
    assert (kind, args) == ("decode", (4, (-1, 0), 30.0, 0.125))  # 3 rows: the 4-row plan
    assert sq_range == (3, 4)
    assert route(1, 300, d=d, window=(64, 0), arch=arch)[:2] == ("decode", (1, (64, 0), 0.0, 0.125))
    assert route(16, 300, d=d, window=(500, 3), softcap=5.0, arch=arch)[:2] == ("decode", (16, (-1, 3), 5.0, 0.125))


def test_route_errors_name_feature_rows_head_dim_and_device():
    with pytest.raises(NotImplementedError) as e:
        route(100, 300, d=256, window=(64, 0), arch=A100)
    for part in ["sliding-window attention (window_size = (64, 0))", "100 query rows", "head dim 256",
                 "compute capability 8.0", "sm_90a prefill kernel", "portable prefill kernel",
                 "decode kernels (at most 16 query rows"]:
        assert part in str(e.value)
    with pytest.raises(NotImplementedError, match=r"softcapping \(softcap = 50\).*head dim 256"):
        route(5000, 5000, d=256, causal=True, softcap=50.0, arch=A100)
    # the portable prefill kernel: windows and softcap at head dims the other kernels lack
    assert route(5000, 5000, d=256, causal=True, softcap=50.0, arch=H100)[0] == "prefill"
    assert route(1, 64, d=96, softcap=30.0)[0] == "prefill"
    assert route(100, 300, window=(64, 0), arch=A100)[0] == "prefill"
    with pytest.raises(ValueError, match=r"window \(-2, 0\)"):
        route(4, 4, window=(-2, 0))
    with pytest.raises(ValueError, match="softcap -1 must be finite and >= 0"):
        route(4, 4, softcap=-1.0)
    with pytest.raises(ValueError, match="empty"):
        route(0, 4)
    with pytest.raises(TypeError, match="bf16 or f16"):
        route(4, 4, dtype="f32")


def test_check_attention_lets_decode_shaped_windows_through():
    # head dim 256 has no sm_90a kernel, but a decode-shaped call runs on the decode plan
    q, k, v = qkv(sq=16, sk=300, d=256)
    assert _core.check_attention(q, k, v, False, window=(8, 8))[0] == (2, 16, 8, 256)
    assert _core.check_attention(q, k, v, True, softcap=30.0)[1] == (2, 8, 16)
    # longer calls: the portable prefill kernel (head dim 256: Hopper)
    q, k, v = qkv(sq=17, sk=300, d=256)
    assert _core.check_attention(q, k, v, False, window=(8, 8))[0] == (2, 17, 8, 256)


def test_route_attention_is_exported():
    assert flashmoe.route_attention is _core.route_attention
    assert "route_attention" in flashmoe.__all__
