// flashmoe — MoE layer backward, portable path (sm_80 and newer, mma.sync).
//
// Compiled at run time by NVRTC; self-contained. One source, one compile per dtype:
//
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (x, weights, dOut, the 16-bit intermediates and the
//                  weight gradients); every accumulation is fp32.
//
// Entries (ABI mirrored by crates/flashmoe/src/moe/backward/, which owns the launch
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
//   moe_bwd_swiglu_saved  the same with gu the forward's saved pre-activations (16-bit).
//   moe_bwd_router_dz   one warp per token (lanes over experts, fixed butterfly sums):
//                       dZ (fp32 [T, E]) from dw, the routing weights, the recomputed
//                       scores and the (d_aux, d_z) pair (null: zeros). grid.x · blockDim.x
//                       >= 32 T.
//   moe_bwd_router_dw   per (c, e) and token chunk z (blockIdx.z, `chunk` tokens):
//                       part[z, c, e] = sum_t x[t, c] dZ[t, e] over the chunk (tf32 mma,
//                       dZ as hi + lo, 8 tokens per step ascending). grid (H / 64, E / 64,
//                       chunks), 128 threads.
//   moe_bwd_router_dw_sum  d_router[c, e] = sum_z part[z, c, e], z ascending (16-bit out).
//   moe_bwd_unpermute   per (t, c): dx[t, c] = ((sum_s dx_perm[slot_row[t k + s], c]) +
//                       dx_shared[t, c]) + sum_e dZ[t, e] router[c, e] (the last sum by
//                       tf32 mma, dZ as hi + lo). grid (T / 64, H / 64), 128 threads.
//
// GEMM tiles: see the GB_* defines below (pipelined cp.async + ldmatrix + mma.sync).

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"
#include "fm_warp.cuh"
#include "moe_gemm_common.cuh"

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

// GEMM tiles: BM = BN = 128, BK = 64, 8 warps (2 along M x 4 along N) of 64 x 32, a
// GB_STAGES-deep cp.async ring of 16-byte copies (dynamic shared memory, GB_SMEM_BYTES),
// fragments by ldmatrix. An operand tile is stored either K-contiguous ([mn][64], 128-byte
// rows, 16-byte chunk c at c ^ (mn & 7)) or MN-contiguous ([64][128], 256-byte rows, chunk
// c at c ^ (k & 7)): the swizzles make every ldmatrix phase hit 8 distinct bank groups.
// K-contiguous tiles are read by ldmatrix, MN-contiguous ones by ldmatrix.trans, so no
// operand is transposed on the way in. Tails: rows past a group's end, columns past N and
// k past K are zero-filled (cp.async with 0 source bytes); K and N are multiples of 32.
#define GB_BM 128
#define GB_BN 128
#define GB_BK 64
#define GB_STAGES 3
#define GB_THREADS 256
#define GB_SMEM_BYTES (GB_STAGES * 2 * GB_BM * GB_BK * 2)
// The weight-gradient GEMM's slices: its blocks walk only an expert's rows (few slices at
// small token counts), where a shallower BK and a deeper ring measured faster.
#define WG_BK 32
#define WG_STAGES 4
#define WG_SMEM_BYTES (WG_STAGES * 2 * GB_BM * WG_BK * 2)

// Byte offset of element (mn, k) in a K-contiguous tile.
__device__ __forceinline__ u32 gb_kmaj(int mn, int k) {
    return (u32)(mn * 128 + ((((k >> 3) ^ mn) & 7) << 4) + ((k & 7) << 1));
}
// Byte offset of element (k, mn) in an MN-contiguous tile.
__device__ __forceinline__ u32 gb_mnmaj(int k, int mn) {
    return (u32)(k * 256 + (((mn >> 3) ^ (k & 7)) << 4) + ((mn & 7) << 1));
}

// acc[mt][nt] += A (rows wm.., 64) x B (cols wn.., 32) over one BK slice of the stage at
// sa (A) / sb (B).
template <int BK, bool A_KMAJ, bool B_KMAJ>
__device__ __forceinline__ void gb_mma_stage(u32 sa, u32 sb, int wm, int wn, int lane,
                                             float (&acc)[4][4][4]) {
    const int q = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        u32 a[4][4];
#pragma unroll
        for (int mt = 0; mt < 4; ++mt) {
            const int m = wm + mt * 16 + (q & 1) * 8;
            const int k = kk + (q >> 1) * 8;
            if (A_KMAJ)
                ldsm_x4(sa + gb_kmaj(m + r8, k), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
            else
                ldsm_x4_t(sa + gb_mnmaj(k + r8, m), a[mt][0], a[mt][1], a[mt][2], a[mt][3]);
        }
        u32 b[4][2];
#pragma unroll
        for (int np = 0; np < 2; ++np) {
            const int n = wn + np * 16 + (q >> 1) * 8;
            const int k = kk + (q & 1) * 8;
            if (B_KMAJ)
                ldsm_x4(sb + gb_kmaj(n + r8, k), b[2 * np][0], b[2 * np][1], b[2 * np + 1][0],
                        b[2 * np + 1][1]);
            else
                ldsm_x4_t(sb + gb_mnmaj(k + r8, n), b[2 * np][0], b[2 * np][1],
                          b[2 * np + 1][0], b[2 * np + 1][1]);
        }
#pragma unroll
        for (int mt = 0; mt < 4; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) mma16816(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
}

// The pipelined main loop over `nk` BK slices: load(stage_base_a, stage_base_b, slice)
// issues this thread's cp.async copies of one slice.
template <int BK, int STAGES, bool A_KMAJ, bool B_KMAJ, typename Load>
__device__ __forceinline__ void gb_mainloop(u32 smem, int nk, int wm, int wn, int lane,
                                            float (&acc)[4][4][4], Load load) {
    constexpr u32 TILE = GB_BM * BK * 2, STAGE = 2 * TILE;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < nk) load(smem + s * STAGE, smem + s * STAGE + TILE, s);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; ++kt) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();
        const int pre = kt + STAGES - 1;
        if (pre < nk) {
            const u32 st = smem + (pre % STAGES) * STAGE;
            load(st, st + TILE, pre);
        }
        cp_async_commit();
        const u32 st = smem + (kt % STAGES) * STAGE;
        gb_mma_stage<BK, A_KMAJ, B_KMAJ>(st, st + TILE, wm, wn, lane, acc);
    }
    cp_async_wait<0>();
}

