//! `flashmoe._core`: the Python binding of flashmoe's plan API (raw layer).
//!
//! It knows nothing of PyTorch: a tensor arrives as a descriptor tuple
//! `(data_ptr, dtype, shape, strides)` (dtype one of "bf16", "f16", "f32", "i32"; strides
//! in elements), a stream as the integer value of a `CUstream`, a workspace as an address
//! and a size. The torch layer (`flashmoe/_torch.py`) builds these from tensors and owns
//! every allocation; this module only checks and enqueues, so a call holds no memory and
//! never synchronises. The checks that need no GPU (`check_attention`, `check_moe`) are
//! the library's own ([`AttentionClass::check_inputs`], [`MoeClass::check_args`]).
//!
//! Errors: bad input raises `TypeError` (a dtype) or `ValueError` (anything else about a
//! tensor) naming the tensor and the rule; a shape class no kernel implements raises
//! `NotImplementedError`; no driver, no GPU or a CUDA failure raises `RuntimeError`.

use flashmoe::attention::backward::{AttentionBackwardPlan as BPlan, BackwardArgs, BwdMode};
use flashmoe::attention::decode::{
    AppendArgs, DecodeArgs, DecodeClass, DecodePlan as DPlan, RawIndex, MAX_Q_PER_SEQ,
};
use flashmoe::attention::prefill::{abi, tiles};
use flashmoe::attention::route::{self, AttnCall, AttnShape, Elem as HalfElem, Route, WindowSize};
use flashmoe::attention::varlen::{self, VarlenArgs, VarlenPlan as VPlan};
use flashmoe::attention::{AttentionArgs, AttentionClass, AttentionPlan as Plan};
use flashmoe::gpu::{self, Device, RawTensor, RawWorkspace};
use flashmoe::moe::{MoeArgs, MoeClass, MoePlan as MPlan, RawU32, RoutingArgs};
use flashmoe::{DType, Error, Scoring};
use pyo3::exceptions::{PyNotImplementedError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

mod mla;
mod moe_bwd;
mod value_dim;
mod varlen_backward;

/// The library's error as the Python exception its kind calls for.
fn py_err(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidProblem(_) | Error::BufferSize { .. } => PyValueError::new_err(msg),
        Error::Unsupported { .. } => PyNotImplementedError::new_err(msg),
        Error::NoGpu(_) | Error::Cuda { .. } | Error::Compile { .. } | Error::Io { .. } => {
            PyRuntimeError::new_err(msg)
        }
    }
}

/// A tensor as the torch layer describes it: `(data_ptr, dtype, shape, strides)`.
#[derive(FromPyObject)]
struct Desc(u64, String, Vec<usize>, Vec<usize>);

/// Element type of a descriptor; `i32` is kept apart (routing ids and counts).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Elem {
    Float(DType),
    I32,
}

fn elem(name: &str, dtype: &str) -> PyResult<Elem> {
    match dtype {
        "bf16" => Ok(Elem::Float(DType::Bf16)),
        "f16" => Ok(Elem::Float(DType::F16)),
        "f32" => Ok(Elem::Float(DType::F32)),
        "i32" => Ok(Elem::I32),
        other => Err(PyTypeError::new_err(format!(
            "{name} has dtype {other}; flashmoe takes bf16 or f16 tensors"
        ))),
    }
}

impl Desc {
    /// The raw tensor of a floating-point descriptor, with `name` in its errors.
    fn raw(&self, name: &str) -> PyResult<RawTensor> {
        self.layout(name, self.float(name)?)
    }

    /// The descriptor's address, shape and strides as a tensor of `dtype`. A size-1
    /// dimension's stride is meaningless (PyTorch may report any value), so it is replaced
    /// by the row-major one: the kernels' stride rules then see only strides that address
    /// memory.
    fn layout(&self, name: &str, dtype: DType) -> PyResult<RawTensor> {
        let (shape, mut strides) = (&self.2, self.3.clone());
        if shape.len() != strides.len() {
            return Err(PyValueError::new_err(format!(
                "{name}: shape {shape:?} and strides {strides:?} differ in length"
            )));
        }
        for i in (0..shape.len()).rev() {
            if shape[i] == 1 {
                strides[i] = if i + 1 < shape.len() {
                    shape[i + 1] * strides[i + 1]
                } else {
                    1
                };
            }
        }
        RawTensor::new(self.0, dtype, shape, &strides).map_err(|e| {
            PyValueError::new_err(format!(
                "{name}: {}",
                e.to_string().trim_start_matches("invalid problem: ")
            ))
        })
    }

    /// The float element type, or a `TypeError` naming the tensor.
    fn float(&self, name: &str) -> PyResult<DType> {
        match elem(name, &self.1)? {
            Elem::Float(d) => Ok(d),
            Elem::I32 => Err(PyTypeError::new_err(format!(
                "{name} has dtype int32; a floating-point tensor is required"
            ))),
        }
    }

    /// An int32 descriptor's strides, or a `TypeError` naming the tensor.
    fn int32(&self, name: &str) -> PyResult<()> {
        if elem(name, &self.1)? != Elem::I32 {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {} but int32 is required",
                self.1
            )));
        }
        Ok(())
    }

    /// A contiguous int32 vector (cu_seqlens, cache_seqlens), optionally of `len` elements.
    fn index_vector(&self, name: &str, len: Option<usize>) -> PyResult<RawIndex> {
        self.int32(name)?;
        let (shape, strides) = (&self.2, &self.3);
        let ok_len = len.is_none_or(|n| shape.first() == Some(&n));
        if shape.len() != 1 || strides.len() != 1 || !ok_len || (shape[0] > 1 && strides[0] != 1) {
            return Err(PyValueError::new_err(format!(
                "{name} must be a contiguous 1-D int32 tensor{} but has shape {shape:?} and \
                 strides {strides:?}",
                len.map_or(String::new(), |n| format!(" of {n} elements"))
            )));
        }
        Ok(RawIndex::vector(self.0, shape[0]))
    }

    /// An int32 matrix with contiguous rows (a block table); any row stride.
    fn index_matrix(&self, name: &str) -> PyResult<RawIndex> {
        self.int32(name)?;
        let (shape, strides) = (&self.2, &self.3);
        if shape.len() != 2 || strides.len() != 2 || (shape[1] > 1 && strides[1] != 1) {
            return Err(PyValueError::new_err(format!(
                "{name} must be a 2-D int32 tensor (batch, max_blocks) with contiguous rows but \
                 has shape {shape:?} and strides {strides:?}"
            )));
        }
        let row_stride = if shape[0] > 1 { strides[0] } else { shape[1] };
        Ok(RawIndex {
            ptr: self.0,
            rows: shape[0],
            cols: shape[1],
            row_stride,
        })
    }

    /// The tensor as a contiguous u32/i32 array of `len` elements (routing outputs).
    fn index(&self, name: &str, len: usize) -> PyResult<RawU32> {
        if elem(name, &self.1)? != Elem::I32 {
            return Err(PyTypeError::new_err(format!(
                "{name} has dtype {} but int32 is required",
                self.1
            )));
        }
        // f32 stands in for the 4-byte integers: only the layout is checked here.
        let t = self.layout(name, DType::F32)?;
        if !t.is_contiguous() || t.elems() != len {
            return Err(PyValueError::new_err(format!(
                "{name} must be a contiguous array of {len} elements but has shape {:?} and \
                 strides {:?}",
                t.shape(),
                t.strides()
            )));
        }
        Ok(RawU32 { ptr: t.ptr, len })
    }
}

