//! The lab's decode problem: one paged-KV decode step (issue 22), causal bottom-right, every
//! sequence holding `seqlen_k` keys, and the paged cache built from the dense inputs.
//!
//! Inputs are the dense attention inputs of [`DecodeProblem::dense`] (q `[B, Sq, Hq, D]`,
//! k/v `[B, Sk, Hkv, D]`, the deterministic generator): the dense baselines read them as
//! they are, and [`PagedCache::build`] copies the same K/V rows into pages of
//! `page_size` keys whose block ids follow a shuffled (deterministic) block table, so every
//! implementation sees identical K/V values.
//!
//! The check matrix's variants (`flashmoe check --suite decode`) go beyond the plain step:
//! a window and softcap, ragged cache lengths (`seqlens_k`: the first keys of each
//! sequence's rows) and mixed batches (`seqlens_q`: the first rows of each sequence's
//! queries, packed with `cu_seqlens_q`). Only the paged plan and the f64 reference run
//! them (the dense baselines state a plain causal step).

pub mod config;
pub mod gpu;

use flashmoe::attention::decode::DecodeClass;
use flashmoe::reference::decode::{paged_decode_f64, PagedDecodeInputs, PagedDecodeSpec};
use flashmoe::reference::{AttentionInputs, AttentionOutput};
use flashmoe::{AttentionProblem, DType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Most query rows per sequence of a decode problem (the decode plan's limit).
pub const MAX_SEQLEN_Q: usize = flashmoe::attention::decode::MAX_Q_PER_SEQ;

/// Seed of the block-table shuffle (fixed: the table is part of the problem, not of the
/// run's inputs).
const TABLE_SEED: u64 = 0x00de_c0de_5eed;

/// One decode step: `batch` sequences of `seqlen_q` new query rows against `seqlen_k`
/// cached keys each (causal, bottom-right: row `i` sees keys `j <= seqlen_k - seqlen_q + i`),
/// the cache in pages of `page_size` keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeProblem {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub head_dim: usize,
    /// Keys per cache page (a multiple of 16).
    pub page_size: usize,
    pub dtype: DType,
    /// (left, right) keys around each row's diagonal, -1 unbounded; (-1, 0) is causal.
    #[serde(default = "causal_window")]
    pub window: (i32, i32),
    /// Logit softcap; 0 = off.
    #[serde(default)]
    pub softcap: f32,
    /// Ragged cache: keys of each sequence (each <= seqlen_k); empty = seqlen_k each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seqlens_k: Vec<usize>,
    /// Mixed batch: query rows of each sequence (each <= seqlen_q, packed q with
    /// cu_seqlens_q); empty = seqlen_q each, q `[B, Sq, Hq, D]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub seqlens_q: Vec<usize>,
}

fn causal_window() -> (i32, i32) {
    (-1, 0)
}

impl DecodeProblem {
    /// Causal decode of `seqlen_q` rows per sequence, bf16/f16 per `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        batch: usize,
        heads_q: usize,
        heads_kv: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        head_dim: usize,
        page_size: usize,
        dtype: DType,
    ) -> DecodeProblem {
        DecodeProblem {
            batch,
            heads_q,
            heads_kv,
            seqlen_q,
            seqlen_k,
            head_dim,
            page_size,
            dtype,
            window: causal_window(),
            softcap: 0.0,
            seqlens_k: Vec::new(),
            seqlens_q: Vec::new(),
        }
    }

    /// The plain causal step of uniform lengths: what the dense baselines compute.
    pub fn is_plain(&self) -> bool {
        self.window == causal_window()
            && self.softcap == 0.0
            && self.seqlens_k.is_empty()
            && self.seqlens_q.is_empty()
    }

    /// Keys of each sequence.
    pub fn seqused(&self) -> Vec<usize> {
        if self.seqlens_k.is_empty() {
            vec![self.seqlen_k; self.batch]
        } else {
            self.seqlens_k.clone()
        }
    }

    /// Query rows of each sequence.
    pub fn rows_q(&self) -> Vec<usize> {
        if self.seqlens_q.is_empty() {
            vec![self.seqlen_q; self.batch]
        } else {
            self.seqlens_q.clone()
        }
    }

    /// `cu_seqlens_q` of a mixed batch (None: uniform rows).
    pub fn cu_seqlens_q(&self) -> Option<Vec<usize>> {
        (!self.seqlens_q.is_empty()).then(|| {
            let mut cu = vec![0];
            for &n in &self.seqlens_q {
                cu.push(cu.last().unwrap() + n);
            }
            cu
        })
    }

    /// Query tokens of the step (o has this many rows of Hq · D).
    pub fn total_q(&self) -> usize {
        self.rows_q().iter().sum()
    }

    /// The packed q of a mixed batch: the first `seqlens_q[b]` rows of each sequence of the
    /// dense q `[B, Sq, Hq, D]` (the dense q itself for uniform rows).
    pub fn pack_q(&self, dense_q: &[f32]) -> Vec<f32> {
        if self.seqlens_q.is_empty() {
            return dense_q.to_vec();
        }
        let row = self.heads_q * self.head_dim;
        let mut q = Vec::with_capacity(self.total_q() * row);
        for (b, &n) in self.seqlens_q.iter().enumerate() {
            let at = b * self.seqlen_q * row;
            q.extend_from_slice(&dense_q[at..at + n * row]);
        }
        q
    }

    /// The same attention on a dense cache: its inputs are the decode problem's inputs.
    /// Bottom-right causal; with one query row the last row sees every key, so Sq = 1 is
    /// stated as non-causal (no mask needed by the dense baselines).
    pub fn dense(&self) -> AttentionProblem {
        AttentionProblem {
            batch: self.batch,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            seqlen_q: self.seqlen_q,
            seqlen_k: self.seqlen_k,
            head_dim: self.head_dim,
            causal: self.seqlen_q > 1,
            dtype: self.dtype,
            softmax_scale: None,
            window: flashmoe::problem::NO_WINDOW,
            softcap: 0.0,
        }
    }

    /// The decode plan's class for this problem (its window and softcap).
    pub fn class(&self) -> DecodeClass {
        DecodeClass {
            window: self.window,
            softcap: self.softcap,
            ..DecodeClass::causal(
                self.dtype,
                self.head_dim,
                self.heads_q,
                self.heads_kv,
                self.page_size,
                self.seqlen_q,
            )
        }
    }

    /// Check the problem is computable: the dense problem's rules, 1 ≤ Sq ≤
    /// [`MAX_SEQLEN_Q`], Sq ≤ Sk (every row sees a key), a page size that is a positive
    /// multiple of 16. Kernel limits (dtype, head dim) are the GPU implementation's.
    pub fn validate(&self) -> flashmoe::Result<()> {
        self.dense().validate()?;
        if self.seqlen_q > MAX_SEQLEN_Q {
            return Err(flashmoe::Error::invalid(format!(
                "decode seqlen_q {} must be in 1..={MAX_SEQLEN_Q}",
                self.seqlen_q
            )));
        }
        if self.seqlen_q > self.seqlen_k {
            return Err(flashmoe::Error::invalid(format!(
                "decode seqlen_q {} must not exceed seqlen_k {}",
                self.seqlen_q, self.seqlen_k
            )));
        }
        if self.page_size == 0 || !self.page_size.is_multiple_of(16) {
            return Err(flashmoe::Error::invalid(format!(
                "page_size {} must be a positive multiple of 16",
                self.page_size
            )));
        }
        for (name, lens, max) in [
            ("seqlens_k", &self.seqlens_k, self.seqlen_k),
            ("seqlens_q", &self.seqlens_q, self.seqlen_q),
        ] {
            if !lens.is_empty() && (lens.len() != self.batch || lens.iter().any(|&n| n > max)) {
                return Err(flashmoe::Error::invalid(format!(
                    "{name} {lens:?} must hold batch = {} values of at most {max}",
                    self.batch
                )));
            }
        }
        // Every row sees a key (its diagonal): no row of the check matrix is empty.
        for (b, (q, k)) in self.rows_q().iter().zip(self.seqused()).enumerate() {
            if *q > k {
                return Err(flashmoe::Error::invalid(format!(
                    "sequence {b}: {q} query rows but {k} keys (rows must not exceed keys)"
                )));
            }
        }
        self.class().validate()?;
        Ok(())
    }

    /// Bytes of K and V the step must read (each visible key once): the memory floor, and
    /// the bytes of the GB/s figures of a decode report.
    pub fn kv_bytes(&self) -> f64 {
        let c = self.class();
        self.seqused()
            .iter()
            .zip(self.rows_q())
            .map(|(&k, q)| c.kv_bytes(&[k], q) as f64)
            .sum()
    }

    /// 4 · Sq-rows · Hq · visible keys · D (masked pairs not counted).
    pub fn flops(&self) -> f64 {
        let c = self.class();
        self.seqused()
            .iter()
            .zip(self.rows_q())
            .map(|(&k, q)| c.flops(&[k], q))
            .sum()
    }

    /// Pages per sequence (the block table's columns).
    pub fn max_blocks(&self) -> usize {
        self.seqlen_k.div_ceil(self.page_size)
    }

    /// Cache blocks in all (one per page of every sequence).
    pub fn num_blocks(&self) -> usize {
        self.batch * self.max_blocks()
    }

    /// A short stable identifier, used as the config id in reports.
    pub fn id(&self) -> String {
        format!(
            "decode_b{}_hq{}_hkv{}_sq{}_sk{}_d{}_p{}_{}{}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            self.page_size,
            self.dtype,
            self.variant("_", "-")
        )
    }

    /// The variant fields that are set, each as `<sep>name<value>` (lists joined by `join`).
    fn variant(&self, sep: &str, join: &str) -> String {
        let list = |v: &[usize]| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(join)
        };
        let mut s = String::new();
        if self.window != causal_window() {
            s += &format!("{sep}w{}{join}{}", self.window.0, self.window.1);
        }
        if self.softcap != 0.0 {
            s += &format!("{sep}cap{}", self.softcap);
        }
        if !self.seqlens_k.is_empty() {
            s += &format!("{sep}k{}", list(&self.seqlens_k));
        }
        if !self.seqlens_q.is_empty() {
            s += &format!("{sep}q{}", list(&self.seqlens_q));
        }
        s
    }
}

