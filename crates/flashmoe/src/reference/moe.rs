//! MoE layer forward ground truth in f64: router, top-k, SwiGLU experts, weighted combine,
//! optional shared expert, auxiliary load-balancing loss and z-loss.
//!
//! For each token `t` (x_t a row of `x`):
//!
//! 1. logits_t = x_t · router (f64), one per expert;
//! 2. scores: `Softmax` → softmax over experts; `Sigmoid` → σ(logit) per expert;
//! 3. top-k experts by score, ids in descending score order, ties broken towards the lower
//!    expert index (deterministic);
//! 4. weights = the selected scores, divided by their sum when `renormalize`;
//! 5. each selected expert `e`: h = silu(x_t·W13[e][:, :I]) ⊙ (x_t·W13[e][:, I:]),
//!    y = h·W2[e]; out_t = Σ_k weight_k·y_k (in top-k order), plus the shared expert's
//!    y with weight 1 when `shared_expert`.
//!
//! Losses (over the whole batch):
//!
//! - aux (Switch-Transformer load balancing) = E · Σ_i f_i · P_i, with
//!   f_i = count_i / (tokens · top_k) — the fraction of the token→expert assignments that
//!   went to expert i, so Σ f_i = 1 and a perfectly balanced router scores 1.0 — and
//!   P_i = mean over tokens of the router probability of expert i. For softmax scoring the
//!   probability is the softmax; for sigmoid scoring (whose scores do not sum to 1) it is
//!   the sigmoid scores normalised to sum 1 per token, σ_i / Σ_j σ_j.
//! - z-loss = mean over tokens of logsumexp(logits_t)² (natural log; the same for both
//!   scorings).
//!
//! Weights are the problem's dtype-rounded values held in f32; everything after the
//! inputs is computed in f64. Work is parallel over tokens, and every sum is taken in a
//! fixed order, so results do not depend on the thread count.

use super::{check_len, checked_product};
use crate::error::{Error, Result};
use crate::inputs::{generate, TensorId};
use crate::problem::{MoeProblem, Scoring};
use rayon::prelude::*;

/// MoE inputs as f32 values already rounded to the problem's dtype.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeInputs {
    /// (tokens, hidden), uniform in [-1, 1).
    pub x: Vec<f32>,
    /// (hidden, experts), uniform in [-1/√hidden, 1/√hidden).
    pub router: Vec<f32>,
    /// (experts, hidden, 2·intermediate): columns [0, I) gate, [I, 2I) up; scale 1/√hidden.
    pub w13: Vec<f32>,
    /// (experts, intermediate, hidden), scale 1/√intermediate.
    pub w2: Vec<f32>,
    /// (hidden, 2·intermediate), only when the problem has a shared expert.
    pub shared_w13: Option<Vec<f32>>,
    /// (intermediate, hidden), only when the problem has a shared expert.
    pub shared_w2: Option<Vec<f32>>,
}

/// Element counts of every MoE tensor, checked for overflow.
struct MoeLens {
    x: usize,
    router: usize,
    w13: usize,
    w2: usize,
    shared_w13: usize,
    shared_w2: usize,
}

fn moe_lens(p: &MoeProblem) -> Result<MoeLens> {
    let (t, h, i, e) = (p.tokens, p.hidden, p.intermediate, p.experts);
    Ok(MoeLens {
        x: checked_product("x", &[t, h])?,
        router: checked_product("router", &[h, e])?,
        w13: checked_product("w13", &[e, h, 2, i])?,
        w2: checked_product("w2", &[e, i, h])?,
        shared_w13: checked_product("shared_w13", &[h, 2, i])?,
        shared_w2: checked_product("shared_w2", &[i, h])?,
    })
}

