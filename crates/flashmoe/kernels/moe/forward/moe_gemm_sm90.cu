// flashmoe — MoE grouped GEMMs, Hopper path (sm_90a only): TMA loads into a shared-memory
// ring guarded by mbarriers, one producer warpgroup, two consumer warpgroups on wgmma.
//
// Compiled at run time by NVRTC for sm_90a; self-contained. Defines (the table of
// variants and the shared-memory formula live in crates/flashmoe/src/moe/gemm/sm90.rs and
// must agree with the constants below):
//
//   FM_GEMM        13 = moe_gemm13_sm90 (gate+up, SwiGLU epilogue), 2 = moe_gemm2_sm90
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (A, B and h storage; accumulation is fp32)
//   FM_WG_M        consumer warpgroups stacked along M (1 or 2); the other 2 / FM_WG_M
//                  split the columns
//   FM_STAGES      depth of the TMA ring (2..6)
//   FM_GROUP_M     row tiles per raster group (L2 reuse of both operands, see below)
//   FM_B_KMAJOR    gemm2 only: 0 = B is [E][K][N] (N contiguous, the forward's weights),
//                  1 = B is [E][N][K] (K contiguous: the backward reads W2 and W13
//                  untransposed for dOut·W2ᵀ and dGU·W13ᵀ)
//
// Tile: BM = 64·WG_M rows. A consumer warpgroup owns 64 rows x NWG columns of each of the
// NB output matrices (gemm13: NB = 2, gate and up, NWG = 128; gemm2: NB = 1, NWG = 256),
// i.e. 128 fp32 accumulators per thread. BN = NWG·(2 / WG_M) columns per block per
// matrix. BK = 64 (one 128-byte swizzle row of A per k tile).
//
// ABI (host side: crates/flashmoe/src/moe/gemm/sm90.rs):
//   moe_gemm13_sm90(FmTensorMap a_map, FmTensorMap b_map, const u32* offsets, u16* h,
//                   u16* gu, int hidden, int inter, int experts, int row_tiles)
//     A = x_perm [rows][hidden] (rows gathered in permuted order by moe_gather_rows),
//     B = w13 [E][hidden][2·inter]; h[r, n] = silu(A_r . B[:, n]) * (A_r . B[:, inter + n]);
//     gu (null: not written) [rows][2·inter] 16-bit = the pre-activations A_r . B (gate |
//     up), kept for the backward instead of recomputing them
//   moe_gemm2_sm90(FmTensorMap a_map, FmTensorMap b_map, const u32* offsets, float* y,
//                  int n, int k, int experts, int row_tiles)
//     A [rows][k], B_e [k][n] (or [n][k] under FM_B_KMAJOR); y[r, j] = A_r . B_e[:, j]
//     (f32, row stride n). The forward: A = h, B = w2, n = hidden, k = inter; the
//     backward: gu = x_perm·W13, G = dOut_perm·W2ᵀ, dX_perm = dGU·W13ᵀ.
//   Tensor maps: A 2-D {K, rows}, box {64, BM}; B 3-D {N_total, K, E} (K-major:
//   {K, N, E}), box {64, 64, 1}; 16-bit elements, 128-byte swizzle, out-of-bounds elements
//   read as zero (so K needs no multiple of 64, a tile may run past the last row and the
//   last column tile past N: columns >= N are not stored).
//   grid.x = row_tiles · ceil(N / BN), row_tiles = ceil(rows / BM) + E (upper bound on
//   sum_e ceil(n_e / BM)); block = 384 threads.
//   Block b -> (row tile, column tile) in groups of GROUP_M row tiles: inside a group the
//   row tile varies fastest, so the blocks resident at one time share B column tiles
//   (same expert) and A row tiles (same rows) through L2. The row tile -> (expert, tile)
//   scan is moe_find_tile; surplus tiles exit before touching memory.
//
// Shared memory (dynamic): [align to 1024] STAGES x [A: BM x 128 B | B: NB·BN/64 boxes of
//   64 k x 128 B] | full[STAGES], empty[STAGES] mbarriers | scan scratch 256 B
//   bytes = STAGES·(BM·128 + NB·BN·128) + 1024 + 16·STAGES + 256.
//
// Pipeline: the producer (one thread) waits empty[s], arms full[s] with the stage's byte
// count and issues the TMA loads; each consumer warpgroup waits full[s], issues the
// stage's wgmmas, commits, waits until at most this group is pending (so the previous
// stage's wgmmas are done) and releases the previous stage. Epilogue straight from the
// accumulators; rows past the expert's rows are computed but never stored.

#ifndef FM_GEMM
#error "FM_GEMM must be 13 or 2"
#endif
#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"
#include "fm_sm90.cuh"
#include "moe_gemm_common.cuh"
#ifndef FM_WG_M
#define FM_WG_M 2
#endif
#ifndef FM_STAGES
#define FM_STAGES 4
#endif
#ifndef FM_GROUP_M
#define FM_GROUP_M 8
#endif
#ifndef FM_B_KMAJOR
#define FM_B_KMAJOR 0
#endif

