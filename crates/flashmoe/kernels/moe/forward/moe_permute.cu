// flashmoe — MoE dropless permutation (see the contract in crates/flashmoe/src/moe/forward/abi.rs).
//
// Self-contained (no CUDA headers). One entry, `moe_permute`: grid E blocks of 256
// threads, block e handles expert e.
//   offsets [E + 1] u32: exclusive scan of counts (written by block 0, a serial loop over
//     E <= 256 values: exact, order-independent integers);
//   for expert e, rows offsets[e] .. offsets[e + 1] hold its slots in slot order (slot
//     t·k + s; a token picks distinct experts, so this is token order: stable):
//     row_token[r] = t, row_slot[r] = t·k + s, slot_row[t·k + s] = r.
// Each block scans the slots in chunks of 256 with a ballot/popc block prefix (integer,
// deterministic) and stops once it has placed counts[e] rows; an expert with no token
// returns at once. No atomics. Block 0 also finishes the router losses (moe_losses.cuh),
// which saves the layer a launch: losses [2] f32 from counts, prob_sum and lse_sq_sum.

typedef unsigned int u32;
typedef long long i64;

#include "moe_losses.cuh"

#define PERMUTE_THREADS 256
static_assert(PERMUTE_THREADS == FM_LOSS_THREADS, "block 0 finishes the losses");
#define PERMUTE_WARPS (PERMUTE_THREADS / 32)

extern "C" __global__ void __launch_bounds__(PERMUTE_THREADS)
moe_permute(const u32* __restrict__ topk_ids, const u32* __restrict__ counts,
            u32* __restrict__ offsets, u32* __restrict__ row_token, u32* __restrict__ row_slot,
            u32* __restrict__ slot_row, const float* __restrict__ prob_sum,
            const float* __restrict__ lse_sq_sum, float* __restrict__ losses, int tokens,
            int experts, int top_k) {
    __shared__ u32 warp_counts[PERMUTE_WARPS];
    __shared__ u32 base_s;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int e = blockIdx.x;
    if (e == 0) finish_router_losses(counts, prob_sum, lse_sq_sum, losses, tokens, experts, top_k);
    if (tid == 0) {
        u32 off = 0;
        for (int i = 0; i < experts; ++i) {
            if (i == e) base_s = off;
            if (e == 0) offsets[i] = off;
            off += counts[i];
        }
        if (e == 0) offsets[experts] = off;
    }
    __syncthreads();
    const u32 mine = counts[e];
    if (mine == 0) return;  // block-uniform
    const u32 base = base_s;
    const i64 n = (i64)tokens * top_k;
    u32 lanemask_lt;
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(lanemask_lt));
    u32 placed = 0;
    for (i64 c = 0; c < n && placed < mine; c += PERMUTE_THREADS) {
        const i64 i = c + tid;
        const bool flag = i < n && topk_ids[i] == (u32)e;
        const u32 ballot = __ballot_sync(0xffffffffu, flag);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        u32 before = 0, total = 0;
#pragma unroll
        for (int w = 0; w < PERMUTE_WARPS; ++w) {
            const u32 wc = warp_counts[w];
            before += w < warp ? wc : 0u;
            total += wc;
        }
        if (flag) {
            const u32 r = base + placed + before + __popc(ballot & lanemask_lt);
            row_token[r] = (u32)(i / top_k);
            row_slot[r] = (u32)i;
            slot_row[i] = r;
        }
        placed += total;
        __syncthreads();  // warp_counts is rewritten by the next chunk
    }
}

// x_perm[r] = x[row_token[r]] for every permuted row r: the sm_90 grouped GEMM
// (moe_gemm_sm90.cu) reads its A operand by TMA, which needs an expert's rows contiguous.
// grid = rows blocks of GATHER_THREADS; 16-byte copies (hidden a multiple of 8).
#define GATHER_THREADS 128

extern "C" __global__ void __launch_bounds__(GATHER_THREADS)
moe_gather_rows(const uint4* __restrict__ x, const u32* __restrict__ row_token,
                uint4* __restrict__ x_perm, int hidden) {
    const int chunks = hidden / 8;  // 16-byte chunks per row
    const i64 r = blockIdx.x;
    const uint4* src = x + (i64)row_token[r] * chunks;
    uint4* dst = x_perm + r * chunks;
    for (int c = threadIdx.x; c < chunks; c += GATHER_THREADS) dst[c] = src[c];
}
