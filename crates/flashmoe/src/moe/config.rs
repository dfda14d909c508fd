//! MoE kernels: variants, launch geometry, and the CONTRACT between `kernels/moe/*/moe_*.cu` and
//! the launcher (`moe/mod.rs`). Keep both sides in agreement.
//!
//! Device data (row-major, 16-bit elements are fp16 or bf16 per FM_DTYPE_BF16):
//! x [T, H], router [H, E], w13 [E, H, 2I] (columns [0, I) gate, [I, 2I) up),
//! w2 [E, I, H], out [T, H]. T tokens, H hidden, I intermediate, E experts, k = top_k.
//!
//! Pipeline (one stream, all deterministic: no floating-point atomics):
//! 1. Router logits [T, E] f32 = x · router, fp32 accumulation. When E is a multiple of
//!    32: `moe_gemm2` of step 6 as a one-group GEMM on tensor cores (A = x with K = H,
//!    offsets = [0, T], B = router [H, E], y = logits; tile from
//!    [`super::gemm_config::router_logits_tile`], launched like step 6 with T rows, one
//!    expert and N = E), a fixed mma summation order. Otherwise the CUDA-core kernels:
//!    `moe_router_logits` (kernels/moe/forward/moe_router.cu), one fmaf chain per (t, e) over h
//!    ascending. Parameters: (const u16* x,
//!    const u16* router, float* logits, int tokens, int hidden, int experts). Defines
//!    FM_DTYPE_BF16. Block 256 threads = (256 / EPAD) token groups × EPAD experts
//!    (EPAD = E rounded up to 32), 4 tokens per thread: grid.x = ceil(T / (4·256/EPAD)).
//!    Few tokens (that grid below [`SMALL_LOGITS_MAX_TILED_BLOCKS`] blocks):
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
//!    [`select`]'s seven (it has no variants): [`losses_kernel`]. The lab's check also
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
//!    w13\[e\]\[:, I:2I\], h\[r\] = silu(g) · u, fp32 accumulation, h \[T·k, I\] stored 16-bit.
//!    Parameters: (const u16* x, const u32* row_token, const u32* offsets, const u16* w13,
//!    u16* h, int hidden, int inter, int experts). Experts with no rows read no weights.
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

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::gemm_config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::problem::{MoeProblem, Scoring};

pub use super::kernel::{MoeKernel, BACKEND, PERMUTE_SOURCE};

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

/// The few-token logits kernel is used while the tiled one would launch fewer blocks than
/// this (about one per SM of an H100): with E = 256 (4 tokens per tiled block) that is up
/// to 508 tokens, with E ≤ 32 (32 per block) up to 4064.
pub const SMALL_LOGITS_MAX_TILED_BLOCKS: u64 = 128;

/// Tokens per block of the tiled logits kernel for `experts` (contract step 1).
pub fn tiled_logits_tokens_per_block(experts: usize) -> u64 {
    let epad = (experts as u64).div_ceil(32).max(1) * 32;
    (LOGITS_THREADS as u64 / epad) * LOGITS_TOKENS_PER_THREAD as u64
}

/// Whether [`select`] picks `moe_router_logits_small` for `p`.
pub fn use_small_logits(p: &MoeProblem) -> bool {
    (p.tokens as u64).div_ceil(tiled_logits_tokens_per_block(p.experts))
        < SMALL_LOGITS_MAX_TILED_BLOCKS
}

/// Indices of the kernels in the list returned by [`select`].
pub const K_LOGITS: usize = 0;
pub const K_TOPK: usize = 1;
pub const K_STATS: usize = 2;
pub const K_PERMUTE: usize = 3;
pub const K_GEMM13: usize = 4;
pub const K_GEMM2: usize = 5;
pub const K_COMBINE: usize = 6;

fn kv(k: &str, v: u32) -> (String, String) {
    (k.to_string(), v.to_string())
}

fn simple(
    source: &'static str,
    entry: &'static str,
    defines: Vec<(String, String)>,
    threads: u32,
) -> MoeKernel {
    MoeKernel {
        source_file: source,
        entry,
        defines,
        block_m: 1,
        block_n: 1,
        block_threads: threads,
        shared_mem_bytes: 0,
        min_arch: 80,
    }
}

