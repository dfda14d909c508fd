#!/usr/bin/env python3
"""PyTorch baselines for the varlen probe (crates/flashmoe-bench/examples/varlen_probe.rs):
the same 16 sequence lengths (its LCG, seed 22), bf16, D=128 H=16 and D=64 H=32, causal
and not, timed the probe's way (CUDA events after a 256 MB L2 flush, median).

  python3 tools/probes/varlen_baseline.py [rounds]

Baselines: torch.nn.attention.varlen.varlen_attn (FlashAttention-2 varlen inside PyTorch)
when importable; SDPA per sequence (a Python loop of 16 calls, cuDNN and flash backends
forced); and dense SDPA cuDNN on B=16, S=total/16 (the dense problem of the probe).
TFLOP/s: 4*H*sq*sk*D per sequence, halved for causal.
"""
import inspect
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def lengths(seed, n):
    s, out = seed, []
    for _ in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        out.append(100 + (s >> 33) % 3901)
    return out


def timed(fn, rounds, flush):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(rounds):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


def varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # noqa: BLE001
        print(f"torch.nn.attention.varlen: not importable ({e})")
        return None
    params = inspect.signature(varlen_attn).parameters

    def call(q, k, v, cu, mx, causal):
        if "is_causal" in params:
            return varlen_attn(q, k, v, cu, cu, mx, mx, is_causal=causal)
        return varlen_attn(q, k, v, cu, cu, mx, mx, window_size=(-1, 0) if causal else (-1, -1))

    return call


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    lens = lengths(22, 16)
    total = sum(lens)
    b, sd = 16, (total + 8) // 16
    print(f"lengths {lens} total {total}; dense B={b} S={sd}")
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    va = varlen_fn()
    for d, h in ((128, 16), (64, 32)):
        q = torch.rand(total, h, d, device=dev, dtype=torch.bfloat16) * 2 - 1
        k = torch.rand_like(q) * 2 - 1
        v = torch.rand_like(q) * 2 - 1
        # Per-sequence (1, H, s, D) tensors for SDPA, made once (not timed).
        offs = [0] + list(torch.tensor(lens).cumsum(0).tolist())
        seqs = [tuple(x[offs[i]:offs[i + 1]].transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))
                for i in range(16)]
        qd = torch.rand(b, h, sd, d, device=dev, dtype=torch.bfloat16) * 2 - 1
        kd, vd = torch.rand_like(qd) * 2 - 1, torch.rand_like(qd) * 2 - 1
        for causal in (False, True):
            half = 0.5 if causal else 1.0
            fv = sum(4.0 * h * d * l * l * half for l in lens)
            fd = 4.0 * b * h * d * sd * sd * half
            row = [f"D={d} H={h} causal={causal}:"]
            if va is not None:
                try:
                    ms = timed(lambda: va(q, k, v, cu, max(lens), causal), rounds, flush)
                    row.append(f"varlen_attn {ms * 1e3:.1f} us {fv / ms / 1e9:.0f} TF")
                except Exception as e:  # noqa: BLE001
                    row.append(f"varlen_attn failed ({type(e).__name__}: {e})")
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        def loop():
                            for (a, bb, c) in seqs:
                                F.scaled_dot_product_attention(a, bb, c, is_causal=causal)
                        ms = timed(loop, rounds, flush)
                        row.append(f"sdpa-{name} per-seq {ms * 1e3:.1f} us {fv / ms / 1e9:.0f} TF")
                        ms = timed(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal), rounds, flush)
                        row.append(f"dense sdpa-{name} {ms * 1e3:.1f} us {fd / ms / 1e9:.0f} TF")
                except Exception as e:  # noqa: BLE001
                    row.append(f"sdpa-{name} failed ({type(e).__name__})")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
