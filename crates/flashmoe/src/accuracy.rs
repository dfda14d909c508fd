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
    // `!(a <= b)` so that a NaN metric fails too.
    if !(m.rel_l2 <= tol.rel_l2) {
        reasons.push(format!(
            "rel_l2 {:.3e} exceeds tolerance {:.1e}",
            m.rel_l2, tol.rel_l2
        ));
    }
    if !(m.max_abs <= tol.max_abs) {
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
