// flashmoe sm_90a attention — the consumer role: one warpgroup's mainloop over a work tile.
//
// Holds: the GEMM issue helpers (S = Q K^T from shared memory or from Q in registers,
// O += P V with P from registers), the ping-pong turns between consumer warpgroups, the
// ring releases, the pass of key tiles (or whole tiles) a warpgroup cannot see, and
// consume(): the software-pipelined loop S(i+1) | softmax(i+1) | P V(i) over the key tiles,
// ending in the epilogue. Included by flash_attn_fwd_sm90.cu, whose consumer loop calls
// consume() once per posted work tile.
#pragma once

#include "fm90_config.cuh"
#include "fm90_epilogue.cuh"
#include "fm90_softmax.cuh"
#include "fm90_trace.cuh"

namespace fm90 {

// Causal work tiles taller than a key tile: some warpgroups cannot see the first key tiles
// visited, and pass them (consume()).
constexpr bool SKIP_MASKED = CAUSAL && BM > FM_BLOCK_N;
// The V wait of the pipelined loop takes a data dependency on the softmax (zero_after):
// without it, ptxas hoists the wait, and the P.V wait behind it, above the softmax in these
// variants (sm90_sass.py event order: "W1 b3 *2 W0 e10 b e56" instead of "e66 b W0"). The
// others keep (almost) all exponentials before the wait on their own, and measured 1-2 %
// faster so. (Re-measured with the last-wave split: the non-causal variants with the dependency
// measured 1-4 % slower than without, though without it ptxas put the D=64 wait above the softmax.)
constexpr bool ORDER_V_WAIT = SKIP_MASKED;

// ---- consumer building blocks (one warpgroup, 64 query rows) ----

// S = Q K^T for ring slot s: issued, not waited for.
__device__ __forceinline__ void issue_qk(float (&sacc)[BN / 2], u64 dq, u64 dk, int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const u32 inner = (kk & 3) * 32;  // k16 step inside the 128-byte row
        wgmma_ss<0, 0>(sacc, desc_add(dq, (kk >> 2) * HALF_Q + inner),
                       desc_add(dk, s * KV_BYTES + (kk >> 2) * HALF_KV + inner), kk > 0 ? 1 : 0);
    }
}

// The same with Q from registers (FM_Q_REGS): qa[kk] is the A fragment of k16 step kk.
__device__ __forceinline__ void issue_qk_rs(float (&sacc)[BN / 2], const u32 (&qa)[D / 16][4], u64 dk,
                                            int s) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
        wgmma_rs<0>(sacc, qa[kk], desc_add(dk, s * KV_BYTES + (kk >> 2) * HALF_KV + (kk & 3) * 32),
                    kk > 0 ? 1 : 0);
}

// This warp's 16 query rows of Q as wgmma A fragments, read from the 128B-swizzled Q tile
// (chunk c of row r sits at chunk c ^ (r & 7)). ldmatrix x4: lanes 8m..8m+7 address the
// rows of matrix m = (rows +8 if m is odd, k +8 if m >= 2), the fragment order of pack_p.
__device__ __forceinline__ void load_q_frags(u32 (&qa)[D / 16][4], u32 sQ, int cw, int warp, int lane) {
    const int m = lane >> 3;
    const int r = cw * 64 + warp * 16 + (lane & 7) + 8 * (m & 1);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const int chunk = (kk & 3) * 2 + (m >> 1);
        const u32 addr = sQ + (kk >> 2) * HALF_Q + r * 128 + ((chunk ^ (r & 7)) << 4);
        ldsm_x4(addr, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3]);
    }
}

// S = Q K^T for ring slot s, Q from shared memory or from registers (FM_Q_REGS).
__device__ __forceinline__ void issue_s(float (&sacc)[BN / 2], const u32 (&qa)[D / 16][4], u64 dq,
                                        u64 dk, int s) {
    if (FM_Q_REGS) issue_qk_rs(sacc, qa, dk, s);
    else issue_qk(sacc, dq, dk, s);
}

