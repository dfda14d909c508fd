// flashmoe sm_90a attention — the producer role (warpgroup 0, one thread).
//
// Holds: Producer, which issues every TMA load of the CTA (Q per work tile, K and V per
// key tile into the mbarrier-guarded ring) and decodes and posts the next work tile while
// the ring is full. The consumer side of the same protocol is in fm90_mainloop.cuh; the
// model check of both is tools/models/ring_protocol_model.py. Included by
// flash_attn_fwd_sm90.cu, whose producer loop drives it.
#pragma once

#include "fm90_config.cuh"
#include "fm90_scheduler.cuh"
#include "fm90_trace.cuh"

namespace fm90 {

// The producer: one thread. It draws the ranks, decodes and posts each work tile, and
// loads Q and every K and V tile the consumers compute. The next tile is decoded and
// written to the other work-tile record during the current tile (once its loads fill the
// ring, where the producer waits for slots anyway), and its first K is loaded
// right after the current tile's last V, ahead of the wait for Q's release: an FM_TRACE
// timeline showed the producer thread taking about 3800 cycles from a tile's last V to
// the next tile's first K (decode 1240, post to Q issued 1260, ...; no barrier wait was
// long). Now that K is issued 2170 cycles before the last P V (710 after it before);
// D=128 +1-2 % against cuDNN in the next sweep (docs/design/attention-prefill-sm90.md).
struct Producer {
    const FmTensorMap *tq, *tk, *tv;
    u32 base;   // the aligned shared memory (Q, the ring, the barriers, the work-tile records)
    int group;  // query heads per KV head
    Schedule sc;
    SlotCursor cur;
    VarlenSeqs seqs;   // VARLEN: the packed batch's sequences
    VarlenCursor vcur;  // VARLEN: the sequence of the last rank decoded
    int rank = 0;            // the last rank drawn (decoded when the cursor's slot is empty)
    bool k0_loaded = false;  // the posted tile's first K is already loaded (into slot 0)
    SlotPhases ring;

    __device__ __forceinline__ Bars bar() const { return Bars{base + OFF_BAR}; }
    __device__ __forceinline__ u32 record(int i) const { return tile_record(base, i); }
    // The work after the current tile (the rest of the cursor's slot, or the drawn rank),
    // written to record i.
    __device__ __forceinline__ void post_next(int i) {
        if (VARLEN) post_tile(record(i), decode_varlen(rank, vcur, seqs));
        else post_tile(record(i), cur.pos != cur.end ? next_segment(sc, cur) : decode_rank(rank, sc, cur));
    }
    // K (or V) of key tile n0 into ring slot s: once every consumer warp released the
    // slot's previous contents (that use's parity). K and V are released separately: K as
    // soon as S is computed, V after P V, so the next K load starts early.
    // n0: the key tile's first row in k / v (varlen: in the packed tensor).
    __device__ __forceinline__ void load_kv(bool is_v, int s, int round, int kv_head, int n0, int batch) {
        const u32 full = is_v ? bar().v_full(s) : bar().k_full(s);
        if (ring.reused(s, round)) mbar_wait(is_v ? bar().v_empty(s) : bar().k_empty(s), ring.parity(s, round) ^ 1u);
        mbar_arrive_expect_tx(full, KV_BYTES);
        const u32 dst = base + (is_v ? OFF_V : OFF_K) + s * KV_BYTES;
#pragma unroll
        for (int h = 0; h < DH; ++h) tma_load_4d(dst + h * HALF_KV, is_v ? tv : tk, full, h * 64, kv_head, n0, batch);
    }
    // Work tile i, w (posted; its Q slot released by the consumers): Q, then K and V of
    // every key tile it visits, posting tile i + 1 on the way; then that tile's first K.
    __device__ __forceinline__ void produce(const WorkTile& w, int i) {
        const int kv_head = w.head / group;
        mbar_arrive_expect_tx(bar().q_full(), Q_BYTES);
#pragma unroll
        for (int h = 0; h < DH; ++h)
            tma_load_4d(base + h * HALF_Q, tq, bar().q_full(), h * 64, w.head, w.q0 + w.m0, VARLEN ? 0 : w.batch);
        trace(i, TR_S0);
        int s = 0, round = 0;
        for (int it = 0; it < w.n_tiles; ++it) {
            const int n0 = w.k0 + (w.kt_end - 1 - it) * BN;
            const int batch = VARLEN ? 0 : w.batch;
            if (it > 0 || !k0_loaded) load_kv(false, s, round, kv_head, n0, batch);
            if (it == 0 && !k0_loaded) trace(i, TR_K0);
            if (it == 1) trace(i, TR_K1);
            load_kv(true, s, round, kv_head, n0, batch);
            if (it == 0) trace(i, TR_V0);
            if (it == min(STAGES - 1, w.n_tiles - 1)) {  // the ring is full: slack until a slot frees
                post_next(i + 1);
                trace(i, TR_LAST_PV);
            }
            if (++s == STAGES) {
                s = 0;
                ++round;
            }
        }
        trace(i, TR_LOOP_END);
        ring.advance(w.n_tiles);
        const WorkTile next = read_tile(record(i + 1));
        k0_loaded = next.head >= 0 && next.n_tiles > 0;
        if (k0_loaded) {
            load_kv(false, 0, 0, next.head / group, next.k0 + (next.kt_end - 1) * BN, VARLEN ? 0 : next.batch);
            trace(i + 1, TR_K0);
        }
    }
};

}  // namespace fm90
