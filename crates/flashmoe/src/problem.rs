//! Problem descriptions: shapes, validation, and the FLOP / minimum-byte models used for
//! every throughput figure flashmoe prints.

use crate::dtype::DType;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;

/// One attention forward problem. Layout of Q/O: (batch, seqlen_q, heads_q, head_dim);
/// K/V: (batch, seqlen_k, heads_kv, head_dim), all contiguous. Causal masking is aligned
/// bottom-right: query `i` sees keys `j <= i + seqlen_k - seqlen_q`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AttentionProblem {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub dtype: DType,
    /// Softmax scale; `None` means 1/sqrt(head_dim).
    #[serde(default)]
    pub softmax_scale: Option<f32>,
    /// Sliding window `(left, right)` around each query row's diagonal `d = i + seqlen_k -
    /// seqlen_q`: row `i` sees keys `d - left ..= d + right`, and -1 leaves a side unbounded
    /// (FlashAttention's `window_size`). `causal` bounds the right side at 0 whatever
    /// `right` says. [`NO_WINDOW`]: every key (within the causal limit).
    #[serde(default = "no_window")]
    pub window: (i32, i32),
    /// Logit softcap (Gemma-2): scores become `softcap · tanh(scores / softcap)` before the
    /// softmax; 0 = off.
    #[serde(default)]
    pub softcap: f32,
}

/// `(left, right) = (-1, -1)`: no sliding window.
pub const NO_WINDOW: (i32, i32) = (-1, -1);

fn no_window() -> (i32, i32) {
    NO_WINDOW
}

/// The rules every attention class applies to a window and a softcap: each side -1
/// (unbounded) or >= 0; the softcap finite and >= 0 (0 = off).
pub fn check_window_softcap(window: (i32, i32), softcap: f32) -> Result<()> {
    if window.0 < -1 || window.1 < -1 {
        return Err(Error::invalid(format!(
            "window {window:?}: each side is -1 (unbounded) or >= 0"
        )));
    }
    if !(softcap >= 0.0 && softcap.is_finite()) {
        return Err(Error::invalid(format!(
            "softcap {softcap} must be finite and >= 0 (0 = off)"
        )));
    }
    Ok(())
}

impl AttentionProblem {
    /// A self-attention problem with Sq = Sk and no GQA.
    pub fn new(
        batch: usize,
        heads: usize,
        seqlen: usize,
        head_dim: usize,
        causal: bool,
        dtype: DType,
    ) -> Self {
        AttentionProblem {
            batch,
            heads_q: heads,
            heads_kv: heads,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            head_dim,
            causal,
            dtype,
            softmax_scale: None,
            window: NO_WINDOW,
            softcap: 0.0,
        }
    }

