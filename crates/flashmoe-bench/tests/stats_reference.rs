//! Reference tests of `flashmoe_bench::stats` against numpy / SciPy values and
//! brute-force computations.
//!
//! Reference values were produced with numpy 2.4.6 / SciPy 1.17.1; each literal is
//! preceded by the exact Python expression (with `import numpy as np,
//! scipy.stats as st`).

use flashmoe_bench::stats::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const ODD: [f64; 7] = [3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0];
const EVEN: [f64; 6] = [1.0, 2.0, 4.0, 8.0, 3.0, 10.0];
const QS: [f64; 9] = [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0];

fn assert_close(got: f64, want: f64, rel: f64) {
    let tol = rel * want.abs().max(f64::MIN_POSITIVE);
    assert!(
        (got - want).abs() <= tol,
        "got {got:e}, want {want:e} (rel tol {rel:e})"
    );
}

#[test]
fn quantiles_match_numpy_odd_n() {
    // np.quantile([3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0],
    //             [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0])
    let want = [
        1.2,
        1.5,
        1.8000000000000003,
        2.6500000000000004,
        4.4,
        6.25,
        8.160000000000002,
        9.029999999999998,
        9.9,
    ];
    let mut sorted = ODD.to_vec();
    sorted.sort_by(f64::total_cmp);
    for (&q, &w) in QS.iter().zip(&want) {
        assert_close(quantile(&ODD, q), w, 1e-13);
        assert_close(quantile_sorted(&sorted, q), w, 1e-13);
    }
    // np.median([3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0])
    assert_eq!(median(&ODD), 4.4);
}

#[test]
fn quantiles_match_numpy_even_n() {
    // np.quantile([1.0, 2.0, 4.0, 8.0, 3.0, 10.0],
    //             [0.0, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0])
    let want = [1.0, 1.25, 1.5, 2.25, 3.5, 7.0, 9.0, 9.5, 10.0];
    for (&q, &w) in QS.iter().zip(&want) {
        assert_close(quantile(&EVEN, q), w, 1e-13);
    }
    // np.median([1.0, 2.0, 4.0, 8.0, 3.0, 10.0])
    assert_eq!(median(&EVEN), 3.5);
}

#[test]
fn quantile_edge_cases() {
    assert_eq!(median(&[4.25]), 4.25);
    assert_eq!(quantile(&[4.25], 0.9), 4.25);
    assert!(median(&[]).is_nan());
    assert!(quantile(&[], 0.3).is_nan());
    assert!(quantile_sorted(&[], 0.3).is_nan());
    assert!(quantile(&ODD, f64::NAN).is_nan());
    // q is clamped to [0, 1].
    assert_eq!(quantile(&ODD, -0.5), 1.2);
    assert_eq!(quantile(&ODD, 1.5), 9.9);
    // The input is not reordered.
    let xs = ODD;
    let _ = quantile(&xs, 0.3);
    assert_eq!(xs, ODD);
}

#[test]
fn mad_matches_scipy() {
    // st.median_abs_deviation([3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0], scale=1)
    assert_close(mad(&ODD), 2.2, 1e-13);
    // st.median_abs_deviation([1.0, 2.0, 4.0, 8.0, 3.0, 10.0], scale=1)
    assert_close(mad(&EVEN), 2.0, 1e-13);
    // st.median_abs_deviation([5.0, 1.0, 5.0, 5.0, 2.0, 9.0, 5.0, 3.0], scale=1)
    assert_close(mad(&[5.0, 1.0, 5.0, 5.0, 2.0, 9.0, 5.0, 3.0]), 1.0, 1e-13);
    assert_eq!(mad(&[7.0]), 0.0);
    assert!(mad(&[]).is_nan());
}

#[test]
fn std_dev_matches_numpy() {
    // np.std([3.1, 1.2, 5.5, 2.2, 9.9, 4.4, 7.0], ddof=1)
    assert_close(std_dev(&ODD), 3.002697200216911, 1e-13);
    // np.std([1.0, 2.0, 4.0, 8.0, 3.0, 10.0], ddof=1)
    assert_close(std_dev(&EVEN), 3.559026084010437, 1e-13);
    // np.std([5.0, 1.0, 5.0, 5.0, 2.0, 9.0, 5.0, 3.0], ddof=1)
    assert_close(
        std_dev(&[5.0, 1.0, 5.0, 5.0, 2.0, 9.0, 5.0, 3.0]),
        2.445841952609133,
        1e-13,
    );
    assert_eq!(std_dev(&[3.0]), 0.0);
    assert!(std_dev(&[]).is_nan());
    assert!(mean(&[]).is_nan());
}

