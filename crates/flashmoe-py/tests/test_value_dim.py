"""A value head dim other than the query/key one (D_v ≠ D_qk) in flashmoe.attention /
attention_varlen, without a GPU: the composition (zero padding to one head dim, the scale, the cut
of o) with the CUDA kernel functions replaced by a float64 reference of the same contract (one
head dim for q, k and v; softmax_scale None = the plan's f32 1/sqrt(D)), against the unpadded
float64 reference: outputs, lse and gradients. The real kernels under the same calls:
test_torch_gpu.py ("value head dim"). Skipped without torch; needs no CUDA device."""

import math
import random

import pytest

torch = pytest.importorskip("torch")

import flashmoe  # noqa: E402
import flashmoe.flash_attn_interface as fai  # noqa: E402
from flashmoe import _core, _torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = random.SystemRandom().randrange(1 << 31)
    torch.manual_seed(seed)
    print(f"seed {seed}")
    return seed


def f32_default_scale(d):
    """1/sqrt(d) as the plans compute it (f32 sqrt and division)."""
    one, dd = torch.tensor(1.0, dtype=torch.float32), torch.tensor(float(d), dtype=torch.float32)
    return (one / dd.sqrt()).item()


def ref_seq(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """float64 attention of one sequence, differentiable: q (sq, hq, dqk), k (sk, hkv, dqk),
    v (sk, hkv, dv); bottom-right masks. o (sq, hq, dv), lse (hq, sq); a row that sees no key gives
    0 and -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    vv = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[0], k.shape[0]
    left, right = window[0], 0 if causal else window[1]
    pos = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    masked = torch.zeros(sq, sk, dtype=torch.bool)
    if right >= 0:
        masked |= j > pos + right
    if left >= 0:
        masked |= j < pos - left
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    return torch.einsum("hqk,khd->qhd", p, vv), lse


def ref_dense(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    outs = [ref_seq(q[i], k[i], v[i], scale, causal, window, softcap) for i in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])


def ref_varlen(q, k, v, cu_q, cu_k, scale, causal=False, window=(-1, -1), softcap=0.0):
    os, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, lse = ref_seq(q[qs], k[ks], v[ks], scale, causal, window, softcap)
        os.append(o)
        lses.append(lse)
    return torch.cat(os), torch.cat(lses, dim=1)


class Kernels:
    """Stand-ins for the dense and varlen kernel functions and ops of flashmoe._torch: they check
    the kernels' contract (one head dim), resolve the scale as the plans do, record every call
    (their tensors keep their gradients) and return the float64 reference."""

    def __init__(self):
        self.calls = []

    def _record(self, q, k, v, softmax_scale):
        d = q.shape[-1]
        assert k.shape[-1] == d and v.shape[-1] == d, "the kernels take one head dim"
        if not torch.compiler.is_compiling():  # (dynamo traces no grad_fn; the compile test records nothing)
            for t in (q, k, v):
                if t.requires_grad and t.grad_fn is not None:
                    t.retain_grad()
            self.calls.append({"q": q, "k": k, "v": v, "softmax_scale": softmax_scale})
        return f32_default_scale(d) if softmax_scale is None else softmax_scale

    def dense(self, q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
              deterministic=False, want_lse=True):
        scale = self._record(q, k, v, softmax_scale)
        return ref_dense(q, k, v, scale, causal, (window_left, window_right), softcap)

    def varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, window_left=-1, window_right=-1,
               softcap=0.0, want_lse=True):
        scale = self._record(q, k, v, softmax_scale)
        return ref_varlen(q, k, v, cu_q.tolist(), cu_k.tolist(), scale, causal, (window_left, window_right), softcap)


@pytest.fixture
def kernels(monkeypatch):
    k = Kernels()
    monkeypatch.setattr(_torch, "_attention_impl", k.dense)
    monkeypatch.setattr(_torch, "_attention_op", k.dense)
    monkeypatch.setattr(_torch, "_attention_varlen_impl", k.varlen)
    monkeypatch.setattr(_torch, "_attention_varlen_op", k.varlen)
    return k


def close(a, b, what, tol=1e-10):
    assert a.shape == b.shape, f"{what}: shape {list(a.shape)} vs {list(b.shape)}"
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), f"{what}: non-finite where the reference is finite"
    err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= tol * max(1.0, b[fin].abs().max().item()), f"{what}: max abs error {err:.3e}"


DIMS = [(192, 128), (64, 32), (96, 128), (32, 64)]
DENSE_CASES = [
    # b, sq, sk, hq, hkv, causal, softmax_scale, window, softcap
    (2, 9, 9, 4, 2, True, None, (-1, -1), 0.0),  # GQA, causal
    (1, 7, 13, 3, 3, False, None, (-1, -1), 0.0),  # Sq < Sk
    (2, 11, 5, 4, 1, True, 0.2, (-1, -1), 0.0),  # MQA, Sq > Sk (rows that see no key), a scale
    (1, 12, 12, 2, 2, True, None, (3, -1), 15.0),  # window and softcap pass through
]


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("case", DENSE_CASES)
def test_attention_outputs_and_grads_match_the_unpadded_reference(kernels, dims, case):
    dqk, dv = dims
    b, sq, sk, hq, hkv, causal, scale, window, softcap = case
    q = torch.randn(b, sq, hq, dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, sk, hkv, dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, sk, hkv, dv, dtype=torch.float64, requires_grad=True)
    o, lse = flashmoe.attention(q, k, v, causal=causal, softmax_scale=scale, window_size=window, softcap=softcap,
                                return_lse=True)
    (call,) = kernels.calls
    pad = max(dqk, dv)
    assert [call[n].shape[-1] for n in "qkv"] == [pad] * 3
    # the scale: the caller's, else 1/sqrt(D_qk) (None when the plan's default at D is that)
    want_scale = scale if scale is not None else (None if pad == dqk else f32_default_scale(dqk))
    assert call["softmax_scale"] == want_scale
    # nothing but the padded tensor(s) is copied
    assert (call["q"] is q and call["k"] is k) if dv < dqk else call["v"] is v
    assert o.shape == (b, sq, hq, dv) and o.is_contiguous() and lse.shape == (b, hq, sq)
    rs = scale if scale is not None else f32_default_scale(dqk)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ro, rlse = ref_dense(q64, k64, v64, rs, causal, window, softcap)
    close(o.detach(), ro.detach(), "o")
    close(lse.detach(), rlse.detach(), "lse")
    do = torch.randn_like(ro)
    o.backward(do)
    ro.backward(do)
    for name, t, r in zip("qkv", (q, k, v), (q64, k64, v64)):
        assert t.grad.shape == t.shape, name
        close(t.grad, r.grad, f"d{name}")
    # the gradients of the padded columns are zero and are dropped by the pad's backward
    if dv < dqk:
        assert (call["v"].grad[..., dv:] == 0).all()
    else:
        assert (call["q"].grad[..., dqk:] == 0).all() and (call["k"].grad[..., dqk:] == 0).all()


@pytest.mark.parametrize("dims", DIMS)
def test_attention_inference_path(kernels, dims):
    # no grad: the kernel function itself (the eager fast path), o only
    dqk, dv = dims
    q, k = torch.randn(2, 6, 4, dqk, dtype=torch.float64), torch.randn(2, 10, 2, dqk, dtype=torch.float64)
    v = torch.randn(2, 10, 2, dv, dtype=torch.float64)
    with torch.no_grad():
        o = flashmoe.attention(q, k, v, causal=True)
    assert o.shape == (2, 6, 4, dv) and o.is_contiguous()
    close(o, ref_dense(q, k, v, f32_default_scale(dqk), True)[0], "o")


# Head dims the kernels do not serve as they are: not multiples of 8 (FlashAttention-2's 59, 111;
# all three tensors padded) and, with a backward to record, dims without a backward kernel (40 → 64).
ODD_DIMS = [(59, 59), (111, 111), (40, 40), (20, 36)]


def served_dim(dqk, dv, target):
    """The head dim the kernels run the call at (the router's rule, written out)."""
    d = -(-max(dqk, dv) // 8) * 8
    dims = {"forward": (), "backward": (32, 64, 96, 128), "varlen": (64, 128)}[target]
    if dims and d <= dims[-1]:
        d = next(b for b in dims if b >= d)
    return d


@pytest.mark.parametrize("dims", ODD_DIMS)
@pytest.mark.parametrize("case", DENSE_CASES[:3])
def test_odd_head_dims_match_the_unpadded_reference(kernels, dims, case):
    dqk, dv = dims
    b, sq, sk, hq, hkv, causal, scale, window, softcap = case
    q = torch.randn(b, sq, hq, dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, sk, hkv, dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, sk, hkv, dv, dtype=torch.float64, requires_grad=True)
    o, lse = flashmoe.attention(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
    (call,) = kernels.calls
    pad = served_dim(dqk, dv, "backward")
    assert [call[n].shape[-1] for n in "qkv"] == [pad] * 3
    assert call["softmax_scale"] == (scale if scale is not None else f32_default_scale(dqk))
    assert o.shape == (b, sq, hq, dv) and o.is_contiguous()
    rs = scale if scale is not None else f32_default_scale(dqk)
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ro, rlse = ref_dense(q64, k64, v64, rs, causal)
    close(o.detach(), ro.detach(), "o")
    close(lse.detach(), rlse.detach(), "lse")
    do = torch.randn_like(ro)
    o.backward(do)
    ro.backward(do)
    for name, t, r in zip("qkv", (q, k, v), (q64, k64, v64)):
        close(t.grad, r.grad, f"d{name}")
    # without a backward to record, the forward's dim (the next multiple of 8)
    kernels.calls.clear()
    with torch.no_grad():
        o2 = flashmoe.attention(q, k, v, causal=causal, softmax_scale=scale)
    (call,) = kernels.calls
    assert call["q"].shape[-1] == served_dim(dqk, dv, "forward")
    close(o2, ro.detach(), "o without grad")


def test_the_odd_rule_is_the_routers():
    for dqk in (1, 7, 40, 59, 80, 111, 129, 250, 256):
        for dv in (dqk, 64, 100):
            for target in ("forward", "backward", "varlen"):
                want = served_dim(dqk, dv, target)
                if target != "forward" and want > 128:
                    with pytest.raises(NotImplementedError, match="they serve head dims up to 128"):
                        _core.pad_head_dims(dqk, dv, None, target)
                    continue
                d, pqk, pv, s = _core.pad_head_dims(dqk, dv, None, target)
                assert (d, pqk, pv) == (want, want - dqk, want - dv)
                assert s == (None if d == dqk else f32_default_scale(dqk))
    with pytest.raises(NotImplementedError, match="query/key head dim 257"):
        _core.pad_head_dims(257, 64)
    with pytest.raises(ValueError, match="target must be"):
        _core.pad_head_dims(64, 64, None, "sideways")

VARLEN_CASES = [
    # q lengths, k lengths, hq, hkv, causal
    ([3, 1, 8], [3, 1, 8], 4, 2, True),
    ([2, 5, 1], [6, 5, 4], 2, 1, True),  # chunked prefill, MQA
    ([4, 7], [9, 2], 3, 3, False),
]


@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_attention_varlen_outputs_and_grads_match_the_unpadded_reference(kernels, dims, case):
    dqk, dv = dims
    lq, lk, hq, hkv, causal = case
    cu_q = [0]
    cu_k = [0]
    for a, c in zip(lq, lk):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + c)
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    q = torch.randn(cu_q[-1], hq, dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, dv, dtype=torch.float64, requires_grad=True)
    o, lse = flashmoe.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, return_lse=True)
    (call,) = kernels.calls
    assert [call[n].shape[-1] for n in "qkv"] == [max(dqk, dv)] * 3
    assert o.shape == (cu_q[-1], hq, dv) and o.is_contiguous() and lse.shape == (hq, cu_q[-1])
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ro, rlse = ref_varlen(q64, k64, v64, cu_q, cu_k, f32_default_scale(dqk), causal)
    close(o.detach(), ro.detach(), "o")
    close(lse.detach(), rlse.detach(), "lse")
    do = torch.randn_like(ro)
    o.backward(do)
    ro.backward(do)
    for name, t, r in zip("qkv", (q, k, v), (q64, k64, v64)):
        close(t.grad, r.grad, f"d{name}")


@pytest.mark.parametrize("dims", ODD_DIMS + [(96, 96), (32, 32)])
def test_attention_varlen_pads_to_the_varlen_head_dims(kernels, dims):
    # the varlen kernels serve 64 and 128: every head dim up to 128 runs padded to one of them
    dqk, dv = dims
    lq, lk, hq, hkv = [3, 1, 8], [5, 1, 9], 4, 2
    cu_q, cu_k = [0, 3, 4, 12], [0, 5, 6, 15]
    cq, ck = torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32)
    q = torch.randn(cu_q[-1], hq, dqk, dtype=torch.float64, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, dqk, dtype=torch.float64, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, dv, dtype=torch.float64, requires_grad=True)
    o = flashmoe.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True)
    (call,) = kernels.calls
    assert [call[n].shape[-1] for n in "qkv"] == [served_dim(dqk, dv, "varlen")] * 3
    q64, k64, v64 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ro, _ = ref_varlen(q64, k64, v64, cu_q, cu_k, f32_default_scale(dqk), True)
    close(o.detach(), ro.detach(), "o")
    do = torch.randn_like(ro)
    o.backward(do)
    ro.backward(do)
    for name, t, r in zip("qkv", (q, k, v), (q64, k64, v64)):
        close(t.grad, r.grad, f"d{name}")


