// flashmoe — DeepSeek MLA paged decode (one latent KV head, D_qk = 576, D_v = 512), sm_80+
// (mma.sync). Crates/flashmoe/src/attention/mla.rs owns the variant table and mirrors the
// constants and parameter structs below.
//
// Defines:
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (q, cache, o; fp32 accumulation)
//   FM_BN          keys per K/V tile (32 or 64): 64 needs the 216 KiB of sm_90's shared
//                  memory, 32 fits sm_80's 163 KiB
//   FM_STAGES      K/V tiles in flight through the cp.async ring (2..3)
//   FM_WGMMA       1 = sm_90a: both GEMMs on warpgroup MMAs (wgmma; needs FM_BN 64),
//                  0 = mma.sync (sm_80+)
//
// Problem: q [B, Sq, Hq, 576] (weight-absorbed), one cache row of 576 per token whose first
// 512 columns are also the value, o [B, Sq, Hq, 512], lse [B, Sq, Hq] (natural log). Causal,
// bottom-right: query row qi of a sequence with seqlen_k keys sees keys j <= seqlen_k - Sq + qi.
// A row that sees no key gets O = 0, LSE = -inf.
//
// mla_decode_fwd: grid (splits * m_blocks, batch), 256 threads (8 warps). The Hq * Sq query
// rows of a sequence are packed (row r: qi = r / Hq, head r % Hq) into m_blocks tiles of
// BM = 64 rows; one CTA owns one (sequence, KV split, row tile), so a KV tile read from HBM
// serves 64 rows (Hq = 128: two CTAs read each page; the second mostly hits L2).
//   Register plan (O is 512 wide): warp w owns rows 16 (w % 4) .. +15 of the tile and the O
//   columns 256 (w / 4) .. +255 (128 f32 accumulators a thread). The two warps of a row
//   group (a pair) split the tile's keys: warp half h computes S for keys BN/2 h .. + BN/2 - 1
//   (16 x BN/2 over 576), so every product of S is computed once. The pair exchanges its
//   row maxima through shared memory (a 64-thread named barrier, id 1 + row group), both
//   warps then hold the same running max m (same operands, same fmaxf), each keeps the row
//   sum of its own keys (added at the end: alpha is the same in both), and each writes its
//   half of P (bf16, in the A-fragment register layout) for the partner to read after a
//   second named barrier. P V then runs over all BN keys for the warp's 256 columns.
//   V is the first 512 columns of the same K tile in shared memory: one load per tile.
//   The cache offsets of the tile after the one being issued (one per 16-key group, from the
//   block table) are read into shared memory one iteration ahead, so the table read never
//   sits between a wait and the next cp.async.
//   splits == 1: writes o and lse. splits > 1: writes the split's normalised O (f32) and its
//   log2-domain LSE to the workspace; mla_decode_combine merges them.
//
// mla_decode_combine: grid (rows = B * Sq * Hq), 128 threads; row r merges the splits'
//   partials LSE-weighted in split order (deterministic) and writes o and lse.
//
// FM_WGMMA (sm_90a): the same CTA, warps, pairs, softmax and exchange; the two warpgroups
//   are the two halves (warps 0-3: keys 0..31 of S and O columns 0..255; warps 4-7: keys
//   32..63 and columns 256..511), and per warp the wgmma accumulator layout is the mma.sync
//   C layout, so only the GEMMs change. S: 36 wgmma m64n32k16, Q and K from shared memory
//   (K-major). P V: 4 wgmma m64n256k16, P from registers (own keys, then the partner's
//   read from the exchange), V from shared memory (MN-major: the cache row's first 512
//   columns). Tiles are stored for the descriptors' 128-byte swizzle: column chunk c
//   (64 elements) of a tile of R rows at c * R * 128, row r at + r * 128, 16-byte piece x
//   at + ((x ^ (r & 7)) << 4); the base is rounded up to 1024 bytes (+1024 allocated).
//
// Shared memory (dynamic), mirrored by MlaKernel::shared_mem_bytes:
//   PITCH_B = 1152 bytes a row (576 x 2; XOR swizzle of 16-byte chunks inside 128-byte groups)
//   bytes = PITCH_B * (BM + STAGES * BN) + WARPS * BN * 16 + WARPS * 16 * 4
//   layout [Q: BM rows][K ring: STAGES x BN rows][P exchange: per warp BN/32 fragments of
//   16 x 16 (512 bytes)][row statistic exchange: per warp 16 floats]
//
// Workspace (splits > 1; MlaDecodePlan::workspace_bytes mirrors it), rows (token, head) with
// token = b * Sq + qi: [o_part: splits x rows x 512 f32][lse_part: splits x rows f32].

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#ifndef FM_WGMMA
#define FM_WGMMA 0
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2
#if FM_WGMMA
#include "fm_sm90.cuh"  // wgmma, descriptors, proxy fence
#endif
#ifndef FM_BN
#define FM_BN 64
#endif
#ifndef FM_STAGES
#define FM_STAGES 2
#endif

