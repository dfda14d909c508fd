// flashmoe — MoE backward weight gradients, Hopper path (sm_90a only): per expert e,
//   dW[e][m][n] = sum over the expert's rows r of A[r][m] · B[r][n]
// (dW2 = (w⊙H)ᵀ·dOut_perm: A = w⊙h [R][I], B = dOut_perm [R][H]; dW13 = X_permᵀ·dGU:
// A = x_perm [R][H], B = dGU [R][2I]), K = the expert's rows, written once in 16 bits.
//
// Compiled at run time by NVRTC for sm_90a; self-contained. Defines (the host side and the
// shared-memory formula live in crates/flashmoe/src/moe/backward/sm90.rs):
//   FM_DTYPE_BF16  0 = fp16, 1 = bf16 (A, B and dW; accumulation is fp32)
//   FM_STAGES      depth of the TMA ring (2..3)
//   FM_OUT_BUFS    16-bit output buffers per consumer warpgroup (1 or 2): with 2, tile i
//                  stages into buffer i % 2 and waits only for the store of tile i - 2
//                  to have read it, so two tiles' stores are in flight (2 stages only:
//                  shared memory)
//
// Tile: BM = 128 rows of dW (two consumer warpgroups of 64) × BN = 256 columns, 128 fp32
// accumulators per thread; BK = 64 of the expert's rows per ring stage. Both operands lie
// MN-major in memory ([rows][m] and [rows][n], m / n contiguous), so a stage holds 64-wide
// boxes of 64 k-rows × 128 B (128-byte swizzle) and wgmma reads A transposed (tnspA) and B
// as the forward's B (tnspB).
//
// ABI (host side: crates/flashmoe/src/moe/backward/sm90.rs):
//   moe_wgrad_sm90(FmTensorMap a_map, FmTensorMap b_map, FmTensorMap dw_map,
//                  const u32* offsets, int m_dim, int n_dim, int experts, int tiles)
//   Tensor maps: A 2-D {M, R}, B 2-D {N, R}, dW 3-D {N, M, E} ([E][M][N]), box {64, 64}
//   ({64, 64, 1}), 16-bit, 128-byte swizzle; loads read out-of-bounds elements as zero,
//   stores skip them. M, N multiples of 8.
//   tiles = E · ceil(M / BM) · ceil(N / BN); grid.x <= tiles (persistent: block b takes
//   tiles b, b + gridDim.x, ...); block = 384 threads.
//
// An expert's rows start anywhere (offsets[e], no padding): its last stage also holds the
// next expert's first rows, which the consumers zero in shared memory (whole 128-byte
// rows, so the swizzle does not matter) before the stage's wgmmas. Experts without rows
// get zero gradients. Each dW element is summed by one block in row order: deterministic.
//
// Pipeline: as moe_gemm_sm90.cu (one producer thread, full/empty mbarriers per stage), with
// the ring's position carried across a block's tiles, so the producer loads the next
// tile's first stages while the consumers store the last one. Epilogue: each consumer
// warpgroup writes its 64 × 256 tile in 16 bits to its own shared-memory buffer (four
// 128-byte-swizzled boxes, conflict-free) and one thread stores it by TMA; the buffer is
// reused once that store has read it, so the writes to HBM run under the next tile (at
// ~128 rows per expert the kernel is bound by writing dW, 2 bytes per 256 FLOPs); with
// FM_OUT_BUFS 2 under the next two.

#ifndef FM_DTYPE_BF16
#define FM_DTYPE_BF16 1
#endif
#include "fm_ptx.cuh"
#include "fm_sm90.cuh"
#include "moe_gemm_common.cuh"
#ifndef FM_STAGES
#define FM_STAGES 3
#endif
#ifndef FM_OUT_BUFS
#define FM_OUT_BUFS 1
#endif

