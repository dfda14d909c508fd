"""flashmoe's torch ops on a GPU: against f64 references, under torch.compile, in CUDA graphs.

Skipped without torch or a CUDA device. Inputs are fresh random tensors (a new seed per test),
and the caching allocator's free blocks are filled with NaN before each call under test, so an
output element the kernel never writes shows up as NaN. The gate is the lab's
(flashmoe::accuracy): relative L2 error and max abs error against a float64 reference, every
value finite.
"""

import functools
import math
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashmoe  # noqa: E402

DEV = torch.device("cuda", 0)
TOL = {torch.bfloat16: (1.6e-2, 0.1), torch.float16: (4e-3, 0.02)}  # (rel_l2, max_abs)


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = random.SystemRandom().randrange(1 << 31)
    torch.manual_seed(seed)
    print(f"seed {seed}")
    return seed


def poison_pool():
    """Fill the caching allocator's free memory of the current stream with NaN (the next torch.empty
    reuses it): one tensor per free block, largest first, so that each lands in a block of its own
    size (best fit) and the pool does not grow. (One tensor of all the free bytes did not fit the
    free blocks once they were fragmented: each call added a segment of that size, up to an
    out-of-memory error.) All-ones bytes are NaN in f32, bf16 and f16."""
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream(DEV).cuda_stream
    sizes = sorted((b["size"] for seg in torch.cuda.memory_snapshot()
                    if seg["device"] == DEV.index and seg["stream"] == stream
                    for b in seg["blocks"] if b["state"] == "inactive"), reverse=True)
    held = [torch.empty(n, dtype=torch.uint8, device=DEV).fill_(255) for n in sizes]
    torch.cuda.synchronize()
    del held


def gate(out, ref, dtype, what):
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"{what}: non-finite output"
    err = (out64 - ref).abs()
    rel_l2 = (torch.linalg.vector_norm(out64 - ref) / torch.linalg.vector_norm(ref)).item()
    max_abs = err.max().item()
    rl, ma = TOL[dtype]
    assert rel_l2 <= rl and max_abs <= ma, f"{what}: rel_l2 {rel_l2:.3e} max_abs {max_abs:.3e}"
    return rel_l2, max_abs


# --------------------------------------------------------------------------- attention


def attention_ref(q, k, v, causal, scale):
    """float64 attention with GQA and bottom-right causal alignment; returns o and lse."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    hq, hkv = q.shape[2], k.shape[2]
    k64 = k64.repeat_interleave(hq // hkv, dim=2)
    v64 = v64.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, k64) * scale
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v64), lse


ATTENTION_CASES = [
    # b, sq, sk, hq, hkv, d, causal
    (2, 200, 200, 8, 2, 128, False),
    (2, 200, 200, 8, 2, 128, True),
    (1, 77, 300, 4, 4, 64, True),
    (3, 129, 65, 6, 1, 64, False),
    (1, 300, 128, 4, 2, 128, True),  # seqlen_q > seqlen_k: early rows see no key
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_attention_matches_f64(case, dtype):
    b, sq, sk, hq, hkv, d, causal = case
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    ro, rlse = attention_ref(q, k, v, causal, scale)
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, sq)
    gate(o, ro, dtype, "o")
    seen = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), seen), "lse: -inf exactly where a row sees no key"
    assert (lse[seen].double() - rlse[seen]).abs().max().item() < 1e-3
    if not seen.all():
        assert (o.transpose(1, 2)[~seen] == 0).all(), "rows that see no key give 0"


def test_attention_scale_and_sdpa_fp32():
    q, k, v = (torch.randn(2, 150, 4, 64, dtype=torch.bfloat16, device=DEV) for _ in range(3))
    o = flashmoe.attention(q, k, v, causal=True, softmax_scale=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2),
        is_causal=True, scale=0.3,
    ).transpose(1, 2)
    gate(o, ref.double(), torch.bfloat16, "o vs SDPA fp32")


def test_attention_packed_qkv_views_bit_identical():
    b, s, hq, hkv, d = 2, 257, 16, 4, 128
    qkv = torch.randn(b, s, hq + 2 * hkv, d, dtype=torch.bfloat16, device=DEV)
    q, k, v = qkv.split([hq, hkv, hkv], dim=2)
    assert not q.is_contiguous()
    o_view = flashmoe.attention(q, k, v, causal=True)
    o_copy = flashmoe.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(o_view, o_copy)


def test_attention_deterministic_across_calls_and_streams():
    q, k, v = (torch.randn(1, 500, 8, 128, dtype=torch.bfloat16, device=DEV) for _ in range(3))
    a = flashmoe.attention(q, k, v)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        b_ = flashmoe.attention(q, k, v)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(a, b_) and torch.equal(a, flashmoe.attention(q, k, v))


def test_attention_errors():
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="q is on cpu"):
        flashmoe.attention(q.cpu(), q.cpu(), q.cpu())
    with pytest.raises(TypeError, match="k has dtype torch.float16 but q has torch.bfloat16"):
        flashmoe.attention(q, q.half(), q)
    with pytest.raises(TypeError, match="bf16 or f16"):
        flashmoe.attention(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="4-D"):
        flashmoe.attention(q[0], q[0], q[0])
    # head dims up to 256; those off multiples of 8 run zero-padded (44 at 48, the portable
    # kernel: exactly the padded call made by hand); above 256 raise
    h44 = torch.randn(1, 16, 4, 44, dtype=torch.bfloat16, device=DEV)
    padded = F.pad(h44, (0, 4))
    want = flashmoe.attention(padded, padded, padded, softmax_scale=f32_scale(44))[..., :44]
    assert torch.equal(flashmoe.attention(h44, h44, h44), want)
    h264 = torch.randn(1, 16, 4, 264, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(NotImplementedError, match="head dim 264"):
        flashmoe.attention(h264, h264, h264)
    # a seq stride that is not a multiple of 8 elements (TMA's 16 bytes)
    wide = torch.randn(1, 16, 4 * 64 + 4, dtype=torch.bfloat16, device=DEV)
    bad = wide[..., : 4 * 64].unflatten(-1, (4, 64))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        flashmoe.attention(bad, q, q)


# --------------------------------------------------------------------------- MoE


def moe_weights(h, i, e, dtype, shared):
    w = dict(
        router_w=torch.randn(h, e, device=DEV) / math.sqrt(h),
        w13=torch.randn(e, h, 2 * i, device=DEV) / math.sqrt(h),
        w2=torch.randn(e, i, h, device=DEV) / math.sqrt(i),
    )
    if shared:
        w["shared"] = (
            torch.randn(h, 2 * i, device=DEV) / math.sqrt(h),
            torch.randn(i, h, device=DEV) / math.sqrt(i),
        )
    return {
        n: (tuple(x.to(dtype) for x in t) if isinstance(t, tuple) else t.to(dtype)) for n, t in w.items()
    }


def moe_ref(x, router_w, w13, w2, top_k, scoring, renormalize, shared=None):
    """float64 MoE layer (flashmoe's reference definition, crates/flashmoe/src/reference/moe.rs)."""
    x64 = x.double()
    logits = x64 @ router_w.double()
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    top = torch.topk(scores, top_k + 1 if top_k < scores.shape[1] else top_k, dim=-1)
    w, ids = top.values[:, :top_k], top.indices[:, :top_k]
    gap = (top.values[:, top_k - 1] - top.values[:, top_k]) if top_k < scores.shape[1] else None
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    i = w2.shape[1]
    out = torch.zeros_like(x64)
    for slot in range(top_k):
        e = ids[:, slot]
        g = torch.einsum("th,thj->tj", x64, w13.double()[e])
        hmid = torch.nn.functional.silu(g[:, :i]) * g[:, i:]
        out += w[:, slot, None] * torch.einsum("ti,tih->th", hmid, w2.double()[e])
    if shared is not None:
        g = x64 @ shared[0].double()
        out += (torch.nn.functional.silu(g[:, :i]) * g[:, i:]) @ shared[1].double()
    e_count = router_w.shape[1]
    counts = torch.bincount(ids.flatten(), minlength=e_count)
    probs = scores if scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
    f = counts.double() / (x.shape[0] * top_k)
    aux = e_count * (f * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    return out, ids, w, counts, aux, z, gap


@pytest.mark.parametrize(
    "tokens, h, i, e, k, scoring, renorm, shared, dtype",
    [
        (100, 256, 512, 8, 2, "softmax", True, False, torch.bfloat16),
        (37, 512, 256, 16, 4, "sigmoid", False, True, torch.bfloat16),
        (300, 256, 128, 8, 1, "softmax", False, False, torch.float16),
    ],
)
def test_moe_matches_f64(tokens, h, i, e, k, scoring, renorm, shared, dtype):
    wts = moe_weights(h, i, e, dtype, shared)
    x = (torch.rand(tokens, h, device=DEV) * 2 - 1).to(dtype)
    poison_pool()
    r = flashmoe.moe(x, wts["router_w"], wts["w13"], wts["w2"], top_k=k, scoring=scoring,
                     renormalize=renorm, shared=wts.get("shared"))
    torch.cuda.synchronize()
    out, ids, w, counts, aux, z, gap = moe_ref(x, wts["router_w"], wts["w13"], wts["w2"], k, scoring,
                                               renorm, wts.get("shared"))
    assert r.out.shape == x.shape and r.topk_ids.dtype == torch.int32 and r.counts.dtype == torch.int32
    # Routing is compared on tokens whose k-th and (k+1)-th scores are not a near tie.
    clear = gap > 1e-4 if gap is not None else torch.ones(tokens, dtype=torch.bool, device=DEV)
    assert clear.float().mean() > 0.9
    assert torch.equal(r.topk_ids[clear].long(), ids[clear])
    assert (r.topk_weights[clear].double() - w[clear]).abs().max().item() < 1e-3
    assert int(r.counts.sum()) == tokens * k
    assert torch.equal(r.counts.long(), torch.bincount(r.topk_ids.flatten().long(), minlength=e))
    gate(r.out[clear], out[clear], dtype, "moe out")
    assert abs(r.aux_loss.item() - aux.item()) < 1e-2 * max(1.0, abs(aux.item()))
    assert abs(r.z_loss.item() - z.item()) < 1e-3 * max(1.0, abs(z.item()))


def test_moe_errors():
    wts = moe_weights(256, 128, 8, torch.bfloat16, False)
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="top_k"):
        flashmoe.moe(x, wts["router_w"], wts["w13"], wts["w2"], top_k=9)
    with pytest.raises(ValueError, match="w13 has shape"):
        flashmoe.moe(x, wts["router_w"], wts["w13"][:, :, :128], wts["w2"], top_k=2)
    with pytest.raises(TypeError, match="w2 has dtype torch.float16 but x has torch.bfloat16"):
        flashmoe.moe(x, wts["router_w"], wts["w13"], wts["w2"].half(), top_k=2)
    with pytest.raises(ValueError, match="x's innermost dimension has stride 4"):
        flashmoe.moe(torch.randn(256, 4, dtype=torch.bfloat16, device=DEV).t(), wts["router_w"],
                     wts["w13"], wts["w2"], top_k=2)


# --------------------------------------------------------------------------- compile and graphs


class Block(torch.nn.Module):
    """Attention (GQA, causal) then an MoE layer with a shared expert: both ops in one module."""

    def __init__(self, h=256, hq=4, hkv=2, d=64, e=8, i=256, k=2, dtype=torch.bfloat16):
        super().__init__()
        self.hq, self.hkv, self.d, self.k = hq, hkv, d, k
        self.qkv = torch.nn.Linear(h, (hq + 2 * hkv) * d, bias=False, device=DEV, dtype=dtype)
        self.proj = torch.nn.Linear(hq * d, h, bias=False, device=DEV, dtype=dtype)
        w = moe_weights(h, i, e, dtype, True)
        for name, t in (("router_w", w["router_w"]), ("w13", w["w13"]), ("w2", w["w2"]),
                        ("s13", w["shared"][0]), ("s2", w["shared"][1])):
            setattr(self, name, torch.nn.Parameter(t, requires_grad=False))

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.qkv(x).view(b, s, self.hq + 2 * self.hkv, self.d)
        q, k, v = qkv.split([self.hq, self.hkv, self.hkv], dim=2)
        x = x + self.proj(flashmoe.attention(q, k, v, causal=True).reshape(b, s, -1))
        r = flashmoe.moe(x.reshape(b * s, h), self.router_w, self.w13, self.w2, top_k=self.k,
                         shared=(self.s13, self.s2))
        return x + r.out.view(b, s, h), r.aux_loss + 0.001 * r.z_loss, r.topk_ids


@torch.no_grad()
def test_torch_compile_traces_both_ops():
    m = Block().requires_grad_(False)
    compiled = torch.compile(m, fullgraph=True)  # fullgraph: a graph break is an error
    for _ in range(2):
        x = torch.randn(2, 96, 256, dtype=torch.bfloat16, device=DEV)
        e_out, e_loss, e_ids = m(x)
        c_out, c_loss, c_ids = compiled(x)
        # Same kernels on the same inputs; inductor may round the projections and residuals
        # differently, which can flip a near-tie routing decision: compare the tokens routed
        # alike, and require nearly all to be.
        same = (e_ids == c_ids).all(-1).view(2, 96)
        assert same.float().mean() > 0.95
        gate(c_out[same], e_out[same].double(), torch.bfloat16, "compiled block")
        assert abs(c_loss.item() - e_loss.item()) < 1e-2


@torch.no_grad()
def test_torch_compile_passes_window_and_softcap():
    def step(q, k, v):
        a = flashmoe.attention(q, k, v, causal=True, window_size=(32, -1), softcap=20.0)
        b = flashmoe.attention(q, k, v, window_size=(8, 8))
        return a, b

    compiled = torch.compile(step, fullgraph=True)
    q = torch.randn(2, 100, 8, 128, dtype=torch.bfloat16, device=DEV)
    k, v = (torch.randn(2, 180, 2, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    for name, e, c in zip(("causal window + softcap", "window"), step(q, k, v), compiled(q, k, v)):
        assert torch.equal(e, c), f"compiled {name} differs from eager"


def graph_step(q, k, v, x, w):
    """Both ops and elementwise glue only: every kernel is deterministic."""
    a = flashmoe.attention(q, k, v, causal=True)
    r = flashmoe.moe(x + a.reshape(x.shape), w["router_w"], w["w13"], w["w2"], top_k=2,
                     shared=w["shared"])
    return a, r.out, r.topk_ids, r.topk_weights, r.counts, r.aux_loss, r.z_loss


@torch.no_grad()
def test_cuda_graph_capture_and_replay_bit_identical():
    b, s, hq, hkv, d = 2, 64, 4, 2, 64
    w = moe_weights(hq * d, 256, 8, torch.bfloat16, True)
    static = [torch.randn(b, s, hq, d, dtype=torch.bfloat16, device=DEV),
              torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=DEV),
              torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=DEV),
              torch.randn(b * s, hq * d, dtype=torch.bfloat16, device=DEV)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans built and kernels loaded before capture
        graph_step(*static, w)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = graph_step(*static, w)
    for step in range(5):
        for t in static:
            t.copy_(torch.randn_like(t))
        for _ in range(1 + step):  # repeated replays of the same inputs give the same bits
            g.replay()
        torch.cuda.synchronize()
        ref = graph_step(*static, w)
        for name, got, want in zip(("o", "out", "ids", "weights", "counts", "aux", "z"), outs, ref):
            assert torch.equal(got, want), f"replay {step}: {name} differs from eager"


# --------------------------------------------------------------------------- varlen


def masked_attention_ref(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0):
    """float64 attention of one sequence: q (sq, hq, d), k, v (sk, hkv, d); query i sits at key
    position sk - sq + i (bottom-right); window (left, right) around it, -1 unbounded; causal sets
    right = 0. Returns o (sq, hq, d) and lse (hq, sq); a row that sees no key gives 0 and -inf."""
    hq, hkv = q.shape[1], k.shape[1]
    q64 = q.double()
    k64 = k.double().repeat_interleave(hq // hkv, dim=1)
    v64 = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[0], k.shape[0]
    left, right = window[0], 0 if causal else window[1]
    pos = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        masked |= j > pos + right
    if left >= 0:
        masked |= j < pos - left
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v64), lse


def offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu, torch.tensor(cu, dtype=torch.int32, device=DEV)


def check_lse(lse, rlse, what):
    seen = torch.isfinite(rlse)
    assert torch.equal(torch.isfinite(lse), seen), f"{what}: lse -inf exactly where a row sees no key"
    if seen.any():
        assert (lse[seen].double() - rlse[seen]).abs().max().item() < 1e-3, what


VARLEN_CASES = [
    # dtype, d, hq, hkv, causal, q lengths, k lengths (None: the q lengths)
    (torch.bfloat16, 128, 8, 2, True, [1, 7, 130, 61, 257, 3], None),
    (torch.bfloat16, 128, 8, 2, True, [1, 13, 0, 97], [5, 13, 11, 300]),  # chunked prefill, an empty q
    (torch.bfloat16, 64, 6, 1, False, [2, 31, 1, 200], [0, 31, 17, 389]),  # MQA, an empty k
    (torch.float16, 128, 4, 4, True, [127, 1, 129], None),
]


@pytest.mark.parametrize("case", VARLEN_CASES)
def test_attention_varlen_matches_f64(case):
    check_varlen_case(*case)


def check_varlen_case(dtype, d, hq, hkv, causal, lq, lk, window=(-1, -1), softcap=0.0):
    """One packed call against masked_attention_ref per sequence."""
    lk = lk or lq
    cu_q, cu_q_t = offsets(lq)
    cu_k, cu_k_t = offsets(lk)
    q = torch.randn(cu_q[-1], hq, d, dtype=dtype, device=DEV)
    k = torch.randn(cu_k[-1], hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(cu_k[-1], hkv, d, dtype=dtype, device=DEV)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention_varlen(q, k, v, cu_q_t, cu_k_t, max(lq), max(lk), causal=causal,
                                       window_size=window, softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (hq, cu_q[-1])
    for b in range(len(lq)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq[b] == 0:
            continue
        ro, rlse = masked_attention_ref(q[qs], k[ks], v[ks], scale, causal, window, softcap)
        check_lse(lse[:, qs], rlse, f"sequence {b} lse")
        assert torch.isfinite(o[qs]).all(), f"sequence {b}: non-finite o"
        if lk[b] == 0:
            assert (o[qs] == 0).all(), "a sequence without keys gives 0"
            continue
        seen = torch.isfinite(rlse)  # (hq, sq)
        if not seen.any():
            assert (o[qs] == 0).all(), f"sequence {b}: no row sees a key, so o is 0"
            continue
        assert (o[qs].transpose(0, 1)[~seen] == 0).all(), f"sequence {b}: rows that see no key give 0"
        gate(o[qs], ro, dtype, f"sequence {b} (sq {lq[b]}, sk {lk[b]})")


def test_attention_varlen_views_and_scale():
    lens = [37, 1, 211]
    cu, cu_t = offsets(lens)
    hq, hkv, d = 8, 2, 128
    qkv = torch.randn(cu[-1], hq + 2 * hkv, d, dtype=torch.bfloat16, device=DEV)
    q, k, v = qkv.split([hq, hkv, hkv], dim=1)
    assert not q.is_contiguous()
    o_view = flashmoe.attention_varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), causal=True)
    o_copy = flashmoe.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(), cu_t, cu_t,
                                       max(lens), max(lens), causal=True)
    assert torch.equal(o_view, o_copy)
    o = flashmoe.attention_varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), causal=True, softmax_scale=0.05)
    for b in range(len(lens)):
        s = slice(cu[b], cu[b + 1])
        gate(o[s], masked_attention_ref(q[s], k[s], v[s], 0.05, True)[0], torch.bfloat16, f"scaled {b}")


