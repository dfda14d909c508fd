//! Tests of the attention references: hand-computed values, masking (causal and sliding
//! window), softcap, GQA, and the tiled f32 FlashAttention-2 against the f64 ground truth.

use super::attention::{attention_f64, softmax_in_place, AttentionInputs};
use super::attention_tiled::{attention_tiled, exp2_fast, tiled_with, Simd};
use crate::accuracy::{check_lse, error_metrics};
use crate::error::Error;
use crate::inputs::{generate, TensorId};
use crate::{AttentionProblem, DType};

fn problem(
    b: usize,
    hq: usize,
    hkv: usize,
    sq: usize,
    sk: usize,
    d: usize,
    causal: bool,
) -> AttentionProblem {
    AttentionProblem {
        batch: b,
        heads_q: hq,
        heads_kv: hkv,
        seqlen_q: sq,
        seqlen_k: sk,
        head_dim: d,
        causal,
        dtype: DType::F32,
        softmax_scale: None,
        window: crate::problem::NO_WINDOW,
        softcap: 0.0,
    }
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * (1.0 + b.abs())
}

/// 1 head, Sq=2, Sk=3, D=2, scale 1:
/// q0=(1,0), q1=(0,2); k0=(0,0), k1=(1,0), k2=(0,1); v0=(1,0), v1=(0,1), v2=(1,1).
fn tiny() -> (AttentionProblem, AttentionInputs) {
    let p = AttentionProblem {
        softmax_scale: Some(1.0),
        ..problem(1, 1, 1, 2, 3, 2, false)
    };
    let x = AttentionInputs {
        q: vec![1.0, 0.0, 0.0, 2.0],
        k: vec![0.0, 0.0, 1.0, 0.0, 0.0, 1.0],
        v: vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0],
    };
    (p, x)
}

#[test]
fn hand_computed_tiny_attention() {
    let e = std::f64::consts::E;
    let (p, x) = tiny();
    // Row 0: scores (0, 1, 0) → weights (1, e, 1)/(e+2).
    // Row 1: scores (0, 0, 2) → weights (1, 1, e²)/(e²+2).
    let want_o = [
        2.0 / (e + 2.0),
        (e + 1.0) / (e + 2.0),
        (1.0 + e * e) / (e * e + 2.0),
        (1.0 + e * e) / (e * e + 2.0),
    ];
    let want_lse = [(e + 2.0).ln(), (e * e + 2.0).ln()];
    let r = attention_f64(&p, &x).unwrap();
    for (g, w) in r.o.iter().zip(&want_o) {
        assert!(close(*g, *w, 1e-14), "o {:?} vs {:?}", r.o, want_o);
    }
    for (g, w) in r.lse.iter().zip(&want_lse) {
        assert!(close(*g, *w, 1e-14), "lse {:?} vs {:?}", r.lse, want_lse);
    }
    let t = attention_tiled(&p, &x, 64, 64).unwrap();
    for (g, w) in t.o.iter().zip(&want_o) {
        assert!(close(*g as f64, *w, 1e-6), "tiled o {:?}", t.o);
    }
    for (g, w) in t.lse.iter().zip(&want_lse) {
        assert!(close(*g as f64, *w, 1e-6), "tiled lse {:?}", t.lse);
    }

    // Causal, bottom-right: row 0 sees keys 0..=1 only → weights (1, e)/(1+e);
    // row 1 sees all three (unchanged).
    let pc = AttentionProblem {
        causal: true,
        ..p.clone()
    };
    let want_o = [1.0 / (1.0 + e), e / (1.0 + e), want_o[2], want_o[3]];
    let want_lse = [(1.0 + e).ln(), want_lse[1]];
    let r = attention_f64(&pc, &x).unwrap();
    for (g, w) in r.o.iter().zip(&want_o) {
        assert!(close(*g, *w, 1e-14), "causal o {:?} vs {:?}", r.o, want_o);
    }
    for (g, w) in r.lse.iter().zip(&want_lse) {
        assert!(close(*g, *w, 1e-14), "causal lse {:?}", r.lse);
    }
    let t = attention_tiled(&pc, &x, 1, 2).unwrap();
    for (g, w) in t.o.iter().zip(&want_o) {
        assert!(close(*g as f64, *w, 1e-6), "tiled causal o {:?}", t.o);
    }
}