namespace fmla {

constexpr int DQK = 576;
constexpr int DV = 512;
constexpr int BM = 64;
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int BN = FM_BN;
constexpr int STAGES = FM_STAGES;
constexpr int PITCH_B = DQK * 2;     // 1152 = 9 x 128: every row starts on bank 0
constexpr int CPR = DQK / 8;         // 72 16-byte chunks a row
constexpr int KD = DQK / 16;         // 36 k16 steps of S
constexpr int NTW = BN / 16;        // n8 tiles of S a warp holds (its BN/2 keys)
constexpr int KS = BN / 16;          // k16 steps of P V
constexpr int KSW = BN / 32;         // k16 steps of P a warp computes (its half of the keys)
constexpr int OCOLS = DV / 2;        // 256 O columns a warp
constexpr int DT = OCOLS / 8;        // 32 n8 tiles of O a warp
constexpr int GROUPS = BN / 16;      // 16-key groups a tile (a group never crosses a page)
constexpr int Q_BYTES = BM * PITCH_B;
constexpr int TILE_BYTES = BN * PITCH_B;
constexpr int ALIGN_PAD = FM_WGMMA ? 1024 : 0;  // the base rounded up to 1024 bytes
constexpr int Q_CHUNK = BM * 128;    // FM_WGMMA: bytes of one 64-column chunk of Q
constexpr int K_CHUNK = BN * 128;    // ... and of a K tile
constexpr int P_OFF = Q_BYTES + STAGES * TILE_BYTES;
constexpr int P_BYTES = WARPS * KSW * 512;   // a warp's P: KSW fragments x 32 lanes x 16 B
constexpr int M_OFF = P_OFF + P_BYTES;
constexpr int SMEM_BYTES = M_OFF + WARPS * 16 * 4 + ALIGN_PAD;
constexpr float LN2 = 0.6931471805599453f;

static_assert(BN == 32 || BN == 64, "FM_BN must be 32 or 64");
static_assert(!FM_WGMMA || BN == 64, "FM_WGMMA needs FM_BN 64 (m64n32 S per warpgroup)");
static_assert(STAGES >= 2 && STAGES <= 3, "FM_STAGES must be 2 or 3");
static_assert(SMEM_BYTES ==
                  PITCH_B * (BM + STAGES * BN) + WARPS * BN * 16 + WARPS * 64 + ALIGN_PAD,
              "smem formula");

// Mirrored by `MlaParams` (#[repr(C)]) in mla.rs.
struct MlaParams {
    const u16* q;
    const u16* kv;
    u16* o;
    float* lse;
    const int* block_table;
    const int* seqused_k;
    float* o_part;    // [splits][rows][512] f32 (splits > 1)
    float* lse_part;  // [splits][rows] f32, log2 domain (splits > 1)
    i64 q_sb, q_ss, q_sh;  // q strides (batch, seq, head), elements
    i64 kv_sblk, kv_srow;  // cache strides (block, row in page), elements
    i64 bt_stride;         // block-table row stride
    int batch, seqlen_q, heads_q, page_size;
    int max_blocks, num_blocks, splits, m_blocks;
    float scale_log2;  // softmax scale * log2(e)
    int pad_;
};
static_assert(sizeof(MlaParams) == 152, "MlaParams layout (mla.rs)");

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
// The two warps (64 threads) of row group rg; id 0 is __syncthreads'.
__device__ __forceinline__ void pair_sync(int rg) {
    asm volatile("bar.sync %0, 64;\n" ::"r"(1 + rg) : "memory");
}

// Byte offset of 16-byte chunk `ch` of row `r` in a swizzled tile (XOR on the low 3 bits:
// the 8 chunks of a 128-byte group permute among themselves).
__device__ __forceinline__ u32 swz(int r, int ch) {
    return (u32)(r * PITCH_B + ((ch ^ (r & 7)) << 4));
}
// The wgmma layout of a tile of R rows: 64-column chunks of R x 128 bytes (see above).
template <int R>
__device__ __forceinline__ u32 swz_wg(int r, int ch) {
    return (u32)((ch >> 3) * (R * 128) + r * 128 + (((ch & 7) ^ (r & 7)) << 4));
}
template <int R>
__device__ __forceinline__ u32 tile_off(int r, int ch) {
    if constexpr (FM_WGMMA) return swz_wg<R>(r, ch);
    else return swz(r, ch);
}

#if FM_WGMMA
// D[64x32] (+)= A[64x16] * B[16x32], A and B K-major in shared memory (descriptors).
// Accumulators: d[4j + 2h + c] is row 16 w + l/4 + 8h, column 8j + 2(l%4) + c.
__device__ __forceinline__ void wgmma_ss_n32(float (&d)[16], u64 desc_a, u64 desc_b, int scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32." FM_WG_T "." FM_WG_T " "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, "
        "1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
          "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}
#endif

// Cache element offset of the first row of each 16-key group of tile t into s_blk (-1: no
// key of [0, kmax) there, past the table, or a block id outside [0, num_blocks)); a group
// never crosses a page. Called by threads 0 .. GROUPS-1. The copies then need no division
// by the page size.
__device__ __forceinline__ void tile_blocks(i64* s_blk, const MlaParams& p,
                                            const int* __restrict__ bt, int t, int kmax,
                                            int g) {
    const int key0 = t * BN + 16 * g;
    const int pidx = key0 / p.page_size;
    const int blk = key0 < kmax && pidx < p.max_blocks ? __ldg(bt + pidx) : -1;
    s_blk[g] = (unsigned)blk < (unsigned)p.num_blocks
                   ? (i64)blk * p.kv_sblk + (i64)(key0 - pidx * p.page_size) * p.kv_srow
                   : -1;
}

// cp.async tile t's rows into a ring slot; keys >= kmax or on an unreadable block are
// zero-filled (nothing read), so their V rows are finite where P = 0.
__device__ __forceinline__ void load_tile(u32 sK, const MlaParams& p, const i64* s_blk, int t,
                                          int kmax, int tid) {
#pragma unroll 2
    for (int c = tid; c < BN * CPR; c += THREADS) {
        const int r = c / CPR, ch = c - (c / CPR) * CPR;
        const i64 base = s_blk[r >> 4];
        const bool ok = base >= 0 && t * BN + r < kmax;
        const u16* src = ok ? p.kv + base + (i64)(r & 15) * p.kv_srow + ch * 8 : p.kv;
        cp_async16(sK + tile_off<BN>(r, ch), src, ok);
    }
}

}  // namespace fmla

extern "C" __global__ void __launch_bounds__(fmla::THREADS, 1)
    mla_decode_fwd(const __grid_constant__ fmla::MlaParams p) {
    using namespace fmla;
    extern __shared__ __align__(FM_WGMMA ? 1024 : 128) unsigned char smem_al[];
    __shared__ i64 s_blk[2][GROUPS];

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int rg = warp & 3;   // row group: tile rows 16 rg .. 16 rg + 15
    const int half = warp >> 2;  // O columns 256 half .. + 255
    const int split = blockIdx.x / p.m_blocks;
    const int mb = blockIdx.x - split * p.m_blocks;
    const int b = blockIdx.y;
    const int Hq = p.heads_q;
    const int Sq = p.seqlen_q;
    const int row0 = mb * BM;
    const int rows = min(BM, Hq * Sq - row0);  // valid rows of this tile (>= 1 by the grid)

    const int seqlen_k = max(0, min(p.seqused_k[b], p.max_blocks * p.page_size));
    const int diag0 = seqlen_k - Sq;
    // Keys row qi sees: [0, hi(qi)).
    auto hi_of = [&](int qi) { return max(0, min(seqlen_k, diag0 + qi + 1)); };
    const int kmax = hi_of((row0 + rows - 1) / Hq);  // keys any row here sees
    const int hi_min = hi_of(row0 / Hq);             // keys every row here sees
    const int t_end = (kmax + BN - 1) / BN;
    const int tps = (t_end + p.splits - 1) / p.splits;
    const int tb = split * tps;
    const int n_tiles = max(0, min(t_end, tb + tps) - tb);
    const int* __restrict__ bt = p.block_table + (i64)b * p.bt_stride;

    // wgmma's 128-byte swizzle needs 1024-byte aligned tiles (the +1024 is allocated).
    unsigned char* const smem_raw =
        smem_al + (FM_WGMMA ? (1024u - (smem_addr(smem_al) & 1023u)) & 1023u : 0u);
    const u32 sQ = smem_addr(smem_raw);
    const u32 sK0 = sQ + Q_BYTES;
    // This warp's P fragments and row maxima / sums; the partner's are at warp ^ 4.
    const u32 sPw = sQ + P_OFF + warp * (KSW * 512) + lane * 16;
    const u32 sPp = sQ + P_OFF + (warp ^ 4) * (KSW * 512) + lane * 16;
    float* const sMw = reinterpret_cast<float*>(smem_raw + M_OFF) + warp * 16;
    float* const sMp = reinterpret_cast<float*>(smem_raw + M_OFF) + (warp ^ 4) * 16;

    // ---- Q: BM packed rows (zero past the valid rows) ----
    for (int c = tid; c < BM * CPR; c += THREADS) {
        const int r = c / CPR, ch = c - (c / CPR) * CPR;
        const bool ok = r < rows;
        const int rr = row0 + r;
        const int qi = rr / Hq;
        const int h = rr - qi * Hq;
        const u16* src =
            ok ? p.q + (i64)b * p.q_sb + (i64)qi * p.q_ss + (i64)h * p.q_sh + ch * 8 : p.q;
        cp_async16(sQ + tile_off<BM>(r, ch), src, ok);
    }
    cp_async_commit();

    // ---- prologue: tiles 0 .. STAGES-2 in flight; block ids of tile STAGES-1 requested ----
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (tid < GROUPS && st < n_tiles) tile_blocks(s_blk[st & 1], p, bt, tb + st, kmax, tid);
        __syncthreads();
        if (st < n_tiles) load_tile(sK0 + st * TILE_BYTES, p, s_blk[st & 1], tb + st, kmax, tid);
        cp_async_commit();
    }
    if (tid < GROUPS && STAGES - 1 < n_tiles)
        tile_blocks(s_blk[(STAGES - 1) & 1], p, bt, tb + STAGES - 1, kmax, tid);

