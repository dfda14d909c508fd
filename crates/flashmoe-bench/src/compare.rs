//! Regression comparison of two result files: per config × implementation, the change of
//! the median time from the old run to the new one with a bootstrap CI, a Mann-Whitney
//! p-value and a verdict. A SLOWER verdict (new significantly slower by more than the
//! practical threshold) is a regression.
//!
//! Two separate runs also differ by the machine (another job, clocks, thermals). When both
//! files hold the calibration workload of a config (`ConfigResult::calibration`), the
//! change is also computed relative to the calibration's change, and the verdict needs
//! both to agree ([`stats::cross_run_verdict`]); a disagreement is ENV-DRIFT, which exits
//! with [`EXIT_ENV_DRIFT`] instead of passing or failing. Files without calibration compare
//! on the raw change alone.

use crate::measure::StopReason;
use crate::report::format::{fmt_ms, fmt_p, fmt_sig, level_pct, truncate};
use crate::results::{ImplResult, RunResults};
use crate::stats::{self, CalibratedComparison, Comparison, CrossRunVerdict, VerdictOptions};
use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{Cell, CellAlignment, ColumnConstraint, ContentArrangement, Table, Width};

/// Exit code of `flashmoe compare` (and `bench --against`) when nothing regressed.
pub const EXIT_OK: u8 = 0;
/// Exit code when at least one implementation is SLOWER (a regression).
pub const EXIT_REGRESSION: u8 = 1;
/// Exit code when nothing is SLOWER but at least one change is ENV-DRIFT: the machine moved
/// between the runs as much as the code seemed to, so the comparison cannot decide (rerun,
/// or use `bench --against` which measures both builds in one run).
pub const EXIT_ENV_DRIFT: u8 = 3;

/// Options of [`compare_runs`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CompareOptions {
    /// Practical threshold as a fraction (0.02 = 2%): smaller changes are SAME.
    pub threshold: f64,
    /// Significance level (0.05); CIs are at 1 − alpha.
    pub alpha: f64,
    pub resamples: usize,
    pub seed: u64,
}

impl Default for CompareOptions {
    fn default() -> Self {
        let v = VerdictOptions::default();
        CompareOptions {
            threshold: v.threshold,
            alpha: v.alpha,
            resamples: v.resamples,
            seed: v.seed,
        }
    }
}

impl CompareOptions {
    fn verdict_options(&self) -> VerdictOptions {
        VerdictOptions {
            threshold: self.threshold,
            alpha: self.alpha,
            resamples: self.resamples,
            seed: self.seed,
        }
    }
}

/// One implementation on one config present in both runs.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ConfigChange {
    pub config_id: String,
    pub label: String,
    pub implementation: String,
    pub old_median_ms: f64,
    pub new_median_ms: f64,
    /// baseline = old, candidate = new: speedup > 1 and FASTER mean the new run is faster.
    pub comparison: Comparison,
    /// The change relative to the calibration workload, when both runs measured it.
    pub calibrated: Option<CalibratedComparison>,
    /// The final verdict: [`stats::cross_run_verdict`] of the raw and the corrected
    /// verdicts with a calibration, the raw verdict without.
    pub verdict: CrossRunVerdict,
    /// `bench --against` only: whether the speedup CI resolved the ±threshold band
    /// ([`crate::measure::resolves`]: entirely beyond it or entirely inside it). `false`
    /// means sampling hit its cap first ([`Self::stop`]) and the verdict rests on an
    /// undecided interval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved: Option<bool>,
    /// `bench --against` only: how the config's sampling ended (absent for runs that did
    /// not record it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<crate::measure::StopReason>,
}

impl ConfigChange {
    /// Relative change of the median time, new / old − 1 (+0.10 = 10% slower).
    pub fn change(&self) -> f64 {
        1.0 / self.comparison.speedup.estimate - 1.0
    }

    /// CI of [`Self::change`] (from the speedup CI), as (low, high).
    pub fn change_ci(&self) -> (f64, f64) {
        let s = &self.comparison.speedup;
        (1.0 / s.high - 1.0, 1.0 / s.low - 1.0)
    }

    /// A SLOWER verdict counts as a regression unless it is an
    /// [unresolved slowdown](Self::is_unresolved_slowdown).
    pub fn is_regression(&self) -> bool {
        self.verdict == CrossRunVerdict::Slower && !self.is_unresolved_slowdown()
    }