#[test]
fn softmax_scale_is_applied() {
    // scale 0.5 on q equals scale 1 on q/2 (both exact powers of two).
    let p = AttentionProblem {
        softmax_scale: Some(0.5),
        ..problem(1, 2, 2, 5, 7, 8, false)
    };
    let x = AttentionInputs::generate(&p, 3);
    let p1 = AttentionProblem {
        softmax_scale: Some(1.0),
        ..p.clone()
    };
    let x1 = AttentionInputs {
        q: x.q.iter().map(|v| v * 0.5).collect(),
        ..x.clone()
    };
    assert_eq!(
        attention_f64(&p, &x).unwrap(),
        attention_f64(&p1, &x1).unwrap()
    );
    // Default scale is 1/sqrt(head_dim) = 1/sqrt(8).
    let pd = AttentionProblem {
        softmax_scale: None,
        ..p.clone()
    };
    let xd = AttentionInputs {
        q: x.q.iter().map(|v| v * 2.0 * (1.0 / 8f32.sqrt())).collect(),
        ..x.clone()
    };
    let a = attention_f64(&pd, &x).unwrap();
    let b = attention_f64(&p, &xd).unwrap();
    assert!(error_metrics_f64_max(&a.o, &b.o) < 1e-6);
}

fn error_metrics_f64_max(a: &[f64], b: &[f64]) -> f64 {
    crate::accuracy::error_metrics_f64(a, b).max_abs
}

#[test]
fn softmax_rows_sum_to_one() {
    // Internal helper: probabilities sum to 1, LSE = log Σ exp.
    let raw: Vec<f64> = generate(5, TensorId::Q, 37, 30.0, DType::F32)
        .iter()
        .map(|&v| v as f64)
        .collect();
    let mut row = raw.clone();
    let lse = softmax_in_place(&mut row);
    let sum: f64 = row.iter().sum();
    assert!((sum - 1.0).abs() < 1e-14, "sum {sum}");
    assert!(row.iter().all(|&p| (0.0..=1.0).contains(&p)));
    let direct = raw.iter().map(|v| v.exp()).sum::<f64>().ln();
    assert!(close(lse, direct, 1e-13), "{lse} vs {direct}");
    // Large scores do not overflow thanks to max subtraction.
    let mut big = vec![1000.0, 1000.0];
    assert!(close(softmax_in_place(&mut big), 1000.0 + 2f64.ln(), 1e-15));
    assert_eq!(big, vec![0.5, 0.5]);

    // Through the API: V = all ones → every output element is Σ p = 1.
    let p = problem(2, 3, 1, 9, 13, 4, true);
    let mut x = AttentionInputs::generate(&p, 11);
    x.q.iter_mut().for_each(|v| *v *= 8.0); // peaky softmax
    x.v.iter_mut().for_each(|v| *v = 1.0);
    let r = attention_f64(&p, &x).unwrap();
    assert!(r.o.iter().all(|&o| (o - 1.0).abs() < 1e-14));
    let t = attention_tiled(&p, &x, 4, 8).unwrap();
    assert!(t.o.iter().all(|&o| (o - 1.0).abs() < 1e-5), "{:?}", t.o);
}

#[test]
fn causal_masked_keys_do_not_change_the_output() {
    for (sq, sk) in [(7, 7), (4, 9), (9, 4)] {
        let p = problem(1, 2, 2, sq, sk, 8, true);
        let x = AttentionInputs::generate(&p, 21);
        // Change key/value j = sk-2 in every head.
        let j = sk - 2;
        let mut y = x.clone();
        for h in 0..2 {
            let off = (j * 2 + h) * 8;
            for t in [&mut y.k, &mut y.v] {
                t[off..off + 8].iter_mut().for_each(|v| *v = 7.0 - *v);
            }
        }
        let (a, b) = (
            attention_f64(&p, &x).unwrap(),
            attention_f64(&p, &y).unwrap(),
        );
        let (ta, tb) = (
            attention_tiled(&p, &x, 2, 3).unwrap(),
            attention_tiled(&p, &y, 2, 3).unwrap(),
        );
        for i in 0..sq {
            let sees = p.visible_keys(i) > j;
            for h in 0..2 {
                let o = (i * 2 + h) * 8..(i * 2 + h + 1) * 8;
                let l = h * sq + i;
                if sees {
                    assert_ne!(a.o[o.clone()], b.o[o.clone()], "sq={sq} sk={sk} row {i}");
                } else {
                    assert_eq!(a.o[o.clone()], b.o[o.clone()], "sq={sq} sk={sk} row {i}");
                    assert_eq!(a.lse[l].to_bits(), b.lse[l].to_bits());
                    assert_eq!(ta.o[o.clone()], tb.o[o], "tiled sq={sq} sk={sk} row {i}");
                    assert_eq!(ta.lse[l].to_bits(), tb.lse[l].to_bits());
                }
            }
        }
    }
}

