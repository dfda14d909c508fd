// flashmoe — MoE layer backward, portable path (sm_80 and newer, mma.sync).
//
// Compiled at run time by NVRTC; self-contained. One source, one compile per dtype:
//
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (x, weights, dOut, the 16-bit intermediates and the
//                  weight gradients); every accumulation is fp32.
//
// Entries (ABI mirrored by crates/flashmoe/src/moe/backward.rs, which owns the launch
// shapes; every reduction has a fixed order, nothing accumulates across blocks, so the
// results are bit-identical run to run):
//
//   moe_bwd_gemm_rows   grouped GEMM, groups over the rows (M): for group e (rows
//                       offsets[e] .. offsets[e+1], or one group of total_rows rows when
//                       offsets is null) C[r, n] = sum_k A(r, k) * B_e(k, n), fp32 out.
//                       A(r, k) = a[src(r) * a_rs + k], src(r) = row_token[r] when
//                       a_gather, else r. B_e(k, n) = b[e * b_gs + k * b_ks + n * b_ns]
//                       (b_ks = 1: the weights read as [N][K], i.e. transposed).
//                       grid.x = ceil(total_rows / BM) + groups, grid.y = ceil(N / BN);
//                       a block finds its (group, row tile) by moe_find_tile; surplus
//                       blocks exit.
//   moe_bwd_gemm_wgrad  weight-gradient grouped GEMM, groups over the reduction (K = that
//                       group's rows): C[e, m, n] = sum_r A(r, m) * B(r, n) over the rows
//                       r of group e ascending (one block owns an output tile and walks
//                       all of K: no split-K), 16-bit out. A(r, m) = a[src_a(r) * a_rs +
//                       m], B(r, n) = b[src_b(r) * b_rs + n]. A group with no rows writes
//                       zeros. grid.x = ceil(M / BM) * ceil(N / BN), grid.y = groups.
//   moe_bwd_swiglu      per slot a (one block; slot_row null: row a, topk_w null: w = 1,
//                       dw null: not written): r = slot_row[a], h = silu(g) * u from the
//                       recomputed gu[r] (fp32), G = dOut . W2^T row r (fp32):
//                       dw[a] = sum_j h_j G_j (fixed-shape tree), dH = w G,
//                       dgu[r] = [dH u silu'(g) | dH silu(g)], wh[r] = w h (16-bit).
//   moe_bwd_router_dz   per token: dZ (fp32 [T, E]) from dw, the routing weights, the
//                       recomputed scores and the (d_aux, d_z) pair (null: zeros).
//   moe_bwd_router_dw   per (c, e): d_router[c, e] = sum_t x[t, c] dZ[t, e] (t ascending).
//   moe_bwd_unpermute   per (t, c): dx[t, c] = ((sum_s dx_perm[slot_row[t k + s], c]) +
//                       dx_shared[t, c]) + sum_e dZ[t, e] router[c, e].
//
// GEMM tiles: BM = BN = 64, BK = 32, 4 warps (2 x 2) of 32 x 32, operands staged in shared
// memory K-contiguous ([m][k] and [n][k], padded rows), fragments read as 32-bit pairs.
// Loads are plain (no cp.async pipeline): this is the correctness path; the sm_90a
// wgmma kernels are a later step.

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"
#include "moe_gemm_common.cuh"

#define BW_BM 64
#define BW_BN 64
#define BW_BK 32
#define BW_PAD 8
#define BW_THREADS 128

__device__ __forceinline__ float h2f(u16 v) {
#if FM_DTYPE_BF16
    return __uint_as_float(((u32)v) << 16);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(v));
    return f;
#endif
}
__device__ __forceinline__ u16 f2h(float v) { return (u16)(pack2(v, 0.f) & 0xffffu); }

__device__ __forceinline__ float sigmoid_acc(float z) {
    if (z >= 0.f) return 1.f / (1.f + expf(-z));
    const float e = expf(z);
    return e / (1.f + e);
}

