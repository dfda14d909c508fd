//! MoE layer backward ground truth in f64: the gradients of x, router_w, w13, w2,
//! shared_w13 and shared_w2 for the forward exactly as [`super::moe`] defines it, given
//! the upstream gradient `d_out` of the output and the upstream scalars `d_aux`, `d_z` of
//! the two losses. That is, the gradient of
//!
//! ```text
//! L = <d_out, out> + d_aux · aux + d_z · z_loss
//! ```
//!
//! (`d_aux = d_z = 0` when the losses are not trained). Notation per token t: logits
//! z = x_t·R (R = router_w, H × E); scores s = softmax(z) or σ(z); ids = top-k of s;
//! weights w_s = s_{id_s} (÷ S = Σ_s s_{id_s} when renormalising); per routed row
//! (t, slot) of expert e: gu = x_t·W13\[e\] = \[g | u\], h = silu(g) ⊙ u, y = h·W2\[e\];
//! out_t = Σ_s w_s·y_s (+ y_shared,t).
//!
//! Differentiation conventions (what a PyTorch user gets from autograd on the same
//! formulas):
//!
//! - **Top-k selection is not differentiated.** The chosen ids are constants (an index
//!   tensor); a perturbation that changes them is outside the derivative (ties are a
//!   measure-zero set; the finite-difference tests keep clear of them).
//! - **Routing weights are differentiated** through the renormalisation and the
//!   softmax / sigmoid of the selected scores.
//! - **aux = E · Σ_i f_i · P_i**: the token fractions f_i = count_i / (T·k) come from the
//!   top-k counts and are **constants** (as `one_hot(topk_ids).mean()` is in PyTorch);
//!   P_i = (1/T) Σ_t p_{t,i} is **differentiable**, p = softmax(z), or for sigmoid scoring
//!   p = σ(z) / Σ_j σ(z_j) — differentiated through both σ and the normalising sum.
//! - **z-loss = (1/T) Σ_t logsumexp(z_t)²**, differentiated through logsumexp (for both
//!   scorings): ∂/∂z_{t,i} = 2·lse_t·softmax(z_t)_i / T.
//! - The forward's degenerate branches (a renormalising sum or a sigmoid total of 0, which
//!   f64 reaches only when every selected logit underflows) are constants there and give
//!   the derivative of the branch taken.
//!
//! The backward is decomposed into the stages the GPU kernels will have, each a public
//! function with its formula, so that every stage can be checked on its own:
//!
//! 1. [`forward_state`]: what the forward must provide (routing, scores, the permutation,
//!    gate/up pre-activations, h, y);
//! 2. [`combine_backward`]: dY = w·dOut, dw = <y, dOut> per (token, slot);
//! 3. per expert ([`expert_backward`]): [`down_backward`] (dH = dY·W2ᵀ, dW2 = Hᵀ·dY),
//!    [`swiglu_backward`], [`up_gate_backward`] (dX_e = dGU·W13ᵀ, dW13 = X_eᵀ·dGU); the
//!    shared expert is the same with dY = dOut and every token;
//! 4. [`router_logits_backward`]: d(logits) from dw (renormalisation, scoring), the
//!    aux loss and the z-loss; [`router_gemm_backward`]: dR = xᵀ·dZ, dx_router = dZ·Rᵀ;
//! 5. [`unpermute_backward`]: dx = the scatter-add of the expert rows, in a fixed order,
//!    plus the shared expert's and the router's dx.
//!
//! [`moe_backward_f64`] runs them in that order. Every sum is taken in a fixed order
//! (stated on each function), so results do not depend on the thread count.
//!
//! Checked (tests below) element by element against central finite differences of
//! [`super::moe_f64`]'s L, step 1e-3 on the f32 inputs, on inputs whose top-k margin is
//! at least ten times the largest logit change a step can cause (asserted, and every
//! perturbed forward must select the same experts): agreement within 2e-7 + 2e-6·|grad|.

use super::moe::{route, MoeInputs, Routing};
use super::moe_grouped::{permute, Permutation};
use super::{check_len, checked_product};
use crate::error::{Error, Result};
use crate::problem::{MoeProblem, Scoring};
use rayon::prelude::*;

fn sigmoid(z: f64) -> f64 {
    if z >= 0.0 {
        1.0 / (1.0 + (-z).exp())
    } else {
        let e = z.exp();
        e / (1.0 + e)
    }
}

/// log Σ exp(v), max-subtracted (as the forward computes it).
fn logsumexp(v: &[f64]) -> f64 {
    let m = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return m;
    }
    m + v.iter().map(|&z| (z - m).exp()).sum::<f64>().ln()
}

/// The router's forward values the backward needs.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterState {
    /// The forward's routing: ids (T, k), weights (T, k), counts (E), losses, logits (T, E).
    pub routing: Routing,
    /// (T, E) scores the top-k ranked: softmax(z) or σ(z).
    pub scores: Vec<f64>,
    /// (T, E) the aux loss's probabilities p: softmax(z), or σ(z)/Σσ(z) for sigmoid.
    pub probs: Vec<f64>,
    /// (T) logsumexp of each token's logits.
    pub lse: Vec<f64>,
}

impl RouterState {
    /// Scores, probabilities and logsumexp recomputed from `routing.logits` with the
    /// forward's formulas (module docs of [`super::moe`]).
    pub fn new(p: &MoeProblem, routing: Routing) -> RouterState {
        let e = p.experts;
        let mut scores = Vec::with_capacity(routing.logits.len());
        let mut probs = Vec::with_capacity(routing.logits.len());
        let mut lse = Vec::with_capacity(p.tokens);
        for z in routing.logits.chunks_exact(e) {
            let l = logsumexp(z);
            lse.push(l);
            match p.scoring {
                Scoring::Softmax => {
                    let s: Vec<f64> = z.iter().map(|&v| (v - l).exp()).collect();
                    scores.extend_from_slice(&s);
                    probs.extend_from_slice(&s);
                }
                Scoring::Sigmoid => {
                    let s: Vec<f64> = z.iter().map(|&v| sigmoid(v)).collect();
                    let total: f64 = s.iter().sum();
                    if total > 0.0 {
                        probs.extend(s.iter().map(|&v| v / total));
                    } else {
                        probs.resize(probs.len() + e, 1.0 / e as f64);
                    }
                    scores.extend_from_slice(&s);
                }
            }
        }
        RouterState {
            routing,
            scores,
            probs,
            lse,
        }
    }
}

