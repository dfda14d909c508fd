//! The lab's varlen problem: one packed prefill call over sequences of unequal lengths
//! (issue 22), FlashAttention's `flash_attn_varlen_func` layout, run by
//! [`flashmoe::attention::VarlenPlan`].
//!
//! Layouts (what every implementation reads and writes, and what the gate compares): q and
//! o `(total_q, heads_q, head_dim)`, k and v `(total_k, heads_kv, head_dim)`, sequence `b`
//! rows `cu_q[b] .. cu_q[b + 1]` of q and `cu_k[b] .. cu_k[b + 1]` of k/v; lse
//! `(heads_q, total_q)` f32, natural log. Causal and windows are bottom-right per sequence
//! (query `i` of a sequence of lengths `(sq, sk)` has diagonal `i + sk - sq`). A sequence
//! may be empty: `sq = 0` has nothing to compute; `sk = 0` gives its rows O = 0 and
//! LSE = -inf, as does a causal row that sees no key.
//!
//! Inputs are the dense generator's tensors of the packed shape
//! ([`VarlenProblem::packed`]: one batch-1 attention problem of `total_q` queries and
//! `total_k` keys), so the Python worker reproduces them bit for bit
//! (`python/flashmoe_inputs.py`, kind `varlen`).
//!
//! The model FLOPs and bytes are the sums of the sequences' dense models: sequence `b` is
//! the batch-1 [`AttentionProblem`] of [`VarlenProblem::sequence`].

pub mod config;
pub mod gpu;

use flashmoe::attention::AttentionClass;
use flashmoe::reference::{AttentionInputs, AttentionOutput};
use flashmoe::{AttentionProblem, DType};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One varlen prefill call: the `(seqlen_q, seqlen_k)` of every sequence, one attention
/// class (heads, head dim, mask, dtype, scale, window, softcap) for all of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VarlenProblem {
    /// `(seqlen_q, seqlen_k)` per sequence, in packing order.
    pub seqlens: Vec<(usize, usize)>,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// Bottom-right per sequence: query `i` sees keys `j <= i + sk - sq`.
    pub causal: bool,
    pub dtype: DType,
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    #[serde(default)]
    pub softmax_scale: Option<f32>,
    /// Sliding window `(left, right)` around each row's diagonal, -1 unbounded
    /// ([`AttentionProblem::window`]).
    #[serde(default = "no_window")]
    pub window: (i32, i32),
    /// Logit softcap; 0 = off.
    #[serde(default)]
    pub softcap: f32,
}

fn no_window() -> (i32, i32) {
    flashmoe::problem::NO_WINDOW
}

/// Most elements one packed tensor may hold (the dense problem's limit).
const MAX_ELEMS: usize = 1 << 40;

impl VarlenProblem {
    /// Self-attention (`sq = sk`) over sequences of `lens` tokens, no window or softcap.
    pub fn new(
        lens: &[usize],
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
        causal: bool,
        dtype: DType,
    ) -> VarlenProblem {
        VarlenProblem {
            seqlens: lens.iter().map(|&l| (l, l)).collect(),
            heads_q,
            heads_kv,
            head_dim,
            causal,
            dtype,
            softmax_scale: None,
            window: no_window(),
            softcap: 0.0,
        }
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.seqlens.len()
    }

    /// Packed query rows (q and o hold this many rows of Hq · D).
    pub fn total_q(&self) -> usize {
        self.seqlens.iter().map(|s| s.0).sum()
    }

    /// Packed key rows (k and v hold this many rows of Hkv · D).
    pub fn total_k(&self) -> usize {
        self.seqlens.iter().map(|s| s.1).sum()
    }

    /// The longest query sequence.
    pub fn max_seqlen_q(&self) -> usize {
        self.seqlens.iter().map(|s| s.0).max().unwrap_or(0)
    }

    /// The longest key sequence.
    pub fn max_seqlen_k(&self) -> usize {
        self.seqlens.iter().map(|s| s.1).max().unwrap_or(0)
    }

    /// `cu_seqlens_q` `[batch + 1]`: sequence `b` is query rows `cu[b] .. cu[b + 1]`.
    pub fn cu_seqlens_q(&self) -> Vec<usize> {
        offsets(self.seqlens.iter().map(|s| s.0))
    }

