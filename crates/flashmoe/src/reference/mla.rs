//! MLA paged decode ground truth in f64: the semantics of [`crate::attention::mla`], row by
//! row with a materialised softmax.
//!
//! Layouts (contiguous): q `[batch, seqlen_q, heads_q, d_qk]`; the cache `[num_blocks,
//! page_size, d_qk]` (one latent head; the value is a row's first `d_v` columns); block table
//! `[batch, max_blocks]`; o `[batch, seqlen_q, heads_q, d_v]`; lse `[batch, seqlen_q,
//! heads_q]` (natural log). Key `j` of sequence `b` is row `j % page_size` of block
//! `block_table[b][j / page_size]`. Causal, bottom-right: row `i` sees keys
//! `j <= seqused_k[b] - seqlen_q + i`; a row that sees no key gets O = 0 and LSE = -inf.

use super::attention::{softmax_in_place, AttentionOutput};
use crate::error::{Error, Result};

/// Shape of one MLA decode call.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaDecodeSpec {
    pub batch: usize,
    pub seqlen_q: usize,
    pub heads_q: usize,
    /// Width of q and of a cache row (576).
    pub d_qk: usize,
    /// Width of the value (a row's first columns) and of o (512).
    pub d_v: usize,
    pub num_blocks: usize,
    pub page_size: usize,
    pub max_blocks: usize,
    pub scale: f64,
}

/// Inputs as f32 values (already rounded to the kernel's dtype).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaDecodeInputs {
    pub q: Vec<f32>,
    pub kv_cache: Vec<f32>,
    /// `[batch, max_blocks]`
    pub block_table: Vec<i32>,
    /// Keys used per sequence.
    pub seqused_k: Vec<usize>,
}

impl MlaDecodeSpec {
    fn check(&self, x: &MlaDecodeInputs) -> Result<()> {
        if self.d_v == 0 || self.d_v > self.d_qk || self.page_size == 0 {
            return Err(Error::invalid(format!(
                "MLA reference: d_v {} must be in 1..=d_qk {} and page_size {} >= 1",
                self.d_v, self.d_qk, self.page_size
            )));
        }
        let (b, sq, hq) = (self.batch, self.seqlen_q, self.heads_q);
        let cache =
            super::checked_product("kv_cache", &[self.num_blocks, self.page_size, self.d_qk])?;
        for (name, want, got) in [
            ("q", b * sq * hq * self.d_qk, x.q.len()),
            ("kv_cache", cache, x.kv_cache.len()),
            ("block_table", b * self.max_blocks, x.block_table.len()),
            ("seqused_k", b, x.seqused_k.len()),
        ] {
            super::check_len(name, want, got)?;
        }
        for (bi, &n) in x.seqused_k.iter().enumerate() {
            if n > self.max_blocks * self.page_size {
                return Err(Error::invalid(format!(
                    "seqused_k[{bi}] = {n} exceeds the table's {} blocks of {} keys",
                    self.max_blocks, self.page_size
                )));
            }
            for p in 0..n.div_ceil(self.page_size) {
                let blk = x.block_table[bi * self.max_blocks + p];
                if blk < 0 || blk as usize >= self.num_blocks {
                    return Err(Error::invalid(format!(
                        "block_table[{bi}][{p}] = {blk} is outside [0, {})",
                        self.num_blocks
                    )));
                }
            }
        }
        Ok(())
    }

    /// Cache row of key `j` of sequence `b` (all `d_qk` columns).
    fn row<'a>(&self, x: &'a MlaDecodeInputs, b: usize, j: usize) -> &'a [f32] {
        let blk = x.block_table[b * self.max_blocks + j / self.page_size] as usize;
        let off = (blk * self.page_size + j % self.page_size) * self.d_qk;
        &x.kv_cache[off..off + self.d_qk]
    }
}

