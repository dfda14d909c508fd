//! Statistics for benchmark samples (times in milliseconds; lower is better).
//!
//! Conventions used throughout this module:
//!
//! * Inputs are assumed NaN-free (NaNs never panic, but give unspecified results).
//! * Empty input never panics: point estimates (median, quantile, mean, std_dev, mad,
//!   cliffs_delta, hodges_lehmann, intervals) are `NaN`; counts are zero; the
//!   Mann-Whitney test reports `p = 1, z = 0`.
//! * Quantiles are numpy's default (linear interpolation, Hyndman-Fan type 7).
//! * Everything that uses randomness takes an explicit seed and uses
//!   [`rand_chacha::ChaCha8Rng`], so results are reproducible bit for bit.

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------
// Descriptive statistics
// ---------------------------------------------------------------------------------

/// Sample median (mean of the two middle values for even n). NaN-free input assumed.
/// Empty input gives NaN.
pub fn median(xs: &[f64]) -> f64 {
    quantile(xs, 0.5)
}

/// Quantile with linear interpolation between order statistics (numpy's default,
/// Hyndman-Fan type 7).
///
/// `q` is clamped to `[0, 1]`; a NaN `q` or empty input gives NaN. Runs in O(n)
/// (selection, no full sort); the input is not modified.
pub fn quantile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() || q.is_nan() {
        return f64::NAN;
    }
    let mut buf = xs.to_vec();
    quantile_mut(&mut buf, q)
}

/// [`quantile`] of data that is already sorted ascending (O(1)). Empty input or a NaN
/// `q` gives NaN; `q` is clamped to `[0, 1]`.
pub fn quantile_sorted(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 || q.is_nan() {
        return f64::NAN;
    }
    let (lo, t) = virtual_index(n, q);
    if t == 0.0 || lo + 1 >= n {
        sorted[lo]
    } else {
        lerp(sorted[lo], sorted[lo + 1], t)
    }
}

/// Type-7 quantile that reorders `buf` in place (selection, O(n)). `buf` non-empty.
fn quantile_mut(buf: &mut [f64], q: f64) -> f64 {
    let n = buf.len();
    let (lo, t) = virtual_index(n, q);
    let (_, &mut a, right) = buf.select_nth_unstable_by(lo, f64::total_cmp);
    if t == 0.0 || right.is_empty() {
        return a;
    }
    let b = right.iter().copied().fold(f64::INFINITY, f64::min);
    lerp(a, b, t)
}

/// Integer part and fraction of the type-7 virtual index `(n − 1)·q`.
fn virtual_index(n: usize, q: f64) -> (usize, f64) {
    let h = (n - 1) as f64 * q.clamp(0.0, 1.0);
    let lo = (h.floor() as usize).min(n - 1);
    (lo, h - lo as f64)
}

/// numpy's `_lerp`: `a + (b − a)·t`, computed from the nearer end for accuracy and
/// monotonicity.
fn lerp(a: f64, b: f64, t: f64) -> f64 {
    let d = b - a;
    if t >= 0.5 {
        b - d * (1.0 - t)
    } else {
        a + d * t
    }
}

/// Arithmetic mean. Empty input gives NaN.
pub fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Sample standard deviation (n − 1 denominator). n = 1 gives 0, empty input NaN.
pub fn std_dev(xs: &[f64]) -> f64 {
    match xs.len() {
        0 => f64::NAN,
        1 => 0.0,
        n => {
            let m = mean(xs);
            let ss: f64 = xs.iter().map(|&x| (x - m) * (x - m)).sum();
            (ss / (n - 1) as f64).sqrt()
        }
    }
}