template <bool B_KMAJ>
__device__ __forceinline__ void gb_rows(const u16* __restrict__ a, int a_rs, int a_gather,
                                        const u16* __restrict__ be, int b_ks, int b_ns,
                                        float* __restrict__ c, int ldc,
                                        const u32* __restrict__ row_token, int row0, int rows,
                                        int n0, int n_cols, int k_dim, u32 smem) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    // This thread's four A chunks: rows tid / 8 + 32 i, chunk tid % 8.
    const int ac = tid & 7;
    const u16* arow[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int m = (tid >> 3) + i * 32;
        arow[i] = nullptr;
        if (m < rows) {
            const int r = row0 + m;
            const i64 src = a_gather ? (i64)row_token[r] : (i64)r;
            arow[i] = a + src * a_rs + ac * 8;
        }
    }
    auto load = [&](u32 sa, u32 sb, int kt) {
        const int k0 = kt * GB_BK;
        const bool a_k = k0 + ac * 8 < k_dim;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m = (tid >> 3) + i * 32;
            const bool ok = arow[i] != nullptr && a_k;
            cp_async16(sa + gb_kmaj(m, ac * 8), ok ? arow[i] + k0 : a, ok);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int idx = tid + i * GB_THREADS;
            if (B_KMAJ) {  // B(k, n) = be[n * b_ns + k]: rows n, chunk idx % 8
                const int n = idx >> 3, ch = idx & 7;
                const bool ok = n0 + n < n_cols && k0 + ch * 8 < k_dim;
                cp_async16(sb + gb_kmaj(n, ch * 8),
                           ok ? be + (i64)(n0 + n) * b_ns + k0 + ch * 8 : be, ok);
            } else {  // B(k, n) = be[k * b_ks + n]: rows k, chunk idx % 16
                const int k = idx >> 4, ch = idx & 15;
                const bool ok = n0 + ch * 8 < n_cols && k0 + k < k_dim;
                cp_async16(sb + gb_mnmaj(k, ch * 8),
                           ok ? be + (i64)(k0 + k) * b_ks + n0 + ch * 8 : be, ok);
            }
        }
    };
    float acc[4][4][4] = {};
    gb_mainloop<GB_BK, GB_STAGES, true, B_KMAJ>(smem, (k_dim + GB_BK - 1) / GB_BK, wm, wn,
                                                lane, acc, load);
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = wm + mt * 16 + g + h * 8;
                const int n = n0 + wn + nt * 8 + 2 * t;
                if (m < rows && n < n_cols)
                    st_global_f32x2(c + (i64)(row0 + m) * ldc + n, acc[mt][nt][2 * h],
                                    acc[mt][nt][2 * h + 1]);
            }
}

