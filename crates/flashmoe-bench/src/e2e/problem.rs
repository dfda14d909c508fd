//! An end-to-end config's problem: which model, inference or a training step, at which
//! batch × sequence shape. Named by the results model (`results::ProblemSpec::E2e`), so it
//! imports nothing of the lab; `e2e/mod.rs` gives it its `Workload` description.

use flashmoe::DType;
use serde::{Deserialize, Serialize};

/// What an e2e config measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum E2eMode {
    /// One prefill forward over batch × seq tokens (logits of every token).
    Inference,
    /// One training step: forward, next-token cross-entropy, backward, AdamW.
    Train,
}

/// One decoder-only model at one batch × sequence shape (`python/flashmoe_e2e.py`'s
/// MODELS): pre-norm blocks of GQA attention with RoPE and a SwiGLU MLP (dense) or a
/// softmax top-k MoE of SwiGLU experts, an LM head of `vocab` logits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct E2eProblem {
    pub model: String,
    pub mode: E2eMode,
    /// The model's shape (its fields sit at the top level of the JSON).
    #[serde(flatten)]
    pub shape: ModelShape,
    pub batch: usize,
    pub seq: usize,
    pub dtype: DType,
    /// `Train`: steps per implementation (the loss curve's length).
    #[serde(default)]
    pub steps: Option<usize>,
}

impl E2eProblem {
    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }

    /// Model FLOPs of one forward: the projections, the causal attention (the
    /// FlashAttention convention, 4·B·Hq·pairs·D), the MLP or MoE (router + 6·H·I per
    /// token and expert), the LM head.
    pub fn forward_flops(&self) -> f64 {
        let t = self.tokens() as f64;
        let (h, d) = (self.shape.hidden as f64, self.shape.head_dim as f64);
        let (hq, hkv) = (self.shape.heads as f64, self.shape.kv_heads as f64);
        let s = self.seq as f64;
        let proj = 2.0 * t * h * (hq + 2.0 * hkv) * d + 2.0 * t * hq * d * h;
        let attn = 4.0 * self.batch as f64 * hq * (s * (s + 1.0) / 2.0) * d;
        let sh = &self.shape;
        let mlp = match (sh.experts, sh.top_k, sh.moe_ffn, sh.ffn) {
            (Some(e), Some(k), Some(i), _) => {
                2.0 * t * h * e as f64 + k as f64 * 6.0 * t * h * i as f64
            }
            (_, _, _, Some(f)) => 6.0 * t * h * f as f64,
            _ => 0.0,
        };
        self.shape.layers as f64 * (proj + attn + mlp) + 2.0 * t * h * self.shape.vocab as f64
    }
}

/// The model's shape as the script's MODELS table gives it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    #[serde(default)]
    pub ffn: Option<usize>,
    #[serde(default)]
    pub experts: Option<usize>,
    #[serde(default)]
    pub top_k: Option<usize>,
    #[serde(default)]
    pub moe_ffn: Option<usize>,
    pub vocab: usize,
}
