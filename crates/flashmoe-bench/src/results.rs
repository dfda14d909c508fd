//! The results data model: what a benchmark run produces and what every report and
//! `compare` consume. Serialised as versioned JSON (see docs/results-schema.md); bump
//! [`SCHEMA_VERSION`] on any incompatible change.

use crate::decode::DecodeProblem;
use crate::e2e::problem::E2eProblem;
use crate::manifest::Manifest;
use crate::mla::MlaProblem;
use crate::stats::{Comparison, Summary};
use crate::varlen::VarlenProblem;
use flashmoe::{AttentionProblem, MoeProblem};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

pub const SCHEMA_VERSION: u32 = 1;

/// Prefix of an old build's implementations in a `bench --against` run (`old:NAME`).
pub const OLD_PREFIX: &str = "old:";

/// Start of the flag the pipeline puts on ceiling-only implementations.
pub const CEILING_ONLY_FLAG: &str = "ceiling only";

/// One whole run of `flashmoe bench`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResults {
    pub schema_version: u32,
    /// "attention" or "moe".
    pub suite: String,
    /// Preset name or config file path that defined the configs.
    pub source: String,
    pub manifest: Manifest,
    pub settings: MeasureSettings,
    /// Measured hardware ceilings (GPU runs only).
    #[serde(default)]
    pub ceilings: Option<Ceilings>,
    /// Name of the implementation whose speedups against every other are reported.
    pub candidate: String,
    pub configs: Vec<ConfigResult>,
    /// True when the run was interrupted (Ctrl-C): the configs present are complete.
    #[serde(default)]
    pub interrupted: bool,
}

/// The sampling policy used for every implementation of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeasureSettings {
    pub warmup_ms: f64,
    /// Stop when the relative half-width of the median's CI falls under this (0.01 = 1%).
    pub target_rel_ci: f64,
    pub min_samples: usize,
    pub max_samples: usize,
    /// Per-config wall-time cap for sampling, in ms.
    pub max_time_ms: f64,
    pub confidence: f64,
    pub bootstrap_resamples: usize,
    pub seed: u64,
    /// Practical threshold for verdicts (0.02 = 2%).
    pub threshold: f64,
    /// How caches were defeated between samples (e.g. "l2-flush 100 MB", "none (cpu)").
    pub cache_policy: String,
    pub timer: String,
    /// `bench --against`: sampling of a config goes on past `max_time_ms` until every
    /// (old:X, X) speedup CI resolves the threshold band, up to this cap in ms
    /// (`measure::ResolveRule`). `None` (and absent in older files): no such rule.
    #[serde(default)]
    pub against_max_time_ms: Option<f64>,
}

/// Ceilings measured in the same session, used for "% of ceiling".
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Dense bf16 GEMM throughput, TFLOP/s.
    pub gemm_tflops: f64,
    /// Description of the GEMM measured (e.g. "cuBLAS bf16 8192^3").
    pub gemm_desc: String,
    /// Device-to-device copy bandwidth counting read + write bytes, GB/s.
    pub copy_gbps: f64,
    /// The DRAM's peak bandwidth, GB/s: the driver's memory clock × bus width (a
    /// specification, not a measurement; absent in files written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hbm_peak_gbps: Option<f64>,
}

impl Ceilings {
    /// `gbps` as a percentage of the DRAM's peak bandwidth, where it is known.
    pub fn pct_of_hbm_peak(&self, gbps: f64) -> Option<f64> {
        self.hbm_peak_gbps
            .filter(|&peak| peak > 0.0)
            .map(|peak| 100.0 * gbps / peak)
    }
}

/// The problem a config describes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum ProblemSpec {
    Attention(AttentionProblem),
    Moe(MoeProblem),
    /// A paged-KV decode step (`flashmoe bench decode`).
    Decode(DecodeProblem),
    /// A packed prefill over sequences of unequal lengths (`flashmoe bench varlen`).
    Varlen(VarlenProblem),
    /// A DeepSeek MLA decode step over a paged latent cache (`flashmoe bench mla`).
    Mla(MlaProblem),
    /// The backward (or forward + backward) of an attention, varlen or MoE layer
    /// (`bench --pass bwd|fwd+bwd`, `check --pass bwd`; `crate::grad`).
    Grad(crate::grad::problem::GradProblem),
    /// A whole decoder model's forward or training step in PyTorch (`flashmoe bench e2e`):
    /// measured by `python/flashmoe_e2e.py`, never by the kernel pipeline.
    E2e(E2eProblem),
}

impl ProblemSpec {
    pub fn id(&self) -> String {
        self.workload().id()
    }
    pub fn label(&self) -> String {
        self.workload().label()
    }
    /// The sweep axis used by plots: sequence length for attention, tokens for MoE, packed
    /// query tokens for varlen.
    pub fn x_value(&self) -> f64 {
        self.workload().x_value()
    }
    pub fn x_label(&self) -> &'static str {
        self.workload().x_label()
    }
    /// Plot series key: configs sharing it form one panel (e.g. head dim × causal).
    pub fn panel(&self) -> String {
        self.workload().panel()
    }
}

