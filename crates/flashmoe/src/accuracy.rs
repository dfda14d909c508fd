//! Error metrics against a reference, and per-dtype tolerances: the correctness gate every
//! implementation passes before it is timed.
//!
//! Metrics (over the compared elements, see [`ErrorMetrics`]):
//!
//! - `max_abs` = max |out − ref|, `mean_abs` = mean |out − ref|;
//! - `max_rel` = max |out − ref| / max(|ref|, eps) with **eps = 1e-3 · max|ref|** (1 when
//!   the reference is all zeros), so elements whose reference is near zero are judged
//!   against the tensor's scale instead of exploding;
//! - `rel_l2` = ‖out − ref‖₂ / ‖ref‖₂ (‖out − ref‖₂ when ‖ref‖₂ = 0).
//!
//! The gate ([`check`]) passes when `rel_l2 ≤ tolerance.rel_l2` and
//! `max_abs ≤ tolerance.max_abs`, every output value is finite, the reference is finite
//! and the lengths agree. A NaN or ±inf in the output always fails.

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// Error of an output against a reference.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ErrorMetrics {
    pub max_abs: f64,
    pub mean_abs: f64,
    pub max_rel: f64,
    pub rel_l2: f64,
    /// Output values that are NaN or ±inf (for LSE, a −inf that matches a −inf reference is
    /// exact and not counted). Pairs with a non-finite value are left out of the other
    /// metrics.
    pub non_finite: usize,
    /// Elements compared: the shorter of the two lengths.
    pub count: usize,
}

/// Pass thresholds. `rel_l2` is the primary criterion; `max_abs` catches a few wildly
/// wrong elements that a norm would average away, and assumes O(1) data (attention
/// outputs are convex combinations of V ∈ [-1, 1]; MoE outputs are smaller).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub rel_l2: f64,
    pub max_abs: f64,
}

/// The outcome of a correctness check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub metrics: ErrorMetrics,
    pub tolerance: Tolerance,
    pub passed: bool,
    /// Why it failed (all reasons, `; `-separated); `None` when it passed.
    pub reason: Option<String>,
}

/// Tolerances for outputs stored in `dtype` and computed with at least f32 accumulation,
/// against the f64 reference on the same (dtype-rounded) inputs.
///
/// Rationale: storing a value in the dtype alone costs up to half an ulp — unit roundoff
/// u = 2⁻⁸ ≈ 3.9e-3 for bf16 (8 significant bits), 2⁻¹¹ ≈ 4.9e-4 for f16 (11 bits),
/// 2⁻²⁴ ≈ 6e-8 for f32 — and FlashAttention also rounds P to the dtype before the P·V
/// GEMM. A correct kernel lands around 0.5–2·u in relative L2 (output rounding alone is
/// ≈ u/√3); the thresholds are 4·u for bf16 (1.6e-2) and 8·u for f16 (4e-3), so honest
/// kernels do not flake while a wrong mask, scale, GQA mapping or tile edge (errors of
/// 1e-1 and more) always fails. f32 (1e-4) is loose next to its u to allow f32
/// accumulation in any order over long rows. `max_abs` (bf16 0.1 ≈ 25·u, f16 0.02 ≈ 40·u,
/// f32 1e-3) is generous for O(1) values and only catches isolated garbage.
pub fn tolerance(dtype: DType) -> Tolerance {
    match dtype {
        DType::Bf16 => Tolerance {
            rel_l2: 1.6e-2,
            max_abs: 0.1,
        },
        DType::F16 => Tolerance {
            rel_l2: 4e-3,
            max_abs: 0.02,
        },
        DType::F32 => Tolerance {
            rel_l2: 1e-4,
            max_abs: 1e-3,
        },
    }
}

/// Tolerance for log-sum-exp outputs (f32, natural log) against the f64 reference.
/// LSE is computed in f32 in every kernel from the same dtype-rounded inputs, so only
/// f32 accumulation error remains (≈1e-6 on values of a few units); `max_abs` 1e-2 is
/// generous, and `rel_l2` 1e-3 is a backstop.
pub const LSE_TOLERANCE: Tolerance = Tolerance {
    rel_l2: 1e-3,
    max_abs: 1e-2,
};

