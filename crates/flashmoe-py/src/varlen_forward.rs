//! Packed variable-length attention: the arguments and checks of a call
//! (`check_attention_varlen`) and the forward plan (`VarlenPlan`); its backward is
//! `varlen_backward.rs`.

use crate::attention::Logits;
use crate::common::attention_dtype;
use crate::common::half_dtype;
use crate::common::CHECK_OUT;
use crate::common::{device, py_err, Desc};
use flashmoe::attention::varlen;
use flashmoe::attention::varlen::VarlenArgs;
use flashmoe::attention::varlen::VarlenPlan as VPlan;
use flashmoe::attention::AttentionClass;
use flashmoe::gpu;
use flashmoe::gpu::RawTensor;
use flashmoe::gpu::RawWorkspace;
use flashmoe::DType;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// The 3-D raw tensor of a packed (tokens, heads, head_dim) descriptor.
pub(crate) fn packed(d: &Desc, name: &str) -> PyResult<RawTensor> {
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
pub(crate) fn varlen_args(
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
pub(crate) type VarlenShapes = ((usize, usize, usize), (usize, usize));

/// Check a varlen call without a GPU: q (total_q, heads_q, head_dim), k and v (total_k,
/// heads_kv, head_dim), int32 cu_seqlens_q and cu_seqlens_k [batch + 1]; the class's
/// `causal`, `softmax_scale`, `window` and `softcap` as in `check_attention`. Returns the
/// shapes of o (total_q, heads_q, head_dim) and lse (heads_q, total_q).
#[pyfunction]
#[pyo3(signature = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=false, softmax_scale=None, *, window=(-1, -1), softcap=0.0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_attention_varlen(
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

/// A varlen plan (sm_90a, head dims 64 and 128): packed sequences of unequal lengths.
#[pyclass(frozen, module = "flashmoe._core")]
pub(crate) struct VarlenPlan {
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
