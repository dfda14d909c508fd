//! Attention forward ground truth: f64 accumulation with a materialised, max-subtracted
//! softmax per query row.
//!
//! Layouts (all contiguous, row-major): Q and O are (batch, seqlen_q, heads_q, head_dim);
//! K and V are (batch, seqlen_k, heads_kv, head_dim); LSE is (batch, heads_q, seqlen_q)
//! in natural log. With GQA/MQA, query head `h` reads KV head `h / (heads_q / heads_kv)`.
//! Masking (causal and sliding window, both bottom-right aligned) is
//! [`AttentionProblem::visible_range`]: query row `i` attends to keys `lo..hi` only; a
//! query row that sees no key at all gets O = 0 and LSE = −inf.
//!
//! The softmax scale is [`AttentionProblem::scale`] — the f32 value every kernel uses —
//! widened to f64, so the reference and the kernels apply the very same scale. With a
//! softcap `c > 0` (also widened from f32) each scaled score `s` becomes `c · tanh(s / c)`
//! before the softmax, and the LSE is that of the capped scores.
//!
//! ALiBi ([`attention_f64_alibi`], FlashAttention's convention): the logit of query `i` and
//! key `j` (after the softcap) gets `-slope · |i + seqlen_k - seqlen_q - j|`, with one f32
//! slope per (batch, head), widened to f64; the LSE is that of the biased logits.
//!
//! [`AttentionProblem::visible_range`]: crate::problem::AttentionProblem::visible_range

use super::{check_len, checked_product};
use crate::error::Result;
use crate::inputs::{generate, TensorId};
use crate::problem::AttentionProblem;
use rayon::prelude::*;

/// Attention inputs as f32 values already rounded to the problem's dtype, so every backend
/// (f64 reference, tiled CPU, GPU kernels, Python baselines) consumes identical numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionInputs {
    /// (batch, seqlen_q, heads_q, head_dim)
    pub q: Vec<f32>,
    /// (batch, seqlen_k, heads_kv, head_dim)
    pub k: Vec<f32>,
    /// (batch, seqlen_k, heads_kv, head_dim)
    pub v: Vec<f32>,
}

impl AttentionInputs {
    /// The deterministic inputs of `p` for `seed`: [`generate`] with tensor ids Q, K, V,
    /// scale 1.0 (uniform in [-1, 1)), rounded to `p.dtype`.
    ///
    /// A problem whose sizes overflow `usize` yields empty tensors (every consumer then
    /// reports the problem instead of trying to allocate).
    pub fn generate(p: &AttentionProblem, seed: u64) -> AttentionInputs {
        let (q_len, kv_len) = tensor_lens(p).unwrap_or((0, 0));
        AttentionInputs {
            q: generate(seed, TensorId::Q, q_len, 1.0, p.dtype),
            k: generate(seed, TensorId::K, kv_len, 1.0, p.dtype),
            v: generate(seed, TensorId::V, kv_len, 1.0, p.dtype),
        }
    }
}

/// Attention outputs. `o`: (batch, seqlen_q, heads_q, head_dim); `lse`: (batch, heads_q,
/// seqlen_q), natural-log log-sum-exp of the scaled scores (−inf for a row with no key).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOutput<T> {
    pub o: Vec<T>,
    pub lse: Vec<T>,
}

/// Element counts of Q and of K (= V), checked for overflow.
fn tensor_lens(p: &AttentionProblem) -> Result<(usize, usize)> {
    let q = checked_product("Q", &[p.batch, p.seqlen_q, p.heads_q, p.head_dim])?;
    let kv = checked_product("K/V", &[p.batch, p.seqlen_k, p.heads_kv, p.head_dim])?;
    Ok((q, kv))
}

/// Validate the problem and the input lengths (shared by every CPU attention path).
pub(crate) fn validate_inputs(p: &AttentionProblem, x: &AttentionInputs) -> Result<()> {
    // Check for overflow before `validate`, which multiplies the sizes unchecked.
    let (q_len, kv_len) = tensor_lens(p)?;
    checked_product("LSE", &[p.batch, p.heads_q, p.seqlen_q])?;
    p.validate()?;
    check_len("q", q_len, x.q.len())?;
    check_len("k", kv_len, x.k.len())?;
    check_len("v", kv_len, x.v.len())?;
    Ok(())
}

/// Softmax of one row in place (max-subtracted, f64); returns the row's log-sum-exp.
/// An empty row or a row of −inf returns −inf and leaves zeros.
pub(crate) fn softmax_in_place(row: &mut [f64]) -> f64 {
    let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        row.fill(0.0);
        return f64::NEG_INFINITY;
    }
    let mut sum = 0.0;
    for s in row.iter_mut() {
        *s = (*s - m).exp();
        sum += *s;
    }
    let inv = 1.0 / sum;
    for s in row.iter_mut() {
        *s *= inv;
    }
    m + sum.ln()
}