#[test]
fn tukey_classifies_crafted_dataset() {
    // 20 values 10.0, 10.1, ..., 11.9 plus six planted outliers.
    // q1, q3 = np.quantile(x, [0.25, 0.75]) -> 10.325, 11.575 (IQR 1.25); fences:
    // severe low 6.575, mild low 8.45, mild high 13.45, severe high 15.325.
    let mut x: Vec<f64> = (0..20).map(|i| 10.0 + 0.1 * i as f64).collect();
    x.extend([7.0, 2.0, 1.0, 13.9, 14.2, 20.0]);
    let o = tukey_outliers(&x);
    assert_eq!(
        o,
        Outliers {
            low_severe: 2,  // 2.0, 1.0 (counted only as severe)
            low_mild: 1,    // 7.0
            high_mild: 2,   // 13.9, 14.2
            high_severe: 1, // 20.0
        }
    );
    assert_eq!(o.total(), 6);
    assert_eq!(tukey_outliers(&[]), Outliers::default());
    assert_eq!(tukey_outliers(&[1.0, 1.0, 1.0]), Outliers::default());
}

/// Reference: r = st.mannwhitneyu(a, b, alternative='two-sided', method='asymptotic',
/// use_continuity=True); U = r.statistic, p = r.pvalue, and
/// |z| = (max(U, n1*n2 - U) - n1*n2/2 - 0.5) / s with s the tie-corrected sigma
/// (SciPy's `_get_mwu_z`; SciPy does not return z itself).
fn check_mw(a: &[f64], b: &[f64], u: f64, p: f64, abs_z: f64) {
    let r = mann_whitney_u(a, b);
    assert_eq!(r.u, u, "U");
    assert_close(r.p_value, p, 1e-11);
    assert_close(r.z.abs(), abs_z, 1e-12);
    // z > 0 iff a tends to be larger, i.e. U above its mean.
    let mu = a.len() as f64 * b.len() as f64 / 2.0;
    assert_eq!(r.z > 0.0, u > mu + 0.5);
    // Swapping the samples mirrors U and z, keeps p.
    let s = mann_whitney_u(b, a);
    assert_eq!(s.u, a.len() as f64 * b.len() as f64 - u);
    assert_eq!(s.z, -r.z);
    assert_eq!(s.p_value, r.p_value);
}

#[test]
fn mann_whitney_matches_scipy_without_ties() {
    check_mw(
        &[1.1, 2.3, 3.7, 4.2, 5.9, 6.4, 7.8, 8.5],
        &[0.4, 1.9, 2.8, 3.3, 4.6, 5.1, 6.7, 7.2],
        39.0,
        0.49483653811309736,
        0.6826365409636548,
    );
    // Unequal sizes, complete separation.
    check_mw(
        &[0.5, 0.7, 0.9],
        &[
            10., 11., 12., 13., 14., 15., 16., 17., 18., 19., 20., 21., 22.,
        ],
        0.0,
        0.01058354713701517,
        2.5561566171859873,
    );
}

#[test]
fn mann_whitney_matches_scipy_with_ties() {
    check_mw(
        &[1., 2., 2., 3., 3., 3., 4., 5., 7., 7.],
        &[2., 3., 3., 4., 4., 6., 7., 8., 8., 9., 9., 10., 12.],
        29.0,
        0.026395380330963385,
        2.2203446627353727,
    );
    // a = [10+((i*37)%23)*0.1 for i in range(30)]
    // b = [11+((j*53)%29)*0.1 for j in range(45)]
    let a: Vec<f64> = (0..30)
        .map(|i| 10.0 + ((i * 37) % 23) as f64 * 0.1)
        .collect();
    let b: Vec<f64> = (0..45)
        .map(|j| 11.0 + ((j * 53) % 29) as f64 * 0.1)
        .collect();
    check_mw(&a, &b, 154.0, 1.7845485247920543e-08, 5.63168746928403);
}

#[test]
fn mann_whitney_degenerate_cases() {
    // |U - mu| < 0.5: SciPy clips p to 1; we report z = 0.
    let r = mann_whitney_u(&[1.0, 4.0], &[2.0, 3.0]);
    assert_eq!((r.u, r.z, r.p_value), (2.0, 0.0, 1.0));
    // All values tied: sigma = 0.
    let r = mann_whitney_u(&[2.5; 5], &[2.5; 7]);
    assert_eq!((r.u, r.z, r.p_value), (17.5, 0.0, 1.0));
    // An empty sample.
    for r in [
        mann_whitney_u(&[], &[1.0, 2.0]),
        mann_whitney_u(&[1.0], &[]),
        mann_whitney_u(&[], &[]),
    ] {
        assert_eq!((r.z, r.p_value), (0.0, 1.0));
        assert!(!r.u.is_nan());
    }
}

