//! Up-front checks of a flash-attention call: tensor ranks, layouts, dtypes, head counts,
//! the window the window sizes describe, and the plan (and its cache key) the call goes to:
//! dense prefill ([`PlanKey::Dense`]), varlen prefill ([`PlanKey::Varlen`]) or paged / decode
//! ([`PlanKey::Decode`]). Pure functions of candle `Layout`s, values and the device's
//! compute capability, so they run (and are tested) without a GPU; the CUDA path
//! (`cuda_fwd.rs`) calls [`check_call`], [`check_varlen`] or [`check_paged`] before touching
//! any device memory.
//!
//! Routing of a dense call ([`check_call`]):
//! - no mask / causal without softcap: the prefill plan (`AttentionPlan`: the sm_90a kernel
//!   on Hopper for head dims 64 and 128, the portable kernel otherwise);
//! - a sliding window or a softcap where the sm_90a kernel serves it ([`prefill_masks`]:
//!   compute capability 9.0, head dims 64 and 128): the prefill plan, whatever the rows;
//! - otherwise, decode-shaped calls ([`decode_shaped`]: at most [`MAX_Q_PER_SEQ`] query
//!   rows, head dims 64/128/256): the decode plan over the dense cache;
//! - otherwise an error naming the feature, the call's rows, head dim and device, and the
//!   kernels that would serve it.
//!
//! Varlen calls ([`check_varlen`]) have one plan, `VarlenPlan` (sm_90a, head dims 64/128),
//! windows and softcap included; paged calls ([`check_paged`]) the decode plan.

use candle_core::{bail, DType, Layout, Result};
use flashmoe::attention::config::SM90_HEAD_DIMS;
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

/// The mask of a call: `(left, right)` keys around each query row's bottom-right diagonal
/// d = i + seq_k - seq_q (row i sees keys d - left ..= d + right), -1 = unbounded:
/// FlashAttention's `window_size`, as the plans take it. [`resolve_window`] normalises it
/// per call, so a side that hides no key is -1: [`NO_MASK`], [`CAUSAL`] or a sliding window
/// ([`is_sliding`]).
pub type Window = (i32, i32);

/// Every key visible.
pub const NO_MASK: Window = (-1, -1);
/// Bottom-right causal: row i sees keys j <= i + seq_k - seq_q (FlashAttention 2's and
/// candle-flash-attn's convention).
pub const CAUSAL: Window = (-1, 0);

/// Whether a normalised window hides keys other than the causal ones: a bounded left side
/// or a right side past the diagonal (the kernels' sliding-window path).
pub fn is_sliding(w: Window) -> bool {
    w.0 >= 0 || w.1 > 0
}

/// Element types the kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    Bf16,
    F16,
}

/// Everything that selects a compiled prefill kernel and its constants: one plan per key and
/// device. The scale and softcap are kept as bit patterns so the key is `Eq + Hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassKey {
    pub elem: Elem,
    pub head_dim: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// The call's normalised window ([`resolve_window`]): [`NO_MASK`], [`CAUSAL`] or a
    /// sliding window.
    pub window: Window,
    /// The softcap's bits; 0 (`0.0f32`) is off.
    pub softcap_bits: u32,
    pub scale_bits: u32,
}

impl ClassKey {
    /// `window` normalised ([`resolve_window`]), `softcap` checked ([`check_softcap`]).
    pub fn new(
        elem: Elem,
        shape: &AttnShape,
        window: Window,
        softcap: Option<f32>,
        softmax_scale: f32,
    ) -> ClassKey {
        ClassKey {
            elem,
            head_dim: shape.head_dim,
            heads_q: shape.heads_q,
            heads_kv: shape.heads_kv,
            window,
            softcap_bits: softcap.unwrap_or(0.0).to_bits(),
            scale_bits: softmax_scale.to_bits(),
        }
    }

    pub fn softmax_scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
    /// 0 is off.
    pub fn softcap(&self) -> f32 {
        f32::from_bits(self.softcap_bits)
    }
    /// The right side is the diagonal (with or without a left bound).
    pub fn causal(&self) -> bool {
        self.window.1 == 0
    }
    /// Whether the class needs the sm_90a kernel: a sliding window or a softcap.
    pub fn needs_sm90(&self) -> bool {
        is_sliding(self.window) || self.softcap_bits != 0
    }
}

