//! Which plan serves an attention call: the decision every front end (flashmoe-candle,
//! flashmoe-py) makes, made once here as pure functions of framework-neutral values (no
//! tensor type, no GPU), with the plan keys the front ends cache plans by.
//!
//! - Window normalisation ([`WindowSize`]): FlashAttention's `window_size`, in the two forms
//!   front ends pass it — `Option<usize>` sides (candle-flash-attn; `None` unbounded) and an
//!   `(left, right)` pair of ints with -1 unbounded (flash_attn's Python API; `causal` sets
//!   the right side to 0) — resolved per call so that a side hiding no key is unbounded
//!   ([`WindowSize::resolve`]; the decode kernels' own reading: [`WindowSize::decode`]).
//! - Softcap validation ([`check_softcap`]): `None` and 0 are off.
//! - Routing ([`route_dense`], [`route_varlen`], [`route_paged`]): a dense call goes to
//!   - the prefill plan ([`Route::Prefill`], `AttentionPlan`) without a sliding window or a
//!     softcap (the sm_90a kernel on Hopper for head dims 64 and 128, the portable kernel
//!     otherwise);
//!   - with a sliding window or a softcap: the decode plan ([`Route::Decode`],
//!     `DecodePlan` over the dense cache) when the call is decode-shaped ([`decode_shaped`]:
//!     at most [`MAX_Q_PER_SEQ`] query rows, head dims 64/128/256 — the decode kernels are
//!     built for few rows over a long cache), else the prefill plan ([`prefill_masks`]: the
//!     sm_90a kernel on compute capability 9.0 for head dims 64 and 128, the portable kernel
//!     for every multiple of 8 up to 256, above 128 on Hopper only);
//!   - otherwise an [`Error::Unsupported`] naming the feature, the call's rows, head dim and
//!     device, and what each kernel takes.
//!
//!   Varlen calls have one plan (`VarlenPlan`: sm_90a, head dims 64/128); paged calls the
//!   decode plan.
//! - ALiBi ([`route_alibi`]): a dense call with slopes goes to the prefill plan's portable
//!   kernel on every GPU, Hopper included (`AttentionPlan::new_alibi`, [`PlanKey::Alibi`]),
//!   with any mask (none, causal, sliding window) and softcap, for any number of query rows;
//!   [`route_alibi_dense`] sends decode-shaped ALiBi calls to the decode plan instead
//!   (`DecodePlan::new_alibi` over the dense cache); the sm_90a kernel has no ALiBi yet.
//!   Varlen calls with slopes are an [`Error::Unsupported`] ([`unsupported_feature`]); paged
//!   calls with slopes take [`route_paged`]'s key on a `DecodePlan::new_alibi` plan.
//! - [`route_scope`]: the sequence lengths around a call over which the route stays the
//!   same, so that a front end that caches routes (flashmoe-py) routes only on a miss.
//! - A value head dim other than the query/key one ([`pad_value_head_dim`]): the zero
//!   padding to one head dim and the scale that keep such a call exact on these routes.
//!
//! Errors carry the front end's vocabulary: [`Error::InvalidProblem`] messages are meant to
//! follow a `flash-attn: ` prefix, [`Error::Unsupported`] reasons (backend `"flashmoe"`) are
//! whole sentences.

use crate::attention::decode::{DecodeClass, HEAD_DIMS as DECODE_HEAD_DIMS, MAX_Q_PER_SEQ};
use crate::attention::prefill::abi::{v1_serves, V1_HEAD_DIMS_TEXT};
use crate::attention::prefill::tiles::SM90_HEAD_DIMS;
use crate::attention::AttentionClass;
use crate::{DType, Error, Result};

mod value_dim;
pub use value_dim::{pad_head_dims, pad_value_head_dim, PadTarget, ValueDimPad};

/// The backend name of the router's [`Error::Unsupported`] errors.
pub const BACKEND: &str = "flashmoe";

/// The mask of a call: `(left, right)` keys around each query row's bottom-right diagonal
/// d = i + seq_k - seq_q (row i sees keys d - left ..= d + right), -1 = unbounded:
/// FlashAttention's `window_size`, as the plans take it. [`WindowSize::resolve`] normalises
/// it per call, so a side that hides no key is -1: [`NO_MASK`], [`CAUSAL`] or a sliding
/// window ([`is_sliding`]).
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

/// Compute capability × 10 of the devices the sm_90a kernel runs on (Hopper).
pub const SM90_ARCH: u32 = 90;

/// Whether flashmoe's prefill plans run sliding windows and softcapping for this head dim on
/// a device of compute capability `arch` (× 10): the sm_90a kernel's (9.0, head dims 64 and
/// 128), else the portable kernel's (every multiple of 8 up to 256, [`v1_serves`]; head dims
/// above 128 need Hopper's shared memory).
pub fn prefill_masks(arch: u32, head_dim: usize) -> bool {
    (arch == SM90_ARCH && SM90_HEAD_DIMS.contains(&head_dim))
        || (v1_serves(head_dim) && (head_dim <= 128 || arch >= SM90_ARCH))
}

/// Whether a call with `rows` query rows per sequence and this head dim fits the decode
/// kernels.
pub fn decode_shaped(rows: usize, head_dim: usize) -> bool {
    rows <= MAX_Q_PER_SEQ && DECODE_HEAD_DIMS.contains(&head_dim)
}

/// The softmax scale a class with `softmax_scale: None` uses: 1/sqrt(head_dim), computed as
/// the plans compute it (so `Some(default_scale(d))` selects bit-identical constants).
pub fn default_scale(head_dim: usize) -> f32 {
    1.0 / (head_dim as f32).sqrt()
}

/// Element types the attention kernels take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    Bf16,
    F16,
}

impl Elem {
    pub fn dtype(self) -> DType {
        match self {
            Elem::Bf16 => DType::Bf16,
            Elem::F16 => DType::F16,
        }
    }

