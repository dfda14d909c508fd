// flashmoe — paged-KV decode attention (Sq = 1..16 query rows per sequence), sm_80+ (mma.sync).
//
// Two entries, one source, specialised by defines (crates/flashmoe/src/attention/decode.rs
// owns the table of variants and mirrors the constants and parameter structs below):
//
//   FM_HEAD_DIM    D: 64, 128 or 256
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (q, caches, o; fp32 accumulation)
//   FM_MT          m16 tiles of packed query rows per CTA (BM = 16 * FM_MT rows)
//   FM_STAGES      K/V pages in flight through the shared-memory ring (cp.async groups)
//   FM_SOFTCAP     1: scores = softcap * tanh(scale * q.k / softcap)
//   FM_ALIBI       1: scores -= slope[b][h] * |d_i - j| after the softcap (FlashAttention's
//                  ALiBi; d_i the row's diagonal below), slopes f32 from DecodeParams::alibi
//
// decode_paged_fwd: grid (splits * m_blocks, heads_kv, batch), 128 threads. One CTA owns one
//   (sequence, KV head, KV split, row block). Query rows: Sq per sequence, or with
//   cu_seqlens_q (mixed batches) rows cu[b] .. cu[b+1] of the packed (total_q, Hq, D) q,
//   at most seqlen_q (the grid's row blocks cover that many); a CTA whose row block holds no
//   row of its sequence returns at once. The G = Hq/Hkv query heads x Sq rows that read
//   one KV head are packed into M = G * Sq tile rows (row r: query row r / G, head
//   kv_head * G + r % G), so K and V are read from HBM once per KV head, not once per query
//   head. K/V tiles of BN = 64 keys stream through a STAGES-deep cp.async ring (16-byte,
//   coalesced: a 16-key group of a tile never crosses a page since page sizes are multiples
//   of 16). The 4 warps split each tile by keys (warp w: keys 16w..16w+15), each running
//   S = Q K^T and O += P V on mma.m16n8k16 over all BM rows with its own fp32 online softmax
//   (exp2 domain); the warps' (m, l, O) merge in shared memory at the end, in a fixed order.
//   Block ids come from the block table one tile ahead (a register prefetch), so the table
//   read never sits between the wait and the next page's cp.async.
//   splits == 1: writes o (dtype) and lse (natural log). splits > 1: writes the split's
//   normalised O (f32) and log2-domain LSE to the workspace, then takes a ticket of its
//   (sequence, KV head, row block); the last of the splits to arrive merges all of them,
//   LSE-weighted in split order (deterministic whichever CTA is last), writes o and lse and
//   resets the ticket (one launch per step; removing the second launch measured -0.3 us at B = 1:
//   docs/design/attention-decode.md).
//   Rows no split saw get O = 0, LSE = -inf.
// decode_append_kv: writes k_new/v_new (B, Snew, Hkv, D) into the paged caches at
//   positions seqused_k[b] + t (t < Snew) through the block table.
//
// Memory floor (what a decode step must move): the visible K and V rows, once per KV head:
//   bytes = sum_b visible_keys(b) * Hkv * D * 2 (K, V) * 2 (16-bit)  (+ q, o: B*Sq*Hq*D*2*2)
//   FLOPs = 4 * sum_b Sq * Hq * visible_keys(b) * D, i.e. 2 * G * Sq FLOPs per KV byte: at
//   G * Sq <= 64 this is far below the H100's ridge point (~300 FLOP/B), so HBM bandwidth
//   bounds the kernel and the mma work (padded to 16 rows) is free.
//
// Masking (per query row i of a sequence with Sq rows and seqlen_k = seqused_k[b] keys):
//   diagonal d_i = seqlen_k - Sq + i; visible keys j with
//   (window_left < 0 || j >= d_i - window_left) && (window_right < 0 || j <= d_i + window_right)
//   and 0 <= j < seqlen_k. Causal decode is window (-1, 0). A row with no visible key gets
//   O = 0, LSE = -inf.
//
// Shared memory (dynamic), mirrored by DecodeKernel::shared_mem_bytes in decode.rs:
//   PITCH = 64 (D <= 64), 128 (D <= 128), 256; rows padded to PITCH elements, XOR swizzle
//   bytes = 2 * PITCH * (BM + 2 * STAGES * BN)   layout [Q: BM rows][K ring][V ring]
//   The ring is reused at the end for the warps' f32 O (WARPS x BM x (D + 8) floats), then by
//   the merging CTA for the splits' weights (BM x splits floats).
//
// Workspace (splits > 1; DecodePlan::partial_bytes mirrors it), rows indexed by
// (token, head) with token = b * Sq + qi (or cu[b] + qi): [o_part: splits x total_q x Hq x D
// f32][lse_part: splits x total_q x Hq f32][tickets: batch x heads_kv x m_blocks int]. The
// tickets are zero before a launch and zero after it.