/// Copy head `head` of a (batch, seqlen, heads, dim) tensor, batch `b`, into a contiguous
/// (seqlen, dim) buffer of f64.
fn gather_head_f64(
    t: &[f32],
    b: usize,
    head: usize,
    seqlen: usize,
    heads: usize,
    dim: usize,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(seqlen * dim);
    for s in 0..seqlen {
        let off = ((b * seqlen + s) * heads + head) * dim;
        out.extend(t[off..off + dim].iter().map(|&v| v as f64));
    }
    out
}

/// (batch, heads, seqlen, dim) → (batch, seqlen, heads, dim).
pub(crate) fn bhsd_to_bshd<T: Copy + Default + Send + Sync>(
    src: &[T],
    batch: usize,
    heads: usize,
    seqlen: usize,
    dim: usize,
) -> Vec<T> {
    let mut out = vec![T::default(); batch * seqlen * heads * dim];
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(heads * dim)
        .enumerate()
        .for_each(|(row, dst)| {
            let (b, s) = (row / seqlen, row % seqlen);
            for (h, d) in dst.chunks_exact_mut(dim).enumerate() {
                let off = ((b * heads + h) * seqlen + s) * dim;
                d.copy_from_slice(&src[off..off + dim]);
            }
        });
    out
}

/// One query row: scores against the visible keys (`scores.len()` of them, the rows of
/// `k` and `v`), softcap (when `softcap > 0`), softmax, weighted sum of V into `o`;
/// returns the LSE (−inf and O = 0 when no key is visible).
/// `alibi`: `(slope, key)` adds `-slope · |key - (j0 + jj)|` to the logit of the row's
/// `jj`-th visible key, `key` being the row's diagonal key i + seqlen_k - seqlen_q and `j0`
/// its first visible key.
#[allow(clippy::too_many_arguments)]
fn attend_row(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    scale: f64,
    softcap: f64,
    alibi: Option<(f64, i64, usize)>,
    scores: &mut [f64],
    o: &mut [f64],
) -> f64 {
    let d = q.len();
    for (jj, (s, kr)) in scores.iter_mut().zip(k.chunks_exact(d)).enumerate() {
        let dot: f64 = q.iter().zip(kr).map(|(a, b)| a * b).sum();
        *s = scale * dot;
        if softcap > 0.0 {
            *s = softcap * (*s / softcap).tanh();
        }
        if let Some((slope, diag, j0)) = alibi {
            *s -= slope * (diag - (j0 + jj) as i64).abs() as f64;
        }
    }
    let lse = softmax_in_place(scores);
    o.fill(0.0);
    for (&w, vr) in scores.iter().zip(v.chunks_exact(d)) {
        for (od, &vd) in o.iter_mut().zip(vr) {
            *od += w * vd;
        }
    }
    lse
}

/// Query rows per parallel work item of [`attention_f64`].
const ROW_BLOCK: usize = 16;

/// Ground-truth attention forward in f64 (see the module docs for layouts and masking).
/// Parallel over (batch, head) and blocks of query rows; each row is computed the same
/// way whatever the thread count.
pub fn attention_f64(p: &AttentionProblem, x: &AttentionInputs) -> Result<AttentionOutput<f64>> {
    attention_f64_impl(p, x, None)
}

/// [`attention_f64`] with ALiBi (module docs): the slope of (batch b, head h) is
/// `slopes[b * batch_stride + h]` (`batch_stride` 0: one `[heads_q]` vector for the batch,
/// `heads_q`: a `[batch, heads_q]` matrix). Errors name a short slope buffer.
pub fn attention_f64_alibi(
    p: &AttentionProblem,
    x: &AttentionInputs,
    slopes: &[f32],
    batch_stride: usize,
) -> Result<AttentionOutput<f64>> {
    let need = (p.batch.saturating_sub(1))
        .saturating_mul(batch_stride)
        .saturating_add(p.heads_q);
    check_len("alibi_slopes", need, slopes.len().min(need))?;
    attention_f64_impl(p, x, Some((slopes, batch_stride)))
}

