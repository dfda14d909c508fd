//! `flashmoe bench e2e`: whole decoder models in PyTorch. `python/flashmoe_e2e.py` builds
//! the models, runs every implementation's gate (logits against an fp32 forward, or with
//! `--train` the loss curve against a baseline's) and times them; it writes the raw
//! samples as a [`SamplesFile`]. This module turns that file into a [`RunResults`] through
//! [`crate::recorded`], so an e2e run has the statistics, reports and `compare` of every
//! other suite.
//!
//! Mapping (docs/results-schema.md, `kind: "e2e"`): a config is one model × batch × seq
//! ([`E2eProblem`]); the samples are whole forwards (or training steps) in ms; the gate's
//! outcome is the row's [`AccuracyResult`] (`rel_l2` of the logits and its bound; for
//! `--train` the loss curve's deviation from the reference curve); peak memory is
//! `peak_extra_bytes`; tokens/s, the first call's time, the training state and the final
//! loss are `metrics`; the loss curve is `loss_curve`.

pub mod problem;
use crate::manifest::{Manifest, PythonManifest};
use crate::recorded::{self, RecordedConfig};
use crate::results::{
    AccuracyResult, ImplResult, MeasureSettings, ProblemSpec, RunResults, SamplingRecord,
    SCHEMA_VERSION,
};
use crate::workload::Workload;
use anyhow::{bail, Context};
use flashmoe::DType;
pub use problem::{E2eMode, E2eProblem, ModelShape};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// The `schema` tag of the script's samples file this build reads.
pub const SAMPLES_SCHEMA: &str = "flashmoe-e2e-samples/1";
/// The samples file's name in the output directory.
pub const SAMPLES_FILE: &str = "e2e-samples.json";

// The problem types live in `problem.rs` (below the results model, which names them).
impl Workload for E2eProblem {
    fn id(&self) -> String {
        format!(
            "e2e_{}_b{}_s{}_{}{}",
            self.model,
            self.batch,
            self.seq,
            self.dtype,
            match self.mode {
                E2eMode::Inference => "",
                E2eMode::Train => "_train",
            }
        )
    }
    fn label(&self) -> String {
        let what = match (self.mode, self.steps) {
            (E2eMode::Inference, _) => "forward".to_string(),
            (E2eMode::Train, Some(n)) => format!("training step ({n} steps)"),
            (E2eMode::Train, None) => "training step".to_string(),
        };
        format!(
            "{} ({} layers), batch {} × seq {}, {} {what}",
            self.model, self.shape.layers, self.batch, self.seq, self.dtype
        )
    }
    fn x_value(&self) -> f64 {
        self.tokens() as f64
    }
    fn x_label(&self) -> &'static str {
        "tokens (batch × seq)"
    }
    fn panel(&self) -> String {
        format!(
            "e2e {} {} {}",
            self.model,
            match self.mode {
                E2eMode::Inference => "forward",
                E2eMode::Train => "train",
            },
            self.dtype
        )
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    /// A training step counts three forwards (the backward as two).
    fn flops(&self) -> f64 {
        match self.mode {
            E2eMode::Inference => self.forward_flops(),
            E2eMode::Train => 3.0 * self.forward_flops(),
        }
    }
    /// The kernel pipeline cannot run a model: only `bench e2e` measures these.
    fn validate(&self) -> flashmoe::Result<()> {
        Err(flashmoe::Error::invalid(format!(
            "{} is an end-to-end model: `flashmoe bench e2e` measures it, not the kernel \
             pipeline",
            self.model
        )))
    }
    /// One token's logits.
    fn gate_row_len(&self) -> usize {
        self.shape.vocab
    }
}

// ---------------------------------------------------------------------------------------
// The script's samples file
// ---------------------------------------------------------------------------------------

