// flashmoe — MoE router: logits, scoring + top-k, per-expert statistics.
//
// Compiled at run time by NVRTC; self-contained (no CUDA headers). The contract (entry
// names, parameters, layouts, launch geometry) is the comment at the top of
// crates/flashmoe/src/moe/forward/abi.rs; the constants below must agree with it.
//
// Defines:
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 storage of x and router (moe_router_logits)
//   FM_SIGMOID     0 = softmax scoring, 1 = sigmoid scoring (moe_router_topk)
//   FM_RENORM      1 = renormalise the k selected weights to sum 1 (moe_router_topk)
//
// Determinism: every floating-point sum has a fixed order that depends only on the
// problem shape (no atomics at all). Logits: one fmaf chain per (token, expert) over the
// hidden index ascending, fp32. Warp reductions are xor butterflies (every lane ends with
// the same, order-fixed value). Block reductions are fixed shared-memory trees.
//
// Ranking: top-k is by LOGIT (a strictly monotonic function of both softmax and sigmoid
// scores, so it equals ranking by score in exact arithmetic and avoids ties created by
// rounding exp/sigmoid in fp32), ties -> lower expert index, using the total order of
// IEEE bits (like Rust's f32::total_cmp), so a NaN never yields an invalid id.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_SIGMOID
#define FM_SIGMOID 0
#endif
#ifndef FM_RENORM
#define FM_RENORM 1
#endif

#define FM_MAX_EXPERTS 256
#include "fm_warp.cuh"
#include "moe_losses.cuh"
#define FM_MAX_TOPK 8
#define LOGITS_THREADS 256
#define LOGITS_TOK_PER_THREAD 4
#define LOGITS_HCHUNK 32
#define TOPK_THREADS 128
#define TOPK_TOKENS_PER_BLOCK (TOPK_THREADS / 32)
#define STATS_THREADS 256

