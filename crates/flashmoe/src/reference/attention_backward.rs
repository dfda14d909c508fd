//! Attention backward ground truth: dq, dk and dv in f64 with a materialised softmax per
//! query row, for the loss `L = Σ dO ∘ O` of the forward in [`super::attention`] (same
//! layouts, masks, scale and softcap).
//!
//! Per query row i of head h (KV head h / group), over its visible keys j
//! ([`AttentionProblem::visible_range`]): logits `z_ij = scale · q_i·k_j` (softcap c:
//! `c · tanh(scale · q_i·k_j / c)`), `P = softmax(z)`, `dP_ij = dO_i·v_j`,
//! `Delta_i = Σ_j P_ij dP_ij`, `dS_ij = P_ij (dP_ij − Delta_i) · ∂z_ij/∂(q_i·k_j) / scale`
//! (`1 − tanh²` with a softcap, else 1), and
//! `dQ_i = scale Σ_j dS_ij k_j`, `dK_j = scale Σ_{h in group, i} dS_ij q_i`,
//! `dV_j = Σ_{h in group, i} P_ij dO_i`. A row that sees no key contributes nothing (its
//! dq row is 0).
//!
//! [`AttentionProblem::visible_range`]: crate::problem::AttentionProblem::visible_range

use super::attention::{validate_inputs, AttentionInputs};
use super::check_len;
use crate::error::Result;
use crate::problem::AttentionProblem;
use rayon::prelude::*;

