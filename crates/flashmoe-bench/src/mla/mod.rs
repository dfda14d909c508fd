//! The lab's MLA decode problem (issue 35): one DeepSeek-V2/V3 Multi-head Latent Attention
//! decode step over a paged latent cache — `Hq` weight-absorbed query heads of width 576
//! against one latent KV head (per token 512 latent + 64 rotary columns; the key is the
//! whole row, the value its first 512 columns), causal bottom-right, `Sq` rows per sequence
//! (1 decode, 2..4 speculative).
//!
//! Inputs ([`generate_inputs`]): q `[B, Sq, Hq, 576]` (the generator's Q stream) and the
//! dense latent cache `[B, Sk, 576]` (its K stream); there is no separate value tensor.
//! [`PagedLatent::build`] copies the latent rows into pages of `page_size` keys following
//! the decode suite's shuffled block table, so every implementation sees the same values.
//! Outputs: o `[B, Sq, Hq, 512]`, lse `[B, Sq, Hq]` (natural log; the MLA plan's layout).
//!
//! Two CPU computations: [`reference_f64`] is the library's f64 ground truth
//! (`flashmoe::reference::mla`), run sequence by sequence on threads;
//! [`blocked_f64`] is an independent f64 computation on the dense latent (keys streamed once
//! per group of heads, vectorisable dot products), fast enough to check the GPU preset's
//! shapes. The CPU tests hold them equal.

pub mod config;
pub mod gpu;

use crate::decode::shuffled_blocks;
use flashmoe::attention::mla::{MlaDecodeClass, D_QK, D_V};
use flashmoe::inputs::{generate, TensorId};
use flashmoe::reference::mla::{mla_decode_f64, MlaDecodeInputs, MlaDecodeSpec};
use flashmoe::reference::{AttentionInputs, AttentionOutput};
use flashmoe::DType;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Most query rows per sequence of an MLA problem (the plan's limit).
pub const MAX_SEQLEN_Q: usize = flashmoe::attention::mla::MAX_Q_PER_SEQ;

/// DeepSeek-V3's page size.
pub const MLA_PAGE_SIZE: usize = 64;

/// DeepSeek-V3's softmax scale before its yarn factor: 1/sqrt(192) (the q/k head dim of
/// the un-absorbed attention, not of the 576-wide latent).
pub fn deepseek_scale() -> f32 {
    1.0 / (192f32).sqrt()
}

/// One MLA decode step: `batch` sequences of `seqlen_q` query rows against `seqlen_k` cached
/// latent rows each (or `seqlens_k[b]`), pages of `page_size` keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MlaProblem {
    pub batch: usize,
    pub heads_q: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    /// Keys per cache page (a positive multiple of 16; DeepSeek: 64).
    pub page_size: usize,
    pub dtype: DType,
    /// Multiplies q·k (DeepSeek: 1/sqrt(192) times its yarn factor).
    #[serde(default = "deepseek_scale")]
    pub softmax_scale: f32,
    /// Ragged cache: keys of each sequence (each in seqlen_q..=seqlen_k); empty = seqlen_k.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seqlens_k: Vec<usize>,
}

impl MlaProblem {
    /// DeepSeek's step: scale 1/sqrt(192), uniform cache lengths.
    pub fn new(
        batch: usize,
        heads_q: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        page_size: usize,
        dtype: DType,
    ) -> MlaProblem {
        MlaProblem {
            batch,
            heads_q,
            seqlen_q,
            seqlen_k,
            page_size,
            dtype,
            softmax_scale: deepseek_scale(),
            seqlens_k: Vec::new(),
        }
    }

    /// Keys of each sequence.
    pub fn seqused(&self) -> Vec<usize> {
        if self.seqlens_k.is_empty() {
            vec![self.seqlen_k; self.batch]
        } else {
            self.seqlens_k.clone()
        }
    }