/// Compute capability × 10 of the devices the sm_90a kernel runs on (Hopper).
pub const SM90_ARCH: u32 = 90;

/// Whether flashmoe's prefill plans run sliding windows and softcapping for this head dim on
/// a device of compute capability `arch` (× 10): the sm_90a kernel's (9.0, head dims 64 and
/// 128); the portable kernel has neither.
pub fn prefill_masks(arch: u32, head_dim: usize) -> bool {
    arch == SM90_ARCH && SM90_HEAD_DIMS.contains(&head_dim)
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

/// The window that candle-flash-attn's window sizes describe for a call of `seq_q` query and
/// `seq_k` key rows (per sequence: the longest ones for varlen calls), normalised: a side
/// that hides no key for any row is -1 (unbounded). So `(None, None)` and over-long windows
/// are [`NO_MASK`], `(None, Some(0))` (what `flash_attn(.., causal)` passes) and
/// `(Some(w >= seq_k - 1), Some(0))` are [`CAUSAL`], and a single query row is never causal
/// (it sees every key under a bottom-right diagonal).
pub fn resolve_window(
    left: Option<usize>,
    right: Option<usize>,
    seq_q: usize,
    seq_k: usize,
) -> Result<Window> {
    // Row i sits at key position d = i + seq_k - seq_q and sees keys d - left ..= d + right:
    // the left side hides a key of some row iff left < seq_k - 1 (the last row's d is
    // seq_k - 1), the right side iff right < seq_q - 1 (the first row's d is seq_k - seq_q).
    let side = |name: &str, w: Option<usize>, rows: usize| -> Result<i32> {
        match w {
            Some(w) if w.saturating_add(1) < rows => i32::try_from(w).map_err(|_| {
                candle_core::Error::Msg(format!("flash-attn: {name} = {w} exceeds i32")).bt()
            }),
            _ => Ok(-1),
        }
    };
    Ok((
        side("window_size_left", left, seq_k)?,
        side("window_size_right", right, seq_q)?,
    ))
}

/// What selects a compiled decode kernel and its constants (`flashmoe::attention::decode`):
/// the paged entry point, and decode-shaped calls of the dense one with a softcap or a
/// sliding window that the prefill plan cannot run ([`prefill_masks`]: head dim 256, or a
/// device other than Hopper). `max_q_per_seq` is the call's rows per sequence
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
    /// `AttentionPlan`: padded batch; no mask or causal on any kernel, sliding windows and
    /// softcap on the sm_90a one ([`prefill_masks`]).
    Dense(ClassKey),
    /// `VarlenPlan`: packed sequences with int32 offsets, windows and softcap per sequence
    /// (sm_90a, head dims 64/128).
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
/// route on a device of compute capability `arch` (× 10; the module docs): the prefill plan
/// for no mask / causal without softcap, and for sliding windows and softcap where the
/// sm_90a kernel serves them; otherwise the decode plan when the call is decode-shaped (at
/// most 16 query rows, head dim 64/128/256); otherwise an error naming the feature.
#[allow(clippy::too_many_arguments)]
pub fn check_call(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
    arch: u32,
) -> Result<Call> {
    let shape = check_layouts(q, k, v)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    if !softmax_scale.is_finite() {
        bail!("flash-attn: softmax_scale must be finite (got {softmax_scale})")
    }
    let softcap = check_softcap(softcap)?;
    let w = resolve_window(window.0, window.1, shape.seq_q, shape.seq_k)?;
    let key = ClassKey::new(elem, &shape, w, softcap, softmax_scale);
    if !key.needs_sm90() {
        return Ok(Call {
            shape,
            plan: PlanKey::Dense(key),
        });
    }
    // A window or softcap: decode-shaped calls on the decode kernels (built for few rows
    // over a long cache: GQA packing, KV splits), the others on the sm_90a prefill kernel.
    if decode_shaped(shape.seq_q, shape.head_dim) {
        let w = decode_window(window.0, window.1, shape.seq_k)?;
        let key = decode_key(elem, &shape, shape.seq_q, w, softcap, softmax_scale);
        return Ok(Call {
            shape,
            plan: PlanKey::Decode(key),
        });
    }
    if prefill_masks(arch, shape.head_dim) {
        return Ok(Call {
            shape,
            plan: PlanKey::Dense(key),
        });
    }
    Err(no_masking_kernel(&shape, w, window, softcap, arch))
}

/// The features of a call that need the sm_90a kernel, in words.
fn masking_features(
    w: Window,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> String {
    let mut what = Vec::new();
    if is_sliding(w) {
        let side = |s: Option<usize>| s.map_or("None".to_string(), |s| format!("Some({s})"));
        what.push(format!(
            "sliding-window attention (window_size_left = {}, window_size_right = {})",
            side(window.0),
            side(window.1)
        ));
    }
    if let Some(c) = softcap {
        what.push(format!("softcapping (softcap = {c})"));
    }
    what.join(" and ")
}

/// The error of a dense call with a sliding window or softcap that no flashmoe kernel serves:
/// neither the sm_90a prefill kernel (device, head dim) nor the decode kernels (rows, head
/// dim). Names the call's rows, head dim and device and what each kernel takes.
fn no_masking_kernel(
    shape: &AttnShape,
    w: Window,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
    arch: u32,
) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "flashmoe-candle: {} with {} query rows per sequence and head dim {} on a GPU of \
         compute capability {}.{} is not supported: flashmoe runs sliding windows and \
         softcapping on its sm_90a prefill kernel (compute capability 9.0, head dims \
         {SM90_HEAD_DIMS:?}, any number of rows) and on its decode kernels (at most \
         {MAX_Q_PER_SEQ} query rows per sequence, head dims {DECODE_HEAD_DIMS:?})",
        masking_features(w, window, softcap),
        shape.seq_q,
        shape.head_dim,
        arch / 10,
        arch % 10,
    ))
    .bt()
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

