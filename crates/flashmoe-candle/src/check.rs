//! Up-front checks of a flash-attention call: tensor ranks, layouts, dtypes, head counts —
//! what candle's `Layout`s and `DType`s say — then the library's router
//! (`flashmoe::attention::route`) for the window, the softcap and the plan (and its cache
//! key) the call goes to: dense prefill ([`PlanKey::Dense`]), varlen prefill
//! ([`PlanKey::Varlen`]) or paged / decode ([`PlanKey::Decode`]). Pure functions of candle
//! `Layout`s, values and the device's compute capability, so they run (and are tested)
//! without a GPU; the CUDA path (`cuda_fwd.rs`) calls [`check_call`], [`check_varlen`] or
//! [`check_paged`] before touching any device memory.
//!
//! The routing itself (dense → prefill plan, or the decode plan for decode-shaped calls with
//! a window or softcap; the errors naming what each kernel takes) is
//! [`flashmoe::attention::route::route_dense`]; its types are re-exported here under their
//! old names. Library errors become candle errors with this crate's prefixes ([`candle_err`]).

use candle_core::{bail, DType, Layout, Result};
use flashmoe::attention::route::{self, AttnCall, WindowSize};
pub use flashmoe::attention::route::{
    decode_shaped, is_sliding, prefill_masks, AttnShape, ClassKey, DecodeKey, Elem, PlanKey,
    Window, CAUSAL, NO_MASK, SM90_ARCH,
};

/// A library error as candle's: invalid values behind candle-flash-attn's `flash-attn: `
/// prefix, features no kernel serves behind this crate's name.
pub fn candle_err(e: flashmoe::Error) -> candle_core::Error {
    let msg = match e {
        flashmoe::Error::InvalidProblem(m) => format!("flash-attn: {m}"),
        flashmoe::Error::Unsupported { reason, .. } => format!("flashmoe-candle: {reason}"),
        other => format!("flashmoe-candle: {other}"),
    };
    candle_core::Error::Msg(msg).bt()
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
/// `seq_k` key rows, normalised ([`WindowSize::resolve`]): `(None, None)` and over-long
/// windows are [`NO_MASK`], `(None, Some(0))` (what `flash_attn(.., causal)` passes) and
/// `(Some(w >= seq_k - 1), Some(0))` are [`CAUSAL`], and a single query row is never causal.
pub fn resolve_window(
    left: Option<usize>,
    right: Option<usize>,
    seq_q: usize,
    seq_k: usize,
) -> Result<Window> {
    WindowSize::from_options(left, right)
        .resolve(seq_q, seq_k)
        .map_err(candle_err)
}

/// What the CUDA path needs to know about one dense call, after every check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub shape: AttnShape,
    pub plan: PlanKey,
}

/// The softcap of a call: `None` and 0 are off (FlashAttention's convention); otherwise it
/// must be finite and positive ([`route::check_softcap`]).
pub fn check_softcap(softcap: Option<f32>) -> Result<Option<f32>> {
    route::check_softcap(softcap).map_err(candle_err)
}

/// candle-flash-attn's window sizes as the decode kernel's `(left, right)`: `None` and sizes
/// beyond `max_seqlen_k` are unbounded (-1), as candle-flash-attn maps them for FA2
/// ([`WindowSize::decode`]).
pub fn decode_window(
    left: Option<usize>,
    right: Option<usize>,
    max_seqlen_k: usize,
) -> Result<(i32, i32)> {
    WindowSize::from_options(left, right)
        .decode(max_seqlen_k)
        .map_err(candle_err)
}

/// The router's view of a call.
fn attn_call(
    elem: Elem,
    shape: AttnShape,
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> AttnCall {
    AttnCall {
        elem,
        shape,
        softmax_scale,
        window: WindowSize::from_options(window.0, window.1),
        softcap,
    }
}

/// All checks of one dense call, in the order candle-flash-attn reports them, and its
/// route on a device of compute capability `arch` (× 10): [`route::route_dense`] — the
/// prefill plan for no mask / causal without softcap; with a sliding window or softcap the
/// decode plan when the call is decode-shaped (at most 16 query rows, head dim 64/128/256),
/// else the prefill plan where a prefill kernel serves it (sm_90a, or the portable one);
/// otherwise an error naming the
/// feature.
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
    let call = attn_call(elem, shape, softmax_scale, window, softcap);
    let route = route::route_dense(&call, arch).map_err(candle_err)?;
    Ok(Call {
        shape,
        plan: route.into(),
    })
}

