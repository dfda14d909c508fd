#!/usr/bin/env python3
"""Lane-level emulation of flash_attn_fwd.cu in NumPy, for checking its index math without
a GPU: the swizzled shared-memory layout, the cp.async tile loads (zero fill), the ldmatrix
lane addresses and register orders, the mma.m16n8k16 fragment layouts, the reverse tile
order with masked-first tiles, the online softmax with the safe max, the O staging through
shared memory and the coalesced stores. It transliterates the kernel's arithmetic on lane
indices (same expressions as the .cu) and emulates the PTX instructions from their
documented semantics:

  ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i (8 rows x 8 b16);
      register i of lane t = (M_i[t/4][2(t%4)], M_i[t/4][2(t%4)+1]); with .trans
      = (M_i[2(t%4)][t/4], M_i[2(t%4)+1][t/4]).
  mma m16n8k16 (g = t/4, c = t%4): A a0=(g, 2c..) a1=(g+8, 2c..) a2=(g, 2c+8..)
      a3=(g+8, 2c+8..); B b0=(k 2c.., n g) b1=(k 2c+8.., n g); C c0,c1=(g, 2c..)
      c2,c3=(g+8, 2c..).

Shared memory starts as NaN so a read of anything not written shows up in the output.
Usage: python3 python/dev/emulate_flash.py   (runs a shape matrix, exits non-zero on error)
"""
import itertools
import math
import sys

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__file__))
from nvrtc_check import V1_TILES  # noqa: E402