    /// The plan's class for this problem (max batch, rows and keys = the problem's).
    pub fn class(&self) -> MlaDecodeClass {
        MlaDecodeClass {
            dtype: self.dtype,
            heads_q: self.heads_q,
            head_dim_qk: D_QK,
            head_dim_v: D_V,
            page_size: self.page_size,
            max_q_per_seq: self.seqlen_q,
            max_batch: self.batch,
            max_seqlen_k: self.seqlen_k,
            softmax_scale: self.softmax_scale,
        }
    }

    /// Check the problem: the plan's class rules, Sq <= every sequence's keys (every row
    /// sees a key), `seqlens_k` of batch values in Sq..=seqlen_k.
    pub fn validate(&self) -> flashmoe::Result<()> {
        let invalid = |m: String| Err(flashmoe::Error::invalid(m));
        if self.batch == 0 || self.seqlen_q == 0 || self.seqlen_k == 0 {
            return invalid(format!(
                "MLA batch {}, seqlen_q {}, seqlen_k {} must each be >= 1",
                self.batch, self.seqlen_q, self.seqlen_k
            ));
        }
        if self.seqlen_q > MAX_SEQLEN_Q {
            return invalid(format!(
                "MLA seqlen_q {} must be in 1..={MAX_SEQLEN_Q}",
                self.seqlen_q
            ));
        }
        if !self.seqlens_k.is_empty()
            && (self.seqlens_k.len() != self.batch
                || self
                    .seqlens_k
                    .iter()
                    .any(|&n| n > self.seqlen_k || n < self.seqlen_q))
        {
            return invalid(format!(
                "seqlens_k {:?} must hold batch = {} values in seqlen_q {}..=seqlen_k {}",
                self.seqlens_k, self.batch, self.seqlen_q, self.seqlen_k
            ));
        }
        if self.seqlen_q > self.seqlen_k {
            return invalid(format!(
                "MLA seqlen_q {} must not exceed seqlen_k {} (every row sees a key)",
                self.seqlen_q, self.seqlen_k
            ));
        }
        self.class().validate()
    }

    /// Cache bytes the step must read (each visible 576-wide row once): the memory floor
    /// and the bytes of the report's GB/s.
    pub fn kv_bytes(&self) -> f64 {
        self.class().kv_bytes(&self.seqused()) as f64
    }

    /// 2 · Hq · (576 + 512) per (query row, visible key).
    pub fn flops(&self) -> f64 {
        self.class().flops(&self.seqused(), self.seqlen_q)
    }

    /// Pages per sequence (the block table's columns).
    pub fn max_blocks(&self) -> usize {
        self.seqlen_k.div_ceil(self.page_size)
    }

    /// Cache blocks in all.
    pub fn num_blocks(&self) -> usize {
        self.batch * self.max_blocks()
    }

    /// Elements of q, of the dense latent cache, of o and of lse.
    pub fn q_elems(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q * D_QK
    }
    pub fn latent_elems(&self) -> usize {
        self.batch * self.seqlen_k * D_QK
    }
    pub fn o_elems(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q * D_V
    }
    pub fn lse_elems(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q
    }

    /// A short stable identifier (the config id in reports).
    pub fn id(&self) -> String {
        let mut s = format!(
            "mla_b{}_hq{}_sq{}_sk{}_p{}_{}",
            self.batch, self.heads_q, self.seqlen_q, self.seqlen_k, self.page_size, self.dtype
        );
        if self.softmax_scale != deepseek_scale() {
            s += &format!("_scale{}", self.softmax_scale);
        }
        if !self.seqlens_k.is_empty() {
            s += &format!("_k{}", join(&self.seqlens_k, "-"));
        }
        s
    }
}

fn join(v: &[usize], sep: &str) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(sep)
}

