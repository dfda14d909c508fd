//! The MoE layer on the GPU: router, dropless permutation, grouped SwiGLU GEMMs, combine.
//! Kernel selection and the kernel ABI live in [`config`].
pub mod config;
pub mod gemm_config;
