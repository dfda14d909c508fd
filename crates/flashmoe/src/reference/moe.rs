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
//! 5. each selected expert `e`: h = silu(x_t·W13\[e\]\[:, :I\]) ⊙ (x_t·W13\[e\]\[:, I:\]),
//!    y = h·W2\[e\]; out_t = Σ_k weight_k·y_k (in top-k order), plus the shared expert's
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
//! inputs is computed in f64. Routing is parallel over tokens, the experts over (expert,
//! block of tokens), and every sum is taken in a fixed order, so results do not depend on
//! the thread count.

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
    /// (tokens, experts) router logits the ranking was made from, for
    /// [`compare_routing`]'s near-tie rule.
    pub logits: Vec<f64>,
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
    logits: Vec<f64>,
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
    route_logits(p, logits)
}

/// Steps 2–4 of the module docs for one token, from its logits.
fn route_logits(p: &MoeProblem, logits: Vec<f64>) -> TokenRoute {
    let e = p.experts;
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
        logits,
    }
}

/// Route every token (see the module docs), parallel over tokens.
pub fn route(p: &MoeProblem, x: &MoeInputs) -> Result<Routing> {
    validate_router(p, x)?;
    let per_token: Vec<TokenRoute> =
        x.x.par_chunks(p.hidden)
            .map(|xt| route_token(p, xt, &x.router))
            .collect();
    Ok(aggregate(p, &per_token))
}

/// Route every token from logits computed elsewhere ([T, E], e.g. by the GPU fp32
/// reference): scoring, top-k, weights and losses exactly as [`route`] does from its
/// own f64 logits.
pub fn route_from_logits(p: &MoeProblem, logits: &[f32]) -> Result<Routing> {
    p.validate()?;
    check_len(
        "logits",
        checked_product("logits", &[p.tokens, p.experts])?,
        logits.len(),
    )?;
    let per_token: Vec<TokenRoute> = logits
        .par_chunks(p.experts)
        .map(|l| route_logits(p, l.iter().map(|&v| v as f64).collect()))
        .collect();
    Ok(aggregate(p, &per_token))
}

/// Routing of the batch from its per-token results (fixed order: token ascending).
fn aggregate(p: &MoeProblem, per_token: &[TokenRoute]) -> Routing {
    let (t, e, k) = (p.tokens, p.experts, p.top_k);
    let mut topk_ids = Vec::with_capacity(t * k);
    let mut topk_weights = Vec::with_capacity(t * k);
    let mut expert_counts = vec![0usize; e];
    let mut prob_sum = vec![0f64; e];
    let mut z_sum = 0.0;
    let mut logits = Vec::with_capacity(t * e);
    for r in per_token {
        logits.extend_from_slice(&r.logits);
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
    Routing {
        topk_ids,
        topk_weights,
        expert_counts,
        aux_loss,
        z_loss: z_sum / t as f64,
        logits,
    }
}

/// Near-tie tolerance of [`compare_routing`], relative to the token's largest |logit|.
/// Any fp32 evaluation of a logit (fmaf chain, tensor-core tree) differs from the f64
/// one by ~1e-6 relative on the H ≤ 8192 of the presets, and the bf16 rounding of x
/// alone moves logits by ~1e-3: two experts closer than this are equally right.
pub const ROUTING_TIE_REL: f64 = 1e-4;

/// How an implementation's top-k ids compare with the reference's, slot by slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoutingComparison {
    /// Slots compared (tokens · top_k of the reference).
    pub slots: usize,
    /// Slots with a different expert whose reference logit is within [`ROUTING_TIE_REL`]
    /// (of the token's largest |logit|) of the reference's choice for that slot.
    pub near_ties: usize,
    /// Slots with a different expert beyond that, an invalid id, or missing.
    pub mismatched: usize,
}

/// Compare `ids` ((tokens, top_k), descending score) with the reference's routing: a
/// slot whose expert differs counts as a near tie when the reference logits of the two
/// experts differ by at most `ROUTING_TIE_REL · max_e |logit[t, e]|` (then both
/// rankings are right within floating-point rounding), else as a mismatch.
pub fn compare_routing(ids: &[u32], reference: &Routing, experts: usize) -> RoutingComparison {
    let want = &reference.topk_ids;
    let mut c = RoutingComparison {
        slots: want.len(),
        mismatched: ids.len().abs_diff(want.len()),
        near_ties: 0,
    };
    let tokens = reference.logits.len() / experts.max(1);
    let top_k = want.len().checked_div(tokens).unwrap_or(0);
    for (slot, (&got, &exp)) in ids.iter().zip(want).enumerate() {
        if got == exp {
            continue;
        }
        let t = slot / top_k.max(1);
        let row = reference.logits.get(t * experts..(t + 1) * experts);
        let tie = match row {
            Some(l) if (got as usize) < experts && (exp as usize) < experts => {
                let scale = l.iter().fold(0f64, |m, v| m.max(v.abs()));
                (l[got as usize] - l[exp as usize]).abs() <= ROUTING_TIE_REL * scale
            }
            _ => false,
        };
        if tie {
            c.near_ties += 1;
        } else {
            c.mismatched += 1;
        }
    }
    c
}

/// Assignments per weight-streaming block: every weight row read is used for this many
/// tokens before moving on (a CPU stand-in for the grouped GEMM's token tile).
const TOKEN_BLOCK: usize = 16;

