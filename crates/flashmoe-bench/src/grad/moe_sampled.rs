//! Sampled f64 MoE gradients for layers whose whole f64 backward would take too long (the
//! seed's 8k–32k-token configs): exact f64 values of
//!
//! - dx of [`SAMPLED_TOKENS`] tokens spread over the batch — a token's dx needs only its own
//!   routed rows (one-row expert forwards and backwards), its shared-expert row, and its
//!   own router-logit gradient (the aux-loss term reads the global expert counts, which the
//!   f64 routing of every token gives);
//! - dw13 and dw2 of two experts — the most loaded and the least loaded non-empty one —
//!   over all of their rows.
//!
//! d_router and the shared expert's weight gradients need every token's backward and are
//! not checked in this mode (the reference's name says what is). The formulas are the
//! stages of `flashmoe::reference::moe_backward`, whose whole result the tests match.

use super::sampled::spread;
use super::RefTensor;
use flashmoe::reference::moe::{route, MoeInputs};
use flashmoe::reference::moe_backward::{
    expert_backward, expert_forward, gather_rows, router_logits_backward, RouterState,
};
use flashmoe::reference::moe_grouped::permute;
use flashmoe::MoeProblem;
use rayon::prelude::*;

/// Tokens whose dx the sampled reference computes.
pub const SAMPLED_TOKENS: usize = 64;