/// Everything measured for one config.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConfigResult {
    pub id: String,
    pub label: String,
    pub problem: ProblemSpec,
    /// Model FLOPs of the problem (see flashmoe::problem).
    pub flops: f64,
    /// Minimum bytes moved (each input read once, each output written once); decode: the
    /// K/V bytes the step must read (the cache read once); varlen: the packed tensors.
    pub min_bytes: f64,
    pub implementations: Vec<ImplResult>,
    /// The candidate against every other implementation that produced samples.
    pub comparisons: Vec<PairResult>,
    /// Set when the config as a whole failed (e.g. invalid for every implementation).
    #[serde(default)]
    pub error: Option<String>,
    /// MoE only: the reference routing's load statistics and losses.
    #[serde(default)]
    pub routing: Option<RoutingSummary>,
    /// The fixed calibration workload, measured interleaved with the implementations
    /// (absent in files written before it existed).
    #[serde(default)]
    pub calibration: Option<CalibrationResult>,
    /// How the measurement of this config ended (absent in files written before it was
    /// recorded).
    #[serde(default)]
    pub sampling: Option<SamplingRecord>,
}

/// Why sampling stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StopReason {
    /// Every median CI half-width fell under the target.
    Converged,
    /// `--against` (`measure::ResolveRule`): every pair's speedup CI resolved the threshold band.
    Resolved,
    SampleCap,
    TimeCap,
    /// The user interrupted (Ctrl-C); the samples are incomplete.
    Cancelled,
}

/// How a config's sampling ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingRecord {
    /// Why sampling stopped: "converged" (every median CI within the target), "resolved"
    /// (`--against`: every pair's CI resolved the threshold band), "sample-cap",
    /// "time-cap".
    pub stop: StopReason,
    /// Rounds measured (one sample of every implementation each).
    pub rounds: usize,
    /// Wall time of the rounds, ms.
    pub sampling_ms: f64,
}

/// A fixed reference workload timed in every round of a config's measurement, with the
/// same timer as the implementations. Its samples let `compare` of two separate runs
/// tell a change of the machine from a change of the code (ENV-DRIFT).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationResult {
    /// What was measured (two runs compare calibrations only when this is equal).
    pub workload: String,
    /// Raw per-round times in ms, in the order measured.
    pub samples_ms: Vec<f64>,
    #[serde(default)]
    pub error: Option<String>,
}

/// Load statistics of a MoE config's routing (the reference's, which every implementation
/// that passed the gate reproduced), and its auxiliary losses.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RoutingSummary {
    /// Token→expert assignments per expert (length = experts, sum = tokens·top_k).
    pub tokens_per_expert: Vec<usize>,
    pub min_load: usize,
    pub max_load: usize,
    pub mean_load: f64,
    /// max / mean: how much longer the busiest expert works than a balanced one.
    pub max_over_mean: f64,
    /// Coefficient of variation of the loads (std / mean, population std).
    pub cv: f64,
    pub empty_experts: usize,
    pub aux_loss: f64,
    pub z_loss: f64,
}

impl RoutingSummary {
    pub fn from_counts(counts: &[usize], aux_loss: f64, z_loss: f64) -> RoutingSummary {
        let n = counts.len().max(1) as f64;
        let mean = counts.iter().sum::<usize>() as f64 / n;
        let var = counts
            .iter()
            .map(|&c| (c as f64 - mean).powi(2))
            .sum::<f64>()
            / n;
        let max = counts.iter().copied().max().unwrap_or(0);
        let ratio = |a: f64| if mean > 0.0 { a / mean } else { 0.0 };
        RoutingSummary {
            tokens_per_expert: counts.to_vec(),
            min_load: counts.iter().copied().min().unwrap_or(0),
            max_load: max,
            mean_load: mean,
            max_over_mean: ratio(max as f64),
            cv: ratio(var.sqrt()),
            empty_experts: counts.iter().filter(|&&c| c == 0).count(),
            aux_loss,
            z_loss,
        }
    }
}

