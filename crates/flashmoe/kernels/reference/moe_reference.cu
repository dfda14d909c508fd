// flashmoe — GPU fp32 reference of the MoE layer, for shapes too large for the CPU f64
// reference. Simple, obviously-correct kernels: fp32 accumulation on CUDA cores, plain
// shared-memory tiles, bounds checks everywhere (any H, I, row count), no tensor cores,
// no atomics. The launcher is crates/flashmoe/src/moe/reference.rs.
//
// Defines: FM_DTYPE_BF16  0 = fp16, 1 = bf16 storage of x and the weights.
//
// 1. moe_ref_logits: logits [T, E] f32 = x · router, one fmaf chain per (t, e) over h
//    ascending from 0 — the summation order the contract fixes for moe_router_logits, so
//    the routing of the fast path is compared exactly, not up to fp32 near-ties. Scoring,
//    top-k, weights and losses are computed on the host in f64 from these logits
//    (reference::moe::route_from_logits).
// 2. moe_ref_gemm13: for each tile (expert e, permuted rows [r0, r1)) of the host-built
//    tile list and 64 columns n: g = x[row_token[r]] · w13[e][:, n], u = ... [:, I + n],
//    h[r, n] = silu(g) · u, stored f32 (not rounded to 16 bits).
// 3. moe_ref_gemm2: y[r, c] = h[r, :] · w2[e][:, c], f32.
// 4. moe_ref_combine: out[t, c] = Σ_s w[t, s] · y[slot_row[t·k + s], c] in slot order
//    (+ shared_y[t, c] when has_shared), accumulated in f64, stored f32.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif

#define REF_TILE 64    // rows and columns per block
#define REF_K 16       // k step staged in shared memory
#define REF_THREADS 256  // 16 × 16 threads, 4 × 4 outputs each

namespace fmref {

__device__ __forceinline__ float load16(u16 v) {
#if FM_DTYPE_BF16
    return __uint_as_float(((u32)v) << 16);
#else
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
    return f;
#endif
}

__device__ __forceinline__ float silu(float z) { return z / (1.f + expf(-z)); }

}  // namespace fmref

// One thread per (t, e); grid ceil(T·E / 256).
extern "C" __global__ void moe_ref_logits(const u16* __restrict__ x,
                                          const u16* __restrict__ router,
                                          float* __restrict__ logits, int tokens, int hidden,
                                          int experts) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)tokens * experts) return;
    const i64 t = idx / experts;
    const int e = (int)(idx - t * experts);
    float acc = 0.f;
    for (int h = 0; h < hidden; ++h) {
        acc = fmaf(fmref::load16(x[t * hidden + h]), fmref::load16(router[(i64)h * experts + e]),
                   acc);
    }
    logits[idx] = acc;
}

