// flashmoe — FlashAttention-2 forward, portable path (sm_80 and newer, mma.sync).
//
// Compiled at run time by NVRTC; self-contained (no CUDA headers). One source, specialised
// by preprocessor defines (see crates/flashmoe/src/attention/prefill/tiles.rs, which owns the
// table of variants and must agree with the constants below):
//
//   FM_HEAD_DIM    head dim D: a multiple of 8, at most 256. The MMAs run over DP = D rounded
//                  up to 16; the extra 8 columns (D = 8 mod 16) are zero in shared memory
//                  for Q and K (cp.async zero-fill), so they add nothing to Q K^T, and the
//                  matching columns of O are computed but never stored
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (Q, K, V, O storage; accumulation is fp32)
//   FM_CAUSAL      0/1, bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q
//   FM_BLOCK_M     query rows per CTA (grid.x = ceil(seqlen_q / FM_BLOCK_M))
//   FM_BLOCK_N     keys per K/V tile (multiple of 16)
//   FM_WARPS       warps per CTA; each warp owns FM_BLOCK_M / FM_WARPS rows (16 or 32)
//   FM_STAGES      K/V shared-memory ring depth (2 or 3); tile i+STAGES-1 loads while i runs
//   FM_Q_IN_REGS   1: Q A-fragments loaded once into registers; 0: re-read by ldmatrix
//   FM_MIN_BLOCKS  second __launch_bounds__ argument (CTAs per SM the compiler must allow)
//   FM_SUB_N       keys per compute step (default FM_BLOCK_N): a loaded K/V tile of
//                  BLOCK_N keys is processed as BLOCK_N/SUB_N sub-tiles (a rolled loop), so
//                  S needs only SUB_N columns of registers while barriers, cp.async groups
//                  and load bookkeeping happen once per BLOCK_N keys
//   FM_WINDOW      0/1 sliding window (with FM_CAUSAL): row i sees keys j with
//                  i + Sk - Sq - left <= j <= i + Sk - Sq + right (the sm_90a kernel's
//                  convention and parameters); every visited tile is masked
//   FM_SOFTCAP     0/1 logit softcap: logits = softcap * tanh(scale * q.k / softcap)
//   FM_ALIBI       0/1 ALiBi (FlashAttention's convention): after the softcap, the logit of
//                  query i and key j gets -slope * |i + Sk - Sq - j|, slope per (batch, head)
//
// ABI (extern "C" flash_attn_fwd):
//   (const u16* q, const u16* k, const u16* v, u16* o, float* lse,
//    int seqlen_q, int seqlen_k, int heads_q, int heads_kv, float softmax_scale_log2
//    [, int window_left, int window_right]          FM_WINDOW
//    [, float softcap_log2]                         FM_SOFTCAP
//    [, const float* alibi_slopes, int alibi_batch_stride]    FM_ALIBI
//    , FmStrides strides)
//   q, o: (batch, seqlen_q, heads_q, D); k, v: (batch, seqlen_k, heads_kv, D), any element
//   strides (batch, seq, head) given by `strides` (multiples of 8: 16-byte rows), the last
//   dimension contiguous; lse: (batch, heads_q, seqlen_q) f32 contiguous, natural log. Grid (ceil(Sq/BLOCK_M), heads_q, batch),
//   block (FM_WARPS*32). Rows with no visible key: O = 0, LSE = -inf.
//   Window sides are >= 0 (the host passes 2^30 for an unbounded side; the kernel clamps
//   left to Sk and right to Sq, which changes no mask and keeps int arithmetic in range).
//   With FM_SOFTCAP, softmax_scale_log2 is scale / softcap and softcap_log2 = softcap*log2 e.
//   ALiBi: slope of (batch b, head h) = alibi_slopes[b * alibi_batch_stride + h] (f32, stride
//   0 for one slope vector shared by the batch), in natural-log units of the logits.
//
// Shared memory (dynamic), one formula, mirrored by TileConfig::shared_mem_bytes in config.rs:
//   PITCH = 64 if DP <= 64, 128 if DP <= 128, else 256 (elements per smem row; rows padded
//           to a power of two >= 128 bytes so the XOR swizzle below is conflict-free)
//   bytes = 2 * PITCH * (BLOCK_M + 2 * STAGES * BLOCK_N)
//   layout: [Q: BLOCK_M rows][K: STAGES x BLOCK_N rows][V: STAGES x BLOCK_N rows]
//   The Q region is reused at the end to stage O for 16-byte coalesced stores.
//   Swizzle: the 16-byte chunk c of row r lives at chunk (c ^ (r & 7)) of that row.
//
// Per warp: 16*MT query rows (MT = 1 or 2 m16 tiles). S = Q K^T with
// mma.m16n8k16 (A = Q fragments, B = K via ldmatrix), online softmax in fp32 in the
// log2 domain (scale*log2(e) folded into one FFMA before ex2), P packed to 16 bit in
// registers and used directly as the A operand of O += P V (B = V via ldmatrix.trans).
// K/V tiles are visited from the last to the first, so the tiles that need masking
// (ragged tail, causal diagonal) come first and the rest run the mask-free code.


