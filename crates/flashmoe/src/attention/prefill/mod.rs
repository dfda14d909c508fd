//! The prefill family (dense and packed variable-length sequences, forward): [`abi`] (the
//! kernels' contract and variant record), [`tiles`] (the tile tables), [`select`] (which
//! variant serves a problem), [`tma`] (the sm_90a tensor maps), [`plan`]
//! ([`plan::AttentionPlan`], built once per shape class, enqueued on the caller's stream over
//! the caller's memory) and [`varlen`] ([`varlen::VarlenPlan`], packed sequences on the
//! sm_90a kernel); their GPU tests beside them. Kernels: `kernels/attention/prefill/`.
//! `plan`, `tma` and `varlen` are re-exported at [`crate::attention`], their paths before
//! this folder.

pub mod abi;
#[cfg(all(test, feature = "lab"))]
mod alibi_gpu_tests;
pub mod plan;
#[cfg(all(test, feature = "lab"))]
mod plan_gpu_tests;
pub mod select;
pub mod tiles;
pub mod tma;
#[cfg(all(test, feature = "lab"))]
mod v1_layout_gpu_tests;
pub mod varlen;
#[cfg(all(test, feature = "lab"))]
mod varlen_gpu_tests;
