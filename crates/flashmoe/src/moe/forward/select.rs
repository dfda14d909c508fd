//! Kernel selection of the MoE forward: which variant of each pipeline kernel
//! ([`super::abi`]'s contract) runs a problem, the limits that refuse one, and every
//! selectable variant (the compile-everything test).

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

use super::abi::*;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::moe::gemm::{sm90, tiles};
pub use crate::moe::kernel::MoeKernel;
use crate::problem::{MoeProblem, Scoring};

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
    let (g13, g2) = tiles::gemm_kernels(problem)?;
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
    if let Some(t) = tiles::router_logits_tile(problem.tokens, problem.experts) {
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
    out.extend(tiles::all_gemm_variants());
    out.extend(sm90::all_sm90_variants());
    out.push(sm90::gather_kernel());
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
    fn select_uses_the_gemm_tiles() {
        // H = 64 and I = 32 are multiples of the grouped GEMM's narrowest column tile (32),
        // so the pipeline must select: the seven kernels in pipeline order, the two GEMMs
        // being the tiles gemm::tiles picks for this problem.
        let p = problem();
        let v = select(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
        let entries: Vec<&str> = v.iter().map(|k| k.entry).collect();
        let logits = if tiles::router_logits_tile(p.tokens, p.experts).is_some() {
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
        let (g13, g2) = tiles::gemm_kernels(&p).unwrap();
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