impl ConfigResult {
    /// The fastest implementation other than `candidate` that passed the gate, is not a
    /// ceiling-only measurement and is not an old build's (`bench --against`): what a user
    /// would otherwise pick, and seed 003's reference.
    pub fn best_baseline(&self, candidate: &str) -> Option<&ImplResult> {
        self.implementations
            .iter()
            .filter(|i| {
                i.name != candidate
                    && i.is_usable()
                    && !i.is_ceiling_only()
                    && !i.name.starts_with(OLD_PREFIX)
            })
            .filter_map(|i| i.median_ms().map(|m| (i, m)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }
}

/// Correctness of one implementation's output against the reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AccuracyResult {
    pub max_abs: f64,
    pub mean_abs: f64,
    pub max_rel: f64,
    pub rel_l2: f64,
    pub non_finite: usize,
    /// Relative-L2 tolerance applied.
    pub tolerance_rel_l2: f64,
    /// Worst per-row relative L2 error (`flashmoe::accuracy`: a row is one query row of
    /// one head for attention, one token for MoE; judged against max(‖ref_row‖, RMS row
    /// norm / 16)). Absent in files written before the per-row gate.
    #[serde(default)]
    pub max_row_rel_l2: Option<f64>,
    /// Index of that row in the output (row-major over the leading dims).
    #[serde(default)]
    pub worst_row: Option<usize>,
    /// Per-row tolerance applied to `max_row_rel_l2`.
    #[serde(default)]
    pub tolerance_row_rel_l2: Option<f64>,
    pub passed: bool,
    /// What the implementation was checked against (e.g. "cpu-f64").
    pub reference: String,
    #[serde(default)]
    pub note: Option<String>,
}

impl AccuracyResult {
    /// A check's metrics, tolerances and verdict as the results record them.
    pub fn from_check(
        c: &flashmoe::accuracy::Check,
        reference: &str,
        note: Option<String>,
    ) -> AccuracyResult {
        AccuracyResult {
            max_abs: c.metrics.max_abs,
            mean_abs: c.metrics.mean_abs,
            max_rel: c.metrics.max_rel,
            rel_l2: c.metrics.rel_l2,
            non_finite: c.metrics.non_finite,
            tolerance_rel_l2: c.tolerance.rel_l2,
            max_row_rel_l2: (c.metrics.rows > 0).then_some(c.metrics.max_row_rel_l2),
            worst_row: c.metrics.worst_row,
            tolerance_row_rel_l2: (c.metrics.rows > 0).then_some(c.tolerance.row_rel_l2),
            passed: c.passed,
            reference: reference.to_string(),
            note,
        }
    }
}

/// One implementation on one config.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ImplResult {
    pub name: String,
    /// Where it ran: "cpu", "cuda", "python".
    pub backend: String,
    /// Raw per-sample times in ms, in the order measured.
    pub samples_ms: Vec<f64>,
    #[serde(default)]
    pub summary: Option<Summary>,
    /// TFLOP/s at the median time.
    #[serde(default)]
    pub tflops: Option<f64>,
    /// GB/s of the minimum bytes at the median time.
    #[serde(default)]
    pub gbps: Option<f64>,
    /// Percent of the measured GEMM ceiling (GPU runs only) = compute floor (FLOPs at the
    /// GEMM ceiling) / median time.
    #[serde(default)]
    pub pct_of_gemm_ceiling: Option<f64>,
    /// Percent of the measured copy ceiling (GPU runs only) = memory floor (minimum bytes
    /// at the copy bandwidth) / median time.
    #[serde(default)]
    pub pct_of_copy_ceiling: Option<f64>,
    /// MoE router alone (logits, scoring + top-k, statistics), median ms, when the
    /// implementation can time it separately (flashmoe-moe).
    #[serde(default)]
    pub router_ms: Option<f64>,
    /// Peak extra device/host memory the implementation allocated, bytes.
    #[serde(default)]
    pub peak_extra_bytes: Option<u64>,
    #[serde(default)]
    pub accuracy: Option<AccuracyResult>,
    /// Checksum of the inputs this implementation consumed (identical-input proof).
    #[serde(default)]
    pub input_checksum: Option<String>,
    /// Set when the implementation could not run this config ("n/a: ..." or an error).
    #[serde(default)]
    pub error: Option<String>,
    /// Warnings such as implausible throughput.
    #[serde(default)]
    pub flags: Vec<String>,
    /// `bench e2e --train`: the loss of every step, in order (absent elsewhere).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_curve: Option<Vec<f64>>,
    /// Suite-specific quantities, the unit in the name's suffix (`tokens_per_s`,
    /// `dispatch_busbw_gbs`, `state_bytes`, ...); empty (and absent) for the kernel suites.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
}

impl ImplResult {
    /// A row with nothing measured yet.
    pub fn new(name: &str, backend: &str) -> ImplResult {
        ImplResult {
            name: name.to_string(),
            backend: backend.to_string(),
            samples_ms: Vec::new(),
            summary: None,
            tflops: None,
            gbps: None,
            pct_of_gemm_ceiling: None,
            pct_of_copy_ceiling: None,
            router_ms: None,
            peak_extra_bytes: None,
            accuracy: None,
            input_checksum: None,
            error: None,
            flags: Vec::new(),
            loss_curve: None,
            metrics: BTreeMap::new(),
        }
    }
    pub fn median_ms(&self) -> Option<f64> {
        self.summary.as_ref().map(|s| s.median)
    }
    /// A throughput ceiling whose output is not the problem's (flagged by the pipeline).
    pub fn is_ceiling_only(&self) -> bool {
        self.flags.iter().any(|f| f.starts_with(CEILING_ONLY_FLAG))
    }
    /// Usable for comparisons: has samples and did not fail correctness.
    pub fn is_usable(&self) -> bool {
        self.error.is_none()
            && !self.samples_ms.is_empty()
            && self.accuracy.as_ref().is_none_or(|a| a.passed)
    }
}

/// Candidate vs one other implementation within a config.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PairResult {
    pub candidate: String,
    pub baseline: String,
    pub comparison: Comparison,
}
