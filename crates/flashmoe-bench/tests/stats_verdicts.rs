//! Bootstrap intervals, summaries and comparison verdicts of
//! `flashmoe_bench::stats` on synthetic timing data.

use flashmoe_bench::stats::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn standard_normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1 = 1.0 - rng.gen::<f64>();
    let u2 = rng.gen::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Lognormal-ish timings around `base` ms with relative noise `sigma`, and with
/// probability `spike` a slow outlier 10–50% above.
fn timings(seed: u64, n: usize, base: f64, sigma: f64, spike: f64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let mut x = base * (sigma * standard_normal(&mut rng)).exp();
            if rng.gen::<f64>() < spike {
                x *= rng.gen_range(1.1..1.5);
            }
            x
        })
        .collect()
}

#[test]
fn bootstrap_is_deterministic_in_the_seed() {
    let xs = timings(1, 300, 2.0, 0.05, 0.02);
    let ys = timings(2, 250, 2.1, 0.05, 0.02);
    let a = bootstrap_median_ci(&xs, 0.95, 1000, 42);
    let b = bootstrap_median_ci(&xs, 0.95, 1000, 42);
    assert_eq!(a, b);
    let c = bootstrap_median_ci(&xs, 0.95, 1000, 43);
    assert_ne!((a.low, a.high), (c.low, c.high));
    let s1 = bootstrap_speedup_ci(&xs, &ys, 0.9, 1000, 7);
    let s2 = bootstrap_speedup_ci(&xs, &ys, 0.9, 1000, 7);
    assert_eq!(s1, s2);
    assert_eq!(s1.level, 0.9);
    // Input order does not matter.
    let mut rev = xs.clone();
    rev.reverse();
    assert_eq!(bootstrap_median_ci(&rev, 0.95, 1000, 42), a);
}

#[test]
fn bootstrap_ci_contains_estimate() {
    for seed in 0..20u64 {
        let n = 5 + 37 * seed as usize;
        let xs = timings(seed, n, 1.0 + seed as f64, 0.1, 0.05);
        let ci = bootstrap_median_ci(&xs, 0.95, 500, seed);
        assert_eq!(ci.estimate, median(&xs));
        assert!(ci.low <= ci.estimate && ci.estimate <= ci.high, "{ci:?}");
        assert!(ci.contains(ci.estimate));
        let ys = timings(seed + 100, n + 3, 1.2 + seed as f64, 0.1, 0.05);
        let s = bootstrap_speedup_ci(&xs, &ys, 0.95, 500, seed);
        assert_eq!(s.estimate, median(&xs) / median(&ys));
        assert!(s.low <= s.estimate && s.estimate <= s.high, "{s:?}");
    }
}

#[test]
fn bootstrap_ci_narrows_with_more_data() {
    let small = bootstrap_median_ci(&timings(3, 50, 1.0, 0.05, 0.0), 0.95, 2000, 1);
    let large = bootstrap_median_ci(&timings(3, 2000, 1.0, 0.05, 0.0), 0.95, 2000, 1);
    // Width scales like 1/sqrt(n): expect about sqrt(40) ≈ 6 times narrower.
    assert!(
        large.relative_half_width() * 3.0 < small.relative_half_width(),
        "{small:?} vs {large:?}"
    );
    let wider = bootstrap_median_ci(&timings(3, 50, 1.0, 0.05, 0.0), 0.99, 2000, 1);
    assert!(wider.high - wider.low >= small.high - small.low);
}

#[test]
fn bootstrap_median_ci_covers_true_median() {
    // Lognormal with sigma 0.05 around 1.0 has median exactly 1.0.
    let trials = 200;
    let covered = (0..trials)
        .filter(|&t| {
            bootstrap_median_ci(&timings(1000 + t, 101, 1.0, 0.05, 0.0), 0.95, 1000, t)
                .contains(1.0)
        })
        .count();
    let coverage = covered as f64 / trials as f64;
    assert!(coverage >= 0.88, "coverage {coverage}");
}