/// k and v of a packed call: `rank` dims (`caller` and `dims` name them in the error), a
/// contiguous last dim, one shape for both, and q's head size as the last dim.
fn check_packed_kv(
    (q, k, v): (&Layout, &Layout, &Layout),
    head_dim: usize,
    (caller, rank, dims): (&str, usize, &str),
) -> Result<()> {
    for (name, l) in [("k", k), ("v", v)] {
        if l.dims().len() != rank {
            bail!(
                "{caller} expects {name} of rank {rank} {dims}, got {:?}",
                l.dims()
            )
        }
        if l.stride()[rank - 1] != 1 {
            bail!(
                "flash-attn: the last dim of {name} must be contiguous (strides {:?})",
                l.stride()
            )
        }
    }
    if v.shape() != k.shape() {
        bail!(
            "flash-attn: shape mismatch k {:?} and v {:?}",
            k.shape(),
            v.shape()
        )
    }
    if k.dims()[rank - 1] != head_dim {
        bail!(
            "flash-attn: shape mismatch q {:?} and k {:?}",
            q.shape(),
            k.shape()
        )
    }
    Ok(())
}

/// `seqlens_q` and `seqlens_k`: each valid, the same length (batch + 1), returned.
fn check_seqlens_pair(q: (DType, &Layout), k: (DType, &Layout)) -> Result<usize> {
    let nq = check_seqlens("seqlens_q", q.0, q.1)?;
    let nk = check_seqlens("seqlens_k", k.0, k.1)?;
    if nq != nk {
        bail!("flash-attn: seqlens_q and seqlens_k should have the same number of elements {nq} <> {nk}")
    }
    Ok(nq)
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

/// All checks of a `flash_attn_varlen*` call. It runs on `VarlenPlan` (the sm_90a kernel,
/// head dims 64 and 128): no mask, causal, sliding windows (bottom-right per sequence) and
/// softcap. The window is read against `max_seqlen_q/k`, as candle-flash-attn does (a side
/// at least as long as every sequence hides nothing: [`resolve_window`]).
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
    softcap: Option<f32>,
) -> Result<VarlenCall> {
    let (total_q, heads_q, head_dim) = check_packed_q(q)?;
    check_packed_kv(
        (q, k, v),
        head_dim,
        ("flash-attn-varlen", 3, "(total_k, heads_kv, head_size)"),
    )?;
    let (total_k, heads_kv, _) = k.shape().dims3()?;
    check_heads(head_dim, heads_q, heads_kv)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    let nq = check_seqlens_pair(seqlens.0, seqlens.1)?;
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
    let softcap = check_softcap(softcap)?;
    let w = resolve_window(window.0, window.1, max_q, max_k)?;
    if !SM90_HEAD_DIMS.contains(&head_dim) {
        let what = match masking_features(w, window, softcap) {
            f if f.is_empty() => String::new(),
            f => format!(" with {f}"),
        };
        bail!(
            "flashmoe-candle: variable-length batches{what} with head dim {head_dim} are not \
             supported: flashmoe's varlen kernel is the sm_90a one (compute capability 9.0, \
             head dims {SM90_HEAD_DIMS:?}); decode-shaped calls (at most {MAX_Q_PER_SEQ} \
             query rows per sequence, head dims {DECODE_HEAD_DIMS:?}) run on a paged cache \
             through flash_attn_varlen_paged_windowed"
        )
    }
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
        plan: PlanKey::Varlen(ClassKey::new(elem, &shape, w, softcap, softmax_scale)),
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
    check_packed_kv(
        (q, k, v),
        head_dim,
        (
            "flash-attn-varlen paged",
            4,
            "(num_blocks, page_block_size, heads_kv, head_size)",
        ),
    )?;
    let (num_blocks, page, heads_kv, _) = k.shape().dims4()?;
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
    let nq = check_seqlens_pair(idx.seqlens_q, idx.seqlens_k)?;
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
        "flashmoe-candle: {what} is not supported yet (flashmoe implements no mask, causal and \
         sliding-window attention with optional softcapping for padded and variable-length \
         batches: windows and softcapping on the sm_90a kernel, compute capability 9.0 and \
         head dims {SM90_HEAD_DIMS:?}, or on the decode kernels for calls of at most \
         {MAX_Q_PER_SEQ} query rows per sequence)"
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
        let r = |l, rr, sq, sk| resolve_window(l, rr, sq, sk).unwrap();
        assert_eq!(r(None, None, 8, 8), NO_MASK);
        assert_eq!(r(None, Some(0), 8, 8), CAUSAL);
        assert_eq!(r(None, Some(0), 8, 32), CAUSAL);
        // One query row sees every key under a bottom-right causal mask.
        assert_eq!(r(None, Some(0), 1, 32), NO_MASK);
        // Windows wider than the sequence mask nothing.
        assert_eq!(r(Some(31), Some(7), 8, 32), NO_MASK);
        assert_eq!(r(Some(1000), Some(0), 8, 32), CAUSAL);
        // A side that hides a key of some row stays: left < seq_k - 1, right < seq_q - 1.
        assert_eq!(r(Some(4), Some(0), 8, 32), (4, 0));
        assert_eq!(r(Some(30), Some(0), 8, 32), (30, 0));
        assert_eq!(r(None, Some(2), 8, 32), (-1, 2));
        assert_eq!(r(Some(6), None, 8, 32), (6, -1));
        assert_eq!(r(Some(0), Some(6), 8, 32), (0, 6));
        assert_eq!(r(Some(0), Some(7), 8, 32), (0, -1));
        // Mistral's window on a prompt shorter than it is plain causal; on a longer one not.
        assert_eq!(r(Some(4096), Some(0), 1000, 1000), CAUSAL);
        assert_eq!(r(Some(4096), Some(0), 5000, 5000), (4096, 0));
        assert_eq!(r(Some(usize::MAX), Some(usize::MAX), 8, 32), NO_MASK);
        assert!(is_sliding((4, 0)) && is_sliding((-1, 2)) && is_sliding((0, -1)));
        assert!(!is_sliding(NO_MASK) && !is_sliding(CAUSAL));
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
        let key = |e, s: &AttnShape, w, cap, scale| ClassKey::new(e, s, w, cap, scale);
        let base = key(Elem::Bf16, &s, CAUSAL, None, 0.125);
        assert_eq!(base.softmax_scale(), 0.125);
        assert_eq!(base.softcap(), 0.0);
        assert!(base.causal() && !base.needs_sm90());
        // Batch and sequence lengths do not select a plan.
        let other_len = AttnShape {
            batch: 7,
            seq_q: 100,
            seq_k: 3000,
            ..s
        };
        assert_eq!(base, key(Elem::Bf16, &other_len, CAUSAL, None, 0.125));
        // Everything else does.
        for other in [
            key(Elem::F16, &s, CAUSAL, None, 0.125),
            key(Elem::Bf16, &s, NO_MASK, None, 0.125),
            key(Elem::Bf16, &s, (64, 0), None, 0.125),
            key(Elem::Bf16, &s, (64, -1), None, 0.125),
            key(Elem::Bf16, &s, CAUSAL, Some(50.0), 0.125),
            key(Elem::Bf16, &s, CAUSAL, None, 0.126),
            key(
                Elem::Bf16,
                &AttnShape { heads_kv: 8, ..s },
                CAUSAL,
                None,
                0.125,
            ),
            key(
                Elem::Bf16,
                &AttnShape { head_dim: 64, ..s },
                CAUSAL,
                None,
                0.125,
            ),
        ] {
            assert_ne!(base, other);
        }
        let w = key(Elem::Bf16, &s, (64, 0), None, 0.125);
        assert!(w.causal() && w.needs_sm90());
        let c = key(Elem::Bf16, &s, NO_MASK, Some(50.0), 0.125);
        assert!(!c.causal() && c.needs_sm90() && c.softcap() == 50.0);
        let mut set = std::collections::HashSet::new();
        set.insert(base);
        assert!(set.contains(&key(Elem::Bf16, &other_len, CAUSAL, None, 0.125)));
    }

    const BF: (DType, DType, DType) = (DType::BF16, DType::BF16, DType::BF16);
    const H100: u32 = 90;
    const A100: u32 = 80;

    #[test]
    fn check_call_builds_key_and_rejects_nan_scale() {
        let (q, kv) = (bshd(1, 4, 4, 64), bshd(1, 6, 2, 64));
        let c = check_call(BF, &q, &kv, &kv, 0.125, (None, Some(0)), None, H100).unwrap();
        let PlanKey::Dense(key) = c.plan else {
            panic!("causal without softcap is the prefill plan: {:?}", c.plan)
        };
        assert_eq!(key.window, CAUSAL);
        assert_eq!((key.heads_q, key.heads_kv, key.head_dim), (4, 2, 64));
        let nan = check_call(BF, &q, &kv, &kv, f32::NAN, (None, None), None, H100);
        assert!(err(nan).contains("finite"));
        // Softcap 0 is off.
        let c = check_call(BF, &q, &kv, &kv, 0.125, (None, None), Some(0.0), A100).unwrap();
        assert!(matches!(
            c.plan,
            PlanKey::Dense(ClassKey {
                window: NO_MASK,
                softcap_bits: 0,
                ..
            })
        ));
        let neg = check_call(BF, &q, &kv, &kv, 0.1, (None, None), Some(-1.0), H100);
        assert!(err(neg).contains("softcap"));
    }

    /// The route of a dense call: (seq_q, seq_k, head dim, window, softcap, arch).
    fn route(
        (sq, sk, d): (usize, usize, usize),
        window: (Option<usize>, Option<usize>),
        softcap: Option<f32>,
        arch: u32,
    ) -> Result<PlanKey> {
        let (q, kv) = (bshd(2, sq, 8, d), bshd(2, sk, 2, d));
        check_call(BF, &q, &kv, &kv, 0.1, window, softcap, arch).map(|c| c.plan)
    }

    #[test]
    fn prefill_windows_and_softcap_route_to_the_prefill_plan_on_hopper() {
        // Mistral: a 4096-key sliding window, causal, head dim 128, an 8k prompt.
        let mistral = (8192, 8192, 128);
        let PlanKey::Dense(key) = route(mistral, (Some(4096), Some(0)), None, H100).unwrap() else {
            panic!("a prefill window on Hopper is the prefill plan")
        };
        assert_eq!((key.window, key.softcap_bits), ((4096, 0), 0));
        assert!(key.causal() && key.needs_sm90());
        // The same window on a prompt it covers is plain causal: any GPU, no window kernel.
        for arch in [H100, A100] {
            let short = route((1000, 1000, 128), (Some(4096), Some(0)), None, arch).unwrap();
            assert!(matches!(
                short,
                PlanKey::Dense(ClassKey { window: CAUSAL, .. })
            ));
        }
        // Gemma-2 27B (head dim 128): softcap 50, alone and with its sliding window.
        let PlanKey::Dense(key) =
            route((600, 600, 128), (None, Some(0)), Some(50.0), H100).unwrap()
        else {
            panic!("a prefill softcap on Hopper is the prefill plan")
        };
        assert_eq!((key.window, key.softcap()), (CAUSAL, 50.0));
        let p = route((600, 600, 128), (Some(256), Some(0)), Some(50.0), H100).unwrap();
        assert!(matches!(
            p,
            PlanKey::Dense(ClassKey {
                window: (256, 0),
                ..
            })
        ));
        // Local (non-causal) windows and head dim 64.
        let p = route((300, 500, 64), (Some(16), Some(16)), None, H100).unwrap();
        assert!(matches!(
            p,
            PlanKey::Dense(ClassKey {
                window: (16, 16),
                ..
            })
        ));
        let p = route((300, 500, 64), (Some(16), None), None, H100).unwrap();
        assert!(matches!(
            p,
            PlanKey::Dense(ClassKey {
                window: (16, -1),
                ..
            })
        ));
        // Decode-shaped calls stay on the decode kernels, built for few rows over long caches.
        let p = route((3, 300, 128), (Some(64), Some(0)), Some(30.0), H100).unwrap();
        assert!(matches!(
            p,
            PlanKey::Decode(DecodeKey {
                window: (64, 0),
                ..
            })
        ));
    }

    #[test]
    fn decode_shaped_windows_and_softcap_route_to_the_decode_plan() {
        // Head dim 256 (Gemma-2 2B/9B) on Hopper, head dim 128 on an A100 and on Hopper.
        for (d, arch) in [(256, H100), (128, A100), (128, H100)] {
            let sd = (3, 300, d);
            let PlanKey::Decode(key) = route(sd, (None, Some(0)), Some(30.0), arch).unwrap() else {
                panic!("softcap goes to the decode plan (d {d}, arch {arch})")
            };
            assert_eq!(key.window, (-1, 0));
            assert_eq!(key.softcap(), 30.0);
            assert_eq!(key.softmax_scale(), 0.1);
            assert_eq!(key.max_q_per_seq, 4, "3 rows round up to a power of two");
            // A sliding window, and a window wider than seq_k (unbounded).
            let p = route(sd, (Some(64), Some(0)), None, arch).unwrap();
            assert!(matches!(
                p,
                PlanKey::Decode(DecodeKey {
                    window: (64, 0),
                    ..
                })
            ));
            let p = route(sd, (Some(500), Some(3)), Some(5.0), arch).unwrap();
            assert!(matches!(
                p,
                PlanKey::Decode(DecodeKey {
                    window: (-1, 3),
                    ..
                })
            ));
            // No window and no softcap: the prefill plan, as always.
            let p = route(sd, (Some(500), Some(0)), None, arch).unwrap();
            assert!(matches!(p, PlanKey::Dense(ClassKey { window: CAUSAL, .. })));
        }
    }

    #[test]
    fn windows_and_softcap_no_kernel_serves_name_the_limits() {
        // Gemma-2 9B prefill: head dim 256, softcap 50, window 4096.
        let e = err(route(
            (5000, 5000, 256),
            (Some(4096), Some(0)),
            Some(50.0),
            H100,
        ));
        for part in [
            "sliding-window attention (window_size_left = Some(4096), window_size_right = Some(0))",
            "softcapping (softcap = 50)",
            "5000 query rows",
            "head dim 256",
            "compute capability 9.0",
            "sm_90a prefill kernel (compute capability 9.0, head dims [64, 128]",
            "decode kernels (at most 16 query rows per sequence, head dims [64, 128, 256])",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        // Prefill-sized softcap / window off Hopper.
        let e = err(route((64, 64, 128), (None, None), Some(30.0), A100));
        assert!(
            e.contains("softcapping") && e.contains("compute capability 8.0"),
            "{e}"
        );
        assert!(!e.contains("sliding-window attention ("), "{e}");
        let e = err(route((64, 64, 128), (Some(8), Some(0)), None, A100));
        assert!(
            e.contains("sliding-window") && !e.contains("softcapping ("),
            "{e}"
        );
        // Head dim without a decode kernel nor an sm_90a one.
        let e = err(route((1, 64, 96), (None, None), Some(30.0), H100));
        assert!(e.contains("head dim 96"), "{e}");
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
        let ok = |w, cap| check_varlen(bf, &q, &kv, &kv, (u, u), (9, 17), 0.1, w, cap).unwrap();
        let c = ok((None, Some(0)), None);
        assert_eq!((c.batch, c.total_q, c.total_k, c.heads_q), (3, 20, 31, 8));
        let PlanKey::Varlen(key) = c.plan else {
            panic!("{:?}", c.plan)
        };
        assert!(key.window == CAUSAL && key.heads_kv == 2 && key.head_dim == 128);
        assert!(!key.needs_sm90());
        let c = ok((None, None), None);
        assert!(matches!(
            c.plan,
            PlanKey::Varlen(ClassKey {
                window: NO_MASK,
                ..
            })
        ));
        // Windows are read against max_seqlen_q/k (9, 17): sliding ones stay, ones at least
        // as long as every sequence are unbounded.
        for (w, want) in [
            ((Some(4), Some(0)), (4, 0)),
            ((Some(15), Some(7)), (15, 7)),
            ((Some(16), Some(8)), NO_MASK),
            ((Some(100), Some(0)), CAUSAL),
            ((None, Some(3)), (-1, 3)),
        ] {
            let c = ok(w, None);
            assert!(
                matches!(c.plan, PlanKey::Varlen(k) if k.window == want && k.softcap_bits == 0),
                "{w:?}: {:?}",
                c.plan
            );
        }
        // Softcap (0 is off).
        let c = ok((Some(4), Some(0)), Some(50.0));
        assert!(matches!(c.plan, PlanKey::Varlen(k) if k.window == (4, 0) && k.softcap() == 50.0));
        let c = ok((None, None), Some(0.0));
        assert!(matches!(c.plan, PlanKey::Varlen(k) if !k.needs_sm90()));
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
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            Some(-2.0)
        ))
        .contains("softcap"));
        // The varlen kernel is the sm_90a one: head dims 64 and 128 only, windows or not.
        let (q256, kv256) = (packed(20, 8, 256), packed(31, 2, 256));
        let e256 = |w, cap| {
            e(check_varlen(
                bf,
                &q256,
                &kv256,
                &kv256,
                (u, u),
                (9, 17),
                0.1,
                w,
                cap,
            ))
        };
        let msg = e256((Some(4), Some(0)), Some(50.0));
        for part in [
            "sliding-window attention (window_size_left = Some(4), window_size_right = Some(0))",
            "softcapping (softcap = 50)",
            "head dim 256",
            "compute capability 9.0, head dims [64, 128]",
            "flash_attn_varlen_paged_windowed",
        ] {
            assert!(msg.contains(part), "{part:?} missing from: {msg}");
        }
        let msg = e256((None, Some(0)), None);
        assert!(
            msg.contains("variable-length batches with head dim 256"),
            "{msg}"
        );
        assert!(e(check_varlen(
            bf,
            &bshd(1, 20, 8, 128),
            &kv,
            &kv,
            (u, u),
            (9, 17),
            0.1,
            (None, None),
            None
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
            (None, None),
            None
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
            (None, None),
            None
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
