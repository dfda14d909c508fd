#!/usr/bin/env python3
"""Compile flashmoe CUDA kernels with NVRTC (through ctypes, no GPU needed) and read the
ptxas resource report: registers, shared memory, stack frame, spills.

  python3 tools/kernels/nvrtc_check.py                    # every variant, sm_80 and sm_90a
  python3 tools/kernels/nvrtc_check.py --arch sm_90a -D FM_HEAD_DIM=128 ... --source flash
  python3 tools/kernels/nvrtc_check.py --sass DIR         # also write cubins (for nvdisasm)

Exits non-zero on a compile error or on any spill / stack frame / local memory.

libnvrtc is found from $NVRTC_LIB, /work/nvrtc13 (pip install --target /work/nvrtc13
nvidia-cuda-nvrtc==13.0.88), the nvidia-cuda-nvrtc wheel in site-packages, or
/usr/local/cuda/lib64.

The variant table lives in crates/flashmoe/src/attention/prefill/tiles.rs (`v1_tile`); this
script keeps a copy in V1_TILES below, and the Rust test `python_tile_table_matches`
fails when the two differ. kernel_probe.py imports V1_TILES from here.
"""
import argparse
import ctypes
import glob
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
KDIR = os.path.join(ROOT, "crates", "flashmoe", "kernels")
# One folder per kernel family under KDIR (build.rs embeds them by file name): every folder
# is an include directory, and a source is found by its name.
KDIRS = sorted(d for d, _, _ in os.walk(KDIR))
INCLUDES = [f"-I{d}" for d in KDIRS]


def kernel_path(name):
    """The path of kernel source `name` (e.g. "flash_attn_fwd.cu") under KDIR."""
    for d in KDIRS:
        p = os.path.join(d, name)
        if os.path.isfile(p):
            return p
    raise FileNotFoundError(f"no kernel source {name} under {KDIR}")

# --- v1 tile table (mirror of config.rs `v1_tile`):
# D -> (BM, BN, WARPS, STAGES, Q_IN_REGS, MIN_BLOCKS, SUB_N)
V1_TILES = {
    32: (128, 128, 4, 2, 1, 2, 64),
    64: (128, 128, 4, 2, 1, 2, 64),
    96: (128, 64, 4, 2, 0, 2, 32),
    128: (128, 64, 4, 2, 0, 2, 32),
    256: (128, 64, 8, 2, 0, 1, 64),
}
REFERENCE_WARPS = 1
REFERENCE_HEAD_DIMS = [8, 32, 40, 64, 80, 96, 100, 128, 192, 256]  # config.rs REFERENCE_TEST_HEAD_DIMS


def flash_defines(d, bf16, causal, tile=None):
    bm, bn, w, st, qr, mb, sn = tile if tile is not None else V1_TILES[d]
    return {
        "FM_HEAD_DIM": d, "FM_DTYPE_BF16": int(bf16), "FM_CAUSAL": int(causal),
        "FM_BLOCK_M": bm, "FM_BLOCK_N": bn, "FM_WARPS": w, "FM_STAGES": st,
        "FM_Q_IN_REGS": qr, "FM_MIN_BLOCKS": mb, "FM_SUB_N": sn,
    }


def reference_defines(d, bf16, causal):
    return {"FM_HEAD_DIM": d, "FM_DTYPE_BF16": int(bf16), "FM_CAUSAL": int(causal),
            "FM_BLOCK_M": REFERENCE_WARPS}


def smem_bytes(d, tile=None):
    """Same formula as the .cu and config.rs: 2*PITCH*(BM + 2*STAGES*BN)."""
    bm, bn, _w, st, _q, _m, _s = tile if tile is not None else V1_TILES[d]
    pitch = 64 if d <= 64 else (128 if d <= 128 else 256)
    return 2 * pitch * (bm + 2 * st * bn)


