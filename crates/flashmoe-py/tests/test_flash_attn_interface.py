"""flashmoe.flash_attn_interface without a GPU: FlashAttention-2's signatures, defaults and the
errors for what flashmoe does not implement (no torch needed), the arguments each function hands
to flashmoe's ops (a recording stand-in for the torch layer; the KV-cache mapping with torch when
it is installed)."""

import importlib.util
import inspect
import types

import pytest

import flashmoe.flash_attn_interface as fai

# FlashAttention-2's public signatures (flash_attn/flash_attn_interface.py): (name, default), in
# order; REQUIRED marks a parameter without a default.
REQUIRED = object()
TAIL = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)),
        ("softcap", 0.0), ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False)]
FA2 = {
    "flash_attn_qkvpacked_func": [("qkv", REQUIRED)] + TAIL,
    "flash_attn_kvpacked_func": [("q", REQUIRED), ("kv", REQUIRED)] + TAIL,
    "flash_attn_varlen_qkvpacked_func": [("qkv", REQUIRED), ("cu_seqlens", REQUIRED), ("max_seqlen", REQUIRED)]
    + TAIL,
    "flash_attn_varlen_kvpacked_func": [("q", REQUIRED), ("kv", REQUIRED), ("cu_seqlens_q", REQUIRED),
                                        ("cu_seqlens_k", REQUIRED), ("max_seqlen_q", REQUIRED),
                                        ("max_seqlen_k", REQUIRED)] + TAIL,
    "flash_attn_func": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False),
    ],
    "flash_attn_varlen_func": [
        ("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("cu_seqlens_q", REQUIRED), ("cu_seqlens_k", REQUIRED),
        ("max_seqlen_q", REQUIRED), ("max_seqlen_k", REQUIRED), ("dropout_p", 0.0), ("softmax_scale", None),
        ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
        ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
    ],
    "flash_attn_with_kvcache": [
        ("q", REQUIRED), ("k_cache", REQUIRED), ("v_cache", REQUIRED), ("k", None), ("v", None),
        ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
        ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
        ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True), ("alibi_slopes", None),
        ("num_splits", 0), ("return_softmax_lse", False),
    ],
}


@pytest.mark.parametrize("fn", sorted(FA2))
def test_signature_is_flash_attn_2s(fn):
    params = list(inspect.signature(getattr(fai, fn)).parameters.values())
    got = [(p.name, REQUIRED if p.default is inspect.Parameter.empty else p.default) for p in params]
    assert got == FA2[fn], fn
    # positional order: nothing keyword-only, nothing variadic
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params), fn
    assert set(fai.__all__) == set(FA2)


class Recorder:
    """A stand-in for flashmoe._torch: records the op each function calls and its arguments."""

    def __init__(self, alibi=False):
        self.calls = []
        if alibi:
            def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                          deterministic=None, alibi_slopes=None):
                return self._record("attention", (q, k, v), locals())
        else:
            def attention(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                          deterministic=None):
                return self._record("attention", (q, k, v), locals())

        def attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, causal=False, softmax_scale=None,
                             window_size=(-1, -1), softcap=0.0):
            return self._record("attention_varlen", (q, k, v, cu_q, cu_k, max_q, max_k), locals())

        self.attention, self.attention_varlen = attention, attention_varlen

    def _record(self, name, args, loc):
        kw = {k: v for k, v in loc.items() if k not in ("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k", "self")}
        self.calls.append((name, args, kw))
        return "out"