/// `TypeError` unless `got` is the dtype `want` (of the tensor named `of`).
fn same_dtype(name: &str, got: DType, want: DType, of: &str) -> PyResult<()> {
    if got != want {
        return Err(PyTypeError::new_err(format!(
            "{name} holds {got} elements but {want} ({of}'s dtype) is required"
        )));
    }
    Ok(())
}

/// The scalars of an attention class that no tensor carries: causal, the softmax scale
/// (None: 1/sqrt(head_dim)), the sliding window `(left, right)` (-1 = unbounded) and the
/// logit softcap (0 = off).
#[derive(Clone, Copy)]
struct Logits {
    causal: bool,
    softmax_scale: Option<f32>,
    window: (i32, i32),
    softcap: f32,
}

/// The class of a dense attention plan (forward or backward) from the binding's arguments:
/// `dtype` must name bf16 or f16 (TypeError naming `what` otherwise).
fn plan_class(
    what: &str,
    dtype: &str,
    head_dim: usize,
    heads_q: usize,
    heads_kv: usize,
    logits: Logits,
) -> PyResult<AttentionClass> {
    let dtype = match elem("dtype", dtype)? {
        Elem::Float(d) if d != DType::F32 => d,
        _ => {
            return Err(PyTypeError::new_err(format!(
                "dtype {dtype}: {what} takes bf16 or f16"
            )))
        }
    };
    logits.class(dtype, head_dim, heads_q, heads_kv)
}

impl Logits {
    /// The class of these scalars and the tensors' dtype, head dim and head counts,
    /// validated (a bad scale, window side or softcap is a `ValueError`).
    fn class(
        self,
        dtype: DType,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
    ) -> PyResult<AttentionClass> {
        let class = AttentionClass {
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            causal: self.causal,
            softmax_scale: self.softmax_scale,
            window: self.window,
            softcap: self.softcap,
        };
        class.problem(1, 1, 1).validate().map_err(py_err)?;
        Ok(class)
    }
}

/// The router's view of a dense call of `class` with `seq_q` query and `seq_k` key rows:
/// the window as flash_attn's pair (-1 unbounded, `causal` sets the right side to 0), the
/// scale resolved (None: 1/sqrt(head_dim), the plans' own default).
fn attn_call(class: &AttentionClass, seq_q: usize, seq_k: usize) -> PyResult<AttnCall> {
    let elem = HalfElem::of(class.dtype).ok_or_else(|| {
        PyTypeError::new_err(format!(
            "dtype {}: flashmoe's attention takes bf16 or f16",
            class.dtype
        ))
    })?;
    let (left, right) = class.window;
    Ok(AttnCall {
        elem,
        shape: AttnShape {
            batch: 1,
            seq_q,
            seq_k,
            heads_q: class.heads_q,
            heads_kv: class.heads_kv,
            head_dim: class.head_dim,
        },
        softmax_scale: class
            .softmax_scale
            .unwrap_or_else(|| route::default_scale(class.head_dim)),
        window: WindowSize::from_pair(left.into(), right.into(), class.causal).map_err(py_err)?,
        softcap: Some(class.softcap),
    })
}

/// `NotImplementedError` for a dense call that no kernel on any device serves: a sliding
/// window or a softcap at a head dim the sm_90a kernel does not take, on a call that is not
/// decode-shaped (the router's decision on the most capable device).
fn check_routable(class: &AttentionClass, seq_q: usize, seq_k: usize) -> PyResult<()> {
    let call = attn_call(class, seq_q, seq_k)?;
    if route::route_dense(&call, route::SM90_ARCH).is_ok() {
        return Ok(());
    }
    Err(py_err(Error::unsupported(
        "flash-sm90",
        format!(
            "head dim {} with window {:?} and softcap {}: sliding windows and softcap run on \
             the sm_90a kernel (Hopper, head dims {:?}), on the portable prefill kernel \
             (head dims: {}) or, for calls of at most {MAX_Q_PER_SEQ} query rows ({seq_q} \
             here), on the decode kernels (head dims {:?})",
            class.head_dim,
            class.window,
            class.softcap,
            tiles::SM90_HEAD_DIMS,
            abi::V1_HEAD_DIMS_TEXT,
            flashmoe::attention::decode::HEAD_DIMS,
        ),
    )))
}

/// The attention class of a call: dtype from q, head dim and head counts from q and k.
fn attention_class(
    q: &Desc,
    k: &Desc,
    v: &Desc,
    logits: Logits,
) -> PyResult<(AttentionClass, [RawTensor; 3])> {
    let dtype = q.float("q")?;
    if dtype == DType::F32 {
        return Err(PyTypeError::new_err(
            "q has dtype f32; flashmoe's attention takes bf16 or f16",
        ));
    }
    same_dtype("k", k.float("k")?, dtype, "q")?;
    same_dtype("v", v.float("v")?, dtype, "q")?;
    let (rq, rk, rv) = (q.raw("q")?, k.raw("k")?, v.raw("v")?);
    for (name, t) in [("q", &rq), ("k", &rk), ("v", &rv)] {
        if t.rank != 4 {
            return Err(PyValueError::new_err(format!(
                "{name} must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                t.shape()
            )));
        }
    }
    let (hq, hkv, d) = (rq.shape[2], rk.shape[2], rq.shape[3]);
    if hkv == 0 || hq % hkv != 0 {
        return Err(PyValueError::new_err(format!(
            "q has {hq} heads and k {hkv}: the query heads must be a multiple of the key/value \
             heads (GQA)"
        )));
    }
    let class = logits.class(dtype, d, hq, hkv)?;
    Ok((class, [rq, rk, rv]))
}

/// Shapes of o `(batch, seqlen_q, heads_q, head_dim)` and lse `(batch, heads_q, seqlen_q)`.
type OutputShapes = ((usize, usize, usize, usize), (usize, usize, usize));

/// Check an attention call's q, k and v without a GPU. The class: `causal`,
/// `softmax_scale`, `window` (left, right) around each row's bottom-right diagonal with -1
/// unbounded, `softcap` (0 = off). Returns the shapes of o `(batch, seqlen_q, heads_q,
/// head_dim)` and lse `(batch, heads_q, seqlen_q)`.
#[pyfunction]
#[pyo3(signature = (q, k, v, causal=false, softmax_scale=None, *, window=(-1, -1), softcap=0.0))]
fn check_attention(
    q: Desc,
    k: Desc,
    v: Desc,
    causal: bool,
    softmax_scale: Option<f32>,
    window: (i32, i32),
    softcap: f32,
) -> PyResult<OutputShapes> {
    let logits = Logits {
        causal,
        softmax_scale,
        window,
        softcap,
    };
    let (class, [rq, rk, rv]) = attention_class(&q, &k, &v, logits)?;
    check_routable(&class, rq.shape[1], rk.shape[1])?;
    let s = class.check_inputs(&rq, &rk, &rv).map_err(py_err)?;
    let (b, sq, hq, d) = (s.batch, s.seqlen_q, class.heads_q, class.head_dim);
    Ok(((b, sq, hq, d), (b, hq, sq)))
}