def round_dtype(x, bf16):
    x = np.asarray(x, dtype=np.float32)
    if not bf16:
        return x.astype(np.float16).astype(np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16  # round to nearest even
    return (b.astype(np.uint32)).view(np.float32)


class Cfg:
    def __init__(self, D, tile, causal, bf16):
        self.D = D
        self.BM, self.BN, self.WARPS, self.STAGES, self.Q_IN_REGS, _, self.SN = tile
        self.THREADS = self.WARPS * 32
        self.RPW = self.BM // self.WARPS
        self.MT = self.RPW // 16
        self.PITCH = 64 if D <= 64 else (128 if D <= 128 else 256)
        self.PITCH_B = self.PITCH * 2
        self.CPR = D // 8
        self.DT = D // 8
        self.KD = D // 16
        self.NSUB = self.BN // self.SN
        self.NT = self.SN // 8
        self.KN = self.SN // 16
        self.Q_BYTES = self.BM * self.PITCH_B
        self.KV_TILE_BYTES = self.BN * self.PITCH_B
        self.SMEM_BYTES = 2 * self.PITCH * (self.BM + 2 * self.STAGES * self.BN)
        self.causal = causal
        self.bf16 = bf16


def swz(c, r, ch):
    return r * c.PITCH_B + ((ch ^ (r & 7)) << 4)


LANE = np.arange(32)


class Smem:
    def __init__(self, nbytes):
        self.m = np.full(nbytes // 2, np.nan, dtype=np.float32)
        self.pending = []  # cp.async writes not yet complete: (group, dst, values)

    def row8(self, addr):
        assert addr % 16 == 0, addr
        return self.m[addr // 2: addr // 2 + 8]


def load_tile(c, sm, rows, dst0, g0, dst1, g1, row0, nrows, tid_all):
    """g0/g1: (seq, D) arrays. Mirrors load_tile<ROWS, TWO> (fast and generic paths)."""
    TOTAL = rows * c.CPR
    ITERS = (TOTAL + c.THREADS - 1) // c.THREADS
    writes = []
    fast = c.THREADS % c.CPR == 0 and (c.THREADS // c.CPR) % 8 == 0
    for tid in tid_all:
        for it in range(ITERS):
            if fast:
                RSTEP = c.THREADS // c.CPR
                r0, ch = tid // c.CPR, tid % c.CPR
                if not (TOTAL % c.THREADS == 0 or tid + it * c.THREADS < TOTAL):
                    continue
                r = r0 + it * RSTEP
                ok = it * RSTEP < nrows - row0 - r0
                so = swz(c, r0, ch) + it * RSTEP * c.PITCH_B
                assert so == swz(c, r, ch)
            else:
                cc = tid + it * c.THREADS
                if not (TOTAL % c.THREADS == 0 or cc < TOTAL):
                    continue
                r, ch = cc // c.CPR, cc % c.CPR
                ok = row0 + r < nrows
                so = swz(c, r, ch)
            for dst, g in ((dst0, g0), (dst1, g1)):
                if g is None:
                    continue
                vals = g[row0 + r, ch * 8: ch * 8 + 8] if ok else np.zeros(8, np.float32)
                writes.append((dst + so, np.array(vals, dtype=np.float32)))
    return writes


def commit(sm, writes, group):
    sm.pending.append((group, writes))


def wait_group(sm, n):
    """cp.async.wait_group n (collectively for all threads; the barrier that follows makes
    it visible to all)."""
    while len(sm.pending) > n:
        _, writes = sm.pending.pop(0)
        for addr, vals in writes:
            sm.m[addr // 2: addr // 2 + 8] = vals


def ldsm(sm, addr, trans=False):
    """addr: per-lane byte addresses (32,). Returns regs (4, 32, 2)."""
    regs = np.zeros((4, 32, 2), np.float32)
    for i in range(4):
        M = np.stack([sm.row8(int(addr[8 * i + j])) for j in range(8)])  # (8 rows, 8 cols)
        for t in range(32):
            if not trans:
                regs[i, t] = M[t // 4, 2 * (t % 4): 2 * (t % 4) + 2]
            else:
                regs[i, t] = M[2 * (t % 4): 2 * (t % 4) + 2, t // 4]
    return regs


def mma(cacc, a, b0, b1):
    """cacc (32,4) fp32, a (4,32,2), b0/b1 (32,2)."""
    A = np.zeros((16, 16), np.float64)
    B = np.zeros((16, 8), np.float64)
    C = np.zeros((16, 8), np.float64)
    for t in range(32):
        g, q = t // 4, t % 4
        A[g, 2 * q: 2 * q + 2] = a[0, t]
        A[g + 8, 2 * q: 2 * q + 2] = a[1, t]
        A[g, 2 * q + 8: 2 * q + 10] = a[2, t]
        A[g + 8, 2 * q + 8: 2 * q + 10] = a[3, t]
        B[2 * q: 2 * q + 2, g] = b0[t]
        B[2 * q + 8: 2 * q + 10, g] = b1[t]
        C[g, 2 * q: 2 * q + 2] = cacc[t, 0:2]
        C[g + 8, 2 * q: 2 * q + 2] = cacc[t, 2:4]
    C = C + A @ B
    out = np.zeros_like(cacc)
    for t in range(32):
        g, q = t // 4, t % 4
        out[t, 0:2] = C[g, 2 * q: 2 * q + 2]
        out[t, 2:4] = C[g + 8, 2 * q: 2 * q + 2]
    return out.astype(np.float32)


def run_cta(c, q, k, v, o, lse, b, head, bx, Sq, Sk, Hq, Hkv, scale_log2, grid_x):
    NEG = -np.inf
    m_block = (grid_x - 1 - bx) if c.causal else bx
    kv_head = head // (Hq // Hkv)
    m0 = m_block * c.BM
    qg = q[b, :, head, :]
    kg = k[b, :, kv_head, :]
    vg = v[b, :, kv_head, :]
    sm = Smem(c.SMEM_BYTES)
    sQ = 0
    sK0 = sQ + c.Q_BYTES
    sV0 = sK0 + c.STAGES * c.KV_TILE_BYTES
    diag = Sk - Sq
    n_end = Sk
    if c.causal:
        n_end = max(0, min(Sk, m0 + c.BM + diag))
    n_tiles = (n_end + c.BN - 1) // c.BN
    thr = Sk - c.BN + 1
    if c.causal:
        thr = min(thr, m0 + diag - c.BN + 2)
    first_masked = 0 if thr <= 0 else (thr + c.BN - 1) // c.BN
    n_masked = max(0, n_tiles - first_masked)
    tids = range(c.THREADS)

    commit(sm, load_tile(c, sm, c.BM, sQ, qg, 0, None, m0, Sq, tids), "Q")
    for st in range(c.STAGES - 1):
        w = []
        if st < n_tiles:
            n0 = (n_tiles - 1 - st) * c.BN
            w = load_tile(c, sm, c.BN, sK0 + st * c.KV_TILE_BYTES, kg, sV0 + st * c.KV_TILE_BYTES, vg, n0, Sk, tids)
        commit(sm, w, st)

    W = c.WARPS
    oacc = np.zeros((W, c.MT, c.DT, 32, 4), np.float32)
    m_i = np.full((W, c.MT, 2, 32), NEG, np.float32)
    l_i = np.zeros((W, c.MT, 2, 32), np.float32)
    li, lr = LANE >> 3, LANE & 7
    lb = [((li & 1) * 8 + lr) * c.PITCH_B + (((2 * j) ^ (lr ^ (li >> 1))) << 4) for j in range(4)]
    kb = [((li >> 1) * 8 + lr) * c.PITCH_B + (((2 * j) ^ (lr ^ (li & 1))) << 4) for j in range(4)]
    sQw = [sQ + w * c.RPW * c.PITCH_B for w in range(W)]
    qf = None
    if c.Q_IN_REGS:
        wait_group(sm, c.STAGES - 1)
        qf = [[[ldsm(sm, sQw[w] + lb[kk & 3] + (kk >> 2) * 128 + mt * 16 * c.PITCH_B)
                for kk in range(c.KD)] for mt in range(c.MT)] for w in range(W)]

    slot = 0
    for i in range(n_tiles):
        wait_group(sm, c.STAGES - 2)
        nx = i + c.STAGES - 1
        w_ = []
        if nx < n_tiles:
            ns = slot + c.STAGES - 1
            if ns >= c.STAGES:
                ns -= c.STAGES
            n0n = (n_tiles - 1 - nx) * c.BN
            w_ = load_tile(c, sm, c.BN, sK0 + ns * c.KV_TILE_BYTES, kg, sV0 + ns * c.KV_TILE_BYTES, vg, n0n, Sk, tids)
        commit(sm, w_, nx)
        n0t = (n_tiles - 1 - i) * c.BN
        sKt = sK0 + slot * c.KV_TILE_BYTES
        sVt = sV0 + slot * c.KV_TILE_BYTES
        mask = i < n_masked
        for sub in range(c.NSUB):
          n0 = n0t + sub * c.SN
          sK = sKt + sub * c.SN * c.PITCH_B
          sV = sVt + sub * c.SN * c.PITCH_B
          for w in range(W):
              row_base = m0 + w * c.RPW
              s = np.zeros((c.MT, c.NT, 32, 4), np.float32)
              for kk in range(c.KD):
                  a = [qf[w][mt][kk] if c.Q_IN_REGS else
                       ldsm(sm, sQw[w] + lb[kk & 3] + (kk >> 2) * 128 + mt * 16 * c.PITCH_B)
                       for mt in range(c.MT)]
                  for np_ in range(c.KN):
                      bb = ldsm(sm, sK + kb[kk & 3] + (kk >> 2) * 128 + np_ * 16 * c.PITCH_B)
                      for mt in range(c.MT):
                          s[mt, 2 * np_] = mma(s[mt, 2 * np_], a[mt], bb[0], bb[1])
                          s[mt, 2 * np_ + 1] = mma(s[mt, 2 * np_ + 1], a[mt], bb[2], bb[3])
              if mask:
                  col0 = n0 + 2 * (LANE & 3)
                  for mt in range(c.MT):
                      for h in range(2):
                          row = row_base + mt * 16 + (LANE >> 2) + h * 8
                          limit = np.full(32, Sk)
                          if c.causal:
                              limit = np.minimum(limit, row + diag + 1)
                          for nt in range(c.NT):
                              for e in range(2):
                                  sel = col0 + nt * 8 + e >= limit
                                  s[mt, nt, sel, 2 * h + e] = NEG
              pa = np.zeros((c.MT, c.KN, 4, 32, 2), np.float32)
              for mt in range(c.MT):
                  for h in range(2):
                      mx = np.full(32, NEG, np.float32)
                      for nt in range(c.NT):
                          mx = np.maximum(mx, np.maximum(s[mt, nt, :, 2 * h], s[mt, nt, :, 2 * h + 1]))
                      mx = np.maximum(mx, mx[LANE ^ 1])
                      mx = np.maximum(mx, mx[LANE ^ 2])
                      with np.errstate(invalid="ignore"):
                          m_new = np.maximum(m_i[w, mt, h], mx * np.float32(scale_log2))
                      m_use = np.where(m_new == NEG, np.float32(0), m_new)
                      alpha = np.exp2(m_i[w, mt, h] - m_use)
                      m_i[w, mt, h] = m_new
                      ssum = np.zeros(32, np.float32)
                      for nt in range(c.NT):
                          p0 = np.exp2(s[mt, nt, :, 2 * h] * np.float32(scale_log2) - m_use)
                          p1 = np.exp2(s[mt, nt, :, 2 * h + 1] * np.float32(scale_log2) - m_use)
                          ssum += p0 + p1
                          pa[mt, nt >> 1, (nt & 1) * 2 + h] = np.stack(
                              [round_dtype(p0, c.bf16), round_dtype(p1, c.bf16)], axis=1)
                      l_i[w, mt, h] = l_i[w, mt, h] * alpha + ssum
                      oacc[w, mt, :, :, 2 * h] *= alpha
                      oacc[w, mt, :, :, 2 * h + 1] *= alpha
              for kk in range(c.KN):
                  for dp in range(c.DT // 2):
                      bb = ldsm(sm, sV + lb[dp & 3] + (dp >> 2) * 128 + kk * 16 * c.PITCH_B, trans=True)
                      for mt in range(c.MT):
                          oacc[w, mt, 2 * dp] = mma(oacc[w, mt, 2 * dp], pa[mt, kk], bb[0], bb[1])
                          oacc[w, mt, 2 * dp + 1] = mma(oacc[w, mt, 2 * dp + 1], pa[mt, kk], bb[2], bb[3])
        slot += 1
        if slot == c.STAGES:
            slot = 0

    wait_group(sm, 0)
    LN2 = math.log(2.0)
    for w in range(W):
        row_base = m0 + w * c.RPW
        for mt in range(c.MT):
            for h in range(2):
                l = l_i[w, mt, h].copy()
                l = l + l[LANE ^ 1]
                l = l + l[LANE ^ 2]
                inv = np.where(l > 0, 1.0 / np.where(l > 0, l, 1), 0).astype(np.float32)
                oacc[w, mt, :, :, 2 * h] *= inv
                oacc[w, mt, :, :, 2 * h + 1] *= inv
                row = row_base + mt * 16 + (LANE >> 2) + h * 8
                for t in range(0, 32, 4):
                    if row[t] < Sq:
                        lse[b, head, row[t]] = (m_i[w, mt, h, t] + math.log2(l[t])) * LN2 if l[t] > 0 else NEG
        # stage O in this warp's Q rows
        for mt in range(c.MT):
            for dt in range(c.DT):
                for h in range(2):
                    r = mt * 16 + (LANE >> 2) + h * 8
                    for t in range(32):
                        addr = sQw[w] + swz(c, int(r[t]), dt) + (t & 3) * 4
                        vals = round_dtype(oacc[w, mt, dt, t, 2 * h: 2 * h + 2], c.bf16)
                        sm.m[addr // 2: addr // 2 + 2] = vals
        OCH = c.RPW * c.CPR
        for it in range((OCH + 31) // 32):
            for lane in range(32):
                cc = lane + it * 32
                if OCH % 32 == 0 or cc < OCH:
                    r, ch = cc // c.CPR, cc % c.CPR
                    grow = row_base + r
                    vals = sm.row8(sQw[w] + swz(c, r, ch)).copy()
                    if grow < Sq:
                        o[b, grow, head, ch * 8: ch * 8 + 8] = vals


def emulate(q, k, v, causal, bf16, tile, scale):
    B, Sq, Hq, D = q.shape
    _, Sk, Hkv, _ = k.shape
    c = Cfg(D, tile, causal, bf16)
    o = np.full(q.shape, np.nan, np.float32)
    lse = np.full((B, Hq, Sq), np.nan, np.float32)
    grid_x = (Sq + c.BM - 1) // c.BM
    for b, h, bx in itertools.product(range(B), range(Hq), range(grid_x)):
        run_cta(c, q, k, v, o, lse, b, h, bx, Sq, Sk, Hq, Hkv, scale * math.log2(math.e), grid_x)
    return o, lse


def reference(q, k, v, causal, scale):
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    qd, kd, vd = (x.astype(np.float64) for x in (q, k, v))
    kd = np.repeat(kd, rep, axis=2)
    vd = np.repeat(vd, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qd, kd) * scale
    if causal:
        i = np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        s = np.where(j <= i + Sk - Sq, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    mx_safe = np.where(np.isfinite(mx), mx, 0)
    p = np.exp(s - mx_safe)
    l = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(l > 0, l, 1), vd)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + mx_safe[..., 0], -np.inf)
    return o, lse


def main():
    rng = np.random.default_rng(0)
    cases = [
        # (D, tile override or None, causal, bf16, B, Hq, Hkv, Sq, Sk)
        (128, None, False, True, 1, 2, 1, 130, 77),
        (128, None, True, False, 1, 1, 1, 70, 150),
        (128, None, True, True, 1, 2, 2, 150, 40),   # rows with no visible key
        (64, None, False, False, 1, 4, 1, 33, 129),
        (64, None, True, True, 2, 1, 1, 129, 129),
        (32, None, True, False, 1, 1, 1, 17, 200),
        (96, None, False, True, 1, 1, 1, 40, 45),
        (256, None, True, True, 1, 1, 1, 20, 70),
        (128, (128, 64, 8, 2, 1, 1, 64), True, True, 1, 1, 1, 100, 130),   # MT=1, Q in regs
        (128, (128, 128, 8, 2, 1, 1, 32), False, True, 1, 2, 1, 100, 300),  # 4 sub-tiles
        (128, (128, 64, 4, 2, 0, 2, 64), False, False, 1, 1, 1, 1, 1),
        # causal boundary: thr = m0 + diag - BN + 2 is a positive multiple of BN, so tile
        # thr/BN is the first one that needs its mask (tiles: D=128 BN=64, D=64 BN=128)
        (128, None, True, True, 1, 1, 1, 10, 136),
        (64, None, True, False, 1, 8, 2, 10, 264),
        (128, None, True, False, 1, 1, 1, 138, 264),
    ]
    fails = 0
    for D, tile, causal, bf16, B, Hq, Hkv, Sq, Sk in cases:
        tile = tile or V1_TILES[D]
        q = round_dtype(rng.standard_normal((B, Sq, Hq, D)), bf16)
        k = round_dtype(rng.standard_normal((B, Sk, Hkv, D)), bf16)
        v = round_dtype(rng.standard_normal((B, Sk, Hkv, D)), bf16)
        scale = 1 / math.sqrt(D)
        o, lse = emulate(q, k, v, causal, bf16, tile, scale)
        ro, rlse = reference(q, k, v, causal, scale)
        nan = np.isnan(o).any() or np.isnan(lse).any()
        rel = np.linalg.norm(o - ro) / max(np.linalg.norm(ro), 1e-30)
        fin = np.isfinite(rlse)
        lse_ok = np.array_equal(np.isfinite(lse), fin) and (
            not fin.any() or np.abs(lse[fin] - rlse[fin]).max() < 1e-3)
        tol = 1.5e-2 if bf16 else 2e-3
        ok = (not nan) and rel < tol and lse_ok
        fails += not ok
        print(f"D={D:3d} tile={tile} causal={int(causal)} {'bf16' if bf16 else 'fp16'} "
              f"B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk}: relL2={rel:.2e} "
              f"lse_err={np.abs(lse[fin] - rlse[fin]).max() if fin.any() else 0:.1e} nan={nan} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    print(f"{len(cases) - fails} passed, {fails} failed")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