/// Gradients of the inputs, f64, in the inputs' layouts: dq (batch, seqlen_q, heads_q,
/// head_dim); dk and dv (batch, seqlen_k, heads_kv, head_dim).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionGradients {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// Gradients of `Σ d_o ∘ attention(q, k, v)` (see the module docs). `d_o` has o's layout,
/// (batch, seqlen_q, heads_q, head_dim). Parallel over (batch, KV head); the order of
/// every sum is fixed.
pub fn attention_backward_f64(
    p: &AttentionProblem,
    x: &AttentionInputs,
    d_o: &[f32],
) -> Result<AttentionGradients> {
    validate_inputs(p, x)?;
    check_len("d_o", x.q.len(), d_o.len())?;
    let (b, hq, hkv) = (p.batch, p.heads_q, p.heads_kv);
    let (sq, sk, d) = (p.seqlen_q, p.seqlen_k, p.head_dim);
    let group = p.group_size();
    let scale = p.scale() as f64;
    let softcap = p.softcap as f64;
    let qi = |bi: usize, i: usize, h: usize| ((bi * sq + i) * hq + h) * d;
    let ki = |bi: usize, j: usize, h: usize| ((bi * sk + j) * hkv + h) * d;

    // One work item per (batch, KV head): its dk and dv (sk x d) and the dq rows of its
    // group's query heads (group x sq x d).
    let parts: Vec<(Vec<f64>, Vec<f64>, Vec<f64>)> = (0..b * hkv)
        .into_par_iter()
        .map(|bk| {
            let (bi, kvh) = (bk / hkv, bk % hkv);
            let mut dk = vec![0f64; sk * d];
            let mut dv = vec![0f64; sk * d];
            let mut dq = vec![0f64; group * sq * d];
            let mut z = vec![0f64; sk];
            let mut dtanh = vec![0f64; sk];
            let mut dp = vec![0f64; sk];
            for g in 0..group {
                let h = kvh * group + g;
                for i in 0..sq {
                    let keys = p.visible_range(i);
                    if keys.is_empty() {
                        continue;
                    }
                    let q = &x.q[qi(bi, i, h)..qi(bi, i, h) + d];
                    let go = &d_o[qi(bi, i, h)..qi(bi, i, h) + d];
                    for j in keys.clone() {
                        let kr = &x.k[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                        let vr = &x.v[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                        let s: f64 = q.iter().zip(kr).map(|(&a, &c)| a as f64 * c as f64).sum();
                        let s = scale * s;
                        if softcap > 0.0 {
                            let t = (s / softcap).tanh();
                            z[j] = softcap * t;
                            dtanh[j] = 1.0 - t * t;
                        } else {
                            z[j] = s;
                            dtanh[j] = 1.0;
                        }
                        dp[j] = go.iter().zip(vr).map(|(&a, &c)| a as f64 * c as f64).sum();
                    }
                    let m = keys.clone().map(|j| z[j]).fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = keys.clone().map(|j| (z[j] - m).exp()).sum();
                    let lse = m + sum.ln();
                    let delta: f64 = keys.clone().map(|j| (z[j] - lse).exp() * dp[j]).sum();
                    let dq_row = &mut dq[(g * sq + i) * d..(g * sq + i + 1) * d];
                    for j in keys {
                        let pij = (z[j] - lse).exp();
                        let ds = pij * (dp[j] - delta) * dtanh[j];
                        let kr = &x.k[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                        for (acc, &kv) in dq_row.iter_mut().zip(kr) {
                            *acc += scale * ds * kv as f64;
                        }
                        for c in 0..d {
                            dk[j * d + c] += scale * ds * q[c] as f64;
                            dv[j * d + c] += pij * go[c] as f64;
                        }
                    }
                }
            }
            (dq, dk, dv)
        })
        .collect();

    let mut out = AttentionGradients {
        dq: vec![0f64; x.q.len()],
        dk: vec![0f64; x.k.len()],
        dv: vec![0f64; x.v.len()],
    };
    for (bk, (dq, dk, dv)) in parts.into_iter().enumerate() {
        let (bi, kvh) = (bk / hkv, bk % hkv);
        for j in 0..sk {
            let o = ki(bi, j, kvh);
            out.dk[o..o + d].copy_from_slice(&dk[j * d..(j + 1) * d]);
            out.dv[o..o + d].copy_from_slice(&dv[j * d..(j + 1) * d]);
        }
        for g in 0..group {
            let h = kvh * group + g;
            for i in 0..sq {
                let o = qi(bi, i, h);
                out.dq[o..o + d].copy_from_slice(&dq[(g * sq + i) * d..(g * sq + i + 1) * d]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::reference::attention_f64;

    /// Σ d_o ∘ O of the f64 forward.
    fn loss(p: &AttentionProblem, x: &AttentionInputs, d_o: &[f32]) -> f64 {
        let o = attention_f64(p, x).unwrap().o;
        o.iter().zip(d_o).map(|(&a, &g)| a * g as f64).sum()
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every gradient element against a central finite difference of the f64 forward
    /// (the step measured on the f32 inputs, so rounding the perturbed input is exact).
    fn check_against_finite_differences(p: &AttentionProblem, seed: u64) {
        let x = AttentionInputs {
            q: values(p.q_elems(), seed),
            k: values(p.kv_elems(), seed + 1),
            v: values(p.kv_elems(), seed + 2),
        };
        let d_o = values(p.q_elems(), seed + 3);
        let g = attention_backward_f64(p, &x, &d_o).unwrap();
        let h = 1e-3f32;
        let mut worst = 0f64;
        for which in 0..3 {
            let n = if which == 0 { x.q.len() } else { x.k.len() };
            for e in 0..n {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                let (tp, tm) = match which {
                    0 => (&mut xp.q, &mut xm.q),
                    1 => (&mut xp.k, &mut xm.k),
                    _ => (&mut xp.v, &mut xm.v),
                };
                tp[e] += h;
                tm[e] -= h;
                let step = tp[e] as f64 - tm[e] as f64;
                let fd = (loss(p, &xp, &d_o) - loss(p, &xm, &d_o)) / step;
                let an = [&g.dq, &g.dk, &g.dv][which][e];
                let err = (fd - an).abs();
                worst = worst.max(err);
                assert!(
                    err <= 1e-5 + 1e-4 * an.abs(),
                    "{p}: grad {which} element {e}: analytic {an}, finite difference {fd}"
                );
            }
        }
        eprintln!(
            "{p} window {:?} softcap {}: worst |fd - analytic| {worst:.2e}",
            p.window, p.softcap
        );
    }

    fn problem(hq: usize, hkv: usize, sq: usize, sk: usize, causal: bool) -> AttentionProblem {
        let mut p = AttentionProblem::new(2, hq, sq, 4, causal, DType::F32);
        p.heads_kv = hkv;
        p.seqlen_k = sk;
        p
    }

    #[test]
    fn backward_matches_finite_differences() {
        check_against_finite_differences(&problem(2, 1, 3, 5, false), 1);
        check_against_finite_differences(&problem(2, 2, 5, 3, true), 2);
        check_against_finite_differences(&problem(3, 1, 4, 6, true), 3);
        let mut w = problem(2, 1, 6, 6, false);
        w.window = (1, 2);
        check_against_finite_differences(&w, 4);
        let mut c = problem(2, 1, 4, 5, true);
        c.softcap = 0.5;
        c.softmax_scale = Some(0.9);
        check_against_finite_differences(&c, 5);
    }

    #[test]
    fn rows_without_keys_get_zero_gradients() {
        // Causal with Sq > Sk: the first Sq - Sk rows see no key.
        let p = problem(1, 1, 5, 2, true);
        let x = AttentionInputs {
            q: values(p.q_elems(), 7),
            k: values(p.kv_elems(), 8),
            v: values(p.kv_elems(), 9),
        };
        let d_o = values(p.q_elems(), 10);
        let g = attention_backward_f64(&p, &x, &d_o).unwrap();
        let d = p.head_dim;
        for i in 0..3 {
            assert!(g.dq[i * d..(i + 1) * d].iter().all(|&v| v == 0.0));
        }
        assert!(g.dq[3 * d..].iter().any(|&v| v != 0.0));
        assert!(attention_backward_f64(&p, &x, &d_o[1..]).is_err());
    }
}