def find_nvrtc():
    cands = []
    if os.environ.get("NVRTC_LIB"):
        cands.append(os.environ["NVRTC_LIB"])
    cands += glob.glob("/work/nvrtc13/nvidia/cu13/lib/libnvrtc.so.13")
    for p in sys.path:
        cands += glob.glob(os.path.join(p, "nvidia", "cu13", "lib", "libnvrtc.so.13"))
        cands += glob.glob(os.path.join(p, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*"))
    cands += glob.glob("/usr/local/cuda/lib64/libnvrtc.so*")
    cands += ["libnvrtc.so.13", "libnvrtc.so"]
    for c in cands:
        try:
            # libnvrtc dlopens libnvrtc-builtins from the library path: preload it from the
            # same folder (RTLD_GLOBAL) so no LD_LIBRARY_PATH is needed.
            d = os.path.dirname(c)
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.*"))) if d else []:
                if ".alt." not in b:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(c), c
        except OSError:
            continue
    raise SystemExit("libnvrtc not found: pip install --target /work/nvrtc13 nvidia-cuda-nvrtc==13.0.88")


class Nvrtc:
    def __init__(self):
        self.lib, self.path = find_nvrtc()
        L = self.lib
        L.nvrtcGetErrorString.restype = ctypes.c_char_p
        ver = (ctypes.c_int(), ctypes.c_int())
        L.nvrtcVersion(ctypes.byref(ver[0]), ctypes.byref(ver[1]))
        self.version = f"{ver[0].value}.{ver[1].value}"

    def _chk(self, rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, src, name, options, want_cubin=True):
        """Returns (ok, log, binary). binary is a CUBIN for a real arch (sm_XX), else PTX."""
        L = self.lib
        prog = ctypes.c_void_p()
        self._chk(L.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), name.encode(), 0, None, None),
                  "nvrtcCreateProgram")
        opts = [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = L.nvrtcCompileProgram(prog, len(opts), arr)
        n = ctypes.c_size_t()
        L.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        L.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        binary = None
        if rc == 0 and want_cubin:
            sz = ctypes.c_size_t()
            if L.nvrtcGetCUBINSize(prog, ctypes.byref(sz)) == 0 and sz.value > 0:
                b = ctypes.create_string_buffer(sz.value)
                L.nvrtcGetCUBIN(prog, b)
                binary = b.raw
            else:
                L.nvrtcGetPTXSize(prog, ctypes.byref(sz))
                b = ctypes.create_string_buffer(sz.value)
                L.nvrtcGetPTX(prog, b)
                binary = b.raw
        L.nvrtcDestroyProgram(ctypes.byref(prog))
        return rc == 0, log, binary


def options_for(arch, defines, verbose=True):
    # -I: kernels include fm_ptx.cuh (the Rust runtime passes it as an in-memory header).
    opts = ["-std=c++17", f"-arch={arch}"] + INCLUDES
    if verbose:
        opts.append("--ptxas-options=-v")
    opts += [f"-D{k}={v}" for k, v in defines.items()]
    return opts


RE_REGS = re.compile(r"Used (\d+) registers")
RE_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
RE_SMEM = re.compile(r"(\d+) bytes smem")
RE_LMEM = re.compile(r"(\d+) bytes lmem")


def parse_report(log):
    r = {}
    m = RE_REGS.search(log)
    r["regs"] = int(m.group(1)) if m else None
    m = RE_STACK.search(log)
    if m:
        r["stack"], r["spill_st"], r["spill_ld"] = map(int, m.groups())
    m = RE_LMEM.search(log)
    r["lmem"] = int(m.group(1)) if m else 0
    m = RE_SMEM.search(log)
    r["static_smem"] = int(m.group(1)) if m else 0
    return r


def all_jobs(archs):
    jobs = []
    for arch in archs:
        for d in sorted(V1_TILES):
            for bf16 in (0, 1):
                for causal in (0, 1):
                    jobs.append(("flash_attn_fwd.cu", arch, flash_defines(d, bf16, causal)))
        for d in REFERENCE_HEAD_DIMS:
            for bf16 in (0, 1):
                for causal in (0, 1):
                    jobs.append(("attention_reference.cu", arch, reference_defines(d, bf16, causal)))
    return jobs


def run_job(nv, job, sass_dir=None):
    fname, arch, defines = job
    src = open(kernel_path(fname)).read()
    ok, log, binary = nv.compile(src, fname, options_for(arch, defines))
    rep = parse_report(log) if ok else {}
    bad = []
    if not ok:
        bad.append("compile error")
    else:
        if rep.get("spill_st") or rep.get("spill_ld"):
            bad.append("spills")
        if rep.get("stack"):
            bad.append("stack frame")
        if rep.get("lmem"):
            bad.append("local memory")
    if sass_dir and binary is not None:
        tag = "_".join(f"{k[3:].lower()}{v}" for k, v in defines.items())
        with open(os.path.join(sass_dir, f"{fname[:-3]}_{arch}_{tag}.cubin"), "wb") as f:
            f.write(binary)
    return job, ok, log, rep, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="sm_80, sm_90a ... (default both)")
    ap.add_argument("--source", choices=["flash", "reference"], help="compile one variant of this source with -D")
    ap.add_argument("-D", action="append", default=[], help="NAME=VALUE (with --source)")
    ap.add_argument("--sass", metavar="DIR", help="write cubins here")
    ap.add_argument("--log", action="store_true", help="print the full NVRTC log of every job")
    ap.add_argument("-j", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    archs = args.arch or ["sm_80", "sm_90", "sm_90a"]
    nv = Nvrtc()
    print(f"NVRTC {nv.version} ({nv.path})")
    if args.sass:
        os.makedirs(args.sass, exist_ok=True)
    if args.source:
        fname = "flash_attn_fwd.cu" if args.source == "flash" else "attention_reference.cu"
        defines = dict(kv.split("=", 1) for kv in args.D)
        jobs = [(fname, a, defines) for a in archs]
    else:
        jobs = all_jobs(archs)
    failures = 0
    with ThreadPoolExecutor(max_workers=args.j) as ex:
        results = list(ex.map(lambda j: run_job(nv, j, args.sass), jobs))
    print(f"{'source':<24} {'arch':<7} {'defines':<62} {'regs':>4} {'stack':>5} {'spill':>5} {'smem':>7}  status")
    for (fname, arch, defines), ok, log, rep, bad in results:
        dstr = " ".join(f"{k[3:]}={v}" for k, v in defines.items())
        smem = ""
        if fname.startswith("flash") and not args.source:
            smem = str(smem_bytes(int(defines["FM_HEAD_DIM"])))
        spill = (rep.get("spill_st", 0) or 0) + (rep.get("spill_ld", 0) or 0)
        status = "ok" if not bad else "FAIL: " + ", ".join(bad)
        print(f"{fname:<24} {arch:<7} {dstr:<62} {str(rep.get('regs')):>4} {str(rep.get('stack')):>5} {spill:>5} {smem:>7}  {status}")
        if bad or args.log:
            print(log)
        failures += bool(bad)
    print(f"{len(results) - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