#[test]
fn bootstrap_degenerate_inputs() {
    let one = bootstrap_median_ci(&[3.5], 0.95, 100, 0);
    assert_eq!((one.estimate, one.low, one.high), (3.5, 3.5, 3.5));
    let flat = bootstrap_median_ci(&[2.0; 10], 0.95, 100, 0);
    assert_eq!((flat.low, flat.high), (2.0, 2.0));
    let empty = bootstrap_median_ci(&[], 0.95, 100, 0);
    assert!(empty.estimate.is_nan() && empty.low.is_nan() && empty.high.is_nan());
    let none = bootstrap_median_ci(&[1.0, 2.0], 0.95, 0, 0);
    assert_eq!(none.estimate, 1.5);
    assert!(none.low.is_nan() && none.high.is_nan());
    assert!(bootstrap_speedup_ci(&[], &[1.0], 0.95, 100, 0)
        .estimate
        .is_nan());
    let s = bootstrap_speedup_ci(&[2.0], &[1.0], 0.95, 100, 0);
    assert_eq!((s.estimate, s.low, s.high), (2.0, 2.0, 2.0));
}

#[test]
fn summarize_fills_every_field() {
    let xs = [3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0, 40.0];
    let s = summarize(&xs, 0.95, 500, 9);
    assert_eq!(s.n, 8);
    assert_eq!(s.mean, mean(&xs));
    assert_eq!(s.std_dev, std_dev(&xs));
    assert_eq!((s.min, s.max), (1.2, 40.0));
    assert_eq!(s.median, median(&xs));
    assert_eq!(s.q1, quantile(&xs, 0.25));
    assert_eq!(s.q3, quantile(&xs, 0.75));
    assert_eq!(s.p05, quantile(&xs, 0.05));
    assert_eq!(s.p95, quantile(&xs, 0.95));
    assert_eq!(s.mad, mad(&xs));
    assert_eq!(s.median_ci, bootstrap_median_ci(&xs, 0.95, 500, 9));
    assert_eq!(s.outliers, tukey_outliers(&xs));
    assert_eq!(s.outliers.high_severe, 1);

    let e = summarize(&[], 0.95, 500, 9);
    assert_eq!(e.n, 0);
    assert!(e.median.is_nan() && e.min.is_nan() && e.median_ci.low.is_nan());
    assert_eq!(e.outliers, Outliers::default());
}

fn interval(estimate: f64, low: f64, high: f64) -> Interval {
    Interval {
        estimate,
        low,
        high,
        level: 0.95,
    }
}

#[test]
fn verdict_rule_on_crafted_intervals() {
    let (t, a) = (0.02, 0.05);
    // CI inside [1/1.02, 1.02]: SAME whatever the p-value.
    assert_eq!(
        verdict(&interval(1.0, 0.99, 1.01), 0.001, t, a),
        Verdict::Same
    );
    assert_eq!(
        verdict(&interval(1.0, 0.99, 1.01), 0.9, t, a),
        Verdict::Same
    );
    // Significant and beyond the threshold.
    assert_eq!(
        verdict(&interval(1.10, 1.05, 1.15), 0.001, t, a),
        Verdict::Faster
    );
    assert_eq!(
        verdict(&interval(0.90, 0.85, 0.95), 0.001, t, a),
        Verdict::Slower
    );
    // Significant but the estimate is within the threshold: real but negligible.
    assert_eq!(
        verdict(&interval(1.01, 1.005, 1.03), 0.001, t, a),
        Verdict::Same
    );
    // CI excludes 1 but Mann-Whitney is not significant.
    assert_eq!(
        verdict(&interval(1.10, 1.05, 1.15), 0.2, t, a),
        Verdict::Unclear
    );
    // Mann-Whitney significant but the CI straddles 1.
    assert_eq!(
        verdict(&interval(1.10, 0.99, 1.2), 0.001, t, a),
        Verdict::Unclear
    );
    // NaN interval.
    assert_eq!(
        verdict(&interval(f64::NAN, f64::NAN, f64::NAN), 0.0, t, a),
        Verdict::Unclear
    );
}

#[test]
fn ten_percent_slowdown_is_slower() {
    let base = timings(10, 200, 1.5, 0.01, 0.0);
    let cand = timings(11, 200, 1.5 * 1.1, 0.01, 0.0);
    let c = compare_samples(&base, &cand, &VerdictOptions::default());
    assert_eq!(c.verdict, Verdict::Slower, "{c:?}");
    assert!((c.speedup.estimate - 1.0 / 1.1).abs() < 0.01, "{c:?}");
    assert!(c.speedup.high < 1.0 / 1.02);
    assert_eq!(c.speedup.level, 0.95);
    assert!(c.mann_whitney.p_value < 1e-10 && c.mann_whitney.z < 0.0);
    assert_eq!(c.cliffs_delta, -1.0);
    assert!((c.hodges_lehmann_ms + 0.15).abs() < 0.01, "{c:?}");
}

