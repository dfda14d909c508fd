// flashmoe — MoE weighted combine (see the contract in crates/flashmoe/src/moe/forward/abi.rs).
//
// Self-contained (no CUDA headers). Entry `moe_combine`, grid T blocks of 256 threads
// (block t = token t), threads stride over hidden:
//   out[t, h] = Σ_{s < k} topk_w[t, s] · y[slot_row[t·k + s], h]   (fmaf chain, s ascending)
//               (+ shared_y[t, h] when FM_SHARED = 1)
// stored 16-bit (FM_DTYPE_BF16: 1 = bf16, 0 = fp16, round to nearest even).
// Deterministic: fixed order, no atomics. y and shared_y are f32 [rows, H] / [T, H].

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_SHARED
#define FM_SHARED 0
#endif

#define COMBINE_THREADS 256
#define FM_MAX_TOPK 8

__device__ __forceinline__ u16 store16(float f) {
    u16 r;
#if FM_DTYPE_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
#endif
    return r;
}

extern "C" __global__ void __launch_bounds__(COMBINE_THREADS)
moe_combine(const float* __restrict__ y, const u32* __restrict__ slot_row,
            const float* __restrict__ topk_w, const float* __restrict__ shared_y,
            u16* __restrict__ out, int tokens, int hidden, int top_k) {
    __shared__ i64 rows[FM_MAX_TOPK];
    __shared__ float ws[FM_MAX_TOPK];
    const i64 t = blockIdx.x;
    if (t >= tokens) return;
    if (threadIdx.x < top_k) {
        rows[threadIdx.x] = (i64)slot_row[t * top_k + threadIdx.x] * hidden;
        ws[threadIdx.x] = topk_w[t * top_k + threadIdx.x];
    }
    __syncthreads();
    for (int h = threadIdx.x; h < hidden; h += COMBINE_THREADS) {
        float acc = 0.f;
        for (int s = 0; s < top_k; ++s) acc = fmaf(ws[s], y[rows[s] + h], acc);
#if FM_SHARED
        acc += shared_y[t * hidden + h];
#endif
        out[t * hidden + h] = store16(acc);
    }
}