/// Median absolute deviation from the median, unscaled (SciPy's
/// `median_abs_deviation(x, scale=1)`). Empty input gives NaN.
pub fn mad(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let med = median(xs);
    let mut dev: Vec<f64> = xs.iter().map(|&x| (x - med).abs()).collect();
    quantile_mut(&mut dev, 0.5)
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

impl Outliers {
    /// Total number of outliers (mild + severe, both sides).
    pub fn total(&self) -> usize {
        self.low_severe + self.low_mild + self.high_mild + self.high_severe
    }
}

/// Classifies samples by Tukey's fences, quartiles by [`quantile`]. A sample strictly
/// beyond the 3·IQR fence counts only as severe; one strictly beyond the 1.5·IQR fence
/// (but not the 3·IQR one) as mild. Points exactly on a fence are not outliers. Empty
/// input gives all zeros.
pub fn tukey_outliers(xs: &[f64]) -> Outliers {
    if xs.is_empty() {
        return Outliers::default();
    }
    let mut sorted = xs.to_vec();
    sorted.sort_unstable_by(f64::total_cmp);
    tukey_outliers_sorted(&sorted)
}

fn tukey_outliers_sorted(sorted: &[f64]) -> Outliers {
    let q1 = quantile_sorted(sorted, 0.25);
    let q3 = quantile_sorted(sorted, 0.75);
    let iqr = q3 - q1;
    let (low_severe_fence, low_mild_fence) = (q1 - 3.0 * iqr, q1 - 1.5 * iqr);
    let (high_mild_fence, high_severe_fence) = (q3 + 1.5 * iqr, q3 + 3.0 * iqr);
    let mut o = Outliers::default();
    for &x in sorted {
        if x < low_severe_fence {
            o.low_severe += 1;
        } else if x < low_mild_fence {
            o.low_mild += 1;
        } else if x > high_severe_fence {
            o.high_severe += 1;
        } else if x > high_mild_fence {
            o.high_mild += 1;
        }
    }
    o
}

// ---------------------------------------------------------------------------------
// Bootstrap
// ---------------------------------------------------------------------------------

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

    /// Whether `x` lies in `[low, high]` (false if any bound is NaN).
    pub fn contains(&self, x: f64) -> bool {
        self.low <= x && x <= self.high
    }

    fn nan(level: f64) -> Interval {
        Interval {
            estimate: f64::NAN,
            low: f64::NAN,
            high: f64::NAN,
            level,
        }
    }
}