// O += P V for ring slot s: issued, not waited for.
__device__ __forceinline__ void issue_pv(float (&oacc)[D / 2], const u32 (&pa)[BN / 16][4], u64 dv,
                                         int s) {
    if constexpr (D % 64 == 0) {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            wgmma_rs<1>(oacc, pa[kk], desc_add(dv, s * KV_BYTES + kk * 16 * 128), 1);
    } else {
        // D = 96: O's columns [0, 64) from V's first panel (N = 64), [64, 96) from the first
        // half of its second (N = 32); an N = 96 accumulator's fragments are the N = 64
        // one's followed by the N = 32 one's (one N = 96 wgmma would span a swizzle atom
        // and a half, which the descriptor does not describe).
        float(&lo)[32] = *reinterpret_cast<float(*)[32]>(&oacc[0]);
        float(&hi)[16] = *reinterpret_cast<float(*)[16]>(&oacc[32]);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            wgmma_rs<1>(lo, pa[kk], desc_add(dv, s * KV_BYTES + kk * 16 * 128), 1);
            wgmma_rs<1>(hi, pa[kk], desc_add(dv, s * KV_BYTES + HALF_KV + kk * 16 * 128), 1);
        }
    }
}

// P to 16 bit in the wgmma A-fragment layout: k16 step kk = 8-column blocks 2kk, 2kk+1;
// registers (row g, k 0-7), (row g+8, k 0-7), (row g, k 8-15), (row g+8, k 8-15).
__device__ __forceinline__ void pack_p(const float (&sacc)[BN / 2], u32 (&pa)[BN / 16][4]) {
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            pa[j >> 1][(j & 1) * 2 + h] = pack2(sacc[4 * j + 2 * h], sacc[4 * j + 2 * h + 1]);
}

// Always 0, but computed from x: a wait whose parity takes it cannot be scheduled before x
// is (ptxas reorders freely around a try-wait otherwise; see the V wait in consume()).
__device__ __forceinline__ u32 zero_after(float x) {
    u32 z;
    asm volatile("min.u32 %0, %1, 0;\n" : "=r"(z) : "r"(__float_as_uint(x)));
    return z;
}

// Ping-pong schedule between the consumer warpgroups: warpgroup cw waits for its turn
// (named barrier 1 + cw, 256 threads: its own 128 sync, the other's 128 arrive) before
// issuing GEMMs and hands the turn over right after issuing.
__device__ __forceinline__ void turn_wait(int cw) {
    if (FM_PINGPONG) named_bar_sync(1 + cw, 256);
}
__device__ __forceinline__ void turn_pass(int cw) {
    if (FM_PINGPONG) named_bar_arrive(1 + (cw + 1 == NCW ? 0 : cw + 1), 256);
}

// This warp's wgmmas reading the slot are complete: one arrival per consumer warp.
__device__ __forceinline__ void release(u32 bar, int lane) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
}

// This thread is done with Q and with the posted work tile: one arrival per consumer
// thread, since the tile was read with ordinary loads by every thread (a warp-level
// arrival after __syncwarp orders them as well, but compute-sanitizer racecheck only
// credits a thread's own arrival: tools/probes/racecheck_mbarrier_probe.cu).
__device__ __forceinline__ void release_q(const Bars& bar) { mbar_arrive(bar.q_empty()); }

// One key tile (ring slot s, round `round`) passed without computing: the slot is
// released as soon as it is full, and the warpgroup's ping-pong turn is passed on.
__device__ __forceinline__ void pass_key_tile(const Bars& bar, int cw, int lane, const SlotPhases& ring,
                                              int& s, int& round) {
    const u32 ph = ring.parity(s, round);
    mbar_wait(bar.k_full(s), ph);
    release(bar.k_empty(s), lane);
    turn_wait(cw);
    turn_pass(cw);
    mbar_wait(bar.v_full(s), ph);
    release(bar.v_empty(s), lane);
    if (++s == STAGES) {
        s = 0;
        ++round;
    }
}

