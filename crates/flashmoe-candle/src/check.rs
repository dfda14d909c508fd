//! Up-front checks of a flash-attention call: tensor ranks, layouts, dtypes, head counts,
//! the mask the window sizes describe, and the plan (and its cache key) the call goes to:
//! dense prefill ([`PlanKey::Dense`]), varlen prefill ([`PlanKey::Varlen`]) or paged / decode
//! ([`PlanKey::Decode`]). Pure functions of candle `Layout`s and values, so they run (and are
//! tested) without a GPU; the CUDA path (`cuda_fwd.rs`) calls [`check_call`],
//! [`check_varlen`] or [`check_paged`] before touching any device memory.

use candle_core::{bail, DType, Layout, Result};
use flashmoe::attention::decode::{HEAD_DIMS as DECODE_HEAD_DIMS, MAX_Q_PER_SEQ};

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
    check_heads(head_dim, heads_q, heads_kv)?;
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

/// What selects a compiled decode kernel and its constants (`flashmoe::attention::decode`):
/// the paged entry point, and decode-shaped calls of the dense one that the prefill plan
/// cannot run (softcap, sliding windows). `max_q_per_seq` is the call's rows per sequence
/// rounded up to a power of two, so one plan serves neighbouring sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeKey {
    pub elem: Elem,
    pub head_dim: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub max_q_per_seq: usize,
    /// (left, right) around each row's bottom-right diagonal; -1 = unbounded.
    pub window: (i32, i32),
    pub softcap_bits: u32,
    pub scale_bits: u32,
}

impl DecodeKey {
    pub fn softmax_scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
    pub fn softcap(&self) -> f32 {
        f32::from_bits(self.softcap_bits)
    }
}

/// The plan a call runs on (and its cache key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PlanKey {
    /// `AttentionPlan`: padded batch, no mask or causal.
    Dense(ClassKey),
    /// `VarlenPlan`: packed sequences with int32 offsets, no mask or causal (sm_90a).
    Varlen(ClassKey),
    /// `DecodePlan`: at most [`MAX_Q_PER_SEQ`] rows per sequence against a (paged) cache.
    Decode(DecodeKey),
}

/// What the CUDA path needs to know about one dense call, after every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub shape: AttnShape,
    pub plan: PlanKey,
}

/// The softcap of a call: `None` and 0 are off (FlashAttention's convention); otherwise it
/// must be finite and positive.
pub fn check_softcap(softcap: Option<f32>) -> Result<Option<f32>> {
    match softcap {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(s)),
        Some(s) => bail!("flash-attn: softcap must be finite and >= 0 (got {s})"),
    }
}

/// candle-flash-attn's window sizes as the decode kernel's `(left, right)`: `None` and sizes
/// beyond `max_seqlen_k` are unbounded (-1), as candle-flash-attn maps them for FA2.
pub fn decode_window(
    left: Option<usize>,
    right: Option<usize>,
    max_seqlen_k: usize,
) -> Result<(i32, i32)> {
    let side = |w: Option<usize>| -> Result<i32> {
        match w {
            Some(w) if w <= max_seqlen_k => i32::try_from(w).map_err(|_| {
                candle_core::Error::Msg(format!("flash-attn: window size {w} exceeds i32")).bt()
            }),
            _ => Ok(-1),
        }
    };
    Ok((side(left)?, side(right)?))
}

/// Whether a call with `rows` query rows per sequence and this head dim fits the decode
/// kernels.
pub fn decode_shaped(rows: usize, head_dim: usize) -> bool {
    rows <= MAX_Q_PER_SEQ && DECODE_HEAD_DIMS.contains(&head_dim)
}

fn decode_key(
    elem: Elem,
    shape: &AttnShape,
    rows: usize,
    window: (i32, i32),
    softcap: Option<f32>,
    softmax_scale: f32,
) -> DecodeKey {
    DecodeKey {
        elem,
        head_dim: shape.head_dim,
        heads_q: shape.heads_q,
        heads_kv: shape.heads_kv,
        max_q_per_seq: rows.max(1).next_power_of_two(),
        window,
        softcap_bits: softcap.unwrap_or(0.0).to_bits(),
        scale_bits: softmax_scale.to_bits(),
    }
}