/// `e2e-samples.json` as `python/flashmoe_e2e.py` writes it: the raw record of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SamplesFile {
    pub schema: String,
    pub mode: E2eMode,
    pub preset: String,
    pub seed: u64,
    /// "bfloat16" or "float32" (torch's names).
    pub dtype: String,
    /// Timer description, e.g. "cuda events (torch.cuda.Event)".
    pub timer: String,
    pub python: ScriptEnv,
    pub settings: ScriptSettings,
    pub configs: Vec<SampledConfig>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ScriptEnv {
    pub python: String,
    pub torch: String,
    #[serde(default)]
    pub cuda: String,
    #[serde(default)]
    pub cudnn: String,
    #[serde(default)]
    pub triton: String,
    /// The GPU torch ran on, or the CPU.
    pub device: String,
}

/// The script's sampling policy and gate constants.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ScriptSettings {
    /// Untimed calls (inference) or steps (train) per implementation before timing.
    pub warmup: usize,
    #[serde(default)]
    pub min_rounds: usize,
    #[serde(default)]
    pub max_rounds: usize,
    /// Seconds of timed rounds per config (inference).
    #[serde(default)]
    pub max_time_s: f64,
    /// Train: steps per implementation.
    #[serde(default)]
    pub steps: Option<usize>,
    /// Inference gate: logits rel L2 ≤ clamp(factor × eager bf16's, floor, cap).
    #[serde(default)]
    pub gate_factor: Option<f64>,
    #[serde(default)]
    pub gate_floor: Option<f64>,
    #[serde(default)]
    pub gate_cap: Option<f64>,
    /// Train gate: |Δloss| (windowed) ≤ max(loss_floor, noise_mult × the measured noise
    /// floor), or ≤ max(loss_floor, loss_relative · loss) where no noise was measured (and in
    /// files without `noise_mult`, per step).
    #[serde(default)]
    pub loss_floor: Option<f64>,
    #[serde(default)]
    pub loss_relative: Option<f64>,
    #[serde(default)]
    pub noise_mult: Option<f64>,
    #[serde(default)]
    pub lr: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampledConfig {
    pub model: String,
    pub shape: ModelShape,
    pub batch: usize,
    pub seq: usize,
    pub weight_bytes: u64,
    /// Timed rounds (inference) or steps (train) and their wall time.
    pub rounds: usize,
    pub sampling_s: f64,
    /// Inference: the eager bf16 forward's logits rel L2 and the gate it sets.
    #[serde(default)]
    pub bf16_rel_l2: Option<f64>,
    #[serde(default)]
    pub gate_rel_l2: Option<f64>,
    /// Train: the implementation whose loss curve the others are checked against, the
    /// second baseline whose distance from it is the noise floor, the window (steps) the
    /// curves are averaged over.
    #[serde(default)]
    pub loss_reference: Option<String>,
    #[serde(default)]
    pub loss_noise_partner: Option<String>,
    #[serde(default)]
    pub loss_window: Option<usize>,
    pub implementations: Vec<SampledImpl>,
}

/// One implementation on one config, raw.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SampledImpl {
    pub name: String,
    /// "ok", "failed-gate", "n/a", "oom" or "error".
    pub status: String,
    #[serde(default)]
    pub notes: Vec<String>,
    /// Timed forwards or steps, ms, in measurement order.
    #[serde(default)]
    pub samples_ms: Vec<f64>,
    #[serde(default)]
    pub peak_extra_bytes: Option<u64>,
    /// The first call (compiles where compiled), ms.
    #[serde(default)]
    pub first_call_ms: Option<f64>,
    /// Inference gate: the logits against the fp32 forward.
    #[serde(default)]
    pub logits: Option<LogitsError>,
    /// Train: the loss of every step (null where it was not finite); the gate's worst step.
    #[serde(default)]
    pub loss_curve: Option<Vec<Option<f64>>>,
    #[serde(default)]
    pub loss_worst_step: Option<usize>,
    /// Train: parameters + gradients + optimiser state, bytes.
    #[serde(default)]
    pub state_bytes: Option<u64>,
}

