//! The MoE forward's kernel ABI: the CONTRACT between `kernels/moe/forward/moe_*.cu` (and
//! the GEMM kernels of [`crate::moe::gemm`]) and the launchers. Keep both sides in agreement.
//!
//! Device data (row-major, 16-bit elements are fp16 or bf16 per FM_DTYPE_BF16):
//! x [T, H], router [H, E], w13 [E, H, 2I] (columns [0, I) gate, [I, 2I) up),
//! w2 [E, I, H], out [T, H]. T tokens, H hidden, I intermediate, E experts, k = top_k.
//!
//! Pipeline (one stream, all deterministic: no floating-point atomics):
//! 1. Router logits [T, E] f32 = x · router, fp32 accumulation. When E is a multiple of
//!    32: `moe_gemm2` of step 6 as a one-group GEMM on tensor cores (A = x with K = H,
//!    offsets = [0, T], B = router [H, E], y = logits; tile from
//!    [`crate::moe::gemm::tiles::router_logits_tile`], launched like step 6 with T rows, one
//!    expert and N = E), a fixed mma summation order. Otherwise the CUDA-core kernels:
//!    `moe_router_logits` (kernels/moe/forward/moe_router.cu), one fmaf chain per (t, e) over h
//!    ascending. Parameters: (const u16* x,
//!    const u16* router, float* logits, int tokens, int hidden, int experts). Defines
//!    FM_DTYPE_BF16. Block 256 threads = (256 / EPAD) token groups × EPAD experts
//!    (EPAD = E rounded up to 32), 4 tokens per thread: grid.x = ceil(T / (4·256/EPAD)).
//!    Few tokens (that grid below [`SMALL_LOGITS_MAX_TILED_BLOCKS`](super::select::SMALL_LOGITS_MAX_TILED_BLOCKS) blocks):
//!    `moe_router_logits_small` instead, same parameters and the same fmaf chain (so
//!    bit-identical logits), one thread per (t, e): grid.x = ceil(T·E / 256).
//! 2. `moe_router_topk` (moe_router.cu): per token, scores = softmax(logits) or
//!    sigmoid(logits); top-k by score, ties → lower expert index, ids in descending score
//!    order → topk_ids [T, k] u32; weights = selected scores, renormalised to sum 1 when
//!    FM_RENORM=1 → topk_w [T, k] f32; probs [T, E] f32 (softmax probabilities, or sigmoid
//!    scores normalised to sum 1 per token, for the aux loss); lse \[T\] f32 (logsumexp of
//!    the logits, for the z-loss). Parameters: (const float* logits, u32* topk_ids,
//!    float* topk_w, float* probs, float* lse, int tokens, int experts, int top_k).
//!    Defines FM_SIGMOID (0/1), FM_RENORM (0/1). One warp per token, 128 threads:
//!    grid.x = ceil(T / 4). Ranking is by logit (monotonic in either score; avoids ties
//!    made by rounding exp/sigmoid in fp32), total order of the IEEE bits, ties → lower
//!    index. The references rank f64 scores of their own logits: two experts whose
//!    logits differ by less than fp32 rounding can be ordered differently; the check
//!    accepts such a slot as a near tie (`reference::moe::compare_routing`, logits within
//!    1e-4 of the token's largest |logit|) and fails any other difference.
//! 3. `moe_expert_stats` (moe_router.cu): per expert e (one block each, fixed-order
//!    reductions): counts\[e\] (u32) = slots routed to e; prob_sum\[e\] (f32) = Σ_t probs\[t, e\].
//!    Grid E + 1 blocks of 256 threads: block E computes lse_sq_sum\[0\] (f32) = Σ_t lse\[t\]².
//!    Per-thread strided f64 sums, fixed shared-memory tree. Parameters: (const u32*
//!    topk_ids, const float* probs, const float* lse, u32* counts, float* prob_sum,
//!    float* lse_sq_sum, int tokens, int experts, int top_k).
//!    3b. The losses are finished on the device, so that no host sync is needed: losses
//!    \[2\] f32 = (aux, z), aux = E · Σ_e (counts\[e\] / (T·k)) · (prob_sum\[e\] / T),
//!    z = lse_sq_sum / T, per-expert terms in f64 summed by a fixed shared-memory tree
//!    (kernels/moe/forward/moe_losses.cuh). In the full layer block 0 of `moe_permute` (step 4) does
//!    it, which costs no launch; the router-only stage (timed alone by the lab) launches
//!    `moe_router_losses` (moe_router.cu: (const u32* counts, const float* prob_sum,
//!    const float* lse_sq_sum, float* losses, int tokens, int experts, int top_k), one
//!    block of [`LOSSES_THREADS`] threads), the same code and bits. Not among
//!    [`select`](super::select::select)'s seven (it has no variants): [`losses_kernel`](super::select::losses_kernel). The lab's check also
//!    finishes them on the host in f64 from the same arrays (`MoeRunner::gpu_routing`).
//! 4. `moe_permute` (kernels/moe/forward/moe_permute.cu): offsets [E + 1] u32 = exclusive scan of
//!    counts (single block); row_token [T·k] u32 and row_slot [T·k] u32: for permuted row r
//!    of expert e (rows offsets\[e\]..offsets\[e+1\]), the token and its slot index (t·k + s),
//!    stable (token order within an expert); slot_row [T·k] u32 = inverse map.
//!    No padding: rows = T·k exactly. Parameters: (const u32* topk_ids, const u32* counts,
//!    u32* offsets, u32* row_token, u32* row_slot, u32* slot_row, const float* prob_sum,
//!    const float* lse_sq_sum, float* losses, int tokens, int experts, int top_k). Grid E
//!    blocks of 256 threads (block e places expert e's rows with a ballot prefix; block 0
//!    also writes offsets and the losses of step 3b). No atomics.
//! 5. `moe_gemm13` (kernels/moe/forward/moe_grouped_gemm.cu): for every expert e with rows, for its
//!    permuted rows r: g = x[row_token\[r\]] · w13\[e\]\[:, 0:I\], u = x[row_token\[r\]] ·
//!    w13\[e\]\[:, I:2I\], h\[r\] = silu(g) · u, fp32 accumulation, h \[T·k, I\] stored 16-bit;
//!    gu \[T·k, 2I\] 16-bit = (g | u) when not null (`MoeArgs::gate_up`, kept for the
//!    backward). Parameters: (const u16* x, const u32* row_token, const u32* offsets,
//!    const u16* w13, u16* h, u16* gu, int hidden, int inter, int experts). Experts with no
//!    rows read no weights. The sm_90 variant (`crate::moe::gemm::sm90`) writes the same h
//!    and gu.
//! 6. `moe_gemm2` (moe_grouped_gemm.cu): y\[r\] = h\[r\] · w2\[e\], fp32 accumulation, y \[T·k, H\]
//!    f32. Parameters: (const u16* h, const u32* offsets, const u16* w2, float* y,
//!    int hidden, int inter, int experts).
//!    Both GEMMs: grid.x = ceil(T·k / block_m) + E (an upper bound on Σ_e ceil(n_e /
//!    block_m): each block finds its (expert, row tile) by walking `offsets`; surplus blocks
//!    exit), grid.y = N / block_n (N = I for gemm13 — each block computes the gate AND up
//!    column tiles for its n range — and H for gemm2); block = block_threads; dynamic
//!    shared memory = shared_mem_bytes.
//! 7. `moe_combine` (kernels/moe/forward/moe_combine.cu): out\[t\] = Σ_{s<k} topk_w\[t, s\] ·
//!    y[slot_row[t·k + s]] in slot order (+ shared-expert output when present), written
//!    16-bit. Deterministic. Parameters: (const float* y, const u32* slot_row,
//!    const float* topk_w, const float* shared_y, u16* out, int tokens, int hidden,
//!    int top_k); shared_y [T, H] f32 is read only when FM_SHARED=1 (else any valid
//!    pointer). Defines FM_DTYPE_BF16, FM_SHARED. Grid T blocks of 256 threads.
//!
//! Shared expert (FM_SHARED=1): run as a one-expert group of all tokens through the SAME
//! grouped GEMM kernels: row_token = [0, T), offsets = [0, T], experts = 1, weights
//! shared_w13 [H, 2I] and shared_w2 [I, H] → h_shared [T, I], shared_y [T, H] f32.
//!
//! Limits (Unsupported otherwise, naming the value): E ≤ 256, k ≤ 8, T·k ≤ 2^31 − 1,
//! H and I ≤ 2^31 − 1, dtype f16 or bf16. All element offsets are computed in 64 bits.

