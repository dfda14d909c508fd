//! Sampled f64 attention gradients: exact f64 values of chosen rows of dq, dk and dv of
//! batch 0 and KV head 0 (with its group of query heads), for problems whose full f64
//! backward — even of one KV head — would take minutes (a 16k-token sequence).
//!
//! The f64 forward of that head group (`flashmoe::reference::attention_f64`, parallel over
//! rows) gives o and the LSE; with Δ_i = Σ_c dO_ic · o_ic (= Σ_j P_ij dP_ij), one row of each
//! gradient costs one pass over a sequence:
//!
//! - dq_i = scale Σ_j dS_ij k_j over the keys row i sees;
//! - dk_j = scale Σ_{h, i} dS_ij q_i and dv_j = Σ_{h, i} P_ij dO_i over the group's query
//!   heads h and the rows i that see key j;
//!
//! with P_ij = exp(z_ij − lse_i), z = scale·q·k (softcap c: c·tanh(scale·q·k / c)),
//! dP_ij = dO_i·v_j, dS_ij = P_ij (dP_ij − Δ_i)·(1 − tanh²) (1 without a softcap) — the
//! formulas of `flashmoe::reference::attention_backward`, whose values the tests match.

use super::RefTensor;
use flashmoe::reference::attention::{attention_f64, AttentionInputs};
use flashmoe::AttentionProblem;
use rayon::prelude::*;

/// `k` indices spread evenly over `0..n` (the first and last included), or all of them.
pub fn spread(n: usize, k: usize) -> Vec<usize> {
    if n <= k || k < 2 {
        return (0..n.min(k)).collect();
    }
    (0..k).map(|t| t * (n - 1) / (k - 1)).collect()
}