extern "C" __global__ void __launch_bounds__(GB_THREADS, 2)
    moe_bwd_gemm_rows(const u16* __restrict__ a, int a_rs, int a_gather,
                      const u16* __restrict__ b, i64 b_gs, int b_ks, int b_ns,
                      float* __restrict__ c, int ldc, const u32* __restrict__ row_token,
                      const u32* __restrict__ offsets, int groups, int total_rows, int n_cols,
                      int k_dim) {
    extern __shared__ __align__(128) unsigned char gb_smem[];
    __shared__ u32 scratch[34];
    const int tid = threadIdx.x;
    int e = 0, tile = (int)blockIdx.x;
    int row0, rows;
    if (offsets != nullptr) {
        if (!moe_find_tile<GB_BM, GB_THREADS>(offsets, groups, scratch, tid, blockIdx.x, e,
                                              tile))
            return;
        row0 = (int)offsets[e] + tile * GB_BM;
        rows = min(GB_BM, (int)offsets[e + 1] - row0);
    } else {
        row0 = tile * GB_BM;
        rows = min(GB_BM, total_rows - row0);
        if (rows <= 0) return;
    }
    const int n0 = blockIdx.y * GB_BN;
    const u16* be = b + (i64)e * b_gs;
    const u32 smem = smem_addr(gb_smem);
    if (b_ks == 1)
        gb_rows<true>(a, a_rs, a_gather, be, b_ks, b_ns, c, ldc, row_token, row0, rows, n0,
                      n_cols, k_dim, smem);
    else
        gb_rows<false>(a, a_rs, a_gather, be, b_ks, b_ns, c, ldc, row_token, row0, rows, n0,
                       n_cols, k_dim, smem);
}

