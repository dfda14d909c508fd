// flashmoe — MoE grouped GEMMs (portable path, sm_80 and newer, mma.sync).
//
// Compiled at run time by NVRTC; self-contained (no CUDA headers). One source, two entries,
// specialised by preprocessor defines (crates/flashmoe/src/moe/gemm/tiles.rs owns the
// table of variants and the shared-memory formula, which must agree with the constants
// below):
//
//   FM_GEMM        13 = moe_gemm13 (gate+up, SwiGLU epilogue), 2 = moe_gemm2 (down)
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (x, weights, h storage; accumulation is fp32)
//   FM_BM          rows per block (multiple of 16 * FM_WARPS_M)
//   FM_BN          output columns per block (gemm13: per matrix, i.e. FM_BN gate columns
//                  AND the FM_BN matching up columns; multiple of 16 * FM_WARPS_N)
//   FM_WARPS_M/N   warp grid; a warp owns (BM/WARPS_M) x (BN/WARPS_N) of each output tile
//   FM_STAGES      cp.async shared-memory ring depth (2..8); k tile i+STAGES-1 is loading
//                  while tile i is multiplied
//   FM_MIN_BLOCKS  second __launch_bounds__ argument
//   BK = 64        k depth of one pipeline stage (fixed: 128-byte A rows for the swizzle)
//
// ABI (contract in crates/flashmoe/src/moe/forward/abi.rs, steps 5 and 6):
//   moe_gemm13(const u16* x, const u32* row_token, const u32* offsets, const u16* w13,
//              u16* h, u16* gu, int hidden, int inter, int experts)
//     h[r, n] = silu(x[row_token[r]] . w13[e][:, n]) * (x[row_token[r]] . w13[e][:, I + n]);
//     gu (null: not written) [rows][2I] 16-bit = the pre-activations (gate | up)
//   moe_gemm2(const u16* h, const u32* offsets, const u16* w2, float* y,
//             int hidden, int inter, int experts)
//     y[r, n] = h[r] . w2[e][:, n]   (f32)
//   grid.x = ceil(T*k / BM) + E (upper bound on sum_e ceil(n_e / BM)); grid.y = N / BN
//   (N = inter for gemm13, hidden for gemm2); block = WARPS_M * WARPS_N * 32 threads.
//   Block x finds its (expert, row tile) by a block-wide scan of the per-expert tile counts
//   ceil(n_e / BM) (experts with no rows own no tile, so their weights are never read);
//   surplus blocks exit before touching memory.
//   Requirements (checked by moe/gemm/tiles.rs): K (hidden for gemm13, inter for gemm2) a
//   multiple of 8 (16-byte chunks; the k tail beyond K inside the last BK tile is
//   zero-filled), N a multiple of BN.
//
// Shared memory (dynamic), one formula, mirrored by GemmTile::shared_mem_bytes:
//   A_BYTES  = BM * 128                     (BM rows x 64 k, 16-bit)
//   BPITCH   = max(BN, 64) elements          (rows padded to >= 128 bytes for the swizzle)
//   B_BYTES  = 64 * BPITCH * 2               (64 k rows x BN columns), NB = 2 (gemm13) or 1
//   bytes    = STAGES * (A_BYTES + NB * B_BYTES) + BM * 8 + 256
//   layout: [stage 0: A | B (gate) | B (up)] ... [stage S-1] [row offsets: BM x i64]
//           [scan scratch: 64 x u32]
//   Swizzle: 16-byte chunk c of row r lives at chunk (c ^ (r & 7)) of that row.
//
// Per warp: MT = WTM/16 m16 tiles x NT = WTN/8 n8 tiles per output matrix; A fragments by
// ldmatrix.x4, B fragments (K-major [k][n] in smem) by ldmatrix.x4.trans, mma.m16n8k16
// with fp32 accumulators. Epilogue straight from registers: gemm13 applies silu(g) * u and
// stores 16-bit pairs; gemm2 stores f32 pairs. Rows beyond the expert's range read zeros
// (cp.async src-size 0) and are never stored.


#ifndef FM_GEMM
#error "FM_GEMM must be 13 or 2"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"  // u32/u16/i64, cp.async, ldmatrix, mma.sync, pack2, ex2
#include "moe_gemm_common.cuh"  // moe_find_tile, swiglu, epilogue stores
#ifndef FM_BM
#define FM_BM 128
#endif
#ifndef FM_BN
#define FM_BN 64
#endif
#ifndef FM_WARPS_M
#define FM_WARPS_M 2
#endif
#ifndef FM_WARPS_N
#define FM_WARPS_N 4
#endif
#ifndef FM_STAGES
#define FM_STAGES 3
#endif
#ifndef FM_MIN_BLOCKS
#define FM_MIN_BLOCKS 1
#endif

