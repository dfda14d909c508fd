//! Error metrics against a reference, and per-dtype tolerances: the correctness gate every
//! implementation passes before it is timed.
//!
//! Metrics (over the compared elements, see [`ErrorMetrics`]):
//!
//! - `max_abs` = max |out − ref|, `mean_abs` = mean |out − ref|;
//! - `max_rel` = max |out − ref| / max(|ref|, eps) with **eps = 1e-3 · max|ref|** (1 when
//!   the reference is all zeros), so elements whose reference is near zero are judged
//!   against the tensor's scale instead of exploding;
//! - `rel_l2` = ‖out − ref‖₂ / ‖ref‖₂ (‖out − ref‖₂ when ‖ref‖₂ = 0);
//! - per row ([`check_rows`]: rows of `row_len` consecutive elements — one query row of one
//!   head for attention, the head dim; one token for MoE, the hidden dim):
//!   `max_row_rel_l2` = max over rows of ‖out_r − ref_r‖₂ / max(‖ref_r‖₂, ‖ref‖_rms / 16),
//!   where ‖ref‖_rms = √(mean over rows of ‖ref_r‖₂²) is the RMS row norm (1 when the
//!   reference is all zeros), and `worst_row` is the row where it is reached.
//!
//! The gate ([`check`]) passes when `rel_l2 ≤ tolerance.rel_l2` and
//! `max_abs ≤ tolerance.max_abs`, every output value is finite, the reference is finite
//! and the lengths agree. A NaN or ±inf in the output always fails. [`check_rows`] adds
//! `max_row_rel_l2 ≤ tolerance.row_rel_l2`: one relative L2 over the whole output averages
//! a wrong tile away — k wrong rows among N with row errors ε move it by ε·√(k/N), so a
//! 128-row tile with a 9% error among 4096 rows, or a fully wrong one (ε ≈ 1) among the
//! ~600k rows of a B=4 H=32 S=4096 problem, stays inside the bf16 1.6e-2 — the row bound
//! does not.
//!
//! **Why the floor `‖ref‖_rms / 16`.** A row's relative error is judged against its own
//! norm, except for rows whose reference is (nearly) zero — no visible key, or a
//! cancellation — where it would explode. The absolute error a correct kernel makes on a
//! row is set by the magnitudes it sums, of the order of a typical row's norm, not by a
//! cancellation in the result; so below 1/16 of the RMS row norm a row is judged on its
//! absolute error against that scale (bf16: ‖err_r‖ ≤ 3.2e-2 · ‖ref‖_rms / 16 ≈ 0.5 unit
//! roundoff of a typical row). Ordinary rows never reach the floor: the smallest
//! attention row norm measured is 0.26 × the RMS (causal S = 4096, where late rows average
//! over more keys), and MoE token rows are of similar norms.

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
    /// Worst per-row error, ‖out_r − ref_r‖₂ / max(‖ref_r‖₂, ‖ref‖_rms / 16) (module
    /// docs); 0 when no row length was given ([`check`], [`error_metrics`]).
    #[serde(default)]
    pub max_row_rel_l2: f64,
    /// The row where `max_row_rel_l2` is reached (`None` without rows, or when every row
    /// is exact).
    #[serde(default)]
    pub worst_row: Option<usize>,
    /// Rows compared (0 without a row length).
    #[serde(default)]
    pub rows: usize,
}

/// Pass thresholds. `rel_l2` is the primary criterion; `max_abs` catches a few wildly
/// wrong elements that a norm would average away, and assumes O(1) data (attention
/// outputs are convex combinations of V ∈ [-1, 1]; MoE outputs are smaller); `row_rel_l2`
/// bounds the worst row ([`check_rows`]) so that one wrong tile of rows fails.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Tolerance {
    pub rel_l2: f64,
    pub max_abs: f64,
    /// Bound on `max_row_rel_l2` (applied by [`check_rows`] only).
    #[serde(default)]
    pub row_rel_l2: f64,
}