extern "C" __global__ void __launch_bounds__(GB_THREADS, 2)
    moe_bwd_gemm_wgrad(const u16* __restrict__ a, int a_rs, int a_gather,
                       const u16* __restrict__ b, int b_rs, int b_gather,
                       u16* __restrict__ c, int m_dim, int n_cols,
                       const u32* __restrict__ row_token, const u32* __restrict__ offsets,
                       int total_rows) {
    extern __shared__ __align__(128) unsigned char gb_smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e = blockIdx.y;
    const int r_lo = offsets != nullptr ? (int)offsets[e] : 0;
    const int r_hi = offsets != nullptr ? (int)offsets[e + 1] : total_rows;
    const int tiles_n = (n_cols + GB_BN - 1) / GB_BN;
    const int m0 = (blockIdx.x / tiles_n) * GB_BM, n0 = (blockIdx.x % tiles_n) * GB_BN;
    const int wm = (warp >> 2) * 64, wn = (warp & 3) * 32;
    const u32 smem = smem_addr(gb_smem);
    // Both operands are MN-contiguous ([row r][m] and [row r][n]): this thread's chunks
    // are rows tid / 16 + 16 i of the WG_BK-row slice, chunk tid % 16.
    const int ch = tid & 15;
    const bool a_ok = m0 + ch * 8 < m_dim, b_ok = n0 + ch * 8 < n_cols;
    auto load = [&](u32 sa, u32 sb, int kt) {
#pragma unroll
        for (int i = 0; i < WG_BK / 16; ++i) {
            const int k = (tid >> 4) + i * 16;
            const int r = r_lo + kt * WG_BK + k;
            const bool in = r < r_hi;
            i64 sa_row = 0, sb_row = 0;
            if (in) {
                const u32 tok = a_gather || b_gather ? row_token[r] : 0u;
                sa_row = a_gather ? (i64)tok : (i64)r;
                sb_row = b_gather ? (i64)tok : (i64)r;
            }
            cp_async16(sa + gb_mnmaj(k, ch * 8),
                       in && a_ok ? a + sa_row * a_rs + m0 + ch * 8 : a, in && a_ok);
            cp_async16(sb + gb_mnmaj(k, ch * 8),
                       in && b_ok ? b + sb_row * b_rs + n0 + ch * 8 : b, in && b_ok);
        }
    };
    float acc[4][4][4] = {};
    gb_mainloop<WG_BK, WG_STAGES, false, false>(smem, (r_hi - r_lo + WG_BK - 1) / WG_BK, wm,
                                                wn, lane, acc, load);
    u16* ce = c + (i64)e * m_dim * n_cols;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < 4; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + wm + mt * 16 + g + h * 8;
                const int n = n0 + wn + nt * 8 + 2 * t;
                if (m < m_dim && n < n_cols)
                    st_global_u32(ce + (i64)m * n_cols + n,
                                  pack2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]));
            }
}

#define SW_THREADS 128

// Eight consecutive pre-activations from a 16-byte aligned address: one 16-byte load of
// 16-bit values, two of f32.
__device__ __forceinline__ void gu_load8(const u16* p, float (&v)[8]) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = h2f((u16)(w[i] & 0xffffu));
        v[2 * i + 1] = h2f((u16)(w[i] >> 16));
    }
}
__device__ __forceinline__ void gu_load8(const float* p, float (&v)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The SwiGLU backward of one element: dgu's gate and up parts, w h, and h G for dw.
struct SwigluGrad {
    float dg, du, wh, hg;
};
__device__ __forceinline__ SwigluGrad swiglu_grad(float gv, float uv, float G, float w) {
    const float s = sigmoid_acc(gv);
    const float silu = gv * s;
    const float h = silu * uv;
    const float dh = w * G;
    return {dh * uv * s * (1.f + gv * (1.f - s)), dh * silu, w * h, h * G};
}

// gu: T = float (recomputed) or u16 (saved by the forward). inter is a multiple of 32 (the
// plan's rule), so every row is 16-byte aligned and each thread takes 8 consecutive
// columns a step: 16-byte loads and stores (one element a thread a step measured
// 2.2-2.4 TB/s on the H200). Each thread sums its h G in column order, the block by a
// fixed tree: bit-identical run to run.
template <typename T>
__device__ __forceinline__ void swiglu_bwd(const T* __restrict__ gu, const float* __restrict__ gmat,
                                           const u32* __restrict__ slot_row,
                                           const float* __restrict__ topk_w,
                                           u16* __restrict__ dgu, u16* __restrict__ wh,
                                           float* __restrict__ dw, int inter) {
    __shared__ float red[SW_THREADS];
    const int a = blockIdx.x, tid = threadIdx.x;
    const i64 r = slot_row != nullptr ? (i64)slot_row[a] : (i64)a;
    const float w = topk_w != nullptr ? topk_w[a] : 1.f;
    const T* gur = gu + r * 2 * inter;
    const float* grow = gmat + r * inter;
    u16* dgr = dgu + r * 2 * inter;
    u16* whr = wh + r * inter;
    float part = 0.f;
    for (int j = 8 * tid; j < inter; j += 8 * SW_THREADS) {
        float gv[8], uv[8], G[8];
        gu_load8(gur + j, gv);
        gu_load8(gur + inter + j, uv);
        gu_load8(grow + j, G);
        u32 dg[4], du[4], hw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const SwigluGrad e0 = swiglu_grad(gv[2 * i], uv[2 * i], G[2 * i], w);
            const SwigluGrad e1 = swiglu_grad(gv[2 * i + 1], uv[2 * i + 1], G[2 * i + 1], w);
            part += e0.hg;
            part += e1.hg;
            dg[i] = pack2(e0.dg, e1.dg);
            du[i] = pack2(e0.du, e1.du);
            hw[i] = pack2(e0.wh, e1.wh);
        }
        st_global_v4(dgr + j, dg[0], dg[1], dg[2], dg[3]);
        st_global_v4(dgr + inter + j, du[0], du[1], du[2], du[3]);
        st_global_v4(whr + j, hw[0], hw[1], hw[2], hw[3]);
    }
    red[tid] = part;
    __syncthreads();
    for (int s = SW_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) red[tid] += red[tid + s];
        __syncthreads();
    }
    if (tid == 0 && dw != nullptr) dw[a] = red[0];
}