#ifndef FM_HEAD_DIM
#error "FM_HEAD_DIM must be defined"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2
#ifndef FM_CAUSAL
#define FM_CAUSAL 0
#endif
#ifndef FM_BLOCK_M
#define FM_BLOCK_M 128
#endif
#ifndef FM_BLOCK_N
#define FM_BLOCK_N 64
#endif
#ifndef FM_WARPS
#define FM_WARPS 4
#endif
#ifndef FM_STAGES
#define FM_STAGES 2
#endif
#ifndef FM_Q_IN_REGS
#define FM_Q_IN_REGS 0
#endif
#ifndef FM_MIN_BLOCKS
#define FM_MIN_BLOCKS 1
#endif
#ifndef FM_SUB_N
#define FM_SUB_N FM_BLOCK_N
#endif
#ifndef FM_WINDOW
#define FM_WINDOW 0
#endif
#ifndef FM_SOFTCAP
#define FM_SOFTCAP 0
#endif
#ifndef FM_ALIBI
#define FM_ALIBI 0
#endif

// Element strides (batch, seq, head) of q, k, v and o, passed by value.
struct FmStrides {
    i64 q[3];
    i64 k[3];
    i64 v[3];
    i64 o[3];
};

namespace fm {

constexpr int D = FM_HEAD_DIM;
constexpr int DP = (D + 15) / 16 * 16;    // compute width (k16 steps of Q K^T, n8 pairs of O)
constexpr int BM = FM_BLOCK_M;
constexpr int BN = FM_BLOCK_N;
constexpr int WARPS = FM_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int STAGES = FM_STAGES;
constexpr bool CAUSAL = FM_CAUSAL != 0;
constexpr bool Q_IN_REGS = FM_Q_IN_REGS != 0;
constexpr bool WINDOW = FM_WINDOW != 0;
constexpr bool SOFTCAP = FM_SOFTCAP != 0;
constexpr bool ALIBI = FM_ALIBI != 0;
// Softcap and ALiBi turn S into log2-domain logits before the softmax (PRE), which then
// uses a scale of 1; the plain variants keep the scale folded into the exponent's FFMA.
constexpr bool PRE = SOFTCAP || ALIBI;
constexpr int RPW = BM / WARPS;           // query rows per warp
constexpr int MT = RPW / 16;              // m16 tiles per warp
constexpr int PITCH = DP <= 64 ? 64 : (DP <= 128 ? 128 : 256);
constexpr int PITCH_B = PITCH * 2;        // bytes per smem row
constexpr int CPR = D / 8;                // 16-byte chunks per row (global)
constexpr int CPRS = DP / 8;              // chunks per smem row the MMAs read (CPR or CPR + 1)
constexpr int DT = DP / 8;                // n8 tiles of O
constexpr int KD = DP / 16;               // k16 steps over DP (S = Q K^T)
constexpr int SN = FM_SUB_N;              // keys per compute sub-tile (S registers)
constexpr int NSUB = BN / SN;             // sub-tiles per loaded K/V tile
constexpr int NT = SN / 8;                // n8 tiles of S
constexpr int KN = SN / 16;               // k16 steps over keys (O += P V)
constexpr int Q_BYTES = BM * PITCH_B;
constexpr int KV_TILE_BYTES = BN * PITCH_B;
constexpr int SMEM_BYTES = 2 * PITCH * (BM + 2 * STAGES * BN);

static_assert(D % 8 == 0 && D >= 8 && D <= 256, "head dim must be a multiple of 8, <= 256");
static_assert(BM % WARPS == 0 && (RPW == 16 || RPW == 32), "rows per warp must be 16 or 32");
static_assert(BN % 16 == 0 && BN >= 16, "BLOCK_N must be a multiple of 16");
static_assert(SN % 16 == 0 && SN >= 16 && BN % SN == 0, "SUB_N must be a multiple of 16 dividing BLOCK_N");
static_assert(STAGES >= 2 && STAGES <= 4, "STAGES must be 2..4");
static_assert(SMEM_BYTES == Q_BYTES + 2 * STAGES * KV_TILE_BYTES, "smem formula");
static_assert(!WINDOW || CAUSAL, "FM_WINDOW needs FM_CAUSAL (the window's right side)");

// ----------------------------------------------------------------------------------------
// PTX wrappers (the ones shared with the other mma.sync kernels are in fm_ptx.cuh)
// ----------------------------------------------------------------------------------------

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float tanh_approx(float x) {
    float r;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// What tile_step needs to transform and mask S: the diagonal shift, the window's sides
// (left only with WINDOW; right = 0 without it), the softcap and the ALiBi slope (log2 units).
struct Logits {
    int seqlen_k;
    int diag;   // row i's diagonal key: i + diag
    int left;   // WINDOW: keys below i + diag - left are hidden
    int right;  // CAUSAL: keys above i + diag + right are hidden
    float scale_log2;
    float softcap_log2;
    float alibi_log2;
};


// Byte offset of 16-byte chunk `ch` of row `r` inside a swizzled tile.
__device__ __forceinline__ u32 swz(int r, int ch) {
    return (u32)(r * PITCH_B + ((ch ^ (r & 7)) << 4));
}

// Copy rows [row0, row0 + ROWS) x D of the (seq, D) matrix at g0 + base0 (row stride
// `stride0` elements) into the swizzled tile at dst0 (and, when TWO, the same rows of the
// matrix at g1 + base1, row stride stride1, into dst1); rows >= `nrows`, and the pad chunk
// of a row when DP > D, are zero-filled (src-size 0: nothing is read).
// Everything is recomputed from (base, row0, tid) so that no per-chunk address stays live
// across the main loop (register pressure).
template <int ROWS, bool TWO>
__device__ __forceinline__ void load_tile(u32 dst0, const u16* __restrict__ g0, i64 base0,
                                          i64 stride0, u32 dst1, const u16* __restrict__ g1,
                                          i64 base1, i64 stride1, int row0, int nrows, int tid) {
    constexpr int TOTAL = ROWS * CPRS;
    constexpr int ITERS = (TOTAL + THREADS - 1) / THREADS;
    if constexpr (THREADS % CPRS == 0 && (THREADS / CPRS) % 8 == 0) {
        // Fast path: each thread keeps one chunk column; rows advance by RSTEP (a multiple
        // of 8, so the swizzle pattern and the smem offset step are compile-time).
        constexpr int RSTEP = THREADS / CPRS;
        const int r0 = (u32)tid / CPRS;
        const int ch = (u32)tid % CPRS;
        const bool col_ok = CPRS == CPR || ch < CPR;
        i64 off0 = base0 + (i64)(row0 + r0) * stride0 + ch * 8;
        i64 off1 = TWO ? base1 + (i64)(row0 + r0) * stride1 + ch * 8 : 0;
        const u32 so = swz(r0, ch);
        const int left = nrows - row0 - r0;  // rows of this thread still in range: it*RSTEP < left
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            if (TOTAL % THREADS == 0 || tid + it * THREADS < TOTAL) {
                const bool ok = col_ok && it * RSTEP < left;
                cp_async16(dst0 + so + it * RSTEP * PITCH_B, g0 + (ok ? off0 : 0), ok);
                if (TWO) cp_async16(dst1 + so + it * RSTEP * PITCH_B, g1 + (ok ? off1 : 0), ok);
            }
            off0 += stride0 * RSTEP;
            if (TWO) off1 += stride1 * RSTEP;
        }
    } else {
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
            const int c = tid + it * THREADS;
            if (TOTAL % THREADS == 0 || c < TOTAL) {
                const int r = c / CPRS;
                const int ch = c % CPRS;
                const int gr = row0 + r;
                const bool ok = gr < nrows && (CPRS == CPR || ch < CPR);
                const i64 off0 = ok ? base0 + (i64)gr * stride0 + ch * 8 : 0;
                cp_async16(dst0 + swz(r, ch), g0 + off0, ok);
                if (TWO) {
                    const i64 off1 = ok ? base1 + (i64)gr * stride1 + ch * 8 : 0;
                    cp_async16(dst1 + swz(r, ch), g1 + off1, ok);
                }
            }
        }
    }
}