/// One group of expert rows' forward activations, row-major, one row per routed
/// (token, slot) (or per token for the shared expert).
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertActivations {
    /// (rows, 2I): the gate (columns [0, I)) and up (columns [I, 2I)) pre-activations.
    pub gu: Vec<f64>,
    /// (rows, I): h = silu(gate) ⊙ up.
    pub h: Vec<f64>,
    /// (rows, H): y = h·W2.
    pub y: Vec<f64>,
}

/// Everything the backward reads from the forward.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeForwardState {
    pub router: RouterState,
    /// Routed rows grouped by expert, token order within an expert
    /// ([`super::moe_grouped::permute`]).
    pub perm: Permutation,
    /// Activations of the routed rows in permuted order (`perm.offsets` delimits experts).
    pub routed: ExpertActivations,
    /// The shared expert's activations, one row per token, when the problem has one.
    pub shared: Option<ExpertActivations>,
    /// (T, H) the layer output, Σ_s w_s·y_s in slot order, then + y_shared.
    pub out: Vec<f64>,
}

/// Gradients of every input, f64, in the inputs' layouts, plus the two router
/// intermediates the kernels will be checked on.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeGradients {
    /// (T, H).
    pub dx: Vec<f64>,
    /// (H, E).
    pub d_router: Vec<f64>,
    /// (E, H, 2I); zero for experts that received no token.
    pub dw13: Vec<f64>,
    /// (E, I, H); zero for experts that received no token.
    pub dw2: Vec<f64>,
    /// (H, 2I), when the problem has a shared expert.
    pub d_shared_w13: Option<Vec<f64>>,
    /// (I, H), when the problem has a shared expert.
    pub d_shared_w2: Option<Vec<f64>>,
    /// (T, k) dL/d(routing weight), slot order of `topk_ids`.
    pub d_weights: Vec<f64>,
    /// (T, E) dL/d(router logit).
    pub d_logits: Vec<f64>,
}

/// Gradients of one expert (or of the shared expert) over its rows.
#[derive(Debug, Clone, PartialEq)]
pub struct ExpertGradients {
    /// (rows, H): the rows' contribution to dx, before the un-permute.
    pub dx: Vec<f64>,
    /// (H, 2I).
    pub dw13: Vec<f64>,
    /// (I, H).
    pub dw2: Vec<f64>,
}

/// The f64 rows `x[t]` of `tokens`, in that order ((rows, H)).
pub fn gather_rows(x: &[f32], tokens: impl Iterator<Item = usize>, hidden: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for t in tokens {
        out.extend(x[t * hidden..(t + 1) * hidden].iter().map(|&v| v as f64));
    }
    out
}

/// One expert's forward on gathered rows `xe` (rows, H): gu = xe·W13 (sum over the hidden
/// index ascending), h = silu(gu\[:, :I\]) ⊙ gu\[:, I:\], y = h·W2 (sum over the
/// intermediate index ascending) — the forward's order, so y equals its expert output.
/// `w13`: (H, 2I); `w2`: (I, H).
pub fn expert_forward(
    xe: &[f64],
    w13: &[f32],
    w2: &[f32],
    hidden: usize,
    inter: usize,
) -> ExpertActivations {
    let rows = xe.len() / hidden;
    let mut gu = vec![0f64; rows * 2 * inter];
    let mut h = vec![0f64; rows * inter];
    let mut y = vec![0f64; rows * hidden];
    gu.par_chunks_mut(2 * inter)
        .zip(h.par_chunks_mut(inter))
        .zip(y.par_chunks_mut(hidden))
        .zip(xe.par_chunks(hidden))
        .for_each(|(((g, hr), yr), xr)| {
            for (&xv, wrow) in xr.iter().zip(w13.chunks_exact(2 * inter)) {
                for (a, &w) in g.iter_mut().zip(wrow) {
                    *a += xv * w as f64;
                }
            }
            let (gate, up) = g.split_at(inter);
            for ((o, &gv), &uv) in hr.iter_mut().zip(gate).zip(up) {
                *o = gv * sigmoid(gv) * uv;
            }
            for (&hv, wrow) in hr.iter().zip(w2.chunks_exact(hidden)) {
                for (o, &w) in yr.iter_mut().zip(wrow) {
                    *o += hv * w as f64;
                }
            }
        });
    ExpertActivations { gu, h, y }
}

