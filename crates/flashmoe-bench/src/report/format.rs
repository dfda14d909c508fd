//! Number formatting and the per-row view shared by the terminal, Markdown and HTML
//! tables. Every renderer shows the same cells; only escaping and styling differ.

use crate::results::{AccuracyResult, ConfigResult, ImplResult, PairResult, RunResults};
use crate::stats::{Interval, Verdict};

/// Format `x` with about `sig` significant digits, without exponent for ordinary
/// magnitudes (1e-4 ..= 1e7) and with one otherwise. Non-finite values print as-is.
pub fn fmt_sig(x: f64, sig: usize) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    if x == 0.0 {
        return "0".to_string();
    }
    let a = x.abs();
    if !(1e-4..1e7).contains(&a) {
        return format!("{:.*e}", sig.saturating_sub(1), x);
    }
    let digits_before = a.log10().floor() as i64 + 1; // 1 for 1..10, 0 for 0.1..1
    let decimals = (sig as i64 - digits_before).max(0) as usize;
    format!("{x:.decimals$}")
}

/// Milliseconds with 4 significant digits.
pub fn fmt_ms(x: f64) -> String {
    fmt_sig(x, 4)
}

/// An interval as "[lo, hi]" with `f` applied to both ends.
pub fn fmt_bracket(iv: &Interval, f: impl Fn(f64) -> String) -> String {
    format!("[{}, {}]", f(iv.low), f(iv.high))
}

/// Confidence level as a percentage label ("95%").
pub fn level_pct(level: f64) -> String {
    let p = level * 100.0;
    if (p - p.round()).abs() < 1e-9 {
        format!("{}%", p.round() as i64)
    } else {
        format!("{p:.1}%")
    }
}

/// Throughput with its unit made explicit: TFLOP/s, or GFLOP/s below 1 TFLOP/s.
pub fn fmt_throughput(tflops: f64) -> String {
    if !tflops.is_finite() {
        return "n/a".to_string();
    }
    if tflops.abs() >= 1.0 {
        format!("{} TFLOP/s", fmt_sig(tflops, 3))
    } else {
        format!("{} GFLOP/s", fmt_sig(tflops * 1e3, 3))
    }
}

/// The unit used for a whole run's throughput plots: (multiplier from TFLOP/s, name).
/// GFLOP/s when no implementation reached 1 TFLOP/s (CPU runs), TFLOP/s otherwise.
pub fn run_flops_unit(results: &RunResults) -> (f64, &'static str) {
    let max = results
        .configs
        .iter()
        .flat_map(|c| c.implementations.iter())
        .filter_map(|i| i.tflops)
        .filter(|t| t.is_finite())
        .fold(0.0f64, f64::max);
    if max < 1.0 {
        (1e3, "GFLOP/s")
    } else {
        (1.0, "TFLOP/s")
    }
}

/// Speedup with CI: "1.23× [1.20, 1.26]".
pub fn fmt_speedup(iv: &Interval) -> String {
    format!(
        "{}× {}",
        fmt_sig(iv.estimate, 3),
        fmt_bracket(iv, |v| fmt_sig(v, 3))
    )
}

/// Byte counts with a binary-free SI unit (bytes, kB, MB, GB, TB).
pub fn fmt_bytes(b: f64) -> String {
    let units = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut v = b;
    let mut u = 0;
    while v.abs() >= 1000.0 && u + 1 < units.len() {
        v /= 1000.0;
        u += 1;
    }
    format!("{} {}", fmt_sig(v, 3), units[u])
}

/// Accuracy cell: "3.1e-3 PASS", "FAIL 2 non-finite", "n/a".
pub fn fmt_accuracy(acc: Option<&AccuracyResult>) -> String {
    match acc {
        None => "n/a".to_string(),
        Some(a) => {
            let verdict = if a.passed { "PASS" } else { "FAIL" };
            if a.non_finite > 0 {
                format!("{verdict} ({} non-finite)", a.non_finite)
            } else {
                format!("{:.1e} {verdict}", a.rel_l2)
            }
        }
    }
}

/// Shorten `s` to at most `max` characters, ending with "…" when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
}

/// The comparison of the candidate against `imp` within `config`, if one was made.
pub fn pair_for<'a>(
    results: &RunResults,
    config: &'a ConfigResult,
    imp: &ImplResult,
) -> Option<&'a PairResult> {
    config
        .comparisons
        .iter()
        .find(|p| p.baseline == imp.name && p.candidate == results.candidate)
        .or_else(|| config.comparisons.iter().find(|p| p.baseline == imp.name))
}

/// Total number of Tukey outliers (mild + severe, both sides).
pub fn outlier_total(o: &crate::stats::Outliers) -> usize {
    o.low_severe + o.low_mild + o.high_mild + o.high_severe
}