    // This thread's two rows (C layout: lane / 4 and lane / 4 + 8 of the warp's 16) and the
    // keys they see; pad rows take the last valid row's range.
    int rhi[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = min(rg * 16 + (lane >> 2) + 8 * h, rows - 1);
        rhi[h] = hi_of((row0 + r) / Hq);
    }

    float oacc[DT][4];
#pragma unroll
    for (int dt = 0; dt < DT; ++dt)
#pragma unroll
        for (int e = 0; e < 4; ++e) oacc[dt][e] = 0.f;
    float m_i[2] = {neg_inf(), neg_inf()};
    float l_i[2] = {0.f, 0.f};

    // ldmatrix lane bases: lb for Q (A, x4) and V (B, x4.trans), kb for K (B, x4); chunk
    // 2j + x of row r sits at chunk (2j + x) ^ (r & 7) (every tile row base is a multiple of 8).
    const int li = lane >> 3, lr = lane & 7;
    u32 lb[4], kb[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        lb[j] = ((li & 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li >> 1))) << 4);
        kb[j] = ((li >> 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li & 1))) << 4);
    }
    const u32 sQw = sQ + rg * 16 * PITCH_B;
    const u32 vcol = half * (OCOLS * 2);  // byte offset of this warp's O columns in a V row
    const int kw0 = half * (BN / 2);      // this warp's first key of a tile (S and own P)
    const int kp0 = (BN / 2) - kw0;       // the partner's

    u32 pa[KSW][4];  // P of this warp's keys (A fragments), then of the partner's
    u32 pp[KSW][4];