def test_flash_attn_interface_takes_a_value_head_dim(kernels):
    q, k = torch.randn(1, 5, 4, 192, dtype=torch.float64), torch.randn(1, 8, 2, 192, dtype=torch.float64)
    v = torch.randn(1, 8, 2, 128, dtype=torch.float64)
    with torch.no_grad():
        o = fai.flash_attn_func(q, k, v, 0.0, None, True)
        close(o, ref_dense(q, k, v, f32_default_scale(192), True)[0], "flash_attn_func")
        cu = torch.tensor([0, 5], dtype=torch.int32)
        cuk = torch.tensor([0, 8], dtype=torch.int32)
        o = fai.flash_attn_varlen_func(q[0], k[0], v[0], cu, cuk, 5, 8, 0.0, None, True)
        close(o, ref_dense(q, k, v, f32_default_scale(192), True)[0][0], "flash_attn_varlen_func")


def test_compile_fullgraph_traces_the_composition(kernels):
    # dynamo over the padding, the router's rule (assume_constant_result) and the cut (the kernel
    # stand-in is plain torch, so the aot_eager backend runs it on the CPU)
    q = torch.randn(1, 6, 2, 96, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 2, 96, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 6, 2, 128, dtype=torch.float64, requires_grad=True)
    fn = torch.compile(lambda q, k, v: flashmoe.attention(q, k, v, causal=True).square().sum(), fullgraph=True,
                       backend="aot_eager")
    fn(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashmoe.attention(q, k, v, causal=True).square().sum().backward()
    for name, a, t in zip("qkv", grads, (q, k, v)):
        close(a, t.grad, f"compiled d{name}")


# ------------------------------------------------------------------ the real ops, traced (no kernel runs)


def op_call(fn, *tensors):
    gm = make_fx(fn, tracing_mode="fake")(*tensors)
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "flashmoe" in str(n.target)]
    assert len(calls) == 1, gm.graph
    node = calls[0]
    bound = {a.name: a.default_value for a in node.target._schema.arguments}
    bound.update({a.name: x for a, x in zip(node.target._schema.arguments, node.args)})
    bound.update(node.kwargs)
    return bound, gm