/// The sampled gradients (module docs) as [`RefTensor`]s selecting those elements of the
/// full dx, dw13 and dw2.
pub fn moe_sampled_f64(
    p: &MoeProblem,
    x: &MoeInputs,
    d_out: &[f32],
    d_aux: f64,
    d_z: f64,
    tokens: usize,
) -> flashmoe::Result<Vec<RefTensor>> {
    let (t, h, i, e, k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
    if d_out.len() != t * h {
        return Err(flashmoe::Error::invalid(format!(
            "d_out holds {} elements, expected {}",
            d_out.len(),
            t * h
        )));
    }
    let routing = route(p, x)?;
    let perm = permute(p, &routing);
    let rs = RouterState::new(p, routing);
    let r = &rs.routing;
    let (per13, per2) = (h * 2 * i, i * h);
    let w13 = |ex: usize| &x.w13[ex * per13..(ex + 1) * per13];
    let w2 = |ex: usize| &x.w2[ex * per2..(ex + 1) * per2];
    let dout = |tok: usize| -> Vec<f64> {
        d_out[tok * h..(tok + 1) * h]
            .iter()
            .map(|&v| v as f64)
            .collect()
    };
    let shared = match (&x.shared_w13, &x.shared_w2) {
        (Some(a), Some(b)) if p.shared_expert => Some((a.as_slice(), b.as_slice())),
        _ => None,
    };

    // Per sampled token: its experts' rows and the shared expert's row (dx before the
    // router's term) and its routing-weight gradients.
    let sampled = spread(t, tokens);
    let per_token: Vec<(Vec<f64>, Vec<f64>)> = sampled
        .par_iter()
        .map(|&tok| {
            let xt = gather_rows(&x.x, std::iter::once(tok), h);
            let go = dout(tok);
            let mut dx = vec![0f64; h];
            let mut dw = vec![0f64; k];
            for (s, dws) in dw.iter_mut().enumerate() {
                let ex = r.topk_ids[tok * k + s] as usize;
                let w = r.topk_weights[tok * k + s];
                let a = expert_forward(&xt, w13(ex), w2(ex), h, i);
                *dws = a.y.iter().zip(&go).map(|(&y, &g)| y * g).sum();
                let dy: Vec<f64> = go.iter().map(|&g| w * g).collect();
                let g = expert_backward(&xt, &a.gu, &a.h, &dy, w13(ex), w2(ex), h, i);
                for (o, v) in dx.iter_mut().zip(&g.dx) {
                    *o += v;
                }
            }
            if let Some((sw13, sw2)) = shared {
                let a = expert_forward(&xt, sw13, sw2, h, i);
                let g = expert_backward(&xt, &a.gu, &a.h, &go, sw13, sw2, h, i);
                for (o, v) in dx.iter_mut().zip(&g.dx) {
                    *o += v;
                }
            }
            (dx, dw)
        })
        .collect();
    // The router's term: the logits' gradient of each token is its own (the aux loss's
    // token fractions are global constants), so the other tokens' d_weights may be 0.
    let mut d_weights = vec![0f64; t * k];
    for (&tok, (_, dw)) in sampled.iter().zip(&per_token) {
        d_weights[tok * k..(tok + 1) * k].copy_from_slice(dw);
    }
    let dz = router_logits_backward(p, &rs, &d_weights, d_aux, d_z);
    let mut dx_values = Vec::with_capacity(sampled.len() * h);
    for (&tok, (dx, _)) in sampled.iter().zip(&per_token) {
        let dzt = &dz[tok * e..(tok + 1) * e];
        for (c, v) in dx.iter().enumerate() {
            let router: f64 = dzt
                .iter()
                .zip(&x.router[c * e..(c + 1) * e])
                .map(|(&g, &w)| g * w as f64)
                .sum();
            dx_values.push(v + router);
        }
    }

    // The two experts: most loaded, least loaded non-empty (one when they coincide).
    let counts = &r.expert_counts;
    let busiest = (0..e).max_by_key(|&ex| (counts[ex], std::cmp::Reverse(ex)));
    let quietest = (0..e)
        .filter(|&ex| counts[ex] > 0)
        .min_by_key(|&ex| (counts[ex], ex));
    let mut experts: Vec<usize> = busiest.into_iter().chain(quietest).collect();
    experts.sort_unstable();
    experts.dedup();
    let per_expert: Vec<(Vec<f64>, Vec<f64>)> = experts
        .par_iter()
        .map(|&ex| {
            let rows = &perm.rows[perm.offsets[ex]..perm.offsets[ex + 1]];
            let xe = gather_rows(&x.x, rows.iter().map(|&(tok, _)| tok as usize), h);
            let a = expert_forward(&xe, w13(ex), w2(ex), h, i);
            let mut dy = Vec::with_capacity(rows.len() * h);
            for &(tok, s) in rows {
                let w = r.topk_weights[tok as usize * k + s as usize];
                dy.extend(dout(tok as usize).iter().map(|&g| w * g));
            }
            let g = expert_backward(&xe, &a.gu, &a.h, &dy, w13(ex), w2(ex), h, i);
            (g.dw13, g.dw2)
        })
        .collect();
    let (dw13, dw2): (Vec<Vec<f64>>, Vec<Vec<f64>>) = per_expert.into_iter().unzip();
    Ok(vec![
        RefTensor {
            name: "dx".into(),
            values: dx_values,
            select: Some(sampled.iter().map(|&tok| (tok * h, h)).collect()),
        },
        RefTensor {
            name: "dw13".into(),
            values: dw13.concat(),
            select: Some(experts.iter().map(|&ex| (ex * per13, per13)).collect()),
        },
        RefTensor {
            name: "dw2".into(),
            values: dw2.concat(),
            select: Some(experts.iter().map(|&ex| (ex * per2, per2)).collect()),
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::inputs::{generate, TensorId};
    use flashmoe::reference::moe_backward::moe_backward_f64;
    use flashmoe::{DType, Scoring};

    /// Every sampled value equals the whole f64 backward's there (softmax with the losses
    /// and a shared expert; sigmoid without renormalisation).
    #[test]
    fn samples_equal_the_full_reference() {
        let mk = |scoring, renormalize, shared| MoeProblem {
            tokens: 30,
            hidden: 24,
            intermediate: 16,
            experts: 6,
            top_k: 2,
            scoring,
            renormalize,
            dtype: DType::Bf16,
            shared_expert: shared,
        };
        for (n, (p, d_aux, d_z)) in [
            (mk(Scoring::Softmax, true, true), 0.5, 0.1),
            (mk(Scoring::Sigmoid, false, false), 0.3, 0.2),
        ]
        .into_iter()
        .enumerate()
        {
            let x = MoeInputs::generate(&p, n as u64 + 3);
            let d_out = generate(
                n as u64,
                TensorId::MoeDOut,
                p.tokens * p.hidden,
                1.0,
                p.dtype,
            );
            let full = moe_backward_f64(&p, &x, &d_out, d_aux, d_z).unwrap();
            let s = moe_sampled_f64(&p, &x, &d_out, d_aux, d_z, 7).unwrap();
            assert_eq!(s[0].select.as_ref().unwrap().len(), 7);
            for (t, f) in s.iter().zip([&full.dx, &full.dw13, &full.dw2]) {
                let mut kk = 0;
                for &(at, len) in t.select.as_ref().unwrap() {
                    for e in 0..len {
                        let (want, got) = (f[at + e], t.values[kk]);
                        assert!(
                            (want - got).abs() <= 1e-10 * (1.0 + want.abs()),
                            "{p}: {} element {}: {got} vs {want}",
                            t.name,
                            at + e
                        );
                        kk += 1;
                    }
                }
                assert_eq!(kk, t.values.len());
            }
        }
    }
}