/// The router, statistics, permutation and combine kernels (everything but the GEMMs) in
/// pipeline order: logits, topk, stats, permute, combine.
pub fn non_gemm_variants(
    dtype: DType,
    scoring: Scoring,
    renormalize: bool,
    shared_expert: bool,
) -> Result<Vec<MoeKernel>> {
    if dtype == DType::F32 {
        return Err(Error::unsupported(
            BACKEND,
            "dtype f32 is not supported (the MoE kernels take f16 or bf16 inputs)",
        ));
    }
    let bf16 = (dtype == DType::Bf16) as u32;
    Ok(vec![
        simple(
            ROUTER_SOURCE,
            LOGITS_ENTRY,
            vec![kv("FM_DTYPE_BF16", bf16)],
            LOGITS_THREADS,
        ),
        simple(
            ROUTER_SOURCE,
            TOPK_ENTRY,
            vec![
                kv("FM_SIGMOID", (scoring == Scoring::Sigmoid) as u32),
                kv("FM_RENORM", renormalize as u32),
            ],
            TOPK_THREADS,
        ),
        simple(ROUTER_SOURCE, STATS_ENTRY, vec![], STATS_THREADS),
        simple(PERMUTE_SOURCE, PERMUTE_ENTRY, vec![], PERMUTE_THREADS),
        simple(
            COMBINE_SOURCE,
            COMBINE_ENTRY,
            vec![
                kv("FM_DTYPE_BF16", bf16),
                kv("FM_SHARED", shared_expert as u32),
            ],
            COMBINE_THREADS,
        ),
    ])
}

/// `moe_router_losses` (contract step 3b): the same kernel for every problem.
pub fn losses_kernel() -> MoeKernel {
    simple(ROUTER_SOURCE, LOSSES_ENTRY, vec![], LOSSES_THREADS)
}

/// Shape limits of the pipeline (everything but the GEMM tiles), `Unsupported` naming
/// the value that fails; problem validation (`InvalidProblem`) first.
pub fn check_limits(p: &MoeProblem) -> Result<()> {
    p.validate()?;
    if p.experts > MAX_EXPERTS {
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "experts = {} exceeds the router limit of {MAX_EXPERTS}",
                p.experts
            ),
        ));
    }
    if p.top_k > MAX_TOP_K {
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "top_k = {} exceeds the router limit of {MAX_TOP_K}",
                p.top_k
            ),
        ));
    }
    let slots = p.tokens.checked_mul(p.top_k);
    match slots {
        Some(s) if s <= MAX_INT => {}
        _ => {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "tokens × top_k = {} × {} exceeds the kernel limit of {MAX_INT} routed rows",
                    p.tokens, p.top_k
                ),
            ))
        }
    }
    for (name, v) in [("hidden", p.hidden), ("intermediate", p.intermediate)] {
        if v > MAX_INT {
            return Err(Error::unsupported(
                BACKEND,
                format!("{name} = {v} does not fit the kernels' 32-bit int parameter"),
            ));
        }
    }
    if p.dtype == DType::F32 {
        return Err(Error::unsupported(
            BACKEND,
            "dtype f32 is not supported (the MoE kernels take f16 or bf16 inputs)",
        ));
    }
    Ok(())
}

/// Every kernel the MoE forward of `problem` needs, in pipeline order (indices
/// [`K_LOGITS`] … [`K_COMBINE`]), or `Error::Unsupported` naming the shape constraint
/// that fails (e.g. intermediate not a multiple of the GEMM tile).
pub fn select(problem: &MoeProblem) -> Result<Vec<MoeKernel>> {
    check_limits(problem)?;
    let mut v = non_gemm_variants(
        problem.dtype,
        problem.scoring,
        problem.renormalize,
        problem.shared_expert,
    )?;
    let (g13, g2) = gemm_config::gemm_kernels(problem)?;
    for (k, entry) in [(&g13, GEMM13_ENTRY), (&g2, GEMM2_ENTRY)] {
        if k.entry != entry || k.block_m == 0 || k.block_n == 0 || k.block_threads == 0 {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "grouped GEMM variant {}:{} is malformed (want entry {entry}, non-zero tiles)",
                    k.source_file, k.entry
                ),
            ));
        }
    }
    if let Some(t) = gemm_config::router_logits_tile(problem.tokens, problem.experts) {
        v[K_LOGITS] = t.kernel(problem.dtype);
    } else if use_small_logits(problem) {
        v[K_LOGITS].entry = LOGITS_SMALL_ENTRY;
    }
    let combine = v.pop().expect("five kernels");
    v.push(g13);
    v.push(g2);
    v.push(combine);
    Ok(v)
}