namespace fm {

constexpr bool G13 = FM_GEMM == 13;
constexpr int NB = G13 ? 2 : 1;  // B matrices (and accumulator tiles) per block
constexpr int BM = FM_BM;
constexpr int BN = FM_BN;
constexpr int BK = 64;
constexpr int WARPS_M = FM_WARPS_M;
constexpr int WARPS_N = FM_WARPS_N;
constexpr int WARPS = WARPS_M * WARPS_N;
constexpr int THREADS = WARPS * 32;
constexpr int STAGES = FM_STAGES;
constexpr int WTM = BM / WARPS_M;
constexpr int WTN = BN / WARPS_N;
constexpr int MT = WTM / 16;
constexpr int NT = WTN / 8;
constexpr int NP = WTN / 16;  // n16 pairs (one ldmatrix.x4.trans each)
constexpr int KK = BK / 16;
constexpr int A_PITCH_B = BK * 2;  // 128
constexpr int BPITCH = BN > 64 ? BN : 64;
constexpr int B_PITCH_B = BPITCH * 2;
constexpr int A_BYTES = BM * A_PITCH_B;
constexpr int B_BYTES = BK * B_PITCH_B;
constexpr int STAGE_BYTES = A_BYTES + NB * B_BYTES;
constexpr int ROWOFF_BYTES = BM * 8;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + ROWOFF_BYTES + 256;
constexpr int A_CHUNKS = BM * (BK / 8);
constexpr int B_CPR = BN / 8;  // 16-byte chunks per B row
constexpr int B_CHUNKS = BK * B_CPR;

static_assert(FM_GEMM == 13 || FM_GEMM == 2, "FM_GEMM must be 13 or 2");
static_assert(WTM % 16 == 0 && WTM >= 16 && BM == WTM * WARPS_M, "BM / WARPS_M must be a multiple of 16");
static_assert(WTN % 16 == 0 && WTN >= 16 && BN == WTN * WARPS_N, "BN / WARPS_N must be a multiple of 16");
static_assert(BN == 32 || BN % 64 == 0, "BN must be 32 or a multiple of 64");
static_assert(STAGES >= 2 && STAGES <= 8, "STAGES must be 2..8");
static_assert(WARPS <= 32, "at most 32 warps");
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory over the sm_90 per-block limit");

// A stage: BM rows x 64 k of the gathered A rows (element offset of row r in rowoff[r],
// -1 = masked row -> zeros), k columns [k0, k0+64) with chunks >= K zero-filled.
__device__ __forceinline__ void load_a(u32 dst, const u16* __restrict__ a, const i64* rowoff,
                                       int k0, int K, int tid) {
    constexpr int ITERS = (A_CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int c = tid + it * THREADS;
        if (A_CHUNKS % THREADS == 0 || c < A_CHUNKS) {
            const int r = c >> 3;
            const int ch = c & 7;
            const i64 ro = rowoff[r];
            const int k = k0 + ch * 8;
            const bool ok = ro >= 0 && k < K;
            cp_async16(dst + r * A_PITCH_B + ((ch ^ (r & 7)) << 4), a + (ok ? ro + k : 0), ok);
        }
    }
}

// B stage: 64 k rows x BN columns of the [K, ldb] K-major weight at w (already offset to
// the expert and the first column), k rows >= K zero-filled.
__device__ __forceinline__ void load_b(u32 dst, const u16* __restrict__ w, i64 ldb, int k0,
                                       int K, int tid) {
    constexpr int ITERS = (B_CHUNKS + THREADS - 1) / THREADS;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
        const int c = tid + it * THREADS;
        if (B_CHUNKS % THREADS == 0 || c < B_CHUNKS) {
            const int r = c / B_CPR;
            const int ch = c % B_CPR;
            const int k = k0 + r;
            const bool ok = k < K;
            cp_async16(dst + r * B_PITCH_B + ((ch ^ (r & 7)) << 4),
                       w + (ok ? (i64)k * ldb + ch * 8 : 0), ok);
        }
    }
}

