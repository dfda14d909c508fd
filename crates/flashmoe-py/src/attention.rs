//! The dense attention family: the class of a call, its O(1) checks (`check_attention`), the
//! routing of a call to the prefill or decode plan (`route_attention`), and the forward and
//! backward plans (`AttentionPlan`, `AttentionBackwardPlan`).

use crate::common::device;
use crate::common::same_dtype;
use crate::common::Desc;
use crate::common::{half_dtype, py_err};
use flashmoe::attention::backward::AttentionBackwardPlan as BPlan;
use flashmoe::attention::backward::BackwardArgs;
use flashmoe::attention::backward::BwdMode;
use flashmoe::attention::decode::MAX_Q_PER_SEQ;
use flashmoe::attention::prefill::abi;
use flashmoe::attention::prefill::tiles;
use flashmoe::attention::route;
use flashmoe::attention::route::AttnCall;
use flashmoe::attention::route::AttnShape;
use flashmoe::attention::route::Elem as HalfElem;
use flashmoe::attention::route::Route;
use flashmoe::attention::route::WindowSize;
use flashmoe::attention::AttentionArgs;
use flashmoe::attention::AttentionClass;
use flashmoe::attention::AttentionPlan as Plan;
use flashmoe::gpu;
use flashmoe::gpu::RawTensor;
use flashmoe::gpu::RawWorkspace;
use flashmoe::DType;
use flashmoe::Error;
use pyo3::exceptions::PyTypeError;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The scalars of an attention class that no tensor carries: causal, the softmax scale
/// (None: 1/sqrt(head_dim)), the sliding window `(left, right)` (-1 = unbounded) and the
/// logit softcap (0 = off).
#[derive(Clone, Copy)]
pub(crate) struct Logits {
    pub(crate) causal: bool,
    pub(crate) softmax_scale: Option<f32>,
    pub(crate) window: (i32, i32),
    pub(crate) softcap: f32,
}

/// The class of a dense attention plan (forward or backward) from the binding's arguments:
/// `dtype` must name bf16 or f16 (TypeError naming `what` otherwise).
pub(crate) fn plan_class(
    what: &str,
    dtype: &str,
    head_dim: usize,
    heads_q: usize,
    heads_kv: usize,
    logits: Logits,
) -> PyResult<AttentionClass> {
    logits.class(half_dtype(dtype, what)?, head_dim, heads_q, heads_kv)
}

impl Logits {
    /// The class of these scalars and the tensors' dtype, head dim and head counts,
    /// validated (a bad scale, window side or softcap is a `ValueError`).
    pub(crate) fn class(
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
pub(crate) fn attn_call(class: &AttentionClass, seq_q: usize, seq_k: usize) -> PyResult<AttnCall> {
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
pub(crate) fn check_routable(class: &AttentionClass, seq_q: usize, seq_k: usize) -> PyResult<()> {
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
pub(crate) fn attention_class(
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
pub(crate) type OutputShapes = ((usize, usize, usize, usize), (usize, usize, usize));

/// Check an attention call's q, k and v without a GPU. The class: `causal`,
/// `softmax_scale`, `window` (left, right) around each row's bottom-right diagonal with -1
/// unbounded, `softcap` (0 = off). Returns the shapes of o `(batch, seqlen_q, heads_q,
/// head_dim)` and lse `(batch, heads_q, seqlen_q)`.
#[pyfunction]
#[pyo3(signature = (q, k, v, causal=false, softmax_scale=None, *, window=(-1, -1), softcap=0.0))]
pub(crate) fn check_attention(
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
pub(crate) type RouteOut = (&'static str, Py<PyAny>, ((usize, usize), (usize, usize)));

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
pub(crate) fn route_attention(
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

/// An attention plan: one kernel resolved for (dtype, head dim, head counts, causal,
/// scale, window, softcap) on one device. Build once, call `forward` per call.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct AttentionPlan {
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
pub(crate) struct AttentionBackwardPlan {
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
