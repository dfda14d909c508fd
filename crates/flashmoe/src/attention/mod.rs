//! Attention on the GPU, one module per kernel family, each with its kernel ABI and
//! selection, its plan (raw layer over pointers + strides + `CUstream`, and a cudarc
//! layer) and its GPU tests beside it:
//!
//! - prefill: [`prefill`] — `abi`, `tiles`, `select` (kernel variants, tile tables and
//!   selection), [`tma`] (the sm_90a
//!   tensor maps), [`plan`] ([`AttentionPlan`], built once per shape class, enqueued on the
//!   caller's stream over the caller's memory), [`varlen`] ([`VarlenPlan`], packed
//!   sequences on the sm_90a kernel); re-exported here under their earlier paths;
//! - backward: [`backward`] ([`backward::AttentionBackwardPlan`], the dense backward on the
//!   portable and sm_90a kernels; [`backward::varlen`], the varlen backward);
//! - decode: [`decode`] ([`decode::DecodePlan`], the paged KV cache);
//! - MLA decode: [`mla`] ([`mla::MlaDecodePlan`], DeepSeek's latent paged cache);
//! - [`launch`]: launch helpers the plans share;
//! - [`route`]: which plan serves a call (window normalisation, softcap checks, the
//!   dense → prefill / decode routing and the plan keys the front ends cache plans by);
//! - [`cache`]: the caches a front end keeps (plans per key, a workspace per stream).
//!
//! With the `lab` feature, `runner` adds the lab's owners of buffers (`AttentionRunner`,
//! the one-off `forward` / `reference_forward`); engines use the plans.

pub mod backward;
pub mod cache;
pub mod decode;
pub mod launch;
pub mod mla;
pub mod prefill;
pub mod route;
#[cfg(feature = "lab")]
pub mod runner;

pub use prefill::{plan, tma, varlen};

pub use crate::gpu::{RawWorkspace, Workspace};
pub use launch::{launch_config, softmax_scale_log2};
pub use plan::{AttentionArgs, AttentionClass, AttentionPlan, Bshd, CallShape, Element};
#[cfg(feature = "lab")]
pub use runner::{forward, reference_forward, AttentionRunner};
pub use varlen::{VarlenArgs, VarlenPlan, VarlenShape};