// ----------------------------------------------------------------------------------------
// One K/V tile: S = Q K^T, (mask), online softmax, O += P V.
// ----------------------------------------------------------------------------------------
__device__ __forceinline__ void tile_step(bool mask, float (&o)[MT][DT][4], float (&m_i)[MT][2],
                                          float (&l_i)[MT][2], const u32 (&qf)[MT][KD][4],
                                          const u32 (&lb)[4], const u32 (&kb)[4], u32 sQw,
                                          u32 sK, u32 sV,
                                          int lane, int n0,
                                          int row_base, const Logits& lg) {
    const int seqlen_k = lg.seqlen_k;
    const float scale_log2 = PRE ? 1.f : lg.scale_log2;
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

    // ---- S = Q K^T ----
#pragma unroll
    for (int kk = 0; kk < KD; ++kk) {
        u32 a[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            if (Q_IN_REGS) {
#pragma unroll
                for (int e = 0; e < 4; ++e) a[mt][e] = qf[mt][kk][e];
            } else {
                ldsm_x4(sQw + lb[kk & 3] + (kk >> 2) * 128 + mt * 16 * PITCH_B, a[mt][0],
                        a[mt][1], a[mt][2], a[mt][3]);
            }
        }
#pragma unroll
        for (int np = 0; np < KN; ++np) {
            u32 b0, b1, b2, b3;
            // b0,b1: keys 0-7 (n-tile 2np), d lo/hi; b2,b3: keys 8-15 (n-tile 2np+1)
            ldsm_x4(sK + kb[kk & 3] + (kk >> 2) * 128 + np * 16 * PITCH_B, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(s[mt][2 * np], a[mt], b0, b1);
                mma16816(s[mt][2 * np + 1], a[mt], b2, b3);
            }
        }
    }

    // ---- softcap, ALiBi: S becomes log2-domain logits ----
    if (PRE) {
        // ALiBi in float: |(row + diag) - col| with the row's diagonal and the lane's first
        // column converted once (exact: |values| < 2^24 for the sequence lengths served, and
        // larger distances only round a bias that is already huge), the per-element column
        // offsets compile-time.
        const float col0 = (float)(n0 + 2 * (lane & 3));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float rd =
                    (float)(row_base + mt * 16 + (lane >> 2) + h * 8 + lg.diag) - col0;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float x = s[mt][nt][2 * h + e];
                        x = SOFTCAP ? tanh_approx(x * lg.scale_log2) * lg.softcap_log2
                                    : x * lg.scale_log2;
                        if (ALIBI) x = fmaf(lg.alibi_log2, -fabsf(rd - (float)(nt * 8 + e)), x);
                        s[mt][nt][2 * h + e] = x;
                    }
            }
    }

    // ---- mask (ragged key tail, causal diagonal, window) ----
    if (mask) {  // block-uniform branch
        const int col0 = n0 + 2 * (lane & 3);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = row_base + mt * 16 + (lane >> 2) + h * 8;
                // keys visible to this row: lo <= col < limit
                int limit = seqlen_k;
                if (CAUSAL) limit = min(limit, row + lg.diag + lg.right + 1);
                const int lo = WINDOW ? row + lg.diag - lg.left : 0;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int col = col0 + nt * 8 + e;
                        if (col >= limit || (WINDOW && col < lo)) s[mt][nt][2 * h + e] = neg_inf();
                    }
            }
    }

    // ---- online softmax (log2 domain), rows g and g+8 of each m-tile; P is packed to 16
    // bit right after its exp so the fp32 scores die early. The C layout of two n8 tiles
    // (2kk, 2kk+1) is the A layout of k16 step kk: a0/a2 hold row g, a1/a3 row g+8.
    u32 pa[MT][KN][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = neg_inf();
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float m_new = fmaxf(m_i[mt][h], mx * scale_log2);
            // Safe max: a row that has seen no key yet keeps m = -inf; subtract 0 instead
            // so that exp2(-inf - (-inf)) never produces NaN.
            const float m_use = (m_new == neg_inf()) ? 0.f : m_new;
            const float alpha = ex2(m_i[mt][h] - m_use);
            m_i[mt][h] = m_new;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const float p0 = ex2(fmaf(s[mt][nt][2 * h], scale_log2, -m_use));
                const float p1 = ex2(fmaf(s[mt][nt][2 * h + 1], scale_log2, -m_use));
                sum += p0 + p1;
                pa[mt][nt >> 1][(nt & 1) * 2 + h] = pack2(p0, p1);
            }
            l_i[mt][h] = l_i[mt][h] * alpha + sum;  // per-thread partial; quad-reduced at end
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                o[mt][dt][2 * h] *= alpha;
                o[mt][dt][2 * h + 1] *= alpha;
            }
        }

    // ---- O += P V ----