/// Uniform f64 in the open interval (0, 1), from 53 random bits.
#[inline]
fn open_unit(rng: &mut ChaCha8Rng) -> f64 {
    ((rng.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal variate (Box-Muller, one output per call).
#[inline]
fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let r = (-2.0 * open_unit(rng).ln()).sqrt();
    r * (std::f64::consts::TAU * open_unit(rng)).cos()
}

/// Gamma(shape, 1) variate for shape ≥ 1 (Marsaglia & Tsang, 2000).
fn gamma_variate(shape: f64, rng: &mut ChaCha8Rng) -> f64 {
    debug_assert!(shape >= 1.0);
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let (x, v) = loop {
            let x = standard_normal(rng);
            let v = 1.0 + c * x;
            if v > 0.0 {
                break (x, v * v * v);
            }
        };
        let u = open_unit(rng);
        let x2 = x * x;
        if u < 1.0 - 0.0331 * x2 * x2 || u.ln() < 0.5 * x2 + d * (1.0 - v + v.ln()) {
            return d * v;
        }
    }
}

/// A sample prepared for bootstrapping its median.
///
/// A bootstrap resample draws n indices i.i.d. uniform on {0, …, n−1} into the sorted
/// data, and its order statistics are the data at the order statistics of the indices.
/// Those are `⌊n·U₍ₖ₎⌋` for the order statistics `U₍ₖ₎` of n i.i.d. U(0, 1) (the floor is
/// monotone and maps U(0, 1) to the uniform index). So instead of materialising a
/// resample, each replicate draws the order statistic(s) that form the median directly:
/// `U₍ₖ₎ ~ Beta(k, n + 1 − k)` (two gamma variates), and for even n the next one,
/// `U₍ₖ₊₁₎ = U₍ₖ₎ + (1 − U₍ₖ₎)·(1 − V^{1/(n−k)})`, V ~ U(0, 1) (minimum of the n − k
/// uniforms above `U₍ₖ₎`). The replicate has exactly the distribution of the median of
/// an explicit resample, at O(1) cost per replicate instead of O(n).
struct MedianResampler {
    sorted: Vec<f64>,
}

impl MedianResampler {
    /// `xs` must be non-empty.
    fn new(xs: &[f64]) -> MedianResampler {
        let mut sorted = xs.to_vec();
        sorted.sort_unstable_by(f64::total_cmp);
        MedianResampler { sorted }
    }

    fn median(&self) -> f64 {
        quantile_sorted(&self.sorted, 0.5)
    }

    /// Index into the sorted data of the value at uniform quantile `u`.
    #[inline]
    fn index(&self, u: f64) -> usize {
        ((u * self.sorted.len() as f64) as usize).min(self.sorted.len() - 1)
    }

    /// Indices into the sorted data of the two order statistics whose type-7 mean is
    /// the median of one bootstrap resample (equal for odd n).
    fn resample_median_indices(&self, rng: &mut ChaCha8Rng) -> (usize, usize) {
        let n = self.sorted.len();
        if n == 1 {
            return (0, 0);
        }
        // 1-based rank of the lower middle order statistic.
        let k = n.div_ceil(2);
        let x = gamma_variate(k as f64, rng);
        let y = gamma_variate((n + 1 - k) as f64, rng);
        let u_k = x / (x + y);
        let lo = self.index(u_k);
        if n % 2 == 1 {
            return (lo, lo);
        }
        let min_above = 1.0 - open_unit(rng).powf(1.0 / (n - k) as f64);
        let u_next = u_k + (1.0 - u_k) * min_above;
        (lo, self.index(u_next).max(lo))
    }

    /// Median of one bootstrap resample.
    fn resample_median(&self, rng: &mut ChaCha8Rng) -> f64 {
        let (lo, hi) = self.resample_median_indices(rng);
        if lo == hi {
            self.sorted[lo]
        } else {
            lerp(self.sorted[lo], self.sorted[hi], 0.5)
        }
    }
}

/// Percentile interval `[q((1−level)/2), q((1+level)/2)]` of bootstrap statistics.
fn percentile_interval(estimate: f64, stats: &mut [f64], level: f64) -> Interval {
    if stats.is_empty() {
        return Interval {
            estimate,
            ..Interval::nan(level)
        };
    }
    stats.sort_unstable_by(f64::total_cmp);
    let tail = (1.0 - level) / 2.0;
    Interval {
        estimate,
        low: quantile_sorted(stats, tail),
        high: quantile_sorted(stats, 1.0 - tail),
        level,
    }
}

/// Percentile bootstrap CI of the median, seeded (same inputs + seed → same interval).
///
/// `estimate` is the median of `xs` itself; `low`/`high` are the `(1 − level)/2` and
/// `(1 + level)/2` type-7 quantiles of `resamples` bootstrap medians. `level` should lie
/// in (0, 1). Empty input gives an all-NaN interval; `resamples == 0` gives NaN bounds
/// around the estimate.
///
/// Cost: one sort plus O(1) per resample, independent of n: each bootstrap median is
/// drawn directly from the exact distribution of the median of a resample (see the
/// private `MedianResampler`), rather than by materialising the resample. Single
/// threaded, well under a millisecond for 2000 resamples. The random stream is
/// `ChaCha8Rng::seed_from_u64(seed)`; intervals are bit-for-bit reproducible on a given
/// platform (the variates use `ln`/`cos`/`powf`, so another libm could in rare cases
/// move one replicate).
pub fn bootstrap_median_ci(xs: &[f64], level: f64, resamples: usize, seed: u64) -> Interval {
    if xs.is_empty() {
        return Interval::nan(level);
    }
    let r = MedianResampler::new(xs);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut stats: Vec<f64> = (0..resamples)
        .map(|_| r.resample_median(&mut rng))
        .collect();
    percentile_interval(r.median(), &mut stats, level)
}

/// Percentile bootstrap CI of the speedup median(baseline) / median(candidate),
/// resampling both groups independently. > 1 means the candidate is faster.
///
/// `estimate` is the ratio of the medians of the original samples. Each replicate
/// draws a baseline then a candidate bootstrap median (as in [`bootstrap_median_ci`])
/// from one seeded stream. Empty input gives an all-NaN interval; `resamples == 0`
/// gives NaN bounds around the estimate. O(1) per resample.
pub fn bootstrap_speedup_ci(
    baseline: &[f64],
    candidate: &[f64],
    level: f64,
    resamples: usize,
    seed: u64,
) -> Interval {
    if baseline.is_empty() || candidate.is_empty() {
        return Interval::nan(level);
    }
    let rb = MedianResampler::new(baseline);
    let rc = MedianResampler::new(candidate);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut stats: Vec<f64> = (0..resamples)
        .map(|_| {
            let b = rb.resample_median(&mut rng);
            let c = rc.resample_median(&mut rng);
            b / c
        })
        .collect();
    percentile_interval(rb.median() / rc.median(), &mut stats, level)
}

// ---------------------------------------------------------------------------------
// Two-sample tests and effect sizes
// ---------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MannWhitney {
    /// U statistic of the first sample.
    pub u: f64,
    /// Normal-approximation z with tie and continuity correction.
    pub z: f64,
    /// Two-sided p-value.
    pub p_value: f64,
}

