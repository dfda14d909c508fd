// flashmoe — FlashAttention forward for Hopper (sm_90a): TMA loads into an mbarrier-guarded
// shared-memory ring, warpgroup MMAs (wgmma) with fp32 accumulators, warp specialisation.
//
// Compiled at run time by NVRTC for sm_90a only, specialised by defines (listed in
// fm90_config.cuh; the table of variants is crates/flashmoe/src/attention/prefill/tiles.rs,
// `sm90_tile`). This file only wires the roles together: it sets up the barriers, splits
// the registers, and runs the producer loop (warpgroup 0) and the consumer loop (the
// others). The roles live in headers over the generic primitives of fm_sm90.cuh, the way
// FlashAttention-3's hopper/ folder is cut:
//   fm90_config.cuh     defines, constants, shared-memory and workspace layouts, the ring's
//                       barriers and parities
//   fm90_scheduler.cuh  work tiles: rank dispenser, schedule, rank -> tile order, split of
//                       the last wave over key ranges
//   fm90_producer.cuh   the TMA producer (Q, K, V loads; posts the next work tile)
//   fm90_mainloop.cuh   a consumer warpgroup: GEMMs, pipeline, ping-pong turns, consume()
//   fm90_softmax.cuh    mask, online softmax, O rescale
//   fm90_epilogue.cuh   merge of split tiles, O and LSE stores
//   fm90_trace.cuh      the FM_TRACE development timeline
//
// ABI (extern "C" flash_attn_fwd_sm90):
//   (const __grid_constant__ FmTensorMap tm_q, tm_k, tm_v, tm_o, u16* o, float* lse,
//    int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2,
//    int batch, unsigned char* workspace)
//   tm_q: 4-D tensor map over q (batch, seqlen_q, heads_q, D) — dims innermost first
//         (D, heads_q, seqlen_q, batch), box (64, 1, BLOCK_M, 1), 128B swizzle, zero fill;
//   tm_k, tm_v: the same over k / v (D, heads_kv, seqlen_k, batch), box (64, 1, BLOCK_N, 1);
//   tm_o: the same over o (D, heads_q, seqlen_q, batch), box (64, 1, 16, 1): with
//         O_TMA_STORE each consumer warp stores its 16 rows with TMA (rows past Sq are not
//         written); otherwise unused, and o is written with plain stores.
//   o: (batch, seqlen_q, heads_q, D) 16-bit; lse: (batch, heads_q, seqlen_q) f32, natural log.
//   Grid (G, 1, 1), G = the number of work tiles or fewer (persistent: one CTA per SM).
//   Work tile of rank r = (query block, head, batch) = (r % nb, r / nb % Hq, r / (nb * Hq))
//   with nb = ceil(Sq / BLOCK_M); causal: query blocks last to first (heaviest first), and
//   from nb >= 6 in groups of heads, each block of all the group's heads before the next
//   (decode_tile). Causal query blocks are aligned to the last query row
//   (rounded up to a multiple of 16, Sq16): block b covers rows [Sq16 - (b+1) BLOCK_M,
//   Sq16 - b BLOCK_M). So a ragged Sq makes the first block short (rows that see the fewest
//   keys) instead of the last one (rows that see every key tile, with idle warpgroups).
//   The first block starts below row 0: Q rows < 0 are TMA-filled with zeros, warpgroups
//   with no row >= 0 pass (pass_tile), and warps with no row >= 0 store nothing. The
//   rounding to 16 keeps every warp's 16 rows on one side of row 0: a TMA store whose box
//   starts at a negative row raised an illegal instruction on the H100.
//   Ranks are handed out by a dispenser in the workspace (one atomicAdd per tile): a CTA
//   takes the next rank when it starts a tile, so CTAs that drew cheap (causal) tiles take
//   more of them. The last CTA to find no work left resets the dispenser. D >= 128
//   non-causal with >= 32 key tiles per work tile: the last G + R tiles are cut over key
//   ranges into G slots, one rank each, whose parts merge through records in the workspace
//   (SPLIT, make_schedule). workspace: WS_BYTES of global memory, zero before the launch
//   and left zero by it; launches that may overlap (other streams) need their own.
//   Block 128 * (CONSUMERS + 1) threads.
//   FM_VARLEN (packed variable-length batch): two more parameters, const int* cu_seqlens_q,
//   cu_seqlens_k ([batch + 1] offsets, device memory); seqlen_q / seqlen_k are then the
//   packed row counts total_q / total_k; q, o (total_q, heads_q, D) and k, v (total_k,
//   heads_kv, D) are mapped as (D, heads, total, 1); lse is (heads_q, total_q); tm_o is
//   unused. Sequence b is rows [cu_q[b], cu_q[b+1]) of q and [cu_k[b], cu_k[b+1]) of k,
//   causal bottom-right per sequence. A tile's rows past its sequence's end load the next
//   sequence's rows: keys >= sk are masked in the scores, queries >= sq are not stored.
//   Work tiles: (sequence, query block, head), see decode_varlen; no split.
//   FM_WINDOW (sliding window, with FM_CAUSAL): two more int parameters after those,
//   window_left and window_right (>= 0; a side at least as long as the sequence is
//   unbounded, the host passes 2^30): row i sees keys j with i + Sk - Sq - left <= j <=
//   i + Sk - Sq + right (per sequence with FM_VARLEN). The kernel clamps right to Sq and left
//   to Sk (no change in meaning, no int overflow). Work tiles visit only key tiles some row
//   of theirs can see (key_tiles in fm90_scheduler.cuh), masked at both ends; no split.
//   FM_SOFTCAP (logit softcap): one more float parameter, softcap_log2 = softcap * log2 e;
//   softmax_scale_log2 is then scale / softcap, and the logits are
//   softcap_log2 * tanh(q.k * softmax_scale_log2) (softcap_tile in fm90_softmax.cuh).
//   Rows with no visible key: O = 0, LSE = -inf. Same contract as flash_attn_fwd.cu (v1).
//
// Roles: warpgroup 0 is the producer (one thread issues every TMA load; the warpgroup gives
// its registers away with setmaxnreg.dec); warpgroups 1..CONSUMERS each own 64 query rows:
//   S = Q K^T     wgmma SS (Q and K K-major from swizzled smem), or RS with FM_Q_REGS (Q
//                 read into registers once per work tile), N = BLOCK_N; S of key tile i+1
//                 is issued before the softmax of tile i+1, while P V of tile i runs
//   softmax       online, fp32, log2 domain (scale*log2e folded into one FFMA before ex2)
//   O += P V      wgmma RS: P packed to 16 bit in registers (the accumulator layout of two
//                 8-column blocks is the A-fragment layout of one k16 step), V MN-major
// Barriers per ring slot: k_full, v_full (TMA bytes landed; V separately so S can start
// first) and k_empty, v_empty (one arrival per consumer warp once its wgmmas reading that
// half of the slot are complete). K/V tiles are visited last to first so the masked tiles come first.
// Per work tile: q_full (the posted tile is readable and Q landed; a tile that sees no key
// loads no Q) and q_empty (one arrival per consumer thread after its last S = Q K^T: Q and
// the posted tile may be replaced).
//
// Shared memory (dynamic, one formula mirrored by Sm90Tile::shared_mem_bytes in config.rs):
//   bytes = 1024 + 2 * D * (BLOCK_M + 2 * STAGES * BLOCK_N) + BLOCK_M * (2 * D + PAD)
//           + 8 * (2 + 4 * STAGES) + 64,   PAD = 0 with O_TMA_STORE (D >= 128), else 16
//   (1024: slack to align the base to the 128B-swizzle atom; Q, K ring, V ring, the O
//   staging rows of the epilogue, barriers, the two work-tile records the producer posts.)