/// The forward, keeping what the backward needs: [`route`] (the forward's own routing:
/// same ids, tie rule and weights), [`RouterState::new`], the permutation, every expert's
/// activations in permuted order ([`expert_forward`]) and the shared expert's.
pub fn forward_state(p: &MoeProblem, x: &MoeInputs) -> Result<MoeForwardState> {
    let routing = route(p, x)?;
    let (t, h, i, e, k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
    check_len("w13", checked_product("w13", &[e, h, 2, i])?, x.w13.len())?;
    check_len("w2", checked_product("w2", &[e, i, h])?, x.w2.len())?;
    let shared_w = shared_weights(p, x)?;
    let perm = permute(p, &routing);
    let router = RouterState::new(p, routing);

    let (per13, per2) = (h * 2 * i, i * h);
    let parts: Vec<ExpertActivations> = (0..e)
        .into_par_iter()
        .map(|ex| {
            let rows = &perm.rows[perm.offsets[ex]..perm.offsets[ex + 1]];
            let xe = gather_rows(&x.x, rows.iter().map(|&(tok, _)| tok as usize), h);
            expert_forward(
                &xe,
                &x.w13[ex * per13..(ex + 1) * per13],
                &x.w2[ex * per2..(ex + 1) * per2],
                h,
                i,
            )
        })
        .collect();
    let mut routed = ExpertActivations {
        gu: Vec::with_capacity(perm.rows.len() * 2 * i),
        h: Vec::with_capacity(perm.rows.len() * i),
        y: Vec::with_capacity(perm.rows.len() * h),
    };
    for a in parts {
        routed.gu.extend_from_slice(&a.gu);
        routed.h.extend_from_slice(&a.h);
        routed.y.extend_from_slice(&a.y);
    }
    let shared =
        shared_w.map(|(w13, w2)| expert_forward(&gather_rows(&x.x, 0..t, h), w13, w2, h, i));

    let mut out = vec![0f64; t * h];
    for (tok, ot) in out.chunks_exact_mut(h).enumerate() {
        for s in 0..k {
            let a = tok * k + s;
            let r = perm.row_of_slot[a];
            let w = router.routing.topk_weights[a];
            for (o, &v) in ot.iter_mut().zip(&routed.y[r * h..(r + 1) * h]) {
                *o += w * v;
            }
        }
        if let Some(sh) = &shared {
            for (o, &v) in ot.iter_mut().zip(&sh.y[tok * h..(tok + 1) * h]) {
                *o += v;
            }
        }
    }
    Ok(MoeForwardState {
        router,
        perm,
        routed,
        shared,
        out,
    })
}

/// The shared expert's weights, checked, when the problem has one.
fn shared_weights<'a>(p: &MoeProblem, x: &'a MoeInputs) -> Result<Option<(&'a [f32], &'a [f32])>> {
    if !p.shared_expert {
        return Ok(None);
    }
    let (Some(w13), Some(w2)) = (&x.shared_w13, &x.shared_w2) else {
        return Err(Error::invalid(
            "shared_expert is set but the shared expert weights \
             (shared_w13, shared_w2) are missing",
        ));
    };
    let (h, i) = (p.hidden, p.intermediate);
    check_len(
        "shared_w13",
        checked_product("shared_w13", &[h, 2, i])?,
        w13.len(),
    )?;
    check_len(
        "shared_w2",
        checked_product("shared_w2", &[i, h])?,
        w2.len(),
    )?;
    Ok(Some((w13, w2)))
}

/// Combine backward. For every routed (token t, slot s) on permuted row r:
///
/// - dY\[r\] = w_{t,s} · dOut\[t\]          (rows, H), permuted order;
/// - dw_{t,s} = <y\[r\], dOut\[t\]>         (T, k), sum over the hidden index ascending.
///
/// (The shared expert's dY is dOut itself.) Equivalently dw_{t,s} = <h\[r\], dOut\[t\]·W2ᵀ>,
/// since y = h·W2: a kernel that computes dOut·W2ᵀ for the down-projection backward gets
/// dw without keeping y.
pub fn combine_backward(
    p: &MoeProblem,
    routing: &Routing,
    perm: &Permutation,
    y: &[f64],
    d_out: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let h = p.hidden;
    let mut dy = vec![0f64; perm.rows.len() * h];
    dy.par_chunks_mut(h)
        .zip(&perm.rows)
        .for_each(|(dr, &(tok, s))| {
            let a = tok as usize * p.top_k + s as usize;
            let w = routing.topk_weights[a];
            for (d, &g) in dr.iter_mut().zip(&d_out[tok as usize * h..]) {
                *d = w * g;
            }
        });
    let dw = perm
        .row_of_slot
        .iter()
        .enumerate()
        .map(|(a, &r)| {
            let tok = a / p.top_k;
            y[r * h..(r + 1) * h]
                .iter()
                .zip(&d_out[tok * h..(tok + 1) * h])
                .map(|(&a, &b)| a * b)
                .sum()
        })
        .collect();
    (dy, dw)
}

/// Down-projection backward of one expert over its rows (`h_e`: (rows, I), `dy`:
/// (rows, H), `w2`: (I, H)):
///
/// - dH = dY·W2ᵀ: dH\[r\]\[j\] = Σ_c dY\[r\]\[c\]·W2\[j\]\[c\]   (c ascending);
/// - dW2 = Hᵀ·dY: dW2\[j\]\[c\] = Σ_r H\[r\]\[j\]·dY\[r\]\[c\]   (r ascending: the weight-
///   gradient GEMM, reduction over the expert's rows).
pub fn down_backward(
    h_e: &[f64],
    dy: &[f64],
    w2: &[f32],
    hidden: usize,
    inter: usize,
) -> (Vec<f64>, Vec<f64>) {
    let mut dh = vec![0f64; h_e.len()];
    dh.par_chunks_mut(inter)
        .zip(dy.par_chunks(hidden))
        .for_each(|(dhr, dyr)| {
            for (d, wrow) in dhr.iter_mut().zip(w2.chunks_exact(hidden)) {
                *d = dyr.iter().zip(wrow).map(|(&g, &w)| g * w as f64).sum();
            }
        });
    let mut dw2 = vec![0f64; inter * hidden];
    dw2.par_chunks_mut(hidden).enumerate().for_each(|(j, row)| {
        for (hr, dyr) in h_e.chunks_exact(inter).zip(dy.chunks_exact(hidden)) {
            let hv = hr[j];
            for (o, &g) in row.iter_mut().zip(dyr) {
                *o += hv * g;
            }
        }
    });
    (dh, dw2)
}

/// SwiGLU backward, elementwise: with g = gate, u = up pre-activations (`gu`: (rows, 2I)),
/// σ = sigmoid(g), silu(g) = g·σ, silu'(g) = σ·(1 + g·(1 − σ)):
///
/// - d(gate) = dH ⊙ u ⊙ silu'(g);
/// - d(up)   = dH ⊙ silu(g).
///
/// Returns dGU (rows, 2I) in gu's layout (gate columns, then up).
pub fn swiglu_backward(gu: &[f64], dh: &[f64], inter: usize) -> Vec<f64> {
    let mut dgu = vec![0f64; gu.len()];
    dgu.par_chunks_mut(2 * inter)
        .zip(gu.par_chunks(2 * inter))
        .zip(dh.par_chunks(inter))
        .for_each(|((d, g), dhr)| {
            let (dg, du) = d.split_at_mut(inter);
            let (gate, up) = g.split_at(inter);
            for j in 0..inter {
                let (gv, uv) = (gate[j], up[j]);
                let s = sigmoid(gv);
                dg[j] = dhr[j] * uv * s * (1.0 + gv * (1.0 - s));
                du[j] = dhr[j] * gv * s;
            }
        });
    dgu
}