/// Mann-Whitney U test, two-sided, normal approximation with tie correction of the
/// variance and continuity correction 0.5 — SciPy's
/// `mannwhitneyu(a, b, alternative='two-sided', method='asymptotic', use_continuity=True)`.
///
/// * `u` = R1 − n1(n1+1)/2 for `a` (midranks for ties), i.e. the number of pairs with
///   a > b plus half the ties.
/// * `z` = sign(U − μ)·max(|U − μ| − 0.5, 0)/σ, with μ = n1·n2/2 and
///   σ² = n1·n2/12·((n+1) − Σ(t³−t)/(n(n−1))). z > 0 means `a` tends to be larger.
/// * `p_value` = 2·P(Z > |z|), capped at 1.
///
/// Degenerate cases (an empty sample, or every value tied so σ = 0) give `z = 0`,
/// `p = 1`; never NaN. Cost O((n1+n2) log(n1+n2)).
pub fn mann_whitney_u(a: &[f64], b: &[f64]) -> MannWhitney {
    let (n1, n2) = (a.len(), b.len());
    if n1 == 0 || n2 == 0 {
        return MannWhitney {
            u: 0.0,
            z: 0.0,
            p_value: 1.0,
        };
    }
    // (value, from_a) sorted by value.
    let mut all: Vec<(f64, bool)> = a
        .iter()
        .map(|&x| (x, true))
        .chain(b.iter().map(|&x| (x, false)))
        .collect();
    all.sort_unstable_by(|x, y| x.0.total_cmp(&y.0));
    let n = all.len();
    let mut r1 = 0.0f64;
    let mut tie_term = 0.0f64;
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n && all[j].0 == all[i].0 {
            j += 1;
        }
        // Ranks i+1 ..= j share the midrank.
        let t = (j - i) as f64;
        let midrank = (i + 1 + j) as f64 / 2.0;
        let in_a = all[i..j].iter().filter(|e| e.1).count() as f64;
        r1 += in_a * midrank;
        tie_term += t * t * t - t;
        i = j;
    }
    let (n1f, n2f, nf) = (n1 as f64, n2 as f64, n as f64);
    let u = r1 - n1f * (n1f + 1.0) / 2.0;
    let mu = n1f * n2f / 2.0;
    // Tie-corrected variance factor (n+1) − Σ(t³−t)/(n(n−1)). It is exactly 0 when
    // every value is tied and at least 3 otherwise (all but one value tied), so
    // comparing with 1 separates the degenerate case from rounding noise.
    let tie_factor = if n > 1 {
        (nf + 1.0) - tie_term / (nf * (nf - 1.0))
    } else {
        0.0
    };
    if tie_factor < 1.0 {
        return MannWhitney {
            u,
            z: 0.0,
            p_value: 1.0,
        };
    }
    let var = n1f * n2f / 12.0 * tie_factor;
    let d = u - mu;
    let z = d.signum() * (d.abs() - 0.5).max(0.0) / var.sqrt();
    let z = if z == 0.0 { 0.0 } else { z }; // no -0.0
    let p_value = (2.0 * normal_sf(z.abs())).min(1.0);
    MannWhitney { u, z, p_value }
}

/// Upper tail P(Z > z) of the standard normal distribution, accurate to ~1e-14
/// relative for z ≥ 0 (and to ~1e-16 absolute for z < 0, via 1 − sf(−z)).
///
/// Series Φ(z) − ½ = φ(z)·Σ z^(2k+1)/(2k+1)!! for z < 2.5, Laplace's continued fraction
/// of the Mills ratio (modified Lentz) above.
pub fn normal_sf(z: f64) -> f64 {
    if z.is_nan() {
        return f64::NAN;
    }
    if z < 0.0 {
        return 1.0 - normal_sf(-z);
    }
    if z > 40.0 {
        return 0.0; // below the smallest subnormal
    }
    let pdf = (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    if z < 2.5 {
        let z2 = z * z;
        let mut term = z;
        let mut sum = z;
        let mut k = 1.0;
        while term > sum * 1e-17 {
            term *= z2 / (2.0 * k + 1.0);
            sum += term;
            k += 1.0;
        }
        0.5 - pdf * sum
    } else {
        // Mills ratio R(z) = 1/(z + 1/(z + 2/(z + 3/(z + ...)))).
        let tiny = 1e-300;
        let mut f = z;
        let mut c = z;
        let mut d = 0.0;
        for k in 1..1000 {
            let a = k as f64;
            d = z + a * d;
            if d.abs() < tiny {
                d = tiny;
            }
            c = z + a / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = c * d;
            f *= delta;
            if (delta - 1.0).abs() < 1e-16 {
                break;
            }
        }
        pdf / f
    }
}

/// Cliff's delta: P(a > b) − P(a < b), in [−1, 1].
///
/// Sort-based, O((n + m) log m): `b` is sorted once and each `a_i` is placed by binary
/// search. Empty input gives NaN.
pub fn cliffs_delta(a: &[f64], b: &[f64]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return f64::NAN;
    }
    let mut sb = b.to_vec();
    sb.sort_unstable_by(f64::total_cmp);
    let m = sb.len() as u64;
    let mut greater = 0u64; // pairs with a > b
    let mut less = 0u64; // pairs with a < b
    for &x in a {
        let below = sb.partition_point(|&y| y < x) as u64;
        let not_above = sb.partition_point(|&y| y <= x) as u64;
        greater += below;
        less += m - not_above;
    }
    (greater as f64 - less as f64) / (a.len() as f64 * b.len() as f64)
}