    /// bf16 or f16; None for any other dtype.
    pub fn of(dtype: DType) -> Option<Elem> {
        match dtype {
            DType::Bf16 => Some(Elem::Bf16),
            DType::F16 => Some(Elem::F16),
            _ => None,
        }
    }
}

/// The shape of one dense call, read from q (b, seq_q, heads_q, d) and k/v (b, seq_k,
/// heads_kv, d); for varlen and paged calls `seq_q` / `seq_k` are the longest sequences
/// (`max_seqlen_q` / `max_seqlen_k`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub seq_q: usize,
    pub seq_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

/// How a front end spells the window (for messages only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WindowSpelling {
    /// candle-flash-attn: `window_size_left = Some(4096), window_size_right = Some(0)`.
    Options,
    /// flash_attn's Python API: `window_size = (4096, 0)`, -1 unbounded.
    Pair,
}

/// FlashAttention's `window_size` as a call passes it, before normalisation: each side
/// `None` (unbounded) or a key count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WindowSize {
    pub left: Option<usize>,
    pub right: Option<usize>,
    pub spelling: WindowSpelling,
}

impl WindowSize {
    /// candle-flash-attn's sides: `(None, None)` no mask, `(None, Some(0))` causal.
    pub fn from_options(left: Option<usize>, right: Option<usize>) -> WindowSize {
        WindowSize {
            left,
            right,
            spelling: WindowSpelling::Options,
        }
    }

    /// flash_attn's `(left, right)` ints, -1 unbounded; `causal` sets the right side to 0.
    /// A side below -1 is an [`Error::InvalidProblem`] (the text of the plans' own check).
    pub fn from_pair(left: i64, right: i64, causal: bool) -> Result<WindowSize> {
        if left < -1 || right < -1 {
            return Err(Error::invalid(format!(
                "window ({left}, {right}): each side is -1 (unbounded) or >= 0"
            )));
        }
        let side = |s: i64| usize::try_from(s).ok();
        Ok(WindowSize {
            left: side(left),
            right: if causal { Some(0) } else { side(right) },
            spelling: WindowSpelling::Pair,
        })
    }

    /// The window these sizes describe for a call of `seq_q` query and `seq_k` key rows
    /// (per sequence: the longest ones for varlen calls), normalised: a side that hides no
    /// key for any row is -1 (unbounded). So `(None, None)` and over-long windows are
    /// [`NO_MASK`], `(None, Some(0))` and `(Some(w >= seq_k - 1), Some(0))` are [`CAUSAL`],
    /// and a single query row is never causal (it sees every key under a bottom-right
    /// diagonal). Errors name a side past i32.
    pub fn resolve(self, seq_q: usize, seq_k: usize) -> Result<Window> {
        // Row i sits at key position d = i + seq_k - seq_q and sees keys d - left ..= d +
        // right: the left side hides a key of some row iff left < seq_k - 1 (the last row's
        // d is seq_k - 1), the right side iff right < seq_q - 1 (the first row's d is
        // seq_k - seq_q).
        let side = |name: &str, w: Option<usize>, rows: usize| -> Result<i32> {
            match w {
                Some(w) if w.saturating_add(1) < rows => i32::try_from(w)
                    .map_err(|_| Error::invalid(format!("{name} = {w} exceeds i32"))),
                _ => Ok(-1),
            }
        };
        Ok((
            side("window_size_left", self.left, seq_k)?,
            side("window_size_right", self.right, seq_q)?,
        ))
    }

    /// The sizes as the decode kernel's `(left, right)`: `None` and sizes beyond
    /// `max_seqlen_k` are unbounded (-1), as candle-flash-attn maps them for FA2.
    pub fn decode(self, max_seqlen_k: usize) -> Result<Window> {
        let side = |w: Option<usize>| -> Result<i32> {
            match w {
                Some(w) if w <= max_seqlen_k => i32::try_from(w)
                    .map_err(|_| Error::invalid(format!("window size {w} exceeds i32"))),
                _ => Ok(-1),
            }
        };
        Ok((side(self.left)?, side(self.right)?))
    }

    /// The sizes in the front end's spelling.
    fn describe(&self) -> String {
        match self.spelling {
            WindowSpelling::Options => {
                let side =
                    |s: Option<usize>| s.map_or("None".to_string(), |s| format!("Some({s})"));
                format!(
                    "window_size_left = {}, window_size_right = {}",
                    side(self.left),
                    side(self.right)
                )
            }
            WindowSpelling::Pair => {
                let side = |s: Option<usize>| s.map_or(-1, |s| s as i128);
                format!("window_size = ({}, {})", side(self.left), side(self.right))
            }
        }
    }
}

/// The softcap of a call: `None` and 0 are off (FlashAttention's convention); otherwise it
/// must be finite and positive.
pub fn check_softcap(softcap: Option<f32>) -> Result<Option<f32>> {
    match softcap {
        None => Ok(None),
        Some(0.0) => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(s)),
        Some(s) => Err(Error::invalid(format!(
            "softcap must be finite and >= 0 (got {s})"
        ))),
    }
}

/// Everything that selects a compiled prefill kernel and its constants: one plan per key and
/// device. The scale and softcap are kept as bit patterns so the key is `Eq + Hash`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ClassKey {
    pub elem: Elem,
    pub head_dim: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    /// The call's normalised window ([`WindowSize::resolve`]): [`NO_MASK`], [`CAUSAL`] or a
    /// sliding window.
    pub window: Window,
    /// The softcap's bits; 0 (`0.0f32`) is off.
    pub softcap_bits: u32,
    pub scale_bits: u32,
}

impl ClassKey {
    /// `window` normalised ([`WindowSize::resolve`]), `softcap` checked ([`check_softcap`]).
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

    /// The key as the prefill and varlen plans' class: a right side of 0 is `causal` (which
    /// bounds the right side), the left side stays the window's; plain causal and no mask
    /// carry `NO_WINDOW`.
    pub fn attention_class(&self) -> AttentionClass {
        let causal = self.causal();
        let (left, right) = self.window;
        AttentionClass {
            dtype: self.elem.dtype(),
            head_dim: self.head_dim,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            causal,
            softmax_scale: Some(self.softmax_scale()),
            window: (left, if causal { -1 } else { right }),
            softcap: self.softcap(),
        }
    }
}

