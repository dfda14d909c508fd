//! The MoE layer's forward: router, dropless permutation, grouped SwiGLU GEMMs, combine.
//! [`abi`] is the contract between the kernels and the launchers, [`select`] picks each
//! kernel's variant for a problem, [`launch`] the launch geometry, and [`plan`] the engine
//! API ([`plan::MoePlan`]: built once per [`plan::MoeClass`], called on the caller's
//! stream). The grouped GEMMs' tiles are [`crate::moe::gemm`]'s (shared with the backward).

pub mod abi;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
pub mod launch;
pub mod plan;
#[cfg(all(test, feature = "lab"))]
mod plan_gpu_tests;
pub mod select;