impl MoeInputs {
    /// The deterministic inputs of `p` for `seed` (tensor ids MoeX, MoeRouter, MoeW13,
    /// MoeW2, MoeSharedW13, MoeSharedW2; scales as documented on the fields), rounded to
    /// `p.dtype`. Shared-expert weights are generated only when `p.shared_expert`.
    ///
    /// A problem whose sizes overflow `usize` yields empty tensors (every consumer then
    /// reports the problem instead of trying to allocate).
    pub fn generate(p: &MoeProblem, seed: u64) -> MoeInputs {
        let n = moe_lens(p).unwrap_or(MoeLens {
            x: 0,
            router: 0,
            w13: 0,
            w2: 0,
            shared_w13: 0,
            shared_w2: 0,
        });
        let dt = p.dtype;
        let sh = 1.0 / (p.hidden.max(1) as f32).sqrt();
        let si = 1.0 / (p.intermediate.max(1) as f32).sqrt();
        MoeInputs {
            x: generate(seed, TensorId::MoeX, n.x, 1.0, dt),
            router: generate(seed, TensorId::MoeRouter, n.router, sh, dt),
            w13: generate(seed, TensorId::MoeW13, n.w13, sh, dt),
            w2: generate(seed, TensorId::MoeW2, n.w2, si, dt),
            shared_w13: p
                .shared_expert
                .then(|| generate(seed, TensorId::MoeSharedW13, n.shared_w13, sh, dt)),
            shared_w2: p
                .shared_expert
                .then(|| generate(seed, TensorId::MoeSharedW2, n.shared_w2, si, dt)),
        }
    }
}

/// Router decisions and statistics.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// (tokens, top_k) expert ids, by descending score; ties → lower expert index first.
    pub topk_ids: Vec<u32>,
    /// (tokens, top_k) combine weights matching `topk_ids`.
    pub topk_weights: Vec<f64>,
    /// Number of tokens routed to each expert (length `experts`; sums to tokens·top_k).
    pub expert_counts: Vec<usize>,
    /// Switch load-balancing loss E·Σ f_i·P_i (see the module docs).
    pub aux_loss: f64,
    /// Mean over tokens of logsumexp(logits)².
    pub z_loss: f64,
}

/// MoE layer output: `out` is (tokens, hidden).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeOutput {
    pub out: Vec<f64>,
    pub routing: Routing,
}

/// Validate the problem and the activation/router lengths.
fn validate_router(p: &MoeProblem, x: &MoeInputs) -> Result<MoeLens> {
    let n = moe_lens(p)?;
    p.validate()?;
    if u32::try_from(p.experts).is_err() {
        return Err(Error::invalid(format!(
            "experts ({}) must fit in u32",
            p.experts
        )));
    }
    check_len("x", n.x, x.x.len())?;
    check_len("router", n.router, x.router.len())?;
    Ok(n)
}

/// Logistic function, written to avoid overflow for large |z|.
fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

fn silu(z: f64) -> f64 {
    z * sigmoid(z)
}

/// log Σ exp(v), max-subtracted.
fn logsumexp(v: &[f64]) -> f64 {
    let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return m;
    }
    m + v.iter().map(|&z| (z - m).exp()).sum::<f64>().ln()
}

/// One token's router result.
struct TokenRoute {
    ids: Vec<u32>,
    weights: Vec<f64>,
    /// Router probabilities (sum 1) used by the aux loss.
    probs: Vec<f64>,
    lse: f64,
}

fn route_token(p: &MoeProblem, xt: &[f32], router: &[f32]) -> TokenRoute {
    let e = p.experts;
    let mut logits = vec![0f64; e];
    for (&xh, row) in xt.iter().zip(router.chunks_exact(e)) {
        let xh = xh as f64;
        for (l, &w) in logits.iter_mut().zip(row) {
            *l += xh * w as f64;
        }
    }
    let lse = logsumexp(&logits);
    let (scores, probs) = match p.scoring {
        Scoring::Softmax => {
            let s: Vec<f64> = logits.iter().map(|&z| (z - lse).exp()).collect();
            (s.clone(), s)
        }
        Scoring::Sigmoid => {
            let s: Vec<f64> = logits.iter().map(|&z| sigmoid(z)).collect();
            let total: f64 = s.iter().sum();
            let probs = if total > 0.0 {
                s.iter().map(|&v| v / total).collect()
            } else {
                vec![1.0 / e as f64; e]
            };
            (s, probs)
        }
    };
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(p.top_k);
    let mut weights: Vec<f64> = order.iter().map(|&i| scores[i]).collect();
    if p.renormalize {
        let sum: f64 = weights.iter().sum();
        if sum > 0.0 {
            weights.iter_mut().for_each(|w| *w /= sum);
        }
    }
    TokenRoute {
        ids: order.iter().map(|&i| i as u32).collect(),
        weights,
        probs,
        lse,
    }
}