#[test]
fn ten_percent_speedup_is_faster() {
    let base = timings(12, 200, 1.5, 0.01, 0.0);
    let cand = timings(13, 200, 1.5 / 1.1, 0.01, 0.0);
    let c = compare_samples(&base, &cand, &VerdictOptions::default());
    assert_eq!(c.verdict, Verdict::Faster, "{c:?}");
    assert!((c.speedup.estimate - 1.1).abs() < 0.01, "{c:?}");
    assert!(c.mann_whitney.p_value < 1e-10 && c.mann_whitney.z > 0.0);
    assert_eq!(c.cliffs_delta, 1.0);
    assert!(c.hodges_lehmann_ms > 0.0);
}

#[test]
fn identical_distributions_are_same() {
    let base = timings(14, 200, 1.5, 0.01, 0.02);
    let cand = timings(15, 200, 1.5, 0.01, 0.02);
    let c = compare_samples(&base, &cand, &VerdictOptions::default());
    assert_eq!(c.verdict, Verdict::Same, "{c:?}");
    // The very same samples.
    let c = compare_samples(&base, &base, &VerdictOptions::default());
    assert_eq!(c.verdict, Verdict::Same, "{c:?}");
    assert_eq!(c.speedup.estimate, 1.0);
    assert_eq!((c.cliffs_delta, c.hodges_lehmann_ms), (0.0, 0.0));
    assert_eq!(c.mann_whitney.p_value, 1.0);
}

#[test]
fn tiny_real_difference_is_same() {
    // 0.5% slower with 0.1% noise: clearly significant, practically negligible.
    let base = timings(16, 200, 1.0, 0.001, 0.0);
    let cand = timings(17, 200, 1.005, 0.001, 0.0);
    let c = compare_samples(&base, &cand, &VerdictOptions::default());
    assert!(c.mann_whitney.p_value < 1e-10);
    assert_eq!(c.verdict, Verdict::Same, "{c:?}");
}

#[test]
fn few_noisy_samples_are_unclear() {
    let base = timings(18, 6, 1.0, 0.2, 0.0);
    let cand = timings(19, 6, 1.05, 0.2, 0.0);
    let c = compare_samples(&base, &cand, &VerdictOptions::default());
    assert_eq!(c.verdict, Verdict::Unclear, "{c:?}");
    let e = compare_samples(&[], &cand, &VerdictOptions::default());
    assert_eq!(e.verdict, Verdict::Unclear);
    assert_eq!(e.mann_whitney.p_value, 1.0);
}

#[test]
fn compare_is_deterministic() {
    let base = timings(20, 80, 1.0, 0.05, 0.05);
    let cand = timings(21, 90, 1.03, 0.05, 0.05);
    let opts = VerdictOptions::default();
    assert_eq!(
        compare_samples(&base, &cand, &opts),
        compare_samples(&base, &cand, &opts)
    );
}

#[test]
fn a_a_false_positive_rate_is_at_most_five_percent() {
    // 300 pairs drawn from the same distribution (noise 1%..20%, some with slow
    // spikes), sizes 50..=100 each, default options (2% threshold, alpha 0.05).
    let pairs = 300u64;
    let sigmas = [0.01, 0.03, 0.05, 0.1, 0.2];
    let mut false_positives = 0;
    for k in 0..pairs {
        let mut rng = ChaCha8Rng::seed_from_u64(0xaa00 + k);
        let n = rng.gen_range(50..=100);
        let m = rng.gen_range(50..=100);
        let sigma = sigmas[k as usize % sigmas.len()];
        let spike = if k % 2 == 0 { 0.0 } else { 0.05 };
        let a = timings(2 * k, n, 2.0, sigma, spike);
        let b = timings(2 * k + 1, m, 2.0, sigma, spike);
        let opts = VerdictOptions {
            seed: k,
            ..VerdictOptions::default()
        };
        let v = compare_samples(&a, &b, &opts).verdict;
        if matches!(v, Verdict::Faster | Verdict::Slower) {
            false_positives += 1;
        }
    }
    let rate = false_positives as f64 / pairs as f64;
    assert!(rate <= 0.05, "A/A false-positive rate {rate}");
}

#[test]
fn verdict_serializes_uppercase() {
    assert_eq!(
        serde_json::to_string(&Verdict::Faster).unwrap(),
        "\"FASTER\""
    );
    assert_eq!(Verdict::Unclear.to_string(), "UNCLEAR");
}
