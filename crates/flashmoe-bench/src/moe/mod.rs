//! The lab's MoE family: its configs ([`config`]). The problem type is the library's
//! [`flashmoe::MoeProblem`], the references are `flashmoe::reference::moe`'s and the GPU
//! fp32 one; the implementations are the runners' (`crate::runner::cpu`,
//! `crate::runner::gpu_moe`, the Python baselines).

pub mod config;
