"""Host time per call of flashmoe's torch ops, layer by layer, on a GPU.

    python tools/overhead.py [OUT.json]

The shapes of the library's api_overhead example (crates/flashmoe/examples/api_overhead.rs):
attention B=1 Hq=32 Hkv=8 S=128 D=128 causal bf16, and the MoE layer H=1024 I=3584 E=8 k=2 at
16 and 128 tokens; then a paged decode step and a varlen prefill (binding, public and kernel
only). For each, the host time per call (enqueue only; 20 batches of 200 calls,
the stream drained between batches; medians) of:

- ``binding``: the core binding's ``plan.forward`` with prebuilt descriptors and outputs, i.e.
  the Rust ``forward_raw`` plus PyO3 argument conversion (the raw call as Python sees it);
- ``impl``: the torch layer's kernel function called directly (descriptors, output allocation,
  stream, workspace, binding) without the dispatcher;
- ``op``: ``torch.ops.flashmoe.*.default`` through the dispatcher (what ``torch.compile`` and
  the public functions call);
- ``public``: ``flashmoe.attention`` / ``flashmoe.moe``;
- ``custom_op``: the same kernel function registered with ``@torch.library.custom_op`` instead
  (why the package registers with ``torch.library.Library``);
- ``sdpa`` (attention only): ``F.scaled_dot_product_attention`` on the same tensors, for scale.

``public - binding`` is the Python overhead over the raw call. Also the kernel time (CUDA events
over a CUDA graph of 100 public calls) and the back-to-back wall time per eager public call.
"""

import json
import statistics
import sys
import time

import torch

import flashmoe
from flashmoe import _torch

BATCHES, CALLS = 20, 200


def host_us(fn):
    per = []
    for _ in range(BATCHES):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        per.append((time.perf_counter() - t0) / CALLS * 1e6)
    torch.cuda.synchronize()
    return statistics.median(per)


def kernel_us(fn, calls=100):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def back_to_back_us(fn, calls=200):
    per = []
    for _ in range(10):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def custom_op_variant(name, impl, fake):
    op = torch.library.custom_op(f"flashmoe_overhead::{name}", mutates_args=())(impl)
    op.register_fake(fake)
    return op


