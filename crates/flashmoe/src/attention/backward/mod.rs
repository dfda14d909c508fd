//! Attention backward: dq, dk and dv of `o = softmax(scale · q kᵀ [mask, softcap]) v`, on
//! the portable mma.sync kernels (`kernels/attention/backward/flash_attn_bwd.cu`, sm_80 and newer) or, on
//! compute capability 9.0 for the classes [`sm90_serves`], the wgmma kernels of
//! `kernels/attention/backward/flash_attn_bwd_sm90.cu`, in the plan's [`BwdMode`]: deterministic, or fast
//! (dQ added with f32 reductions inside the dK/dV kernel, see [`Sm90Dq`]).
//!
//! [`AttentionBackwardPlan::new`] does the slow work once per
//! [`crate::attention::AttentionClass`] (dtype, head dim, head counts, causal, scale,
//! window, softcap): NVRTC compile or disk cache of
//! one module with the three kernels, module load, shared-memory attributes. A call
//! ([`AttentionBackwardPlan::backward_raw`]) does O(1) checks and enqueues three launches
//! (four in the fast sm_90a mode: preprocess, zero the dQ tiles, dK/dV with dQ, convert)
//! on the caller's stream: no allocation, no synchronisation, no compile, so it can be
//! captured in a CUDA graph.
//!
//! 1. `flash_attn_bwd_preprocess`: `Delta = rowsum(dO ∘ O)` and the LSE in log2 units,
//!    into the workspace ([`AttentionBackwardPlan::workspace_bytes`], written before it is
//!    read: nothing to zero).
//! 2. `flash_attn_bwd_dkdv`: one CTA per (batch, kv head, key block); loops over the query
//!    heads of its GQA group and their query blocks, recomputing `P = exp(S − LSE)`;
//!    writes dk and dv once.
//! 3. `flash_attn_bwd_dq`: one CTA per (batch, query head, query block); loops over key
//!    blocks; writes dq once.
//!
//! In [`BwdMode::Deterministic`] there are no atomics: every gradient element is
//! accumulated in a fixed order by one CTA, so two runs give bit-identical gradients. Masks
//! are the forward's: causal bottom-right (row i
//! sees keys j ≤ i + Sk − Sq), sliding windows around that diagonal, Sq ≠ Sk; a row that
//! sees no key (LSE = −inf) gets zero gradients.
//!
//! FLOPs: 2.5 × the forward's ([`backward_flops`]).
//!
//! Files (one role each, as `attention/decode/`): `abi.rs` (kernel sources, entry points
//! and the portable kernels' argument list), `tiles.rs` (modes, kernel paths, tiles and
//! their NVRTC defines: the selection), `plan.rs` ([`AttentionBackwardPlan`], raw and
//! cudarc layers), [`varlen`] (the varlen backward plan), `gpu_tests.rs` and
//! `varlen_gpu_tests.rs` (lab feature). Kernels: `kernels/attention/backward/flash_attn_bwd.cu`,
//! `kernels/attention/backward/flash_attn_bwd_sm90.cu` (design note: docs/design/attention-backward.md).

// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

mod abi;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
mod plan;
mod tiles;
pub mod varlen;
#[cfg(all(test, feature = "lab"))]
mod varlen_gpu_tests;

pub use abi::{
    BWD_DKDV_ENTRY, BWD_DQ_ENTRY, BWD_PREPROCESS_ENTRY, BWD_SM90_DKDV_ENTRY,
    BWD_SM90_DQ_CONVERT_ENTRY, BWD_SM90_DQ_ENTRY, BWD_SM90_DQ_ZERO_ENTRY, BWD_SM90_SOURCE,
    BWD_SOURCE,
};
pub use plan::{AttentionBackwardPlan, BackwardArgs};
pub use tiles::{
    all_bwd_classes, all_sm90_bwd_classes, bwd_defines, default_kernel, sm90_bwd_defines,
    sm90_serves, BwdKernel, BwdMode, BwdTile, Sm90BwdTile, Sm90Dq, BWD_HEAD_DIMS,
    BWD_SM90_HEAD_DIMS,
};

use crate::problem::AttentionProblem;

/// FLOPs of one backward call, FlashAttention's convention: 2.5 × the forward's
/// 4·B·Hq·(unmasked pairs)·D (five GEMMs to the forward's two).
pub fn backward_flops(p: &AttentionProblem) -> f64 {
    2.5 * p.flops()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn flops_are_two_and_a_half_forwards() {
        let mut p = AttentionProblem::new(1, 2, 100, 64, true, DType::Bf16);
        assert_eq!(backward_flops(&p), 2.5 * p.flops());
        p.causal = false;
        assert_eq!(backward_flops(&p), 2.5 * 4.0 * 2.0 * 100.0 * 100.0 * 64.0);
    }
}