/// Hodges-Lehmann shift estimate: median of all pairwise differences a_i − b_j.
///
/// Exact (not subsampled) for any size, without materialising the n·m differences:
/// with both samples sorted, the number of differences ≤ x is counted in O(n + m) by a
/// two-pointer sweep, and the k-th smallest difference is found by bisection over the
/// ordered bit patterns of f64 (≤ 64 sweeps). Total O((n + m)·64 + sort). The result
/// equals the type-7 median of the floating-point differences `a_i − b_j` (mean of the
/// two middle ones for even n·m). Empty input gives NaN.
pub fn hodges_lehmann(a: &[f64], b: &[f64]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return f64::NAN;
    }
    let mut sa = a.to_vec();
    let mut sb = b.to_vec();
    sa.sort_unstable_by(f64::total_cmp);
    sb.sort_unstable_by(f64::total_cmp);
    let total = sa.len() as u64 * sb.len() as u64;
    // 0-based ranks of the median's order statistics.
    let k_lo = (total - 1) / 2;
    let k_hi = total / 2;
    let lo = kth_pairwise_difference(&sa, &sb, k_lo);
    if k_lo == k_hi {
        return lo;
    }
    let hi = if count_differences_le(&sa, &sb, lo) > k_hi {
        lo
    } else {
        kth_pairwise_difference(&sa, &sb, k_hi)
    };
    lerp(lo, hi, 0.5)
}

/// Number of pairs with `a_i − b_j ≤ x` (both sorted ascending). Floating-point
/// subtraction is monotone, so the qualifying j for each i form a suffix whose start
/// moves right as i grows.
fn count_differences_le(a: &[f64], b: &[f64], x: f64) -> u64 {
    let m = b.len();
    let mut j = 0;
    let mut count = 0u64;
    for &ai in a {
        while j < m && ai - b[j] > x {
            j += 1;
        }
        count += (m - j) as u64;
    }
    count
}

