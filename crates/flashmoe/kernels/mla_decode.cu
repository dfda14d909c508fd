// flashmoe — DeepSeek MLA paged decode (one latent KV head, D_qk = 576, D_v = 512), sm_80+
// (mma.sync). Crates/flashmoe/src/attention/mla.rs owns the variant table and mirrors the
// constants and parameter structs below.
//
// Defines:
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (q, cache, o; fp32 accumulation)
//   FM_BN          keys per K/V tile (32 or 64): 64 needs the 216 KiB of sm_90's shared
//                  memory, 32 fits sm_80's 163 KiB
//   FM_STAGES      K/V tiles in flight through the cp.async ring (2..3)
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
//   columns 256 (w / 4) .. +255 (128 f32 accumulators a thread). Both warps of a row group
//   compute the same S = Q K^T (16 x BN over 576) and the same online softmax, so P stays in
//   registers and the row statistics need no exchange; the cost is the S product twice,
//   which is idle tensor time while the kernel is memory-bound (Sq = 1).
//   V is the first 512 columns of the same K tile in shared memory: one load per tile.
//   Block ids of the tile after the one being issued are read into shared memory one
//   iteration ahead, so the table read never sits between a wait and the next cp.async.
//   splits == 1: writes o and lse. splits > 1: writes the split's normalised O (f32) and its
//   log2-domain LSE to the workspace; mla_decode_combine merges them.
//
// mla_decode_combine: grid (rows = B * Sq * Hq), 128 threads; row r merges the splits'
//   partials LSE-weighted in split order (deterministic) and writes o and lse.
//
// Shared memory (dynamic), mirrored by MlaKernel::shared_mem_bytes:
//   PITCH_B = 1152 bytes a row (576 x 2; XOR swizzle of 16-byte chunks inside 128-byte groups)
//   bytes = PITCH_B * (BM + STAGES * BN)    layout [Q: BM rows][K ring: STAGES x BN rows]
//
// Workspace (splits > 1; MlaDecodePlan::workspace_bytes mirrors it), rows (token, head) with
// token = b * Sq + qi: [o_part: splits x rows x 512 f32][lse_part: splits x rows f32].

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2
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
constexpr int NT = BN / 8;           // n8 tiles of S a warp holds
constexpr int KS = BN / 16;          // k16 steps of P V
constexpr int OCOLS = DV / 2;        // 256 O columns a warp
constexpr int DT = OCOLS / 8;        // 32 n8 tiles of O a warp
constexpr int GROUPS = BN / 16;      // 16-key groups a tile (a group never crosses a page)
constexpr int Q_BYTES = BM * PITCH_B;
constexpr int TILE_BYTES = BN * PITCH_B;
constexpr int SMEM_BYTES = Q_BYTES + STAGES * TILE_BYTES;
constexpr float LN2 = 0.6931471805599453f;

