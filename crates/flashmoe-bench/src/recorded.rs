//! Suites measured outside the kernel pipeline hand their raw samples here: `bench e2e`
//! (whole PyTorch models, timed by `python/flashmoe_e2e.py`) and `bench moe --gpus N`
//! (one process per rank, `crate::ep`). A config's rows become a [`ConfigResult`] with
//! the statistics every other suite gets — [`stats::summarize`] per implementation, the
//! candidate against every other usable implementation with [`stats::compare_samples`]
//! under the run's settings — so reports, `flashmoe report` and `flashmoe compare` read
//! them like any run.

use crate::results::{ConfigResult, ImplResult, MeasureSettings, PairResult, ProblemSpec};
use crate::results::{SamplingRecord, OLD_PREFIX};
use crate::stats::{self, VerdictOptions};

/// One config of a recorded suite before its statistics.
pub struct RecordedConfig {
    /// `None`: the problem's own id.
    pub id: Option<String>,
    /// `None`: the problem's own label.
    pub label: Option<String>,
    pub problem: ProblemSpec,
    pub min_bytes: f64,
    /// Rows with raw `samples_ms` and whatever the suite measured besides (accuracy,
    /// memory, metrics, errors); summaries and throughputs are filled here.
    pub implementations: Vec<ImplResult>,
    pub error: Option<String>,
    pub sampling: Option<SamplingRecord>,
}

/// The statistics of one recorded config: a summary, TFLOP/s and GB/s for every row
/// with samples, and the candidate against every other usable row.
pub fn finish_config(
    c: RecordedConfig,
    candidate: &str,
    settings: &MeasureSettings,
) -> ConfigResult {
    let flops = c.problem.workload().flops();
    let mut rows = c.implementations;
    for row in &mut rows {
        if row.samples_ms.is_empty() {
            continue;
        }
        let s = stats::summarize(
            &row.samples_ms,
            settings.confidence,
            settings.bootstrap_resamples,
            settings.seed,
        );
        let secs = s.median * 1e-3;
        if secs > 0.0 {
            row.tflops = Some(flops / secs / 1e12);
            row.gbps = Some(c.min_bytes / secs / 1e9);
        }
        row.summary = Some(s);
    }
    let opts = VerdictOptions {
        threshold: settings.threshold,
        alpha: 1.0 - settings.confidence,
        resamples: settings.bootstrap_resamples,
        seed: settings.seed,
    };
    let mut comparisons = Vec::new();
    if let Some(cand) = rows.iter().find(|r| r.name == candidate && r.is_usable()) {
        for other in rows.iter().filter(|r| r.name != candidate && r.is_usable()) {
            comparisons.push(PairResult {
                candidate: cand.name.clone(),
                baseline: other.name.clone(),
                comparison: stats::compare_samples(&other.samples_ms, &cand.samples_ms, &opts),
            });
        }
    }
    ConfigResult {
        id: c.id.unwrap_or_else(|| c.problem.id()),
        label: c.label.unwrap_or_else(|| c.problem.label()),
        problem: c.problem,
        flops,
        min_bytes: c.min_bytes,
        implementations: rows,
        comparisons,
        error: c.error,
        routing: None,
        calibration: None,
        sampling: c.sampling,
    }
}

/// The run's candidate: the first of `preferred` that some config has, else the first
/// implementation seen (never an old build's).
pub fn pick_candidate<'a>(names: impl IntoIterator<Item = &'a str>, preferred: &[&str]) -> String {
    let names: Vec<&str> = names
        .into_iter()
        .filter(|n| !n.starts_with(OLD_PREFIX))
        .collect();
    preferred
        .iter()
        .find(|p| names.contains(p))
        .or(names.first())
        .map(|s| s.to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixtures::{noisy_samples, settings};
    use flashmoe::{DType, MoeProblem, Scoring};

    fn moe() -> ProblemSpec {
        ProblemSpec::Moe(MoeProblem {
            tokens: 64,
            hidden: 256,
            intermediate: 512,
            experts: 8,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        })
    }

    #[test]
    fn rows_get_the_pipeline_statistics_and_the_candidate_its_comparisons() {
        let s = settings(false);
        let mut fast = ImplResult::new("new", "python");
        fast.samples_ms = noisy_samples(1.0, 0.01, 40, 1);
        let mut slow = ImplResult::new("old", "python");
        slow.samples_ms = noisy_samples(2.0, 0.01, 40, 2);
        let mut failed = ImplResult::new("wrong", "python");
        failed.samples_ms = noisy_samples(0.5, 0.01, 40, 3);
        failed.accuracy = Some(crate::results::AccuracyResult {
            max_abs: 1.0,
            mean_abs: 1.0,
            max_rel: 1.0,
            rel_l2: 1.0,
            non_finite: 0,
            tolerance_rel_l2: 0.1,
            max_row_rel_l2: None,
            worst_row: None,
            tolerance_row_rel_l2: None,
            passed: false,
            reference: "r".into(),
            note: None,
        });
        let mut na = ImplResult::new("absent", "python");
        na.error = Some("n/a: not here".into());
        let c = finish_config(
            RecordedConfig {
                id: None,
                label: None,
                problem: moe(),
                min_bytes: 1e6,
                implementations: vec![fast, slow, failed, na],
                error: None,
                sampling: None,
            },
            "new",
            &s,
        );
        assert_eq!(c.id, moe().id());
        let sum = c.implementations[0].summary.as_ref().unwrap();
        let direct = stats::summarize(
            &c.implementations[0].samples_ms,
            s.confidence,
            s.bootstrap_resamples,
            s.seed,
        );
        assert_eq!(sum.median, direct.median);
        assert_eq!(sum.median_ci, direct.median_ci);
        let tf = c.implementations[0].tflops.unwrap();
        assert!((tf - c.flops / (sum.median * 1e-3) / 1e12).abs() < 1e-12);
        // Only the usable rows are compared: the failed gate and the n/a row are not.
        assert_eq!(c.comparisons.len(), 1);
        let p = &c.comparisons[0];
        assert_eq!((p.candidate.as_str(), p.baseline.as_str()), ("new", "old"));
        assert!(p.comparison.speedup.estimate > 1.8);
        assert_eq!(p.comparison.verdict, stats::Verdict::Faster);
        assert!(c.implementations[3].summary.is_none());
    }

    #[test]
    fn candidate_is_the_first_preferred_name_present() {
        let names = ["eager", "sdpa-flash", "flashmoe-attn", "flashmoe"];
        assert_eq!(
            pick_candidate(names, &["flashmoe", "flashmoe-attn"]),
            "flashmoe"
        );
        assert_eq!(pick_candidate(["eager", "sdpa"], &["flashmoe"]), "eager");
        assert_eq!(pick_candidate([], &["flashmoe"]), "");
    }
}