/// Gate/up-projection backward of one expert over its gathered rows (`xe`: (rows, H),
/// `dgu`: (rows, 2I), `w13`: (H, 2I)):
///
/// - dX_e = dGU·W13ᵀ: dX_e\[r\]\[c\] = Σ_n dGU\[r\]\[n\]·W13\[c\]\[n\]   (n ascending over
///   gate then up columns);
/// - dW13 = X_eᵀ·dGU: dW13\[c\]\[n\] = Σ_r X_e\[r\]\[c\]·dGU\[r\]\[n\]   (r ascending).
pub fn up_gate_backward(
    xe: &[f64],
    dgu: &[f64],
    w13: &[f32],
    hidden: usize,
    inter: usize,
) -> (Vec<f64>, Vec<f64>) {
    let n = 2 * inter;
    let mut dxe = vec![0f64; xe.len()];
    dxe.par_chunks_mut(hidden)
        .zip(dgu.par_chunks(n))
        .for_each(|(dxr, dgr)| {
            for (d, wrow) in dxr.iter_mut().zip(w13.chunks_exact(n)) {
                *d = dgr.iter().zip(wrow).map(|(&g, &w)| g * w as f64).sum();
            }
        });
    let mut dw13 = vec![0f64; hidden * n];
    dw13.par_chunks_mut(n).enumerate().for_each(|(c, row)| {
        for (xr, dgr) in xe.chunks_exact(hidden).zip(dgu.chunks_exact(n)) {
            let xv = xr[c];
            for (o, &g) in row.iter_mut().zip(dgr) {
                *o += xv * g;
            }
        }
    });
    (dxe, dw13)
}

/// One expert's backward over its rows: [`down_backward`] → [`swiglu_backward`] →
/// [`up_gate_backward`]. `xe` (rows, H) gathered inputs, `gu` (rows, 2I) and `h_e`
/// (rows, I) its forward activations, `dy` (rows, H) from [`combine_backward`] (dOut for
/// the shared expert).
#[allow(clippy::too_many_arguments)]
pub fn expert_backward(
    xe: &[f64],
    gu: &[f64],
    h_e: &[f64],
    dy: &[f64],
    w13: &[f32],
    w2: &[f32],
    hidden: usize,
    inter: usize,
) -> ExpertGradients {
    let (dh, dw2) = down_backward(h_e, dy, w2, hidden, inter);
    let dgu = swiglu_backward(gu, &dh, inter);
    let (dx, dw13) = up_gate_backward(xe, &dgu, w13, hidden, inter);
    ExpertGradients { dx, dw13, dw2 }
}

/// Un-permute backward: the scatter-add of the routed rows' dX_e into dx, in a fixed
/// order. For each token t:
///
/// dx\[t\] = ((Σ_{s = 0..k} dX_perm\[row(t, s)\]) + dX_shared\[t\]) + dx_router\[t\],
///
/// summed left to right, slots ascending (`dx_perm`: (rows, H) permuted order;
/// `dx_shared`: (T, H) when there is a shared expert; `dx_router`: (T, H)).
pub fn unpermute_backward(
    p: &MoeProblem,
    perm: &Permutation,
    dx_perm: &[f64],
    dx_shared: Option<&[f64]>,
    dx_router: &[f64],
) -> Vec<f64> {
    let (h, k) = (p.hidden, p.top_k);
    let mut dx = vec![0f64; p.tokens * h];
    dx.par_chunks_mut(h).enumerate().for_each(|(t, d)| {
        for s in 0..k {
            let r = perm.row_of_slot[t * k + s];
            for (o, &v) in d.iter_mut().zip(&dx_perm[r * h..(r + 1) * h]) {
                *o += v;
            }
        }
        if let Some(sh) = dx_shared {
            for (o, &v) in d.iter_mut().zip(&sh[t * h..(t + 1) * h]) {
                *o += v;
            }
        }
        for (o, &v) in d.iter_mut().zip(&dx_router[t * h..(t + 1) * h]) {
            *o += v;
        }
    });
    dx
}

/// Router backward up to the logits: dZ (T, E) = dL/d(logits) from the routing-weight
/// gradients `d_weights` (T, k) and the two loss scalars. Per token (σ = scores when
/// sigmoid, s = scores, p = aux probabilities, ids and S = Σ_s s_{id_s} as in the module
/// docs), the gradient on the scores, only at the selected experts:
///
/// - renormalised: ds_{id_s} = (dw_s − Σ_j dw_j·w_j) / S;  else ds_{id_s} = dw_s;
///
/// the aux loss's gradient on the probabilities (f constant):
/// dp_i = d_aux · E · f_i / T, f_i = count_i / (T·k); then
///
/// - softmax (s = p = softmax(z)): dZ_i = s_i·(G_i − Σ_j s_j·G_j) with G = ds + dp;
/// - sigmoid: dZ_i = σ_i·(1 − σ_i)·(ds_i + (dp_i − Σ_j p_j·dp_j) / Σ_j σ_j);
///
/// plus the z-loss for both: dZ_i += d_z · 2·lse / T · softmax(z)_i.
pub fn router_logits_backward(
    p: &MoeProblem,
    rs: &RouterState,
    d_weights: &[f64],
    d_aux: f64,
    d_z: f64,
) -> Vec<f64> {
    let (t, e, k) = (p.tokens, p.experts, p.top_k);
    let r = &rs.routing;
    let tf = t as f64;
    let dp: Vec<f64> = r
        .expert_counts
        .iter()
        .map(|&c| d_aux * e as f64 * (c as f64 / (tf * k as f64)) / tf)
        .collect();
    let mut dz = vec![0f64; t * e];
    dz.par_chunks_mut(e).enumerate().for_each(|(tok, dzt)| {
        let ids = &r.topk_ids[tok * k..(tok + 1) * k];
        let w = &r.topk_weights[tok * k..(tok + 1) * k];
        let dw = &d_weights[tok * k..(tok + 1) * k];
        let s = &rs.scores[tok * e..(tok + 1) * e];
        let z = &r.logits[tok * e..(tok + 1) * e];
        let lse = rs.lse[tok];
        // Gradient on the scores from the routing weights.
        let mut ds = vec![0f64; e];
        let sum: f64 = ids.iter().map(|&id| s[id as usize]).sum();
        if p.renormalize && sum > 0.0 {
            let dot: f64 = dw.iter().zip(w).map(|(&a, &b)| a * b).sum();
            for (&id, &g) in ids.iter().zip(dw) {
                ds[id as usize] += (g - dot) / sum;
            }
        } else {
            for (&id, &g) in ids.iter().zip(dw) {
                ds[id as usize] += g;
            }
        }
        match p.scoring {
            Scoring::Softmax => {
                let g: Vec<f64> = ds.iter().zip(&dp).map(|(&a, &b)| a + b).collect();
                let dot: f64 = s.iter().zip(&g).map(|(&a, &b)| a * b).sum();
                for ((o, &si), &gi) in dzt.iter_mut().zip(s).zip(&g) {
                    *o = si * (gi - dot);
                }
            }
            Scoring::Sigmoid => {
                let total: f64 = s.iter().sum();
                let pr = &rs.probs[tok * e..(tok + 1) * e];
                let dot: f64 = pr.iter().zip(&dp).map(|(&a, &b)| a * b).sum();
                for i in 0..e {
                    let from_aux = if total > 0.0 {
                        (dp[i] - dot) / total
                    } else {
                        0.0
                    };
                    dzt[i] = s[i] * (1.0 - s[i]) * (ds[i] + from_aux);
                }
            }
        }
        let c = d_z * 2.0 * lse / tf;
        for (o, &zi) in dzt.iter_mut().zip(z) {
            *o += c * (zi - lse).exp();
        }
    });
    dz
}