#pragma unroll
    for (int g = 0; g < KSW; ++g)
#pragma unroll
        for (int e = 0; e < 4; ++e) pa[g][e] = pp[g][e] = 0u;
#if FM_WGMMA
    float* const of = &oacc[0][0];
    float(&oa)[128] = *reinterpret_cast<float(*)[128]>(of);
#endif
    int slot = 0;
    for (int i = 0; i < n_tiles; ++i) {
        // Tile i + STAGES - 1 into the slot of tile i - 1 (free once every warp's P V of
        // tile i - 1 is done), block offsets of the tile after it.
        auto issue_next = [&]() {
            const int nx = i + STAGES - 1;
            if (nx < n_tiles) {
                int ns = slot + STAGES - 1;
                if (ns >= STAGES) ns -= STAGES;
                load_tile(sK0 + ns * TILE_BYTES, p, s_blk[nx & 1], tb + nx, kmax, tid);
                if (tid < GROUPS && nx + 1 < n_tiles)
                    tile_blocks(s_blk[(nx + 1) & 1], p, bt, tb + nx + 1, kmax, tid);
            }
            cp_async_commit();
        };
        cp_async_wait<STAGES - 2>();  // tile i (and Q) landed, this thread's part
#if FM_WGMMA
        fence_proxy_async_smem();  // cp.async wrote through the generic proxy; wgmma reads
        __syncthreads();           // everyone's part; tile i-1's slot and s_blk are free
#else
        __syncthreads();  // everyone's part; tile i-1's slot and s_blk are free
        issue_next();
#endif
        const int n0 = (tb + i) * BN;
        const u32 sK = sK0 + slot * TILE_BYTES;

        // ---- S = Q K^T: 16 rows x this warp's BN/2 keys over 576 ----
        float s[NTW][4];
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#if FM_WGMMA
        {
            // Q: chunk kk / 4 of the Q tile, k16 step kk % 4 inside the 128-byte row; K: the
            // same for this warpgroup's 32 keys (rows kw0.. of the tile, whole atoms).
            float* sf = &s[0][0];
            float(&sacc)[16] = *reinterpret_cast<float(*)[16]>(sf);
            const u64 dq = smem_desc_sw128(sQ, 16, 1024);
            const u64 dk = smem_desc_sw128(sK + kw0 * 128, 16, 1024);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < KD; ++kk) {
                const u32 inner = (kk & 3) * 32;
                wgmma_ss_n32(sacc, desc_add(dq, (kk >> 2) * Q_CHUNK + inner),
                             desc_add(dk, (kk >> 2) * K_CHUNK + inner), kk > 0 ? 1 : 0);
            }
            wgmma_commit();
            // Every warp waited for its P V of tile i - 1 before the barrier above: the slot
            // takes the next tile, copied while S runs. (Leaving that P V in flight across
            // the loop made ptxas serialize every wgmma, C7514.)
            issue_next();
            wgmma_wait<0>();
            reg_fence(sacc);
        }