/// What selects a compiled decode kernel and its constants (`attention::decode`): the paged
/// entry point, and decode-shaped dense calls with a softcap or a sliding window.
/// `max_q_per_seq` is the call's rows per sequence rounded up to a power of two, so one plan
/// serves neighbouring sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeKey {
    pub elem: Elem,
    pub head_dim: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub max_q_per_seq: usize,
    /// (left, right) around each row's bottom-right diagonal; -1 = unbounded
    /// ([`WindowSize::decode`]).
    pub window: Window,
    pub softcap_bits: u32,
    pub scale_bits: u32,
}

impl DecodeKey {
    fn new(
        elem: Elem,
        shape: &AttnShape,
        rows: usize,
        window: Window,
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

    pub fn softmax_scale(&self) -> f32 {
        f32::from_bits(self.scale_bits)
    }
    pub fn softcap(&self) -> f32 {
        f32::from_bits(self.softcap_bits)
    }

    /// The key as the decode plan's class, for any page size (taken from the cache per call:
    /// one plan for every cache).
    pub fn decode_class(&self) -> DecodeClass {
        DecodeClass {
            dtype: self.elem.dtype(),
            head_dim: self.head_dim,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            page_size: 0,
            max_q_per_seq: self.max_q_per_seq,
            window: self.window,
            softcap: self.softcap(),
            softmax_scale: Some(self.softmax_scale()),
        }
    }
}

/// The plan a call runs on, and its cache key (with the device).
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
    /// `AttentionPlan::new_alibi`: a padded batch with ALiBi slopes, any mask and softcap,
    /// on the portable kernel ([`route_alibi`]).
    Alibi(ClassKey),
}

impl PlanKey {
    pub fn elem(&self) -> Elem {
        match self {
            PlanKey::Dense(k) | PlanKey::Varlen(k) | PlanKey::Alibi(k) => k.elem,
            PlanKey::Decode(k) => k.elem,
        }
    }
}

/// The plan a dense call runs on ([`route_dense`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// `AttentionPlan` of this class.
    Prefill(ClassKey),
    /// `DecodePlan` of this class over the dense cache: k/v (b, seq_k, heads_kv, d) as b
    /// pages of seq_k keys, the identity block table, every sequence seq_k keys long.
    Decode(DecodeKey),
}

impl From<Route> for PlanKey {
    fn from(r: Route) -> PlanKey {
        match r {
            Route::Prefill(k) => PlanKey::Dense(k),
            Route::Decode(k) => PlanKey::Decode(k),
        }
    }
}

/// One call's arguments as the router takes them (the shape already checked by the front
/// end: non-empty, head dim, GQA).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnCall {
    pub elem: Elem,
    pub shape: AttnShape,
    /// Multiplies q·k ([`default_scale`] for FlashAttention's `None`).
    pub softmax_scale: f32,
    pub window: WindowSize,
    /// `None` or 0: off.
    pub softcap: Option<f32>,
}

impl AttnCall {
    /// The checks every route starts with: a finite scale, a valid softcap.
    fn softcap(&self) -> Result<Option<f32>> {
        if !self.softmax_scale.is_finite() {
            return Err(Error::invalid(format!(
                "softmax_scale must be finite (got {})",
                self.softmax_scale
            )));
        }
        check_softcap(self.softcap)
    }
}

/// The route of one dense call on a device of compute capability `arch` (× 10; the module
/// docs): the prefill plan for no mask / causal without softcap; with a sliding window or a
/// softcap, the decode plan when the call is decode-shaped (at most 16 query rows, head dim
/// 64/128/256), else the prefill plan where the sm_90a kernel serves it; otherwise an
/// [`Error::Unsupported`] naming the feature. Checks first: a finite scale
/// ([`Error::InvalidProblem`]), the softcap ([`check_softcap`]), the window's sides.
pub fn route_dense(call: &AttnCall, arch: u32) -> Result<Route> {
    let softcap = call.softcap()?;
    let shape = &call.shape;
    let w = call.window.resolve(shape.seq_q, shape.seq_k)?;
    let key = ClassKey::new(call.elem, shape, w, softcap, call.softmax_scale);
    if !key.needs_sm90() {
        return Ok(Route::Prefill(key));
    }
    // A window or softcap: decode-shaped calls on the decode kernels (built for few rows
    // over a long cache: GQA packing, KV splits), the others on the sm_90a prefill kernel.
    if decode_shaped(shape.seq_q, shape.head_dim) {
        let dw = call.window.decode(shape.seq_k)?;
        let key = DecodeKey::new(
            call.elem,
            shape,
            shape.seq_q,
            dw,
            softcap,
            call.softmax_scale,
        );
        return Ok(Route::Decode(key));
    }
    if prefill_masks(arch, shape.head_dim) {
        return Ok(Route::Prefill(key));
    }
    Err(no_masking_kernel(shape, w, &call.window, softcap, arch))
}

/// The class of a varlen call (`seq_q` / `seq_k` the longest sequences): `VarlenPlan`, the
/// sm_90a kernel, head dims 64 and 128, windows (read against the longest sequences, as
/// candle-flash-attn does) and softcap included; other head dims an
/// [`Error::Unsupported`] that names the paged route for decode-shaped calls.
pub fn route_varlen(call: &AttnCall) -> Result<ClassKey> {
    let softcap = call.softcap()?;
    let shape = &call.shape;
    let w = call.window.resolve(shape.seq_q, shape.seq_k)?;
    let head_dim = shape.head_dim;
    if !SM90_HEAD_DIMS.contains(&head_dim) {
        let what = match masking_features(w, &call.window, softcap) {
            f if f.is_empty() => String::new(),
            f => format!(" with {f}"),
        };
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "variable-length batches{what} with head dim {head_dim} are not supported: \
                 flashmoe's varlen kernel is the sm_90a one (compute capability 9.0, head dims \
                 {SM90_HEAD_DIMS:?}); decode-shaped calls (at most {MAX_Q_PER_SEQ} query rows \
                 per sequence, head dims {DECODE_HEAD_DIMS:?}) run on a paged cache through \
                 flash_attn_varlen_paged_windowed"
            ),
        ));
    }
    Ok(ClassKey::new(
        call.elem,
        shape,
        w,
        softcap,
        call.softmax_scale,
    ))
}