// acc[mt][nt][4] += As (rows wm.., k) x Bs (cols wn.., k) over one BK tile.
__device__ __forceinline__ void bw_mma_tile(const u16 (*As)[BW_BK + BW_PAD],
                                            const u16 (*Bs)[BW_BK + BW_PAD], int wm, int wn,
                                            int lane, float (&acc)[2][4][4]) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kk = 0; kk < BW_BK; kk += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            const int r = wm + mt * 16 + g;
            a[mt][0] = *(const u32*)&As[r][kk + 2 * t];
            a[mt][1] = *(const u32*)&As[r + 8][kk + 2 * t];
            a[mt][2] = *(const u32*)&As[r][kk + 2 * t + 8];
            a[mt][3] = *(const u32*)&As[r + 8][kk + 2 * t + 8];
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
            const int c = wn + nt * 8 + g;
            const u32 b0 = *(const u32*)&Bs[c][kk + 2 * t];
            const u32 b1 = *(const u32*)&Bs[c][kk + 2 * t + 8];
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) mma16816(acc[mt][nt], a[mt], b0, b1);
        }
    }
}

extern "C" __global__ void __launch_bounds__(BW_THREADS)
    moe_bwd_gemm_rows(const u16* __restrict__ a, int a_rs, int a_gather,
                      const u16* __restrict__ b, i64 b_gs, int b_ks, int b_ns,
                      float* __restrict__ c, int ldc, const u32* __restrict__ row_token,
                      const u32* __restrict__ offsets, int groups, int total_rows, int n_cols,
                      int k_dim) {
    __shared__ __align__(16) u16 As[BW_BM][BW_BK + BW_PAD];
    __shared__ __align__(16) u16 Bs[BW_BN][BW_BK + BW_PAD];
    __shared__ u32 scratch[34];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int e = 0, tile = (int)blockIdx.x;
    int row0, rows;
    if (offsets != nullptr) {
        if (!moe_find_tile<BW_BM, BW_THREADS>(offsets, groups, scratch, tid, blockIdx.x, e,
                                              tile))
            return;
        row0 = (int)offsets[e] + tile * BW_BM;
        rows = min(BW_BM, (int)offsets[e + 1] - row0);
    } else {
        row0 = tile * BW_BM;
        rows = min(BW_BM, total_rows - row0);
        if (rows <= 0) return;
    }
    const int n0 = blockIdx.y * BW_BN;
    const u16* be = b + (i64)e * b_gs;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    float acc[2][4][4] = {};
    for (int k0 = 0; k0 < k_dim; k0 += BW_BK) {
        for (int idx = tid; idx < BW_BM * BW_BK; idx += BW_THREADS) {
            const int m = idx / BW_BK, k = idx % BW_BK;
            u16 v = 0;
            if (m < rows && k0 + k < k_dim) {
                const int r = row0 + m;
                const i64 src = a_gather ? (i64)row_token[r] : (i64)r;
                v = a[src * a_rs + k0 + k];
            }
            As[m][k] = v;
        }
        for (int idx = tid; idx < BW_BN * BW_BK; idx += BW_THREADS) {
            int n, k;
            if (b_ks == 1) {
                n = idx / BW_BK;
                k = idx % BW_BK;
            } else {
                k = idx / BW_BN;
                n = idx % BW_BN;
            }
            u16 v = 0;
            if (n0 + n < n_cols && k0 + k < k_dim)
                v = be[(i64)(k0 + k) * b_ks + (i64)(n0 + n) * b_ns];
            Bs[n][k] = v;
        }
        __syncthreads();
        bw_mma_tile(As, Bs, wm, wn, lane, acc);
        __syncthreads();
    }
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = wm + mt * 16 + g + h * 8;
                const int n = n0 + wn + nt * 8 + 2 * t;
                if (m >= rows) continue;
                float* dst = c + (i64)(row0 + m) * ldc + n;
                if (n < n_cols) dst[0] = acc[mt][nt][2 * h];
                if (n + 1 < n_cols) dst[1] = acc[mt][nt][2 * h + 1];
            }
}