    /// `bench --against`: SLOWER, but sampling hit its cap while the CI still touched the
    /// ±threshold band (slower by more than the threshold is not yet confirmed at the
    /// CI's level). Not a regression: the gate exits [`EXIT_ENV_DRIFT`] (3, "rerun")
    /// instead of failing or passing. Under heavy load these are where the A/A false
    /// alarms were (docs/regression-gate.md).
    pub fn is_unresolved_slowdown(&self) -> bool {
        self.verdict == CrossRunVerdict::Slower
            && self.resolved == Some(false)
            && matches!(self.stop, Some(StopReason::TimeCap | StopReason::SampleCap))
    }
}

/// Result of [`compare_runs`] (serialised by `compare --json`).
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct CompareReport {
    pub changes: Vec<ConfigChange>,
    /// Config ids present only in the old run.
    pub only_in_old: Vec<String>,
    /// Config ids present only in the new run.
    pub only_in_new: Vec<String>,
    /// Number of SLOWER verdicts.
    pub regressions: usize,
    /// Number of FASTER verdicts.
    pub improvements: usize,
    /// Number of ENV-DRIFT verdicts.
    pub env_drifts: usize,
    /// `bench --against`: changes whose CI did not resolve the ±threshold band before the
    /// sampling cap (their verdict is SAME, UNCLEAR or SLOWER/FASTER on a CI that still
    /// touches the band).
    pub unresolved: usize,
    /// `bench --against`: SLOWER verdicts among them
    /// ([`ConfigChange::is_unresolved_slowdown`]); not counted in `regressions`.
    pub unresolved_slowdowns: usize,
    /// Configs compared with a calibration correction (both runs measured it).
    pub calibrated_configs: usize,
    /// Implementations of shared configs that were not compared, with the reason
    /// ("config_id / impl: reason"): missing from one run, or too few samples.
    pub skipped: Vec<String>,
    /// Differences between the runs that make the comparison less meaningful (suite,
    /// GPU, schema...).
    pub warnings: Vec<String>,
    /// Options used (for rendering).
    pub threshold: f64,
    pub alpha: f64,
}

/// Minimum samples per side for a comparison.
const MIN_SAMPLES: usize = 2;

fn median_of(imp: &ImplResult) -> f64 {
    imp.summary
        .as_ref()
        .map(|s| s.median)
        .unwrap_or_else(|| stats::median(&imp.samples_ms))
}