#include "fm90_config.cuh"
#include "fm90_mainloop.cuh"
#include "fm90_producer.cuh"
#include "fm90_scheduler.cuh"
#include "fm90_trace.cuh"

extern "C" __global__ void __launch_bounds__(fm90::THREADS, 1)
    flash_attn_fwd_sm90(const __grid_constant__ FmTensorMap tm_q,
                        const __grid_constant__ FmTensorMap tm_k,
                        const __grid_constant__ FmTensorMap tm_v,
                        const __grid_constant__ FmTensorMap tm_o, u16* __restrict__ o,
                        float* __restrict__ lse, int seqlen_q, int seqlen_k, int heads_q,
                        int heads_kv, float softmax_scale_log2, int batch_size,
                        unsigned char* __restrict__ workspace
#if FM_VARLEN
                        ,
                        const int* __restrict__ cu_seqlens_q, const int* __restrict__ cu_seqlens_k
#endif
#if FM_WINDOW
                        ,
                        int window_left, int window_right
#endif
#if FM_SOFTCAP
                        ,
                        float softcap_log2
#endif
                        ) {
    using namespace fm90;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    // 128B-swizzle atoms must start on 1024-byte boundaries (descriptor base offset 0).
    const u32 base = (smem_addr(smem_raw) + 1023u) & ~1023u;
    const u32 sQ = base, sK = base + OFF_K, sV = base + OFF_V;
    const Bars bar{base + OFF_BAR};

    if (threadIdx.x == 0) {
        mbar_init(bar.q_full(), 1);
        mbar_init(bar.q_empty(), NCW * 128);  // every consumer thread (release_q)
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(bar.k_full(s), 1);
            mbar_init(bar.v_full(s), 1);
            mbar_init(bar.k_empty(s), NCW * 4);
            mbar_init(bar.v_empty(s), NCW * 4);
        }
        mbar_init_fence();
    }
    __syncthreads();

    // Work tiles in rank order (see decode_tile): query block fastest, so that the CTAs
    // running together share K/V in L2; causal: each head's heaviest (last) query blocks
    // first. The producer draws the ranks and posts each tile to the consumers in one of two
    // shared-memory records (tile_record), published by the q_full barrier (its arrive
    // releases the post) and rewritten two tiles later, after q_empty (every consumer thread
    // has read it by then).