@pytest.mark.parametrize("dims", DIMS)
def test_the_ops_get_one_head_dim_and_the_scale(dims):
    dqk, dv = dims
    q, k = torch.randn(1, 20, 4, dqk, dtype=torch.bfloat16), torch.randn(1, 30, 2, dqk, dtype=torch.bfloat16)
    v = torch.randn(1, 30, 2, dv, dtype=torch.bfloat16)
    a, _ = op_call(lambda q, k, v: flashmoe.attention(q, k, v, causal=True), q, k, v)
    pad = max(dqk, dv)
    assert [a[n].meta["val"].shape[-1] for n in "qkv"] == [pad] * 3
    assert a["softmax_scale"] == (None if pad == dqk else f32_default_scale(dqk))
    a, _ = op_call(lambda q, k, v: flashmoe.attention(q, k, v, softmax_scale=0.3), q, k, v)
    assert a["softmax_scale"] == 0.3
    cu = torch.tensor([0, 20], dtype=torch.int32)
    cuk = torch.tensor([0, 30], dtype=torch.int32)
    a, _ = op_call(lambda q, k, v, c, ck: flashmoe.attention_varlen(q, k, v, c, ck, 20, 30), q[0], k[0], v[0], cu,
                   cuk)
    assert [a[n].meta["val"].shape[-1] for n in "qkv"] == [pad] * 3


