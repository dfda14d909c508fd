//! A call's workspace: the byte offsets of every intermediate ([`WorkspaceLayout`]),
//! 256-byte aligned regions carved in pipeline order, overflow checked.

use super::class::MoeClass;
use crate::error::{Error, Result};

/// Alignment of every workspace region and of the workspace base.
pub const WORKSPACE_ALIGN: usize = 256;

/// Byte offsets of the intermediates in a call's workspace (each 256-byte aligned) and
/// its total size. T tokens, R = T·k routed rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// [T, E] f32 router logits.
    pub logits: usize,
    /// [T, E] f32 normalised scores (for the aux loss).
    pub probs: usize,
    /// \[T\] f32 logsumexp of the logits (for the z-loss).
    pub lse: usize,
    /// \[E\] f32 Σ_t probs.
    pub prob_sum: usize,
    /// \[1\] f32 Σ_t lse².
    pub lse_sq_sum: usize,
    /// [E + 1] u32 row offsets of the experts' groups.
    pub offsets: usize,
    /// \[R\] u32 token of each permuted row.
    pub row_token: usize,
    /// \[R\] u32 slot (t·k + s) of each permuted row.
    pub row_slot: usize,
    /// \[R\] u32 permuted row of each slot.
    pub slot_row: usize,
    /// [R, I] 16-bit SwiGLU activations.
    pub h: usize,
    /// [R, H] f32 expert outputs.
    pub y: usize,
    /// [R, H] 16-bit gathered tokens (sm_90 path only).
    pub x_perm: Option<usize>,
    /// [T, I] 16-bit and [T, H] f32 (shared expert only).
    pub shared_h: Option<usize>,
    pub shared_y: Option<usize>,
    pub bytes: usize,
}

pub(super) fn too_big(what: &str) -> Error {
    Error::invalid(format!(
        "the MoE workspace for {what} exceeds the address space"
    ))
}

/// Appends regions to a workspace, 256-byte aligned, overflow checked.
struct Carver {
    end: usize,
}

impl Carver {
    fn take(&mut self, elems: usize, elem_bytes: usize) -> Result<usize> {
        let start = self
            .end
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(|| too_big("this shape"))?;
        let bytes = elems
            .checked_mul(elem_bytes)
            .ok_or_else(|| too_big("this shape"))?;
        self.end = start
            .checked_add(bytes.max(1))
            .ok_or_else(|| too_big("this shape"))?;
        Ok(start)
    }
}

impl WorkspaceLayout {
    /// The layout of a call of `class` with `tokens` tokens (`sm90`: the sm_90 GEMM path
    /// runs, which needs the gathered tokens).
    pub fn new(class: &MoeClass, tokens: usize, sm90: bool) -> Result<WorkspaceLayout> {
        let (h, i, e, el) = (
            class.hidden,
            class.intermediate,
            class.experts,
            class.dtype.size_bytes(),
        );
        let rows = tokens
            .checked_mul(class.top_k)
            .ok_or_else(|| too_big("tokens × top_k"))?;
        let te = tokens.checked_mul(e).ok_or_else(|| too_big("T × E"))?;
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(|| too_big("this shape"));
        let mut c = Carver { end: 0 };
        let logits = c.take(te, 4)?;
        let probs = c.take(te, 4)?;
        let lse = c.take(tokens, 4)?;
        let prob_sum = c.take(e, 4)?;
        let lse_sq_sum = c.take(1, 4)?;
        let offsets = c.take(e + 1, 4)?;
        let row_token = c.take(rows, 4)?;
        let row_slot = c.take(rows, 4)?;
        let slot_row = c.take(rows, 4)?;
        let h_off = c.take(mul(rows, i)?, el)?;
        let y = c.take(mul(rows, h)?, 4)?;
        let x_perm = if sm90 {
            Some(c.take(mul(rows, h)?, el)?)
        } else {
            None
        };
        let (shared_h, shared_y) = if class.shared_expert {
            (
                Some(c.take(mul(tokens, i)?, el)?),
                Some(c.take(mul(tokens, h)?, 4)?),
            )
        } else {
            (None, None)
        };
        let bytes = c
            .end
            .checked_next_multiple_of(WORKSPACE_ALIGN)
            .ok_or_else(|| too_big("this shape"))?;
        Ok(WorkspaceLayout {
            logits,
            probs,
            lse,
            prob_sum,
            lse_sq_sum,
            offsets,
            row_token,
            row_slot,
            slot_row,
            h: h_off,
            y,
            x_perm,
            shared_h,
            shared_y,
            bytes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::class::tests::class;
    use super::*;

    #[test]
    fn workspace_regions_are_aligned_disjoint_and_monotone() {
        for shared in [false, true] {
            for sm90 in [false, true] {
                let c = MoeClass {
                    shared_expert: shared,
                    ..class(4096)
                };
                let mut last = 0;
                for t in [1, 7, 100, 2048, 4096] {
                    let l = WorkspaceLayout::new(&c, t, sm90).unwrap();
                    let r = t * c.top_k;
                    let mut regions = vec![
                        (l.logits, t * 8 * 4),
                        (l.probs, t * 8 * 4),
                        (l.lse, t * 4),
                        (l.prob_sum, 8 * 4),
                        (l.lse_sq_sum, 4),
                        (l.offsets, 9 * 4),
                        (l.row_token, r * 4),
                        (l.row_slot, r * 4),
                        (l.slot_row, r * 4),
                        (l.h, r * c.intermediate * 2),
                        (l.y, r * c.hidden * 4),
                    ];
                    assert_eq!(l.x_perm.is_some(), sm90);
                    if let Some(o) = l.x_perm {
                        regions.push((o, r * c.hidden * 2));
                    }
                    assert_eq!(l.shared_h.is_some(), shared);
                    if let (Some(a), Some(b)) = (l.shared_h, l.shared_y) {
                        regions.push((a, t * c.intermediate * 2));
                        regions.push((b, t * c.hidden * 4));
                    }
                    for w in regions.windows(2) {
                        assert!(w[0].0 + w[0].1 <= w[1].0, "{t}: overlap {w:?}");
                    }
                    for (o, _) in &regions {
                        assert_eq!(o % WORKSPACE_ALIGN, 0);
                    }
                    let (o, n) = regions.last().unwrap();
                    assert!(o + n <= l.bytes && l.bytes % WORKSPACE_ALIGN == 0);
                    assert!(l.bytes > last);
                    last = l.bytes;
                }
            }
        }
        let huge = MoeClass {
            hidden: usize::MAX / 4,
            ..class(16)
        };
        assert!(WorkspaceLayout::new(&huge, 16, false).is_err());
    }
}