#if !FM_WINDOW
    constexpr int window_left = 0, window_right = 0;
#endif
#if !FM_SOFTCAP
    constexpr float softcap_log2 = 0.f;
#endif
    // The softmax's multiplier of the scores, and with SOFTCAP the tanh's.
    const float sm_scale = SOFTCAP ? softcap_log2 : softmax_scale_log2;
    const int n_mb = (seqlen_q + BM - 1) / BM;
    // Row i sees keys j <= i + diag (causal), and with WINDOW j >= i + lo_shift. (Varlen:
    // per sequence, from its lengths.)
    const int right = WINDOW ? min(window_right, seqlen_q) : 0;
    const int left = WINDOW ? min(window_left, seqlen_k) : 0;
    const int diag = seqlen_k - seqlen_q + right;
    const int lo_shift = seqlen_k - seqlen_q - left;
    const int group = heads_q / heads_kv;
    const u32 tile_records = tile_record(base, 0);  // (hoisted: the consumers' address arithmetic)
    SlotPhases ring;

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0) {
            tma_prefetch_desc(&tm_q);
            tma_prefetch_desc(&tm_k);
            tma_prefetch_desc(&tm_v);
            if (O_TMA_STORE) tma_prefetch_desc(&tm_o);
            int* disp = reinterpret_cast<int*>(workspace);
            Producer p{&tm_q, &tm_k, &tm_v, base, group,
                       make_schedule(n_mb, heads_q, batch_size, seqlen_q, seqlen_k, diag, lo_shift)};
#if FM_VARLEN
            p.seqs = VarlenSeqs{cu_seqlens_q, cu_seqlens_k, batch_size, heads_q, seqlen_q, seqlen_k, right,
                                left};
#endif
            p.rank = draw_rank(disp);
            p.post_next(0);
            for (int i = 0;; ++i) {
                // Record i was written during tile i - 1, whose consumers had read record
                // i - 2 (the same one) before they released Q (q_empty of tile i - 2).
                trace(i, TR_Q_EMPTY);
                if (i > 0) mbar_wait(bar.q_empty(), (i - 1) & 1);
                const WorkTile w = read_tile(p.record(i));
                trace(i, TR_POSTED);
                trace_value(i, TR_N_TILES, w.n_tiles);
                if (w.head < 0) {
                    mbar_arrive(bar.q_full());  // the consumers read "no work left" and stop
                    leave_dispenser(disp);
                    break;
                }
                // The next tile's rank, drawn early to hide the atomic (none while the
                // slot of split tiles has segments left).
                if (p.cur.pos == p.cur.end) p.rank = draw_rank(disp);
                if (w.n_tiles == 0) {
                    p.post_next(i + 1);
                    p.k0_loaded = false;
                    mbar_arrive(bar.q_full());
                } else {
                    p.produce(w, i);
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int cw = wg - 1;
        if (FM_PINGPONG && cw == NCW - 1) turn_pass(cw);  // warpgroup 0 issues first
        const i64 q_stride = (i64)heads_q * D;
        for (int i = 0;; ++i) {
            mbar_wait(bar.q_full(), i & 1);
            trace(i, TR_POSTED);
            const WorkTile w = read_tile(tile_records + (i & 1) * 32);  // tile_record(base, i)
            if (w.head < 0) break;
            if (VARLEN) {  // rows of the sequence: o (total_q, Hq, D) from row q0, lse (Hq, total_q)
                u16* og = o + ((i64)w.q0 * heads_q + w.head) * D;
                float* lseg = lse + (i64)w.head * seqlen_q + w.q0;
                consume(sQ, sK, sV, STAGE_IN_Q ? sQ : base + OFF_STAGE, bar, cw, w.m0 + cw * 64, w.n_tiles, w.kt_end, w.split, w.sq,
                        w.sk, w.sk - w.sq + right, w.sk - w.sq - left, sm_scale, softmax_scale_log2, &tm_o, w.head, 0, og,
                        q_stride, lseg, ring, i, workspace);
            } else {
                u16* og = o + ((i64)w.batch * seqlen_q * heads_q + w.head) * D;
                float* lseg = lse + ((i64)w.batch * heads_q + w.head) * seqlen_q;
                consume(sQ, sK, sV, STAGE_IN_Q ? sQ : base + OFF_STAGE, bar, cw, w.m0 + cw * 64, w.n_tiles, w.kt_end, w.split,
                        seqlen_q, seqlen_k - w.k0, diag - w.k0, lo_shift - w.k0, sm_scale, softmax_scale_log2, &tm_o, w.head, w.batch,
                        og, q_stride, lseg, ring, i, workspace);
            }
        }
        // The shared memory the last O stores read must outlive them.
        if (O_TMA_STORE && (threadIdx.x & 31) == 0) bulk_wait<0>();
    }
}
