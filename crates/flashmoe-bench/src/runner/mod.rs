//! Runners: one trait, many implementations (CPU reference/tiled, native GPU kernels,
//! Python baselines). A runner produces outputs (for the correctness gate) and timed
//! samples; it knows nothing of statistics or reports.

pub mod calibration;
pub mod check;
pub mod cpu;
pub mod gpu;
pub mod pipeline;
pub(crate) mod plan_backed;
pub mod python;
pub mod scripts;
pub mod serve;
pub mod session;

pub use crate::suite_io::{Outputs, ReferenceOutputs, SuiteInputs};

use crate::measure::Sampled;
use crate::results::ProblemSpec;
use flashmoe::reference::attention::AttentionInputs;
use flashmoe::reference::moe::MoeInputs;

impl SuiteInputs {
    /// A config's inputs from the generator's streams (a gradient config: its forward's,
    /// then the upstream gradient).
    pub fn generate(problem: &ProblemSpec, seed: u64) -> SuiteInputs {
        match problem {
            ProblemSpec::Attention(p) => SuiteInputs::Attention(AttentionInputs::generate(p, seed)),
            ProblemSpec::Moe(p) => SuiteInputs::Moe(MoeInputs::generate(p, seed)),
            ProblemSpec::Decode(p) => {
                SuiteInputs::Attention(AttentionInputs::generate(&p.dense(), seed))
            }
            ProblemSpec::Varlen(p) => {
                SuiteInputs::Attention(AttentionInputs::generate(&p.packed(), seed))
            }
            ProblemSpec::Mla(p) => SuiteInputs::Attention(crate::mla::generate_inputs(p, seed)),
            // No tensors: a model runs only in `bench e2e`, and its validate() refuses the
            // pipeline.
            ProblemSpec::E2e(_) => SuiteInputs::Attention(AttentionInputs {
                q: Vec::new(),
                k: Vec::new(),
                v: Vec::new(),
            }),
            ProblemSpec::Grad(p) => {
                let forward = SuiteInputs::generate(&p.layer.forward(), seed);
                SuiteInputs::Grad(Box::new(crate::grad::GradInputs::generate(
                    p, forward, seed,
                )))
            }
        }
    }
}

/// An implementation bound to one config, with its buffers allocated and inputs loaded.
pub trait Prepared: Sampled {
    /// Poison the outputs, run once, and return what was computed.
    fn run_for_check(&mut self) -> anyhow::Result<Outputs>;
    /// Peak extra memory the implementation allocated beyond inputs and outputs, bytes.
    fn peak_extra_bytes(&self) -> Option<u64> {
        None
    }
    /// MoE: median ms of the router stage alone, measured by `run_for_check` when the
    /// implementation can launch it separately.
    fn router_ms(&self) -> Option<f64> {
        None
    }
    /// Remarks for the report (compile time, backend caveats), after `run_for_check`.
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }
    /// A throughput ceiling whose output is not the problem's (e.g. a dense GEMM chain of
    /// the same FLOPs): timed, flagged, never gated.
    fn ceiling_only(&self) -> bool {
        false
    }
}

/// A named implementation that can be prepared for a config.
pub trait Implementation {
    fn name(&self) -> &str;
    /// "cpu", "cuda" or "python".
    fn backend(&self) -> &str;
    /// Whether it can run `problem` at all; `Err(reason)` is reported as "n/a: reason".
    fn supports(&self, problem: &ProblemSpec) -> Result<(), String>;
    fn prepare<'a>(
        &'a self,
        problem: &ProblemSpec,
        inputs: &'a SuiteInputs,
    ) -> anyhow::Result<Box<dyn Prepared + 'a>>;
}

/// Turns a config into its reference outputs (CPU f64 for small problems, a GPU reference
/// for large ones when a GPU is present).
pub trait ReferenceProvider {
    /// Name recorded in accuracy results (e.g. "cpu-f64").
    fn name(&self, problem: &ProblemSpec) -> String;
    fn compute(
        &self,
        problem: &ProblemSpec,
        inputs: &SuiteInputs,
    ) -> anyhow::Result<ReferenceOutputs>;
    /// The implementation that *is* the reference for this problem (not checked against
    /// itself), if any.
    fn serves_as(&self, _problem: &ProblemSpec) -> Option<&str> {
        None
    }
}

/// Host bytes a config needs for its f32 inputs and f64 reference outputs.
pub fn host_bytes_needed(problem: &ProblemSpec) -> u64 {
    match problem {
        ProblemSpec::Attention(p) => {
            // q, k, v, and a few output copies (f32 and f64) of q's size.
            ((p.q_elems() + 2 * p.kv_elems()) * 4 + p.q_elems() * 24) as u64
        }
        ProblemSpec::Moe(p) => {
            let weights = p.experts * 3 * p.hidden * p.intermediate
                + p.hidden * p.experts
                + if p.shared_expert {
                    3 * p.hidden * p.intermediate
                } else {
                    0
                };
            (weights * 4 + p.tokens * p.hidden * 32) as u64
        }
        // The dense inputs plus one paged copy of K and V (f32).
        ProblemSpec::Decode(p) => {
            let d = p.dense();
            let paged = 2 * p.num_blocks() * p.page_size * p.heads_kv * p.head_dim;
            ((d.q_elems() + 2 * d.kv_elems() + paged) * 4 + d.q_elems() * 24) as u64
        }
        // The packed tensors, as a batch-1 attention problem of the totals.
        ProblemSpec::Varlen(p) => {
            let d = p.packed();
            ((d.q_elems() + 2 * d.kv_elems()) * 4 + d.q_elems() * 24) as u64
        }
        // q, the dense latent, one paged copy (f32), the f64 reference's o and lse and the
        // f32 outputs read back.
        ProblemSpec::Grad(p) => {
            crate::grad::host_bytes_needed(p, host_bytes_needed(&p.layer.forward()))
        }
        ProblemSpec::Mla(p) => {
            let paged = p.num_blocks() * p.page_size * flashmoe::attention::mla::D_QK;
            ((p.q_elems() + p.latent_elems() + paged) * 4 + (p.o_elems() + p.lse_elems()) * 12)
                as u64
        }
        ProblemSpec::E2e(_) => 0,
    }
}

/// Host memory a run may use: $FLASHMOE_HOST_MEM_LIMIT_GB, else 60% of MemAvailable.
pub fn host_memory_limit() -> u64 {
    if let Some(gb) = std::env::var("FLASHMOE_HOST_MEM_LIMIT_GB")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    {
        return (gb * 1e9) as u64;
    }
    let available_kb = std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find(|l| l.starts_with("MemAvailable:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    });
    available_kb
        .map(|kb| kb * 1024 * 6 / 10)
        .unwrap_or(8_000_000_000)
}

/// `Err(reason)` when a config's host-side inputs would not fit in memory.
pub fn check_host_memory(problem: &ProblemSpec) -> Result<(), String> {
    let need = host_bytes_needed(problem);
    let limit = host_memory_limit();
    if need > limit {
        return Err(format!(
            "needs about {:.1} GB of host memory for inputs and reference outputs, above the limit of {:.1} GB (set FLASHMOE_HOST_MEM_LIMIT_GB to change it)",
            need as f64 / 1e9,
            limit as f64 / 1e9
        ));
    }
    Ok(())
}