extern "C" __global__ void __launch_bounds__(SW_THREADS)
    moe_bwd_swiglu(const float* __restrict__ gu, const float* __restrict__ gmat,
                   const u32* __restrict__ slot_row, const float* __restrict__ topk_w,
                   u16* __restrict__ dgu, u16* __restrict__ wh, float* __restrict__ dw,
                   int inter) {
    swiglu_bwd(gu, gmat, slot_row, topk_w, dgu, wh, dw, inter);
}

extern "C" __global__ void __launch_bounds__(SW_THREADS)
    moe_bwd_swiglu_saved(const u16* __restrict__ gu, const float* __restrict__ gmat,
                         const u32* __restrict__ slot_row, const float* __restrict__ topk_w,
                         u16* __restrict__ dgu, u16* __restrict__ wh, float* __restrict__ dw,
                         int inter) {
    swiglu_bwd(gu, gmat, slot_row, topk_w, dgu, wh, dw, inter);
}

extern "C" __global__ void moe_bwd_router_dz(const float* __restrict__ logits,
                                             const u32* __restrict__ ids,
                                             const float* __restrict__ topk_w,
                                             const float* __restrict__ dw,
                                             const u32* __restrict__ counts,
                                             const float* __restrict__ dloss,
                                             float* __restrict__ dz, int tokens, int experts,
                                             int top_k, int sigmoid_scoring, int renorm) {
    const int tok = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5);
    const int lane = threadIdx.x & 31;
    if (tok >= tokens) return;  // whole warps
    const float* z = logits + (i64)tok * experts;
    const u32* id = ids + (i64)tok * top_k;
    const float* w = topk_w + (i64)tok * top_k;
    const float* g = dw + (i64)tok * top_k;
    float* out = dz + (i64)tok * experts;
    const float d_aux = dloss != nullptr ? dloss[0] : 0.f;
    const float d_z = dloss != nullptr ? dloss[1] : 0.f;
    const float tf = (float)tokens;
    float m = __int_as_float(0xff800000);
    for (int i = lane; i < experts; i += 32) m = fmaxf(m, z[i]);
    m = warp_max(m);
    float se = 0.f;
    for (int i = lane; i < experts; i += 32) se += expf(z[i] - m);
    const float lse = m + logf(warp_sum(se));
    auto score = [&](int i) {
        return sigmoid_scoring ? sigmoid_acc(z[i]) : expf(z[i] - lse);
    };
    // The top-k terms: every lane the same, slots in order.
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
    const float cz = d_z * 2.f * lse / tf;
    if (!sigmoid_scoring) {
        float sg = 0.f;
        for (int i = lane; i < experts; i += 32) sg += score(i) * (ds(i) + dp(i));
        sg = warp_sum(sg);
        for (int i = lane; i < experts; i += 32) {
            const float p = score(i);
            out[i] = p * (ds(i) + dp(i) - sg) + cz * p;
        }
    } else {
        float total = 0.f;
        for (int i = lane; i < experts; i += 32) total += score(i);
        total = warp_sum(total);
        float pdp = 0.f;
        if (total > 0.f) {
            for (int i = lane; i < experts; i += 32) pdp += score(i) / total * dp(i);
            pdp = warp_sum(pdp);
        }
        for (int i = lane; i < experts; i += 32) {
            const float sv = score(i);
            const float from_aux = total > 0.f ? (dp(i) - pdp) / total : 0.f;
            out[i] = sv * (1.f - sv) * (ds(i) + from_aux) + cz * expf(z[i] - lse);
        }
    }
}