/// A plan kind (`"prefill"`: `AttentionPlan`, `"decode"`: `DecodePlan`), the plan's
/// arguments after (device, dtype, head_dim, heads_q, heads_kv), and the route's scope
/// `((seq_q lo, hi), (seq_k lo, hi))`.
type RouteOut = (&'static str, Py<PyAny>, ((usize, usize), (usize, usize)));

/// Which plan serves a dense attention call on a device of compute capability `arch`
/// (major × 10 + minor), without a GPU: the library's router (`flashmoe::attention::route`),
/// as flashmoe-candle uses it. Windows are normalised for the call's `seq_q` / `seq_k` (a side
/// hiding no key is unbounded); a sliding window or softcap goes to the decode plan when the
/// call is decode-shaped (at most 16 query rows, head dims 64/128/256), else to the prefill
/// plan (the sm_90a kernel on compute capability 9.0 for head dims 64/128, the portable one
/// for multiples of 8 up to 256, above 128 on Hopper only), else `NotImplementedError`
/// naming the feature, rows, head dim and device. Returns `(kind, args, scope)`: `kind`
/// `"prefill"` with `args = (causal, softmax_scale, window, softcap)` for `AttentionPlan`,
/// or `"decode"` with `args = (max_q_per_seq, window, softcap, softmax_scale)` for
/// `DecodePlan` (over the dense k/v as one page per sequence); `scope` the lengths over
/// which every other argument being equal routes the same (a cache keeps the route for
/// them). Bad values raise as the plans do (`ValueError`, `TypeError`). `alibi=True`: the
/// route of an ALiBi call (`route_alibi_dense`: decode-shaped calls on the decode plan, the
/// others on the portable prefill kernel, any GPU); `args` then end with `True`, the plans'
/// `alibi` argument.
#[pyfunction]
#[pyo3(signature = (dtype, head_dim, heads_q, heads_kv, seq_q, seq_k, causal, softmax_scale=None, window=(-1, -1), softcap=0.0, *, arch, alibi=false))]
#[allow(clippy::too_many_arguments)]
fn route_attention(
    py: Python<'_>,
    dtype: &str,
    head_dim: usize,
    heads_q: usize,
    heads_kv: usize,
    seq_q: usize,
    seq_k: usize,
    causal: bool,
    softmax_scale: Option<f32>,
    window: (i32, i32),
    softcap: f32,
    arch: u32,
    alibi: bool,
) -> PyResult<RouteOut> {
    let logits = Logits {
        causal,
        softmax_scale,
        window,
        softcap,
    };
    let class = logits.class(
        half_dtype(dtype, "an attention plan")?,
        head_dim,
        heads_q,
        heads_kv,
    )?;
    if seq_q == 0 || seq_k == 0 {
        return Err(PyValueError::new_err(format!(
            "empty attention call: seq_q {seq_q} and seq_k {seq_k} must be >= 1"
        )));
    }
    let call = attn_call(&class, seq_q, seq_k)?;
    // ALiBi (the plans' trailing `alibi` argument): route_alibi_dense, any GPU.
    let (scope, r) = if alibi {
        (
            route::route_scope_alibi(&call),
            route::route_alibi_dense(&call),
        )
    } else {
        (route::route_scope(&call), route::route_dense(&call, arch))
    };
    let scope = (scope.seq_q, scope.seq_k);
    match r.map_err(py_err)? {
        Route::Prefill(key) => {
            let c = key.attention_class();
            let args = (c.causal, c.softmax_scale, c.window, c.softcap);
            let args = if alibi {
                (args.0, args.1, args.2, args.3, true)
                    .into_pyobject(py)?
                    .into_any()
            } else {
                args.into_pyobject(py)?.into_any()
            };
            Ok(("prefill", args.unbind(), scope))
        }
        Route::Decode(key) => {
            let c = key.decode_class();
            let args = (c.max_q_per_seq, c.window, c.softcap, c.softmax_scale);
            let args = if alibi {
                (args.0, args.1, args.2, args.3, true)
                    .into_pyobject(py)?
                    .into_any()
            } else {
                args.into_pyobject(py)?.into_any()
            };
            Ok(("decode", args.unbind(), scope))
        }
    }
}

/// A placeholder output address for the device-free checks (aligned, never dereferenced).
const CHECK_OUT: u64 = 1 << 20;

/// The float dtype of q (bf16 or f16) and the same dtype for every other named tensor.
fn attention_dtype(q: &Desc, others: &[(&str, &Desc)]) -> PyResult<DType> {
    let dtype = q.float("q")?;
    if dtype == DType::F32 {
        return Err(PyTypeError::new_err(
            "q has dtype f32; flashmoe's attention takes bf16 or f16",
        ));
    }
    for (name, d) in others {
        same_dtype(name, d.float(name)?, dtype, "q")?;
    }
    Ok(dtype)
}

/// The 3-D raw tensor of a packed (tokens, heads, head_dim) descriptor.
fn packed(d: &Desc, name: &str) -> PyResult<RawTensor> {
    let t = d.raw(name)?;
    if t.rank != 3 {
        return Err(PyValueError::new_err(format!(
            "{name} must be 3-D (total_tokens, heads, head_dim) for a varlen call but has shape \
             {:?}",
            t.shape()
        )));
    }
    Ok(t)
}

/// The varlen class and arguments of a call; o and lse at `o`/`lse` (contiguous).
#[allow(clippy::too_many_arguments)]
fn varlen_args(
    q: &Desc,
    k: &Desc,
    v: &Desc,
    cu_seqlens_q: &Desc,
    cu_seqlens_k: &Desc,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    logits: Logits,
    (o, lse): (u64, u64),
) -> PyResult<(AttentionClass, VarlenArgs)> {
    let dtype = attention_dtype(q, &[("k", k), ("v", v)])?;
    let (rq, rk, rv) = (packed(q, "q")?, packed(k, "k")?, packed(v, "v")?);
    let (tq, hq, d, hkv) = (rq.shape[0], rq.shape[1], rq.shape[2], rk.shape[1]);
    if hkv == 0 || hq % hkv != 0 {
        return Err(PyValueError::new_err(format!(
            "q has {hq} heads and k {hkv}: the query heads must be a multiple of the key/value \
             heads (GQA)"
        )));
    }
    let batch1 = cu_seqlens_q.2.first().copied().unwrap_or(0);
    let args = VarlenArgs {
        q: rq,
        k: rk,
        v: rv,
        o: RawTensor::contiguous(o, dtype, &[tq, hq, d]).map_err(py_err)?,
        lse: RawTensor::contiguous(lse, DType::F32, &[hq, tq]).map_err(py_err)?,
        cu_seqlens_q: cu_seqlens_q.index_vector("cu_seqlens_q", None)?,
        cu_seqlens_k: cu_seqlens_k.index_vector("cu_seqlens_k", Some(batch1))?,
        max_seqlen_q,
        max_seqlen_k,
    };
    let class = logits.class(dtype, d, hq, hkv)?;
    Ok((class, args))
}

/// Shapes of a varlen call's o `(total_q, heads_q, head_dim)` and lse `(heads_q, total_q)`.
type VarlenShapes = ((usize, usize, usize), (usize, usize));

/// Check a varlen call without a GPU: q (total_q, heads_q, head_dim), k and v (total_k,
/// heads_kv, head_dim), int32 cu_seqlens_q and cu_seqlens_k [batch + 1]; the class's
/// `causal`, `softmax_scale`, `window` and `softcap` as in `check_attention`. Returns the
/// shapes of o (total_q, heads_q, head_dim) and lse (heads_q, total_q).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=false, softmax_scale=None, *, window=(-1, -1), softcap=0.0))]
#[allow(clippy::too_many_arguments)]
fn check_attention_varlen(
    q: Desc,
    k: Desc,
    v: Desc,
    cu_seqlens_q: Desc,
    cu_seqlens_k: Desc,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
    causal: bool,
    softmax_scale: Option<f32>,
    window: (i32, i32),
    softcap: f32,
) -> PyResult<VarlenShapes> {
    let logits = Logits {
        causal,
        softmax_scale,
        window,
        softcap,
    };
    let (class, args) = varlen_args(
        &q,
        &k,
        &v,
        &cu_seqlens_q,
        &cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        logits,
        (CHECK_OUT, CHECK_OUT),
    )?;
    let s = varlen::check_args(&class, &args).map_err(py_err)?;
    let (hq, d) = (class.heads_q, class.head_dim);
    Ok(((s.total_q, hq, d), (hq, s.total_q)))
}

/// A decode class from the Python layer's parameters (page size taken from the cache per
/// call: it changes no kernel).
#[allow(clippy::too_many_arguments)]
fn decode_class(
    dtype: DType,
    head_dim: usize,
    heads_q: usize,
    heads_kv: usize,
    max_q_per_seq: usize,
    window: (i32, i32),
    softcap: f32,
    softmax_scale: Option<f32>,
) -> PyResult<DecodeClass> {
    let class = DecodeClass {
        dtype,
        head_dim,
        heads_q,
        heads_kv,
        page_size: 0,
        max_q_per_seq,
        window,
        softcap,
        softmax_scale,
    };
    class.validate().map_err(py_err)?;
    Ok(class)
}

/// The decode arguments of a call; o and lse at `o`/`lse` (contiguous, q's shape and
/// (B, Hq, Sq) or (Hq, total_q)). `seqused_k` is named `cache_seqlens` in errors.
#[allow(clippy::too_many_arguments)]
fn decode_args(
    dtype: DType,
    q: &Desc,
    k_cache: &Desc,
    v_cache: &Desc,
    block_table: &Desc,
    seqused_k: &Desc,
    cu_seqlens_q: Option<&Desc>,
    (o, lse): (u64, u64),
) -> PyResult<DecodeArgs> {
    let rq = q.raw("q")?;
    let bt = block_table.index_matrix("block_table")?;
    let seqused = seqused_k.index_vector("cache_seqlens", Some(bt.rows))?;
    let cu = match cu_seqlens_q {
        Some(c) => Some(c.index_vector("cu_seqlens_q", Some(bt.rows + 1))?),
        None => None,
    };
    let lse_shape: &[usize] = match (cu.is_some(), rq.shape()) {
        (false, &[b, sq, hq, _]) => &[b, hq, sq],
        (true, &[t, hq, _]) => &[hq, t],
        (varlen, shape) => {
            return Err(PyValueError::new_err(format!(
                "q must be {} but has shape {shape:?}",
                if varlen {
                    "3-D (total_q, heads_q, head_dim) with cu_seqlens_q"
                } else {
                    "4-D (batch, seqlen_q, heads_q, head_dim)"
                }
            )))
        }
    };
    Ok(DecodeArgs {
        o: RawTensor::contiguous(o, dtype, rq.shape()).map_err(py_err)?,
        lse: RawTensor::contiguous(lse, DType::F32, lse_shape).map_err(py_err)?,
        q: rq,
        k_cache: k_cache.raw("k_cache")?,
        v_cache: v_cache.raw("v_cache")?,
        block_table: bt,
        seqused_k: seqused,
        max_seqlen_k: None,
        cu_seqlens_q: cu,
    })
}

/// The append arguments: new rows k, v (batch, s_new, heads_kv, head_dim) written at
/// `cache_seqlens[b]..` through the block table.
fn append_args(
    k: &Desc,
    v: &Desc,
    k_cache: &Desc,
    v_cache: &Desc,
    block_table: &Desc,
    cache_seqlens: &Desc,
) -> PyResult<AppendArgs> {
    let bt = block_table.index_matrix("block_table")?;
    if let Some(&b) = k.2.first() {
        if b != bt.rows {
            return Err(PyValueError::new_err(format!(
                "k holds new rows of {b} sequences but block_table has {} rows",
                bt.rows
            )));
        }
    }
    Ok(AppendArgs {
        k_new: k.raw("k")?,
        v_new: v.raw("v")?,
        k_cache: k_cache.raw("k_cache")?,
        v_cache: v_cache.raw("v_cache")?,
        seqused_k: cache_seqlens.index_vector("cache_seqlens", Some(bt.rows))?,
        block_table: bt,
    })
}

/// Check a paged-KV-cache attention call without a GPU. q (batch, seqlen_q, heads_q,
/// head_dim), or (total_q, heads_q, head_dim) with int32 cu_seqlens_q [batch + 1]; k_cache,
/// v_cache (num_blocks, page_size, heads_kv, head_dim); int32 block_table (batch,
/// max_blocks) and cache_seqlens [batch]; new rows k, v (batch, s_new, heads_kv, head_dim)
/// to append (both or neither). The class: `max_q_per_seq` (1..=16), `window` (left,
/// right), `softcap`. Returns the shapes of o (q's) and lse ((batch, heads_q, seqlen_q) or
/// (heads_q, total_q)).
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, block_table, cache_seqlens, k=None, v=None, cu_seqlens_q=None, *, max_q_per_seq, window=(-1, 0), softcap=0.0, softmax_scale=None))]
#[allow(clippy::too_many_arguments)]
fn check_attention_kvcache(
    q: Desc,
    k_cache: Desc,
    v_cache: Desc,
    block_table: Desc,
    cache_seqlens: Desc,
    k: Option<Desc>,
    v: Option<Desc>,
    cu_seqlens_q: Option<Desc>,
    max_q_per_seq: usize,
    window: (i32, i32),
    softcap: f32,
    softmax_scale: Option<f32>,
) -> PyResult<(Vec<usize>, Vec<usize>)> {
    let dtype = attention_dtype(&q, &[("k_cache", &k_cache), ("v_cache", &v_cache)])?;
    let (hq, d) = match q.2.as_slice() {
        [.., h, d] if q.2.len() >= 3 => (*h, *d),
        shape => {
            return Err(PyValueError::new_err(format!(
                "q must be (batch, seqlen_q, heads_q, head_dim) or (total_q, heads_q, head_dim) \
                 but has shape {shape:?}"
            )))
        }
    };
    let hkv = match k_cache.2.as_slice() {
        [_, _, h, _] => *h,
        shape => {
            return Err(PyValueError::new_err(format!(
                "k_cache must be 4-D (num_blocks, page_size, heads_kv, head_dim) but has shape \
                 {shape:?}"
            )))
        }
    };
    let class = decode_class(
        dtype,
        d,
        hq,
        hkv,
        max_q_per_seq,
        window,
        softcap,
        softmax_scale,
    )?;
    match (&k, &v) {
        (Some(k), Some(v)) => {
            same_dtype("k", k.float("k")?, dtype, "q")?;
            same_dtype("v", v.float("v")?, dtype, "q")?;
            let a = append_args(k, v, &k_cache, &v_cache, &block_table, &cache_seqlens)?;
            class.check_append(&a).map_err(py_err)?;
        }
        (None, None) => {}
        _ => {
            return Err(PyValueError::new_err(
                "k and v are appended together: give both or neither",
            ))
        }
    }
    let a = decode_args(
        dtype,
        &q,
        &k_cache,
        &v_cache,
        &block_table,
        &cache_seqlens,
        cu_seqlens_q.as_ref(),
        (CHECK_OUT, CHECK_OUT),
    )?;
    class.check_args(&a).map_err(py_err)?;
    Ok((a.o.shape().to_vec(), a.lse.shape().to_vec()))
}