/// One implementation row of a results table, already formatted (unescaped).
#[derive(Debug, Clone)]
pub struct RowView {
    pub config_label: String,
    pub impl_name: String,
    pub backend: String,
    pub is_candidate: bool,
    /// The fastest other implementation that passed the gate (see `best_baseline`).
    pub is_best_baseline: bool,
    /// "n/a: ..." or an error message; when set most other cells are "—".
    pub error: Option<String>,
    pub median: String,
    pub ci: String,
    pub n: String,
    pub outliers: String,
    pub throughput: String,
    pub gbps: String,
    pub pct_ceiling: String,
    /// % of the copy ceiling: memory floor / median.
    pub pct_copy: String,
    pub accuracy: String,
    pub accuracy_passed: Option<bool>,
    /// Candidate speedup vs this implementation with CI, "candidate" on the candidate row.
    pub speedup: String,
    pub verdict: Option<Verdict>,
    pub p_value: String,
    pub flags: Vec<String>,
    /// What a suite measured besides the time ([`details`]): the metrics, memory and the
    /// gate's bound of the e2e and expert-parallel suites; empty for the kernel suites.
    pub details: Vec<String>,
}

pub const DASH: &str = "—";

/// Build the formatted view of one implementation's row.
pub fn row_view(results: &RunResults, config: &ConfigResult, imp: &ImplResult) -> RowView {
    let is_candidate = imp.name == results.candidate;
    let s = imp.summary.as_ref();
    let opt = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map(f).unwrap_or(DASH.to_string());
    let pair = if is_candidate {
        None
    } else {
        pair_for(results, config, imp)
    };
    let speedup = if is_candidate {
        "candidate".to_string()
    } else {
        pair.map(|p| fmt_speedup(&p.comparison.speedup))
            .unwrap_or(DASH.to_string())
    };
    let error = imp.error.clone().or_else(|| {
        if imp.samples_ms.is_empty() && imp.summary.is_none() {
            Some("no samples".to_string())
        } else {
            None
        }
    });
    RowView {
        config_label: config.label.clone(),
        impl_name: imp.name.clone(),
        backend: imp.backend.clone(),
        is_candidate,
        is_best_baseline: config
            .best_baseline(&results.candidate)
            .is_some_and(|b| b.name == imp.name),
        error,
        median: opt(s.map(|s| s.median), &fmt_ms),
        ci: s
            .map(|s| fmt_bracket(&s.median_ci, fmt_ms))
            .unwrap_or(DASH.to_string()),
        n: s.map(|s| s.n.to_string())
            .unwrap_or_else(|| imp.samples_ms.len().to_string()),
        outliers: s
            .map(|s| {
                let total = outlier_total(&s.outliers);
                let severe = s.outliers.low_severe + s.outliers.high_severe;
                if severe > 0 {
                    format!("{total} ({severe} sev)")
                } else {
                    total.to_string()
                }
            })
            .unwrap_or(DASH.to_string()),
        throughput: match (imp.tflops, imp.metrics.get(TOKENS_PER_S)) {
            (Some(t), Some(tps)) => format!("{} · {} tok/s", fmt_throughput(t), fmt_sig(*tps, 4)),
            (t, _) => opt(t, &fmt_throughput),
        },
        gbps: opt(imp.gbps, &|g| fmt_sig(g, 3)),
        pct_ceiling: opt(imp.pct_of_gemm_ceiling, &|p| format!("{p:.1}%")),
        pct_copy: match (imp.pct_of_copy_ceiling, hbm_pct(results, imp)) {
            (Some(p), Some(h)) => format!("{p:.1}% ({h:.1}% of HBM peak)"),
            (p, _) => opt(p, &|p| format!("{p:.1}%")),
        },
        accuracy: fmt_accuracy(imp.accuracy.as_ref()),
        accuracy_passed: imp.accuracy.as_ref().map(|a| a.passed),
        speedup,
        verdict: pair.map(|p| p.comparison.verdict),
        p_value: pair
            .map(|p| fmt_p(p.comparison.mann_whitney.p_value))
            .unwrap_or(DASH.to_string()),
        flags: imp.flags.clone(),
        details: details(imp),
    }
}

/// The metric shown in the throughput cell beside TFLOP/s (e2e).
pub const TOKENS_PER_S: &str = "tokens_per_s";

/// One metric as "name value unit", the unit from the name's suffix.
fn fmt_metric(name: &str, v: f64) -> String {
    let (stem, value) = if let Some(s) = name.strip_suffix("_ms") {
        (s, format!("{} ms", fmt_sig(v, 4)))
    } else if let Some(s) = name.strip_suffix("_bytes") {
        (s, fmt_bytes(v))
    } else if let Some(s) = name.strip_suffix("_gbs") {
        (s, format!("{} GB/s", fmt_sig(v, 4)))
    } else if let Some(s) = name.strip_suffix("_per_s") {
        (s, format!("{}/s", fmt_sig(v, 4)))
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        (name, format!("{}", v as i64))
    } else {
        (name, fmt_sig(v, 4))
    };
    format!("{} {value}", stem.replace('_', " "))
}