/// Row i of a causal problem equals non-causal attention of that query over the first
/// visible_keys(i) keys.
#[test]
fn causal_is_bottom_right_aligned_for_sq_ne_sk() {
    for (sq, sk) in [(3, 5), (5, 3), (4, 4), (1, 6)] {
        let d = 4;
        let p = problem(1, 1, 1, sq, sk, d, true);
        let x = AttentionInputs::generate(&p, 8);
        let r = attention_f64(&p, &x).unwrap();
        for i in 0..sq {
            // Query i sees keys j <= i + sk - sq.
            let visible = (i as i64 + sk as i64 - sq as i64 + 1).clamp(0, sk as i64) as usize;
            assert_eq!(p.visible_keys(i), visible);
            let row_o = &r.o[i * d..(i + 1) * d];
            if visible == 0 {
                assert!(row_o.iter().all(|&v| v == 0.0));
                assert_eq!(r.lse[i], f64::NEG_INFINITY);
                continue;
            }
            let pi = problem(1, 1, 1, 1, visible, d, false);
            let xi = AttentionInputs {
                q: x.q[i * d..(i + 1) * d].to_vec(),
                k: x.k[..visible * d].to_vec(),
                v: x.v[..visible * d].to_vec(),
            };
            let ri = attention_f64(&pi, &xi).unwrap();
            assert_eq!(row_o, &ri.o[..], "sq={sq} sk={sk} row {i}");
            assert_eq!(r.lse[i], ri.lse[0]);
        }
    }
}

#[test]
fn rows_with_no_visible_key_are_zero_with_neg_inf_lse() {
    // Sq=5 > Sk=2, causal: rows 0..3 see nothing.
    let p = problem(2, 2, 1, 5, 2, 8, true);
    let x = AttentionInputs::generate(&p, 4);
    let r = attention_f64(&p, &x).unwrap();
    let t = attention_tiled(&p, &x, 2, 1).unwrap();
    for b in 0..2 {
        for i in 0..5 {
            for h in 0..2 {
                let o = ((b * 5 + i) * 2 + h) * 8..((b * 5 + i) * 2 + h + 1) * 8;
                let l = (b * 2 + h) * 5 + i;
                if i < 3 {
                    assert!(r.o[o.clone()].iter().all(|&v| v == 0.0));
                    assert!(t.o[o].iter().all(|&v| v == 0.0));
                    assert_eq!(r.lse[l], f64::NEG_INFINITY);
                    assert_eq!(t.lse[l], f32::NEG_INFINITY);
                } else {
                    assert!(r.o[o].iter().any(|&v| v != 0.0));
                    assert!(r.lse[l].is_finite() && t.lse[l].is_finite());
                }
            }
        }
    }
    let c = check_lse(&t.lse, &r.lse);
    assert!(c.passed, "{c:?}");
}

/// Expand K/V of a GQA problem to one KV head per query head.
fn repeat_kv(p: &AttentionProblem, t: &[f32]) -> Vec<f32> {
    let (g, d) = (p.group_size(), p.head_dim);
    let mut out = Vec::with_capacity(p.batch * p.seqlen_k * p.heads_q * d);
    for b in 0..p.batch {
        for s in 0..p.seqlen_k {
            for h in 0..p.heads_q {
                let off = ((b * p.seqlen_k + s) * p.heads_kv + h / g) * d;
                out.extend_from_slice(&t[off..off + d]);
            }
        }
    }
    out
}