/// The MoE class of a call, from the shapes of x, the router and the weights.
#[allow(clippy::too_many_arguments)]
fn moe_class(
    x: &Desc,
    router: &Desc,
    w2: &Desc,
    shared: bool,
    top_k: usize,
    scoring: &str,
    renormalize: bool,
    max_tokens: usize,
) -> PyResult<MoeClass> {
    let dtype = x.float("x")?;
    if dtype == DType::F32 {
        return Err(PyTypeError::new_err(
            "x has dtype f32; flashmoe's MoE takes bf16 or f16",
        ));
    }
    for (name, d) in [("router_w", router), ("w2", w2)] {
        if d.2.len() != 2 + usize::from(name == "w2") {
            return Err(PyValueError::new_err(format!(
                "{name} must be {} but has shape {:?}",
                if name == "w2" {
                    "3-D [experts, intermediate, hidden]"
                } else {
                    "2-D [hidden, experts]"
                },
                d.2
            )));
        }
    }
    if x.2.len() != 2 {
        return Err(PyValueError::new_err(format!(
            "x must be 2-D [tokens, hidden] but has shape {:?}",
            x.2
        )));
    }
    let scoring: Scoring = scoring
        .parse()
        .map_err(|e: String| PyValueError::new_err(format!("scoring: {e}")))?;
    let class = MoeClass {
        dtype,
        hidden: x.2[1],
        intermediate: w2.2[1],
        experts: router.2[1],
        top_k,
        scoring,
        renormalize,
        shared_expert: shared,
        max_tokens,
    };
    class.problem(1).validate().map_err(py_err)?;
    Ok(class)
}