/// Per-row bound as a multiple of the global `rel_l2` tolerance (see [`tolerance`]).
pub const ROW_TOLERANCE_FACTOR: f64 = 2.0;

/// Rows whose reference norm is below the RMS row norm divided by this are judged against
/// RMS / ROW_FLOOR_DIVISOR instead of their own norm (module docs).
pub const ROW_FLOOR_DIVISOR: f64 = 16.0;

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
///
/// Per-row bound `row_rel_l2` = [`ROW_TOLERANCE_FACTOR`] (2) × `rel_l2`: bf16 3.2e-2 (8·u),
/// f16 8e-3 (16·u), f32 2e-4. Rationale: rounding the output alone keeps every row within
/// u exactly (|fl(x) − x| ≤ u·|x| element-wise), and rounding P before P·V adds an error of
/// the same order. Measured: a bf16/f16 FlashAttention emulated on the CPU (P rounded to
/// the dtype, f32 row sums, O rounded) against the f64 reference, 40k rows of head dim
/// 64/128 over the quick shapes and causal S up to 4096, has its worst row at 0.8–0.9·u
/// (bf16 ≤ 3.7e-3, f16 ≤ 4.4e-4) for a global rel_l2 of 2.0–2.4e-3 / 2.5–3.0e-4 — the
/// figures the H100 kernels and the PyTorch baselines publish (bf16 attention 2.3e-3,
/// decode ≤ 3.2e-3, MoE 4.1e-3 whose token rows of 1–7k elements sit near their global
/// value; f16 ≤ 3.0e-4). The bound is ≥ 8× the worst correct row — the margin the global
/// tolerance keeps over correct kernels (4·u vs 0.6·u) — and 30× below the error of a
/// wrong row (≥ 1 for a row of garbage, zeros or another row's output).
pub fn tolerance(dtype: DType) -> Tolerance {
    let (rel_l2, max_abs) = match dtype {
        DType::Bf16 => (1.6e-2, 0.1),
        DType::F16 => (4e-3, 0.02),
        DType::F32 => (1e-4, 1e-3),
    };
    Tolerance {
        rel_l2,
        max_abs,
        row_rel_l2: ROW_TOLERANCE_FACTOR * rel_l2,
    }
}