    /// Check the problem is computable at all (backends add their own limits).
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("batch", self.batch),
            ("heads_q", self.heads_q),
            ("heads_kv", self.heads_kv),
            ("seqlen_q", self.seqlen_q),
            ("seqlen_k", self.seqlen_k),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("{name} must be at least 1, got 0")));
            }
        }
        if !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(Error::invalid(format!(
                "heads_q ({}) must be a multiple of heads_kv ({})",
                self.heads_q, self.heads_kv
            )));
        }
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::invalid(format!(
                    "softmax_scale must be finite and positive, got {s}"
                )));
            }
        }
        check_window_softcap(self.window, self.softcap)?;
        let elems = self.q_elems().max(self.kv_elems());
        if elems > (1usize << 40) {
            return Err(Error::invalid(format!(
                "tensor of {elems} elements is too large"
            )));
        }
        Ok(())
    }

    pub fn scale(&self) -> f32 {
        self.softmax_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Query heads per KV head (1 = MHA, heads_q = MQA).
    pub fn group_size(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    pub fn q_elems(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q * self.head_dim
    }
    pub fn kv_elems(&self) -> usize {
        self.batch * self.seqlen_k * self.heads_kv * self.head_dim
    }
    pub fn lse_elems(&self) -> usize {
        self.batch * self.heads_q * self.seqlen_q
    }

    /// The window as the kernels apply it: `(left, right)` with `causal` folded into the
    /// right side (0), -1 = unbounded.
    pub fn effective_window(&self) -> (i32, i32) {
        (self.window.0, if self.causal { 0 } else { self.window.1 })
    }

    /// Whether some key is hidden by a window bound other than the causal one.
    pub fn has_window(&self) -> bool {
        let (l, r) = self.effective_window();
        l >= 0 || r > 0
    }

    /// The keys query row `i` may attend to: `lo..hi` (empty when none).
    pub fn visible_range(&self, i: usize) -> std::ops::Range<usize> {
        let sk = self.seqlen_k as i64;
        let d = i as i64 + sk - self.seqlen_q as i64;
        let (left, right) = self.effective_window();
        let hi = if right < 0 {
            sk
        } else {
            (d + right as i64 + 1).clamp(0, sk)
        };
        let lo = if left < 0 {
            0
        } else {
            (d - left as i64).clamp(0, sk)
        };
        lo as usize..hi.max(lo) as usize
    }

    /// Number of keys query row `i` may attend to.
    pub fn visible_keys(&self, i: usize) -> usize {
        self.visible_range(i).len()
    }

    /// Unmasked (query, key) pairs per (batch, head).
    pub fn unmasked_pairs(&self) -> u64 {
        if self.effective_window() == NO_WINDOW {
            return self.seqlen_q as u64 * self.seqlen_k as u64;
        }
        (0..self.seqlen_q)
            .map(|i| self.visible_keys(i) as u64)
            .sum()
    }

    /// FlashAttention convention: 4·B·Hq·(unmasked pairs)·D (two GEMMs, 2 flops per MAC).
    pub fn flops(&self) -> f64 {
        4.0 * self.batch as f64
            * self.heads_q as f64
            * self.unmasked_pairs() as f64
            * self.head_dim as f64
    }

    /// Minimum bytes: Q, K, V read once; O written once in `dtype`; LSE written in f32.
    pub fn min_bytes(&self) -> f64 {
        let e = self.dtype.size_bytes() as f64;
        (2 * self.q_elems() + 2 * self.kv_elems()) as f64 * e + self.lse_elems() as f64 * 4.0
    }

    /// A short stable identifier, used as the config id in reports.
    pub fn id(&self) -> String {
        let mut s = format!(
            "attn_b{}_hq{}_hkv{}_sq{}_sk{}_d{}_{}_{}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            if self.causal { "causal" } else { "full" },
            self.dtype
        );
        if let Some(sc) = self.softmax_scale {
            s.push_str(&format!("_scale{sc}"));
        }
        if self.window != NO_WINDOW {
            s.push_str(&format!("_w{}_{}", self.window.0, self.window.1));
        }
        if self.softcap > 0.0 {
            s.push_str(&format!("_cap{}", self.softcap));
        }
        s
    }
}

impl fmt::Display for AttentionProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "B={} Hq={} Hkv={} Sq={} Sk={} D={} {} {}",
            self.batch,
            self.heads_q,
            self.heads_kv,
            self.seqlen_q,
            self.seqlen_k,
            self.head_dim,
            if self.causal { "causal" } else { "non-causal" },
            self.dtype
        )?;
        if self.window != NO_WINDOW {
            write!(f, " window=({},{})", self.window.0, self.window.1)?;
        }
        if self.softcap > 0.0 {
            write!(f, " softcap={}", self.softcap)?;
        }
        Ok(())
    }
}

/// Router scoring function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scoring {
    Softmax,
    Sigmoid,
}

impl std::str::FromStr for Scoring {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "softmax" => Ok(Scoring::Softmax),
            "sigmoid" => Ok(Scoring::Sigmoid),
            o => Err(format!(
                "unknown scoring '{o}': expected softmax or sigmoid"
            )),
        }
    }
}

/// One MoE layer forward problem: x (tokens, hidden) → router (hidden, experts) → top-k
/// experts, each a SwiGLU MLP with W13 (hidden, 2·intermediate: gate then up) and
/// W2 (intermediate, hidden) → weighted combine (tokens, hidden).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeProblem {
    pub tokens: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub experts: usize,
    pub top_k: usize,
    pub scoring: Scoring,
    /// Renormalise the k selected weights to sum to 1.
    pub renormalize: bool,
    pub dtype: DType,
    /// Add a shared expert (same intermediate size) applied to every token with weight 1.
    #[serde(default)]
    pub shared_expert: bool,
}