namespace fm {

__device__ __forceinline__ float load16(u16 v) {
#if FM_DTYPE_BF16
    return __uint_as_float(((u32)v) << 16);
#else
    float f;
    asm("{ .reg .f16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(v));
    return f;
#endif
}

// Total-order key of a float (as f32::total_cmp): larger key = larger value.
__device__ __forceinline__ int order_key(float f) {
    int b = __float_as_int(f);
    return b >= 0 ? b : (b ^ 0x7fffffff);
}
__device__ __forceinline__ float key_value(int k) {
    return __int_as_float(k >= 0 ? k : (k ^ 0x7fffffff));
}

__device__ __forceinline__ float sigmoidf_stable(float z) {
    if (z >= 0.f) {
        return 1.f / (1.f + expf(-z));
    }
    float e = expf(z);
    return e / (1.f + e);
}

}  // namespace fm

// logits [T, E] f32 = x [T, H] · router [H, E].
// Block: 256 threads = TPB token groups × EPAD experts (EPAD = E rounded up to 32,
// TPB = 256 / EPAD); each thread owns expert e and LOGITS_TOK_PER_THREAD tokens, so a
// block covers BT = TPB · 4 tokens. Grid: ceil(T / BT). Hidden is walked in chunks of 32
// staged in shared memory; each output is one fmaf chain over h ascending.
extern "C" __global__ void __launch_bounds__(LOGITS_THREADS)
moe_router_logits(const u16* __restrict__ x, const u16* __restrict__ router,
                  float* __restrict__ logits, int tokens, int hidden, int experts) {
    __shared__ float xs[LOGITS_THREADS * LOGITS_TOK_PER_THREAD / 32][LOGITS_HCHUNK];
    __shared__ float rs[LOGITS_HCHUNK][FM_MAX_EXPERTS];
    const int epad = (experts + 31) & ~31;
    const int tpb = LOGITS_THREADS / epad;
    const int bt = tpb * LOGITS_TOK_PER_THREAD;
    const int tid = threadIdx.x;
    const int tl = tid / epad;
    const int e = tid - tl * epad;
    const i64 t0 = (i64)blockIdx.x * bt;
    float acc[LOGITS_TOK_PER_THREAD];
#pragma unroll
    for (int j = 0; j < LOGITS_TOK_PER_THREAD; ++j) acc[j] = 0.f;

    const bool active = tl < tpb;
    const int tl_c = active ? tl : 0;
    for (int h0 = 0; h0 < hidden; h0 += LOGITS_HCHUNK) {
        // Stage x[t0 .. t0 + bt, h0 .. h0 + 32] and router[h0 .. h0 + 32, :] (zero-filled
        // past the ends: fmaf(0, 0, acc) == acc, the chain is unchanged).
        for (int i = tid; i < bt * LOGITS_HCHUNK; i += LOGITS_THREADS) {
            const int r = i >> 5, c = i & (LOGITS_HCHUNK - 1);
            const i64 t = t0 + r;
            xs[r][c] = (t < tokens && h0 + c < hidden) ? fm::load16(x[t * hidden + h0 + c]) : 0.f;
        }
        for (int i = tid; i < LOGITS_HCHUNK * epad; i += LOGITS_THREADS) {
            const int r = i / epad, c = i - r * epad;
            rs[r][c] = (c < experts && h0 + r < hidden)
                           ? fm::load16(router[(i64)(h0 + r) * experts + c])
                           : 0.f;
        }
        __syncthreads();
#pragma unroll 8
        for (int hh = 0; hh < LOGITS_HCHUNK; ++hh) {
            const float w = rs[hh][e];
#pragma unroll
            for (int j = 0; j < LOGITS_TOK_PER_THREAD; ++j) {
                acc[j] = fmaf(xs[tl_c + j * tpb][hh], w, acc[j]);
            }
        }
        __syncthreads();
    }
    if (tl >= tpb || e >= experts) return;
#pragma unroll
    for (int j = 0; j < LOGITS_TOK_PER_THREAD; ++j) {
        const i64 t = t0 + tl + j * tpb;
        if (t < tokens) logits[t * experts + e] = acc[j];
    }
}

// Few-token variant of moe_router_logits (picked by moe::config::select when the tiled
// kernel's grid would leave most SMs idle): one thread per (t, e), e fastest, grid
// ceil(T·E / 256). The same fmaf chain over h ascending from 0, so the logits are
// bit-identical to the tiled kernel's; the loads of successive h are independent, so
// unrolling keeps several in flight (the tiled kernel walks H in dependent 32-wide steps
// with two barriers each, which is latency-bound when it has only a few blocks).
extern "C" __global__ void __launch_bounds__(LOGITS_THREADS)
moe_router_logits_small(const u16* __restrict__ x, const u16* __restrict__ router,
                        float* __restrict__ logits, int tokens, int hidden, int experts) {
    const i64 idx = (i64)blockIdx.x * LOGITS_THREADS + threadIdx.x;
    if (idx >= (i64)tokens * experts) return;
    const i64 t = idx / experts;
    const int e = (int)(idx - t * experts);
    const u16* xr = x + t * hidden;
    const u16* rc = router + e;
    float acc = 0.f;
#pragma unroll 8
    for (int h = 0; h < hidden; ++h) {
        acc = fmaf(fm::load16(xr[h]), fm::load16(rc[(i64)h * experts]), acc);
    }
    logits[idx] = acc;
}

// One warp per token (4 per block, grid ceil(T / 4)); lane l holds experts l + 32·j.
// Writes topk_ids [T, k] (descending score), topk_w [T, k], probs [T, E] (softmax, or
// sigmoid scores normalised per token), lse [T] (natural log). A NaN logit makes every
// output of its token NaN (ids stay valid).
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
moe_router_topk(const float* __restrict__ logits, u32* __restrict__ topk_ids,
                float* __restrict__ topk_w, float* __restrict__ probs, float* __restrict__ lse,
                int tokens, int experts, int top_k) {
    const int lane = threadIdx.x & 31;
    const i64 t = (i64)blockIdx.x * TOPK_TOKENS_PER_BLOCK + (threadIdx.x >> 5);
    if (t >= tokens) return;  // warp-uniform
    const float* lr = logits + t * experts;
    constexpr int J = FM_MAX_EXPERTS / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    float v[J];
    float m = NEG_INF;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int e = lane + 32 * j;
        v[j] = e < experts ? lr[e] : NEG_INF;
        nan |= v[j] != v[j];
        m = fmaxf(m, v[j]);
    }
    m = warp_max(m);
    if (__any_sync(0xffffffffu, nan)) m = __int_as_float(0x7fffffff);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        if (lane + 32 * j < experts) s += expf(v[j] - m);
    }
    s = warp_sum(s);
    const float lse_t = m + logf(s);
#if FM_SIGMOID
    float ssum = 0.f;
#pragma unroll
    for (int j = 0; j < J; ++j) {
        if (lane + 32 * j < experts) ssum += fm::sigmoidf_stable(v[j]);
    }
    ssum = warp_sum(ssum);
#endif
#pragma unroll
    for (int j = 0; j < J; ++j) {
        const int e = lane + 32 * j;
        if (e < experts) {
#if FM_SIGMOID
            const float p = ssum > 0.f ? fm::sigmoidf_stable(v[j]) / ssum : 1.f / (float)experts;
#else
            const float p = expf(v[j] - m) / s;
#endif
            probs[t * experts + e] = p;
        }
    }

    // Top-k: k rounds of a warp arg-max over the not yet chosen experts.
    u32 chosen = 0;  // bit j: expert lane + 32·j taken
    float wsel[FM_MAX_TOPK];
    int idsel[FM_MAX_TOPK];
