#!/usr/bin/env python3
"""Lane-level NumPy emulation of kernels/moe_grouped_gemm.cu (no GPU): the block -> (expert,
row tile) scan, the row gather table, cp.async 16-byte copies into the XOR-swizzled ring
(with the k-tail zero fill and the slot rotation), ldmatrix(.trans) lane addressing and
fragment layouts, mma.m16n8k16 fragment semantics, and the SwiGLU / f32 epilogues with
row masking. Threads run one after another, so it checks indexing, not races.

  python3 python/dev/emulate_moe_gemm.py          # every tile of the table on small shapes

Exits 1 on any mismatch against a float64 reference.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_nvrtc_check import REGIMES, all_tiles, tile_for  # noqa: E402

BK = 64


class Tile:
    def __init__(self, gemm, t):
        self.G13 = gemm == 13
        self.NB = 2 if self.G13 else 1
        self.BM, self.BN, self.WM, self.WN, self.STAGES, _ = t
        self.THREADS = self.WM * self.WN * 32
        self.WTM, self.WTN = self.BM // self.WM, self.BN // self.WN
        self.MT, self.NT, self.NP = self.WTM // 16, self.WTN // 8, self.WTN // 16
        self.A_PB = BK * 2
        self.B_PB = max(self.BN, 64) * 2
        self.A_BYTES = self.BM * self.A_PB
        self.B_BYTES = BK * self.B_PB
        self.STAGE = self.A_BYTES + self.NB * self.B_BYTES


def find_tile(T, offsets, experts, bx):
    ept = (experts + T.THREADS - 1) // T.THREADS
    mine = []
    for tid in range(T.THREADS):
        lo = min(experts, tid * ept)
        hi = min(experts, lo + ept)
        mine.append(sum((int(offsets[e + 1] - offsets[e]) + T.BM - 1) // T.BM for e in range(lo, hi)))
    # warp scans + warp totals (as the kernel does)
    found = None
    warp_tot = [sum(mine[w * 32:(w + 1) * 32]) for w in range(T.THREADS // 32)]
    for tid in range(T.THREADS):
        w, lane = divmod(tid, 32)
        incl = sum(mine[w * 32: w * 32 + lane + 1])
        base = incl - mine[tid] + sum(warp_tot[:w])
        if base <= bx < base + mine[tid]:
            assert found is None, "two owners"
            lo = min(experts, tid * ept)
            hi = min(experts, lo + ept)
            start = base
            for e in range(lo, hi):
                nt = (int(offsets[e + 1] - offsets[e]) + T.BM - 1) // T.BM
                if bx < start + nt:
                    found = (e, bx - start)
                    break
                start += nt
    return found


def ldsm(smem, addrs, trans):
    """addrs: 32 byte addresses; returns regs[lane][i] = (lo, hi) pairs."""
    mats = []
    for i in range(4):
        m = np.stack([smem[addrs[8 * i + r] // 2: addrs[8 * i + r] // 2 + 8] for r in range(8)])
        mats.append(m)
    regs = [[None] * 4 for _ in range(32)]
    for t in range(32):
        for i in range(4):
            if trans:
                regs[t][i] = (mats[i][2 * (t & 3), t >> 2], mats[i][2 * (t & 3) + 1, t >> 2])
            else:
                regs[t][i] = (mats[i][t >> 2, 2 * (t & 3)], mats[i][t >> 2, 2 * (t & 3) + 1])
    return regs


def mma(c, a, b0, b1):
    """c[lane][4], a[lane][4] pairs, b0/b1[lane] pairs: c += A(16x16) B(16x8)."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, q = t >> 2, t & 3
        for j in range(2):
            A[g, 2 * q + j] = a[t][0][j]
            A[g + 8, 2 * q + j] = a[t][1][j]
            A[g, 2 * q + 8 + j] = a[t][2][j]
            A[g + 8, 2 * q + 8 + j] = a[t][3][j]
            B[2 * q + j, g] = b0[t][j]
            B[2 * q + 8 + j, g] = b1[t][j]
    C = A @ B
    for t in range(32):
        g, q = t >> 2, t & 3
        c[t][0] += C[g, 2 * q]
        c[t][1] += C[g, 2 * q + 1]
        c[t][2] += C[g + 8, 2 * q]
        c[t][3] += C[g + 8, 2 * q + 1]