impl fmt::Display for DecodeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "B={} Hq={} Hkv={} Sq={} Sk={} D={} page={} {} decode",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            self.page_size,
            self.dtype
        )?;
        f.write_str(&self.variant(" ", ","))
    }
}

/// splitmix64 step.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The block table `[batch, max_blocks]`: a deterministic shuffle of `0..num_blocks`
/// (page `j` of sequence `b` lives in block `table[b · max_blocks + j]`).
pub fn block_table(p: &DecodeProblem) -> Vec<i32> {
    shuffled_blocks(p.num_blocks())
}

/// A deterministic shuffle of `0..n` (the block ids of the lab's paged caches: decode and
/// MLA).
pub fn shuffled_blocks(n: usize) -> Vec<i32> {
    let mut perm: Vec<i32> = (0..n as i32).collect();
    let mut state = TABLE_SEED;
    for i in (1..n).rev() {
        let j = (next(&mut state) % (i as u64 + 1)) as usize;
        perm.swap(i, j);
    }
    perm
}

/// A paged K/V cache `[num_blocks, page_size, Hkv, D]` holding the dense K/V, with its
/// block table. Rows past `seqlen_k` in a sequence's last page are zero (never read).
pub struct PagedCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub table: Vec<i32>,
}

impl PagedCache {
    /// Copy the dense `[B, Sk, Hkv, D]` K/V of `x` into pages following [`block_table`].
    pub fn build(p: &DecodeProblem, x: &AttentionInputs) -> PagedCache {
        let table = block_table(p);
        let row = p.heads_kv * p.head_dim;
        let (ps, mb, sk) = (p.page_size, p.max_blocks(), p.seqlen_k);
        let paginate = |dense: &[f32]| {
            let mut out = vec![0f32; p.num_blocks() * ps * row];
            for b in 0..p.batch {
                for j in 0..mb {
                    let keys = ps.min(sk - j * ps);
                    let src = (b * sk + j * ps) * row;
                    let dst = table[b * mb + j] as usize * ps * row;
                    out[dst..dst + keys * row].copy_from_slice(&dense[src..src + keys * row]);
                }
            }
            out
        };
        PagedCache {
            k: paginate(&x.k),
            v: paginate(&x.v),
            table,
        }
    }
}

