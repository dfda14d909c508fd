//! A value head dim that differs from the query/key head dim (D_v ≠ D_qk: DeepSeek MLA's
//! prefill, 192 / 128): the rule the front ends share to run such a call exactly on the
//! kernels of one head dim D = max(D_qk, D_v). [`pad_head_dims`] extends it to any head dim
//! up to 256 (rounded up to a multiple of 8) and to the backward's head dims.
//!
//! - D_v < D_qk: v is zero-padded to D_qk; the padded columns of o are P·0 = 0 and are
//!   dropped (o[..., :D_v]). The default scale 1/sqrt(D_qk) is the plan's own at D.
//! - D_v > D_qk: q and k are zero-padded to D_v; Q·Kᵀ is unchanged (the padded columns
//!   add 0·0), so the call passes its scale, by default 1/sqrt(D_qk) (not the plan's
//!   default at D), explicitly.
//!
//! Both are exact: the scores, the softmax, the lse and the first D_v columns of o are those
//! of the unpadded call. The cost is the front end's: a zero-padded copy of the padded
//! tensor(s), and the padded product's FLOPs (P·V over D instead of D_v columns, or Q·Kᵀ
//! over D instead of D_qk).

use super::{default_scale, BACKEND};
use crate::attention::backward::BWD_HEAD_DIMS;
use crate::attention::prefill::abi::{v1_serves, V1_HEAD_DIMS_TEXT};
use crate::attention::prefill::tiles::SM90_HEAD_DIMS;
use crate::{Error, Result};

/// How a call of query/key head dim `head_dim_qk` and value head dim `head_dim_v` runs on
/// kernels of one head dim ([`pad_value_head_dim`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ValueDimPad {
    pub head_dim_qk: usize,
    pub head_dim_v: usize,
    /// The head dim the kernels run at: max(head_dim_qk, head_dim_v).
    pub head_dim: usize,
    /// The scale to give the padded call: the caller's when it gave one; else `None` (the
    /// plan's default 1/sqrt(head_dim)) when q and k are not padded, and
    /// `Some(default_scale(head_dim_qk))` when they are.
    pub softmax_scale: Option<f32>,
}

impl ValueDimPad {
    /// Zero columns appended to q and k.
    pub fn pad_qk(&self) -> usize {
        self.head_dim - self.head_dim_qk
    }

    /// Zero columns appended to v (and dropped from o).
    pub fn pad_v(&self) -> usize {
        self.head_dim - self.head_dim_v
    }

    /// Whether nothing is padded.
    pub fn is_identity(&self) -> bool {
        self.pad_qk() == 0 && self.pad_v() == 0
    }
}

/// The padding of a call with query/key head dim `head_dim_qk`, value head dim `head_dim_v`
/// and the caller's `softmax_scale` (`None`: 1/sqrt(head_dim_qk)). Both head dims must be
/// multiples of 8 up to 256 (the portable kernel's; the kernel that then runs at
/// [`ValueDimPad::head_dim`] is the router's choice for that head dim), else an
/// [`Error::Unsupported`] naming the head dim; a non-finite scale is an
/// [`Error::InvalidProblem`].
pub fn pad_value_head_dim(
    head_dim_qk: usize,
    head_dim_v: usize,
    softmax_scale: Option<f32>,
) -> Result<ValueDimPad> {
    for (what, d) in [
        ("query/key head dim", head_dim_qk),
        ("value head dim", head_dim_v),
    ] {
        if !v1_serves(d) {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "{what} {d} (query/key {head_dim_qk}, value {head_dim_v}) is not \
                     supported: flashmoe runs a value head dim other than the query/key one by \
                     zero-padding both to the larger, and both must be {V1_HEAD_DIMS_TEXT}"
                ),
            ));
        }
    }
    if let Some(s) = softmax_scale {
        if !s.is_finite() {
            return Err(Error::invalid(format!(
                "softmax_scale must be finite (got {s})"
            )));
        }
    }
    pad_head_dims(head_dim_qk, head_dim_v, softmax_scale, PadTarget::Forward)
}