/// Compare `new` against `old`: configs matched by id, implementations by name.
pub fn compare_runs(old: &RunResults, new: &RunResults, opts: &CompareOptions) -> CompareReport {
    let vopts = opts.verdict_options();
    let mut rep = CompareReport {
        threshold: opts.threshold,
        alpha: opts.alpha,
        ..Default::default()
    };
    if old.suite != new.suite {
        rep.warnings.push(format!(
            "different suites: old '{}', new '{}'",
            old.suite, new.suite
        ));
    }
    let gpu = |r: &RunResults| {
        r.manifest
            .gpu
            .as_ref()
            .map(|g| g.name.clone())
            .unwrap_or_else(|| format!("CPU {}", r.manifest.cpu_model))
    };
    if gpu(old) != gpu(new) {
        rep.warnings.push(format!(
            "different machines: old '{}', new '{}'",
            gpu(old),
            gpu(new)
        ));
    }
    if old.settings.cache_policy != new.settings.cache_policy
        || old.settings.timer != new.settings.timer
    {
        rep.warnings.push(format!(
            "different timing method: old '{}' / '{}', new '{}' / '{}'",
            old.settings.timer,
            old.settings.cache_policy,
            new.settings.timer,
            new.settings.cache_policy
        ));
    }
    for run in [old, new] {
        if run.interrupted {
            rep.warnings.push(format!(
                "the {} run was interrupted: only its completed configs are compared",
                if std::ptr::eq(run, old) { "old" } else { "new" }
            ));
        }
    }

    let mut calibration_notes: Vec<String> = Vec::new();
    for oc in &old.configs {
        let Some(nc) = new.configs.iter().find(|c| c.id == oc.id) else {
            rep.only_in_old.push(oc.id.clone());
            continue;
        };
        let calibration = calibration_pair(oc, nc, &mut calibration_notes);
        if calibration.is_some() {
            rep.calibrated_configs += 1;
        }
        for oi in &oc.implementations {
            let key = format!("{} / {}", oc.id, oi.name);
            let Some(ni) = nc.implementations.iter().find(|i| i.name == oi.name) else {
                rep.skipped.push(format!("{key}: only in the old run"));
                continue;
            };
            let too_few = |imp: &ImplResult| {
                imp.samples_ms.iter().filter(|x| x.is_finite()).count() < MIN_SAMPLES
            };
            if too_few(oi) || too_few(ni) {
                let why = |imp: &ImplResult, which: &str| {
                    imp.error
                        .as_ref()
                        .map(|e| format!("{which}: {}", truncate(e, 80)))
                        .unwrap_or_else(|| format!("{which}: {} samples", imp.samples_ms.len()))
                };
                let mut reasons = Vec::new();
                if too_few(oi) {
                    reasons.push(why(oi, "old"));
                }
                if too_few(ni) {
                    reasons.push(why(ni, "new"));
                }
                rep.skipped.push(format!(
                    "{key}: no samples to compare ({})",
                    reasons.join("; ")
                ));
                continue;
            }
            let clean = |xs: &[f64]| {
                xs.iter()
                    .copied()
                    .filter(|x| x.is_finite())
                    .collect::<Vec<_>>()
            };
            let (o, n) = (clean(&oi.samples_ms), clean(&ni.samples_ms));
            let comparison = stats::compare_samples(&o, &n, &vopts);
            let calibrated = calibration
                .as_ref()
                .map(|(oc, nc)| stats::compare_calibrated(&o, &n, oc, nc, &vopts));
            let verdict = match &calibrated {
                Some(c) => stats::cross_run_verdict(comparison.verdict, c.corrected_verdict),
                None => comparison.verdict.into(),
            };
            match verdict {
                CrossRunVerdict::Slower => rep.regressions += 1,
                CrossRunVerdict::Faster => rep.improvements += 1,
                CrossRunVerdict::EnvDrift => rep.env_drifts += 1,
                _ => {}
            }
            rep.changes.push(ConfigChange {
                config_id: oc.id.clone(),
                label: oc.label.clone(),
                implementation: oi.name.clone(),
                old_median_ms: median_of(oi),
                new_median_ms: median_of(ni),
                comparison,
                calibrated,
                verdict,
                resolved: None,
                stop: None,
            });
        }
        for ni in &nc.implementations {
            if !oc.implementations.iter().any(|i| i.name == ni.name) {
                rep.skipped
                    .push(format!("{} / {}: only in the new run", nc.id, ni.name));
            }
        }
    }
    for nc in &new.configs {
        if !old.configs.iter().any(|c| c.id == nc.id) {
            rep.only_in_new.push(nc.id.clone());
        }
    }
    calibration_notes.sort();
    calibration_notes.dedup();
    rep.warnings.extend(calibration_notes);
    rep
}

/// `bench --against`: within one run, every implementation X against the old build's
/// `old:X` (prefix [`crate::runner::python::OLD_PREFIX`]), measured interleaved in the same
/// rounds. old = the old build, new = this build; no calibration is needed since both
/// builds saw the same machine at the same time.
pub fn compare_against_old(run: &RunResults, opts: &CompareOptions) -> CompareReport {
    use crate::runner::python::OLD_PREFIX;
    let vopts = opts.verdict_options();
    let mut rep = CompareReport {
        threshold: opts.threshold,
        alpha: opts.alpha,
        ..Default::default()
    };
    for c in &run.configs {
        for new in c
            .implementations
            .iter()
            .filter(|i| !i.name.starts_with(OLD_PREFIX))
        {
            let key = format!("{} / {}", c.id, new.name);
            let old_name = format!("{OLD_PREFIX}{}", new.name);
            let Some(old) = c.implementations.iter().find(|i| i.name == old_name) else {
                rep.skipped.push(format!("{key}: not in the old build"));
                continue;
            };
            if !old.is_usable() || !new.is_usable() {
                let why = |i: &ImplResult| {
                    i.error
                        .as_deref()
                        .map(|e| truncate(e, 80))
                        .unwrap_or_else(|| format!("{} samples", i.samples_ms.len()))
                };
                rep.skipped.push(format!(
                    "{key}: not compared (old: {}; new: {})",
                    why(old),
                    why(new)
                ));
                continue;
            }
            let comparison = stats::compare_samples(&old.samples_ms, &new.samples_ms, &vopts);
            let verdict: CrossRunVerdict = comparison.verdict.into();
            let resolved = crate::measure::resolves(&comparison.speedup, opts.threshold);
            if !resolved {
                rep.unresolved += 1;
            }
            let change = ConfigChange {
                config_id: c.id.clone(),
                label: c.label.clone(),
                implementation: new.name.clone(),
                old_median_ms: median_of(old),
                new_median_ms: median_of(new),
                comparison,
                calibrated: None,
                verdict,
                resolved: Some(resolved),
                stop: c.sampling.as_ref().map(|s| s.stop),
            };
            if change.is_regression() {
                rep.regressions += 1;
            } else if change.is_unresolved_slowdown() {
                rep.unresolved_slowdowns += 1;
            } else if change.verdict == CrossRunVerdict::Faster {
                rep.improvements += 1;
            }
            rep.changes.push(change);
        }
        for old in c
            .implementations
            .iter()
            .filter(|i| i.name.starts_with(OLD_PREFIX))
        {
            let name = &old.name[OLD_PREFIX.len()..];
            if !c.implementations.iter().any(|i| i.name == name) {
                rep.skipped
                    .push(format!("{} / {}: only in the old build", c.id, old.name));
            }
        }
    }
    rep
}

