"""Cross-check of three ways to time the same SDPA call on one GPU, in one process:
(1) triton.testing.do_bench (median; L2 cleared; start event right after the clear),
(2) CUDA events with a spin kernel queued before the start event (the GPU is busy when
    the start is recorded: the flashmoe method), after an L2 flush,
(3) the CUPTI profiler's kernel durations (torch.profiler), excluding the flush kernel:
    the ground truth for GPU time, immune to host gaps.
Also prints the host dispatch time of one call. Usage: python3 timing_crosscheck.py
"""
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

B, H, S, D = 4, 16, 4096, 128
N = 30
q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flush = torch.empty(100 * 2**20, dtype=torch.uint8, device="cuda")


def flops(causal):
    return 4 * B * H * S * S * D / (2 if causal else 1)


def events_with_spin(fn):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(N):
        flush.zero_()
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU work so the start event waits on it
        s.record()
        fn()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    out.sort()
    return out[N // 2]


def profiled(fn):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(N):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total_us, names = 0.0, set()
    for ev in prof.key_averages():
        name = ev.key
        if "fill" in name.lower() or "Fill" in name:
            continue
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0:
            total_us += t
            names.add(name[:60])
    return total_us / N / 1e3, sorted(names)


def dispatch_us(fn):
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e6


print(f"B={B} H={H} S={S} D={D} bf16, {torch.cuda.get_device_name()}, torch {torch.__version__}")
print(f"{'backend':8s} {'causal':6s} {'do_bench':>9s} {'events+spin':>11s} {'CUPTI kernels':>13s} {'dispatch':>9s}  (ms, TFLOP/s from CUPTI)")
for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
    for causal in (False, True):
        with sdpa_kernel([be]):
            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            db = do_bench(fn, warmup=100, rep=500, return_mode="median")
            ev = events_with_spin(fn)
            cu, kernels = profiled(fn)
            du = dispatch_us(fn)
        print(f"{name:8s} {causal!s:6s} {db:9.4f} {ev:11.4f} {cu:13.4f} {du:7.0f}us  "
              f"{flops(causal) / cu / 1e9:.0f} TF  kernels: {', '.join(kernels)}")