extern "C" __global__ void __launch_bounds__(BW_THREADS)
    moe_bwd_gemm_wgrad(const u16* __restrict__ a, int a_rs, int a_gather,
                       const u16* __restrict__ b, int b_rs, int b_gather,
                       u16* __restrict__ c, int m_dim, int n_cols,
                       const u32* __restrict__ row_token, const u32* __restrict__ offsets,
                       int total_rows) {
    __shared__ __align__(16) u16 As[BW_BM][BW_BK + BW_PAD];
    __shared__ __align__(16) u16 Bs[BW_BN][BW_BK + BW_PAD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e = blockIdx.y;
    const int r_lo = offsets != nullptr ? (int)offsets[e] : 0;
    const int r_hi = offsets != nullptr ? (int)offsets[e + 1] : total_rows;
    const int tiles_n = (n_cols + BW_BN - 1) / BW_BN;
    const int m0 = (blockIdx.x / tiles_n) * BW_BM, n0 = (blockIdx.x % tiles_n) * BW_BN;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    float acc[2][4][4] = {};
    for (int k0 = r_lo; k0 < r_hi; k0 += BW_BK) {
        // Both operands are contiguous along m / n: consecutive threads take consecutive
        // columns of one row r.
        for (int idx = tid; idx < BW_BM * BW_BK; idx += BW_THREADS) {
            const int k = idx / BW_BM, m = idx % BW_BM;
            u16 v = 0;
            const int r = k0 + k;
            if (r < r_hi && m0 + m < m_dim) {
                const i64 src = a_gather ? (i64)row_token[r] : (i64)r;
                v = a[src * a_rs + m0 + m];
            }
            As[m][k] = v;
        }
        for (int idx = tid; idx < BW_BN * BW_BK; idx += BW_THREADS) {
            const int k = idx / BW_BN, n = idx % BW_BN;
            u16 v = 0;
            const int r = k0 + k;
            if (r < r_hi && n0 + n < n_cols) {
                const i64 src = b_gather ? (i64)row_token[r] : (i64)r;
                v = b[src * b_rs + n0 + n];
            }
            Bs[n][k] = v;
        }
        __syncthreads();
        bw_mma_tile(As, Bs, wm, wn, lane, acc);
        __syncthreads();
    }
    u16* ce = c + (i64)e * m_dim * n_cols;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + wm + mt * 16 + g + h * 8;
                const int n = n0 + wn + nt * 8 + 2 * t;
                if (m >= m_dim) continue;
                u16* dst = ce + (i64)m * n_cols + n;
                if (n < n_cols) dst[0] = f2h(acc[mt][nt][2 * h]);
                if (n + 1 < n_cols) dst[1] = f2h(acc[mt][nt][2 * h + 1]);
            }
}

#define SW_THREADS 128