/// The logits of one implementation against the fp32 forward (rows are tokens).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LogitsError {
    pub rel_l2: Option<f64>,
    pub max_abs: Option<f64>,
    pub mean_abs: Option<f64>,
    pub max_rel: Option<f64>,
    pub non_finite: usize,
    pub max_row_rel_l2: Option<f64>,
    pub worst_row: Option<usize>,
}

impl SamplesFile {
    pub fn read(path: &Path) -> anyhow::Result<SamplesFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the e2e samples file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{}", path.display()))
    }

    pub fn parse(text: &str) -> anyhow::Result<SamplesFile> {
        let v: serde_json::Value =
            serde_json::from_str(text).context("not an e2e samples file: not valid JSON")?;
        match v.get("schema").and_then(|s| s.as_str()) {
            Some(SAMPLES_SCHEMA) => {}
            Some(other) => bail!(
                "e2e samples schema '{other}': this flashmoe reads '{SAMPLES_SCHEMA}' \
                 (python/flashmoe_e2e.py of the same checkout writes it)"
            ),
            None => bail!("not an e2e samples file: no 'schema' field"),
        }
        serde_json::from_str(text).context("the e2e samples file does not match its schema")
    }

    /// Did any implementation fail its gate or error (n/a and out-of-memory do not count),
    /// or the planted wrong gradient pass the train gate?
    pub fn any_failed(&self) -> bool {
        self.configs
            .iter()
            .flat_map(|c| &c.implementations)
            .any(|i| match (i.name.as_str(), i.status.as_str()) {
                (PLANTED, s) => s == "error" || (s == "ok" && i.loss_curve.is_some()),
                (_, s) => matches!(s, "failed-gate" | "error"),
            })
    }
}

/// The train run's implementation with a deliberately wrong backward
/// (`python/flashmoe_e2e_common.py`): its gate must fail.
pub const PLANTED: &str = "planted-wrong-dk";

/// Implementations preferred as the candidate, in order.
const CANDIDATES: [&str; 3] = ["flashmoe", "flashmoe+compile", "flashmoe-attn"];

fn dtype_of(torch_name: &str) -> anyhow::Result<DType> {
    torch_name
        .parse::<DType>()
        .map_err(|e| anyhow::anyhow!("e2e samples: dtype '{torch_name}': {e}"))
}

/// The run's settings as the script sampled: the timed rounds' bounds and time cap,
/// warm-up by calls (`warmup_ms` 0; the count is in `cache_policy`), no CI target.
fn settings_of(f: &SamplesFile) -> MeasureSettings {
    let s = &f.settings;
    let (min, max, max_time_ms, policy) = match f.mode {
        E2eMode::Inference => (
            s.min_rounds,
            s.max_rounds,
            s.max_time_s * 1e3,
            format!(
                "none: weights resident; {} untimed forwards per implementation before the \
                 interleaved rounds",
                s.warmup
            ),
        ),
        E2eMode::Train => {
            let timed = s.steps.unwrap_or(0).saturating_sub(s.warmup);
            (
                timed,
                timed,
                0.0,
                format!(
                    "none: every step timed round-robin after {} untimed warm-up steps",
                    s.warmup
                ),
            )
        }
    };
    MeasureSettings {
        warmup_ms: 0.0,
        target_rel_ci: 0.0,
        min_samples: min,
        max_samples: max,
        max_time_ms,
        confidence: 0.95,
        bootstrap_resamples: 2000,
        seed: f.seed,
        threshold: 0.02,
        cache_policy: policy,
        timer: f.timer.clone(),
        against_max_time_ms: None,
    }
}