@pytest.fixture
def ops(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(fai, "_torch_ops", lambda: rec)
    return rec


def test_flash_attn_func_positional_call_reaches_attention(ops):
    out = fai.flash_attn_func("q", "k", "v", 0.0, 0.5, True, (8, 0), 30.0, None, True, False)
    assert out == "out"
    assert ops.calls == [("attention", ("q", "k", "v"),
                          {"causal": True, "softmax_scale": 0.5, "window_size": (8, 0), "softcap": 30.0,
                           "deterministic": True})]


def test_flash_attn_func_defaults_reach_attention(ops):
    fai.flash_attn_func("q", "k", "v")
    # deterministic=False (FA's default) leaves the choice to torch's flag (None)
    assert ops.calls[0][2] == {"causal": False, "softmax_scale": None, "window_size": (-1, -1), "softcap": 0.0,
                               "deterministic": None}


def test_flash_attn_varlen_func_positional_call_reaches_attention_varlen(ops):
    fai.flash_attn_varlen_func("q", "k", "v", "cq", "ck", 100, 200, 0.0, None, True, (-1, 4), 5.0)
    assert ops.calls == [("attention_varlen", ("q", "k", "v", "cq", "ck", 100, 200),
                          {"causal": True, "softmax_scale": None, "window_size": (-1, 4), "softcap": 5.0})]


class Packed:
    """A stand-in for a packed tensor: its shape and the views unbind(-3) gives."""

    def __init__(self, name, n):
        self.name, self.shape = name, (7, n, 4, 64)

    def dim(self):
        return len(self.shape)

    def unbind(self, dim):
        assert dim == -3
        return tuple(f"{self.name}[{i}]" for i in range(self.shape[-3]))


def test_packed_forms_call_the_functions_on_views(ops):
    fai.flash_attn_qkvpacked_func(Packed("qkv", 3), 0.0, 0.25, True, (16, 0), 3.0)
    fai.flash_attn_kvpacked_func("q", Packed("kv", 2), causal=True)
    fai.flash_attn_varlen_qkvpacked_func(Packed("qkv", 3), "cu", 9, 0.0, None, False, (-1, 2))
    fai.flash_attn_varlen_kvpacked_func("q", Packed("kv", 2), "cq", "ck", 5, 7, softcap=1.0)
    full = {"causal": True, "softmax_scale": 0.25, "window_size": (16, 0), "softcap": 3.0, "deterministic": None}
    assert ops.calls[0] == ("attention", ("qkv[0]", "qkv[1]", "qkv[2]"), full)
    assert ops.calls[1][:2] == ("attention", ("q", "kv[0]", "kv[1]")) and ops.calls[1][2]["causal"] is True
    assert ops.calls[2] == ("attention_varlen", ("qkv[0]", "qkv[1]", "qkv[2]", "cu", "cu", 9, 9),
                            {"causal": False, "softmax_scale": None, "window_size": (-1, 2), "softcap": 0.0})
    assert ops.calls[3][:2] == ("attention_varlen", ("q", "kv[0]", "kv[1]", "cq", "ck", 5, 7))
    assert ops.calls[3][2]["softcap"] == 1.0
    with pytest.raises(ValueError, match=r"qkv must have 3 packed tensors in dim -3"):
        fai.flash_attn_qkvpacked_func(Packed("qkv", 2))
    with pytest.raises(ValueError, match="no attention dropout"):
        fai.flash_attn_kvpacked_func("q", Packed("kv", 2), 0.1)


@pytest.mark.parametrize("dropout_p", [0.1, 1, 0.5])
def test_dropout_is_a_value_error(ops, dropout_p):
    with pytest.raises(ValueError, match=f"dropout_p = {dropout_p}: flashmoe has no attention dropout"):
        fai.flash_attn_func("q", "k", "v", dropout_p)
    with pytest.raises(ValueError, match="no attention dropout"):
        fai.flash_attn_varlen_func("q", "k", "v", "cq", "ck", 1, 1, dropout_p=dropout_p)
    with pytest.raises(TypeError, match="dropout_p must be a float"):
        fai.flash_attn_func("q", "k", "v", "0.1")
    assert ops.calls == []  # nothing ran
    fai.flash_attn_func("q", "k", "v", 0)  # an int 0 is no dropout
    assert len(ops.calls) == 1


def test_return_attn_probs_is_not_implemented(ops):
    for call in (lambda: fai.flash_attn_func("q", "k", "v", return_attn_probs=True),
                 lambda: fai.flash_attn_varlen_func("q", "k", "v", "cq", "ck", 1, 1, return_attn_probs=True)):
        with pytest.raises(NotImplementedError, match=r"return_attn_probs=True is not implemented .*return_lse"):
            call()
    assert ops.calls == []


def test_varlen_block_table_is_not_implemented(ops):
    with pytest.raises(NotImplementedError, match="block_table"):
        fai.flash_attn_varlen_func("q", "k", "v", "cq", "ck", 1, 1, block_table="bt")
    assert ops.calls == []


def test_alibi_is_not_implemented_until_the_op_takes_slopes(ops, monkeypatch):
    with pytest.raises(NotImplementedError, match="alibi_slopes is not implemented"):
        fai.flash_attn_func("q", "k", "v", alibi_slopes="slopes")
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fai.flash_attn_varlen_func("q", "k", "v", "cq", "ck", 1, 1, alibi_slopes="slopes")
    assert ops.calls == []
    # once the op takes slopes, they pass through
    rec = Recorder(alibi=True)
    monkeypatch.setattr(fai, "_torch_ops", lambda: rec)
    fai.flash_attn_func("q", "k", "v", alibi_slopes="slopes")
    assert rec.calls[0][2]["alibi_slopes"] == "slopes"


@pytest.mark.parametrize("kwargs, words", [
    ({"cache_leftpad": "p"}, "cache_leftpad is not implemented"),
])
def test_kvcache_options_that_are_not_implemented(ops, kwargs, words):
    with pytest.raises(NotImplementedError, match=words):
        fai.flash_attn_with_kvcache("q", "kc", "vc", **kwargs)


@pytest.mark.parametrize("num_splits", [-1, 1.5, True])
def test_kvcache_num_splits_must_be_a_count(ops, num_splits):
    with pytest.raises(ValueError, match="num_splits must be an int >= 0"):
        fai.flash_attn_with_kvcache("q", "kc", "vc", num_splits=num_splits)


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed")
def test_without_torch_the_functions_say_they_need_it():
    for call in (lambda: fai.flash_attn_func(None, None, None),
                 lambda: fai.flash_attn_varlen_func(None, None, None, None, None, 1, 1),
                 lambda: fai.flash_attn_with_kvcache(None, None, None)):
        with pytest.raises(ImportError, match="flash_attn_interface needs PyTorch"):
            call()


# --------------------------------------------------------------------------- KV cache mapping (torch)


@pytest.fixture
def kvcache_calls(monkeypatch):
    torch = pytest.importorskip("torch")
    _torch = importlib.import_module("flashmoe._torch")

    calls = []

    def attention_with_kvcache(q, k_cache, v_cache, **kw):
        calls.append(kw)
        return "out"

    monkeypatch.setattr(_torch, "attention_with_kvcache", attention_with_kvcache)
    return torch, calls


def test_kvcache_contiguous_cache_becomes_one_page_per_row(kvcache_calls):
    torch, calls = kvcache_calls
    q = torch.empty(3, 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.empty(5, 100, 2, 64, dtype=torch.bfloat16)
    fai.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=17)
    kw = calls[-1]
    assert torch.equal(kw["block_table"], torch.arange(3, dtype=torch.int32).view(3, 1))
    assert kw["cache_seqlens"].dtype == torch.int32 and kw["cache_seqlens"].tolist() == [17, 17, 17]
    assert kw["causal"] is False and kw["window_size"] == (-1, -1) and kw["softcap"] == 0.0
    assert kw["softmax_scale"] is None and kw["return_lse"] is False and kw["k"] is None and kw["v"] is None
    # cache_batch_idx picks each sequence's cache row; no cache_seqlens: the whole row
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    fai.flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=idx, causal=True, return_softmax_lse=True)
    kw = calls[-1]
    assert kw["block_table"].tolist() == [[4], [0], [2]]
    assert kw["cache_seqlens"].tolist() == [100, 100, 100]
    assert kw["causal"] is True and kw["return_lse"] is True
    with pytest.raises(ValueError, match=r"cache_batch_idx must be \(batch,\)"):
        fai.flash_attn_with_kvcache(q, cache, cache, cache_batch_idx=idx[:2])