/// Router GEMM backward (logits = x·R, R (H, E)):
///
/// - dx_router = dZ·Rᵀ: dx\[t\]\[c\] = Σ_e dZ\[t\]\[e\]·R\[c\]\[e\]   (e ascending), (T, H);
/// - dR = xᵀ·dZ: dR\[c\]\[e\] = Σ_t x\[t\]\[c\]·dZ\[t\]\[e\]   (t ascending), (H, E).
pub fn router_gemm_backward(
    p: &MoeProblem,
    x: &[f32],
    router: &[f32],
    d_logits: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let (h, e) = (p.hidden, p.experts);
    let mut dx = vec![0f64; p.tokens * h];
    dx.par_chunks_mut(h)
        .zip(d_logits.par_chunks(e))
        .for_each(|(dxt, dzt)| {
            for (o, rrow) in dxt.iter_mut().zip(router.chunks_exact(e)) {
                *o = dzt.iter().zip(rrow).map(|(&g, &w)| g * w as f64).sum();
            }
        });
    let mut dr = vec![0f64; h * e];
    dr.par_chunks_mut(e).enumerate().for_each(|(c, row)| {
        for (xt, dzt) in x.chunks_exact(h).zip(d_logits.chunks_exact(e)) {
            let xv = xt[c] as f64;
            for (o, &g) in row.iter_mut().zip(dzt) {
                *o += xv * g;
            }
        }
    });
    (dx, dr)
}

