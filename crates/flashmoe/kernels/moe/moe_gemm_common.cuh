// Shared by the MoE grouped-GEMM kernels (moe_grouped_gemm.cu, moe_gemm_sm90.cu): the
// row-tile work assignment and the epilogue math/stores. Include after fm_ptx.cuh.
#pragma once

__device__ __forceinline__ float rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}
// silu(g) * u = g * u / (1 + e^-g). e^-g overflows to +inf for g < -88: rcp(inf) = 0, so
// the product is (-)0 as it should be.
__device__ __forceinline__ float swiglu(float g, float u) {
    constexpr float LOG2E = 1.4426950408889634f;
    return g * u * rcp(1.f + ex2(-g * LOG2E));
}

__device__ __forceinline__ void st_global_u32(void* p, u32 a) {
    asm volatile("st.global.u32 [%0], %1;\n" ::"l"(p), "r"(a) : "memory");
}
__device__ __forceinline__ void st_global_f32x2(void* p, float a, float b) {
    asm volatile("st.global.v2.f32 [%0], {%1,%2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
}

// Row tile `t` of the grouped GEMM -> (expert, tile within the expert): a block-wide
// exclusive scan of the per-expert tile counts ceil(n_e / BM) over experts (experts with
// no rows own no tile, so their weights are never read). Thread `tid` of THREADS owns
// experts [tid*EPT, (tid+1)*EPT). `scratch` holds 34 u32 of shared memory. Every thread
// of the block must call it (two __syncthreads); returns false for a surplus tile
// (block-uniform).
template <int BM, int THREADS>
__device__ __forceinline__ bool moe_find_tile(const u32* __restrict__ offsets, int experts,
                                              u32* scratch, int tid, u32 t, int& expert,
                                              int& tile) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "whole warps, at most 32");
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int ept = (experts + THREADS - 1) / THREADS;
    const int e_lo = min(experts, tid * ept);
    const int e_hi = min(experts, e_lo + ept);
    u32 mine = 0;
    for (int e = e_lo; e < e_hi; ++e) {
        const u32 n = offsets[e + 1] - offsets[e];
        mine += (n + BM - 1) / BM;
    }
    // inclusive warp scan
    u32 incl = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const u32 v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) scratch[warp] = incl;
    if (tid == 0) scratch[32] = 0xffffffffu;  // found: expert
    __syncthreads();
    u32 base = incl - mine;
    for (int w = 0; w < warp; ++w) base += scratch[w];
    if (t >= base && t < base + mine) {  // exactly one thread owns tile t (if any)
        u32 start = base;
        for (int e = e_lo; e < e_hi; ++e) {
            const u32 n = offsets[e + 1] - offsets[e];
            const u32 nt = (n + BM - 1) / BM;
            if (t < start + nt) {
                scratch[32] = (u32)e;
                scratch[33] = t - start;
                break;
            }
            start += nt;
        }
    }
    __syncthreads();
    const u32 e = scratch[32];
    if (e == 0xffffffffu) return false;
    expert = (int)e;
    tile = (int)scratch[33];
    return true;
}
