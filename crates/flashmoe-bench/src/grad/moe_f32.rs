//! The MoE layer's backward on the CPU in f32, the grouped algorithm a GPU backward runs:
//! the lab's CPU implementation under test for MoE gradients (checked against the f64
//! reference `flashmoe::reference::moe_backward`).
//!
//! Routing (the top-k ids and their weights) is the reference router's, as the forward's
//! `cpu-grouped` takes it (`flashmoe::reference::moe_grouped`): the choice of experts is a
//! discrete decision the forward check gates; a near-tie decided the other way would make
//! two backwards incomparable, not one of them wrong. Everything after it is f32:
//!
//! - per expert, its rows gathered in token order: gu = X_e·W13 recomputed (the forward
//!   is not stored), h = silu(gate) ⊙ up;
//! - dHu = dOut·W2ᵀ per row (unweighted), then the routing-weight gradient
//!   dw = <h, dHu> (= <y, dOut>, without y) and dH = w·dHu; dW2 = hᵀ·(w·dOut);
//! - the SwiGLU backward, dX_e = dGU·W13ᵀ, dW13 = X_eᵀ·dGU;
//! - the shared expert the same with w = 1 over every token;
//! - the router: d(logits) from dw through the renormalisation and the softmax / sigmoid,
//!   plus the aux-loss (token fractions constant) and z-loss terms, then
//!   dx += dZ·Rᵀ and d_router = xᵀ·dZ;
//! - dx = Σ over a token's slots in slot order + the shared expert's + the router's;
//! - every gradient rounded to the dtype (what a kernel stores).

use flashmoe::reference::moe::{route, MoeInputs};
use flashmoe::reference::moe_grouped::permute;
use flashmoe::{MoeProblem, Scoring};
use rayon::prelude::*;

fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// One row's forward activation and gradients.
struct RowGrads {
    /// (I) h = silu(gate) ⊙ up.
    h: Vec<f32>,
    /// (2I) d(gate | up).
    dgu: Vec<f32>,
    /// d(routing weight).
    dw: f32,
    /// (H) the row's dX.
    dx: Vec<f32>,
}

/// One expert's (or the shared expert's) backward over gathered rows.
struct ExpertGrads {
    /// (rows, H) contributions to dx.
    dx: Vec<f32>,
    /// (H, 2I).
    dw13: Vec<f32>,
    /// (I, H).
    dw2: Vec<f32>,
    /// (rows) d(routing weight).
    dw: Vec<f32>,
}

/// `xe` (rows, H), `dout` (rows, H) the upstream gradient of each row's token, `w` the
/// row's routing weight (1 for the shared expert).
fn expert_backward(
    xe: &[f32],
    dout: &[f32],
    w: &[f32],
    w13: &[f32],
    w2: &[f32],
    hidden: usize,
    inter: usize,
) -> ExpertGrads {
    let rows = w.len();
    let n = 2 * inter;
    // Per row: h, dGU, dw, dX.
    let per_row: Vec<RowGrads> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let xr = &xe[r * hidden..(r + 1) * hidden];
            let mut gu = vec![0f32; n];
            for (&xv, wrow) in xr.iter().zip(w13.chunks_exact(n)) {
                for (a, &wv) in gu.iter_mut().zip(wrow) {
                    *a += xv * wv;
                }
            }
            let (gate, up) = gu.split_at(inter);
            let h: Vec<f32> = gate
                .iter()
                .zip(up)
                .map(|(&g, &u)| g * sigmoid(g) * u)
                .collect();
            let dr = &dout[r * hidden..(r + 1) * hidden];
            let dhu: Vec<f32> = w2
                .chunks_exact(hidden)
                .map(|wrow| wrow.iter().zip(dr).map(|(&a, &b)| a * b).sum())
                .collect();
            let dw: f32 = h.iter().zip(&dhu).map(|(&a, &b)| a * b).sum();
            let mut dgu = vec![0f32; n];
            for j in 0..inter {
                let (g, u) = (gate[j], up[j]);
                let s = sigmoid(g);
                let dh = w[r] * dhu[j];
                dgu[j] = dh * u * s * (1.0 + g * (1.0 - s));
                dgu[inter + j] = dh * g * s;
            }
            let dx: Vec<f32> = w13
                .chunks_exact(n)
                .map(|wrow| wrow.iter().zip(&dgu).map(|(&a, &b)| a * b).sum())
                .collect();
            RowGrads { h, dgu, dw, dx }
        })
        .collect();
    let mut dw2 = vec![0f32; inter * hidden];
    dw2.par_chunks_mut(hidden).enumerate().for_each(|(j, row)| {
        for (r, g) in per_row.iter().enumerate() {
            let a = g.h[j] * w[r];
            for (o, &g) in row.iter_mut().zip(&dout[r * hidden..(r + 1) * hidden]) {
                *o += a * g;
            }
        }
    });
    let mut dw13 = vec![0f32; hidden * n];
    dw13.par_chunks_mut(n).enumerate().for_each(|(c, row)| {
        for (r, g) in per_row.iter().enumerate() {
            let a = xe[r * hidden + c];
            for (o, &g) in row.iter_mut().zip(&g.dgu) {
                *o += a * g;
            }
        }
    });
    let mut dx = Vec::with_capacity(rows * hidden);
    let mut dw = Vec::with_capacity(rows);
    for g in per_row {
        dw.push(g.dw);
        dx.extend_from_slice(&g.dx);
    }
    ExpertGrads { dx, dw13, dw2, dw }
}