/// Monotone map from f64 (non-NaN) to u64 preserving order.
fn f64_key(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

fn f64_from_key(k: u64) -> f64 {
    if k >> 63 == 1 {
        f64::from_bits(k & !(1 << 63))
    } else {
        f64::from_bits(!k)
    }
}

/// k-th smallest (0-based) of the differences `a_i − b_j`, both sorted ascending.
fn kth_pairwise_difference(a: &[f64], b: &[f64], k: u64) -> f64 {
    let mut lo = f64_key(a[0] - b[b.len() - 1]);
    let mut hi = f64_key(a[a.len() - 1] - b[0]);
    // Invariant: count(≤ value(hi)) > k; find the smallest such key.
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if count_differences_le(a, b, f64_from_key(mid)) > k {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    f64_from_key(hi)
}

// ---------------------------------------------------------------------------------
// Summary and verdicts
// ---------------------------------------------------------------------------------

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

/// Descriptive summary; `median_ci` is [`bootstrap_median_ci`]`(xs, level, resamples,
/// seed)`. Empty input gives `n = 0`, NaN statistics and zero outliers.
pub fn summarize(xs: &[f64], level: f64, resamples: usize, seed: u64) -> Summary {
    let mut sorted = xs.to_vec();
    sorted.sort_unstable_by(f64::total_cmp);
    let q = |p: f64| quantile_sorted(&sorted, p);
    Summary {
        n: xs.len(),
        mean: mean(xs),
        std_dev: std_dev(xs),
        min: sorted.first().copied().unwrap_or(f64::NAN),
        max: sorted.last().copied().unwrap_or(f64::NAN),
        median: q(0.5),
        q1: q(0.25),
        q3: q(0.75),
        p05: q(0.05),
        p95: q(0.95),
        mad: mad(xs),
        median_ci: bootstrap_median_ci(xs, level, resamples, seed),
        outliers: if sorted.is_empty() {
            Outliers::default()
        } else {
            tukey_outliers_sorted(&sorted)
        },
    }
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

/// The verdict rule, given the speedup interval (estimate and CI) and the
/// Mann-Whitney p-value. With band `[1/(1+t), 1+t]`:
///
/// * `Same` if the whole CI lies inside the band;
/// * else, if significant (`p < alpha` and the CI excludes 1): `Faster` if the
///   estimate is above `1+t`, `Slower` if below `1/(1+t)`, otherwise `Same` (real but
///   negligible);
/// * else `Unclear` (also whenever the interval is NaN).
pub fn verdict(speedup: &Interval, p_value: f64, threshold: f64, alpha: f64) -> Verdict {
    let upper = 1.0 + threshold;
    let lower = 1.0 / upper;
    if speedup.low >= lower && speedup.high <= upper {
        Verdict::Same
    } else if p_value < alpha && (speedup.low > 1.0 || speedup.high < 1.0) {
        if speedup.estimate > upper {
            Verdict::Faster
        } else if speedup.estimate < lower {
            Verdict::Slower
        } else {
            Verdict::Same
        }
    } else {
        Verdict::Unclear
    }
}

/// Compares candidate against baseline: speedup median(baseline)/median(candidate)
/// with a bootstrap CI at level 1 − alpha ([`bootstrap_speedup_ci`] with the options'
/// resamples and seed), [`mann_whitney_u`]`(baseline, candidate)`,
/// [`cliffs_delta`]`(baseline, candidate)`, [`hodges_lehmann`]`(baseline, candidate)`
/// and the [`verdict`]. An empty side gives NaN estimates and `Unclear`.
pub fn compare_samples(baseline: &[f64], candidate: &[f64], opts: &VerdictOptions) -> Comparison {
    let speedup = bootstrap_speedup_ci(
        baseline,
        candidate,
        1.0 - opts.alpha,
        opts.resamples,
        opts.seed,
    );
    let mann_whitney = mann_whitney_u(baseline, candidate);
    Comparison {
        speedup,
        mann_whitney,
        cliffs_delta: cliffs_delta(baseline, candidate),
        hodges_lehmann_ms: hodges_lehmann(baseline, candidate),
        verdict: verdict(&speedup, mann_whitney.p_value, opts.threshold, opts.alpha),
    }
}

// ---------------------------------------------------------------------------------
// Cross-run verdicts corrected by a calibration workload
// ---------------------------------------------------------------------------------

/// Percentile bootstrap CI of the calibrated speedup of `new` over `old`:
/// `[median(old) / median(new)] / [median(old_cal) / median(new_cal)]`, the candidate's
/// speedup divided by the speedup the fixed calibration workload showed between the same
/// two runs. > 1 means the candidate got faster relative to the machine.
///
/// The four samples are resampled independently (one seeded stream, O(1) per replicate,
/// as in [`bootstrap_speedup_ci`]). Any empty input gives an all-NaN interval.
pub fn bootstrap_calibrated_speedup_ci(
    old: &[f64],
    new: &[f64],
    old_cal: &[f64],
    new_cal: &[f64],
    level: f64,
    resamples: usize,
    seed: u64,
) -> Interval {
    if [old, new, old_cal, new_cal].iter().any(|x| x.is_empty()) {
        return Interval::nan(level);
    }
    let r = [old, new, old_cal, new_cal].map(MedianResampler::new);
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut stats: Vec<f64> = (0..resamples)
        .map(|_| {
            let m = [0, 1, 2, 3].map(|i| r[i].resample_median(&mut rng));
            (m[0] / m[1]) / (m[2] / m[3])
        })
        .collect();
    let est = (r[0].median() / r[1].median()) / (r[2].median() / r[3].median());
    percentile_interval(est, &mut stats, level)
}

/// Verdict of a comparison between two separate runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CrossRunVerdict {
    Faster,
    Slower,
    Same,
    Unclear,
    /// The raw and the calibration-corrected change disagree: the machine moved between the
    /// runs (the calibration workload changed as much as the candidate did, or changed on
    /// its own), so the change cannot be attributed to the code.
    EnvDrift,
}

impl std::fmt::Display for CrossRunVerdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CrossRunVerdict::Faster => "FASTER",
            CrossRunVerdict::Slower => "SLOWER",
            CrossRunVerdict::Same => "SAME",
            CrossRunVerdict::Unclear => "UNCLEAR",
            CrossRunVerdict::EnvDrift => "ENV-DRIFT",
        })
    }
}

impl From<Verdict> for CrossRunVerdict {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Faster => CrossRunVerdict::Faster,
            Verdict::Slower => CrossRunVerdict::Slower,
            Verdict::Same => CrossRunVerdict::Same,
            Verdict::Unclear => CrossRunVerdict::Unclear,
        }
    }
}

/// The calibration part of a cross-run comparison.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CalibratedComparison {
    /// median(old_cal) / median(new_cal) with its bootstrap CI: < 1 means the machine ran
    /// the fixed workload slower in the new run.
    pub calibration: Interval,
    /// [`bootstrap_calibrated_speedup_ci`]: the candidate's speedup relative to the machine.
    pub corrected: Interval,
    /// [`verdict`] of `corrected` (significance from its CI alone).
    pub corrected_verdict: Verdict,
}