#[test]
fn normal_sf_matches_scipy() {
    // st.norm.sf(z) for each z
    let table = [
        (0.0, 0.5),
        (0.1, 0.460172162722971),
        (0.5, 0.3085375387259869),
        (1.0, 0.15865525393145707),
        (1.5, 0.06680720126885807),
        (1.96, 0.024997895148220435),
        (2.5, 0.006209665325776132),
        (3.0, 0.0013498980316300933),
        (4.0, 3.167124183311986e-05),
        (5.0, 2.866515718791933e-07),
        (6.0, 9.865876450376946e-10),
        (8.0, 6.22096057427174e-16),
        (10.0, 7.61985302416047e-24),
        (15.0, 3.6709661993126986e-51),
        (20.0, 2.7536241186061556e-89),
        (30.0, 4.906713927147908e-198),
        (37.0, 5.7255712225239266e-300),
    ];
    for (z, want) in table {
        assert_close(normal_sf(z), want, 1e-12);
        assert_close(normal_sf(-z), 1.0 - want, 1e-15);
    }
    assert_eq!(normal_sf(50.0), 0.0);
}

/// Random data rounded to a coarse grid so that ties are frequent.
fn tied_data(rng: &mut ChaCha8Rng, n: usize, offset: f64) -> Vec<f64> {
    (0..n)
        .map(|_| offset + (rng.gen_range(0.0..5.0f64) * 4.0).round() / 4.0)
        .collect()
}

fn cliffs_brute(a: &[f64], b: &[f64]) -> f64 {
    let mut s = 0i64;
    for &x in a {
        for &y in b {
            s += (x > y) as i64 - (x < y) as i64;
        }
    }
    s as f64 / (a.len() * b.len()) as f64
}

#[test]
fn cliffs_delta_matches_brute_force() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    for &(n, m, off) in &[
        (1, 1, 0.0),
        (5, 9, 0.3),
        (40, 17, -0.5),
        (100, 100, 0.0),
        (333, 250, 1.0),
    ] {
        let a = tied_data(&mut rng, n, off);
        let b = tied_data(&mut rng, m, 0.0);
        let d = cliffs_delta(&a, &b);
        assert_close(d, cliffs_brute(&a, &b), 1e-12);
        assert_close(cliffs_delta(&b, &a), -d, 1e-12);
    }
    assert_eq!(cliffs_delta(&[2.0, 3.0], &[0.0, 1.0]), 1.0);
    assert_eq!(cliffs_delta(&[0.0, 1.0], &[2.0, 3.0]), -1.0);
    assert_eq!(cliffs_delta(&[1.0, 1.0], &[1.0]), 0.0);
    assert!(cliffs_delta(&[], &[1.0]).is_nan());
}

fn hodges_lehmann_brute(a: &[f64], b: &[f64]) -> f64 {
    let diffs: Vec<f64> = a
        .iter()
        .flat_map(|&x| b.iter().map(move |&y| x - y))
        .collect();
    median(&diffs)
}

#[test]
fn hodges_lehmann_matches_brute_force() {
    let mut rng = ChaCha8Rng::seed_from_u64(12);
    for &(n, m, off) in &[
        (1, 1, 0.0),
        (1, 2, 0.0),
        (2, 2, 1.5),
        (7, 3, 0.25),
        (10, 10, -3.0),
        (31, 64, 0.7),
        (300, 251, 2.0),
    ] {
        // With ties.
        let a = tied_data(&mut rng, n, off);
        let b = tied_data(&mut rng, m, 0.0);
        assert_eq!(hodges_lehmann(&a, &b), hodges_lehmann_brute(&a, &b));
        // Continuous, values of mixed sign.
        let a: Vec<f64> = (0..n).map(|_| rng.gen_range(-3.0..5.0) + off).collect();
        let b: Vec<f64> = (0..m).map(|_| rng.gen_range(-4.0..4.0)).collect();
        assert_eq!(hodges_lehmann(&a, &b), hodges_lehmann_brute(&a, &b));
    }
    assert_eq!(hodges_lehmann(&[5.0, 6.0, 7.0], &[1.0, 2.0, 3.0]), 4.0);
    assert_eq!(hodges_lehmann(&[1.0; 4], &[1.0; 3]), 0.0);
    assert!(hodges_lehmann(&[1.0], &[]).is_nan());
}

#[test]
fn hodges_lehmann_large_is_exact_shift() {
    // Beyond 4M pairs the algorithm is still exact: a pure shift gives the shift.
    let base: Vec<f64> = (0..2500)
        .map(|i| 1.0 + (i as f64 * 0.618).fract())
        .collect();
    let shifted: Vec<f64> = base.iter().map(|x| x + 0.5).collect();
    let hl = hodges_lehmann(&shifted, &base);
    assert!((hl - 0.5).abs() < 1e-12, "{hl}");
}