    /// `cu_seqlens_k` `[batch + 1]`.
    pub fn cu_seqlens_k(&self) -> Vec<usize> {
        offsets(self.seqlens.iter().map(|s| s.1))
    }

    /// Every sequence has as many keys as queries.
    pub fn is_self_attention(&self) -> bool {
        self.seqlens.iter().all(|&(q, k)| q == k)
    }

    /// Every sequence has the same lengths: the problem is also a dense batch
    /// ([`VarlenProblem::dense`]).
    pub fn is_uniform(&self) -> bool {
        self.seqlens.windows(2).all(|w| w[0] == w[1])
    }

    /// The attention class shared by every sequence (what a [`flashmoe::attention::VarlenPlan`]
    /// is built for).
    pub fn class(&self) -> AttentionClass {
        AttentionClass {
            dtype: self.dtype,
            head_dim: self.head_dim,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            causal: self.causal,
            softmax_scale: self.softmax_scale,
            window: self.window,
            softcap: self.softcap,
        }
    }

    /// Sequence `b` alone: the batch-1 dense problem of its lengths (its FLOP and byte
    /// models, its reference). May have a zero length (not computable on its own).
    pub fn sequence(&self, b: usize) -> AttentionProblem {
        let (sq, sk) = self.seqlens[b];
        self.class().problem(1, sq, sk)
    }

    /// The packed tensors as one batch-1 attention problem (`total_q` queries, `total_k`
    /// keys): its generated inputs are this problem's inputs. It is not the same
    /// attention (every query would see every sequence's keys).
    pub fn packed(&self) -> AttentionProblem {
        AttentionProblem {
            window: no_window(),
            softcap: 0.0,
            causal: false,
            ..self.class().problem(1, self.total_q(), self.total_k())
        }
    }

    /// The same problem as a dense batch `(B, S, H, D)` when every sequence has the same
    /// lengths (the packed `(B · S, H, D)` tensors are the dense ones), else `None`.
    pub fn dense(&self) -> Option<AttentionProblem> {
        let &(sq, sk) = self.seqlens.first()?;
        (self.is_uniform() && sq > 0 && sk > 0).then(|| self.class().problem(self.batch(), sq, sk))
    }

    /// Check the problem is computable: at least one sequence, at least one query and one
    /// key row in all (a sequence may be empty), the dense problem's rules for heads, head
    /// dim, scale, window and softcap, tensor sizes. Kernel limits (dtype, head dim) are
    /// the GPU implementation's.
    pub fn validate(&self) -> flashmoe::Result<()> {
        if self.seqlens.is_empty() {
            return Err(flashmoe::Error::invalid(
                "a varlen problem needs at least one sequence (seqlens is empty)",
            ));
        }
        let (tq, tk) = (self.total_q(), self.total_k());
        if tq == 0 || tk == 0 {
            return Err(flashmoe::Error::invalid(format!(
                "varlen total_q = {tq} and total_k = {tk} must each be at least 1 (every \
                 sequence is empty on that side)"
            )));
        }
        // Heads, head dim, scale, window and softcap: the dense rules on the longest
        // lengths (each >= 1 here).
        self.class()
            .problem(1, self.max_seqlen_q(), self.max_seqlen_k())
            .validate()?;
        let elems = (tq * self.heads_q).max(tk * self.heads_kv) as u128 * self.head_dim as u128;
        if elems > MAX_ELEMS as u128 {
            return Err(flashmoe::Error::invalid(format!(
                "packed tensor of {elems} elements is too large"
            )));
        }
        Ok(())
    }

    /// Model FLOPs: the sum over sequences of the dense problem's (4 · Hq · visible pairs
    /// · D, masked pairs not counted; causal and window honoured).
    pub fn flops(&self) -> f64 {
        (0..self.batch()).map(|b| self.sequence(b).flops()).sum()
    }

