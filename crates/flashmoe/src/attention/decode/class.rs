//! What a decode plan is built for ([`DecodeClass`]): its validation and the byte and FLOP
//! models of a step.

use super::abi::{HEAD_DIMS, MAX_Q_PER_SEQ};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What a decode plan is built for; batch, Sq (<= `max_q_per_seq`) and the cache come per
/// call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeClass {
    /// bf16 or f16 (q, caches, o).
    pub dtype: DType,
    /// 64, 128 or 256.
    pub head_dim: usize,
    pub heads_q: usize,
    /// Divides `heads_q`.
    pub heads_kv: usize,
    /// Keys per cache block: a multiple of 16; 0 = any (taken from the cache per call; a
    /// size that is not a multiple of 16 then needs a one-block table, the dense case).
    pub page_size: usize,
    /// Most query rows per sequence of a call, 1..=16.
    pub max_q_per_seq: usize,
    /// (left, right) around each row's diagonal; -1 = unbounded. (-1, 0) is causal.
    pub window: (i32, i32),
    /// Logit softcap (scores = softcap · tanh(scores / softcap)); 0 = off.
    pub softcap: f32,
    /// Multiplies q·k; None is 1/sqrt(head_dim).
    pub softmax_scale: Option<f32>,
}

impl DecodeClass {
    /// Causal decode of `max_q_per_seq` rows, no window or softcap.
    pub fn causal(
        dtype: DType,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        page_size: usize,
        max_q_per_seq: usize,
    ) -> DecodeClass {
        DecodeClass {
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            page_size,
            max_q_per_seq,
            window: (-1, 0),
            softcap: 0.0,
            softmax_scale: None,
        }
    }

