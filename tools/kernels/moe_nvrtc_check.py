#!/usr/bin/env python3
"""Compile every MoE grouped-GEMM variant (kernels/moe/forward/moe_grouped_gemm.cu) with NVRTC, no GPU
needed, and read the ptxas resource report: registers, stack frame, spills.

  python3 tools/kernels/moe_nvrtc_check.py                  # every variant, sm_80 and sm_90a
  python3 tools/kernels/moe_nvrtc_check.py --arch sm_90a -D FM_GEMM=13 -D FM_BM=128 ...
  python3 tools/kernels/moe_nvrtc_check.py --sass DIR       # also write cubins (nvdisasm)

Exits non-zero on a compile error or on any spill / stack frame / local memory.

The tile table mirrors crates/flashmoe/src/moe/gemm/tiles.rs (`regime_tile`); the Rust
test `python_tile_table_matches` fails when the two differ. moe_gemm_probe.py imports it.
"""
import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nvrtc_check import Nvrtc  # noqa: E402
from nvrtc_check import run_job as nvrtc_check_run_job  # noqa: E402

SOURCE = "moe_grouped_gemm.cu"

# (regime, gemm) -> (BM, BN, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS); mirror of moe/gemm/tiles.rs
MOE_TILES = {
    ("decode", 13): (16, 64, 1, 4, 6, 2),
    ("decode", 2): (16, 64, 1, 4, 6, 3),
    ("small", 13): (32, 64, 2, 2, 5, 2),
    ("small", 2): (32, 64, 1, 4, 6, 3),
    ("medium", 13): (64, 64, 2, 2, 4, 2),
    ("medium", 2): (64, 128, 2, 2, 4, 2),
    ("large", 13): (128, 64, 2, 4, 3, 2),
    ("large", 2): (128, 128, 2, 4, 3, 2),
}
REGIMES = ["decode", "small", "medium", "large"]
BK = 64


def regime_for(tokens, top_k, experts):
    rows = tokens * top_k / experts
    return "decode" if rows <= 12 else "small" if rows <= 40 else "medium" if rows <= 96 else "large"


def with_block_n(tile, bn):
    bm, bn0, wm, wn, st, mb = tile
    return (bm, bn, wm, max(1, min(wn, bn // 16)), st, mb)


def tile_for(regime, gemm, n):
    base = MOE_TILES[(regime, gemm)]
    for bn in (base[1], 64, 32):
        if bn <= base[1] and n % bn == 0:
            return with_block_n(base, bn)
    return None


def smem_bytes(gemm, tile):
    """Same formula as the .cu and GemmTile::shared_mem_bytes."""
    bm, bn, _wm, _wn, st, _mb = tile
    nb = 2 if gemm == 13 else 1
    return st * (bm * BK * 2 + nb * BK * max(bn, 64) * 2) + bm * 8 + 256


def defines(gemm, tile, bf16):
    bm, bn, wm, wn, st, mb = tile
    return {"FM_GEMM": gemm, "FM_DTYPE_BF16": int(bf16), "FM_BM": bm, "FM_BN": bn,
            "FM_WARPS_M": wm, "FM_WARPS_N": wn, "FM_STAGES": st, "FM_MIN_BLOCKS": mb}


def all_tiles():
    out = []
    for r in REGIMES:
        for g in (13, 2):
            base = MOE_TILES[(r, g)]
            for bn in (base[1], 64, 32):
                if bn <= base[1]:
                    t = (g, with_block_n(base, bn))
                    if t not in out:
                        out.append(t)
    return out


def run_job(nv, job, sass_dir=None):
    """Compile one (arch, defines) variant through nvrtc_check's shared checker."""
    arch, d = job
    _, ok, log, rep, bad = nvrtc_check_run_job(nv, (SOURCE, arch, d), sass_dir)
    return job, ok, log, rep, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="sm_80, sm_90a ... (default both)")
    ap.add_argument("-D", action="append", default=[], help="NAME=VALUE: compile this one variant")
    ap.add_argument("--bf16-only", action="store_true", help="skip the fp16 variants")
    ap.add_argument("--sass", metavar="DIR", help="write cubins here")
    ap.add_argument("--log", action="store_true")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    archs = args.arch or ["sm_80", "sm_90a"]
    nv = Nvrtc()
    print(f"NVRTC {nv.version} ({nv.path})")
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    if args.D:
        jobs = [(a, dict(kv.split("=", 1) for kv in args.D)) for a in archs]
    else:
        jobs = [(a, defines(g, t, bf)) for a in archs for g, t in all_tiles()
                for bf in ((1,) if args.bf16_only else (0, 1))]
    with ThreadPoolExecutor(max_workers=args.j) as ex:
        results = list(ex.map(lambda j: run_job(nv, j, args.sass), jobs))
    failures = 0
    print(f"{'arch':<7} {'defines':<78} {'regs':>4} {'stack':>5} {'spill':>5} {'smem':>7}  status")
    for (arch, d), ok, log, rep, bad in results:
        dstr = " ".join(f"{k[3:]}={v}" for k, v in d.items())
        g = int(d["FM_GEMM"])
        tile = tuple(int(d[k]) for k in ("FM_BM", "FM_BN", "FM_WARPS_M", "FM_WARPS_N", "FM_STAGES", "FM_MIN_BLOCKS")) \
            if all(k in d for k in ("FM_BM", "FM_BN", "FM_WARPS_M", "FM_WARPS_N", "FM_STAGES", "FM_MIN_BLOCKS")) else None
        smem = smem_bytes(g, tile) if tile else ""
        spill = (rep.get("spill_st", 0) or 0) + (rep.get("spill_ld", 0) or 0)
        status = "ok" if not bad else "FAIL: " + ", ".join(bad)
        print(f"{arch:<7} {dstr:<78} {str(rep.get('regs')):>4} {str(rep.get('stack')):>5} {spill:>5} {smem:>7}  {status}")
        if bad or args.log:
            print(log)
        failures += bool(bad)
    print(f"{len(results) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