impl fmt::Display for MlaProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "B={} Hq={} Sq={} Sk={} D=576/512 page={} {} MLA decode",
            self.batch, self.heads_q, self.seqlen_q, self.seqlen_k, self.page_size, self.dtype
        )?;
        if self.softmax_scale != deepseek_scale() {
            write!(f, " scale {}", self.softmax_scale)?;
        }
        if !self.seqlens_k.is_empty() {
            write!(f, " k{}", join(&self.seqlens_k, ","))?;
        }
        Ok(())
    }
}

/// The inputs: q in `x.q`, the dense latent cache `[B, Sk, 576]` in `x.k`, `x.v` empty
/// (the value is the latent's first 512 columns). The Python worker generates the same two
/// tensors (`flashmoe_inputs.mla_specs`).
pub fn generate_inputs(p: &MlaProblem, seed: u64) -> AttentionInputs {
    AttentionInputs {
        q: generate(seed, TensorId::Q, p.q_elems(), 1.0, p.dtype),
        k: generate(seed, TensorId::K, p.latent_elems(), 1.0, p.dtype),
        v: Vec::new(),
    }
}

/// The paged latent cache `[num_blocks, page_size, 576]` and its block table
/// `[batch, max_blocks]` (the decode suite's deterministic shuffle). Rows past a
/// sequence's keys are zero (never read).
pub struct PagedLatent {
    pub cache: Vec<f32>,
    pub table: Vec<i32>,
}

impl PagedLatent {
    pub fn build(p: &MlaProblem, latent: &[f32]) -> PagedLatent {
        let table = shuffled_blocks(p.num_blocks());
        let (ps, mb, sk) = (p.page_size, p.max_blocks(), p.seqlen_k);
        let mut cache = vec![0f32; p.num_blocks() * ps * D_QK];
        for b in 0..p.batch {
            for j in 0..mb {
                let keys = ps.min(sk - j * ps);
                let src = (b * sk + j * ps) * D_QK;
                let dst = table[b * mb + j] as usize * ps * D_QK;
                cache[dst..dst + keys * D_QK].copy_from_slice(&latent[src..src + keys * D_QK]);
            }
        }
        PagedLatent { cache, table }
    }
}

/// The library's f64 ground truth, one sequence per task: each sequence's call is
/// independent, so it runs as a batch-1 call over that sequence's keys alone, laid out in
/// pages of `page_size` (the last one zero-padded) with an identity table.
pub fn reference_f64(
    p: &MlaProblem,
    x: &AttentionInputs,
) -> flashmoe::Result<AttentionOutput<f64>> {
    let (sq, hq, sk, ps) = (p.seqlen_q, p.heads_q, p.seqlen_k, p.page_size);
    let rows = sq * hq;
    let seqused = p.seqused();
    let parts: Vec<AttentionOutput<f64>> = (0..p.batch)
        .into_par_iter()
        .map(|b| {
            let n = seqused[b];
            let pages = n.div_ceil(ps);
            let mut kv_cache = x.k[b * sk * D_QK..(b * sk + n) * D_QK].to_vec();
            kv_cache.resize(pages * ps * D_QK, 0.0);
            let spec = MlaDecodeSpec {
                batch: 1,
                seqlen_q: sq,
                heads_q: hq,
                d_qk: D_QK,
                d_v: D_V,
                num_blocks: pages,
                page_size: ps,
                max_blocks: pages,
                scale: p.softmax_scale as f64,
            };
            let inputs = MlaDecodeInputs {
                q: x.q[b * rows * D_QK..(b + 1) * rows * D_QK].to_vec(),
                kv_cache,
                block_table: (0..pages as i32).collect(),
                seqused_k: vec![n],
            };
            mla_decode_f64(&spec, &inputs)
        })
        .collect::<flashmoe::Result<_>>()?;
    let mut out = AttentionOutput {
        o: Vec::with_capacity(p.o_elems()),
        lse: Vec::with_capacity(p.lse_elems()),
    };
    for part in parts {
        out.o.extend(part.o);
        out.lse.extend(part.lse);
    }
    Ok(out)
}

