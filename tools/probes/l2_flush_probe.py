"""Does the lab's L2 flush set a floor under small decode steps? (docs/design/attention-decode.md, "The B=1 floor")

The lab flushes L2 with a ~105 MB memset queued right before the start event. The memset
leaves L2 (50 MiB on the H100) full of dirty lines; a step that reads ~34 MB right after
it may pay their write-back. This times, interleaved, the same calls after three
preludes:
  memset        the lab's protocol (memset, then the start event);
  memset+read   the memset, then a read-only pass over a 64 MB buffer (evicts the dirty
                lines before the start event: L2 holds clean lines of another buffer);
  none          no flush (K/V partly L2-resident: a lower bound, not a cold read).
Calls: SDPA cuDNN on issue 22's B=1 decode (q [1, 32, 1, 128], k/v [1, 8, 8192, 128] bf16,
enable_gqa) and a plain read of the same 33.5 MB of K/V (k.sum() + v.sum()).
Prediction if the write-back hypothesis holds: memset is ~15 us slower than memset+read for
both calls. Usage: python3 l2_flush_probe.py [--reps 60]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(1, 32, 1, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 8, 8192, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 8, 8192, 128, device=dev, dtype=torch.bfloat16)
    flush = torch.empty(105 * 10**6, dtype=torch.uint8, device=dev)
    clean = torch.randn(16 * 2**20, device=dev)  # 64 MiB of f32, read-only

    def attention():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def read_kv():
        return k.sum(dtype=torch.float32) + v.sum(dtype=torch.float32)

    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
    )
    out = attention()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < 2e-2, f"cuDNN SDPA rel L2 {err:.2e} against the fp32 reference"

    preludes = {
        "memset": lambda: flush.zero_(),
        "memset+read": lambda: (flush.zero_(), clean.sum()),
        "none": lambda: None,
    }
    calls = {"sdpa-cudnn": attention, "read 33.5 MB": read_kv}
    times = {(c, p): [] for c in calls for p in preludes}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):  # warm-up: module loads, cuDNN plan
        for fn in calls.values():
            fn()
    torch.cuda.synchronize()
    for _ in range(args.reps):
        for c, fn in calls.items():
            for p, prelude in preludes.items():
                prelude()
                torch.cuda._sleep(200_000)  # the GPU is busy when the start is recorded
                start.record()
                fn()
                end.record()
                end.synchronize()
                times[(c, p)].append(start.elapsed_time(end) * 1e3)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; sdpa rel L2 {err:.1e}")
    print(f"{'call':<14} {'prelude':<12} {'median us':>10} {'p10':>8} {'p90':>8}")
    for (c, p), t in times.items():
        t.sort()
        n = len(t)
        print(f"{c:<14} {p:<12} {statistics.median(t):10.1f} {t[n // 10]:8.1f} {t[9 * n // 10]:8.1f}")


if __name__ == "__main__":
    main()