/// Gradients of L = <d_out, out> + d_aux·aux + d_z·z_loss of the forward [`super::moe_f64`]
/// with respect to every input (module docs: conventions and stages). `d_out`: (T, H);
/// `d_aux = d_z = 0` leaves the losses out.
pub fn moe_backward_f64(
    p: &MoeProblem,
    x: &MoeInputs,
    d_out: &[f32],
    d_aux: f64,
    d_z: f64,
) -> Result<MoeGradients> {
    let st = forward_state(p, x)?;
    let (t, h, i, e) = (p.tokens, p.hidden, p.intermediate, p.experts);
    check_len("d_out", t * h, d_out.len())?;
    let d_out: Vec<f64> = d_out.iter().map(|&v| v as f64).collect();

    let (dy, d_weights) = combine_backward(p, &st.router.routing, &st.perm, &st.routed.y, &d_out);

    let (per13, per2) = (h * 2 * i, i * h);
    let perm = &st.perm;
    let experts: Vec<ExpertGradients> = (0..e)
        .into_par_iter()
        .map(|ex| {
            let (a, b) = (perm.offsets[ex], perm.offsets[ex + 1]);
            let xe = gather_rows(
                &x.x,
                perm.rows[a..b].iter().map(|&(tok, _)| tok as usize),
                h,
            );
            expert_backward(
                &xe,
                &st.routed.gu[a * 2 * i..b * 2 * i],
                &st.routed.h[a * i..b * i],
                &dy[a * h..b * h],
                &x.w13[ex * per13..(ex + 1) * per13],
                &x.w2[ex * per2..(ex + 1) * per2],
                h,
                i,
            )
        })
        .collect();
    let mut dx_perm = Vec::with_capacity(perm.rows.len() * h);
    let mut dw13 = Vec::with_capacity(e * per13);
    let mut dw2 = Vec::with_capacity(e * per2);
    for g in experts {
        dx_perm.extend_from_slice(&g.dx);
        dw13.extend_from_slice(&g.dw13);
        dw2.extend_from_slice(&g.dw2);
    }

    let shared = match (shared_weights(p, x)?, &st.shared) {
        (Some((w13, w2)), Some(a)) => Some(expert_backward(
            &gather_rows(&x.x, 0..t, h),
            &a.gu,
            &a.h,
            &d_out,
            w13,
            w2,
            h,
            i,
        )),
        _ => None,
    };

    let d_logits = router_logits_backward(p, &st.router, &d_weights, d_aux, d_z);
    let (dx_router, d_router) = router_gemm_backward(p, &x.x, &x.router, &d_logits);
    let dx = unpermute_backward(
        p,
        perm,
        &dx_perm,
        shared.as_ref().map(|g| g.dx.as_slice()),
        &dx_router,
    );
    let (d_shared_w13, d_shared_w2) = match shared {
        Some(g) => (Some(g.dw13), Some(g.dw2)),
        None => (None, None),
    };
    Ok(MoeGradients {
        dx,
        d_router,
        dw13,
        dw2,
        d_shared_w13,
        d_shared_w2,
        d_weights,
        d_logits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::reference::moe::{moe_f64, route_from_logits};

    /// Finite-difference step on the f32 inputs (the step actually taken is measured after
    /// rounding, so it is exact).
    const STEP: f32 = 1e-3;
    /// Upstream scalars of the two losses in every finite-difference check.
    const D_AUX: f64 = 0.7;
    const D_Z: f64 = 0.3;

    fn problem(
        t: usize,
        e: usize,
        k: usize,
        scoring: Scoring,
        renormalize: bool,
        shared_expert: bool,
    ) -> MoeProblem {
        MoeProblem {
            tokens: t,
            hidden: 8,
            intermediate: 6,
            experts: e,
            top_k: k,
            scoring,
            renormalize,
            dtype: DType::F32,
            shared_expert,
        }
    }

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Smallest gap over tokens between the k-th and the (k+1)-th largest logit (scores
    /// are monotone in the logits for both scorings); infinite when k = E.
    fn topk_margin(k: usize, e: usize, logits: &[f64]) -> f64 {
        if k == e {
            return f64::INFINITY;
        }
        logits
            .chunks_exact(e)
            .map(|z| {
                let mut v = z.to_vec();
                v.sort_by(|a, b| b.total_cmp(a));
                v[k - 1] - v[k]
            })
            .fold(f64::INFINITY, f64::min)
    }

    /// The most one ±STEP perturbation can move the difference of two logits of a token:
    /// a router element R[c][e] moves logit e by STEP·|x[t][c]|; an x element x[t][c]
    /// moves logit e by STEP·R[c][e], so a difference by at most 2·STEP·max|R|.
    fn logit_shift(x: &MoeInputs) -> f64 {
        let amax = |v: &[f32]| v.iter().fold(0f64, |m, &a| m.max(a.abs() as f64));
        STEP as f64 * amax(&x.x).max(2.0 * amax(&x.router))
    }

    /// The generated inputs of the first seed from `seed` whose top-k margin exceeds ten
    /// times [`logit_shift`], so no perturbation can change the selected experts.
    fn inputs_with_margin(p: &MoeProblem, seed: u64) -> MoeInputs {
        for s in seed..seed + 64 {
            let x = MoeInputs::generate(p, s);
            let logits = route(p, &x).unwrap().logits;
            if topk_margin(p.top_k, p.experts, &logits) > 10.0 * logit_shift(&x) {
                return x;
            }
        }
        panic!("{p}: no seed in {seed}..+64 with a top-k margin above 10 × the step");
    }

    /// Selected experts per token as sets (the function does not depend on their order).
    fn selected(p: &MoeProblem, r: &Routing) -> Vec<Vec<u32>> {
        r.topk_ids
            .chunks_exact(p.top_k)
            .map(|c| {
                let mut v = c.to_vec();
                v.sort_unstable();
                v
            })
            .collect()
    }

    /// L = <d_out, out> + D_AUX·aux + D_Z·z of the f64 forward, and its selection.
    fn loss(p: &MoeProblem, x: &MoeInputs, d_out: &[f32]) -> (f64, Vec<Vec<u32>>) {
        let o = moe_f64(p, x).unwrap();
        let l = o
            .out
            .iter()
            .zip(d_out)
            .map(|(&a, &g)| a * g as f64)
            .sum::<f64>()
            + D_AUX * o.routing.aux_loss
            + D_Z * o.routing.z_loss;
        (l, selected(p, &o.routing))
    }

    fn tensor(x: &mut MoeInputs, which: usize) -> Option<&mut Vec<f32>> {
        match which {
            0 => Some(&mut x.x),
            1 => Some(&mut x.router),
            2 => Some(&mut x.w13),
            3 => Some(&mut x.w2),
            4 => x.shared_w13.as_mut(),
            _ => x.shared_w2.as_mut(),
        }
    }

    const NAMES: [&str; 6] = ["x", "router", "w13", "w2", "shared_w13", "shared_w2"];

    /// Every element of every input tensor against a central finite difference of the
    /// f64 forward loss; returns the worst |fd − analytic| per tensor.
    fn check_against_finite_differences(p: &MoeProblem, seed: u64) -> [f64; 6] {
        let x = inputs_with_margin(p, seed);
        let base = route(p, &x).unwrap();
        let margin = topk_margin(p.top_k, p.experts, &base.logits);
        assert!(
            margin > 10.0 * logit_shift(&x),
            "{p}: top-k margin {margin:e} vs logit shift {:e}",
            logit_shift(&x)
        );
        let want_sel = selected(p, &base);
        let d_out = values(p.tokens * p.hidden, seed + 17);
        let g = moe_backward_f64(p, &x, &d_out, D_AUX, D_Z).unwrap();
        assert_eq!(g.d_shared_w13.is_some(), p.shared_expert);
        assert_eq!(g.d_shared_w2.is_some(), p.shared_expert);
        let analytic: [Option<&Vec<f64>>; 6] = [
            Some(&g.dx),
            Some(&g.d_router),
            Some(&g.dw13),
            Some(&g.dw2),
            g.d_shared_w13.as_ref(),
            g.d_shared_w2.as_ref(),
        ];
        let mut worst = [0f64; 6];
        for which in 0..6 {
            let n = match tensor(&mut x.clone(), which) {
                Some(v) => v.len(),
                None => continue,
            };
            let an = analytic[which].unwrap();
            assert_eq!(an.len(), n, "{p}: {} length", NAMES[which]);
            for el in 0..n {
                let (mut xp, mut xm) = (x.clone(), x.clone());
                let (tp, tm) = (
                    tensor(&mut xp, which).unwrap(),
                    tensor(&mut xm, which).unwrap(),
                );
                tp[el] += STEP;
                tm[el] -= STEP;
                let step = tp[el] as f64 - tm[el] as f64;
                let (lp, sp) = loss(p, &xp, &d_out);
                let (lm, sm) = loss(p, &xm, &d_out);
                assert!(
                    sp == want_sel && sm == want_sel,
                    "{p}: perturbing {}[{el}] changed the selected experts",
                    NAMES[which]
                );
                let fd = (lp - lm) / step;
                let err = (fd - an[el]).abs();
                worst[which] = worst[which].max(err);
                assert!(
                    err <= 2e-7 + 2e-6 * an[el].abs(),
                    "{p}: d{}[{el}]: analytic {}, finite difference {fd}",
                    NAMES[which],
                    an[el]
                );
            }
        }
        // Experts without tokens get exactly zero weight gradients.
        let (per13, per2) = (p.hidden * 2 * p.intermediate, p.intermediate * p.hidden);
        for (ex, &c) in base.expert_counts.iter().enumerate() {
            if c == 0 {
                assert!(g.dw13[ex * per13..(ex + 1) * per13]
                    .iter()
                    .all(|&v| v == 0.0));
                assert!(g.dw2[ex * per2..(ex + 1) * per2].iter().all(|&v| v == 0.0));
            }
        }
        eprintln!(
            "{p}: margin {margin:.3e}; worst |fd - analytic|: {}",
            NAMES
                .iter()
                .zip(worst)
                .filter(|(_, w)| *w > 0.0)
                .map(|(n, w)| format!("{n} {w:.1e}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        worst
    }

    #[test]
    fn top2_softmax_renormalized_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 4, 2, Scoring::Softmax, true, false), 1);
    }

    #[test]
    fn top2_softmax_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 4, 2, Scoring::Softmax, false, false), 2);
    }

    #[test]
    fn top1_matches_finite_differences() {
        // Renormalised top-1 weights are the constant 1: the router learns only from the
        // losses. Without renormalisation the weight is the softmax probability.
        check_against_finite_differences(&problem(5, 4, 1, Scoring::Softmax, true, false), 3);
        check_against_finite_differences(&problem(5, 4, 1, Scoring::Softmax, false, false), 4);
    }

    #[test]
    fn top_k_equal_to_experts_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 4, 4, Scoring::Softmax, true, false), 5);
        check_against_finite_differences(&problem(5, 4, 4, Scoring::Sigmoid, false, false), 6);
    }

    #[test]
    fn sigmoid_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 4, 2, Scoring::Sigmoid, false, false), 7);
        check_against_finite_differences(&problem(5, 4, 2, Scoring::Sigmoid, true, false), 8);
    }

    #[test]
    fn shared_expert_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 4, 2, Scoring::Softmax, true, true), 9);
        check_against_finite_differences(&problem(5, 4, 1, Scoring::Sigmoid, false, true), 10);
    }

    #[test]
    fn one_expert_matches_finite_differences() {
        check_against_finite_differences(&problem(5, 1, 1, Scoring::Softmax, true, false), 11);
        check_against_finite_differences(&problem(5, 1, 1, Scoring::Sigmoid, false, true), 12);
    }

    /// The router stage alone against finite differences of the forward's own routing
    /// from logits ([`route_from_logits`]): L(z) = <dw, weights(z)> + D_AUX·aux + D_Z·z.
    #[test]
    fn router_stage_matches_finite_differences_of_routing() {
        let cases = [
            (4, 2, Scoring::Softmax, true),
            (4, 2, Scoring::Softmax, false),
            (4, 1, Scoring::Softmax, false),
            (4, 4, Scoring::Softmax, true),
            (4, 2, Scoring::Sigmoid, false),
            (4, 2, Scoring::Sigmoid, true),
            (4, 4, Scoring::Sigmoid, true),
            (1, 1, Scoring::Sigmoid, false),
        ];
        let mut worst = 0f64;
        for (n, &(e, k, scoring, renorm)) in cases.iter().enumerate() {
            let p = problem(6, e, k, scoring, renorm, false);
            let (logits, base) = (0..64u64)
                .map(|s| {
                    let l: Vec<f32> = values(p.tokens * e, 100 * n as u64 + s)
                        .iter()
                        .map(|v| 2.0 * v)
                        .collect();
                    let r = route_from_logits(&p, &l).unwrap();
                    (l, r)
                })
                .find(|(_, r)| topk_margin(k, e, &r.logits) > 10.0 * STEP as f64)
                .expect("a seed with a top-k margin above 10 × the step");
            let dw: Vec<f64> = values(p.tokens * k, 7 + n as u64)
                .iter()
                .map(|&v| v as f64)
                .collect();
            let l_of = |r: &Routing| {
                r.topk_weights
                    .iter()
                    .zip(&dw)
                    .map(|(&a, &b)| a * b)
                    .sum::<f64>()
                    + D_AUX * r.aux_loss
                    + D_Z * r.z_loss
            };
            let want_sel = selected(&p, &base);
            let dz = router_logits_backward(&p, &RouterState::new(&p, base), &dw, D_AUX, D_Z);
            for el in 0..logits.len() {
                let (mut lp, mut lm) = (logits.clone(), logits.clone());
                lp[el] += STEP;
                lm[el] -= STEP;
                let step = lp[el] as f64 - lm[el] as f64;
                let (rp, rm) = (
                    route_from_logits(&p, &lp).unwrap(),
                    route_from_logits(&p, &lm).unwrap(),
                );
                assert!(selected(&p, &rp) == want_sel && selected(&p, &rm) == want_sel);
                let fd = (l_of(&rp) - l_of(&rm)) / step;
                let err = (fd - dz[el]).abs();
                worst = worst.max(err);
                assert!(
                    err <= 2e-7 + 2e-6 * dz[el].abs(),
                    "{p}: d_logits[{el}]: analytic {}, finite difference {fd}",
                    dz[el]
                );
            }
        }
        eprintln!("router stage: worst |fd - analytic| {worst:.1e}");
    }

    /// The forward state reproduces the forward: routing and output of [`moe_f64`].
    #[test]
    fn forward_state_is_the_forward() {
        for p in [
            problem(37, 4, 2, Scoring::Softmax, true, true),
            problem(37, 4, 3, Scoring::Sigmoid, false, false),
        ] {
            let x = MoeInputs::generate(&p, 21);
            let f = moe_f64(&p, &x).unwrap();
            let st = forward_state(&p, &x).unwrap();
            assert_eq!(st.router.routing, f.routing);
            for (a, b) in st.out.iter().zip(&f.out) {
                assert!((a - b).abs() <= 1e-14 * (1.0 + b.abs()), "{p}: {a} vs {b}");
            }
        }
    }

    fn assert_close(got: &[f64], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (n, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12 * (1.0 + w.abs()),
                "{what}[{n}]: {g} vs {w}"
            );
        }
    }

    /// The stages composed in the order of the kernel plan (docs/design/moe.md, Backward:
    /// G = dOut_perm·W2ᵀ, dw = <h, G>, dH = w·G, dW2 = (w ⊙ H)ᵀ·dOut_perm, no y) give the
    /// whole of [`moe_backward_f64`].
    #[test]
    fn stages_compose_to_the_whole() {
        for p in [
            problem(29, 4, 2, Scoring::Softmax, true, true),
            problem(29, 4, 3, Scoring::Sigmoid, false, false),
            problem(29, 4, 2, Scoring::Sigmoid, true, true),
        ] {
            let x = MoeInputs::generate(&p, 5);
            let d_out = values(p.tokens * p.hidden, 6);
            let whole = moe_backward_f64(&p, &x, &d_out, D_AUX, D_Z).unwrap();
            let st = forward_state(&p, &x).unwrap();
            let (t, h, i, e, k) = (p.tokens, p.hidden, p.intermediate, p.experts, p.top_k);
            let (per13, per2) = (h * 2 * i, i * h);
            let weights = &st.router.routing.topk_weights;
            let mut d_weights = vec![0f64; t * k];
            let (mut dx_perm, mut dw13, mut dw2) = (Vec::new(), Vec::new(), Vec::new());
            for ex in 0..e {
                let (a, b) = (st.perm.offsets[ex], st.perm.offsets[ex + 1]);
                let rows = &st.perm.rows[a..b];
                let toks = || rows.iter().map(|&(tok, _)| tok as usize);
                let (xe, dout_e) = (gather_rows(&x.x, toks(), h), gather_rows(&d_out, toks(), h));
                let (w13, w2) = (
                    &x.w13[ex * per13..(ex + 1) * per13],
                    &x.w2[ex * per2..(ex + 1) * per2],
                );
                let h_e = &st.routed.h[a * i..b * i];
                let (g, _) = down_backward(h_e, &dout_e, w2, h, i);
                let mut dh = vec![0f64; g.len()];
                let mut wh = vec![0f64; g.len()];
                for (r, &(tok, s)) in rows.iter().enumerate() {
                    let slot = tok as usize * k + s as usize;
                    let w = weights[slot];
                    let (gr, hr) = (&g[r * i..(r + 1) * i], &h_e[r * i..(r + 1) * i]);
                    d_weights[slot] = gr.iter().zip(hr).map(|(&u, &v)| u * v).sum();
                    for j in 0..i {
                        dh[r * i + j] = w * gr[j];
                        wh[r * i + j] = w * hr[j];
                    }
                }
                let dgu = swiglu_backward(&st.routed.gu[a * 2 * i..b * 2 * i], &dh, i);
                let (_, dw2_e) = down_backward(&wh, &dout_e, w2, h, i);
                let (dx_e, dw13_e) = up_gate_backward(&xe, &dgu, w13, h, i);
                dx_perm.extend(dx_e);
                dw13.extend(dw13_e);
                dw2.extend(dw2_e);
            }
            // combine_backward's dw = <y, dOut> is the same quantity.
            let d_out64: Vec<f64> = d_out.iter().map(|&v| v as f64).collect();
            let (_, dw_combine) =
                combine_backward(&p, &st.router.routing, &st.perm, &st.routed.y, &d_out64);
            assert_close(&dw_combine, &d_weights, "dw = <y, dOut> vs <h, dOut·W2ᵀ>");
            let shared = st.shared.as_ref().map(|a| {
                expert_backward(
                    &gather_rows(&x.x, 0..t, h),
                    &a.gu,
                    &a.h,
                    &d_out64,
                    x.shared_w13.as_ref().unwrap(),
                    x.shared_w2.as_ref().unwrap(),
                    h,
                    i,
                )
            });
            let d_logits = router_logits_backward(&p, &st.router, &d_weights, D_AUX, D_Z);
            let (dx_router, d_router) = router_gemm_backward(&p, &x.x, &x.router, &d_logits);
            let dx = unpermute_backward(
                &p,
                &st.perm,
                &dx_perm,
                shared.as_ref().map(|s| s.dx.as_slice()),
                &dx_router,
            );
            assert_close(&d_weights, &whole.d_weights, "d_weights");
            assert_close(&d_logits, &whole.d_logits, "d_logits");
            assert_close(&dx, &whole.dx, "dx");
            assert_close(&d_router, &whole.d_router, "d_router");
            assert_close(&dw13, &whole.dw13, "dw13");
            assert_close(&dw2, &whole.dw2, "dw2");
            if let Some(s) = shared {
                assert_close(
                    &s.dw13,
                    whole.d_shared_w13.as_ref().unwrap(),
                    "d_shared_w13",
                );
                assert_close(&s.dw2, whole.d_shared_w2.as_ref().unwrap(), "d_shared_w2");
            }
        }
    }

    #[test]
    fn results_do_not_depend_on_the_thread_count() {
        let p = problem(40, 4, 2, Scoring::Softmax, true, true);
        let x = MoeInputs::generate(&p, 3);
        let d_out = values(p.tokens * p.hidden, 4);
        let many = moe_backward_f64(&p, &x, &d_out, D_AUX, D_Z).unwrap();
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap()
            .install(|| moe_backward_f64(&p, &x, &d_out, D_AUX, D_Z).unwrap());
        assert_eq!(many, one);
    }

    #[test]
    fn bad_inputs_are_errors() {
        let p = problem(5, 4, 2, Scoring::Softmax, true, true);
        let x = MoeInputs::generate(&p, 1);
        let d_out = values(p.tokens * p.hidden, 2);
        assert!(moe_backward_f64(&p, &x, &d_out[1..], 0.0, 0.0).is_err());
        let mut no_shared = x.clone();
        no_shared.shared_w2 = None;
        assert!(moe_backward_f64(&p, &no_shared, &d_out, 0.0, 0.0).is_err());
        let mut short = x.clone();
        short.w2.pop();
        assert!(moe_backward_f64(&p, &short, &d_out, 0.0, 0.0).is_err());
        let bad = MoeProblem { top_k: 5, ..p };
        assert!(moe_backward_f64(&bad, &x, &d_out, 0.0, 0.0).is_err());
    }
}