#[test]
fn gqa_equals_mha_with_repeated_kv_heads() {
    for (hq, hkv, causal) in [(4, 2, false), (6, 3, true), (4, 1, true), (3, 1, false)] {
        let p = problem(2, hq, hkv, 11, 19, 16, causal);
        let x = AttentionInputs::generate(&p, 99);
        let mha = AttentionProblem {
            heads_kv: hq,
            ..p.clone()
        };
        let xm = AttentionInputs {
            q: x.q.clone(),
            k: repeat_kv(&p, &x.k),
            v: repeat_kv(&p, &x.v),
        };
        assert_eq!(
            attention_f64(&p, &x).unwrap(),
            attention_f64(&mha, &xm).unwrap(),
            "hq={hq} hkv={hkv}"
        );
        assert_eq!(
            attention_tiled(&p, &x, 8, 8).unwrap(),
            attention_tiled(&mha, &xm, 8, 8).unwrap(),
            "tiled hq={hq} hkv={hkv}"
        );
    }
}

fn assert_tiled_matches(p: &AttentionProblem, seed: u64, blocks: &[(usize, usize)], simd: Simd) {
    let x = AttentionInputs::generate(p, seed);
    let r = attention_f64(p, &x).unwrap();
    for &(bm, bn) in blocks {
        let t = tiled_with(p, &x, bm, bn, simd).unwrap();
        let m = error_metrics(&t.o, &r.o);
        assert!(
            m.rel_l2 < 1e-5 && m.non_finite == 0,
            "{p} blocks ({bm},{bn}) {simd:?}: {m:?}"
        );
        let c = check_lse(&t.lse, &r.lse);
        assert!(
            c.passed && c.metrics.max_abs < 1e-5,
            "{p} blocks ({bm},{bn}) {simd:?} lse: {c:?}"
        );
    }
}

#[test]
fn tiled_matches_f64_across_shapes_and_blocks() {
    let sizes = [
        (1, 1),
        (1, 17),
        (17, 1),
        (17, 63),
        (63, 65),
        (65, 17),
        (130, 130),
        (64, 130),
        (130, 64),
    ];
    let blocks = [(64, 64), (16, 32), (7, 13), (128, 16)];
    for (i, &(sq, sk)) in sizes.iter().enumerate() {
        for causal in [false, true] {
            let (hq, hkv) = [(2, 2), (4, 2), (3, 1)][i % 3];
            let d = [64, 32, 40][i % 3];
            let p = problem(1 + i % 2, hq, hkv, sq, sk, d, causal);
            assert_tiled_matches(&p, i as u64, &blocks, Simd::detect());
        }
    }
    // Bigger head dim, default blocks, bf16-rounded inputs.
    let p = AttentionProblem {
        dtype: DType::Bf16,
        ..problem(1, 2, 1, 100, 150, 128, true)
    };
    assert_tiled_matches(&p, 77, &[(64, 64), (1, 1)], Simd::detect());
}

#[test]
fn tiled_portable_path_matches_f64() {
    for (sq, sk, causal) in [(33, 70, true), (70, 33, true), (45, 45, false)] {
        let p = problem(1, 4, 2, sq, sk, 24, causal);
        assert_tiled_matches(&p, 5, &[(64, 64), (5, 9)], Simd::Portable);
    }
}

