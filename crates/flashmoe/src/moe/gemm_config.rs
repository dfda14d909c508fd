//! STUB (branch `moe-path`): the grouped-GEMM variants are owned by branch `moe-gemm`,
//! whose real file replaces this one at merge. Same two signatures; until then every
//! problem is Unsupported and there are no GEMM variants.

use super::config::MoeKernel;
use crate::error::{Error, Result};
use crate::problem::MoeProblem;

/// The (`moe_gemm13`, `moe_gemm2`) variants for `p`, or `Error::Unsupported`.
pub fn gemm_kernels(p: &MoeProblem) -> Result<(MoeKernel, MoeKernel)> {
    Err(Error::unsupported(
        "flashmoe-moe",
        format!("grouped GEMM kernels are not in this build (stub gemm_config; problem {p})"),
    ))
}

/// Every grouped-GEMM variant that can be selected (none in the stub).
pub fn all_gemm_variants() -> Vec<MoeKernel> {
    Vec::new()
}