/// The calibrated comparison of a candidate measured in two runs, each with its
/// calibration samples. The CI is at level 1 − alpha, resamples and seed from `opts`.
pub fn compare_calibrated(
    old: &[f64],
    new: &[f64],
    old_cal: &[f64],
    new_cal: &[f64],
    opts: &VerdictOptions,
) -> CalibratedComparison {
    let level = 1.0 - opts.alpha;
    let calibration =
        bootstrap_speedup_ci(old_cal, new_cal, level, opts.resamples, opts.seed ^ 0xca1);
    let corrected = bootstrap_calibrated_speedup_ci(
        old,
        new,
        old_cal,
        new_cal,
        level,
        opts.resamples,
        opts.seed,
    );
    // p = 0: the verdict rule then rests on the CI excluding 1 alone.
    let corrected_verdict = verdict(&corrected, 0.0, opts.threshold, opts.alpha);
    CalibratedComparison {
        calibration,
        corrected,
        corrected_verdict,
    }
}

/// The cross-run rule. A change is attributed to the code only when the raw comparison
/// and the calibration-corrected one agree:
///
/// * both `Slower` → `Slower`; both `Faster` → `Faster`;
/// * exactly one of them is `Slower` or `Faster` (or they point opposite ways) →
///   `EnvDrift`: either the machine slowed down or sped up as much as the candidate did,
///   or the calibration moved while the candidate did not;
/// * otherwise the raw verdict (`Same` or `Unclear`).
pub fn cross_run_verdict(raw: Verdict, corrected: Verdict) -> CrossRunVerdict {
    let decisive = |v: Verdict| matches!(v, Verdict::Faster | Verdict::Slower);
    if raw == corrected && decisive(raw) {
        raw.into()
    } else if decisive(raw) || decisive(corrected) {
        CrossRunVerdict::EnvDrift
    } else {
        raw.into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Exact distribution of (lower, upper) median order-statistic indices of a
    /// bootstrap resample of size n, by enumerating all n^n index tuples.
    fn exact_median_index_pairs(n: usize) -> HashMap<(usize, usize), f64> {
        let total = n.pow(n as u32);
        let mut freq = HashMap::new();
        let mut idx = vec![0usize; n];
        for code in 0..total {
            let mut c = code;
            for slot in idx.iter_mut() {
                *slot = c % n;
                c /= n;
            }
            idx.sort_unstable();
            *freq.entry((idx[(n - 1) / 2], idx[n / 2])).or_insert(0.0) += 1.0;
        }
        for v in freq.values_mut() {
            *v /= total as f64;
        }
        freq
    }

    #[test]
    fn resampled_median_has_exact_bootstrap_distribution() {
        let draws = 100_000;
        for n in 1..=6 {
            let data: Vec<f64> = (0..n).map(|i| i as f64).collect();
            let r = MedianResampler::new(&data);
            let mut rng = ChaCha8Rng::seed_from_u64(n as u64);
            let mut got: HashMap<(usize, usize), f64> = HashMap::new();
            for _ in 0..draws {
                *got.entry(r.resample_median_indices(&mut rng))
                    .or_insert(0.0) += 1.0;
            }
            let exact = exact_median_index_pairs(n);
            for key in got.keys() {
                assert!(exact.contains_key(key), "n={n}: impossible pair {key:?}");
            }
            for (key, &p) in &exact {
                let p_hat = got.get(key).copied().unwrap_or(0.0) / draws as f64;
                let sigma = (p * (1.0 - p) / draws as f64).sqrt();
                assert!(
                    (p_hat - p).abs() <= 5.0 * sigma + 1e-9,
                    "n={n} {key:?}: got {p_hat}, exact {p}"
                );
            }
        }
    }

    /// Explicit resampling: median of n uniform indices, by sorting.
    fn explicit_median_index(n: usize, rng: &mut ChaCha8Rng) -> usize {
        let mut idx: Vec<u64> = (0..n).map(|_| rng.next_u64() % n as u64).collect();
        idx.sort_unstable();
        idx[(n - 1) / 2] as usize
    }

    #[test]
    fn resampled_median_matches_explicit_resampling_for_large_n() {
        // Two-sample Kolmogorov-Smirnov distance between the median index of explicit
        // resamples and of the direct order-statistic draw (n = 501, 10k each).
        let n = 501;
        let reps = 10_000;
        let data: Vec<f64> = (0..n).map(|i| i as f64).collect();
        let r = MedianResampler::new(&data);
        let mut rng = ChaCha8Rng::seed_from_u64(99);
        let mut direct: Vec<usize> = (0..reps)
            .map(|_| r.resample_median_indices(&mut rng).0)
            .collect();
        let mut explicit: Vec<usize> = (0..reps)
            .map(|_| explicit_median_index(n, &mut rng))
            .collect();
        direct.sort_unstable();
        explicit.sort_unstable();
        let mut ks = 0.0f64;
        for v in 0..n {
            let fa = direct.partition_point(|&x| x <= v) as f64 / reps as f64;
            let fb = explicit.partition_point(|&x| x <= v) as f64 / reps as f64;
            ks = ks.max((fa - fb).abs());
        }
        // Critical value at alpha = 0.001 is 1.95 * sqrt(2 / 10000) = 0.0276.
        assert!(ks < 0.0276, "KS distance {ks}");
    }

    #[test]
    fn gamma_variate_moments() {
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        for &shape in &[1.0, 2.0, 7.5, 500.0] {
            let m = 20_000;
            let xs: Vec<f64> = (0..m).map(|_| gamma_variate(shape, &mut rng)).collect();
            let mean = mean(&xs);
            let var = std_dev(&xs).powi(2);
            // Gamma(shape, 1): mean = var = shape; standard error of the mean sqrt(shape/m).
            assert!(
                (mean - shape).abs() < 5.0 * (shape / m as f64).sqrt(),
                "{mean}"
            );
            assert!((var / shape - 1.0).abs() < 0.1, "{var}");
        }
    }

    #[test]
    fn open_unit_is_open() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for _ in 0..10_000 {
            let u = open_unit(&mut rng);
            assert!(u > 0.0 && u < 1.0);
        }
    }

    #[test]
    fn f64_key_preserves_order() {
        let xs = [
            f64::NEG_INFINITY,
            -1e300,
            -1.0,
            -f64::MIN_POSITIVE,
            -0.0,
            0.0,
            5e-324,
            1.0,
            2.5,
            f64::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(f64_key(w[0]) < f64_key(w[1]));
        }
        for &x in &xs {
            assert_eq!(f64_from_key(f64_key(x)).to_bits(), x.to_bits());
        }
    }
    #[test]
    fn calibrated_speedup_divides_out_a_common_drift() {
        let noisy = |m: f64, seed: u64| -> Vec<f64> {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..80)
                .map(|_| m * (1.0 + 0.01 * (open_unit(&mut rng) - 0.5)))
                .collect()
        };
        // Candidate and calibration both 20% slower in the new run: corrected ≈ 1.
        let ci = bootstrap_calibrated_speedup_ci(
            &noisy(10.0, 1),
            &noisy(12.0, 2),
            &noisy(2.0, 3),
            &noisy(2.4, 4),
            0.95,
            2000,
            5,
        );
        assert!(ci.contains(1.0), "{ci:?}");
        assert!((ci.estimate - 1.0).abs() < 0.01, "{ci:?}");
        // Candidate 10% slower on a steady machine: corrected ≈ 1/1.1.
        let ci = bootstrap_calibrated_speedup_ci(
            &noisy(10.0, 1),
            &noisy(11.0, 2),
            &noisy(2.0, 3),
            &noisy(2.0, 4),
            0.95,
            2000,
            5,
        );
        assert!(ci.high < 0.93 && ci.low > 0.88, "{ci:?}");
        let empty = bootstrap_calibrated_speedup_ci(&[], &[1.0], &[1.0], &[1.0], 0.95, 10, 0);
        assert!(empty.estimate.is_nan() && empty.low.is_nan());
    }

    #[test]
    fn cross_run_rule_needs_raw_and_corrected_to_agree() {
        use CrossRunVerdict as X;
        use Verdict::*;
        assert_eq!(cross_run_verdict(Slower, Slower), X::Slower);
        assert_eq!(cross_run_verdict(Faster, Faster), X::Faster);
        assert_eq!(cross_run_verdict(Slower, Same), X::EnvDrift);
        assert_eq!(cross_run_verdict(Slower, Unclear), X::EnvDrift);
        assert_eq!(cross_run_verdict(Same, Slower), X::EnvDrift);
        assert_eq!(cross_run_verdict(Unclear, Faster), X::EnvDrift);
        assert_eq!(cross_run_verdict(Slower, Faster), X::EnvDrift);
        assert_eq!(cross_run_verdict(Same, Same), X::Same);
        assert_eq!(cross_run_verdict(Same, Unclear), X::Same);
        assert_eq!(cross_run_verdict(Unclear, Same), X::Unclear);
        assert_eq!(X::EnvDrift.to_string(), "ENV-DRIFT");
    }
}