#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2
#ifndef FM_MT
#define FM_MT 1
#endif
#ifndef FM_STAGES
#define FM_STAGES 3
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_ALIBI
#define FM_ALIBI 0
#endif

namespace fmd {

constexpr int D = FM_HEAD_DIM;
constexpr int MT = FM_MT;
constexpr int BM = 16 * MT;
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int BN = 16 * WARPS;  // keys per K/V tile: 16 per warp
constexpr int STAGES = FM_STAGES;
constexpr bool SOFTCAP = FM_SOFTCAP != 0;
constexpr bool ALIBI = FM_ALIBI != 0;
constexpr int PITCH = D <= 64 ? 64 : (D <= 128 ? 128 : 256);
constexpr int PITCH_B = PITCH * 2;
constexpr int CPR = D / 8;  // 16-byte chunks per row
constexpr int DT = D / 8;   // n8 tiles of O
constexpr int KD = D / 16;  // k16 steps of S = Q K^T
constexpr int Q_BYTES = BM * PITCH_B;
constexpr int KV_TILE_BYTES = BN * PITCH_B;
constexpr int RING_BYTES = 2 * STAGES * KV_TILE_BYTES;
constexpr int SMEM_BYTES = Q_BYTES + RING_BYTES;
constexpr int OP = D + 8;  // f32 row pitch of the epilogue's O (8 banks of shift per row)
constexpr int RSTEP = THREADS / CPR;  // tile rows one pass of the block loads
constexpr int LOAD_ITERS = BN / RSTEP;
constexpr float LN2 = 0.6931471805599453f;

static_assert(D == 64 || D == 128 || D == 256, "head dim must be 64, 128 or 256");
static_assert(MT == 1 || MT == 2, "FM_MT must be 1 or 2");
static_assert(STAGES >= 2 && STAGES <= 6, "FM_STAGES must be 2..6");
static_assert(THREADS % CPR == 0 && 16 % RSTEP == 0, "a thread's load rows stay in 16-key groups");
static_assert(WARPS * BM * OP * 4 <= RING_BYTES, "epilogue O must fit the ring");
constexpr int MAX_SPLITS = 128;  // decode.rs MAX_SPLITS
static_assert(BM * MAX_SPLITS * 4 <= RING_BYTES, "the merge's split weights must fit the ring");
static_assert(SMEM_BYTES == 2 * PITCH * (BM + 2 * STAGES * BN), "smem formula");

// Kernel parameters, by value. Mirrored by `DecodeParams` (#[repr(C)]) in decode.rs.
struct DecodeParams {
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    const int* block_table;
    const int* seqused_k;
    float* o_part;    // [splits][total_q][heads_q][D] f32 (splits > 1)
    float* lse_part;  // [splits][total_q][heads_q] f32, log2 domain (splits > 1)
    int* tickets;     // [batch][heads_kv][m_blocks] arrivals (splits > 1)
    const int* cu_seqlens_q;  // [batch + 1] or null (every sequence has seqlen_q rows)
    i64 q_sb, q_ss, q_sh;        // q strides (batch, seq, head), elements
    i64 k_sblk, k_srow, k_sh;    // k cache strides (block, row in page, head)
    i64 v_sblk, v_srow, v_sh;
    i64 bt_stride;               // block-table row stride
    int batch, seqlen_q, heads_q, heads_kv;
    int group, page_size, max_blocks, splits;
    int m_blocks, window_left, window_right;
    float scale_log2;    // SOFTCAP: scale / softcap; else scale * log2(e)
    float softcap_log2;  // softcap * log2(e) (SOFTCAP only)
    int num_blocks;      // block ids outside [0, num_blocks) are never read
    int total_q;         // query tokens of the call: batch * seqlen_q, or cu_seqlens_q[batch]
    const float* alibi;  // ALIBI: slopes, slope of (b, h) at alibi[b * alibi_bstride + h]
    i64 alibi_bstride;   // 0: one [heads_q] vector for every sequence
};
static_assert(sizeof(DecodeParams) == 248, "DecodeParams layout (decode/config.rs)");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
// Byte offset of 16-byte chunk `ch` of row `r` inside a swizzled tile.
__device__ __forceinline__ u32 swz(int r, int ch) {
    return (u32)(r * PITCH_B + ((ch ^ (r & 7)) << 4));
}

// Where one 16-key group of a tile lives: block id (-1 or out of range: nothing read) and the row
// inside the page of the group's first key.
struct Pages {
    int blk[WARPS];
    int off[WARPS];
};

// Look up the pages of tile t (keys t*BN ..) for the groups that hold a key of [kmin, kmax).
__device__ __forceinline__ void tile_pages(Pages& pg, const DecodeParams& p,
                                           const int* __restrict__ bt, int t, int kmin,
                                           int kmax) {
    const int n = t * BN;
    int pidx = n / p.page_size;
    int rem = n - pidx * p.page_size;
#pragma unroll
    for (int g = 0; g < WARPS; ++g) {
        const int key0 = n + 16 * g;
        const bool need = key0 < kmax && key0 + 16 > kmin && pidx < p.max_blocks;
        // Not inspected here: the value is first used by load_kv one iteration later, so
        // the load's latency hides behind a tile of compute.
        pg.blk[g] = need ? __ldg(bt + pidx) : -1;
        pg.off[g] = rem;
        rem += 16;
        // Page sizes are multiples of 16 (or there is one page): groups never straddle.
        if (rem >= p.page_size) {
            rem -= p.page_size;
            ++pidx;
        }
    }
}

// cp.async tile t's K and V rows into the ring slot; keys outside [kmin, kmax) or on an
// unreadable page are zero-filled (nothing read), so V rows that get P = 0 are finite.
__device__ __forceinline__ void load_kv(u32 sK, u32 sV, const DecodeParams& p, const Pages& pg,
                                        int t, int kv_head, int kmin, int kmax, int tid) {
    const int r0 = tid / CPR;
    const int ch = tid % CPR;
    const u16* kb = p.k + (i64)kv_head * p.k_sh + ch * 8;
    const u16* vb = p.v + (i64)kv_head * p.v_sh + ch * 8;
#pragma unroll
    for (int it = 0; it < LOAD_ITERS; ++it) {
        const int g = (it * RSTEP) / 16;          // compile-time after unrolling
        const int rin = r0 + it * RSTEP - 16 * g;  // row inside the 16-key group
        const int r = r0 + it * RSTEP;
        const int key = t * BN + r;
        const int blk = pg.blk[g];  // first use of the prefetched table entry
        const bool ok = (unsigned)blk < (unsigned)p.num_blocks && key >= kmin && key < kmax;
        const i64 row = (i64)(pg.off[g] + rin);
        const u16* ks = ok ? kb + (i64)blk * p.k_sblk + row * p.k_srow : p.k;
        const u16* vs = ok ? vb + (i64)blk * p.v_sblk + row * p.v_srow : p.v;
        cp_async16(sK + swz(r, ch), ks, ok);
        cp_async16(sV + swz(r, ch), vs, ok);
    }
}

}  // namespace fmd