// The whole block: C[NB] (BM x BN each) = A (gathered rows) x B[NB], then the epilogue.
// a: A matrix; rowoff computed by the caller in smem; w0/w1: B column tiles (w1 unused
// when NB == 1); ldb: row stride of the weight; K: reduction depth.
__device__ __forceinline__ void gemm_block(const u16* __restrict__ a, const u16* __restrict__ w0,
                                           const u16* __restrict__ w1, i64 ldb, int K,
                                           u32 smem, const i64* rowoff, int tid,
                                           float (&acc)[NB][MT][NT][4]) {
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wm = warp / WARPS_N;
    const int wn = warp % WARPS_N;
    const int ktiles = (K + BK - 1) / BK;

#pragma unroll
    for (int b = 0; b < NB; ++b)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[b][mt][nt][e] = 0.f;

    // prologue: stages 0 .. STAGES-2
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ktiles) {
            const u32 st = smem + s * STAGE_BYTES;
            load_a(st, a, rowoff, s * BK, K, tid);
            load_b(st + A_BYTES, w0, ldb, s * BK, K, tid);
            if (NB == 2) load_b(st + A_BYTES + B_BYTES, w1, ldb, s * BK, K, tid);
        }
        cp_async_commit();
    }

    // Lane-dependent ldmatrix offsets (bytes inside a stage). ldmatrix.x4 lane l addresses
    // row (l & 7) of matrix l >> 3.
    //   A (x4):       matrix i -> rows (i&1)*8 + lr, k chunk 2kk + (i>>1) -> a0 a1 a2 a3
    //   B (x4.trans): matrix i -> k rows (i&1)*8 + lr, n chunk 2np + (i>>1) -> b0 b1 of
    //                 n8 tile 2np, then b0 b1 of n8 tile 2np+1
    // All rows touched are congruent to lr mod 8 (tile bases are multiples of 8), so the
    // swizzle term is (chunk ^ lr).
    const int lr = lane & 7;
    const int l16 = lane & 15;
    const int hi = lane >> 4;
    u32 aoff[KK];
#pragma unroll
    for (int kk = 0; kk < KK; ++kk)
        aoff[kk] = (wm * WTM + l16) * A_PITCH_B + (((2 * kk + hi) ^ lr) << 4);
    u32 boff[NP];
#pragma unroll
    for (int np = 0; np < NP; ++np)
        boff[np] = l16 * B_PITCH_B + (((wn * (WTN / 8) + 2 * np + hi) ^ lr) << 4);

    int slot = 0;
    for (int kt = 0; kt < ktiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // k tile kt has landed (this thread's copies)
        __syncthreads();              // ... everyone's; the slot of tile kt-1 is free
        {
            const int nx = kt + STAGES - 1;
            if (nx < ktiles) {
                int ns = slot + STAGES - 1;
                if (ns >= STAGES) ns -= STAGES;
                const u32 st = smem + ns * STAGE_BYTES;
                load_a(st, a, rowoff, nx * BK, K, tid);
                load_b(st + A_BYTES, w0, ldb, nx * BK, K, tid);
                if (NB == 2) load_b(st + A_BYTES + B_BYTES, w1, ldb, nx * BK, K, tid);
            }
            cp_async_commit();
        }
        const u32 sA = smem + slot * STAGE_BYTES;
        const u32 sB = sA + A_BYTES;
#pragma unroll
        for (int kk = 0; kk < KK; ++kk) {
            u32 af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(sA + aoff[kk] + mt * 16 * A_PITCH_B, af[mt][0], af[mt][1], af[mt][2],
                        af[mt][3]);
#pragma unroll
            for (int b = 0; b < NB; ++b)
#pragma unroll
                for (int np = 0; np < NP; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4_t(sB + b * B_BYTES + kk * 16 * B_PITCH_B + boff[np], b0, b1, b2, b3);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        mma16816(acc[b][mt][2 * np], af[mt], b0, b1);
                        mma16816(acc[b][mt][2 * np + 1], af[mt], b2, b3);
                    }
                }
        }
        if (++slot == STAGES) slot = 0;
    }
    cp_async_wait<0>();  // only empty groups remain; keep the ring quiet before exit
}

// rowoff[r] = element offset of A row r of this tile, or -1 beyond the expert's rows.
__device__ __forceinline__ void fill_rowoff(i64* rowoff, const u32* __restrict__ row_token,
                                            u32 row0, int nrows, i64 row_stride, int tid) {
    for (int r = tid; r < BM; r += THREADS) {
        i64 v = -1;
        if (r < nrows) {
            const u32 src = row_token ? row_token[row0 + r] : row0 + r;
            v = (i64)src * row_stride;
        }
        rowoff[r] = v;
    }
}