/// The class of a paged call (`seq_q` = `max_seqlen_q`, `seq_k` = `max_seqlen_k`): the
/// decode plan, at most [`MAX_Q_PER_SEQ`] query rows per sequence, head dims 64/128/256;
/// longer query sequences (chunked prefill on a paged cache) and other head dims are an
/// [`Error::Unsupported`] naming that ([`unsupported_feature`]).
pub fn route_paged(call: &AttnCall) -> Result<DecodeKey> {
    let softcap = call.softcap()?;
    let shape = &call.shape;
    let (head_dim, max_q) = (shape.head_dim, shape.seq_q);
    if !DECODE_HEAD_DIMS.contains(&head_dim) {
        return Err(unsupported_feature(&format!(
            "paged KV with head dim {head_dim} (the paged kernels take {DECODE_HEAD_DIMS:?})"
        )));
    }
    if max_q > MAX_Q_PER_SEQ {
        return Err(unsupported_feature(&format!(
            "paged KV with {max_q} query rows per sequence (max_seqlen_q; the paged kernels \
             take at most {MAX_Q_PER_SEQ}: decode and speculative steps, not chunked prefill)"
        )));
    }
    let w = call.window.decode(shape.seq_k)?;
    Ok(DecodeKey::new(
        call.elem,
        shape,
        max_q,
        w,
        softcap,
        call.softmax_scale,
    ))
}

/// The class of a dense ALiBi call (module docs): the portable prefill kernel on every GPU
/// (compute capability 8.0 and newer), any mask and softcap, head dims that are multiples of 8
/// up to 256 ([`v1_serves`]);
/// the slopes themselves are checked by the plan (`AttentionPlan::check_alibi`). Checks as
/// [`route_dense`]: a finite scale, the softcap, the window's sides; another head dim is an
/// [`Error::Unsupported`] naming the served ones.
pub fn route_alibi(call: &AttnCall) -> Result<ClassKey> {
    let softcap = call.softcap()?;
    let shape = &call.shape;
    let w = call.window.resolve(shape.seq_q, shape.seq_k)?;
    if !v1_serves(shape.head_dim) {
        return Err(Error::unsupported(
            BACKEND,
            format!(
                "ALiBi with head dim {} is not supported: flashmoe runs ALiBi on its portable \
                 prefill kernel (head dims: {V1_HEAD_DIMS_TEXT})",
                shape.head_dim
            ),
        ));
    }
    Ok(ClassKey::new(
        call.elem,
        shape,
        w,
        softcap,
        call.softmax_scale,
    ))
}

/// The plan of a dense ALiBi call: decode-shaped calls ([`decode_shaped`]) on the decode plan
/// ([`Route::Decode`], to be built with `DecodePlan::new_alibi`, window read as
/// [`WindowSize::decode`]), the others on the portable prefill kernel ([`Route::Prefill`],
/// `AttentionPlan::new_alibi`, [`route_alibi`]'s key). Checks as [`route_alibi`]. The lengths
/// over which the answer holds: [`route_scope_alibi`].
pub fn route_alibi_dense(call: &AttnCall) -> Result<Route> {
    let key = route_alibi(call)?;
    let shape = &call.shape;
    if decode_shaped(shape.seq_q, shape.head_dim) {
        let dw = call.window.decode(shape.seq_k)?;
        let softcap = call.softcap()?;
        return Ok(Route::Decode(DecodeKey::new(
            call.elem,
            shape,
            shape.seq_q,
            dw,
            softcap,
            call.softmax_scale,
        )));
    }
    Ok(Route::Prefill(key))
}

/// The [`RouteScope`] of [`route_alibi_dense`]: [`route_scope`]'s cells with the
/// decode-shaped limit and the decode plan's row buckets always among the cuts.
pub fn route_scope_alibi(call: &AttnCall) -> RouteScope {
    scope_of(call, true)
}

/// The ranges of query rows `seq_q` and key rows `seq_k` (inclusive, `(lo, hi)` each) around
/// the call's over which [`route_dense`] gives the same result for the call's other
/// arguments, on any device: a front end that caches the route by those arguments keeps it
/// for every call whose lengths fall in both ranges (an `Ok` route; errors are not meant to
/// be cached: their text names the rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteScope {
    pub seq_q: (usize, usize),
    pub seq_k: (usize, usize),
}

impl RouteScope {
    pub fn contains(&self, seq_q: usize, seq_k: usize) -> bool {
        (self.seq_q.0..=self.seq_q.1).contains(&seq_q)
            && (self.seq_k.0..=self.seq_k.1).contains(&seq_k)
    }
}

/// The [`RouteScope`] of a dense call. The route depends on the lengths only through
/// thresholds of the window's sides, the decode-shaped limit and the decode plan's row
/// buckets; the scope is the cell of those thresholds that holds the call.
pub fn route_scope(call: &AttnCall) -> RouteScope {
    scope_of(call, false)
}