    /// Minimum bytes: q, k, v read once, o written once in `dtype`, lse in f32 (the sum of
    /// the sequences' dense minimum bytes: the packed tensors).
    pub fn min_bytes(&self) -> f64 {
        let e = self.dtype.size_bytes() as f64;
        let (tq, tk) = (self.total_q() as f64, self.total_k() as f64);
        let (hq, hkv, d) = (
            self.heads_q as f64,
            self.heads_kv as f64,
            self.head_dim as f64,
        );
        (2.0 * tq * hq * d + 2.0 * tk * hkv * d) * e + tq * hq * 4.0
    }

    /// A short stable identifier, used as the config id in reports: sequence count, total
    /// tokens, length range, the class, and a hash of the exact lengths (two length lists
    /// with the same summary get different ids).
    pub fn id(&self) -> String {
        let range = |v: &[usize]| {
            format!(
                "{}-{}",
                v.iter().min().unwrap_or(&0),
                v.iter().max().unwrap_or(&0)
            )
        };
        let (lq, lk) = self.lens();
        let mut s = format!("varlen_n{}_t{}", self.batch(), self.total_q());
        if !self.is_self_attention() {
            s += &format!("-{}", self.total_k());
        }
        s += &format!("_s{}", range(&lq));
        if !self.is_self_attention() {
            s += &format!("_k{}", range(&lk));
        }
        s += &format!(
            "_hq{}_hkv{}_d{}_{}_{}",
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            if self.causal { "causal" } else { "full" },
            self.dtype
        );
        if let Some(sc) = self.softmax_scale {
            s += &format!("_scale{sc}");
        }
        if self.window != no_window() {
            s += &format!("_w{}_{}", self.window.0, self.window.1);
        }
        if self.softcap > 0.0 {
            s += &format!("_cap{}", self.softcap);
        }
        format!("{s}_{:08x}", self.lengths_hash() as u32)
    }

    /// Query and key lengths as two lists.
    fn lens(&self) -> (Vec<usize>, Vec<usize>) {
        self.seqlens.iter().copied().unzip()
    }

    /// FNV-1a over the lengths (for the id).
    fn lengths_hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &(q, k) in &self.seqlens {
            for x in [q as u64, k as u64] {
                for b in x.to_le_bytes() {
                    h ^= b as u64;
                    h = h.wrapping_mul(0x0000_0100_0000_01B3);
                }
            }
        }
        h
    }
}

impl fmt::Display for VarlenProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (lq, lk) = self.lens();
        let side = |v: &[usize], total: usize| {
            format!(
                "{total} (len {}..{})",
                v.iter().min().unwrap_or(&0),
                v.iter().max().unwrap_or(&0)
            )
        };
        write!(f, "varlen {} seqs, ", self.batch())?;
        if self.is_self_attention() {
            write!(f, "tokens {}", side(&lq, self.total_q()))?;
        } else {
            write!(
                f,
                "q {}, k {}",
                side(&lq, self.total_q()),
                side(&lk, self.total_k())
            )?;
        }
        write!(
            f,
            " Hq={} Hkv={} D={} {} {}",
            self.heads_q,
            self.heads_kv,
            self.head_dim,
            if self.causal { "causal" } else { "non-causal" },
            self.dtype
        )?;
        if let Some(sc) = self.softmax_scale {
            write!(f, " scale={sc}")?;
        }
        if self.window != no_window() {
            write!(f, " window=({},{})", self.window.0, self.window.1)?;
        }
        if self.softcap > 0.0 {
            write!(f, " softcap={}", self.softcap)?;
        }
        Ok(())
    }
}

fn offsets(lens: impl Iterator<Item = usize>) -> Vec<usize> {
    let mut cu = vec![0];
    for l in lens {
        cu.push(cu.last().unwrap() + l);
    }
    cu
}

/// `n` lengths uniform in `lo..=hi` from a 64-bit LCG (Knuth's MMIX constants): length =
/// `lo + (s >> 33) % (hi - lo + 1)`. `random_lengths(22, 16, 100, 4000)` are issue 22's
/// varlen lengths (`examples/varlen_probe.rs`, `tools/probes/varlen_baseline.py`).
pub fn random_lengths(seed: u64, n: usize, lo: usize, hi: usize) -> Vec<usize> {
    assert!(lo <= hi, "random_lengths: lo {lo} > hi {hi}");
    let span = (hi - lo + 1) as u64;
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + ((s >> 33) % span) as usize
        })
        .collect()
}