/// The two runs' calibration samples of one config, when both measured the same workload
/// with enough samples; otherwise `None` and a note of why (deduplicated by the caller).
fn calibration_pair(
    old: &crate::results::ConfigResult,
    new: &crate::results::ConfigResult,
    notes: &mut Vec<String>,
) -> Option<(Vec<f64>, Vec<f64>)> {
    let usable = |c: &crate::results::CalibrationResult| {
        let xs: Vec<f64> = c
            .samples_ms
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .collect();
        (xs.len() >= MIN_SAMPLES).then_some(xs)
    };
    match (&old.calibration, &new.calibration) {
        // Files from before the calibration existed compare on the raw change, as then.
        (None, None) => None,
        (Some(_), None) | (None, Some(_)) => {
            notes.push(format!(
                "only the {} run measured the calibration: raw verdicts",
                if old.calibration.is_some() {
                    "old"
                } else {
                    "new"
                }
            ));
            None
        }
        (Some(a), Some(b)) if a.workload != b.workload => {
            notes.push(format!(
                "different calibration workloads ('{}' vs '{}'): raw verdicts",
                a.workload, b.workload
            ));
            None
        }
        (Some(a), Some(b)) => match (usable(a), usable(b)) {
            (Some(x), Some(y)) => Some((x, y)),
            _ => {
                notes.push(format!(
                    "config {}: too few calibration samples: raw verdicts",
                    old.id
                ));
                None
            }
        },
    }
}

fn pct(x: f64) -> String {
    if !x.is_finite() {
        return "n/a".to_string();
    }
    format!(
        "{}{}%",
        if x > 0.0 { "+" } else { "" },
        fmt_sig(x * 100.0, 3)
    )
}

impl CompareReport {
    /// True when any implementation got a SLOWER verdict.
    pub fn has_regression(&self) -> bool {
        self.changes.iter().any(|c| c.is_regression())
    }

    /// True when any change is ENV-DRIFT.
    pub fn has_env_drift(&self) -> bool {
        self.changes
            .iter()
            .any(|c| c.verdict == CrossRunVerdict::EnvDrift)
    }

    /// [`EXIT_REGRESSION`] if anything regressed, else [`EXIT_ENV_DRIFT`] if the machine
    /// drifted or (`--against`) a slowdown stayed unresolved at the cap, else [`EXIT_OK`].
    pub fn exit_code(&self) -> u8 {
        if self.has_regression() {
            EXIT_REGRESSION
        } else if self.has_env_drift() || self.unresolved_slowdowns > 0 {
            EXIT_ENV_DRIFT
        } else {
            EXIT_OK
        }
    }

