//! The MoE layer on the GPU: router, dropless permutation, grouped SwiGLU GEMMs, combine,
//! and their backward. One folder a role:
//! - [`forward`]: the forward's kernel ABI (`abi`), kernel selection (`select`), launch
//!   geometry (`launch`) and the engine API, [`MoePlan`] (`plan`): built once per
//!   [`MoeClass`], then called on the caller's stream over the caller's device weights,
//!   activations and workspace (raw pointers or cudarc buffers); no allocation, sync or
//!   compile per call, CUDA-graph safe, routing results and losses left on the device.
//! - [`backward`]: [`backward::MoeBackwardPlan`] over the forward's saved routing.
//! - [`gemm`]: the grouped GEMMs' tiles (portable) and the sm_90a kernels' descriptors,
//!   shared by both passes; [`kernel`]: the record every MoE kernel is described by.
//! - [`ep`]: expert parallelism over several GPUs.
//! - With the `lab` feature, `runner` (the lab's owner of one problem's buffers,
//!   `MoeRunner`, over the forward and backward plans) and `reference` (the GPU fp32
//!   reference).
//!
//! Shared expert: supported, as a one-expert group of all tokens through the same grouped
//! GEMM kernels (see the contract); its output is added by the combine with weight 1.
// `x % n != 0` instead of `is_multiple_of`: the workspace's rust-version is 1.80.
#![allow(clippy::manual_is_multiple_of)]

pub mod backward;
pub mod ep;
pub mod forward;
pub mod gemm;
pub mod kernel;
#[cfg(feature = "lab")]
pub mod reference;
#[cfg(feature = "lab")]
pub mod runner;

pub use forward::launch::{gemm_launch_config, launch_configs};
pub use forward::plan::{
    MoeArgs, MoeClass, MoePlan, MoeRouting, MoeWeights, RawU32, RoutingArgs, TokenRange,
    WorkspaceLayout,
};
#[cfg(feature = "lab")]
pub use runner::{
    check_inputs, load_stats, routing_mismatch, GpuRouting, MoeRunner, Permutation, RoutingTuple,
};