/// Run `attend` on every sequence with query rows, on the batch-1 problem of
/// [`VarlenProblem::sequence`] and its slices of the packed inputs, and scatter the outputs
/// into the packed layout (o `(total_q, Hq, D)`, lse `(Hq, total_q)`). Sequences without
/// keys are not passed to `attend`: their rows get O = 0 and LSE = -inf (what the kernel
/// writes, and the limit of a row that sees no key).
pub fn per_sequence<T, E>(
    p: &VarlenProblem,
    x: &AttentionInputs,
    mut attend: impl FnMut(&AttentionProblem, &AttentionInputs) -> Result<AttentionOutput<T>, E>,
) -> Result<AttentionOutput<T>, E>
where
    T: Copy + From<f32>,
    E: From<flashmoe::Error>,
{
    let (hq, hkv, d) = (p.heads_q, p.heads_kv, p.head_dim);
    let (tq, tk) = (p.total_q(), p.total_k());
    for (name, want, got) in [
        ("q", tq * hq * d, x.q.len()),
        ("k", tk * hkv * d, x.k.len()),
        ("v", tk * hkv * d, x.v.len()),
    ] {
        if want != got {
            return Err(flashmoe::Error::invalid(format!(
                "varlen input {name} holds {got} elements but the packed shape needs {want}"
            ))
            .into());
        }
    }
    let (cu_q, cu_k) = (p.cu_seqlens_q(), p.cu_seqlens_k());
    let mut o = vec![T::from(0.0); tq * hq * d];
    let mut lse = vec![T::from(f32::NEG_INFINITY); hq * tq];
    let (rq, rk) = (hq * d, hkv * d);
    for (b, &(sq, sk)) in p.seqlens.iter().enumerate() {
        if sq == 0 || sk == 0 {
            continue;
        }
        let (q0, k0) = (cu_q[b], cu_k[b]);
        let inputs = AttentionInputs {
            q: x.q[q0 * rq..(q0 + sq) * rq].to_vec(),
            k: x.k[k0 * rk..(k0 + sk) * rk].to_vec(),
            v: x.v[k0 * rk..(k0 + sk) * rk].to_vec(),
        };
        let r = attend(&p.sequence(b), &inputs)?;
        if r.o.len() != sq * rq || r.lse.len() != hq * sq {
            return Err(flashmoe::Error::invalid(format!(
                "sequence {b}: the per-sequence attention returned {} / {} O / LSE values, \
                 expected {} / {}",
                r.o.len(),
                r.lse.len(),
                sq * rq,
                hq * sq
            ))
            .into());
        }
        o[q0 * rq..(q0 + sq) * rq].copy_from_slice(&r.o);
        // The sequence's lse is (1, Hq, sq): head h's rows go to lse[h, q0 .. q0 + sq].
        for h in 0..hq {
            lse[h * tq + q0..h * tq + q0 + sq].copy_from_slice(&r.lse[h * sq..(h + 1) * sq]);
        }
    }
    Ok(AttentionOutput { o, lse })
}