/// The outputs of an MoE call: out, topk_ids, topk_w, counts, losses.
type MoeOutputs = (RawTensor, RawU32, RawTensor, RawU32, RawTensor);

/// The raw arguments of an MoE call, checked against `class` (no GPU needed).
#[allow(clippy::too_many_arguments)]
fn moe_args(
    class: &MoeClass,
    x: &Desc,
    router: &Desc,
    w13: &Desc,
    w2: &Desc,
    shared: Option<(Desc, Desc)>,
    (out, topk_ids, topk_w, counts, losses): MoeOutputs,
    gate_up: Option<RawTensor>,
) -> PyResult<MoeArgs> {
    let dt = class.dtype;
    for (name, d) in [("x", x), ("router_w", router), ("w13", w13), ("w2", w2)] {
        same_dtype(name, d.float(name)?, dt, "x")?;
    }
    let (s13, s2) = match &shared {
        Some((a, b)) => {
            same_dtype("shared_w13", a.float("shared_w13")?, dt, "x")?;
            same_dtype("shared_w2", b.float("shared_w2")?, dt, "x")?;
            (Some(a.raw("shared_w13")?), Some(b.raw("shared_w2")?))
        }
        None => (None, None),
    };
    let args = MoeArgs {
        gate_up,
        x: x.raw("x")?,
        router: router.raw("router_w")?,
        w13: w13.raw("w13")?,
        w2: w2.raw("w2")?,
        shared_w13: s13,
        shared_w2: s2,
        out,
        routing: RoutingArgs {
            topk_ids,
            topk_w,
            counts,
            losses,
        },
    };
    class.check_args(&args).map_err(py_err)?;
    Ok(args)
}

/// Check an MoE call without a GPU: x [T, H], router_w [H, E], w13 [E, H, 2I], w2
/// [E, I, H], the shared expert's [H, 2I] and [I, H] (both or neither), and the outputs
/// out [T, H], topk_ids int32 [T, k], topk_w f32 [T, k], counts int32 [E], losses f32 [2].
/// Returns (tokens, hidden, intermediate, experts).
#[pyfunction]
#[pyo3(signature = (x, router_w, w13, w2, shared, out, topk_ids, topk_w, counts, losses, *, top_k, scoring="softmax", renormalize=true))]
#[allow(clippy::too_many_arguments)]
fn check_moe(
    x: Desc,
    router_w: Desc,
    w13: Desc,
    w2: Desc,
    shared: Option<(Desc, Desc)>,
    out: Desc,
    topk_ids: Desc,
    topk_w: Desc,
    counts: Desc,
    losses: Desc,
    top_k: usize,
    scoring: &str,
    renormalize: bool,
) -> PyResult<(usize, usize, usize, usize)> {
    let tokens = x.2.first().copied().unwrap_or(0);
    let class = moe_class(
        &x,
        &router_w,
        &w2,
        shared.is_some(),
        top_k,
        scoring,
        renormalize,
        tokens.max(1),
    )?;
    let (t, k) = (tokens, class.top_k);
    same_dtype("out", out.float("out")?, class.dtype, "x")?;
    let outs = (
        out.raw("out")?,
        topk_ids.index("topk_ids", t * k)?,
        topk_w.raw("topk_w")?,
        counts.index("counts", class.experts)?,
        losses.raw("losses")?,
    );
    moe_args(&class, &x, &router_w, &w13, &w2, shared, outs, None)?;
    Ok((tokens, class.hidden, class.intermediate, class.experts))
}

/// A plan's element type from its name: bf16 or f16, else a `TypeError` naming `what`.
fn half_dtype(dtype: &str, what: &str) -> PyResult<DType> {
    match elem("dtype", dtype)? {
        Elem::Float(d) if d != DType::F32 => Ok(d),
        _ => Err(PyTypeError::new_err(format!(
            "dtype {dtype}: {what} takes bf16 or f16"
        ))),
    }
}