/// All checks of one dense call, in the order candle-flash-attn reports them, and its
/// route: the prefill plan for no mask / causal without softcap; otherwise the decode plan
/// when the call is decode-shaped (at most 16 query rows, head dim 64/128/256); otherwise an
/// error naming the feature.
pub fn check_call(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> Result<Call> {
    let shape = check_layouts(q, k, v)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    if !softmax_scale.is_finite() {
        bail!("flash-attn: softmax_scale must be finite (got {softmax_scale})")
    }
    let softcap = check_softcap(softcap)?;
    let mask = resolve_window(window.0, window.1, shape.seq_q, shape.seq_k);
    if let (Ok(mask), None) = (&mask, softcap) {
        return Ok(Call {
            shape,
            plan: PlanKey::Dense(ClassKey::new(elem, &shape, *mask, softmax_scale)),
        });
    }
    if decode_shaped(shape.seq_q, shape.head_dim) {
        let w = decode_window(window.0, window.1, shape.seq_k)?;
        let key = decode_key(elem, &shape, shape.seq_q, w, softcap, softmax_scale);
        return Ok(Call {
            shape,
            plan: PlanKey::Decode(key),
        });
    }
    mask?;
    Err(unsupported(&format!(
        "softcapping with {} query rows per sequence and head dim {} (flashmoe softcaps on \
         its decode kernels: at most {MAX_Q_PER_SEQ} rows, head dims {DECODE_HEAD_DIMS:?})",
        shape.seq_q, shape.head_dim
    )))
}

/// The cumulative sequence offsets (`batch + 1` elements) candle-flash-attn takes: u32,
/// rank 1, contiguous, at least 2 elements. Returns the element count.
pub fn check_seqlens(name: &str, dtype: DType, l: &Layout) -> Result<usize> {
    if dtype != DType::U32 {
        bail!("flash-attn: {name} must be u32 (got {dtype:?})")
    }
    let n = match l.dims() {
        [n] => *n,
        d => bail!("flash-attn: {name} must have rank 1 (batch + 1 offsets) but has shape {d:?}"),
    };
    if l.contiguous_offsets().is_none() {
        bail!("flash-attn: {name} has to be contiguous")
    }
    if n < 2 {
        bail!("flash-attn: {name} should have a len >= 2 (got {n})")
    }
    Ok(n)
}

/// Rank-3 packed q (total_q, heads_q, d): last dim contiguous. Returns (total_q, heads_q, d).
fn check_packed_q(q: &Layout) -> Result<(usize, usize, usize)> {
    if q.dims().len() != 3 {
        bail!(
            "flash-attn-varlen expects q of rank 3 (total_q, heads_q, head_size), got {:?}",
            q.dims()
        )
    }
    if q.stride()[2] != 1 {
        bail!(
            "flash-attn: the last dim of q must be contiguous (strides {:?})",
            q.stride()
        )
    }
    q.shape().dims3()
}

fn check_heads(head_dim: usize, heads_q: usize, heads_kv: usize) -> Result<()> {
    if head_dim == 0 || heads_q == 0 || heads_kv == 0 {
        bail!("flash-attn: empty input (head_dim {head_dim}, heads {heads_q}/{heads_kv})")
    }
    if head_dim > MAX_HEAD_DIM {
        bail!("flash-attn: only supports head dimension at most {MAX_HEAD_DIM} (got {head_dim})")
    }
    if !head_dim.is_multiple_of(8) {
        bail!("flash-attn: only supports head sizes that are a multiple of 8 (got {head_dim})")
    }
    if !heads_q.is_multiple_of(heads_kv) {
        bail!("flash-attn: number of k/v heads {heads_kv} must divide number of heads in query {heads_q}")
    }
    Ok(())
}

/// One varlen (packed, unpaged) call after every check: q (total_q, heads_q, d), k/v
/// (total_k, heads_kv, d), `batch + 1` offsets each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VarlenCall {
    pub batch: usize,
    pub total_q: usize,
    pub total_k: usize,
    pub heads_q: usize,
    pub plan: PlanKey,
}