#[test]
fn exp2_fast_is_accurate() {
    assert_eq!(exp2_fast::<false>(0.0), 1.0);
    assert_eq!(exp2_fast::<false>(f32::NEG_INFINITY), 0.0);
    assert_eq!(exp2_fast::<false>(-200.0), 0.0);
    assert!(exp2_fast::<false>(f32::NAN).is_nan());
    let mut worst = 0f64;
    // Down to -125.9 (results below 2^-126 flush to zero by design).
    for i in 0..=125_900 {
        let x = -(i as f32) * 1e-3;
        let want = (x as f64).exp2();
        for got in [exp2_fast::<false>(x), exp2_fast::<true>(x)] {
            worst = worst.max(((got as f64) - want).abs() / want);
        }
    }
    assert!(worst < 5e-7, "worst relative error {worst}");
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let p = problem(1, 2, 2, 4, 5, 8, false);
    let mut x = AttentionInputs::generate(&p, 1);
    x.k.pop();
    for e in [
        attention_f64(&p, &x).unwrap_err(),
        attention_tiled(&p, &x, 64, 64).unwrap_err(),
    ] {
        match e {
            Error::BufferSize {
                name,
                expected,
                actual,
            } => {
                assert_eq!((name.as_str(), expected, actual), ("k", 80, 79));
            }
            other => panic!("unexpected {other}"),
        }
    }
    let x = AttentionInputs::generate(&p, 1);
    let mut bad = x.clone();
    bad.v.push(0.0);
    assert!(attention_f64(&p, &bad)
        .unwrap_err()
        .to_string()
        .contains("v"));
    bad = x.clone();
    bad.q.clear();
    assert!(attention_tiled(&p, &bad, 4, 4)
        .unwrap_err()
        .to_string()
        .contains("for q"));
    assert!(attention_tiled(&p, &x, 0, 4)
        .unwrap_err()
        .to_string()
        .contains("block_m=0"));
    let gqa = AttentionProblem {
        heads_kv: 3,
        ..p.clone()
    };
    assert!(matches!(
        attention_f64(&gqa, &x),
        Err(Error::InvalidProblem(_))
    ));
    let zero = AttentionProblem {
        seqlen_q: 0,
        ..p.clone()
    };
    assert!(matches!(
        attention_tiled(&zero, &x, 4, 4),
        Err(Error::InvalidProblem(_))
    ));
    let huge = AttentionProblem {
        batch: usize::MAX / 2,
        ..p.clone()
    };
    assert!(matches!(
        attention_f64(&huge, &x),
        Err(Error::InvalidProblem(_))
    ));
    assert!(AttentionInputs::generate(&huge, 1).q.is_empty());
    // Huge tile sizes are clamped, not allocated.
    assert!(attention_tiled(&p, &x, usize::MAX, usize::MAX).is_ok());
}

#[test]
fn generated_inputs_have_the_problem_shapes_and_dtype() {
    let p = AttentionProblem {
        dtype: DType::Bf16,
        ..problem(2, 4, 2, 3, 5, 8, false)
    };
    let x = AttentionInputs::generate(&p, 42);
    assert_eq!(x.q.len(), p.q_elems());
    assert_eq!(x.k.len(), p.kv_elems());
    assert_eq!(x.v.len(), p.kv_elems());
    assert_eq!(
        x.q,
        generate(42, TensorId::Q, p.q_elems(), 1.0, DType::Bf16)
    );
    assert!(x
        .v
        .iter()
        .all(|&v| DType::Bf16.round(v) == v && (-1.0..=1.0).contains(&v)));
    assert_ne!(x.k, x.v);
}

/// Direct O(Sq·Sk) evaluation of the window / softcap definition, independent of
/// `visible_range`: key `j` is visible to row `i` iff `j >= diag - left` (left >= 0) and
/// `j <= diag + right` (right >= 0, 0 when causal), `diag = i + Sk - Sq`; scores are
/// `cap · tanh(scale · q·k / cap)` when the softcap `cap` is on. Returns O (B, Sq, Hq, D)
/// and LSE (B, Hq, Sq), with O = 0 and LSE = −inf for a row that sees nothing.
fn naive_attention(p: &AttentionProblem, x: &AttentionInputs) -> (Vec<f64>, Vec<f64>) {
    let (sq, sk, d) = (p.seqlen_q, p.seqlen_k, p.head_dim);
    let (hq, hkv, group) = (p.heads_q, p.heads_kv, p.group_size());
    let (scale, cap) = (p.scale() as f64, p.softcap as f64);
    let left = p.window.0 as i64;
    let right = if p.causal { 0 } else { p.window.1 as i64 };
    let mut o = vec![0f64; p.q_elems()];
    let mut lse = vec![f64::NEG_INFINITY; p.lse_elems()];
    for b in 0..p.batch {
        for h in 0..hq {
            for i in 0..sq {
                let diag = i as i64 + sk as i64 - sq as i64;
                let qo = ((b * sq + i) * hq + h) * d;
                let mut scores = Vec::new();
                for j in 0..sk {
                    let jj = j as i64;
                    if (left >= 0 && jj < diag - left) || (right >= 0 && jj > diag + right) {
                        continue;
                    }
                    let ko = ((b * sk + j) * hkv + h / group) * d;
                    let dot: f64 = (0..d)
                        .map(|t| x.q[qo + t] as f64 * x.k[ko + t] as f64)
                        .sum();
                    let mut s = scale * dot;
                    if cap > 0.0 {
                        s = cap * (s / cap).tanh();
                    }
                    scores.push((ko, s));
                }
                if scores.is_empty() {
                    continue;
                }
                let m = scores.iter().fold(f64::NEG_INFINITY, |a, &(_, s)| a.max(s));
                let sum: f64 = scores.iter().map(|&(_, s)| (s - m).exp()).sum();
                lse[(b * hq + h) * sq + i] = m + sum.ln();
                for &(vo, s) in &scores {
                    let w = (s - m).exp() / sum;
                    for t in 0..d {
                        o[qo + t] += w * x.v[vo + t] as f64;
                    }
                }
            }
        }
    }
    (o, lse)
}