#else
        const u32 sKw = sK + kw0 * PITCH_B;
#pragma unroll 4
        for (int kk = 0; kk < KD; ++kk) {
            u32 a[4];
            ldsm_x4(sQw + lb[kk & 3] + (kk >> 2) * 128, a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int g = 0; g < KSW; ++g) {
                u32 b0, b1, b2, b3;
                ldsm_x4(sKw + g * 16 * PITCH_B + kb[kk & 3] + (kk >> 2) * 128, b0, b1, b2, b3);
                mma16816(s[2 * g], a, b0, b1);
                mma16816(s[2 * g + 1], a, b2, b3);
            }
        }
#endif

        // ---- log2-domain scores and the causal mask ----
#pragma unroll
        for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
        if (n0 + BN > hi_min) {  // CTA-uniform: some row's range ends inside this tile
            const int col0 = n0 + kw0 + 2 * (lane & 3);
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (col0 + nt * 8 + (e & 1) >= rhi[e >> 1]) s[nt][e] = neg_inf();
        }

        // ---- online softmax over the tile; P packed as the A operand of P V ----
        // Row maxima of this warp's keys, then the pair's (exchanged through shared memory).
        float mx[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float m = neg_inf();
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) m = fmaxf(m, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
            mx[h] = m;
            if ((lane & 3) == 0) sMw[(lane >> 2) + 8 * h] = m;
        }
        pair_sync(rg);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // max(own, partner) in both warps: the same value, so the same m and alpha.
            const float m_pair = fmaxf(mx[h], sMp[(lane >> 2) + 8 * h]);
            const float m_new = fmaxf(m_i[h], m_pair);
            // A row that has seen no key keeps m = -inf: subtract 0, never -inf - -inf.
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = ex2(m_i[h] - m_use);
            m_i[h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NTW; ++nt) {
                const float p0 = ex2(s[nt][2 * h] - m_use);
                const float p1 = ex2(s[nt][2 * h + 1] - m_use);
                sum += p0 + p1;
                pa[nt >> 1][(nt & 1) * 2 + h] = pack2(p0, p1);
            }
            l_i[h] = l_i[h] * alpha + sum;  // this warp's keys only
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                oacc[dt][2 * h] *= alpha;
                oacc[dt][2 * h + 1] *= alpha;
            }
        }
        // Publish this warp's P; the partner's arrives after the pair barrier. The slots are
        // rewritten only after the next __syncthreads, when the partner has read them.
