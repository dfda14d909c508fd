"""flashmoe.mla_decode (DeepSeek MLA paged decode) on a GPU: against a float64 reference over a
shuffled paged cache, under torch.compile and in a CUDA graph, and its errors (requires grad,
shapes, dtypes). Skipped without torch or a CUDA device.
"""

import math
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import flashmoe  # noqa: E402

DEV = torch.device("cuda", 0)
TOL = {torch.bfloat16: (1.6e-2, 0.1), torch.float16: (4e-3, 0.02)}  # (rel_l2, max_abs)
SCALE = 1.2 / math.sqrt(192)


@pytest.fixture(autouse=True)
def fresh_seed():
    seed = random.SystemRandom().randrange(1 << 31)
    torch.manual_seed(seed)
    print(f"seed {seed}")
    return seed


def paged(lengths, page, dtype):
    """A cache of NaN with each sequence's rows on shuffled pages; returns (cache, table, rows)."""
    pages = [max(1, -(-n // page)) for n in lengths]
    nb = sum(pages) + 2
    perm = torch.randperm(nb).tolist()
    cache = torch.full((nb, page, 576), float("nan"), dtype=dtype, device=DEV)
    table = torch.full((len(lengths), max(pages) + 1), -1, dtype=torch.int32)
    rows, nxt = [], 0
    for i, n in enumerate(lengths):
        r = torch.rand(n, 576, device=DEV).mul(2).sub(1).to(dtype)
        for j in range(pages[i]):
            blk = perm[nxt]
            nxt += 1
            table[i, j] = blk
            chunk = r[j * page:(j + 1) * page]
            cache[blk, :chunk.shape[0]] = chunk
        rows.append(r)
    return cache, table.to(DEV), rows


def reference(q, rows, lengths):
    """float64 MLA: causal bottom-right, value = the first 512 columns."""
    b, sq, hq, _ = q.shape
    o = torch.zeros(b, sq, hq, 512, dtype=torch.float64, device=DEV)
    lse = torch.full((b, sq, hq), float("-inf"), dtype=torch.float64, device=DEV)
    for i, n in enumerate(lengths):
        k = rows[i].double()
        for t in range(sq):
            hi = max(0, min(n, n - sq + t + 1))
            if hi == 0:
                continue
            s = SCALE * q[i, t].double() @ k[:hi].T  # (hq, hi)
            lse[i, t] = torch.logsumexp(s, -1)
            o[i, t] = torch.softmax(s, -1) @ k[:hi, :512]
    return o, lse


def gate(got, want, dtype, what):
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    rel_l2, max_abs = TOL[dtype]
    err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
    assert err <= rel_l2, f"{what}: rel L2 {err:.3e}"
    assert (got.double() - want).abs().max() <= max_abs, f"{what}: max abs"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,sq", [(128, 1), (16, 4), (128, 2)])
def test_mla_decode_matches_f64(dtype, hq, sq):
    lengths = [1, 63, 65, 700] if hq == 16 else [64, 300]
    cache, table, rows = paged(lengths, 64, dtype)
    q = torch.rand(len(lengths), sq, hq, 576, device=DEV).mul(2).sub(1).to(dtype)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        o, lse = flashmoe.mla_decode(q, cache, block_table=table, cache_seqlens=seqlens, softmax_scale=SCALE,
                                     return_lse=True)
    want_o, want_lse = reference(q, rows, lengths)
    assert o.shape == (len(lengths), sq, hq, 512) and lse.shape == (len(lengths), sq, hq)
    gate(o, want_o, dtype, "o")
    fin = torch.isfinite(want_lse)
    assert torch.equal(fin, torch.isfinite(lse)), "rows with no key must have lse = -inf"
    assert (lse[fin].double() - want_lse[fin]).abs().max() <= 1e-2
    # The op path (torch.compile) and a CUDA graph give the eager bits.
    f = torch.compile(lambda *a: flashmoe.mla_decode(*a[:2], block_table=a[2], cache_seqlens=a[3],
                                                     softmax_scale=SCALE), fullgraph=True)
    assert torch.equal(f(q, cache, table, seqlens), o)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        flashmoe.mla_decode(q, cache, block_table=table, cache_seqlens=seqlens, softmax_scale=SCALE)
        with torch.cuda.graph(g):
            og = flashmoe.mla_decode(q, cache, block_table=table, cache_seqlens=seqlens, softmax_scale=SCALE)
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(og, o)


def test_mla_decode_errors():
    cache, table, _ = paged([5, 9], 64, torch.bfloat16)
    seqlens = torch.tensor([5, 9], dtype=torch.int32, device=DEV)
    q = torch.randn(2, 1, 16, 576, dtype=torch.bfloat16, device=DEV)
    kw = dict(block_table=table, cache_seqlens=seqlens, softmax_scale=SCALE)
    with pytest.raises(RuntimeError, match="has no backward pass yet, but q requires grad"):
        flashmoe.mla_decode(q.clone().requires_grad_(), cache, **kw)
    with pytest.raises(RuntimeError, match="requires grad"):
        torch.ops.flashmoe.mla_decode(q.clone().requires_grad_(), cache, table, seqlens, SCALE)
    with pytest.raises(ValueError, match="q must be"):
        flashmoe.mla_decode(q[..., :512], cache, **kw)
    with pytest.raises(TypeError, match="block_table has dtype torch.int64"):
        flashmoe.mla_decode(q, cache, block_table=table.long(), cache_seqlens=seqlens, softmax_scale=SCALE)
    with pytest.raises(TypeError, match="kv_cache has dtype torch.float16"):
        flashmoe.mla_decode(q, cache.half(), **kw)
    with pytest.raises(ValueError, match="page_size 24"):
        flashmoe.mla_decode(q, cache[:, :24], **kw)