/// Tolerance for log-sum-exp outputs (f32, natural log) against the f64 reference.
/// LSE is computed in f32 in every kernel from the same dtype-rounded inputs, so only
/// f32 accumulation error remains (≈1e-6 on values of a few units); `max_abs` 1e-2 is
/// generous, and `rel_l2` 1e-3 is a backstop.
pub const LSE_TOLERANCE: Tolerance = Tolerance {
    rel_l2: 1e-3,
    max_abs: 1e-2,
    // One value per row: max_abs is the per-row bound.
    row_rel_l2: 0.0,
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
/// a −inf output counts as exact. With `rows = Some((row_len, floor_divisor))` (row_len
/// > 0), also the per-row metric, rows judged against max(‖ref_r‖, RMS / floor_divisor).
fn compare<T: Copy + Into<f64>>(
    out: &[T],
    reference: &[f64],
    lse: bool,
    rows: Option<(usize, f64)>,
) -> Acc {
    let floor_divisor = rows.map_or(ROW_FLOOR_DIVISOR, |r| r.1);
    let row_len = rows.map(|r| r.0);
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
    // Per row: (Σ err², Σ ref²) over the row's finite pairs.
    let row_len = row_len.filter(|&l| l > 0);
    let mut row_sums: Vec<(f64, f64)> = match row_len {
        Some(l) => vec![(0.0, 0.0); n.div_ceil(l)],
        None => Vec::new(),
    };
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
        if let Some(l) = row_len {
            let row = &mut row_sums[idx / l];
            row.0 += e * e;
            row.1 += r * r;
        }
    }
    if !row_sums.is_empty() {
        m.rows = row_sums.len();
        let total_ref: f64 = row_sums.iter().map(|r| r.1).sum();
        let rms = (total_ref / row_sums.len() as f64).sqrt();
        let floor = if rms > 0.0 { rms / floor_divisor } else { 1.0 };
        for (i, &(err_sq, ref_sq)) in row_sums.iter().enumerate() {
            let e = err_sq.sqrt() / ref_sq.sqrt().max(floor);
            // `>` keeps the first worst row; a NaN error (impossible over finite pairs)
            // would be caught by the non-finite count.
            if e > m.max_row_rel_l2 {
                m.max_row_rel_l2 = e;
                m.worst_row = Some(i);
            }
        }
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
    compare(out, reference, false, None).metrics
}

/// [`error_metrics`] for an f64 output.
pub fn error_metrics_f64(out: &[f64], reference: &[f64]) -> ErrorMetrics {
    compare(out, reference, false, None).metrics
}

/// [`error_metrics`] with the per-row metric over rows of `row_len` elements.
pub fn error_metrics_rows(out: &[f32], reference: &[f64], row_len: usize) -> ErrorMetrics {
    compare(out, reference, false, Some((row_len, ROW_FLOOR_DIVISOR))).metrics
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
    if m.rows > 0 && (m.max_row_rel_l2.is_nan() || m.max_row_rel_l2 > tol.row_rel_l2) {
        reasons.push(format!(
            "row {} of {} has relative L2 error {:.3e}, over the per-row tolerance {:.1e}",
            m.worst_row.unwrap_or(0),
            m.rows,
            m.max_row_rel_l2,
            tol.row_rel_l2
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
    let acc = compare(out, reference, false, None);
    verdict(acc, tolerance(dtype), out.len(), reference.len(), false)
}

/// [`check`] for an f64 output.
pub fn check_f64(out: &[f64], reference: &[f64], dtype: DType) -> Check {
    let acc = compare(out, reference, false, None);
    verdict(acc, tolerance(dtype), out.len(), reference.len(), false)
}

/// [`check`] plus the per-row bound: the output is rows of `row_len` consecutive elements
/// (attention: the head dim, one query row of one head; MoE: the hidden dim, one token),
/// and the worst row's relative L2 error (module docs: against max(‖ref_r‖, RMS/16)) must
/// be within `tolerance(dtype).row_rel_l2`; a failure names the row. `row_len` 0 means no
/// rows (as [`check`]); a length that is not a multiple of `row_len` ends in a short row.
pub fn check_rows(out: &[f32], reference: &[f64], dtype: DType, row_len: usize) -> Check {
    let acc = compare(out, reference, false, Some((row_len, ROW_FLOOR_DIVISOR)));
    verdict(acc, tolerance(dtype), out.len(), reference.len(), false)
}

/// Gate a log-sum-exp output (f32, natural log) with [`LSE_TOLERANCE`]. A reference −inf
/// (a row with no visible key) must be −inf in the output and then counts as exact; any
/// other non-finite value fails.
pub fn check_lse(out: &[f32], reference: &[f64]) -> Check {
    let acc = compare(out, reference, true, None);
    verdict(acc, LSE_TOLERANCE, out.len(), reference.len(), true)
}

/// Per-row bound of a gradient as a multiple of the global `rel_l2` tolerance
/// ([`check_gradient`]).
pub const GRADIENT_ROW_FACTOR: f64 = 8.0;

/// Gradient rows whose reference norm is below the RMS row norm divided by this are judged
/// against RMS / GRADIENT_ROW_FLOOR_DIVISOR ([`check_gradient`]).
pub const GRADIENT_ROW_FLOOR_DIVISOR: f64 = 4.0;

/// Tolerances of a gradient stored in `dtype` ([`check_gradient`]): the forward's global
/// `rel_l2`, a per-row bound of [`GRADIENT_ROW_FACTOR`] × that, and no `max_abs` bound
/// (infinite).
///
/// Why they differ from the forward's: a gradient is not O(1) — dk and dv sum over every
/// query row that sees a key, dW over every token of an expert — so an absolute bound has
/// no fixed scale, and the per-row bound (row floor RMS / [`GRADIENT_ROW_FLOOR_DIVISOR`])
/// is what catches isolated garbage instead. Many gradient rows are small by cancellation:
/// dq of a causal row that sees one key is exactly 0 (dS = P·(dP − Δ) vanishes when P = 1),
/// and a few keys give a near-zero dq built from terms of ordinary size; a backward that
/// takes Δ = rowsum(dO ∘ O) from the forward's dtype-rounded O (as every FlashAttention
/// backward does) carries O's rounding into those rows. The bounds are the library's GPU
/// backward tests' (attention/backward/gpu_tests.rs: rows within 8 × tol with the RMS/4
/// floor after the forward plan); a wrong mask, scale, GQA reduction or tile leaves row
/// errors of order 1.
pub fn gradient_tolerance(dtype: DType) -> Tolerance {
    let rel_l2 = tolerance(dtype).rel_l2;
    Tolerance {
        rel_l2,
        max_abs: f64::INFINITY,
        row_rel_l2: GRADIENT_ROW_FACTOR * rel_l2,
    }
}

/// Gate a gradient stored in `dtype` against the f64 reference: global relative L2 and
/// the per-row bound of [`gradient_tolerance`], rows of `row_len` elements judged against
/// max(‖ref_r‖, RMS / [`GRADIENT_ROW_FLOOR_DIVISOR`]). NaN/inf in the output, a non-finite
/// reference or a length mismatch always fail.
pub fn check_gradient(out: &[f32], reference: &[f64], dtype: DType, row_len: usize) -> Check {
    let acc = compare(
        out,
        reference,
        false,
        Some((row_len, GRADIENT_ROW_FLOOR_DIVISOR)),
    );
    verdict(
        acc,
        gradient_tolerance(dtype),
        out.len(),
        reference.len(),
        false,
    )
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

    /// Deterministic pseudo-random values in [-1, 1) (splitmix64).
    fn uniform(n: usize, seed: u64) -> Vec<f64> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = x;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                (z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn one_wrong_tile_fails_the_row_bound_where_the_global_l2_passes() {
        // 4096 rows of head dim 64; rows 1024..1152 (one 128-row tile) are 8.5% off, as a
        // tile with a wrong rescale factor would be. Globally that is 0.085·√(128/4096) =
        // 1.5e-2, just under the bf16 tolerance, and max_abs ≤ 0.09 < 0.1: the global
        // gate passes, the per-row bound (3.2e-2) does not.
        let (rows, d) = (4096, 64);
        let r = uniform(rows * d, 1);
        let mut o: Vec<f32> = r.iter().map(|&x| DType::Bf16.round(x as f32)).collect();
        for x in &mut o[1024 * d..1152 * d] {
            *x *= 1.085;
        }
        let global = check(&o, &r, DType::Bf16);
        assert!(global.passed, "{global:?}");
        assert!(global.metrics.rel_l2 > 1.4e-2, "{global:?}");
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(!c.passed);
        assert_eq!(c.metrics.rows, rows);
        let w = c.metrics.worst_row.unwrap();
        assert!((1024..1152).contains(&w), "worst row {w}");
        assert!(c.metrics.max_row_rel_l2 > 0.08, "{c:?}");
        let why = c.reason.unwrap();
        assert!(
            why.contains(&format!("row {w} of 4096")) && why.contains("per-row tolerance"),
            "{why}"
        );
        // The metrics agree with error_metrics_rows.
        assert_eq!(error_metrics_rows(&o, &r, d), c.metrics);

        // A fully wrong tile (zeros) among ~600k rows: the global L2 passes, the row fails.
        let (rows, d) = (600_000, 8);
        let r = uniform(rows * d, 2);
        let mut o: Vec<f32> = r.iter().map(|&x| DType::Bf16.round(x as f32)).collect();
        o[5000 * d..5128 * d].fill(0.0);
        // max_abs catches zeroed values of O(1) data: scale the reference below it.
        let r: Vec<f64> = r.iter().map(|x| x * 0.05).collect();
        let o: Vec<f32> = o.iter().map(|x| x * 0.05).collect();
        assert!(check(&o, &r, DType::Bf16).passed);
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(!c.passed);
        assert!((5000..5128).contains(&c.metrics.worst_row.unwrap()));
        assert!((c.metrics.max_row_rel_l2 - 1.0).abs() < 0.2, "{c:?}");
    }

    #[test]
    fn rounding_noise_passes_the_row_bound() {
        // Output rounding alone keeps every row within u (|fl(x) − x| ≤ u·|x|); add a
        // further relative noise of up to u per element, as rounding P before P·V does.
        for (dt, u) in [(DType::Bf16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
            for d in [64, 128] {
                let rows = 4096;
                let r = uniform(rows * d, 3);
                let noise = uniform(rows * d, 4);
                let o: Vec<f32> = r
                    .iter()
                    .zip(&noise)
                    .map(|(&x, &e)| dt.round((x * (1.0 + u * e)) as f32))
                    .collect();
                let c = check_rows(&o, &r, dt, d);
                assert!(c.passed, "{dt:?} d={d}: {c:?}");
                assert!(c.metrics.max_row_rel_l2 < 2.0 * u, "{dt:?}: {c:?}");
                assert!(c.metrics.max_row_rel_l2 * 4.0 < c.tolerance.row_rel_l2);
            }
        }
        // f32 accumulation noise.
        let r = uniform(64 * 1000, 5);
        let o: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        assert!(check_rows(&o, &r, DType::F32, 64).passed);
    }

    #[test]
    fn nan_fails_check_rows_and_the_other_rows_are_still_measured() {
        let d = 64;
        let r = uniform(100 * d, 6);
        let mut o: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        o[37 * d + 5] = f32::NAN;
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(!c.passed);
        assert_eq!(c.metrics.non_finite, 1);
        assert!(c.reason.as_deref().unwrap().contains("non-finite"));
        assert!(c.metrics.max_row_rel_l2 < 1e-6, "{c:?}");
        // Every row NaN: still a failure, never a pass by an empty maximum.
        let o = vec![f32::NAN; r.len()];
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(!c.passed && c.metrics.non_finite == r.len());
    }

    #[test]
    fn zero_reference_rows_are_judged_against_the_rms_floor() {
        let d = 64;
        let rows = 256;
        // Values exact in f32, so an f32 copy is exact.
        let mut r: Vec<f64> = uniform(rows * d, 7)
            .into_iter()
            .map(|x| x as f32 as f64)
            .collect();
        r[10 * d..11 * d].fill(0.0); // a row with no visible key: O = 0
        let exact: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        let c = check_rows(&exact, &r, DType::Bf16, d);
        assert!(c.passed && c.metrics.max_row_rel_l2 == 0.0, "{c:?}");
        assert_eq!(c.metrics.worst_row, None);
        // Tiny absolute noise on the zero row: judged against RMS/16 (≈ 0.29), not 0.
        let rms = (r.iter().map(|x| x * x).sum::<f64>() / rows as f64).sqrt();
        let mut o = exact.clone();
        for x in &mut o[10 * d..11 * d] {
            *x = 1e-4;
        }
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(c.passed, "{c:?}");
        assert_eq!(c.metrics.worst_row, Some(10));
        let want = (1e-4f64 * 1e-4 * d as f64).sqrt() / (rms / ROW_FLOOR_DIVISOR);
        assert!(
            (c.metrics.max_row_rel_l2 / want - 1.0).abs() < 1e-3,
            "{c:?}"
        );
        // Garbage where the reference row is zero fails.
        for x in &mut o[10 * d..11 * d] {
            *x = 0.05;
        }
        let c = check_rows(&o, &r, DType::Bf16, d);
        assert!(!c.passed && c.metrics.worst_row == Some(10), "{c:?}");
        // An all-zero reference: absolute row errors (floor 1).
        let z = vec![0f64; 4 * d];
        let mut o = vec![0f32; 4 * d];
        assert!(check_rows(&o, &z, DType::Bf16, d).passed);
        o[3 * d] = 0.5;
        let c = check_rows(&o, &z, DType::Bf16, d);
        assert_eq!(
            (c.metrics.max_row_rel_l2, c.metrics.worst_row),
            (0.5, Some(3))
        );
        assert!(!c.passed);
    }

    #[test]
    fn row_edge_cases() {
        // row_len 0 = no rows, as check(); a short last row is a row.
        let r = uniform(10, 8);
        let o: Vec<f32> = r.iter().map(|&x| x as f32).collect();
        let c = check_rows(&o, &r, DType::F32, 0);
        assert!(c.passed && c.metrics.rows == 0);
        assert_eq!(check_rows(&o, &r, DType::F32, 4).metrics.rows, 3);
        let mut o = o;
        o[9] += 1.0;
        assert_eq!(check_rows(&o, &r, DType::F32, 4).metrics.worst_row, Some(2));
        // Without rows, check() reports no row metric and applies no row bound.
        let m = check(&o, &r, DType::F32).metrics;
        assert_eq!((m.rows, m.worst_row, m.max_row_rel_l2), (0, None, 0.0));
        assert!(check_rows(&[], &[], DType::Bf16, 64).passed);
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
        assert_eq!(
            (b.row_rel_l2, h.row_rel_l2, f.row_rel_l2),
            (3.2e-2, 8e-3, 2e-4)
        );
    }

    /// Gradients: no absolute bound (large values pass when relatively close), the row
    /// bound at 8 × tol with the RMS/4 floor, NaN and length mismatches fail.
    #[test]
    fn gradient_check_scales_with_the_gradient() {
        let d = 64;
        let r: Vec<f64> = uniform(256 * d, 11).iter().map(|v| 50.0 * v).collect();
        // 0.5% relative noise on values of up to 50: max_abs ≈ 0.25, far above bf16's 0.1.
        let noise = uniform(r.len(), 12);
        let o: Vec<f32> = r
            .iter()
            .zip(&noise)
            .map(|(&v, &n)| (v * (1.0 + 5e-3 * n)) as f32)
            .collect();
        assert!(!check_rows(&o, &r, DType::Bf16, d).passed);
        let c = check_gradient(&o, &r, DType::Bf16, d);
        assert!(c.passed, "{:?}", c.reason);
        assert_eq!(c.tolerance, gradient_tolerance(DType::Bf16));
        assert_eq!(c.tolerance.row_rel_l2, GRADIENT_ROW_FACTOR * 1.6e-2);
        // A row 20% off: the global L2 passes (1 of 256 rows), the row bound does not.
        let mut bad = o.clone();
        for v in &mut bad[7 * d..8 * d] {
            *v *= 1.2;
        }
        let c = check_gradient(&bad, &r, DType::Bf16, d);
        assert!(c.metrics.rel_l2 < 1.6e-2 && !c.passed, "{c:?}");
        assert_eq!(c.metrics.worst_row, Some(7));
        // A near-zero reference row is judged against RMS/4, not its own norm.
        let mut small = r.clone();
        for v in &mut small[3 * d..4 * d] {
            *v *= 1e-6;
        }
        let mut o2: Vec<f32> = small.iter().map(|&v| v as f32).collect();
        let rms = (small.iter().map(|v| v * v).sum::<f64>() / 256.0).sqrt();
        // An error of 0.5 × tol × RMS/4 on that row: within the floor-scaled bound.
        o2[3 * d] += (0.5 * 1.6e-2 * rms / GRADIENT_ROW_FLOOR_DIVISOR) as f32;
        assert!(check_gradient(&o2, &small, DType::Bf16, d).passed);
        let mut nan = o.clone();
        nan[100] = f32::NAN;
        assert!(!check_gradient(&nan, &r, DType::Bf16, d).passed);
        assert!(!check_gradient(&o[1..], &r, DType::Bf16, d).passed);
    }
}