fn logits_accuracy(
    c: &SampledConfig,
    i: &SampledImpl,
    s: &ScriptSettings,
) -> Option<AccuracyResult> {
    let l = i.logits.as_ref()?;
    let nan = f64::NAN;
    let gate = c.gate_rel_l2.unwrap_or(nan);
    let note = format!(
        "gate: logits rel L2 ≤ {} × eager's {} (clamped to [{}, {}]) = {gate:.3e}",
        s.gate_factor.unwrap_or(nan),
        c.bf16_rel_l2.map_or("—".into(), |e| format!("{e:.3e}")),
        s.gate_floor.unwrap_or(nan),
        s.gate_cap.unwrap_or(nan),
    );
    let failed_note = i.notes.first().filter(|_| i.status == "failed-gate");
    Some(AccuracyResult {
        max_abs: l.max_abs.unwrap_or(nan),
        mean_abs: l.mean_abs.unwrap_or(nan),
        max_rel: l.max_rel.unwrap_or(nan),
        rel_l2: l.rel_l2.unwrap_or(nan),
        non_finite: l.non_finite,
        tolerance_rel_l2: gate,
        max_row_rel_l2: l.max_row_rel_l2,
        worst_row: l.worst_row,
        tolerance_row_rel_l2: None,
        passed: i.status != "failed-gate",
        reference: "fp32 forward of the same weights".into(),
        note: Some(match failed_note {
            Some(n) => format!("{n}; {note}"),
            None => note,
        }),
    })
}

/// The loss curve against the reference's: |Δ| per step (rows are steps).
fn curve_accuracy(
    c: &SampledConfig,
    i: &SampledImpl,
    s: &ScriptSettings,
) -> Option<AccuracyResult> {
    let curve = i.loss_curve.as_ref()?;
    let ref_name = c.loss_reference.as_ref()?;
    let reference = c
        .implementations
        .iter()
        .find(|r| &r.name == ref_name)?
        .loss_curve
        .as_ref()?;
    let nan = |v: &Option<f64>| v.unwrap_or(f64::NAN);
    let curve: Vec<f64> = curve.iter().map(nan).collect();
    let reference: Vec<f64> = reference.iter().map(nan).collect();
    let n = curve.len().min(reference.len());
    let (mut max_abs, mut sum_abs, mut max_rel, mut d2, mut r2) = (0f64, 0f64, 0f64, 0f64, 0f64);
    let mut non_finite = 0;
    for (&a, &b) in curve[..n].iter().zip(&reference[..n]) {
        if !(a.is_finite() && b.is_finite()) {
            non_finite += 1;
            continue;
        }
        let d = (a - b).abs();
        max_abs = max_abs.max(d);
        sum_abs += d;
        max_rel = max_rel.max(d / b.abs().max(1e-12));
        d2 += d * d;
        r2 += b * b;
    }
    let floor = s.loss_floor.unwrap_or(f64::NAN);
    let relative = s.loss_relative.unwrap_or(f64::NAN);
    let w = c.loss_window.unwrap_or(1);
    let mut note = match (s.noise_mult, &c.loss_noise_partner) {
        (Some(m), Some(partner)) => format!(
            "|Δloss| averaged over {w} steps ≤ max({floor}, {m} × the noise floor: the \
             largest such gap over the run between {ref_name} and {partner}, same \
             initialisation) against {ref_name}'s curve"
        ),
        (Some(_), None) => format!(
            "|Δloss| averaged over {w} steps ≤ max({floor}, {relative} · loss) against \
             {ref_name}'s curve (one baseline: noise floor not measured)"
        ),
        (None, _) => format!(
            "per-step bound |Δloss| ≤ max({floor}, {relative} · loss) against {ref_name}'s curve"
        ),
    };
    if i.name == PLANTED {
        note = format!("a planted wrong gradient: the gate must fail it; {note}");
    }
    if let Some(w) = i.loss_worst_step {
        note = format!("worst step {w}; {note}");
    }
    if i.status == "failed-gate" {
        if let Some(n) = i.notes.first() {
            note = format!("{n}; {note}");
        }
    }
    Some(AccuracyResult {
        max_abs,
        mean_abs: if n > 0 { sum_abs / n as f64 } else { f64::NAN },
        max_rel,
        rel_l2: if r2 > 0.0 { (d2 / r2).sqrt() } else { f64::NAN },
        non_finite,
        tolerance_rel_l2: relative,
        max_row_rel_l2: None,
        worst_row: i.loss_worst_step,
        tolerance_row_rel_l2: None,
        passed: i.status != "failed-gate" && non_finite == 0,
        reference: format!("{ref_name} loss curve"),
        note: Some(note),
    })
}

