//! CSV: one row per config × implementation (a config that failed as a whole and has no
//! implementations gets one row with an empty implementation). Times in ms, throughput
//! in TFLOP/s, bandwidth in GB/s, sizes in bytes; empty cells mean "not available".

use super::format::pair_for;
use crate::results::{ConfigResult, ImplResult, RunResults};
use crate::stats::Summary;
use anyhow::Context;

/// Column names, in order.
pub const CSV_HEADER: &[&str] = &[
    "config_id",
    "config_label",
    "problem_kind",
    "x_value",
    "flops",
    "min_bytes",
    "implementation",
    "backend",
    "is_candidate",
    "is_best_baseline",
    "error",
    "n",
    "mean_ms",
    "std_dev_ms",
    "min_ms",
    "max_ms",
    "median_ms",
    "q1_ms",
    "q3_ms",
    "p05_ms",
    "p95_ms",
    "mad_ms",
    "median_ci_low_ms",
    "median_ci_high_ms",
    "median_ci_level",
    "outliers_low_severe",
    "outliers_low_mild",
    "outliers_high_mild",
    "outliers_high_severe",
    "tflops",
    "gbps",
    "pct_of_gemm_ceiling",
    "pct_of_copy_ceiling",
    "pct_of_hbm_peak",
    "router_ms",
    "peak_extra_bytes",
    "acc_max_abs",
    "acc_mean_abs",
    "acc_max_rel",
    "acc_rel_l2",
    "acc_non_finite",
    "acc_tolerance_rel_l2",
    "acc_passed",
    "acc_reference",
    "candidate",
    "speedup_vs_candidate",
    "speedup_ci_low",
    "speedup_ci_high",
    "speedup_ci_level",
    "mann_whitney_p",
    "cliffs_delta",
    "hodges_lehmann_ms",
    "verdict",
    "flags",
];

fn num(x: f64) -> String {
    // Shortest round-trip representation; non-finite values stay explicit.
    format!("{x}")
}

fn opt<T: ToString>(x: Option<T>) -> String {
    x.map(|v| v.to_string()).unwrap_or_default()
}

fn row(results: &RunResults, c: &ConfigResult, imp: Option<&ImplResult>) -> Vec<String> {
    let kind = match &c.problem {
        crate::results::ProblemSpec::Attention(_) => "attention",
        crate::results::ProblemSpec::Moe(_) => "moe",
        crate::results::ProblemSpec::Decode(_) => "decode",
        crate::results::ProblemSpec::Varlen(_) => "varlen",
        crate::results::ProblemSpec::Mla(_) => "mla",
        crate::results::ProblemSpec::E2e(_) => "e2e",
        crate::results::ProblemSpec::Grad(_) => "grad",
    };
    let mut r = vec![
        c.id.clone(),
        c.label.clone(),
        kind.to_string(),
        num(c.problem.x_value()),
        num(c.flops),
        num(c.min_bytes),
    ];
    let Some(imp) = imp else {
        r.extend(std::iter::repeat_n(String::new(), 4)); // implementation .. is_best_baseline
        r.push(c.error.clone().unwrap_or_default());
        r.resize(CSV_HEADER.len(), String::new());
        return r;
    };
    let is_candidate = imp.name == results.candidate;
    r.push(imp.name.clone());
    r.push(imp.backend.clone());
    r.push(is_candidate.to_string());
    r.push(
        c.best_baseline(&results.candidate)
            .is_some_and(|b| b.name == imp.name)
            .to_string(),
    );
    r.push(
        imp.error
            .clone()
            .or_else(|| c.error.clone())
            .unwrap_or_default(),
    );
    let s = imp.summary.as_ref();
    r.push(s.map(|s| s.n).unwrap_or(imp.samples_ms.len()).to_string());
    let fields: [fn(&Summary) -> f64; 13] = [
        |s| s.mean,
        |s| s.std_dev,
        |s| s.min,
        |s| s.max,
        |s| s.median,
        |s| s.q1,
        |s| s.q3,
        |s| s.p05,
        |s| s.p95,
        |s| s.mad,
        |s| s.median_ci.low,
        |s| s.median_ci.high,
        |s| s.median_ci.level,
    ];
    for f in fields {
        r.push(s.map(|s| num(f(s))).unwrap_or_default());
    }
    let o = s.map(|s| s.outliers);
    r.push(opt(o.map(|o| o.low_severe)));
    r.push(opt(o.map(|o| o.low_mild)));
    r.push(opt(o.map(|o| o.high_mild)));
    r.push(opt(o.map(|o| o.high_severe)));
    r.push(imp.tflops.map(num).unwrap_or_default());
    r.push(imp.gbps.map(num).unwrap_or_default());
    r.push(imp.pct_of_gemm_ceiling.map(num).unwrap_or_default());
    r.push(imp.pct_of_copy_ceiling.map(num).unwrap_or_default());
    r.push(
        super::format::hbm_pct(results, imp)
            .map(num)
            .unwrap_or_default(),
    );
    r.push(imp.router_ms.map(num).unwrap_or_default());
    r.push(opt(imp.peak_extra_bytes));
    let a = imp.accuracy.as_ref();
    r.push(a.map(|a| num(a.max_abs)).unwrap_or_default());
    r.push(a.map(|a| num(a.mean_abs)).unwrap_or_default());
    r.push(a.map(|a| num(a.max_rel)).unwrap_or_default());
    r.push(a.map(|a| num(a.rel_l2)).unwrap_or_default());
    r.push(opt(a.map(|a| a.non_finite)));
    r.push(a.map(|a| num(a.tolerance_rel_l2)).unwrap_or_default());
    r.push(opt(a.map(|a| a.passed)));
    r.push(a.map(|a| a.reference.clone()).unwrap_or_default());
    r.push(results.candidate.clone());
    let p = if is_candidate {
        None
    } else {
        pair_for(results, c, imp)
    };
    let cmp = p.map(|p| &p.comparison);
    r.push(cmp.map(|c| num(c.speedup.estimate)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.speedup.low)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.speedup.high)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.speedup.level)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.mann_whitney.p_value)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.cliffs_delta)).unwrap_or_default());
    r.push(cmp.map(|c| num(c.hodges_lehmann_ms)).unwrap_or_default());
    r.push(opt(cmp.map(|c| c.verdict)));
    r.push(imp.flags.join("; "));
    debug_assert_eq!(r.len(), CSV_HEADER.len());
    r
}

/// The CSV text of the run.
pub fn to_csv(results: &RunResults) -> anyhow::Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    w.write_record(CSV_HEADER).context("writing CSV header")?;
    for c in &results.configs {
        if c.implementations.is_empty() {
            w.write_record(row(results, c, None))
                .context("writing CSV row")?;
        }
        for imp in &c.implementations {
            w.write_record(row(results, c, Some(imp)))
                .context("writing CSV row")?;
        }
    }
    let bytes = w
        .into_inner()
        .map_err(|e| anyhow::anyhow!("finishing CSV: {e}"))?;
    String::from_utf8(bytes).context("CSV is not UTF-8")
}