extern "C" __global__ void __launch_bounds__(fmd::THREADS, 1)
    decode_paged_fwd(const __grid_constant__ fmd::DecodeParams p) {
    using namespace fmd;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ float s_m[WARPS][BM], s_l[WARPS][BM], s_f[WARPS][BM], s_lse[BM];

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int split = blockIdx.x / p.m_blocks;
    const int mb = blockIdx.x - split * p.m_blocks;
    const int kv_head = blockIdx.y;
    const int b = blockIdx.z;
    const int G = p.group;
    // This sequence's query rows: its first token (the row of o) and their count. Bounds
    // from cu_seqlens_q are clamped to [0, total_q] and to seqlen_q rows (no access past q/o).
    int tok0, Sq;
    if (p.cu_seqlens_q) {
        tok0 = min(max(p.cu_seqlens_q[b], 0), p.total_q);
        Sq = min(min(max(p.cu_seqlens_q[b + 1], tok0), p.total_q) - tok0, p.seqlen_q);
    } else {
        tok0 = b * p.seqlen_q;
        Sq = p.seqlen_q;
    }
    const int row0 = mb * BM;  // first packed row of this CTA
    if (row0 >= G * Sq) return;  // CTA-uniform: no row of this sequence here (no ticket either)
    const int rows = min(BM, G * Sq - row0);  // valid packed rows (>= 1)
    // q: the batch stride is 0 with cu_seqlens_q, and rows are counted from tok0.
    const i64 q_base = (i64)b * p.q_sb + (i64)(p.cu_seqlens_q ? tok0 : 0) * p.q_ss;

    // Keys of this sequence; clamped to the table's capacity so no table read goes past it.
    const int seqlen_k = max(0, min(p.seqused_k[b], p.max_blocks * p.page_size));
    const int diag0 = seqlen_k - Sq;
    // Visible keys of query row qi: [lo(qi), hi(qi)); both are non-decreasing in qi.
    auto lo_of = [&](int qi) {
        return p.window_left < 0 ? 0 : max(0, diag0 + qi - p.window_left);
    };
    auto hi_of = [&](int qi) {
        return p.window_right < 0 ? seqlen_k : max(0, min(seqlen_k, diag0 + qi + p.window_right + 1));
    };
    const int qi_first = row0 / G;
    const int qi_last = (row0 + rows - 1) / G;
    const int kmin = lo_of(qi_first), kmax = hi_of(qi_last);  // keys any row here sees
    const int lo_max = lo_of(qi_last), hi_min = hi_of(qi_first);  // keys every row sees
    const int t_begin = kmin / BN;
    const int t_end = kmax > kmin ? (kmax + BN - 1) / BN : t_begin;
    const int tps = (t_end - t_begin + p.splits - 1) / p.splits;
    const int tb = t_begin + split * tps;
    const int n_tiles = max(0, min(t_end, tb + tps) - tb);
    const int* __restrict__ bt = p.block_table + (i64)b * p.bt_stride;

    const u32 sQ = smem_addr(smem_raw);
    const u32 sK0 = sQ + Q_BYTES;
    const u32 sV0 = sK0 + STAGES * KV_TILE_BYTES;

    // ---- Q: the BM packed rows (zero beyond the valid rows) ----
    for (int c = tid; c < BM * CPR; c += THREADS) {
        const int r = c / CPR, ch = c % CPR;
        const bool ok = r < rows;
        const int rr = row0 + r;
        const int qi = rr / G;
        const int h = kv_head * G + (rr - qi * G);
        const u16* src = ok ? p.q + q_base + (i64)qi * p.q_ss + (i64)h * p.q_sh + ch * 8 : p.q;
        cp_async16(sQ + swz(r, ch), src, ok);
    }
    cp_async_commit();

    // ---- prologue: tiles 0 .. STAGES-2 in flight; block ids of tile STAGES-1 requested ----
    Pages pg;
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_tiles) {
            tile_pages(pg, p, bt, tb + st, kmin, kmax);
            load_kv(sK0 + st * KV_TILE_BYTES, sV0 + st * KV_TILE_BYTES, p, pg, tb + st, kv_head,
                    kmin, kmax, tid);
        }
        cp_async_commit();
    }
    if (STAGES - 1 < n_tiles) tile_pages(pg, p, bt, tb + STAGES - 1, kmin, kmax);

    // Per-thread rows of the mma C layout: row mt*16 + lane/4 + 8h; their visible ranges
    // (and with ALiBi the row's slope in log2 units and its diagonal key).
    int rlo[MT][2], rhi[MT][2];
    float rslope[MT][2];
    int rdiag[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = min(mt * 16 + (lane >> 2) + 8 * h, rows - 1);  // pad rows: last row
            const int rr = row0 + r;
            const int qi = rr / G;
            rlo[mt][h] = lo_of(qi);
            rhi[mt][h] = hi_of(qi);
            if (ALIBI) {
                const int head = kv_head * G + (rr - qi * G);
                rslope[mt][h] = __ldg(p.alibi + (i64)b * p.alibi_bstride + head) * 1.4426950408889634f;
                rdiag[mt][h] = diag0 + qi;
            } else {
                rslope[mt][h] = 0.f;
                rdiag[mt][h] = 0;
            }
        }

    float oacc[MT][DT][4];
    float m_i[MT][2], l_i[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int e = 0; e < 4; ++e) oacc[mt][dt][e] = 0.f;
        m_i[mt][0] = m_i[mt][1] = neg_inf();
        l_i[mt][0] = l_i[mt][1] = 0.f;
    }

    // ldmatrix lane bases (as in flash_attn_fwd.cu): lb for Q (A, x4) and V (B, x4.trans),
    // kb for K (B, x4); chunk 2j + b of row r sits at chunk (2j + b) ^ (r & 7).
    const int li = lane >> 3, lr = lane & 7;
    u32 lb[4], kb[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        lb[j] = ((li & 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li >> 1))) << 4);
        kb[j] = ((li >> 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li & 1))) << 4);
    }
    const u32 wrow = warp * 16 * PITCH_B;  // this warp's 16 keys inside a tile

    int slot = 0;
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<STAGES - 2>();  // tile i (and Q) landed, this thread's part
        __syncthreads();              // everyone's part; the slot of tile i-1 is free
        {
            const int nx = i + STAGES - 1;
            if (nx < n_tiles) {
                int ns = slot + STAGES - 1;
                if (ns >= STAGES) ns -= STAGES;
                load_kv(sK0 + ns * KV_TILE_BYTES, sV0 + ns * KV_TILE_BYTES, p, pg, tb + nx,
                        kv_head, kmin, kmax, tid);
                // Block ids of the tile after: consumed one iteration later.
                if (nx + 1 < n_tiles) tile_pages(pg, p, bt, tb + nx + 1, kmin, kmax);
            }
            cp_async_commit();
        }
        const int n0 = (tb + i) * BN;
        const u32 sK = sK0 + slot * KV_TILE_BYTES + wrow;
        const u32 sV = sV0 + slot * KV_TILE_BYTES + wrow;

        // ---- S = Q K^T over this warp's 16 keys ----
        float s[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;
#pragma unroll
        for (int kk = 0; kk < KD; ++kk) {
            u32 b0, b1, b2, b3;
            ldsm_x4(sK + kb[kk & 3] + (kk >> 2) * 128, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                u32 a[4];
                ldsm_x4(sQ + lb[kk & 3] + (kk >> 2) * 128 + mt * 16 * PITCH_B, a[0], a[1], a[2],
                        a[3]);
                mma16816(s[mt][0], a, b0, b1);
                mma16816(s[mt][1], a, b2, b3);
            }
        }

        // ---- scores in the log2 domain (softcap first), then the mask ----
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (SOFTCAP)
                        s[mt][nt][e] = tanh_acc(s[mt][nt][e] * p.scale_log2) * p.softcap_log2;
                    else
                        s[mt][nt][e] *= p.scale_log2;
                }
        if (ALIBI) {  // the bias after the softcap, in log2 units (FlashAttention's order)
            const int col0 = n0 + warp * 16 + 2 * (lane & 3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int dist = abs(rdiag[mt][h] - (col0 + nt * 8 + e));
                            s[mt][nt][2 * h + e] -= rslope[mt][h] * (float)dist;
                        }
        }
        if (n0 < lo_max || n0 + BN > hi_min) {  // CTA-uniform: tile cut by some row's range
            const int col0 = n0 + warp * 16 + 2 * (lane & 3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const int col = col0 + nt * 8 + e;
                            if (col < rlo[mt][h] || col >= rhi[mt][h])
                                s[mt][nt][2 * h + e] = neg_inf();
                        }
        }

        // ---- online softmax (per warp) and O += P V ----
        u32 pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                float mx = fmaxf(fmaxf(s[mt][0][2 * h], s[mt][0][2 * h + 1]),
                                 fmaxf(s[mt][1][2 * h], s[mt][1][2 * h + 1]));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                const float m_new = fmaxf(m_i[mt][h], mx);
                // A row that has seen no key keeps m = -inf: subtract 0, never -inf - -inf.
                const float m_use = m_new == neg_inf() ? 0.f : m_new;
                const float alpha = ex2(m_i[mt][h] - m_use);
                m_i[mt][h] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float p0 = ex2(s[mt][nt][2 * h] - m_use);
                    const float p1 = ex2(s[mt][nt][2 * h + 1] - m_use);
                    sum += p0 + p1;
                    pa[mt][nt * 2 + h] = pack2(p0, p1);
                }
                l_i[mt][h] = l_i[mt][h] * alpha + sum;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt) {
                    oacc[mt][dt][2 * h] *= alpha;
                    oacc[mt][dt][2 * h + 1] *= alpha;
                }
            }
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(sV + lb[dp & 3] + (dp >> 2) * 128, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(oacc[mt][2 * dp], pa[mt], b0, b1);
                mma16816(oacc[mt][2 * dp + 1], pa[mt], b2, b3);
            }
        }
        if (++slot == STAGES) slot = 0;
    }

    // ---- epilogue: merge the 4 warps' (m, l, O) in warp order, then write ----
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: reuse it for the warps' O
    float* sO = reinterpret_cast<float*>(smem_raw + Q_BYTES);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_i[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            const int r = mt * 16 + (lane >> 2) + 8 * h;
            if ((lane & 3) == 0) {
                s_m[warp][r] = m_i[mt][h];
                s_l[warp][r] = l;
            }
            float* dst = sO + (warp * BM + r) * OP + 2 * (lane & 3);
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) =
                    make_float2(oacc[mt][dt][2 * h], oacc[mt][dt][2 * h + 1]);
        }
    __syncthreads();
    if (tid < BM) {
        float m = neg_inf();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, s_m[w][tid]);
        if (m == neg_inf()) {  // no visible key in this split
#pragma unroll
            for (int w = 0; w < WARPS; ++w) s_f[w][tid] = 0.f;
            s_lse[tid] = neg_inf();
        } else {
            float f[WARPS], L = 0.f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                f[w] = ex2(s_m[w][tid] - m);  // 0 for a warp that saw no key
                L += f[w] * s_l[w][tid];
            }
            const float inv = 1.f / L;  // L >= 1: the warp holding the max contributes 1