/// The gradients of `<d_out, out> + d_aux·aux + d_z·z_loss` (module docs), in the order
/// dx, d_router, dw13, dw2 (+ d_shared_w13, d_shared_w2), rounded to `p.dtype`.
pub fn moe_backward_f32(
    p: &MoeProblem,
    x: &MoeInputs,
    d_out: &[f32],
    d_aux: f64,
    d_z: f64,
) -> flashmoe::Result<Vec<Vec<f32>>> {
    let routing = route(p, x)?; // validates the problem and the input sizes
    let (t, h, i, e, k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
    if d_out.len() != t * h {
        return Err(flashmoe::Error::invalid(format!(
            "d_out holds {} elements, expected tokens × hidden = {}",
            d_out.len(),
            t * h
        )));
    }
    if x.w13.len() != e * h * 2 * i || x.w2.len() != e * i * h {
        return Err(flashmoe::Error::invalid(
            "w13 / w2 sizes do not match the problem",
        ));
    }
    let perm = permute(p, &routing);
    let (per13, per2) = (h * 2 * i, i * h);
    let experts: Vec<ExpertGrads> = (0..e)
        .into_par_iter()
        .map(|ex| {
            let rows = &perm.rows[perm.offsets[ex]..perm.offsets[ex + 1]];
            let mut xe = Vec::with_capacity(rows.len() * h);
            let mut dout = Vec::with_capacity(rows.len() * h);
            let mut w = Vec::with_capacity(rows.len());
            for &(tok, s) in rows {
                let tok = tok as usize;
                xe.extend_from_slice(&x.x[tok * h..(tok + 1) * h]);
                dout.extend_from_slice(&d_out[tok * h..(tok + 1) * h]);
                w.push(routing.topk_weights[tok * k + s as usize] as f32);
            }
            expert_backward(
                &xe,
                &dout,
                &w,
                &x.w13[ex * per13..(ex + 1) * per13],
                &x.w2[ex * per2..(ex + 1) * per2],
                h,
                i,
            )
        })
        .collect();
    let shared = match (&x.shared_w13, &x.shared_w2) {
        (Some(a), Some(b)) if p.shared_expert => {
            Some(expert_backward(&x.x, d_out, &vec![1.0; t], a, b, h, i))
        }
        _ => None,
    };

    // Router: d(logits) per token from the routing-weight gradients and the losses.
    let counts = &routing.expert_counts;
    let tf = t as f32;
    let dp: Vec<f32> = counts
        .iter()
        .map(|&c| d_aux as f32 * e as f32 * (c as f32 / (tf * k as f32)) / tf)
        .collect();
    let mut dz = vec![0f32; t * e];
    dz.par_chunks_mut(e).enumerate().for_each(|(tok, dzt)| {
        let z: Vec<f32> = routing.logits[tok * e..(tok + 1) * e]
            .iter()
            .map(|&v| v as f32)
            .collect();
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let lse = m + z.iter().map(|&v| (v - m).exp()).sum::<f32>().ln();
        let soft: Vec<f32> = z.iter().map(|&v| (v - lse).exp()).collect();
        let s: Vec<f32> = match p.scoring {
            Scoring::Softmax => soft.clone(),
            Scoring::Sigmoid => z.iter().map(|&v| sigmoid(v)).collect(),
        };
        let ids = &routing.topk_ids[tok * k..(tok + 1) * k];
        let dw: Vec<f32> = (0..k)
            .map(|slot| {
                let ex = ids[slot] as usize;
                let r = perm.row_of_slot[tok * k + slot] - perm.offsets[ex];
                experts[ex].dw[r]
            })
            .collect();
        let w: Vec<f32> = routing.topk_weights[tok * k..(tok + 1) * k]
            .iter()
            .map(|&v| v as f32)
            .collect();
        let mut ds = vec![0f32; e];
        let sum: f32 = ids.iter().map(|&id| s[id as usize]).sum();
        if p.renormalize && sum > 0.0 {
            let dot: f32 = dw.iter().zip(&w).map(|(&a, &b)| a * b).sum();
            for (&id, &g) in ids.iter().zip(&dw) {
                ds[id as usize] += (g - dot) / sum;
            }
        } else {
            for (&id, &g) in ids.iter().zip(&dw) {
                ds[id as usize] += g;
            }
        }
        match p.scoring {
            Scoring::Softmax => {
                let g: Vec<f32> = ds.iter().zip(&dp).map(|(&a, &b)| a + b).collect();
                let dot: f32 = s.iter().zip(&g).map(|(&a, &b)| a * b).sum();
                for ((o, &si), &gi) in dzt.iter_mut().zip(&s).zip(&g) {
                    *o = si * (gi - dot);
                }
            }
            Scoring::Sigmoid => {
                let total: f32 = s.iter().sum();
                let dot: f32 = if total > 0.0 {
                    s.iter().zip(&dp).map(|(&a, &b)| a / total * b).sum()
                } else {
                    0.0
                };
                for j in 0..e {
                    let from_aux = if total > 0.0 {
                        (dp[j] - dot) / total
                    } else {
                        0.0
                    };
                    dzt[j] = s[j] * (1.0 - s[j]) * (ds[j] + from_aux);
                }
            }
        }
        let c = d_z as f32 * 2.0 * lse / tf;
        for (o, &sm) in dzt.iter_mut().zip(&soft) {
            *o += c * sm;
        }
    });

    // dx: the token's slots in order, the shared expert, the router.
    let mut dx = vec![0f32; t * h];
    dx.par_chunks_mut(h).enumerate().for_each(|(tok, d)| {
        for slot in 0..k {
            let ex = routing.topk_ids[tok * k + slot] as usize;
            let r = perm.row_of_slot[tok * k + slot] - perm.offsets[ex];
            for (o, &v) in d.iter_mut().zip(&experts[ex].dx[r * h..(r + 1) * h]) {
                *o += v;
            }
        }
        if let Some(sh) = &shared {
            for (o, &v) in d.iter_mut().zip(&sh.dx[tok * h..(tok + 1) * h]) {
                *o += v;
            }
        }
        let dzt = &dz[tok * e..(tok + 1) * e];
        for (o, rrow) in d.iter_mut().zip(x.router.chunks_exact(e)) {
            *o += dzt.iter().zip(rrow).map(|(&a, &b)| a * b).sum::<f32>();
        }
    });
    let mut d_router = vec![0f32; h * e];
    d_router.par_chunks_mut(e).enumerate().for_each(|(c, row)| {
        for (xt, dzt) in x.x.chunks_exact(h).zip(dz.chunks_exact(e)) {
            let xv = xt[c];
            for (o, &g) in row.iter_mut().zip(dzt) {
                *o += xv * g;
            }
        }
    });

    let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| p.dtype.round(x)).collect() };
    let mut dw13 = Vec::with_capacity(e * per13);
    let mut dw2 = Vec::with_capacity(e * per2);
    for g in &experts {
        dw13.extend_from_slice(&g.dw13);
        dw2.extend_from_slice(&g.dw2);
    }
    let mut out = vec![round(dx), round(d_router), round(dw13), round(dw2)];
    if let Some(sh) = shared {
        out.push(round(sh.dw13));
        out.push(round(sh.dw2));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::accuracy::check_gradient;
    use flashmoe::inputs::{generate, TensorId};
    use flashmoe::reference::moe_backward::moe_backward_f64;
    use flashmoe::DType;

    fn case(p: &MoeProblem, d_aux: f64, d_z: f64, seed: u64) {
        let x = MoeInputs::generate(p, seed);
        let d_out = generate(seed, TensorId::MoeDOut, p.tokens * p.hidden, 1.0, p.dtype);
        let got = moe_backward_f32(p, &x, &d_out, d_aux, d_z).unwrap();
        let w = moe_backward_f64(p, &x, &d_out, d_aux, d_z).unwrap();
        let mut want = vec![w.dx, w.d_router, w.dw13, w.dw2];
        want.extend(w.d_shared_w13);
        want.extend(w.d_shared_w2);
        assert_eq!(got.len(), want.len());
        let rows = [
            p.hidden,
            p.experts,
            2 * p.intermediate,
            p.hidden,
            2 * p.intermediate,
            p.hidden,
        ];
        for (n, (g, w)) in got.iter().zip(&want).enumerate() {
            let c = check_gradient(g, w, p.dtype, rows[n]);
            assert!(c.passed, "{p} gradient {n}: {:?}", c.reason);
        }
    }

    #[test]
    fn f32_backward_matches_the_f64_reference() {
        let mk = |t, e, k, scoring, renormalize, shared| MoeProblem {
            tokens: t,
            hidden: 48,
            intermediate: 32,
            experts: e,
            top_k: k,
            scoring,
            renormalize,
            dtype: DType::Bf16,
            shared_expert: shared,
        };
        case(&mk(40, 8, 2, Scoring::Softmax, true, false), 0.0, 0.0, 1);
        case(&mk(40, 8, 2, Scoring::Softmax, true, false), 0.5, 0.1, 2);
        case(&mk(33, 6, 6, Scoring::Softmax, false, true), 0.3, 0.0, 3);
        case(&mk(25, 1, 1, Scoring::Softmax, true, false), 0.0, 0.2, 4);
        case(&mk(40, 8, 3, Scoring::Sigmoid, false, true), 0.5, 0.1, 5);
    }
}