// tiles [n_tiles, 3] = (expert, first row, end row) with end − first ≤ 64.
// Grid (n_tiles, ceil(I / 64)), 256 threads.
extern "C" __global__ void __launch_bounds__(REF_THREADS)
moe_ref_gemm13(const u16* __restrict__ x, const u32* __restrict__ row_token,
               const u32* __restrict__ tiles, const u16* __restrict__ w13,
               float* __restrict__ h, int hidden, int inter) {
    __shared__ float as[REF_K][REF_TILE];
    __shared__ float bg[REF_K][REF_TILE];
    __shared__ float bu[REF_K][REF_TILE];
    const u32 e = tiles[3 * blockIdx.x];
    const i64 r0 = tiles[3 * blockIdx.x + 1], r1 = tiles[3 * blockIdx.x + 2];
    const int n0 = blockIdx.y * REF_TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const u16* w = w13 + (i64)e * hidden * 2 * inter;
    float g[4][4], u[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) g[i][j] = u[i][j] = 0.f;
    for (int k0 = 0; k0 < hidden; k0 += REF_K) {
        for (int i = threadIdx.x; i < REF_K * REF_TILE; i += REF_THREADS) {
            const int m = i / REF_K, kk = i % REF_K;
            const i64 r = r0 + m;
            const int k = k0 + kk;
            as[kk][m] = (r < r1 && k < hidden) ? fmref::load16(x[(i64)row_token[r] * hidden + k])
                                               : 0.f;
        }
        for (int i = threadIdx.x; i < REF_K * REF_TILE; i += REF_THREADS) {
            const int kk = i / REF_TILE, n = i % REF_TILE;
            const int k = k0 + kk, c = n0 + n;
            const bool ok = k < hidden && c < inter;
            bg[kk][n] = ok ? fmref::load16(w[(i64)k * 2 * inter + c]) : 0.f;
            bu[kk][n] = ok ? fmref::load16(w[(i64)k * 2 * inter + inter + c]) : 0.f;
        }
        __syncthreads();
        for (int kk = 0; kk < REF_K; ++kk) {
            for (int i = 0; i < 4; ++i) {
                const float a = as[kk][ty * 4 + i];
                for (int j = 0; j < 4; ++j) {
                    g[i][j] = fmaf(a, bg[kk][tx * 4 + j], g[i][j]);
                    u[i][j] = fmaf(a, bu[kk][tx * 4 + j], u[i][j]);
                }
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        const i64 r = r0 + ty * 4 + i;
        if (r >= r1) continue;
        for (int j = 0; j < 4; ++j) {
            const int c = n0 + tx * 4 + j;
            if (c < inter) h[r * inter + c] = fmref::silu(g[i][j]) * u[i][j];
        }
    }
}

// Grid (n_tiles, ceil(H / 64)), 256 threads.
extern "C" __global__ void __launch_bounds__(REF_THREADS)
moe_ref_gemm2(const float* __restrict__ h, const u32* __restrict__ tiles,
              const u16* __restrict__ w2, float* __restrict__ y, int hidden, int inter) {
    __shared__ float as[REF_K][REF_TILE];
    __shared__ float bs[REF_K][REF_TILE];
    const u32 e = tiles[3 * blockIdx.x];
    const i64 r0 = tiles[3 * blockIdx.x + 1], r1 = tiles[3 * blockIdx.x + 2];
    const int n0 = blockIdx.y * REF_TILE;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const u16* w = w2 + (i64)e * inter * hidden;
    float acc[4][4];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < inter; k0 += REF_K) {
        for (int i = threadIdx.x; i < REF_K * REF_TILE; i += REF_THREADS) {
            const int m = i / REF_K, kk = i % REF_K;
            const i64 r = r0 + m;
            const int k = k0 + kk;
            as[kk][m] = (r < r1 && k < inter) ? h[r * inter + k] : 0.f;
        }
        for (int i = threadIdx.x; i < REF_K * REF_TILE; i += REF_THREADS) {
            const int kk = i / REF_TILE, n = i % REF_TILE;
            const int k = k0 + kk, c = n0 + n;
            bs[kk][n] = (k < inter && c < hidden) ? fmref::load16(w[(i64)k * hidden + c]) : 0.f;
        }
        __syncthreads();
        for (int kk = 0; kk < REF_K; ++kk) {
            for (int i = 0; i < 4; ++i) {
                const float a = as[kk][ty * 4 + i];
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a, bs[kk][tx * 4 + j], acc[i][j]);
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 4; ++i) {
        const i64 r = r0 + ty * 4 + i;
        if (r >= r1) continue;
        for (int j = 0; j < 4; ++j) {
            const int c = n0 + tx * 4 + j;
            if (c < hidden) y[r * hidden + c] = acc[i][j];
        }
    }
}

// One thread per (t, c); grid ceil(T·H / 256). shared_y is read only when has_shared.
extern "C" __global__ void moe_ref_combine(const float* __restrict__ y,
                                           const u32* __restrict__ slot_row,
                                           const float* __restrict__ topk_w,
                                           const float* __restrict__ shared_y,
                                           float* __restrict__ out, int tokens, int hidden,
                                           int top_k, int has_shared) {
    const i64 idx = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (i64)tokens * hidden) return;
    const i64 t = idx / hidden;
    const i64 c = idx - t * hidden;
    double acc = 0.0;
    for (int s = 0; s < top_k; ++s) {
        const i64 a = t * top_k + s;
        acc += (double)topk_w[a] * (double)y[(i64)slot_row[a] * hidden + c];
    }
    if (has_shared) acc += (double)shared_y[idx];
    out[idx] = (float)acc;
}