fn scope_of(call: &AttnCall, alibi: bool) -> RouteScope {
    let (left, right) = (call.window.left, call.window.right);
    // Where each length-dependent predicate of `route_dense` flips: `t` such that the
    // predicate differs between length t - 1 and t.
    let mut q_cuts = Vec::new();
    let mut k_cuts = Vec::new();
    // resolve: the right side bounds some row iff right + 1 < seq_q; the left iff left + 1
    // < seq_k.
    if let Some(r) = right {
        q_cuts.push(r.saturating_add(2));
    }
    if let Some(l) = left {
        k_cuts.push(l.saturating_add(2));
    }
    // A call that can need the masked kernels: decode-shaped or not, the row bucket, and
    // the decode kernel's reading of the window (a side is kept iff it is <= seq_k).
    let maybe_masked = alibi
        || call.softcap.is_some_and(|c| c != 0.0)
        || left.is_some()
        || right.is_some_and(|r| r > 0);
    if maybe_masked {
        q_cuts.extend([2, 3, 5, 9, MAX_Q_PER_SEQ + 1]);
        k_cuts.extend(left);
        k_cuts.extend(right);
    }
    let cell = |cuts: &[usize], n: usize| {
        let lo = cuts.iter().copied().filter(|&t| t <= n).max().unwrap_or(0);
        let hi = cuts
            .iter()
            .copied()
            .filter(|&t| t > n)
            .min()
            .map_or(usize::MAX, |t| t - 1);
        (lo.max(1), hi)
    };
    RouteScope {
        seq_q: cell(&q_cuts, call.shape.seq_q),
        seq_k: cell(&k_cuts, call.shape.seq_k),
    }
}

/// The features of a call that need the masked kernels, in words.
fn masking_features(w: Window, window: &WindowSize, softcap: Option<f32>) -> String {
    let mut what = Vec::new();
    if is_sliding(w) {
        what.push(format!("sliding-window attention ({})", window.describe()));
    }
    if let Some(c) = softcap {
        what.push(format!("softcapping (softcap = {c})"));
    }
    what.join(" and ")
}

/// The error of a dense call with a sliding window or softcap that no flashmoe kernel serves:
/// neither the sm_90a prefill kernel (device, head dim), the portable one (head dim, and
/// Hopper above 128) nor the decode kernels (rows, head dim).
fn no_masking_kernel(
    shape: &AttnShape,
    w: Window,
    window: &WindowSize,
    softcap: Option<f32>,
    arch: u32,
) -> Error {
    Error::unsupported(
        BACKEND,
        format!(
            "{} with {} query rows per sequence and head dim {} on a GPU of compute capability \
             {}.{} is not supported: flashmoe runs sliding windows and softcapping on its \
             sm_90a prefill kernel (compute capability 9.0, head dims {SM90_HEAD_DIMS:?}, any \
             number of rows), on its portable prefill kernel (head dims: {V1_HEAD_DIMS_TEXT}; \
             above 128 on compute capability 9.0 only) and on its decode kernels (at most \
             {MAX_Q_PER_SEQ} query rows per sequence, head dims {DECODE_HEAD_DIMS:?})",
            masking_features(w, window, softcap),
            shape.seq_q,
            shape.head_dim,
            arch / 10,
            arch % 10,
        ),
    )
}