/// Running sums of one comparison.
struct Acc {
    metrics: ErrorMetrics,
    /// Reference values that are NaN or ±inf (or −inf not matched, for LSE).
    ref_non_finite: usize,
    /// LSE: rows whose reference is −inf but whose output is finite.
    missed_neg_inf: usize,
    first_bad: Option<usize>,
}

/// Compare `out` against `reference` element-wise. With `lse`, a −inf reference matched by
/// a −inf output counts as exact.
fn compare<T: Copy + Into<f64>>(out: &[T], reference: &[f64], lse: bool) -> Acc {
    let n = out.len().min(reference.len());
    let (out, reference) = (&out[..n], &reference[..n]);
    let max_ref = reference
        .iter()
        .filter(|r| r.is_finite())
        .fold(0f64, |m, r| m.max(r.abs()));
    let eps = if max_ref > 0.0 { 1e-3 * max_ref } else { 1.0 };

    let mut m = ErrorMetrics {
        count: n,
        ..ErrorMetrics::default()
    };
    let (mut ref_non_finite, mut missed_neg_inf) = (0, 0);
    let mut first_bad = None;
    let (mut sum_abs, mut sum_sq_err, mut sum_sq_ref) = (0f64, 0f64, 0f64);
    let mut finite_pairs = 0usize;
    for (idx, (&o, &r)) in out.iter().zip(reference).enumerate() {
        let o: f64 = o.into();
        if lse && r == f64::NEG_INFINITY {
            if o == f64::NEG_INFINITY {
                continue; // exact: no visible key in either
            }
            if o.is_finite() {
                missed_neg_inf += 1;
            } else {
                m.non_finite += 1;
            }
            first_bad.get_or_insert(idx);
            continue;
        }
        if !o.is_finite() {
            m.non_finite += 1;
            first_bad.get_or_insert(idx);
            continue;
        }
        if !r.is_finite() {
            ref_non_finite += 1;
            first_bad.get_or_insert(idx);
            continue;
        }
        let e = (o - r).abs();
        m.max_abs = m.max_abs.max(e);
        m.max_rel = m.max_rel.max(e / r.abs().max(eps));
        sum_abs += e;
        sum_sq_err += e * e;
        sum_sq_ref += r * r;
        finite_pairs += 1;
    }
    if finite_pairs > 0 {
        m.mean_abs = sum_abs / finite_pairs as f64;
    }
    m.rel_l2 = if sum_sq_ref > 0.0 {
        (sum_sq_err / sum_sq_ref).sqrt()
    } else {
        sum_sq_err.sqrt()
    };
    Acc {
        metrics: m,
        ref_non_finite,
        missed_neg_inf,
        first_bad,
    }
}

/// Error metrics of an f32 output against an f64 reference (see the module docs).
/// Compares the first min(len) elements; [`check`] reports a length mismatch.
pub fn error_metrics(out: &[f32], reference: &[f64]) -> ErrorMetrics {
    compare(out, reference, false).metrics
}

/// [`error_metrics`] for an f64 output.
pub fn error_metrics_f64(out: &[f64], reference: &[f64]) -> ErrorMetrics {
    compare(out, reference, false).metrics
}

fn verdict(acc: Acc, tol: Tolerance, out_len: usize, ref_len: usize, lse: bool) -> Check {
    let m = acc.metrics;
    let mut reasons = Vec::new();
    if out_len != ref_len {
        reasons.push(format!(
            "length mismatch: output has {out_len} elements, reference has {ref_len}"
        ));
    }
    if m.non_finite > 0 {
        reasons.push(format!(
            "{} non-finite (NaN/inf) output value(s), first at index {}",
            m.non_finite,
            acc.first_bad.unwrap_or(0)
        ));
    }
    if acc.missed_neg_inf > 0 {
        reasons.push(format!(
            "{} row(s) with no visible key (reference LSE = -inf) have a finite output LSE",
            acc.missed_neg_inf
        ));
    }
    if acc.ref_non_finite > 0 {
        reasons.push(format!(
            "the reference has {} non-finite value(s){}",
            acc.ref_non_finite,
            if lse { " other than -inf" } else { "" }
        ));
    }
    // A NaN metric fails too.
    if m.rel_l2.is_nan() || m.rel_l2 > tol.rel_l2 {
        reasons.push(format!(
            "rel_l2 {:.3e} exceeds tolerance {:.1e}",
            m.rel_l2, tol.rel_l2
        ));
    }
    if m.max_abs.is_nan() || m.max_abs > tol.max_abs {
        reasons.push(format!(
            "max_abs {:.3e} exceeds tolerance {:.1e}",
            m.max_abs, tol.max_abs
        ));
    }
    Check {
        metrics: m,
        tolerance: tol,
        passed: reasons.is_empty(),
        reason: (!reasons.is_empty()).then(|| reasons.join("; ")),
    }
}