def attention_figures():
    dev = torch.device("cuda", 0)
    b, s, hq, hkv, d = 1, 128, 32, 8, 128
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn(b, s, hkv, d, dtype=torch.bfloat16, device=dev)
    public = lambda: flashmoe.attention(q, k, v, causal=True)  # noqa: E731
    public()  # plan, workspace
    plan = _torch._attention_plan(0, "bf16", torch.bfloat16, d, hq, hkv, True, None)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, s, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    ws, wsb = _torch._workspace("prefill", plan.workspace_bytes, 0, stream)
    descs = [_torch._desc(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))]
    o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()

    def binding():
        plan.forward(stream, *descs, o_ptr, lse_ptr, ws, wsb)

    def _attention_ann(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _torch._attention_impl(q, k, v, causal, softmax_scale)

    cop = custom_op_variant("attention", _attention_ann, _torch._attention_fake)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    fig = {
        "shape": dict(batch=b, seqlen=s, heads_q=hq, heads_kv=hkv, head_dim=d, causal=True, dtype="bf16"),
        "kernel": plan.kernel,
        "binding_host_us": host_us(binding),
        "impl_host_us": host_us(lambda: _torch._attention_impl(q, k, v, True, None)),
        "op_host_us": host_us(lambda: torch.ops.flashmoe.attention.default(q, k, v, True, None)),
        "public_host_us": host_us(public),
        "custom_op_host_us": host_us(lambda: cop(q, k, v, True, 1.0 / d**0.5)),
        "sdpa_host_us": host_us(
            lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        ),
        "kernel_us": kernel_us(public),
        "back_to_back_us": back_to_back_us(public),
    }
    fig["python_overhead_us"] = fig["public_host_us"] - fig["binding_host_us"]
    return fig


def decode_figures():
    """A decode step: B=8 Hq=32 Hkv=8 D=128 bf16, one query row, 1000 keys, 16-key pages."""
    dev = torch.device("cuda", 0)
    b, hq, hkv, d, page, n = 8, 32, 8, 128, 16, 1000
    max_blocks = (n + page - 1) // page
    k_cache = torch.randn(b * max_blocks, page, hkv, d, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(b * max_blocks, device=dev).view(b, max_blocks).to(torch.int32)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16, device=dev)
    public = lambda: flashmoe.attention_with_kvcache(q, k_cache, v_cache, block_table=table,  # noqa: E731
                                                      cache_seqlens=seqlens)
    public()
    plan = _torch._decode_plan(0, torch.bfloat16, d, hq, hkv, 1, -1, 0, 0.0, None)
    o = torch.empty_like(q)
    lse = torch.empty(b, hq, 1, dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    ws, wsb = _torch._workspace("decode", plan.workspace_bytes(b, max_blocks * page), 0, stream)
    descs = [_torch._desc(q, "q"), _torch._desc(k_cache, "k"), _torch._desc(v_cache, "v"),
             _torch._idesc(table, "t"), _torch._idesc(seqlens, "s"), None]
    o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()

    def binding():
        plan.forward(stream, *descs, o_ptr, lse_ptr, ws, wsb)

    fig = {
        "shape": dict(batch=b, heads_q=hq, heads_kv=hkv, head_dim=d, page_size=page, seqlen_k=n, dtype="bf16"),
        "binding_host_us": host_us(binding),
        "public_host_us": host_us(public),
        "kernel_us": kernel_us(public),
    }
    fig["python_overhead_us"] = fig["public_host_us"] - fig["binding_host_us"]
    return fig


def varlen_figures():
    """A small packed prefill (host-bound: 4 sequences, 102 tokens), Hq=32 Hkv=8 D=128 causal bf16."""
    dev = torch.device("cuda", 0)
    lens, hq, hkv, d = [10, 40, 25, 27], 32, 8, 128
    cu = torch.tensor([0, 10, 50, 75, 102], dtype=torch.int32, device=dev)
    q = torch.randn(sum(lens), hq, d, dtype=torch.bfloat16, device=dev)
    k = torch.randn(sum(lens), hkv, d, dtype=torch.bfloat16, device=dev)
    v = torch.randn_like(k)
    public = lambda: flashmoe.attention_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True)  # noqa: E731
    public()
    plan = _torch._plans[("varlen", (0, torch.bfloat16, d, hq, hkv, True, None, -1, -1, 0.0))]
    o = torch.empty_like(q)
    lse = torch.empty(hq, sum(lens), dtype=torch.float32, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    ws, wsb = _torch._workspace("varlen", plan.workspace_bytes, 0, stream)
    descs = [_torch._desc(t, n) for t, n in ((q, "q"), (k, "k"), (v, "v"))]
    descs += [_torch._idesc(cu, "cu_q"), _torch._idesc(cu, "cu_k"), max(lens), max(lens)]
    o_ptr, lse_ptr = o.data_ptr(), lse.data_ptr()

    def binding():
        plan.forward(stream, *descs, o_ptr, lse_ptr, ws, wsb)

    fig = {
        "shape": dict(lengths=lens, heads_q=hq, heads_kv=hkv, head_dim=d, causal=True, dtype="bf16"),
        "binding_host_us": host_us(binding),
        "public_host_us": host_us(public),
        "kernel_us": kernel_us(public, calls=20),
    }
    fig["python_overhead_us"] = fig["public_host_us"] - fig["binding_host_us"]
    return fig


def moe_figures(tokens):
    dev = torch.device("cuda", 0)
    h, i, e, k = 1024, 3584, 8, 2
    x = torch.randn(tokens, h, dtype=torch.bfloat16, device=dev)
    router = torch.randn(h, e, dtype=torch.bfloat16, device=dev) / 32
    w13 = torch.randn(e, h, 2 * i, dtype=torch.bfloat16, device=dev) / 32
    w2 = torch.randn(e, i, h, dtype=torch.bfloat16, device=dev) / 60
    public = lambda: flashmoe.moe(x, router, w13, w2, top_k=k)  # noqa: E731
    public()
    plan = _torch._moe_plan(0, "bf16", h, i, e, k, "softmax", True, False, tokens)
    out = torch.empty_like(x)
    ids = torch.empty(tokens, k, dtype=torch.int32, device=dev)
    wts = torch.empty(tokens, k, dtype=torch.float32, device=dev)
    counts = torch.empty(e, dtype=torch.int32, device=dev)
    losses = torch.empty(2, dtype=torch.float32, device=dev)
    wsb = plan.workspace_bytes(tokens)
    ws = torch.empty(wsb, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    d = _torch._desc
    args = [d(x, "x"), d(router, "r"), d(w13, "w13"), d(w2, "w2"), None]
    args += [t.data_ptr() for t in (out, ids, wts, counts, losses, ws)] + [wsb]

    def binding():
        plan.forward(stream, *args)

    fig = {
        "shape": dict(tokens=tokens, hidden=h, intermediate=i, experts=e, top_k=k, dtype="bf16"),
        "binding_host_us": host_us(binding),
        "impl_host_us": host_us(lambda: _torch._moe_impl(x, router, w13, w2, None, None, k, "softmax", True)),
        "op_host_us": host_us(
            lambda: torch.ops.flashmoe.moe.default(x, router, w13, w2, None, None, k, "softmax", True)
        ),
        "public_host_us": host_us(public),
        "kernel_us": kernel_us(public, calls=20),
        "back_to_back_us": back_to_back_us(public, calls=50),
    }
    fig["python_overhead_us"] = fig["public_host_us"] - fig["binding_host_us"]
    return fig


def main():
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        sys.exit(2)
    res = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "attention": attention_figures(),
        "moe": [moe_figures(t) for t in (16, 128)],
        "decode": decode_figures(),
        "varlen": varlen_figures(),
    }
    text = json.dumps(res, indent=2)
    print(text)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