// One block: an RD_BM x RD_BN tile of d_router (columns c, experts e) over one chunk of
// `chunk` tokens (blockIdx.z), on the tensor cores: A = xᵀ (16-bit floats are exact in
// tf32), B = dZ split into two tf32 parts hi + lo when it is staged (dZ - hi rounded again:
// ~21 of f32's 24 mantissa bits kept; one tf32 part alone loses 2^-11 per term), two mmas
// per step into f32 accumulators, tokens RD_KT at a time staged in shared memory and taken
// 8 per step, ascending. Four warps, each
// 16 columns x all RD_BN experts. The chunks give the blocks to fill the GPU when H · E is
// small against T; moe_bwd_router_dw_sum adds them in order. (The scalar kernel this
// replaced, 4 FMAs per 5 shared loads, ran at 9.6 TFLOP/s: 0.45 ms at Qwen3-30B's 8192
// tokens on an H200.)
#define RD_BM 64
#define RD_BN 64
#define RD_KT 32
#if RD_BN != RD_BM
#error "moe_bwd_router_dw stages x's columns and dZ's experts in one loop: RD_BN must equal RD_BM"
#endif
// Row pitch in floats, 8 mod 32: a fragment's 32 loads (rows q, q + 4; columns g) fall in
// 32 distinct banks.
#define RD_PITCH (RD_BM + 8)
#define RD_THREADS 128

extern "C" __global__ void __launch_bounds__(RD_THREADS)
moe_bwd_router_dw(const u16* __restrict__ x, const float* __restrict__ dz, float* __restrict__ part,
                  int tokens, int hidden, int experts, int chunk) {
    __shared__ float xs[RD_KT][RD_PITCH];
    __shared__ u32 zh[RD_KT][RD_PITCH];  // dZ's tf32 hi part
    __shared__ u32 zl[RD_KT][RD_PITCH];  // tf32(dZ - hi)
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, q = lane & 3;
    const int c0 = blockIdx.x * RD_BM, e0 = blockIdx.y * RD_BN;
    const int m = warp * 16 + g;  // this lane's A rows: m, m + 8 (columns c0 + m)
    float acc[RD_BN / 8][4];
#pragma unroll
    for (int n = 0; n < RD_BN / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    const int t_lo = blockIdx.z * chunk, t_hi = min(tokens, t_lo + chunk);
    for (int t0 = t_lo; t0 < t_hi; t0 += RD_KT) {
        for (int i = tid; i < RD_KT * RD_BM; i += RD_THREADS) {
            const int j = i / RD_BM, l = i % RD_BM;
            const int t = t0 + j;
            xs[j][l] = (t < t_hi && c0 + l < hidden) ? h2f(x[(i64)t * hidden + c0 + l]) : 0.f;
            const float v = (t < t_hi && e0 + l < experts) ? dz[(i64)t * experts + e0 + l] : 0.f;
            const u32 hi = to_tf32(v);
            zh[j][l] = hi;
            zl[j][l] = to_tf32(v - __uint_as_float(hi));
        }
        __syncthreads();
        // Rows past t_hi are zeros: a chunk's last, partial step adds nothing for them.
#pragma unroll
        for (int k = 0; k < RD_KT; k += 8) {
            u32 a[4];
            a[0] = __float_as_uint(xs[k + q][m]);
            a[1] = __float_as_uint(xs[k + q][m + 8]);
            a[2] = __float_as_uint(xs[k + q + 4][m]);
            a[3] = __float_as_uint(xs[k + q + 4][m + 8]);
#pragma unroll
            for (int n = 0; n < RD_BN / 8; ++n) {
                mma1688_tf32(acc[n], a, zh[k + q][n * 8 + g], zh[k + q + 4][n * 8 + g]);
                mma1688_tf32(acc[n], a, zl[k + q][n * 8 + g], zl[k + q + 4][n * 8 + g]);
            }
        }
        __syncthreads();
    }
    float* out = part + (i64)blockIdx.z * hidden * experts;
#pragma unroll
    for (int n = 0; n < RD_BN / 8; ++n) {
        const int e = e0 + n * 8 + 2 * q;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int c = c0 + m + 8 * half;
            if (c >= hidden) continue;
            if (e < experts) out[(i64)c * experts + e] = acc[n][2 * half];
            if (e + 1 < experts) out[(i64)c * experts + e + 1] = acc[n][2 * half + 1];
        }
    }
}