// The whole block of either GEMM: K = reduction depth, N = output columns per matrix;
// row_token gathers the A rows (gemm13) or is null when they are already in permuted
// order (gemm2). Weights are [E][K][NB·N] (gemm13: gate | up). out: h (16-bit, gemm13)
// or y (f32, gemm2), [rows][N].
__device__ __forceinline__ void grouped_gemm(const u16* __restrict__ a,
                                             const u32* __restrict__ row_token,
                                             const u32* __restrict__ offsets,
                                             const u16* __restrict__ w, void* out, u16* gu,
                                             int K, int N, int experts,
                                             unsigned char* smem_raw) {
    const int tid = threadIdx.x;
    const u32 smem = smem_addr(smem_raw);
    i64* rowoff = reinterpret_cast<i64*>(smem_raw + STAGES * STAGE_BYTES);
    u32* scratch = reinterpret_cast<u32*>(smem_raw + STAGES * STAGE_BYTES + ROWOFF_BYTES);

    int e, tile;
    if (!moe_find_tile<BM, THREADS>(offsets, experts, scratch, tid, blockIdx.x, e, tile)) return;
    const u32 row0 = offsets[e] + (u32)tile * BM;
    const int nrows = min(BM, (int)(offsets[e + 1] - row0));
    fill_rowoff(rowoff, row_token, row0, nrows, K, tid);
    __syncthreads();

    const int n0 = blockIdx.y * BN;
    const i64 ldb = (i64)NB * N;
    const u16* wb = w + (i64)e * K * ldb + n0;
    float acc[NB][MT][NT][4];
    gemm_block(a, wb, wb + (NB == 2 ? N : 0), ldb, K, smem, rowoff, tid, acc);

    // epilogue straight from the accumulators: gemm13 h = silu(g) * u as 16-bit pairs,
    // gemm2 y as f32 pairs
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wm = warp / WARPS_N;
    const int wn = warp % WARPS_N;
    const int col = n0 + wn * WTN + 2 * (lane & 3);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int r = wm * WTM + mt * 16 + (lane >> 2) + hh * 8;
            if (r < nrows) {
                const i64 off = (i64)(row0 + r) * N + col;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#if FM_GEMM == 13
                    st_global_u32(static_cast<u16*>(out) + off + nt * 8,
                                  pack2(swiglu(acc[0][mt][nt][2 * hh], acc[1][mt][nt][2 * hh]),
                                        swiglu(acc[0][mt][nt][2 * hh + 1],
                                               acc[1][mt][nt][2 * hh + 1])));
                    if (gu != nullptr) {
                        u16* g = gu + (i64)(row0 + r) * 2 * N + col + nt * 8;
                        st_global_u32(g, pack2(acc[0][mt][nt][2 * hh], acc[0][mt][nt][2 * hh + 1]));
                        st_global_u32(g + N,
                                      pack2(acc[1][mt][nt][2 * hh], acc[1][mt][nt][2 * hh + 1]));
                    }
#else
                    st_global_f32x2(static_cast<float*>(out) + off + nt * 8,
                                    acc[0][mt][nt][2 * hh], acc[0][mt][nt][2 * hh + 1]);
#endif
                }
            }
        }
}

}  // namespace fm

#if FM_GEMM == 13
extern "C" __global__ void __launch_bounds__(fm::THREADS, FM_MIN_BLOCKS)
    moe_gemm13(const u16* __restrict__ x, const u32* __restrict__ row_token,
               const u32* __restrict__ offsets, const u16* __restrict__ w13,
               u16* __restrict__ h, u16* __restrict__ gu, int hidden, int inter, int experts) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    fm::grouped_gemm(x, row_token, offsets, w13, h, gu, hidden, inter, experts, smem_raw);
}
#endif

#if FM_GEMM == 2
extern "C" __global__ void __launch_bounds__(fm::THREADS, FM_MIN_BLOCKS)
    moe_gemm2(const u16* __restrict__ hin, const u32* __restrict__ offsets,
              const u16* __restrict__ w2, float* __restrict__ y, int hidden, int inter,
              int experts) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    fm::grouped_gemm(hin, nullptr, offsets, w2, y, nullptr, inter, hidden, experts, smem_raw);
}
#endif