/// One `Device` per ordinal over the device's primary context (the one PyTorch uses),
/// shared by every plan of that device (its kernel cache loads each module once).
fn device(ordinal: usize) -> PyResult<Arc<Device>> {
    static DEVICES: OnceLock<Mutex<HashMap<usize, Arc<Device>>>> = OnceLock::new();
    let mut map = DEVICES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some(d) = map.get(&ordinal) {
        return Ok(d.clone());
    }
    let count = gpu::device_count().map_err(py_err)?;
    if ordinal >= count {
        return Err(PyRuntimeError::new_err(format!(
            "no GPU available: CUDA device {ordinal} requested but {count} are visible"
        )));
    }
    // The driver loaded above, so retaining the primary context cannot hit cudarc's
    // missing-library panic.
    let ctx = cudarc::driver::CudaContext::new(ordinal).map_err(|e| {
        PyRuntimeError::new_err(format!(
            "CUDA error retaining the primary context of device {ordinal}: {e}"
        ))
    })?;
    let dev = Arc::new(Device::from_context(ctx).map_err(py_err)?);
    map.insert(ordinal, dev.clone());
    Ok(dev)
}

/// Number of visible CUDA devices; `RuntimeError` naming the reason when there is no
/// usable driver.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    gpu::device_count().map_err(py_err)
}

/// Name and compute capability of device `ordinal` (opens the primary context).
#[pyfunction]
fn device_name(ordinal: usize) -> PyResult<(String, (u32, u32))> {
    let d = device(ordinal)?;
    Ok((d.info().name.clone(), d.info().compute_capability))
}

/// An attention plan: one kernel resolved for (dtype, head dim, head counts, causal,
/// scale, window, softcap) on one device. Build once, call `forward` per call.
#[pyclass(frozen, module = "flashmoe._core")]
struct AttentionPlan {
    plan: Plan,
}

#[pymethods]
impl AttentionPlan {
    /// `window` (left, right) around each query row's bottom-right diagonal, -1 unbounded
    /// (`causal` bounds the right side at 0); `softcap` > 0 turns the scores s into
    /// softcap·tanh(s / softcap). Both run on the sm_90a kernel (Hopper, head dims 64 and
    /// 128) and on the portable kernel (every multiple of 8 up to 256; above 128 on Hopper
    /// only, else `NotImplementedError`). The arguments are checked
    /// before the GPU is touched. `alibi`: ALiBi biases on the portable kernel (any GPU,
    /// windows and softcap included); `forward` then takes the slopes.
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, causal, softmax_scale=None, window=(-1, -1), softcap=0.0, alibi=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        causal: bool,
        softmax_scale: Option<f32>,
        window: (i32, i32),
        softcap: f32,
        alibi: bool,
    ) -> PyResult<Self> {
        let logits = Logits {
            causal,
            softmax_scale,
            window,
            softcap,
        };
        let class = plan_class(
            "an attention plan",
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            logits,
        )?;
        let dev = self::device(device)?;
        let plan = if alibi {
            Plan::new_alibi(&dev, class)
        } else {
            Plan::new(&dev, class)
        };
        Ok(AttentionPlan {
            plan: plan.map_err(py_err)?,
        })
    }

    /// Bytes of the zeroed workspace a launch needs (0: none).
    #[getter]
    fn workspace_bytes(&self) -> usize {
        self.plan.workspace_bytes()
    }

    /// The kernel's entry point name.
    #[getter]
    fn kernel(&self) -> &'static str {
        self.plan.variant().entry
    }

    /// Enqueue one forward on `stream` (a `CUstream` value). q, k and v are descriptors;
    /// `o` and `lse` are the addresses of contiguous outputs the caller allocated: o of q's
    /// shape and dtype, lse f32 [batch, heads_q, seqlen_q]. `workspace` is a zeroed
    /// allocation of at least `workspace_bytes` that no concurrently running launch uses;
    /// every launch leaves it zeroed. `alibi_slopes`: f32 (heads_q) or (batch, heads_q), on
    /// an `alibi` plan only.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, q, k, v, o, lse, workspace, workspace_bytes, alibi_slopes=None))]
    fn forward(
        &self,
        stream: usize,
        q: Desc,
        k: Desc,
        v: Desc,
        o: u64,
        lse: u64,
        workspace: u64,
        workspace_bytes: usize,
        alibi_slopes: Option<Desc>,
    ) -> PyResult<()> {
        let dt = self.plan.class().dtype;
        for (name, d) in [("q", &q), ("k", &k), ("v", &v)] {
            same_dtype(name, d.float(name)?, dt, "the plan")?;
        }
        let q = q.raw("q")?;
        let &[b, sq, hq, d] = q.shape() else {
            return Err(PyValueError::new_err(format!(
                "q must be 4-D (batch, seq, heads, head_dim) but has shape {:?}",
                q.shape()
            )));
        };
        let args = AttentionArgs {
            q,
            k: k.raw("k")?,
            v: v.raw("v")?,
            o: RawTensor::contiguous(o, self.plan.out_dtype(), &[b, sq, hq, d]).map_err(py_err)?,
            lse: RawTensor::contiguous(lse, DType::F32, &[b, hq, sq]).map_err(py_err)?,
        };
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: the torch layer passes live tensors of the device this plan was built
        // on, allocated by PyTorch on the primary context, kept alive by the caching
        // allocator's stream semantics until the stream has run the launch; o and lse are
        // fresh contiguous outputs of the shapes above; the workspace is the stream's own
        // (docs/python.md); the slopes likewise.
        let slopes = alibi_slopes.map(|d| d.raw("alibi_slopes")).transpose()?;
        unsafe {
            self.plan
                .forward_raw_alibi(stream as gpu::RawStream, &args, slopes.as_ref(), ws)
                .map_err(py_err)
        }
    }
}

/// An attention backward plan: dq, dk and dv of one dense class (dtype, head dim, head
/// counts, causal, scale, window, softcap; head dims 32, 64, 96, 128; any GPU of compute
/// capability 8.0 or newer), fast or deterministic (bit-identical run to run).
#[pyclass(frozen, module = "flashmoe._core")]
struct AttentionBackwardPlan {
    plan: BPlan,
}