/// SwiGLU expert on a block of tokens: for each token `t` of `tokens`,
/// y_t = (silu(x_t·W_gate) ⊙ (x_t·W_up))·W2, written to consecutive rows of `y`.
/// `w13`: (hidden, 2I); `w2`: (I, hidden); `gu`: scratch. Each element is summed in the
/// same order (hidden index, then intermediate index ascending) whatever the block.
fn expert_block(
    x: &[f32],
    tokens: &[usize],
    w13: &[f32],
    w2: &[f32],
    inter: usize,
    gu: &mut Vec<f64>,
    y: &mut [f64],
) {
    let hidden = w13.len() / (2 * inter);
    gu.clear();
    gu.resize(tokens.len() * 2 * inter, 0.0);
    for (hh, row) in w13.chunks_exact(2 * inter).enumerate() {
        for (&t, g) in tokens.iter().zip(gu.chunks_exact_mut(2 * inter)) {
            let xh = x[t * hidden + hh] as f64;
            for (gj, &w) in g.iter_mut().zip(row) {
                *gj += xh * w as f64;
            }
        }
    }
    for g in gu.chunks_exact_mut(2 * inter) {
        let (gate, up) = g.split_at_mut(inter);
        for (gj, &uj) in gate.iter_mut().zip(up.iter()) {
            *gj = silu(*gj) * uj;
        }
    }
    y.fill(0.0);
    for (j, row) in w2.chunks_exact(hidden).enumerate() {
        for (g, yt) in gu.chunks_exact(2 * inter).zip(y.chunks_exact_mut(hidden)) {
            let hj = g[j];
            for (o, &w) in yt.iter_mut().zip(row) {
                *o += hj * w as f64;
            }
        }
    }
}

/// The MoE layer forward in f64 (see the module docs).
///
/// Like the GPU path, tokens are permuted by expert: every (expert, block of
/// 16 assigned tokens) is one parallel work item that streams the expert's
/// weights once; the combine then sums, per token and in top-k order, weight·y, plus the
/// shared expert's y. The result does not depend on the thread count or on the blocking.
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
                "shared_expert is set but the shared expert weights \
                 (shared_w13, shared_w2) are missing",
            ));
        };
        check_len("shared_w13", n.shared_w13, sw13.len())?;
        check_len("shared_w2", n.shared_w2, sw2.len())?;
        Some((sw13.as_slice(), sw2.as_slice()))
    } else {
        None
    };
    let routing = route(p, x)?;

    let (tokens, h, i, k, e) = (p.tokens, p.hidden, p.intermediate, p.top_k, p.experts);
    // Permutation: the tokens of each expert (the shared expert, index `e`, takes all),
    // and the row of y holding each (token, slot) assignment.
    let groups = e + usize::from(shared.is_some());
    let mut lists: Vec<Vec<usize>> = (0..groups)
        .map(|g| {
            Vec::with_capacity(if g < e {
                routing.expert_counts[g]
            } else {
                tokens
            })
        })
        .collect();
    for (a, &id) in routing.topk_ids.iter().enumerate() {
        lists[id as usize].push(a / k);
    }
    if shared.is_some() {
        lists[e].extend(0..tokens);
    }
    let mut first_row = Vec::with_capacity(groups);
    let mut rows = 0;
    for l in &lists {
        first_row.push(rows);
        rows += l.len();
    }
    let mut next = first_row.clone();
    let row_of: Vec<usize> = routing
        .topk_ids
        .iter()
        .map(|&id| {
            let r = next[id as usize];
            next[id as usize] += 1;
            r
        })
        .collect();

    // Expert outputs, one row of `hidden` per assignment, grouped by expert.
    let mut y = vec![0f64; rows * h];
    let mut items = Vec::new();
    let mut rest: &mut [f64] = &mut y;
    for (g, l) in lists.iter().enumerate() {
        let (mine, tail) = std::mem::take(&mut rest).split_at_mut(l.len() * h);
        rest = tail;
        for (ys, ts) in mine.chunks_mut(TOKEN_BLOCK * h).zip(l.chunks(TOKEN_BLOCK)) {
            items.push((g, ts, ys));
        }
    }
    let (per_w13, per_w2) = (h * 2 * i, i * h);
    items
        .into_par_iter()
        .for_each_init(Vec::new, |gu, (g, ts, ys)| {
            let (w13, w2) = match shared {
                Some(sw) if g == e => sw,
                _ => (
                    &x.w13[g * per_w13..(g + 1) * per_w13],
                    &x.w2[g * per_w2..(g + 1) * per_w2],
                ),
            };
            expert_block(&x.x, ts, w13, w2, i, gu, ys);
        });

    // Combine, per token in top-k order, then the shared expert with weight 1.
    let mut out = vec![0f64; tokens * h];
    out.par_chunks_mut(h).enumerate().for_each(|(t, ot)| {
        for slot in 0..k {
            let a = t * k + slot;
            let w = routing.topk_weights[a];
            let yr = &y[row_of[a] * h..(row_of[a] + 1) * h];
            for (o, &v) in ot.iter_mut().zip(yr) {
                *o += w * v;
            }
        }
        if shared.is_some() {
            let r = first_row[e] + t;
            for (o, &v) in ot.iter_mut().zip(&y[r * h..(r + 1) * h]) {
                *o += v;
            }
        }
    });
    Ok(MoeOutput { out, routing })
}