def test_the_rule_is_the_routers():
    for dqk in range(8, 257, 8):
        for dv in (8, 32, 64, 128, 192, 256):
            d, pqk, pv, s = _core.pad_value_head_dim(dqk, dv)
            assert d == max(dqk, dv) and pqk == d - dqk and pv == d - dv
            assert s == (None if d == dqk else f32_default_scale(dqk))


@pytest.mark.parametrize("dims", [(64, 32), (96, 128)])
def test_meta_backward_shapes(dims):
    # the fake kernels of attention and attention_backward through the pad and the cut
    dqk, dv = dims
    q = torch.empty(1, 8, 4, dqk, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(1, 8, 2, dqk, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(1, 8, 2, dv, dtype=torch.bfloat16, device="meta", requires_grad=True)
    o = flashmoe.attention(q, k, v, causal=True)
    assert o.shape == (1, 8, 4, dv)
    grads = torch.autograd.grad(o, (q, k, v), torch.empty_like(o))
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and g.dtype == t.dtype


# ------------------------------------------------------------------ errors


def test_errors_name_the_problem():
    q = torch.randn(1, 4, 2, 192, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="value head dim 300"):
        flashmoe.attention(q, q, torch.randn(1, 4, 2, 300, dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="query/key head dim 264"):
        x = torch.randn(1, 4, 2, 264, dtype=torch.bfloat16)
        flashmoe.attention(x, x, q)
    with pytest.raises(ValueError, match="v has k's shape but for its last dim"):
        flashmoe.attention(q, q, torch.randn(1, 5, 2, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="q and k share the query/key head dim"):
        flashmoe.attention(q, torch.randn(1, 4, 2, 128, dtype=torch.bfloat16), torch.randn(1, 4, 2, 64,
                                                                                            dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="softmax_scale must be finite"):
        flashmoe.attention(q, q, torch.randn(1, 4, 2, 128, dtype=torch.bfloat16), softmax_scale=math.inf)
    # padded, the call meets the kernels' own checks (here: CPU tensors)
    with pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention(q, q, torch.randn(1, 4, 2, 128, dtype=torch.bfloat16))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="flashmoe takes CUDA tensors"):
        flashmoe.attention_varlen(q[0], q[0], torch.randn(4, 2, 128, dtype=torch.bfloat16), cu, cu, 4, 4)


def test_kvcache_with_another_value_head_dim_is_refused():
    q = torch.randn(1, 1, 4, 192, dtype=torch.bfloat16)
    kc, vc = torch.randn(2, 16, 2, 192, dtype=torch.bfloat16), torch.randn(2, 16, 2, 128, dtype=torch.bfloat16)
    bt, lens = torch.zeros(1, 2, dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="v_cache has head dim 128 but k_cache has 192.*mla_decode"):
        flashmoe.attention_with_kvcache(q, kc, vc, block_table=bt, cache_seqlens=lens)
    with pytest.raises(NotImplementedError, match="v_cache has head dim 128"):
        fai.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=8)


@pytest.mark.parametrize("dims", [(192, 128), (96, 128)])
def test_alibi_calls_are_padded_too(monkeypatch, dims):
    # ALiBi (forward only) takes the same composition: the slopes pass through, o is cut back
    dqk, dv = dims
    seen = []

    def alibi(q, k, v, slopes, causal, softmax_scale, *rest):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], softmax_scale, slopes))
        b, sq, hq, d = q.shape
        return torch.full((b, sq, hq, d), 1.0, dtype=q.dtype), torch.zeros(b, hq, sq)

    monkeypatch.setattr(_torch, "_attention_alibi_impl", alibi)
    slopes = torch.rand(4)
    q, k = torch.randn(1, 5, 4, dqk, dtype=torch.bfloat16), torch.randn(1, 5, 2, dqk, dtype=torch.bfloat16)
    o = flashmoe.attention(q, k, torch.randn(1, 5, 2, dv, dtype=torch.bfloat16), causal=True, alibi_slopes=slopes)
    pad = max(dqk, dv)
    assert seen == [(pad, pad, pad, None if pad == dqk else f32_default_scale(dqk), slopes)]
    assert o.shape == (1, 5, 4, dv) and o.is_contiguous()