/// The f64 ground truth of MLA paged decode (module docs). `lse` is `[batch, seqlen_q,
/// heads_q]`.
pub fn mla_decode_f64(s: &MlaDecodeSpec, x: &MlaDecodeInputs) -> Result<AttentionOutput<f64>> {
    s.check(x)?;
    let (b, sq, hq, dqk, dv) = (s.batch, s.seqlen_q, s.heads_q, s.d_qk, s.d_v);
    let mut o = vec![0f64; b * sq * hq * dv];
    let mut lse = vec![0f64; b * sq * hq];
    for bi in 0..b {
        let sk = x.seqused_k[bi];
        for i in 0..sq {
            let hi = (sk as i64 - sq as i64 + i as i64 + 1).clamp(0, sk as i64) as usize;
            for h in 0..hq {
                let row = (bi * sq + i) * hq + h;
                let q = &x.q[row * dqk..(row + 1) * dqk];
                let mut scores: Vec<f64> = (0..hi)
                    .map(|j| {
                        let k = s.row(x, bi, j);
                        s.scale
                            * q.iter()
                                .zip(k)
                                .map(|(&a, &c)| a as f64 * c as f64)
                                .sum::<f64>()
                    })
                    .collect();
                lse[row] = softmax_in_place(&mut scores);
                let orow = &mut o[row * dv..(row + 1) * dv];
                for (w, j) in scores.iter().zip(0..hi) {
                    for (od, &vd) in orow.iter_mut().zip(&s.row(x, bi, j)[..dv]) {
                        *od += w * vd as f64;
                    }
                }
            }
        }
    }
    Ok(AttentionOutput { o, lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::problem::AttentionProblem;
    use crate::reference::{attention_f64, AttentionInputs};
    use crate::DType;

    /// MLA equals dense causal attention with one KV head whose K is the cache row and whose
    /// V is the same row (its first d_v columns of O are MLA's O), with shuffled pages and
    /// NaN in every unused cache row; a row that sees no key (seqused < Sq) gets O = 0 and
    /// LSE = -inf.
    #[test]
    fn mla_matches_dense_reference() {
        let (dqk, dv) = (40, 32); // the same code path as 576/512, small for CI
        for &(b, sq, sk, hq, page) in &[(2, 1, 37, 4, 16), (1, 4, 100, 3, 32), (2, 3, 16, 2, 16)] {
            let p = AttentionProblem {
                batch: b,
                heads_q: hq,
                heads_kv: 1,
                seqlen_q: sq,
                seqlen_k: sk,
                head_dim: dqk,
                causal: true,
                dtype: DType::Bf16,
                softmax_scale: Some(0.17),
                window: crate::problem::NO_WINDOW,
                softcap: 0.0,
            };
            let mut x = AttentionInputs::generate(&p, 5);
            x.v = x.k.clone();
            let dense = attention_f64(&p, &x).unwrap();
            // Paged cache: sequence bi's page j at block perm(bi, j), reversed order.
            let max_blocks = sk.div_ceil(page) + 1;
            let num_blocks = b * max_blocks;
            let mut cache = vec![f32::NAN; num_blocks * page * dqk];
            let mut table = vec![-1i32; b * max_blocks];
            for bi in 0..b {
                for j in 0..sk {
                    let blk = num_blocks - 1 - (bi * max_blocks + j / page);
                    table[bi * max_blocks + j / page] = blk as i32;
                    let dst = (blk * page + j % page) * dqk;
                    let src = (bi * sk + j) * dqk;
                    cache[dst..dst + dqk].copy_from_slice(&x.k[src..src + dqk]);
                }
            }
            let spec = MlaDecodeSpec {
                batch: b,
                seqlen_q: sq,
                heads_q: hq,
                d_qk: dqk,
                d_v: dv,
                num_blocks,
                page_size: page,
                max_blocks,
                scale: p.scale() as f64,
            };
            let inp = MlaDecodeInputs {
                q: x.q.clone(),
                kv_cache: cache,
                block_table: table,
                seqused_k: vec![sk; b],
            };
            let got = mla_decode_f64(&spec, &inp).unwrap();
            for bi in 0..b {
                for i in 0..sq {
                    for h in 0..hq {
                        let row = (bi * sq + i) * hq + h;
                        let drow = (bi * sq + i) * hq + h; // dense o: (b, sq, hq, d)
                        let want_lse = dense.lse[(bi * hq + h) * sq + i]; // (b, hq, sq)
                        assert!(
                            (got.lse[row] - want_lse).abs() < 1e-12,
                            "lse b{bi} i{i} h{h}"
                        );
                        for c in 0..dv {
                            let w = dense.o[drow * dqk + c];
                            assert!((got.o[row * dv + c] - w).abs() < 1e-12, "o b{bi} i{i} h{h}");
                        }
                    }
                }
            }
            // Fewer keys than rows: the first rows see nothing.
            let mut short = inp.clone();
            short.seqused_k = vec![1; b];
            if sq > 1 {
                let got = mla_decode_f64(&spec, &short).unwrap();
                assert_eq!(got.lse[0], f64::NEG_INFINITY);
                assert!(got.o[..dv].iter().all(|&v| v == 0.0));
                assert!(got.lse[(sq - 1) * hq].is_finite());
            }
        }
        // Bad input is an error naming the problem.
        let spec = MlaDecodeSpec {
            batch: 1,
            seqlen_q: 1,
            heads_q: 1,
            d_qk: 8,
            d_v: 4,
            num_blocks: 1,
            page_size: 16,
            max_blocks: 1,
            scale: 1.0,
        };
        let inp = MlaDecodeInputs {
            q: vec![0.0; 8],
            kv_cache: vec![0.0; 16 * 8],
            block_table: vec![3],
            seqused_k: vec![5],
        };
        let e = mla_decode_f64(&spec, &inp).unwrap_err().to_string();
        assert!(e.contains("block_table[0][0] = 3"), "{e}");
    }
}