# --------------------------------------------------------------------------- windows and softcap


def windowed_ref(q, k, v, scale, causal, window, softcap):
    """masked_attention_ref per batch element of dense (B, S, H, D) tensors: o like q, lse (B, Hq, Sq)."""
    outs = [masked_attention_ref(q[i], k[i], v[i], scale, causal, window, softcap) for i in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])


WINDOW_CASES = [
    # dtype, b, sq, sk, hq, hkv, d, causal, window, softcap
    (torch.bfloat16, 2, 200, 200, 8, 2, 128, False, (64, 64), 0.0),
    (torch.bfloat16, 2, 300, 300, 8, 2, 128, True, (100, -1), 0.0),  # causal sliding window
    (torch.float16, 1, 77, 300, 4, 4, 64, True, (31, 0), 30.0),  # Sq < Sk, window and softcap
    (torch.bfloat16, 3, 129, 65, 6, 1, 64, False, (-1, 16), 0.0),  # Sq > Sk, right side only, MQA
    (torch.bfloat16, 1, 300, 128, 4, 2, 128, False, (20, 7), 0.0),  # Sq > Sk: the first rows see no key
    (torch.float16, 2, 150, 150, 8, 8, 128, False, (-1, -1), 50.0),  # softcap only
    (torch.bfloat16, 2, 256, 256, 4, 2, 64, True, (-1, -1), 20.0),  # causal softcap
    (torch.bfloat16, 1, 64, 64, 2, 2, 64, False, (0, 0), 0.0),  # the diagonal alone
    (torch.float16, 2, 333, 1000, 8, 2, 128, False, (200, 50), 15.0),  # long keys, both sides, softcap
]


@pytest.mark.parametrize("case", WINDOW_CASES)
def test_attention_window_and_softcap_match_f64(case):
    dtype, b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, sq)
    ro, rlse = windowed_ref(q, k, v, scale, causal, window, softcap)
    check_lse(lse, rlse, "lse")
    gate(o, ro, dtype, "o")
    seen = torch.isfinite(rlse)
    if not seen.all():
        assert (o.transpose(1, 2)[~seen] == 0).all(), "rows that see no key give 0"


