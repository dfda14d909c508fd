"""Time PyTorch's MoE training baselines at the MoE backward's speed-test shapes (issue 34):
the torch._grouped_mm path of python/flashmoe_worker.py (route, sort by expert, grouped
gate/up and down, weighted combine) and the per-expert loop, under autograd; forward alone,
forward + backward (dx, d_router, dw13, dw2), backward = the difference. Inputs: bf16, the
same distributions as the lab's (x, router, weights scaled like MoeInputs), random routing.
CUDA events, L2 flushed before each sample, median of 5. Prints one line per (shape, impl).

Usage (on the GPU machine): python3 tools/probes/moe_bwd_torch.py [--shapes seed003-2048,...]
"""
import argparse
import torch
import torch.nn.functional as F

SHAPES = {
    "seed003-2048": (2048, 4096, 11008, 32, 2),
    "seed003-32768": (32768, 4096, 11008, 32, 2),
    "qwen3-30b-8192": (8192, 2048, 768, 128, 8),
}


def inputs(t, h, i, e, dev):
    g = torch.Generator(device=dev).manual_seed(7)
    r = lambda *s, scale: (torch.rand(*s, generator=g, device=dev) * 2 - 1).mul_(scale).to(torch.bfloat16)
    x = r(t, h, scale=1.0)
    router = r(h, e, scale=h ** -0.5)
    w13 = r(e, h, 2 * i, scale=h ** -0.5)
    w2 = r(e, i, h, scale=i ** -0.5)
    dout = r(t, h, scale=1.0)
    return x, router, w13, w2, dout


def layer_grouped(x, router, w13, w2, k, i):
    e = w13.shape[0]
    logits = torch.matmul(x.float(), router.float())
    scores = torch.softmax(logits, dim=-1)
    vals, ids = torch.topk(scores, k, dim=-1)
    w = vals / vals.sum(dim=-1, keepdim=True)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=e)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = torch.div(order, k, rounding_mode="floor")
    xs = x.index_select(0, tok)
    hs = torch._grouped_mm(xs, w13, offs=offs)
    a = F.silu(hs[:, :i]) * hs[:, i:]
    ys = torch._grouped_mm(a, w2, offs=offs)
    y = torch.empty_like(ys)
    y[order] = ys
    out = (y.view(x.shape[0], k, -1).float() * w.unsqueeze(-1)).sum(dim=1)
    return out.to(x.dtype)


def layer_loop(x, router, w13, w2, k, i):
    e = w13.shape[0]
    logits = torch.matmul(x.float(), router.float())
    scores = torch.softmax(logits, dim=-1)
    vals, ids = torch.topk(scores, k, dim=-1)
    w = vals / vals.sum(dim=-1, keepdim=True)
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for ex in range(e):
        tok, slot = torch.where(ids == ex)
        if tok.numel() == 0:
            continue
        hh = torch.matmul(x[tok], w13[ex])
        y = torch.matmul(F.silu(hh[:, :i]) * hh[:, i:], w2[ex])
        out = out.index_add(0, tok, y.float() * w[tok, slot].unsqueeze(1))
    return out.to(x.dtype)


def timed(fn, flush, n=5):
    fn()
    torch.cuda.synchronize()
    v = []
    for _ in range(n):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        v.append(a.elapsed_time(b))
    v.sort()
    return v[len(v) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--impls", default="grouped_mm,loop")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
    for name in args.shapes.split(","):
        t, h, i, e, k = SHAPES[name]
        x, router, w13, w2, dout = inputs(t, h, i, e, dev)
        params = [p.requires_grad_() for p in (x, router, w13, w2)]
        flops_bwd = 2 * (6 * t * k * h * i + 2 * t * h * e)
        for impl in args.impls.split(","):
            layer = layer_grouped if impl == "grouped_mm" else layer_loop

            def fwd():
                with torch.no_grad():
                    layer(x, router, w13, w2, k, i)

            def fwd_bwd():
                for p in params:
                    p.grad = None
                out = layer(x, router, w13, w2, k, i)
                out.backward(dout)

            try:
                f = timed(fwd, flush)
                fb = timed(fwd_bwd, flush)
            except Exception as ex:  # noqa: BLE001
                print(f"{name} {impl}: failed: {type(ex).__name__}: {str(ex).splitlines()[0]}")
                continue
            b = fb - f
            print(f"{name} T={t} H={h} I={i} E={e} k={k} torch-{impl}: fwd {f:.3f} ms, "
                  f"fwd+bwd {fb:.3f} ms, bwd (difference) {b:.3f} ms = "
                  f"{flops_bwd / b / 1e9:.1f} TFLOP/s (bwd model {flops_bwd / 1e12:.3f} TF)")
            torch.cuda.empty_cache()
        del x, router, w13, w2, dout, params
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
