// flashmoe sm_90a attention — masking and the online softmax of one consumer warpgroup.
//
// Holds: mask_tile (ragged key tail, causal diagonal), softmax_tile (online softmax in the
// log2 domain with the lazy rescale), rescale_o (the O rescale it asks for) and neg_inf.
// Register-level work on the S and O accumulators in the wgmma m64nN layout; no shared
// memory, no barriers. Included by fm90_mainloop.cuh and fm90_epilogue.cuh.
#pragma once

#include "fm90_config.cuh"

namespace fm90 {

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// Ragged key tail, causal diagonal and (WINDOW) the window's lower edge: scores of keys a
// row must not see become -inf. Row r = row0 + i sees keys [lo0 + i, min(Sk, r + diag + 1)).
__device__ __forceinline__ void mask_tile(float (&sacc)[BN / 2], int n0, int row0, int lane,
                                          int seqlen_k, int diag, int lo0) {
    const int col0 = n0 + 2 * (lane & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        int limit = seqlen_k;
        if (CAUSAL) limit = min(limit, row0 + 8 * h + diag + 1);
        const int lo = lo0 + 8 * h;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = col0 + j * 8 + c;
                if (col >= limit || (WINDOW && col < lo)) sacc[4 * j + 2 * h + c] = neg_inf();
            }
    }
}

// Logit softcap (SOFTCAP): S becomes tanh(S * pre), pre = scale / softcap; the softmax then
// scales by softcap * log2 e. tanh.approx.f32 (relative error about 2^-11, one MUFU op like
// the exponential): a softcap of 50 moves a saturated logit by at most about 0.025.
__device__ __forceinline__ void softcap_tile(float (&sacc)[BN / 2], float pre) {
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) asm("tanh.approx.f32 %0, %1;\n" : "=f"(sacc[i]) : "f"(sacc[i] * pre));
}

// Lazy rescale: P = exp2(S*scale - m) with m up to RESCALE_SLACK below the true row max,
// so P <= 2^8 (exact in 16 bit, far from overflow in the fp32 O and l). O and l are relative
// to the same m, so O / l and the LSE m + log2(l) are unchanged.
constexpr float RESCALE_SLACK = 8.f;

// A softcap bounds every logit to [-C, C] (C = softcap * log2 e), so up to SOFTCAP_FIXED_MAX
// the bf16 softmax needs no running max: m stays 0 and P = exp2(logit) lies in [2^-C, 2^C],
// normal in fp32 and bf16 (not in fp16, whose P tops out at 65504), and O and l stay below
// Sk * 2^C * 65504 < 2^128 for any Sk < 2^31. That saves the max, its shuffles and every
// rescale (fixed_m in softmax_tile): +0.3 to +2.3 % (run softcap-ab2). Above it (softcap >
// 50) and in fp16, the online max as without softcap.
constexpr float SOFTCAP_FIXED_MAX = 72.135f;  // 50 * log2 e

// Online softmax step (log2 domain): sacc becomes P = exp2(S*scale - m) in place, m and the
// per-thread partial l are updated, alpha = the factor O must be rescaled by. Returns
// whether O needs the rescale: whether some row of the warp moved its m (a warp-uniform
// answer, so the skip is a uniform branch). fixed_m (SOFTCAP, uniform): m stays 0, no max.
__device__ __forceinline__ bool softmax_tile(float (&sacc)[BN / 2], float (&m_i)[2], float (&l_i)[2],
                                             float (&alpha)[2], float scale_log2, bool fixed_m = false) {
    if (SOFTCAP && fixed_m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < BN / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const float p = ex2(sacc[4 * j + 2 * h + c] * scale_log2);
                    sacc[4 * j + 2 * h + c] = p;
                    sum += p;
                }
            alpha[h] = 1.f;
            l_i[h] += sum;
        }
        return false;
    }
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
            mx = fmaxf(mx, fmaxf(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m_i[h], mx * scale_log2);
        // Lazy: keep m unless the row max passed it by more than the slack (m = -inf: any
        // visible key moves it). alpha is then exactly 1 for the rows that kept m.
        if (!(m_new > m_i[h] + RESCALE_SLACK)) m_new = m_i[h];
        // Safe max: a row that has seen no key keeps m = -inf; subtract 0 instead.
        const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
        const bool row_moved = m_new != m_i[h];
        alpha[h] = !row_moved ? 1.f : ex2(m_i[h] - m_use);
        moved = moved || row_moved;
        m_i[h] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float x = fmaf(sacc[4 * j + 2 * h + c], scale_log2, -m_use);
                const float p = ex2(x);
                sacc[4 * j + 2 * h + c] = p;
                sum += p;
            }
        l_i[h] = l_i[h] * alpha[h] + sum;  // per-thread partial; quad-reduced at the end
    }
    return __any_sync(0xffffffffu, moved);
}

// need: softmax_tile's answer (false when alpha is 1 for every row of the warp).
__device__ __forceinline__ void rescale_o(float (&oacc)[D / 2], const float (&alpha)[2], bool need) {
    if (!need) return;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            oacc[4 * j + 2 * h] *= alpha[h];
            oacc[4 * j + 2 * h + 1] *= alpha[h];
        }
}

}  // namespace fm90
