#!/usr/bin/env python3
"""Standalone GPU probe for the MoE grouped GEMMs (kernels/moe/forward/moe_grouped_gemm.cu), PyTorch +
CuPy, no Rust.

  python3 tools/probes/moe_gemm_probe.py [--quick] [--out DIR] [--no-tune]

1. Compiles moe_gemm13 / moe_gemm2 for every tile of the table (tools/kernels/
   moe_nvrtc_check.py, mirror of crates/flashmoe/src/moe/gemm/tiles.rs) with NVRTC
   (ctypes; cupy.RawModule(code=...) fallback) and loads them with CuPy.
2. Correctness: random x / w13 / w2 (torch.randn, scaled), random routing with an expert
   that gets no token and a skewed one (in every token's top-k), offsets / row_token built
   on the host as moe_permute would (stable, token order inside an expert); h and y are
   poisoned with NaN, both kernels run, h is checked against float64 silu(x w_g) * (x w_u)
   and y against float64 h_kernel . w2 (relative L2 <= 1e-2; NaN fails). Shapes cover
   every regime (decode / small / medium / large tiles), bf16 and fp16, the check shape
   hidden 128 / intermediate 96 (block_n 32, k tail), and seed003 at 16 and 2048 tokens
   (experts 0..3 checked).
3. Timing (bf16, seed003: hidden 4096, intermediate 11008, 32 experts, top-2, random
   balanced routing) at 16, 2048 and 32768 tokens: our gemm13 (gather + gate/up + SwiGLU
   fused) and gemm2 vs torch._grouped_mm (x already gathered, + F.silu(g) * u; down
   projection, bf16 out), CUDA events, 256 MB L2 flush before each call, round-robin,
   median. Reports ms, TFLOP/s, GB/s of expert weights touched and % of 3.0 TB/s. Without
   --no-tune, the other regimes' tiles are timed too at each size.
Prints a compact table last; exits 1 on any correctness failure.
"""
import argparse
import json
import os
import sys
import tempfile
import traceback
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "kernels"))
import nvrtc_check as nc  # noqa: E402
import moe_nvrtc_check as mc  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import cupy  # noqa: E402

PEAK_BW = 3.0e12
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}
SRC = open(nc.kernel_path(mc.SOURCE)).read()
ENTRY = {13: "moe_gemm13", 2: "moe_gemm2"}