def test_attention_window_softcap_vs_fp32_explicit_mask():
    """Against an fp32 SDPA-style reference with an explicit boolean mask and the softcap applied to the
    scaled scores, with a non-default scale (one (left, right) window, Sq != Sk, GQA)."""
    b, sq, sk, hq, hkv, d, scale, window, cap = 2, 96, 160, 8, 2, 128, 0.2, (40, 8), 10.0
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, device=DEV)
    v = torch.randn(b, sk, hkv, d, dtype=torch.bfloat16, device=DEV)
    o = flashmoe.attention(q, k, v, softmax_scale=scale, window_size=window, softcap=cap)
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(hq // hkv, 1), vf.repeat_interleave(hq // hkv, 1)
    s = cap * torch.tanh(qf @ kf.transpose(-1, -2) * scale / cap)
    i = torch.arange(sq, device=DEV)[:, None] + sk - sq
    j = torch.arange(sk, device=DEV)[None, :]
    allowed = (j >= i - window[0]) & (j <= i + window[1])
    ref = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vf
    gate(o, ref.transpose(1, 2).double(), torch.bfloat16, "o vs fp32 explicit mask")


def test_attention_window_softcap_plans_kept_apart():
    """Classes differing only in window or softcap get their own plans (the cache keys include them)."""
    q, k, v = (torch.randn(1, 256, 4, 64, dtype=torch.bfloat16, device=DEV) for _ in range(3))
    full = flashmoe.attention(q, k, v)
    win = flashmoe.attention(q, k, v, window_size=(16, 16))
    cap30 = flashmoe.attention(q, k, v, softcap=30.0)
    cap5 = flashmoe.attention(q, k, v, softcap=5.0)
    assert not torch.equal(full, win) and not torch.equal(full, cap30) and not torch.equal(cap30, cap5)
    assert torch.equal(flashmoe.attention(q, k, v), full)
    assert torch.equal(flashmoe.attention(q, k, v, window_size=(16, 16)), win)
    assert torch.equal(flashmoe.attention(q, k, v, softcap=30.0), cap30)
    # a window wider than the keys hides nothing (another kernel variant: close, not bit-equal);
    # causal with right side 5 is plain causal (the same kernel)
    gate(flashmoe.attention(q, k, v, window_size=(4096, 4096)), full.double(), torch.bfloat16, "wide window")
    assert torch.equal(flashmoe.attention(q, k, v, causal=True, window_size=(-1, 5)),
                       flashmoe.attention(q, k, v, causal=True))


def test_attention_window_softcap_errors():
    q = torch.randn(1, 16, 4, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match=r"window \(-2, 0\)"):
        flashmoe.attention(q, q, q, window_size=(-2, 0))
    with pytest.raises(ValueError, match="softcap -1 must be finite and >= 0"):
        flashmoe.attention(q, q, q, softcap=-1.0)
    with pytest.raises(ValueError, match="softcap NaN"):
        flashmoe.attention(q, q, q, causal=True, softcap=float("nan"))
    with pytest.raises(TypeError, match="window_size must be a"):
        flashmoe.attention(q, q, q, window_size=8)
    # head dim 256 has no sm_90a kernel: a prefill-sized window and softcap (Gemma-2) run on the
    # portable kernel (Hopper: its 256 tile needs Hopper's shared memory)
    h256 = torch.randn(1, 32, 4, 256, dtype=torch.bfloat16, device=DEV)
    if torch.cuda.get_device_capability(DEV)[0] >= 9:
        o = flashmoe.attention(h256, h256, h256, window_size=(8, 8), softcap=30.0)
        ro, _ = masked_attention_ref(h256[0], h256[0], h256[0], 1 / 16, False, (8, 8), 30.0)
        gate(o[0], ro, torch.bfloat16, "head dim 256 window + softcap")
    else:
        with pytest.raises(NotImplementedError, match="portable prefill kernel"):
            flashmoe.attention(h256, h256, h256, window_size=(8, 8))
    flashmoe.attention(h256, h256, h256, causal=True)  # without a window head dim 256 runs (v1)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"window \(3, -9\)"):
        flashmoe.attention_varlen(q[0], q[0], q[0], cu, cu, 10, 10, window_size=(3, -9))
    with pytest.raises(ValueError, match="softcap inf"):
        flashmoe.attention_varlen(q[0], q[0], q[0], cu, cu, 10, 10, softcap=float("inf"))


DECODE_SHAPED_WINDOW_CASES = [
    # dtype, b, sq, sk, hq, hkv, d, causal, window, softcap: at most 16 query rows with a window or
    # softcap run on the decode plan over the dense k/v on every GPU (head dim 256 included), as in
    # flashmoe-candle
    (torch.bfloat16, 2, 1, 300, 8, 2, 256, True, (-1, -1), 50.0),  # Gemma-2 decode step: softcap
    (torch.bfloat16, 3, 4, 1000, 8, 1, 256, True, (255, -1), 30.0),  # + sliding window, MQA, 4 rows
    (torch.float16, 2, 16, 77, 4, 4, 128, False, (20, 3), 0.0),  # local window, 16 rows
    (torch.bfloat16, 1, 3, 5000, 8, 2, 64, True, (4096, -1), 0.0),  # Mistral window, long keys (splits)
    (torch.float16, 2, 7, 9, 8, 2, 128, True, (2, -1), 10.0),  # short keys: rows see only the window
]


@pytest.mark.parametrize("case", DECODE_SHAPED_WINDOW_CASES)
def test_attention_decode_shaped_windows_use_the_decode_plan(case):
    dtype, b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    poison_pool()
    o, lse = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == dtype and lse.shape == (b, hq, sq)
    ro, rlse = windowed_ref(q, k, v, 1.0 / math.sqrt(d), causal, window, softcap)
    check_lse(lse, rlse, "lse")
    gate(o, ro, dtype, "o")
    # the same class at other lengths: each call routed by its own lengths (prefill-sized calls
    # of head dim 256 with a window: the portable prefill kernel on Hopper, no kernel elsewhere),
    # the cached decode plan reused
    if d != 256:
        return
    o2 = flashmoe.attention(q[:, :1], k[:, : sk // 2], v[:, : sk // 2], causal=causal, window_size=window,
                            softcap=softcap)
    gate(o2, windowed_ref(q[:, :1], k[:, : sk // 2], v[:, : sk // 2], 1.0 / math.sqrt(d), causal, window,
                          softcap)[0], dtype, "o, one row")
    long_q = torch.randn(b, 17, hq, d, dtype=dtype, device=DEV)
    if torch.cuda.get_device_capability(DEV)[0] >= 9:
        o3 = flashmoe.attention(long_q, k, v, causal=causal, window_size=window, softcap=softcap)
        gate(o3, windowed_ref(long_q, k, v, 1.0 / math.sqrt(d), causal, window, softcap)[0], dtype, "o, 17 rows")
    else:
        with pytest.raises(NotImplementedError, match="17 query rows"):
            flashmoe.attention(long_q, k, v, causal=causal, window_size=window, softcap=softcap)


@torch.no_grad()
def test_decode_shaped_window_in_a_cuda_graph():
    """The decode route's per-call block table and lengths are captured like any op."""
    q = torch.randn(2, 1, 8, 256, dtype=torch.bfloat16, device=DEV)
    k, v = (torch.randn(2, 500, 2, 256, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    step = lambda: flashmoe.attention(q, k, v, causal=True, window_size=(127, -1), softcap=50.0)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for t in (q, k, v):
        t.copy_(torch.randn_like(t))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step())


VARLEN_WINDOW_CASES = [
    # dtype, d, hq, hkv, causal, q lengths, k lengths (None: the q lengths), window, softcap
    (torch.bfloat16, 128, 8, 2, True, [1, 7, 130, 61, 257, 3], None, (64, -1), 0.0),
    (torch.bfloat16, 128, 8, 2, False, [1, 13, 0, 97], [5, 13, 11, 300], (50, 20), 30.0),  # Sq != Sk, empty q
    (torch.bfloat16, 64, 6, 1, False, [2, 31, 1, 200], [0, 31, 17, 389], (-1, 10), 0.0),  # MQA, an empty k
    (torch.float16, 128, 4, 4, True, [127, 1, 129], [300, 1, 129], (-1, -1), 25.0),  # causal softcap
    (torch.bfloat16, 64, 4, 2, False, [200, 50], [100, 400], (16, 16), 0.0),  # Sq > Sk: rows without keys
    (torch.float16, 64, 8, 2, True, [300, 1, 45], [301, 5, 45], (7, 0), 10.0),  # narrow causal window
]


@pytest.mark.parametrize("case", VARLEN_WINDOW_CASES)
def test_attention_varlen_window_and_softcap_match_f64(case):
    check_varlen_case(*case)


def test_attention_varlen_errors():
    q = torch.randn(10, 4, 64, dtype=torch.bfloat16, device=DEV)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype torch.int64 but torch.int32 is required"):
        flashmoe.attention_varlen(q, q, q, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k is on cpu"):
        flashmoe.attention_varlen(q, q, q, cu, cu.cpu(), 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q = 11"):
        flashmoe.attention_varlen(q, q, q, cu, cu, 11, 6)
    with pytest.raises(ValueError, match="3-D"):
        flashmoe.attention_varlen(q[None], q[None], q[None], cu, cu, 6, 6)


# --------------------------------------------------------------------------- paged KV cache


def paged_cache(lengths, hkv, d, page_size, dtype, spare_blocks=3):
    """A paged cache holding `lengths[b]` random keys per sequence through a random block table
    (every sequence owns max_blocks distinct blocks); every other position is NaN, so a read past
    a sequence's length shows."""
    b = len(lengths)
    max_blocks = max(1, max(math.ceil(n / page_size) for n in lengths))
    num_blocks = b * max_blocks + spare_blocks
    table = torch.randperm(num_blocks, device=DEV)[: b * max_blocks].view(b, max_blocks).to(torch.int32)
    k_cache = torch.full((num_blocks, page_size, hkv, d), float("nan"), dtype=dtype, device=DEV)
    v_cache = torch.full_like(k_cache, float("nan"))
    keys, values = [], []
    for i, n in enumerate(lengths):
        kk = torch.randn(n, hkv, d, dtype=dtype, device=DEV)
        vv = torch.randn(n, hkv, d, dtype=dtype, device=DEV)
        write_rows(k_cache, table[i], 0, kk)
        write_rows(v_cache, table[i], 0, vv)
        keys.append(kk)
        values.append(vv)
    return k_cache, v_cache, table, keys, values


def write_rows(cache, row, start, x):
    pos = torch.arange(start, start + x.shape[0], device=DEV)
    page = cache.shape[1]
    cache[row[pos // page].long(), pos % page] = x


def read_rows(cache, row, n):
    pos = torch.arange(n, device=DEV)
    page = cache.shape[1]
    return cache[row[pos // page].long(), pos % page]


KVCACHE_CASES = [
    # dtype, d, hq, hkv, page, cache lengths, q rows (int: uniform; list: cu_seqlens_q), s_new appended,
    # causal, window, softcap
    (torch.bfloat16, 128, 8, 2, 16, [1, 17, 130, 61, 2], 1, 0, True, (-1, -1), 0.0),
    (torch.bfloat16, 128, 8, 2, 64, [3, 1000, 97, 1], 4, 4, True, (100, -1), 0.0),
    (torch.float16, 64, 4, 4, 32, [29, 2, 131], 1, 1, False, (-1, -1), 30.0),
    (torch.bfloat16, 256, 16, 2, 16, [7, 4099], 2, 0, True, (-1, -1), 50.0),  # long: KV splits
    (torch.bfloat16, 128, 8, 2, 16, [2003, 5], 3, 0, False, (31, 5), 0.0),  # sliding window, splits
    (torch.bfloat16, 128, 8, 2, 16, [11, 5, 40, 1, 23], [1, 3, 0, 1, 7], 0, True, (-1, -1), 0.0),  # mixed
]


@pytest.mark.parametrize("case", KVCACHE_CASES)
def test_attention_with_kvcache_matches_f64(case):
    dtype, d, hq, hkv, page, lengths, rows, s_new, causal, window, softcap = case
    b = len(lengths)
    final = [n + s_new for n in lengths]
    k_cache, v_cache, table, keys, values = paged_cache(final, hkv, d, page, dtype)
    if s_new:  # the last s_new rows of each sequence come with the call
        k_new = torch.stack([kk[-s_new:] for kk in keys])
        v_new = torch.stack([vv[-s_new:] for vv in values])
        for i, n in enumerate(lengths):  # and are not in the cache yet
            write_rows(k_cache, table[i], n, torch.full_like(k_new[i], float("nan")))
            write_rows(v_cache, table[i], n, torch.full_like(v_new[i], float("nan")))
    else:
        k_new = v_new = None
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    if isinstance(rows, list):
        cu, cu_t = offsets(rows)
        q = torch.randn(cu[-1], hq, d, dtype=dtype, device=DEV)
        q_of = [q[cu[i]:cu[i + 1]] for i in range(b)]
        extra = dict(cu_seqlens_q=cu_t, max_seqlen_q=max(rows))
    else:
        q = torch.randn(b, rows, hq, d, dtype=dtype, device=DEV)
        q_of = list(q)
        extra = {}
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention_with_kvcache(
        q, k_cache, v_cache, block_table=table, cache_seqlens=seqlens, k=k_new, v=v_new, causal=causal,
        window_size=window, softcap=softcap, return_lse=True, **extra)
    torch.cuda.synchronize()
    assert o.shape == q.shape and o.dtype == dtype
    assert torch.equal(seqlens.cpu(), torch.tensor(lengths, dtype=torch.int32)), "cache_seqlens unchanged"
    for i in range(b):
        assert torch.equal(read_rows(k_cache, table[i], final[i]), keys[i]), f"k_cache of sequence {i}"
        assert torch.equal(read_rows(v_cache, table[i], final[i]), values[i]), f"v_cache of sequence {i}"
        if q_of[i].shape[0] == 0:
            continue
        ro, rlse = masked_attention_ref(q_of[i], keys[i], values[i], scale, causal, window, softcap)
        if extra:
            o_i, lse_i = o[cu[i]:cu[i + 1]], lse[:, cu[i]:cu[i + 1]]
        else:
            o_i, lse_i = o[i], lse[i]
        check_lse(lse_i, rlse, f"sequence {i} lse")
        gate(o_i, ro, dtype, f"sequence {i} ({final[i]} keys)")


def test_attention_with_kvcache_errors():
    k_cache, v_cache, table, _, _ = paged_cache([5, 9], 2, 64, 16, torch.bfloat16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 1, 4, 64, dtype=torch.bfloat16, device=DEV)
    kw = dict(block_table=table, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="q has 17 rows per sequence"):
        flashmoe.attention_with_kvcache(q.expand(2, 17, 4, 64), k_cache, v_cache, **kw)
    with pytest.raises(TypeError, match="block_table has dtype torch.int64 but torch.int32 is required"):
        flashmoe.attention_with_kvcache(q, k_cache, v_cache, block_table=table.long(), cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="k and v are appended together"):
        flashmoe.attention_with_kvcache(q, k_cache, v_cache, k=q[:, :, :2], **kw)
    with pytest.raises(ValueError, match="cache_seqlens is on cpu"):
        flashmoe.attention_with_kvcache(q, k_cache, v_cache, block_table=table, cache_seqlens=seqlens.cpu())
    with pytest.raises(TypeError, match="k_cache has dtype torch.float16 but q has torch.bfloat16"):
        flashmoe.attention_with_kvcache(q, k_cache.half(), v_cache.half(), **kw)
    with pytest.raises(ValueError, match="softcap"):
        flashmoe.attention_with_kvcache(q, k_cache, v_cache, softcap=-1.0, **kw)


# --------------------------------------------------------------------------- inference step: compile, graphs


def inference_step(q_dec, k_new, v_new, k_cache, v_cache, table, seqlens, q_pre, kv_pre, cu, max_len):
    """One decode step with an append into the paged cache, then a varlen prefill."""
    o_dec = flashmoe.attention_with_kvcache(q_dec, k_cache, v_cache, block_table=table, cache_seqlens=seqlens,
                                            k=k_new, v=v_new, window_size=(200, -1), softcap=20.0)
    k_pre, v_pre = kv_pre.unbind(1)
    o_pre, lse = flashmoe.attention_varlen(q_pre, k_pre, v_pre, cu, cu, max_len, max_len, causal=True,
                                           return_lse=True)
    o_win = flashmoe.attention_varlen(q_pre, k_pre, v_pre, cu, cu, max_len, max_len, window_size=(16, 4),
                                      softcap=30.0)
    return o_dec * 2, o_pre, lse, o_win


def inference_inputs():
    b, hq, hkv, d = 3, 8, 2, 128
    lengths = [37, 301, 5]
    # room for the appended row of each of the graph test's steps (positions past it are NaN)
    k_cache, v_cache, table, _, _ = paged_cache([n + 4 for n in lengths], hkv, d, 16, torch.bfloat16)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    lens = [19, 1, 64]
    _, cu = offsets(lens)
    return dict(
        q_dec=torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device=DEV),
        k_new=torch.randn(b, 1, hkv, d, dtype=torch.bfloat16, device=DEV),
        v_new=torch.randn(b, 1, hkv, d, dtype=torch.bfloat16, device=DEV),
        k_cache=k_cache, v_cache=v_cache, table=table, seqlens=seqlens,
        q_pre=torch.randn(sum(lens), hq, d, dtype=torch.bfloat16, device=DEV),
        kv_pre=torch.randn(sum(lens), 2, hkv, d, dtype=torch.bfloat16, device=DEV),
        cu=cu, max_len=sum(lens),  # a bound for any lengths of the same total (graph replays)
    )


@torch.no_grad()
def test_torch_compile_traces_the_inference_ops():
    compiled = torch.compile(inference_step, fullgraph=True)
    for _ in range(2):
        x = inference_inputs()
        y = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        eager = inference_step(**x)
        comp = compiled(**y)
        for name, e, c in zip(("decode", "prefill", "lse", "windowed prefill"), eager, comp):
            assert torch.equal(e, c), f"compiled {name} differs from eager"
        # the compiled append wrote the caches in place, as the eager one did
        assert torch.equal(x["k_cache"].nan_to_num(7.0), y["k_cache"].nan_to_num(7.0))
        assert torch.equal(x["v_cache"].nan_to_num(7.0), y["v_cache"].nan_to_num(7.0))


@torch.no_grad()
def test_cuda_graph_of_the_inference_ops():
    x = inference_inputs()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: plans built, workspaces zeroed before capture
        inference_step(**x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = inference_step(**x)
    lens_per_replay = [[19, 1, 64], [1, 82, 1], [40, 40, 4]]  # same totals: new offsets, same graph
    for step, lens in enumerate(lens_per_replay):
        for n in ("q_dec", "k_new", "v_new", "q_pre", "kv_pre"):
            x[n].copy_(torch.randn_like(x[n]))
        x["cu"].copy_(offsets(lens)[1])
        x["seqlens"].add_(step)  # the decode position moves on
        g.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in outs]
        ref = inference_step(**x)
        for name, a, e in zip(("decode", "prefill", "lse", "windowed prefill"), got, ref):
            assert torch.isfinite(a).all(), f"replay {step}: {name} not finite"
            assert torch.equal(a, e), f"replay {step}: {name} differs from eager"


# --------------------------------------------------------------------------- autograd (backward)
# flashmoe.attention's gradients (the library's deterministic backward) against float64 autograd
# of the masked reference, under torch.compile, and in a small training step.

GRAD_CASES = [
    # dtype, b, sq, sk, hq, hkv, d, causal, window, softcap
    (torch.bfloat16, 2, 200, 200, 8, 2, 128, False, (-1, -1), 0.0),
    (torch.bfloat16, 2, 200, 200, 8, 2, 128, True, (-1, -1), 0.0),
    (torch.float16, 2, 77, 200, 4, 4, 64, True, (-1, -1), 0.0),  # Sq < Sk
    (torch.bfloat16, 2, 150, 99, 4, 1, 64, False, (-1, -1), 0.0),  # Sq > Sk, MQA
    (torch.bfloat16, 1, 256, 256, 4, 2, 64, True, (64, -1), 20.0),  # causal window + softcap
    (torch.float16, 2, 130, 130, 4, 4, 128, False, (32, 16), 0.0),  # two-sided window
]


def grad_ref(q, k, v, do, scale, causal, window, softcap):
    """dq, dk, dv of sum(do * attention(q, k, v)) by float64 autograd of windowed_ref."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o, _ = windowed_ref(q64, k64, v64, scale, causal, window, softcap)
    return torch.autograd.grad(o, (q64, k64, v64), do.double())


def rel_l2(out, ref):
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref)).item()


@pytest.mark.parametrize("case", GRAD_CASES)
def test_attention_grads_match_f64(case):
    dtype, b, sq, sk, hq, hkv, d, causal, window, softcap = case
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV, requires_grad=True)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV, requires_grad=True)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV, requires_grad=True)
    do = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV)
    poison_pool()
    o = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert o.requires_grad and o.grad_fn is not None
    o.backward(do)
    refs = grad_ref(q, k, v, do, 1.0 / math.sqrt(d), causal, window, softcap)
    for name, t, ref in zip("qkv", (q, k, v), refs):
        g = t.grad
        assert g.shape == t.shape and g.dtype == dtype and torch.isfinite(g).all(), name
        err = rel_l2(g, ref)
        print(f"d{name}: rel L2 {err:.2e}")
        assert err <= TOL[dtype][0], f"d{name}: rel L2 {err:.3e}"
    # The default (fast) mode again: dk and dv bit for bit; dq within f32 summation order.
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap).backward(do)
    assert torch.equal(grads[1], k.grad) and torch.equal(grads[2], v.grad)
    assert rel_l2(q.grad, grads[0].double()) <= TOL[dtype][0]
    # deterministic=True: within the tolerance too, and the same gradients bit for bit
    det = []
    for _ in range(2):
        for t in (q, k, v):
            t.grad = None
        flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                           deterministic=True).backward(do)
        det.append([t.grad.clone() for t in (q, k, v)])
    assert all(torch.equal(a, b_) for a, b_ in zip(*det))
    for name, g, ref in zip("qkv", det[0], refs):
        err = rel_l2(g, ref)
        print(f"d{name} (deterministic): rel L2 {err:.2e}")
        assert err <= TOL[dtype][0], f"d{name} (deterministic): rel L2 {err:.3e}"


def test_attention_deterministic_follows_torch_flag():
    # deterministic=None follows torch.are_deterministic_algorithms_enabled() at the forward call
    q, k, v = (torch.randn(2, 333, 4, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
               for _ in range(3))
    do = torch.randn(2, 333, 4, 128, dtype=torch.bfloat16, device=DEV)

    def grads(**kw):
        for t in (q, k, v):
            t.grad = None
        flashmoe.attention(q, k, v, causal=True, **kw).backward(do)
        return [t.grad.clone() for t in (q, k, v)]

    want = grads(deterministic=True)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        got = [grads() for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(before)
    # the deterministic plan's bits, whichever mode ran first
    assert all(torch.equal(a, b_) for g in got for a, b_ in zip(want, g))


def test_attention_grads_match_sdpa():
    q, k, v = (torch.randn(2, 128, 4, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True) for _ in range(3))
    do = torch.randn(2, 128, 4, 64, dtype=torch.bfloat16, device=DEV)
    flashmoe.attention(q, k, v, causal=True).backward(do)
    ours = [t.grad for t in (q, k, v)]
    q2, k2, v2 = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    o.backward(do.float().transpose(1, 2))
    for name, a, b_ in zip("qkv", ours, (q2.grad, k2.grad, v2.grad)):
        err = rel_l2(a, b_.transpose(1, 2).double())
        assert err <= 1.6e-2, f"d{name} vs SDPA fp32: {err:.3e}"


def test_attention_grads_under_compile_match_eager():
    q = torch.randn(2, 96, 8, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(2, 96, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(2, 96, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    # a compiled loss's backward() (forward and backward graphs through AOTAutograd)
    fn = torch.compile(lambda q, k, v: flashmoe.attention(q, k, v, causal=True, deterministic=True)
                       .float().square().sum(), fullgraph=True)
    fn(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashmoe.attention(q, k, v, causal=True, deterministic=True).float().square().sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_training_step_reaches_upstream_weights():
    # the repro: Linear -> flashmoe.attention -> loss; the Linear's weight gets a gradient
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 3 * 256, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2, 64, 256, device=DEV, dtype=torch.bfloat16)
    qkv = lin(x).view(2, 64, 3, 4, 64)
    o = flashmoe.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert o.requires_grad and o.grad_fn is not None
    o.float().pow(2).mean().backward()
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()
    assert lin.weight.grad.abs().sum() > 0
    # the same step through SDPA gives nearly the same weight gradient
    g = lin.weight.grad.clone()
    lin.weight.grad = None
    qkv = lin(x).view(2, 64, 3, 4, 64).permute(2, 0, 3, 1, 4)  # (3, b, h, s, d)
    o = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
    o.float().pow(2).mean().backward()
    assert rel_l2(g, lin.weight.grad.double()) < 3e-2


def test_attention_head_dim_without_backward_raises_on_gpu():
    q = torch.randn(1, 16, 2, 256, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="no backward pass for head_dim 256"):
        flashmoe.attention(q, q, q)


def test_attention_forward_backward_in_cuda_graph():
    q = torch.randn(2, 160, 8, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(2, 160, 2, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(2, 160, 2, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    do = torch.randn(2, 160, 8, 64, dtype=torch.bfloat16, device=DEV)
    # deterministic=True so that the replay's bits can be compared (the fast mode's plan is
    # captured the same way: its zeroing of the dq workspace is a kernel of the graph)
    att = functools.partial(flashmoe.attention, causal=True, deterministic=True)
    att(q, k, v).backward(do)
    want = [t.grad.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            att(q, k, v).backward(do)
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        att(q, k, v).backward(do)
    grads = [t.grad for t in (q, k, v)]
    for g in grads:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b_) for a, b_ in zip(want, grads))


# --------------------------------------------------------------------------- autograd (varlen)
# flashmoe.attention_varlen's gradients (the library's deterministic varlen backward) against
# float64 autograd of masked_attention_ref per sequence, under torch.compile and in a CUDA graph.

VARLEN_GRAD_CASES = [
    # dtype, d, hq, hkv, causal, q lengths, k lengths (None: the q lengths), window, softcap
    (torch.bfloat16, 128, 8, 2, True, [1, 7, 130, 61, 257, 3], None, (-1, -1), 0.0),
    (torch.bfloat16, 128, 8, 2, True, [1, 13, 0, 97], [5, 13, 11, 300], (-1, -1), 0.0),  # an empty q
    (torch.bfloat16, 64, 6, 1, False, [2, 31, 1, 200], [0, 31, 17, 389], (-1, -1), 0.0),  # MQA, an empty k
    (torch.float16, 128, 4, 4, True, [127, 1, 129], None, (-1, -1), 0.0),
    (torch.bfloat16, 64, 4, 2, True, [100, 1, 250], [120, 9, 250], (32, -1), 20.0),  # window + softcap
    (torch.float16, 64, 4, 4, False, [65, 130], None, (16, 8), 0.0),  # two-sided window
]


@pytest.mark.parametrize("case", VARLEN_GRAD_CASES)
def test_attention_varlen_grads_match_f64(case):
    dtype, d, hq, hkv, causal, lq, lk, window, softcap = case
    lk = lk or lq
    cu_q, cu_q_t = offsets(lq)
    cu_k, cu_k_t = offsets(lk)
    q = torch.randn(cu_q[-1], hq, d, dtype=dtype, device=DEV, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, d, dtype=dtype, device=DEV, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, d, dtype=dtype, device=DEV, requires_grad=True)
    do = torch.randn(cu_q[-1], hq, d, dtype=dtype, device=DEV)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o = flashmoe.attention_varlen(q, k, v, cu_q_t, cu_k_t, max(lq), max(lk), causal=causal, window_size=window,
                                  softcap=softcap)
    assert o.requires_grad and o.grad_fn is not None
    o.backward(do)
    refs = [torch.zeros(t.shape, dtype=torch.float64, device=DEV) for t in (q, k, v)]
    for b in range(len(lq)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if lq[b] == 0 or lk[b] == 0:
            continue  # no gradient flows: the reference stays 0
        q64, k64, v64 = (t[s].detach().double().requires_grad_() for t, s in ((q, qs), (k, ks), (v, ks)))
        ro, _ = masked_attention_ref(q64, k64, v64, scale, causal, window, softcap)
        gq, gk, gv = torch.autograd.grad(ro, (q64, k64, v64), do[qs].double())
        refs[0][qs], refs[1][ks], refs[2][ks] = gq.nan_to_num(0.0), gk.nan_to_num(0.0), gv.nan_to_num(0.0)
    for name, t, ref in zip("qkv", (q, k, v), refs):
        g = t.grad
        assert g.shape == t.shape and g.dtype == dtype and torch.isfinite(g).all(), name
        err = rel_l2(g, ref)
        print(f"d{name}: rel L2 {err:.2e}")
        assert err <= TOL[dtype][0], f"d{name}: rel L2 {err:.3e}"
    # deterministic: the same gradients, bit for bit
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashmoe.attention_varlen(q, k, v, cu_q_t, cu_k_t, max(lq), max(lk), causal=causal, window_size=window,
                              softcap=softcap).backward(do)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_attention_varlen_backward_equals_dense_on_equal_lengths():
    # equal lengths packed are a dense batch: given the same o and lse, the same kernels give the
    # same bits (the forward kernels differ, so both backward ops get the dense forward's o, lse).
    # Head dim 96: the dense backward runs the portable kernels there on every GPU (at 64/128 an
    # H100 takes its wgmma kernels, which the varlen backward does not have).
    b, s, hq, hkv, d = 3, 150, 8, 2, 96
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=DEV)
    v = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=DEV)
    do = torch.randn(b, s, hq, d, dtype=torch.bfloat16, device=DEV)
    o, lse = flashmoe.attention(q, k, v, causal=True, return_lse=True)
    dense = torch.ops.flashmoe.attention_backward(do, q, k, v, o, lse, True, None)
    _, cu = offsets([s] * b)
    flat = [t.flatten(0, 1) for t in (do, q, k, v, o)]
    lse_packed = lse.permute(1, 0, 2).reshape(hq, b * s)  # (b, hq, s) -> (hq, b * s)
    poison_pool()
    packed = torch.ops.flashmoe.attention_varlen_backward(*flat, lse_packed, cu, cu, s, s, True, None)
    for name, a, p in zip("qkv", dense, packed):
        assert torch.equal(a.flatten(0, 1), p), f"d{name}: varlen differs from dense"


def test_attention_varlen_grads_under_compile_match_eager():
    _, cu = offsets([40, 1, 96])
    q = torch.randn(137, 8, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(137, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(137, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)

    def loss(q, k, v):
        return flashmoe.attention_varlen(q, k, v, cu, cu, 96, 96, causal=True).float().square().sum()

    torch.compile(loss, fullgraph=True)(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    loss(q, k, v).backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_attention_varlen_forward_backward_in_cuda_graph():
    _, cu = offsets([100, 3, 57])
    q = torch.randn(160, 8, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(160, 2, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(160, 2, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    do = torch.randn(160, 8, 64, dtype=torch.bfloat16, device=DEV)

    def step():
        flashmoe.attention_varlen(q, k, v, cu, cu, 100, 100, causal=True).backward(do)

    step()
    want = [t.grad.clone() for t in (q, k, v)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        for _ in range(2):
            for t in (q, k, v):
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in (q, k, v):
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    grads = [t.grad for t in (q, k, v)]
    for g in grads:
        g.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b_) for a, b_ in zip(want, grads))


def test_attention_with_kvcache_still_refuses_grad():
    q = torch.randn(1, 1, 4, 64, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    cache = torch.randn(2, 16, 2, 64, dtype=torch.bfloat16, device=DEV)
    bt, lens = torch.zeros(1, 2, dtype=torch.int32, device=DEV), torch.tensor([8], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="has no backward pass yet, but q requires grad"):
        flashmoe.attention_with_kvcache(q, cache, cache, block_table=bt, cache_seqlens=lens)


# --------------------------------------------------------------------------- MoE backward
# flashmoe.moe is differentiable (flashmoe::moe_train / moe_backward, _moe_autograd.py): gradients
# of <g, out> + 0.7·aux + 0.3·z against float64 autograd through moe_ref (same conventions: top-k
# ids and the token fractions constant), global relative L2 and a per-row bound.


def rel_errors(out, ref):
    out64 = out.double()
    assert torch.isfinite(out64).all()
    rel = (torch.linalg.vector_norm(out64 - ref) / torch.linalg.vector_norm(ref)).item()
    rows_ref = ref.reshape(-1, ref.shape[-1])
    rows_err = (out64 - ref).reshape(-1, ref.shape[-1])
    floor = torch.linalg.vector_norm(rows_ref, dim=-1).pow(2).mean().sqrt() / 4
    row = (torch.linalg.vector_norm(rows_err, dim=-1)
           / torch.linalg.vector_norm(rows_ref, dim=-1).clamp_min(floor)).max().item()
    return rel, row


@pytest.mark.parametrize(
    "tokens, h, i, e, k, scoring, renorm, shared, dtype, recompute",
    [
        (67, 256, 128, 8, 2, "softmax", True, False, torch.bfloat16, False),
        (67, 256, 128, 8, 2, "softmax", True, False, torch.bfloat16, True),
        (37, 256, 128, 8, 3, "sigmoid", False, True, torch.float16, False),
        (50, 128, 64, 4, 4, "softmax", True, False, torch.bfloat16, False),
    ],
)
def test_moe_backward_matches_f64_autograd(tokens, h, i, e, k, scoring, renorm, shared, dtype, recompute):
    wts = moe_weights(h, i, e, dtype, shared)
    x = (torch.rand(tokens, h, device=DEV) * 2 - 1).to(dtype)
    leaves = [x, wts["router_w"], wts["w13"], wts["w2"]] + (list(wts["shared"]) if shared else [])
    leaves = [t.clone().requires_grad_() for t in leaves]
    sh = tuple(leaves[4:]) if shared else None
    g = torch.randn(tokens, h, device=DEV).to(dtype)

    def run():
        poison_pool()
        r = flashmoe.moe(*leaves[:4], top_k=k, scoring=scoring, renormalize=renorm, shared=sh,
                         recompute_gate_up=recompute)
        loss = (r.out.float() * g.float()).sum() + 0.7 * r.aux_loss + 0.3 * r.z_loss
        return r, torch.autograd.grad(loss, leaves)

    r, grads = run()
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out, ids, w, counts, aux, z, gap = moe_ref(*ref_leaves[:4], k, scoring, renorm,
                                               tuple(ref_leaves[4:]) if shared else None)
    assert torch.equal(r.topk_ids.long(), ids), "routing differs from the f64 reference (a near tie)"
    ref_grads = torch.autograd.grad((out * g.double()).sum() + 0.7 * aux + 0.3 * z, ref_leaves)
    names = ["dx", "d_router_w", "dw13", "dw2", "d_shared_w13", "d_shared_w2"]
    rl = TOL[dtype][0]
    for name, got, ref in zip(names, grads, ref_grads):
        assert got.dtype == dtype and got.shape == ref.shape
        rel, row = rel_errors(got, ref)
        print(f"{name}: rel L2 {rel:.2e} worst row {row:.2e}")
        assert rel <= rl and row <= 4 * rl, f"{name}: rel L2 {rel:.3e} worst row {row:.3e}"
    # deterministic: a second forward + backward gives bit-identical gradients
    _, again = run()
    for name, a, b in zip(names, grads, again):
        assert torch.equal(a, b), f"{name} differs between two runs"


def moe_ref_given_ids(x, router_w, w13, w2, ids):
    """float64 softmax-renormalised MoE layer on given top-k ids, one expert at a time (a
    gather of every token's expert weights, as moe_ref does, would take tens of GB at
    Qwen3-30B-A3B's shape)."""
    x64 = x.double()
    w = torch.softmax(x64 @ router_w.double(), -1).gather(1, ids)
    w = w / w.sum(-1, keepdim=True)
    i = w2.shape[1]
    out = torch.zeros_like(x64)
    for e in range(w13.shape[0]):
        t, slot = (ids == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        g = x64[t] @ w13[e].double()
        y = (torch.nn.functional.silu(g[:, :i]) * g[:, i:]) @ w2[e].double()
        out = out.index_add(0, t, w[t, slot, None] * y)
    return out


# Qwen3-30B-A3B's layer at the e2e training batch (4 x 512 tokens: the sm90 GEMM path), with
# the regimes a trained model reaches: routing skewed by a per-expert bias (experts with no
# rows, experts with over a thousand) and a gradient carried by a few tokens (a model that
# predicts most tokens well). The reference takes flashmoe's top-k ids, so near ties in the
# router do not enter; per-expert errors are printed for a failure's diagnosis.
@pytest.mark.parametrize("skew, heavy_tail, recompute", [
    (0.0, False, False), (3.0, False, False), (3.0, True, False), (3.0, True, True)])
def test_moe_backward_qwen3_shape_matches_f64(skew, heavy_tail, recompute):
    t_count, h, i, e, k = 2048, 2048, 768, 128, 8
    wts = moe_weights(h, i, e, torch.bfloat16, False)
    x = torch.rand(t_count, h, device=DEV) * 2 - 1
    x[:, 0] = 1.0  # a constant feature: router_w's row 0 is a per-expert bias
    router = wts["router_w"].float()
    router[0] = skew * torch.linspace(-1, 1, e, device=DEV)[torch.randperm(e, device=DEV)]
    leaves = [t.clone().requires_grad_() for t in
              (x.bfloat16(), router.bfloat16(), wts["w13"], wts["w2"])]
    g = torch.randn(t_count, h, device=DEV)
    if heavy_tail:
        g[torch.randperm(t_count, device=DEV)[:16]] *= 50.0
    g = g.bfloat16()
    poison_pool()
    r = flashmoe.moe(*leaves, top_k=k, recompute_gate_up=recompute)
    grads = torch.autograd.grad((r.out.float() * g.float()).sum(), leaves)
    ids = r.topk_ids.long()
    counts = torch.bincount(ids.flatten(), minlength=e)
    print(f"rows per expert: min {counts.min().item()} max {counts.max().item()} "
          f"empty {(counts == 0).sum().item()}")
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out = moe_ref_given_ids(*ref_leaves, ids)
    ref_grads = torch.autograd.grad((out * g.double()).sum(), ref_leaves)
    rl = TOL[torch.bfloat16][0]
    failures = []
    for name, got, ref in zip(["dx", "d_router_w", "dw13", "dw2"], grads, ref_grads):
        rel, row = rel_errors(got, ref)
        line = f"{name}: rel L2 {rel:.2e} worst row {row:.2e}"
        if name in ("dw13", "dw2"):
            err = torch.linalg.vector_norm((got.double() - ref).flatten(1), dim=1)
            per = err / torch.linalg.vector_norm(ref.flatten(1), dim=1).clamp_min(1e-30)
            worst = int(per.argmax())
            line += f"; worst expert {worst} ({counts[worst].item()} rows) rel {per[worst].item():.2e}"
        print(line)
        if not (rel <= rl and row <= 4 * rl):
            failures.append(line)
    assert not failures, failures


def test_moe_backward_under_compile_matches_eager():
    wts = moe_weights(256, 128, 8, torch.bfloat16, True)
    x = (torch.rand(40, 256, device=DEV) * 2 - 1).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, wts["router_w"], wts["w13"], wts["w2"], *wts["shared"])]

    g = torch.randn(40, 256, device=DEV).to(torch.bfloat16)

    def step(x, rw, w13, w2, s13, s2):
        # d(out) = g exactly in both modes, so the gradients must agree bit for bit
        r = flashmoe.moe(x, rw, w13, w2, top_k=2, shared=(s13, s2))
        return (r.out.float() * g.float()).sum() + r.aux_loss + r.z_loss

    eager = torch.autograd.grad(step(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(*leaves), leaves)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


# --------------------------------------------------------------------------- FlashAttention conventions
# flashmoe.flash_attn_interface: FA2's call conventions over the ops above give the ops' results
# (bit for bit), SDPA's within tolerance, and the ops' gradients.

import flashmoe.flash_attn_interface as flash_attn_interface  # noqa: E402


def test_flash_attn_func_is_attention():
    q = torch.randn(2, 200, 8, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(2, 260, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(2, 260, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    do = torch.randn(2, 200, 8, 128, dtype=torch.bfloat16, device=DEV)
    # FA2's positional order: q, k, v, dropout_p, softmax_scale, causal, window_size, softcap
    o = flash_attn_interface.flash_attn_func(q, k, v, 0.0, None, True)
    want = flashmoe.attention(q, k, v, causal=True)
    assert torch.equal(o, want)
    o.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want.backward(do)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
    # against SDPA (fp32), causal bottom-right = top-left here only when Sq == Sk: use Sq == Sk
    qs, ks, vs = (t.detach()[:, :200] for t in (q, k, v))
    o = flash_attn_interface.flash_attn_func(qs, ks, vs, causal=True, deterministic=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qs.float().transpose(1, 2), ks.float().repeat_interleave(4, 2).transpose(1, 2),
        vs.float().repeat_interleave(4, 2).transpose(1, 2), is_causal=True).transpose(1, 2)
    gate(o, ref.double(), torch.bfloat16, "flash_attn_func vs SDPA")


def test_flash_attn_func_window_and_softcap_are_attention():
    q = torch.randn(1, 256, 4, 64, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(1, 256, 2, 64, dtype=torch.bfloat16, device=DEV)
    o = flash_attn_interface.flash_attn_func(q, k, k, 0.0, 0.1, True, (64, -1), 20.0)
    assert torch.equal(o, flashmoe.attention(q, k, k, causal=True, softmax_scale=0.1, window_size=(64, -1),
                                             softcap=20.0))


def test_flash_attn_varlen_func_is_attention_varlen():
    lens = [1, 77, 130]
    cu, cu_t = offsets(lens)
    q = torch.randn(cu[-1], 8, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(cu[-1], 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(cu[-1], 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    o = flash_attn_interface.flash_attn_varlen_func(q, k, v, cu_t, cu_t, max(lens), max(lens), 0.0, None, True)
    want = flashmoe.attention_varlen(q, k, v, cu_t, cu_t, max(lens), max(lens), causal=True)
    assert torch.equal(o, want)
    do = torch.randn_like(o)
    o.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want.backward(do)
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))


def test_flash_attn_with_kvcache_contiguous_cache():
    b, s_cache, hq, hkv, d = 3, 300, 8, 2, 128
    k_cache = torch.randn(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.randn(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device=DEV)
    lens = [17, 300, 120]
    seqlens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    o, lse = flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                          return_softmax_lse=True)
    assert o.shape == q.shape and lse.shape == (b, hq, 1)
    scale = 1.0 / math.sqrt(d)
    for i, n in enumerate(lens):
        ro, rlse = masked_attention_ref(q[i], k_cache[i, :n], v_cache[i, :n], scale)
        gate(o[i], ro, torch.bfloat16, f"kvcache sequence {i}")
        check_lse(lse[i], rlse, f"kvcache sequence {i} lse")
    # an int cache_seqlens, and cache_batch_idx choosing the cache rows (reversed)
    idx = torch.tensor([2, 1, 0], dtype=torch.int32, device=DEV)
    o = flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=100, cache_batch_idx=idx)
    for i in range(b):
        ro, _ = masked_attention_ref(q[i], k_cache[2 - i, :100], v_cache[2 - i, :100], scale)
        gate(o[i], ro, torch.bfloat16, f"kvcache row {2 - i}")


def test_flash_attn_with_kvcache_appends_in_place():
    b, s_cache, hkv, d = 2, 64, 2, 64
    k_cache = torch.zeros(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.zeros(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    k_cache[:, :10] = torch.randn(b, 10, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_cache[:, :10] = torch.randn(b, 10, hkv, d, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(b, 2, 4, d, dtype=torch.bfloat16, device=DEV)
    k_new = torch.randn(b, 2, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_new = torch.randn(b, 2, hkv, d, dtype=torch.bfloat16, device=DEV)
    o = flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=10,
                                                     causal=True)
    assert torch.equal(k_cache[:, 10:12], k_new) and torch.equal(v_cache[:, 10:12], v_new)
    scale = 1.0 / math.sqrt(d)
    for i in range(b):
        ro, _ = masked_attention_ref(q[i], k_cache[i, :12], v_cache[i, :12], scale, causal=True)
        gate(o[i], ro, torch.bfloat16, f"appended sequence {i}")


@pytest.mark.parametrize("interleaved, causal", [(True, True), (False, False)])
def test_flash_attn_with_kvcache_rotary_matches_f64(interleaved, causal):
    # FA2's in-call rotary embedding: the new keys (written rotated into the cache) at positions
    # cache_seqlens + i, q there too when causal, else at cache_seqlens; against a float64
    # rotation (complex multiplication) and attention over the rotated cache
    b, s_cache, hq, hkv, d, r, sq = 2, 64, 4, 2, 128, 64, 2
    k_cache = torch.randn(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_cache = torch.randn(b, s_cache, hkv, d, dtype=torch.bfloat16, device=DEV)
    q = torch.randn(b, sq, hq, d, dtype=torch.bfloat16, device=DEV)
    k_new = torch.randn(b, sq, hkv, d, dtype=torch.bfloat16, device=DEV)
    v_new = torch.randn(b, sq, hkv, d, dtype=torch.bfloat16, device=DEV)
    angle = torch.rand(s_cache, r // 2, device=DEV) * 6.28
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    lens = torch.tensor([5, 40], dtype=torch.int32, device=DEV)
    o = flash_attn_interface.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cos, sin, lens,
                                                     causal=causal, rotary_interleaved=interleaved)

    def rotate(x, positions):
        x = x.double()
        head, tail = x[..., :r], x[..., r:]
        re, im = (head[..., 0::2], head[..., 1::2]) if interleaved else (head[..., : r // 2], head[..., r // 2:])
        z = torch.complex(re, im) * torch.complex(cos.double()[positions], sin.double()[positions]).unsqueeze(2)
        out = torch.stack((z.real, z.imag), -1).flatten(-2) if interleaved else torch.cat((z.real, z.imag), -1)
        return torch.cat((out, tail), -1)

    at = lens.long().view(b, 1) + torch.arange(sq, device=DEV).view(1, sq)
    k_rot = rotate(k_new, at)
    q_rot = rotate(q, at if causal else lens.long().view(b, 1).expand(b, sq))
    scale = 1.0 / math.sqrt(d)
    for i in range(b):
        n = int(lens[i]) + sq
        written = k_cache[i, int(lens[i]):n].double()
        assert (written - k_rot[i]).abs().max().item() <= 0.02, f"rotated keys of sequence {i}"
        keys = torch.cat((k_cache[i, : int(lens[i])].double(), k_rot[i]))
        ro, _ = masked_attention_ref(q_rot[i], keys, v_cache[i, :n].double(), scale, causal=causal)
        gate(o[i], ro, torch.bfloat16, f"rotary sequence {i}")


def test_flash_attn_interface_refuses_dropout_on_gpu():
    q = torch.randn(1, 16, 2, 64, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="no attention dropout"):
        flash_attn_interface.flash_attn_func(q, q, q, 0.1)


def test_flash_attn_packed_forms_are_the_functions_on_views():
    # qkv (b, s, 3, h, d): views on the sm_90a kernel (D 128), gradients flow back into qkv
    qkv = torch.randn(2, 150, 3, 4, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    do = torch.randn(2, 150, 4, 128, dtype=torch.bfloat16, device=DEV)
    o = flash_attn_interface.flash_attn_qkvpacked_func(qkv, 0.0, None, True)
    o.backward(do)
    q, k, v = (t.detach().contiguous().requires_grad_() for t in qkv.unbind(2))
    want = flashmoe.attention(q, k, v, causal=True)
    want.backward(do)
    assert torch.equal(o, want)
    assert torch.equal(qkv.grad, torch.stack([q.grad, k.grad, v.grad], dim=2))
    # varlen qkv (total, 3, h, d) and kv (total, 2, h, d)
    lens = [33, 1, 100]
    cu, cu_t = offsets(lens)
    qkv = torch.randn(cu[-1], 3, 4, 64, dtype=torch.bfloat16, device=DEV)
    o = flash_attn_interface.flash_attn_varlen_qkvpacked_func(qkv, cu_t, max(lens), causal=True)
    want = flashmoe.attention_varlen(qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2].contiguous(), cu_t,
                                     cu_t, max(lens), max(lens), causal=True)
    assert torch.equal(o, want)
    o = flash_attn_interface.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu_t, cu_t, max(lens), max(lens))
    want = flashmoe.attention_varlen(qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2].contiguous(), cu_t,
                                     cu_t, max(lens), max(lens))
    assert torch.equal(o, want)


def test_flash_attn_func_compiles_fullgraph():
    q = torch.randn(2, 96, 8, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(2, 96, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    fn = torch.compile(lambda q, k: flash_attn_interface.flash_attn_func(q, k, k, 0.0, None, True).float().sum(),
                       fullgraph=True)
    fn(q, k).backward()
    grads = [q.grad.clone(), k.grad.clone()]
    q.grad = k.grad = None
    flashmoe.attention(q, k, k, causal=True).float().sum().backward()
    assert torch.equal(grads[0], q.grad) and torch.equal(grads[1], k.grad)


# --------------------------------------------------------------------------- ALiBi


def alibi_ref(q, k, v, scale, slopes, causal=False, window=(-1, -1), softcap=0.0):
    """masked_attention_ref of one sequence with FlashAttention's ALiBi: the score of query i
    (position p_i = sk - sq + i) and key j gets -slope[h] * |p_i - j| after the softcap."""
    hq, hkv = q.shape[1], k.shape[1]
    q64 = q.double()
    k64 = k.double().repeat_interleave(hq // hkv, dim=1)
    v64 = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q64, k64) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[0], k.shape[0]
    pos = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    s = s - slopes.double()[:, None, None] * (pos - j).abs()[None]
    left, right = window[0], 0 if causal else window[1]
    masked = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        masked |= j > pos + right
    if left >= 0:
        masked |= j < pos - left
    s = s.masked_fill(masked, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v64), lse


def fa_slopes(b, hq, per_batch):
    """FlashAttention-style slopes 2^(-8(h+1)/hq), scaled per sequence when per_batch."""
    base = torch.tensor([2.0 ** (-8.0 * (h + 1) / hq) for h in range(hq)], dtype=torch.float32)
    if not per_batch:
        return base.to(DEV)
    return torch.stack([base * (1.0 + 0.5 * i) for i in range(b)]).to(DEV)


ALIBI_CASES = [
    # dtype, d, hq, hkv, b, sq, sk, causal, window, softcap, per_batch
    (torch.bfloat16, 128, 8, 2, 2, 200, 300, True, (-1, -1), 0.0, False),  # prefill, portable kernel
    (torch.bfloat16, 128, 8, 2, 2, 1, 2000, True, (-1, -1), 0.0, True),  # decode-shaped: decode kernel
    (torch.float16, 64, 4, 4, 3, 4, 500, True, (64, -1), 0.0, False),  # decode-shaped window
    (torch.bfloat16, 96, 6, 2, 2, 3, 700, True, (-1, -1), 0.0, True),  # decode-shaped, portable head dim
    (torch.bfloat16, 256, 4, 1, 1, 100, 260, False, (-1, -1), 30.0, False),  # Gemma-like dims, softcap
    (torch.bfloat16, 64, 8, 8, 2, 333, 333, False, (40, 7), 0.0, True),  # sliding window, prefill
]


@pytest.mark.parametrize("case", ALIBI_CASES)
def test_attention_alibi_matches_f64(case):
    dtype, d, hq, hkv, b, sq, sk, causal, window, softcap, per_batch = case
    q = torch.randn(b, sq, hq, d, dtype=dtype, device=DEV)
    k = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(b, sk, hkv, d, dtype=dtype, device=DEV)
    if softcap:
        q = q * 4
    slopes = fa_slopes(b, hq, per_batch)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                alibi_slopes=slopes, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == q.shape and lse.shape == (b, hq, sq)
    for i in range(b):
        sl = slopes[i] if per_batch else slopes
        ro, rlse = alibi_ref(q[i], k[i], v[i], scale, sl, causal, window, softcap)
        check_lse(lse[i], rlse, f"sequence {i} lse")
        gate(o[i], ro, dtype, f"sequence {i}")
    # The slopes matter here: the plain result differs.
    plain = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert not torch.equal(plain, o)
    # o without lse (the lse sink path) is the same bits.
    o2 = flashmoe.attention(q, k, v, causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    assert torch.equal(o, o2)


def test_attention_alibi_under_compile_matches_eager():
    q = torch.randn(2, 64, 8, 128, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(2, 96, 2, 128, dtype=torch.bfloat16, device=DEV)
    slopes = fa_slopes(2, 8, False)
    f = lambda q, k, v, s: flashmoe.attention(q, k, v, causal=True, alibi_slopes=s)  # noqa: E731
    eager = f(q, k, k, slopes)
    compiled = torch.compile(f, fullgraph=True)(q, k, k, slopes)
    assert torch.equal(eager, compiled)


def test_attention_alibi_errors():
    q = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16, device=DEV)
    k = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16, device=DEV)
    slopes = fa_slopes(1, 4, False)
    with pytest.raises(RuntimeError, match="alibi_slopes.*no backward pass"):
        flashmoe.attention(q.clone().requires_grad_(), k, k, alibi_slopes=slopes)
    with pytest.raises(TypeError, match="alibi_slopes has dtype"):
        flashmoe.attention(q, k, k, alibi_slopes=slopes.to(torch.bfloat16))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashmoe.attention(q, k, k, alibi_slopes=fa_slopes(1, 3, False))
    with pytest.raises(ValueError, match="alibi_slopes"):
        flashmoe.attention(q, k, k, alibi_slopes=fa_slopes(3, 4, True))
    with torch.no_grad():  # inference on tensors that require grad is fine
        flashmoe.attention(q.clone().requires_grad_(), k, k, alibi_slopes=slopes)


KVCACHE_ALIBI_CASES = [
    # dtype, d, hq, hkv, page, cache lengths, q rows, causal, window, softcap, per_batch
    (torch.bfloat16, 128, 8, 2, 16, [1, 17, 1300, 61], 1, True, (-1, -1), 0.0, True),
    (torch.float16, 64, 4, 4, 32, [29, 2, 531], 4, True, (50, -1), 0.0, False),
    (torch.bfloat16, 256, 16, 2, 16, [7, 4099], 2, True, (-1, -1), 50.0, True),  # KV splits
]


@pytest.mark.parametrize("case", KVCACHE_ALIBI_CASES)
def test_attention_with_kvcache_alibi_matches_f64(case):
    dtype, d, hq, hkv, page, lengths, rows, causal, window, softcap, per_batch = case
    b = len(lengths)
    k_cache, v_cache, table, keys, values = paged_cache(lengths, hkv, d, page, dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    q = torch.randn(b, rows, hq, d, dtype=dtype, device=DEV)
    slopes = fa_slopes(b, hq, per_batch)
    scale = 1.0 / math.sqrt(d)
    poison_pool()
    o, lse = flashmoe.attention_with_kvcache(
        q, k_cache, v_cache, block_table=table, cache_seqlens=seqlens, causal=causal, window_size=window,
        softcap=softcap, alibi_slopes=slopes, return_lse=True)
    torch.cuda.synchronize()
    for i in range(b):
        sl = slopes[i] if per_batch else slopes
        ro, rlse = alibi_ref(q[i], keys[i], values[i], scale, sl, causal, window, softcap)
        check_lse(lse[i], rlse, f"sequence {i} lse")
        gate(o[i], ro, dtype, f"sequence {i} ({lengths[i]} keys)")
    with pytest.raises(RuntimeError, match="no backward pass"):
        flashmoe.attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, block_table=table,
                                        cache_seqlens=seqlens, alibi_slopes=slopes)


# --------------------------------------------------------------------------- value head dim
# v with a head dim of its own (D_v ≠ D_qk; DeepSeek MLA prefill 192 / 128): the calls run on the
# kernels of one head dim max(D_qk, D_v) on zero-padded copies (flashmoe/_value_dim.py); against the
# unpadded float64 reference, bit-identical to the padded call made by hand, gradients, compile and
# graphs. (CPU tests of the composition itself: test_value_dim.py.)

import torch.nn.functional as F  # noqa: E402


def f32_scale(d):
    """1/sqrt(d) as the plans compute it (f32)."""
    return (torch.tensor(1.0) / torch.tensor(float(d)).sqrt()).item()


VALUE_DIM_CASES = [
    # dtype, b, sq, sk, hq, hkv, d_qk, d_v, causal
    (torch.bfloat16, 2, 200, 200, 8, 2, 192, 128, True),  # MLA prefill (portable kernel at 192)
    (torch.float16, 1, 77, 300, 4, 4, 192, 128, False),
    (torch.bfloat16, 2, 130, 130, 4, 1, 64, 32, True),  # sm_90a at 64, MQA
    (torch.bfloat16, 2, 150, 99, 4, 2, 96, 128, True),  # q, k padded: sm_90a at 128, Sq > Sk
    (torch.float16, 1, 64, 64, 8, 8, 32, 64, False),
    # head dims that are not multiples of 8 (FlashAttention-2 serves them by padding): all padded
    (torch.bfloat16, 2, 150, 150, 4, 2, 59, 59, True),  # -> 64
    (torch.float16, 1, 90, 130, 4, 4, 111, 111, False),  # -> 112 (portable kernel)
    (torch.bfloat16, 1, 70, 70, 2, 1, 20, 36, True),  # -> 40
]


@pytest.mark.parametrize("case", VALUE_DIM_CASES)
def test_attention_value_head_dim_matches_f64(case):
    dtype, b, sq, sk, hq, hkv, dqk, dv, causal = case
    q = torch.randn(b, sq, hq, dqk, dtype=dtype, device=DEV)
    k = torch.randn(b, sk, hkv, dqk, dtype=dtype, device=DEV)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype, device=DEV)
    poison_pool()
    o, lse = flashmoe.attention(q, k, v, causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == (b, sq, hq, dv) and o.is_contiguous() and lse.shape == (b, hq, sq)
    ro, rlse = windowed_ref(q, k, v, 1.0 / math.sqrt(dqk), causal, (-1, -1), 0.0)
    gate(o, ro, dtype, f"o ({dqk}/{dv})")
    check_lse(lse, rlse, "lse")
    # exactly the padded call made by hand: max(D_qk, D_v) rounded up to a multiple of 8
    pad = -(-max(dqk, dv) // 8) * 8
    want = flashmoe.attention(F.pad(q, (0, pad - dqk)), F.pad(k, (0, pad - dqk)), F.pad(v, (0, pad - dv)),
                              causal=causal, softmax_scale=None if pad == dqk else f32_scale(dqk))[..., :dv]
    assert torch.equal(o, want)


def test_attention_value_head_dim_strided_views_and_interface():
    # an MLA-style packed projection: q, k views at 192 (the portable kernel takes the views), v its own
    b, s, h, dqk, dv = 2, 129, 4, 192, 128
    qk = torch.randn(b, s, 2 * h, dqk, dtype=torch.bfloat16, device=DEV)
    q, k = qk.split([h, h], dim=2)
    v = torch.randn(b, s, h, dv, dtype=torch.bfloat16, device=DEV)
    o = flashmoe.attention(q, k, v, causal=True, softmax_scale=0.07)
    assert torch.equal(o, flashmoe.attention(q.contiguous(), k.contiguous(), v, causal=True, softmax_scale=0.07))
    gate(o, windowed_ref(q, k, v, 0.07, True, (-1, -1), 0.0)[0], torch.bfloat16, "strided 192/128")
    assert torch.equal(flash_attn_interface.flash_attn_func(q, k, v, 0.0, 0.07, True), o)


VALUE_DIM_GRAD_CASES = [
    # dtype, b, sq, sk, hq, hkv, d_qk, d_v, causal
    (torch.bfloat16, 2, 200, 200, 8, 2, 64, 32, True),
    (torch.float16, 2, 77, 130, 4, 4, 96, 128, True),
    (torch.bfloat16, 1, 120, 120, 4, 1, 128, 64, False),
    # head dims without a backward kernel, padded to the next one that has one
    (torch.bfloat16, 2, 100, 100, 4, 2, 40, 40, True),  # -> 64
    (torch.float16, 1, 77, 77, 4, 4, 111, 111, False),  # -> 128
    (torch.bfloat16, 1, 64, 90, 4, 1, 80, 80, True),  # -> 96
]


@pytest.mark.parametrize("case", VALUE_DIM_GRAD_CASES)
def test_attention_value_head_dim_grads_match_f64(case):
    dtype, b, sq, sk, hq, hkv, dqk, dv, causal = case
    q = torch.randn(b, sq, hq, dqk, dtype=dtype, device=DEV, requires_grad=True)
    k = torch.randn(b, sk, hkv, dqk, dtype=dtype, device=DEV, requires_grad=True)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype, device=DEV, requires_grad=True)
    do = torch.randn(b, sq, hq, dv, dtype=dtype, device=DEV)
    poison_pool()
    o = flashmoe.attention(q, k, v, causal=causal)
    o.backward(do)
    refs = grad_ref(q, k, v, do, 1.0 / math.sqrt(dqk), causal, (-1, -1), 0.0)
    for name, t, ref in zip("qkv", (q, k, v), refs):
        g = t.grad
        assert g.shape == t.shape and g.dtype == dtype and torch.isfinite(g).all(), name
        err = rel_l2(g, ref)
        print(f"d{name} ({dqk}/{dv}): rel L2 {err:.2e}")
        assert err <= TOL[dtype][0], f"d{name}: rel L2 {err:.3e}"


def test_attention_value_head_dim_without_backward_raises():
    # MLA's 192: the forward runs (portable kernel), the backward plan has no head dim 192
    q = torch.randn(1, 16, 2, 192, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(1, 16, 2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(RuntimeError, match="no backward pass for head_dim 192"):
        flashmoe.attention(q, q, v)
    with torch.no_grad():
        assert flashmoe.attention(q, q, v).shape == (1, 16, 2, 128)


VARLEN_VALUE_DIM_CASES = [
    # dtype, d_qk, d_v, hq, hkv, causal, q lengths, k lengths
    (torch.bfloat16, 64, 32, 8, 2, True, [1, 7, 130, 61], None),
    (torch.float16, 96, 128, 4, 1, True, [3, 1, 97], [5, 13, 200]),
    (torch.bfloat16, 128, 64, 4, 4, False, [33, 100], None),
    # head dims other than the varlen kernels' 64 / 128, padded to the next (FA2's varlen calls)
    (torch.bfloat16, 96, 96, 4, 2, True, [5, 1, 140], None),  # -> 128
    (torch.float16, 40, 40, 4, 4, False, [17, 64], [30, 64]),  # -> 64
    (torch.bfloat16, 59, 59, 8, 1, True, [1, 77], None),  # -> 64
]


@pytest.mark.parametrize("case", VARLEN_VALUE_DIM_CASES)
def test_attention_varlen_value_head_dim_matches_f64(case):
    dtype, dqk, dv, hq, hkv, causal, lq, lk = case
    lk = lk or lq
    cu_q, cu_q_t = offsets(lq)
    cu_k, cu_k_t = offsets(lk)
    q = torch.randn(cu_q[-1], hq, dqk, dtype=dtype, device=DEV, requires_grad=True)
    k = torch.randn(cu_k[-1], hkv, dqk, dtype=dtype, device=DEV, requires_grad=True)
    v = torch.randn(cu_k[-1], hkv, dv, dtype=dtype, device=DEV, requires_grad=True)
    do = torch.randn(cu_q[-1], hq, dv, dtype=dtype, device=DEV)
    poison_pool()
    o, lse = flashmoe.attention_varlen(q, k, v, cu_q_t, cu_k_t, max(lq), max(lk), causal=causal, return_lse=True)
    torch.cuda.synchronize()
    assert o.shape == (cu_q[-1], hq, dv) and lse.shape == (hq, cu_q[-1])
    scale = 1.0 / math.sqrt(dqk)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for b in range(len(lq)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ro, rlse = masked_attention_ref(q64[qs], k64[ks], v64[ks], scale, causal)
        check_lse(lse[:, qs], rlse.detach(), f"sequence {b} lse")
        gate(o[qs].detach(), ro.detach(), dtype, f"sequence {b} ({dqk}/{dv})")
        outs.append(ro)
    o.backward(do)
    refs = torch.autograd.grad(torch.cat(outs), (q64, k64, v64), do.double())
    for name, t, ref in zip("qkv", (q, k, v), refs):
        err = rel_l2(t.grad, ref)
        assert torch.isfinite(t.grad).all() and err <= TOL[dtype][0], f"d{name}: rel L2 {err:.3e}"


def test_attention_varlen_mla_head_dims_say_what_is_missing():
    # padded to 192, which the sm_90a varlen kernel (64/128) does not serve
    cu = torch.tensor([0, 16], dtype=torch.int32, device=DEV)
    q = torch.randn(16, 2, 192, dtype=torch.bfloat16, device=DEV)
    v = torch.randn(16, 2, 128, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(NotImplementedError, match="head dim 192"):
        flashmoe.attention_varlen(q, q, v, cu, cu, 16, 16)


def test_attention_value_head_dim_compile_and_graph():
    q = torch.randn(2, 96, 8, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    k = torch.randn(2, 96, 2, 96, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    v = torch.randn(2, 96, 2, 128, dtype=torch.bfloat16, device=DEV, requires_grad=True)
    fn = torch.compile(lambda q, k, v: flashmoe.attention(q, k, v, causal=True, deterministic=True)
                       .float().square().sum(), fullgraph=True)
    fn(q, k, v).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    flashmoe.attention(q, k, v, causal=True, deterministic=True).float().square().sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))
    # inference in a CUDA graph (192/128: the pad and the cut are captured with the kernel)
    q2 = torch.randn(1, 64, 4, 192, dtype=torch.bfloat16, device=DEV)
    v2 = torch.randn(1, 64, 4, 128, dtype=torch.bfloat16, device=DEV)
    with torch.no_grad():
        want = flashmoe.attention(q2, q2, v2, causal=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flashmoe.attention(q2, q2, v2, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flashmoe.attention(q2, q2, v2, causal=True)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, want)


def test_attention_value_head_dim_with_masks_and_alibi():
    # window + softcap (64/32 on the sm_90a kernel) and ALiBi (192/128 on the portable kernel)
    dtype = torch.bfloat16
    q = torch.randn(2, 256, 4, 64, dtype=dtype, device=DEV)
    k = torch.randn(2, 256, 2, 64, dtype=dtype, device=DEV)
    v = torch.randn(2, 256, 2, 32, dtype=dtype, device=DEV)
    o = flashmoe.attention(q, k, v, causal=True, window_size=(64, -1), softcap=20.0)
    gate(o, windowed_ref(q, k, v, 1.0 / math.sqrt(64), True, (64, -1), 20.0)[0], dtype, "64/32 window softcap")
    q = torch.randn(2, 100, 4, 192, dtype=dtype, device=DEV)
    k = torch.randn(2, 130, 2, 192, dtype=dtype, device=DEV)
    v = torch.randn(2, 130, 2, 128, dtype=dtype, device=DEV)
    slopes = fa_slopes(2, 4, False)
    o = flashmoe.attention(q, k, v, causal=True, alibi_slopes=slopes)
    assert o.shape == (2, 100, 4, 128)
    scale = 1.0 / math.sqrt(192)
    for i in range(2):
        gate(o[i], alibi_ref(q[i], k[i], v[i], scale, slopes, True)[0], dtype, f"192/128 ALiBi {i}")