    /// The report as a terminal table followed by a summary.
    pub fn render(&self) -> String {
        let level = self
            .changes
            .first()
            .map(|c| c.comparison.speedup.level)
            .unwrap_or(1.0 - self.alpha);
        let calibrated = self.changes.iter().any(|c| c.calibrated.is_some());
        let mut t = Table::new();
        t.load_preset(UTF8_FULL_CONDENSED)
            .set_content_arrangement(ContentArrangement::Dynamic)
            .set_width(160)
            .set_header({
                let mut h = vec![
                    "config".to_string(),
                    "implementation".to_string(),
                    "old ms".to_string(),
                    "new ms".to_string(),
                    format!("change [{} CI]", level_pct(level)),
                    "p".to_string(),
                ];
                if calibrated {
                    h.push("machine (calibration)".to_string());
                    h.push(format!("change vs machine [{} CI]", level_pct(level)));
                }
                h.push("verdict".to_string());
                h
            });
        let mut last_cfg: Option<&str> = None;
        for c in &self.changes {
            let label = if last_cfg == Some(c.config_id.as_str()) {
                String::new()
            } else {
                c.label.clone()
            };
            last_cfg = Some(&c.config_id);
            let (lo, hi) = c.change_ci();
            let mut verdict = match c.verdict {
                CrossRunVerdict::Slower => "SLOWER (regression)".to_string(),
                CrossRunVerdict::Faster => "FASTER (improvement)".to_string(),
                CrossRunVerdict::EnvDrift => "ENV-DRIFT (machine moved)".to_string(),
                v => v.to_string(),
            };
            if c.resolved == Some(false) {
                verdict.push_str(&match c.stop {
                    Some(s @ (StopReason::TimeCap | StopReason::SampleCap)) => format!(
                        ", unresolved at the {}",
                        if s == StopReason::TimeCap {
                            "time cap"
                        } else {
                            "sample cap"
                        }
                    ),
                    _ => ", unresolved".to_string(),
                });
            }
            let right = |s: String| Cell::new(s).set_alignment(CellAlignment::Right);
            let mut row = vec![
                Cell::new(label),
                Cell::new(&c.implementation),
                right(fmt_ms(c.old_median_ms)),
                right(fmt_ms(c.new_median_ms)),
                right(format!("{} [{}, {}]", pct(c.change()), pct(lo), pct(hi))),
                right(fmt_p(c.comparison.mann_whitney.p_value)),
            ];
            if calibrated {
                match &c.calibrated {
                    Some(k) => {
                        let ch = |s: f64| 1.0 / s - 1.0;
                        row.push(right(pct(ch(k.calibration.estimate))));
                        row.push(right(format!(
                            "{} [{}, {}]",
                            pct(ch(k.corrected.estimate)),
                            pct(ch(k.corrected.high)),
                            pct(ch(k.corrected.low))
                        )));
                    }
                    None => {
                        row.push(right("—".into()));
                        row.push(right("—".into()));
                    }
                }
            }
            row.push(Cell::new(verdict));
            t.add_row(row);
        }
        if let Some(col) = t.column_mut(0) {
            col.set_constraint(ColumnConstraint::UpperBoundary(Width::Fixed(50)));
        }
        let mut out = String::new();
        if self.changes.is_empty() {
            out.push_str("No implementation was present with samples in both runs.\n");
        } else {
            out.push_str(&t.to_string());
            out.push('\n');
        }
        out.push_str(&format!(
            "change = new median / old median − 1 (negative = faster); threshold ±{}%, \
             alpha {}.\n",
            fmt_sig(self.threshold * 100.0, 3),
            self.alpha
        ));
        if calibrated {
            out.push_str(
                "machine = the calibration workload's change between the runs; change vs \
                 machine = the change divided by it. A verdict needs both changes to agree; \
                 ENV-DRIFT = they disagree (the machine moved as much as the code seemed to).\n",
            );
        }
        let count = |v: CrossRunVerdict| self.changes.iter().filter(|c| c.verdict == v).count();
        out.push_str(&format!(
            "{} compared: {} regression(s), {} improvement(s), {} same, {} unclear, {} env-drift.\n",
            self.changes.len(),
            self.regressions,
            self.improvements,
            count(CrossRunVerdict::Same),
            count(CrossRunVerdict::Unclear),
            self.env_drifts
        ));
        let list = |out: &mut String, title: &str, items: &[String]| {
            if !items.is_empty() {
                out.push_str(&format!("{title} ({}):\n", items.len()));
                for i in items {
                    out.push_str(&format!("  - {i}\n"));
                }
            }
        };
        if self.unresolved > 0 {
            out.push_str(&format!(
                "{} change(s) unresolved: sampling hit its cap before the CI left the ±{}% band \
                 edge it straddles, so the verdict is not decided by the data; raise \
                 --against-max-time or use a quieter machine.\n",
                self.unresolved,
                fmt_sig(self.threshold * 100.0, 3)
            ));
        }
        list(&mut out, "Configs only in the old run", &self.only_in_old);
        list(&mut out, "Configs only in the new run", &self.only_in_new);
        list(&mut out, "Not compared", &self.skipped);
        list(&mut out, "Warnings", &self.warnings);
        if self.has_regression() {
            out.push_str("REGRESSION: the new run is significantly slower.\n");
        } else if self.unresolved_slowdowns > 0 {
            out.push_str(
                "UNRESOLVED: a slowdown beyond the threshold was measured but its CI still \
                 touched the band when sampling hit its cap; rerun on a quieter machine or \
                 with a larger --against-max-time.\n",
            );
        } else if self.has_env_drift() {
            out.push_str(
                "ENV-DRIFT: no regression the calibration confirms, but the machine moved \
                 between the runs; rerun, or compare builds in one run with `bench --against`.\n",
            );
        }
        out
    }
}
