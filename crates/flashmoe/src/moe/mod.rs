//! The MoE layer on the GPU: router, dropless permutation, grouped SwiGLU GEMMs, combine.
//! Kernel selection and the kernel ABI live in [`config`] (the contract at its top);
//! grouped-GEMM variants in [`gemm_config`] and [`gemm_sm90`]; the GPU fp32 reference (lab
//! feature) in `reference`.
//!
//! The engine API is [`MoePlan`] ([`plan`]): built once per [`MoeClass`], then called on
//! the caller's stream over the caller's device weights, activations and workspace (raw
//! pointers or cudarc buffers); no allocation, sync or compile per call, CUDA-graph safe,
//! routing results and losses left on the device. [`launch`] holds the pipeline's launch
//! geometry. With the `lab` feature, `runner` adds the lab's owner of one problem's
//! buffers (`MoeRunner`) and `reference` the GPU fp32 reference.
//!
//! Shared expert: supported, as a one-expert group of all tokens through the same grouped
//! GEMM kernels (see the contract); its output is added by the combine with weight 1.
// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

pub mod backward;
pub mod config;
pub mod ep;
pub mod gemm_config;
pub mod gemm_sm90;
#[cfg(all(test, feature = "lab"))]
mod gpu_tests;
pub mod kernel;
pub mod launch;
pub mod plan;
#[cfg(all(test, feature = "lab"))]
mod plan_gpu_tests;
#[cfg(feature = "lab")]
pub mod reference;
#[cfg(feature = "lab")]
pub mod runner;

pub use launch::{gemm_launch_config, launch_configs};
pub use plan::{
    MoeArgs, MoeClass, MoePlan, MoeRouting, MoeWeights, RawU32, RoutingArgs, TokenRange,
    WorkspaceLayout,
};
#[cfg(feature = "lab")]
pub use runner::{
    check_inputs, load_stats, routing_mismatch, GpuRouting, MoeRunner, Permutation, RoutingTuple,
};
