//! The attention backward on the CPU in f32, FlashAttention-2's algorithm: the lab's CPU
//! implementation under test for the gradient family (checked against the f64 reference
//! `flashmoe::reference::attention_backward`, which materialises every softmax row in f64).
//!
//! As a GPU backward does it, it takes what a forward left behind rather than the exact
//! values: the forward is the lab's tiled f32 FlashAttention
//! (`flashmoe::reference::attention_tiled`), its o rounded to the dtype (a GPU forward
//! stores o in the dtype) and its f32 LSE; then
//!
//! - Δ_i = Σ_c dO_ic · o_ic (the preprocess, from the rounded o);
//! - per (batch, KV head), key blocks of [`BLOCK_N`] keys stationary, the query rows of
//!   every head of the group streamed: P_ij = exp(z_ij − lse_i) recomputed from the LSE
//!   (z = scale·q·k, or c·tanh(scale·q·k / c) with a softcap), dP_ij = dO_i·v_j,
//!   dS_ij = P_ij (dP_ij − Δ_i) · (1 − tanh²) (1 without a softcap),
//!   dV_j += P_ij dO_i, dK_j += scale·dS_ij q_i, dQ_i += scale·dS_ij k_j — all in f32, the
//!   GQA reduction of dK, dV over the group's query heads in the work item (deterministic);
//! - dq, dk, dv rounded to the dtype (a GPU backward stores them in the dtype).
//!
//! A row that sees no key (LSE −inf) contributes nothing and gets dq = 0.

use flashmoe::reference::attention::AttentionInputs;
use flashmoe::reference::attention_tiled::{attention_tiled, DEFAULT_BLOCK_M, DEFAULT_BLOCK_N};
use flashmoe::{AttentionProblem, DType};
use rayon::prelude::*;

use crate::varlen::VarlenProblem;

/// Keys per stationary block.
pub const BLOCK_N: usize = 64;

/// dq, dk, dv in the inputs' layouts.
pub type Grads<T> = [Vec<T>; 3];

/// The f32 backward of `Σ d_o ∘ attention(q, k, v)` (module docs), gradients rounded to
/// `p.dtype`.
pub fn attention_backward_f32(
    p: &AttentionProblem,
    x: &AttentionInputs,
    d_o: &[f32],
) -> flashmoe::Result<Grads<f32>> {
    if d_o.len() != x.q.len() {
        return Err(flashmoe::Error::invalid(format!(
            "d_o holds {} elements, q holds {}",
            d_o.len(),
            x.q.len()
        )));
    }
    let f = forward_f32(p, x)?;
    backward_from_forward(p, x, d_o, &f.o, &f.lse)
}