// A consumer warpgroup whose 64 rows all lie outside [0, Sq) (in the ragged query block,
// e.g. S=512 with 192-row tiles: 2 x 192 + 128): it computes nothing, so
// the tensor cores serve the other warpgroups alone, but it keeps the protocol. It
// releases Q and each ring slot as soon as the slot is full (so its arrivals count for
// that use of the slot), and with ping-pong it passes on as many turns as consume() takes.
__device__ __forceinline__ void pass_tile(const Bars& bar, int cw, int n_tiles, int lane, SlotPhases& ring) {
    release_q(bar);
    int s = 0, round = 0;
    for (int it = 0; it < n_tiles; ++it) pass_key_tile(bar, cw, lane, ring, s, round);
    if (n_tiles > 0) {  // consume()'s last turn: the final P V
        turn_wait(cw);
        turn_pass(cw);
    }
    ring.advance(n_tiles);
}


// Consumer warpgroup `cw`: 64 query rows [m0w, m0w + 64) of the work tile just posted
// (its q_full phase completed: Q landed, or no key is visible and Q was not loaded).
// diag: the upper diagonal (causal: row r sees keys <= r + diag); lo_shift: WINDOW's lower
// edge (keys >= r + lo_shift); scale_log2 multiplies the scores in the softmax, and
// with SOFTCAP cap_pre multiplies them inside the tanh (softcap_tile).
__device__ __forceinline__ void consume(u32 sQ, u32 sK, u32 sV, u32 sStage, const Bars& bar, int cw, int m0w,
                                        int n_tiles, int kt_end_posted, int split, int seqlen_q,
                                        int seqlen_k, int diag, int lo_shift, float scale_log2, float cap_pre,
                                        const FmTensorMap* tm_o, int head,
                                        int batch, u16* __restrict__ og, i64 q_stride, float* __restrict__ lseg,
                                        SlotPhases& ring, int tile_i, unsigned char* ws) {
    const int t = threadIdx.x & 127;
    const int warp = t >> 5;
    const int lane = t & 31;
    // No row of this warpgroup exists. (The vote tells ptxas the branch is warp-uniform;
    // a plain compare costs the loop its uniform datapath: R2UR 0 -> 32, 673 -> 765 SASS.)
    if (__all_sync(0xffffffffu, m0w >= seqlen_q || m0w + 64 <= 0)) {
        pass_tile(bar, cw, n_tiles, lane, ring);
        trace_value(tile_i, TR_N_VIS, -1);
        trace(tile_i, TR_EPILOGUE);
        return;
    }
    const int row0 = m0w + warp * 16 + (lane >> 2);  // this thread's rows: row0, row0 + 8
    // Key tiles visited: kt_end - 1 down to kt_end - n_tiles (all of them unless split;
    // WINDOW: seqlen_k and the diagonals are relative to the first visited key).
    const int kt_end = SPLIT ? kt_end_posted : n_tiles;

    // Iterations [0, n_masked) are the tiles that need a mask: ragged key tail
    // (n0 + BN > Sk) or, when causal, a key beyond this warpgroup's first row's limit.
    int thr = seqlen_k - BN + 1;
    if (CAUSAL) thr = min(thr, m0w + diag - BN + 2);
    const int first_masked = thr <= 0 ? 0 : (thr + BN - 1) / BN;
    const int n_masked = max(0, kt_end - first_masked);
    // WINDOW: iterations [left_from, n_tiles) hold keys below the window's lower edge of
    // this warpgroup's last row (the highest edge), and are masked too.
    int left_from = n_tiles;
    const int lo0 = WINDOW ? row0 + lo_shift : 0;  // the lowest key row0 sees (mask_tile)
    if (WINDOW) {
        const int lo_last = m0w + 63 + lo_shift;
        if (lo_last > 0) left_from = kt_end - (lo_last + BN - 1) / BN;
    }
    // Causal: the first key tiles visited (the highest keys) can lie entirely past the
    // limit of this warpgroup's last row. With 192-row work tiles and 128-key tiles that is
    // one key tile for 1 or 2 of the 3 warpgroups of every work tile. The warpgroup passes
    // them (pass_key_tile) and starts computing at iteration `skip`. (The reduction keeps
    // skip, and with it the loop's slot arithmetic, on the uniform datapath.) Only where
    // BM > BN: with BM = BN it is 0 on square problems, and the variable start costs the
    // steady-state loop 20 instructions at D=128 (673 -> 693).
    int skip = 0;
    if (SKIP_MASKED) {
        const int lim = m0w + 63 + diag;  // the last row sees keys <= lim
        const int visible = lim < 0 ? 0 : min(n_tiles, lim / BN + 1);
        skip = __reduce_max_sync(0xffffffffu, n_tiles - visible);
    }
    const int n_vis = n_tiles - skip;  // key tiles this warpgroup computes
    trace_value(tile_i, TR_N_TILES, n_tiles);
    trace_value(tile_i, TR_N_VIS, n_vis);

    float oacc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) oacc[i] = 0.f;
    // SOFTCAP up to SOFTCAP_FIXED_MAX, bf16: logits are bounded, m stays 0 (softmax_tile).
    const bool fixed_m = SOFTCAP && FM_DTYPE_BF16 && scale_log2 <= SOFTCAP_FIXED_MAX;
    float m_i[2] = {fixed_m ? 0.f : neg_inf(), fixed_m ? 0.f : neg_inf()};
    float l_i[2] = {0.f, 0.f};
    float alpha[2];
    float sacc[BN / 2];
    u32 pa[BN / 16][4];

    const u64 dq = smem_desc_sw128(sQ + cw * 64 * 128, 16, 1024);
    const u64 dk = smem_desc_sw128(sK, 16, 1024);
    const u64 dv = smem_desc_sw128(sV, HALF_KV, 1024);  // MN-major: LBO = next 64 columns of D

    u32 qa[D / 16][4];  // Q fragments (FM_Q_REGS; unused and eliminated otherwise)
    if (FM_Q_REGS && n_vis > 0) load_q_frags(qa, sQ, cw, warp, lane);
    // Q and the posted tile are free: with FM_Q_REGS at once, else after the last S; with
    // STAGE_IN_Q once the O stores have read this warpgroup's rows of Q (the end).
    const int q_last = STAGE_IN_Q ? -2 : FM_Q_REGS ? -1 : n_tiles - 1;
    if (!STAGE_IN_Q && (n_vis == 0 || FM_Q_REGS)) release_q(bar);  // (no key visible: Q is not read)
    if (n_tiles > 0) {
        int s = 0, round = 0;  // ring slot of iteration `it` and its round
        for (int it = 0; it < skip; ++it) pass_key_tile(bar, cw, lane, ring, s, round);
        if (n_vis == 0) {  // consume()'s last turn (the final P V), as pass_tile
            turn_wait(cw);
            turn_pass(cw);
        } else {
            // Software pipeline inside the warpgroup: the scores of tile i+1 are computed by
            // the tensor cores while this warpgroup runs the softmax of tile i+1 and P V of
            // tile i is in flight (FA3's intra-warpgroup overlap). Prologue: S of the first
            // computed key tile (iteration skip, in slot s).
            mbar_wait(bar.k_full(s), ring.parity(s, round));
            trace(tile_i, TR_K0);
            turn_wait(cw);
            wgmma_fence();
            issue_s(sacc, qa, dq, dk, s);
            wgmma_commit();
            turn_pass(cw);
            wgmma_wait<0>();
            reg_fence(sacc);
            trace(tile_i, TR_S0);
            release(bar.k_empty(s), lane);
            if (q_last == skip) release_q(bar);  // last S of this work tile
            if (SOFTCAP) softcap_tile(sacc, cap_pre);
            if (skip < n_masked || (WINDOW && skip >= left_from))
                mask_tile(sacc, (kt_end - 1 - skip) * BN, row0, lane, seqlen_k, diag, lo0);
            softmax_tile(sacc, m_i, l_i, alpha, scale_log2, fixed_m);
            trace(tile_i, TR_SOFTMAX0);
            mbar_wait(bar.v_full(s), ring.parity(s, round));  // V of that tile (see the loop)
            trace(tile_i, TR_V0);
            pack_p(sacc, pa);
            int ps = s;  // slot of the tile whose P is in pa (its V has landed)
            if (++s == STAGES) {
                s = 0;
                ++round;
            }
            for (int it = skip + 1; it < n_tiles; ++it) {
                const u32 ph = ring.parity(s, round);
                mbar_wait(bar.k_full(s), ph);
                if (FM_TRACE && it == skip + 1) trace(tile_i, TR_K1);
                reg_fence(oacc);
                turn_wait(cw);
                wgmma_fence();
                issue_s(sacc, qa, dq, dk, s);
                wgmma_commit();
                issue_pv(oacc, pa, dv, ps);
                wgmma_commit();
                turn_pass(cw);
                wgmma_wait<1>();  // S of tile it is ready; P V of tile it-1 may still run
                reg_fence(sacc);
                release(bar.k_empty(s), lane);
                if (it == q_last) release_q(bar);  // last S of this work tile
                if (SOFTCAP) softcap_tile(sacc, cap_pre);
                if (it < n_masked || (WINDOW && it >= left_from))
                    mask_tile(sacc, (kt_end - 1 - it) * BN, row0, lane, seqlen_k, diag, lo0);
                const bool need_rescale = softmax_tile(sacc, m_i, l_i, alpha, scale_log2, fixed_m);
                // V of tile it (needed by the next P V) is waited for here, between the
                // softmax and the wait for P V of tile it-1, for a second reason: ptxas
                // schedules a wgmma wait at the top of its basic block, so without the
                // try-wait's branch in between, the wait for P V would be hoisted above the
                // whole softmax and the softmax would no longer overlap P V (SASS before:
                // DEPBAR.LE gsb0, 0x0 ahead of every MUFU.EX2 of the loop; fixing it measured +4-10 % at
                // D=128 non-causal: docs/design/attention-prefill-sm90.md).
                // In some variants (ORDER_V_WAIT) ptxas moved the try-wait itself up into the
                // softmax: there its parity takes the softmax's sums through zero_after, which
                // keeps all 66 MUFU.EX2 before it.
                const u32 after_softmax = ORDER_V_WAIT ? zero_after(l_i[0]) ^ zero_after(l_i[1]) : 0u;
                mbar_wait(bar.v_full(s), ph ^ after_softmax);
                wgmma_wait<0>();
                reg_fence(oacc);
                reg_fence_u32(pa);  // pa stays live until the P V reading it has completed
                release(bar.v_empty(ps), lane);
                rescale_o(oacc, alpha, need_rescale);
                pack_p(sacc, pa);
                ps = s;
                if (++s == STAGES) {
                    s = 0;
                    ++round;
                }
            }
            trace(tile_i, TR_LOOP_END);
            reg_fence(oacc);  // V of the last tile was waited for after its softmax
            turn_wait(cw);
            wgmma_fence();
            issue_pv(oacc, pa, dv, ps);
            wgmma_commit();
            turn_pass(cw);
            wgmma_wait<0>();
            reg_fence(oacc);
            trace(tile_i, TR_LAST_PV);
            release(bar.v_empty(ps), lane);
        }
    }
    ring.advance(n_tiles);
    // A split tile: the first part to finish hands its O, m and l over and stores nothing.
    if (!SPLIT || split < 0 || merge_split(oacc, m_i, l_i, split >> 1, cw, warp, lane, ws)) {
        store_o(oacc, m_i, l_i, sStage, cw, warp, lane, m0w, row0, seqlen_q, tm_o, head, batch, og, q_stride, lseg);
        if (STAGE_IN_Q) {  // the stores have read the staged rows (this warp's Q rows)
            if (lane == 0) bulk_wait_read<0>();
            __syncwarp();
        }
    }
    if (STAGE_IN_Q) release_q(bar);
    trace(tile_i, TR_EPILOGUE);
}

}  // namespace fm90