/// A row's metrics (but tokens/s, which has its cell), its peak memory and its gate's
/// bound, for the suites that record metrics (e2e, expert parallel).
pub fn details(imp: &ImplResult) -> Vec<String> {
    if imp.metrics.is_empty() {
        return Vec::new();
    }
    let mut parts: Vec<String> = imp
        .metrics
        .iter()
        .filter(|(k, _)| k.as_str() != TOKENS_PER_S)
        .map(|(k, v)| fmt_metric(k, *v))
        .collect();
    if let Some(b) = imp.peak_extra_bytes {
        parts.push(format!("peak extra {}", fmt_bytes(b as f64)));
    }
    let mut out = vec![parts.join(", ")];
    if let Some(note) = imp.accuracy.as_ref().and_then(|a| a.note.as_ref()) {
        out.push(note.clone());
    }
    out.retain(|s| !s.is_empty());
    out
}

/// An implementation's GB/s as a percentage of the run's DRAM peak bandwidth, where both
/// are known.
pub fn hbm_pct(results: &RunResults, imp: &ImplResult) -> Option<f64> {
    results.ceilings.as_ref()?.pct_of_hbm_peak(imp.gbps?)
}

/// A p-value: "<1e-4" for tiny ones, 2 significant digits otherwise.
pub fn fmt_p(p: f64) -> String {
    if !p.is_finite() {
        "n/a".to_string()
    } else if p < 1e-4 {
        "<1e-4".to_string()
    } else {
        fmt_sig(p, 2)
    }
}

/// Whether any implementation of the run reports a % of the GEMM ceiling.
pub fn has_pct_ceiling(results: &RunResults) -> bool {
    results
        .configs
        .iter()
        .flat_map(|c| c.implementations.iter())
        .any(|i| i.pct_of_gemm_ceiling.is_some())
}

/// The confidence level used by the run's median CIs (from the first summary found,
/// falling back to the settings).
pub fn ci_level(results: &RunResults) -> f64 {
    results
        .configs
        .iter()
        .flat_map(|c| c.implementations.iter())
        .find_map(|i| i.summary.as_ref().map(|s| s.median_ci.level))
        .unwrap_or(results.settings.confidence)
}

/// Level of the speedup CIs (1 − alpha of the verdict), from the first comparison.
pub fn speedup_level(results: &RunResults) -> Option<f64> {
    results
        .configs
        .iter()
        .flat_map(|c| c.comparisons.iter())
        .map(|p| p.comparison.speedup.level)
        .next()
}

/// MoE configs: the routing's load statistics, its losses, and each implementation's
/// router time as a share of its layer time, as separate parts (None for attention).
pub fn moe_routing_parts(config: &ConfigResult) -> Option<Vec<String>> {
    let r = config.routing.as_ref()?;
    let mut v = vec![
        format!(
            "tokens per expert min {} / max {} / mean {} (max/mean {}), CV {}, {} of {} experts empty",
            r.min_load,
            r.max_load,
            fmt_sig(r.mean_load, 4),
            fmt_sig(r.max_over_mean, 3),
            fmt_sig(r.cv, 3),
            r.empty_experts,
            r.tokens_per_expert.len(),
        ),
        format!(
            "aux loss {}, z-loss {}",
            fmt_sig(r.aux_loss, 5),
            fmt_sig(r.z_loss, 5)
        ),
    ];
    for imp in &config.implementations {
        if let (Some(router), Some(layer)) = (imp.router_ms, imp.median_ms()) {
            v.push(format!(
                "{} router {} ms = {}% of its layer",
                imp.name,
                fmt_sig(router, 3),
                fmt_sig(100.0 * router / layer, 3)
            ));
        }
    }
    Some(v)
}

/// [`moe_routing_parts`] on one line.
pub fn moe_routing_line(config: &ConfigResult) -> Option<String> {
    moe_routing_parts(config).map(|v| v.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn significant_digits() {
        assert_eq!(fmt_sig(1.23456, 4), "1.235");
        assert_eq!(fmt_sig(123.456, 4), "123.5");
        assert_eq!(fmt_sig(0.0123456, 3), "0.0123");
        assert_eq!(fmt_sig(12345.6, 3), "12346");
        assert_eq!(fmt_sig(0.0, 3), "0");
        assert_eq!(fmt_sig(1.5e-6, 2), "1.5e-6");
    }

    #[test]
    fn throughput_units() {
        assert_eq!(fmt_throughput(312.4), "312 TFLOP/s");
        assert_eq!(fmt_throughput(0.0456), "45.6 GFLOP/s");
        assert_eq!(fmt_throughput(1.0), "1.00 TFLOP/s");
    }

    #[test]
    fn misc() {
        assert_eq!(level_pct(0.95), "95%");
        assert_eq!(level_pct(0.999), "99.9%");
        assert_eq!(truncate("abcdef", 4), "abc…");
        assert_eq!(truncate("abc", 4), "abc");
        assert_eq!(fmt_bytes(2.5e9), "2.50 GB");
        assert_eq!(fmt_p(0.5), "0.50");
        assert_eq!(fmt_p(1e-9), "<1e-4");
    }
}