/// All checks of a `flash_attn_varlen*` call. Only no mask and causal (bottom-right per
/// sequence) run (on `VarlenPlan`); the window is read against `max_seqlen_q/k`, as
/// candle-flash-attn does.
#[allow(clippy::too_many_arguments)]
pub fn check_varlen(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    seqlens: ((DType, &Layout), (DType, &Layout)),
    max_seqlen: (usize, usize),
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
) -> Result<VarlenCall> {
    let (total_q, heads_q, head_dim) = check_packed_q(q)?;
    for (name, l) in [("k", k), ("v", v)] {
        if l.dims().len() != 3 {
            bail!("flash-attn-varlen expects {name} of rank 3 (total_k, heads_kv, head_size), got {:?}", l.dims())
        }
        if l.stride()[2] != 1 {
            bail!(
                "flash-attn: the last dim of {name} must be contiguous (strides {:?})",
                l.stride()
            )
        }
    }
    let (total_k, heads_kv, kd) = k.shape().dims3()?;
    if kd != head_dim {
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
    check_heads(head_dim, heads_q, heads_kv)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    let nq = check_seqlens("seqlens_q", seqlens.0 .0, seqlens.0 .1)?;
    let nk = check_seqlens("seqlens_k", seqlens.1 .0, seqlens.1 .1)?;
    if nq != nk {
        bail!("flash-attn: seqlens_q and seqlens_k should have the same number of elements {nq} <> {nk}")
    }
    if total_q == 0 || total_k == 0 {
        bail!(
            "flash-attn: empty input (q {:?}, k {:?})",
            q.shape(),
            k.shape()
        )
    }
    let (max_q, max_k) = max_seqlen;
    for (what, value, total) in [
        ("max_seqlen_q", max_q, total_q),
        ("max_seqlen_k", max_k, total_k),
    ] {
        if value == 0 || value > total {
            bail!("flash-attn: {what} = {value} must be in 1..={total} (the packed row count)")
        }
    }
    if !softmax_scale.is_finite() {
        bail!("flash-attn: softmax_scale must be finite (got {softmax_scale})")
    }
    let mask = resolve_window(window.0, window.1, max_q, max_k)?;
    let shape = AttnShape {
        batch: nq - 1,
        seq_q: max_q,
        seq_k: max_k,
        heads_q,
        heads_kv,
        head_dim,
    };
    Ok(VarlenCall {
        batch: nq - 1,
        total_q,
        total_k,
        heads_q,
        plan: PlanKey::Varlen(ClassKey::new(elem, &shape, mask, softmax_scale)),
    })
}

/// One paged call after every check: q (total_q, heads_q, d), caches (num_blocks,
/// page_size, heads_kv, d), block table (batch, max_blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PagedCall {
    pub batch: usize,
    pub total_q: usize,
    pub heads_q: usize,
    pub max_blocks: usize,
    pub max_seqlen_k: usize,
    pub key: DecodeKey,
}

