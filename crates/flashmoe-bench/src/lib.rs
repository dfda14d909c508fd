//! flashmoe-bench: the benchmark lab. Measurement (sampling loop), statistics, runners
//! (CPU, GPU, Python baselines), reports and regression comparison.
//!
//! Data flows one way: presets/config → problems → runners produce outputs and raw
//! samples → correctness gate → statistics → report. Runners know nothing of reports;
//! statistics know nothing of CUDA.

pub mod attention;
pub mod compare;
pub mod config;
pub mod decode;
pub mod e2e;
pub mod ep;
pub mod gpu;
pub mod grad;
pub mod grades;
pub mod manifest;
pub mod measure;
pub mod mla;
pub mod moe;
pub mod profile;
pub mod recorded;
pub mod report;
pub mod results;
pub mod runner;
pub mod stats;
pub mod suite_io;
pub mod toml_fields;
pub mod varlen;
pub mod workload;

// What an out-of-tree implementation needs (docs/plugins.md,
// examples/plugin_implementation.rs).
pub use measure::Sampled;
pub use runner::{Implementation, Outputs, Prepared, SuiteInputs};