#pragma unroll
            for (int w = 0; w < WARPS; ++w) s_f[w][tid] = f[w] * inv;
            s_lse[tid] = m + lg2(L);
        }
    }
    __syncthreads();

    // Row (token, head) of packed row rr; o, o_part and lse_part index rows by it.
    auto out_row = [&](int rr, int& qi, int& h) {
        qi = rr / G;
        h = kv_head * G + (rr - qi * G);
        return (i64)(tok0 + qi) * p.heads_q + h;
    };
    // lse: [batch, heads_q, seqlen_q], or [heads_q, total_q] with cu_seqlens_q.
    auto lse_index = [&](int qi, int h) {
        return p.cu_seqlens_q ? (i64)h * p.total_q + tok0 + qi
                              : ((i64)b * p.heads_q + h) * Sq + qi;
    };
    const bool direct = p.splits == 1;
    const i64 split_rows = (i64)p.total_q * p.heads_q;  // rows of one split's partials
    for (int c = tid; c < rows * CPR; c += THREADS) {
        const int r = c / CPR, ch = c % CPR;
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = s_f[w][r];
            const float4* src = reinterpret_cast<const float4*>(sO + (w * BM + r) * OP + ch * 8);
            const float4 x0 = src[0], x1 = src[1];
            acc[0] += f * x0.x; acc[1] += f * x0.y; acc[2] += f * x0.z; acc[3] += f * x0.w;
            acc[4] += f * x1.x; acc[5] += f * x1.y; acc[6] += f * x1.z; acc[7] += f * x1.w;
        }
        int qi, h;
        const i64 orow = out_row(row0 + r, qi, h);
        if (direct) {
            u16* dst = p.o + orow * D + ch * 8;
            st_global_v4(dst, pack2(acc[0], acc[1]), pack2(acc[2], acc[3]), pack2(acc[4], acc[5]),
                         pack2(acc[6], acc[7]));
        } else {
            float4* dst = reinterpret_cast<float4*>(p.o_part + (split * split_rows + orow) * D + ch * 8);
            dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
            dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
        }
    }
    if (tid < rows) {
        int qi, h;
        const i64 orow = out_row(row0 + tid, qi, h);
        const float l2 = s_lse[tid];
        if (direct)
            p.lse[lse_index(qi, h)] = l2 == neg_inf() ? l2 : l2 * LN2;
        else
            p.lse_part[split * split_rows + orow] = l2;
    }
    if (direct) return;

    // ---- split merge: the last split of this (sequence, KV head, row block) to arrive ----
    __shared__ int s_last;
    __shared__ float s_inv[BM];
    __threadfence();  // this CTA's partials are visible device-wide before its ticket
    __syncthreads();
    if (tid == 0) {
        int* ticket = p.tickets + ((i64)b * p.heads_kv + kv_head) * p.m_blocks + mb;
        const int last = atomicAdd(ticket, 1) == p.splits - 1;
        if (last) *ticket = 0;  // every split has arrived: ready for the next launch
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    // Weights of the splits per row (unnormalised, in split order) in the free ring.
    float* s_w = sO;
    if (tid < rows) {
        int qi, h;
        const i64 orow = out_row(row0 + tid, qi, h);
        const float* lp = p.lse_part + orow;
        float m = neg_inf();
        for (int sp = 0; sp < p.splits; ++sp) m = fmaxf(m, __ldcg(lp + sp * split_rows));
        float L = 0.f;
        for (int sp = 0; sp < p.splits; ++sp) {
            const float ls = __ldcg(lp + sp * split_rows);
            const float w = ls == neg_inf() ? 0.f : ex2(ls - m);  // an empty split: weight 0
            s_w[tid * p.splits + sp] = w;
            L += w;
        }
        s_inv[tid] = L > 0.f ? 1.f / L : 0.f;
        p.lse[lse_index(qi, h)] = m == neg_inf() ? m : (m + lg2(L)) * LN2;
    }
    __syncthreads();
    for (int c = tid; c < rows * CPR; c += THREADS) {
        const int r = c / CPR, ch = c % CPR;
        int qi, h;
        const i64 orow = out_row(row0 + r, qi, h);
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.f;
        for (int sp = 0; sp < p.splits; ++sp) {  // fixed order: deterministic
            const float w = s_w[r * p.splits + sp];
            if (w == 0.f) continue;  // nothing to add (and an empty split's O is 0)
            const float4* src =
                reinterpret_cast<const float4*>(p.o_part + (sp * split_rows + orow) * D + ch * 8);
            const float4 x0 = __ldcg(src), x1 = __ldcg(src + 1);
            acc[0] += w * x0.x; acc[1] += w * x0.y; acc[2] += w * x0.z; acc[3] += w * x0.w;
            acc[4] += w * x1.x; acc[5] += w * x1.y; acc[6] += w * x1.z; acc[7] += w * x1.w;
        }
        const float inv = s_inv[r];
        st_global_v4(p.o + orow * D + ch * 8, pack2(acc[0] * inv, acc[1] * inv),
                     pack2(acc[2] * inv, acc[3] * inv), pack2(acc[4] * inv, acc[5] * inv),
                     pack2(acc[6] * inv, acc[7] * inv));
    }
}