namespace fm {

constexpr bool G13 = FM_GEMM == 13;
constexpr int NB = G13 ? 2 : 1;
constexpr int NWG = G13 ? 128 : 256;  // columns per consumer warpgroup per matrix
constexpr int NACC = NWG / 2;         // fp32 accumulators per thread per matrix
constexpr int WG_M = FM_WG_M;
constexpr int WG_N = 2 / WG_M;
constexpr int BM = 64 * WG_M;
constexpr int BN = NWG * WG_N;
constexpr int BK = 64;
constexpr int STAGES = FM_STAGES;
constexpr int GROUP_M = FM_GROUP_M;
constexpr int THREADS = 384;
constexpr int BOX_BYTES = 64 * 128;  // one B box: 64 k rows x 64 columns
constexpr int B_BOXES = NB * BN / 64;
constexpr int A_BYTES = BM * 128;
constexpr int STAGE_BYTES = A_BYTES + B_BOXES * BOX_BYTES;
constexpr int BAR_BYTES = 16 * STAGES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024 + BAR_BYTES + 256;

static_assert(FM_GEMM == 13 || FM_GEMM == 2, "FM_GEMM must be 13 or 2");
static_assert(WG_M == 1 || WG_M == 2, "FM_WG_M must be 1 or 2");
static_assert(STAGES >= 2 && STAGES <= 6, "FM_STAGES must be 2..6");
static_assert(GROUP_M >= 1, "FM_GROUP_M must be positive");
constexpr bool B_KMAJOR = FM_B_KMAJOR != 0;
static_assert(!B_KMAJOR || !G13, "FM_B_KMAJOR is a gemm2 variant");
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory over the sm_90 per-block limit");

struct Tile {
    int expert;
    u32 row0;   // first permuted row of the tile
    int nrows;  // rows of the expert inside the tile (<= BM)
    int n0;     // first output column (per matrix)
};

// Epilogue from the accumulators of consumer warpgroup c (thread tid of the block).
// gemm13: out = h [rows][N] 16-bit, silu(gate) * up, and gu [rows][2N] 16-bit (gate |
// up) when not null; gemm2: out = y [rows][N] f32.
// N is a multiple of 8 and col even, so a pair at col + 8j < N lies wholly inside.
__device__ __forceinline__ void store_tile(void* out, u16* gu, int N, const Tile& tile,
                                           const float (&acc)[NB][NACC], int tid) {
    const int c = (tid >> 7) - 1;
    const int wm = c % WG_M, wn = c / WG_M;
    const int w = (tid >> 5) & 3, l = tid & 31;
    const int col = tile.n0 + wn * NWG + 2 * (l & 3);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = wm * 64 + w * 16 + (l >> 2) + 8 * hh;
        if (r < tile.nrows) {
            const i64 off = (i64)(tile.row0 + r) * N + col;
#pragma unroll
            for (int j = 0; j < NWG / 8; ++j) {
                const int i = 4 * j + 2 * hh;
                if (col + 8 * j < N) {
#if FM_GEMM == 13
                    st_global_u32(static_cast<u16*>(out) + off + 8 * j,
                                  pack2(swiglu(acc[0][i], acc[1][i]),
                                        swiglu(acc[0][i + 1], acc[1][i + 1])));
                    if (gu != nullptr) {
                        u16* g = gu + (i64)(tile.row0 + r) * 2 * N + col + 8 * j;
                        st_global_u32(g, pack2(acc[0][i], acc[0][i + 1]));
                        st_global_u32(g + N, pack2(acc[1][i], acc[1][i + 1]));
                    }
#else
                    st_global_f32x2(static_cast<float*>(out) + off + 8 * j, acc[0][i],
                                    acc[0][i + 1]);
#endif
                }
            }
        }
    }
}