def test_kvcache_paged_cache_passes_the_table(kvcache_calls):
    torch, calls = kvcache_calls
    q = torch.empty(2, 1, 8, 64, dtype=torch.bfloat16)
    cache = torch.empty(10, 16, 2, 64, dtype=torch.bfloat16)
    table = torch.tensor([[0, 1, 2], [5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    new = torch.empty(2, 1, 2, 64, dtype=torch.bfloat16)
    fai.flash_attn_with_kvcache(q, cache, cache, new, new, None, None, lens, None, None, table, 0.1, True, (32, 0),
                                5.0)
    kw = calls[-1]
    assert kw["block_table"] is table and kw["cache_seqlens"] is lens and kw["k"] is new and kw["v"] is new
    assert (kw["softmax_scale"], kw["causal"], kw["window_size"], kw["softcap"]) == (0.1, True, (32, 0), 5.0)
    fai.flash_attn_with_kvcache(q, cache, cache, block_table=table)  # no cache_seqlens: the table's capacity
    assert calls[-1]["cache_seqlens"].tolist() == [48, 48]
    with pytest.raises(NotImplementedError, match="cache_batch_idx with a block_table"):
        fai.flash_attn_with_kvcache(q, cache, cache, block_table=table, cache_batch_idx=lens)


def rotary_reference(torch, x, cos, sin, positions, interleaved):
    """FlashAttention-2's rotary embedding as complex multiplication, float64: x (b, s, h, d),
    positions (b, s); the pairs (2j, 2j + 1) (interleaved) or (j, j + r / 2) are the real and
    imaginary parts rotated by the angle of row `position`, column j of cos / sin."""
    r = 2 * cos.shape[1]
    x = x.double()
    head, tail = x[..., :r], x[..., r:]
    if interleaved:
        re, im = head[..., 0::2], head[..., 1::2]
    else:
        re, im = head[..., : r // 2], head[..., r // 2:]
    rot = torch.complex(re, im) * torch.complex(cos.double()[positions], sin.double()[positions]).unsqueeze(2)
    if interleaved:
        out = torch.stack((rot.real, rot.imag), dim=-1).flatten(-2)
    else:
        out = torch.cat((rot.real, rot.imag), dim=-1)
    return torch.cat((out, tail), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 0))])
def test_kvcache_rotary_rotates_q_and_the_new_keys(monkeypatch, interleaved, causal, window):
    torch = pytest.importorskip("torch")
    _torch = importlib.import_module("flashmoe._torch")
    seen = []
    monkeypatch.setattr(_torch, "attention_with_kvcache", lambda q, kc, vc, **kw: seen.append((q, kw)) or "out")
    b, sq, hq, hk, d, r, cap = 3, 2, 4, 2, 64, 32, 40
    q = torch.randn(b, sq, hq, d, dtype=torch.float32)
    k, v = torch.randn(b, sq, hk, d), torch.randn(b, sq, hk, d)
    cache = torch.empty(b, cap, hk, d)
    angle = torch.rand(cap, r // 2) * 6.28
    cos, sin = angle.cos(), angle.sin()
    lens = torch.tensor([0, 7, 30], dtype=torch.int32)
    fai.flash_attn_with_kvcache(q, cache, cache, k, v, cos, sin, lens, causal=causal, window_size=window,
                                rotary_interleaved=interleaved)
    (got_q, kw) = seen[-1]
    steps = torch.arange(sq).view(1, sq)
    at = lens.long().view(b, 1) + steps
    want_k = rotary_reference(torch, k, cos, sin, at, interleaved)
    # q: at the new keys' positions under a causal mask or a window, else all at cache_seqlens
    q_at = at if (causal or window != (-1, -1)) else lens.long().view(b, 1).expand(b, sq)
    want_q = rotary_reference(torch, q, cos, sin, q_at, interleaved)
    assert (got_q.double() - want_q).abs().max().item() < 1e-5
    assert (kw["k"].double() - want_k).abs().max().item() < 1e-5
    assert kw["v"] is v and kw["cache_seqlens"] is lens
    # the dims past rotary_dim are not touched
    assert torch.equal(got_q[..., r:], q[..., r:]) and torch.equal(kw["k"][..., r:], k[..., r:])


def test_kvcache_rotary_errors(monkeypatch):
    torch = pytest.importorskip("torch")
    _torch = importlib.import_module("flashmoe._torch")
    monkeypatch.setattr(_torch, "attention_with_kvcache", lambda *a, **kw: "out")
    q = torch.randn(1, 1, 2, 64)
    cache = torch.empty(1, 16, 2, 64)
    cos = torch.ones(16, 16)
    with pytest.raises(ValueError, match="apply with k and v"):
        fai.flash_attn_with_kvcache(q, cache, cache, rotary_cos=cos, rotary_sin=cos)
    with pytest.raises(ValueError, match="go together"):
        fai.flash_attn_with_kvcache(q, cache, cache, q, q, rotary_cos=cos)
    with pytest.raises(ValueError, match="fewer than the cache's 16"):
        fai.flash_attn_with_kvcache(q, cache, cache, q, q, cos[:8], cos[:8])
    with pytest.raises(ValueError, match="rotary_dim <= headdim"):
        fai.flash_attn_with_kvcache(q, cache, cache, q, q, torch.ones(16, 40), torch.ones(16, 40))


def test_one_line_swap():
    # the module is importable under the name FlashAttention code uses for it
    import flashmoe.flash_attn_interface as flash_attn_interface

    assert callable(flash_attn_interface.flash_attn_func)
    assert callable(flash_attn_interface.flash_attn_varlen_func)
    assert callable(flash_attn_interface.flash_attn_with_kvcache)
    assert isinstance(fai, types.ModuleType)
