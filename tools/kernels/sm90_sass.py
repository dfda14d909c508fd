#!/usr/bin/env python3
"""Compile the production variants of the sm_90a attention kernel (bf16 by default, fp16
with --dtypes; D 64 and 128; causal and not; tile table of config.rs `sm90_tile`) with
NVRTC, disassemble them and print the ptxas report plus the per-loop counts and event order
of sass_loops.py (docs/design/attention-prefill-sm90.md).

  python3 tools/kernels/sm90_sass.py OUTDIR [--nvdisasm PATH] [--dtypes bf16,fp16] [-D NAME=VALUE ...]

Files: OUTDIR/sm90_d{D}_c{causal}.{cubin,sass} for bf16, sm90_fp16_d{D}_c{causal}.* for fp16.
The kernel's headers (fm_sm90.cuh, fm90_*.cuh) are found through -I kernels/.

nvdisasm: the CUDA toolkit's, or the pip wheel nvidia-cuda-nvdisasm (13.x).
"""
import argparse
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from nvrtc_check import Nvrtc, kernel_path, options_for, parse_report  # noqa: E402

# Mirror of config.rs `sm90_tile`:
# D -> (BLOCK_N, STAGES, CONSUMERS, PINGPONG, Q_REGS).
SM90_TILES = {64: (128, 3, 3, 1, 0), 128: (128, 2, 2, 0, 1)}


def defines(d, causal, extra, bf16=1):
    bn, st, cons, pp, qregs = SM90_TILES[d]
    dd = {"FM_HEAD_DIM": d, "FM_DTYPE_BF16": bf16, "FM_CAUSAL": causal, "FM_BLOCK_N": bn,
          "FM_STAGES": st, "FM_CONSUMERS": cons, "FM_PINGPONG": pp, "FM_Q_REGS": qregs}
    dd.update(extra)
    return dd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("outdir")
    ap.add_argument("--nvdisasm", default=os.environ.get("NVDISASM", "/tmp/nvd/x/nvidia/cu13/bin/nvdisasm"))
    ap.add_argument("-D", action="append", default=[])
    ap.add_argument("--dims", default="128,64", help="head dims to compile, e.g. 128")
    ap.add_argument("--dtypes", default="bf16", help="storage types to compile: bf16, fp16 or bf16,fp16")
    a = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in a.D)
    os.makedirs(a.outdir, exist_ok=True)
    nv = Nvrtc()
    src = open(kernel_path("flash_attn_fwd_sm90.cu")).read()
    sass_files = []
    jobs = [(dt, d, c) for dt in a.dtypes.split(",") for d in (int(x) for x in a.dims.split(",")) for c in (1, 0)]
    for dtype, d, causal in jobs:
        if dtype not in ("bf16", "fp16"):
            sys.exit(f"unknown dtype {dtype!r} (bf16 or fp16)")
        dd = defines(d, causal, extra, bf16=int(dtype == "bf16"))
        ok, log, cubin = nv.compile(src, "flash_attn_fwd_sm90.cu", options_for("sm_90a", dd))
        tag = ("" if dtype == "bf16" else "fp16_") + f"d{d}_c{causal}"
        if not ok:
            print(f"{tag}: compile error\n{log}")
            sys.exit(1)
        rep = parse_report(log)
        for line in log.splitlines():  # ptxas warnings, e.g. C7515 (serialised wgmma)
            if "warning" in line.lower():
                print(f"{tag}: {line.strip()}")
        print(f"{tag}: regs {rep['regs']} stack {rep.get('stack')} spills {rep.get('spill_st')}/{rep.get('spill_ld')}")
        path = os.path.join(a.outdir, f"sm90_{tag}.cubin")
        open(path, "wb").write(cubin)
        sass = path[:-6] + ".sass"
        with open(sass, "w") as f:
            subprocess.run([a.nvdisasm, "-c", path], stdout=f, check=True)
        sass_files.append(sass)
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "sass_loops.py"), "--order", *sass_files], check=True)


if __name__ == "__main__":
    main()