#pragma unroll
        for (int g = 0; g < KSW; ++g) {
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(sPw + g * 512),
                         "r"(pa[g][0]), "r"(pa[g][1]), "r"(pa[g][2]), "r"(pa[g][3])
                         : "memory");
        }
        pair_sync(rg);
#pragma unroll
        for (int g = 0; g < KSW; ++g) ld_shared_v4(sPp + g * 512, pp[g][0], pp[g][1], pp[g][2], pp[g][3]);

        // ---- O += P V over this warp's 256 columns (V: the tile's first 512 columns) ----
#if FM_WGMMA
        {
            // V MN-major: 16 keys a k16 step (16 rows = 2048 bytes), this warpgroup's 256
            // columns = chunks 4 half .. + 3 (LBO: the next chunk).
            const u64 dv = smem_desc_sw128(sK + half * 4 * K_CHUNK, K_CHUNK, 1024);
            wgmma_fence();
#pragma unroll
            for (int g = 0; g < KSW; ++g)
                wgmma_rs_n256<1>(oa, pa[g], desc_add(dv, (kw0 + g * 16) * 128), 1);
#pragma unroll
            for (int g = 0; g < KSW; ++g)
                wgmma_rs_n256<1>(oa, pp[g], desc_add(dv, (kp0 + g * 16) * 128), 1);
            wgmma_commit();
            wgmma_wait<0>();
            reg_fence(oa);
        }
#else
#pragma unroll
        for (int g = 0; g < KS; ++g) {
            const bool own = g < KSW;
            const int gg = own ? g : g - KSW;
            const u32 sV = sK + ((own ? kw0 : kp0) + gg * 16) * PITCH_B + vcol;
            const u32(&pg)[4] = own ? pa[gg] : pp[gg];
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(sV + lb[dp & 3] + (dp >> 2) * 128, b0, b1, b2, b3);
                mma16816(oacc[2 * dp], pg, b0, b1);
                mma16816(oacc[2 * dp + 1], pg, b2, b3);
            }
        }
