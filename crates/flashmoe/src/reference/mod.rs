//! CPU reference implementations.
//!
//! - [`attention`]: the f64 ground truth for attention forward (materialised softmax).
//! - [`attention_tiled`](mod@attention_tiled): FlashAttention-2 on the CPU in f32 (tiles, online softmax,
//!   O(N) extra memory): the CPU backend of the benchmark lab.
//! - [`decode`]: the f64 ground truth for paged-KV decode attention.
//! - [`moe`]: the f64 ground truth for the MoE layer (router, top-k, SwiGLU experts,
//!   weighted combine, auxiliary losses).
//! - [`moe_backward`]: the f64 ground truth for the MoE layer's backward (gradients of x,
//!   router and expert weights, stage by stage), checked against finite differences.
//!
//! All entry points validate the problem and the buffer lengths and return an
//! [`Error`] instead of panicking on bad input.

pub mod attention;
/// The f64 attention backward (dq, dk, dv), checked against finite differences.
pub mod attention_backward;
pub mod attention_tiled;
/// Paged-KV decode attention in f64 (block tables, windows, softcap).
pub mod decode;
/// MLA paged decode (one latent KV head, value = a row's first columns) in f64.
pub mod mla;
pub mod moe;
pub mod moe_backward;
/// The dropless-permutation MoE in f32 (the CPU analogue of the GPU algorithm).
pub mod moe_grouped;

pub use attention::{attention_f64, AttentionInputs, AttentionOutput};
pub use attention_tiled::{attention_tiled, DEFAULT_BLOCK_M, DEFAULT_BLOCK_N};
pub use moe::{moe_f64, route, MoeInputs, MoeOutput, Routing};

use crate::error::{Error, Result};

/// Product of sizes, or an `InvalidProblem` naming `what` when it overflows `usize`.
pub(crate) fn checked_product(what: &str, dims: &[usize]) -> Result<usize> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| Error::invalid(format!("{what}: size {dims:?} overflows usize")))
}

/// `Err(BufferSize)` naming `name` unless `actual == expected`.
pub(crate) fn check_len(name: &str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::BufferSize {
            name: name.to_string(),
            expected,
            actual,
        })
    }
}

#[cfg(test)]
mod tests_attention;
#[cfg(test)]
mod tests_moe;