/// dq, dk, dv of `p` at `rows` query rows (per query head of KV head 0's group) and `rows`
/// keys of KV head 0, batch 0, as [`RefTensor`]s selecting those rows of the full tensors.
/// `x` and `d_o` are the full problem's.
pub fn sampled_f64(
    p: &AttentionProblem,
    x: &AttentionInputs,
    d_o: &[f32],
    rows: usize,
) -> flashmoe::Result<Vec<RefTensor>> {
    let (hq, hkv, d) = (p.heads_q, p.heads_kv, p.head_dim);
    let (sq, sk, g) = (p.seqlen_q, p.seqlen_k, p.group_size());
    // Batch 0, KV head 0 and its query heads 0..g, in their own contiguous layouts.
    let sub = AttentionProblem {
        batch: 1,
        heads_q: g,
        heads_kv: 1,
        ..p.clone()
    };
    let take = |v: &[f32], seq: usize, heads: usize, keep: usize| -> Vec<f32> {
        (0..seq)
            .flat_map(|i| v[i * heads * d..(i * heads + keep) * d].iter().copied())
            .collect()
    };
    let xs = AttentionInputs {
        q: take(&x.q, sq, hq, g),
        k: take(&x.k, sk, hkv, 1),
        v: take(&x.v, sk, hkv, 1),
    };
    let dos = take(d_o, sq, hq, g);
    let fwd = attention_f64(&sub, &xs)?;
    let scale = p.scale() as f64;
    let softcap = p.softcap as f64;
    // Row i of head h (layout (sq, g, d)), its LSE ((g, sq)) and Δ.
    let at = |i: usize, h: usize| (i * g + h) * d;
    let delta: Vec<f64> = (0..g * sq)
        .map(|r| {
            let (h, i) = (r / sq, r % sq);
            (0..d)
                .map(|c| dos[at(i, h) + c] as f64 * fwd.o[at(i, h) + c])
                .sum()
        })
        .collect();
    let dot =
        |a: &[f32], b: &[f32]| -> f64 { a.iter().zip(b).map(|(&u, &v)| u as f64 * v as f64).sum() };
    // (P_ij, dS_ij / scale·…): the probability and dS of row i of head h at key j.
    let p_ds = |h: usize, i: usize, j: usize| -> Option<(f64, f64)> {
        let lse = fwd.lse[h * sq + i];
        if lse == f64::NEG_INFINITY {
            return None;
        }
        let q = &xs.q[at(i, h)..at(i, h) + d];
        let k = &xs.k[j * d..(j + 1) * d];
        let v = &xs.v[j * d..(j + 1) * d];
        let s = scale * dot(q, k);
        let (z, dtanh) = if softcap > 0.0 {
            let t = (s / softcap).tanh();
            (softcap * t, 1.0 - t * t)
        } else {
            (s, 1.0)
        };
        let pij = (z - lse).exp();
        let dp = dot(&dos[at(i, h)..at(i, h) + d], v);
        Some((pij, pij * (dp - delta[h * sq + i]) * dtanh))
    };

    let q_rows = spread(sq, rows);
    let k_rows = spread(sk, rows);
    // dq: (head, row) pairs in row-major order of the full tensor.
    let dq_items: Vec<(usize, usize)> = q_rows
        .iter()
        .flat_map(|&i| (0..g).map(move |h| (i, h)))
        .collect();
    let dq: Vec<Vec<f64>> = dq_items
        .par_iter()
        .map(|&(i, h)| {
            let mut acc = vec![0f64; d];
            for j in sub.visible_range(i) {
                if let Some((_, ds)) = p_ds(h, i, j) {
                    for (a, &kv) in acc.iter_mut().zip(&xs.k[j * d..(j + 1) * d]) {
                        *a += scale * ds * kv as f64;
                    }
                }
            }
            acc
        })
        .collect();
    let dkv: Vec<(Vec<f64>, Vec<f64>)> = k_rows
        .par_iter()
        .map(|&j| {
            let (mut dk, mut dv) = (vec![0f64; d], vec![0f64; d]);
            for h in 0..g {
                for i in 0..sq {
                    if !sub.visible_range(i).contains(&j) {
                        continue;
                    }
                    let Some((pij, ds)) = p_ds(h, i, j) else {
                        continue;
                    };
                    let q = &xs.q[at(i, h)..at(i, h) + d];
                    let go = &dos[at(i, h)..at(i, h) + d];
                    for c in 0..d {
                        dk[c] += scale * ds * q[c] as f64;
                        dv[c] += pij * go[c] as f64;
                    }
                }
            }
            (dk, dv)
        })
        .collect();
    let q_ranges = dq_items
        .iter()
        .map(|&(i, h)| ((i * hq + h) * d, d))
        .collect();
    let k_ranges: Vec<(usize, usize)> = k_rows.iter().map(|&j| (j * hkv * d, d)).collect();
    let (dk, dv): (Vec<Vec<f64>>, Vec<Vec<f64>>) = dkv.into_iter().unzip();
    Ok(vec![
        RefTensor {
            name: "dq".into(),
            values: dq.concat(),
            select: Some(q_ranges),
        },
        RefTensor {
            name: "dk".into(),
            values: dk.concat(),
            select: Some(k_ranges.clone()),
        },
        RefTensor {
            name: "dv".into(),
            values: dv.concat(),
            select: Some(k_ranges),
        },
    ])
}

/// Sequences of a varlen problem the sampled reference checks.
pub const SAMPLED_SEQUENCES: usize = 3;