namespace fm {

constexpr int BM = 128;
constexpr int BN = 256;
constexpr int NWG = BN;            // each consumer warpgroup: 64 rows x all BN columns
constexpr int NACC = NWG / 2;      // fp32 accumulators per thread
constexpr int BK = 64;
constexpr int STAGES = FM_STAGES;
constexpr int THREADS = 384;
constexpr int BOX_BYTES = 64 * 128;  // 64 k-rows x 64 elements
constexpr int A_BOXES = BM / 64;
constexpr int B_BOXES = BN / 64;
constexpr int A_BYTES = A_BOXES * BOX_BYTES;
constexpr int STAGE_BYTES = (A_BOXES + B_BOXES) * BOX_BYTES;
constexpr int OUT_BYTES = 64 * BN * 2;  // one consumer warpgroup's 16-bit tile
constexpr int OUT_BUFS = FM_OUT_BUFS;    // of them per consumer warpgroup
constexpr int BAR_BYTES = 16 * STAGES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 2 * OUT_BUFS * OUT_BYTES + 1024 + BAR_BYTES;
static_assert(OUT_BUFS == 1 || OUT_BUFS == 2, "FM_OUT_BUFS must be 1 or 2");
constexpr int ZERO_BAR = 1;  // named barrier of the 256 consumer threads
constexpr int OUT_BAR = 2;   // + wm: named barrier of consumer warpgroup wm

static_assert(STAGES >= 2 && STAGES <= 3, "FM_STAGES must be 2..3");
static_assert(SMEM_BYTES <= 227 * 1024, "shared memory over the sm_90 per-block limit");

struct WTile {
    int e, m0, n0;
    u32 row0;  // the expert's first permuted row
    int rows;  // its row count
};

__device__ __forceinline__ WTile wtile(u32 t, const u32* __restrict__ offsets, int mt, int nt) {
    WTile w;
    const u32 per_e = (u32)(mt * nt);
    w.e = (int)(t / per_e);
    const u32 in_e = t - (u32)w.e * per_e;
    w.m0 = (int)(in_e % (u32)mt) * BM;  // m fastest: neighbours share B's column tile
    w.n0 = (int)(in_e / (u32)mt) * BN;
    w.row0 = offsets[w.e];
    w.rows = (int)(offsets[w.e + 1] - w.row0);
    return w;
}

// Zero k-rows [valid, 64) of every box of the stage at `st` (consumer thread c of 256).
__device__ __forceinline__ void zero_tail(u32 st, int valid, int c) {
    const int per_box = (64 - valid) * 8;  // 16-byte chunks
    const int total = (A_BOXES + B_BOXES) * per_box;
    for (int i = c; i < total; i += 256) {
        const int box = i / per_box;
        const u32 addr = st + box * BOX_BYTES + valid * 128 + (i - box * per_box) * 16;
        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0u) : "memory");
    }
}

// dW tile from the accumulators of consumer warpgroup wm (thread tid): into its buffer
// `out` as four boxes of 64 rows × 64 columns (128-byte rows, 16-byte chunk c of row r at
// c ^ (r % 8): TMA's 128-byte swizzle), then one TMA store per box inside [M) × [N).
__device__ __forceinline__ void store_wtile(const FmTensorMap* dw_map, u32 out, int M, int N,
                                            const WTile& w, const float (&acc)[NACC], int wm,
                                            int tid) {
    const int wp = (tid >> 5) & 3, l = tid & 31;
    const bool leader = (tid & 127) == 0;
    // The store that last used this buffer (OUT_BUFS tiles ago) has read it; later ones may
    // still run.
    if (leader) bulk_wait_read<OUT_BUFS - 1>();
    named_bar_sync(OUT_BAR + wm, 128);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int r = wp * 16 + (l >> 2) + 8 * hh;
#pragma unroll
        for (int j = 0; j < NWG / 8; ++j) {
            const int i = 4 * j + 2 * hh;
            const u32 addr = out + (j / 8) * BOX_BYTES + r * 128 + (((j % 8) ^ (r % 8)) * 16) +
                             4 * (l & 3);
            st_shared_u32(addr, pack2(acc[i], acc[i + 1]));
        }
    }
    fence_proxy_async_smem();
    named_bar_sync(OUT_BAR + wm, 128);
    const int m = w.m0 + wm * 64;
    if (leader) {
        if (m < M) {
#pragma unroll
            for (int b = 0; b < BN / 64; ++b)
                if (w.n0 + b * 64 < N) tma_store_3d(dw_map, out + b * BOX_BYTES, w.n0 + b * 64, m, w.e);
        }
        // One group a tile, empty past M: the wait above counts groups as tiles.
        bulk_commit();
    }
}

}  // namespace fm