#[test]
fn window_and_softcap_match_a_direct_evaluation() {
    let cases = [
        ((2, 1), false),
        ((3, -1), true),
        ((0, 0), false),
        ((0, 0), true),
        ((-1, 2), false),
        ((2, 5), true), // causal folds the right side to 0
        ((1, 0), false),
        ((-1, -1), false),
        ((-1, -1), true),
    ];
    let mut empty_rows_seen = 0;
    for (sq, sk) in [(5, 9), (9, 5)] {
        for &(window, causal) in &cases {
            for softcap in [0.0, 0.5, 5.0] {
                let p = AttentionProblem {
                    window,
                    softcap,
                    ..problem(1, 2, 1, sq, sk, 8, causal)
                };
                let mut x = AttentionInputs::generate(&p, 17);
                // Scores up to ~±11, so a cap of 5 bites too.
                x.q.iter_mut().for_each(|v| *v *= 4.0);
                let (want_o, want_lse) = naive_attention(&p, &x);
                let r = attention_f64(&p, &x).unwrap();
                let what = format!("{p}");
                for (g, w) in r.o.iter().zip(&want_o) {
                    assert!(close(*g, *w, 1e-12), "{what} o {g} vs {w}");
                }
                for (g, w) in r.lse.iter().zip(&want_lse) {
                    if *w == f64::NEG_INFINITY {
                        assert_eq!(*g, f64::NEG_INFINITY, "{what}");
                    } else {
                        assert!(close(*g, *w, 1e-12), "{what} lse {g} vs {w}");
                    }
                }
                // Rows that see nothing: exactly zero output (f64 and tiled).
                let t = attention_tiled(&p, &x, 2, 3).unwrap();
                for i in 0..sq {
                    if p.visible_range(i).is_empty() {
                        empty_rows_seen += 1;
                        for h in 0..2 {
                            let o = (i * 2 + h) * 8..(i * 2 + h + 1) * 8;
                            assert!(r.o[o.clone()].iter().all(|&v| v == 0.0), "{what}");
                            assert!(t.o[o].iter().all(|&v| v == 0.0), "{what}");
                            assert_eq!(t.lse[h * sq + i], f32::NEG_INFINITY, "{what}");
                        }
                    }
                }
                // The cap bounds every score, hence LSE <= ln(#visible) + cap.
                if softcap > 0.0 {
                    for (l, &lse) in r.lse.iter().enumerate() {
                        let n = p.visible_keys(l % sq) as f64;
                        assert!(lse <= n.ln() + softcap as f64 + 1e-12, "{what}");
                    }
                }
            }
        }
    }
    // Only Sq=9 > Sk=5 has empty rows (diag = i - 4): rows i with diag + right < 0, i.e.
    // 3 for (2,1), 2 for (-1,2), 0 for no window, 4 for the six cases with right 0 (or
    // causal); for each of the three caps.
    assert_eq!(empty_rows_seen, 3 * (3 + 2 + 6 * 4));

    // Non-vacuous: the window and the softcap both change the result.
    let p = AttentionProblem {
        window: (2, 1),
        ..problem(1, 2, 1, 5, 9, 8, false)
    };
    let x = AttentionInputs::generate(&p, 17);
    let full = attention_f64(
        &AttentionProblem {
            window: crate::problem::NO_WINDOW,
            ..p.clone()
        },
        &x,
    )
    .unwrap();
    let windowed = attention_f64(&p, &x).unwrap();
    let capped = attention_f64(
        &AttentionProblem {
            softcap: 0.5,
            ..p.clone()
        },
        &x,
    )
    .unwrap();
    assert_ne!(full.o, windowed.o);
    assert_ne!(windowed.o, capped.o);
    assert_ne!(windowed.lse, capped.lse);
}

