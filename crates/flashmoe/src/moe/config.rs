//! MoE kernels: variants, launch geometry, and the CONTRACT between `kernels/moe_*.cu` and
//! the launcher (`moe/mod.rs`). Keep both sides in agreement.
//!
//! Device data (row-major, 16-bit elements are fp16 or bf16 per FM_DTYPE_BF16):
//! x [T, H], router [H, E], w13 [E, H, 2I] (columns [0, I) gate, [I, 2I) up),
//! w2 [E, I, H], out [T, H]. T tokens, H hidden, I intermediate, E experts, k = top_k.
//!
//! Pipeline (one stream, all deterministic: no floating-point atomics):
//! 1. `moe_router_logits` (kernels/moe_router.cu): logits [T, E] f32 = x · router, fp32
//!    accumulation.
//! 2. `moe_router_topk` (moe_router.cu): per token, scores = softmax(logits) or
//!    sigmoid(logits); top-k by score, ties → lower expert index, ids in descending score
//!    order → topk_ids [T, k] u32; weights = selected scores, renormalised to sum 1 when
//!    FM_RENORM=1 → topk_w [T, k] f32; probs [T, E] f32 (softmax probabilities, or sigmoid
//!    scores normalised to sum 1 per token, for the aux loss); lse [T] f32 (logsumexp of
//!    the logits, for the z-loss).
//! 3. `moe_expert_stats` (moe_router.cu): per expert e (one block each, fixed-order
//!    reductions): counts[e] (u32) = slots routed to e; prob_sum[e] (f32) = Σ_t probs[t, e].
//!    z-loss and aux loss are finished on the host from these small arrays (or a tiny
//!    kernel): aux = E · Σ_e (counts[e] / (T·k)) · (prob_sum[e] / T); z = mean_t lse[t]².
//! 4. `moe_permute` (kernels/moe_permute.cu): offsets [E + 1] u32 = exclusive scan of
//!    counts (single block); row_token [T·k] u32 and row_slot [T·k] u32: for permuted row r
//!    of expert e (rows offsets[e]..offsets[e+1]), the token and its slot index (t·k + s),
//!    stable (token order within an expert); slot_row [T·k] u32 = inverse map.
//! 5. `moe_gemm13` (kernels/moe_grouped_gemm.cu): for every expert e with rows, for its
//!    permuted rows r: g = x[row_token[r]] · w13[e][:, 0:I], u = x[row_token[r]] ·
//!    w13[e][:, I:2I], h[r] = silu(g) · u, fp32 accumulation, h [T·k, I] stored 16-bit.
//!    Parameters: (const u16* x, const u32* row_token, const u32* offsets, const u16* w13,
//!    u16* h, int hidden, int inter, int experts). Experts with no rows read no weights.
//! 6. `moe_gemm2` (moe_grouped_gemm.cu): y[r] = h[r] · w2[e], fp32 accumulation, y [T·k, H]
//!    f32. Parameters: (const u16* h, const u32* offsets, const u16* w2, float* y,
//!    int hidden, int inter, int experts).
//!    Both GEMMs: grid.x = ceil(T·k / block_m) + E (an upper bound on Σ_e ceil(n_e /
//!    block_m): each block finds its (expert, row tile) by walking `offsets`; surplus blocks
//!    exit), grid.y = N / block_n (N = I for gemm13 — each block computes the gate AND up
//!    column tiles for its n range — and H for gemm2); block = block_threads; dynamic
//!    shared memory = shared_mem_bytes.
//! 7. `moe_combine` (kernels/moe_combine.cu): out[t] = Σ_{s<k} topk_w[t, s] ·
//!    y[slot_row[t·k + s]] in slot order (+ shared-expert output when present), written
//!    16-bit. Deterministic.

use crate::error::{Error, Result};
use crate::problem::MoeProblem;

/// One compiled kernel and how to launch it (same shape as the attention variants).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeKernel {
    pub source_file: &'static str,
    pub entry: &'static str,
    pub defines: Vec<(String, String)>,
    /// Rows per block for the grouped GEMMs (1 for the other kernels).
    pub block_m: u32,
    /// Output columns per block for the grouped GEMMs.
    pub block_n: u32,
    pub block_threads: u32,
    pub shared_mem_bytes: u32,
    pub min_arch: u32,
}

/// Every kernel the MoE forward of `problem` needs, in pipeline order, or
/// `Error::Unsupported` naming the shape constraint that fails (e.g. intermediate not a
/// multiple of the GEMM tile).
pub fn select(_problem: &MoeProblem) -> Result<Vec<MoeKernel>> {
    Err(Error::unsupported(
        "flashmoe-moe",
        "MoE kernels are not defined yet",
    ))
}

/// Every variant that can be selected (for the compile-everything test).
pub fn all_variants() -> Vec<MoeKernel> {
    Vec::new()
}