/// The f64 ground truth: the CPU f64 reference on each sequence alone
/// ([`flashmoe::reference::attention_f64`]), scattered into the packed layout.
pub fn reference_f64(
    p: &VarlenProblem,
    x: &AttentionInputs,
) -> flashmoe::Result<AttentionOutput<f64>> {
    per_sequence(p, x, flashmoe::reference::attention_f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashmoe::reference::attention_f64;

    fn ragged() -> VarlenProblem {
        let mut p = VarlenProblem::new(&[], 8, 2, 64, true, DType::Bf16);
        p.seqlens = vec![(5, 5), (0, 3), (4, 9), (3, 0), (7, 2), (1, 1)];
        p
    }

    /// Visible (query, key) pairs of one sequence, straight from the mask's definition.
    fn brute_pairs(sq: usize, sk: usize, causal: bool, window: (i32, i32)) -> u64 {
        let mut n = 0;
        for i in 0..sq as i64 {
            let d = i + sk as i64 - sq as i64;
            for j in 0..sk as i64 {
                let right = if causal { 0 } else { window.1 };
                let ok_r = right < 0 || j <= d + right as i64;
                let ok_l = window.0 < 0 || j >= d - window.0 as i64;
                n += (ok_r && ok_l) as u64;
            }
        }
        n
    }

    #[test]
    fn flops_and_bytes_are_the_sum_over_sequences() {
        for (causal, window) in [
            (false, (-1, -1)),
            (true, (-1, -1)),
            (true, (3, -1)),
            (false, (2, 1)),
        ] {
            let mut p = ragged();
            p.causal = causal;
            p.window = window;
            p.validate().unwrap();
            let (hq, hkv, d) = (8.0, 2.0, 64.0);
            let pairs: u64 = p
                .seqlens
                .iter()
                .map(|&(q, k)| brute_pairs(q, k, causal, window))
                .sum();
            assert_eq!(
                p.flops(),
                4.0 * hq * d * pairs as f64,
                "{causal} {window:?}"
            );
            // Brute-force bytes: each sequence's q, k, v read and o written (bf16), lse f32.
            let bytes: f64 = p
                .seqlens
                .iter()
                .map(|&(q, k)| {
                    let (q, k) = (q as f64, k as f64);
                    (2.0 * q * hq * d + 2.0 * k * hkv * d) * 2.0 + q * hq * 4.0
                })
                .sum();
            assert_eq!(p.min_bytes(), bytes);
            // ... which is the sum of the dense models of the sequences.
            let dense: f64 = (0..p.batch()).map(|b| p.sequence(b).min_bytes()).sum();
            assert_eq!(p.min_bytes(), dense);
        }
        // Non-causal self-attention: 4 · H · D · Σ l².
        let p = VarlenProblem::new(&[3, 10, 1], 4, 4, 128, false, DType::F16);
        assert_eq!(p.flops(), 4.0 * 4.0 * 128.0 * (9.0 + 100.0 + 1.0));
    }

    #[test]
    fn offsets_lengths_and_ids() {
        let p = ragged();
        assert_eq!((p.total_q(), p.total_k()), (20, 20));
        assert_eq!(p.cu_seqlens_q(), [0, 5, 5, 9, 12, 19, 20]);
        assert_eq!(p.cu_seqlens_k(), [0, 5, 8, 17, 17, 19, 20]);
        assert_eq!((p.max_seqlen_q(), p.max_seqlen_k()), (7, 9));
        assert!(!p.is_self_attention() && !p.is_uniform() && p.dense().is_none());
        assert!(
            p.id()
                .starts_with("varlen_n6_t20-20_s0-7_k0-9_hq8_hkv2_d64_causal_bf16_"),
            "{}",
            p.id()
        );
        assert!(
            p.to_string()
                .starts_with("varlen 6 seqs, q 20 (len 0..7), k 20 (len 0..9)"),
            "{p}"
        );
        // Same summary, other lengths: another id.
        let mut q = p.clone();
        q.seqlens.swap(0, 5);
        q.seqlens[0] = (5, 5);
        q.seqlens[5] = (1, 1);
        assert_eq!(q, p);
        q.seqlens[2] = (3, 9);
        q.seqlens[5] = (2, 1);
        assert_ne!(q.id(), p.id());
        let u = VarlenProblem::new(&[7, 7, 7], 4, 2, 128, false, DType::Bf16);
        assert!(u.is_uniform() && u.is_self_attention());
        let d = u.dense().unwrap();
        assert_eq!((d.batch, d.seqlen_q, d.seqlen_k, d.heads_kv), (3, 7, 7, 2));
        assert_eq!(d.flops(), u.flops());
        assert!(u
            .id()
            .starts_with("varlen_n3_t21_s7-7_hq4_hkv2_d128_full_bf16_"));
    }

    #[test]
    fn validation_names_the_rule() {
        let bad = |p: VarlenProblem| p.validate().unwrap_err().to_string();
        let mut p = ragged();
        p.seqlens.clear();
        assert!(bad(p).contains("at least one sequence"));
        let mut p = ragged();
        p.seqlens = vec![(0, 4), (0, 0)];
        assert!(bad(p).contains("total_q = 0"));
        let mut p = ragged();
        p.seqlens = vec![(3, 0)];
        assert!(bad(p).contains("total_k = 0"));
        let mut p = ragged();
        p.heads_kv = 3;
        assert!(bad(p).contains("heads_kv (3)"));
        let mut p = ragged();
        p.window = (-2, 0);
        assert!(bad(p).contains("window"));
        let mut p = ragged();
        p.softcap = -1.0;
        assert!(bad(p).contains("softcap"));
        let mut p = ragged();
        p.head_dim = 0;
        assert!(bad(p).contains("head_dim"));
    }

    #[test]
    fn reference_is_each_sequence_alone_in_the_packed_layout() {
        let mut p = ragged();
        p.seqlens.push((6, 6));
        let x = AttentionInputs::generate(&p.packed(), 7);
        let (hq, rq, rk) = (p.heads_q, p.heads_q * p.head_dim, p.heads_kv * p.head_dim);
        assert_eq!((x.q.len(), x.k.len()), (p.total_q() * rq, p.total_k() * rk));
        let r = reference_f64(&p, &x).unwrap();
        let tq = p.total_q();
        let (cu_q, cu_k) = (p.cu_seqlens_q(), p.cu_seqlens_k());
        for (b, &(sq, sk)) in p.seqlens.iter().enumerate() {
            let q0 = cu_q[b];
            let o = &r.o[q0 * rq..(q0 + sq) * rq];
            let lse = |h: usize, i: usize| r.lse[h * tq + q0 + i];
            if sk == 0 {
                assert!(o.iter().all(|&v| v == 0.0));
                assert!((0..sq).all(|i| lse(0, i) == f64::NEG_INFINITY));
                continue;
            }
            if sq == 0 {
                continue;
            }
            let k0 = cu_k[b];
            let alone = attention_f64(
                &p.sequence(b),
                &AttentionInputs {
                    q: x.q[q0 * rq..(q0 + sq) * rq].to_vec(),
                    k: x.k[k0 * rk..(k0 + sk) * rk].to_vec(),
                    v: x.v[k0 * rk..(k0 + sk) * rk].to_vec(),
                },
            )
            .unwrap();
            assert_eq!(o, &alone.o[..], "seq {b}");
            for h in 0..hq {
                for i in 0..sq {
                    assert_eq!(lse(h, i), alone.lse[h * sq + i], "seq {b} h {h} row {i}");
                }
            }
        }
        // Causal (7, 2): the first 5 rows see no key.
        let b = 4;
        let q0 = cu_q[b];
        assert_eq!(r.lse[q0], f64::NEG_INFINITY);
        assert!(r.lse[q0 + 6].is_finite());
        // Inputs of the wrong size are refused.
        let short = AttentionInputs {
            q: x.q[1..].to_vec(),
            ..x.clone()
        };
        assert!(reference_f64(&p, &short)
            .unwrap_err()
            .to_string()
            .contains("varlen input q"));
    }

    #[test]
    fn random_lengths_are_the_probe_s() {
        // examples/varlen_probe.rs and tools/probes/varlen_baseline.py draw these lengths too.
        assert_eq!(
            random_lengths(22, 16, 100, 4000),
            [
                985, 2886, 3860, 1234, 3035, 1455, 2770, 429, 2329, 2045, 427, 688, 566, 3987,
                3795, 982
            ]
        );
        let short = random_lengths(5, 200, 1, 3);
        assert!(short.iter().all(|l| (1..=3).contains(l)));
        assert!((1..=3).all(|l| short.contains(&l)));
    }

    #[test]
    fn serde_round_trip_with_defaults() {
        let p = ragged();
        let v = serde_json::to_value(&p).unwrap();
        assert_eq!(v["seqlens"][1], serde_json::json!([0, 3]));
        let back: VarlenProblem = serde_json::from_value(v).unwrap();
        assert_eq!(back, p);
        let min = serde_json::json!({
            "seqlens": [[4, 4]], "heads_q": 2, "heads_kv": 1, "head_dim": 64,
            "causal": false, "dtype": "f16"
        });
        let m: VarlenProblem = serde_json::from_value(min).unwrap();
        assert_eq!(
            (m.window, m.softcap, m.softmax_scale),
            ((-1, -1), 0.0, None)
        );
    }
}