// d_router[i] = sum_z part[z, i] for the H · E outputs i, chunks ascending.
extern "C" __global__ void moe_bwd_router_dw_sum(const float* __restrict__ part,
                                                 u16* __restrict__ dr, int chunks, int outputs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= outputs) return;
    float acc = 0.f;
    for (int z = 0; z < chunks; ++z) acc += part[(i64)z * outputs + i];
    dr[i] = f2h(acc);
}

// One block: UP_TOK tokens x UP_COLS columns, four warps of 16 tokens each. dZ·Rᵀ on the
// tensor cores (the 4.3 GFLOP at Qwen3-30B's 8192 tokens ran at 8 TFLOP/s on the FMA
// pipes, 0.52 ms on an H200, with the router tile's staging as costly as the sums): A = dZ
// (tokens x experts) staged as two tf32 parts hi + lo (~21 mantissa bits: f32's error
// class), B = Rᵀ (16-bit router, exact in tf32), UP_ECH experts at a time, f32
// accumulators; then per (t, c) the gather-sum of the formula in its order (slots, then the
// shared expert) plus those accumulators.
#define UP_TOK 64
#define UP_COLS 64
#define UP_ECH 32
// Row pitch in 32-bit words, 4 mod 32: a fragment's loads (rows g, columns q) fall in 32
// distinct banks.
#define UP_PITCH (UP_ECH + 4)
#define UP_THREADS 128