pub use crate::moe::kernel::{BACKEND, PERMUTE_SOURCE};

pub const ROUTER_SOURCE: &str = "moe_router.cu";
pub const COMBINE_SOURCE: &str = "moe_combine.cu";
pub const LOGITS_ENTRY: &str = "moe_router_logits";
pub const LOGITS_SMALL_ENTRY: &str = "moe_router_logits_small";
pub const TOPK_ENTRY: &str = "moe_router_topk";
pub const STATS_ENTRY: &str = "moe_expert_stats";
pub const PERMUTE_ENTRY: &str = "moe_permute";
pub const GEMM13_ENTRY: &str = "moe_gemm13";
pub const GEMM2_ENTRY: &str = "moe_gemm2";
pub const COMBINE_ENTRY: &str = "moe_combine";
pub const LOSSES_ENTRY: &str = "moe_router_losses";

/// Largest expert count (the top-k kernel holds 8 logits per lane of one warp).
pub const MAX_EXPERTS: usize = 256;
/// Largest top_k (selected weights are kept in registers).
pub const MAX_TOP_K: usize = 8;
/// Threads per block of the router / stats / permute / combine kernels (mirrors the .cu).
pub const LOGITS_THREADS: u32 = 256;
pub const LOGITS_TOKENS_PER_THREAD: u32 = 4;
pub const TOPK_THREADS: u32 = 128;
pub const STATS_THREADS: u32 = 256;
pub const PERMUTE_THREADS: u32 = 256;
pub const COMBINE_THREADS: u32 = 256;
/// One thread per expert slot (FM_MAX_EXPERTS in the .cu).
pub const LOSSES_THREADS: u32 = MAX_EXPERTS as u32;
/// Largest value passed as a kernel `int` (and grid.x of the combine).
pub const MAX_INT: usize = i32::MAX as usize;