extern "C" __global__ void __launch_bounds__(fm::THREADS, 1)
    moe_wgrad_sm90(const __grid_constant__ FmTensorMap a_map,
                   const __grid_constant__ FmTensorMap b_map,
                   const __grid_constant__ FmTensorMap dw_map, const u32* __restrict__ offsets,
                   int m_dim, int n_dim, int experts, int tiles) {
    using namespace fm;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const int tid = threadIdx.x;
    const u32 raw = smem_addr(smem_raw);
    const u32 base = (raw + 1023u) & ~1023u;
    const u32 outs = base + STAGES * STAGE_BYTES;  // the consumers' tile buffers
    const u32 bars = outs + 2 * OUT_BUFS * OUT_BYTES;  // full[s] at bars + 8s, empty at + 8(S+s)
    const int mt = (m_dim + BM - 1) / BM;
    const int nt = (n_dim + BN - 1) / BN;

    if (tid == 0) mbar_init_ring(bars, STAGES, 2);  // one release per consumer warpgroup
    __syncthreads();

    if (tid < 128) {
        setmaxnreg_dec<40>();
        if (tid == 0) {
            tma_prefetch_desc(&a_map);
            tma_prefetch_desc(&b_map);
            tma_prefetch_desc(&dw_map);
            u32 it = 0;
            for (u32 t = blockIdx.x; t < (u32)tiles; t += gridDim.x) {
                const WTile w = wtile(t, offsets, mt, nt);
                const int kts = (w.rows + BK - 1) / BK;
                for (int kt = 0; kt < kts; ++kt, ++it) {
                    const int s = (int)(it % STAGES);
                    const u32 ph = (it / STAGES) & 1u;
                    const u32 full = bars + 8 * s;
                    mbar_wait(bars + 8 * (STAGES + s), ph ^ 1u);
                    mbar_arrive_expect_tx(full, STAGE_BYTES);
                    const u32 st = base + s * STAGE_BYTES;
                    const int r = (int)w.row0 + kt * BK;
#pragma unroll
                    for (int j = 0; j < A_BOXES; ++j)
                        tma_load_2d(st + j * BOX_BYTES, &a_map, full, w.m0 + j * 64, r);
#pragma unroll
                    for (int j = 0; j < B_BOXES; ++j)
                        tma_load_2d(st + A_BYTES + j * BOX_BYTES, &b_map, full, w.n0 + j * 64, r);
                }
            }
        }
    } else {
        setmaxnreg_inc<232>();
        const int wm = (tid >> 7) - 1;  // consumer warpgroup: rows wm*64.. of the tile
        u32 it = 0, tile_n = 0;  // stages consumed; tiles stored by this block
        float acc[NACC];
        for (u32 t = blockIdx.x; t < (u32)tiles; t += gridDim.x, ++tile_n) {
            const WTile w = wtile(t, offsets, mt, nt);
            const int kts = (w.rows + BK - 1) / BK;
#pragma unroll
            for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
            for (int kt = 0; kt < kts; ++kt, ++it) {
                const int s = (int)(it % STAGES);
                mbar_wait(bars + 8 * s, (it / STAGES) & 1u);
                const u32 st = base + s * STAGE_BYTES;
                const int valid = w.rows - kt * BK;
                if (valid < BK) {  // the next expert's rows: zero them (both warpgroups)
                    zero_tail(st, valid, tid - 128);
                    fence_proxy_async_smem();
                    named_bar_sync(ZERO_BAR, 256);
                }
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BK / 16; ++kk) {
                    const u64 da = smem_desc_sw128(st + wm * BOX_BYTES + kk * 2048, BOX_BYTES, 1024);
                    const u64 db = smem_desc_sw128(st + A_BYTES + kk * 2048, BOX_BYTES, 1024);
                    wgmma_ss<1, 1>(acc, da, db, 1);
                }
                wgmma_commit();
                wgmma_wait<1>();  // the previous stage's wgmmas are done: release it
                if (kt > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
            }
            wgmma_wait<0>();
            if (kts > 0 && (tid & 127) == 0) mbar_arrive(bars + 8 * (STAGES + (it - 1) % STAGES));
            reg_fence(acc);
            const u32 buf = outs + (wm * OUT_BUFS + (int)(tile_n % OUT_BUFS)) * OUT_BYTES;
            store_wtile(&dw_map, buf, m_dim, n_dim, w, acc, wm, tid);
        }
        if ((tid & 127) == 0) bulk_wait<0>();  // the last stores are done before the exit
    }
}