extern "C" __global__ void __launch_bounds__(UP_THREADS)
    moe_bwd_unpermute(const float* __restrict__ dx_perm, const u32* __restrict__ slot_row,
                      const float* __restrict__ dx_shared, const float* __restrict__ dz,
                      const u16* __restrict__ router, u16* __restrict__ dx, int tokens,
                      int hidden, int experts, int top_k) {
    __shared__ u32 zh[UP_TOK][UP_PITCH];   // dZ's tf32 hi part
    __shared__ u32 zl[UP_TOK][UP_PITCH];   // tf32(dZ - hi)
    __shared__ u32 rs[UP_COLS][UP_PITCH];  // router rows c0.., as f32 bits
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, q = lane & 3;
    const int t0 = blockIdx.x * UP_TOK, c0 = blockIdx.y * UP_COLS;
    const int m = warp * 16 + g;  // this lane's rows: tokens t0 + m, t0 + m + 8
    float dr[UP_COLS / 8][4];
#pragma unroll
    for (int n = 0; n < UP_COLS / 8; ++n) dr[n][0] = dr[n][1] = dr[n][2] = dr[n][3] = 0.f;
    for (int e0 = 0; e0 < experts; e0 += UP_ECH) {
        // Zeros past the last token / column / expert: they add 0 · 0.
        for (int i = tid; i < UP_TOK * UP_ECH; i += UP_THREADS) {
            const int j = i / UP_ECH, e = i % UP_ECH;
            const int t = t0 + j;
            const float v = (t < tokens && e0 + e < experts) ? dz[(i64)t * experts + e0 + e] : 0.f;
            const u32 hi = to_tf32(v);
            zh[j][e] = hi;
            zl[j][e] = to_tf32(v - __uint_as_float(hi));
        }
        for (int i = tid; i < UP_COLS * UP_ECH; i += UP_THREADS) {
            const int r = i / UP_ECH, e = i % UP_ECH;
            const int c = c0 + r;
            rs[r][e] = (c < hidden && e0 + e < experts)
                           ? __float_as_uint(h2f(router[(i64)c * experts + e0 + e]))
                           : 0u;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < UP_ECH; k += 8) {
            const u32 ah[4] = {zh[m][k + q], zh[m + 8][k + q], zh[m][k + q + 4], zh[m + 8][k + q + 4]};
            const u32 al[4] = {zl[m][k + q], zl[m + 8][k + q], zl[m][k + q + 4], zl[m + 8][k + q + 4]};
#pragma unroll
            for (int n = 0; n < UP_COLS / 8; ++n) {
                const u32 b0 = rs[n * 8 + g][k + q], b1 = rs[n * 8 + g][k + q + 4];
                mma1688_tf32(dr[n], ah, b0, b1);
                mma1688_tf32(dr[n], al, b0, b1);
            }
        }
        __syncthreads();
    }
    // Accumulator (n, 2 half + j) is token t0 + m + 8 half, column c0 + 8 n + 2 q + j. With
    // an even hidden size (and dx 4-byte aligned: a caller's view may start at an odd
    // element) a lane's two columns are one 8-byte load and one 4-byte store.
    const bool pairs = (hidden & 1) == 0 && (reinterpret_cast<unsigned long long>(dx) & 3) == 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int t = t0 + m + 8 * half;
        if (t >= tokens) continue;
        float acc[UP_COLS / 8][2];
#pragma unroll
        for (int n = 0; n < UP_COLS / 8; ++n) acc[n][0] = acc[n][1] = 0.f;
        for (int s = 0; s < top_k; ++s) {
            const float* src = dx_perm + (i64)slot_row[(i64)t * top_k + s] * hidden;
#pragma unroll
            for (int n = 0; n < UP_COLS / 8; ++n) {
                const int c = c0 + n * 8 + 2 * q;
                if (pairs) {
                    if (c < hidden) {
                        const float2 v = *reinterpret_cast<const float2*>(src + c);
                        acc[n][0] += v.x;
                        acc[n][1] += v.y;
                    }
                } else {
                    if (c < hidden) acc[n][0] += src[c];
                    if (c + 1 < hidden) acc[n][1] += src[c + 1];
                }
            }
        }
        const i64 row = (i64)t * hidden;
#pragma unroll
        for (int n = 0; n < UP_COLS / 8; ++n) {
            const int c = c0 + n * 8 + 2 * q;
            if (pairs) {
                if (c >= hidden) continue;
                float v0 = acc[n][0], v1 = acc[n][1];
                if (dx_shared != nullptr) {
                    const float2 sh = *reinterpret_cast<const float2*>(dx_shared + row + c);
                    v0 += sh.x;
                    v1 += sh.y;
                }
                *reinterpret_cast<u32*>(dx + row + c) =
                    pack2(v0 + dr[n][2 * half], v1 + dr[n][2 * half + 1]);
            } else {
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    if (c + j >= hidden) continue;
                    float v = acc[n][j];
                    if (dx_shared != nullptr) v += dx_shared[row + c + j];
                    dx[row + c + j] = f2h(v + dr[n][2 * half + j]);
                }
            }
        }
    }
}