    /// Check the class; errors name the field and the rule.
    pub fn validate(&self) -> Result<()> {
        if !matches!(self.dtype, DType::Bf16 | DType::F16) {
            return Err(Error::invalid(format!(
                "decode dtype {} is not supported (bf16 or f16)",
                self.dtype
            )));
        }
        if !HEAD_DIMS.contains(&self.head_dim) {
            return Err(Error::invalid(format!(
                "decode head_dim {} is not supported (one of {HEAD_DIMS:?})",
                self.head_dim
            )));
        }
        if self.heads_kv == 0 || self.heads_q == 0 || self.heads_q % self.heads_kv != 0 {
            return Err(Error::invalid(format!(
                "heads_q {} must be a positive multiple of heads_kv {}",
                self.heads_q, self.heads_kv
            )));
        }
        if self.heads_kv > 65_535 {
            return Err(Error::invalid(format!(
                "heads_kv {} exceeds the grid's y limit 65535",
                self.heads_kv
            )));
        }
        if self.page_size % 16 != 0 || self.page_size > i32::MAX as usize {
            return Err(Error::invalid(format!(
                "page_size {} must be a multiple of 16 (or 0: from the cache per call)",
                self.page_size
            )));
        }
        if self.max_q_per_seq == 0 || self.max_q_per_seq > MAX_Q_PER_SEQ {
            return Err(Error::invalid(format!(
                "max_q_per_seq {} must be in 1..={MAX_Q_PER_SEQ}",
                self.max_q_per_seq
            )));
        }
        crate::problem::check_window_softcap(self.window, self.softcap)?;
        if let Some(s) = self.softmax_scale {
            if !s.is_finite() || s <= 0.0 {
                return Err(Error::invalid(format!(
                    "softmax_scale {s} must be finite and > 0"
                )));
            }
        }
        Ok(())
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    pub fn scale(&self) -> f32 {
        self.softmax_scale
            .unwrap_or(1.0 / (self.head_dim as f32).sqrt())
    }

    /// Keys visible to some query row of a sequence with `seqused` keys and `seqlen_q` rows
    /// (the union of the rows' windows): what a decode step must read.
    pub fn visible_keys(&self, seqused: usize, seqlen_q: usize) -> usize {
        let d0 = seqused as i64 - seqlen_q as i64;
        let lo = if self.window.0 < 0 {
            0
        } else {
            (d0 - self.window.0 as i64).max(0)
        };
        let hi = if self.window.1 < 0 {
            seqused as i64
        } else {
            (d0 + seqlen_q as i64 - 1 + self.window.1 as i64 + 1).clamp(0, seqused as i64)
        };
        (hi - lo).max(0) as usize
    }

    /// Bytes of K and V a decode step must read (the memory floor): visible keys × Hkv × D ×
    /// 2 (K and V) × element size, summed over the sequences. For GB/s reports.
    pub fn kv_bytes(&self, seqused: &[usize], seqlen_q: usize) -> u64 {
        let per_key = (self.heads_kv * self.head_dim * 2 * self.dtype.size_bytes()) as u64;
        seqused
            .iter()
            .map(|&n| self.visible_keys(n, seqlen_q) as u64 * per_key)
            .sum()
    }

    /// [`DecodeClass::kv_bytes`] plus q and o (read and written once) and lse.
    pub fn min_bytes(&self, seqused: &[usize], seqlen_q: usize) -> u64 {
        let b = seqused.len() as u64;
        let rows = b * seqlen_q as u64 * self.heads_q as u64;
        self.kv_bytes(seqused, seqlen_q)
            + rows * (2 * self.head_dim * self.dtype.size_bytes() + 4) as u64
    }

    /// FLOPs of a decode step (4 · Sq · Hq · visible keys · D per sequence; masked pairs not
    /// counted).
    pub fn flops(&self, seqused: &[usize], seqlen_q: usize) -> f64 {
        let mut pairs = 0u64;
        for &n in seqused {
            for i in 0..seqlen_q {
                let d = n as i64 - seqlen_q as i64 + i as i64;
                let lo = if self.window.0 < 0 {
                    0
                } else {
                    (d - self.window.0 as i64).max(0)
                };
                let hi = if self.window.1 < 0 {
                    n as i64
                } else {
                    (d + self.window.1 as i64 + 1).clamp(0, n as i64)
                };
                pairs += (hi - lo).max(0) as u64;
            }
        }
        4.0 * pairs as f64 * self.heads_q as f64 * self.head_dim as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn class_validation_names_the_rule() {
        let ok = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 4);
        ok.validate().unwrap();
        let e = DecodeClass { heads_q: 30, ..ok }.validate().unwrap_err();
        assert!(e.to_string().contains("multiple of heads_kv"), "{e}");
        let e = DecodeClass {
            page_size: 24,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("page_size 24"), "{e}");
        let e = DecodeClass {
            max_q_per_seq: 17,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("max_q_per_seq 17"), "{e}");
        let e = DecodeClass { head_dim: 96, ..ok }.validate().unwrap_err();
        assert!(e.to_string().contains("head_dim 96"), "{e}");
        let e = DecodeClass {
            window: (-2, 0),
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        let e = DecodeClass {
            softcap: -1.0,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("softcap"), "{e}");
        let e = DecodeClass {
            dtype: DType::F32,
            ..ok
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("f32"), "{e}");
        DecodeClass { page_size: 0, ..ok }.validate().unwrap();
    }

    #[test]
    fn byte_and_flop_models() {
        let c = DecodeClass::causal(DType::Bf16, 128, 32, 8, 16, 1);
        // Sk = 8192, one sequence: 8192 · 8 · 128 · 2 · 2 = 32 MiB.
        assert_eq!(c.kv_bytes(&[8192], 1), 32 << 20);
        assert_eq!(c.flops(&[8192], 1), 4.0 * 8192.0 * 32.0 * 128.0);
        // Window of 100 left: 101 keys per row; Sq = 4 reads 104 keys.
        let w = DecodeClass {
            window: (100, 0),
            ..c
        };
        assert_eq!(w.visible_keys(1000, 1), 101);
        assert_eq!(w.visible_keys(1000, 4), 104);
        assert_eq!(w.visible_keys(50, 4), 50);
        // seqused < Sq with causal: the first rows see nothing.
        assert_eq!(c.visible_keys(2, 4), 2);
        assert_eq!(c.flops(&[2], 4), 4.0 * (1.0 + 2.0) * 32.0 * 128.0);
    }
}
