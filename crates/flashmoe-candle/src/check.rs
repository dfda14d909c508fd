//! Up-front checks of a flash-attention call: tensor ranks, layouts, dtypes, head counts,
//! the mask the window sizes describe, and the plan-cache key they lead to. Pure functions
//! of candle `Layout`s and values, so they run (and are tested) without a GPU; the CUDA
//! path (`cuda_fwd.rs`) calls [`check_call`] before touching any device memory.

use candle_core::{bail, DType, Layout, Result};

/// The shape of one attention call, read from q (b, seq_q, heads_q, d) and k/v
/// (b, seq_k, heads_kv, d).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

/// The masks the kernels implement. Causal is bottom-right aligned (query row i sees keys
/// j <= i + seq_k - seq_q), the convention of FlashAttention 2 and candle-flash-attn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mask {
    None,
    Causal,
}

/// Element types the kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    Bf16,
    F16,
}

/// Everything that selects a compiled kernel and its constants: one plan per key and
/// device. The scale is kept as its bit pattern so the key is `Eq + Hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassKey {
    pub elem: Elem,
    pub head_dim: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub causal: bool,
    pub scale_bits: u32,
}

impl ClassKey {
    pub fn new(elem: Elem, shape: &AttnShape, mask: Mask, softmax_scale: f32) -> ClassKey {
        ClassKey {
            elem,
            head_dim: shape.head_dim,
            heads_q: shape.heads_q,
            heads_kv: shape.heads_kv,
            causal: mask == Mask::Causal,
            scale_bits: softmax_scale.to_bits(),
        }
    }

    pub fn softmax_scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
}

/// Largest head dimension accepted before asking the plan (which knows the exact list its
/// kernels were built for and says so in its error).
pub const MAX_HEAD_DIM: usize = 256;

/// The element type of q, k and v, which must agree and be bf16 or f16.
pub fn check_dtypes(q: DType, k: DType, v: DType) -> Result<Elem> {
    if q != k || q != v {
        bail!("flash-attn: q, k and v must have the same dtype (q: {q:?}, k: {k:?}, v: {v:?})")
    }
    match q {
        DType::BF16 => Ok(Elem::Bf16),
        DType::F16 => Ok(Elem::F16),
        other => bail!("flash-attn: only bf16 and f16 are supported (got {other:?})"),
    }
}

/// Ranks, last-dim contiguity and matching sizes of q, k, v.
pub fn check_layouts(q: &Layout, k: &Layout, v: &Layout) -> Result<AttnShape> {
    let (qr, kr, vr) = (q.dims().len(), k.dims().len(), v.dims().len());
    if qr != 4 || kr != 4 || vr != 4 {
        bail!("flash-attn expects input tensors of rank 4 (q: {qr}, k: {kr}, v: {vr})")
    }
    for (name, l) in [("q", q), ("k", k), ("v", v)] {
        if l.stride()[3] != 1 {
            bail!(
                "flash-attn: the last dim of {name} must be contiguous (strides {:?})",
                l.stride()
            )
        }
    }
    let (batch, seq_q, heads_q, head_dim) = q.shape().dims4()?;
    let (kb, seq_k, heads_kv, kd) = k.shape().dims4()?;
    if (kb, kd) != (batch, head_dim) {
        bail!(
            "flash-attn: shape mismatch q {:?} and k {:?}",
            q.shape(),
            k.shape()
        )
    }
    if v.shape() != k.shape() {
        bail!(
            "flash-attn: shape mismatch k {:?} and v {:?}",
            k.shape(),
            v.shape()
        )
    }
    if batch == 0 || seq_q == 0 || seq_k == 0 || heads_q == 0 || heads_kv == 0 {
        bail!(
            "flash-attn: empty input (q {:?}, k {:?})",
            q.shape(),
            k.shape()
        )
    }
    if head_dim > MAX_HEAD_DIM {
        bail!("flash-attn: only supports head dimension at most {MAX_HEAD_DIM} (got {head_dim})")
    }
    if head_dim % 8 != 0 {
        bail!("flash-attn: only supports head sizes that are a multiple of 8 (got {head_dim})")
    }
    if heads_q % heads_kv != 0 {
        bail!("flash-attn: number of k/v heads {heads_kv} must divide number of heads in query {heads_q}")
    }
    Ok(AttnShape {
        batch,
        seq_q,
        seq_k,
        heads_q,
        heads_kv,
        head_dim,
    })
}