#[test]
fn window_masked_keys_do_not_change_the_output() {
    // Change key/value j of every head: rows whose window excludes j are bit-identical in
    // both paths (the tiled one visits j's tile for other rows of the Q tile).
    for (sq, sk, window, causal, j) in [
        (7, 7, (2, 1), false, 3),
        (4, 9, (1, -1), true, 2),
        (9, 4, (0, 0), false, 1),
        (6, 6, (-1, 1), false, 4),
    ] {
        let p = AttentionProblem {
            window,
            softcap: 2.0,
            ..problem(1, 2, 2, sq, sk, 8, causal)
        };
        let x = AttentionInputs::generate(&p, 21);
        let mut y = x.clone();
        for h in 0..2 {
            let off = (j * 2 + h) * 8;
            for t in [&mut y.k, &mut y.v] {
                t[off..off + 8].iter_mut().for_each(|v| *v = 7.0 - *v);
            }
        }
        let (a, b) = (
            attention_f64(&p, &x).unwrap(),
            attention_f64(&p, &y).unwrap(),
        );
        let (ta, tb) = (
            attention_tiled(&p, &x, 3, 2).unwrap(),
            attention_tiled(&p, &y, 3, 2).unwrap(),
        );
        let mut hidden = 0;
        for i in 0..sq {
            let sees = p.visible_range(i).contains(&j);
            for h in 0..2 {
                let o = (i * 2 + h) * 8..(i * 2 + h + 1) * 8;
                let l = h * sq + i;
                if sees {
                    assert_ne!(a.o[o.clone()], b.o[o.clone()], "{p} row {i}");
                } else {
                    hidden += 1;
                    assert_eq!(a.o[o.clone()], b.o[o.clone()], "{p} row {i}");
                    assert_eq!(a.lse[l].to_bits(), b.lse[l].to_bits());
                    assert_eq!(ta.o[o.clone()], tb.o[o], "tiled {p} row {i}");
                    assert_eq!(ta.lse[l].to_bits(), tb.lse[l].to_bits());
                }
            }
        }
        assert!(hidden > 0, "{p}: key {j} is visible to every row");
    }
}

#[test]
fn tiled_matches_f64_with_window_and_softcap() {
    let windows = [
        ((8, 0), true),
        ((20, 3), false),
        ((0, 0), false),
        ((-1, 5), false),
        ((17, -1), true),
        ((3, 40), false),
        ((-1, -1), false),
        ((-1, -1), true),
    ];
    let shapes = [(40, 70), (70, 40), (33, 33)];
    let blocks = [(64, 64), (16, 8), (7, 13)];
    for (i, &(sq, sk)) in shapes.iter().enumerate() {
        for (k, &(window, causal)) in windows.iter().enumerate() {
            let (hq, hkv) = [(4, 2), (3, 1), (2, 2)][(i + k) % 3];
            let d = [32, 64, 40][(i + k) % 3];
            let dtype = [DType::Bf16, DType::F16][k % 2];
            for (softcap, scale) in [(0.0, None), (2.0, Some(1.0)), (30.0, None)] {
                if window == crate::problem::NO_WINDOW && softcap == 0.0 {
                    continue; // covered by the tests above
                }
                let p = AttentionProblem {
                    window,
                    softcap,
                    softmax_scale: scale,
                    dtype,
                    ..problem(1 + k % 2, hq, hkv, sq, sk, d, causal)
                };
                assert_tiled_matches(&p, (i * 10 + k) as u64, &blocks, Simd::detect());
            }
        }
    }
    // The portable instruction path too.
    for (window, causal) in [((5, 2), false), ((9, -1), true)] {
        let p = AttentionProblem {
            window,
            softcap: 3.0,
            softmax_scale: Some(1.0),
            dtype: DType::F16,
            ..problem(1, 4, 1, 45, 60, 24, causal)
        };
        assert_tiled_matches(&p, 6, &[(64, 64), (5, 9)], Simd::Portable);
    }
}