#pragma unroll
    for (int r = 0; r < FM_MAX_TOPK; ++r) {
        wsel[r] = 0.f;
        idsel[r] = 0;
        if (r < top_k) {
            int bk = (int)0x80000000;
            int be = 0x7fffffff;
#pragma unroll
            for (int j = 0; j < J; ++j) {
                const int e = lane + 32 * j;
                if (e < experts && !((chosen >> j) & 1u)) {
                    const int k = fm::order_key(v[j]);
                    if (be == 0x7fffffff || k > bk) {  // e ascends with j: ties keep the lower
                        bk = k;
                        be = e;
                    }
                }
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                const int ok = __shfl_xor_sync(0xffffffffu, bk, o);
                const int oe = __shfl_xor_sync(0xffffffffu, be, o);
                if (ok > bk || (ok == bk && oe < be)) {
                    bk = ok;
                    be = oe;
                }
            }
            if ((be & 31) == lane) chosen |= 1u << (be >> 5);
            const float l = fm::key_value(bk);
#if FM_SIGMOID
            wsel[r] = fm::sigmoidf_stable(l);
#else
            wsel[r] = expf(l - m) / s;
#endif
            idsel[r] = be;
        }
    }
#if FM_RENORM
    float wsum = 0.f;
#pragma unroll
    for (int r = 0; r < FM_MAX_TOPK; ++r) {
        if (r < top_k) wsum += wsel[r];
    }
#endif
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < FM_MAX_TOPK; ++r) {
            if (r < top_k) {
                float w = wsel[r];
#if FM_RENORM
                if (wsum > 0.f || wsum != wsum) w = w / wsum;
#endif
                topk_ids[t * top_k + r] = (u32)idsel[r];
                topk_w[t * top_k + r] = w;
            }
        }
        lse[t] = lse_t;
    }
}

// Grid E + 1 blocks of 256 threads. Block e < E: counts[e] = #slots with id e,
// prob_sum[e] = Σ_t probs[t, e]. Block E: lse_sq_sum[0] = Σ_t lse[t]². Each thread sums
// a fixed stride in f64, then a fixed shared-memory tree; results stored as u32 / f32.
extern "C" __global__ void __launch_bounds__(STATS_THREADS)
moe_expert_stats(const u32* __restrict__ topk_ids, const float* __restrict__ probs,
                 const float* __restrict__ lse, u32* __restrict__ counts,
                 float* __restrict__ prob_sum, float* __restrict__ lse_sq_sum, int tokens,
                 int experts, int top_k) {
    __shared__ double sd[STATS_THREADS];
    __shared__ u32 sc[STATS_THREADS];
    const int tid = threadIdx.x;
    const int e = blockIdx.x;
    double acc = 0.0;
    u32 cnt = 0;
    if (e < experts) {
        const i64 n = (i64)tokens * top_k;
        for (i64 i = tid; i < n; i += STATS_THREADS) cnt += topk_ids[i] == (u32)e;
        for (i64 t = tid; t < tokens; t += STATS_THREADS) acc += (double)probs[t * experts + e];
    } else {
        for (i64 t = tid; t < tokens; t += STATS_THREADS) {
            const double l = (double)lse[t];
            acc += l * l;
        }
    }
    sd[tid] = acc;
    sc[tid] = cnt;
    __syncthreads();
    for (int w = STATS_THREADS / 2; w > 0; w >>= 1) {
        if (tid < w) {
            sd[tid] += sd[tid + w];
            sc[tid] += sc[tid + w];
        }
        __syncthreads();
    }
    if (tid == 0) {
        if (e < experts) {
            counts[e] = sc[0];
            prob_sum[e] = (float)sd[0];
        } else {
            lse_sq_sum[0] = (float)sd[0];
        }
    }
}

// One block of FM_LOSS_THREADS (= FM_MAX_EXPERTS) threads, after moe_expert_stats: the
// router losses of the router-only stage (the full layer finishes them in moe_permute's
// block 0 instead; same code, moe_losses.cuh).
static_assert(FM_LOSS_THREADS == FM_MAX_EXPERTS, "one loss thread per expert slot");
extern "C" __global__ void __launch_bounds__(FM_LOSS_THREADS)
moe_router_losses(const u32* __restrict__ counts, const float* __restrict__ prob_sum,
                  const float* __restrict__ lse_sq_sum, float* __restrict__ losses, int tokens,
                  int experts, int top_k) {
    finish_router_losses(counts, prob_sum, lse_sq_sum, losses, tokens, experts, top_k);
}