/// The mask that candle-flash-attn's window sizes describe, or an error for the ones we
/// do not implement. A side that excludes no key for any row counts as unbounded, so
/// `(None, None)` and over-long windows mean no mask and `(None, Some(0))` means causal
/// (also what `flash_attn(.., causal)` passes).
pub fn resolve_window(
    left: Option<usize>,
    right: Option<usize>,
    seq_q: usize,
    seq_k: usize,
) -> Result<Mask> {
    // Row i sits at key position p = i + seq_k - seq_q and sees keys p - left ..= p + right.
    let left_unbounded = left.is_none_or(|w| w + 1 >= seq_k);
    let right_unbounded = right.is_none_or(|w| w + 1 >= seq_q);
    if !left_unbounded {
        bail!(
            "flash-attn: sliding-window attention (window_size_left = {}) is not supported by flashmoe yet",
            left.unwrap_or_default()
        )
    }
    match right {
        _ if right_unbounded => Ok(Mask::None),
        Some(0) => Ok(Mask::Causal),
        Some(w) => bail!(
            "flash-attn: a local window to the right (window_size_right = {w}) is not supported by flashmoe yet; use 0 (causal) or None"
        ),
        None => unreachable!("None is unbounded"),
    }
}

/// What the CUDA path needs to know about one call, after every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub shape: AttnShape,
    pub key: ClassKey,
}

/// All checks of one call, in the order candle-flash-attn reports them.
pub fn check_call(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
) -> Result<Call> {
    let shape = check_layouts(q, k, v)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    if !softmax_scale.is_finite() {
        bail!("flash-attn: softmax_scale must be finite (got {softmax_scale})")
    }
    let mask = resolve_window(window.0, window.1, shape.seq_q, shape.seq_k)?;
    Ok(Call {
        shape,
        key: ClassKey::new(elem, &shape, mask, softmax_scale),
    })
}