# ---------------------------------------------------------------------------------------
class Kernels:
    def __init__(self, arch, tmp):
        self.arch, self.tmp, self.cache, self.reports = arch, tmp, {}, {}
        try:
            self.nv = nc.Nvrtc()
            self.info = f"NVRTC {self.nv.version} ({self.nv.path})"
        except BaseException as e:  # noqa: BLE001
            self.nv, self.info = None, f"cupy.RawModule fallback ({e})"

    def build(self, keys):
        """keys: [(gemm, tile, dtype)] compiled in parallel."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]

        def one(key):
            gemm, tile, dt = key
            d = mc.defines(gemm, tile, dt == "bf16")
            if self.nv is None:
                return key, None, {}, ""
            ok, log, binary = self.nv.compile(SRC, mc.SOURCE, nc.options_for(self.arch, d))
            if not ok:
                raise RuntimeError(f"compile failed {key}:\n{log[-3000:]}")
            path = os.path.join(self.tmp, f"moe_{gemm}_{'_'.join(map(str, tile))}_{dt}.cubin")
            open(path, "wb").write(binary)
            return key, path, nc.parse_report(log), log

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as ex:
            res = list(ex.map(one, todo))
        for key, path, rep, _log in res:
            gemm, tile, dt = key
            if path:
                mod = cupy.RawModule(path=path)
            else:
                d = mc.defines(gemm, tile, dt == "bf16")
                mod = cupy.RawModule(code=SRC, options=tuple(["-std=c++17"] + nc.INCLUDES + [f"-D{k}={v}" for k, v in d.items()]))
            fn = mod.get_function(ENTRY[gemm])
            smem = mc.smem_bytes(gemm, tile)
            if smem > 48 * 1024:
                fn.max_dynamic_shared_size_bytes = smem
            self.cache[key] = fn
            self.reports[key] = rep

    def get(self, gemm, tile, dt):
        self.build([(gemm, tile, dt)])
        return self.cache[(gemm, tile, dt)]


def cp_(t):
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return cupy.asarray(t)


def launcher(K, gemm, tile, dt, prob, bufs):
    """Closure launching one GEMM on torch's current stream with prebuilt arguments."""
    H, I, E, R = prob["H"], prob["I"], prob["E"], prob["R"]
    fn = K.get(gemm, tile, dt)
    bm, bn, wm, wn, _st, _mb = tile
    smem = mc.smem_bytes(gemm, tile)
    n = I if gemm == 13 else H
    assert n % bn == 0
    grid = ((R + bm - 1) // bm + E, n // bn, 1)
    block = (wm * wn * 32, 1, 1)
    if gemm == 13:
        args = (cp_(bufs["x"]), cp_(bufs["row_token"]), cp_(bufs["offsets"]), cp_(bufs["w13"]),
                cp_(bufs["h"]), np.uint64(0), np.int32(H), np.int32(I), np.int32(E))  # gu: not saved
    else:
        args = (cp_(bufs["h"]), cp_(bufs["offsets"]), cp_(bufs["w2"]), cp_(bufs["y"]),
                np.int32(H), np.int32(I), np.int32(E))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def go():
        with stream:
            fn(grid, block, args, shared_mem=smem)
    return go


# ---------------------------------------------------------------------------------------
def routing(T, E, k, gen, special):
    """ids [T, k]. special: expert E-1 gets no token, expert 0 is in every token's top-k."""
    scores = torch.rand(T, E, generator=gen, device="cuda")
    if special:
        scores[:, E - 1] = -1.0
        scores[:, 0] = 2.0
    return scores.topk(k, dim=1).indices


def permute(ids, E):
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    offsets = torch.zeros(E + 1, dtype=torch.int64, device="cuda")
    offsets[1:] = torch.cumsum(counts, 0)
    row_token = torch.div(order, k, rounding_mode="floor")
    return offsets.to(torch.int32), row_token.to(torch.int32), counts


def make_problem(T, H, I, E, k, dt, seed, special):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = DT[dt]
    x = torch.randn(T, H, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    w13 = (torch.randn(E, H, 2 * I, generator=gen, device="cuda", dtype=torch.float32) * H ** -0.5).to(dtype)
    w2 = (torch.randn(E, I, H, generator=gen, device="cuda", dtype=torch.float32) * I ** -0.5).to(dtype)
    ids = routing(T, E, k, gen, special)
    offsets, row_token, counts = permute(ids, E)
    R = T * k
    bufs = dict(x=x, w13=w13, w2=w2, offsets=offsets, row_token=row_token,
                h=torch.empty(R, I, device="cuda", dtype=dtype),
                y=torch.empty(R, H, device="cuda", dtype=torch.float32))
    prob = dict(T=T, H=H, I=I, E=E, k=k, R=R, counts=counts.cpu().tolist())
    return prob, bufs


def rel_l2(out, ref):
    out = out.double()
    if torch.isnan(out).any():
        return float("nan")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def check(K, prob, bufs, dt, tiles, experts_checked=None):
    """Runs both kernels (poisoned outputs) and returns (err_h, err_y, n_nan_h, n_nan_y)."""
    H, I, E = prob["H"], prob["I"], prob["E"]
    bufs["h"].fill_(float("nan"))
    bufs["y"].fill_(float("nan"))
    launcher(K, 13, tiles[0], dt, prob, bufs)()
    torch.cuda.synchronize()
    launcher(K, 2, tiles[1], dt, prob, bufs)()
    torch.cuda.synchronize()
    off = bufs["offsets"].cpu().tolist()
    es = range(E) if experts_checked is None else experts_checked
    hs, hr, ys, yr = [], [], [], []
    for e in es:
        r0, r1 = off[e], off[e + 1]
        if r1 == r0:
            continue
        xs = bufs["x"][bufs["row_token"][r0:r1].long()].double()
        w = bufs["w13"][e].double()
        g, u = xs @ w[:, :I], xs @ w[:, I:]
        hr.append(F.silu(g) * u)
        hs.append(bufs["h"][r0:r1])
        yr.append(bufs["h"][r0:r1].double() @ bufs["w2"][e].double())
        ys.append(bufs["y"][r0:r1])
    nan_h = int(torch.isnan(bufs["h"]).sum().item())
    nan_y = int(torch.isnan(bufs["y"]).sum().item())
    return rel_l2(torch.cat(hs), torch.cat(hr)), rel_l2(torch.cat(ys), torch.cat(yr)), nan_h, nan_y


# ---------------------------------------------------------------------------------------
def time_round_robin(impls, samples, flush):
    times = {n: [] for n in impls}
    alive = dict(impls)
    for name, f in list(alive.items()):
        try:
            f()
            f()
        except Exception as e:  # noqa: BLE001
            times[name] = None
            alive.pop(name)
            print(f"    {name}: unavailable ({str(e).splitlines()[0][:120]})")
    torch.cuda.synchronize()
    for _ in range(samples):
        ev = []
        for name, f in alive.items():
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            f()
            e.record()
            ev.append((name, s, e))
        torch.cuda.synchronize()
        for name, s, e in ev:
            times[name].append(s.elapsed_time(e))
    return {n: (float(np.median(v)) if v else None) for n, v in times.items()}


def torch_impls(prob, bufs):
    """torch._grouped_mm for the same two GEMMs (gather outside the timed region)."""
    if not hasattr(torch, "_grouped_mm"):
        return {}
    I = prob["I"]
    offs = bufs["offsets"][1:].contiguous()
    xs = bufs["x"].index_select(0, bufs["row_token"].long())
    w13, w2 = bufs["w13"], bufs["w2"]
    try:
        torch._grouped_mm(xs, w13, offs=offs)
    except Exception:  # noqa: BLE001  some versions want column-major B
        w13 = w13.transpose(-2, -1).contiguous().transpose(-2, -1)
        w2 = w2.transpose(-2, -1).contiguous().transpose(-2, -1)
    hs = torch.empty(prob["R"], I, device="cuda", dtype=xs.dtype).normal_()

    def g13():
        gu = torch._grouped_mm(xs, w13, offs=offs)
        return F.silu(gu[:, :I]) * gu[:, I:]

    def g2():
        return torch._grouped_mm(hs, w2, offs=offs)
    return {"torch g13+swiglu": g13, "torch g2": g2}


# ---------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer samples, no tuning section")
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    samples = args.samples or (10 if args.quick else 30)
    tune = not (args.quick or args.no_tune)

    torch.manual_seed(0)
    cap = torch.cuda.get_device_capability()
    arch = "sm_90a" if cap == (9, 0) else f"sm_{cap[0]}{cap[1]}"
    tmp = tempfile.mkdtemp(prefix="moe_probe_")
    K = Kernels(arch, tmp)
    print(f"device {torch.cuda.get_device_name()} ({arch}), torch {torch.__version__}, "
          f"cupy {cupy.__version__}, {K.info}")
    K.build([(g, t, dt) for g, t in mc.all_tiles() for dt in ("bf16", "fp16")])
    print("\n## resource report (regs / stack / spill bytes / smem)")
    for (g, t, dt), rep in sorted(K.reports.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        if dt == "bf16":
            sp = (rep.get("spill_st") or 0) + (rep.get("spill_ld") or 0)
            print(f"  gemm{g:<2} tile={t} regs={rep.get('regs')} stack={rep.get('stack')} spill={sp} smem={mc.smem_bytes(g, t)}")

    failures = []
    rows = []
    # --- correctness ---------------------------------------------------------------------
    print("\n## correctness (rel L2 vs float64; h: gemm13 vs silu(x wg)(x wu), y: gemm2 vs h.w2)")
    cases = [  # T, H, I, E, k, special
        (7, 128, 96, 4, 2, True), (1, 128, 96, 4, 1, False), (16, 128, 96, 8, 8, False),
        (60, 256, 160, 6, 2, True), (300, 256, 256, 8, 2, True), (1000, 512, 384, 8, 2, True),
        (2500, 384, 320, 10, 2, True),
    ]
    if not args.quick:
        cases += [(33, 1024, 768, 16, 4, True), (4096, 256, 512, 64, 8, True)]
    seed = 1
    for T, H, I, E, k, special in cases:
        for dt in ("bf16", "fp16"):
            seed += 1
            prob, bufs = make_problem(T, H, I, E, k, dt, seed, special)
            regimes = mc.REGIMES if (T, H) in ((7, 128), (300, 256)) else [mc.regime_for(T, k, E)]
            for reg in regimes:
                tiles = (mc.tile_for(reg, 13, I), mc.tile_for(reg, 2, H))
                try:
                    eh, ey, nh, ny = check(K, prob, bufs, dt, tiles)
                    ok = eh <= 1e-2 and ey <= 1e-2 and nh == 0 and ny == 0
                except Exception as ex:  # noqa: BLE001
                    traceback.print_exc()
                    eh = ey = float("nan")
                    nh = ny = -1
                    ok = False
                line = (f"  T={T:<5} H={H:<5} I={I:<5} E={E:<3} k={k} {dt} {reg:<7} "
                        f"tiles={tiles[0][:2]}/{tiles[1][:2]} h {eh:.2e} y {ey:.2e} nan {nh}/{ny} "
                        f"{'ok' if ok else 'FAIL'}")
                print(line)
                if not ok:
                    failures.append(line.strip())
            del bufs
    torch.cuda.empty_cache()

    # --- seed003 timing ------------------------------------------------------------------
    H, I, E, k = 4096, 11008, 32, 2
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device="cuda")
    token_list = [16, 2048, 32768]
    print(f"\n## timing, seed003 bf16 (H={H} I={I} E={E} top-{k}), median of {samples}, L2 flushed, round-robin")
    for T in token_list:
        prob, bufs = make_problem(T, H, I, E, k, "bf16", 1000 + T, False)
        reg = mc.regime_for(T, k, E)
        tiles = (mc.tile_for(reg, 13, I), mc.tile_for(reg, 2, H))
        touched = sum(1 for c in prob["counts"] if c > 0)
        R = prob["R"]
        # correctness at this size (experts 0..3)
        eh, ey, nh, ny = check(K, prob, bufs, "bf16", tiles, experts_checked=range(4))
        ok = eh <= 1e-2 and ey <= 1e-2 and nh == 0 and ny == 0
        line = f"  seed003 T={T} {reg} h {eh:.2e} y {ey:.2e} nan {nh}/{ny} {'ok' if ok else 'FAIL'}"
        print(line)
        if not ok:
            failures.append(line.strip())
        impls = {"ours g13": launcher(K, 13, tiles[0], "bf16", prob, bufs),
                 "ours g2": launcher(K, 2, tiles[1], "bf16", prob, bufs)}
        impls.update(torch_impls(prob, bufs))
        alt = {}
        if tune:
            for r2 in mc.REGIMES:
                if r2 != reg:
                    t13, t2 = mc.tile_for(r2, 13, I), mc.tile_for(r2, 2, H)
                    impls[f"ours g13 [{r2}]"] = launcher(K, 13, t13, "bf16", prob, bufs)
                    impls[f"ours g2 [{r2}]"] = launcher(K, 2, t2, "bf16", prob, bufs)
                    alt[f"ours g13 [{r2}]"], alt[f"ours g2 [{r2}]"] = t13, t2
        med = time_round_robin(impls, samples, flush)
        fl13, fl2 = 2.0 * R * H * 2 * I, 2.0 * R * I * H
        wb13, wb2 = touched * H * 2 * I * 2.0, touched * I * H * 2.0
        for name, ms in med.items():
            g13 = "g13" in name
            fl, wb = (fl13, wb13) if g13 else (fl2, wb2)
            tile = alt.get(name, tiles[0] if g13 else tiles[1]) if name.startswith("ours") else None
            if ms is None:
                rows.append((T, name, None, None, None, None, tile))
                continue
            rows.append((T, name, ms, fl / ms / 1e9, wb / ms / 1e6, 100.0 * wb / (ms * 1e-3) / PEAK_BW, tile))
        pair_ours = (med.get("ours g13") or 0) + (med.get("ours g2") or 0)
        pair_t = (med.get("torch g13+swiglu") or float("nan")) + (med.get("torch g2") or float("nan"))
        floor = (wb13 + wb2) / PEAK_BW * 1e3
        rows.append((T, "ours g13+g2", pair_ours, (fl13 + fl2) / pair_ours / 1e9, (wb13 + wb2) / pair_ours / 1e6,
                     100.0 * floor / pair_ours, None))
        rows.append((T, "torch g13+g2", pair_t, (fl13 + fl2) / pair_t / 1e9, (wb13 + wb2) / pair_t / 1e6,
                     100.0 * floor / pair_t, None))
        print(f"  T={T}: touched experts {touched}, weight floor {floor:.3f} ms, "
              f"speedup vs torch {pair_t / pair_ours:.2f}x")
        del bufs, impls
        torch.cuda.empty_cache()

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "moe_gemm_probe.json"), "w") as f:
            json.dump({"rows": rows, "failures": failures,
                       "reports": {str(k): v for k, v in K.reports.items()}}, f, indent=1)

    print("\n## summary (bf16 seed003; GB/s = expert weights touched / time; %BW of 3.0 TB/s)")
    print(f"{'T':>6} {'impl':<22} {'ms':>8} {'TFLOP/s':>8} {'GB/s':>7} {'%BW':>5}  tile")
    for T, name, ms, tf, gbs, pct, tile in rows:
        if ms is None:
            print(f"{T:>6} {name:<22} {'n/a':>8}")
        else:
            print(f"{T:>6} {name:<22} {ms:8.3f} {tf:8.1f} {gbs:7.0f} {pct:5.1f}  {tile if tile else ''}")
    print(f"correctness: {'FAIL ' + str(len(failures)) if failures else 'all ok'}")
    for f_ in failures:
        print("  FAIL:", f_)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
