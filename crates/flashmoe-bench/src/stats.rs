//! Statistics for benchmark samples (times in milliseconds; lower is better).
//!
//! STUB: signatures are the contract; bodies are being written.

use serde::{Deserialize, Serialize};

/// Sample median (mean of the two middle values for even n). NaN-free input assumed.
pub fn median(xs: &[f64]) -> f64 {
    quantile(xs, 0.5)
}

/// Quantile with linear interpolation between order statistics (numpy's default,
/// Hyndman-Fan type 7).
pub fn quantile(_xs: &[f64], _q: f64) -> f64 {
    unimplemented!()
}

pub fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample standard deviation (n − 1 denominator).
pub fn std_dev(_xs: &[f64]) -> f64 {
    unimplemented!()
}

/// Median absolute deviation from the median, unscaled.
pub fn mad(_xs: &[f64]) -> f64 {
    unimplemented!()
}

/// Counts of samples outside Tukey's fences (Q1 − k·IQR, Q3 + k·IQR; k = 1.5 mild,
/// 3 severe). Outliers are reported, never dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outliers {
    pub low_severe: usize,
    pub low_mild: usize,
    pub high_mild: usize,
    pub high_severe: usize,
}

pub fn tukey_outliers(_xs: &[f64]) -> Outliers {
    unimplemented!()
}

/// A point estimate with a confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Interval {
    pub estimate: f64,
    pub low: f64,
    pub high: f64,
    /// Confidence level, e.g. 0.95.
    pub level: f64,
}

impl Interval {
    /// Half-width of the interval relative to the estimate.
    pub fn relative_half_width(&self) -> f64 {
        (self.high - self.low) / 2.0 / self.estimate.abs()
    }
}

/// Percentile bootstrap CI of the median, seeded (same inputs + seed → same interval).
pub fn bootstrap_median_ci(_xs: &[f64], _level: f64, _resamples: usize, _seed: u64) -> Interval {
    unimplemented!()
}

/// Percentile bootstrap CI of the speedup median(baseline) / median(candidate),
/// resampling both groups independently. > 1 means the candidate is faster.
pub fn bootstrap_speedup_ci(
    _baseline: &[f64],
    _candidate: &[f64],
    _level: f64,
    _resamples: usize,
    _seed: u64,
) -> Interval {
    unimplemented!()
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MannWhitney {
    /// U statistic of the first sample.
    pub u: f64,
    /// Normal-approximation z with tie and continuity correction.
    pub z: f64,
    /// Two-sided p-value.
    pub p_value: f64,
}

pub fn mann_whitney_u(_a: &[f64], _b: &[f64]) -> MannWhitney {
    unimplemented!()
}

/// Cliff's delta: P(a > b) − P(a < b), in [−1, 1].
pub fn cliffs_delta(_a: &[f64], _b: &[f64]) -> f64 {
    unimplemented!()
}

/// Hodges-Lehmann shift estimate: median of all pairwise differences a_i − b_j.
pub fn hodges_lehmann(_a: &[f64], _b: &[f64]) -> f64 {
    unimplemented!()
}

/// Descriptive summary of one implementation's samples.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    pub std_dev: f64,
    pub min: f64,
    pub max: f64,
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
    pub p05: f64,
    pub p95: f64,
    pub mad: f64,
    pub median_ci: Interval,
    pub outliers: Outliers,
}

pub fn summarize(_xs: &[f64], _level: f64, _resamples: usize, _seed: u64) -> Summary {
    unimplemented!()
}

/// Outcome of comparing a candidate against a baseline (lower time is better).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Verdict {
    /// Candidate significantly faster, by more than the practical threshold.
    Faster,
    /// Candidate significantly slower, by more than the practical threshold.
    Slower,
    /// The speedup CI lies inside the practical band, or the difference is significant
    /// but smaller than the threshold.
    Same,
    /// Not enough evidence either way.
    Unclear,
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Verdict::Faster => "FASTER",
            Verdict::Slower => "SLOWER",
            Verdict::Same => "SAME",
            Verdict::Unclear => "UNCLEAR",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct VerdictOptions {
    /// Practical threshold as a fraction (0.02 = 2%).
    pub threshold: f64,
    /// Significance level for Mann-Whitney and the CI (0.05).
    pub alpha: f64,
    pub resamples: usize,
    pub seed: u64,
}

impl Default for VerdictOptions {
    fn default() -> Self {
        VerdictOptions {
            threshold: 0.02,
            alpha: 0.05,
            resamples: 2000,
            seed: 0x5eed,
        }
    }
}

/// Full comparison of candidate against baseline.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// median(baseline) / median(candidate) with its bootstrap CI at level 1 − alpha.
    pub speedup: Interval,
    pub mann_whitney: MannWhitney,
    /// Cliff's delta of baseline vs candidate (> 0: baseline times larger, candidate faster).
    pub cliffs_delta: f64,
    /// Hodges-Lehmann shift baseline − candidate in ms (> 0: candidate faster).
    pub hodges_lehmann_ms: f64,
    pub verdict: Verdict,
}

pub fn compare_samples(_baseline: &[f64], _candidate: &[f64], _opts: &VerdictOptions) -> Comparison {
    unimplemented!()
}