/// The error every entry point with a feature we lack returns, naming the feature.
pub fn unsupported(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flashmoe-candle: {what} is not supported yet (flashmoe implements dense, \
         padded-batch attention with no mask or a causal mask)"
    ))
    .bt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bshd(b: usize, s: usize, h: usize, d: usize) -> Layout {
        Layout::contiguous((b, s, h, d))
    }

    #[test]
    fn accepts_gqa_and_reads_shape() {
        let s = check_layouts(&bshd(2, 5, 8, 64), &bshd(2, 7, 2, 64), &bshd(2, 7, 2, 64)).unwrap();
        assert_eq!(
            s,
            AttnShape {
                batch: 2,
                seq_q: 5,
                seq_k: 7,
                heads_q: 8,
                heads_kv: 2,
                head_dim: 64
            }
        );
    }

    #[test]
    fn accepts_strided_heads_with_offset() {
        // q, k, v narrowed out of one packed (b, s, 3h, d) tensor.
        let packed = bshd(2, 16, 3 * 4, 128);
        let q = packed.narrow(2, 0, 4).unwrap();
        let k = packed.narrow(2, 4, 4).unwrap();
        let v = packed.narrow(2, 8, 4).unwrap();
        assert_eq!(k.start_offset(), 4 * 128);
        check_layouts(&q, &k, &v).unwrap();
    }

    fn err(r: Result<impl std::fmt::Debug>) -> String {
        r.expect_err("expected an error").to_string()
    }

    #[test]
    fn rejects_bad_layouts() {
        let q = bshd(1, 4, 2, 64);
        let kv = bshd(1, 4, 2, 64);
        let rank3 = Layout::contiguous((4, 2, 64));
        assert!(err(check_layouts(&rank3, &kv, &kv)).contains("rank 4"));
        let last_strided = q.transpose(2, 3).unwrap();
        assert!(err(check_layouts(&q, &last_strided, &kv)).contains("last dim of k"));
        assert!(err(check_layouts(&q, &bshd(2, 4, 2, 64), &kv)).contains("shape mismatch q"));
        assert!(err(check_layouts(&q, &kv, &bshd(1, 5, 2, 64))).contains("shape mismatch k"));
        let q3 = bshd(1, 4, 3, 64);
        assert!(err(check_layouts(&q3, &kv, &kv)).contains("must divide"));
        let (q, kv) = (bshd(1, 4, 2, 60), bshd(1, 4, 2, 60));
        assert!(err(check_layouts(&q, &kv, &kv)).contains("multiple of 8"));
        let (q, kv) = (bshd(1, 4, 2, 512), bshd(1, 4, 2, 512));
        assert!(err(check_layouts(&q, &kv, &kv)).contains("at most 256"));
        let (q, kv) = (bshd(1, 0, 2, 64), bshd(1, 4, 2, 64));
        assert!(err(check_layouts(&q, &kv, &kv)).contains("empty"));
    }

    #[test]
    fn dtypes() {
        assert_eq!(
            check_dtypes(DType::BF16, DType::BF16, DType::BF16).unwrap(),
            Elem::Bf16
        );
        assert_eq!(
            check_dtypes(DType::F16, DType::F16, DType::F16).unwrap(),
            Elem::F16
        );
        assert!(err(check_dtypes(DType::F32, DType::F32, DType::F32)).contains("bf16 and f16"));
        assert!(err(check_dtypes(DType::F16, DType::BF16, DType::F16)).contains("same dtype"));
    }

    #[test]
    fn windows() {
        let r = |l, rr, sq, sk| resolve_window(l, rr, sq, sk);
        assert_eq!(r(None, None, 8, 8).unwrap(), Mask::None);
        assert_eq!(r(None, Some(0), 8, 8).unwrap(), Mask::Causal);
        assert_eq!(r(None, Some(0), 8, 32).unwrap(), Mask::Causal);
        // One query row sees every key under a bottom-right causal mask.
        assert_eq!(r(None, Some(0), 1, 32).unwrap(), Mask::None);
        // Windows wider than the sequence mask nothing.
        assert_eq!(r(Some(31), Some(7), 8, 32).unwrap(), Mask::None);
        assert_eq!(r(Some(1000), Some(0), 8, 32).unwrap(), Mask::Causal);
        assert!(err(r(Some(4), Some(0), 8, 32)).contains("sliding-window"));
        assert!(err(r(None, Some(2), 8, 32)).contains("window_size_right = 2"));
    }

    #[test]
    fn class_key_separates_what_selects_a_kernel() {
        let s = AttnShape {
            batch: 2,
            seq_q: 9,
            seq_k: 9,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 128,
        };
        let base = ClassKey::new(Elem::Bf16, &s, Mask::Causal, 0.125);
        assert_eq!(base.softmax_scale(), 0.125);
        // Batch and sequence lengths do not select a plan.
        let other_len = AttnShape {
            batch: 7,
            seq_q: 100,
            seq_k: 3000,
            ..s
        };
        assert_eq!(
            base,
            ClassKey::new(Elem::Bf16, &other_len, Mask::Causal, 0.125)
        );
        // Everything else does.
        assert_ne!(base, ClassKey::new(Elem::F16, &s, Mask::Causal, 0.125));
        assert_ne!(base, ClassKey::new(Elem::Bf16, &s, Mask::None, 0.125));
        assert_ne!(base, ClassKey::new(Elem::Bf16, &s, Mask::Causal, 0.126));
        assert_ne!(
            base,
            ClassKey::new(
                Elem::Bf16,
                &AttnShape { heads_kv: 8, ..s },
                Mask::Causal,
                0.125
            )
        );
        assert_ne!(
            base,
            ClassKey::new(
                Elem::Bf16,
                &AttnShape { head_dim: 64, ..s },
                Mask::Causal,
                0.125
            )
        );
        let mut set = std::collections::HashSet::new();
        set.insert(base);
        assert!(set.contains(&ClassKey::new(Elem::Bf16, &other_len, Mask::Causal, 0.125)));
    }

    #[test]
    fn check_call_builds_key_and_rejects_nan_scale() {
        let (q, kv) = (bshd(1, 4, 4, 64), bshd(1, 6, 2, 64));
        let bf = (DType::BF16, DType::BF16, DType::BF16);
        let c = check_call(bf, &q, &kv, &kv, 0.125, (None, Some(0))).unwrap();
        assert!(c.key.causal);
        assert_eq!((c.key.heads_q, c.key.heads_kv, c.key.head_dim), (4, 2, 64));
        assert!(err(check_call(bf, &q, &kv, &kv, f32::NAN, (None, None))).contains("finite"));
    }
}