/// The kernels a padded call must land on ([`pad_head_dims`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PadTarget {
    /// The forward kernels of the dense call: any multiple of 8 up to 256.
    Forward,
    /// A call that also runs the backward: the head dims the backward kernels serve
    /// ([`BWD_HEAD_DIMS`]: 32, 64, 96, 128).
    Backward,
    /// The varlen forward (sm_90a: 64 and 128), whose head dims the varlen backward also
    /// serves.
    Varlen,
}

impl PadTarget {
    fn served(self) -> &'static [usize] {
        match self {
            PadTarget::Forward => &[],
            PadTarget::Backward => &BWD_HEAD_DIMS,
            PadTarget::Varlen => &SM90_HEAD_DIMS,
        }
    }
}

/// The padding of any call with query/key head dim `head_dim_qk` and value head dim
/// `head_dim_v` (each 1..=256) onto kernels of one head dim: the larger of the two rounded
/// up to a multiple of 8 (FlashAttention-2's rule for head dims such as 59 or 111), and for
/// a [`PadTarget::Backward`] or [`PadTarget::Varlen`] call the smallest head dim ≥ that
/// which those kernels serve (a backward at 40 runs at 64; varlen at 96 runs at 128). q and
/// k, v, or all three get zero columns; the scores, softmax and lse are the unpadded call's
/// and o's first `head_dim_v` columns are its o (the gradients of the padded columns are
/// zero). The scale as [`pad_value_head_dim`]'s: the caller's, else 1/sqrt(head_dim_qk),
/// passed explicitly when q and k are padded. A head dim outside 1..=256, or above the
/// target's largest (128), is an [`Error::Unsupported`] naming it.
pub fn pad_head_dims(
    head_dim_qk: usize,
    head_dim_v: usize,
    softmax_scale: Option<f32>,
    target: PadTarget,
) -> Result<ValueDimPad> {
    for (what, d) in [
        ("query/key head dim", head_dim_qk),
        ("value head dim", head_dim_v),
    ] {
        if d == 0 || !v1_serves(d.next_multiple_of(8)) {
            return Err(Error::unsupported(
                BACKEND,
                format!(
                    "{what} {d} (query/key {head_dim_qk}, value {head_dim_v}) is not \
                     supported: flashmoe serves head dims 1 to 256 (the kernels run at \
                     {V1_HEAD_DIMS_TEXT}; other dims are zero-padded to the next)"
                ),
            ));
        }
    }
    if let Some(s) = softmax_scale {
        if !s.is_finite() {
            return Err(Error::invalid(format!(
                "softmax_scale must be finite (got {s})"
            )));
        }
    }
    let forward_dim = head_dim_qk.max(head_dim_v).next_multiple_of(8);
    let served = target.served();
    let head_dim = if served.is_empty() {
        forward_dim
    } else {
        *served.iter().find(|&&d| d >= forward_dim).ok_or_else(|| {
            let what = match target {
                PadTarget::Varlen => "the varlen kernels",
                _ => "the backward kernels",
            };
            Error::unsupported(
                BACKEND,
                format!(
                    "head dims {head_dim_qk} / {head_dim_v} on {what}: they serve head dims \
                     up to {} (other dims zero-padded to one of {served:?})",
                    served[served.len() - 1]
                ),
            )
        })?
    };
    let softmax_scale = match softmax_scale {
        Some(s) => Some(s),
        None if head_dim == head_dim_qk => None,
        None => Some(default_scale(head_dim_qk)),
    };
    Ok(ValueDimPad {
        head_dim_qk,
        head_dim_v,
        head_dim,
        softmax_scale,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mla_prefill_pads_v_and_keeps_the_default_scale() {
        let p = pad_value_head_dim(192, 128, None).unwrap();
        assert_eq!((p.head_dim, p.pad_qk(), p.pad_v()), (192, 0, 64));
        assert_eq!(p.softmax_scale, None);
        assert!(!p.is_identity());
        let p = pad_value_head_dim(64, 32, Some(0.3)).unwrap();
        assert_eq!(
            (p.head_dim, p.pad_qk(), p.pad_v(), p.softmax_scale),
            (64, 0, 32, Some(0.3))
        );
    }

    #[test]
    fn a_wider_value_pads_q_and_k_with_the_scale_of_the_unpadded_dim() {
        let p = pad_value_head_dim(96, 128, None).unwrap();
        assert_eq!((p.head_dim, p.pad_qk(), p.pad_v()), (128, 32, 0));
        // The plan's default at 128 would be 1/sqrt(128): the call's is 1/sqrt(96).
        assert_eq!(p.softmax_scale, Some(default_scale(96)));
        assert_eq!(
            p.softmax_scale.unwrap().to_bits(),
            (1.0f32 / 96f32.sqrt()).to_bits()
        );
        let p = pad_value_head_dim(96, 128, Some(0.05)).unwrap();
        assert_eq!(p.softmax_scale, Some(0.05));
    }

    #[test]
    fn equal_dims_pad_nothing() {
        let p = pad_value_head_dim(128, 128, None).unwrap();
        assert!(p.is_identity());
        assert_eq!(
            (p.head_dim, p.pad_qk(), p.pad_v(), p.softmax_scale),
            (128, 0, 0, None)
        );
    }

    #[test]
    fn head_dims_off_the_kernels_are_named() {
        for (qk, v, bad) in [
            (192, 100, "value head dim 100"),
            (264, 128, "query/key head dim 264"),
            (0, 64, "query/key head dim 0"),
            (128, 512, "value head dim 512"),
        ] {
            let e = pad_value_head_dim(qk, v, None).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
        let e = pad_value_head_dim(192, 128, Some(f32::NAN)).unwrap_err();
        assert!(matches!(e, Error::InvalidProblem(_)), "{e}");
    }

    #[test]
    fn any_head_dim_pads_to_the_next_served_one() {
        // FlashAttention-2's odd head dims: all three tensors padded, the scale of the dim
        let p = pad_head_dims(59, 59, None, PadTarget::Forward).unwrap();
        assert_eq!((p.head_dim, p.pad_qk(), p.pad_v()), (64, 5, 5));
        assert_eq!(p.softmax_scale, Some(default_scale(59)));
        assert!(!p.is_identity());
        let p = pad_head_dims(111, 111, Some(0.1), PadTarget::Forward).unwrap();
        assert_eq!((p.head_dim, p.softmax_scale), (112, Some(0.1)));
        // a backward: the next head dim the backward kernels serve
        for (d, want) in [(111, 128), (40, 64), (80, 96), (16, 32), (1, 32), (64, 64)] {
            let p = pad_head_dims(d, d, None, PadTarget::Backward).unwrap();
            assert_eq!(p.head_dim, want, "{d}");
            assert_eq!(p.softmax_scale.is_none(), want == d, "{d}");
        }
        // varlen: the sm_90a varlen kernels' 64 and 128
        for (d, want) in [(40, 64), (64, 64), (96, 128), (111, 128), (8, 64)] {
            assert_eq!(
                pad_head_dims(d, d, None, PadTarget::Varlen)
                    .unwrap()
                    .head_dim,
                want
            );
        }
        let p = pad_head_dims(96, 100, None, PadTarget::Backward).unwrap();
        assert_eq!((p.head_dim, p.pad_qk(), p.pad_v()), (128, 32, 28));
        // multiples of 8 without a backward are left alone, and the old rule is this one
        assert!(pad_head_dims(128, 128, None, PadTarget::Forward)
            .unwrap()
            .is_identity());
        assert_eq!(
            pad_head_dims(192, 128, None, PadTarget::Forward).unwrap(),
            pad_value_head_dim(192, 128, None).unwrap()
        );
    }

    #[test]
    fn head_dims_beyond_the_kernels_are_named() {
        use PadTarget::*;
        for (qk, v, target, bad) in [
            (0, 64, Forward, "query/key head dim 0"),
            (257, 257, Forward, "query/key head dim 257"),
            (64, 300, Forward, "value head dim 300"),
            (
                136,
                136,
                Backward,
                "head dims 136 / 136 on the backward kernels",
            ),
            (192, 128, Backward, "they serve head dims up to 128"),
            (192, 192, Varlen, "on the varlen kernels"),
        ] {
            let e = pad_head_dims(qk, v, None, target).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{e}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }
}
