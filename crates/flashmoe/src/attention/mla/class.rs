//! [`MlaDecodeClass`]: what a plan is built for, its validation and FLOP count.

use super::abi::*;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What an MLA decode plan is built for; batch, Sq and the cache come per call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaDecodeClass {
    /// bf16 or f16 (q, cache, o).
    pub dtype: DType,
    /// Query heads (DeepSeek-V3: 128; any >= 1).
    pub heads_q: usize,
    /// Width of q and of a cache row: 576.
    pub head_dim_qk: usize,
    /// Width of the value (the row's first columns) and of o: 512.
    pub head_dim_v: usize,
    /// Keys per cache block: a positive multiple of 16 (DeepSeek: 64).
    pub page_size: usize,
    /// Most query rows per sequence of a call (1 decode, 2..4 speculative), <= 16.
    pub max_q_per_seq: usize,
    /// Most sequences of a call (sizes the workspace).
    pub max_batch: usize,
    /// Most keys of a sequence (sizes the workspace; also the default of a call's bound).
    pub max_seqlen_k: usize,
    /// Multiplies q·k (finite, > 0).
    pub softmax_scale: f32,
}

impl MlaDecodeClass {
    /// DeepSeek-V3's decode: 128 heads, 576/512, page 64, scale 1/sqrt(192).
    pub fn deepseek_v3(
        dtype: DType,
        max_q_per_seq: usize,
        max_batch: usize,
        max_seqlen_k: usize,
    ) -> MlaDecodeClass {
        MlaDecodeClass {
            dtype,
            heads_q: 128,
            head_dim_qk: D_QK,
            head_dim_v: D_V,
            page_size: 64,
            max_q_per_seq,
            max_batch,
            max_seqlen_k,
            softmax_scale: 1.0 / (192f32).sqrt(),
        }
    }

    /// Check the class; errors name the field and the rule.
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::invalid(format!(
                "MLA decode dtype {} is not supported (bf16 or f16)",
                self.dtype
            )));
        }
        if self.head_dim_qk != D_QK || self.head_dim_v != D_V {
            return Err(Error::invalid(format!(
                "MLA decode head dims {}/{} have no kernel (only {D_QK}/{D_V}: latent 512 + \
                 rotary 64)",
                self.head_dim_qk, self.head_dim_v
            )));
        }
        if self.heads_q == 0 || self.heads_q > 65_536 {
            return Err(Error::invalid(format!(
                "heads_q {} must be in 1..=65536",
                self.heads_q
            )));
        }
        if self.page_size == 0 || self.page_size % 16 != 0 || self.page_size > 1 << 20 {
            return Err(Error::invalid(format!(
                "page_size {} must be a positive multiple of 16 (at most 2^20)",
                self.page_size
            )));
        }
        if self.max_q_per_seq == 0 || self.max_q_per_seq > MAX_Q_PER_SEQ {
            return Err(Error::invalid(format!(
                "max_q_per_seq {} must be in 1..={MAX_Q_PER_SEQ}",
                self.max_q_per_seq
            )));
        }
        if self.max_batch == 0 || self.max_batch > 65_535 {
            return Err(Error::invalid(format!(
                "max_batch {} must be in 1..=65535 (the grid's y limit)",
                self.max_batch
            )));
        }
        if self.max_seqlen_k == 0 || self.max_seqlen_k > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "max_seqlen_k {} must be in 1..=2^31-1",
                self.max_seqlen_k
            )));
        }
        // Output rows (token, head) are 32-bit in the kernels.
        let rows = self.max_batch * self.max_q_per_seq * self.heads_q;
        if rows > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "max_batch {} × max_q_per_seq {} × heads_q {} = {rows} output rows exceeds 2^31-1",
                self.max_batch, self.max_q_per_seq, self.heads_q
            )));
        }
        if !self.softmax_scale.is_finite() || self.softmax_scale <= 0.0 {
            return Err(Error::invalid(format!(
                "softmax_scale {} must be finite and > 0",
                self.softmax_scale
            )));
        }
        Ok(())
    }

    /// CTAs per (sequence, split) at `sq` rows: ceil(Hq · Sq / 64).
    pub fn m_blocks(&self, sq: usize) -> usize {
        (self.heads_q * sq).div_ceil(BLOCK_M)
    }

    /// Keys visible to some row of a sequence of `seqused` keys (causal: all of them).
    pub fn visible_keys(&self, seqused: usize) -> usize {
        seqused
    }

    /// Cache bytes a decode step must read (each visible row of 576 once): the memory floor.
    pub fn kv_bytes(&self, seqused: &[usize]) -> u64 {
        let row = (D_QK * self.dtype.size_bytes()) as u64;
        seqused.iter().map(|&n| n as u64 * row).sum()
    }

    /// FLOPs of a decode step: per (row, visible key) 2·576 (q·k) + 2·512 (p·v).
    pub fn flops(&self, seqused: &[usize], seqlen_q: usize) -> f64 {
        let mut pairs = 0u64;
        for &n in seqused {
            for i in 0..seqlen_q {
                let hi = n as i64 - seqlen_q as i64 + i as i64 + 1;
                pairs += hi.clamp(0, n as i64) as u64;
            }
        }
        pairs as f64 * self.heads_q as f64 * 2.0 * (D_QK + D_V) as f64
    }
}