#[test]
fn visible_range_pairs_and_flops_match_brute_force() {
    // Hand-checked ranges.
    let p = AttentionProblem {
        window: (2, 1),
        ..problem(1, 1, 1, 5, 9, 8, false)
    };
    assert_eq!(p.visible_range(0), 2..6); // diag 4: keys 2..=5
    assert_eq!(p.visible_range(4), 6..9); // diag 8: keys 6..=8 (9 clipped)
    let c = AttentionProblem {
        window: (3, -1),
        causal: true,
        ..p.clone()
    };
    assert_eq!(c.visible_range(0), 1..5);
    let e = AttentionProblem {
        window: (1, 0),
        ..problem(1, 1, 1, 9, 5, 8, false)
    };
    let ranges: Vec<_> = (0..9).map(|i| e.visible_range(i)).collect();
    assert!(ranges[..4].iter().all(|r| r.is_empty()), "{ranges:?}");
    assert_eq!(ranges[4], 0..1);
    assert_eq!(ranges[8], 3..5);
    assert_eq!(e.unmasked_pairs(), 1 + 4 * 2);

    let sides = [-1, 0, 1, 3, 20];
    for (sq, sk) in [(1, 1), (5, 9), (9, 5), (7, 7), (1, 13), (13, 1)] {
        for causal in [false, true] {
            for left in sides {
                for right in sides {
                    let p = AttentionProblem {
                        window: (left, right),
                        ..problem(2, 6, 3, sq, sk, 16, causal)
                    };
                    let right_eff = if causal { 0 } else { right as i64 };
                    let mut pairs = 0u64;
                    for i in 0..sq {
                        let diag = i as i64 + sk as i64 - sq as i64;
                        let seen: Vec<usize> = (0..sk)
                            .filter(|&j| {
                                let j = j as i64;
                                (left < 0 || j >= diag - left as i64)
                                    && (right_eff < 0 || j <= diag + right_eff)
                            })
                            .collect();
                        let range = p.visible_range(i);
                        assert_eq!(range.clone().collect::<Vec<_>>(), seen, "{p} row {i}");
                        assert_eq!(p.visible_keys(i), seen.len(), "{p} row {i}");
                        pairs += seen.len() as u64;
                    }
                    assert_eq!(p.unmasked_pairs(), pairs, "{p}");
                    assert_eq!(p.flops(), 4.0 * 2.0 * 6.0 * pairs as f64 * 16.0, "{p}");
                    assert_eq!(p.effective_window(), (left, right_eff as i32), "{p}");
                    if !p.has_window() {
                        // Then the mask is the plain full or causal one.
                        let plain = AttentionProblem {
                            window: crate::problem::NO_WINDOW,
                            causal: right_eff == 0,
                            ..p.clone()
                        };
                        for i in 0..sq {
                            assert_eq!(p.visible_range(i), plain.visible_range(i), "{p}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn validate_rejects_bad_window_and_softcap() {
    let base = problem(1, 2, 1, 4, 6, 8, false);
    let x = AttentionInputs::generate(&base, 1);
    for window in [(-2, 0), (0, -2), (-5, -5)] {
        let p = AttentionProblem {
            window,
            ..base.clone()
        };
        for e in [
            p.validate().unwrap_err(),
            attention_f64(&p, &x).unwrap_err(),
            attention_tiled(&p, &x, 4, 4).unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidProblem(_)), "{e}");
            assert!(e.to_string().contains("window"), "{e}");
        }
    }
    for softcap in [-1.0, f32::NAN, f32::INFINITY] {
        let p = AttentionProblem {
            softcap,
            ..base.clone()
        };
        for e in [
            p.validate().unwrap_err(),
            attention_f64(&p, &x).unwrap_err(),
            attention_tiled(&p, &x, 4, 4).unwrap_err(),
        ] {
            assert!(matches!(e, Error::InvalidProblem(_)), "{e}");
            assert!(e.to_string().contains("softcap"), "{e}");
        }
    }
    for (window, softcap) in [((-1, -1), 0.0), ((0, 0), 30.0), ((5, -1), 0.5)] {
        let p = AttentionProblem {
            window,
            softcap,
            ..base.clone()
        };
        assert!(p.validate().is_ok(), "{p}");
    }
}