#[pymethods]
impl AttentionBackwardPlan {
    /// The class as for `AttentionPlan`; a head dim or dtype the backward does not serve
    /// raises `NotImplementedError`. `deterministic`: bit-identical gradients run to run
    /// (on Hopper the fast mode sums dq in the order its parts land).
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, causal, softmax_scale=None, window=(-1, -1), softcap=0.0, deterministic=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        causal: bool,
        softmax_scale: Option<f32>,
        window: (i32, i32),
        softcap: f32,
        deterministic: bool,
    ) -> PyResult<Self> {
        let logits = Logits {
            causal,
            softmax_scale,
            window,
            softcap,
        };
        let class = plan_class(
            "an attention backward plan",
            dtype,
            head_dim,
            heads_q,
            heads_kv,
            logits,
        )?;
        let dev = self::device(device)?;
        let mode = if deterministic {
            BwdMode::Deterministic
        } else {
            BwdMode::Fast
        };
        Ok(AttentionBackwardPlan {
            plan: BPlan::new(&dev, class, mode).map_err(py_err)?,
        })
    }

    /// Bytes of the workspace a call of `batch` sequences of `seqlen_q` queries needs (any
    /// contents: the launch writes it before reading).
    fn workspace_bytes(&self, batch: usize, seqlen_q: usize) -> usize {
        self.plan.workspace_bytes(batch, seqlen_q)
    }

    /// Whether two calls on the same inputs give the same bits.
    #[getter]
    fn deterministic(&self) -> bool {
        self.plan.deterministic()
    }

    /// Enqueue one backward on `stream` (a `CUstream` value). Every tensor is a descriptor
    /// of a contiguous tensor: q, o, d_o, dq (batch, seqlen_q, heads_q, head_dim); k, v,
    /// dk, dv (batch, seqlen_k, heads_kv, head_dim); lse f32 (batch, heads_q, seqlen_q)
    /// from the forward. dq, dk and dv are written entirely.
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        stream: usize,
        q: Desc,
        k: Desc,
        v: Desc,
        o: Desc,
        d_o: Desc,
        lse: Desc,
        dq: Desc,
        dk: Desc,
        dv: Desc,
        workspace: u64,
        workspace_bytes: usize,
    ) -> PyResult<()> {
        let args = BackwardArgs {
            q: q.raw("q")?,
            k: k.raw("k")?,
            v: v.raw("v")?,
            o: o.raw("o")?,
            d_o: d_o.raw("d_o")?,
            lse: lse.raw("lse")?,
            dq: dq.raw("dq")?,
            dk: dk.raw("dk")?,
            dv: dv.raw("dv")?,
        };
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: the torch layer passes live tensors of the device this plan was built on,
        // allocated by PyTorch on the primary context and kept alive by the caching
        // allocator's stream semantics until the stream has run the launches; dq, dk, dv
        // and the workspace are fresh allocations of the shapes the plan checks.
        unsafe {
            self.plan
                .backward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

/// A varlen plan (sm_90a, head dims 64 and 128): packed sequences of unequal lengths.
#[pyclass(frozen, module = "flashmoe._core")]
struct VarlenPlan {
    plan: VPlan,
}

#[pymethods]
impl VarlenPlan {
    /// `window` and `softcap` as in `AttentionPlan`. The arguments are checked before the
    /// GPU is touched.
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, causal, softmax_scale=None, window=(-1, -1), softcap=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        causal: bool,
        softmax_scale: Option<f32>,
        window: (i32, i32),
        softcap: f32,
    ) -> PyResult<Self> {
        let logits = Logits {
            causal,
            softmax_scale,
            window,
            softcap,
        };
        let class = logits.class(
            half_dtype(dtype, "a varlen plan")?,
            head_dim,
            heads_q,
            heads_kv,
        )?;
        let dev = self::device(device)?;
        Ok(VarlenPlan {
            plan: VPlan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Bytes of the zeroed workspace a launch needs (every launch leaves it zeroed).
    #[getter]
    fn workspace_bytes(&self) -> usize {
        self.plan.workspace_bytes()
    }

    /// Enqueue one varlen forward on `stream`. q, k, v, cu_seqlens_q and cu_seqlens_k are
    /// descriptors; `o` (total_q, heads_q, head_dim) and `lse` f32 (heads_q, total_q) are
    /// addresses of contiguous outputs; the workspace as in `AttentionPlan.forward`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        stream: usize,
        q: Desc,
        k: Desc,
        v: Desc,
        cu_seqlens_q: Desc,
        cu_seqlens_k: Desc,
        max_seqlen_q: usize,
        max_seqlen_k: usize,
        o: u64,
        lse: u64,
        workspace: u64,
        workspace_bytes: usize,
    ) -> PyResult<()> {
        let c = self.plan.class();
        let logits = Logits {
            causal: c.causal,
            softmax_scale: c.softmax_scale,
            window: c.window,
            softcap: c.softcap,
        };
        let (_, args) = varlen_args(
            &q,
            &k,
            &v,
            &cu_seqlens_q,
            &cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            logits,
            (o, lse),
        )?;
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: as in AttentionPlan::forward; the offsets are int32 device tensors of the
        // same device (the kernel clamps them into the tensors).
        unsafe {
            self.plan
                .forward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

/// A paged-KV decode plan: one class (dtype, head dim, head counts, rows per sequence,
/// window, softcap, scale) on one device; the page size comes from the cache per call.
#[pyclass(frozen, module = "flashmoe._core")]
struct DecodePlan {
    plan: DPlan,
}

#[pymethods]
impl DecodePlan {
    #[new]
    #[pyo3(signature = (device, dtype, head_dim, heads_q, heads_kv, max_q_per_seq, window, softcap, softmax_scale=None, alibi=false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        head_dim: usize,
        heads_q: usize,
        heads_kv: usize,
        max_q_per_seq: usize,
        window: (i32, i32),
        softcap: f32,
        softmax_scale: Option<f32>,
        alibi: bool,
    ) -> PyResult<Self> {
        let class = decode_class(
            half_dtype(dtype, "a decode plan")?,
            head_dim,
            heads_q,
            heads_kv,
            max_q_per_seq,
            window,
            softcap,
            softmax_scale,
        )?;
        let dev = self::device(device)?;
        let plan = if alibi {
            DPlan::new_alibi(&dev, class)
        } else {
            DPlan::new(&dev, class)
        };
        Ok(DecodePlan {
            plan: plan.map_err(py_err)?,
        })
    }

    /// Bytes of the zeroed workspace of a call of `batch` sequences with a table of
    /// `max_seqlen_k` keys' capacity (0: the call runs unsplit).
    fn workspace_bytes(&self, batch: usize, max_seqlen_k: usize) -> usize {
        self.plan.workspace_bytes(batch, max_seqlen_k)
    }

    /// Enqueue decode attention on `stream`: q, the caches, block_table, seqused_k (keys in
    /// use per sequence) and cu_seqlens_q (None: q is (B, Sq, Hq, D)) are descriptors; `o`
    /// (q's shape) and `lse` f32 ((B, Hq, Sq) or (Hq, total_q)) addresses of contiguous
    /// outputs; the workspace is the stream's own, zeroed, of `workspace_bytes(batch,
    /// max_blocks · page_size)`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, q, k_cache, v_cache, block_table, seqused_k, cu_seqlens_q, o, lse, workspace, workspace_bytes, alibi_slopes=None))]
    fn forward(
        &self,
        stream: usize,
        q: Desc,
        k_cache: Desc,
        v_cache: Desc,
        block_table: Desc,
        seqused_k: Desc,
        cu_seqlens_q: Option<Desc>,
        o: u64,
        lse: u64,
        workspace: u64,
        workspace_bytes: usize,
        alibi_slopes: Option<Desc>,
    ) -> PyResult<()> {
        let dt = self.plan.class().dtype;
        for (name, d) in [("q", &q), ("k_cache", &k_cache), ("v_cache", &v_cache)] {
            same_dtype(name, d.float(name)?, dt, "the plan")?;
        }
        let args = decode_args(
            dt,
            &q,
            &k_cache,
            &v_cache,
            &block_table,
            &seqused_k,
            cu_seqlens_q.as_ref(),
            (o, lse),
        )?;
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: as in AttentionPlan::forward; block_table, seqused_k and cu_seqlens_q are
        // int32 tensors of the same device; the caller keeps seqused_k within the table's
        // capacity (the kernel clamps to it and to [0, num_blocks)); alibi_slopes likewise
        // (f32 on the device, checked against the plan).
        let slopes = alibi_slopes.map(|d| d.raw("alibi_slopes")).transpose()?;
        unsafe {
            self.plan
                .forward_raw_alibi(stream as gpu::RawStream, &args, slopes.as_ref(), ws)
                .map_err(py_err)
        }
    }

    /// Enqueue the append of k, v (batch, s_new, heads_kv, head_dim) into the caches at
    /// positions `cache_seqlens[b] ..` (the lengths before the append) on `stream`.
    #[allow(clippy::too_many_arguments)]
    fn append_kv(
        &self,
        stream: usize,
        k: Desc,
        v: Desc,
        k_cache: Desc,
        v_cache: Desc,
        block_table: Desc,
        cache_seqlens: Desc,
    ) -> PyResult<()> {
        let a = append_args(&k, &v, &k_cache, &v_cache, &block_table, &cache_seqlens)?;
        // SAFETY: as in `forward`; positions past the table's capacity or on block ids out
        // of range are skipped by the kernel.
        unsafe {
            self.plan
                .append_kv_raw(stream as gpu::RawStream, &a)
                .map_err(py_err)
        }
    }
}

/// An MoE plan: one MoE layer for one class (dims, dtype, top-k, scoring, shared
/// expert) and calls of 1..=max_tokens tokens on one device.
#[pyclass(frozen, module = "flashmoe._core")]
struct MoePlan {
    plan: MPlan,
}

#[pymethods]
impl MoePlan {
    #[new]
    #[pyo3(signature = (device, dtype, hidden, intermediate, experts, top_k, scoring, renormalize, shared_expert, max_tokens))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        device: usize,
        dtype: &str,
        hidden: usize,
        intermediate: usize,
        experts: usize,
        top_k: usize,
        scoring: &str,
        renormalize: bool,
        shared_expert: bool,
        max_tokens: usize,
    ) -> PyResult<Self> {
        let dtype = match elem("dtype", dtype)? {
            Elem::Float(d) if d != DType::F32 => d,
            _ => {
                return Err(PyTypeError::new_err(format!(
                    "dtype {dtype}: an MoE plan takes bf16 or f16"
                )))
            }
        };
        let scoring: Scoring = scoring
            .parse()
            .map_err(|e: String| PyValueError::new_err(format!("scoring: {e}")))?;
        let class = MoeClass {
            dtype,
            hidden,
            intermediate,
            experts,
            top_k,
            scoring,
            renormalize,
            shared_expert,
            max_tokens,
        };
        class.problem(1).validate().map_err(py_err)?;
        let dev = self::device(device)?;
        Ok(MoePlan {
            plan: MPlan::new(&dev, class).map_err(py_err)?,
        })
    }

    /// Largest token count of a call.
    #[getter]
    fn max_tokens(&self) -> usize {
        self.plan.class().max_tokens
    }

    /// Bytes of the workspace a call of `tokens` tokens needs (nothing to zero).
    fn workspace_bytes(&self, tokens: usize) -> PyResult<usize> {
        self.plan.workspace_bytes(tokens).map_err(py_err)
    }

    /// Enqueue the layer on `stream`: router, permutation, grouped SwiGLU GEMMs (+ shared
    /// expert), combine, and the routing results. x, router_w, w13, w2 and `shared`
    /// (`(w13, w2)` or None) are descriptors; the outputs are the addresses of contiguous
    /// tensors the caller allocated: out [T, H] of x's dtype, topk_ids int32 [T, k],
    /// topk_w f32 [T, k], counts int32 [E], losses f32 [2] = (aux, z); `gate_up`: the
    /// address of a contiguous [T·k, 2I] tensor of x's dtype that also receives the routed
    /// rows' gate/up pre-activations for the backward, or 0.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, x, router_w, w13, w2, shared, out, topk_ids, topk_w, counts, losses, workspace, workspace_bytes, gate_up=0))]
    fn forward(
        &self,
        stream: usize,
        x: Desc,
        router_w: Desc,
        w13: Desc,
        w2: Desc,
        shared: Option<(Desc, Desc)>,
        out: u64,
        topk_ids: u64,
        topk_w: u64,
        counts: u64,
        losses: u64,
        workspace: u64,
        workspace_bytes: usize,
        gate_up: u64,
    ) -> PyResult<()> {
        let c = self.plan.class();
        let (t, h, k, e) = (
            x.2.first().copied().unwrap_or(0),
            c.hidden,
            c.top_k,
            c.experts,
        );
        let f32s = |ptr, shape: &[usize]| RawTensor::contiguous(ptr, DType::F32, shape);
        let outs = (
            RawTensor::contiguous(out, c.dtype, &[t, h]).map_err(py_err)?,
            RawU32 {
                ptr: topk_ids,
                len: t * k,
            },
            f32s(topk_w, &[t, k]).map_err(py_err)?,
            RawU32 {
                ptr: counts,
                len: e,
            },
            f32s(losses, &[2]).map_err(py_err)?,
        );
        let gate_up = match gate_up {
            0 => None,
            p => Some(
                RawTensor::contiguous(p, c.dtype, &[t * k, 2 * c.intermediate]).map_err(py_err)?,
            ),
        };
        let args = moe_args(c, &x, &router_w, &w13, &w2, shared, outs, gate_up)?;
        let ws = RawWorkspace {
            ptr: workspace,
            bytes: workspace_bytes,
        };
        // SAFETY: as in AttentionPlan::forward; the outputs are fresh contiguous tensors of
        // the shapes above and the workspace a fresh allocation of this call from
        // PyTorch's caching allocator on this stream.
        unsafe {
            self.plan
                .forward_raw(stream as gpu::RawStream, &args, ws)
                .map_err(py_err)
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(check_attention, m)?)?;
    m.add_function(wrap_pyfunction!(route_attention, m)?)?;
    m.add_function(wrap_pyfunction!(check_moe, m)?)?;
    m.add_function(wrap_pyfunction!(check_attention_varlen, m)?)?;
    m.add_function(wrap_pyfunction!(check_attention_kvcache, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(device_name, m)?)?;
    m.add_class::<AttentionPlan>()?;
    m.add_class::<AttentionBackwardPlan>()?;
    m.add_class::<MoePlan>()?;
    m.add_class::<VarlenPlan>()?;
    m.add_class::<DecodePlan>()?;
    mla::register(m)?;
    moe_bwd::register(m)?;
    varlen_backward::register(m)?;
    value_dim::register(m)?;
    m.add("MAX_Q_PER_SEQ", MAX_Q_PER_SEQ)?;
    Ok(())
}