/// The backward given the forward's o (as stored) and natural-log LSE
/// `(batch, heads_q, seqlen_q)`.
pub fn backward_from_forward(
    p: &AttentionProblem,
    x: &AttentionInputs,
    d_o: &[f32],
    o: &[f32],
    lse: &[f32],
) -> flashmoe::Result<Grads<f32>> {
    let (b, hq, hkv) = (p.batch, p.heads_q, p.heads_kv);
    let (sq, sk, d) = (p.seqlen_q, p.seqlen_k, p.head_dim);
    if o.len() != x.q.len() || lse.len() != p.lse_elems() {
        return Err(flashmoe::Error::invalid(format!(
            "the forward's o / lse hold {} / {} elements, expected {} / {}",
            o.len(),
            lse.len(),
            x.q.len(),
            p.lse_elems()
        )));
    }
    let group = p.group_size();
    let scale = p.scale();
    let softcap = p.softcap;
    let qi = |bi: usize, i: usize, h: usize| ((bi * sq + i) * hq + h) * d;
    let ki = |bi: usize, j: usize, h: usize| ((bi * sk + j) * hkv + h) * d;

    // The preprocess: Δ (batch, heads_q, seqlen_q).
    let mut delta = vec![0f32; b * hq * sq];
    delta.par_iter_mut().enumerate().for_each(|(r, dl)| {
        let (bi, h, i) = (r / (hq * sq), (r / sq) % hq, r % sq);
        let at = qi(bi, i, h);
        *dl = d_o[at..at + d]
            .iter()
            .zip(&o[at..at + d])
            .map(|(&a, &c)| a * c)
            .sum();
    });

    let parts: Vec<Grads<f32>> = (0..b * hkv)
        .into_par_iter()
        .map(|bk| {
            let (bi, kvh) = (bk / hkv, bk % hkv);
            let mut dk = vec![0f32; sk * d];
            let mut dv = vec![0f32; sk * d];
            let mut dq = vec![0f32; group * sq * d];
            let mut p_row = vec![0f32; BLOCK_N];
            let mut ds_row = vec![0f32; BLOCK_N];
            for j0 in (0..sk).step_by(BLOCK_N) {
                let j1 = (j0 + BLOCK_N).min(sk);
                for g in 0..group {
                    let h = kvh * group + g;
                    for i in 0..sq {
                        let keys = p.visible_range(i);
                        let (lo, hi) = (keys.start.max(j0), keys.end.min(j1));
                        let l = lse[(bi * hq + h) * sq + i];
                        if lo >= hi || l == f32::NEG_INFINITY {
                            continue;
                        }
                        let q = &x.q[qi(bi, i, h)..qi(bi, i, h) + d];
                        let go = &d_o[qi(bi, i, h)..qi(bi, i, h) + d];
                        let dl = delta[(bi * hq + h) * sq + i];
                        for j in lo..hi {
                            let kr = &x.k[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                            let vr = &x.v[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                            let s = scale * dot(q, kr);
                            let (z, dtanh) = if softcap > 0.0 {
                                let t = (s / softcap).tanh();
                                (softcap * t, 1.0 - t * t)
                            } else {
                                (s, 1.0)
                            };
                            let pij = (z - l).exp();
                            let dp = dot(go, vr);
                            p_row[j - lo] = pij;
                            ds_row[j - lo] = pij * (dp - dl) * dtanh;
                        }
                        let dq_row = &mut dq[(g * sq + i) * d..(g * sq + i + 1) * d];
                        for j in lo..hi {
                            let (pij, ds) = (p_row[j - lo], scale * ds_row[j - lo]);
                            let kr = &x.k[ki(bi, j, kvh)..ki(bi, j, kvh) + d];
                            axpy(dq_row, ds, kr);
                            axpy(&mut dk[j * d..(j + 1) * d], ds, q);
                            axpy(&mut dv[j * d..(j + 1) * d], pij, go);
                        }
                    }
                }
            }
            [dq, dk, dv]
        })
        .collect();

    let round = |v: f32| p.dtype.round(v);
    let mut out = [
        vec![0f32; x.q.len()],
        vec![0f32; x.k.len()],
        vec![0f32; x.v.len()],
    ];
    for (bk, [dq, dk, dv]) in parts.into_iter().enumerate() {
        let (bi, kvh) = (bk / hkv, bk % hkv);
        for j in 0..sk {
            let at = ki(bi, j, kvh);
            for c in 0..d {
                out[1][at + c] = round(dk[j * d + c]);
                out[2][at + c] = round(dv[j * d + c]);
            }
        }
        for g in 0..group {
            let h = kvh * group + g;
            for i in 0..sq {
                let at = qi(bi, i, h);
                for c in 0..d {
                    out[0][at + c] = round(dq[(g * sq + i) * d + c]);
                }
            }
        }
    }
    Ok(out)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

fn axpy(acc: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in acc.iter_mut().zip(x) {
        *o += a * v;
    }
}

/// A varlen backward sequence by sequence: each sequence's slices of the packed q, k, v
/// and d_o through `backward(index, problem, inputs, d_o)` (the dense backward of
/// [`VarlenProblem::sequence`]), its
/// gradients scattered back into the packed layout. Empty sequences contribute zeros.
pub fn varlen_per_sequence<T: Copy + Default>(
    p: &VarlenProblem,
    x: &AttentionInputs,
    d_o: &[f32],
    mut backward: impl FnMut(
        usize,
        &AttentionProblem,
        &AttentionInputs,
        &[f32],
    ) -> flashmoe::Result<Grads<T>>,
) -> flashmoe::Result<Grads<T>> {
    let (hq, hkv, d) = (p.heads_q, p.heads_kv, p.head_dim);
    let (tq, tk) = (p.total_q(), p.total_k());
    for (name, want, got) in [
        ("q", tq * hq * d, x.q.len()),
        ("k", tk * hkv * d, x.k.len()),
        ("v", tk * hkv * d, x.v.len()),
        ("d_o", tq * hq * d, d_o.len()),
    ] {
        if want != got {
            return Err(flashmoe::Error::invalid(format!(
                "varlen {name} holds {got} elements but the packed shape needs {want}"
            )));
        }
    }
    let (cu_q, cu_k) = (p.cu_seqlens_q(), p.cu_seqlens_k());
    let (rq, rk) = (hq * d, hkv * d);
    let mut out = [
        vec![T::default(); tq * rq],
        vec![T::default(); tk * rk],
        vec![T::default(); tk * rk],
    ];
    for (s, &(sq, sk)) in p.seqlens.iter().enumerate() {
        if sq == 0 || sk == 0 {
            continue;
        }
        let (q0, k0) = (cu_q[s], cu_k[s]);
        let inputs = AttentionInputs {
            q: x.q[q0 * rq..(q0 + sq) * rq].to_vec(),
            k: x.k[k0 * rk..(k0 + sk) * rk].to_vec(),
            v: x.v[k0 * rk..(k0 + sk) * rk].to_vec(),
        };
        let g = backward(s, &p.sequence(s), &inputs, &d_o[q0 * rq..(q0 + sq) * rq])?;
        for (dst, src, at, n) in [
            (0, &g[0], q0 * rq, sq * rq),
            (1, &g[1], k0 * rk, sk * rk),
            (2, &g[2], k0 * rk, sk * rk),
        ] {
            if src.len() != n {
                return Err(flashmoe::Error::invalid(format!(
                    "sequence {s}: the per-sequence backward returned {} values, expected {n}",
                    src.len()
                )));
            }
            out[dst][at..at + n].copy_from_slice(src);
        }
    }
    Ok(out)
}

/// The varlen f32 backward: [`attention_backward_f32`] per sequence.
pub fn varlen_backward_f32(
    p: &VarlenProblem,
    x: &AttentionInputs,
    d_o: &[f32],
) -> flashmoe::Result<Grads<f32>> {
    varlen_per_sequence(p, x, d_o, |_, s, xs, d| attention_backward_f32(s, xs, d))
}

/// What a forward leaves for the backward: o rounded to the dtype and the f32 LSE, in the
/// layout of the problem (dense: lse (batch, heads_q, seqlen_q); varlen: o packed,
/// lse (heads_q, total_q)).
pub struct SavedForward {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
}

/// The tiled f32 forward of a dense problem, o rounded to the dtype.
pub fn forward_f32(p: &AttentionProblem, x: &AttentionInputs) -> flashmoe::Result<SavedForward> {
    let f = attention_tiled(p, x, DEFAULT_BLOCK_M, DEFAULT_BLOCK_N)?;
    Ok(SavedForward {
        o: f.o.iter().map(|&v| p.dtype.round(v)).collect(),
        lse: f.lse,
    })
}

/// The tiled f32 forward of a varlen problem, sequence by sequence (packed layouts).
pub fn varlen_forward_f32(
    p: &VarlenProblem,
    x: &AttentionInputs,
) -> flashmoe::Result<SavedForward> {
    let f = crate::varlen::per_sequence(p, x, |s, xs| {
        attention_tiled(s, xs, DEFAULT_BLOCK_M, DEFAULT_BLOCK_N)
    })?;
    Ok(SavedForward {
        o: f.o.iter().map(|&v| p.dtype.round(v)).collect(),
        lse: f.lse,
    })
}

/// The varlen backward over a saved varlen forward ([`varlen_forward_f32`]).
pub fn varlen_backward_from_forward(
    p: &VarlenProblem,
    x: &AttentionInputs,
    d_o: &[f32],
    saved: &SavedForward,
) -> flashmoe::Result<Grads<f32>> {
    let (hq, d, tq) = (p.heads_q, p.head_dim, p.total_q());
    if saved.o.len() != tq * hq * d || saved.lse.len() != hq * tq {
        return Err(flashmoe::Error::invalid(
            "the saved varlen forward does not match the problem",
        ));
    }
    let cu_q = p.cu_seqlens_q();
    varlen_per_sequence(p, x, d_o, |s, seq, xs, dd| {
        let (q0, sq) = (cu_q[s], seq.seqlen_q);
        let o = &saved.o[q0 * hq * d..(q0 + sq) * hq * d];
        // (heads_q, total_q) → the sequence's (1, heads_q, sq).
        let lse: Vec<f32> = (0..hq)
            .flat_map(|h| saved.lse[h * tq + q0..h * tq + q0 + sq].iter().copied())
            .collect();
        backward_from_forward(seq, xs, dd, o, &lse)
    })
}

/// Gradients rounded to a dtype, kept f32 (what a kernel stores).
pub fn rounded(dtype: DType, v: &[f64]) -> Vec<f32> {
    v.iter().map(|&x| dtype.round(x as f32)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::accuracy::check_gradient;
    use flashmoe::reference::attention_backward::attention_backward_f64;
    use flashmoe::{inputs, problem::NO_WINDOW};

    fn case(p: &AttentionProblem, seed: u64) {
        let x = AttentionInputs::generate(p, seed);
        let d_o = inputs::generate(seed, inputs::TensorId::DOut, x.q.len(), 1.0, p.dtype);
        let got = attention_backward_f32(p, &x, &d_o).unwrap();
        let want = attention_backward_f64(p, &x, &d_o).unwrap();
        for (name, g, w) in [
            ("dq", &got[0], &want.dq),
            ("dk", &got[1], &want.dk),
            ("dv", &got[2], &want.dv),
        ] {
            let c = check_gradient(g, w, p.dtype, p.head_dim);
            assert!(
                c.passed,
                "{p} window {:?} softcap {}: {name}: {:?}",
                p.window, p.softcap, c.reason
            );
        }
    }

    /// Every feature of the forward on small shapes, with key blocks crossing the masks.
    #[test]
    fn f32_backward_matches_the_f64_reference() {
        let mk = |hq, hkv, sq, sk, d, causal, dtype| {
            let mut p = AttentionProblem::new(2, hq, sq, d, causal, dtype);
            p.heads_kv = hkv;
            p.seqlen_k = sk;
            p
        };
        case(&mk(2, 2, 70, 70, 32, false, DType::Bf16), 1);
        case(&mk(4, 1, 37, 100, 64, true, DType::F16), 2);
        case(&mk(4, 2, 100, 37, 32, true, DType::Bf16), 3);
        let mut w = mk(2, 1, 90, 90, 32, false, DType::Bf16);
        w.window = (20, 5);
        case(&w, 4);
        let mut c = mk(2, 2, 40, 70, 32, true, DType::F16);
        c.softcap = 5.0;
        case(&c, 5);
        assert_eq!(c.window, NO_WINDOW);
    }

    #[test]
    fn varlen_scatters_sequences_and_skips_empty_ones() {
        let mut p = VarlenProblem::new(&[], 4, 2, 32, true, DType::Bf16);
        p.seqlens = vec![(5, 5), (0, 3), (9, 20), (3, 0), (17, 17)];
        let x = AttentionInputs::generate(&p.packed(), 9);
        let d_o = inputs::generate(9, inputs::TensorId::DOut, x.q.len(), 1.0, p.dtype);
        let got = varlen_backward_f32(&p, &x, &d_o).unwrap();
        let want = varlen_per_sequence(&p, &x, &d_o, |_, s, xs, d| {
            let g = attention_backward_f64(s, xs, d)?;
            Ok([g.dq, g.dk, g.dv])
        })
        .unwrap();
        for (g, w) in got.iter().zip(&want) {
            let c = check_gradient(g, w, p.dtype, p.head_dim);
            assert!(c.passed, "{:?}", c.reason);
        }
        // Keys of the sequence without queries (sequence 1: keys 5..8) get zero dk, dv.
        let rk = p.heads_kv * p.head_dim;
        assert!(got[1][5 * rk..8 * rk].iter().all(|&v| v == 0.0));
        assert!(varlen_backward_f32(&p, &x, &d_o[1..]).is_err());
        // Over a saved forward: the same bits as the chained call.
        let saved = varlen_forward_f32(&p, &x).unwrap();
        let again = varlen_backward_from_forward(&p, &x, &d_o, &saved).unwrap();
        assert_eq!(again, got);
    }
}