/// The f64 ground truth of the problem on its paged cache (the library's
/// `paged_decode_f64`).
pub fn reference_f64(
    p: &DecodeProblem,
    x: &AttentionInputs,
) -> flashmoe::Result<AttentionOutput<f64>> {
    let cache = PagedCache::build(p, x);
    let spec = PagedDecodeSpec {
        batch: p.batch,
        seqlen_q: p.seqlen_q,
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        num_blocks: p.num_blocks(),
        page_size: p.page_size,
        max_blocks: p.max_blocks(),
        window: (p.window.0 as i64, p.window.1 as i64),
        softcap: p.softcap as f64,
        scale: p.class().scale() as f64,
    };
    let inputs = PagedDecodeInputs {
        q: p.pack_q(&x.q),
        k_cache: cache.k,
        v_cache: cache.v,
        block_table: cache.table,
        seqused_k: p.seqused(),
        cu_seqlens_q: p.cu_seqlens_q(),
    };
    paged_decode_f64(&spec, &inputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::reference::attention_f64;

    fn small(sq: usize, sk: usize) -> DecodeProblem {
        DecodeProblem::new(2, 8, 2, sq, sk, 64, 16, DType::Bf16)
    }

    #[test]
    fn table_is_a_deterministic_shuffle() {
        let p = small(1, 100);
        assert_eq!(p.max_blocks(), 7);
        let t = block_table(&p);
        assert_eq!(t, block_table(&p));
        let mut sorted = t.clone();
        sorted.sort();
        assert_eq!(sorted, (0..14).collect::<Vec<i32>>());
        assert_ne!(t, sorted, "the table is shuffled");
    }

    #[test]
    fn paged_reference_equals_dense_reference() {
        // Ragged last pages (100 = 6 · 16 + 4) and Sq = 1 and 4 (bottom-right causal).
        for sq in [1, 4] {
            let p = small(sq, 100);
            p.validate().unwrap();
            let x = AttentionInputs::generate(&p.dense(), 3);
            let paged = reference_f64(&p, &x).unwrap();
            let mut dense_problem = p.dense();
            dense_problem.causal = true;
            let dense = attention_f64(&dense_problem, &x).unwrap();
            let diff = paged
                .o
                .iter()
                .zip(&dense.o)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            assert!(diff < 1e-12, "sq={sq}: {diff}");
            for (a, b) in paged.lse.iter().zip(&dense.lse) {
                assert!((a - b).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn byte_and_flop_models() {
        // Issue 22's first row: 33.5 MB of KV (452 GB/s at 74.3 µs).
        let p = DecodeProblem::new(1, 32, 8, 1, 8192, 128, 16, DType::Bf16);
        assert_eq!(p.kv_bytes(), (8192 * 8 * 128 * 2 * 2) as f64);
        assert_eq!(p.flops(), 4.0 * 32.0 * 8192.0 * 128.0);
        // Sq = 4: every row reads the union of the rows' keys (all of them).
        let q4 = DecodeProblem::new(2, 8, 2, 4, 100, 64, 16, DType::Bf16);
        assert_eq!(q4.kv_bytes(), (2 * 100 * 2 * 64 * 2 * 2) as f64);
        assert_eq!(q4.flops(), q4.dense().flops());
        assert!(!p.dense().causal && q4.dense().causal);
    }

    /// The variants: packed rows of a mixed batch, per-sequence byte and FLOP models, ids,
    /// and the reference in the packed layout (o [total_q, Hq, D], lse [Hq, total_q]).
    #[test]
    fn variants_pack_and_model() {
        let mut p = small(4, 100);
        p.seqlens_q = vec![1, 4];
        p.seqlens_k = vec![33, 100];
        p.window = (10, 0);
        p.softcap = 30.0;
        p.validate().unwrap();
        assert!(!p.is_plain());
        assert_eq!(p.cu_seqlens_q(), Some(vec![0, 1, 5]));
        let x = AttentionInputs::generate(&p.dense(), 9);
        let row = p.heads_q * p.head_dim;
        let q = p.pack_q(&x.q);
        assert_eq!(q.len(), 5 * row);
        assert_eq!(&q[..row], &x.q[..row]);
        assert_eq!(&q[row..], &x.q[4 * row..8 * row]);
        // Window 10 left: 11 keys for the last row; the 4 rows of sequence 1 read 14.
        let per_key = (p.heads_kv * p.head_dim * 2 * 2) as f64;
        assert_eq!(p.kv_bytes(), (11.0 + 14.0) * per_key);
        let r = reference_f64(&p, &x).unwrap();
        assert_eq!((r.o.len(), r.lse.len()), (5 * row, 5 * p.heads_q));
        assert!(r.lse.iter().all(|l| l.is_finite()));
        assert!(p.id().ends_with("_w10-0_cap30_k33-100_q1-4"), "{}", p.id());
        assert!(p.to_string().ends_with(" w10,0 cap30 k33,100 q1,4"), "{p}");
        let mut bad = p.clone();
        bad.seqlens_k = vec![0, 100];
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("1 query rows but 0 keys"));
        bad.seqlens_k = vec![33];
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("seqlens_k"));
    }

    #[test]
    fn validation_names_the_rule() {
        let bad = |p: DecodeProblem| p.validate().unwrap_err().to_string();
        assert!(bad(small(17, 100)).contains("seqlen_q 17"));
        assert!(bad(small(8, 4)).contains("must not exceed seqlen_k"));
        let mut p = small(1, 100);
        p.page_size = 24;
        assert!(bad(p).contains("page_size 24"));
        let mut p = small(1, 100);
        p.heads_kv = 3;
        assert!(bad(p).contains("heads_kv"));
        assert!(small(1, 100)
            .id()
            .starts_with("decode_b2_hq8_hkv2_sq1_sk100_d64_p16"));
    }
}