/// A loss curve up to its first non-finite step, and that step.
fn finite_curve(curve: &[Option<f64>]) -> (Vec<f64>, Option<usize>) {
    let end = curve.iter().position(|l| !l.is_some_and(f64::is_finite));
    let kept = curve[..end.unwrap_or(curve.len())]
        .iter()
        .map(|l| l.unwrap_or(f64::NAN))
        .collect();
    (kept, end)
}

fn impl_row(f: &SamplesFile, c: &SampledConfig, i: &SampledImpl) -> ImplResult {
    let mut row = ImplResult::new(&i.name, "python");
    let notes = i.notes.join("; ");
    match i.status.as_str() {
        "n/a" => row.error = Some(format!("n/a: {notes}")),
        "oom" => row.error = Some(format!("out of memory: {notes}")),
        "error" => {
            row.error = Some(if notes.is_empty() {
                "error".into()
            } else {
                notes
            })
        }
        _ => {}
    }
    row.accuracy = match f.mode {
        E2eMode::Inference => logits_accuracy(c, i, &f.settings),
        E2eMode::Train => curve_accuracy(c, i, &f.settings),
    };
    if f.mode == E2eMode::Inference && i.status == "failed-gate" {
        row.error = Some("correctness gate failed: not timed".into());
    }
    if matches!(i.status.as_str(), "ok" | "failed-gate") {
        // The gate's own message is in the accuracy note; the rest are warnings.
        let skip = usize::from(i.status == "failed-gate");
        row.flags.extend(i.notes.iter().skip(skip).cloned());
    }
    row.samples_ms = i.samples_ms.clone();
    row.peak_extra_bytes = i.peak_extra_bytes;
    let mut m = BTreeMap::new();
    if !i.samples_ms.is_empty() {
        let med = crate::stats::median(&i.samples_ms);
        if med > 0.0 {
            m.insert(
                "tokens_per_s".into(),
                (c.batch * c.seq) as f64 / (med * 1e-3),
            );
        }
    }
    if let Some(t) = i.first_call_ms {
        m.insert("first_call_ms".into(), t);
    }
    if let Some(b) = i.state_bytes {
        m.insert("state_bytes".into(), b as f64);
    }
    if let Some(curve) = &i.loss_curve {
        let (kept, cut) = finite_curve(curve);
        match cut {
            Some(step) => row.flags.push(format!(
                "the loss is not finite from step {step}: the curve stops there"
            )),
            None => {
                if let Some(last) = kept.last() {
                    m.insert("final_loss".into(), *last);
                }
            }
        }
        row.loss_curve = Some(kept);
    }
    row.metrics = m;
    row
}