#endif
        if (++slot == STAGES) slot = 0;
    }
    cp_async_wait<0>();

    // ---- epilogue: the pair's row sums, normalise, write this warp's rows x 256 columns ----
    // The partner read this warp's maxima before the last pair barrier: the slots are free.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        l_i[h] = l;
        if ((lane & 3) == 0) sMw[(lane >> 2) + 8 * h] = l;
    }
    pair_sync(rg);
    const bool direct = p.splits == 1;
    const i64 split_rows = (i64)p.batch * Sq * Hq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // Own keys' sum + the partner's: the same value in both warps (addition commutes).
        const float l = l_i[h] + sMp[(lane >> 2) + 8 * h];
        const int r = rg * 16 + (lane >> 2) + 8 * h;
        if (r >= rows) continue;
        const int rr = row0 + r;
        const int qi = rr / Hq;
        const int hd = rr - qi * Hq;
        const i64 orow = ((i64)b * Sq + qi) * Hq + hd;  // also the lse index [B, Sq, Hq]
        const bool empty = m_i[h] == neg_inf();           // l >= 1 otherwise
        const float inv = empty ? 0.f : 1.f / l;
        const int c0 = half * OCOLS + 2 * (lane & 3);
        if (direct) {
            u16* dst = p.o + orow * DV + c0;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<u32*>(dst + dt * 8) =
                    pack2(oacc[dt][2 * h] * inv, oacc[dt][2 * h + 1] * inv);
            if (half == 0 && (lane & 3) == 0)
                p.lse[orow] = empty ? neg_inf() : (m_i[h] + lg2(l)) * LN2;
        } else {
            float* dst = p.o_part + (split * split_rows + orow) * DV + c0;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(dst + dt * 8) =
                    make_float2(oacc[dt][2 * h] * inv, oacc[dt][2 * h + 1] * inv);
            if (half == 0 && (lane & 3) == 0)
                p.lse_part[split * split_rows + orow] = empty ? neg_inf() : m_i[h] + lg2(l);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Split merge: one CTA of 128 threads per output row (token, head); each thread 4 columns.
// Weights exp2(lse_s - max) in split order: the result does not depend on which split CTA
// finished first. Rows no split saw: O = 0, LSE = -inf.
// ---------------------------------------------------------------------------------------
namespace fmla {
struct CombineParams {
    const float* o_part;
    const float* lse_part;
    u16* o;
    float* lse;
    int rows, splits;
};
static_assert(sizeof(CombineParams) == 40, "CombineParams layout (mla.rs)");
constexpr int MAX_SPLITS = 64;  // mla.rs MAX_SPLITS
}  // namespace fmla

extern "C" __global__ void __launch_bounds__(128)
    mla_decode_combine(const __grid_constant__ fmla::CombineParams p) {
    using namespace fmla;
    __shared__ float s_w[MAX_SPLITS];
    __shared__ float s_inv;
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int S = min(p.splits, MAX_SPLITS);
    if (tid < 32) {
        float m = neg_inf();
        for (int sp = tid; sp < S; sp += 32) m = fmaxf(m, p.lse_part[(i64)sp * p.rows + row]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        for (int sp = tid; sp < S; sp += 32) {
            const float ls = p.lse_part[(i64)sp * p.rows + row];
            s_w[sp] = ls == neg_inf() ? 0.f : ex2(ls - m);  // an empty split: weight 0
        }
        __syncwarp();
        if (tid == 0) {
            float L = 0.f;
            for (int sp = 0; sp < S; ++sp) L += s_w[sp];  // split order
            s_inv = L > 0.f ? 1.f / L : 0.f;
            p.lse[row] = m == neg_inf() ? m : (m + lg2(L)) * LN2;
        }
    }
    __syncthreads();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int sp = 0; sp < S; ++sp) {
        const float w = s_w[sp];
        if (w == 0.f) continue;
        const float4 x =
            *reinterpret_cast<const float4*>(p.o_part + ((i64)sp * p.rows + row) * DV + tid * 4);
        acc[0] += w * x.x;
        acc[1] += w * x.y;
        acc[2] += w * x.z;
        acc[3] += w * x.w;
    }
    const float inv = s_inv;
    u32* dst = reinterpret_cast<u32*>(p.o + (i64)row * DV + tid * 4);
    dst[0] = pack2(acc[0] * inv, acc[1] * inv);
    dst[1] = pack2(acc[2] * inv, acc[3] * inv);
}
