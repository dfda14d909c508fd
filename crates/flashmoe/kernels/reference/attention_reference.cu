// flashmoe — simple GPU reference for attention forward (fp32 accumulation throughout).
//
// Used by `check` for shapes too large for the CPU f64 reference; validated itself against
// the CPU on small shapes. Written to be obviously correct, not fast: one warp per
// (query row, head, batch); the 32 lanes split the head dim (lane handles d = lane + 32*j);
// for each visible key the warp forms the dot product (butterfly sum), then an online
// softmax in fp32 (exact exp2f/log2f, no fast math), O accumulated in fp32.
//
// Defines: FM_HEAD_DIM (any 1..256), FM_DTYPE_BF16 (0 = fp16, 1 = bf16 inputs),
// FM_CAUSAL (0/1), FM_WINDOW and FM_SOFTCAP (0/1, the parameters and meaning of the sm_90a
// kernel's: flash_attn_fwd_sm90.cu; here tanhf, not tanh.approx), FM_BLOCK_M (warps per block = query rows per block; config.rs uses 1 so
// that the row, and so the key loop, is block-uniform: ptxas then emits plain SHFL instead
// of the divergence-safe shuffle subroutine).
// ABI (extern "C" attention_reference): same as flash_attn_fwd except o is float*:
//   (const u16* q, const u16* k, const u16* v, float* o, float* lse,
//    int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2
//    [, int window_left, int window_right] [, float softcap_log2])
// Layouts: q/o (batch, seqlen_q, heads_q, D), k/v (batch, seqlen_k, heads_kv, D),
// lse (batch, heads_q, seqlen_q), natural log. Grid (ceil(Sq / FM_BLOCK_M), heads_q, batch),
// block FM_BLOCK_M * 32 threads, no shared memory. Causal is bottom-right aligned: query i
// sees keys j <= i + seqlen_k - seqlen_q. A row with no visible key: O = 0, LSE = -inf.

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;

#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_CAUSAL
#define FM_CAUSAL 0
#endif
#ifndef FM_WINDOW
#define FM_WINDOW 0
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_BLOCK_M
#define FM_BLOCK_M 1
#endif

namespace fmref {

constexpr int D = FM_HEAD_DIM;
constexpr int PER_LANE = (D + 31) / 32;
static_assert(D >= 1 && D <= 256, "reference head dim must be 1..256");

__device__ __forceinline__ float to_f32(u16 x) {
#if FM_DTYPE_BF16
    return __uint_as_float(((u32)x) << 16);  // bf16 is the top half of an fp32
#else
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(x));
    return r;
#endif
}

}  // namespace fmref

extern "C" __global__ void __launch_bounds__(FM_BLOCK_M * 32)
    attention_reference(const u16* __restrict__ q, const u16* __restrict__ k,
                        const u16* __restrict__ v, float* __restrict__ o,
                        float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q,
                        int heads_kv, float softmax_scale_log2
#if FM_WINDOW
                        ,
                        int window_left, int window_right
#endif
#if FM_SOFTCAP
                        ,
                        float softcap_log2
#endif
                        ) {
    using namespace fmref;
    const int lane = threadIdx.x & 31;
    const int row = FM_BLOCK_M == 1 ? (int)blockIdx.x : (int)(blockIdx.x * FM_BLOCK_M + (threadIdx.x >> 5));
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    if (row >= seqlen_q) return;  // whole warp leaves together
    const int kv_head = head / (heads_q / heads_kv);

    const i64 q_idx = (((i64)batch * seqlen_q + row) * heads_q + head) * D;
    const i64 kv_base = ((i64)batch * seqlen_k * heads_kv + kv_head) * D;
    const i64 kv_stride = (i64)heads_kv * D;

    float qr[PER_LANE], acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        const int d = lane + 32 * j;
        qr[j] = d < D ? to_f32(q[q_idx + d]) : 0.f;
        acc[j] = 0.f;
    }

    // Keys lo .. n_vis-1 are visible: up to the (shifted) diagonal when causal, from the
    // window's lower edge with FM_WINDOW.
#if !FM_WINDOW
    const int window_left = 0, window_right = 0;
#endif
    const i64 diag = (i64)seqlen_k - seqlen_q + (FM_WINDOW ? window_right : 0);
    int n_vis = seqlen_k;
    if (FM_CAUSAL) {
        const i64 lim = (i64)row + diag + 1;
        n_vis = (int)(lim < 0 ? 0 : (lim > seqlen_k ? seqlen_k : lim));
    }
    int lo = 0;
    if (FM_WINDOW) {
        const i64 first = (i64)row + seqlen_k - seqlen_q - window_left;
        lo = (int)(first < 0 ? 0 : (first > n_vis ? n_vis : first));
    }

    const float NEG_INF = __int_as_float(0xff800000);
    float m = NEG_INF;  // running max of s (log2 domain: s = q.k * scale * log2 e)
    float l = 0.f;      // running sum of 2^(s - m)
    for (int j = lo; j < n_vis; ++j) {
        const i64 kv_idx = kv_base + (i64)j * kv_stride;
        float part = 0.f;
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int d = lane + 32 * t;
            if (d < D) part = fmaf(qr[t], to_f32(k[kv_idx + d]), part);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) part += __shfl_xor_sync(0xffffffffu, part, off);
#if FM_SOFTCAP
        const float s = softcap_log2 * tanhf(part * softmax_scale_log2);
#else
        const float s = part * softmax_scale_log2;
#endif
        const float m_new = fmaxf(m, s);          // finite: s is finite
        const float corr = exp2f(m - m_new);      // m = -inf on the first key -> 0
        const float p = exp2f(s - m_new);
        l = l * corr + p;
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int d = lane + 32 * t;
            const float vv = d < D ? to_f32(v[kv_idx + d]) : 0.f;
            acc[t] = fmaf(p, vv, acc[t] * corr);
        }
        m = m_new;
    }

    // Division by l: rcp.approx (<= 1 ulp) plus one Newton step, inline (the IEEE rcp.rn
    // path is a subroutine call).
    float inv = 0.f;
    if (l > 0.f) {
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l));
        inv = inv * (2.f - l * inv);
    }
#pragma unroll
    for (int t = 0; t < PER_LANE; ++t) {
        const int d = lane + 32 * t;
        if (d < D) o[q_idx + d] = acc[t] * inv;
    }
    if (lane == 0) {
        const float LN2 = 0.693147180559945309f;
        lse[((i64)batch * heads_q + head) * seqlen_q + row] =
            l > 0.f ? (m + log2f(l)) * LN2 : NEG_INF;
    }
}