#pragma unroll
    for (int kk = 0; kk < KN; ++kk) {
#pragma unroll
        for (int dp = 0; dp < DT / 2; ++dp) {
            u32 b0, b1, b2, b3;
            ldsm_x4_t(sV + lb[dp & 3] + (dp >> 2) * 128 + kk * 16 * PITCH_B, b0, b1, b2, b3);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                mma16816(o[mt][2 * dp], pa[mt][kk], b0, b1);
                mma16816(o[mt][2 * dp + 1], pa[mt][kk], b2, b3);
            }
        }
    }
}

}  // namespace fm

extern "C" __global__ void __launch_bounds__(fm::THREADS, FM_MIN_BLOCKS)
    flash_attn_fwd(const u16* __restrict__ q, const u16* __restrict__ k,
                   const u16* __restrict__ v, u16* __restrict__ o, float* __restrict__ lse,
                   int seqlen_q, int seqlen_k, int heads_q, int heads_kv,
                   float softmax_scale_log2
#if FM_WINDOW
                   , int window_left, int window_right
#endif
#if FM_SOFTCAP
                   , float softcap_log2
#endif
#if FM_ALIBI
                   , const float* __restrict__ alibi_slopes, int alibi_batch_stride
#endif
                   , const FmStrides strides) {
    using namespace fm;
#if !FM_WINDOW
    constexpr int window_left = 0, window_right = 0;
#endif
#if !FM_SOFTCAP
    constexpr float softcap_log2 = 0.f;
#endif
    extern __shared__ __align__(128) unsigned char smem_raw[];

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    // Causal: the last query blocks see the most keys; start them first.
    const int m_block = CAUSAL ? (int)(gridDim.x - 1 - blockIdx.x) : (int)blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int kv_head = head / (heads_q / heads_kv);
    const int m0 = m_block * BM;

    // Row strides and the (batch, head) base of each matrix, in elements.
    const i64 q_stride = strides.q[1], k_stride = strides.k[1], v_stride = strides.v[1];
    const i64 q_off = (i64)batch * strides.q[0] + (i64)head * strides.q[2];
    const i64 k_off = (i64)batch * strides.k[0] + (i64)kv_head * strides.k[2];
    const i64 v_off = (i64)batch * strides.v[0] + (i64)kv_head * strides.v[2];
    // K's and V's bases are re-read from shared memory at each tile load instead of
    // occupying four registers through the main loop (the D=128 tile has none to spare).
    __shared__ i64 kv_base[2];
    if (tid == 0) {
        kv_base[0] = k_off;
        kv_base[1] = v_off;
    }
    __syncthreads();
    const volatile i64* kvb = kv_base;

    const u32 sQ = smem_addr(smem_raw);
    const u32 sK0 = sQ + Q_BYTES;
    const u32 sV0 = sK0 + STAGES * KV_TILE_BYTES;
    const u32 sQw = sQ + warp * RPW * PITCH_B;  // this warp's rows of Q (and later of O)

    // Keys [n_begin, n_end) can be visible to some row of this block.
    const int diag = seqlen_k - seqlen_q;  // row i sees keys j <= i + diag (+ right)
    const int wleft = WINDOW ? min(window_left, seqlen_k) : 0;
    const int wright = WINDOW ? min(window_right, seqlen_q) : 0;
    int n_end = seqlen_k;
    if (CAUSAL) n_end = max(0, min(seqlen_k, m0 + BM + diag + wright));
    const int t_lo = WINDOW ? max(0, m0 + diag - wleft) / BN : 0;
    const int t_hi = (n_end + BN - 1) / BN;  // tiles [t_lo, t_hi), visited last to first
    const int n_tiles = max(0, t_hi - t_lo);
    // Tiles from index first_masked on need masking: ragged tail (n0 + BN > Sk) or, when
    // causal, a key beyond the first row's limit (n0 + BN - 1 > m0 + diag). With a window
    // every tile is masked (its left edge moves with the row).
    int thr = seqlen_k - BN + 1;
    if (CAUSAL) thr = min(thr, m0 + diag - BN + 2);
    const int first_masked = thr <= 0 ? 0 : (thr + BN - 1) / BN;
    const int n_masked = WINDOW ? n_tiles : min(n_tiles, max(0, t_hi - first_masked));
    Logits lg;
    lg.seqlen_k = seqlen_k;
    lg.diag = diag;
    lg.left = wleft;
    lg.right = wright;
    lg.scale_log2 = softmax_scale_log2;
    lg.softcap_log2 = softcap_log2;
    lg.alibi_log2 = 0.f;
#if FM_ALIBI
    lg.alibi_log2 = alibi_slopes[(i64)batch * alibi_batch_stride + head] * 1.4426950408889634f;
#endif

    // ---- prologue: Q, then the first STAGES-1 K/V tiles (tiles visited last to first) ----
    load_tile<BM, false>(sQ, q, q_off, q_stride, 0, q, 0, 0, m0, seqlen_q, tid);
    cp_async_commit();
#pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) {
        if (st < n_tiles) {
            const int n0 = (t_hi - 1 - st) * BN;
            load_tile<BN, true>(sK0 + st * KV_TILE_BYTES, k, k_off, k_stride,
                                sV0 + st * KV_TILE_BYTES, v, v_off, v_stride, n0, seqlen_k, tid);
        }
        cp_async_commit();
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

    // Lane-dependent ldmatrix base offsets. ldmatrix.x4 lane l gives the row address of
    // matrix i = l >> 3, row l & 7 (= lr). In a swizzled tile, chunk 2j+b of a row r with
    // r & 7 == lr sits at chunk (2j+b) ^ lr = 8*(j>>2) + ((2*(j&3)) ^ (b ^ lr)), so four
    // lane bases (j&3) cover every k step; j>>2, the m/n tile and the key block become
    // compile-time immediates, and region bases are uniform. The four result registers
    // must come out in the order the mma operands need them (B pairs are consecutive):
    //   Q (A, x4):        matrix i -> rows (i&1)*8 + lr, chunk 2kk + (i>>1)  (a0 a1 a2 a3)
    //   V (B, x4.trans):  matrix i -> keys (i&1)*8 + lr, chunk 2dp + (i>>1)  (b0 b1 of the
    //                     lower n8 tile of d, then b0 b1 of the upper one)
    //   K (B, x4):        matrix i -> keys (i>>1)*8 + lr, chunk 2kk + (i&1)  (b0 b1 of keys
    //                     0-7, then b0 b1 of keys 8-15)
    const int li = lane >> 3, lr = lane & 7;
    u32 lb[4], kb[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        lb[j] = ((li & 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li >> 1))) << 4);
        kb[j] = ((li >> 1) * 8 + lr) * PITCH_B + (((2 * j) ^ (lr ^ (li & 1))) << 4);
    }

    u32 qf[MT][KD][4];
    if (Q_IN_REGS) {
        cp_async_wait<STAGES - 1>();  // the Q group is complete
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int kk = 0; kk < KD; ++kk)
                ldsm_x4(sQw + lb[kk & 3] + (kk >> 2) * 128 + mt * 16 * PITCH_B, qf[mt][kk][0],
                        qf[mt][kk][1], qf[mt][kk][2], qf[mt][kk][3]);
    }

    const int row_base = m0 + warp * RPW;
    // Iteration i handles tile t_hi-1-i from ring slot i % STAGES; it first starts the
    // load of iteration i+STAGES-1 into the slot that iteration i-1 used (free after the
    // barrier). The first n_masked iterations are the tiles that need masking.
    int slot = 0;
    for (int i = 0; i < n_tiles; ++i) {
        cp_async_wait<STAGES - 2>();  // tile i has landed (this thread's part)
        __syncthreads();              // ... everyone's part; slot of tile i-1 is free
        {
            const int nx = i + STAGES - 1;
            if (nx < n_tiles) {
                int ns = slot + STAGES - 1;
                if (ns >= STAGES) ns -= STAGES;
                load_tile<BN, true>(sK0 + ns * KV_TILE_BYTES, k, kvb[0], k_stride,
                                    sV0 + ns * KV_TILE_BYTES, v, kvb[1], v_stride,
                                    (t_hi - 1 - nx) * BN, seqlen_k, tid);
            }
            cp_async_commit();
        }
        const int n0 = (t_hi - 1 - i) * BN;
        const u32 sK = sK0 + slot * KV_TILE_BYTES;
        const u32 sV = sV0 + slot * KV_TILE_BYTES;
#pragma unroll 1
        for (int sub = 0; sub < NSUB; ++sub)
            tile_step(i < n_masked, oacc, m_i, l_i, qf, lb, kb, sQw, sK + sub * SN * PITCH_B,
                      sV + sub * SN * PITCH_B, lane, n0 + sub * SN, row_base, lg);
        if (++slot == STAGES) slot = 0;
    }

    // ---- epilogue ----
    cp_async_wait<0>();
    __syncthreads();  // every cp.async into smem (Q included, even with n_tiles == 0) is done

    // Output bases computed here, not before the main loop (registers).
    float* lseg = lse + ((i64)blockIdx.z * heads_q + blockIdx.y) * seqlen_q;
    const i64 o_stride = strides.o[1];
    u16* og = o + (i64)blockIdx.z * strides.o[0] + (i64)blockIdx.y * strides.o[2];
    constexpr float LN2 = 0.693147180559945309f;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float l = l_i[mt][h];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            float inv = 0.f;  // 1/l: rcp.approx (<= 1 ulp) inline, not the IEEE subroutine
            if (l > 0.f) asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l));
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                oacc[mt][dt][2 * h] *= inv;
                oacc[mt][dt][2 * h + 1] *= inv;
            }
            const int row = row_base + mt * 16 + (lane >> 2) + h * 8;
            if ((lane & 3) == 0 && row < seqlen_q)
                lseg[row] = l > 0.f ? (m_i[mt][h] + lg2(l)) * LN2 : neg_inf();
        }

    // Stage O (16-bit) in this warp's own Q rows, then 16-byte coalesced stores.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = mt * 16 + (lane >> 2) + h * 8;
                st_shared_u32(sQw + swz(r, dt) + (lane & 3) * 4,
                              pack2(oacc[mt][dt][2 * h], oacc[mt][dt][2 * h + 1]));
            }
    __syncwarp();
    constexpr int OCH = RPW * CPR;  // 16-byte chunks of this warp's O rows
#pragma unroll
    for (int it = 0; it < (OCH + 31) / 32; ++it) {
        const int c = lane + it * 32;
        if (OCH % 32 == 0 || c < OCH) {
            const int r = c / CPR;
            const int ch = c % CPR;
            const int grow = row_base + r;
            u32 a, b, cc, d;
            ld_shared_v4(sQw + swz(r, ch), a, b, cc, d);
            if (grow < seqlen_q) st_global_v4(og + (i64)grow * o_stride + ch * 8, a, b, cc, d);
        }
    }
}