/// Every variant that can be selected (for the compile-everything test): the non-GEMM
/// kernels for both 16-bit dtypes, both scorings, with/without renormalisation and
/// shared expert (duplicates removed), plus every grouped-GEMM variant (portable and
/// sm_90) and the sm_90 path's token gather.
pub fn all_variants() -> Vec<MoeKernel> {
    let mut out: Vec<MoeKernel> = Vec::new();
    for dtype in [DType::F16, DType::Bf16] {
        for scoring in [Scoring::Softmax, Scoring::Sigmoid] {
            for renorm in [false, true] {
                for shared in [false, true] {
                    for k in non_gemm_variants(dtype, scoring, renorm, shared).expect("16-bit") {
                        if !out.contains(&k) {
                            out.push(k);
                        }
                    }
                }
            }
        }
    }
    let small: Vec<MoeKernel> = out
        .iter()
        .filter(|k| k.entry == LOGITS_ENTRY)
        .map(|k| MoeKernel {
            entry: LOGITS_SMALL_ENTRY,
            ..k.clone()
        })
        .collect();
    out.extend(small);
    out.push(losses_kernel());
    out.extend(gemm_config::all_gemm_variants());
    out.extend(super::gemm_sm90::all_sm90_variants());
    out.push(super::gemm_sm90::gather_kernel());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn problem() -> MoeProblem {
        MoeProblem {
            tokens: 7,
            hidden: 64,
            intermediate: 32,
            experts: 8,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        }
    }

    fn unsupported_reason(r: Result<Vec<MoeKernel>>) -> String {
        match r {
            Err(Error::Unsupported { backend, reason }) => {
                assert_eq!(backend, BACKEND);
                reason
            }
            other => panic!("expected Unsupported, got {other:?}"),
        }
    }

    #[test]
    fn limits_name_the_value() {
        let mut p = problem();
        p.experts = 300;
        let r = unsupported_reason(select(&p));
        assert!(r.contains("experts = 300") && r.contains("256"), "{r}");
        let mut p = problem();
        p.top_k = 9;
        p.experts = 16;
        let r = unsupported_reason(select(&p));
        assert!(r.contains("top_k = 9") && r.contains('8'), "{r}");
        let mut p = problem();
        p.dtype = DType::F32;
        assert!(unsupported_reason(select(&p)).contains("f32"));
        let mut p = problem();
        p.tokens = usize::MAX / 2;
        let r = unsupported_reason(select(&p));
        assert!(r.contains("tokens × top_k"), "{r}");
    }

    #[test]
    fn invalid_problems_are_invalid_not_unsupported() {
        let mut p = problem();
        p.tokens = 0;
        let e = select(&p).unwrap_err();
        assert!(matches!(e, Error::InvalidProblem(_)), "{e}");
        assert!(e.to_string().contains("tokens must be at least 1"), "{e}");
        let mut p = problem();
        p.top_k = 9;
        let e = select(&p).unwrap_err();
        assert!(
            e.to_string()
                .contains("top_k (9) must not exceed experts (8)"),
            "{e}"
        );
    }

    #[test]
    fn select_uses_gemm_config() {
        // H = 64 and I = 32 are multiples of the grouped GEMM's narrowest column tile (32),
        // so the pipeline must select: the seven kernels in pipeline order, the two GEMMs
        // being the tiles gemm_config picks for this problem.
        let p = problem();
        let v = select(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
        let entries: Vec<&str> = v.iter().map(|k| k.entry).collect();
        let logits = if gemm_config::router_logits_tile(p.tokens, p.experts).is_some() {
            GEMM2_ENTRY
        } else if use_small_logits(&p) {
            LOGITS_SMALL_ENTRY
        } else {
            LOGITS_ENTRY
        };
        assert_eq!(
            entries,
            [
                logits,
                TOPK_ENTRY,
                STATS_ENTRY,
                PERMUTE_ENTRY,
                GEMM13_ENTRY,
                GEMM2_ENTRY,
                COMBINE_ENTRY
            ]
        );
        let (g13, g2) = gemm_config::gemm_kernels(&p).unwrap();
        assert_eq!((&v[K_GEMM13], &v[K_GEMM2]), (&g13, &g2));
        // A hidden or intermediate dim that is not a multiple of 32 has no grouped-GEMM
        // column tile: select must be Unsupported (not an invalid problem, not a panic),
        // and say which dim and why.
        for (hidden, intermediate, why) in [
            (64, 100, "intermediate (100) must be a multiple of 32"),
            (80, 32, "hidden (80) must be a multiple of 32"),
        ] {
            let q = MoeProblem {
                hidden,
                intermediate,
                ..problem()
            };
            match select(&q) {
                Err(Error::Unsupported { reason, .. }) => {
                    assert!(reason.contains(why), "{q}: {reason}")
                }
                other => panic!("{q}: expected Unsupported ({why}), got {other:?}"),
            }
        }
    }

    #[test]
    fn router_logits_kernel_choice() {
        let pick = |tokens, experts| {
            let p = MoeProblem {
                tokens,
                experts,
                top_k: 2,
                hidden: 4096,
                intermediate: 1024,
                ..problem()
            };
            select(&p).map(|k| (k[K_LOGITS].entry, k[K_LOGITS].block_m, k[K_LOGITS].block_n))
        };
        // E a multiple of 32: the one-group tensor-core GEMM, the tallest tile that still
        // launches 128 blocks, else 16 x 32 tiles.
        assert_eq!(pick(32768, 32).unwrap(), (GEMM2_ENTRY, 128, 32));
        assert_eq!(pick(2048, 32).unwrap(), (GEMM2_ENTRY, 16, 32));
        assert_eq!(pick(16, 32).unwrap(), (GEMM2_ENTRY, 16, 32));
        assert_eq!(pick(8192, 256).unwrap(), (GEMM2_ENTRY, 128, 128));
        assert_eq!(pick(16, 256).unwrap(), (GEMM2_ENTRY, 16, 32));
        assert_eq!(pick(2048, 128).unwrap(), (GEMM2_ENTRY, 32, 64));
        // Otherwise the CUDA-core kernels. E = 8: 32 tokens per tiled block, so up to
        // 4064 tokens the tiled grid is < 128 blocks and the few-token kernel runs.
        assert_eq!(pick(2048, 8).unwrap().0, LOGITS_SMALL_ENTRY);
        assert_eq!(pick(4096, 8).unwrap().0, LOGITS_ENTRY);
        assert_eq!(pick(4096, 48).unwrap().0, LOGITS_ENTRY);
    }

    #[test]
    fn non_gemm_defines_follow_the_problem() {
        let v = non_gemm_variants(DType::F16, Scoring::Sigmoid, false, true).unwrap();
        let entries: Vec<&str> = v.iter().map(|k| k.entry).collect();
        assert_eq!(
            entries,
            [
                LOGITS_ENTRY,
                TOPK_ENTRY,
                STATS_ENTRY,
                PERMUTE_ENTRY,
                COMBINE_ENTRY
            ]
        );
        let def = |k: &MoeKernel, n: &str| {
            k.defines
                .iter()
                .find(|(a, _)| a == n)
                .map(|(_, b)| b.clone())
        };
        assert_eq!(def(&v[0], "FM_DTYPE_BF16").as_deref(), Some("0"));
        assert_eq!(def(&v[1], "FM_SIGMOID").as_deref(), Some("1"));
        assert_eq!(def(&v[1], "FM_RENORM").as_deref(), Some("0"));
        assert_eq!(def(&v[4], "FM_SHARED").as_deref(), Some("1"));
        assert!(non_gemm_variants(DType::F32, Scoring::Softmax, true, false).is_err());
    }

    #[test]
    fn all_variants_cover_every_combination_once() {
        let v = all_variants();
        let count = |e: &str| v.iter().filter(|k| k.entry == e).count();
        assert_eq!(count(LOGITS_ENTRY), 2);
        assert_eq!(count(LOGITS_SMALL_ENTRY), 2);
        assert_eq!(count(TOPK_ENTRY), 4);
        assert_eq!(count(STATS_ENTRY), 1);
        assert_eq!(count(PERMUTE_ENTRY), 1);
        assert_eq!(count(COMBINE_ENTRY), 4);
        assert_eq!(count(LOSSES_ENTRY), 1);
        for (i, a) in v.iter().enumerate() {
            assert!(!v[i + 1..].contains(a), "duplicate {a:?}");
        }
    }
}
