//! The MoE layer the way the GPU does it, on the CPU in f32: dropless permutation of
//! tokens by expert, one GEMM pair per expert with SwiGLU fused, deterministic weighted
//! combine in token order. Routing comes from [`route`], so it is identical to
//! the reference's.
//!
//! [`route`]: crate::reference::moe::route

use super::moe::{route, MoeInputs, Routing};
use crate::error::Result;
use crate::problem::MoeProblem;
use rayon::prelude::*;

/// Tokens grouped by expert: `rows[offsets[e]..offsets[e+1]]` are the (token, slot) pairs
/// routed to expert `e`, in token order. No token is dropped; empty experts have empty
/// ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct Permutation {
    pub offsets: Vec<usize>,
    /// For each permuted row: the token and which of its top-k slots it is.
    pub rows: Vec<(u32, u32)>,
    /// For each (token, slot) in token-major order: its permuted row.
    pub row_of_slot: Vec<usize>,
}

pub fn permute(p: &MoeProblem, routing: &Routing) -> Permutation {
    let mut offsets = vec![0usize; p.experts + 1];
    for &e in &routing.topk_ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..p.experts {
        offsets[e + 1] += offsets[e];
    }
    let mut cursor = offsets.clone();
    let mut rows = vec![(0u32, 0u32); routing.topk_ids.len()];
    let mut row_of_slot = vec![0usize; routing.topk_ids.len()];
    for (i, &e) in routing.topk_ids.iter().enumerate() {
        let r = cursor[e as usize];
        cursor[e as usize] += 1;
        rows[r] = ((i / p.top_k) as u32, (i % p.top_k) as u32);
        row_of_slot[i] = r;
    }
    Permutation {
        offsets,
        rows,
        row_of_slot,
    }
}

/// c[m×n] = a[m×k] · b[k×n], row-major, f32 accumulation (i-k-j order vectorises).
fn matmul(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        let row = &mut c[i * n..(i + 1) * n];
        for (kk, &aik) in a[i * k..(i + 1) * k].iter().enumerate() {
            let brow = &b[kk * n..(kk + 1) * n];
            for (cv, &bv) in row.iter_mut().zip(brow) {
                *cv += aik * bv;
            }
        }
    }
    c
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// One SwiGLU expert on `m` gathered rows: silu(x·Wg) ⊙ (x·Wu) · W2.
pub(crate) fn expert_mlp(
    x: &[f32],
    w13: &[f32],
    w2: &[f32],
    m: usize,
    h: usize,
    i: usize,
) -> Vec<f32> {
    let gu = matmul(x, w13, m, h, 2 * i);
    let mut act = vec![0f32; m * i];
    for r in 0..m {
        for c in 0..i {
            act[r * i + c] = silu(gu[r * 2 * i + c]) * gu[r * 2 * i + i + c];
        }
    }
    matmul(&act, w2, m, i, h)
}

/// Output (tokens × hidden, f32) and the routing used.
pub fn moe_grouped(p: &MoeProblem, x: &MoeInputs) -> Result<(Vec<f32>, Routing)> {
    let routing = route(p, x)?; // validates the problem and input sizes
    let (h, i) = (p.hidden, p.intermediate);
    let perm = permute(p, &routing);
    // Per expert: gather its rows, run the MLP. Experts with no rows read no weights.
    let per_expert: Vec<Vec<f32>> = (0..p.experts)
        .into_par_iter()
        .map(|e| {
            let rows = &perm.rows[perm.offsets[e]..perm.offsets[e + 1]];
            if rows.is_empty() {
                return Vec::new();
            }
            let mut gathered = Vec::with_capacity(rows.len() * h);
            for &(t, _) in rows {
                gathered.extend_from_slice(&x.x[t as usize * h..(t as usize + 1) * h]);
            }
            let w13 = &x.w13[e * h * 2 * i..(e + 1) * h * 2 * i];
            let w2 = &x.w2[e * i * h..(e + 1) * i * h];
            expert_mlp(&gathered, w13, w2, rows.len(), h, i)
        })
        .collect();
    let shared = match (&x.shared_w13, &x.shared_w2) {
        (Some(a), Some(b)) if p.shared_expert => Some(expert_mlp(&x.x, a, b, p.tokens, h, i)),
        _ => None,
    };
    // Deterministic combine: each token sums its k slots in slot order.
    let mut out = vec![0f32; p.tokens * h];
    out.par_chunks_mut(h).enumerate().for_each(|(t, dst)| {
        for s in 0..p.top_k {
            let slot = t * p.top_k + s;
            let e = routing.topk_ids[slot] as usize;
            let local = perm.row_of_slot[slot] - perm.offsets[e];
            let w = routing.topk_weights[slot] as f32;
            let y = &per_expert[e][local * h..(local + 1) * h];
            for (d, &v) in dst.iter_mut().zip(y) {
                *d += w * v;
            }
        }
        if let Some(sh) = &shared {
            for (d, &v) in dst.iter_mut().zip(&sh[t * h..(t + 1) * h]) {
                *d += v;
            }
        }
    });
    Ok((out, routing))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accuracy;
    use crate::reference::moe::moe_f64;
    use crate::{DType, Scoring};

    fn problem(tokens: usize, experts: usize, top_k: usize, shared: bool) -> MoeProblem {
        MoeProblem {
            tokens,
            hidden: 48,
            intermediate: 40,
            experts,
            top_k,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: shared,
        }
    }

    #[test]
    fn matches_the_f64_reference_with_identical_routing() {
        for (t, e, k, shared) in [
            (1, 4, 1, false),
            (37, 8, 2, true),
            (64, 16, 8, false),
            (5, 32, 2, false),
        ] {
            let p = problem(t, e, k, shared);
            let x = MoeInputs::generate(&p, 11);
            let (out, routing) = moe_grouped(&p, &x).unwrap();
            let r = moe_f64(&p, &x).unwrap();
            assert_eq!(routing.topk_ids, r.routing.topk_ids);
            let c = accuracy::check(&out, &r.out, DType::F32);
            assert!(c.passed, "t={t} e={e} k={k}: {:?}", c);
        }
    }

    #[test]
    fn permutation_is_dropless_and_grouped() {
        let p = problem(50, 32, 2, false);
        let x = MoeInputs::generate(&p, 3);
        let routing = route(&p, &x).unwrap();
        let perm = permute(&p, &routing);
        assert_eq!(perm.rows.len(), 100);
        assert_eq!(*perm.offsets.last().unwrap(), 100);
        // 50 tokens × 2 over 32 experts: some expert is empty, and its range is too.
        let empty = (0..32)
            .filter(|&e| perm.offsets[e] == perm.offsets[e + 1])
            .count();
        assert_eq!(
            empty,
            routing.expert_counts.iter().filter(|&&c| c == 0).count()
        );
        for e in 0..32 {
            for &(t, s) in &perm.rows[perm.offsets[e]..perm.offsets[e + 1]] {
                assert_eq!(routing.topk_ids[t as usize * 2 + s as usize] as usize, e);
            }
        }
        // Every (token, slot) appears exactly once.
        let mut seen = perm.row_of_slot.clone();
        seen.sort();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
    }
}
