//! Launch geometry of the MoE pipeline's kernels per the contract in [`super::abi`]:
//! the grouped GEMMs' tile grids and the one-dimensional grids of the router, permute and
//! combine kernels.

use super::abi::{self, BACKEND};
use super::select::{self, MoeKernel};
use crate::error::{Error, Result};
use crate::moe::gemm::tiles;
use crate::problem::MoeProblem;
use cudarc::driver::LaunchConfig;

/// CUDA grid limits (x, y).
const MAX_GRID_X: u64 = i32::MAX as u64;
const MAX_GRID_Y: u64 = 65_535;

fn grid_1d(kernel: &MoeKernel, blocks: u64, gy: u64) -> Result<LaunchConfig> {
    if kernel.block_threads == 0 {
        return Err(Error::unsupported(
            kernel.entry,
            "kernel variant has zero block_threads",
        ));
    }
    if blocks > MAX_GRID_X || gy > MAX_GRID_Y {
        return Err(Error::unsupported(
            kernel.entry,
            format!(
                "grid ({blocks}, {gy}) exceeds the CUDA grid limit ({MAX_GRID_X}, {MAX_GRID_Y})"
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (blocks.max(1) as u32, gy.max(1) as u32, 1),
        block_dim: (kernel.block_threads, 1, 1),
        shared_mem_bytes: kernel.shared_mem_bytes,
    })
}

/// Launch geometry of a grouped GEMM over `rows` permuted rows of `experts` groups with
/// `n` output columns (contract step 5/6): grid.x = ceil(rows / block_m) + experts,
/// grid.y = n / block_n (n must be a multiple of block_n).
pub fn gemm_launch_config(
    k: &MoeKernel,
    rows: usize,
    experts: usize,
    n: usize,
) -> Result<LaunchConfig> {
    if k.block_m == 0 || k.block_n == 0 {
        return Err(Error::unsupported(
            k.entry,
            "kernel variant has a zero block_m or block_n",
        ));
    }
    if n % k.block_n as usize != 0 {
        return Err(Error::unsupported(
            k.entry,
            format!(
                "{n} output columns are not a multiple of the tile width {}",
                k.block_n
            ),
        ));
    }
    let gx = (rows as u64).div_ceil(k.block_m as u64) + experts as u64;
    grid_1d(k, gx, (n / k.block_n as usize) as u64)
}

/// Launch geometry of every kernel of [`select::select`] (same order) for `p`, per the
/// contract in [`super::abi`].
pub fn launch_configs(p: &MoeProblem, kernels: &[MoeKernel]) -> Result<Vec<LaunchConfig>> {
    if kernels.len() != 7 {
        select::check_limits(p)?;
        return Err(Error::unsupported(
            BACKEND,
            format!("expected 7 pipeline kernels, got {}", kernels.len()),
        ));
    }
    let k: [&MoeKernel; 7] = std::array::from_fn(|i| &kernels[i]);
    Ok(pipeline_configs(p, k)?.to_vec())
}

/// [`launch_configs`] without allocation (the plans' hot path).
pub(crate) fn pipeline_configs(
    p: &MoeProblem,
    kernels: [&MoeKernel; 7],
) -> Result<[LaunchConfig; 7]> {
    select::check_limits(p)?;
    let (t, e, k) = (p.tokens as u64, p.experts as u64, p.top_k as u64);
    let logits_kernel = kernels[select::K_LOGITS];
    let logits_cfg = match logits_kernel.entry {
        tiles::GEMM2_ENTRY => gemm_launch_config(logits_kernel, p.tokens, 1, p.experts)?,
        abi::LOGITS_SMALL_ENTRY => grid_1d(
            logits_kernel,
            (t * e).div_ceil(abi::LOGITS_THREADS as u64),
            1,
        )?,
        _ => grid_1d(
            logits_kernel,
            t.div_ceil(select::tiled_logits_tokens_per_block(p.experts)),
            1,
        )?,
    };
    let topk_tokens = abi::TOPK_THREADS as u64 / 32;
    let rows = (t * k) as usize;
    Ok([
        logits_cfg,
        grid_1d(kernels[select::K_TOPK], t.div_ceil(topk_tokens), 1)?,
        grid_1d(kernels[select::K_STATS], e + 1, 1)?,
        grid_1d(kernels[select::K_PERMUTE], e, 1)?,
        gemm_launch_config(kernels[select::K_GEMM13], rows, p.experts, p.intermediate)?,
        gemm_launch_config(kernels[select::K_GEMM2], rows, p.experts, p.hidden)?,
        grid_1d(kernels[select::K_COMBINE], t, 1)?,
    ])
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::problem::Scoring;

    /// A softmax top-2 problem over 40 experts (also the runner's tests' fixture).
    pub(crate) fn problem() -> MoeProblem {
        MoeProblem {
            tokens: 100,
            hidden: 256,
            intermediate: 128,
            experts: 40,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        }
    }

    fn gemm(entry: &'static str) -> MoeKernel {
        MoeKernel {
            source_file: "moe_grouped_gemm.cu",
            entry,
            defines: vec![],
            block_m: 64,
            block_n: 64,
            block_threads: 128,
            shared_mem_bytes: 64 * 1024,
            min_arch: 80,
        }
    }

    fn kernels(p: &MoeProblem) -> Vec<MoeKernel> {
        let mut v = select::non_gemm_variants(p.dtype, p.scoring, p.renormalize, false).unwrap();
        let c = v.pop().unwrap();
        v.extend([gemm(abi::GEMM13_ENTRY), gemm(abi::GEMM2_ENTRY), c]);
        v
    }

    #[test]
    fn launch_geometry_follows_the_contract() {
        let p = problem();
        let c = launch_configs(&p, &kernels(&p)).unwrap();
        // E = 40 → EPAD 64 → 4 token groups × 4 tokens = 16 tokens per block.
        assert_eq!(c[select::K_LOGITS].grid_dim, (7, 1, 1));
        assert_eq!(c[select::K_LOGITS].block_dim, (256, 1, 1));
        assert_eq!(c[select::K_TOPK].grid_dim, (25, 1, 1));
        assert_eq!(c[select::K_TOPK].block_dim, (128, 1, 1));
        assert_eq!(c[select::K_STATS].grid_dim, (41, 1, 1));
        assert_eq!(c[select::K_PERMUTE].grid_dim, (40, 1, 1));
        // 200 rows / 64 → 4, + 40 experts; N / 64.
        assert_eq!(c[select::K_GEMM13].grid_dim, (44, 2, 1));
        assert_eq!(c[select::K_GEMM2].grid_dim, (44, 4, 1));
        assert_eq!(c[select::K_GEMM2].shared_mem_bytes, 64 * 1024);
        assert_eq!(c[select::K_COMBINE].grid_dim, (100, 1, 1));
        // A 1-token problem with 256 experts: one token per thread group.
        let q = MoeProblem {
            tokens: 1,
            experts: 256,
            top_k: 8,
            ..p.clone()
        };
        let c = launch_configs(&q, &kernels(&q)).unwrap();
        assert_eq!(c[select::K_LOGITS].grid_dim, (1, 1, 1));
        assert_eq!(c[select::K_GEMM13].grid_dim, (257, 2, 1));
        // The few-token logits kernel: one thread per (token, expert).
        let mut ks = kernels(&q);
        ks[select::K_LOGITS].entry = abi::LOGITS_SMALL_ENTRY;
        let q7 = MoeProblem { tokens: 7, ..q };
        let c = launch_configs(&q7, &ks).unwrap();
        assert_eq!(c[select::K_LOGITS].grid_dim, (7, 1, 1));
        assert_eq!(c[select::K_LOGITS].block_dim, (256, 1, 1));
    }

    #[test]
    fn gemm_geometry_agrees_with_the_gemm_tiles() {
        // Whatever grouped-GEMM variants gemm::tiles selects, the launcher's grid is the
        // one the GEMM side documents.
        for (t, h, i, e, k) in [
            (1, 256, 256, 16, 8),
            (7, 4096, 11008, 32, 2),
            (2048, 2048, 768, 128, 8),
        ] {
            let p = MoeProblem {
                tokens: t,
                hidden: h,
                intermediate: i,
                experts: e,
                top_k: k,
                ..problem()
            };
            let ks = select::select(&p).unwrap_or_else(|e| panic!("{p}: {e}"));
            let c = launch_configs(&p, &ks).unwrap();
            for g in [select::K_GEMM13, select::K_GEMM2] {
                let (gx, gy) = tiles::gemm_grid(&p, &ks[g]);
                assert_eq!(c[g].grid_dim, (gx, gy, 1), "{p} {}", ks[g].entry);
                assert_eq!(c[g].block_dim.0, ks[g].block_threads);
            }
        }
    }

    #[test]
    fn gemm_tile_mismatch_is_unsupported() {
        let p = MoeProblem {
            intermediate: 100,
            ..problem()
        };
        let e = launch_configs(&p, &kernels(&p)).unwrap_err().to_string();
        assert!(
            e.contains("moe_gemm13") && e.contains("100 output columns"),
            "{e}"
        );
        let mut k = kernels(&problem());
        k[select::K_GEMM2].block_m = 0;
        assert!(launch_configs(&problem(), &k).is_err());
        assert!(launch_configs(&problem(), &k[..3]).is_err());
    }
}