/// The run as the lab's results: one config per model × shape, the script's gate as
/// each row's accuracy, the pipeline's statistics. `manifest` is the host's (written by
/// `bench e2e` before the script ran); the script's Python/torch versions are added.
/// `candidate`: the implementation whose speedups are reported (default: flashmoe, else
/// flashmoe+compile, flashmoe-attn, else the first implementation).
pub fn to_run_results(
    f: &SamplesFile,
    mut manifest: Manifest,
    candidate: Option<&str>,
) -> anyhow::Result<RunResults> {
    let dtype = dtype_of(&f.dtype)?;
    manifest.python = Some(PythonManifest {
        python: f.python.python.clone(),
        torch: f.python.torch.clone(),
        cuda: f.python.cuda.clone(),
        cudnn: f.python.cudnn.clone(),
        triton: f.python.triton.clone(),
        gpu_name: f.python.device.clone(),
        packages: Vec::new(),
        skipped: Vec::new(),
    });
    let settings = settings_of(f);
    let names = || {
        f.configs
            .iter()
            .flat_map(|c| c.implementations.iter().map(|i| i.name.as_str()))
    };
    let candidate = match candidate {
        Some(c) if names().any(|n| n == c) => c.to_string(),
        Some(c) => bail!(
            "--candidate {c}: the samples have no such implementation (they have: {})",
            names()
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        ),
        None => recorded::pick_candidate(names(), &CANDIDATES),
    };
    let configs = f
        .configs
        .iter()
        .map(|c| {
            let problem = E2eProblem {
                model: c.model.clone(),
                mode: f.mode,
                shape: c.shape.clone(),
                batch: c.batch,
                seq: c.seq,
                dtype,
                steps: f.settings.steps.filter(|_| f.mode == E2eMode::Train),
            };
            let rows = c
                .implementations
                .iter()
                .map(|i| impl_row(f, c, i))
                .collect();
            let max = settings.max_samples;
            recorded::finish_config(
                RecordedConfig {
                    id: None,
                    label: None,
                    problem: ProblemSpec::E2e(problem),
                    min_bytes: c.weight_bytes as f64,
                    implementations: rows,
                    error: None,
                    sampling: Some(SamplingRecord {
                        stop: if c.rounds >= max {
                            crate::results::StopReason::SampleCap
                        } else {
                            crate::results::StopReason::TimeCap
                        },
                        rounds: c.rounds,
                        sampling_ms: c.sampling_s * 1e3,
                    }),
                },
                &candidate,
                &settings,
            )
        })
        .collect();
    Ok(RunResults {
        schema_version: SCHEMA_VERSION,
        suite: match f.mode {
            E2eMode::Inference => "e2e".into(),
            E2eMode::Train => "e2e-train".into(),
        },
        source: f.preset.clone(),
        manifest,
        settings,
        ceilings: None,
        candidate,
        configs,
        interrupted: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            layers: 2,
            hidden: 128,
            heads: 4,
            kv_heads: 2,
            head_dim: 32,
            ffn: Some(256),
            experts: None,
            top_k: None,
            moe_ffn: None,
            vocab: 32000,
        }
    }

    fn imp(name: &str, status: &str, median: f64) -> SampledImpl {
        SampledImpl {
            name: name.into(),
            status: status.into(),
            notes: if status == "ok" {
                vec![]
            } else {
                vec![format!("{name} went {status}")]
            },
            samples_ms: if matches!(status, "ok") {
                crate::report::fixtures::noisy_samples(median, 0.01, 20, median.to_bits())
            } else {
                vec![]
            },
            peak_extra_bytes: Some(1 << 20),
            first_call_ms: Some(3.0),
            logits: Some(LogitsError {
                rel_l2: Some(if status == "failed-gate" { 0.9 } else { 0.013 }),
                max_abs: Some(0.1),
                mean_abs: Some(0.01),
                max_rel: Some(0.2),
                non_finite: 0,
                max_row_rel_l2: Some(0.02),
                worst_row: Some(7),
            }),
            loss_curve: None,
            loss_worst_step: None,
            state_bytes: None,
        }
    }

    fn file(mode: E2eMode, impls: Vec<SampledImpl>) -> SamplesFile {
        SamplesFile {
            schema: SAMPLES_SCHEMA.into(),
            mode,
            preset: "smoke".into(),
            seed: 1,
            dtype: "bfloat16".into(),
            timer: "cuda events".into(),
            python: ScriptEnv {
                python: "3.12".into(),
                torch: "2.9".into(),
                device: "GPU".into(),
                ..Default::default()
            },
            settings: ScriptSettings {
                warmup: 2,
                min_rounds: 5,
                max_rounds: 30,
                max_time_s: 3.0,
                steps: (mode == E2eMode::Train).then_some(10),
                gate_factor: Some(1.5),
                gate_floor: Some(0.01),
                gate_cap: Some(0.25),
                loss_floor: Some(0.05),
                loss_relative: Some(0.02),
                noise_mult: (mode == E2eMode::Train).then_some(4.0),
                lr: None,
            },
            configs: vec![SampledConfig {
                model: "tiny".into(),
                shape: shape(),
                batch: 2,
                seq: 64,
                weight_bytes: 20_000_000,
                rounds: 20,
                sampling_s: 1.5,
                bf16_rel_l2: Some(0.0134),
                gate_rel_l2: Some(0.0201),
                loss_reference: (mode == E2eMode::Train).then(|| "eager".into()),
                loss_noise_partner: (mode == E2eMode::Train).then(|| "sdpa-math".into()),
                loss_window: (mode == E2eMode::Train).then_some(2),
                implementations: impls,
            }],
        }
    }

    #[test]
    fn inference_samples_become_a_run_with_gates_and_comparisons() {
        let f = file(
            E2eMode::Inference,
            vec![
                imp("eager", "ok", 10.0),
                imp("sdpa-flash", "ok", 8.0),
                imp("flashmoe", "ok", 6.0),
                imp("sdpa-cudnn", "n/a", 0.0),
                imp("flashmoe+compile", "failed-gate", 0.0),
            ],
        );
        let text = serde_json::to_string(&f).unwrap();
        let f = SamplesFile::parse(&text).unwrap();
        assert!(f.any_failed());
        let r = to_run_results(&f, Manifest::default(), None).unwrap();
        assert_eq!(
            (r.suite.as_str(), r.candidate.as_str()),
            ("e2e", "flashmoe")
        );
        let c = &r.configs[0];
        assert_eq!(c.id, "e2e_tiny_b2_s64_bf16");
        assert_eq!(c.problem.x_value(), 128.0);
        let row = |n: &str| c.implementations.iter().find(|i| i.name == n).unwrap();
        let fm = row("flashmoe");
        let acc = fm.accuracy.as_ref().unwrap();
        assert!(acc.passed && acc.tolerance_rel_l2 == 0.0201 && acc.rel_l2 == 0.013);
        assert_eq!(fm.summary.as_ref().unwrap().n, 20);
        let tps = fm.metrics["tokens_per_s"];
        assert!((tps - 128.0 / (crate::stats::median(&fm.samples_ms) * 1e-3)).abs() < 1e-6);
        assert!(row("sdpa-cudnn")
            .error
            .as_deref()
            .unwrap()
            .starts_with("n/a: "));
        let bad = row("flashmoe+compile");
        assert!(!bad.accuracy.as_ref().unwrap().passed);
        assert!(bad.error.as_deref().unwrap().contains("gate failed"));
        // flashmoe against the two usable baselines, faster than both.
        assert_eq!(c.comparisons.len(), 2);
        for p in &c.comparisons {
            assert_eq!(p.candidate, "flashmoe");
            assert_eq!(p.comparison.verdict, crate::stats::Verdict::Faster);
        }
        // Through the JSON round trip and every report.
        let back = crate::report::parse_json(&crate::report::to_json(&r).unwrap()).unwrap();
        assert_eq!(back.configs[0].problem, c.problem);
        assert!(crate::report::to_markdown(&r).contains("tok/s"));
        let _ = crate::report::to_html(&r);
        let _ = crate::report::to_csv(&r).unwrap();
    }

    #[test]
    fn train_samples_carry_the_loss_curves_and_their_gate() {
        let mut eager = imp("eager", "ok", 30.0);
        eager.loss_curve = Some(vec![Some(10.0), Some(9.0), Some(8.0)]);
        eager.state_bytes = Some(4096);
        let mut fm = imp("flashmoe-attn", "ok", 20.0);
        fm.loss_curve = Some(vec![Some(10.0), Some(9.01), Some(8.03)]);
        let mut bad = imp("flashmoe", "failed-gate", 15.0);
        bad.samples_ms = crate::report::fixtures::noisy_samples(15.0, 0.01, 20, 9);
        bad.loss_curve = Some(vec![Some(10.0), Some(9.5), None]);
        bad.loss_worst_step = Some(2);
        let f = file(E2eMode::Train, vec![eager, fm, bad]);
        let r = to_run_results(&f, Manifest::default(), None).unwrap();
        assert_eq!(
            (r.suite.as_str(), r.candidate.as_str()),
            ("e2e-train", "flashmoe")
        );
        assert_eq!((r.settings.min_samples, r.settings.max_samples), (8, 8));
        let c = &r.configs[0];
        assert!(c.id.ends_with("_train"));
        let a = c.implementations[1].accuracy.as_ref().unwrap();
        assert!(a.passed && (a.max_abs - 0.03).abs() < 1e-9);
        assert_eq!(a.reference, "eager loss curve");
        let note = a.note.as_deref().unwrap();
        assert!(
            note.contains("4 × the noise floor: the largest such gap over the run between eager and sdpa-math"),
            "{note}"
        );
        let b = &c.implementations[2];
        let ba = b.accuracy.as_ref().unwrap();
        assert!(!ba.passed && ba.max_abs == 0.5 && ba.worst_row == Some(2));
        assert_eq!(ba.non_finite, 1);
        assert_eq!(b.loss_curve.as_deref(), Some(&[10.0, 9.5][..]));
        assert!(b.flags.iter().any(|f| f.contains("not finite from step 2")));
        // A training step that failed its curve keeps its samples but is not compared.
        assert!(b.summary.is_some() && !b.is_usable());
        assert!(c.comparisons.is_empty());
        assert_eq!(c.implementations[0].metrics["final_loss"], 8.0);
        assert_eq!(c.implementations[0].loss_curve.as_ref().unwrap().len(), 3);
        assert!(
            (c.flops
                - 3.0
                    * match &c.problem {
                        ProblemSpec::E2e(p) => p.forward_flops(),
                        _ => unreachable!(),
                    })
            .abs()
                < 1.0
        );
    }

    #[test]
    fn the_planted_wrong_gradient_must_fail_the_train_gate() {
        let mut eager = imp("eager", "ok", 30.0);
        eager.loss_curve = Some(vec![Some(10.0), Some(9.0), Some(8.0)]);
        let mut planted = imp(PLANTED, "failed-gate", 30.0);
        planted.loss_curve = Some(vec![Some(10.0), Some(9.4), Some(8.9)]);
        let f = file(E2eMode::Train, vec![eager.clone(), planted.clone()]);
        assert!(
            !f.any_failed(),
            "the planted gradient failed its gate, as it must"
        );
        let r = to_run_results(&f, Manifest::default(), None).unwrap();
        let a = r.configs[0].implementations[1].accuracy.as_ref().unwrap();
        assert!(
            !a.passed
                && a.note
                    .as_deref()
                    .unwrap()
                    .contains("planted wrong gradient")
        );
        planted.status = "ok".into();
        planted.notes = vec!["the gate passed a planted wrong gradient".into()];
        let f = file(E2eMode::Train, vec![eager, planted]);
        assert!(
            f.any_failed(),
            "a gate that passes the planted gradient fails the run"
        );
    }

    #[test]
    fn foreign_or_old_samples_files_are_refused_by_name() {
        let e = SamplesFile::parse("{\"schema\": \"flashmoe-e2e/1\"}").unwrap_err();
        assert!(format!("{e:#}").contains("flashmoe-e2e-samples/1"), "{e:#}");
        let e = SamplesFile::parse("[]").unwrap_err();
        assert!(format!("{e:#}").contains("no 'schema'"), "{e:#}");
    }

    #[test]
    fn flops_count_projections_attention_mlp_and_head() {
        let p = E2eProblem {
            model: "m".into(),
            mode: E2eMode::Inference,
            shape: ModelShape {
                layers: 1,
                hidden: 8,
                heads: 2,
                kv_heads: 1,
                head_dim: 4,
                ffn: Some(16),
                experts: None,
                top_k: None,
                moe_ffn: None,
                vocab: 10,
            },
            batch: 1,
            seq: 2,
            dtype: DType::F32,
            steps: None,
        };
        // qkv 2·2·8·16 + o 2·2·8·8 + attention 4·1·2·3·4 + MLP 6·2·8·16 + head 2·2·8·10.
        let want = 512.0 + 256.0 + 96.0 + 1536.0 + 320.0;
        assert_eq!(p.forward_flops(), want);
        assert!(p.validate().is_err());
    }
}