/// The tensors of a paged call besides q, k and v: (dtype, layout) each.
pub struct PagedIndexes<'a> {
    pub seqlens_q: (DType, &'a Layout),
    pub seqlens_k: (DType, &'a Layout),
    pub block_table: (DType, &'a Layout),
}

/// All checks of a `flash_attn_varlen_paged_windowed` call. It runs on the decode kernels:
/// at most [`MAX_Q_PER_SEQ`] query rows per sequence (`max_seqlen_q`), head dims 64/128/256;
/// longer query sequences (chunked prefill on a paged cache) are an error naming that.
#[allow(clippy::too_many_arguments)]
pub fn check_paged(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    idx: &PagedIndexes,
    max_seqlen: (usize, usize),
    page_block_size: usize,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> Result<PagedCall> {
    let (total_q, heads_q, head_dim) = check_packed_q(q)?;
    for (name, l) in [("k", k), ("v", v)] {
        if l.dims().len() != 4 {
            bail!("flash-attn-varlen paged expects {name} of rank 4 (num_blocks, page_block_size, heads_kv, head_size), got {:?}", l.dims())
        }
        if l.stride()[3] != 1 {
            bail!(
                "flash-attn: the last dim of {name} must be contiguous (strides {:?})",
                l.stride()
            )
        }
    }
    let (num_blocks, page, heads_kv, kd) = k.shape().dims4()?;
    if v.shape() != k.shape() {
        bail!(
            "flash-attn: shape mismatch k {:?} and v {:?}",
            k.shape(),
            v.shape()
        )
    }
    if kd != head_dim {
        bail!(
            "flash-attn: shape mismatch q {:?} and k {:?}",
            q.shape(),
            k.shape()
        )
    }
    if page_block_size != page {
        bail!(
            "flash-attn: page_block_size {page_block_size} does not match k shape {:?}",
            k.shape()
        )
    }
    if num_blocks == 0 || page == 0 || total_q == 0 {
        bail!(
            "flash-attn: empty input (q {:?}, k {:?})",
            q.shape(),
            k.shape()
        )
    }
    check_heads(head_dim, heads_q, heads_kv)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    let nq = check_seqlens("seqlens_q", idx.seqlens_q.0, idx.seqlens_q.1)?;
    let nk = check_seqlens("seqlens_k", idx.seqlens_k.0, idx.seqlens_k.1)?;
    if nq != nk {
        bail!("flash-attn: seqlens_q and seqlens_k should have the same number of elements {nq} <> {nk}")
    }
    let (bt_dtype, bt) = idx.block_table;
    if !matches!(bt_dtype, DType::U32 | DType::I32) {
        bail!("flash-attn: block_table must be u32 or i32, got {bt_dtype:?}")
    }
    let (bt_rows, max_blocks) = match bt.dims() {
        [r, c] => (*r, *c),
        d => bail!(
            "flash-attn: block_table must have rank 2 (batch, max_blocks) but has shape {d:?}"
        ),
    };
    if bt.stride()[1] != 1 {
        bail!(
            "flash-attn: block_table last dimension must be contiguous (strides {:?})",
            bt.stride()
        )
    }
    if bt_rows != nq - 1 || max_blocks == 0 {
        bail!(
            "flash-attn: block_table has shape {:?} but ({}, max_blocks >= 1) is required (batch from seqlens_q)",
            bt.dims(),
            nq - 1
        )
    }
    let (max_q, max_k) = max_seqlen;
    if max_q == 0 || max_q > total_q || max_k == 0 {
        bail!("flash-attn: max_seqlen_q = {max_q} must be in 1..={total_q} and max_seqlen_k = {max_k} >= 1")
    }
    if !softmax_scale.is_finite() {
        bail!("flash-attn: softmax_scale must be finite (got {softmax_scale})")
    }
    let softcap = check_softcap(softcap)?;
    if !DECODE_HEAD_DIMS.contains(&head_dim) {
        return Err(unsupported(&format!(
            "paged KV with head dim {head_dim} (the paged kernels take {DECODE_HEAD_DIMS:?})"
        )));
    }
    if max_q > MAX_Q_PER_SEQ {
        return Err(unsupported(&format!(
            "paged KV with {max_q} query rows per sequence (max_seqlen_q; the paged kernels \
             take at most {MAX_Q_PER_SEQ}: decode and speculative steps, not chunked prefill)"
        )));
    }
    let shape = AttnShape {
        batch: nq - 1,
        seq_q: max_q,
        seq_k: max_k,
        heads_q,
        heads_kv,
        head_dim,
    };
    let w = decode_window(window.0, window.1, max_k)?;
    Ok(PagedCall {
        batch: nq - 1,
        total_q,
        heads_q,
        max_blocks,
        max_seqlen_k: max_k,
        key: decode_key(elem, &shape, max_q, w, softcap, softmax_scale),
    })
}

/// The error every entry point with a feature we lack returns, naming the feature.
pub fn unsupported(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flashmoe-candle: {what} is not supported yet (flashmoe implements no mask and causal \
         attention for padded and variable-length batches, and windows and softcapping for \
         decode-shaped calls of at most {MAX_Q_PER_SEQ} query rows per sequence)"
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
        let c = check_call(bf, &q, &kv, &kv, 0.125, (None, Some(0)), None).unwrap();
        let PlanKey::Dense(key) = c.plan else {
            panic!("causal without softcap is the prefill plan: {:?}", c.plan)
        };
        assert!(key.causal);
        assert_eq!((key.heads_q, key.heads_kv, key.head_dim), (4, 2, 64));
        assert!(err(check_call(bf, &q, &kv, &kv, f32::NAN, (None, None), None)).contains("finite"));
        // Softcap 0 is off.
        let c = check_call(bf, &q, &kv, &kv, 0.125, (None, None), Some(0.0)).unwrap();
        assert!(matches!(c.plan, PlanKey::Dense(_)));
        assert!(
            err(check_call(bf, &q, &kv, &kv, 0.1, (None, None), Some(-1.0))).contains("softcap")
        );
    }

    #[test]
    fn decode_shaped_softcap_and_windows_route_to_the_decode_plan() {
        let bf = (DType::BF16, DType::BF16, DType::BF16);
        let (q, kv) = (bshd(2, 3, 8, 128), bshd(2, 300, 2, 128));
        let c = check_call(bf, &q, &kv, &kv, 0.1, (None, Some(0)), Some(30.0)).unwrap();
        let PlanKey::Decode(key) = c.plan else {
            panic!("softcap goes to the decode plan: {:?}", c.plan)
        };
        assert_eq!(key.window, (-1, 0));
        assert_eq!(key.softcap(), 30.0);
        assert_eq!(key.softmax_scale(), 0.1);
        assert_eq!(key.max_q_per_seq, 4, "3 rows round up to a power of two");
        // A sliding window, and a window wider than seq_k (unbounded).
        let c = check_call(bf, &q, &kv, &kv, 0.1, (Some(64), Some(0)), None).unwrap();
        assert!(matches!(
            c.plan,
            PlanKey::Decode(DecodeKey {
                window: (64, 0),
                ..
            })
        ));
        let c = check_call(bf, &q, &kv, &kv, 0.1, (Some(500), Some(3)), Some(5.0)).unwrap();
        assert!(matches!(
            c.plan,
            PlanKey::Decode(DecodeKey {
                window: (-1, 3),
                ..
            })
        ));
        // Prefill-sized softcap / window: errors naming the feature.
        let (q, kv) = (bshd(1, 64, 8, 128), bshd(1, 64, 8, 128));
        assert!(
            err(check_call(bf, &q, &kv, &kv, 0.1, (None, None), Some(30.0)))
                .contains("softcapping")
        );
        assert!(
            err(check_call(bf, &q, &kv, &kv, 0.1, (Some(8), Some(0)), None))
                .contains("sliding-window")
        );
        // Head dim without a decode kernel.
        let (q, kv) = (bshd(1, 1, 8, 96), bshd(1, 64, 8, 96));
        assert!(
            err(check_call(bf, &q, &kv, &kv, 0.1, (None, None), Some(30.0)))
                .contains("head dim 96")
        );
    }

    fn packed(t: usize, h: usize, d: usize) -> Layout {
        Layout::contiguous((t, h, d))
    }

    #[test]
    fn varlen_checks_and_key() {
        let bf = (DType::BF16, DType::BF16, DType::BF16);
        let cu = Layout::contiguous(4);
        let u = (DType::U32, &cu);
        let (q, kv) = (packed(20, 8, 128), packed(31, 2, 128));
        let c = check_varlen(bf, &q, &kv, &kv, (u, u), (9, 17), 0.1, (None, Some(0))).unwrap();
        assert_eq!((c.batch, c.total_q, c.total_k, c.heads_q), (3, 20, 31, 8));
        let PlanKey::Varlen(key) = c.plan else {
            panic!("{:?}", c.plan)
        };
        assert!(key.causal && key.heads_kv == 2 && key.head_dim == 128);
        let c = check_varlen(bf, &q, &kv, &kv, (u, u), (9, 17), 0.1, (None, None)).unwrap();
        assert!(matches!(
            c.plan,
            PlanKey::Varlen(ClassKey { causal: false, .. })
        ));
        let e = |r: Result<VarlenCall>| err(r);
        let i32s = (DType::I32, &cu);
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            (i32s, u),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("seqlens_q must be u32"));
        let cu5 = Layout::contiguous(5);
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            (u, (DType::U32, &cu5)),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("same number"));
        let one = Layout::contiguous(1);
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            ((DType::U32, &one), (DType::U32, &one)),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("len >= 2"));
        let strided = Layout::new(4.into(), vec![2], 0);
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            ((DType::U32, &strided), u),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("contiguous"));
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            (u, u),
            (21, 17),
            0.1,
            (None, None)
        ))
        .contains("max_seqlen_q = 21"));
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            (u, u),
            (9, 0),
            0.1,
            (None, None)
        ))
        .contains("max_seqlen_k = 0"));
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &kv,
            (u, u),
            (9, 17),
            0.1,
            (Some(4), Some(0))
        ))
        .contains("sliding-window"));
        assert!(e(check_varlen(
            bf,
            &bshd(1, 20, 8, 128),
            &kv,
            &kv,
            (u, u),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("rank 3"));
        assert!(e(check_varlen(
            bf,
            &q,
            &packed(31, 3, 128),
            &packed(31, 3, 128),
            (u, u),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("must divide"));
        assert!(e(check_varlen(
            bf,
            &q,
            &kv,
            &packed(30, 2, 128),
            (u, u),
            (9, 17),
            0.1,
            (None, None)
        ))
        .contains("shape mismatch k"));
    }

    #[test]
    fn paged_checks_and_key() {
        let bf = (DType::BF16, DType::BF16, DType::BF16);
        let cu = Layout::contiguous(4);
        let idx = |bt_dtype, bt| PagedIndexes {
            seqlens_q: (DType::U32, &cu),
            seqlens_k: (DType::U32, &cu),
            block_table: (bt_dtype, bt),
        };
        let table = &Layout::contiguous((3, 5));
        let (q, kc) = (packed(7, 8, 128), bshd(40, 16, 2, 128));
        let call = |i: &PagedIndexes, q: &Layout, k: &Layout, max: (usize, usize), page, w, cap| {
            check_paged(bf, q, k, k, i, max, page, 0.1, w, cap)
        };
        let c = call(
            &idx(DType::U32, table),
            &q,
            &kc,
            (4, 80),
            16,
            (None, Some(0)),
            Some(50.0),
        )
        .unwrap();
        assert_eq!(
            (c.batch, c.total_q, c.heads_q, c.max_blocks, c.max_seqlen_k),
            (3, 7, 8, 5, 80)
        );
        assert_eq!(c.key.window, (-1, 0));
        assert_eq!(c.key.softcap(), 50.0);
        assert_eq!(c.key.max_q_per_seq, 4);
        let c = call(
            &idx(DType::I32, table),
            &q,
            &kc,
            (1, 80),
            16,
            (Some(32), None),
            None,
        )
        .unwrap();
        assert_eq!(
            (c.key.window, c.key.max_q_per_seq, c.key.softcap_bits),
            ((32, -1), 1, 0)
        );
        let e = |r: Result<PagedCall>| err(r);
        assert!(e(call(
            &idx(DType::F32, table),
            &q,
            &kc,
            (4, 80),
            16,
            (None, None),
            None
        ))
        .contains("u32 or i32"));
        let bad_rows = &Layout::contiguous((2, 5));
        assert!(e(call(
            &idx(DType::U32, bad_rows),
            &q,
            &kc,
            (4, 80),
            16,
            (None, None),
            None
        ))
        .contains("block_table has shape"));
        let col_major = &Layout::contiguous((5, 3)).transpose(0, 1).unwrap();
        assert!(e(call(
            &idx(DType::U32, col_major),
            &q,
            &kc,
            (4, 80),
            16,
            (None, None),
            None
        ))
        .contains("last dimension must be contiguous"));
        assert!(e(call(
            &idx(DType::U32, table),
            &q,
            &kc,
            (4, 80),
            32,
            (None, None),
            None
        ))
        .contains("page_block_size 32"));
        assert!(e(call(
            &idx(DType::U32, table),
            &packed(40, 8, 128),
            &kc,
            (17, 80),
            16,
            (None, None),
            None
        ))
        .contains("17 query rows per sequence"));
        assert!(e(call(
            &idx(DType::U32, table),
            &packed(7, 8, 96),
            &bshd(40, 16, 2, 96),
            (4, 80),
            16,
            (None, None),
            None
        ))
        .contains("head dim 96"));
        assert!(e(call(
            &idx(DType::U32, table),
            &q,
            &packed(40, 2, 128),
            (4, 80),
            16,
            (None, None),
            None
        ))
        .contains("rank 4"));
        assert!(e(call(
            &idx(DType::U32, table),
            &q,
            &kc,
            (4, 80),
            16,
            (None, None),
            Some(f32::INFINITY)
        ))
        .contains("softcap"));
    }
}
