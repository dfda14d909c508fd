// Shared PTX wrappers for the mma.sync kernels (flash_attn_fwd.cu, moe_grouped_gemm.cu).
// Self-contained (NVRTC has no CUDA include path); the flashmoe runtime hands every .cuh in
// kernels/ to NVRTC as an in-memory header. Include it after FM_DTYPE_BF16 is defined:
// mma16816 and pack2 pick the 16-bit type from it.
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef FM_DTYPE_BF16
#error "define FM_DTYPE_BF16 (0 = fp16, 1 = bf16) before including fm_ptx.cuh"
#endif

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
    return r;
}

// 16-byte global->shared async copy; src_bytes = 0 writes 16 zero bytes (no global read).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool pred) {
    const int n = pred ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c += a * b, m16n8k16, A row-major (4 regs), B column-major (2 regs), fp32 accumulators.
__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if FM_DTYPE_BF16
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c += a * b, m16n8k8 on tf32 operands (the f32 bit patterns; the unit reads the top 19
// bits), A row-major (4 regs), B column-major (2 regs), fp32 accumulators.
__device__ __forceinline__ void mma1688_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// f32 -> tf32 (10 mantissa bits), round to nearest, ties away; as an f32 bit pattern.
__device__ __forceinline__ u32 to_tf32(float v) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
    return r;
}

// Two fp32 -> one 32-bit register of two 16-bit values (lo in bits 0..15), round to nearest.
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if FM_DTYPE_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

// Plain 16-byte global stores and shared loads/stores (the epilogues' O copy-out).
__device__ __forceinline__ void st_global_v4(void* p, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"l"(p), "r"(a), "r"(b), "r"(c),
                 "r"(d)
                 : "memory");
}
__device__ __forceinline__ void ld_shared_v4(u32 addr, u32& a, u32& b, u32& c, u32& d) {
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                 : "r"(addr)
                 : "memory");
}
__device__ __forceinline__ void st_shared_u32(u32 addr, u32 v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// 2^x, ex2(-inf) = 0
__device__ __forceinline__ float ex2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// log2 x, lg2(0) = -inf
__device__ __forceinline__ float lg2(float x) {
    float r;
    asm("lg2.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// tanh(x) = 1 - 2 / (2^(2 x log2 e) + 1): absolute error a few 1e-7 (ex2.approx and
// rcp.approx), where tanh.approx.f32 has a relative 2^-11 (too coarse for the backward's
// 1 - tanh^2 once multiplied by the softcap inside an exponent). Saturates to +-1
// (2^inf = inf, 1/inf = 0).
__device__ __forceinline__ float tanh_acc(float x) {
    const float e = ex2(x * 2.8853900817779268f);  // 2 log2 e
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(e + 1.f));
    return fmaf(-2.f, r, 1.f);
}