/// Heads per task of [`blocked_f64`]: the sequence's keys are streamed once per group.
const HEAD_GROUP: usize = 32;

/// Four f64 dot products of `k` with `q[0..4]`, 8 partial sums each (vectorisable, and
/// each key element loaded once for four rows; the order differs from the library
/// reference's, the precision does not). Lengths are multiples of 8 (576).
fn dot8x4(q: &[Vec<f64>], k: &[f64]) -> [f64; 4] {
    let mut acc = [[0f64; 8]; 4];
    for e in (0..k.len()).step_by(8) {
        let kk = &k[e..e + 8];
        for (t, a) in acc.iter_mut().enumerate() {
            let qq = &q[t][e..e + 8];
            for i in 0..8 {
                a[i] += qq[i] * kk[i];
            }
        }
    }
    acc.map(|a| a.iter().sum())
}

const _: () = assert!(D_QK.is_multiple_of(8));

/// An independent f64 computation of the step on the dense latent cache: per (sequence,
/// group of heads) the scores of every row against every visible key (keys streamed once),
/// an exact softmax, then O accumulated key by key. Output layouts as [`reference_f64`].
pub fn blocked_f64(p: &MlaProblem, x: &AttentionInputs) -> flashmoe::Result<AttentionOutput<f64>> {
    p.validate()?;
    for (name, want, got) in [
        ("q", p.q_elems(), x.q.len()),
        ("latent cache", p.latent_elems(), x.k.len()),
    ] {
        if want != got {
            return Err(flashmoe::Error::invalid(format!(
                "MLA {name} holds {got} values, the problem needs {want}"
            )));
        }
    }
    let (sq, hq, sk) = (p.seqlen_q, p.heads_q, p.seqlen_k);
    let group = HEAD_GROUP.min(hq);
    let groups = hq.div_ceil(group);
    let seqused = p.seqused();
    let scale = p.softmax_scale as f64;
    // Task (b, g): rows (i, h) for h in the group; results [Sq][heads of the group].
    let tasks: Vec<(Vec<f64>, Vec<f64>)> = (0..p.batch * groups)
        .into_par_iter()
        .map(|t| {
            let (b, g) = (t / groups, t % groups);
            let heads = (g * group)..((g + 1) * group).min(hq);
            let nh = heads.len();
            let n = seqused[b];
            let rows = sq * nh;
            // Query rows (i, h) as f64, padded with zero rows to a multiple of 4.
            let mut qrows: Vec<Vec<f64>> = (0..sq)
                .flat_map(|i| heads.clone().map(move |h| (i, h)))
                .map(|(i, h)| {
                    let at = ((b * sq + i) * hq + h) * D_QK;
                    x.q[at..at + D_QK].iter().map(|&v| v as f64).collect()
                })
                .collect();
            qrows.resize(rows.next_multiple_of(4), vec![0f64; D_QK]);
            let visible = |r: usize| n - sq + r / nh + 1;
            let mut scores = vec![f64::NEG_INFINITY; rows * n];
            let mut key = vec![0f64; D_QK];
            for j in 0..n {
                let at = (b * sk + j) * D_QK;
                for (kd, &v) in key.iter_mut().zip(&x.k[at..at + D_QK]) {
                    *kd = v as f64;
                }
                for (c, four) in qrows.chunks(4).enumerate() {
                    for (t, d) in dot8x4(four, &key).into_iter().enumerate() {
                        let r = 4 * c + t;
                        if r < rows && j < visible(r) {
                            scores[r * n + j] = scale * d;
                        }
                    }
                }
            }
            let mut lse = vec![0f64; rows];
            for (r, s) in scores.chunks_mut(n).enumerate() {
                let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|&v| (v - m).exp()).sum();
                for v in s.iter_mut() {
                    *v = (*v - m).exp() / l;
                }
                lse[r] = m + l.ln();
            }
            // O += P V, four keys per pass over the rows (each O row loaded once per four).
            let mut o = vec![0f64; rows * D_V];
            let mut vals = vec![0f64; 4 * D_V];
            for j0 in (0..n).step_by(4) {
                let nk = 4.min(n - j0);
                for t in 0..4 {
                    let dst = &mut vals[t * D_V..(t + 1) * D_V];
                    if t < nk {
                        let at = (b * sk + j0 + t) * D_QK;
                        for (vd, &v) in dst.iter_mut().zip(&x.k[at..at + D_V]) {
                            *vd = v as f64;
                        }
                    } else {
                        dst.fill(0.0);
                    }
                }
                let (v0, rest) = vals.split_at(D_V);
                let (v1, rest) = rest.split_at(D_V);
                let (v2, v3) = rest.split_at(D_V);
                for (r, orow) in o.chunks_mut(D_V).enumerate() {
                    let w: [f64; 4] =
                        std::array::from_fn(|t| if t < nk { scores[r * n + j0 + t] } else { 0.0 });
                    if w == [0.0; 4] {
                        continue;
                    }
                    for d in 0..D_V {
                        orow[d] += w[0] * v0[d] + w[1] * v1[d] + w[2] * v2[d] + w[3] * v3[d];
                    }
                }
            }
            (o, lse)
        })
        .collect();
    let mut out = AttentionOutput {
        o: vec![0f64; p.o_elems()],
        lse: vec![0f64; p.lse_elems()],
    };
    for (t, (o, lse)) in tasks.into_iter().enumerate() {
        let (b, g) = (t / groups, t % groups);
        let h0 = g * group;
        let nh = group.min(hq - h0);
        for i in 0..sq {
            for k in 0..nh {
                let row = (b * sq + i) * hq + h0 + k;
                let r = i * nh + k;
                out.lse[row] = lse[r];
                out.o[row * D_V..(row + 1) * D_V].copy_from_slice(&o[r * D_V..(r + 1) * D_V]);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(b: usize, hq: usize, sq: usize, sk: usize) -> MlaProblem {
        MlaProblem::new(b, hq, sq, sk, 16, DType::Bf16)
    }

    /// The blocked computation equals the library's f64 reference on the shuffled paged
    /// cache: ragged lengths (1 = Sq, page ± 1), Sq 1..4, head groups split unevenly.
    #[test]
    fn blocked_equals_library_reference() {
        for (b, hq, sq, lens) in [
            (3, 5, 1, vec![1, 17, 40]),
            (2, 35, 4, vec![4, 15]),
            (2, 16, 2, vec![33, 33]),
        ] {
            let mut p = small(b, hq, sq, *lens.iter().max().unwrap());
            if lens.iter().any(|&n| n != p.seqlen_k) {
                p.seqlens_k = lens.clone();
            }
            p.softmax_scale = 0.11;
            p.validate().unwrap();
            let x = generate_inputs(&p, 7);
            assert!(x.v.is_empty());
            let r = reference_f64(&p, &x).unwrap();
            let f = blocked_f64(&p, &x).unwrap();
            assert_eq!((r.o.len(), r.lse.len()), (p.o_elems(), p.lse_elems()));
            let worst = |a: &[f64], b: &[f64]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f64::max)
            };
            assert!(worst(&r.o, &f.o) < 1e-12, "{p}: o");
            assert!(worst(&r.lse, &f.lse) < 1e-12, "{p}: lse");
            assert!(r.lse.iter().all(|v| v.is_finite()));
            // A sequence of one key (Sq = 1): O is that key's value row.
            if lens[0] == 1 {
                assert_eq!(
                    &r.o[..D_V],
                    &x.k[..D_V].iter().map(|&v| v as f64).collect::<Vec<_>>()[..]
                );
            }
        }
    }

    /// A page holds the dense rows it should, following the shuffled table.
    #[test]
    fn paged_latent_follows_the_table() {
        let p = small(2, 1, 1, 40);
        let x = generate_inputs(&p, 1);
        let paged = PagedLatent::build(&p, &x.k);
        assert_eq!(paged.table.len(), 2 * 3);
        // Key 35 of sequence 1: page 2, row 3.
        let blk = paged.table[3 + 2] as usize;
        let got = &paged.cache[(blk * 16 + 3) * D_QK..][..D_QK];
        assert_eq!(got, &x.k[(40 + 35) * D_QK..][..D_QK]);
    }

    #[test]
    fn byte_and_flop_models() {
        // DeepSeek-V3 B=128 Sk=4096 Sq=1: 576 bf16 columns per key read once.
        let p = MlaProblem::new(128, 128, 1, 4096, 64, DType::Bf16);
        p.validate().unwrap();
        assert_eq!(p.kv_bytes(), (128 * 4096 * 576 * 2) as f64);
        assert_eq!(p.flops(), 128.0 * 4096.0 * 128.0 * 2.0 * 1088.0);
        // 241 FLOP per cache byte at Hq = 128, Sq = 1.
        assert!((p.flops() / p.kv_bytes() - 241.8).abs() < 0.1);
        // Sq = 4: the rows see Sk-3..Sk keys (bottom-right causal); bytes unchanged.
        let q4 = MlaProblem::new(2, 16, 4, 100, 64, DType::F16);
        let pairs = (97 + 98 + 99 + 100) as f64;
        assert_eq!(q4.flops(), 2.0 * pairs * 16.0 * 2.0 * 1088.0);
        assert_eq!(q4.kv_bytes(), (2 * 100 * 576 * 2) as f64);
        let mut r = q4.clone();
        r.seqlens_k = vec![4, 100];
        assert_eq!(r.kv_bytes(), (104 * 576 * 2) as f64);
    }

    #[test]
    fn validation_and_ids_name_the_rule() {
        let bad = |p: MlaProblem| p.validate().unwrap_err().to_string();
        assert!(bad(small(1, 16, 17, 100)).contains("seqlen_q 17"));
        assert!(bad(small(1, 16, 4, 3)).contains("must not exceed seqlen_k"));
        let mut p = small(2, 16, 2, 100);
        p.seqlens_k = vec![1, 100];
        assert!(bad(p.clone()).contains("seqlens_k [1, 100]"));
        p.seqlens_k = vec![100];
        assert!(bad(p).contains("batch = 2"));
        let mut p = small(1, 16, 1, 100);
        p.page_size = 24;
        assert!(bad(p).contains("page_size 24"));
        let mut p = small(1, 16, 1, 100);
        p.dtype = DType::F32;
        assert!(bad(p).contains("f32"));
        let mut p = small(2, 128, 1, 100);
        assert_eq!(p.id(), "mla_b2_hq128_sq1_sk100_p16_bf16");
        p.seqlens_k = vec![5, 100];
        p.softmax_scale = 0.5;
        assert_eq!(p.id(), "mla_b2_hq128_sq1_sk100_p16_bf16_scale0.5_k5-100");
        assert!(
            p.to_string().ends_with("MLA decode scale 0.5 k5,100"),
            "{p}"
        );
        // The scale round-trips through JSON and defaults to DeepSeek's.
        let json = serde_json::to_string(&small(1, 16, 1, 64)).unwrap();
        let back: MlaProblem = serde_json::from_str(&json).unwrap();
        assert_eq!(back, small(1, 16, 1, 64));
        let no_scale = json.replace(&format!(",\"softmax_scale\":{}", deepseek_scale()), "");
        assert_ne!(no_scale, json);
        let back: MlaProblem = serde_json::from_str(&no_scale).unwrap();
        assert_eq!(back.softmax_scale, deepseek_scale());
    }
}