static_assert(BN == 32 || BN == 64, "FM_BN must be 32 or 64");
static_assert(STAGES >= 2 && STAGES <= 3, "FM_STAGES must be 2 or 3");
static_assert(SMEM_BYTES == PITCH_B * (BM + STAGES * BN), "smem formula");

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
__device__ __forceinline__ float lg2(float x) {
    float r;
    asm("lg2.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// Byte offset of 16-byte chunk `ch` of row `r` in a swizzled tile (XOR on the low 3 bits:
// the 8 chunks of a 128-byte group permute among themselves).
__device__ __forceinline__ u32 swz(int r, int ch) {
    return (u32)(r * PITCH_B + ((ch ^ (r & 7)) << 4));
}

// Block ids of tile t's 16-key groups into s_blk (-1: no key of [0, kmax) there, or past
// the table). Called by threads 0 .. GROUPS-1.
__device__ __forceinline__ void tile_blocks(int* s_blk, const MlaParams& p,
                                            const int* __restrict__ bt, int t, int kmax,
                                            int g) {
    const int key0 = t * BN + 16 * g;
    const int pidx = key0 / p.page_size;
    s_blk[g] = key0 < kmax && pidx < p.max_blocks ? __ldg(bt + pidx) : -1;
}

// cp.async tile t's rows into a ring slot; keys >= kmax or on an unreadable block are
// zero-filled (nothing read), so their V rows are finite where P = 0.
__device__ __forceinline__ void load_tile(u32 sK, const MlaParams& p, const int* s_blk, int t,
                                          int kmax, int tid) {
#pragma unroll 2
    for (int c = tid; c < BN * CPR; c += THREADS) {
        const int r = c / CPR, ch = c - (c / CPR) * CPR;
        const int key = t * BN + r;
        const int blk = s_blk[r >> 4];
        const bool ok = (unsigned)blk < (unsigned)p.num_blocks && key < kmax;
        const int off = key - (key / p.page_size) * p.page_size;
        const u16* src = ok ? p.kv + (i64)blk * p.kv_sblk + (i64)off * p.kv_srow + ch * 8 : p.kv;
        cp_async16(sK + swz(r, ch), src, ok);
    }
}

}  // namespace fmla

extern "C" __global__ void __launch_bounds__(fmla::THREADS, 1)
    mla_decode_fwd(const __grid_constant__ fmla::MlaParams p) {
    using namespace fmla;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    __shared__ int s_blk[2][GROUPS];

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

    const u32 sQ = smem_addr(smem_raw);
    const u32 sK0 = sQ + Q_BYTES;

    // ---- Q: BM packed rows (zero past the valid rows) ----
    for (int c = tid; c < BM * CPR; c += THREADS) {
        const int r = c / CPR, ch = c - (c / CPR) * CPR;
        const bool ok = r < rows;
        const int rr = row0 + r;
        const int qi = rr / Hq;
        const int h = rr - qi * Hq;
        const u16* src =
            ok ? p.q + (i64)b * p.q_sb + (i64)qi * p.q_ss + (i64)h * p.q_sh + ch * 8 : p.q;
        cp_async16(sQ + swz(r, ch), src, ok);
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

    int slot = 0;
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<STAGES - 2>();  // tile i (and Q) landed, this thread's part
        __syncthreads();              // everyone's part; tile i-1's slot and s_blk are free
        {
            const int nx = i + STAGES - 1;
            if (nx < n_tiles) {
                int ns = slot + STAGES - 1;
                if (ns >= STAGES) ns -= STAGES;
                load_tile(sK0 + ns * TILE_BYTES, p, s_blk[nx & 1], tb + nx, kmax, tid);
                if (tid < GROUPS && nx + 1 < n_tiles)
                    tile_blocks(s_blk[(nx + 1) & 1], p, bt, tb + nx + 1, kmax, tid);
            }
            cp_async_commit();
        }
        const int n0 = (tb + i) * BN;
        const u32 sK = sK0 + slot * TILE_BYTES;

        // ---- S = Q K^T: 16 rows x BN keys over 576 ----
        float s[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll 4
        for (int kk = 0; kk < KD; ++kk) {
            u32 a[4];
            ldsm_x4(sQw + lb[kk & 3] + (kk >> 2) * 128, a[0], a[1], a[2], a[3]);
#pragma unroll
            for (int g = 0; g < KS; ++g) {
                u32 b0, b1, b2, b3;
                ldsm_x4(sK + g * 16 * PITCH_B + kb[kk & 3] + (kk >> 2) * 128, b0, b1, b2, b3);
                mma16816(s[2 * g], a, b0, b1);
                mma16816(s[2 * g + 1], a, b2, b3);
            }
        }

        // ---- log2-domain scores and the causal mask ----
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
        if (n0 + BN > hi_min) {  // CTA-uniform: some row's range ends inside this tile
            const int col0 = n0 + 2 * (lane & 3);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (col0 + nt * 8 + (e & 1) >= rhi[e >> 1]) s[nt][e] = neg_inf();
        }

        // ---- online softmax over the tile; P packed as the A operand of P V ----
        u32 pa[KS][4];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = neg_inf();
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_i[h], mx);
            // A row that has seen no key keeps m = -inf: subtract 0, never -inf - -inf.
            const float m_use = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = ex2(m_i[h] - m_use);
            m_i[h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float p0 = ex2(s[nt][2 * h] - m_use);
                const float p1 = ex2(s[nt][2 * h + 1] - m_use);
                sum += p0 + p1;
                pa[nt >> 1][(nt & 1) * 2 + h] = pack2(p0, p1);
            }
            l_i[h] = l_i[h] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                oacc[dt][2 * h] *= alpha;
                oacc[dt][2 * h + 1] *= alpha;
            }
        }

        // ---- O += P V over this warp's 256 columns (V: the tile's first 512 columns) ----
#pragma unroll
        for (int g = 0; g < KS; ++g) {
            const u32 sV = sK + g * 16 * PITCH_B + vcol;
#pragma unroll
            for (int dp = 0; dp < DT / 2; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(sV + lb[dp & 3] + (dp >> 2) * 128, b0, b1, b2, b3);
                mma16816(oacc[2 * dp], pa[g], b0, b1);
                mma16816(oacc[2 * dp + 1], pa[g], b2, b3);
            }
        }
        if (++slot == STAGES) slot = 0;
    }
    cp_async_wait<0>();

    // ---- epilogue: normalise and write this warp's rows x 256 columns ----
    const bool direct = p.splits == 1;
    const i64 split_rows = (i64)p.batch * Sq * Hq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float l = l_i[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
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