extern "C" __global__ void __launch_bounds__(SW_THREADS)
    moe_bwd_swiglu(const float* __restrict__ gu, const float* __restrict__ gmat,
                   const u32* __restrict__ slot_row, const float* __restrict__ topk_w,
                   u16* __restrict__ dgu, u16* __restrict__ wh, float* __restrict__ dw,
                   int inter) {
    __shared__ float red[SW_THREADS];
    const int a = blockIdx.x, tid = threadIdx.x;
    const i64 r = slot_row != nullptr ? (i64)slot_row[a] : (i64)a;
    const float w = topk_w != nullptr ? topk_w[a] : 1.f;
    const float* gur = gu + r * 2 * inter;
    const float* grow = gmat + r * inter;
    u16* dgr = dgu + r * 2 * inter;
    float part = 0.f;
    for (int j = tid; j < inter; j += SW_THREADS) {
        const float gv = gur[j], uv = gur[inter + j], G = grow[j];
        const float s = sigmoid_acc(gv);
        const float silu = gv * s;
        const float h = silu * uv;
        part += h * G;
        const float dh = w * G;
        dgr[j] = f2h(dh * uv * s * (1.f + gv * (1.f - s)));
        dgr[inter + j] = f2h(dh * silu);
        wh[r * inter + j] = f2h(w * h);
    }
    red[tid] = part;
    __syncthreads();
    for (int s = SW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    if (tid == 0 && dw != nullptr) dw[a] = red[0];
}

extern "C" __global__ void moe_bwd_router_dz(const float* __restrict__ logits,
                                             const u32* __restrict__ ids,
                                             const float* __restrict__ topk_w,
                                             const float* __restrict__ dw,
                                             const u32* __restrict__ counts,
                                             const float* __restrict__ dloss,
                                             float* __restrict__ dz, int tokens, int experts,
                                             int top_k, int sigmoid_scoring, int renorm) {
    const int tok = blockIdx.x * blockDim.x + threadIdx.x;
    if (tok >= tokens) return;
    const float* z = logits + (i64)tok * experts;
    const u32* id = ids + (i64)tok * top_k;
    const float* w = topk_w + (i64)tok * top_k;
    const float* g = dw + (i64)tok * top_k;
    float* out = dz + (i64)tok * experts;
    const float d_aux = dloss != nullptr ? dloss[0] : 0.f;
    const float d_z = dloss != nullptr ? dloss[1] : 0.f;
    const float tf = (float)tokens;
    float m = __int_as_float(0xff800000);
    for (int i = 0; i < experts; ++i) m = fmaxf(m, z[i]);
    float se = 0.f;
    for (int i = 0; i < experts; ++i) se += expf(z[i] - m);
    const float lse = m + logf(se);
    auto score = [&](int i) {
        return sigmoid_scoring ? sigmoid_acc(z[i]) : expf(z[i] - lse);
    };
    float ssel = 0.f, dot = 0.f;
    for (int s = 0; s < top_k; ++s) {
        ssel += score((int)id[s]);
        dot += g[s] * w[s];
    }
    const bool rn = renorm && ssel > 0.f;
    auto ds = [&](int i) {
        float v = 0.f;
        for (int s = 0; s < top_k; ++s)
            if ((int)id[s] == i) v += rn ? (g[s] - dot) / ssel : g[s];
        return v;
    };
    auto dp = [&](int i) {
        return d_aux * (float)experts * ((float)counts[i] / (tf * (float)top_k)) / tf;
    };
    if (!sigmoid_scoring) {
        float sg = 0.f;
        for (int i = 0; i < experts; ++i) sg += score(i) * (ds(i) + dp(i));
        for (int i = 0; i < experts; ++i) out[i] = score(i) * (ds(i) + dp(i) - sg);
    } else {
        float total = 0.f;
        for (int i = 0; i < experts; ++i) total += score(i);
        float pdp = 0.f;
        if (total > 0.f)
            for (int i = 0; i < experts; ++i) pdp += score(i) / total * dp(i);
        for (int i = 0; i < experts; ++i) {
            const float s = score(i);
            const float from_aux = total > 0.f ? (dp(i) - pdp) / total : 0.f;
            out[i] = s * (1.f - s) * (ds(i) + from_aux);
        }
    }
    const float cz = d_z * 2.f * lse / tf;
    for (int i = 0; i < experts; ++i) out[i] += cz * expf(z[i] - lse);
}

extern "C" __global__ void moe_bwd_router_dw(const u16* __restrict__ x,
                                             const float* __restrict__ dz,
                                             u16* __restrict__ dr, int tokens, int hidden,
                                             int experts) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)hidden * experts) return;
    const int c = (int)(idx / experts), e = (int)(idx % experts);
    float acc = 0.f;
    for (int t = 0; t < tokens; ++t) acc += h2f(x[(i64)t * hidden + c]) * dz[(i64)t * experts + e];
    dr[idx] = f2h(acc);
}

extern "C" __global__ void moe_bwd_unpermute(const float* __restrict__ dx_perm,
                                             const u32* __restrict__ slot_row,
                                             const float* __restrict__ dx_shared,
                                             const float* __restrict__ dz,
                                             const u16* __restrict__ router,
                                             u16* __restrict__ dx, int tokens, int hidden,
                                             int experts, int top_k) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)tokens * hidden) return;
    const i64 t = idx / hidden;
    const int c = (int)(idx % hidden);
    float acc = 0.f;
    for (int s = 0; s < top_k; ++s) acc += dx_perm[(i64)slot_row[t * top_k + s] * hidden + c];
    if (dx_shared != nullptr) acc += dx_shared[idx];
    float dr = 0.f;
    for (int e = 0; e < experts; ++e) dr += dz[t * experts + e] * h2f(router[(i64)c * experts + e]);
    dx[idx] = f2h(acc + dr);
}