// The whole block: schedule, barrier setup, then the producer / consumer roles (one
// branch each, as setmaxnreg requires). K = reduction depth, N = output columns per matrix.
__device__ __forceinline__ void gemm_block(const FmTensorMap* a_map, const FmTensorMap* b_map,
                                           const u32* __restrict__ offsets, void* out, u16* gu,
                                           int K, int N, int experts, int row_tiles,
                                           unsigned char* smem_raw) {
    const int tid = threadIdx.x;
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 bars = base + STAGES * STAGE_BYTES;  // full[s] at bars + 8s, empty at + 8(S+s)
    u32* scratch = reinterpret_cast<u32*>(smem_raw + (bars - raw) + BAR_BYTES);

    // raster: groups of GROUP_M row tiles, row tile fastest inside a group
    const u32 n_tiles = (u32)((N + BN - 1) / BN);
    const u32 per_group = (u32)GROUP_M * n_tiles;
    const u32 g = blockIdx.x / per_group;
    const u32 first = g * GROUP_M;
    const u32 gm = min((u32)GROUP_M, (u32)row_tiles - first);
    const u32 local = blockIdx.x - g * per_group;
    const u32 t = first + local % gm;
    const u32 ny = local / gm;

    int e, et;
    if (!moe_find_tile<BM, THREADS>(offsets, experts, scratch, tid, t, e, et)) return;
    Tile tile;
    tile.expert = e;
    tile.row0 = offsets[e] + (u32)et * BM;
    tile.nrows = min(BM, (int)(offsets[e + 1] - tile.row0));
    tile.n0 = (int)ny * BN;

    if (tid == 0) mbar_init_ring(bars, STAGES, 2);  // one release per consumer warpgroup
    __syncthreads();

    const int ktiles = (K + BK - 1) / BK;
    if (tid < 128) {
        // producer warpgroup: one thread issues every load
        setmaxnreg_dec<40>();
        if (tid == 0) {
            tma_prefetch_desc(a_map);
            tma_prefetch_desc(b_map);
            for (int kt = 0; kt < ktiles; ++kt) {
                const int s = kt % STAGES;
                const u32 ph = (u32)(kt / STAGES) & 1u;
                const u32 full = bars + 8 * s;
                mbar_wait(bars + 8 * (STAGES + s), ph ^ 1u);
                mbar_arrive_expect_tx(full, STAGE_BYTES);
                const u32 st = base + s * STAGE_BYTES;
                tma_load_2d(st, a_map, full, kt * BK, (int)tile.row0);
#pragma unroll
                for (int b = 0; b < NB; ++b)
#pragma unroll
                    for (int j = 0; j < BN / 64; ++j) {
                        const u32 dst = st + A_BYTES + (b * (BN / 64) + j) * BOX_BYTES;
                        if constexpr (B_KMAJOR)  // 64 n rows of 64 k: like A's rows
                            tma_load_3d(dst, b_map, full, kt * BK, tile.n0 + j * 64, e);
                        else  // 64 k rows of 64 n
                            tma_load_3d(dst, b_map, full, b * N + tile.n0 + j * 64, kt * BK, e);
                    }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int c = (tid >> 7) - 1;  // consumer warpgroup 0 / 1
        const int wm = c % WG_M;
        const int wn = c / WG_M;
        float acc[NB][NACC];
#pragma unroll
        for (int b = 0; b < NB; ++b)
#pragma unroll
            for (int i = 0; i < NACC; ++i) acc[b][i] = 0.f;
        for (int kt = 0; kt < ktiles; ++kt) {
            const int s = kt % STAGES;
            mbar_wait(bars + 8 * s, (u32)(kt / STAGES) & 1u);
            const u32 st = base + s * STAGE_BYTES;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                const u64 da = smem_desc_sw128(st + wm * 64 * 128 + kk * 32, 16, 1024);
#pragma unroll
                for (int b = 0; b < NB; ++b) {
                    const u32 box = st + A_BYTES + (b * (BN / 64) + wn * (NWG / 64)) * BOX_BYTES;
                    if constexpr (B_KMAJOR)  // NWG rows of 128 B, k16 step = 32 B, as A
                        wgmma_ss<0, 0>(acc[b], da, smem_desc_sw128(box + kk * 32, 16, 1024), 1);
                    else  // 16 k rows per step; the 64-column boxes BOX_BYTES apart
                        wgmma_ss<0, 1>(acc[b], da,
                                       smem_desc_sw128(box + kk * 2048, BOX_BYTES, 1024), 1);
                }
            }
            wgmma_commit();
            wgmma_wait<1>();  // the previous k tile's wgmmas are done: release its stage
            if (kt > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + (kt - 1) % STAGES));
        }
        wgmma_wait<0>();
#pragma unroll
        for (int b = 0; b < NB; ++b) reg_fence(acc[b]);
        store_tile(out, gu, N, tile, acc, tid);
    }
}

}  // namespace fm

#if FM_GEMM == 13
extern "C" __global__ void __launch_bounds__(fm::THREADS, 1)
    moe_gemm13_sm90(const __grid_constant__ FmTensorMap a_map,
                    const __grid_constant__ FmTensorMap b_map, const u32* __restrict__ offsets,
                    u16* __restrict__ h, u16* __restrict__ gu, int hidden, int inter,
                    int experts, int row_tiles) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    fm::gemm_block(&a_map, &b_map, offsets, h, gu, hidden, inter, experts, row_tiles, smem_raw);
}
#endif

#if FM_GEMM == 2
extern "C" __global__ void __launch_bounds__(fm::THREADS, 1)
    moe_gemm2_sm90(const __grid_constant__ FmTensorMap a_map,
                   const __grid_constant__ FmTensorMap b_map, const u32* __restrict__ offsets,
                   float* __restrict__ y, int n, int k, int experts, int row_tiles) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    fm::gemm_block(&a_map, &b_map, offsets, y, nullptr, k, n, experts, row_tiles, smem_raw);
}
#endif