def run_block(T, a, rowoff, w_list, ldb, K, col0s):
    """Emulate gemm_block; a: flat A; w_list: NB flat weight arrays with the start offsets
    col0s (elements). Returns acc[b][warp][mt][nt][lane][4]."""
    smem = np.full(T.STAGES * T.STAGE // 2, np.nan)
    ktiles = (K + BK - 1) // BK

    def cp(dst, src, off, ok):
        smem[dst // 2: dst // 2 + 8] = src[off:off + 8] if ok else 0.0

    def load_a(st, k0):
        for c in range(T.BM * 8):
            r, ch = c >> 3, c & 7
            ro = rowoff[r]
            k = k0 + ch * 8
            ok = ro >= 0 and k < K
            cp(st + r * T.A_PB + ((ch ^ (r & 7)) << 4), a, ro + k if ok else 0, ok)

    def load_b(st, w, c0, k0):
        cpr = T.BN // 8
        for c in range(BK * cpr):
            r, ch = divmod(c, cpr)
            k = k0 + r
            ok = k < K
            cp(st + r * T.B_PB + ((ch ^ (r & 7)) << 4), w, c0 + (k * ldb + ch * 8 if ok else 0), ok)

    def load(slot, kt):
        st = slot * T.STAGE
        load_a(st, kt * BK)
        for b in range(T.NB):
            load_b(st + T.A_BYTES + b * T.B_BYTES, w_list[b], col0s[b], kt * BK)

    nw = T.WM * T.WN
    acc = [[[[[[0.0] * 4 for _ in range(32)] for _ in range(T.NT)] for _ in range(T.MT)]
            for _ in range(nw)] for _ in range(T.NB)]
    for s in range(T.STAGES - 1):
        if s < ktiles:
            load(s, s)
    slot = 0
    for kt in range(ktiles):
        nx = kt + T.STAGES - 1
        if nx < ktiles:
            load((slot + T.STAGES - 1) % T.STAGES, nx)
        sA = slot * T.STAGE
        sB = sA + T.A_BYTES
        for warp in range(nw):
            wm, wn = divmod(warp, T.WN)
            for kk in range(BK // 16):
                af = []
                for mt in range(T.MT):
                    addrs = [sA + (wm * T.WTM + (l & 15)) * T.A_PB + (((2 * kk + (l >> 4)) ^ (l & 7)) << 4)
                             + mt * 16 * T.A_PB for l in range(32)]
                    af.append(ldsm(smem, addrs, False))
                for b in range(T.NB):
                    for np_ in range(T.NP):
                        addrs = [sB + b * T.B_BYTES + kk * 16 * T.B_PB + (l & 15) * T.B_PB
                                 + (((wn * (T.WTN // 8) + 2 * np_ + (l >> 4)) ^ (l & 7)) << 4) for l in range(32)]
                        br = ldsm(smem, addrs, True)
                        for mt in range(T.MT):
                            mma(acc[b][warp][mt][2 * np_], af[mt], [br[t][0] for t in range(32)], [br[t][1] for t in range(32)])
                            mma(acc[b][warp][mt][2 * np_ + 1], af[mt], [br[t][2] for t in range(32)], [br[t][3] for t in range(32)])
        slot = (slot + 1) % T.STAGES
    assert not any(np.isnan(v) for b in acc for w in b for m in w for n in m for l in n for v in l), "read unwritten smem"
    return acc


def silu_mul(g, u):
    return g * u / (1.0 + np.exp(-g))


def emulate(gemm, tile, x, w13, w2, hbuf, offsets, row_token, H, I, E):
    T = Tile(gemm, tile)
    rows = int(offsets[-1])
    N = I if T.G13 else H
    gx = (rows + T.BM - 1) // T.BM + E
    gy = N // T.BN
    out = np.full((rows, N), np.nan)
    for bx in range(gx):
        f = find_tile(T, offsets, E, bx)
        if f is None:
            continue
        e, tile_i = f
        row0 = int(offsets[e]) + tile_i * T.BM
        nrows = min(T.BM, int(offsets[e + 1]) - row0)
        assert nrows > 0
        if T.G13:
            rowoff = [int(row_token[row0 + r]) * H if r < nrows else -1 for r in range(T.BM)]
        else:
            rowoff = [(row0 + r) * I if r < nrows else -1 for r in range(T.BM)]
        for by in range(gy):
            n0 = by * T.BN
            if T.G13:
                ldb = 2 * I
                base = e * H * ldb + n0
                acc = run_block(T, x.ravel(), rowoff, [w13.ravel(), w13.ravel()], ldb, H, [base, base + I])
            else:
                ldb = H
                base = e * I * ldb + n0
                acc = run_block(T, hbuf.ravel(), rowoff, [w2.ravel()], ldb, I, [base])
            for warp in range(T.WM * T.WN):
                wm, wn = divmod(warp, T.WN)
                for lane in range(32):
                    col = n0 + wn * T.WTN + 2 * (lane & 3)
                    for mt in range(T.MT):
                        for hh in range(2):
                            r = wm * T.WTM + mt * 16 + (lane >> 2) + hh * 8
                            if r < nrows:
                                for nt in range(T.NT):
                                    for j in range(2):
                                        g = acc[0][warp][mt][nt][lane][2 * hh + j]
                                        v = silu_mul(g, acc[1][warp][mt][nt][lane][2 * hh + j]) if T.G13 else g
                                        assert np.isnan(out[row0 + r, col + nt * 8 + j]), "written twice"
                                        out[row0 + r, col + nt * 8 + j] = v
    return out


def main():
    rng = np.random.default_rng(7)
    fails = 0
    # H, I, E, T, k. H=160: k tail in gemm13; E=70 > threads of the BN=32 tiles (several
    # experts per scan thread); T=40: expert 0 spans several row tiles at BM 16 and 32.
    cases = [(128, 96, 5, 9, 2), (160, 128, 3, 6, 2), (128, 96, 70, 40, 2)]
    for H, I, E, T_, k in cases:
        x = rng.standard_normal((T_, H))
        w13 = rng.standard_normal((E, H, 2 * I)) / np.sqrt(H)
        w2 = rng.standard_normal((E, I, H)) / np.sqrt(I)
        # routing: expert 1 gets nothing, expert 0 is skewed (every token)
        ids = np.zeros((T_, k), dtype=int)
        for t in range(T_):
            others = [e for e in range(2, E)]
            ids[t] = [0] + list(rng.choice(others, k - 1, replace=False))
        counts = np.bincount(ids.ravel(), minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        row_token = np.concatenate([[t for t in range(T_) for s in range(k) if ids[t, s] == e] for e in range(E)]).astype(np.int64)
        href = np.zeros((T_ * k, I))
        yref = np.zeros((T_ * k, H))
        for e in range(E):
            r0, r1 = offsets[e], offsets[e + 1]
            xs = x[row_token[r0:r1]]
            g, u = xs @ w13[e][:, :I], xs @ w13[e][:, I:]
            href[r0:r1] = silu_mul(g, u)
            yref[r0:r1] = href[r0:r1] @ w2[e]
        for regime in REGIMES:
            for gemm in (13, 2):
                t = tile_for(regime, gemm, I if gemm == 13 else H)
                if gemm == 13:
                    out = emulate(13, t, x, w13, w2, None, offsets, row_token, H, I, E)
                    ref = href
                else:
                    out = emulate(2, t, x, w13, w2, href, offsets, row_token, H, I, E)
                    ref = yref
                ok = not np.isnan(out).any() and np.allclose(out, ref, rtol=1e-9, atol=1e-9)
                err = np.nanmax(np.abs(out - ref)) if not np.isnan(out).all() else float("nan")
                print(f"H={H} I={I} E={E} T={T_} k={k} {regime:<7} gemm{gemm:<2} tile={t}  max|err|={err:.2e}  {'ok' if ok else 'FAIL'}")
                fails += not ok
    print(f"{fails} failures")
    sys.exit(1 if fails else 0)


if __name__ == "__main__":
    main()
