//! The lab's MoE family: its configs ([`config`]). The problem type is the library's
//! [`flashmoe::MoeProblem`], the references are `flashmoe::reference::moe`'s and the GPU
//! fp32 one; the implementations are the runners' (`crate::runner::cpu`,
//! `gpu`, the Python baselines).

pub mod config;
pub mod gpu;