/// Gate an output stored in `dtype` against the f64 reference with [`tolerance`]`(dtype)`.
/// NaN/inf in the output, a non-finite reference, or a length mismatch always fail, with
/// the reason given; never panics.
pub fn check(out: &[f32], reference: &[f64], dtype: DType) -> Check {
    let acc = compare(out, reference, false);
    verdict(acc, tolerance(dtype), out.len(), reference.len(), false)
}

/// [`check`] for an f64 output.
pub fn check_f64(out: &[f64], reference: &[f64], dtype: DType) -> Check {
    let acc = compare(out, reference, false);
    verdict(acc, tolerance(dtype), out.len(), reference.len(), false)
}

/// Gate a log-sum-exp output (f32, natural log) with [`LSE_TOLERANCE`]. A reference −inf
/// (a row with no visible key) must be −inf in the output and then counts as exact; any
/// other non-finite value fails.
pub fn check_lse(out: &[f32], reference: &[f64]) -> Check {
    let acc = compare(out, reference, true);
    verdict(acc, LSE_TOLERANCE, out.len(), reference.len(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perfect_match_passes_with_zero_error() {
        let r = [0.5f64, -1.0, 0.25, 0.0];
        let o = [0.5f32, -1.0, 0.25, 0.0];
        for dt in [DType::Bf16, DType::F16, DType::F32] {
            let c = check(&o, &r, dt);
            assert!(c.passed && c.reason.is_none(), "{c:?}");
            assert_eq!(
                c.metrics,
                ErrorMetrics {
                    count: 4,
                    ..ErrorMetrics::default()
                }
            );
            assert_eq!(c.tolerance, tolerance(dt));
        }
        // Empty tensors compare equal.
        assert!(check(&[], &[], DType::F32).passed);
    }

    #[test]
    fn nan_and_inf_always_fail() {
        let r = vec![0.5f64; 100];
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut o = vec![0.5f32; 100];
            o[37] = bad;
            let c = check(&o, &r, DType::Bf16);
            assert!(!c.passed);
            assert_eq!(c.metrics.non_finite, 1);
            let why = c.reason.unwrap();
            assert!(
                why.contains("non-finite") && why.contains("index 37"),
                "{why}"
            );
            // The other 99 elements are exact and still measured.
            assert_eq!(c.metrics.max_abs, 0.0);
            assert!(!check_lse(&o, &r).passed);
        }
        // A NaN reference is never a pass either.
        let c = check(&[1.0], &[f64::NAN], DType::Bf16);
        assert!(!c.passed && c.reason.unwrap().contains("reference"));
    }

    #[test]
    fn perturbation_gives_the_expected_metrics() {
        // ref (3, 4) has norm 5; error (0.03, 0.04) has norm 0.05 → rel_l2 = 0.01.
        let r = [3.0f64, 4.0];
        let o = [3.03f32, 4.04];
        let m = error_metrics(&o, &r);
        assert!((m.rel_l2 - 0.01).abs() < 1e-6, "{m:?}");
        assert!((m.max_abs - 0.04).abs() < 1e-6);
        assert!((m.mean_abs - 0.035).abs() < 1e-6);
        assert!((m.max_rel - 0.01).abs() < 1e-6);
        assert_eq!((m.count, m.non_finite), (2, 0));
        // 1e-2 is inside the bf16 tolerance (1.6e-2), outside f16 (4e-3) and f32.
        assert!(check(&o, &r, DType::Bf16).passed);
        for dt in [DType::F16, DType::F32] {
            let c = check(&o, &r, dt);
            assert!(
                !c.passed && c.reason.as_ref().unwrap().contains("rel_l2"),
                "{c:?}"
            );
        }
        // The f64 variant agrees.
        let m64 = error_metrics_f64(&[3.03, 4.04], &r);
        assert!((m64.rel_l2 - 0.01).abs() < 1e-12);
        assert!(!check_f64(&[3.03, 4.04], &r, DType::F16).passed);
        // One wild element fails on max_abs even when rel_l2 is small.
        let r = vec![1.0f64; 10_000];
        let mut o = vec![1.0f32; 10_000];
        o[5] = 1.5;
        let c = check(&o, &r, DType::Bf16);
        assert!(c.metrics.rel_l2 < 1.6e-2);
        assert!(!c.passed && c.reason.unwrap().contains("max_abs"));
    }

    #[test]
    fn max_rel_uses_a_scale_aware_epsilon() {
        // eps = 1e-3·max|ref| = 1: a 0.5 error on a zero reference is max_rel 0.5, not inf.
        let m = error_metrics(&[1000.0, 0.5], &[1000.0, 0.0]);
        assert_eq!(m.max_rel, 0.5);
        // All-zero reference: rel_l2 falls back to the absolute L2 norm.
        let m = error_metrics(&[3.0, 4.0], &[0.0, 0.0]);
        assert_eq!((m.rel_l2, m.max_rel), (5.0, 4.0));
    }

    #[test]
    fn length_mismatch_fails_without_panicking() {
        let c = check(&[1.0, 2.0, 3.0], &[1.0, 2.0], DType::F32);
        assert!(!c.passed);
        assert!(c
            .reason
            .unwrap()
            .contains("length mismatch: output has 3 elements, reference has 2"));
        assert_eq!(c.metrics.count, 2);
        assert!(!check(&[], &[1.0], DType::Bf16).passed);
        assert!(!check_lse(&[1.0], &[]).passed);
    }

    #[test]
    fn lse_neg_inf_rows_must_match() {
        let ninf64 = f64::NEG_INFINITY;
        let ninf = f32::NEG_INFINITY;
        let r = [ninf64, 2.5, ninf64, 3.0];
        let c = check_lse(&[ninf, 2.5, ninf, 3.001], &r);
        assert!(c.passed, "{c:?}");
        assert_eq!(c.metrics.non_finite, 0);
        assert!((c.metrics.max_abs - 0.001).abs() < 1e-6);
        assert_eq!(c.tolerance, LSE_TOLERANCE);
        // A finite value where the reference says "no visible key".
        let c = check_lse(&[0.0, 2.5, ninf, 3.0], &r);
        assert!(!c.passed && c.reason.unwrap().contains("no visible key"));
        // -inf where the reference is finite.
        let c = check_lse(&[ninf, ninf, ninf, 3.0], &r);
        assert!(!c.passed && c.metrics.non_finite == 1);
        // NaN / +inf where the reference is -inf.
        for bad in [f32::NAN, f32::INFINITY] {
            assert!(!check_lse(&[bad, 2.5, ninf, 3.0], &r).passed);
        }
        // Beyond the LSE tolerance (max_abs 1e-2).
        let c = check_lse(&[ninf, 2.52, ninf, 3.0], &r);
        assert!(!c.passed && c.reason.unwrap().contains("max_abs"));
        // In the O check, -inf is never accepted.
        assert!(!check(&[ninf], &[ninf64], DType::F32).passed);
    }

    #[test]
    fn tolerances_are_ordered_by_precision() {
        let (b, h, f) = (
            tolerance(DType::Bf16),
            tolerance(DType::F16),
            tolerance(DType::F32),
        );
        assert_eq!((b.rel_l2, h.rel_l2, f.rel_l2), (1.6e-2, 4e-3, 1e-4));
        assert!(b.max_abs > h.max_abs && h.max_abs > f.max_abs);
    }
}