/// The varlen problem's gradients sampled as [`sampled_f64`] samples a dense one, on
/// [`SAMPLED_SEQUENCES`] sequences spread over those with queries and keys (each its own
/// dense problem: sequences are independent), in the packed layout.
pub fn varlen_sampled_f64(
    p: &crate::varlen::VarlenProblem,
    x: &AttentionInputs,
    d_o: &[f32],
    rows: usize,
) -> flashmoe::Result<Vec<RefTensor>> {
    let (hq, hkv, d) = (p.heads_q, p.heads_kv, p.head_dim);
    let (rq, rk) = (hq * d, hkv * d);
    if x.q.len() != p.total_q() * rq || x.k.len() != p.total_k() * rk || d_o.len() != x.q.len() {
        return Err(flashmoe::Error::invalid(
            "varlen inputs do not match the packed shapes",
        ));
    }
    let (cu_q, cu_k) = (p.cu_seqlens_q(), p.cu_seqlens_k());
    let live: Vec<usize> = (0..p.seqlens.len())
        .filter(|&s| p.seqlens[s].0 > 0 && p.seqlens[s].1 > 0)
        .collect();
    let mut out: Vec<RefTensor> = ["dq", "dk", "dv"]
        .iter()
        .map(|n| RefTensor {
            name: n.to_string(),
            values: Vec::new(),
            select: Some(Vec::new()),
        })
        .collect();
    for idx in spread(live.len(), SAMPLED_SEQUENCES) {
        let s = live[idx];
        let (sq, sk) = p.seqlens[s];
        let (q0, k0) = (cu_q[s], cu_k[s]);
        let xs = AttentionInputs {
            q: x.q[q0 * rq..(q0 + sq) * rq].to_vec(),
            k: x.k[k0 * rk..(k0 + sk) * rk].to_vec(),
            v: x.v[k0 * rk..(k0 + sk) * rk].to_vec(),
        };
        let seq = sampled_f64(&p.sequence(s), &xs, &d_o[q0 * rq..(q0 + sq) * rq], rows)?;
        for (o, t) in out.iter_mut().zip(seq) {
            let base = if t.name == "dq" { q0 * rq } else { k0 * rk };
            o.values.extend(t.values);
            let ranges = o.select.as_mut().expect("set above");
            ranges.extend(
                t.select
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(at, n)| (base + at, n)),
            );
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::inputs::{generate, TensorId};
    use flashmoe::reference::attention_backward::attention_backward_f64;
    use flashmoe::DType;

    /// Varlen: the sampled sequences' values equal the whole per-sequence f64 backward.
    #[test]
    fn varlen_samples_equal_the_full_reference() {
        let mut p = crate::varlen::VarlenProblem::new(&[], 4, 2, 16, true, DType::Bf16);
        p.seqlens = vec![(9, 20), (0, 4), (17, 17), (6, 0), (25, 25)];
        let x = AttentionInputs::generate(&p.packed(), 5);
        let d_o = generate(5, TensorId::DOut, x.q.len(), 1.0, p.dtype);
        let full = crate::grad::attention_f32::varlen_per_sequence(&p, &x, &d_o, |_, s, xs, d| {
            let g = attention_backward_f64(s, xs, d)?;
            Ok([g.dq, g.dk, g.dv])
        })
        .unwrap();
        let s = varlen_sampled_f64(&p, &x, &d_o, 4).unwrap();
        for (t, f) in s.iter().zip(&full) {
            let mut k = 0;
            for &(at, len) in t.select.as_ref().unwrap() {
                for e in 0..len {
                    let (want, got) = (f[at + e], t.values[k]);
                    assert!(
                        (want - got).abs() <= 1e-12 * (1.0 + want.abs()),
                        "{}",
                        t.name
                    );
                    k += 1;
                }
            }
            assert_eq!(k, t.values.len());
            assert!(k > 0);
        }
    }

    #[test]
    fn spread_keeps_the_ends() {
        assert_eq!(spread(5, 8), vec![0, 1, 2, 3, 4]);
        assert_eq!(spread(101, 5), vec![0, 25, 50, 75, 100]);
        assert_eq!(spread(0, 4), Vec::<usize>::new());
    }

    /// Every sampled value equals the full f64 backward's there (GQA, causal Sq > Sk with
    /// rows that see no key, a window with a softcap).
    #[test]
    fn samples_equal_the_full_reference() {
        let mut a = AttentionProblem::new(2, 6, 37, 16, true, DType::Bf16);
        a.heads_kv = 2;
        a.seqlen_k = 29;
        let mut w = AttentionProblem::new(1, 2, 40, 32, false, DType::F16);
        w.window = (7, 2);
        w.softcap = 3.0;
        for (n, p) in [a, w].into_iter().enumerate() {
            let x = AttentionInputs::generate(&p, n as u64);
            let d_o = generate(n as u64, TensorId::DOut, x.q.len(), 1.0, p.dtype);
            let full = attention_backward_f64(&p, &x, &d_o).unwrap();
            let s = sampled_f64(&p, &x, &d_o, 6).unwrap();
            for (t, f) in s.iter().zip([&full.dq, &full.dk, &full.dv]) {
                let f32s: Vec<f32> = f.iter().map(|&v| v as f32).collect();
                let picked = t.pick(&f32s);
                assert_eq!(picked.len(), t.values.len(), "{}", t.name);
                let mut k = 0;
                for &(at, len) in t.select.as_ref().unwrap() {
                    for e in 0..len {
                        let (want, got) = (f[at + e], t.values[k]);
                        assert!(
                            (want - got).abs() <= 1e-12 * (1.0 + want.abs()),
                            "{p}: {} element {}: {got} vs {want}",
                            t.name,
                            at + e
                        );
                        k += 1;
                    }
                }
            }
        }
    }
}
