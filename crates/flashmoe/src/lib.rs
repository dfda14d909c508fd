//! flashmoe: exact attention and Mixture-of-Experts kernels for NVIDIA GPUs, driven from
//! Rust: plans built once per shape class and enqueued on the caller's stream over the
//! caller's memory (docs/library.md).
//!
//! The product:
//! - [`attention`]: prefill, varlen and paged-decode plans and their kernel selection.
//! - [`moe`]: the MoE layer's plan, and expert parallelism over NCCL ([`moe::ep`]).
//! - [`gpu`]: the CUDA runtime (cudarc, NVRTC kernel cache, the raw launch layer).
//! - [`dtype`], [`error`], [`problem`] (shape descriptions, validation, FLOP/byte models).
//!
//! The `lab` feature (the benchmark lab's, never needed by an engine) adds:
//! - `inputs`: the deterministic, backend-independent input generator.
//! - `reference`: CPU implementations (f64 ground truth; tiled f32 FlashAttention).
//! - `accuracy`: error metrics and per-dtype tolerances.
//! - the owners of lab buffers: `attention::runner`, `moe::runner`, the GPU fp32 MoE
//!   reference (`moe::reference`) and the CPU simulation of expert parallelism.

#[cfg(feature = "lab")]
pub mod accuracy;
pub mod attention;
pub mod dtype;
pub mod error;
pub mod gpu;
#[cfg(feature = "lab")]
pub mod inputs;
pub mod moe;
pub mod problem;
#[cfg(feature = "lab")]
pub mod reference;

pub use dtype::DType;
pub use error::{Error, Result};
pub use problem::{AttentionProblem, MoeProblem, Scoring};
