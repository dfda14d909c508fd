//! flashmoe: exact attention and Mixture-of-Experts kernels for NVIDIA GPUs, driven from
//! Rust, plus the CPU reference implementations every kernel is checked against.
//!
//! Modules:
//! - [`dtype`]: element types and their rounding.
//! - [`problem`]: attention and MoE problem descriptions, validation, FLOP/byte models.
//! - [`inputs`]: the deterministic, backend-independent input generator.
//! - [`reference`]: CPU implementations (f64 ground truth; tiled f32 FlashAttention).
//! - [`accuracy`]: error metrics and per-dtype tolerances.
//! - [`gpu`]: the CUDA runtime (cudarc, NVRTC kernel cache, timing).

pub mod accuracy;
pub mod attention;
pub mod dtype;
pub mod error;
pub mod gpu;
pub mod inputs;
pub mod moe;
pub mod problem;
pub mod reference;

pub use dtype::DType;
pub use error::{Error, Result};
pub use problem::{AttentionProblem, MoeProblem, Scoring};
