// flashmoe sm_90a attention — the work-tile scheduler of the persistent grid.
//
// Holds: the rank dispenser in the workspace (draw_rank, leave_dispenser), the work tile
// as the producer posts it (WorkTile, post_tile / read_tile), the launch's schedule
// (make_schedule: which ranks are whole tiles, which are slots of the last wave's tiles
// split over key ranges), the rank -> tile order (decode_tile: causal heaviest first, in
// groups of heads), the slot cursor of split tiles (decode_rank, next_segment) and, for
// FM_VARLEN, the walk over the packed batch's sequences (decode_varlen). Run by
// the producer thread only; the consumers just read the posted record. Included by
// fm90_producer.cuh and flash_attn_fwd_sm90.cu.
#pragma once

#include "fm90_config.cuh"

namespace fm90 {

// Rank dispenser of the work tiles, the first two ints of the launch's workspace (see
// WS_BYTES): [0] the next rank, [1] CTAs that drew a rank past the end. Zero before the
// launch; the last CTA to finish puts it back to zero.
__device__ __forceinline__ int draw_rank(int* disp) { return atomicAdd(&disp[0], 1); }

// Called once per CTA, after its last draw (a rank past the end). The fences order this
// CTA's draws before its arrival, and every arrival before the reset.
__device__ __forceinline__ void leave_dispenser(int* disp) {
    __threadfence();
    if (atomicAdd(&disp[1], 1) == (int)gridDim.x - 1) {
        __threadfence();
        disp[0] = 0;
        disp[1] = 0;
    }
}

// One work tile as the producer posts it in shared memory: the first query row, the query
// head, the batch, the number of key tiles it visits, key tiles kt_end - n_tiles .. kt_end
// - 1 (last to first; kt_end = n_tiles unless split), and split: -1, or the part of a tile
// split over two key ranges (see the split below): 2 * boundary + part. head = -1: no work left.
// VARLEN posts, instead of kt_end and split (never split there), the sequence: its first
// query and key rows in the packed tensors (q0, k0) and its lengths (sq, sk); m0 and the
// rows the tile's masks and stores use are relative to the sequence. Dense: q0 = k0 = 0.
// WINDOW: a tile visits only the key tiles from the one holding the lowest key its first
// row sees, and its keys start there: k0 is that key row (dense: posted in pad0), so
// kt_end = n_tiles, and the consumers shift Sk and the diagonals by it (varlen: sk is
// posted shifted).
struct WorkTile {
    int m0, head, batch, n_tiles;
    int kt_end, split, pad0, pad1;
    int q0 = 0, k0 = 0, sq = 0, sk = 0;
};

// ---- split of the launch's last tiles over key ranges (non-causal) ----
// Equal work tiles on G persistent CTAs leave the last wave partly empty: 2048 tiles of the
// D=128 sweep shapes on 132 SMs are 15.5 waves, and 64 CTAs sit idle for the 16th (3.3 % of
// the SM time in an FM_TRACE timeline). So the last G + R tiles (R = total mod G) are not
// dealt out whole: their key-tile iterations, in a row, are cut into G contiguous ranges
// (slots), one per rank after the whole tiles, like stream-K GEMMs. A range is at least one
// tile long, so a tile is cut at most once, into a part that starts it (part 0: the highest
// keys, visited first) and one that ends it (part 1). Each part's warps meet at the tile's
// boundary record: the first to finish publishes its unnormalised O, m and l there; the
// second merges them into its own and writes O and LSE (merge_split). Neither part ever
// waits for one that has not started, so any order of the ranks completes.
// SPLIT (D >= 128 non-causal) and SPLIT_MIN_KV_TILES, with the runs that chose them, are
// in fm90_config.cuh beside the workspace they size.

// The work-tile order of a launch, fixed by the problem and the grid (producer only).
struct Schedule {
    int total, n_mb, heads_q, seqlen_q, seqlen_k, diag;
    int lo_shift;  // WINDOW: row i sees keys >= i + lo_shift (diag - the window's lower edge)
    int n_whole;   // ranks [0, n_whole) are whole tiles (rank = tile)
    int n_ranks;   // ranks [n_whole, n_ranks) are the slots of the split tiles (SPLIT)
    int kv_tiles;  // key tiles of every (non-causal) work tile
    int sk_iters;  // key-tile iterations of the tiles [n_whole, total), cut into the slots
};

// Split only where the idle part of the last wave is worth more than the two extra tile
// starts and the merge each slot costs: (G - R) idle CTAs x L key tiles >= 2 G iterations,
// and L >= SPLIT_MIN_KV_TILES (fm90_config.cuh).
__device__ __forceinline__ Schedule make_schedule(int n_mb, int heads_q, int batch, int seqlen_q,
                                                  int seqlen_k, int diag, int lo_shift) {
    Schedule sc;
    sc.total = n_mb * heads_q * batch;
    sc.n_mb = n_mb;
    sc.heads_q = heads_q;
    sc.seqlen_q = seqlen_q;
    sc.seqlen_k = seqlen_k;
    sc.diag = diag;
    sc.lo_shift = lo_shift;
    sc.kv_tiles = (seqlen_k + BN - 1) / BN;
    sc.n_whole = sc.n_ranks = sc.total;
    sc.sk_iters = 0;
    const int g = (int)gridDim.x, waves = sc.total / g, rest = sc.total % g;
    if (SPLIT && g <= SPLIT_MAX_CTAS && waves >= 2 && rest != 0 && sc.kv_tiles >= SPLIT_MIN_KV_TILES &&
        (long long)(g - rest) * sc.kv_tiles >= 2ll * g) {
        sc.n_whole = (waves - 1) * g;
        sc.n_ranks = sc.n_whole + g;
        sc.sk_iters = (sc.total - sc.n_whole) * sc.kv_tiles;
    }
    return sc;
}

// Causal work tiles differ in cost (a query block visits as many key tiles as its last row
// sees), and the dispenser hands them out in rank order, so the launch ends well balanced
// only if it ends on light tiles. With every head's blocks in turn (heaviest first), the
// last heads' heaviest tiles start late: 5.4-7.9 % of the SM time sat idle after the CTAs'
// last tiles at S <= 1024 (FM_TRACE timeline). Ranks therefore go through groups of heads
// holding CAUSAL_GROUP_WAVES waves of tiles: inside a group, the heaviest query block of
// every head first, then the next (longest first). The partial group goes first, so the
// last one is full. Measured (H100): idle tail 2.6-4.3 %, +2-5 % at S >= 2048, but -3 % /
// -6 % at S = 512 (D=128 / 64): there the launch is near the copy ceiling, and grouping
// runs every head's light, memory-heavy tiles at the same time (slower key-tile steps).
// So the groups apply from CAUSAL_GROUP_MIN_BLOCKS query blocks per head (S = 1024 at
// both head dims: +5 % at D=64 and +1 % at D=128 against the same kernel with 10),
// and while a group's K and V (upper bound, no GQA sharing) stay within
// CAUSAL_GROUP_MAX_KV_BYTES of L2.
constexpr int CAUSAL_GROUP_WAVES = 2;
constexpr int CAUSAL_GROUP_MIN_BLOCKS = 6;
constexpr long long CAUSAL_GROUP_MAX_KV_BYTES = 32ll << 20;  // groups measured up to 25 MB (D=128 S=16384)
// Below CAUSAL_GROUP_MIN_BLOCKS, only the launch's last group (CAUSAL_GROUP_WAVES waves of
// tiles) is ordered longest first: the light tiles run together once, at the end. Measured
// (H100, S = 512 causal, 6 alternated rounds): idle tail 6.8 -> 3.2 % (D=128) and 5.5 ->
// 2.3 % (D=64), +2.2 % (D=128 bf16), +1.9 % (fp16), +2.5 % (D=64); key-tile steps unchanged.

// The key tiles a work tile of first row m0 visits: kt_end - n_tiles .. kt_end - 1, up to
// the key range of its last row (n_end), and with WINDOW from the tile holding the lowest
// key its first row (>= 0) sees (row i sees keys >= i + lo_shift).
struct KeyTiles {
    int kt_end, n_tiles;
};
__device__ __forceinline__ KeyTiles key_tiles(int m0, int n_end, int lo_shift) {
    const int kt_end = (n_end + BN - 1) / BN;
    if (!WINDOW) return KeyTiles{kt_end, kt_end};
    const int lo = max(0, max(m0, 0) + lo_shift);
    return KeyTiles{kt_end, max(0, kt_end - lo / BN)};
}

__device__ __forceinline__ WorkTile decode_tile(int rank, int total, int n_mb, int heads_q,
                                                int seqlen_q, int seqlen_k, int diag, int lo_shift) {
    if (rank >= total) return WorkTile{0, -1, 0, 0, 0, -1, 0, 0};
    int mb, bh;  // query block; batch * heads_q + head
    if (CAUSAL && n_mb >= CAUSAL_GROUP_MIN_BLOCKS) {
        const int n_bh = total / n_mb;
        int g_heads = (CAUSAL_GROUP_WAVES * (int)gridDim.x + n_mb - 1) / n_mb;
        if ((long long)g_heads * seqlen_k * (4 * D) > CAUSAL_GROUP_MAX_KV_BYTES) g_heads = 1;
        const int first = n_bh % g_heads;  // heads of the partial group (0: none)
        int r = rank, in_group = first, bh0 = 0;
        if (rank >= first * n_mb) {
            r = rank - first * n_mb;
            const int g = r / (g_heads * n_mb);
            r -= g * g_heads * n_mb;
            in_group = g_heads;
            bh0 = first + g * g_heads;
        }
        mb = r / in_group;
        bh = bh0 + (r - mb * in_group);
    } else {
        // Each head's blocks in turn. (Its own branch, with fewer divisions: the
        // group arithmetic measured at 1-3.5 % on short causal tiles, while the
        // decode still sat between the wait for Q's release and the next post.)
        mb = rank % n_mb;
        bh = rank / n_mb;
        if (CAUSAL) {
            // Only the last CAUSAL_GROUP_WAVES waves of tiles go longest first, so the
            // launch ends on light tiles without running light tiles together before
            // (and only while that group's K and V fit the same L2 budget).
            const int n_bh = total / n_mb;
            const int t_heads = min(n_bh, (CAUSAL_GROUP_WAVES * (int)gridDim.x + n_mb - 1) / n_mb);
            const int r = rank - (n_bh - t_heads) * n_mb;
            if (r >= 0 && (long long)t_heads * seqlen_k * (4 * D) <= CAUSAL_GROUP_MAX_KV_BYTES) {
                mb = r / t_heads;
                bh = n_bh - t_heads + (r - mb * t_heads);
            }
        }
    }
    // Causal: aligned to the last row rounded up to 16 (see the ABI note in
    // flash_attn_fwd_sm90.cu); the first block may start below row 0.
    const int m0 = CAUSAL ? ((seqlen_q + 15) & ~15) - (mb + 1) * BM : mb * BM;
    const int n_end = CAUSAL ? max(0, min(seqlen_k, m0 + BM + diag)) : seqlen_k;
    const KeyTiles kt = key_tiles(m0, n_end, lo_shift);
    // WINDOW: the keys start at the first visited key tile (pad0 carries it as k0).
    const int kb = (kt.kt_end - kt.n_tiles) * BN;
    return WorkTile{m0, bh % heads_q, bh / heads_q, kt.n_tiles, kt.n_tiles, -1, kb, 0};
}

// ---- varlen: work tiles over the sequences of a packed batch ----
// The sequences as the launch gives them: cu_q / cu_k [batch + 1] int32 offsets into the
// packed q (total_q rows) and k / v (total_k rows). Offsets are clamped to [previous,
// total], so malformed offsets shorten sequences instead of reaching past the tensors.
// Read by the producer thread only.
struct VarlenSeqs {
    const int* cu_q;
    const int* cu_k;
    int batch, heads_q, total_q, total_k;
    int win_right, win_left;  // WINDOW: the sides, clamped to the packed totals
};

// The producer's walk over the sequences: ranks are drawn in increasing order by each CTA,
// so the sequence of a rank is found by advancing from the last one (no table, no search).
// Longest first, without sorting on the device: the walk goes over the batch
// VARLEN_PASSES times, pass p taking the sequences whose key tiles kt = ceil(sk / BN) have
// floor(log2 kt) = VARLEN_PASSES - 1 - p (pass 0: kt >= 32, i.e. 4096 keys at BN = 128;
// the last pass: kt <= 1). So the launch ends on the tiles of the shortest sequences and
// its tail (the CTAs idle while the last tiles run) costs at most a short tile, where batch
// order could end on a 4000-key tile (0.951x dense at D=128 non-causal, 1.000x longest first;
// docs/design/attention-varlen-window.md). The enumeration is model-checked by tools/models/varlen_schedule_model.py. Inside a sequence (ranks [base, base + n)): each query block (causal: the heaviest,
// last rows first) of all its heads in turn (GQA heads sharing K/V run together, the
// sequence's K/V stays in L2). Only (pass, b, base, n) are kept: the producer runs on 24
// registers (PRODUCER_REGS), so the offsets are read again (L1 hits) when needed.
constexpr int VARLEN_PASSES = 6;
struct VarlenCursor {
    int b = -1;    // current sequence (-1: before the first of this pass)
    int pass = 0;  // VARLEN_PASSES: no work left
    int base = 0, n = 0;
};

// Rows [start, end) of sequence b in a packed tensor of `total` rows: offsets clamped to
// [0, total] and end to >= start.
__device__ __forceinline__ int2 seq_rows(const int* cu, int b, int total) {
    const int start = min(max(__ldg(cu + b), 0), total);
    return make_int2(start, min(max(__ldg(cu + b + 1), start), total));
}

// The walk's pass of a sequence of sk keys.
__device__ __forceinline__ int varlen_pass(int sk) {
    const int kt = max(1, (sk + BN - 1) / BN);
    return max(0, VARLEN_PASSES - 1 - (31 - __clz(kt)));
}

__device__ __forceinline__ WorkTile decode_varlen(int rank, VarlenCursor& c, const VarlenSeqs& v) {
    while (rank >= c.base + c.n) {
        if (c.pass >= VARLEN_PASSES) return WorkTile{0, -1, 0, 0, 0, -1, 0, 0};  // no work left
        c.base += c.n;
        c.n = 0;
        if (++c.b == v.batch) {
            c.b = -1;
            ++c.pass;
            continue;
        }
        const int2 k = seq_rows(v.cu_k, c.b, v.total_k);
        if (varlen_pass(k.y - k.x) != c.pass) continue;
        const int2 q = seq_rows(v.cu_q, c.b, v.total_q);
        c.n = (q.y - q.x + BM - 1) / BM * v.heads_q;  // empty sequences have no tiles
    }
    const int2 q = seq_rows(v.cu_q, c.b, v.total_q), k = seq_rows(v.cu_k, c.b, v.total_k);
    const int sq = q.y - q.x, sk = k.y - k.x;
    const int r = rank - c.base;
    const int mb = r / v.heads_q;
    const int head = r - mb * v.heads_q;
    // The same block alignment and key range as decode_tile, per sequence.
    const int m0 = CAUSAL ? ((sq + 15) & ~15) - (mb + 1) * BM : mb * BM;
    const int diag = sk - sq + (WINDOW ? v.win_right : 0);
    const int n_end = CAUSAL ? max(0, min(sk, m0 + BM + diag)) : sk;
    const KeyTiles kt = key_tiles(m0, n_end, sk - sq - v.win_left);
    // WINDOW: the sequence's keys start at the first visited key tile for this tile.
    const int kb = min(sk, (kt.kt_end - kt.n_tiles) * BN);
    WorkTile w{m0, head, c.b, kt.n_tiles, kt.n_tiles, -1, 0, 0};
    w.q0 = q.x;
    w.k0 = k.x + kb;
    w.sq = sq;
    w.sk = sk - kb;
    return w;
}

// The producer's position in its slot of split tiles: key-tile iterations [pos, end) of
// the tiles [n_whole, total), in a row. Empty (pos == end) outside a slot.
struct SlotCursor {
    int pos = 0, end = 0, slot = 0;
};

// The next segment of the cursor's slot: the rest of the tile at pos, up to the slot's end.
__device__ __forceinline__ WorkTile next_segment(const Schedule& sc, SlotCursor& cur) {
    const int L = sc.kv_tiles;
    const int t = sc.n_whole + cur.pos / L;
    const int i0 = cur.pos % L;                    // first iteration of the tile in this segment
    const int i1 = min(L, i0 + (cur.end - cur.pos));  // one past its last
    cur.pos += i1 - i0;
    WorkTile w = decode_tile(t, sc.total, sc.n_mb, sc.heads_q, sc.seqlen_q, sc.seqlen_k, sc.diag, sc.lo_shift);
    w.n_tiles = i1 - i0;
    w.kt_end = L - i0;  // iterations visit key tiles last to first
    // Cut at a slot boundary: the part that ends the tile opens this slot (boundary = slot),
    // the part that starts it closes this slot (boundary = slot + 1).
    if (i0 > 0) w.split = 2 * cur.slot + 1;
    else if (i1 < L) w.split = 2 * (cur.slot + 1);
    return w;
}

// The work of a drawn rank: a whole tile, the first segment of a slot, or none.
__device__ __forceinline__ WorkTile decode_rank(int rank, const Schedule& sc, SlotCursor& cur) {
    if (!SPLIT || rank < sc.n_whole || rank >= sc.n_ranks) {
        if (rank >= sc.n_ranks) rank = sc.total;  // past the slots: no work left
        return decode_tile(rank, sc.total, sc.n_mb, sc.heads_q, sc.seqlen_q, sc.seqlen_k, sc.diag, sc.lo_shift);
    }
    const int g = (int)gridDim.x;
    cur.slot = rank - sc.n_whole;
    // floor(slot * sk_iters / g) without 64-bit products (a 64-bit division is a call,
    // around which ptxas spilled the producer's registers): sk_iters = q g + r.
    const int q = sc.sk_iters / g, r = sc.sk_iters - q * g;
    cur.pos = cur.slot * q + cur.slot * r / g;
    cur.end = (cur.slot + 1) * q + (cur.slot + 1) * r / g;
    return next_segment(sc, cur);
}

__device__ __forceinline__ void post_tile(u32 slot, const WorkTile& w) {
    asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot), "r"(w.m0), "r"(w.head),
                 "r"(w.batch), "r"(w.n_tiles)
                 : "memory");
    if (VARLEN)
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + 16), "r"(w.q0), "r"(w.k0),
                     "r"(w.sq), "r"(w.sk)
                     : "memory");
    else
        asm volatile("st.shared.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"r"(slot + 16), "r"(w.kt_end),
                     "r"(w.split), "r"(w.pad0), "r"(w.pad1)
                     : "memory");
}
__device__ __forceinline__ WorkTile read_tile(u32 slot) {
    WorkTile w;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w.m0), "=r"(w.head), "=r"(w.batch), "=r"(w.n_tiles)
                 : "r"(slot)
                 : "memory");
    if (VARLEN) {
        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.q0), "=r"(w.k0), "=r"(w.sq), "=r"(w.sk)
                     : "r"(slot + 16)
                     : "memory");
        w.kt_end = w.n_tiles;
        w.split = -1;
    } else {
        asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(w.kt_end), "=r"(w.split), "=r"(w.pad0), "=r"(w.pad1)
                     : "r"(slot + 16)
                     : "memory");
        if (WINDOW) w.k0 = w.pad0;
    }
    return w;
}

}  // namespace fm90