// ---------------------------------------------------------------------------------------
// Append new K/V rows into the paged caches. Mirrored by `AppendParams` in decode.rs.
// Grid (s_new, batch), 128 threads; one 16-byte chunk per thread-iteration.
// Position of new row t of sequence b: seqused_k[b] + t (the lengths BEFORE this step; the
// caller advances seqused_k afterwards). Rows past the table, or on a block id outside
// [0, num_blocks), are not written.
// ---------------------------------------------------------------------------------------
namespace fmd {
struct AppendParams {
    const u16* k_new;
    const u16* v_new;
    u16* k_cache;
    u16* v_cache;
    const int* block_table;
    const int* seqused_k;
    i64 kn_sb, kn_ss, kn_sh;
    i64 vn_sb, vn_ss, vn_sh;
    i64 k_sblk, k_srow, k_sh;
    i64 v_sblk, v_srow, v_sh;
    i64 bt_stride;
    int heads_kv, page_size, max_blocks, num_blocks;
};
static_assert(sizeof(AppendParams) == 168, "AppendParams layout (decode.rs)");
}  // namespace fmd

extern "C" __global__ void __launch_bounds__(128) decode_append_kv(const __grid_constant__ fmd::AppendParams p) {
    using namespace fmd;
    const int t = blockIdx.x;
    const int b = blockIdx.y;
    const int pos = p.seqused_k[b] + t;
    if (pos < 0) return;
    const int pidx = pos / p.page_size;
    if (pidx >= p.max_blocks) return;
    const int blk = p.block_table[(i64)b * p.bt_stride + pidx];
    if ((unsigned)blk >= (unsigned)p.num_blocks) return;
    const int off = pos - pidx * p.page_size;
    for (int c = threadIdx.x; c < p.heads_kv * CPR; c += blockDim.x) {
        const int h = c / CPR, ch = c % CPR;
        const uint4 kx = *reinterpret_cast<const uint4*>(
            p.k_new + (i64)b * p.kn_sb + (i64)t * p.kn_ss + (i64)h * p.kn_sh + ch * 8);
        const uint4 vx = *reinterpret_cast<const uint4*>(
            p.v_new + (i64)b * p.vn_sb + (i64)t * p.vn_ss + (i64)h * p.vn_sh + ch * 8);
        *reinterpret_cast<uint4*>(p.k_cache + (i64)blk * p.k_sblk + (i64)off * p.k_srow +
                                  (i64)h * p.k_sh + ch * 8) = kx;
        *reinterpret_cast<uint4*>(p.v_cache + (i64)blk * p.v_sblk + (i64)off * p.v_srow +
                                  (i64)h * p.v_sh + ch * 8) = vx;
    }
}