/// The error of a feature flashmoe lacks (ALiBi on varlen or paged calls, chunked prefill
/// on a paged cache, …),
/// naming it and what flashmoe implements.
pub fn unsupported_feature(what: &str) -> Error {
    Error::unsupported(
        BACKEND,
        format!(
            "{what} is not supported yet (flashmoe implements no mask, causal and \
             sliding-window attention with optional softcapping for padded and variable-length \
             batches: windows and softcapping on the sm_90a kernel, compute capability 9.0 and \
             head dims {SM90_HEAD_DIMS:?}, or on the decode kernels for calls of at most \
             {MAX_Q_PER_SEQ} query rows per sequence; ALiBi for padded batches on the \
             portable kernel, head dims: {V1_HEAD_DIMS_TEXT})"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: u32 = 90;
    const A100: u32 = 80;

    fn opts(l: Option<usize>, r: Option<usize>) -> WindowSize {
        WindowSize::from_options(l, r)
    }

    fn shape(sq: usize, sk: usize, d: usize) -> AttnShape {
        AttnShape {
            batch: 2,
            seq_q: sq,
            seq_k: sk,
            heads_q: 8,
            heads_kv: 2,
            head_dim: d,
        }
    }

    fn call(
        (sq, sk, d): (usize, usize, usize),
        window: WindowSize,
        softcap: Option<f32>,
    ) -> AttnCall {
        AttnCall {
            elem: Elem::Bf16,
            shape: shape(sq, sk, d),
            softmax_scale: 0.1,
            window,
            softcap,
        }
    }

    /// The route of a dense call: (seq_q, seq_k, head dim), candle's window, softcap, arch.
    fn route(
        sqkd: (usize, usize, usize),
        window: (Option<usize>, Option<usize>),
        softcap: Option<f32>,
        arch: u32,
    ) -> Result<Route> {
        route_dense(&call(sqkd, opts(window.0, window.1), softcap), arch)
    }

    fn err(r: Result<impl std::fmt::Debug>) -> String {
        r.expect_err("expected an error").to_string()
    }

    #[test]
    fn windows() {
        let r = |l, rr, sq, sk| opts(l, rr).resolve(sq, sk).unwrap();
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
        // A side past i32 that hides keys is an error naming it.
        let big = i32::MAX as usize + 1;
        let e = err(opts(Some(big), None).resolve(8, usize::MAX));
        assert!(
            e.contains("window_size_left = 2147483648 exceeds i32"),
            "{e}"
        );
        // The decode kernel's reading: sides beyond max_seqlen_k are unbounded.
        assert_eq!(opts(Some(500), Some(3)).decode(300).unwrap(), (-1, 3));
        assert_eq!(opts(Some(300), None).decode(300).unwrap(), (300, -1));
        assert!(err(opts(Some(big), None).decode(usize::MAX)).contains("window size"));
    }

    #[test]
    fn pair_windows_follow_flash_attn() {
        let p = |l, r, causal| WindowSize::from_pair(l, r, causal).unwrap();
        assert_eq!(
            (p(-1, -1, false).left, p(-1, -1, false).right),
            (None, None)
        );
        // causal sets the right side to 0, whatever it was.
        assert_eq!(
            (p(-1, -1, true).left, p(-1, -1, true).right),
            (None, Some(0))
        );
        assert_eq!(
            (p(64, 5, true).left, p(64, 5, true).right),
            (Some(64), Some(0))
        );
        assert_eq!(
            (p(16, 16, false).left, p(16, 16, false).right),
            (Some(16), Some(16))
        );
        // The same normalisation as the Option form.
        assert_eq!(p(4096, 0, false).resolve(1000, 1000).unwrap(), CAUSAL);
        assert_eq!(p(-1, -1, true).resolve(1, 9).unwrap(), NO_MASK);
        assert_eq!(p(2, 2, false).resolve(8, 8).unwrap(), (2, 2));
        // Below -1 is invalid, in the plans' words.
        let e = err(WindowSize::from_pair(-2, 0, false));
        assert!(
            e.contains("window (-2, 0)") && e.contains("-1 (unbounded) or >= 0"),
            "{e}"
        );
        assert!(err(WindowSize::from_pair(16, -5, true)).contains("window (16, -5)"));
        // Messages speak the caller's form.
        let e = err(route_dense(
            &call((64, 64, 256), p(8, 8, false), None),
            A100,
        ));
        assert!(
            e.contains("sliding-window attention (window_size = (8, 8))"),
            "{e}"
        );
        let e = err(route((64, 64, 256), (Some(8), None), None, A100));
        assert!(
            e.contains("(window_size_left = Some(8), window_size_right = None)"),
            "{e}"
        );
    }

    #[test]
    fn softcap_and_scale_checks() {
        assert_eq!(check_softcap(None).unwrap(), None);
        assert_eq!(check_softcap(Some(0.0)).unwrap(), None);
        assert_eq!(check_softcap(Some(50.0)).unwrap(), Some(50.0));
        for bad in [-1.0, f32::NAN, f32::INFINITY] {
            let e = err(check_softcap(Some(bad)));
            assert!(e.contains("softcap must be finite and >= 0"), "{e}");
        }
        let mut c = call((4, 6, 64), opts(None, None), None);
        c.softmax_scale = f32::NAN;
        assert!(err(route_dense(&c, H100)).contains("softmax_scale must be finite"));
        // Softcap 0 is off: the prefill plan on any GPU.
        let r = route((4, 6, 64), (None, None), Some(0.0), A100).unwrap();
        assert!(matches!(
            r,
            Route::Prefill(ClassKey {
                window: NO_MASK,
                softcap_bits: 0,
                ..
            })
        ));
        assert!(err(route((4, 6, 64), (None, None), Some(-1.0), H100)).contains("softcap"));
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
        // As the plans' classes: causal bounds the right side; the left side stays.
        let a = w.attention_class();
        assert!(a.causal && a.window == (64, -1) && a.softmax_scale == Some(0.125));
        assert_eq!(a.dtype, DType::Bf16);
        let a = key(Elem::F16, &s, (16, 16), Some(30.0), 0.125).attention_class();
        assert!(!a.causal && a.window == (16, 16) && a.softcap == 30.0);
        assert_eq!(a.dtype, DType::F16);
    }

    #[test]
    fn prefill_windows_and_softcap_route_to_the_prefill_plan_on_hopper() {
        // Mistral: a 4096-key sliding window, causal, head dim 128, an 8k prompt.
        let mistral = (8192, 8192, 128);
        let Route::Prefill(key) = route(mistral, (Some(4096), Some(0)), None, H100).unwrap() else {
            panic!("a prefill window on Hopper is the prefill plan")
        };
        assert_eq!((key.window, key.softcap_bits), ((4096, 0), 0));
        assert!(key.causal() && key.needs_sm90());
        // The same window on a prompt it covers is plain causal: any GPU, no window kernel.
        for arch in [H100, A100] {
            let short = route((1000, 1000, 128), (Some(4096), Some(0)), None, arch).unwrap();
            assert!(matches!(
                short,
                Route::Prefill(ClassKey { window: CAUSAL, .. })
            ));
        }
        // Gemma-2 27B (head dim 128): softcap 50, alone and with its sliding window.
        let Route::Prefill(key) =
            route((600, 600, 128), (None, Some(0)), Some(50.0), H100).unwrap()
        else {
            panic!("a prefill softcap on Hopper is the prefill plan")
        };
        assert_eq!((key.window, key.softcap()), (CAUSAL, 50.0));
        let p = route((600, 600, 128), (Some(256), Some(0)), Some(50.0), H100).unwrap();
        assert!(matches!(
            p,
            Route::Prefill(ClassKey {
                window: (256, 0),
                ..
            })
        ));
        // Local (non-causal) windows and head dim 64.
        let p = route((300, 500, 64), (Some(16), Some(16)), None, H100).unwrap();
        assert!(matches!(
            p,
            Route::Prefill(ClassKey {
                window: (16, 16),
                ..
            })
        ));
        let p = route((300, 500, 64), (Some(16), None), None, H100).unwrap();
        assert!(matches!(
            p,
            Route::Prefill(ClassKey {
                window: (16, -1),
                ..
            })
        ));
        // Decode-shaped calls stay on the decode kernels, built for few rows over long caches.
        let p = route((3, 300, 128), (Some(64), Some(0)), Some(30.0), H100).unwrap();
        assert!(matches!(
            p,
            Route::Decode(DecodeKey {
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
            let Route::Decode(key) = route(sd, (None, Some(0)), Some(30.0), arch).unwrap() else {
                panic!("softcap goes to the decode plan (d {d}, arch {arch})")
            };
            assert_eq!(key.window, (-1, 0));
            assert_eq!(key.softcap(), 30.0);
            assert_eq!(key.softmax_scale(), 0.1);
            assert_eq!(key.max_q_per_seq, 4, "3 rows round up to a power of two");
            let c = key.decode_class();
            assert_eq!((c.page_size, c.max_q_per_seq, c.window), (0, 4, (-1, 0)));
            assert_eq!(
                (c.softcap, c.softmax_scale, c.head_dim),
                (30.0, Some(0.1), d)
            );
            // A sliding window, and a window wider than seq_k (unbounded).
            let p = route(sd, (Some(64), Some(0)), None, arch).unwrap();
            assert!(matches!(
                p,
                Route::Decode(DecodeKey {
                    window: (64, 0),
                    ..
                })
            ));
            let p = route(sd, (Some(500), Some(3)), Some(5.0), arch).unwrap();
            assert!(matches!(
                p,
                Route::Decode(DecodeKey {
                    window: (-1, 3),
                    ..
                })
            ));
            // No window and no softcap: the prefill plan, as always.
            let p = route(sd, (Some(500), Some(0)), None, arch).unwrap();
            assert!(matches!(p, Route::Prefill(ClassKey { window: CAUSAL, .. })));
        }
        assert_eq!(
            PlanKey::from(route((3, 300, 128), (None, None), Some(5.0), A100).unwrap()).elem(),
            Elem::Bf16
        );
    }

    #[test]
    fn windows_and_softcap_no_kernel_serves_name_the_limits() {
        // Gemma-2 9B prefill (head dim 256, softcap 50, window 4096) on Hopper: the portable
        // prefill kernel; off Hopper its 256 tile does not fit: an error naming the limits.
        let r = route((5000, 5000, 256), (Some(4096), Some(0)), Some(50.0), H100).unwrap();
        assert!(matches!(r, Route::Prefill(k) if k.window == (4096, 0) && k.softcap() == 50.0));
        let r = route((5000, 5000, 256), (Some(4096), Some(0)), Some(50.0), A100);
        assert!(matches!(r, Err(Error::Unsupported { .. })));
        let e = err(r);
        for part in [
            "sliding-window attention (window_size_left = Some(4096), window_size_right = Some(0))",
            "softcapping (softcap = 50)",
            "5000 query rows",
            "head dim 256",
            "compute capability 8.0",
            "sm_90a prefill kernel (compute capability 9.0, head dims [64, 128]",
            "portable prefill kernel (head dims: multiples of 8",
            "decode kernels (at most 16 query rows per sequence, head dims [64, 128, 256])",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        // Prefill-sized softcap / window off Hopper at head dims up to 128: the portable kernel.
        for d in [32, 96, 128] {
            let r = route((64, 64, d), (None, None), Some(30.0), A100).unwrap();
            assert!(matches!(r, Route::Prefill(k) if k.softcap() == 30.0 && k.head_dim == d));
            let r = route((64, 64, d), (Some(8), Some(0)), None, A100).unwrap();
            assert!(matches!(r, Route::Prefill(k) if k.window == (8, 0)));
        }
        let e = err(route((64, 64, 192), (None, None), Some(30.0), A100));
        assert!(
            e.contains("softcapping") && e.contains("compute capability 8.0"),
            "{e}"
        );
        assert!(!e.contains("sliding-window attention ("), "{e}");
        let e = err(route((64, 64, 160), (Some(8), Some(0)), None, A100));
        assert!(
            e.contains("sliding-window") && !e.contains("softcapping ("),
            "{e}"
        );
        // Head dim 96 decode-shaped (no decode kernel): the portable prefill kernel; a head dim
        // no kernel serves: an error.
        let r = route((1, 64, 96), (None, None), Some(30.0), H100).unwrap();
        assert!(matches!(r, Route::Prefill(k) if k.head_dim == 96));
        let e = err(route((1, 64, 12), (None, None), Some(30.0), H100));
        assert!(e.contains("head dim 12"), "{e}");
    }

    #[test]
    fn varlen_and_paged_routes() {
        // Varlen: windows read against the longest sequences (9, 17).
        let v = |w: (Option<usize>, Option<usize>), cap, d| {
            route_varlen(&call((9, 17, d), opts(w.0, w.1), cap))
        };
        for (w, want) in [
            ((Some(4), Some(0)), (4, 0)),
            ((Some(15), Some(7)), (15, 7)),
            ((Some(16), Some(8)), NO_MASK),
            ((Some(100), Some(0)), CAUSAL),
            ((None, Some(3)), (-1, 3)),
        ] {
            assert_eq!(v(w, None, 128).unwrap().window, want, "{w:?}");
        }
        assert_eq!(
            v((Some(4), Some(0)), Some(50.0), 64).unwrap().softcap(),
            50.0
        );
        let e = err(v((Some(4), Some(0)), Some(50.0), 256));
        for part in [
            "variable-length batches with sliding-window attention (window_size_left = Some(4), \
             window_size_right = Some(0)) and softcapping (softcap = 50) with head dim 256",
            "compute capability 9.0, head dims [64, 128]",
            "flash_attn_varlen_paged_windowed",
        ] {
            assert!(e.contains(part), "{part:?} missing from: {e}");
        }
        assert!(err(v((None, Some(0)), None, 256))
            .contains("variable-length batches with head dim 256 are not supported"));
        // Paged: the decode kernel's window, rows rounded up, limits named.
        let p = |sq, w: (Option<usize>, Option<usize>), cap, d| {
            route_paged(&call((sq, 80, d), opts(w.0, w.1), cap))
        };
        let k = p(4, (None, Some(0)), Some(50.0), 128).unwrap();
        assert_eq!((k.window, k.softcap(), k.max_q_per_seq), ((-1, 0), 50.0, 4));
        let k = p(1, (Some(32), None), None, 256).unwrap();
        assert_eq!(
            (k.window, k.max_q_per_seq, k.softcap_bits),
            ((32, -1), 1, 0)
        );
        let e = err(p(17, (None, None), None, 128));
        assert!(e.contains("17 query rows per sequence") && e.contains("not supported yet"));
        assert!(err(p(4, (None, None), None, 96)).contains("head dim 96"));
        assert!(err(p(4, (None, None), Some(f32::INFINITY), 128)).contains("softcap"));
        let e = unsupported_feature("ALiBi").to_string();
        assert!(
            e.contains("ALiBi is not supported yet (flashmoe implements"),
            "{e}"
        );
    }

    /// Every call in a route's scope routes the same: sides around the thresholds, softcap on
    /// and off, head dims with and without each kernel, both device kinds.
    #[test]
    fn route_scope_holds_the_route() {
        let sides = [
            None,
            Some(0),
            Some(1),
            Some(2),
            Some(6),
            Some(15),
            Some(16),
            Some(40),
        ];
        let lens: Vec<usize> = (1..=24).chain([40, 41, 42, 43, 100, 5000]).collect();
        let same = |a: &Result<Route>, b: &Result<Route>| match (a, b) {
            (Ok(a), Ok(b)) => a == b,
            (Err(_), Err(_)) => true,
            _ => false,
        };
        for left in sides {
            for right in sides {
                for softcap in [None, Some(30.0)] {
                    for (d, arch) in [(128, H100), (128, A100), (256, H100), (96, H100)] {
                        let c = |sq, sk| call((sq, sk, d), opts(left, right), softcap);
                        for &sq in &lens {
                            for &sk in &lens {
                                let s = route_scope(&c(sq, sk));
                                assert!(s.contains(sq, sk), "{s:?} misses ({sq}, {sk})");
                                // The cell's first lengths route like this call.
                                let here = route_dense(&c(sq, sk), arch);
                                let first = route_dense(&c(s.seq_q.0, s.seq_k.0), arch);
                                assert!(
                                    same(&here, &first),
                                    "{left:?} {right:?} {softcap:?} d {d} arch {arch}: \
                                     ({sq}, {sk}) {here:?} but {s:?} starts {first:?}"
                                );
                            }
                        }
                    }
                }
            }
        }
        // Without a window or softcap the scope is wide: one route for every length (causal:
        // a single row is not causal).
        let s = route_scope(&call((100, 300, 128), opts(None, None), None));
        assert_eq!(s.seq_q, (1, usize::MAX));
        assert_eq!(s.seq_k, (1, usize::MAX));
        let s = route_scope(&call((100, 300, 128), opts(None, Some(0)), None));
        assert_eq!((s.seq_q, s.seq_k), ((2, usize::MAX), (1, usize::MAX)));
        let s = route_scope(&call((1, 300, 128), opts(None, Some(0)), None));
        assert_eq!(s.seq_q, (1, 1));
    }

    #[test]
    fn alibi_routes_to_the_portable_kernel_with_any_mask() {
        // Sliding window + softcap, prefill-sized, any head dim of the portable kernel.
        for d in [8, 32, 40, 64, 80, 96, 128, 160, 192, 256] {
            let k =
                route_alibi(&call((5000, 5000, d), opts(Some(100), Some(0)), Some(30.0))).unwrap();
            assert_eq!((k.window, k.softcap(), k.head_dim), ((100, 0), 30.0, d));
            let c = k.attention_class();
            assert!(c.causal && c.window == (100, -1) && c.softcap == 30.0);
        }
        // route_alibi gives the prefill key for decode-shaped calls too (route_alibi_dense
        // picks the decode plan for them).
        let k = route_alibi(&call((1, 300, 128), opts(None, None), None)).unwrap();
        assert_eq!(k.window, NO_MASK);
        assert_eq!(PlanKey::Alibi(k).elem(), Elem::Bf16);
        let e = err(route_alibi(&call((10, 10, 12), opts(None, None), None)));
        assert!(
            e.contains("ALiBi with head dim 12") && e.contains("portable prefill kernel"),
            "{e}"
        );
        let e = err(route_alibi(&call(
            (10, 10, 64),
            opts(None, None),
            Some(-2.0),
        )));
        assert!(e.contains("softcap"), "{e}");
    }

    #[test]
    fn decode_shaped_alibi_routes_to_the_decode_plan() {
        // At most 16 rows and a decode head dim: the decode plan, window read as decode does.
        for d in [64, 128, 256] {
            let Route::Decode(k) =
                route_alibi_dense(&call((1, 3000, d), opts(None, Some(0)), None)).unwrap()
            else {
                panic!("decode-shaped ALiBi goes to the decode plan (d {d})")
            };
            assert_eq!((k.window, k.max_q_per_seq, k.head_dim), ((-1, 0), 1, d));
        }
        let Route::Decode(k) =
            route_alibi_dense(&call((5, 400, 128), opts(Some(50), Some(0)), Some(30.0))).unwrap()
        else {
            panic!("windowed softcapped decode-shaped ALiBi goes to the decode plan")
        };
        assert_eq!((k.window, k.softcap(), k.max_q_per_seq), ((50, 0), 30.0, 8));
        // Longer calls and head dims without a decode kernel: the portable prefill kernel.
        for (sq, d) in [(17, 128), (3, 96), (4000, 64)] {
            let r = route_alibi_dense(&call((sq, 3000, d), opts(None, Some(0)), None)).unwrap();
            assert!(
                matches!(r, Route::Prefill(k) if k.head_dim == d),
                "{sq} {d}: {r:?}"
            );
        }
        assert!(route_alibi_dense(&call((1, 10, 12), opts(None, None), None)).is_err());
        // The scope: every length in it routes like the cell's first one.
        let lens: Vec<usize> = (1..=20).chain([40, 41, 100, 5000]).collect();
        for (left, right) in [
            (None, None),
            (None, Some(0)),
            (Some(6), Some(0)),
            (Some(15), Some(2)),
        ] {
            for d in [128, 96] {
                let c = |sq, sk| call((sq, sk, d), opts(left, right), None);
                for &sq in &lens {
                    for &sk in &lens {
                        let s = route_scope_alibi(&c(sq, sk));
                        assert!(s.contains(sq, sk), "{s:?} misses ({sq}, {sk})");
                        let here = route_alibi_dense(&c(sq, sk)).unwrap();
                        let first = route_alibi_dense(&c(s.seq_q.0, s.seq_k.0)).unwrap();
                        assert_eq!(here, first, "{left:?} {right:?} d {d} ({sq}, {sk}) {s:?}");
                    }
                }
            }
        }
    }
}