fn attention_f64_impl(
    p: &AttentionProblem,
    x: &AttentionInputs,
    alibi: Option<(&[f32], usize)>,
) -> Result<AttentionOutput<f64>> {
    validate_inputs(p, x)?;
    let (b, hq, hkv) = (p.batch, p.heads_q, p.heads_kv);
    let (sq, sk, d) = (p.seqlen_q, p.seqlen_k, p.head_dim);
    let group = p.group_size();
    let scale = p.scale() as f64;
    let softcap = p.softcap as f64;

    let mut o_bh = vec![0f64; b * hq * sq * d];
    let mut lse = vec![0f64; b * hq * sq];
    o_bh.par_chunks_mut(sq * d)
        .zip(lse.par_chunks_mut(sq))
        .enumerate()
        .for_each(|(bh, (o, l))| {
            let (bi, h) = (bh / hq, bh % hq);
            let kvh = h / group;
            let slope = alibi.map(|(s, bs)| s[bi * bs + h] as f64);
            let k = gather_head_f64(&x.k, bi, kvh, sk, hkv, d);
            let v = gather_head_f64(&x.v, bi, kvh, sk, hkv, d);
            // Query rows in parallel blocks too, so few (batch, head) pairs still use
            // every core.
            o.par_chunks_mut(ROW_BLOCK * d)
                .zip(l.par_chunks_mut(ROW_BLOCK))
                .enumerate()
                .for_each_init(
                    || (vec![0f64; sk], vec![0f64; d]),
                    |(scores, q), (blk, (o, l))| {
                        for (r, (orow, li)) in o.chunks_exact_mut(d).zip(l.iter_mut()).enumerate() {
                            let i = blk * ROW_BLOCK + r;
                            let off = ((bi * sq + i) * hq + h) * d;
                            for (qd, &xq) in q.iter_mut().zip(&x.q[off..off + d]) {
                                *qd = xq as f64;
                            }
                            let keys = p.visible_range(i);
                            let (kr, vr) = (
                                &k[keys.start * d..keys.end * d],
                                &v[keys.start * d..keys.end * d],
                            );
                            let row = &mut scores[..keys.len()];
                            let diag = i as i64 + sk as i64 - sq as i64;
                            let bias = slope.map(|s| (s, diag, keys.start));
                            *li = attend_row(q, kr, vr, scale, softcap, bias, row, orow);
                        }
                    },
                );
        });
    Ok(AttentionOutput {
        o: bhsd_to_bshd(&o_bh, b, hq, sq, d),
        lse,
    })
}

#[cfg(test)]
mod alibi_tests {
    use super::*;
    use crate::dtype::DType;

    fn problem(causal: bool, window: (i32, i32), softcap: f32) -> AttentionProblem {
        AttentionProblem {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            seqlen_q: 7,
            seqlen_k: 11,
            head_dim: 8,
            causal,
            dtype: DType::Bf16,
            softmax_scale: None,
            window,
            softcap,
        }
    }

    /// Zero slopes are plain attention; a brute-force row (every key, masks as -inf,
    /// FlashAttention's bias after the softcap) matches for a [batch, heads] slope matrix.
    #[test]
    fn alibi_reference_matches_brute_force() {
        for (causal, window, softcap) in [
            (false, crate::problem::NO_WINDOW, 0.0),
            (true, crate::problem::NO_WINDOW, 0.0),
            (true, (3, -1), 0.0),
            (false, (2, 1), 4.0),
        ] {
            let p = problem(causal, window, softcap);
            let x = AttentionInputs::generate(&p, 42);
            let plain = attention_f64(&p, &x).unwrap();
            let zero = attention_f64_alibi(&p, &x, &[0.0; 4], 0).unwrap();
            assert_eq!(plain, zero);
            let slopes: Vec<f32> = (0..8).map(|i| 0.05 + 0.1 * i as f32).collect();
            let got = attention_f64_alibi(&p, &x, &slopes, 4).unwrap();
            let (sq, sk, d, hq, hkv) = (7usize, 11usize, 8usize, 4usize, 2usize);
            for b in 0..2 {
                for h in 0..hq {
                    for i in 0..sq {
                        let vis = p.visible_range(i);
                        let qo = ((b * sq + i) * hq + h) * d;
                        let mut s: Vec<f64> = (0..sk)
                            .map(|j| {
                                if !vis.contains(&j) {
                                    return f64::NEG_INFINITY;
                                }
                                let ko = ((b * sk + j) * hkv + h / 2) * d;
                                let dot: f64 = (0..d)
                                    .map(|e| x.q[qo + e] as f64 * x.k[ko + e] as f64)
                                    .sum();
                                let mut l = p.scale() as f64 * dot;
                                if softcap > 0.0 {
                                    l = softcap as f64 * (l / softcap as f64).tanh();
                                }
                                let dist = (i as f64 + sk as f64 - sq as f64 - j as f64).abs();
                                l - slopes[b * 4 + h] as f64 * dist
                            })
                            .collect();
                        let lse = softmax_in_place(&mut s);
                        let l = got.lse[(b * hq + h) * sq + i];
                        assert!(
                            (l - lse).abs() < 1e-12 || (l == lse),
                            "lse {l} vs {lse} (b {b} h {h} i {i} {causal} {window:?})"
                        );
                        for e in 0..d {
                            let want: f64 = (0..sk)
                                .map(|j| s[j] * x.v[((b * sk + j) * hkv + h / 2) * d + e] as f64)
                                .sum();
                            assert!((got.o[qo + e] - want).abs() < 1e-12);
                        }
                    }
                }
            }
        }
        // A short slope buffer is an error, not a panic.
        let p = problem(false, crate::problem::NO_WINDOW, 0.0);
        let x = AttentionInputs::generate(&p, 1);
        assert!(attention_f64_alibi(&p, &x, &[0.1; 7], 4).is_err());
        assert!(attention_f64_alibi(&p, &x, &[0.1; 3], 0).is_err());
    }
}