/// All checks of one dense ALiBi call: q, k and v as [`check_call`], then the slopes (f32,
/// `(num_heads_q)` or `(batch, num_heads_q)`, contiguous), then [`route::route_alibi`]: the
/// prefill plan's portable kernel on every GPU, any mask and softcap.
#[allow(clippy::too_many_arguments)]
pub fn check_alibi_call(
    dtypes: (DType, DType, DType),
    q: &Layout,
    k: &Layout,
    v: &Layout,
    slopes: (DType, &Layout),
    softmax_scale: f32,
    window: (Option<usize>, Option<usize>),
    softcap: Option<f32>,
) -> Result<Call> {
    let shape = check_layouts(q, k, v)?;
    let elem = check_dtypes(dtypes.0, dtypes.1, dtypes.2)?;
    let (sd, sl) = slopes;
    if sd != DType::F32 {
        bail!("flash-attn: alibi_slopes must be f32 (got {sd:?})")
    }
    let (b, h) = (shape.batch, shape.heads_q);
    if sl.dims() != [h] && sl.dims() != [b, h] {
        bail!(
            "flash-attn: alibi_slopes must have shape ({h}) or ({b}, {h}) (num_heads_q or batch \
             x num_heads_q) but has shape {:?}",
            sl.dims()
        )
    }
    if sl.contiguous_offsets().is_none() {
        bail!("flash-attn: alibi_slopes has to be contiguous")
    }
    let call = attn_call(elem, shape, softmax_scale, window, softcap);
    let key = route::route_alibi(&call).map_err(candle_err)?;
    Ok(Call {
        shape,
        plan: PlanKey::Alibi(key),
    })
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
    let shape = AttnShape {
        batch: nq - 1,
        seq_q: max_q,
        seq_k: max_k,
        heads_q,
        heads_kv,
        head_dim,
    };
    let call = attn_call(elem, shape, softmax_scale, window, softcap);
    let key = route::route_varlen(&call).map_err(candle_err)?;
    Ok(VarlenCall {
        batch: nq - 1,
        total_q,
        total_k,
        heads_q,
        plan: PlanKey::Varlen(key),
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
/// at most 16 query rows per sequence (`max_seqlen_q`), head dims 64/128/256;
/// longer query sequences (chunked prefill on a paged cache) are an error naming that
/// ([`route::route_paged`]).
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
    let shape = AttnShape {
        batch: nq - 1,
        seq_q: max_q,
        seq_k: max_k,
        heads_q,
        heads_kv,
        head_dim,
    };
    let call = attn_call(elem, shape, softmax_scale, window, softcap);
    let key = route::route_paged(&call).map_err(candle_err)?;
    Ok(PagedCall {
        batch: nq - 1,
        total_q,
        heads_q,
        max_blocks,
        max_seqlen_k: max_k,
        key,
    })
}

/// The error every entry point with a feature we lack returns, naming the feature
/// ([`route::unsupported_feature`]).
pub fn unsupported(what: &str) -> candle_core::Error {
    candle_err(route::unsupported_feature(what))
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
        assert!(err(neg).contains("flash-attn: softcap must be finite and >= 0 (got -1)"));
    }

    #[test]
    fn check_alibi_call_checks_slopes_and_routes_to_the_portable_kernel() {
        let (q, kv) = (bshd(2, 40, 8, 128), bshd(2, 50, 2, 128));
        let one = Layout::contiguous((8,));
        let per_batch = Layout::contiguous((2, 8));
        let f = DType::F32;
        for l in [&one, &per_batch] {
            let c = check_alibi_call(BF, &q, &kv, &kv, (f, l), 0.1, (Some(4), Some(0)), Some(5.0))
                .unwrap();
            let PlanKey::Alibi(key) = c.plan else {
                panic!("ALiBi is the ALiBi plan: {:?}", c.plan)
            };
            assert_eq!((key.window, key.softcap()), ((4, 0), 5.0));
        }
        let e = |r: Result<Call>| err(r);
        let bad = Layout::contiguous((4,));
        assert!(e(check_alibi_call(
            BF,
            &q,
            &kv,
            &kv,
            (f, &bad),
            0.1,
            (None, None),
            None
        ))
        .contains("alibi_slopes must have shape (8) or (2, 8)"));
        assert!(e(check_alibi_call(
            BF,
            &q,
            &kv,
            &kv,
            (DType::BF16, &one),
            0.1,
            (None, None),
            None
        ))
        .contains("alibi_slopes must be f32"));
        let strided = Layout::new((8,).into(), vec![2], 0);
        assert!(e(check_alibi_call(
            BF,
            &q,
            &kv,
            &kv,
            (f, &strided),
            0.1,
            (None, None),
            None
        ))
        .contains("contiguous"));
    }

    /// The library's router decides (its own tests cover the routing); here, that the
    /// adapter passes candle's arguments through and keeps candle's error texts.
    #[test]
    fn check_call_routes_through_the_library() {
        let call = |sq, sk, d, window, softcap, arch| {
            let (q, kv) = (bshd(2, sq, 8, d), bshd(2, sk, 2, d));
            check_call(BF, &q, &kv, &kv, 0.1, window, softcap, arch).map(|c| c.plan)
        };
        let p = call(8192, 8192, 128, (Some(4096), Some(0)), None, H100).unwrap();
        assert!(matches!(
            p,
            PlanKey::Dense(ClassKey {
                window: (4096, 0),
                ..
            })
        ));
        let p = call(3, 300, 256, (None, Some(0)), Some(30.0), A100).unwrap();
        let PlanKey::Decode(key) = p else {
            panic!("a decode-shaped softcap is the decode plan: {p:?}")
        };
        assert_eq!(
            (key.window, key.max_q_per_seq, key.softcap()),
            ((-1, 0), 4, 30.0)
        );
        // Gemma-2 prefill (head dim 256, window, softcap): the portable prefill kernel on
        // Hopper; off Hopper its 256 tile does not fit.
        let p = call(5000, 5000, 256, (Some(4096), Some(0)), Some(50.0), H100).unwrap();
        assert!(matches!(p, PlanKey::Dense(k) if k.window == (4096, 0) && k.softcap() == 50.0));
        let e = err(call(
            5000,
            5000,
            256,
            (Some(4096), Some(0)),
            Some(50.0),
            A100,
        ));
        assert!(
            e.starts_with(
                "flashmoe-candle: sliding-window attention (window_size_left = Some(4096), \
                 window_size_right = Some(0)) and softcapping (softcap = 50) with 5000 query rows \
                 per sequence and head dim 256 on a GPU of compute capability 8.0 is not \
                 supported: flashmoe runs sliding windows and softcapping on its sm_90a prefill \
                 kernel (compute capability 9.0, head dims [64, 128], any number of rows), on its \
                 portable prefill kernel (head dims: multiples of 8 up to 256; above 128 on \
                 compute capability 9.0 only) and on its decode kernels (at most 16 query rows \
                 per sequence, head dims [64, 128, 256])"
            ),
            "{e}"
        );
        assert!(unsupported("ALiBi (flash_attn_alibi)")
            .to_string()
            .starts_with("flashmoe-candle: ALiBi (flash_attn_alibi) is not supported yet"),);
        // The wrappers keep candle's names and texts.
        assert_eq!(resolve_window(None, Some(0), 1, 32).unwrap(), NO_MASK);
        assert_eq!(decode_window(Some(500), Some(3), 300).unwrap(), (-1, 3));
        assert_eq!(check_softcap(Some(0.0)).unwrap(), None);
        let big = i32::MAX as usize + 1;
        assert!(err(resolve_window(Some(big), None, 8, usize::MAX))
            .starts_with("flash-attn: window_size_left = 2147483648 exceeds i32"));
        assert!(decode_shaped(16, 256) && !decode_shaped(17, 128) && !decode_shaped(1, 96));
        assert!(prefill_masks(SM90_ARCH, 64) && prefill_masks(80, 64) && !prefill_masks(80, 256));
        assert!(is_sliding((4, 0)) && !is_sliding(CAUSAL));
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