/// Route every token (see the module docs), parallel over tokens.
pub fn route(p: &MoeProblem, x: &MoeInputs) -> Result<Routing> {
    validate_router(p, x)?;
    let per_token: Vec<TokenRoute> =
        x.x.par_chunks(p.hidden)
            .map(|xt| route_token(p, xt, &x.router))
            .collect();

    let (t, e, k) = (p.tokens, p.experts, p.top_k);
    let mut topk_ids = Vec::with_capacity(t * k);
    let mut topk_weights = Vec::with_capacity(t * k);
    let mut expert_counts = vec![0usize; e];
    let mut prob_sum = vec![0f64; e];
    let mut z_sum = 0.0;
    for r in &per_token {
        for &id in &r.ids {
            expert_counts[id as usize] += 1;
        }
        topk_ids.extend_from_slice(&r.ids);
        topk_weights.extend_from_slice(&r.weights);
        for (s, &pr) in prob_sum.iter_mut().zip(&r.probs) {
            *s += pr;
        }
        z_sum += r.lse * r.lse;
    }
    let assignments = (t * k) as f64;
    let aux_loss = e as f64
        * expert_counts
            .iter()
            .zip(&prob_sum)
            .map(|(&c, &ps)| (c as f64 / assignments) * (ps / t as f64))
            .sum::<f64>();
    Ok(Routing {
        topk_ids,
        topk_weights,
        expert_counts,
        aux_loss,
        z_loss: z_sum / t as f64,
    })
}

/// One SwiGLU expert on one token: out += weight · (silu(x·Wg) ⊙ (x·Wu))·W2.
/// `w13`: (hidden, 2I); `w2`: (I, hidden); `gu`: scratch of 2I.
fn expert_accumulate(
    xt: &[f64],
    w13: &[f32],
    w2: &[f32],
    inter: usize,
    weight: f64,
    gu: &mut [f64],
    out: &mut [f64],
) {
    gu.fill(0.0);
    for (&xh, row) in xt.iter().zip(w13.chunks_exact(2 * inter)) {
        for (g, &w) in gu.iter_mut().zip(row) {
            *g += xh * w as f64;
        }
    }
    let (gate, up) = gu.split_at_mut(inter);
    for (g, &u) in gate.iter_mut().zip(up.iter()) {
        *g = silu(*g) * u * weight;
    }
    let hidden = out.len();
    for (&hj, row) in gate.iter().zip(w2.chunks_exact(hidden)) {
        for (o, &w) in out.iter_mut().zip(row) {
            *o += hj * w as f64;
        }
    }
}

/// The MoE layer forward in f64 (see the module docs). Parallel over tokens.
///
/// `shared_w13`/`shared_w2` must be present when `p.shared_expert`; they are ignored
/// otherwise.
pub fn moe_f64(p: &MoeProblem, x: &MoeInputs) -> Result<MoeOutput> {
    let n = validate_router(p, x)?;
    check_len("w13", n.w13, x.w13.len())?;
    check_len("w2", n.w2, x.w2.len())?;
    let shared = if p.shared_expert {
        let (Some(sw13), Some(sw2)) = (&x.shared_w13, &x.shared_w2) else {
            return Err(Error::invalid(
                "shared_expert is set but the shared expert weights (shared_w13, shared_w2) are missing",
            ));
        };
        check_len("shared_w13", n.shared_w13, sw13.len())?;
        check_len("shared_w2", n.shared_w2, sw2.len())?;
        Some((sw13.as_slice(), sw2.as_slice()))
    } else {
        None
    };
    let routing = route(p, x)?;

    let (h, i, k) = (p.hidden, p.intermediate, p.top_k);
    let per_expert_w13 = h * 2 * i;
    let per_expert_w2 = i * h;
    let mut out = vec![0f64; p.tokens * h];
    out.par_chunks_mut(h)
        .zip(x.x.par_chunks(h))
        .enumerate()
        .for_each_init(
            || (vec![0f64; h], vec![0f64; 2 * i]),
            |(xt, gu), (t, (ot, xs))| {
                for (a, &b) in xt.iter_mut().zip(xs) {
                    *a = b as f64;
                }
                for slot in 0..k {
                    let e = routing.topk_ids[t * k + slot] as usize;
                    let w = routing.topk_weights[t * k + slot];
                    let w13 = &x.w13[e * per_expert_w13..(e + 1) * per_expert_w13];
                    let w2 = &x.w2[e * per_expert_w2..(e + 1) * per_expert_w2];
                    expert_accumulate(xt, w13, w2, i, w, gu, ot);
                }
                if let Some((sw13, sw2)) = shared {
                    expert_accumulate(xt, sw13, sw2, i, 1.0, gu, ot);
                }
            },
        );
    Ok(MoeOutput { out, routing })
}
