// flashmoe sm_90a attention — the epilogue of a work tile (one consumer warp's 16 rows).
//
// Holds: merge_split (the two parts of a tile split over key ranges meet in the workspace
// and the second merges the first's O, m and l), store_o (normalise, LSE, O through the
// staging rows to global memory, with TMA at D >= 128) and lg2. Included by
// fm90_mainloop.cuh, whose consume() calls them at the end of each work tile.
#pragma once

#include "fm90_config.cuh"
#include "fm90_softmax.cuh"

namespace fm90 {

// The meeting of a split tile's two parts at their boundary record, per consumer warp (16
// rows; both parts hold the same rows in the same warp of the same warpgroup). The warp
// takes a ticket: the first publishes its O (unnormalised), m and l (per-thread partial)
// and returns false; the second waits for that publication (the first is already storing
// it), merges it into its own registers and returns true (it writes O and LSE). The merge
// is symmetric (products, then one add), so the bits do not depend on which part came
// second; the second resets the record for the next launch.
__device__ __forceinline__ bool merge_split(float (&oacc)[D / 2], float (&m_i)[2], float (&l_i)[2],
                                            int boundary, int cw, int warp, int lane, unsigned char* ws) {
    const int rec = (boundary * NCW + cw) * 4 + warp;
    float4* part = reinterpret_cast<float4*>(ws + WS_PARTS) + (size_t)rec * PART_CHUNKS * 32 + lane;
    int* ticket = reinterpret_cast<int*>(ws + WS_SYNC) + 2 * rec;
    int* ready = ticket + 1;
    int first = 0;
    if (lane == 0) first = atomicAdd(ticket, 1) == 0;
    if (__shfl_sync(0xffffffffu, first, 0)) {
#pragma unroll
        for (int c = 0; c < D / 8; ++c)
            __stcg(part + 32 * c, make_float4(oacc[4 * c], oacc[4 * c + 1], oacc[4 * c + 2], oacc[4 * c + 3]));
        __stcg(part + 32 * (D / 8), make_float4(m_i[0], m_i[1], l_i[0], l_i[1]));
        __threadfence();
        __syncwarp();
        if (lane == 0) st_release_gpu(ready, 1);
        return false;
    }
    // Every lane's own acquire load must see the flag (the vote ends the loop for all).
    while (!__all_sync(0xffffffffu, ld_acquire_gpu(ready) != 0)) {
    }
    const float4 ml = __ldcg(part + 32 * (D / 8));
    const float m_o[2] = {ml.x, ml.y}, l_o[2] = {ml.z, ml.w};
    float a_self[2], a_other[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float m = fmaxf(m_i[h], m_o[h]);
        const float m_use = m == neg_inf() ? 0.f : m;
        a_self[h] = ex2(m_i[h] - m_use);
        a_other[h] = ex2(m_o[h] - m_use);
        l_i[h] = __fadd_rn(__fmul_rn(l_i[h], a_self[h]), __fmul_rn(l_o[h], a_other[h]));
        m_i[h] = m;
    }
#pragma unroll
    for (int c = 0; c < D / 8; ++c) {
        const float4 o = __ldcg(part + 32 * c);
        const float other[4] = {o.x, o.y, o.z, o.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int h = e >> 1;  // element 4c + 2h + col: row h
            oacc[4 * c + e] = __fadd_rn(__fmul_rn(oacc[4 * c + e], a_self[h]), __fmul_rn(other[e], a_other[h]));
        }
    }
    __syncwarp();  // every lane has seen `ready` before it is cleared
    if (lane == 0) {
        *ticket = 0;
        *ready = 0;
    }
    return true;
}

// The epilogue of a work tile: normalise, LSE; 16-bit O into this warp's staging rows (see
// O_TMA_STORE), then to global memory as whole rows. (From registers, each store
// instruction wrote 16 bytes into 8 rows: twice the ideal L2 sectors in ncu; staging measured +7 % at D=128 S=512.)
// Rows outside [0, Sq) are not stored; a warp's 16 rows start at a multiple of 16.
__device__ __forceinline__ void store_o(const float (&oacc)[D / 2], const float (&m_i)[2], const float (&l_i)[2],
                                        u32 sStage, int cw, int warp, int lane, int m0w, int row0, int seqlen_q,
                                        const FmTensorMap* tm_o, int head, int batch, u16* __restrict__ og,
                                        i64 q_stride, float* __restrict__ lseg) {
    constexpr float LN2 = 0.693147180559945309f;
    // This warp's staging: its own rows of the staging area, or (STAGE_IN_Q: sStage is
    // the Q tile) its own 16 rows of Q, one box per 128-byte panel.
    const u32 stg = STAGE_IN_Q ? sStage + (cw * 64 + warp * 16) * 128 : sStage + (cw * 4 + warp) * STAGE_WARP_BYTES;
    constexpr u32 PANEL = STAGE_IN_Q ? HALF_Q : 2048;  // bytes from one 64-column box to the next
    if (O_TMA_STORE) {
        if (lane == 0) bulk_wait_read<0>();  // the previous tile's store has read the boxes
        __syncwarp();
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // A row that saw no key keeps m = -inf (and l = 0).
        const bool seen = m_i[h] != neg_inf() && l > 0.f;
        float inv = 0.f;
        if (seen) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l));
        const int row = row0 + 8 * h;
        if ((lane & 3) == 0 && row >= 0 && row < seqlen_q)
            lseg[row] = seen ? (m_i[h] + lg2(l)) * LN2 : neg_inf();
        const int r = (lane >> 2) + 8 * h;  // row in the warp's 16
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            // TMA box: 16-byte chunk c of a row's 128 bytes sits at chunk c ^ (r & 7).
            const u32 addr = O_TMA_STORE ? stg + (j >> 3) * PANEL + r * 128 + (((j & 7) ^ (r & 7)) << 4)
                                         : stg + r * STAGE_PITCH + 16 * j;
            st_shared_u32(addr + 4 * (lane & 3), pack2(oacc[4 * j + 2 * h] * inv, oacc[4 * j + 2 * h + 1] * inv));
        }
    }
    const int wrow0 = m0w + warp * 16;
    if (O_TMA_STORE) {
        fence_proxy_async_smem();  // the generic-proxy writes, before the TMA (async proxy) reads
        __syncwarp();
        if (lane == 0 && wrow0 >= 0 && wrow0 < seqlen_q) {
#pragma unroll
            for (int hh = 0; hh < DH; ++hh) tma_store_4d(tm_o, stg + hh * PANEL, hh * 64, head, wrow0, batch);
            bulk_commit();
        }
    } else {
        __syncwarp();
        constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
#pragma unroll
        for (int c = lane; c < 16 * CHUNKS; c += 32) {
            const int r = c / CHUNKS, col = c % CHUNKS;
            u32 a, b, cc, d;
            ld_shared_v4(stg + r * STAGE_PITCH + col * 16, a, b, cc, d);
            if (wrow0 + r >= 0 && wrow0 + r < seqlen_q)
                st_global_v4(og + (i64)(wrow0 + r) * q_stride + col * 8, a, b, cc, d);
        }
        __syncwarp();  // the staging rows are read before the next tile's epilogue writes them
    }
}

}  // namespace fm90