impl MoeProblem {
    pub fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("tokens", self.tokens),
            ("hidden", self.hidden),
            ("intermediate", self.intermediate),
            ("experts", self.experts),
            ("top_k", self.top_k),
        ] {
            if v == 0 {
                return Err(Error::invalid(format!("{name} must be at least 1, got 0")));
            }
        }
        if self.top_k > self.experts {
            return Err(Error::invalid(format!(
                "top_k ({}) must not exceed experts ({})",
                self.top_k, self.experts
            )));
        }
        Ok(())
    }

    /// Router GEMM plus 6·H·I flops per (token, expert) assignment (gate+up: 4·H·I,
    /// down: 2·H·I), plus the shared expert if any. Elementwise work is not counted.
    pub fn flops(&self) -> f64 {
        let (t, h, i) = (
            self.tokens as f64,
            self.hidden as f64,
            self.intermediate as f64,
        );
        let router = 2.0 * t * h * self.experts as f64;
        let per_assignment = 6.0 * h * i;
        let assignments = t * (self.top_k as f64 + if self.shared_expert { 1.0 } else { 0.0 });
        router + assignments * per_assignment
    }

    /// Bytes of one expert's weights (W13 and W2).
    pub fn expert_weight_bytes(&self) -> f64 {
        3.0 * self.hidden as f64 * self.intermediate as f64 * self.dtype.size_bytes() as f64
    }

    /// Minimum bytes given how many experts received at least one token: x read, output
    /// written, router weights read, and the touched experts' weights read once.
    pub fn min_bytes(&self, touched_experts: usize) -> f64 {
        let e = self.dtype.size_bytes() as f64;
        let act = 2.0 * self.tokens as f64 * self.hidden as f64 * e;
        let router = self.hidden as f64 * self.experts as f64 * e;
        let shared = if self.shared_expert {
            self.expert_weight_bytes()
        } else {
            0.0
        };
        act + router + touched_experts as f64 * self.expert_weight_bytes() + shared
    }

    pub fn id(&self) -> String {
        format!(
            "moe_t{}_h{}_i{}_e{}_k{}_{}{}_{}{}",
            self.tokens,
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
            match self.scoring {
                Scoring::Softmax => "softmax",
                Scoring::Sigmoid => "sigmoid",
            },
            if self.renormalize { "_renorm" } else { "" },
            self.dtype,
            if self.shared_expert { "_shared" } else { "" }
        )
    }
}

impl fmt::Display for MoeProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "T={} H={} I={} E={} k={} {:?}{} {}",
            self.tokens,
            self.hidden,
            self.intermediate,
            self.experts,
            self.top_k,
            self.scoring,
            if self.renormalize { " renorm" } else { "" },
            self.dtype
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_flops_full_and_causal() {
        let p = AttentionProblem::new(2, 3, 4, 8, false, DType::F16);
        assert_eq!(p.flops(), 4.0 * 2.0 * 3.0 * 16.0 * 8.0);
        let c = AttentionProblem {
            causal: true,
            ..p.clone()
        };
        // 1 + 2 + 3 + 4 = 10 visible pairs
        assert_eq!(c.unmasked_pairs(), 10);
        assert_eq!(c.flops(), 4.0 * 2.0 * 3.0 * 10.0 * 8.0);
    }

    #[test]
    fn causal_bottom_right_alignment() {
        // Sq=2, Sk=5: query 0 sees keys 0..=3, query 1 sees all 5.
        let p = AttentionProblem {
            seqlen_q: 2,
            seqlen_k: 5,
            ..AttentionProblem::new(1, 1, 1, 8, true, DType::Bf16)
        };
        assert_eq!(p.visible_keys(0), 4);
        assert_eq!(p.visible_keys(1), 5);
        // Sq=5, Sk=2: the first 3 queries see nothing.
        let q = AttentionProblem {
            seqlen_q: 5,
            seqlen_k: 2,
            ..p
        };
        assert_eq!(
            (0..5).map(|i| q.visible_keys(i)).collect::<Vec<_>>(),
            vec![0, 0, 0, 1, 2]
        );
        assert_eq!(q.unmasked_pairs(), 3);
    }

    #[test]
    fn validation_names_the_problem() {
        let mut p = AttentionProblem::new(1, 8, 16, 64, false, DType::Bf16);
        p.heads_kv = 3;
        let e = p.validate().unwrap_err().to_string();
        assert!(
            e.contains("heads_q (8)") && e.contains("heads_kv (3)"),
            "{e}"
        );
        p.heads_kv = 2;
        assert!(p.validate().is_ok());
        p.seqlen_k = 0;
        assert!(p.validate().unwrap_err().to_string().contains("seqlen_k"));
        let m = MoeProblem {
            tokens: 4,
            hidden: 8,
            intermediate: 16,
            experts: 2,
            top_k: 3,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        };
        assert!(m.validate().unwrap_err().to_string().contains("top_k (3)"));
    }

    #[test]
    fn moe_models() {
        let m = MoeProblem {
            tokens: 2048,
            hidden: 4096,
            intermediate: 11008,
            experts: 32,
            top_k: 2,
            scoring: Scoring::Softmax,
            renormalize: true,
            dtype: DType::Bf16,
            shared_expert: false,
        };
        // All 32 experts touched: 8.66 GB of weights (DESIGN.md's 2.9 ms floor at 3 TB/s).
        let gb = m.min_bytes(32) / 1e9;
        assert!((8.6..8.8).contains(&gb), "{gb}");
        let expect = 2.0 * 2048.0 * 4096.0 * 32.0 + 2048.0 * 2.0 * 6.0 * 4096.0 * 11008.0;
        assert_eq!(m.flops(), expect);
    }
}
