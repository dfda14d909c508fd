//! The lab's attention family (dense prefill): its configs ([`config`]). The problem type
//! is the library's [`flashmoe::AttentionProblem`], the references are
//! `flashmoe::reference`'s; the implementations are the runners' (`crate::runner::cpu`,
//! `gpu`, the Python baselines).

pub mod config;
pub mod gpu;
